//! Text mode and the tokenizer, one test binary.

#[path = "../common/mod.rs"]
mod common;
mod support;

mod mode;
mod tokenizer;
mod tools;
