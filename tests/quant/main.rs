//! The weight formats, one test binary: the kernels, reading pre-quantised containers, Kimi
//! K3's published MXFP4 experts, and `coli convert` on every fixture.

#[path = "../common/mod.rs"]
mod common;

mod convert;
mod formats;
mod kernels;
mod kimi_k3_mxfp4;
