//! The oracle run's own behaviour on OLMoE: a wrong reference fails under `ORACLE_STRICT`
//! (and only there), and `IDS=` mode continues the reference and ends at a stop id. Exactness at every cache size,
//! the trace, chunked prefill and reset are in `conformance.rs`, for every engine.

use crate::common;

use common::{coli, edit_json, fixture, read_json, stderr, stdout};

#[test]
fn strict_mode_fails_on_a_wrong_reference() {
    let dir = common::copy_fixture("olmoe_tiny");
    let path = dir.path().join("ref.json");
    let mut reference = read_json(&path);
    let last = reference["full_ids"].as_array().unwrap().len() - 1;
    let wrong = (reference["full_ids"][last].as_u64().unwrap() + 1) % 128;
    reference["full_ids"][last] = wrong.into();
    reference["tf_pred"][last - 1] = wrong.into();
    std::fs::write(&path, reference.to_string()).unwrap();
    let snap = format!("SNAP={}", dir.path().display());

    let out = coli(&[&snap, "TF=1", "ORACLE_STRICT=1", "64", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(stderr(&out).contains(&format!(
        "[ORACLE] mismatch pos={} expected={wrong}",
        last - 1
    )));
    let out = coli(&[&snap, "ORACLE_STRICT=1", "64", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stdout(&out).contains("Matching tokens: 19/20"),
        "{}",
        stdout(&out)
    );
    // Without ORACLE_STRICT a mismatch is reported, not fatal.
    let out = coli(&[&snap, "64", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn ids_mode_continues_the_reference() {
    let reference = read_json(&fixture("olmoe_tiny").join("ref.json"));
    let ids = |key: &str| -> Vec<String> {
        reference[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.to_string())
            .collect()
    };
    let prompt = ids("prompt_ids").join(" ");
    let expected = ids("full_ids")[12..17].join(" ");
    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    let out = coli(
        &[
            &snap,
            &format!("IDS={prompt}"),
            "NGEN=5",
            "USAGE_SAVE=0",
            "2",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).lines().any(|line| line == expected),
        "{}",
        stdout(&out)
    );
}

#[test]
fn ids_mode_ends_at_a_stop_id_of_the_model() {
    let dir = common::copy_fixture("olmoe_tiny");
    let reference = read_json(&dir.path().join("ref.json"));
    let full: Vec<u64> = reference["full_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let prompt_len = reference["prompt_ids"].as_array().unwrap().len();
    // The model's third generated token becomes its end of sequence; it must not be one of
    // the two before it, or the generation would stop sooner.
    let stop = full[prompt_len + 2];
    assert!(!full[prompt_len..prompt_len + 2].contains(&stop));
    edit_json(&dir.path().join("config.json"), |config| {
        config["eos_token_id"] = stop.into()
    });
    let prompt: Vec<String> = full[..prompt_len].iter().map(u64::to_string).collect();
    let out = coli(
        &[
            &format!("SNAP={}", dir.path().display()),
            &format!("IDS={}", prompt.join(" ")),
            "NGEN=8",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let expected = format!("{} {}", full[prompt_len], full[prompt_len + 1]);
    assert!(
        stdout(&out).lines().any(|line| line == expected),
        "{}",
        stdout(&out)
    );
    assert!(
        stderr(&out).contains(&format!(
            "[stop] stop id {stop} chosen after 2 tokens (of NGEN=8)"
        )),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_config_without_eos_takes_the_transformers_default_and_null_means_none() {
    let dir = common::copy_fixture("olmoe_tiny");
    let snap = format!("SNAP={}", dir.path().display());
    let args = [
        snap.as_str(),
        "IDS=3 11",
        "NGEN=1",
        "USAGE_SAVE=0",
        "64",
        "16",
        "16",
    ];
    // The committed fixture says `"eos_token_id": null`: no stop ids.
    let out = coli(&args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stderr(&out).contains("[stop]"), "{}", stderr(&out));
    // Without the key, OlmoeConfig's default.
    edit_json(&dir.path().join("config.json"), |config| {
        config.as_object_mut().unwrap().remove("eos_token_id");
    });
    let out = coli(&args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("[stop] 1 stop tokens: 50279"),
        "{}",
        stderr(&out)
    );
}
