//! Property tests over the two files every run trusts first, `config.json` and a shard's
//! safetensors header: whatever they hold, opening and loading returns a model or an error
//! (exit 2 in the binary), never a panic or an abort.

use crate::common;

use std::path::Path;

use coli::engines::{self, LoadOptions};
use coli::snapshot::Snapshot;
use common::{copy_fixture, fixture, fixture_with_config, text_config};
use proptest::prelude::*;
use serde_json::Value;

/// Open and load `dir` as the engine its config names; the result itself does not matter.
fn open_and_load(dir: &Path) {
    if let Ok(snapshot) = Snapshot::open(dir) {
        if let Ok(name) = engines::resolve(None, &snapshot) {
            let _ = engines::load(name, &snapshot, LoadOptions::exact(2));
        }
    }
}

/// Values a careless or hostile config might hold.
fn arb_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (0u64..70).prop_map(Value::from),
        prop_oneof![
            Just(0u64),
            Just(1),
            Just(1 << 20),
            Just(1 << 31),
            Just(u32::MAX as u64),
            Just(1 << 40),
            Just(u64::MAX)
        ]
        .prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        Just(Value::from(-1.0)),
        "[a-z_]{0,8}".prop_map(Value::from),
        prop::collection::vec((0u64..8).prop_map(Value::from), 0..4).prop_map(Value::from),
    ]
}

proptest! {
    // A fixed seed keeps the suite's verdict the same from run to run; PROPTEST_CASES=4000
    // explores further (it found the shape overflow the 2^31 bound now refuses).
    #![proptest_config(ProptestConfig {
        rng_seed: proptest::test_runner::RngSeed::Fixed(20261201),
        ..ProptestConfig::with_cases(64)
    })]

    #[test]
    fn any_config_value_loads_or_is_refused(
        fixture_index in 0usize..4,
        key_index in any::<prop::sample::Index>(),
        value in arb_value(),
    ) {
        let name = ["olmoe_tiny", "inkling_tiny", "glm_moe_dsa_tiny", "kimi_k3_tiny"][fixture_index];
        let dir = fixture_with_config(name, |config| {
            let object = text_config(config).as_object_mut().unwrap();
            let keys: Vec<String> = object.keys().cloned().collect();
            let key = key_index.get(&keys).clone();
            object.insert(key, value);
        });
        open_and_load(dir.path());
    }

    #[test]
    fn any_header_edit_opens_or_is_refused(
        position in any::<prop::sample::Index>(),
        replacement in prop::collection::vec(any::<u8>(), 1..6),
    ) {
        let dir = copy_fixture("olmoe_tiny");
        let shard = dir.path().join("model.safetensors");
        let mut bytes = std::fs::read(fixture("olmoe_tiny").join("model.safetensors")).unwrap();
        let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        // Anywhere in the length prefix and the JSON header.
        let at = position.index(header_end);
        for (offset, byte) in replacement.iter().enumerate() {
            if let Some(slot) = bytes.get_mut(at + offset) {
                *slot = *byte;
            }
        }
        std::fs::write(&shard, &bytes).unwrap();
        open_and_load(dir.path());
    }
}
