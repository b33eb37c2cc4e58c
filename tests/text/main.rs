//! Text mode and the tokenizer, one test binary.

#[path = "../common/mod.rs"]
mod common;
mod support;

mod guide;
mod mode;
mod tokenizer;
mod tools;
