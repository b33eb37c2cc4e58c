//! coli runs mixture-of-experts language models over memory-mapped expert shards and learns
//! which experts a workload uses.
//!
//! How a run flows through the crate:
//! - [`cli`] parses `coli [--model ENGINE] [KEY=VALUE ...] [CAP [EBITS [DBITS]]]`;
//!   [`settings`] resolves every `KEY` (argument, environment, default);
//! - [`startup`] opens the model directory with [`snapshot`] (config + mapped shards) and
//!   builds the engine from [`engines`], for [`run`] (the main job), [`serve`] and the MPI
//!   ranks; the engine's weights are [`quant`] matrices, its routed experts live in the
//!   [`experts`] store, and [`backend`] decides whether products run on the CPU or a GPU;
//! - [`convert`] (`coli convert`) turns a float or FP8 checkpoint into a quantised container;
//! - [`generate`] runs prefill and decode; [`oracle`] compares against a reference;
//! - [`text`] turns a prompt into ids and streams the generated text, [`sampling`] picking
//!   each token, [`guide`] restricting the choice where a grammar or JSON schema is asked for;
//! - [`route_trace`] counts every routing decision and keeps the usage history;
//! - [`tools`] reads those histories and traces offline (`coli usage`, `coli trace`);
//! - [`verbosity`] is how much a run says on stderr (`-q`, `-v`).
pub mod activation;
pub mod backend;
pub mod cli;
#[cfg(feature = "mpi")]
pub mod cluster;
pub mod convert;
pub mod engines;
pub mod experts;
pub mod files;
pub mod generate;
pub mod guide;
pub mod interrupt;
pub mod layout;
pub mod oracle;
pub mod perplexity;
pub mod profile;
pub mod quant;
pub mod route_trace;
pub mod run;
pub mod sampling;
pub mod serve;
pub mod session;
pub mod settings;
pub mod snapshot;
pub mod startup;
pub mod text;
pub mod tools;
pub mod verbosity;
