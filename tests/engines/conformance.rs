//! What every engine owes on every committed fixture, one table for all of them:
//!
//! - exact against its transformers reference, teacher-forced and greedy, at one slot, two
//!   slots and every expert per layer, so that eviction can never change a token (greedy
//!   with the engine found from `config.json`'s `model_type`, no `--model`);
//! - the routing trace covers exactly the MoE layers: one line per layer and token, `top_k`
//!   experts of the layer's range with positive gates, and the counters agree;
//! - a prompt fed in uneven chunks, or one token at a time, predicts what one forward over it
//!   predicts, with logits that differ only by summation order;
//! - a new state on a used engine computes what a freshly loaded engine computes, bit for
//!   bit;
//! - in a batch, every sequence computes the bits it computes alone: 1 to 8 sequences of
//!   different lengths, prompts being filled beside sequences decoding, sequences joining
//!   and leaving between steps, in changing order, at one slot, two and every expert, and
//!   with experts streamed by direct I/O and read ahead (`PILOT`); a forked state continues
//!   as the original would; a truncated state as one that never went further, or the
//!   engine says why it cannot.
//!
//! What one engine alone has (windows, the DSA indexer, MTP drafts, the KDA recurrence) is
//! tested in its own file.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

use crate::common::{self, fixture};
use crate::reference;
use coli::engines::{self, Engine, LoadOptions, Logits, State, Step};
use coli::experts::{ExpertIo, StoreOptions};
use coli::quant::Width;
use coli::sampling::argmax;
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
        let engine = load(c, c.experts);
        engine.routed().telemetry.open_trace(&path).unwrap();
        let mut state = engine.new_state();
        engine
            .forward_one(&mut state, &r.full_ids, Logits::All)
            .unwrap();
        engine.routed().telemetry.flush_trace().unwrap();

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

        let routed = engine.routed();
        let counts = routed.telemetry.counts();
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
        let engine = load(c, 2);
        let vocab = engine.vocab_size();
        let mut state = engine.new_state();
        let whole = engine
            .forward_one(&mut state, &r.full_ids, Logits::All)
            .unwrap();
        assert_eq!(state.position(), r.full_ids.len(), "{}", c.fixture);
        assert_eq!(predictions(&whole, vocab), r.tf_pred, "{}", c.fixture);

        let mut state = engine.new_state();
        let mut single = Vec::new();
        for (position, &token) in r.full_ids.iter().enumerate() {
            assert_eq!(state.position(), position, "{}", c.fixture);
            single.extend(
                engine
                    .forward_one(&mut state, &[token], Logits::All)
                    .unwrap(),
            );
        }
        assert_eq!(predictions(&single, vocab), r.tf_pred, "{}", c.fixture);

        let mut state = engine.new_state();
        let mut uneven = Vec::new();
        let mut start = 0;
        // 35: longer than Kimi K3's prefill chunk of 32.
        for size in [5, 1, 35, 2, 1, 7].iter().cycle() {
            if start == r.full_ids.len() {
                break;
            }
            let end = (start + size).min(r.full_ids.len());
            let chunk = &r.full_ids[start..end];
            uneven.extend(engine.forward_one(&mut state, chunk, Logits::All).unwrap());
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
        let mut state = engine.new_state();
        let prompt = &r.full_ids[..r.prompt_ids.len()];
        let last = engine
            .forward_one(&mut state, prompt, Logits::Last)
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
fn a_new_state_on_a_used_engine_computes_what_a_fresh_engine_does() {
    for c in CASES {
        let r = reference(c.fixture);
        let fresh = load(c, 2);
        let expected = fresh
            .forward_one(&mut fresh.new_state(), &r.full_ids, Logits::All)
            .unwrap();

        // Used first (another prompt, then a few decode steps), then a new state.
        let used = load(c, 2);
        let other: Vec<u32> = r.full_ids.iter().rev().copied().collect();
        let mut state = used.new_state();
        let prompt = r.prompt_ids.len();
        used.forward_one(&mut state, &other[..prompt], Logits::Last)
            .unwrap();
        for &token in &other[prompt..prompt + 3] {
            used.forward_one(&mut state, &[token], Logits::Last)
                .unwrap();
        }
        let mut state = used.new_state();
        assert_eq!(state.position(), 0, "{}", c.fixture);
        let again = used
            .forward_one(&mut state, &r.full_ids, Logits::All)
            .unwrap();
        assert_eq!(bits(&expected), bits(&again), "{}", c.fixture);
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// How one sequence of a batch test is fed: its tokens in chunks (the first a prompt, the
/// rest mostly single tokens), the logits each chunk asks for, and the step it joins at.
struct Feed {
    tokens: Vec<u32>,
    chunks: Vec<(std::ops::Range<usize>, Logits)>,
    join: usize,
}

/// `n` sequences over rotations of `ids`, of different lengths, prompts of different sizes
/// (one longer than Kimi K3's prefill chunk of 32 where the ids allow), joining at steps 0 to
/// 2 and so leaving at different steps.
fn feeds(ids: &[u32], n: usize) -> Vec<Feed> {
    (0..n)
        .map(|i| {
            let mut tokens = ids.to_vec();
            tokens.rotate_left((3 * i) % ids.len());
            tokens.truncate(ids.len() - (i % 4) * 3);
            let prompt = match i % 4 {
                0 => 1,
                1 => 35.min(tokens.len() - 4),
                2 => tokens.len() / 3,
                _ => 5,
            };
            let mut chunks = vec![(
                0..prompt,
                if i % 2 == 0 {
                    Logits::All
                } else {
                    Logits::Last
                },
            )];
            let mut at = prompt;
            while at < tokens.len() {
                // Now and then a few tokens at once (a speculative check's shape).
                let size = if at % 7 == 3 {
                    3.min(tokens.len() - at)
                } else {
                    1
                };
                let logits = if size > 1 || at % 5 == 0 {
                    Logits::All
                } else {
                    Logits::Last
                };
                chunks.push((at..at + size, logits));
                at += size;
            }
            Feed {
                tokens,
                chunks,
                join: i % 3,
            }
        })
        .collect()
}

/// Each feed alone: its chunks one forward each, from a new state.
fn alone(engine: &dyn Engine, feeds: &[Feed]) -> Vec<Vec<Vec<u32>>> {
    feeds
        .iter()
        .map(|feed| {
            let mut state = engine.new_state();
            feed.chunks
                .iter()
                .map(|(range, logits)| {
                    let tokens = &feed.tokens[range.clone()];
                    bits(&engine.forward_one(&mut state, tokens, *logits).unwrap())
                })
                .collect()
        })
        .collect()
}

/// Every feed in one batch a step: each active sequence's next chunk, in an order that
/// changes from step to step.
fn together(engine: &dyn Engine, feeds: &[Feed]) -> Vec<Vec<Vec<u32>>> {
    let n = feeds.len();
    let mut states: Vec<State> = (0..n).map(|_| engine.new_state()).collect();
    let mut out: Vec<Vec<Vec<u32>>> = vec![Vec::new(); n];
    for step in 0usize.. {
        let mut batch: Vec<(usize, usize, Step)> = Vec::new();
        for (i, (state, feed)) in states.iter_mut().zip(feeds).enumerate() {
            let Some(k) = step.checked_sub(feed.join) else {
                continue;
            };
            if let Some((range, logits)) = feed.chunks.get(k) {
                let order = (i * 5 + step * 3) % (n + 1);
                let step = Step::new(state, &feed.tokens[range.clone()], *logits);
                batch.push((order, i, step));
            }
        }
        if batch.is_empty() {
            break;
        }
        batch.sort_by_key(|(order, i, _)| (*order, *i));
        let owners: Vec<usize> = batch.iter().map(|(_, i, _)| *i).collect();
        let mut steps: Vec<Step> = batch.into_iter().map(|(_, _, s)| s).collect();
        let logits = engine.forward(&mut steps).unwrap();
        for (i, logits) in owners.into_iter().zip(logits) {
            out[i].push(bits(&logits));
        }
    }
    out
}

/// The case's engine with experts streamed into `cap` owned slots by direct I/O, the next
/// layer's experts read ahead.
fn load_streamed(c: &Case, cap: usize) -> Box<dyn Engine> {
    let snapshot = Snapshot::open(&fixture(c.fixture)).unwrap();
    let options = LoadOptions {
        draft: Some(0),
        store: StoreOptions {
            io: ExpertIo::Direct,
            pilot: 1,
            transitions: true,
            io_threads: 2,
            ..StoreOptions::mapped(cap, Width::F32)
        },
        ..LoadOptions::exact(cap)
    };
    engines::load(c.engine, &snapshot, options).unwrap()
}

#[test]
fn a_sequence_in_a_batch_computes_the_bits_it_computes_alone() {
    for c in CASES {
        let r = reference(c.fixture);
        let engines = [
            ("1 slot", load(c, 1)),
            ("2 slots", load(c, 2)),
            ("every expert", load(c, c.experts)),
            ("streamed, PILOT=1", load_streamed(c, 2)),
        ];
        for (setting, engine) in &engines {
            for n in [1, 2, 5, 8] {
                let feeds = feeds(&r.full_ids, n);
                let expected = alone(engine.as_ref(), &feeds);
                let batched = together(engine.as_ref(), &feeds);
                for (i, (want, got)) in expected.iter().zip(&batched).enumerate() {
                    assert_eq!(want.len(), got.len(), "{} {setting}", c.fixture);
                    for (k, (w, g)) in want.iter().zip(got).enumerate() {
                        assert!(
                            w == g,
                            "{} ({setting}), {n} sequences: sequence {i}'s chunk {k} differs from its run alone",
                            c.fixture
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_batch_reads_each_expert_once_per_layer() {
    // Two new sequences fed the same token route to the same experts: the store is asked
    // for them once per layer, not once per sequence, and the history counts both rows.
    for c in CASES {
        let r = reference(c.fixture);
        let engine = load(c, c.experts);
        let token = &r.full_ids[..1];
        let before = engine.cache_stats();
        engine
            .forward_one(&mut engine.new_state(), token, Logits::Last)
            .unwrap();
        let alone = engine.cache_stats().since(&before);
        let (mut a, mut b) = (engine.new_state(), engine.new_state());
        let before = engine.cache_stats();
        let mut steps = [
            Step::new(&mut a, token, Logits::Last),
            Step::new(&mut b, token, Logits::Last),
        ];
        engine.forward(&mut steps).unwrap();
        let pair = engine.cache_stats().since(&before);
        let lookups = |s: &coli::experts::CacheStats| s.pin_hits + s.lru_hits + s.misses;
        assert_eq!(
            lookups(&pair),
            lookups(&alone),
            "{}: lookups of a pair routed alike",
            c.fixture
        );
        let routed = engine.routed();
        let selections = routed.telemetry.counts().total();
        let want = 3 * c.moe.len() * c.top_k;
        assert_eq!(
            selections, want as i64,
            "{}: every row is counted",
            c.fixture
        );
    }
}

#[test]
fn a_forked_state_continues_as_the_original_would() {
    for c in CASES {
        let r = reference(c.fixture);
        let engine = load(c, 2);
        let prompt = r.prompt_ids.len();
        let rest = &r.full_ids[prompt..];
        let mut original = engine.new_state();
        engine
            .forward_one(&mut original, &r.full_ids[..prompt], Logits::Last)
            .unwrap();
        let mut fork = original.clone();
        assert_eq!(fork.position(), prompt);
        assert_eq!(fork.size_bytes(), original.size_bytes(), "{}", c.fixture);
        // The fork goes elsewhere first; the original must not notice.
        let mut elsewhere = fork.clone();
        engine
            .forward_one(&mut elsewhere, &rest[..2.min(rest.len())], Logits::All)
            .unwrap();
        let from_fork = engine.forward_one(&mut fork, rest, Logits::All).unwrap();
        let from_original = engine
            .forward_one(&mut original, rest, Logits::All)
            .unwrap();
        assert_eq!(bits(&from_fork), bits(&from_original), "{}", c.fixture);
        assert_eq!(
            predictions(&from_fork, engine.vocab_size()),
            r.tf_pred[prompt..]
        );
        assert!(original.size_bytes() > 0, "{}", c.fixture);
    }
}

#[test]
fn a_truncated_state_computes_what_one_that_never_went_further_does() {
    for c in CASES {
        let r = reference(c.fixture);
        let engine = load(c, 2);
        let cut = r.prompt_ids.len();
        let (head, tail) = r.full_ids.split_at(cut);
        let mut straight = engine.new_state();
        engine
            .forward_one(&mut straight, head, Logits::Last)
            .unwrap();
        let want = engine
            .forward_one(&mut straight, tail, Logits::All)
            .unwrap();

        let mut state = engine.new_state();
        engine.forward_one(&mut state, head, Logits::Last).unwrap();
        engine
            .forward_one(&mut state, &tail[..3], Logits::All)
            .unwrap();
        match state.truncate(cut) {
            Ok(()) => {
                assert!(matches!(c.engine, "olmoe" | "glm_moe_dsa"), "{}", c.fixture);
                assert_eq!(state.position(), cut);
                let got = engine.forward_one(&mut state, tail, Logits::All).unwrap();
                assert_eq!(bits(&want), bits(&got), "{}", c.fixture);
            }
            Err(err) => {
                assert!(
                    matches!(c.engine, "inkling" | "kimi_k3"),
                    "{}: {err}",
                    c.fixture
                );
                let message = err.to_string();
                assert!(
                    message.contains(c.engine) && message.contains("fork"),
                    "{message}"
                );
            }
        }
        // Back to nothing is always exact.
        state.truncate(0).unwrap();
        let again = engine
            .forward_one(&mut state, &r.full_ids, Logits::All)
            .unwrap();
        assert_eq!(
            predictions(&again, engine.vocab_size()),
            r.tf_pred,
            "{}",
            c.fixture
        );
        assert!(state.truncate(state.position() + 1).is_err());
    }
}
