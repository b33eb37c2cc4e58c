//! The kept conversation states of `--kv-dir` (`coli::serve::kv_dir`), through the library:
//! a state saved before a restart is found by prefix and continues bit for bit; a file of
//! another model, width or format version, or a truncated or damaged one, is refused naming
//! it and left on disk as it was; the byte limit removes the least recently used of this
//! model's files and nothing else.

use std::fs;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

use crate::common::{fixture, fixture_with_config};
use coli::engines::{self, Engine, LoadOptions, Logits, State};
use coli::quant::Width;
use coli::serve::kv_dir::{KvDir, KvIdentity, Saved};
use coli::snapshot::Snapshot;

/// Engine `name` on the model in `dir`, in f32, and its identity at those widths.
fn load(name: &str, dir: &Path) -> (Box<dyn Engine>, KvIdentity) {
    let snapshot = Snapshot::open(dir).unwrap();
    let engine = engines::load(name, &snapshot, LoadOptions::exact(2)).unwrap();
    let identity = KvIdentity::of(&snapshot, name, Width::F32, Width::F32).unwrap();
    (engine, identity)
}

fn olmoe() -> (Box<dyn Engine>, KvIdentity) {
    load("olmoe", &fixture("olmoe_tiny"))
}

/// A state of `engine` fed `tokens`.
fn fed(engine: &dyn Engine, tokens: &[u32]) -> State {
    let mut state = engine.new_state();
    engine
        .forward_one(&mut state, tokens, Logits::Last)
        .unwrap();
    state
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// The path of a file `save` wrote.
fn written(saved: Saved) -> PathBuf {
    match saved {
        Saved::Written { path, .. } => path,
        other => panic!("not written: {other:?}"),
    }
}

/// The names in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

const PROMPT: [u32; 6] = [3, 14, 15, 92, 65, 35];

#[test]
fn a_state_saved_before_a_restart_is_found_by_prefix_and_continues_bit_for_bit() {
    for (name, fixture_name) in [("olmoe", "olmoe_tiny"), ("kimi_k3", "kimi_k3_tiny")] {
        let dir = tempfile::tempdir().unwrap();
        let kv = dir.path().join("kv");
        let (engine, identity) = load(name, &fixture(fixture_name));
        let mut original = fed(engine.as_ref(), &PROMPT);
        {
            let (mut kept, notes) = KvDir::open(&kv, 1 << 30, identity.clone()).unwrap();
            assert!(notes.is_empty(), "{notes:?}");
            let path = written(kept.save(&PROMPT, &original).unwrap());
            // The same tokens replace their own file.
            assert_eq!(written(kept.save(&PROMPT, &original).unwrap()), path);
            assert_eq!(kept.entries(), 1);
            assert_eq!(kept.bytes(), fs::metadata(&path).unwrap().len());
        }

        let (mut kept, notes) = KvDir::open(&kv, 1 << 30, identity).unwrap();
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(kept.entries(), 1);
        let mut prompt = PROMPT.to_vec();
        prompt.extend([89, 79, 32]);
        assert_eq!(kept.best(&prompt), Some((0, PROMPT.len())));
        assert_eq!(kept.best(&PROMPT[..2]), Some((0, 2)));
        assert_eq!(kept.best(&[7, 7]), None);
        let (tokens, mut state) = kept.load(0, engine.as_ref()).unwrap();
        assert_eq!(tokens, PROMPT);
        assert_eq!(state.position(), PROMPT.len());
        let rest = &prompt[PROMPT.len()..];
        let want = engine
            .forward_one(&mut original, rest, Logits::All)
            .unwrap();
        let got = engine.forward_one(&mut state, rest, Logits::All).unwrap();
        assert_eq!(bits(&got), bits(&want), "{fixture_name}");
        assert_eq!(listing(&kv).len(), 1, "{:?}", listing(&kv));
    }
}

#[test]
fn the_longest_prefix_wins_and_then_a_state_the_prompt_continues_whole() {
    let dir = tempfile::tempdir().unwrap();
    let (engine, identity) = olmoe();
    let (mut kept, _) = KvDir::open(dir.path(), 1 << 30, identity).unwrap();
    kept.save(&PROMPT[..2], &fed(engine.as_ref(), &PROMPT[..2]))
        .unwrap();
    let diverging = [3, 14, 15, 1, 1];
    kept.save(&diverging, &fed(engine.as_ref(), &diverging))
        .unwrap();
    kept.save(&PROMPT[..3], &fed(engine.as_ref(), &PROMPT[..3]))
        .unwrap();
    let (entry, common) = kept.best(&PROMPT).unwrap();
    assert_eq!(common, 3);
    assert_eq!(kept.load(entry, engine.as_ref()).unwrap().0, &PROMPT[..3]);
    let (entry, common) = kept.best(&[3, 14, 99]).unwrap();
    assert_eq!(common, 2);
    assert_eq!(kept.load(entry, engine.as_ref()).unwrap().0, &PROMPT[..2]);
}

/// `dir`'s files and their bytes and modification times.
fn snapshot_of(dir: &Path) -> Vec<(String, Vec<u8>, std::time::SystemTime)> {
    listing(dir)
        .into_iter()
        .map(|name| {
            let path = dir.join(&name);
            let modified = fs::metadata(&path).unwrap().modified().unwrap();
            (name, fs::read(&path).unwrap(), modified)
        })
        .collect()
}

#[test]
fn a_file_of_another_model_is_refused_by_name_and_left_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path();
    let (engine, identity) = olmoe();
    let (mut kept, _) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    let path = written(kept.save(&PROMPT, &fed(engine.as_ref(), &PROMPT)).unwrap());
    let file = path.display().to_string();
    let before = snapshot_of(kv);

    let (kimi, kimi_identity) = load("kimi_k3", &fixture("kimi_k3_tiny"));
    let (mut other, notes) = KvDir::open(kv, 1 << 30, kimi_identity).unwrap();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with(&format!("{file}: not used (")),
        "{}",
        notes[0]
    );
    assert!(
        notes[0].contains("belongs to engine olmoe, not kimi_k3"),
        "{}",
        notes[0]
    );
    assert!(notes[0].ends_with("left as it is"), "{}", notes[0]);
    assert_eq!(
        (other.entries(), other.bytes(), other.best(&PROMPT)),
        (0, 0, None)
    );
    // Its own states go beside, under names of their own, and count alone.
    let theirs = written(other.save(&PROMPT, &fed(kimi.as_ref(), &PROMPT)).unwrap());
    assert_eq!(other.entries(), 1);
    assert_eq!(listing(kv).len(), 2);
    fs::remove_file(theirs).unwrap();
    assert_eq!(snapshot_of(kv), before);

    let changed = fixture_with_config("olmoe_tiny", |c| c["unused_key"] = 1.into());
    let (_, changed) = load("olmoe", changed.path());
    let (changed_dir, notes) = KvDir::open(kv, 1 << 30, changed).unwrap();
    assert_eq!(changed_dir.entries(), 0);
    assert_eq!(
        notes,
        [format!(
            "{file}: not used (config.json differs); left as it is"
        )]
    );

    let snapshot = Snapshot::open(&fixture("olmoe_tiny")).unwrap();
    let int8 = KvIdentity::of(&snapshot, "olmoe", Width::F32, Width::Int8Row).unwrap();
    let (_, notes) = KvDir::open(kv, 1 << 30, int8).unwrap();
    assert_eq!(
        notes,
        [format!(
            "{file}: not used (expert width f32, this run int8); left as it is"
        )]
    );

    // A later format: its version is named, and nothing else is read.
    let mut bytes = fs::read(&path).unwrap();
    bytes[6] = 2;
    let later = kv.join("later.colikv");
    fs::write(&later, &bytes).unwrap();
    let (kept, notes) = KvDir::open(kv, 1 << 30, identity).unwrap();
    assert_eq!(kept.entries(), 1);
    assert_eq!(
        notes,
        [format!(
            "{}: not used (format version 2, this build reads 1); left as it is",
            later.display()
        )]
    );
    fs::remove_file(&later).unwrap();
    assert_eq!(snapshot_of(kv), before);
}

#[test]
fn the_byte_limit_removes_the_least_recently_used_of_this_models_files() {
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path();
    let (engine, identity) = olmoe();
    let [a, b, c]: [Vec<u32>; 3] = [vec![1, 2, 3], vec![4, 5, 6], vec![7, 8, 9]];
    // Another model's file, which no limit may remove.
    let (kimi, kimi_identity) = load("kimi_k3", &fixture("kimi_k3_tiny"));
    let (mut other, _) = KvDir::open(kv, 1 << 30, kimi_identity).unwrap();
    let foreign = written(other.save(&a, &fed(kimi.as_ref(), &a)).unwrap());

    let (mut kept, _) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    let path_a = written(kept.save(&a, &fed(engine.as_ref(), &a)).unwrap());
    let one = kept.bytes();
    drop(kept);
    // Room for two states of three tokens, not three.
    let (mut kept, _) = KvDir::open(kv, 2 * one + one / 2, identity).unwrap();
    let path_b = written(kept.save(&b, &fed(engine.as_ref(), &b)).unwrap());
    let (entry, _) = kept.best(&a).unwrap();
    kept.load(entry, engine.as_ref()).unwrap();
    let Saved::Written {
        path: path_c,
        evicted,
        bytes,
    } = kept.save(&c, &fed(engine.as_ref(), &c)).unwrap()
    else {
        panic!("not written");
    };
    assert_eq!(bytes, one);
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0], path_b);
    assert!(!path_b.exists());
    assert!(path_a.exists() && path_c.exists() && foreign.exists());
    assert_eq!((kept.entries(), kept.bytes()), (2, 2 * one));
    assert_eq!(kept.best(&b), None);

    // A state whose file alone is over the limit is not written.
    let long: Vec<u32> = (1..=40).collect();
    let saved = kept.save(&long, &fed(engine.as_ref(), &long)).unwrap();
    assert!(
        matches!(saved, Saved::TooLarge { bytes, limit } if bytes > limit && limit == 2 * one + one / 2),
        "{saved:?}"
    );
    assert_eq!(listing(kv).len(), 3);
    assert_eq!(kept.entries(), 2);
}

#[test]
fn after_a_restart_the_files_times_say_which_was_used_last() {
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path();
    let (engine, identity) = olmoe();
    let [a, b, c]: [Vec<u32>; 3] = [vec![1, 2, 3], vec![4, 5, 6], vec![7, 8, 9]];
    let (mut kept, _) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    let path_a = written(kept.save(&a, &fed(engine.as_ref(), &a)).unwrap());
    let path_b = written(kept.save(&b, &fed(engine.as_ref(), &b)).unwrap());
    let one = kept.bytes() / 2;
    // b saved well after a, as far as the files say.
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for (path, age) in [(&path_a, 0), (&path_b, 10)] {
        let file = fs::File::options().write(true).open(path).unwrap();
        file.set_modified(long_ago + std::time::Duration::from_secs(age))
            .unwrap();
    }
    let (mut kept, _) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    let (entry, _) = kept.best(&a).unwrap();
    kept.load(entry, engine.as_ref()).unwrap();

    let (mut kept, _) = KvDir::open(kv, 2 * one + one / 2, identity).unwrap();
    let Saved::Written { evicted, .. } = kept.save(&c, &fed(engine.as_ref(), &c)).unwrap() else {
        panic!("not written");
    };
    assert_eq!(evicted.len(), 1);
    assert_eq!(evicted[0], path_b);
    assert!(path_a.exists());
}

#[test]
fn a_truncated_or_damaged_file_is_refused_naming_it_and_left_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path();
    let (engine, identity) = olmoe();
    let (mut kept, _) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    let path = written(kept.save(&PROMPT, &fed(engine.as_ref(), &PROMPT)).unwrap());
    let whole = fs::read(&path).unwrap();

    fs::write(&path, &whole[..whole.len() - 10]).unwrap();
    let (kept, notes) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    assert_eq!(kept.entries(), 0);
    assert_eq!(notes.len(), 1);
    assert!(
        notes[0].starts_with(&format!(
            "{}: not used (truncated or corrupt",
            path.display()
        )),
        "{}",
        notes[0]
    );
    assert_eq!(fs::read(&path).unwrap(), &whole[..whole.len() - 10]);

    // A byte of the state itself: the header reads, the checksum refuses the load.
    let mut damaged = whole.clone();
    let at = whole.len() - 100;
    damaged[at] ^= 0x40;
    fs::write(&path, &damaged).unwrap();
    let (mut kept, notes) = KvDir::open(kv, 1 << 30, identity).unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    let err = kept.load(0, engine.as_ref()).err().unwrap().to_string();
    assert_eq!(
        err,
        format!(
            "{}: not loaded (truncated or corrupt (its checksum does not match its bytes)); left as it is",
            path.display()
        )
    );
    assert_eq!(kept.entries(), 0);
    assert_eq!(fs::read(&path).unwrap(), damaged);
}

#[test]
fn no_damaged_byte_of_a_file_is_ever_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let kv = dir.path();
    let (engine, identity) = load("glm_moe_dsa", &fixture("glm_moe_dsa_tiny"));
    let (mut kept, _) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
    let path = written(
        kept.save(&PROMPT[..3], &fed(engine.as_ref(), &PROMPT[..3]))
            .unwrap(),
    );
    let whole = fs::read(&path).unwrap();
    let mut runner = TestRunner::new(Config::with_cases(256));
    runner
        .run(
            &(any::<prop::sample::Index>(), 1..=255u8, any::<bool>()),
            |(at, xor, cut)| {
                let at = at.index(whole.len());
                let bytes = if cut {
                    whole[..at].to_vec()
                } else {
                    let mut bytes = whole.clone();
                    bytes[at] ^= xor;
                    bytes
                };
                fs::write(&path, &bytes).unwrap();
                let (mut kept, notes) = KvDir::open(kv, 1 << 30, identity.clone()).unwrap();
                if kept.entries() == 0 {
                    prop_assert_eq!(notes.len(), 1);
                    prop_assert!(
                        notes[0].starts_with(&path.display().to_string()),
                        "{}",
                        notes[0]
                    );
                } else {
                    let err = kept.load(0, engine.as_ref()).err();
                    prop_assert!(err.is_some(), "byte {} loaded", at);
                    let message = err.unwrap().to_string();
                    prop_assert!(
                        message.starts_with(&path.display().to_string()),
                        "{}",
                        message
                    );
                }
                prop_assert_eq!(fs::read(&path).unwrap(), bytes);
                Ok(())
            },
        )
        .unwrap();
}
