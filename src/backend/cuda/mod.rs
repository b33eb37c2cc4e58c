//! The CUDA device, on cudarc with the driver and NVRTC loaded at run time: the binary
//! builds and starts without a CUDA toolkit, and `open` says which library or capability
//! is missing.
//!
//! The kernels (`kernels/cuda/coli.cu`) are compiled by NVRTC at `open` for the device's
//! virtual architecture (`compute_XY`, PTX that the driver finishes for the exact chip),
//! with IEEE division and square root and no flush-to-zero, and the PTX is cached under
//! `$XDG_CACHE_HOME/coli/cuda/` (or `~/.cache/coli/cuda/`) by architecture and source hash;
//! a cache that cannot be read or written only costs a compilation. The kernels use no
//! feature newer than sm_70 (warp shuffles with a mask), the minimum `open` accepts.
//!
//! One context, one stream, one lock: every operation takes the lock, stages its inputs in
//! pinned host memory, issues one copy in, its kernels and one copy out on the stream, and
//! waits once. Weights are copied once at upload with each row padded to 16 bytes (the
//! unit a kernel thread reads). This module computes and reports; what to do about an
//! error is [`backend`](super)'s decision.
//!
//! Three files: this one, the device (the driver, memory, the lock, the `Device`
//! methods); `plan`, what an operation stages and queues, decided by pure code apart from
//! the driver ([`MatmulPlan`] and [`GroupPlan`] write the staged bytes for buffers at given
//! device addresses and list the [`Step`]s to queue; the CPU emulation of the kernels,
//! `tests/gpu/cuda_kernels_emulated.rs`, runs the same bytes and steps); `compile`, the kernel
//! source and its NVRTC compilation and PTX cache.

mod compile;
mod plan;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{
    result as driver, sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr,
    DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{self, Ptx};

use super::{Device, DeviceError, DeviceMemory, ExpertGroup, RawMatrix, RawScales, WeightId};
pub use compile::{compile_kernels, KERNEL_NAMES, KERNEL_SOURCE};
use compile::{read_cached, write_cached};
use plan::{blocks, put_f32, round_up, Job, Sections, JOB_BYTES};
pub use plan::{format_code, Arg, GroupBuffers, GroupPlan, Layout, MatmulPlan, Placed, Step};

/// The oldest compute capability the kernels are written for.
pub const MIN_CAPABILITY: (i32, i32) = (7, 0);
/// Bytes of each of the two pinned halves that stream a weight to the device.
const UPLOAD_CHUNK: usize = 32 << 20;

/// `BACKEND=cuda`: see the module documentation.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The kernels of [`KERNEL_NAMES`], by name.
    kernels: Vec<(&'static str, CudaFunction)>,
    description: String,
    state: Mutex<State>,
}

/// Everything the lock guards: the weights and the reusable buffers.
struct State {
    weights: HashMap<WeightId, Weight>,
    next_id: WeightId,
    /// Inputs of one operation, laid out as the device reads them.
    staging: Pinned,
    /// Results of one operation on their way back.
    readback: Pinned,
    /// The two halves of `staging` an upload alternates between, and the copy each last fed.
    upload_done: [CudaEvent; 2],
    input: Scratch,
    gate: Scratch,
    up: Scratch,
    down: Scratch,
    output: Scratch,
}

impl State {
    /// Where the kernels find uploaded weight `id`.
    fn placed(&self, id: WeightId, stream: &CudaStream) -> Result<Placed, DeviceError> {
        let weight = self
            .weights
            .get(&id)
            .ok_or_else(|| DeviceError::Unsupported(format!("unknown weight {id}")))?;
        Ok(Placed {
            layout: weight.layout,
            data: device_address(&weight.data, stream),
            scales: weight
                .scales
                .as_ref()
                .map_or(0, |s| device_address(s, stream)),
        })
    }
}

/// An uploaded matrix.
struct Weight {
    data: CudaSlice<u8>,
    scales: Option<CudaSlice<u8>>,
    layout: Layout,
}

/// Page-locked host memory that grows to the largest request.
struct Pinned {
    ctx: Arc<CudaContext>,
    buffer: Option<PinnedHostSlice<u8>>,
    flags: u32,
}

impl Pinned {
    fn new(ctx: &Arc<CudaContext>, flags: u32) -> Pinned {
        Pinned {
            ctx: ctx.clone(),
            buffer: None,
            flags,
        }
    }

    fn get(&mut self, bytes: usize) -> Result<&mut [u8], DriverError> {
        if self.buffer.as_ref().is_none_or(|b| b.len() < bytes) {
            self.buffer = None;
            let len = bytes.next_power_of_two().max(1 << 20);
            // SAFETY: the bytes are written before they are read.
            self.buffer = Some(unsafe { self.ctx.alloc_pinned_with_flags(len, self.flags) }?);
        }
        let buffer = self.buffer.as_mut().expect("allocated above");
        Ok(&mut buffer.as_mut_slice()?[..bytes])
    }
}

/// A device buffer that grows to the largest request.
#[derive(Default)]
struct Scratch(Option<CudaSlice<u8>>);

impl Scratch {
    fn get(&mut self, stream: &Arc<CudaStream>, bytes: usize) -> Result<u64, DriverError> {
        if self.0.as_ref().is_none_or(|b| b.len() < bytes) {
            self.0 = None;
            let len = bytes.next_power_of_two().max(1 << 16);
            // SAFETY: every kernel writes what it later reads, or the memory is cleared first.
            self.0 = Some(unsafe { stream.alloc::<u8>(len) }?);
        }
        Ok(device_address(
            self.0.as_ref().expect("allocated above"),
            stream,
        ))
    }
}

fn device_address(slice: &CudaSlice<u8>, stream: &CudaStream) -> u64 {
    // Event tracking is off, so the guard records nothing.
    let (address, _guard) = slice.device_ptr(stream);
    address
}

fn describe(error: DriverError) -> String {
    let name = error
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", error.0));
    match error.error_string() {
        Ok(text) => format!("{name}: {}", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// A driver error after startup: the device must not be used again.
fn failed(what: &'static str) -> impl Fn(DriverError) -> DeviceError {
    move |error| DeviceError::Failed(anyhow!("CUDA {what}: {}", describe(error)))
}

fn launch_config(grid: (usize, usize), threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl CudaDevice {
    /// Start on the first CUDA device: load the driver, check the compute capability,
    /// compile (or read from the cache) and load the kernels.
    pub fn open() -> Result<CudaDevice> {
        // SAFETY: opens and closes the library only to see whether it exists, so that a
        // missing driver is an error here rather than a panic inside cudarc.
        if !unsafe { sys::is_culib_present() } {
            bail!(
                "the CUDA driver library libcuda.so was not found; install the NVIDIA driver, or add the directory holding libcuda.so.1 to LD_LIBRARY_PATH"
            );
        }
        match std::panic::catch_unwind(open_device) {
            Ok(device) => device,
            Err(_) => bail!(
                "the CUDA driver library lacks a function coli calls; update the NVIDIA driver to one for CUDA 12.2 or newer"
            ),
        }
    }

    /// Run `operation` under the lock, with the context bound to this thread. An operation
    /// that fails may leave copies queued that still read the pinned staging buffer, which
    /// the next operation rewrites (or frees, to grow it): the stream is drained before the
    /// lock is released.
    fn locked<T>(
        &self,
        operation: impl FnOnce(&mut State) -> Result<T, DeviceError>,
    ) -> Result<T, DeviceError> {
        let mut state = self.state.lock().map_err(|_| {
            DeviceError::Failed(anyhow!(
                "CUDA device state is unusable after a panic in another thread"
            ))
        })?;
        self.ctx.bind_to_thread().map_err(failed("context"))?;
        let result = operation(&mut state);
        if result.is_err() {
            // The operation's own error is the one to report.
            let _ = self.stream.synchronize();
        }
        result
    }

    /// Copy `staging[..bytes]` to the `input` buffer; returns its device address.
    fn send(&self, state: &mut State, bytes: usize) -> Result<u64, DeviceError> {
        let address = state
            .input
            .get(&self.stream, bytes)
            .map_err(failed("allocation"))?;
        let staged = state
            .staging
            .get(bytes)
            .map_err(failed("pinned allocation"))?;
        // SAFETY: `address` holds at least `bytes`; the staging memory stays untouched
        // until the stream is synchronised at the end of the operation (`locked` drains
        // the stream when an operation fails).
        unsafe { driver::memcpy_htod_async(address, &staged[..bytes], self.stream.cu_stream()) }
            .map_err(failed("copy to the device"))?;
        Ok(address)
    }

    /// Copy `out.len()` floats from `address` back, after everything queued before.
    fn receive(&self, state: &mut State, address: u64, out: &mut [f32]) -> Result<(), DeviceError> {
        let bytes = out.len() * 4;
        let landing = state
            .readback
            .get(bytes)
            .map_err(failed("pinned allocation"))?;
        // SAFETY: `address` holds `bytes` written by the kernels queued before.
        unsafe {
            driver::memcpy_dtoh_async(&mut landing[..bytes], address, self.stream.cu_stream())
        }
        .map_err(failed("copy from the device"))?;
        self.stream.synchronize().map_err(failed("kernel"))?;
        let landing = state
            .readback
            .get(bytes)
            .map_err(failed("pinned allocation"))?;
        bytemuck::cast_slice_mut::<f32, u8>(out).copy_from_slice(&landing[..bytes]);
        Ok(())
    }

    /// Queue `steps` on the stream.
    fn issue(&self, steps: &[Step]) -> Result<(), DeviceError> {
        for step in steps {
            match step {
                Step::Clear { address, bytes } => {
                    // SAFETY: the plans clear only buffers they sized to at least `bytes`.
                    unsafe {
                        driver::memset_d8_async(*address, 0, *bytes, self.stream.cu_stream())
                    }
                    .map_err(failed("clear"))?;
                }
                Step::Launch {
                    name,
                    grid,
                    threads,
                    args,
                } => {
                    let Some((_, kernel)) = self.kernels.iter().find(|(n, _)| n == name) else {
                        return Err(DeviceError::Failed(anyhow!("no CUDA kernel {name}")));
                    };
                    let mut launch = self.stream.launch_builder(kernel);
                    for arg in args {
                        match arg {
                            Arg::Address(value) => launch.arg(value),
                            Arg::Int(value) => launch.arg(value),
                            Arg::Float(value) => launch.arg(value),
                        };
                    }
                    // SAFETY: the plans give every kernel buffers that are live and large
                    // enough for the rows, columns and strides its arguments and jobs name.
                    unsafe { launch.launch(launch_config(*grid, *threads)) }.map_err(|error| {
                        DeviceError::Failed(anyhow!("CUDA {name} launch: {}", describe(error)))
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Device-to-device copy bandwidth in bytes per second: `bytes` copied `repeat` times
    /// between two buffers, timed on the stream (a benchmark probe).
    pub fn measure_copy(&self, bytes: usize, repeat: usize) -> Result<f64, DeviceError> {
        self.locked(|_| {
            // SAFETY: the copy only moves bytes; their values do not matter.
            let alloc = |len| unsafe { self.stream.alloc::<u8>(len) }.map_err(failed("allocation"));
            let (source, target) = (alloc(bytes)?, alloc(bytes)?);
            let (from, to) = (
                device_address(&source, &self.stream),
                device_address(&target, &self.stream),
            );
            let seconds_per_copy = self.timed(repeat, || {
                // SAFETY: both buffers hold `bytes`.
                unsafe { driver::memcpy_dtod_async(to, from, bytes, self.stream.cu_stream()) }
                    .map_err(failed("device copy"))
            })?;
            // A copy reads and writes every byte.
            Ok(2.0 * bytes as f64 / seconds_per_copy)
        })
    }

    /// Seconds one single-row matmul kernel takes on the device, averaged over `repeat`
    /// launches that cycle through `weights` (all of one width), so that a set larger than
    /// the L2 cache streams from memory (a benchmark probe).
    pub fn measure_matmul(&self, weights: &[WeightId], repeat: usize) -> Result<f64, DeviceError> {
        self.locked(|state| {
            let matrices: Vec<Placed> = weights
                .iter()
                .map(|&id| state.placed(id, &self.stream))
                .collect::<Result<_, _>>()?;
            let Some(first) = matrices.first() else {
                return Err(DeviceError::Unsupported("no weights to time".into()));
            };
            let cols = first.layout.cols;
            if matrices.iter().any(|m| m.layout.cols != cols) {
                return Err(DeviceError::Unsupported(
                    "timed weights must share a width".into(),
                ));
            }
            let xstride = round_up(cols, 32);
            let max_rows = matrices.iter().map(|m| m.layout.rows).max().unwrap_or(0);
            let sections = Sections::new(&[xstride * 4, matrices.len() * JOB_BYTES]);
            let input = state
                .input
                .get(&self.stream, sections.total)
                .map_err(failed("allocation"))?;
            let output = state
                .output
                .get(&self.stream, max_rows * 4)
                .map_err(failed("allocation"))?;
            let staged = state
                .staging
                .get(sections.total)
                .map_err(failed("pinned allocation"))?;
            staged[..xstride * 4].fill(0);
            for (k, &matrix) in matrices.iter().enumerate() {
                Job {
                    matrix,
                    x: input,
                    x_rows: 0,
                    y: output,
                    xstride,
                    ystride: matrix.layout.rows,
                    n: 1,
                    block0: 0,
                }
                .write(&mut staged[sections.offsets[1] + k * JOB_BYTES..]);
            }
            self.send(state, sections.total)?;
            let jobs = input + sections.offsets[1] as u64;
            let launches: Vec<Step> = matrices
                .iter()
                .enumerate()
                .map(|(k, m)| {
                    Step::matmul(jobs + (k * JOB_BYTES) as u64, 1, blocks(m.layout.rows), 1)
                })
                .collect();
            let mut k = 0;
            self.timed(repeat, || {
                k += 1;
                self.issue(std::slice::from_ref(&launches[k % launches.len()]))
            })
        })
    }

    /// Run `step` `repeat` times (after one untimed warm-up) between two timing events;
    /// the mean seconds of one step.
    fn timed(
        &self,
        repeat: usize,
        mut step: impl FnMut() -> Result<(), DeviceError>,
    ) -> Result<f64, DeviceError> {
        let event = || {
            self.ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(failed("event"))
        };
        let (start, end) = (event()?, event()?);
        step()?;
        start.record(&self.stream).map_err(failed("event"))?;
        for _ in 0..repeat {
            step()?;
        }
        end.record(&self.stream).map_err(failed("event"))?;
        end.synchronize().map_err(failed("kernel"))?;
        let ms = start.elapsed_ms(&end).map_err(failed("event"))?;
        Ok(f64::from(ms) / 1000.0 / repeat.max(1) as f64)
    }
}

fn open_device() -> Result<CudaDevice> {
    let start = |error: DriverError| {
        anyhow!(
            "the CUDA driver did not start ({}); check that nvidia-smi lists a GPU and that this process may use it",
            describe(error)
        )
    };
    driver::init().map_err(start)?;
    if driver::device::get_count().map_err(start)? == 0 {
        bail!("the CUDA driver found no device");
    }
    let ctx = CudaContext::new(0).map_err(start)?;
    let name = ctx.name().map_err(start)?;
    let (major, minor) = ctx.compute_capability().map_err(start)?;
    if (major, minor) < MIN_CAPABILITY {
        bail!(
            "{name} has compute capability {major}.{minor}; the kernels need {}.{} or newer",
            MIN_CAPABILITY.0,
            MIN_CAPABILITY.1
        );
    }
    // SAFETY: set before any buffer exists. Everything runs on one stream, in order, so no
    // buffer needs the per-use events cudarc records for work spread over several streams.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(start)?;
    let (module, arch) = load_kernels(&ctx, (major * 10 + minor) as u32)?;
    let function = |name: &str| {
        module
            .load_function(name)
            .map_err(|e| anyhow!("kernel {name} missing: {}", describe(e)))
    };
    let kernels = KERNEL_NAMES
        .iter()
        .map(|&name| Ok((name, function(name)?)))
        .collect::<Result<_>>()?;
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }
        .result()
        .map_err(start)?;
    let description = format!(
        "CUDA: {name} (compute {major}.{minor}, driver {}.{}, kernels compute_{arch})",
        version / 1000,
        version % 1000 / 10
    );
    let event = || ctx.new_event(None).map_err(start);
    let state = State {
        weights: HashMap::new(),
        next_id: 1,
        staging: Pinned::new(&ctx, sys::CU_MEMHOSTALLOC_WRITECOMBINED),
        readback: Pinned::new(&ctx, 0),
        upload_done: [event()?, event()?],
        input: Scratch::default(),
        gate: Scratch::default(),
        up: Scratch::default(),
        down: Scratch::default(),
        output: Scratch::default(),
    };
    Ok(CudaDevice {
        ctx,
        stream,
        kernels,
        description,
        state: Mutex::new(state),
    })
}

/// The kernels as a loaded module, from the PTX cache or NVRTC; and the architecture
/// they were compiled for. A device newer than NVRTC knows gets PTX for the newest
/// architecture NVRTC accepts, which the driver compiles forward.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    device_arch: u32,
) -> Result<(Arc<cudarc::driver::CudaModule>, u32)> {
    let mut arches = vec![device_arch];
    arches.extend(
        [90, 89, 86, 80, 75, 70]
            .into_iter()
            .filter(|&a| a < device_arch),
    );
    for &arch in &arches {
        if let Some(ptx) = read_cached(arch) {
            if let Ok(module) = ctx.load_module(Ptx::from_src(ptx)) {
                return Ok((module, arch));
            }
        }
    }
    // SAFETY: opens and closes the library only to see whether it exists.
    if !unsafe { nvrtc::sys::is_culib_present() } {
        bail!(
            "the NVRTC library libnvrtc.so was not found, and the kernels must be compiled once per GPU; install the CUDA toolkit or the nvidia-cuda-nvrtc package and add the directory holding libnvrtc.so.12 to LD_LIBRARY_PATH"
        );
    }
    let mut first_error = None;
    for &arch in &arches {
        match compile_kernels(arch) {
            Ok(ptx) => {
                let module = ctx.load_module(Ptx::from_src(ptx.clone())).map_err(|e| {
                    anyhow!(
                        "the driver refused the kernels NVRTC compiled for compute_{arch} ({}); a driver older than the NVRTC library cannot load its PTX: update the driver or use the NVRTC of the driver's CUDA version",
                        describe(e)
                    )
                })?;
                write_cached(arch, &ptx);
                return Ok((module, arch));
            }
            Err(error) => {
                first_error.get_or_insert(error);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| anyhow!("no architecture to compile for")))
}

impl Device for CudaDevice {
    fn description(&self) -> String {
        self.description.clone()
    }

    fn memory(&self) -> DeviceMemory {
        match self.ctx.mem_get_info() {
            Ok((free, total)) => DeviceMemory {
                free: free as u64,
                total: total as u64,
            },
            Err(_) => DeviceMemory { free: 0, total: 0 },
        }
    }

    fn upload(&self, matrix: &RawMatrix<'_>) -> Result<WeightId, DeviceError> {
        let layout = Layout::of(matrix)?;
        self.locked(|state| {
            // SAFETY: every byte is written by the copies below before a kernel reads it.
            let data = unsafe { self.stream.alloc::<u8>(layout.rows * layout.stride) }
                .map_err(failed("weight allocation"))?;
            let address = device_address(&data, &self.stream);
            let chunk_rows = (UPLOAD_CHUNK / layout.stride).max(1);
            let half = chunk_rows * layout.stride;
            for (k, first) in (0..layout.rows).step_by(chunk_rows).enumerate() {
                let count = chunk_rows.min(layout.rows - first);
                let side = k % 2;
                if k >= 2 {
                    // The copy queued two chunks ago read this half.
                    state.upload_done[side]
                        .synchronize()
                        .map_err(failed("weight copy"))?;
                }
                let staged = state
                    .staging
                    .get(2 * half)
                    .map_err(failed("pinned allocation"))?;
                let staged = &mut staged[side * half..][..count * layout.stride];
                layout.pad_rows(
                    &matrix.data[first * layout.row_bytes..][..count * layout.row_bytes],
                    staged,
                );
                let target = address + (first * layout.stride) as u64;
                // SAFETY: the target range lies inside `data`; this half of the staging
                // buffer is not written again until `upload_done[side]` has passed.
                unsafe { driver::memcpy_htod_async(target, &*staged, self.stream.cu_stream()) }
                    .map_err(failed("weight copy"))?;
                state.upload_done[side]
                    .record(&self.stream)
                    .map_err(failed("weight copy"))?;
            }
            let scale_bytes: &[u8] = match matrix.scales {
                RawScales::None => &[],
                RawScales::F32(scales) => bytemuck::cast_slice(scales),
                RawScales::E8m0(scales) => scales,
            };
            let scales = if scale_bytes.is_empty() {
                None
            } else {
                // SAFETY: written by the copy below.
                let scales = unsafe { self.stream.alloc::<u8>(scale_bytes.len()) }
                    .map_err(failed("scale allocation"))?;
                let target = device_address(&scales, &self.stream);
                // SAFETY: `scales` holds `scale_bytes.len()` bytes; the stream is
                // synchronised below, before the borrowed source can go away.
                unsafe { driver::memcpy_htod_async(target, scale_bytes, self.stream.cu_stream()) }
                    .map_err(failed("scale copy"))?;
                Some(scales)
            };
            self.stream.synchronize().map_err(failed("weight copy"))?;
            let id = state.next_id;
            state.next_id += 1;
            state.weights.insert(
                id,
                Weight {
                    data,
                    scales,
                    layout,
                },
            );
            Ok(id)
        })
    }

    fn release(&self, weight: WeightId) {
        let _ = self.locked(|state| {
            state.weights.remove(&weight);
            Ok(())
        });
    }

    fn matmul(
        &self,
        weight: WeightId,
        input: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        self.locked(|state| {
            let matrix = state.placed(weight, &self.stream)?;
            let (rows, cols) = (matrix.layout.rows, matrix.layout.cols);
            if input.len() != n * cols || out.len() != n * rows {
                return Err(DeviceError::Unsupported(format!(
                    "matmul of a {rows}x{cols} matrix with {} inputs and {} outputs for n = {n}",
                    input.len(),
                    out.len()
                )));
            }
            if n == 0 {
                return Ok(());
            }
            let plan = MatmulPlan::new(matrix, n)?;
            let staged = state
                .input
                .get(&self.stream, plan.staged_bytes())
                .map_err(failed("allocation"))?;
            let output = state
                .output
                .get(&self.stream, plan.output_bytes())
                .map_err(failed("allocation"))?;
            let bytes = state
                .staging
                .get(plan.staged_bytes())
                .map_err(failed("pinned allocation"))?;
            plan.write(input, staged, output, bytes);
            self.send(state, plan.staged_bytes())?;
            self.issue(&plan.steps(staged))?;
            self.receive(state, output, out)
        })
    }

    fn rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let width = weight.len();
        let rows = super::rms_norm_rows(x, weight, out)?;
        if rows == 0 {
            return Ok(());
        }
        if width > i32::MAX as usize {
            return Err(DeviceError::Unsupported(format!(
                "RMSNorm rows of {width} values"
            )));
        }
        self.locked(|state| {
            let sections = Sections::new(&[x.len() * 4, width * 4]);
            let staged = state
                .staging
                .get(sections.total)
                .map_err(failed("pinned allocation"))?;
            put_f32(&mut staged[sections.offsets[0]..], x);
            put_f32(&mut staged[sections.offsets[1]..], weight);
            let input = self.send(state, sections.total)?;
            let output = state
                .output
                .get(&self.stream, x.len() * 4)
                .map_err(failed("allocation"))?;
            let weights = input + sections.offsets[1] as u64;
            self.issue(&[Step::rms_norm(input, weights, output, rows, width, eps)])?;
            self.receive(state, output, out)
        })
    }

    fn expert_group(&self, group: &ExpertGroup<'_>, out: &mut [f32]) -> Result<(), DeviceError> {
        let out_len = out.len();
        self.locked(|state| {
            let Some(plan) = GroupPlan::new(group, out_len, |id| state.placed(id, &self.stream))?
            else {
                out.fill(0.0);
                return Ok(());
            };
            let alloc = |scratch: &mut Scratch, bytes| {
                scratch
                    .get(&self.stream, bytes)
                    .map_err(failed("allocation"))
            };
            let at = GroupBuffers {
                staged: alloc(&mut state.input, plan.staged_bytes())?,
                gate: alloc(&mut state.gate, plan.hidden_bytes())?,
                up: alloc(&mut state.up, plan.hidden_bytes())?,
                down: alloc(&mut state.down, plan.down_bytes())?,
                output: alloc(&mut state.output, plan.output_bytes())?,
            };
            let bytes = state
                .staging
                .get(plan.staged_bytes())
                .map_err(failed("pinned allocation"))?;
            plan.write(&at, bytes);
            self.send(state, plan.staged_bytes())?;
            self.issue(&plan.steps(&at))?;
            self.receive(state, at.output, out)
        })
    }
}
