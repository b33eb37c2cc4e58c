//! The engines against their references, one test binary (they need no process of their
//! own): what every engine owes on every fixture (`conformance`), then what only one engine
//! has, a module per engine.

#[path = "../common/mod.rs"]
mod common;

mod conformance;
mod glm_moe_dsa;
mod inkling;
mod kimi_k3;
mod olmoe;
