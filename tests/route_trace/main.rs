//! The routing telemetry through the library and the binary, one test binary: colibri's C
//! contract, the command line, the history and the trace stream; what needs several threads
//! or processes (the children are this binary run again); and what a run or a tool must never
//! do to the files around it.

#[path = "../common/mod.rs"]
mod common;
mod support;

mod c_contract;
mod cli;
mod history;
mod integrity;
mod processes;
mod stream;
