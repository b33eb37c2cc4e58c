//! The kernels' source and its compilation by NVRTC to PTX for a virtual architecture,
//! with IEEE division and square root and no flush-to-zero, cached under
//! `$XDG_CACHE_HOME/coli/cuda/` (or `~/.cache/coli/cuda/`) by architecture and source hash.

use std::path::PathBuf;

use anyhow::{bail, Result};
use cudarc::nvrtc::{self, CompileOptions};

/// The kernel source, compiled by NVRTC when the device opens.
pub const KERNEL_SOURCE: &str = include_str!("../../../kernels/cuda/coli.cu");

/// The kernels `open` loads from [`KERNEL_SOURCE`].
pub const KERNEL_NAMES: [&str; 5] = ["matmul_1", "matmul_8", "rms_norm", "glu", "combine"];

/// [`KERNEL_SOURCE`] compiled by NVRTC to PTX for `compute_{arch}` (for example 90), with
/// IEEE division and square root and denormals kept.
pub fn compile_kernels(arch: u32) -> Result<String> {
    let options = CompileOptions {
        ftz: Some(false),
        prec_sqrt: Some(true),
        prec_div: Some(true),
        fmad: Some(true),
        options: vec![format!("--gpu-architecture=compute_{arch}")],
        name: Some("coli.cu".into()),
        ..Default::default()
    };
    match nvrtc::compile_ptx_with_opts(KERNEL_SOURCE, options) {
        Ok(ptx) => Ok(ptx.to_src()),
        Err(nvrtc::CompileError::CompileError { nvrtc, log, .. }) => bail!(
            "NVRTC could not compile the kernels for compute_{arch} ({nvrtc:?}):\n{}",
            log.to_string_lossy()
        ),
        Err(other) => bail!("NVRTC failed for compute_{arch}: {other:?}"),
    }
}

fn cache_path(arch: u32) -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => PathBuf::from(std::env::var_os("HOME")?).join(".cache"),
    };
    // FNV-1a: a hash that stays the same across Rust versions, so the file name does.
    let hash = KERNEL_SOURCE
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        });
    Some(
        base.join("coli")
            .join("cuda")
            .join(format!("compute_{arch}-{hash:016x}.ptx")),
    )
}

pub(super) fn read_cached(arch: u32) -> Option<String> {
    std::fs::read_to_string(cache_path(arch)?).ok()
}

/// Best effort: a cache that cannot be written only costs the next start a compilation.
pub(super) fn write_cached(arch: u32, ptx: &str) {
    let Some(path) = cache_path(arch) else {
        return;
    };
    let Some(dir) = path.parent() else {
        return;
    };
    let partial = path.with_extension(format!("ptx.{}", std::process::id()));
    let written = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&partial, ptx))
        .and_then(|()| std::fs::rename(&partial, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
}
