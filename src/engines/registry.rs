//! The engines this build runs, as one table: a row per engine with its name (as `--model`
//! spells it), the other `model_type` values of `config.json` that name it, what
//! `coli convert` keeps in f32 for it, the settings only it reads, and the function that
//! loads it. [`ENGINES`], [`kept_in_f32`], [`resolve`] and [`load`] read that table and
//! nothing else; a new engine is a new row.

use anyhow::{bail, Result};

use super::checks::check_config_integers;
use super::{glm_moe_dsa, inkling, kimi_k3, olmoe, Engine, LoadOptions};
use crate::snapshot::Snapshot;

/// One engine of the table.
struct Entry {
    /// The engine's name, as `--model` and `model_type` spell it.
    name: &'static str,
    /// Other `model_type` values that name this engine.
    model_types: &'static [&'static str],
    /// Fragments of the names of the tensors the engine reads only in f32, declared by the
    /// engine beside the code that reads them ([`kept_in_f32`]).
    kept_f32: &'static [&'static str],
    /// The engine has a draft (MTP) head, which `DRAFT` sets the depth of.
    drafts: bool,
    /// The engine has a DSA indexer, which `DSA_FORCE` runs on every query.
    dsa: bool,
    load: fn(&Snapshot, LoadOptions) -> Result<Box<dyn Engine>>,
}

/// Every engine, in the order `--help` lists them.
const TABLE: &[Entry] = &[
    Entry {
        name: olmoe::NAME,
        model_types: &[],
        kept_f32: olmoe::KEPT_F32,
        drafts: false,
        dsa: false,
        load: |snapshot, options| Ok(Box::new(olmoe::Olmoe::load(snapshot, options)?)),
    },
    Entry {
        name: inkling::NAME,
        // Inkling's text config, and its multimodal release config whose text part this
        // engine runs.
        model_types: &["inkling_text", "inkling_mm_model"],
        kept_f32: inkling::KEPT_F32,
        drafts: false,
        dsa: false,
        load: |snapshot, options| Ok(Box::new(inkling::Inkling::load(snapshot, options)?)),
    },
    Entry {
        name: glm_moe_dsa::NAME,
        model_types: &[],
        kept_f32: glm_moe_dsa::KEPT_F32,
        drafts: true,
        dsa: true,
        load: |snapshot, options| Ok(Box::new(glm_moe_dsa::GlmMoeDsa::load(snapshot, options)?)),
    },
    Entry {
        name: kimi_k3::NAME,
        // Kimi K3's text config.
        model_types: &["kimi_linear"],
        kept_f32: kimi_k3::KEPT_F32,
        drafts: false,
        dsa: false,
        load: |snapshot, options| Ok(Box::new(kimi_k3::KimiK3::load(snapshot, options)?)),
    },
];

/// The table's names, in its order.
const NAMES: [&str; TABLE.len()] = {
    let mut names = [""; TABLE.len()];
    let mut i = 0;
    while i < TABLE.len() {
        names[i] = TABLE[i].name;
        i += 1;
    }
    names
};

/// Every engine this build can run.
pub const ENGINES: &[&str] = &NAMES;

fn entry(name: &str) -> Option<&'static Entry> {
    TABLE.iter().find(|entry| entry.name == name)
}

/// The names of the engines that have `feature`, for a message.
fn engines_with(feature: fn(&Entry) -> bool) -> String {
    let names: Vec<&str> = TABLE
        .iter()
        .filter(|entry| feature(entry))
        .map(|entry| entry.name)
        .collect();
    names.join(", ")
}

/// What `coli convert` keeps in f32 for `engine` (one of [`ENGINES`]), beside what every
/// engine keeps (vectors, norms, routers, biases): fragments of the names of the tensors
/// the engine reads only in f32.
pub fn kept_in_f32(engine: &str) -> &'static [&'static str] {
    match entry(engine) {
        Some(entry) => entry.kept_f32,
        None => unreachable!("{engine} is not in ENGINES"),
    }
}

/// The engine a `model_type` from `config.json` names.
fn engine_of_model_type(model_type: &str) -> &str {
    TABLE
        .iter()
        .find(|entry| entry.model_types.contains(&model_type))
        .map_or(model_type, |entry| entry.name)
}

/// Build the engine `name` from `snapshot`.
pub fn load(name: &str, snapshot: &Snapshot, options: LoadOptions) -> Result<Box<dyn Engine>> {
    check_config_integers(snapshot.config_json(), "")?;
    let Some(entry) = entry(name) else {
        bail!(
            "unknown engine {name:?}; this build runs: {}",
            ENGINES.join(", ")
        );
    };
    // Settings that only some engines read are refused elsewhere rather than ignored.
    if let Some(depth) = options.draft.filter(|&d| d > 0 && !entry.drafts) {
        bail!(
            "DRAFT={depth}: {name} has no draft (MTP) head; speculative decoding is {}'s (drop DRAFT)",
            engines_with(|e| e.drafts)
        );
    }
    if options.dsa_force && !entry.dsa {
        bail!(
            "DSA_FORCE=1: {name} has no DSA indexer; it is {}'s (drop DSA_FORCE)",
            engines_with(|e| e.dsa)
        );
    }
    (entry.load)(snapshot, options)
}

/// The engine to use: `--model` when given, else `model_type` from `config.json`; refuse
/// when both are present and disagree.
pub fn resolve(requested: Option<&str>, snapshot: &Snapshot) -> Result<&'static str> {
    let config_path = snapshot.dir().join("config.json");
    let from_config = snapshot.model_type().map(engine_of_model_type);
    let name = match (requested, from_config) {
        (Some(asked), Some(found)) if asked != found => bail!(
            "--model {asked} but {} says model_type {:?}; drop --model or point SNAP at a {asked} model",
            config_path.display(),
            snapshot.model_type().unwrap_or(found)
        ),
        (Some(asked), _) => asked,
        (None, Some(found)) => found,
        (None, None) => bail!(
            "{} has no model_type; pass --model ENGINE (one of: {})",
            config_path.display(),
            ENGINES.join(", ")
        ),
    };
    match entry(name) {
        Some(entry) => Ok(entry.name),
        None => bail!(
            "unknown engine {name:?}; this build runs: {}",
            ENGINES.join(", ")
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_model_type_names_one_engine() {
        assert_eq!(ENGINES, ["olmoe", "inkling", "glm_moe_dsa", "kimi_k3"]);
        assert_eq!(engine_of_model_type("inkling_mm_model"), "inkling");
        assert_eq!(engine_of_model_type("kimi_linear"), "kimi_k3");
        assert_eq!(engine_of_model_type("olmoe"), "olmoe");
        assert_eq!(engine_of_model_type("llama"), "llama");
        let mut names: Vec<&str> = TABLE
            .iter()
            .flat_map(|entry| std::iter::once(entry.name).chain(entry.model_types.iter().copied()))
            .collect();
        let all = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all, "a name or model_type appears twice");
        assert_eq!(engines_with(|e| e.drafts), "glm_moe_dsa");
    }
}
