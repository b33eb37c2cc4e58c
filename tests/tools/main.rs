//! The offline tools (`coli usage`, `coli trace`, the plots), one test binary.

#[path = "../common/mod.rs"]
mod common;

mod plot;
mod trace;
mod usage;
