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
//! What an operation stages and queues is decided by pure code, apart from the driver:
//! [`MatmulPlan`] and [`GroupPlan`] write the staged bytes (input rows, jobs, combine tables)
//! for buffers at given device addresses and list the [`Step`]s to queue. The CPU emulation
//! of the kernels (`tests/cuda_kernels_emulated.rs`) runs the same bytes and steps.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{
    result as driver, sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr,
    DriverError, LaunchConfig, PinnedHostSlice, PushKernelArg,
};
use cudarc::nvrtc::{self, CompileOptions, Ptx};

use super::group::GroupRouting;
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
/// Threads per block of the element-wise kernels and RMSNorm; `THREADS` in the kernel source.
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

/// How a matrix sits on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// The kernel's `FMT_*` code.
    pub code: i32,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of one row as the host holds it.
    pub row_bytes: usize,
    /// Bytes of one row on the device: `row_bytes` padded to 16.
    pub stride: usize,
    /// The int4-grouped group size (0 for other formats).
    pub group: usize,
    /// Scales per row (per 128-row block for fp8; 0 for per-row and float formats).
    pub per_row: usize,
}

impl Layout {
    /// The device layout of `matrix`, or why the kernels cannot take it.
    pub fn of(matrix: &RawMatrix<'_>) -> Result<Layout, DeviceError> {
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
        let Some(row_bytes) = matrix.format.row_bytes(cols) else {
            return unsupported("no CUDA kernel for this format".into());
        };
        let group = match matrix.format {
            Format::Int4Grouped { group } if group == 0 || !group.is_multiple_of(8) => {
                return unsupported(format!("group size {group} is not a multiple of 8"));
            }
            Format::Int4Grouped { group } => group,
            _ => 0,
        };
        // The kernels take 0 scales per row for one scale per row.
        let per_row = match matrix.format {
            Format::Int8Row | Format::Int4Row => 0,
            format => format.scales_per_row(cols),
        };
        let scale_count = matrix.format.scale_count(rows, cols);
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

    /// Whole rows of `row_bytes` from `data` into rows of `stride` in `out`, zero-padded.
    pub fn pad_rows(&self, data: &[u8], out: &mut [u8]) {
        for (row, source) in out
            .chunks_exact_mut(self.stride)
            .zip(data.chunks_exact(self.row_bytes))
        {
            row[..self.row_bytes].copy_from_slice(source);
            row[self.row_bytes..].fill(0);
        }
    }
}

/// A matrix where the kernels find it: its layout and the device addresses of its rows
/// (`layout.stride` bytes apart) and of its scales (0 when it has none).
#[derive(Debug, Clone, Copy)]
pub struct Placed {
    pub layout: Layout,
    pub data: u64,
    pub scales: u64,
}

/// One product the matmul kernels compute; written in the kernel's `struct Job` layout.
struct Job {
    matrix: Placed,
    x: u64,
    x_rows: u64,
    y: u64,
    xstride: usize,
    ystride: usize,
    n: usize,
    block0: usize,
}

impl Job {
    /// Five device pointers, then ten `int`s, little-endian: 80 bytes.
    fn write(&self, out: &mut [u8]) {
        let matrix = &self.matrix;
        let pointers = [matrix.data, matrix.scales, self.x, self.x_rows, self.y];
        let layout = &matrix.layout;
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
}

/// Matmul blocks (of [`WARPS`] rows) for a matrix of `rows` rows.
fn blocks(rows: usize) -> usize {
    rows.div_ceil(WARPS)
}

/// A kernel argument: a device address, an `int` or a `float`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Arg {
    Address(u64),
    Int(i32),
    Float(f32),
}

/// One thing an operation queues on the stream, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Zero `bytes` bytes at device address `address`.
    Clear { address: u64, bytes: usize },
    /// Kernel `name` (one of [`KERNEL_NAMES`]) on a grid of `grid.0 x grid.1` blocks of
    /// `threads` threads.
    Launch {
        name: &'static str,
        grid: (usize, usize),
        threads: u32,
        args: Vec<Arg>,
    },
}

impl Step {
    /// The products of `count` jobs at `jobs`, whose matrices have `blocks` blocks of rows
    /// in all and whose largest row count is `max_n`: `matmul_1` when that is one row,
    /// else `matmul_8` with a block row per 8 input rows.
    pub fn matmul(jobs: u64, count: usize, blocks: usize, max_n: usize) -> Step {
        let (name, tile) = if max_n == 1 {
            ("matmul_1", 1)
        } else {
            ("matmul_8", TILE)
        };
        Step::Launch {
            name,
            grid: (blocks, max_n.div_ceil(tile)),
            threads: (WARPS * 32) as u32,
            args: vec![Arg::Address(jobs), Arg::Int(count as i32)],
        }
    }

    /// RMSNorm of `rows` rows of `width` floats at `x` into `out`, one block per row.
    pub fn rms_norm(x: u64, weight: u64, out: u64, rows: usize, width: usize, eps: f32) -> Step {
        Step::Launch {
            name: "rms_norm",
            grid: (rows, 1),
            threads: THREADS,
            args: vec![
                Arg::Address(x),
                Arg::Address(weight),
                Arg::Address(out),
                Arg::Int(width as i32),
                Arg::Float(eps),
            ],
        }
    }

    /// `gate = activation(gate, up)` over `count` floats.
    pub fn glu(gate: u64, up: u64, count: usize, activation: Activation) -> Step {
        let (kind, beta, linear_beta, has_linear_beta) = match activation {
            Activation::SwiGlu => (0, 0.0, 0.0, 0),
            Activation::Situ(situ) => (
                1,
                situ.beta,
                situ.linear_beta.unwrap_or(0.0),
                i32::from(situ.linear_beta.is_some()),
            ),
        };
        Step::Launch {
            name: "glu",
            grid: (count.div_ceil(THREADS as usize), 1),
            threads: THREADS,
            args: vec![
                Arg::Address(gate),
                Arg::Address(up),
                Arg::Int(count as i32),
                Arg::Int(kind),
                Arg::Float(beta),
                Arg::Float(linear_beta),
                Arg::Int(has_linear_beta),
            ],
        }
    }

    /// `out` (`rows x width`) = the weighted sums of the rows of `y` that the compressed
    /// row lists `row_start`, `entry_slot`, `entry_weight` name.
    pub fn combine(
        y: u64,
        width: usize,
        row_start: u64,
        entry_slot: u64,
        entry_weight: u64,
        out: u64,
        rows: usize,
    ) -> Step {
        Step::Launch {
            name: "combine",
            grid: (width.div_ceil(THREADS as usize), rows),
            threads: THREADS,
            args: vec![
                Arg::Address(y),
                Arg::Int(width as i32),
                Arg::Address(row_start),
                Arg::Address(entry_slot),
                Arg::Address(entry_weight),
                Arg::Address(out),
            ],
        }
    }
}

/// One matrix product laid out for the kernels. The staged bytes are the `n` input rows,
/// each padded with zeros to `xstride` floats, then the one job.
pub struct MatmulPlan {
    matrix: Placed,
    n: usize,
    xstride: usize,
    sections: Sections,
}

impl MatmulPlan {
    /// A product of `matrix` with `n` (at least one) input rows.
    pub fn new(matrix: Placed, n: usize) -> Result<MatmulPlan, DeviceError> {
        if n == 0 || n.div_ceil(TILE) > GRID_Y_MAX {
            return Err(DeviceError::Unsupported(format!("{n} input rows")));
        }
        let xstride = round_up(matrix.layout.cols, 32);
        Ok(MatmulPlan {
            matrix,
            n,
            xstride,
            sections: Sections::new(&[n * xstride * 4, JOB_BYTES]),
        })
    }

    pub fn staged_bytes(&self) -> usize {
        self.sections.total
    }

    pub fn output_bytes(&self) -> usize {
        self.n * self.matrix.layout.rows * 4
    }

    /// Fill `bytes` (`staged_bytes` long) with `input` (`n x cols`) and the job, for the
    /// staged bytes at device address `staged` and the output at `output`.
    pub fn write(&self, input: &[f32], staged: u64, output: u64, bytes: &mut [u8]) {
        let cols = self.matrix.layout.cols;
        put_rows(
            &mut bytes[..self.n * self.xstride * 4],
            input,
            cols,
            self.xstride,
        );
        Job {
            matrix: self.matrix,
            x: staged,
            x_rows: 0,
            y: output,
            xstride: self.xstride,
            ystride: self.matrix.layout.rows,
            n: self.n,
            block0: 0,
        }
        .write(&mut bytes[self.sections.offsets[1]..]);
    }

    /// What to queue after the staged bytes are at `staged`.
    pub fn steps(&self, staged: u64) -> Vec<Step> {
        let jobs = staged + self.sections.offsets[1] as u64;
        vec![Step::matmul(
            jobs,
            1,
            blocks(self.matrix.layout.rows),
            self.n,
        )]
    }
}

/// The device buffers of one expert group: the staged bytes, the gate and up products
/// (`hidden_bytes` each), the down products and the output.
#[derive(Debug, Clone, Copy)]
pub struct GroupBuffers {
    pub staged: u64,
    pub gate: u64,
    pub up: u64,
    pub down: u64,
    pub output: u64,
}

/// An expert with routed rows, as a [`GroupPlan`] lays it out.
struct PlannedExpert {
    /// Gate, up and down.
    matrices: [Placed; 3],
    /// Its first slot: its rows are slots `first..first + n`.
    first: usize,
    n: usize,
    /// The first block of each of its three jobs.
    block0: [usize; 3],
}

/// An expert group laid out for the kernels. Each routed (row, expert) pair is a slot, in
/// expert order; slot `s` has a row of `inter_stride` floats in the gate and up buffers
/// (zero past the expert's width, so the down product may read whole units) and a row of
/// `width` floats in the down buffer. The staged sections are: the input rows (padded to
/// `xstride`), each slot's input row, the gate and up jobs (alternating, expert by expert),
/// the down jobs, and the combine kernel's compressed rows (each output row's start in the
/// entry lists; each entry's slot; each entry's gate weight), entries in expert order.
pub struct GroupPlan<'a> {
    input: &'a [f32],
    rows: usize,
    width: usize,
    activation: Activation,
    experts: Vec<PlannedExpert>,
    slots: usize,
    xstride: usize,
    inter_stride: usize,
    sections: Sections,
    max_n: usize,
    gate_up_blocks: usize,
    down_blocks: usize,
    routing: GroupRouting<'a>,
}

impl<'a> GroupPlan<'a> {
    /// The layout of `group` into `out_len` outputs, with `placed` saying where each
    /// weight is; `None` when no expert has a row (the output is all zeros).
    pub fn new(
        group: &'a ExpertGroup<'a>,
        out_len: usize,
        mut placed: impl FnMut(WeightId) -> Result<Placed, DeviceError>,
    ) -> Result<Option<GroupPlan<'a>>, DeviceError> {
        let Some(routing) = GroupRouting::new(group, out_len)? else {
            return Ok(None);
        };
        let (rows, width, slots) = (group.rows, group.width, routing.slots());
        if rows > GRID_Y_MAX {
            return Err(DeviceError::Unsupported(format!(
                "{rows} rows in one group"
            )));
        }

        let mut experts = Vec::with_capacity(routing.experts.len());
        let (mut gate_up_blocks, mut down_blocks) = (0, 0);
        for &(expert, first) in &routing.experts {
            let [gate, up, down] = [expert.gate, expert.up, expert.down].map(&mut placed);
            let [gate, up, down] = [gate?, up?, down?];
            let (g, u, d) = (gate.layout, up.layout, down.layout);
            let fits = g.cols == width
                && u.cols == width
                && u.rows == g.rows
                && d.cols == g.rows
                && d.rows == width;
            if !fits {
                return Err(DeviceError::Unsupported(format!(
                    "expert of gate {}x{}, up {}x{}, down {}x{} in a group of width {width} and {rows} rows",
                    g.rows, g.cols, u.rows, u.cols, d.rows, d.cols
                )));
            }
            let block0 = [gate_up_blocks, gate_up_blocks + blocks(g.rows), down_blocks];
            gate_up_blocks += blocks(g.rows) + blocks(u.rows);
            down_blocks += blocks(d.rows);
            experts.push(PlannedExpert {
                matrices: [gate, up, down],
                first,
                n: expert.rows.len(),
                block0,
            });
        }
        let max_n = experts.iter().map(|e| e.n).max().unwrap_or(0);
        let widest = experts
            .iter()
            .map(|e| e.matrices[0].layout.rows)
            .max()
            .unwrap_or(0);
        let inter_stride = round_up(widest, 32);
        if slots * inter_stride > i32::MAX as usize || max_n.div_ceil(TILE) > GRID_Y_MAX {
            return Err(DeviceError::Unsupported(format!(
                "{slots} expert rows of width {inter_stride}, {max_n} for one expert"
            )));
        }

        let xstride = round_up(width, 32);
        let sections = Sections::new(&[
            rows * xstride * 4,
            slots * 4,
            2 * experts.len() * JOB_BYTES,
            experts.len() * JOB_BYTES,
            (rows + 1) * 4,
            slots * 4,
            slots * 4,
        ]);
        Ok(Some(GroupPlan {
            input: group.input,
            rows,
            width,
            activation: group.activation,
            experts,
            slots,
            xstride,
            inter_stride,
            sections,
            max_n,
            gate_up_blocks,
            down_blocks,
            routing,
        }))
    }

    pub fn staged_bytes(&self) -> usize {
        self.sections.total
    }

    /// Bytes of each of the gate and up buffers.
    pub fn hidden_bytes(&self) -> usize {
        self.slots * self.inter_stride * 4
    }

    pub fn down_bytes(&self) -> usize {
        self.slots * self.width * 4
    }

    pub fn output_bytes(&self) -> usize {
        self.rows * self.width * 4
    }

    /// Fill `bytes` (`staged_bytes` long) for the buffers at `at`.
    pub fn write(&self, at: &GroupBuffers, bytes: &mut [u8]) {
        let offsets = &self.sections.offsets;
        let staged = |section: usize| at.staged + offsets[section] as u64;
        put_rows(
            &mut bytes[offsets[0]..][..self.rows * self.xstride * 4],
            self.input,
            self.width,
            self.xstride,
        );
        put_i32(&mut bytes[offsets[1]..], &self.routing.slot_rows);
        let hidden_row = |slot: usize| (slot * self.inter_stride * 4) as u64;
        for (k, expert) in self.experts.iter().enumerate() {
            let [gate, up, down] = expert.matrices;
            for (j, (matrix, y)) in [(gate, at.gate), (up, at.up)].into_iter().enumerate() {
                Job {
                    matrix,
                    x: staged(0),
                    x_rows: staged(1) + (expert.first * 4) as u64,
                    y: y + hidden_row(expert.first),
                    xstride: self.xstride,
                    ystride: self.inter_stride,
                    n: expert.n,
                    block0: expert.block0[j],
                }
                .write(&mut bytes[offsets[2] + (2 * k + j) * JOB_BYTES..]);
            }
            Job {
                matrix: down,
                x: at.gate + hidden_row(expert.first),
                x_rows: 0,
                y: at.down + (expert.first * self.width * 4) as u64,
                xstride: self.inter_stride,
                ystride: self.width,
                n: expert.n,
                block0: expert.block0[2],
            }
            .write(&mut bytes[offsets[3] + k * JOB_BYTES..]);
        }
        put_i32(&mut bytes[offsets[4]..], &self.routing.row_start);
        put_i32(&mut bytes[offsets[5]..], &self.routing.entry_slot);
        put_f32(&mut bytes[offsets[6]..], &self.routing.entry_weight);
    }

    /// What to queue after the staged bytes are at `at.staged`.
    pub fn steps(&self, at: &GroupBuffers) -> Vec<Step> {
        let staged = |section: usize| at.staged + self.sections.offsets[section] as u64;
        let count = self.experts.len();
        vec![
            // The activation keeps zeros zero, so the padding the down product reads is 0.
            Step::Clear {
                address: at.gate,
                bytes: self.hidden_bytes(),
            },
            Step::Clear {
                address: at.up,
                bytes: self.hidden_bytes(),
            },
            Step::matmul(staged(2), 2 * count, self.gate_up_blocks, self.max_n),
            Step::glu(
                at.gate,
                at.up,
                self.slots * self.inter_stride,
                self.activation,
            ),
            Step::matmul(staged(3), count, self.down_blocks, self.max_n),
            Step::combine(
                at.down,
                self.width,
                staged(4),
                staged(5),
                staged(6),
                at.output,
                self.rows,
            ),
        ]
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
            let seconds = self.timed(repeat, || {
                // SAFETY: both buffers hold `bytes`.
                unsafe { driver::memcpy_dtod_async(to, from, bytes, self.stream.cu_stream()) }
                    .map_err(failed("device copy"))
            })?;
            // A copy reads and writes every byte.
            Ok(2.0 * bytes as f64 / seconds)
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
            let seconds = self.timed(repeat, || {
                k += 1;
                self.issue(std::slice::from_ref(&launches[k % launches.len()]))
            })?;
            Ok(seconds / repeat as f64)
        })
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::GroupExpert;

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
        assert_eq!(defined("THREADS"), Some(i64::from(THREADS)));
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
            matrix: Placed {
                layout,
                data: 0x1000,
                scales: 0x2000,
            },
            x: 0x3000,
            x_rows: 0,
            y: 0x5000,
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

    /// A float matrix of `rows x cols` at `data`.
    fn float_matrix(rows: usize, cols: usize, data: u64) -> Placed {
        Placed {
            layout: Layout {
                code: 0,
                rows,
                cols,
                row_bytes: cols * 4,
                stride: round_up(cols * 4, 16),
                group: 0,
                per_row: 0,
            },
            data,
            scales: 0,
        }
    }

    #[test]
    fn a_group_plan_lays_out_slots_jobs_and_combine_lists() {
        // Expert 0 takes rows 2 and 0, expert 1 none, expert 2 rows 0 and 1; row 3 none.
        let routes: [&[(usize, f32)]; 3] = [&[(2, 0.5), (0, 0.25)], &[], &[(0, 2.0), (1, 1.0)]];
        let experts: Vec<GroupExpert<'_>> = (0..3)
            .map(|e| GroupExpert {
                gate: 3 * e as u64,
                up: 3 * e as u64 + 1,
                down: 3 * e as u64 + 2,
                rows: routes[e],
            })
            .collect();
        let input = vec![0f32; 4 * 8];
        let group = ExpertGroup {
            experts: &experts,
            input: &input,
            rows: 4,
            width: 8,
            activation: Activation::SwiGlu,
        };
        // Experts 12 wide: two blocks of rows for each gate and up product, one for a down.
        let plan = GroupPlan::new(&group, 4 * 8, |id| {
            let data = 0x1000 * (id + 1);
            Ok(if id % 3 == 2 {
                float_matrix(8, 12, data)
            } else {
                float_matrix(12, 8, data)
            })
        })
        .unwrap()
        .expect("routed rows");
        // Slots: expert 0's rows 2, 0, then expert 2's rows 0, 1. Each output row lists
        // its (slot, weight) entries in expert order.
        assert_eq!(plan.routing.slot_rows, [2, 0, 0, 1]);
        assert_eq!(plan.routing.row_start, [0, 2, 3, 4, 4]);
        assert_eq!(plan.routing.entry_slot, [1, 2, 3, 0]);
        assert_eq!(plan.routing.entry_weight, [0.25, 2.0, 1.0, 0.5]);
        assert_eq!((plan.inter_stride, plan.hidden_bytes()), (32, 4 * 32 * 4));

        let at = GroupBuffers {
            staged: 0x10_0000,
            gate: 0x20_0000,
            up: 0x30_0000,
            down: 0x40_0000,
            output: 0x50_0000,
        };
        let mut bytes = vec![0u8; plan.staged_bytes()];
        plan.write(&at, &mut bytes);
        let offsets = &plan.sections.offsets;
        let job = |section: usize, k: usize| {
            let job = &bytes[offsets[section] + k * JOB_BYTES..][..JOB_BYTES];
            let pointers: Vec<u64> = job[..40]
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let ints: Vec<i32> = job[40..]
                .chunks_exact(4)
                .map(|b| i32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            (pointers, ints)
        };
        // Expert 2's up product (ids 6, 7, 8): its slots 2 and 3 gathered from the input.
        let (pointers, ints) = job(2, 3);
        let x_rows = at.staged + offsets[1] as u64 + 2 * 4;
        let y = at.up + 2 * 32 * 4;
        assert_eq!(pointers, [0x8000, 0, at.staged, x_rows, y]);
        assert_eq!(ints, [0, 12, 8, 32, 0, 0, 32, 32, 2, 6]);
        // Its down product reads the activations in the gate buffer.
        let (pointers, ints) = job(3, 1);
        let (x, y) = (at.gate + 2 * 32 * 4, at.down + 2 * 8 * 4);
        assert_eq!(pointers, [0x9000, 0, x, 0, y]);
        assert_eq!(ints, [0, 8, 12, 48, 0, 0, 32, 8, 2, 1]);

        let staged = |section: usize| at.staged + offsets[section] as u64;
        let clear = |address| Step::Clear {
            address,
            bytes: 4 * 32 * 4,
        };
        assert_eq!(
            plan.steps(&at),
            [
                clear(at.gate),
                clear(at.up),
                Step::matmul(staged(2), 4, 8, 2),
                Step::glu(at.gate, at.up, 4 * 32, Activation::SwiGlu),
                Step::matmul(staged(3), 2, 2, 2),
                Step::combine(at.down, 8, staged(4), staged(5), staged(6), at.output, 4),
            ]
        );
        let Step::Launch { name, grid, .. } = &plan.steps(&at)[2] else {
            panic!("a launch");
        };
        assert_eq!((*name, *grid), ("matmul_8", (8, 1)));
    }
}
