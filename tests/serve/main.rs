//! `coli serve`, one test binary: the server driven with `curl` (and the engine behind it
//! through the library), then through the official `openai` Python client.

#[path = "../common/mod.rs"]
mod common;

mod batching;
mod kv_dir;
mod openai;
mod sampling;
mod server;
