//! Bad input the careless or hostile way, through the binary: each case exits 2 with a
//! message naming the key or file and what was expected (or, where the input is usable,
//! says what it did instead), and no panic.

mod common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use common::{coli, coli_command, copy_fixture, fixture, stderr, stdout};

fn snap_arg(path: &std::path::Path) -> String {
    format!("SNAP={}", path.display())
}

fn refused(out: &std::process::Output, needles: &[&str]) {
    let message = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{}{message}", stdout(out));
    for needle in needles {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    assert!(!message.contains("panicked"), "{message}");
}

#[test]
fn an_environment_value_that_is_not_utf8_is_refused_by_name() {
    let dir = copy_fixture("olmoe_tiny");
    let snap = snap_arg(dir.path());
    for key in ["USAGE_SAVE", "COLI_USAGE", "PROMPT", "SNAP"] {
        // An argument wins over the environment, so SNAP comes from the environment alone.
        let args: &[&str] = if key == "SNAP" {
            &["IDS=3 11", "NGEN=1"]
        } else {
            &[&snap, "IDS=3 11", "NGEN=1"]
        };
        let out = coli_command(args, &[])
            .env(key, OsStr::from_bytes(b"0\xff"))
            .output()
            .unwrap();
        refused(&out, &[&format!("environment variable {key} is not UTF-8")]);
    }
    assert!(!dir.path().join(".coli_usage").exists());
}

#[test]
fn names_from_colibri_and_other_tools_point_to_ours() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    for (arg, needle) in [
        ("EBITS=8", "positional"),
        ("MODEL=olmoe", "--model"),
        ("DECAY=0.9", "COLI_USAGE_DECAY"),
        ("NUCLEUS=0.9", "TOP_P"),
        ("TOPK=4", "no routing overrides"),
        ("NGNE=3", "did you mean NGEN?"),
    ] {
        refused(
            &coli(&[&snap, arg], &[]),
            &[arg.split('=').next().unwrap(), needle],
        );
    }
    refused(&coli(&[&snap, "64", "3", "16"], &[]), &["EBITS", "5..15"]);
}

#[test]
fn more_threads_than_cpus_are_bounded_and_said() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    let out = coli(
        &[
            &snap,
            "THREADS=100000",
            "IDS=3 11",
            "NGEN=2",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("[threads] THREADS=100000 is more than the"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_trace_that_cannot_be_created_stops_the_run() {
    let dir = copy_fixture("olmoe_tiny");
    let out = coli(
        &[
            &snap_arg(dir.path()),
            "ROUTE_TRACE=/nonexistent/dir/trace.txt",
            "IDS=3 11",
            "NGEN=2",
            "64",
            "16",
            "16",
        ],
        &[],
    );
    refused(
        &out,
        &["ROUTE_TRACE=/nonexistent/dir/trace.txt", "No such file"],
    );
    assert!(!dir.path().join(".coli_usage").exists());
}

#[test]
fn a_directory_where_a_shard_should_be_is_named() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("model.safetensors")).unwrap();
    std::fs::copy(
        fixture("olmoe_tiny").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    refused(
        &coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]),
        &["model.safetensors is a directory, not a safetensors file"],
    );
}
