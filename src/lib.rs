//! coli runs mixture-of-experts language models over memory-mapped expert shards and learns
//! which experts a workload uses.
//!
//! How a run flows through the crate:
//! - [`cli`] parses `coli [--model ENGINE] [KEY=VALUE ...] [CAP [EBITS [DBITS]]]`;
//!   [`settings`] resolves every `KEY` (argument, environment, default);
//! - [`run`] opens the model directory with [`snapshot`] (config + mapped shards) and builds
//!   the engine from [`engines`], whose weights are [`quant`] matrices and whose routed
//!   experts live in the [`experts`] store;
//! - [`generate`] runs prefill and decode; [`oracle`] compares against a reference;
pub mod cli;
pub mod engines;
pub mod experts;
pub mod generate;
pub mod oracle;
pub mod quant;
pub mod run;
pub mod settings;
pub mod snapshot;
