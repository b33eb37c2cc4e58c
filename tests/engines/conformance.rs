//! What every engine owes on every committed fixture, one table for all of them:
//!
//! - exact against its transformers reference, teacher-forced and greedy, at one slot, two
//!   slots and every expert per layer, so that eviction can never change a token (greedy
//!   with the engine found from `config.json`'s `model_type`, no `--model`);
//! - the routing trace covers exactly the MoE layers: one line per layer and token, `top_k`
//!   experts of the layer's range with positive gates, and the counters agree;
//! - a prompt fed in uneven chunks, or one token at a time, predicts what one forward over it
//!   predicts, with logits that differ only by summation order;
//! - a reset engine computes what a freshly loaded one computes, bit for bit.
//!
//! What one engine alone has (windows, the DSA indexer, MTP drafts, the KDA recurrence) is
//! tested in its own file.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::common::{self, fixture};
use crate::reference;
use coli::engines::{self, Engine, LoadOptions};
use coli::generate::argmax;
use coli::snapshot::Snapshot;

struct Case {
    engine: &'static str,
    fixture: &'static str,
    layers: usize,
    /// The layers that route (the rest are dense).
    moe: Range<usize>,
    experts: usize,
    top_k: usize,
}

const fn case(
    engine: &'static str,
    fixture: &'static str,
    layers: usize,
    moe: Range<usize>,
    experts: usize,
    top_k: usize,
) -> Case {
    Case {
        engine,
        fixture,
        layers,
        moe,
        experts,
        top_k,
    }
}

const CASES: &[Case] = &[
    case("olmoe", "olmoe_tiny", 3, 0..3, 8, 2),
    case("olmoe", "olmoe_tiny_b", 4, 0..4, 12, 3),
    case("olmoe", "olmoe_trained", 4, 0..4, 32, 4),
    case("glm_moe_dsa", "glm_moe_dsa_tiny", 4, 1..4, 8, 2),
    case("glm_moe_dsa", "glm_moe_dsa_tiny_b", 5, 2..5, 12, 3),
    case("glm_moe_dsa", "glm_moe_dsa_tiny_mtp", 4, 1..4, 8, 2),
    case("inkling", "inkling_tiny", 7, 1..7, 8, 2),
    case("inkling", "inkling_tiny_b", 6, 2..6, 12, 3),
    case("kimi_k3", "kimi_k3_tiny", 6, 1..6, 8, 2),
    case("kimi_k3", "kimi_k3_tiny_b", 7, 2..7, 12, 3),
];

/// The case's engine in f32 with `cap` slots per layer, not drafting.
fn load(c: &Case, cap: usize) -> Box<dyn Engine> {
    let snapshot = Snapshot::open(&fixture(c.fixture)).unwrap();
    let options = LoadOptions {
        draft: Some(0),
        ..LoadOptions::exact(cap)
    };
    engines::load(c.engine, &snapshot, options).unwrap()
}

/// The argmax of every row of `logits`.
fn predictions(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits.chunks_exact(vocab).map(argmax).collect()
}

#[test]
fn every_engine_is_exact_at_every_cache_size() {
    for c in CASES {
        for cap in [1, 2, c.experts] {
            let (_, errors) = common::oracle_exact(Some(c.engine), c.fixture, cap, true);
            assert!(
                !errors.contains("[ORACLE] mismatch"),
                "{}: {errors}",
                c.fixture
            );
            let (text, _) = common::oracle_exact(None, c.fixture, cap, false);
            assert!(
                text.contains(&format!("== coli {} |", c.engine)),
                "{}: {text}",
                c.fixture
            );
            assert!(text.contains("Expert cache hit rate: "), "{text}");
        }
    }
}

#[test]
fn the_trace_covers_exactly_the_moe_layers() {
    for c in CASES {
        let r = reference(c.fixture);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.txt");
        let mut engine = load(c, c.experts);
        engine.telemetry().open_trace(&path).unwrap();
        engine.forward(&r.full_ids, true).unwrap();
        engine.telemetry().flush_trace().unwrap();

        // `call row layer choices`: a row is numbered within its call (Kimi K3 calls once
        // per prefill chunk).
        let mut seen = BTreeSet::new();
        let mut per_layer = BTreeMap::new();
        for line in std::fs::read_to_string(&path).unwrap().lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let key: (u64, usize, usize) = (
                fields[0].parse().unwrap(),
                fields[1].parse().unwrap(),
                fields[2].parse().unwrap(),
            );
            assert!(seen.insert(key), "{}: {line} twice", c.fixture);
            *per_layer.entry(key.2).or_insert(0) += 1;
            assert_eq!(fields.len() - 3, c.top_k, "{}: {line}", c.fixture);
            for choice in &fields[3..] {
                let (id, gate) = choice.split_once(':').unwrap();
                assert!(id.parse::<usize>().unwrap() < c.experts, "{line}");
                assert!(gate.parse::<f32>().unwrap() > 0.0, "{line}");
            }
        }
        let want: BTreeMap<usize, usize> = c.moe.clone().map(|l| (l, r.full_ids.len())).collect();
        assert_eq!(per_layer, want, "{}: lines per layer", c.fixture);

        let counts = engine.telemetry().counts();
        for layer in 0..c.layers {
            assert_eq!(
                counts.routes(layer),
                c.moe.contains(&layer),
                "{} layer {layer}",
                c.fixture
            );
        }
        let selections = c.moe.len() * r.full_ids.len() * c.top_k;
        assert_eq!(counts.total(), selections as i64, "{}", c.fixture);
    }
}

#[test]
fn a_prompt_in_chunks_or_token_by_token_predicts_what_one_forward_does() {
    for c in CASES {
        let r = reference(c.fixture);
        let mut engine = load(c, 2);
        let vocab = engine.vocab_size();
        let whole = engine.forward(&r.full_ids, true).unwrap();
        assert_eq!(engine.position(), r.full_ids.len(), "{}", c.fixture);
        assert_eq!(predictions(&whole, vocab), r.tf_pred, "{}", c.fixture);

        engine.reset();
        let mut single = Vec::new();
        for (position, &token) in r.full_ids.iter().enumerate() {
            assert_eq!(engine.position(), position, "{}", c.fixture);
            single.extend(engine.forward(&[token], true).unwrap());
        }
        assert_eq!(predictions(&single, vocab), r.tf_pred, "{}", c.fixture);

        engine.reset();
        let mut uneven = Vec::new();
        let mut start = 0;
        // 35: longer than Kimi K3's prefill chunk of 32.
        for size in [5, 1, 35, 2, 1, 7].iter().cycle() {
            if start == r.full_ids.len() {
                break;
            }
            let end = (start + size).min(r.full_ids.len());
            uneven.extend(engine.forward(&r.full_ids[start..end], true).unwrap());
            start = end;
        }
        assert_eq!(predictions(&uneven, vocab), r.tf_pred, "{}", c.fixture);

        // Splitting a prompt changes at most the order of some sums, not the values.
        for other in [&single, &uneven] {
            let worst = whole
                .iter()
                .zip(other)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(worst < 1e-3, "{}: logits differ by {worst}", c.fixture);
        }

        // The last position's logits alone.
        engine.reset();
        let last = engine
            .forward(&r.full_ids[..r.prompt_ids.len()], false)
            .unwrap();
        assert_eq!(last.len(), vocab, "{}", c.fixture);
        assert_eq!(
            argmax(&last),
            r.tf_pred[r.prompt_ids.len() - 1],
            "{}",
            c.fixture
        );
    }
}

#[test]
fn a_reset_engine_computes_what_a_fresh_one_does() {
    for c in CASES {
        let r = reference(c.fixture);
        let mut fresh = load(c, 2);
        let expected = fresh.forward(&r.full_ids, true).unwrap();

        // Used first (another prompt, then a few decode steps), then reset.
        let mut used = load(c, 2);
        let other: Vec<u32> = r.full_ids.iter().rev().copied().collect();
        used.forward(&other[..r.prompt_ids.len()], false).unwrap();
        for &token in &other[r.prompt_ids.len()..r.prompt_ids.len() + 3] {
            used.forward(&[token], false).unwrap();
        }
        used.reset();
        assert_eq!(used.position(), 0, "{}", c.fixture);
        let again = used.forward(&r.full_ids, true).unwrap();
        let differing = expected
            .iter()
            .zip(&again)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(differing, 0, "{}: {differing} logits differ", c.fixture);
    }
}
