//! What only Inkling has, on the committed fixtures: decode one token at a time and in uneven
//! chunks far past the sliding window (KV ring and convolution states carried across calls);
//! an IKU1 history read into the engine's table and rewritten as text; its config errors.
//! Exactness at every cache size and the routing telemetry are in `conformance.rs`.
//!
//! `inkling_tiny` is saved by transformers as `inkling_text`; `inkling_tiny_b` uses the
//! release's multimodal schema (`inkling_mm_model` + `text_config`, `dense_intermediate_size`,
//! `local_layer_ids`, `dense_mlp_idx`, `sconv_kernel_size`) and the older tensor names
//! (`model.language_model.*`, `embed_norm` outside the embedding).

use crate::common;
use crate::common::Conversation;
use crate::reference;

use coli::engines::{self, LoadOptions};
use coli::route_trace::{ReadOutcome, SaveOptions};
use coli::sampling::argmax;
use coli::snapshot::Snapshot;
use common::{coli, fixture, fixture_with_config, stderr};

struct Fixture {
    name: &'static str,
    layers: usize,
    experts: usize,
    window: usize,
    sparse: std::ops::Range<usize>,
}

const FIXTURES: &[Fixture] = &[
    Fixture {
        name: "inkling_tiny",
        layers: 7,
        experts: 8,
        window: 8,
        sparse: 1..7,
    },
    Fixture {
        name: "inkling_tiny_b",
        layers: 6,
        experts: 12,
        window: 6,
        sparse: 2..6,
    },
];

fn load(name: &str, cap: usize) -> Conversation {
    let snapshot = Snapshot::open(&fixture(name)).unwrap();
    let options = LoadOptions::exact(cap);
    Conversation::new(engines::load("inkling", &snapshot, options).unwrap())
}

#[test]
fn decode_token_by_token_slides_the_window() {
    for f in FIXTURES {
        let r = reference(f.name);
        assert!(
            r.full_ids.len() > 3 * f.window,
            "{}: the window must slide",
            f.name
        );
        let mut engine = load(f.name, 1);
        engine.reset();
        for (position, &token) in r.full_ids.iter().enumerate() {
            assert_eq!(engine.position(), position);
            let logits = engine.forward(&[token], false).unwrap();
            assert_eq!(logits.len(), engine.vocab_size());
            assert_eq!(
                argmax(&logits),
                r.tf_pred[position],
                "{} position {position}",
                f.name
            );
        }
        // A reset starts over from an empty window and zero convolution states.
        engine.reset();
        let logits = engine.forward(&r.full_ids, true).unwrap();
        let vocab = engine.vocab_size();
        let predicted: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(predicted, r.tf_pred, "{}", f.name);
    }
}

#[test]
fn uneven_chunks_continue_the_window_and_convolutions() {
    for f in FIXTURES {
        let r = reference(f.name);
        let mut engine = load(f.name, 2);
        let vocab = engine.vocab_size();
        let mut predicted = Vec::new();
        let mut start = 0;
        // Chunks shorter than, equal to and longer than the window, and single tokens.
        for size in [5, 1, f.window, 2, f.window + 3, 1, 1, 4].iter().cycle() {
            if start == r.full_ids.len() {
                break;
            }
            let end = (start + size).min(r.full_ids.len());
            let logits = engine.forward(&r.full_ids[start..end], true).unwrap();
            predicted.extend(logits.chunks_exact(vocab).map(argmax));
            start = end;
        }
        assert_eq!(predicted, r.tf_pred, "{}", f.name);
    }
}

#[test]
fn iku1_history_is_read_and_rewritten_as_text() {
    let f = &FIXTURES[0];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(".coli_usage");
    let mut bytes = b"IKU1".to_vec();
    for word in [f.layers as u32, f.experts as u32] {
        bytes.extend(word.to_le_bytes());
    }
    // colibri's Inkling counts only sparse layers: the dense layer's row is all zero.
    let mut total = 0i64;
    for l in 0..f.layers {
        for e in 0..f.experts {
            let count = if f.sparse.contains(&l) {
                (l * 10 + e + 1) as u32
            } else {
                0
            };
            bytes.extend(count.to_le_bytes());
            total += i64::from(count);
        }
    }
    std::fs::write(&path, &bytes).unwrap();

    let engine = load(f.name, f.experts);
    let outcome = engine.engine.routed().telemetry.load_history(&path, None);
    assert!(matches!(outcome, ReadOutcome::Read(_)), "{outcome:?}");
    assert_eq!(outcome.total(), total);
    assert_eq!(engine.engine.routed().telemetry.counts().total(), total);

    engine
        .engine
        .routed()
        .telemetry
        .save_history(&path, SaveOptions::default())
        .unwrap();
    let rewritten = std::fs::read(&path).unwrap();
    assert!(!rewritten.starts_with(b"IKU1"));
    assert!(std::str::from_utf8(&rewritten).is_ok());
    let again = load(f.name, f.experts);
    assert_eq!(
        again
            .engine
            .routed()
            .telemetry
            .load_history(&path, None)
            .total(),
        total
    );
}

#[test]
fn model_flag_and_config_errors_are_named() {
    let snap = format!("SNAP={}", fixture("inkling_tiny").display());
    let out = coli(&["--model", "olmoe", &snap, "64", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("model_type \"inkling_text\""),
        "{}",
        stderr(&out)
    );

    let dir = fixture_with_config("inkling_tiny", |config| {
        config["layer_types"][2] = "full_attention".into()
    });
    let snap = format!("SNAP={}", dir.path().display());
    let out = coli(&[&snap, "64", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(2));
    let message = stderr(&out);
    assert!(
        message.contains("layer_types") && message.contains("full_attention"),
        "{message}"
    );
}
