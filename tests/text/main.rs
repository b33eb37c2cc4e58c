//! Text mode and the tokenizer, one test binary.

#[path = "../common/mod.rs"]
mod common;
#[path = "../text_support/mod.rs"]
mod text_support;

mod mode;
mod tokenizer;
