//! Text mode (`PROMPT=`) through the binary on every committed fixture: greedy text equals
//! the detokenised `IDS=` greedy ids, seeded sampling repeats, EOS ids from every source
//! stop it, `NGEN` bounds it, `CHAT=1` renders a template, bad input exits 2, and Ctrl-C
//! stops it with the routing history saved.

use crate::common;
use crate::support;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use coli::text::TextModel;

use common::{coli, copy_fixture, edit_json, read_json, stderr, stdout};
use support::{
    generated_ids, load_engine, snap, streamed_text, summary, text_fixture, tokenizer, Run,
    FIXTURES,
};

const PROMPT: &str = "PROMPT=Hello there";

/// The prompt ids and stop set text mode uses for `text` in `dir`.
fn prompt_and_stops(dir: &Path, text: &str) -> (Vec<u32>, Vec<u32>) {
    let tokenizer = tokenizer(dir);
    let (snapshot, engine) = load_engine(dir);
    let model = TextModel::new(&tokenizer, &snapshot, engine.as_ref());
    (
        model.prompt(text, false).unwrap().ids,
        model.stop_ids(engine.stop_tokens()).unwrap(),
    )
}

fn ids_arg(ids: &[u32]) -> String {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!("IDS={}", ids.join(" "))
}

fn run_ok(args: &[&str]) -> Run {
    let out = coli(args, &[]);
    assert!(out.status.success(), "{args:?}: {}", stderr(&out));
    Run {
        stdout: stdout(&out),
        stderr: stderr(&out),
    }
}

#[test]
fn greedy_text_is_the_detokenised_greedy_ids_on_every_fixture() {
    for (fixture, tokenizer_name) in FIXTURES {
        let dir = text_fixture(fixture, tokenizer_name);
        let snap = snap(dir.path());
        let (prompt, stops) = prompt_and_stops(dir.path(), "Hello there");
        let text_run = run_ok(&[
            &snap,
            PROMPT,
            "TEMP=0",
            "NGEN=16",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ]);
        let ids_run = run_ok(&[
            &snap,
            &ids_arg(&prompt),
            "NGEN=16",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ]);
        // `IDS=` stops at the engine's stop ids (not printed); text mode's stop set also
        // holds the tokenizer's end tokens.
        let mut ids = generated_ids(&ids_run.stdout);
        assert!(ids.len() <= 16, "{fixture}: {}", ids_run.stdout);
        let ids_stopped = ids.len() < 16;
        assert_eq!(
            ids_stopped,
            ids_run.stderr.contains("[stop] stop id"),
            "{fixture}: {}",
            ids_run.stderr
        );
        let mut stop = ids.iter().position(|id| stops.contains(id));
        if let Some(at) = stop {
            ids.truncate(at);
        } else if ids_stopped {
            stop = Some(ids.len());
        }
        let expected = tokenizer(dir.path()).decode(&ids).unwrap();
        assert_eq!(streamed_text(&text_run), expected, "{fixture}");
        let (generated, ending) = summary(&text_run);
        assert_eq!(generated, ids.len(), "{fixture}");
        match stop {
            Some(_) => assert!(ending.starts_with("stop token"), "{fixture}: {ending}"),
            None => assert_eq!(ending, "NGEN reached", "{fixture}"),
        }
        assert!(
            text_run.stderr.contains("Expert cache hit rate: "),
            "{fixture}"
        );
        // stdout is the text alone.
        assert_eq!(text_run.stdout, format!("{expected}\n"), "{fixture}");
    }
}

#[test]
fn the_same_seed_gives_the_same_text() {
    let mut differs = false;
    for (fixture, tokenizer_name) in FIXTURES {
        let dir = text_fixture(fixture, tokenizer_name);
        let snap = snap(dir.path());
        let sample = |seed: &str| {
            let out = run_ok(&[
                &snap,
                PROMPT,
                "TEMP=1",
                "TOP_P=0.95",
                seed,
                "NGEN=24",
                "USAGE_SAVE=0",
            ]);
            (streamed_text(&out).to_string(), summary(&out))
        };
        let first = sample("SEED=11");
        assert_eq!(first, sample("SEED=11"), "{fixture}");
        differs |= first != sample("SEED=12");
        // TOP_K=1 leaves only the most likely token: greedy at any temperature.
        let cut = run_ok(&[
            &snap,
            PROMPT,
            "TEMP=5",
            "TOP_K=1",
            "SEED=11",
            "NGEN=24",
            "USAGE_SAVE=0",
        ]);
        let greedy = run_ok(&[&snap, PROMPT, "TEMP=0", "NGEN=24", "USAGE_SAVE=0"]);
        assert_eq!(streamed_text(&cut), streamed_text(&greedy), "{fixture}");
    }
    assert!(differs, "another seed should change some fixture's text");
}

#[test]
fn sampling_with_a_draft_head_draws_the_tokens_of_plain_decoding() {
    let dir = text_fixture("glm_moe_dsa_tiny_mtp", "glm_moe_dsa_128");
    let snap = snap(dir.path());
    let run = |draft: &str| {
        run_ok(&[
            &snap,
            PROMPT,
            "TEMP=1",
            "SEED=5",
            "NGEN=24",
            draft,
            "USAGE_SAVE=0",
        ])
    };
    let plain = run("DRAFT=0");
    let drafted = run("DRAFT=1");
    assert!(
        drafted.stderr.contains("speculation (DRAFT=1)"),
        "{}",
        drafted.stderr
    );
    assert!(!plain.stderr.contains("speculation ("), "{}", plain.stderr);
    assert_eq!(streamed_text(&plain), streamed_text(&drafted));
    assert_eq!(summary(&plain), summary(&drafted));
}

#[test]
fn an_eos_id_from_any_source_stops_generation() {
    // Inkling stops on EOS ids only, so the chosen id below is the only stop besides the
    // tokenizer's <|end_message|>.
    let dir = text_fixture("inkling_tiny", "inkling_250");
    let (prompt, stops) = prompt_and_stops(dir.path(), "Hello there");
    let ids = generated_ids(
        &run_ok(&[
            &snap(dir.path()),
            &ids_arg(&prompt),
            "NGEN=12",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ])
        .stdout,
    );
    let tokenizer = tokenizer(dir.path());
    let specials = tokenizer.special_ids();
    // A token first generated at index >= 2, before any existing stop.
    let end = ids
        .iter()
        .position(|id| stops.contains(id))
        .unwrap_or(ids.len());
    let at = (2..end)
        .find(|&i| !ids[..i].contains(&ids[i]) && !specials.contains(&ids[i]))
        .expect("a fresh ordinary token among the greedy ids");
    let target = ids[at];
    let expected = tokenizer.decode(&ids[..at]).unwrap();
    let check = |dir: &Path, source: &str| {
        let out = run_ok(&[
            &snap(dir),
            PROMPT,
            "TEMP=0",
            "NGEN=12",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ]);
        assert_eq!(
            summary(&out),
            (at, format!("stop token {target}")),
            "{source}"
        );
        assert_eq!(streamed_text(&out), expected, "{source}");
    };

    let config = text_fixture("inkling_tiny", "inkling_250");
    edit_json(&config.path().join("config.json"), |json| {
        json["eos_token_id"] = target.into()
    });
    check(config.path(), "config.json");

    let generation = text_fixture("inkling_tiny", "inkling_250");
    edit_json(&generation.path().join("generation_config.json"), |json| {
        json["eos_token_id"] = serde_json::json!([target])
    });
    check(generation.path(), "generation_config.json");

    let tokenizer_config = text_fixture("inkling_tiny", "inkling_250");
    let vocab = read_json(&tokenizer_config.path().join("tokenizer.json"));
    let token = vocab["model"]["vocab"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, id)| id.as_u64() == Some(u64::from(target)))
        .map(|(token, _)| token.clone())
        .unwrap();
    edit_json(
        &tokenizer_config.path().join("tokenizer_config.json"),
        |json| json["eos_token"] = token.into(),
    );
    check(tokenizer_config.path(), "tokenizer_config.json");
}

#[test]
fn ngen_bounds_the_generation() {
    for (fixture, tokenizer_name) in FIXTURES {
        let dir = text_fixture(fixture, tokenizer_name);
        let snap = snap(dir.path());
        let out = run_ok(&[
            &snap,
            PROMPT,
            "TEMP=0.8",
            "SEED=3",
            "NGEN=3",
            "USAGE_SAVE=0",
        ]);
        let (generated, ending) = summary(&out);
        match ending.as_str() {
            "NGEN reached" => assert_eq!(generated, 3, "{fixture}"),
            _ => assert!(
                generated < 3 && ending.starts_with("stop token"),
                "{fixture}: {ending}"
            ),
        }
        let out = run_ok(&[&snap, PROMPT, "NGEN=0", "USAGE_SAVE=0"]);
        assert_eq!(summary(&out), (0, "NGEN reached".to_string()), "{fixture}");
        assert_eq!(streamed_text(&out), "", "{fixture}");
    }
}

#[test]
fn chat_wraps_the_prompt_in_a_template() {
    let dir = text_fixture("olmoe_tiny", "olmoe_128");
    let snap = snap(dir.path());
    let tokens = |text: &str| tokenizer(dir.path()).encode(text, false).unwrap().len();
    let out = coli(
        &[&snap, PROMPT, "CHAT=1", "TEMP=0", "NGEN=4", "USAGE_SAVE=0"],
        &[],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let expected = format!(
        "[prompt] {} tokens (chat template: olmoe built-in)",
        tokens("<|user|>\nHello there\n<|assistant|>\n")
    );
    assert!(err.contains(&expected), "{err}");

    edit_json(&dir.path().join("tokenizer_config.json"), |json| {
        json["chat_template"] = "<|user|>{{ messages[0]['content'] }}".into()
    });
    let out = coli(
        &[&snap, PROMPT, "CHAT=1", "TEMP=0", "NGEN=4", "USAGE_SAVE=0"],
        &[],
    );
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "[prompt] {} tokens (chat template: ",
            tokens("<|user|>Hello there")
        )),
        "{err}"
    );
    assert!(
        err.contains("tokenizer_config.json chat_template)"),
        "{err}"
    );
}

#[test]
fn bad_text_input_exits_2_and_leaves_no_history() {
    let missing = copy_fixture("olmoe_tiny");
    for file in support::TOKENIZER_FILES {
        let _ = std::fs::remove_file(missing.path().join(file));
    }
    let corrupt = text_fixture("olmoe_tiny", "olmoe_128");
    std::fs::write(
        corrupt.path().join("tokenizer.json"),
        "{\"version\": \"1.0\", \"model\": {}}",
    )
    .unwrap();
    let unknown_variable = text_fixture("olmoe_tiny", "olmoe_128");
    std::fs::write(
        unknown_variable.path().join("chat_template.jinja"),
        "{{ system_message }}{{ messages[0]['content'] }}",
    )
    .unwrap();
    let fine = text_fixture("olmoe_tiny", "olmoe_128");
    let cases: &[(&Path, &[&str], &[&str])] = &[
        (
            missing.path(),
            &[],
            &["tokenizer.json not found", "oracle mode", "IDS="],
        ),
        (corrupt.path(), &[], &["tokenizer.json: not a tokenizer"]),
        (
            unknown_variable.path(),
            &["CHAT=1"],
            &["chat_template.jinja", "undefined", "system_message"],
        ),
        (fine.path(), &["TEMP=-1"], &["TEMP=-1", "temperature >= 0"]),
        (
            fine.path(),
            &["TEMP=warm"],
            &["TEMP=\"warm\"", "expected a temperature"],
        ),
        (fine.path(), &["TOP_P=2"], &["TOP_P=2", "(0, 1]"]),
        (fine.path(), &["MIN_P=3"], &["MIN_P", "[0, 1]"]),
        (
            fine.path(),
            &["PRESENCE_PENALTY=2.5"],
            &["PRESENCE_PENALTY", "[-2, 2]"],
        ),
        (fine.path(), &["IDS=1 2"], &["PROMPT and IDS"]),
    ];
    for (dir, extra, needles) in cases {
        let mut args = vec![snap(dir), PROMPT.to_string(), "NGEN=4".to_string()];
        args.extend(extra.iter().map(|arg| arg.to_string()));
        let out = coli(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {err}");
        for needle in *needles {
            assert!(err.contains(needle), "{extra:?}: {needle:?} not in {err}");
        }
        assert!(!dir.join(".coli_usage").exists(), "{extra:?}");
    }
    // Oracle and IDS modes do not need the tokenizer.
    let dir = snap(missing.path());
    run_ok(&[&dir, "64", "16", "16"]);
    run_ok(&[&dir, "IDS=3 11 29", "NGEN=4", "64", "16", "16"]);
}

#[test]
fn ctrl_c_stops_text_and_still_saves_history() {
    // Without an EOS id, Inkling's text mode has no stop token: only NGEN or Ctrl-C ends it.
    let dir = text_fixture("inkling_tiny", "inkling_250");
    edit_json(&dir.path().join("tokenizer_config.json"), |json| {
        json["eos_token"] = serde_json::Value::Null
    });
    let mut command = Command::new(env!("CARGO_BIN_EXE_coli"));
    for key in coli::settings::KEYS {
        command.env_remove(key.name);
    }
    let mut child = command
        .args([
            &snap(dir.path()),
            PROMPT,
            "NGEN=1000000",
            "TEMP=0.8",
            "SEED=1",
            "64",
            "16",
            "16",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let started = Instant::now();
    // Wait until text is streaming, then interrupt.
    while started.elapsed() < Duration::from_secs(60) {
        let mut chunk = [0u8; 256];
        let n = out.read(&mut chunk).unwrap();
        assert!(
            n > 0,
            "coli ended before the interrupt: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&chunk[..n]);
        if seen.len() > 200 {
            break;
        }
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    out.read_to_end(&mut seen).unwrap();
    let output = child.wait_with_output().unwrap();
    let err = stderr(&output);
    // Saved, then 128 + SIGINT, so a script can tell it from a finished run.
    assert_eq!(output.status.code(), Some(130), "{err}");
    let run = Run {
        stdout: String::from_utf8_lossy(&seen).into_owned(),
        stderr: err,
    };
    let (generated, ending) = summary(&run);
    assert_eq!(ending, "interrupted");
    assert!(generated > 0);
    let history = std::fs::read_to_string(dir.path().join(".coli_usage")).expect("history saved");
    assert!(history.lines().count() > 2, "{history}");
}
