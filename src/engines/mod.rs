//! The models: one file per engine, the layer operations they share in [`layers`], the
//! [`Engine`] trait they implement ([`engine`]), and the [`registry`] that maps an engine
//! name (`--model`, or `model_type` in `config.json`) to the code that builds it.
//!
//! An engine decides what a model computes; it owns no file format, no counters of its own
//! and no caching policy (those are `snapshot`, `route_trace` and `experts`).

pub mod attn_res;
pub mod checks;
pub mod dsa;
pub mod engine;
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
pub mod registry;
pub mod short_conv;
pub mod situ;
pub mod state;
pub mod state_io;
pub mod weights;
pub mod window_attention;

pub(crate) use checks::{check_config, check_positive};
pub(crate) use engine::lock;
pub use engine::{Engine, LoadOptions};
pub use prompt::{PromptConvention, ToolSyntax};
pub use registry::{kept_in_f32, load, resolve, ENGINES};
pub use state::{Logits, State, Step};
