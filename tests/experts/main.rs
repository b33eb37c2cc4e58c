//! The expert store, one test binary: eviction and counters on a real snapshot, experts that
//! stream from disk under every setting, and learned placement on the trained OLMoE.

#[path = "../common/mod.rs"]
mod common;

mod cache;
mod learned_placement;
mod streaming;
