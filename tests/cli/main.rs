//! The command line through the binary and the library, one test binary: bad and hostile
//! input (every refusal exits 2 naming the problem and touches no file); property tests over
//! `config.json` and a shard's header; what it tells a new user (the oracle mode named, the
//! prompt flags, `-q`/`-v`, `--help`, `coli settings`, the banner); and the perplexity and
//! divergence runs (`PPL=1`, `KLD_BASE`); `coli chat` at a terminal (a pseudo-terminal) and
//! from a pipe.

#[path = "../common/mod.rs"]
mod common;

mod chat;
mod errors;
mod fuzz_inputs;
mod guide;
mod perplexity;
mod robustness;
