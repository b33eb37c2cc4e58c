//! Bad input the careless or hostile way, through the binary: each case exits 2 with a
//! message naming the key or file and what was expected (or, where the input is usable,
//! says what it did instead), and no panic.

use crate::common;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use common::{
    coli, coli_command, copy_fixture, fixture, fixture_with_config, stderr, stdout, text_config,
};

fn snap_arg(path: &std::path::Path) -> String {
    format!("SNAP={}", path.display())
}

/// A two-token greedy run of `snap` with `extra` settings, the history left alone.
fn short_run(snap: &str, extra: &str) -> std::process::Output {
    coli(
        &[
            snap,
            extra,
            "IDS=3 11",
            "NGEN=2",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[],
    )
}

/// `out` succeeded and said `needle` on stderr.
fn warned(out: &std::process::Output, needle: &str) {
    assert!(out.status.success(), "{}", stderr(out));
    assert!(stderr(out).contains(needle), "{}", stderr(out));
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
    warned(
        &short_run(&snap, "THREADS=100000"),
        "[threads] THREADS=100000 is more than the",
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

/// A named pipe where a shard should be is refused without opening it (an open would wait
/// for a writer). Should coli open it anyway, the test writes nothing and closes its end, so
/// the run sees an empty file instead of hanging.
#[cfg(unix)]
#[test]
fn a_named_pipe_where_a_shard_should_be_is_refused_without_waiting() {
    let dir = tempfile::tempdir().unwrap();
    let pipe = dir.path().join("model.safetensors");
    let made = std::process::Command::new("mkfifo")
        .arg(&pipe)
        .status()
        .expect("mkfifo runs");
    assert!(made.success());
    std::fs::copy(
        fixture("olmoe_tiny").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let run = std::thread::spawn({
        let snap = snap_arg(dir.path());
        move || coli(&[&snap, "64", "16", "16"], &[])
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !run.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    if !run.is_finished() {
        // Unblock a reader that opened the pipe, then fail.
        drop(std::fs::OpenOptions::new().write(true).open(&pipe));
        run.join().unwrap();
        panic!("coli waited on the named pipe");
    }
    refused(
        &run.join().unwrap(),
        &["model.safetensors is a pipe, socket or device, not a safetensors file"],
    );
}

/// A copy of `name` whose config (its `text_config` when it has one) `edit` changes.
fn with_config(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> tempfile::TempDir {
    fixture_with_config(name, |config| edit(text_config(config)))
}

#[test]
fn a_layer_count_the_checkpoint_does_not_hold_is_refused_before_allocating() {
    for (name, layers) in [("olmoe_tiny", 3), ("inkling_tiny", 7), ("kimi_k3_tiny", 6)] {
        for wrong in [1_000_000_000u64, 0, layers - 1, layers + 1] {
            let dir = with_config(name, |c| c["num_hidden_layers"] = wrong.into());
            let started = std::time::Instant::now();
            let out = coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]);
            refused(&out, &["config.json", "num_hidden_layers"]);
            assert!(
                started.elapsed() < std::time::Duration::from_secs(10),
                "{name} {wrong}"
            );
        }
    }
    let dir = with_config("olmoe_tiny", |c| c["rms_norm_eps"] = (-1.0).into());
    refused(
        &coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]),
        &["rms_norm_eps is -1"],
    );
    let dir = with_config("olmoe_tiny", |c| {
        c["rope_theta"] = 0.0.into();
        c.as_object_mut().unwrap().remove("rope_parameters");
    });
    refused(
        &coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]),
        &["rope_theta is 0"],
    );
}

#[test]
fn settings_and_tensors_the_model_cannot_use_are_refused_not_ignored() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    refused(
        &coli(&[&snap, "DRAFT=2", "64", "16", "16"], &[]),
        &["DRAFT=2", "olmoe has no draft"],
    );
    refused(
        &coli(&[&snap, "DSA_FORCE=1", "64", "16", "16"], &[]),
        &["DSA_FORCE=1", "no DSA indexer"],
    );
    let out = tempfile::tempdir().unwrap();
    refused(
        &coli(
            &[
                "convert",
                fixture("olmoe_tiny").to_str().unwrap(),
                out.path().join("c").to_str().unwrap(),
                "--shard-gb",
                "0",
            ],
            &[],
        ),
        &["--shard-gb 0", "positive"],
    );
    // One expert more than the config says: the checkpoint is not what the config describes.
    let dir = with_config("olmoe_tiny", |c| c["num_experts"] = 7.into());
    refused(
        &coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]),
        &["num_experts is 7", ".experts.7."],
    );
}

#[test]
fn a_config_number_beyond_any_model_and_a_bad_header_entry_are_named() {
    let dir = with_config("kimi_k3_tiny", |c| {
        c["moe_intermediate_size"] = u64::MAX.into()
    });
    refused(
        &coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]),
        &[
            "moe_intermediate_size is 18446744073709551615",
            "larger than any model",
        ],
    );
    // A header entry whose offsets lie beyond the data: named, with the sizes.
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        fixture("olmoe_tiny").join("config.json"),
        dir.path().join("config.json"),
    )
    .unwrap();
    let mut header =
        br#"{"model.norm.weight":{"dtype":"F32","shape":[64],"data_offsets":[0,999999]}}"#.to_vec();
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&[0u8; 256]);
    std::fs::write(dir.path().join("model.safetensors"), bytes).unwrap();
    refused(
        &coli(&[&snap_arg(dir.path()), "64", "16", "16"], &[]),
        &["tensor model.norm.weight", "[0, 999999]", "256 data bytes"],
    );
}

#[test]
fn positions_beyond_the_trained_context_are_refused_unless_allowed() {
    let dir = copy_fixture("olmoe_tiny");
    let snap = snap_arg(dir.path());
    // max_position_embeddings is 4096.
    let ids = |n: usize| {
        format!(
            "IDS={}",
            (0..n)
                .map(|i| (i % 100).to_string())
                .collect::<Vec<_>>()
                .join(" ")
        )
    };
    refused(
        &coli(
            &[
                &snap,
                &ids(4100),
                "NGEN=1",
                "USAGE_SAVE=0",
                "64",
                "16",
                "16",
            ],
            &[],
        ),
        &[
            "IDS takes 4100 positions",
            "max_position_embeddings (4096)",
            "LONG_CONTEXT=1",
        ],
    );
    refused(
        &coli(
            &[&snap, "PPL=1", "IDS=1 2 3", "CTX=5000", "64", "16", "16"],
            &[],
        ),
        &["a CTX window takes 5000 positions"],
    );
    // A generation that would run past it stops there, and says so.
    let out = coli(
        &[
            &snap,
            &ids(4090),
            "NGEN=10",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out)
        .contains("[context] NGEN=10: generation stops at the model's 4096 positions (6 tokens"));
    assert_eq!(
        stdout(&out)
            .lines()
            .find(|l| l.split(' ').count() > 1 && l.chars().all(|c| c.is_ascii_digit() || c == ' '))
            .map(|l| l.split(' ').count()),
        Some(6)
    );
    let out = coli(
        &[
            &snap,
            &ids(4100),
            "NGEN=2",
            "USAGE_SAVE=0",
            "LONG_CONTEXT=1",
            "64",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_pin_file_with_no_records_says_so() {
    let dir = copy_fixture("olmoe_tiny");
    let garbage = dir.path().join("notes.bin");
    std::fs::write(&garbage, [0xde, 0xad, 0xbe, 0xef, b'\n', 0x01]).unwrap();
    warned(
        &short_run(&snap_arg(dir.path()), &format!("PIN={}", garbage.display())),
        "no expert-usage records for this engine in it",
    );
}

#[test]
fn a_conversion_that_stops_says_a_rerun_resumes() {
    let out = tempfile::tempdir().unwrap();
    let dst = out.path().join("c");
    let convert = || {
        coli(
            &[
                "convert",
                fixture("olmoe_tiny").to_str().unwrap(),
                dst.to_str().unwrap(),
            ],
            &[],
        )
    };
    assert!(convert().status.success());
    // The shard's place taken by a directory: the rename at the end of the shard fails.
    let shard = dst.join("model-00001-of-00001.safetensors");
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    refused(
        &convert(),
        &[
            "the conversion stopped; rerun the same command to resume",
            "Is a directory",
        ],
    );
}

/// A shard truncated under a running generation, its experts mapped or read with direct
/// I/O, ends the run with exit 2 naming the shard (not SIGBUS); the tokens generated before
/// are printed, the history is saved with their routing and the trace is flushed.
/// The shard is cut once the trace's buffer first reached its file, so that tokens have
/// been generated whatever the machine's speed.
#[test]
fn a_shard_truncated_under_a_running_generation_is_named_and_the_history_kept() {
    use std::io::{BufRead as _, BufReader, Read as _};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    for io in ["EXPERT_IO=mmap", "EXPERT_IO=direct"] {
        let dir = copy_fixture("olmoe_tiny");
        let outputs = tempfile::tempdir().unwrap();
        let shard = dir.path().join("model.safetensors");
        let trace = outputs.path().join("trace.txt");
        let mut child = coli_command(
            &[
                &snap_arg(dir.path()),
                "IDS=3 11 29",
                "NGEN=100000000",
                "LONG_CONTEXT=1",
                io,
                &format!("ROUTE_TRACE={}", trace.display()),
                "64",
                "16",
                "16",
            ],
            &[],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
        let mut out = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            out.read_to_string(&mut text).unwrap();
            text
        });
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut err = String::new();
        // The generation starts once the history is located.
        for line in lines.by_ref() {
            let line = line.unwrap();
            err.push_str(&line);
            err.push('\n');
            if line.starts_with("[USAGE] history:") {
                break;
            }
        }
        assert!(err.contains("[USAGE] history:"), "{io}: {err}");
        // The trace reaches its file when its buffer first fills, hundreds of tokens in.
        let started = Instant::now();
        while std::fs::metadata(&trace).map_or(0, |m| m.len()) == 0 {
            assert!(
                started.elapsed() < Duration::from_secs(120) && child.try_wait().unwrap().is_none(),
                "{io}: no trace written: {err}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let size = std::fs::metadata(&shard).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&shard)
            .unwrap()
            .set_len(size / 2)
            .unwrap();
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(120) {
                child.kill().unwrap();
                panic!("{io}: the run went on after its shard was truncated: {err}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        for line in lines {
            err.push_str(&line.unwrap());
            err.push('\n');
        }
        let text = reader.join().unwrap();
        assert_eq!(status.code(), Some(2), "{io}: {status:?}\n{text}{err}");
        let message = err
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("{io}: no error line: {err}"));
        assert!(
            message.contains(&shard.display().to_string()),
            "{io}: the error does not name the shard: {message}"
        );
        assert!(!err.contains("panicked"), "{io}: {err}");
        let history = dir.path().join(".coli_usage");
        assert!(
            err.contains(&format!("-> {}", history.display())),
            "{io}: no [STATS] line for the saved history: {err}"
        );
        let saved = std::fs::read_to_string(&history).unwrap();
        assert!(saved.lines().count() > 2, "{io}: {saved}");
        assert!(std::fs::metadata(&trace).unwrap().len() > 0, "{io}: {err}");
        assert!(
            text.lines()
                .any(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_digit() || c == ' ')),
            "{io}: the tokens generated are not printed: {text}"
        );
    }
}
