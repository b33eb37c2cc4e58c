//! The routing telemetry through the library and the binary, one test binary: colibri's C
//! contract, the command line, the history and the trace stream. The tests that re-run their
//! own binary as child processes are `route_trace_processes`, a binary of its own.

#[path = "../common/mod.rs"]
mod common;
#[path = "../route_trace_support/mod.rs"]
mod route_trace_support;

mod c_contract;
mod cli;
mod history;
mod stream;
