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

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{
    result as driver, sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr,
    DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{self, CompileOptions, Ptx};

use super::{
    Activation, Device, DeviceError, DeviceMemory, ExpertGroup, RawMatrix, RawScales, WeightId,
};
use crate::quant::Format;

/// The kernel source, compiled by NVRTC when the device opens.
pub const KERNEL_SOURCE: &str = include_str!("../../kernels/cuda/coli.cu");

/// The kernels `open` loads from [`KERNEL_SOURCE`].
pub const KERNEL_NAMES: [&str; 5] = ["matmul_1", "matmul_8", "rms_norm", "glu", "combine"];

/// The oldest compute capability the kernels are written for.
pub const MIN_CAPABILITY: (i32, i32) = (7, 0);

/// Output rows per matmul block (one warp each); `WARPS` in the kernel source.
const WARPS: usize = 8;
/// Input rows per block row in the batched matmul kernel (`matmul_8`).
const TILE: usize = 8;
/// Bytes of one `Job` in the kernel source.
const JOB_BYTES: usize = 80;
/// Threads per block of the element-wise kernels and RMSNorm.
const THREADS: u32 = 256;
/// Each host-to-device section starts on this boundary (the kernels read float4 and
/// 8-byte fields).
const SECTION_ALIGN: usize = 256;
/// Bytes of each of the two pinned halves that stream a weight to the device.
const UPLOAD_CHUNK: usize = 32 << 20;

/// The kernel's `FMT_*` code for a format it computes (`None`: no kernel).
pub fn format_code(format: Format) -> Option<i32> {
    Some(match format {
        Format::F32 => 0,
        Format::Bf16 => 1,
        Format::F16 => 2,
        Format::Int8Row => 3,
        Format::Int4Row => 4,
        Format::Int4Grouped { .. } => 5,
        Format::Fp8E4m3B128 => 6,
        Format::Mxfp4 => 7,
        Format::Int2Row | Format::Int3G64 | Format::E8Iq3Lattice => return None,
    })
}

/// `value` rounded up to a multiple of `to`.
fn round_up(value: usize, to: usize) -> usize {
    value.div_ceil(to) * to
}

/// `BACKEND=cuda`: see the module documentation.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
    description: String,
    state: Mutex<State>,
}

struct Kernels {
    matmul_1: CudaFunction,
    matmul_8: CudaFunction,
    rms_norm: CudaFunction,
    glu: CudaFunction,
    combine: CudaFunction,
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

/// An uploaded matrix.
struct Weight {
    data: CudaSlice<u8>,
    scales: Option<CudaSlice<u8>>,
    layout: Layout,
}

/// How a matrix sits on the device.
#[derive(Debug, Clone, Copy)]
struct Layout {
    code: i32,
    rows: usize,
    cols: usize,
    /// Bytes of one row as the host holds it.
    row_bytes: usize,
    /// Bytes of one row on the device: `row_bytes` padded to 16.
    stride: usize,
    /// The int4-grouped group size (0 for other formats).
    group: usize,
    /// Scales per row (per 128-row block for fp8; 0 for per-row and float formats).
    per_row: usize,
}

impl Layout {
    fn of(matrix: &RawMatrix<'_>) -> Result<Layout, DeviceError> {
        let (rows, cols) = (matrix.rows, matrix.cols);
        let unsupported = |why: String| {
            Err(DeviceError::Unsupported(format!(
                "{} matrix {rows}x{cols}: {why}",
                matrix.format
            )))
        };
        let Some(code) = format_code(matrix.format) else {
            return unsupported("no CUDA kernel for this format".into());
        };
        if rows == 0 || cols == 0 {
            return unsupported("an empty matrix".into());
        }
        let nibbles = cols.div_ceil(2);
        let (row_bytes, group, per_row, scale_count) = match matrix.format {
            Format::F32 => (cols * 4, 0, 0, 0),
            Format::Bf16 | Format::F16 => (cols * 2, 0, 0, 0),
            Format::Int8Row => (cols, 0, 0, rows),
            Format::Int4Row => (nibbles, 0, 0, rows),
            Format::Int4Grouped { group } => {
                if group == 0 || !group.is_multiple_of(8) {
                    return unsupported(format!("group size {group} is not a multiple of 8"));
                }
                let per_row = cols.div_ceil(group);
                (nibbles, group, per_row, rows * per_row)
            }
            Format::Fp8E4m3B128 => {
                let per_row = cols.div_ceil(128);
                (cols, 0, per_row, rows.div_ceil(128) * per_row)
            }
            Format::Mxfp4 => {
                let per_row = cols.div_ceil(32);
                (nibbles, 0, per_row, rows * per_row)
            }
            Format::Int2Row | Format::Int3G64 | Format::E8Iq3Lattice => {
                return unsupported("no CUDA kernel for this format".into())
            }
        };
        if matrix.data.len() != rows * row_bytes {
            return unsupported(format!(
                "{} data bytes, expected {rows} rows of {row_bytes}",
                matrix.data.len()
            ));
        }
        let scales_found = match matrix.scales {
            RawScales::None => 0,
            RawScales::F32(scales) => scales.len(),
            RawScales::E8m0(scales) => scales.len(),
        };
        let kind_matches = match matrix.scales {
            RawScales::None => scale_count == 0,
            RawScales::F32(_) => scale_count > 0 && matrix.format != Format::Mxfp4,
            RawScales::E8m0(_) => matrix.format == Format::Mxfp4,
        };
        if !kind_matches || scales_found != scale_count {
            return unsupported(format!(
                "{scales_found} scales of the wrong count or kind, expected {scale_count}"
            ));
        }
        let stride = round_up(row_bytes, 16);
        // The kernels index with 32-bit row and column numbers.
        if rows > i32::MAX as usize
            || round_up(cols, 32) > i32::MAX as usize
            || stride > i32::MAX as usize
        {
            return unsupported("too large for 32-bit indexing".into());
        }
        Ok(Layout {
            code,
            rows,
            cols,
            row_bytes,
            stride,
            group,
            per_row,
        })
    }
}

/// One product the matmul kernels compute; written in the kernel's `struct Job` layout.
struct Job {
    weight: u64,
    scales: u64,
    x: u64,
    x_rows: u64,
    y: u64,
    layout: Layout,
    xstride: usize,
    ystride: usize,
    n: usize,
    block0: usize,
}

impl Job {
    /// Five device pointers, then ten `int`s, little-endian: 80 bytes.
    fn write(&self, out: &mut [u8]) {
        let pointers = [self.weight, self.scales, self.x, self.x_rows, self.y];
        let layout = &self.layout;
        let ints = [
            layout.code as usize,
            layout.rows,
            layout.cols,
            layout.stride,
            layout.group,
            layout.per_row,
            self.xstride,
            self.ystride,
            self.n,
            self.block0,
        ];
        let (head, tail) = out[..JOB_BYTES].split_at_mut(40);
        for (slot, value) in head.chunks_exact_mut(8).zip(pointers) {
            slot.copy_from_slice(&value.to_le_bytes());
        }
        for (slot, value) in tail.chunks_exact_mut(4).zip(ints) {
            slot.copy_from_slice(&(value as i32).to_le_bytes());
        }
    }

    /// Matmul blocks this job needs along grid x.
    fn blocks(&self) -> usize {
        self.layout.rows.div_ceil(WARPS)
    }
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

/// Where each section of one operation's inputs starts in the staging buffer.
struct Sections {
    offsets: Vec<usize>,
    total: usize,
}

impl Sections {
    fn new(sizes: &[usize]) -> Sections {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0;
        for &size in sizes {
            offsets.push(total);
            total = round_up(total + size, SECTION_ALIGN);
        }
        Sections { offsets, total }
    }
}

fn put_f32(out: &mut [u8], values: &[f32]) {
    out[..values.len() * 4].copy_from_slice(bytemuck::cast_slice(values));
}

fn put_i32(out: &mut [u8], values: &[i32]) {
    out[..values.len() * 4].copy_from_slice(bytemuck::cast_slice(values));
}

/// `rows` rows of `width` floats, each padded with zeros to `stride` floats.
fn put_rows(out: &mut [u8], values: &[f32], width: usize, stride: usize) {
    for (row, values) in out
        .chunks_exact_mut(stride * 4)
        .zip(values.chunks_exact(width))
    {
        put_f32(row, values);
        row[width * 4..].fill(0);
    }
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

/// Grid y and the combine kernel's rows are limited to this.
const GRID_Y_MAX: usize = 65535;

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

    fn lock(&self) -> Result<MutexGuard<'_, State>, DeviceError> {
        let state = self.state.lock().map_err(|_| {
            DeviceError::Failed(anyhow!(
                "CUDA device state is unusable after a panic in another thread"
            ))
        })?;
        self.ctx.bind_to_thread().map_err(failed("context"))?;
        Ok(state)
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
        // until the stream is synchronised at the end of the operation.
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

    fn launch_matmul(
        &self,
        jobs: u64,
        count: usize,
        blocks: usize,
        max_n: usize,
    ) -> Result<(), DeviceError> {
        let (kernel, tile) = if max_n == 1 {
            (&self.kernels.matmul_1, 1)
        } else {
            (&self.kernels.matmul_8, TILE)
        };
        let count = count as i32;
        let config = launch_config((blocks, max_n.div_ceil(tile)), (WARPS * 32) as u32);
        // SAFETY: `jobs` holds `count` jobs whose buffers are live and large enough for
        // the rows, columns and strides they name (checked by the callers).
        unsafe {
            self.stream
                .launch_builder(kernel)
                .arg(&jobs)
                .arg(&count)
                .launch(config)
        }
        .map(|_| ())
        .map_err(failed("matmul launch"))
    }

    /// Device-to-device copy bandwidth in bytes per second: `bytes` copied `repeat` times
    /// between two buffers, timed on the stream (a benchmark probe).
    pub fn measure_copy(&self, bytes: usize, repeat: usize) -> Result<f64, DeviceError> {
        let _serialised = self.lock()?;
        // SAFETY: the copy only moves bytes; their values do not matter.
        let alloc = |len| unsafe { self.stream.alloc::<u8>(len) }.map_err(failed("allocation"));
        let (source, target) = (alloc(bytes)?, alloc(bytes)?);
        let (from, to) = (
            device_address(&source, &self.stream),
            device_address(&target, &self.stream),
        );
        let seconds = self.timed(repeat, || {
            // SAFETY: both buffers hold `bytes`.
            unsafe { driver::memcpy_dtod_async(to, from, bytes, self.stream.cu_stream()) }
                .map_err(failed("device copy"))
        })?;
        // A copy reads and writes every byte.
        Ok(2.0 * bytes as f64 / seconds)
    }

    /// Seconds one single-row matmul kernel takes on the device, averaged over `repeat`
    /// launches that cycle through `weights` (all of one width), so that a set larger than
    /// the L2 cache streams from memory (a benchmark probe).
    pub fn measure_matmul(&self, weights: &[WeightId], repeat: usize) -> Result<f64, DeviceError> {
        let mut state = self.lock()?;
        let layouts: Vec<(Layout, u64, u64)> = weights
            .iter()
            .map(|id| {
                state
                    .weights
                    .get(id)
                    .map(|w| {
                        let scales = w
                            .scales
                            .as_ref()
                            .map_or(0, |s| device_address(s, &self.stream));
                        (w.layout, device_address(&w.data, &self.stream), scales)
                    })
                    .ok_or_else(|| DeviceError::Unsupported(format!("unknown weight {id}")))
            })
            .collect::<Result<_, _>>()?;
        let Some(&(first, ..)) = layouts.first() else {
            return Err(DeviceError::Unsupported("no weights to time".into()));
        };
        let xstride = round_up(first.cols, 32);
        let max_rows = layouts.iter().map(|(l, ..)| l.rows).max().unwrap_or(0);
        let sections = Sections::new(&[xstride * 4, layouts.len() * JOB_BYTES]);
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
        for (k, &(layout, weight, scales)) in layouts.iter().enumerate() {
            if layout.cols != first.cols {
                return Err(DeviceError::Unsupported(
                    "timed weights must share a width".into(),
                ));
            }
            Job {
                weight,
                scales,
                x: input,
                x_rows: 0,
                y: output,
                layout,
                xstride,
                ystride: layout.rows,
                n: 1,
                block0: 0,
            }
            .write(&mut staged[sections.offsets[1] + k * JOB_BYTES..]);
        }
        self.send(&mut state, sections.total)?;
        let jobs = input + sections.offsets[1] as u64;
        let mut k = 0;
        let seconds = self.timed(repeat, || {
            let (layout, ..) = layouts[k % layouts.len()];
            let job = jobs + (k % layouts.len() * JOB_BYTES) as u64;
            k += 1;
            self.launch_matmul(job, 1, layout.rows.div_ceil(WARPS), 1)
        })?;
        Ok(seconds / repeat as f64)
    }

    /// Run `step` `repeat` times between two timing events; seconds for all of them.
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
        Ok(f64::from(ms) / 1000.0)
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
    let kernels = Kernels {
        matmul_1: function("matmul_1")?,
        matmul_8: function("matmul_8")?,
        rms_norm: function("rms_norm")?,
        glu: function("glu")?,
        combine: function("combine")?,
    };
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

fn read_cached(arch: u32) -> Option<String> {
    std::fs::read_to_string(cache_path(arch)?).ok()
}

/// Best effort: a cache that cannot be written only costs the next start a compilation.
fn write_cached(arch: u32, ptx: &str) {
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
        let mut state = self.lock()?;
        let state = &mut *state;
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
            let source = &matrix.data[first * layout.row_bytes..][..count * layout.row_bytes];
            for (row, source) in staged
                .chunks_exact_mut(layout.stride)
                .zip(source.chunks_exact(layout.row_bytes))
            {
                row[..layout.row_bytes].copy_from_slice(source);
                row[layout.row_bytes..].fill(0);
            }
            let target = address + (first * layout.stride) as u64;
            // SAFETY: the target range lies inside `data`; this half of the staging buffer
            // is not written again until `upload_done[side]` has passed.
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
            // SAFETY: `scales` holds `scale_bytes.len()` bytes; the stream is synchronised
            // below, before the borrowed source can go away.
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
    }

    fn release(&self, weight: WeightId) {
        if let Ok(mut state) = self.lock() {
            state.weights.remove(&weight);
        }
    }

    fn matmul(
        &self,
        weight: WeightId,
        input: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let mut state = self.lock()?;
        let Some(w) = state.weights.get(&weight) else {
            return Err(DeviceError::Unsupported(format!("unknown weight {weight}")));
        };
        let layout = w.layout;
        let (weight_address, scales) = (
            device_address(&w.data, &self.stream),
            w.scales
                .as_ref()
                .map_or(0, |s| device_address(s, &self.stream)),
        );
        if input.len() != n * layout.cols || out.len() != n * layout.rows {
            return Err(DeviceError::Unsupported(format!(
                "matmul of a {}x{} matrix with {} inputs and {} outputs for n = {n}",
                layout.rows,
                layout.cols,
                input.len(),
                out.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        if n.div_ceil(TILE) > GRID_Y_MAX {
            return Err(DeviceError::Unsupported(format!("{n} input rows")));
        }
        let xstride = round_up(layout.cols, 32);
        let sections = Sections::new(&[n * xstride * 4, JOB_BYTES]);
        let input_address = state
            .input
            .get(&self.stream, sections.total)
            .map_err(failed("allocation"))?;
        let output = state
            .output
            .get(&self.stream, n * layout.rows * 4)
            .map_err(failed("allocation"))?;
        let staged = state
            .staging
            .get(sections.total)
            .map_err(failed("pinned allocation"))?;
        put_rows(&mut staged[..n * xstride * 4], input, layout.cols, xstride);
        Job {
            weight: weight_address,
            scales,
            x: input_address,
            x_rows: 0,
            y: output,
            layout,
            xstride,
            ystride: layout.rows,
            n,
            block0: 0,
        }
        .write(&mut staged[sections.offsets[1]..]);
        self.send(&mut state, sections.total)?;
        let jobs = input_address + sections.offsets[1] as u64;
        self.launch_matmul(jobs, 1, layout.rows.div_ceil(WARPS), n)?;
        self.receive(&mut state, output, out)
    }

    fn rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let width = weight.len();
        if width == 0 || !x.len().is_multiple_of(width) || out.len() != x.len() {
            return Err(DeviceError::Unsupported(format!(
                "RMSNorm of {} values of width {width} into {}",
                x.len(),
                out.len()
            )));
        }
        let rows = x.len() / width;
        if rows == 0 {
            return Ok(());
        }
        let mut state = self.lock()?;
        let sections = Sections::new(&[x.len() * 4, width * 4]);
        let staged = state
            .staging
            .get(sections.total)
            .map_err(failed("pinned allocation"))?;
        put_f32(&mut staged[sections.offsets[0]..], x);
        put_f32(&mut staged[sections.offsets[1]..], weight);
        let input = self.send(&mut state, sections.total)?;
        let output = state
            .output
            .get(&self.stream, x.len() * 4)
            .map_err(failed("allocation"))?;
        let weights = input + sections.offsets[1] as u64;
        let width = width as i32;
        // SAFETY: `input` holds `rows x width` floats and then the weight; `output` holds
        // `rows x width` floats.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.rms_norm)
                .arg(&input)
                .arg(&weights)
                .arg(&output)
                .arg(&width)
                .arg(&eps)
                .launch(launch_config((rows, 1), THREADS))
        }
        .map_err(failed("RMSNorm launch"))?;
        self.receive(&mut state, output, out)
    }

    fn expert_group(&self, group: &ExpertGroup<'_>, out: &mut [f32]) -> Result<(), DeviceError> {
        let (rows, width) = (group.rows, group.width);
        if group.input.len() != rows * width || out.len() != rows * width {
            return Err(DeviceError::Unsupported(format!(
                "expert group of {rows} rows of width {width} with {} inputs and {} outputs",
                group.input.len(),
                out.len()
            )));
        }
        let experts: Vec<_> = group
            .experts
            .iter()
            .filter(|e| !e.rows.is_empty())
            .collect();
        let slots: usize = experts.iter().map(|e| e.rows.len()).sum();
        if slots == 0 {
            out.fill(0.0);
            return Ok(());
        }
        if rows > GRID_Y_MAX {
            return Err(DeviceError::Unsupported(format!(
                "{rows} rows in one group"
            )));
        }
        let mut state = self.lock()?;

        // Every expert's three matrices, checked against the group's shape.
        let mut matrices = Vec::with_capacity(experts.len());
        for expert in &experts {
            let find = |id: WeightId| {
                state
                    .weights
                    .get(&id)
                    .map(|w| {
                        let scales = w
                            .scales
                            .as_ref()
                            .map_or(0, |s| device_address(s, &self.stream));
                        (w.layout, device_address(&w.data, &self.stream), scales)
                    })
                    .ok_or_else(|| DeviceError::Unsupported(format!("unknown weight {id}")))
            };
            let (gate, up, down) = (find(expert.gate)?, find(expert.up)?, find(expert.down)?);
            let inter = gate.0.rows;
            let fits = gate.0.cols == width
                && up.0.cols == width
                && up.0.rows == inter
                && down.0.cols == inter
                && down.0.rows == width
                && expert.rows.iter().all(|&(row, _)| row < rows);
            if !fits {
                return Err(DeviceError::Unsupported(format!(
                    "expert of gate {}x{}, up {}x{}, down {}x{} in a group of width {width} and {rows} rows",
                    gate.0.rows, gate.0.cols, up.0.rows, up.0.cols, down.0.rows, down.0.cols
                )));
            }
            matrices.push([gate, up, down]);
        }
        let inter_stride = round_up(
            matrices
                .iter()
                .map(|[gate, ..]| gate.0.rows)
                .max()
                .unwrap_or(0),
            32,
        );
        let xstride = round_up(width, 32);
        if slots * inter_stride > i32::MAX as usize {
            return Err(DeviceError::Unsupported(format!(
                "{slots} expert rows of width {inter_stride}"
            )));
        }

        // Slots: the expert rows in expert order; each output row's entries (slot,
        // weight) in expert order, as compressed rows.
        let mut slot_rows = Vec::with_capacity(slots);
        let mut first_slot = Vec::with_capacity(experts.len());
        let mut row_start = vec![0i32; rows + 1];
        for expert in &experts {
            first_slot.push(slot_rows.len());
            for &(row, _) in expert.rows {
                slot_rows.push(row as i32);
                row_start[row + 1] += 1;
            }
        }
        for r in 0..rows {
            row_start[r + 1] += row_start[r];
        }
        let mut next: Vec<usize> = row_start[..rows].iter().map(|&s| s as usize).collect();
        let mut entry_slot = vec![0i32; slots];
        let mut entry_weight = vec![0f32; slots];
        let mut slot = 0i32;
        for expert in &experts {
            for &(row, weight) in expert.rows {
                entry_slot[next[row]] = slot;
                entry_weight[next[row]] = weight;
                next[row] += 1;
                slot += 1;
            }
        }

        let sections = Sections::new(&[
            rows * xstride * 4,
            slots * 4,
            2 * experts.len() * JOB_BYTES,
            experts.len() * JOB_BYTES,
            (rows + 1) * 4,
            slots * 4,
            slots * 4,
        ]);
        let at = &sections.offsets;
        let input = state
            .input
            .get(&self.stream, sections.total)
            .map_err(failed("allocation"))?;
        let hidden_bytes = slots * inter_stride * 4;
        let gate_out = state
            .gate
            .get(&self.stream, hidden_bytes)
            .map_err(failed("allocation"))?;
        let up_out = state
            .up
            .get(&self.stream, hidden_bytes)
            .map_err(failed("allocation"))?;
        let down_out = state
            .down
            .get(&self.stream, slots * width * 4)
            .map_err(failed("allocation"))?;
        let output = state
            .output
            .get(&self.stream, rows * width * 4)
            .map_err(failed("allocation"))?;
        let address = |section: usize| input + at[section] as u64;

        let staged = state
            .staging
            .get(sections.total)
            .map_err(failed("pinned allocation"))?;
        put_rows(
            &mut staged[at[0]..at[0] + rows * xstride * 4],
            group.input,
            width,
            xstride,
        );
        put_i32(&mut staged[at[1]..], &slot_rows);
        let (mut gate_up_blocks, mut down_blocks, mut max_n) = (0, 0, 0);
        for (k, (matrices, &first)) in matrices.iter().zip(&first_slot).enumerate() {
            let n = experts[k].rows.len();
            max_n = max_n.max(n);
            let [gate, up, down] = *matrices;
            for (j, ((layout, weight, scales), y)) in
                [(gate, gate_out), (up, up_out)].into_iter().enumerate()
            {
                let job = Job {
                    weight,
                    scales,
                    x: address(0),
                    x_rows: address(1) + (first * 4) as u64,
                    y: y + (first * inter_stride * 4) as u64,
                    layout,
                    xstride,
                    ystride: inter_stride,
                    n,
                    block0: gate_up_blocks,
                };
                gate_up_blocks += job.blocks();
                job.write(&mut staged[at[2] + (2 * k + j) * JOB_BYTES..]);
            }
            let (layout, weight, scales) = down;
            let job = Job {
                weight,
                scales,
                x: gate_out + (first * inter_stride * 4) as u64,
                x_rows: 0,
                y: down_out + (first * width * 4) as u64,
                layout,
                xstride: inter_stride,
                ystride: width,
                n,
                block0: down_blocks,
            };
            down_blocks += job.blocks();
            job.write(&mut staged[at[3] + k * JOB_BYTES..]);
        }
        put_i32(&mut staged[at[4]..], &row_start);
        put_i32(&mut staged[at[5]..], &entry_slot);
        put_f32(&mut staged[at[6]..], &entry_weight);
        if max_n.div_ceil(TILE) > GRID_Y_MAX {
            return Err(DeviceError::Unsupported(format!(
                "{max_n} rows for one expert"
            )));
        }
        self.send(&mut state, sections.total)?;

        let stream = self.stream.cu_stream();
        // SAFETY: both buffers hold `hidden_bytes`. Columns past an expert's width must
        // read as zero in the down product's input.
        unsafe {
            driver::memset_d8_async(gate_out, 0, hidden_bytes, stream)
                .and_then(|()| driver::memset_d8_async(up_out, 0, hidden_bytes, stream))
        }
        .map_err(failed("clear"))?;
        self.launch_matmul(address(2), 2 * experts.len(), gate_up_blocks, max_n)?;
        let count = (slots * inter_stride) as i32;
        let (kind, beta, linear_beta, has_linear_beta) = match group.activation {
            Activation::SwiGlu => (0i32, 0f32, 0f32, 0i32),
            Activation::Situ(situ) => (
                1,
                situ.beta,
                situ.linear_beta.unwrap_or(0.0),
                i32::from(situ.linear_beta.is_some()),
            ),
        };
        // SAFETY: both buffers hold `count` floats.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.glu)
                .arg(&gate_out)
                .arg(&up_out)
                .arg(&count)
                .arg(&kind)
                .arg(&beta)
                .arg(&linear_beta)
                .arg(&has_linear_beta)
                .launch(launch_config(
                    ((count as usize).div_ceil(THREADS as usize), 1),
                    THREADS,
                ))
        }
        .map_err(failed("activation launch"))?;
        self.launch_matmul(address(3), experts.len(), down_blocks, max_n)?;
        let width_arg = width as i32;
        let (starts, entry_slots, entry_weights) = (address(4), address(5), address(6));
        // SAFETY: `down_out` holds `slots x width` floats, the entry lists name slots below
        // `slots`, and `output` holds `rows x width` floats.
        unsafe {
            self.stream
                .launch_builder(&self.kernels.combine)
                .arg(&down_out)
                .arg(&width_arg)
                .arg(&starts)
                .arg(&entry_slots)
                .arg(&entry_weights)
                .arg(&output)
                .launch(launch_config(
                    (width.div_ceil(THREADS as usize), rows),
                    THREADS,
                ))
        }
        .map_err(failed("combine launch"))?;
        self.receive(&mut state, output, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define NAME value` in the kernel source.
    fn defined(name: &str) -> Option<i64> {
        KERNEL_SOURCE.lines().find_map(|line| {
            let rest = line.strip_prefix("#define ")?.strip_prefix(name)?;
            rest.trim().parse().ok()
        })
    }

    #[test]
    fn the_kernel_source_agrees_with_the_host() {
        for name in KERNEL_NAMES {
            assert!(
                KERNEL_SOURCE.contains(&format!(") {name}(")),
                "kernel {name} is not in coli.cu"
            );
        }
        assert_eq!(defined("WARPS"), Some(WARPS as i64));
        assert!(KERNEL_SOURCE.contains(&format!("sizeof(Job) == {JOB_BYTES}")));
        let formats = [
            ("FMT_F32", Format::F32),
            ("FMT_BF16", Format::Bf16),
            ("FMT_F16", Format::F16),
            ("FMT_INT8_ROW", Format::Int8Row),
            ("FMT_INT4_ROW", Format::Int4Row),
            ("FMT_INT4_GROUPED", Format::Int4Grouped { group: 64 }),
            ("FMT_FP8_B128", Format::Fp8E4m3B128),
            ("FMT_MXFP4", Format::Mxfp4),
        ];
        for (name, format) in formats {
            assert_eq!(defined(name), format_code(format).map(i64::from), "{name}");
        }
        assert_eq!(defined("ACT_SWIGLU"), Some(0));
        assert_eq!(defined("ACT_SITU"), Some(1));
    }

    #[test]
    fn a_job_is_written_in_the_kernel_layout() {
        let layout = Layout {
            code: 5,
            rows: 3,
            cols: 70,
            row_bytes: 35,
            stride: 48,
            group: 16,
            per_row: 5,
        };
        let job = Job {
            weight: 0x1000,
            scales: 0x2000,
            x: 0x3000,
            x_rows: 0,
            y: 0x5000,
            layout,
            xstride: 96,
            ystride: 3,
            n: 17,
            block0: 4,
        };
        let mut bytes = [0xffu8; JOB_BYTES];
        job.write(&mut bytes);
        let word = |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().unwrap());
        assert_eq!(
            [word(0), word(1), word(2), word(3), word(4)],
            [0x1000, 0x2000, 0x3000, 0, 0x5000]
        );
        let ints: Vec<i32> = bytes[40..]
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(ints, [5, 3, 70, 48, 16, 5, 96, 3, 17, 4]);
    }

    #[test]
    fn layouts_pad_rows_to_sixteen_bytes_and_check_scales() {
        let data = vec![0u8; 3 * 35];
        let scales = vec![1f32; 3 * 5];
        let matrix = RawMatrix {
            rows: 3,
            cols: 70,
            format: Format::Int4Grouped { group: 16 },
            data: &data,
            scales: RawScales::F32(&scales),
        };
        let layout = Layout::of(&matrix).unwrap();
        assert_eq!(
            (layout.row_bytes, layout.stride, layout.per_row),
            (35, 48, 5)
        );
        let short = RawMatrix {
            scales: RawScales::F32(&scales[..14]),
            ..matrix
        };
        assert!(matches!(
            Layout::of(&short),
            Err(DeviceError::Unsupported(_))
        ));
        let odd_group = RawMatrix {
            format: Format::Int4Grouped { group: 12 },
            ..matrix
        };
        assert!(matches!(
            Layout::of(&odd_group),
            Err(DeviceError::Unsupported(_))
        ));
        let e8 = RawMatrix {
            format: Format::Int2Row,
            ..matrix
        };
        assert!(matches!(Layout::of(&e8), Err(DeviceError::Unsupported(_))));
    }

    #[test]
    fn sections_start_aligned() {
        let sections = Sections::new(&[4, 300, 0, 8]);
        assert_eq!(sections.offsets, [0, 256, 768, 768]);
        assert_eq!(sections.total, 1024);
    }
}
