//! Bad and hostile input through the binary and the library, one test binary: every refusal
//! exits 2 naming the problem and touches no file; property tests over `config.json` and a
//! shard's header; and the perplexity and divergence runs (`PPL=1`, `KLD_BASE`).

#[path = "../common/mod.rs"]
mod common;

mod errors;
mod fuzz_inputs;
mod perplexity;
mod robustness;
