//! The models: one file per engine, the layer operations they share in [`layers`], and the
//! registry that maps an engine name (`--model`, or `model_type` in `config.json`) to the
//! code that builds it.
//!
//! An engine decides what a model computes; it owns no file format, no counters of its own
//! and no caching policy (those are `snapshot`, `route_trace` and `experts`).

pub mod attn_res;
pub mod dsa;
pub mod gated_norm;
pub mod glm_moe_dsa;
pub mod inkling;
pub mod kda;
pub mod kimi_k3;
pub mod layers;
pub mod mla;
pub mod moe;
pub mod olmoe;
pub mod prompt;
pub mod short_conv;
pub mod situ;
pub mod state;
pub mod window_attention;

use std::sync::{Mutex, MutexGuard, PoisonError};

use anyhow::{bail, Result};

use crate::experts::{CacheStats, StoreOptions};
use crate::quant::Width;
use crate::snapshot::Snapshot;
use moe::RoutedExperts;
pub use prompt::PromptConvention;
pub use state::{Logits, State, Step};

/// How to build an engine from a snapshot.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The expert store: slots, width of routed experts stored in float, memory budget,
    /// how experts are read.
    pub store: StoreOptions,
    /// Width of dense tensors stored in float.
    pub dense_width: Width,
    /// `DRAFT`: speculative draft depth; `None` lets an engine with a draft head pick.
    pub draft: Option<usize>,
    /// `DSA_FORCE`: sparse-attention engines select on every query but keep every key.
    pub dsa_force: bool,
}

impl LoadOptions {
    /// Everything in f32 (the oracle setting) with `cap` slots per layer and no drafting.
    pub fn exact(cap: usize) -> LoadOptions {
        LoadOptions {
            store: StoreOptions::mapped(cap, Width::F32),
            dense_width: Width::F32,
            draft: None,
            dsa_force: false,
        }
    }
}

/// A loaded model: its weights, immutable after [`load`] and shared by every conversation,
/// and its routed experts (the expert store and the routing telemetry, which every forward
/// updates under one lock). What grows with a conversation is a [`State`] the engine
/// creates; one [`Engine::forward`] runs the rows of many states.
pub trait Engine: Send + Sync {
    /// The engine's name, as `--model` spells it.
    fn name(&self) -> &'static str;

    fn vocab_size(&self) -> usize;

    /// An empty conversation: no positions.
    fn new_state(&self) -> State;

    /// One forward over a batch: each step's tokens at the positions after those its state
    /// holds, every dense product once over all rows, attention per sequence on its own
    /// state, each MoE layer taking each distinct expert once for every row routed to it.
    /// Returns each step's logits (`vocab` for [`Logits::Last`], `tokens x vocab` for
    /// [`Logits::All`]), every row the bits it has when its sequence runs alone. A forward
    /// that fails (a signal between layers, an expert that cannot be read) leaves the
    /// batch's states partly filled: the caller starts them again.
    fn forward(&self, batch: &mut [Step]) -> Result<Vec<Vec<f32>>>;

    /// [`Engine::forward`] of one sequence.
    fn forward_one(&self, state: &mut State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let mut out = self.forward(&mut [Step::new(state, tokens, logits)])?;
        Ok(out.pop().unwrap_or_default())
    }

    /// The routed experts and their telemetry, locked (a forward holds the lock).
    fn routed(&self) -> MutexGuard<'_, RoutedExperts>;

    fn cache_stats(&self) -> CacheStats {
        self.routed().stats()
    }

    /// Expert-cache slots per MoE layer actually in use (the fewest of the expert ranks'
    /// in an MPI job).
    fn cache_capacity(&self) -> usize {
        self.routed().slots().0
    }

    /// Bytes of weights resident outside the expert cache.
    fn resident_bytes(&self) -> usize;

    /// Token ids that end a generation: the model's `eos_token_id`s
    /// ([`Snapshot::stop_ids`]), or its transformers config class's default without one.
    fn stop_tokens(&self) -> &[u32];

    /// How a text prompt becomes ids for this model (BOS, a fixed prefix, a built-in chat
    /// template) and which special tokens end its answers; used by text mode only.
    fn prompt_convention(&self) -> PromptConvention {
        PromptConvention::PLAIN
    }

    /// Lines describing what the loaded model will do beyond its shapes (e.g. an active
    /// draft head or sparse attention), for the start of a run.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }

    /// Draft depth for speculative greedy decoding; 0 when the engine has no draft head or
    /// drafting is off.
    fn draft_depth(&self) -> usize {
        0
    }

    /// Up to `depth` tokens the engine's draft head expects after `next`, the token chosen
    /// from `state`'s last forward's logits (which no forward has seen yet). Empty when the
    /// engine has no draft head.
    fn propose(&self, state: &mut State, next: u32, depth: usize) -> Result<Vec<u32>> {
        let _ = (state, next, depth);
        Ok(Vec::new())
    }
}

/// `routed` locked, whether or not a forward that held it panicked: the store and the
/// counters stay consistent between expert calls.
pub(crate) fn lock(routed: &Mutex<RoutedExperts>) -> MutexGuard<'_, RoutedExperts> {
    routed.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every engine this build can run.
pub const ENGINES: &[&str] = &[olmoe::NAME, inkling::NAME, glm_moe_dsa::NAME, kimi_k3::NAME];

/// What `coli convert` keeps in f32 for `engine` (one of [`ENGINES`]), beside what every
/// engine keeps (vectors, norms, routers, biases): fragments of the names of the tensors
/// the engine reads only in f32, declared by the engine beside the code that reads them.
pub fn kept_in_f32(engine: &str) -> &'static [&'static str] {
    match engine {
        olmoe::NAME => olmoe::KEPT_F32,
        inkling::NAME => inkling::KEPT_F32,
        glm_moe_dsa::NAME => glm_moe_dsa::KEPT_F32,
        kimi_k3::NAME => kimi_k3::KEPT_F32,
        other => unreachable!("{other} is not in ENGINES"),
    }
}

/// `model_type` values that name an engine differently: Inkling's text config, and its
/// multimodal release config whose text part this engine runs; Kimi K3's text config.
const MODEL_TYPES: &[(&str, &str)] = &[
    ("inkling_text", inkling::NAME),
    ("inkling_mm_model", inkling::NAME),
    ("kimi_linear", kimi_k3::NAME),
];

/// The engine a `model_type` from `config.json` names.
fn engine_of_model_type(model_type: &str) -> &str {
    MODEL_TYPES
        .iter()
        .find(|(known, _)| *known == model_type)
        .map_or(model_type, |(_, engine)| engine)
}

/// Build the engine `name` from `snapshot`.
pub fn load(name: &str, snapshot: &Snapshot, options: LoadOptions) -> Result<Box<dyn Engine>> {
    check_config_integers(snapshot.config_json(), "")?;
    // Settings that only GLM-5.2 reads are refused elsewhere rather than ignored.
    if name != glm_moe_dsa::NAME {
        if let Some(depth) = options.draft.filter(|&d| d > 0) {
            bail!("DRAFT={depth}: {name} has no draft (MTP) head; speculative decoding is glm_moe_dsa's (drop DRAFT)");
        }
        if options.dsa_force {
            bail!("DSA_FORCE=1: {name} has no DSA indexer; it is glm_moe_dsa's (drop DSA_FORCE)");
        }
    }
    match name {
        olmoe::NAME => Ok(Box::new(olmoe::Olmoe::load(snapshot, options)?)),
        inkling::NAME => Ok(Box::new(inkling::Inkling::load(snapshot, options)?)),
        glm_moe_dsa::NAME => Ok(Box::new(glm_moe_dsa::GlmMoeDsa::load(snapshot, options)?)),
        kimi_k3::NAME => Ok(Box::new(kimi_k3::KimiK3::load(snapshot, options)?)),
        other => bail!(
            "unknown engine {other:?}; this build runs: {}",
            ENGINES.join(", ")
        ),
    }
}

/// The largest integer a config may hold: beyond every model dimension, layer and token
/// count, and small enough that the shape arithmetic of two such numbers cannot overflow.
const MAX_CONFIG_INTEGER: u64 = 1 << 31;

/// Every integer in `config.json`, at any depth, is at most [`MAX_CONFIG_INTEGER`]; checked
/// before an engine reads a dimension, so a hostile number is refused by name instead of
/// overflowing a shape or sizing an allocation.
fn check_config_integers(value: &serde_json::Value, path: &str) -> Result<()> {
    match value {
        serde_json::Value::Number(n) => match n.as_u64() {
            Some(v) if v > MAX_CONFIG_INTEGER => bail!(
                "config.json: {path} is {v}, larger than any model's dimension or count (at most {MAX_CONFIG_INTEGER})"
            ),
            _ => Ok(()),
        },
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_config_integers(item, &format!("{path}[{i}]"))),
        serde_json::Value::Object(map) => map.iter().try_for_each(|(key, item)| {
            let path = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            check_config_integers(item, &path)
        }),
        _ => Ok(()),
    }
}

/// Checks of a config against its checkpoint that every engine makes before it allocates
/// anything: `num_hidden_layers` is the number of decoder layers the checkpoint holds under
/// `prefix` (`model.layers.`): every index below it is present and none at or above it
/// beyond `extra` (an MTP head's layers); no routed expert (`.experts.N.`) is numbered at
/// or beyond the config's count (`experts`: its key and value); and the RMSNorm epsilon is
/// a positive number.
pub(crate) fn check_config(
    snapshot: &Snapshot,
    prefix: &str,
    layers: usize,
    extra: usize,
    experts: (&str, usize),
    rms_norm_eps: f64,
) -> Result<()> {
    if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
        bail!("config.json: rms_norm_eps is {rms_norm_eps}; it must be a positive number");
    }
    let (key, count) = experts;
    let beyond = snapshot.names().find(|name| {
        name.split(".experts.")
            .nth(1)
            .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .is_some_and(|e| e >= count)
    });
    if let Some(name) = beyond {
        bail!("config.json: {key} is {count}, but the checkpoint holds tensor {name}: the config does not describe these weights");
    }
    let present: std::collections::BTreeSet<usize> = snapshot
        .names()
        .filter_map(|name| name.strip_prefix(prefix))
        .filter_map(|rest| rest.split('.').next()?.parse().ok())
        .collect();
    let highest = present.iter().next_back().copied();
    let found = match highest {
        Some(h) => format!("layers 0..={h}"),
        None => "no layers".to_string(),
    };
    if layers == 0 {
        bail!("config.json: num_hidden_layers is 0; the checkpoint holds {found} under {prefix}N");
    }
    if let Some(missing) = (0..layers).find(|l| !present.contains(l)) {
        bail!(
            "config.json: num_hidden_layers is {layers}, but the checkpoint has no layer {missing} ({prefix}{missing}.*; it holds {found}): the config does not belong to these weights"
        );
    }
    if let Some(h) = highest.filter(|&h| h >= layers + extra) {
        bail!(
            "config.json: num_hidden_layers is {layers}, but the checkpoint holds layers up to {h} ({prefix}{h}.*): the config does not describe every layer of these weights"
        );
    }
    Ok(())
}

/// `value` of `key` in config.json is a positive number.
pub(crate) fn check_positive(key: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value > 0.0) {
        bail!("config.json: {key} is {value}; it must be a positive number");
    }
    Ok(())
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
    match ENGINES.iter().find(|&&known| known == name) {
        Some(known) => Ok(known),
        None => bail!(
            "unknown engine {name:?}; this build runs: {}",
            ENGINES.join(", ")
        ),
    }
}
