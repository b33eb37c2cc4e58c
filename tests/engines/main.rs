//! The engines against their references, one test binary (they need no process of their
//! own): what every engine owes on every fixture (`conformance`), then what only one engine
//! has, a module per engine.

#[path = "../common/mod.rs"]
mod common;

/// A fixture's `ref.json` (or another reference file beside it): the ids the transformers
/// reference ran and what it predicted.
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub full_ids: Vec<u32>,
    /// The argmax after each position of `full_ids` (teacher-forced).
    pub tf_pred: Vec<u32>,
    pub json: serde_json::Value,
}

/// `file` of fixture `name` (`ref.json`, or e.g. `ref_dense.json`).
pub fn reference_in(name: &str, file: &str) -> Reference {
    let json = common::read_json(&common::fixture(name).join(file));
    let ids = |key: &str| -> Vec<u32> {
        json[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    Reference {
        prompt_ids: ids("prompt_ids"),
        full_ids: ids("full_ids"),
        tf_pred: ids("tf_pred"),
        json,
    }
}

/// Fixture `name`'s `ref.json`.
pub fn reference(name: &str) -> Reference {
    reference_in(name, "ref.json")
}

mod conformance;
mod glm_moe_dsa;
mod inkling;
mod kimi_k3;
mod olmoe;
mod saved_state;
