//! What a CUDA operation stages and queues, decided by pure code apart from the driver:
//! the layout of an uploaded weight, [`MatmulPlan`] and [`GroupPlan`] (which write the
//! staged bytes, input rows, jobs and combine tables, for buffers at given device addresses)
//! and the [`Step`]s to queue. The CPU emulation of the kernels
//! (`tests/gpu/cuda_kernels_emulated.rs`) runs the same bytes and steps.

use super::super::group::GroupRouting;
use super::super::{Activation, DeviceError, ExpertGroup, RawMatrix, RawScales, WeightId};
use crate::layout::Format;

/// Output rows per matmul block (one warp each); `WARPS` in the kernel source.
pub(super) const WARPS: usize = 8;
/// Input rows per block row in the batched matmul kernel (`matmul_8`).
pub(super) const TILE: usize = 8;
/// Bytes of one `Job` in the kernel source.
pub(super) const JOB_BYTES: usize = 80;
/// Threads per block of the element-wise kernels and RMSNorm; `THREADS` in the kernel source.
pub(super) const THREADS: u32 = 256;
/// Each host-to-device section starts on this boundary (the kernels read float4 and
/// 8-byte fields).
pub(super) const SECTION_ALIGN: usize = 256;

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
pub(super) fn round_up(value: usize, to: usize) -> usize {
    value.div_ceil(to) * to
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
pub(super) struct Job {
    pub(super) matrix: Placed,
    pub(super) x: u64,
    pub(super) x_rows: u64,
    pub(super) y: u64,
    pub(super) xstride: usize,
    pub(super) ystride: usize,
    pub(super) n: usize,
    pub(super) block0: usize,
}

impl Job {
    /// Five device pointers, then ten `int`s, little-endian: 80 bytes.
    pub(super) fn write(&self, out: &mut [u8]) {
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
pub(super) fn blocks(rows: usize) -> usize {
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

/// Where each section of one operation's inputs starts in the staging buffer.
pub(super) struct Sections {
    pub(super) offsets: Vec<usize>,
    pub(super) total: usize,
}

impl Sections {
    pub(super) fn new(sizes: &[usize]) -> Sections {
        let mut offsets = Vec::with_capacity(sizes.len());
        let mut total = 0;
        for &size in sizes {
            offsets.push(total);
            total = round_up(total + size, SECTION_ALIGN);
        }
        Sections { offsets, total }
    }
}

pub(super) fn put_f32(out: &mut [u8], values: &[f32]) {
    out[..values.len() * 4].copy_from_slice(bytemuck::cast_slice(values));
}

pub(super) fn put_i32(out: &mut [u8], values: &[i32]) {
    out[..values.len() * 4].copy_from_slice(bytemuck::cast_slice(values));
}

/// `rows` rows of `width` floats, each padded with zeros to `stride` floats.
pub(super) fn put_rows(out: &mut [u8], values: &[f32], width: usize, stride: usize) {
    for (row, values) in out
        .chunks_exact_mut(stride * 4)
        .zip(values.chunks_exact(width))
    {
        put_f32(row, values);
        row[width * 4..].fill(0);
    }
}

/// Grid y and the combine kernel's rows are limited to this.
pub(super) const GRID_Y_MAX: usize = 65535;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cuda::{KERNEL_NAMES, KERNEL_SOURCE};

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
        let experts = crate::backend::group::numbered_experts(&routes);
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
