//! A state written to bytes and read back into a fresh state of the same engine continues
//! bit for bit as the original, on every fixture (windows that forgot positions, recurrent
//! KDA states, short convolutions, DSA index keys, the MTP head's draft window); a state of
//! another shape, and every cut or corrupt byte stream, is refused with what did not match,
//! never a panic.

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::common::fixture;
use crate::reference;
use coli::engines::{self, Engine, LoadOptions, Logits, State};
use coli::sampling::argmax;
use coli::snapshot::Snapshot;

const FIXTURES: &[(&str, &str)] = &[
    ("olmoe", "olmoe_tiny"),
    ("olmoe", "olmoe_tiny_b"),
    ("olmoe", "olmoe_trained"),
    ("glm_moe_dsa", "glm_moe_dsa_tiny"),
    ("glm_moe_dsa", "glm_moe_dsa_tiny_b"),
    ("glm_moe_dsa", "glm_moe_dsa_tiny_mtp"),
    ("inkling", "inkling_tiny"),
    ("inkling", "inkling_tiny_b"),
    ("kimi_k3", "kimi_k3_tiny"),
    ("kimi_k3", "kimi_k3_tiny_b"),
];

/// Fixture `name` as `engine` in f32, two slots a layer, drafting `draft` deep.
fn load(engine: &str, name: &str, draft: usize) -> Box<dyn Engine> {
    let snapshot = Snapshot::open(&fixture(name)).unwrap();
    let options = LoadOptions {
        draft: Some(draft),
        ..LoadOptions::exact(2)
    };
    engines::load(engine, &snapshot, options).unwrap()
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

fn saved(state: &State) -> Vec<u8> {
    let mut bytes = Vec::new();
    state.save(&mut bytes).unwrap();
    bytes
}

/// `bytes` read into a fresh state of `engine`.
fn restored(engine: &dyn Engine, bytes: &[u8]) -> anyhow::Result<State> {
    let mut state = engine.new_state();
    state.restore(&mut &bytes[..])?;
    Ok(state)
}

/// A state of `engine` fed the reference's prompt in one forward, then `singles` more of its
/// tokens one at a time (enough for Inkling's window to forget positions); the ids fed and
/// the last logits.
fn fed(
    engine: &dyn Engine,
    ids: &[u32],
    prompt: usize,
    singles: usize,
) -> (State, usize, Vec<f32>) {
    let mut state = engine.new_state();
    let mut logits = engine
        .forward_one(&mut state, &ids[..prompt], Logits::Last)
        .unwrap();
    let end = (prompt + singles).min(ids.len() - 1);
    for &token in &ids[prompt..end] {
        logits = engine
            .forward_one(&mut state, &[token], Logits::Last)
            .unwrap();
    }
    (state, end, logits)
}

#[test]
fn a_restored_state_continues_bit_for_bit() {
    for &(name, fixture) in FIXTURES {
        let r = reference(fixture);
        let engine = load(name, fixture, 0);
        let (mut original, fed_to, _) = fed(engine.as_ref(), &r.full_ids, r.prompt_ids.len(), 10);
        let bytes = saved(&original);
        let mut back = restored(engine.as_ref(), &bytes).unwrap();
        assert_eq!(back.position(), original.position(), "{fixture}");
        assert_eq!(back.size_bytes(), original.size_bytes(), "{fixture}");
        assert_eq!(saved(&back), bytes, "{fixture}: saved again");
        let rest = &r.full_ids[fed_to..];
        let want = engine
            .forward_one(&mut original, rest, Logits::All)
            .unwrap();
        let got = engine.forward_one(&mut back, rest, Logits::All).unwrap();
        assert_eq!(bits(&got), bits(&want), "{fixture}");
    }
}

#[test]
fn a_restored_draft_window_drafts_and_continues_as_the_original() {
    let r = reference("glm_moe_dsa_tiny_mtp");
    let engine = load("glm_moe_dsa", "glm_moe_dsa_tiny_mtp", 3);
    let (mut original, fed_to, logits) = fed(engine.as_ref(), &r.full_ids, r.prompt_ids.len(), 2);
    let next = argmax(&logits);
    // The drafts leave paired positions, chained rows and no pending states in the window.
    let drafts = engine.propose(&mut original, next, 3).unwrap();
    let mut check = vec![next];
    check.extend(&drafts);
    let bytes = saved(&original);
    let mut back = restored(engine.as_ref(), &bytes).unwrap();
    assert_eq!(back.size_bytes(), original.size_bytes());
    let want = engine
        .forward_one(&mut original, &check, Logits::All)
        .unwrap();
    // Now states wait for the MTP head: saved here, they must draft alike.
    let mut again = restored(engine.as_ref(), &saved(&original)).unwrap();
    let got = engine.forward_one(&mut back, &check, Logits::All).unwrap();
    assert_eq!(bits(&got), bits(&want));
    let next = argmax(&want[want.len() - engine.vocab_size()..]);
    let from_original = engine.propose(&mut original, next, 3).unwrap();
    assert_eq!(engine.propose(&mut back, next, 3).unwrap(), from_original);
    assert_eq!(engine.propose(&mut again, next, 3).unwrap(), from_original);
    let step = [r.full_ids[fed_to]];
    assert_eq!(
        bits(&engine.forward_one(&mut again, &step, Logits::Last).unwrap()),
        bits(
            &engine
                .forward_one(&mut original, &step, Logits::Last)
                .unwrap()
        )
    );
}

#[test]
fn a_state_of_another_shape_is_refused_naming_what_differs() {
    let ids = reference("olmoe_tiny").full_ids;
    let tiny = load("olmoe", "olmoe_tiny", 0);
    let (state, _, _) = fed(tiny.as_ref(), &ids, 4, 0);
    let bytes = saved(&state);
    let refusal =
        |engine: &dyn Engine, bytes: &[u8]| restored(engine, bytes).err().unwrap().to_string();

    let b = load("olmoe", "olmoe_tiny_b", 0);
    assert_eq!(
        refusal(b.as_ref(), &bytes),
        "cannot restore a saved olmoe state: layers: the saved state has 3, this model's has 4"
    );
    let kimi = load("kimi_k3", "kimi_k3_tiny", 0);
    assert_eq!(
        refusal(kimi.as_ref(), &bytes),
        "a saved olmoe state cannot be restored into a kimi_k3 state"
    );
    let inkling = load("inkling", "inkling_tiny", 0);
    let other = saved(&fed(inkling.as_ref(), &reference("inkling_tiny").full_ids, 4, 0).0);
    let b = load("inkling", "inkling_tiny_b", 0);
    let message = refusal(b.as_ref(), &other);
    assert!(message.starts_with("cannot restore a saved inkling state: layers: the saved state has 7, this model's has 6"), "{message}");

    // The draft head's window does not fit an engine that does not draft, nor the reverse.
    let glm = |draft| load("glm_moe_dsa", "glm_moe_dsa_tiny_mtp", draft);
    let ids = reference("glm_moe_dsa_tiny_mtp").full_ids;
    let drafting = saved(&fed(glm(2).as_ref(), &ids, 4, 0).0);
    let message = refusal(glm(0).as_ref(), &drafting);
    assert_eq!(
        message,
        "cannot restore a saved glm_moe_dsa state: MTP head: the saved state has drafting with 64-wide hidden states, this model's has drafting off"
    );
    let plain = saved(&fed(glm(0).as_ref(), &ids, 4, 0).0);
    assert!(refusal(glm(2).as_ref(), &plain).contains("MTP head"));
    let message = refusal(
        load("glm_moe_dsa", "glm_moe_dsa_tiny_b", 0).as_ref(),
        &plain,
    );
    assert!(
        message.contains("layers: the saved state has 4, this model's has 5"),
        "{message}"
    );
}

/// A small state of every engine (a few positions), and the engine.
fn small_states() -> Vec<(Box<dyn Engine>, Vec<u8>)> {
    [
        ("olmoe", "olmoe_tiny", 0),
        ("glm_moe_dsa", "glm_moe_dsa_tiny_mtp", 2),
        ("inkling", "inkling_tiny", 0),
        ("kimi_k3", "kimi_k3_tiny", 0),
    ]
    .into_iter()
    .map(|(name, fixture, draft)| {
        let engine = load(name, fixture, draft);
        let ids = reference(fixture).full_ids;
        let (mut state, fed_to, logits) = fed(engine.as_ref(), &ids, 3, 0);
        if draft > 0 {
            engine.propose(&mut state, argmax(&logits), draft).unwrap();
            engine
                .forward_one(&mut state, &ids[fed_to..fed_to + 1], Logits::Last)
                .unwrap();
        }
        let bytes = saved(&state);
        (engine, bytes)
    })
    .collect()
}

#[test]
fn every_cut_of_a_saved_state_is_refused_and_leaves_the_state_alone() {
    for (engine, bytes) in small_states() {
        assert!(restored(engine.as_ref(), &bytes).is_ok());
        for cut in 0..bytes.len() {
            let mut state = engine.new_state();
            let err = state.restore(&mut &bytes[..cut]).unwrap_err();
            let message = err.to_string();
            assert!(message.contains(engine.name()), "{message}");
            assert!(message.contains("ends inside"), "cut at {cut}: {message}");
            assert_eq!(state.position(), 0);
            assert_eq!(state.size_bytes(), engine.new_state().size_bytes());
        }
    }
}

#[test]
fn a_corrupt_saved_state_is_refused_or_runs_but_never_panics() {
    let states = small_states();
    let mut runner = TestRunner::new(Config::with_cases(1024));
    let flips = (0..states.len(), any::<prop::sample::Index>(), 1..=255u8);
    runner
        .run(&flips, |(which, at, xor)| {
            let (engine, bytes) = &states[which];
            let mut bytes = bytes.clone();
            let at = at.index(bytes.len());
            bytes[at] ^= xor;
            match restored(engine.as_ref(), &bytes) {
                Ok(mut state) => {
                    // A flipped value, not a length: the state is whole and a forward runs.
                    let _ = engine.forward_one(&mut state, &[1], Logits::Last);
                }
                Err(err) => {
                    prop_assert!(err.to_string().contains(engine.name()), "byte {at}: {err}")
                }
            }
            Ok(())
        })
        .unwrap();
}
