//! GLM-5.2 (`glm_moe_dsa`) against the transformers reference on the committed fixtures
//! (teacher-forced exactness is in `conformance.rs`): greedy, exact, at one slot, two slots
//! and every expert per layer, with its stop tokens and the indexer active; the
//! DSA indexer with every key kept equals dense attention bit for bit and transformers' dense
//! reference; the absorbed decode path equals the plain path; speculative decoding with the
//! MTP head gives the tokens of plain greedy decoding at every draft depth; and the routing
//! telemetry sees every MoE layer and row and no dense layer.

use crate::common;
use crate::common::Conversation;
use crate::{reference, reference_in};

use std::collections::BTreeSet;

use coli::engines::{self, LoadOptions};
use coli::generate::greedy;
use coli::route_trace::{EngineId, ReadOutcome, SaveOptions};
use coli::sampling::argmax;
use coli::snapshot::Snapshot;
use common::{coli, copy_fixture, fixture, fixture_with_config, read_json, stderr, stdout};

struct Fixture {
    name: &'static str,
    layers: usize,
    /// MoE layers (the rest are dense).
    sparse: std::ops::Range<usize>,
    experts: usize,
    top_k: usize,
    index_topk: usize,
    stops: &'static str,
}

const TINY: Fixture = Fixture {
    name: "glm_moe_dsa_tiny",
    layers: 4,
    sparse: 1..4,
    experts: 8,
    top_k: 2,
    index_topk: 8,
    stops: "[stop] 2 stop tokens: 2 5",
};

/// n_group 3, topk_group 2, top-3 of 12, two dense layers, legacy config keys.
const GROUPED: Fixture = Fixture {
    name: "glm_moe_dsa_tiny_b",
    layers: 5,
    sparse: 2..5,
    experts: 12,
    top_k: 3,
    index_topk: 8,
    stops: "[stop] 2 stop tokens: 3 7",
};

/// Carries the MTP layer (index 4) the generator adds.
const MTP: Fixture = Fixture {
    name: "glm_moe_dsa_tiny_mtp",
    layers: 4,
    sparse: 1..4,
    experts: 8,
    top_k: 2,
    index_topk: 8,
    stops: "[stop] 2 stop tokens: 2 5",
};

const FIXTURES: [&Fixture; 3] = [&TINY, &GROUPED, &MTP];

fn load_from(
    snapshot: &Snapshot,
    cap: usize,
    draft: Option<usize>,
    dsa_force: bool,
) -> Conversation {
    let options = LoadOptions {
        draft,
        dsa_force,
        ..LoadOptions::exact(cap)
    };
    Conversation::new(engines::load("glm_moe_dsa", snapshot, options).unwrap())
}

fn load(name: &str, cap: usize, draft: Option<usize>, dsa_force: bool) -> Conversation {
    load_from(
        &Snapshot::open(&fixture(name)).unwrap(),
        cap,
        draft,
        dsa_force,
    )
}

fn run(args: &[&str]) -> (bool, String, String) {
    let out = coli(args, &[]);
    (out.status.success(), stdout(&out), stderr(&out))
}

#[test]
fn greedy_is_exact_at_every_cache_size() {
    for f in FIXTURES {
        let r = reference(f.name);
        let generated = r.full_ids.len() - r.prompt_ids.len();
        let snap = format!("SNAP={}", fixture(f.name).display());
        for cap in [1, 2, f.experts] {
            let cap = cap.to_string();
            let (ok, out, err) = run(&[&snap, "ORACLE_STRICT=1", &cap, "16", "16"]);
            assert!(ok, "{} cap {cap}: {out}{err}", f.name);
            assert!(
                out.contains(&format!("Matching tokens: {generated}/{generated}")),
                "{} cap {cap}: {out}",
                f.name
            );
            assert!(err.contains(f.stops), "{}: {err}", f.name);
            assert!(
                err.contains(&format!(
                    "[DSA] indexer active: top-{} sparse attention",
                    f.index_topk
                )),
                "{err}"
            );
        }
    }
}

#[test]
fn the_indexer_selects_on_the_fixtures() {
    for f in FIXTURES {
        let r = reference(f.name);
        assert!(r.full_ids.len() >= 4 * f.index_topk, "{}", f.name);
        assert!(r.json["selecting_rows"].as_u64().unwrap() > 0, "{}", f.name);
        // Dense attention (every key kept) predicts differently: the selection matters.
        let dense = reference_in(f.name, "ref_dense.json");
        assert_ne!(dense.tf_pred, r.tf_pred, "{}", f.name);
    }
}

#[test]
fn dsa_force_matches_the_dense_reference() {
    for f in FIXTURES {
        let n = reference(f.name).full_ids.len();
        let snap = format!("SNAP={}", fixture(f.name).display());
        let dense = format!("REF={}", fixture(f.name).join("ref_dense.json").display());
        let (ok, out, err) = run(&[
            &snap,
            &dense,
            "DSA_FORCE=1",
            "TF=1",
            "ORACLE_STRICT=1",
            "2",
            "16",
            "16",
        ]);
        assert!(ok, "{}: {out}{err}", f.name);
        assert!(
            out.contains(&format!("vs oracle: {n}/{n} positions")),
            "{out}"
        );
        assert!(err.contains("DSA_FORCE=1"), "{err}");
        // Without it the indexer drops keys, and the dense reference no longer matches.
        let (ok, out, _) = run(&[&snap, &dense, "TF=1", "ORACLE_STRICT=1", "2", "16", "16"]);
        assert!(
            !ok && !out.contains(&format!("vs oracle: {n}/{n} positions")),
            "{out}"
        );
    }
}

/// A copy of the fixture whose indexer keeps more keys than any sequence has: dense MLA.
fn without_selection(name: &str) -> tempfile::TempDir {
    fixture_with_config(name, |config| config["index_topk"] = 1_000_000.into())
}

#[test]
fn dsa_force_is_dense_attention_bit_for_bit() {
    for f in FIXTURES {
        let r = reference(f.name);
        let dense_dir = without_selection(f.name);
        let mut dense = load_from(
            &Snapshot::open(dense_dir.path()).unwrap(),
            f.experts,
            Some(0),
            false,
        );
        let mut forced = load(f.name, f.experts, Some(0), true);
        // Prefill (plain path) over everything, then decode steps (absorbed path).
        let split = r.prompt_ids.len();
        assert_eq!(
            dense.forward(&r.full_ids[..split], true).unwrap(),
            forced.forward(&r.full_ids[..split], true).unwrap(),
            "{}",
            f.name
        );
        for &token in &r.full_ids[split..] {
            assert_eq!(
                dense.forward(&[token], false).unwrap(),
                forced.forward(&[token], false).unwrap(),
                "{}",
                f.name
            );
        }
        // Within index_topk nothing is dropped, so the unforced engine reads every key too.
        let mut plain = load(f.name, f.experts, Some(0), false);
        let mut forced = load(f.name, f.experts, Some(0), true);
        let short = &r.full_ids[..f.index_topk];
        assert_eq!(
            plain.forward(short, true).unwrap(),
            forced.forward(short, true).unwrap()
        );
    }
}

#[test]
fn absorbed_decode_equals_the_plain_path() {
    for f in FIXTURES {
        let r = reference(f.name);
        let mut engine = load(f.name, f.experts, Some(0), false);
        let vocab = engine.vocab_size();
        // One forward from position 0 expands the latent cache (plain path).
        let plain = engine.forward(&r.full_ids, true).unwrap();
        // The first token alone, then one token at a time: every later step is absorbed.
        engine.reset();
        let mut absorbed = Vec::with_capacity(plain.len());
        for &token in &r.full_ids {
            absorbed.extend(engine.forward(&[token], true).unwrap());
        }
        let worst = plain
            .iter()
            .zip(&absorbed)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 1e-4,
            "{}: plain and absorbed logits differ by {worst}",
            f.name
        );
        let plain_pred: Vec<u32> = plain.chunks_exact(vocab).map(argmax).collect();
        let absorbed_pred: Vec<u32> = absorbed.chunks_exact(vocab).map(argmax).collect();
        assert_eq!(plain_pred, r.tf_pred, "{}", f.name);
        assert_eq!(absorbed_pred, r.tf_pred, "{}", f.name);
    }
}

#[test]
fn drafting_gives_the_tokens_of_plain_greedy() {
    let r = reference(MTP.name);
    let generated = r.full_ids.len() - r.prompt_ids.len();
    let snap = format!("SNAP={}", fixture(MTP.name).display());
    for cap in [1, MTP.experts] {
        let cap = cap.to_string();
        for depth in 0..=3 {
            let draft = format!("DRAFT={depth}");
            let (ok, out, err) = run(&[&snap, &draft, "ORACLE_STRICT=1", &cap, "16", "16"]);
            assert!(ok, "DRAFT={depth} cap {cap}: {out}{err}");
            assert!(
                out.contains(&format!("Matching tokens: {generated}/{generated}")),
                "{out}"
            );
            let line = out.lines().find(|l| l.starts_with("speculation"));
            match depth {
                0 => assert!(
                    line.is_none() && err.contains("[MTP] present, drafting off"),
                    "{out}{err}"
                ),
                d => {
                    let line = line.unwrap_or_else(|| panic!("no speculation line: {out}"));
                    assert!(
                        line.starts_with(&format!("speculation (DRAFT={d}): ")),
                        "{line}"
                    );
                    assert!(
                        err.contains(&format!(
                            "[MTP] active: native speculative decoding (draft={d})"
                        )),
                        "{err}"
                    );
                }
            }
        }
    }
    // The default depth is 1 with an MTP head, 0 without one.
    let (_, out, _) = run(&[&snap, "2", "16", "16"]);
    assert!(out.contains("speculation (DRAFT=1)"), "{out}");
    let plain = format!("SNAP={}", fixture(TINY.name).display());
    let (_, out, err) = run(&[&plain, "DRAFT=2", "2", "16", "16"]);
    assert!(
        !out.contains("speculation") && err.contains("[MTP] absent"),
        "{out}{err}"
    );
}

#[test]
fn depth_one_drafts_are_the_reference_mtp_predictions() {
    // The generator runs the MTP head in PyTorch along the reference sequence and replays the
    // depth-1 loop; with unambiguous margins the counts must agree exactly.
    let r = reference(MTP.name);
    let mtp = &r.json["mtp"];
    assert!(
        mtp["exact"].as_bool().unwrap(),
        "the fixture's MTP margins are not asserted"
    );
    let want = &mtp["draft1"];
    let field = |key: &str| want[key].as_u64().unwrap() as usize;
    let engine = load(MTP.name, MTP.experts, Some(1), false);
    let generated = r.full_ids.len() - r.prompt_ids.len();
    let generation = greedy(engine.engine.as_ref(), &r.prompt_ids, generated).unwrap();
    assert_eq!(generation.tokens, r.full_ids[r.prompt_ids.len()..]);
    let stats = generation.speculation.unwrap();
    assert_eq!(
        (stats.forwards, stats.drafted, stats.accepted),
        (field("forwards"), field("drafted"), field("accepted"))
    );
    assert!(
        stats.accepted > 0 && stats.accepted < stats.drafted,
        "{stats:?}"
    );
}

#[test]
fn drafting_is_lossless_beyond_the_reference() {
    // Past the reference nothing guarantees margins, so this holds only because verifying
    // drafts computes bit for bit what one-token steps compute.
    let r = reference(MTP.name);
    let baseline = load(MTP.name, 2, Some(0), false);
    let want = greedy(baseline.engine.as_ref(), &r.prompt_ids, 64)
        .unwrap()
        .tokens;
    for depth in 1..=3 {
        let engine = load(MTP.name, 2, Some(depth), false);
        let got = greedy(engine.engine.as_ref(), &r.prompt_ids, 64).unwrap();
        assert_eq!(got.tokens, want, "DRAFT={depth}");
        assert!(
            got.speculation.unwrap().forwards < 63,
            "DRAFT={depth} accepted nothing"
        );
    }
}

/// One round of speculative greedy decoding for each sequence of `states`: its draft head
/// proposes up to `depth` tokens after its last token, one forward checks every sequence's
/// drafts (`together`: all in one batch; else one forward each), each keeps the drafts its
/// logits confirm and one more token, and drops the rest. Returns each check's logits.
fn draft_round(
    engine: &dyn engines::Engine,
    states: &mut [engines::State],
    tokens: &mut [Vec<u32>],
    depth: usize,
    together: bool,
) -> Vec<Vec<f32>> {
    let vocab = engine.vocab_size();
    let feeds: Vec<Vec<u32>> = states
        .iter_mut()
        .zip(tokens.iter())
        .map(|(state, tokens)| {
            let next = *tokens.last().unwrap();
            let mut feed = vec![next];
            feed.extend(engine.propose(state, next, depth).unwrap());
            feed
        })
        .collect();
    let starts: Vec<usize> = states.iter().map(|s| s.position()).collect();
    let logits: Vec<Vec<f32>> = if together {
        let mut steps: Vec<engines::Step> = states
            .iter_mut()
            .zip(&feeds)
            .map(|(state, feed)| engines::Step::new(state, feed, engines::Logits::All))
            .collect();
        engine.forward(&mut steps).unwrap()
    } else {
        states
            .iter_mut()
            .zip(&feeds)
            .map(|(state, feed)| {
                engine
                    .forward_one(state, feed, engines::Logits::All)
                    .unwrap()
            })
            .collect()
    };
    for (i, rows) in logits.iter().enumerate() {
        let drafts = &feeds[i][1..];
        let mut kept = 0;
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            let token = argmax(row);
            tokens[i].push(token);
            if drafts.get(j) != Some(&token) {
                break;
            }
            kept += 1;
        }
        if kept < drafts.len() {
            states[i].truncate(starts[i] + kept + 1).unwrap();
        }
    }
    logits
}

#[test]
fn drafting_sequences_in_one_batch_compute_what_each_computes_alone() {
    // Sequences at different positions each propose and check their own drafts; checked
    // together, every check's logits are those of the sequence alone, and every sequence
    // decodes the tokens of plain greedy decoding.
    let r = reference(MTP.name);
    let baseline = load(MTP.name, 2, Some(0), false);
    let prompts: Vec<Vec<u32>> = (0..3)
        .map(|i| {
            let mut ids = r.prompt_ids.clone();
            ids.rotate_left(i);
            ids.truncate(r.prompt_ids.len() - i);
            ids
        })
        .collect();
    for depth in [1, 2] {
        let engine = load(MTP.name, 2, Some(depth), false);
        let engine = engine.engine.as_ref();
        let start = |prompt: &Vec<u32>| {
            let mut state = engine.new_state();
            let logits = engine
                .forward_one(&mut state, prompt, engines::Logits::Last)
                .unwrap();
            (state, vec![argmax(&logits)])
        };
        let (mut alone, mut alone_tokens): (Vec<_>, Vec<_>) = prompts.iter().map(start).unzip();
        let (mut batch, mut batch_tokens): (Vec<_>, Vec<_>) = prompts.iter().map(start).unzip();
        for round in 0..12 {
            let want = draft_round(engine, &mut alone, &mut alone_tokens, depth, false);
            let got = draft_round(engine, &mut batch, &mut batch_tokens, depth, true);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert!(
                    bits(w) == bits(g),
                    "DRAFT={depth}, round {round}: sequence {i}'s check differs in a batch"
                );
            }
        }
        assert_eq!(alone_tokens, batch_tokens, "DRAFT={depth}");
        for (prompt, tokens) in prompts.iter().zip(&batch_tokens) {
            let plain = greedy(baseline.engine.as_ref(), prompt, tokens.len()).unwrap();
            assert_eq!(&plain.tokens, tokens, "DRAFT={depth}");
        }
    }
}

#[test]
fn truncation_keeps_what_the_draft_head_paired() {
    let r = reference(MTP.name);
    let mut engine = load(MTP.name, 2, Some(1), false);
    engine.forward(&r.full_ids[..10], false).unwrap();
    // The draft head pairs position 9 with the token that follows it.
    let next = r.full_ids[10];
    let drafts = engine.engine.propose(&mut engine.state, next, 1).unwrap();
    assert_eq!(drafts.len(), 1);
    engine.forward(&[next, drafts[0]], true).unwrap();
    let message = engine.state.truncate(10).unwrap_err().to_string();
    assert!(message.contains("draft head"), "{message}");
    assert!(
        engine.state.truncate(13).is_err(),
        "more positions than cached"
    );
    engine.state.truncate(11).unwrap();
    assert_eq!(engine.position(), 11);
    // The cache continues as if only 11 tokens had been fed.
    let logits = engine.forward(&r.full_ids[11..], true).unwrap();
    let vocab = engine.vocab_size();
    let pred: Vec<u32> = logits.chunks_exact(vocab).map(argmax).collect();
    assert_eq!(pred, r.tf_pred[11..]);
}

#[test]
fn route_trace_covers_every_moe_layer_and_no_dense_one() {
    for f in FIXTURES {
        let r = reference(f.name);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.txt");
        let mut engine = load(f.name, f.experts, Some(0), false);
        engine.engine.routed().telemetry.open_trace(&path).unwrap();
        engine.forward(&r.full_ids, true).unwrap();
        engine.engine.routed().telemetry.flush_trace().unwrap();

        let text = std::fs::read_to_string(&path).unwrap();
        let mut seen = BTreeSet::new();
        for line in text.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (row, layer): (usize, usize) =
                (fields[1].parse().unwrap(), fields[2].parse().unwrap());
            assert!(seen.insert((layer, row)), "{line} twice");
            assert_eq!(fields.len() - 3, f.top_k, "{line}");
            for choice in &fields[3..] {
                let (id, gate) = choice.split_once(':').unwrap();
                assert!(id.parse::<usize>().unwrap() < f.experts, "{line}");
                assert!(gate.parse::<f32>().unwrap() > 0.0, "{line}");
            }
        }
        let want: BTreeSet<(usize, usize)> = f
            .sparse
            .clone()
            .flat_map(|l| (0..r.full_ids.len()).map(move |row| (l, row)))
            .collect();
        assert_eq!(seen, want, "{}", f.name);

        let routed = engine.engine.routed();
        let counts = routed.telemetry.counts();
        for l in 0..f.layers {
            assert_eq!(
                counts.routes(l),
                f.sparse.contains(&l),
                "{} layer {l}",
                f.name
            );
        }
        // The row after the last layer is the MTP head's: kept only when it exists.
        assert_eq!(counts.routes(f.layers), f.name == MTP.name, "{}", f.name);
        assert_eq!(
            counts.total(),
            (f.sparse.len() * r.full_ids.len() * f.top_k) as i64
        );
    }
}

#[test]
fn the_mtp_head_routes_on_its_own_row() {
    let r = reference(MTP.name);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.txt");
    let engine = load(MTP.name, MTP.experts, Some(1), false);
    engine.engine.routed().telemetry.open_trace(&path).unwrap();
    greedy(engine.engine.as_ref(), &r.prompt_ids, 4).unwrap();
    engine.engine.routed().telemetry.flush_trace().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let mtp_lines = text
        .lines()
        .filter(|l| l.split_whitespace().nth(2) == Some("4"))
        .count();
    assert!(mtp_lines >= r.prompt_ids.len(), "{text}");
    assert!(
        !text
            .lines()
            .any(|l| l.split_whitespace().nth(2) == Some("0")),
        "dense layer 0 routed"
    );
}

#[test]
fn history_round_trips_with_the_engine_identity() {
    for f in [&TINY, &MTP] {
        let r = reference(f.name);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".coli_usage");
        let mut engine = load(f.name, f.experts, Some(0), false);
        assert_eq!(
            engine.engine.routed().telemetry.engine_id(),
            EngineId::of("glm_moe_dsa")
        );
        engine.forward(&r.full_ids, true).unwrap();
        let total = engine.engine.routed().telemetry.counts().total();
        engine
            .engine
            .routed()
            .telemetry
            .save_history(&path, SaveOptions::default())
            .unwrap();

        let again = load(f.name, f.experts, Some(0), false);
        let outcome = again.engine.routed().telemetry.load_history(&path, None);
        assert!(matches!(outcome, ReadOutcome::Read(_)), "{outcome:?}");
        assert_eq!(outcome.total(), total);
        let (before, after) = (
            engine.engine.routed().telemetry.counts().clone(),
            again.engine.routed().telemetry.counts().clone(),
        );
        for l in 0..=f.layers {
            for e in 0..f.experts {
                assert_eq!(
                    before.get(l, e),
                    after.get(l, e),
                    "{} layer {l} expert {e}",
                    f.name
                );
            }
        }
        // An OLMoE engine refuses a glm_moe_dsa history.
        let olmoe = engines::load(
            "olmoe",
            &Snapshot::open(&fixture("olmoe_tiny")).unwrap(),
            LoadOptions::exact(8),
        )
        .unwrap();
        assert!(matches!(
            olmoe.routed().telemetry.load_history(&path, None),
            ReadOutcome::Refused(_)
        ));
    }
}

#[test]
fn config_problems_are_named() {
    let dir = copy_fixture(TINY.name);
    let path = dir.path().join("config.json");
    let original = read_json(&path);
    let snap = format!("SNAP={}", dir.path().display());
    let edit = |change: &dyn Fn(&mut serde_json::Value)| {
        let mut config = original.clone();
        change(&mut config);
        std::fs::write(&path, config.to_string()).unwrap();
    };
    let refuse = |want: &str| {
        let out = coli(&[&snap, "2", "16", "16"], &[]);
        assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
        assert!(stderr(&out).contains(want), "{}", stderr(&out));
    };
    edit(&|c| c["rope_parameters"]["rope_type"] = "yarn".into());
    refuse("rope_type \"yarn\" is not supported by glm_moe_dsa");
    edit(&|c| c["indexer_types"] = serde_json::json!(["shared", "full", "full", "full"]));
    refuse("layer 0 is a \"shared\" indexer layer");
    edit(&|c| c["n_group"] = 3.into());
    refuse("n_routed_experts (8) must be a positive multiple of n_group (3)");
    edit(&|c| c["eos_token_id"] = "two".into());
    refuse("eos_token_id must be a token id or a list of token ids");
    edit(&|c| c["kv_lora_rank"] = 16.into());
    refuse("self_attn.kv_a_proj_with_mqa.weight has shape [40, 64], expected [24, 64]");
}
