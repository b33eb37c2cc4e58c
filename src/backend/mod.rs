//! Where the arithmetic runs: the CPU kernels of [`quant`](crate::quant), or a GPU through
//! the [`Device`] interface ([`vulkan`] on ash, [`cuda`] on cudarc).
//!
//! `BACKEND=cpu|vulkan|cuda|auto` picks the device once, at startup ([`start`]); asking for
//! a GPU that cannot start is an error naming the reason, never a quiet fallback. Once a
//! device is installed:
//! - every dense [`Matrix::matmul`](crate::quant::Matrix::matmul) runs on it, its weights
//!   uploaded on first use and kept there for the life of the matrix ([`Residency`]), and
//!   so does [`rms_norm`] (unless `GPU_DENSE=0`);
//! - the routed experts of the VRAM tier ([`tier`](crate::experts::tier), sized by `GPU_EXPERT_GB`) run as one
//!   submission per MoE layer, while the CPU computes the other experts of the layer.
//!
//! A failure after startup (device lost, out of memory) switches the process to the CPU
//! with one warning; an operation or format a device does not offer is computed on the CPU
//! without comment. This module owns that policy; the devices only compute and report.

pub mod cuda;
pub mod group;
pub mod vulkan;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{bail, Context, Result};
use thiserror::Error;

use crate::activation::Activation;
/// The weight view a device receives; defined in the leaf [`layout`](crate::layout).
pub use crate::layout::{RawMatrix, RawScales};

/// A weight a device holds, by the number it gave at upload.
pub type WeightId = u64;

/// One expert of an [`ExpertGroup`] and the input rows routed to it.
#[derive(Debug, Clone, Copy)]
pub struct GroupExpert<'a> {
    pub gate: WeightId,
    pub up: WeightId,
    pub down: WeightId,
    /// `(row of the group's input, gate weight)` for every row routed to this expert.
    pub rows: &'a [(usize, f32)],
}

/// The resident experts one MoE layer runs for a batch: the device computes
/// `out[row] = sum over experts, in order, of weight * down(act(gate x[row], up x[row]))`
/// in one submission. `out` is `rows x width` and is overwritten (rows no expert names
/// are zero).
#[derive(Debug, Clone, Copy)]
pub struct ExpertGroup<'a> {
    pub experts: &'a [GroupExpert<'a>],
    /// `rows x width` activations; the experts map `width` inputs to `width` outputs.
    pub input: &'a [f32],
    pub rows: usize,
    pub width: usize,
    pub activation: Activation,
}

/// Why a device did not compute something.
#[derive(Debug, Error)]
pub enum DeviceError {
    /// The device does not offer this operation or format; the CPU computes it.
    #[error("not offered by the device: {0}")]
    Unsupported(String),
    /// The device failed (lost, out of memory, a timed-out fence): it must not be used
    /// again in this process.
    #[error("{0:#}")]
    Failed(#[from] anyhow::Error),
}

/// Free and total device memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceMemory {
    pub free: u64,
    pub total: u64,
}

/// What a GPU backend offers the engines. Every method may be called from several threads
/// at once; implementations serialise their queue internally.
pub trait Device: Send + Sync {
    /// `"Vulkan: <device name>, <driver>"`, for the startup line.
    fn description(&self) -> String;

    /// Device memory the weights may use.
    fn memory(&self) -> DeviceMemory;

    /// Copy `matrix` to the device once; the id stays valid until [`Device::release`].
    fn upload(&self, matrix: &RawMatrix<'_>) -> Result<WeightId, DeviceError>;

    /// Free an uploaded weight (an unknown id is ignored).
    fn release(&self, weight: WeightId);

    /// `out[t] = W . input[t]` for `n` rows of input (`n x cols` in, `n x rows` out).
    fn matmul(
        &self,
        weight: WeightId,
        input: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), DeviceError>;

    /// `out = x / sqrt(mean(x^2) + eps) * weight` for each `weight.len()`-wide row of `x`.
    fn rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), DeviceError>;

    /// See [`ExpertGroup`].
    fn expert_group(&self, group: &ExpertGroup<'_>, out: &mut [f32]) -> Result<(), DeviceError>;
}

/// The rows of an RMSNorm call (`x` and `out` are rows of `weight.len()` values), or why
/// the call is malformed: the check every device makes before it stages anything.
pub fn rms_norm_rows(x: &[f32], weight: &[f32], out: &[f32]) -> Result<usize, DeviceError> {
    let width = weight.len();
    if width == 0 || !x.len().is_multiple_of(width) || out.len() != x.len() {
        return Err(DeviceError::Unsupported(format!(
            "RMSNorm of {} values into {} with a {width}-wide weight",
            x.len(),
            out.len()
        )));
    }
    Ok(x.len() / width)
}

/// The `BACKEND` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Cpu,
    Vulkan,
    Cuda,
    /// A GPU when one starts (CUDA first, then a Vulkan device that is not a software
    /// driver), else the CPU; the startup line says which.
    Auto,
}

impl Choice {
    pub fn from_setting(value: &str) -> Result<Choice> {
        Ok(match value.to_ascii_lowercase().as_str() {
            "cpu" => Choice::Cpu,
            "vulkan" => Choice::Vulkan,
            "cuda" => Choice::Cuda,
            "auto" => Choice::Auto,
            other => bail!("setting BACKEND={other}: expected cpu, vulkan, cuda or auto"),
        })
    }
}

/// Open and install the device `BACKEND` names, saying on stderr which one computes. A
/// named GPU that cannot start is an error with the reason; `auto` tries CUDA, then Vulkan
/// (passing over a software driver such as lavapipe), then settles on the CPU and says why. With `dense` false (`GPU_DENSE=0`) only the expert
/// tier uses the device; `vulkan` says how a Vulkan device is opened.
pub fn start(choice: Choice, dense: bool, vulkan: &vulkan::VulkanOptions) -> Result<()> {
    let device: Arc<dyn Device> = match choice {
        Choice::Cpu => return Ok(()),
        Choice::Vulkan => Arc::new(
            vulkan::VulkanDevice::open(vulkan)
                .context("BACKEND=vulkan cannot start (BACKEND=cpu runs without a GPU)")?,
        ),
        Choice::Cuda => Arc::new(
            cuda::CudaDevice::open()
                .context("BACKEND=cuda cannot start (BACKEND=cpu runs without a GPU)")?,
        ),
        Choice::Auto => match cuda::CudaDevice::open() {
            Ok(device) => Arc::new(device),
            Err(cuda) => match vulkan::VulkanDevice::open(vulkan).and_then(|device| {
                if device.is_software() {
                    bail!(
                        "{} is a driver that computes on the CPU, slower than BACKEND=cpu \
                         (BACKEND=vulkan uses it anyway)",
                        device.description().trim_start_matches("Vulkan: ")
                    );
                }
                Ok(device)
            }) {
                Ok(device) => Arc::new(device),
                Err(vulkan) => {
                    eprintln!(
                        "[BACKEND] auto: computing on the CPU (CUDA: {cuda:#}; Vulkan: {vulkan:#})"
                    );
                    return Ok(());
                }
            },
        },
    };
    if dense {
        eprintln!("[BACKEND] {}", device.description());
    } else {
        eprintln!(
            "[BACKEND] {} (expert tier only: GPU_DENSE=0)",
            device.description()
        );
    }
    install(device);
    DENSE.store(dense, Ordering::Relaxed);
    Ok(())
}

struct Active {
    device: Arc<dyn Device>,
    failed: AtomicBool,
}

static ACTIVE: OnceLock<Active> = OnceLock::new();

/// Whether dense products and norms go to the device (`GPU_DENSE`).
static DENSE: AtomicBool = AtomicBool::new(true);

/// The active device, for dense work.
fn dense_device() -> Option<&'static dyn Device> {
    active().filter(|_| DENSE.load(Ordering::Relaxed))
}

/// Make `device` the process's device (once; a second call is ignored).
pub fn install(device: Arc<dyn Device>) {
    let _ = ACTIVE.set(Active {
        device,
        failed: AtomicBool::new(false),
    });
}

/// The installed device, unless there is none or it has failed.
pub fn active() -> Option<&'static dyn Device> {
    let active = ACTIVE.get()?;
    (!active.failed.load(Ordering::Relaxed)).then_some(active.device.as_ref())
}

/// Handle an error from the device: unsupported work is the CPU's without comment; a
/// failure turns the device off for the rest of the process, with one warning.
pub fn fell_back(error: DeviceError) {
    if let DeviceError::Failed(error) = error {
        if let Some(active) = ACTIVE.get() {
            if !active.failed.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "[BACKEND] {} failed: {error:#}; continuing on the CPU",
                    active.device.description()
                );
            }
        }
    }
}

/// A weight's life on the device: a dense matrix is offered to the device on its first
/// product and keeps the upload until it is dropped. Routed experts are `HostOnly`: they
/// reach the device only through the VRAM [`tier`](crate::experts::tier), which decides which of them deserve the
/// memory.
#[derive(Debug)]
pub enum Residency {
    /// Not uploaded yet (empty), uploaded (`Some`), or refused by the device (`None`).
    Offered(OnceLock<Option<DeviceWeight>>),
    HostOnly,
}

impl Default for Residency {
    fn default() -> Residency {
        Residency::Offered(OnceLock::new())
    }
}

/// An upload, released from the device when dropped.
#[derive(Debug)]
pub struct DeviceWeight(WeightId);

impl DeviceWeight {
    pub fn id(&self) -> WeightId {
        self.0
    }

    /// Upload `matrix` to `device`.
    pub fn upload(
        device: &dyn Device,
        matrix: &RawMatrix<'_>,
    ) -> Result<DeviceWeight, DeviceError> {
        device.upload(matrix).map(DeviceWeight)
    }
}

impl Drop for DeviceWeight {
    fn drop(&mut self) {
        if let Some(active) = ACTIVE.get() {
            active.device.release(self.0);
        }
    }
}

/// `out = W . input` on the active device when there is one and it takes the matrix
/// (uploading it on first use); `false` when the CPU must compute it.
pub fn matmul<'a>(
    residency: &Residency,
    raw: impl FnOnce() -> RawMatrix<'a>,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) -> bool {
    let Residency::Offered(upload) = residency else {
        return false;
    };
    let Some(device) = dense_device() else {
        return false;
    };
    let weight = upload.get_or_init(|| match DeviceWeight::upload(device, &raw()) {
        Ok(weight) => Some(weight),
        Err(error) => {
            fell_back(error);
            None
        }
    });
    let Some(weight) = weight else {
        return false;
    };
    match device.matmul(weight.id(), input, n, out) {
        Ok(()) => true,
        Err(error) => {
            fell_back(error);
            false
        }
    }
}

/// RMSNorm on the active device, else on the CPU (see
/// [`layers::rms_norm`](crate::engines::layers::rms_norm)).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) -> bool {
    let Some(device) = dense_device() else {
        return false;
    };
    match device.rms_norm(x, weight, eps as f32, out) {
        Ok(()) => true,
        Err(error) => {
            fell_back(error);
            false
        }
    }
}
