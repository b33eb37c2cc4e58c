//! The models: one file per engine, the layer operations they share in [`layers`], and the
//! registry that maps an engine name (`--model`, or `model_type` in `config.json`) to the
//! code that builds it.
//!
//! An engine decides what a model computes; it owns no file format, no counters of its own
//! and no caching policy (those are `snapshot`, `route_trace` and `experts`).

pub mod layers;
pub mod moe;
pub mod olmoe;

use anyhow::{bail, Result};

use crate::experts::CacheStats;
use crate::quant::Width;
use crate::snapshot::Snapshot;

/// How to build an engine from a snapshot.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Expert-cache slots per MoE layer; 0 means "size from the RAM budget".
    pub cap: usize,
    /// Width of routed experts stored in float.
    pub expert_width: Width,
    /// Width of dense tensors stored in float.
    pub dense_width: Width,
    /// RAM budget in bytes for `cap == 0`.
    pub ram_budget: u64,
}

/// A loaded model that turns token ids into logits.
pub trait Engine {
    /// The engine's name, as `--model` spells it.
    fn name(&self) -> &'static str;

    fn vocab_size(&self) -> usize;

    /// Number of positions already in the KV cache.
    fn position(&self) -> usize;

    /// Run `tokens` at the positions following those already cached and return the logits
    /// of the last position, or of every position (`tokens.len() x vocab`) when
    /// `all_positions`.
    fn forward(&mut self, tokens: &[u32], all_positions: bool) -> Result<Vec<f32>>;

    /// Forget every cached position (the expert cache stays warm).
    fn reset(&mut self);

    fn cache_stats(&self) -> CacheStats;

    /// Expert-cache slots per MoE layer actually in use.
    fn cache_capacity(&self) -> usize;

    /// Bytes of weights resident outside the expert cache.
    fn resident_bytes(&self) -> usize;
}

/// Every engine this build can run.
pub const ENGINES: &[&str] = &[olmoe::NAME];

/// Build the engine `name` from `snapshot`.
pub fn load(name: &str, snapshot: &Snapshot, options: LoadOptions) -> Result<Box<dyn Engine>> {
    match name {
        olmoe::NAME => Ok(Box::new(olmoe::Olmoe::load(snapshot, options)?)),
        other => bail!(
            "unknown engine {other:?}; this build runs: {}",
            ENGINES.join(", ")
        ),
    }
}

/// The engine to use: `--model` when given, else `model_type` from `config.json`; refuse
/// when both are present and disagree.
pub fn resolve(requested: Option<&str>, snapshot: &Snapshot) -> Result<&'static str> {
    let config_path = snapshot.dir().join("config.json");
    let from_config = snapshot.model_type();
    let name = match (requested, from_config) {
        (Some(asked), Some(found)) if asked != found => bail!(
            "--model {asked} but {} says model_type {found:?}; drop --model or point SNAP at a {asked} model",
            config_path.display()
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
