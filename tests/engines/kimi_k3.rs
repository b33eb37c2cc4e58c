//! Kimi K3 against its PyTorch reference (`fixtures/gen/kimi_k3_reference.py`, built from
//! transformers' `kimi_linear` and `glm5_next` modules) on the committed fixtures, what only
//! it has (exactness at every cache size, and one forward against uneven chunks and one token
//! at a time, are in `conformance.rs`): prompts that cross the engine's prefill chunk, so that
//! those runs carry the KDA recurrence, convolution windows and MLA cache across it; the KDA
//! step against
//! transformers' `recurrent_kimi_delta_attention`; the routing telemetry of every MoE layer
//! and of no dense one; config and checkpoint errors that name what is wrong.
//!
//! `kimi_k3_tiny` has the release's layout (`kimi_k3` config with a `kimi_linear`
//! `text_config`, tensors under `language_model.`); `kimi_k3_tiny_b` is a bare `kimi_linear`
//! config with unprefixed tensors, grouped top-k, no SiTU linear beta and a last
//! attention-residual block that is cut short.

use crate::common;
use crate::common::Conversation;
use crate::reference;

use std::collections::BTreeSet;

use coli::engines::kda::delta_rule;
use coli::engines::kimi_k3::PREFILL_CHUNK;
use coli::engines::{self, LoadOptions};
use coli::sampling::argmax;
use coli::snapshot::Snapshot;
use common::{
    coli, copy_fixture, fixture, fixture_with_config, read_json, rewrite_shard, stderr, stdout,
};

struct Fixture {
    name: &'static str,
    layers: usize,
    experts: usize,
    top_k: usize,
    dense: usize,
}

const FIXTURES: &[Fixture] = &[
    Fixture {
        name: "kimi_k3_tiny",
        layers: 6,
        experts: 8,
        top_k: 2,
        dense: 1,
    },
    Fixture {
        name: "kimi_k3_tiny_b",
        layers: 7,
        experts: 12,
        top_k: 3,
        dense: 2,
    },
];

fn load(name: &str, cap: usize) -> Conversation {
    let snapshot = Snapshot::open(&fixture(name)).unwrap();
    Conversation::new(engines::load("kimi_k3", &snapshot, LoadOptions::exact(cap)).unwrap())
}

/// The argmax of every row of `logits`.
fn predictions(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks_exact(vocab).map(argmax).collect()
}

#[test]
fn the_prompts_cross_a_prefill_chunk() {
    // So that the conformance suite's one forward, uneven chunks (one longer than a chunk)
    // and token-by-token runs cross K3's own chunk boundary.
    for f in FIXTURES {
        let r = reference(f.name);
        assert!(
            r.prompt_ids.len() > PREFILL_CHUNK,
            "{}: the prompt must cross a prefill chunk",
            f.name
        );
        let mut engine = load(f.name, 2);
        let whole = engine.forward(&r.full_ids, true).unwrap();
        assert_eq!(engine.position(), r.full_ids.len(), "{}", f.name);
        let vocab = engine.vocab_size();
        assert_eq!(predictions(&whole, vocab), r.tf_pred, "{}", f.name);
    }
}

#[test]
fn kda_step_matches_the_transformers_recurrence() {
    for f in FIXTURES {
        kda_step_matches(&read_json(&fixture(f.name).join("kda_recurrence.json")));
    }
}

fn kda_step_matches(data: &serde_json::Value) {
    let floats = |key: &str| -> Vec<f32> {
        data[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    let count = |key: &str| data[key].as_u64().unwrap() as usize;
    let (tokens, heads, dim) = (count("tokens"), count("heads"), count("dim"));
    let (q, k, v, g, beta) = (
        floats("q"),
        floats("k"),
        floats("v"),
        floats("g"),
        floats("beta"),
    );
    let mut state = floats("initial_state");
    let expected = floats("output");
    let width = heads * dim;
    let mut out = vec![0f32; tokens * width];
    for t in 0..tokens {
        let row = |x: &[f32]| x[t * width..][..width].to_vec();
        delta_rule(
            heads,
            dim,
            &row(&q),
            &row(&k),
            &row(&v),
            &row(&g),
            &beta[t * heads..][..heads],
            &mut state,
            &mut out[t * width..][..width],
        );
    }
    let close = |got: &[f32], want: &[f32], what: &str| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{what}[{i}]: {a} vs {b}"
            );
        }
    };
    close(&out, &expected, "output");
    close(&state, &floats("final_state"), "final state");
}

#[test]
fn route_trace_covers_every_moe_layer_and_no_dense_one() {
    for f in FIXTURES {
        let r = reference(f.name);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.txt");
        let mut engine = load(f.name, f.experts);
        engine.engine.routed().telemetry.open_trace(&path).unwrap();
        engine.forward(&r.full_ids, true).unwrap();
        engine.engine.routed().telemetry.flush_trace().unwrap();

        let text = std::fs::read_to_string(&path).unwrap();
        let config = read_json(&fixture(f.name).join("config.json"));
        let text_config = config.get("text_config").unwrap_or(&config);
        let scale = text_config["routed_scaling_factor"].as_f64().unwrap() as f32;
        let moe = f.dense..f.layers;
        let mut layers = BTreeSet::new();
        let mut calls = BTreeSet::new();
        let mut lines = 0;
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            calls.insert(fields[0].parse::<u64>().unwrap());
            layers.insert(fields[2].parse::<usize>().unwrap());
            let choices = &fields[3..];
            assert_eq!(choices.len(), f.top_k, "{line}");
            let mut gates = 0.0;
            for choice in choices {
                let (id, gate) = choice.split_once(':').unwrap();
                assert!(id.parse::<usize>().unwrap() < f.experts, "{line}");
                gates += gate.parse::<f32>().unwrap();
            }
            // Renormalised gates, times routed_scaling_factor.
            assert!((gates - scale).abs() < 2e-3, "{line}");
            lines += 1;
        }
        assert_eq!(layers, moe.clone().collect::<BTreeSet<_>>(), "{}", f.name);
        assert_eq!(lines, moe.len() * r.full_ids.len(), "{}", f.name);
        // One call per MoE layer per prefill chunk, numbered from 0.
        let chunks = r.full_ids.len().div_ceil(PREFILL_CHUNK);
        let expected: BTreeSet<u64> = (0..(moe.len() * chunks) as u64).collect();
        assert_eq!(calls, expected, "{}", f.name);

        let routed = engine.engine.routed();
        let counts = routed.telemetry.counts();
        for l in 0..=f.layers {
            assert_eq!(counts.routes(l), moe.contains(&l), "{} layer {l}", f.name);
        }
        let selections = (moe.len() * r.full_ids.len() * f.top_k) as i64;
        assert_eq!(counts.total(), selections, "{}", f.name);
    }
}

#[test]
fn model_flag_and_config_errors_are_named() {
    let snap = format!("SNAP={}", fixture("kimi_k3_tiny").display());
    let out = coli(&["--model", "olmoe", &snap, "64", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("model_type \"kimi_k3\""),
        "{}",
        stderr(&out)
    );

    let edit = |change: &dyn Fn(&mut serde_json::Value)| -> String {
        let dir = fixture_with_config("kimi_k3_tiny", change);
        let snap = format!("SNAP={}", dir.path().display());
        let out = coli(&[&snap, "64", "16", "16"], &[]);
        assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
        stderr(&out)
    };
    let message = edit(&|c| {
        c["text_config"]["linear_attn_config"]["kda_layers"] = serde_json::json!([0, 1, 2, 4])
    });
    assert!(
        message.contains("kda_layers") && message.contains("1-indexed"),
        "{message}"
    );
    let message = edit(&|c| c["text_config"]["topk_method"] = "greedy".into());
    assert!(message.contains("topk_method"), "{message}");
    let message = edit(&|c| {
        c["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("attn_res_block_size");
    });
    assert!(message.contains("attn_res_block_size"), "{message}");
    // A MoE with more experts than the checkpoint has is refused at the router.
    let message = edit(&|c| c["text_config"]["num_experts"] = 16.into());
    assert!(
        message.contains("block_sparse_moe.gate.weight") && message.contains("[16, 64]"),
        "{message}"
    );
}

/// Overwrite `len` bytes of tensor `name` in a copy of a fixture's shard.
fn patch_tensor(dir: &std::path::Path, name: &str, at: usize, bytes: &[u8]) {
    let path = dir.join("model.safetensors");
    let mut data = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(data[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&data[8..8 + header_len]).unwrap();
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    let offset = 8 + header_len + start + at;
    data[offset..offset + bytes.len()].copy_from_slice(bytes);
    std::fs::write(&path, data).unwrap();
}

#[test]
fn a_log_must_be_per_head_with_zero_padding() {
    let dir = copy_fixture("kimi_k3_tiny");
    // The fixture stores 2 heads' values in 16 entries; entry 5 must stay zero.
    patch_tensor(
        dir.path(),
        "language_model.model.layers.0.self_attn.A_log",
        5 * 4,
        &0.25f32.to_le_bytes(),
    );
    let snapshot = Snapshot::open(dir.path()).unwrap();
    let err = engines::load("kimi_k3", &snapshot, LoadOptions::exact(1))
        .err()
        .unwrap();
    let message = format!("{err:#}");
    assert!(
        message.contains("layers.0.self_attn.A_log") && message.contains("entry 5"),
        "{message}"
    );
}

/// Rewrite a copy of a fixture's shard with tensor `name` replaced by `shape` and `bytes`.
fn replace_tensor(dir: &std::path::Path, name: &str, shape: Vec<usize>, bytes: Vec<u8>) {
    rewrite_shard(dir, |tensors| {
        let tensor = tensors
            .iter_mut()
            .find(|tensor| tensor.0 == name)
            .expect("the tensor is in the shard");
        (tensor.2, tensor.3) = (shape, bytes);
    });
}

#[test]
fn an_expert_of_the_wrong_size_is_refused() {
    let dir = copy_fixture("kimi_k3_tiny");
    // One scale byte per row instead of two (64 values per row of w2 are two MXFP4 groups).
    let name = "language_model.model.layers.2.block_sparse_moe.experts.3.w2";
    replace_tensor(
        dir.path(),
        &format!("{name}.weight_scale"),
        vec![32, 1],
        vec![127; 32],
    );
    let snapshot = Snapshot::open(dir.path()).unwrap();
    let err = engines::load("kimi_k3", &snapshot, LoadOptions::exact(1))
        .err()
        .unwrap();
    let message = format!("{err:#}");
    assert!(
        message.contains(&format!("{name}.weight_packed")) && message.contains("mxfp4"),
        "{message}"
    );
}
