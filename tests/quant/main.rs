//! The weight formats and the kernels, one test binary.

#[path = "../common/mod.rs"]
mod common;

mod formats;
mod kernels;
