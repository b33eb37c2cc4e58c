//! What the command line tells a new user, through the binary: the oracle mode named before
//! anything loads when a run has neither a prompt, ids nor a reference; the prompt flags
//! (`-p`, `-f`, `-n`) as their settings, refused beside them; `-q` and `-v`; `--help`'s
//! examples; the `coli settings` table; the banner's expert width; `CTX` where it does
//! nothing.

use crate::common;

use std::io::Write;
use std::process::{Output, Stdio};

use common::{coli, coli_command, copy_fixture, fixture, stderr, stdout};

fn snap_arg(path: &std::path::Path) -> String {
    format!("SNAP={}", path.display())
}

/// `out` exited 2 without a panic, saying each of `needles` on stderr.
fn refused(out: &Output, needles: &[&str]) {
    let message = stderr(out);
    assert_eq!(out.status.code(), Some(2), "{}{message}", stdout(out));
    for needle in needles {
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    assert!(!message.contains("panicked"), "{message}");
}

const PROMPT: &str = "The licence grants you";

/// A greedy text run of the trained fixture with `args` after its SNAP, the history left
/// alone.
fn text_run(args: &[&str]) -> Output {
    let snap = snap_arg(&fixture("olmoe_trained"));
    let mut all = vec![snap.as_str(), "TEMP=0", "USAGE_SAVE=0"];
    all.extend(args);
    coli(&all, &[])
}

#[test]
fn a_run_without_prompt_ids_or_reference_names_the_oracle_mode_before_loading() {
    let dir = copy_fixture("olmoe_tiny");
    std::fs::remove_file(dir.path().join("ref.json")).unwrap();
    let snap = dir.path().display().to_string();
    let out = coli(&[&format!("SNAP={snap}")], &[]);
    refused(
        &out,
        &[
            "oracle mode",
            "teacher-forced",
            &format!("{snap}/ref.json"),
            "REF=",
            &format!("coli SNAP={snap} PROMPT="),
            &format!("coli chat SNAP={snap}"),
            &format!("coli serve SNAP={snap}"),
        ],
    );
    // Said before the weights load: no store line, no banner.
    let said = stderr(&out) + &stdout(&out);
    assert!(
        !said.contains("[experts]") && !said.contains("== coli"),
        "{said}"
    );
    // A reference named with REF= is the oracle asked for by name: its own message.
    let out = coli(&[&format!("SNAP={snap}"), "REF=/nonexistent/ref.json"], &[]);
    refused(&out, &["/nonexistent/ref.json"]);
    assert!(!stderr(&out).contains("coli chat"), "{}", stderr(&out));
}

#[test]
fn prompt_flags_give_the_prompt_and_ngen_settings() {
    let by_keys = text_run(&[&format!("PROMPT={PROMPT}"), "NGEN=6"]);
    assert!(by_keys.status.success(), "{}", stderr(&by_keys));
    let text = stdout(&by_keys);
    assert!(!text.trim().is_empty());
    assert!(
        stderr(&by_keys).contains("6 generated"),
        "{}",
        stderr(&by_keys)
    );

    for flags in [["-p", PROMPT, "-n", "6"], ["--prompt", PROMPT, "-n", "6"]] {
        let out = text_run(&flags);
        assert!(out.status.success(), "{flags:?}: {}", stderr(&out));
        assert_eq!(stdout(&out), text, "{flags:?}");
    }

    // A file's final newline is not part of the prompt.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, format!("{PROMPT}\n")).unwrap();
    let out = text_run(&["-f", file.to_str().unwrap(), "NGEN=6"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), text);

    // `-f -` reads standard input.
    let snap = snap_arg(&fixture("olmoe_trained"));
    let mut child = coli_command(
        &[&snap, "TEMP=0", "USAGE_SAVE=0", "-n", "6", "-f", "-"],
        &[],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{PROMPT}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), text);
}

#[test]
fn a_flag_and_its_setting_given_together_are_refused_naming_both() {
    refused(
        &text_run(&["-p", PROMPT, "PROMPT=Hello"]),
        &["-p/--prompt", "PROMPT="],
    );
    refused(
        &text_run(&["-p", PROMPT, "-n", "3", "NGEN=4"]),
        &["-n", "NGEN="],
    );
    refused(
        &text_run(&["-f", "/nonexistent/prompt.txt", "PROMPT=Hello"]),
        &["-f/--file", "PROMPT="],
    );
    refused(
        &text_run(&["-p", PROMPT, "-f", "-"]),
        &["--prompt", "--file"],
    );
    refused(
        &text_run(&["-p", PROMPT, "-q", "-v"]),
        &["--quiet", "--verbose"],
    );
    refused(&text_run(&["-p", PROMPT, "-n", "many"]), &["-n", "many"]);
}

#[test]
fn an_unreadable_prompt_file_is_named() {
    refused(
        &text_run(&["-f", "/nonexistent/prompt.txt"]),
        &["-f /nonexistent/prompt.txt", "cannot read the prompt file"],
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("latin1.txt");
    std::fs::write(&file, b"caf\xe9").unwrap();
    refused(
        &text_run(&["-f", file.to_str().unwrap()]),
        &["-f", "latin1.txt", "not UTF-8"],
    );
}

#[test]
fn quiet_prints_the_text_alone_and_verbose_the_settings_given() {
    // A private copy, so that the history is read and saved as in a user's run.
    let dir = copy_fixture("olmoe_tiny");
    let snap = snap_arg(dir.path());
    let args = [snap.as_str(), "PROMPT=Hello there", "NGEN=8", "TEMP=0"];
    let normal = coli(&args, &[]);
    assert!(normal.status.success(), "{}", stderr(&normal));
    assert!(stderr(&normal).contains("== coli"), "{}", stderr(&normal));

    let mut quiet_args = args.to_vec();
    quiet_args.push("-q");
    let quiet = coli(&quiet_args, &[]);
    assert!(quiet.status.success(), "{}", stderr(&quiet));
    assert_eq!(stdout(&quiet), stdout(&normal));
    assert_eq!(stderr(&quiet), "", "-q printed on stderr");

    // Quiet hides no error.
    refused(
        &coli(&[snap.as_str(), "PROMPT=Hello", "TEMP=hot", "-q"], &[]),
        &["TEMP"],
    );

    let mut verbose_args = args.to_vec();
    verbose_args.push("-v");
    let verbose = coli(&verbose_args, &[("TOP_P", "0.5")]);
    assert!(verbose.status.success(), "{}", stderr(&verbose));
    assert_eq!(stdout(&verbose), stdout(&normal));
    let said = stderr(&verbose);
    for needle in [
        "[settings] NGEN=\"8\" (argument)",
        "[settings] TOP_P=\"0.5\" (environment)",
        "[prompt] ids: ",
        "== coli",
    ] {
        assert!(said.contains(needle), "{said:?} lacks {needle:?}");
    }
}

#[test]
fn help_shows_runnable_examples_on_the_trained_fixture() {
    let out = coli(&["--help"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let help = stdout(&out);
    for needle in [
        "coli SNAP=fixtures/olmoe_trained PROMPT=\"The licence grants you\" NGEN=40 TEMP=0",
        "coli SNAP=fixtures/olmoe_trained -p \"The licence grants you\" -n 40 TEMP=0 -q",
        "coli chat SNAP=fixtures/olmoe_trained",
        "coli serve SNAP=fixtures/olmoe_trained",
        "coli SNAP=fixtures/olmoe_trained ORACLE_STRICT=1 64 16 16",
        "-p, --prompt <TEXT>",
        "-f, --file <PATH>",
        "-q, --quiet",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    // The main job's examples run as written from the repository's root (the history left
    // alone: the committed fixture is not written).
    let mut ran = 0;
    for example in help.lines().map(str::trim) {
        let Some(args) = example.strip_prefix("coli SNAP=") else {
            continue;
        };
        let args = shell_words(&format!("SNAP={args}"));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = coli_command(&args, &[("USAGE_SAVE", "0")])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{example}: {}", stderr(&out));
        assert!(!stdout(&out).is_empty(), "{example}");
        ran += 1;
    }
    assert_eq!(ran, 4, "{help}");
}

/// `line` split as a shell splits words, for the double quotes the examples use.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                word.get_or_insert_with(String::new);
            }
            ' ' if !quoted => words.extend(word.take()),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    words
}

#[test]
fn the_settings_table_lines_up_its_columns() {
    let out = coli(&["settings"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let rows: Vec<&str> = text.lines().take_while(|line| !line.is_empty()).collect();
    assert_eq!(rows.len(), coli::settings::KEYS.len() + 1, "{text}");
    // Where each column starts: after the key and its padding, then the type's, then the
    // default's.
    let starts = |line: &str| -> Vec<usize> {
        let mut starts = Vec::new();
        let mut offset = 0;
        let mut rest = line;
        for _ in 0..3 {
            let word = rest.find(' ').unwrap_or(rest.len());
            let gap = rest[word..].len() - rest[word..].trim_start().len();
            offset += word + gap;
            rest = &rest[word + gap..];
            starts.push(offset);
        }
        starts
    };
    let header = starts(rows[0]);
    for row in &rows[1..] {
        assert_eq!(
            starts(row),
            header,
            "misaligned: {row:?}\nunder {:?}",
            rows[0]
        );
    }
}

#[test]
fn the_banner_gives_the_experts_width_they_compute_in() {
    let banner = |snap: &str, widths: &[&str]| -> String {
        let mut args = vec![snap, "IDS=3 11", "NGEN=1", "USAGE_SAVE=0", "64"];
        args.extend(widths);
        let out = coli(&args, &[]);
        assert!(out.status.success(), "{args:?}: {}", stderr(&out));
        stdout(&out)
            .lines()
            .find(|line| line.starts_with("== coli"))
            .unwrap_or_else(|| panic!("no banner: {}", stdout(&out)))
            .to_string()
    };
    let float = snap_arg(&fixture("olmoe_tiny"));
    assert!(banner(&float, &["16", "16"]).contains("experts@32-bit dense@32-bit"));
    assert!(banner(&float, &[]).contains("experts@8-bit dense@8-bit"));
    assert!(banner(&float, &["4", "8"]).contains("experts@4-bit dense@8-bit"));

    // An int4 container keeps its format whatever EBITS asks (8 by default).
    let dir = tempfile::tempdir().unwrap();
    let int4 = dir.path().join("int4");
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            int4.to_str().unwrap(),
            "--expert-bits",
            "4",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let int4 = snap_arg(&int4);
    assert!(
        banner(&int4, &[]).contains("experts@4-bit"),
        "{}",
        banner(&int4, &[])
    );
    assert!(banner(&int4, &["16", "16"]).contains("experts@4-bit"));
}

#[test]
fn ctx_is_refused_where_it_does_nothing() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    for mode in ["PROMPT=Hello", "IDS=3 11"] {
        refused(
            &coli(&[&snap, mode, "CTX=128", "USAGE_SAVE=0"], &[]),
            &["CTX", "PPL=1", "NGEN"],
        );
    }
    refused(
        &coli(&[&snap, "IDS=3 11", "PPL_STRIDE=64", "USAGE_SAVE=0"], &[]),
        &["PPL_STRIDE", "PPL=1"],
    );
    // An environment's CTX may be another program's: left alone.
    let out = coli(
        &[
            &snap,
            "IDS=3 11",
            "NGEN=1",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[("CTX", "128")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    // Where it applies, it is taken.
    let out = coli(&[&snap, "PPL=1", "CTX=8", "64", "16", "16"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("PPL: "), "{}", stdout(&out));
}
