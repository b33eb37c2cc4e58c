//! Bad input through the built binary: each case exits 2 with a message naming the problem,
//! and leaves the files it was given untouched.

use crate::common;

use common::{coli, copy_fixture, fixture, read_json, rewrite_shard, stderr, stdout};

fn snap_arg(path: &std::path::Path) -> String {
    format!("SNAP={}", path.display())
}

fn assert_refused(args: &[&str], env: &[(&str, &str)], needles: &[&str]) {
    let out = coli(args, env);
    let message = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{args:?}: {}{message}",
        stdout(&out)
    );
    for needle in needles {
        assert!(
            message.contains(needle),
            "{args:?}: {message:?} lacks {needle:?}"
        );
    }
    assert!(!message.contains("panicked"), "{message}");
}

#[test]
fn unknown_key_names_the_nearest_known_key() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    assert_refused(
        &[&snap, "NGNE=3"],
        &[],
        &["unknown setting NGNE", "did you mean NGEN"],
    );
}

#[test]
fn malformed_values_name_the_key_and_type() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    assert_refused(
        &[&snap, "NGEN=many"],
        &[],
        &["NGEN", "non-negative integer"],
    );
    assert_refused(&[&snap, "TF=maybe"], &[], &["TF", "boolean"]);
    assert_refused(&[&snap, "sixty"], &[], &["\"sixty\"", "CAP"]);
    assert_refused(&[&snap, "64", "3", "16"], &[], &["EBITS", "3-bit"]);
    assert_refused(&[&snap, "1", "2", "3", "4"], &[], &["too many numbers"]);
    assert_refused(
        &[&snap],
        &[("NGEN", "-1")],
        &["environment variable NGEN", "non-negative integer"],
    );
}

#[test]
fn a_setting_may_come_from_the_environment_and_the_argument_wins() {
    let snap = fixture("olmoe_tiny").display().to_string();
    let out = coli(
        &["IDS=1 2 3", "NGEN=2", "USAGE_SAVE=0", "2", "16"],
        &[("SNAP", &snap), ("NGEN", "7")],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let ids_line = stdout(&out)
        .lines()
        .find(|l| l.chars().all(|c| c.is_ascii_digit() || c == ' '))
        .map(str::to_string);
    assert_eq!(ids_line.map(|l| l.split(' ').count()), Some(2));
}

#[test]
fn missing_snap_is_explained() {
    assert_refused(&["64", "16", "16"], &[], &["SNAP is not set"]);
    assert_refused(
        &["SNAP=/nonexistent/model", "64", "16", "16"],
        &[],
        &["/nonexistent/model", "not a directory"],
    );
}

#[test]
fn engine_and_config_must_agree() {
    let snap = snap_arg(&fixture("olmoe_tiny"));
    assert_refused(
        &["--model", "glm_moe_dsa", &snap, "64", "16", "16"],
        &[],
        &["--model glm_moe_dsa", "model_type \"olmoe\""],
    );
    assert_refused(&["--model", "mixtral", &snap], &[], &["mixtral"]);
}

#[test]
fn truncated_shard_names_the_file_and_sizes() {
    let dir = copy_fixture("olmoe_tiny");
    let shard = dir.path().join("model.safetensors");
    let full = std::fs::metadata(&shard).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    file.set_len(full - 1000).unwrap();
    drop(file);
    assert_refused(
        &[&snap_arg(dir.path()), "64", "16", "16"],
        &[],
        &[
            "model.safetensors",
            "truncated",
            &format!("declares {full} bytes"),
        ],
    );
    assert_eq!(std::fs::metadata(&shard).unwrap().len(), full - 1000);
    std::fs::write(&shard, b"short").unwrap();
    assert_refused(
        &[&snap_arg(dir.path())],
        &[],
        &["model.safetensors", "not a safetensors file"],
    );
}

#[test]
fn config_errors_name_the_key() {
    let dir = copy_fixture("olmoe_tiny");
    let path = dir.path().join("config.json");
    let original = read_json(&path);
    let mut config = original.clone();

    config.as_object_mut().unwrap().remove("num_experts");
    std::fs::write(&path, config.to_string()).unwrap();
    assert_refused(
        &[&snap_arg(dir.path()), "64", "16", "16"],
        &[],
        &["config.json", "num_experts"],
    );

    let mut config = original.clone();
    config["hidden_size"] = "wide".into();
    std::fs::write(&path, config.to_string()).unwrap();
    assert_refused(
        &[&snap_arg(dir.path()), "64", "16", "16"],
        &[],
        &["config.json", "invalid type"],
    );

    // A shape that disagrees with the weights names the tensor and both shapes.
    let mut config = original;
    config["intermediate_size"] = 16.into();
    std::fs::write(&path, config.to_string()).unwrap();
    assert_refused(
        &[&snap_arg(dir.path()), "64", "16", "16"],
        &[],
        &["mlp.experts.0.gate_proj.weight", "[32, 64]", "[16, 64]"],
    );

    std::fs::write(&path, "{ not json").unwrap();
    assert_refused(
        &[&snap_arg(dir.path())],
        &[],
        &["config.json", "not valid JSON"],
    );
}

/// `generation_config.json`'s stop ids: a list of millions is refused at once (naming the
/// file, the key and the count), an id beyond the vocabulary is refused naming it, and a
/// long list that is taken is shown shortened.
#[test]
fn stop_ids_are_bounded_and_within_the_vocabulary() {
    let dir = copy_fixture("olmoe_tiny");
    let path = dir.path().join("generation_config.json");
    let run = [snap_arg(dir.path()), "IDS=3 11".into(), "NGEN=1".into()];
    let run: Vec<&str> = run
        .iter()
        .map(String::as_str)
        .chain(["64", "16", "16"])
        .collect();
    let many: Vec<u32> = (0..3_000_000).map(|i| i % 100).collect();
    std::fs::write(
        &path,
        serde_json::json!({ "eos_token_id": many }).to_string(),
    )
    .unwrap();
    assert_refused(
        &run,
        &[],
        &["generation_config.json", "eos_token_id lists 3000000 ids"],
    );

    std::fs::write(&path, r#"{"eos_token_id": [7, 500]}"#).unwrap();
    assert_refused(
        &run,
        &[],
        &[
            "generation_config.json",
            "eos_token_id holds 500",
            "vocab_size 128",
        ],
    );

    let forty: Vec<u32> = (60..100).collect();
    std::fs::write(
        &path,
        serde_json::json!({ "eos_token_id": forty }).to_string(),
    )
    .unwrap();
    let out = coli(&run, &[("USAGE_SAVE", "0")]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("[stop] 40 stop tokens: 60 61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 ... (24 more)\n"),
        "{err}"
    );
}

#[test]
fn malformed_reference_names_the_problem() {
    let dir = copy_fixture("olmoe_tiny");
    let path = dir.path().join("ref.json");
    let snap = snap_arg(dir.path());
    for (text, needle) in [
        (r#"{"full_ids": [1, 2]}"#, "missing key prompt_ids"),
        (
            r#"{"prompt_ids": [1], "full_ids": [1, "two"]}"#,
            "full_ids[1]",
        ),
        (
            r#"{"prompt_ids": [1], "full_ids": [1, 4096]}"#,
            "outside the vocabulary",
        ),
        (
            r#"{"prompt_ids": [-1], "full_ids": [1, 2]}"#,
            "prompt_ids[0] = -1",
        ),
        ("[1, 2", "not valid JSON"),
    ] {
        std::fs::write(&path, text).unwrap();
        assert_refused(&[&snap, "64", "16", "16"], &[], &["ref.json", needle]);
    }
    assert_refused(
        &[&snap, "REF=/nonexistent/ref.json"],
        &[],
        &["/nonexistent/ref.json"],
    );
}

#[test]
fn settings_subcommand_lists_every_key() {
    let out = coli(&["settings"], &[]);
    assert!(out.status.success());
    let text = stdout(&out);
    for key in coli::settings::KEYS {
        assert!(text.contains(key.name), "{} missing from {text}", key.name);
    }
}

#[test]
fn missing_tensor_and_wrong_dtype_are_named() {
    let dir = copy_fixture("olmoe_tiny");
    rewrite_shard(dir.path(), |tensors| {
        tensors.retain(|t| t.0 != "model.layers.1.mlp.experts.5.up_proj.weight")
    });
    assert_refused(
        &[&snap_arg(dir.path()), "64", "16", "16"],
        &[],
        &["model.layers.1.mlp.experts.5.up_proj.weight", "not found"],
    );

    let dir = copy_fixture("olmoe_tiny");
    rewrite_shard(dir.path(), |tensors| {
        for tensor in tensors.iter_mut().filter(|t| t.0 == "model.norm.weight") {
            tensor.1 = safetensors::Dtype::I32;
        }
    });
    assert_refused(
        &[&snap_arg(dir.path()), "64", "16", "16"],
        &[],
        &["model.norm.weight", "I32", "expected F32, BF16 or F16"],
    );

    // A routed expert in a wrong dtype is refused at load, not when it is first used, and
    // the converter refuses it too.
    let dir = copy_fixture("olmoe_tiny");
    let expert = "model.layers.2.mlp.experts.6.down_proj.weight";
    rewrite_shard(dir.path(), |tensors| {
        for tensor in tensors.iter_mut().filter(|t| t.0 == expert) {
            tensor.1 = safetensors::Dtype::I32;
        }
    });
    assert_refused(
        &[
            &snap_arg(dir.path()),
            "IDS=3",
            "NGEN=1",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[],
        &[expert, "I32"],
    );
    let out = tempfile::tempdir().unwrap();
    assert_refused(
        &[
            "convert",
            dir.path().to_str().unwrap(),
            out.path().join("c").to_str().unwrap(),
        ],
        &[],
        &[expert, "I32", "weight matrix"],
    );
}

#[test]
fn bf16_weights_run_widened_to_f32() {
    // The same fixture stored in bf16 loads and runs; tokens may differ from the f32
    // reference, so only completion is checked here.
    let dir = copy_fixture("olmoe_tiny");
    rewrite_shard(dir.path(), |tensors| {
        for tensor in tensors.iter_mut() {
            tensor.1 = safetensors::Dtype::BF16;
            tensor.3 = tensor
                .3
                .chunks_exact(4)
                .flat_map(|b| {
                    half::bf16::from_f32(f32::from_le_bytes([b[0], b[1], b[2], b[3]])).to_le_bytes()
                })
                .collect();
        }
    });
    let out = coli(&[&snap_arg(dir.path()), "TF=1", "64", "16", "16"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("PREFILL (teacher-forcing) vs oracle: "));
}
