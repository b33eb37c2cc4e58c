//! `coli serve`, one test binary: the server driven with `curl` (and the engine behind it
//! through the library), against clients that misbehave on raw sockets, then through the
//! official `openai` Python client, and its page in headless Chromium.

#[path = "../common/mod.rs"]
mod common;

mod batching;
mod hostile;
mod kv_dir;
mod openai;
mod page;
mod sampling;
mod server;
