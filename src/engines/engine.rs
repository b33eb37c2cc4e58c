//! The `Engine` trait every model implements, and how one is asked to load: what a run
//! can do with a loaded model, not which models exist (that is the registry's).

use std::sync::{Mutex, MutexGuard, PoisonError};

use anyhow::Result;

use super::moe::RoutedExperts;
use super::prompt::PromptConvention;
use super::state::{Logits, State, Step};
use crate::experts::{CacheStats, StoreOptions};
use crate::quant::Width;

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

/// A loaded model: its weights, immutable after [`load`](super::load) and shared by every conversation,
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

    /// [`Engine::forward`] of a run's own sequences (not a server's), whose selections join
    /// the counts only when it completes or is stopped by a signal between layers (what it
    /// routed was traced, and the layers it ran are whole): a forward that fails part-way (an
    /// expert rank that stopped answering, a shard that changed) leaves the history as the
    /// last whole forward left it.
    fn forward_whole(&self, batch: &mut [Step]) -> Result<Vec<Vec<f32>>> {
        self.routed().telemetry.hold_step();
        let out = self.forward(batch);
        let kept = match &out {
            Ok(_) => true,
            Err(err) => err.is::<crate::interrupt::Interrupted>(),
        };
        self.routed().telemetry.end_step(kept);
        out
    }

    /// [`Engine::forward_whole`] of one sequence.
    fn forward_one(&self, state: &mut State, tokens: &[u32], logits: Logits) -> Result<Vec<f32>> {
        let mut out = self.forward_whole(&mut [Step::new(state, tokens, logits)])?;
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
    /// ([`Snapshot::stop_ids`](crate::snapshot::Snapshot::stop_ids)), or its transformers config class's default without one.
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
