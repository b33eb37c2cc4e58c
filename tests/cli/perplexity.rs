//! `PPL=1` and `KLD_BASE`: the perplexity of the trained fixture equals the transformers
//! reference's windowed NLL (written by its generator into ref.json), a run compared with
//! its own base diverges by exactly 0 on every engine, a scoring run leaves the history
//! byte for byte as it was, int8 activations (`ACT_BITS=8`) cost a measurable little and
//! are refused on the exact path, and bad input is refused with exit 2 and no file touched.

use crate::common;

use std::fs;
use std::path::Path;

use common::{coli, fixture, read_json, stderr, stdout};

/// The number after `key` in `text` (up to the next space, comma or parenthesis).
fn number_after(text: &str, key: &str) -> f64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {text}"));
    text[at + key.len()..]
        .trim_start()
        .split([' ', ',', '(', '%'])
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no number after {key:?} in {text}"))
}

fn reference() -> serde_json::Value {
    read_json(&fixture("olmoe_trained").join("ref.json"))
}

fn ids_of(value: &serde_json::Value) -> String {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|id| id.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn snap(name: &str) -> String {
    format!("SNAP={}", fixture(name).display())
}

#[test]
fn perplexity_matches_the_transformers_reference_on_held_out_text() {
    let r = reference();
    let ppl = &r["ppl"];
    for domain in ["prose", "code"] {
        let want = ppl[domain]["nll"].as_f64().unwrap();
        let tokens = ppl[domain]["tokens"].as_u64().unwrap();
        let out = coli(
            &[
                &snap("olmoe_trained"),
                "PPL=1",
                &format!("IDS={}", ids_of(&ppl[domain]["ids"])),
                &format!("CTX={}", ppl["ctx"]),
                &format!("PPL_STRIDE={}", ppl["stride"]),
                "64",
                "16",
                "16",
            ],
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let text = stdout(&out);
        let nll = number_after(&text, "mean NLL");
        assert!(
            (nll - want).abs() < 2e-6 * want,
            "{domain}: NLL {nll} vs reference {want}\n{text}"
        );
        assert_eq!(number_after(&text, " over") as u64, tokens, "{text}");
        let perplexity = number_after(&text, "PPL:");
        assert!(
            (perplexity - want.exp()).abs() < 1e-3 * want.exp(),
            "{text}"
        );
    }
}

#[test]
fn a_run_against_its_own_base_diverges_by_zero_and_int8_by_a_little() {
    let dir = tempfile::tempdir().unwrap();
    for (name, ctx) in [
        ("olmoe_trained", "CTX=12"),
        ("olmoe_tiny", "CTX=5"),
        ("glm_moe_dsa_tiny", "CTX=5"),
        ("inkling_tiny", "CTX=5"),
        ("kimi_k3_tiny", "CTX=5"),
    ] {
        let base = dir.path().join(format!("{name}.kld"));
        let base_arg = format!("KLD_BASE={}", base.display());
        // Windows of CTX every CTX/2 over the reference's full_ids: several windows, each
        // from an empty cache.
        let run = |bits: &[&str]| {
            let mut args = vec![snap(name), "PPL=1".into(), ctx.into(), base_arg.clone()];
            args.extend(bits.iter().map(|b| b.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            coli(&args, &[])
        };
        let first = run(&["64", "16", "16"]);
        assert!(first.status.success(), "{name}: {}", stderr(&first));
        assert!(
            stderr(&first).contains("[KLD_BASE] wrote"),
            "{}",
            stderr(&first)
        );
        let written = fs::read(&base).unwrap();
        let again = run(&["64", "16", "16"]);
        assert!(again.status.success(), "{name}: {}", stderr(&again));
        let text = stdout(&again);
        assert!(text.contains("KLD: mean 0.000000,"), "{name}: {text}");
        assert!(text.contains("max 0.000000 "), "{name}: {text}");
        assert!(text.contains("top-1 agreement 100.00%"), "{name}: {text}");
        assert!(text.contains("PPL ratio 1.00000"), "{name}: {text}");
        assert_eq!(
            fs::read(&base).unwrap(),
            written,
            "a base is never rewritten"
        );
        if name == "olmoe_trained" {
            let int8 = run(&["64", "8", "8"]);
            assert!(int8.status.success(), "{}", stderr(&int8));
            let kld = number_after(&stdout(&int8), "KLD: mean");
            assert!(kld > 0.0 && kld < 0.05, "{}", stdout(&int8));
            // Int8 activations on top cost a little more, still far below int4's cost.
            let act8 = run(&["64", "8", "8", "ACT_BITS=8"]);
            assert!(act8.status.success(), "{}", stderr(&act8));
            let kld8 = number_after(&stdout(&act8), "KLD: mean");
            assert!(kld8 > 0.0 && kld8 < 0.05, "{}", stdout(&act8));
            assert_ne!(kld8, kld, "ACT_BITS=8 changed nothing");
        }
    }
}

#[test]
fn a_perplexity_run_leaves_the_history_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let history = dir.path().join("h.coli_usage");
    // A history of a generating run first.
    let made = coli(
        &[
            &snap("olmoe_trained"),
            &format!("COLI_USAGE={}", history.display()),
            "IDS=5 6 7",
            "NGEN=4",
        ],
        &[],
    );
    assert!(made.status.success(), "{}", stderr(&made));
    let before = fs::read(&history).unwrap();
    let text = dir.path().join("t.txt");
    fs::write(
        &text,
        "The licence grants you the right to copy the work.\n",
    )
    .unwrap();
    let out = coli(
        &[
            &snap("olmoe_trained"),
            &format!("COLI_USAGE={}", history.display()),
            "PPL=1",
            &format!("PPL_FILE={}", text.display()),
            "CTX=8",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("PPL: "), "{}", stdout(&out));
    assert!(
        stderr(&out).contains(&format!("of {}", text.display())),
        "{}",
        stderr(&out)
    );
    assert_eq!(fs::read(&history).unwrap(), before);
}

#[test]
fn bad_perplexity_input_is_refused_and_touches_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let not_base = dir.path().join("notes.txt");
    fs::write(&not_base, "my notes\n").unwrap();
    let base = dir.path().join("b.kld");
    let refuse = |args: &[&str], what: &str| {
        let mut all = vec![snap("olmoe_tiny")];
        all.extend(args.iter().map(|a| a.to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        let out = coli(&all, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(what), "{args:?}: {}", stderr(&out));
    };
    let arg = |key: &str, path: &Path| format!("{key}={}", path.display());
    refuse(&["PPL=1", &arg("KLD_BASE", &not_base)], "not a base file");
    assert_eq!(fs::read_to_string(&not_base).unwrap(), "my notes\n");
    refuse(&[&arg("KLD_BASE", &base)], "add PPL=1");
    refuse(&["PPL=1", "CTX=1"], "CTX=1");
    refuse(&["PPL=1", "CTX=4", "PPL_STRIDE=5"], "PPL_STRIDE=5");
    refuse(&["PPL=1", "PROMPT=hi"], "PROMPT");
    refuse(
        &["PPL=1", &arg("PPL_FILE", &dir.path().join("missing"))],
        "PPL_FILE",
    );
    refuse(&["PPL=1", "IDS=3"], "at least 2 tokens");
    refuse(&["PPL=1", "IDS=3 99999"], "outside the vocabulary");
    // The exact path keeps f32 activations.
    refuse(&["ACT_BITS=8", "64", "16", "16"], "exact f32 path");
    refuse(&["ACT_BITS=4", "64", "8", "8"], "ACT_BITS=4");
    // A base of one windowing is refused by another, and stays as it was.
    let made = coli(
        &[
            &snap("olmoe_tiny"),
            "PPL=1",
            "CTX=4",
            &arg("KLD_BASE", &base),
        ],
        &[],
    );
    assert!(made.status.success(), "{}", stderr(&made));
    let written = fs::read(&base).unwrap();
    refuse(&["PPL=1", "CTX=6", &arg("KLD_BASE", &base)], "CTX=4");
    refuse(
        &["PPL=1", "CTX=4", "IDS=1 2 3", &arg("KLD_BASE", &base)],
        "another text",
    );
    assert_eq!(fs::read(&base).unwrap(), written);
}

/// The first SIGTERM stops a perplexity run between windows: it prints the figures of the
/// windows scored, writes no partial `KLD_BASE`, and exits 128 + 15.
#[test]
fn sigterm_stops_scoring_between_windows_and_prints_what_was_scored() {
    use std::io::{BufRead as _, BufReader, Read as _};
    use std::process::Stdio;
    use std::time::{Duration, Instant};

    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("long.txt");
    // Far more windows of two tokens than a run scores before the signal comes.
    fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog\n".repeat(20_000),
    )
    .unwrap();
    let base = dir.path().join("b.kld");
    let mut child = common::coli_command(
        &[
            &snap("olmoe_tiny"),
            "PPL=1",
            &format!("PPL_FILE={}", text.display()),
            &format!("KLD_BASE={}", base.display()),
            "CTX=2",
            "PPL_STRIDE=1",
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
    // Scoring begins after the `[PPL]` line.
    for line in lines.by_ref() {
        let line = line.unwrap();
        err.push_str(&line);
        err.push('\n');
        if line.starts_with("[PPL] ") {
            break;
        }
    }
    assert!(err.contains("[PPL] "), "coli ended before scoring: {err}");
    // SAFETY: kill has no memory preconditions; the pid is our child's, not yet waited on.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > Duration::from_secs(120) {
            child.kill().unwrap();
            panic!("SIGTERM did not stop the perplexity run: {err}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    for line in lines {
        err.push_str(&line.unwrap());
        err.push('\n');
    }
    let text = reader.join().unwrap();
    assert_eq!(status.code(), Some(128 + 15), "{text}{err}");
    let line = text
        .lines()
        .find(|l| l.starts_with("PPL: "))
        .unwrap_or_else(|| panic!("no PPL line: {text}{err}"));
    assert!(line.contains("| stopped by a signal after "), "{line}");
    let (done, of) = {
        let tail = &line[line.find("after ").unwrap() + 6..];
        let mut words = tail.split(' ');
        let done: usize = words.next().unwrap().parse().unwrap();
        let of: usize = words.nth(1).unwrap().parse().unwrap();
        (done, of)
    };
    assert!(done < of, "{line}");
    // Each window of two tokens scores one.
    assert_eq!(number_after(line, " over") as usize, done, "{line}");
    assert!(
        err.contains("[KLD_BASE]") && err.contains("not written"),
        "{err}"
    );
    assert!(!base.exists());
}
