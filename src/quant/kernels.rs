//! The matrix kernels, written once over an 8-lane vector type ([`Lanes`]) and an element
//! decoder ([`Decode`]), and instantiated for the scalar reference, AVX2/FMA (x86-64) and
//! NEON (aarch64); the AVX-512 kernels (`avx512`) run two of these vectors per register.
//!
//! The arithmetic is fixed so that every instantiation gives the same bits: a row's
//! elements are decoded exactly (an int8, a nibble, an e4m3 or e2m1 code, a bf16/f16 to its
//! f32 value, without its scale), element `8c + l` goes to lane `l` with one fused
//! multiply-add per element in column order (a row that ends inside a chunk is padded with
//! zeros), and the eight lanes are summed as `((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`. Formats
//! with group scales keep one lane accumulator per group and fold it in with
//! `acc = fma(group, scale, acc)` at the end of each group; per-row formats multiply the
//! reduced sum by the row scale. Because decoding is exact, the batched path (decode a
//! block of rows to f32 once, then run it against every input row; for a few inputs, decode
//! each chunk in registers for a tile of inputs) computes the same bits as the one-row
//! path, so prefill and decode agree and `COLI_SIMD=scalar` changes nothing.
//!
//! Work is split across rayon threads by blocks of output rows; each output element is
//! computed by one thread in one fixed order, so results do not depend on the thread count.
//!
//! Beside the matrices, the f32 vector operations attention runs on activations and caches
//! ([`dots`], [`add_weighted`], [`Queries`]) use the same lanes with a separate multiply and
//! add ([`Lanes::add_product`]), the arithmetic of plain `f32` loops, which the engines'
//! decode attention was written in and its fixtures were checked with. Their fused forms
//! ([`fused_dots`], [`fused_add_weighted`], [`fused_add_weighted_tile`], [`Queries::fused`])
//! round each product with its add, in the same lanes and order: a prompt's expanded
//! attention runs on them.

use std::sync::atomic::{AtomicU8, Ordering};

use anyhow::{bail, Result};
use half::f16;
use rayon::prelude::*;

use super::codec;
use super::lines::Lines;

/// An 8-lane f32 vector.
pub trait Lanes: Copy {
    /// # Safety
    /// The CPU must support the instruction set of the implementation.
    unsafe fn zero() -> Self;
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn splat(value: f32) -> Self;
    /// # Safety
    /// `ptr` must be valid for reading 8 f32 (no alignment needed).
    unsafe fn load(ptr: *const f32) -> Self;
    /// # Safety
    /// `ptr` must be valid for writing 8 f32.
    unsafe fn store(self, ptr: *mut f32);
    /// `a * b + c`, rounded once.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    /// `c + a * b` with the product rounded before the add: plain `f32` arithmetic, the
    /// step of [`dots`] and [`add_weighted`].
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn add_product(a: Self, b: Self, c: Self) -> Self;
    /// `((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`.
    /// # Safety
    /// As [`Lanes::zero`].
    unsafe fn sum(self) -> f32;
    /// Ask for the cache line at `ptr` ahead of use (any address; never faults). The x86
    /// kernels ask for it in the second-level cache: asked into the first, decode read
    /// memory at 55-60% of its bandwidth on Zen 4, and at 98-100% this way (likely because
    /// a request into the first level holds one of its few miss buffers for a whole trip
    /// to memory, and one a line for every row being read ran them out; docs/benchmarks.md).
    /// # Safety
    /// As [`Lanes::zero`].
    #[inline(always)]
    unsafe fn prefetch(_ptr: *const u8) {}
}

/// How a format stores the elements of one row.
pub trait Codes: Copy + Send + Sync + 'static {
    type Elem: Copy + Send + Sync;
    /// Bytes that hold one chunk of eight elements.
    const CHUNK_BYTES: usize;
    /// Whether decoding a chunk costs several multiply-adds (E4M3, a table lookup per
    /// element without AVX-512): a batch decodes each chunk again for another tile of
    /// inputs only where it does not ([`few_inputs`]).
    const COSTLY_DECODE: bool = false;
    /// Storage units per row of `cols` elements.
    fn stride(cols: usize) -> usize;
    /// The exact value of element `i`, without its scale.
    fn value(row: &[Self::Elem], i: usize) -> f32;
}

/// Decoding eight consecutive elements into lanes.
pub trait Decode<V: Lanes>: Codes {
    /// Elements `8c .. 8c + 8` of `row`.
    /// # Safety
    /// `8c + 8` must not exceed the row's element count, and the CPU must support `V`.
    unsafe fn chunk(row: &[Self::Elem], c: usize) -> V;
}

/// f32 elements.
#[derive(Clone, Copy)]
pub struct F32Codes;
/// bf16 bit patterns.
#[derive(Clone, Copy)]
pub struct Bf16Codes;
/// IEEE f16 bit patterns.
#[derive(Clone, Copy)]
pub struct F16Codes;
/// int8 values.
#[derive(Clone, Copy)]
pub struct I8Codes;
/// Offset-binary int4 nibbles, low nibble first.
#[derive(Clone, Copy)]
pub struct Int4Codes;
/// FP8 E4M3 bytes.
#[derive(Clone, Copy)]
pub struct E4m3Codes;
/// e2m1 nibbles, low nibble first, decoded doubled.
#[derive(Clone, Copy)]
pub struct E2m1Codes;

impl Codes for F32Codes {
    type Elem = f32;
    const CHUNK_BYTES: usize = 32;
    fn stride(cols: usize) -> usize {
        cols
    }
    #[inline(always)]
    fn value(row: &[f32], i: usize) -> f32 {
        row[i]
    }
}

impl Codes for Bf16Codes {
    type Elem = u16;
    const CHUNK_BYTES: usize = 16;
    fn stride(cols: usize) -> usize {
        cols
    }
    #[inline(always)]
    fn value(row: &[u16], i: usize) -> f32 {
        f32::from_bits(u32::from(row[i]) << 16)
    }
}

impl Codes for F16Codes {
    type Elem = u16;
    const CHUNK_BYTES: usize = 16;
    fn stride(cols: usize) -> usize {
        cols
    }
    #[inline(always)]
    fn value(row: &[u16], i: usize) -> f32 {
        f16::from_bits(row[i]).to_f32()
    }
}

impl Codes for I8Codes {
    type Elem = i8;
    const CHUNK_BYTES: usize = 8;
    fn stride(cols: usize) -> usize {
        cols
    }
    #[inline(always)]
    fn value(row: &[i8], i: usize) -> f32 {
        f32::from(row[i])
    }
}

impl Codes for Int4Codes {
    type Elem = u8;
    const CHUNK_BYTES: usize = 4;
    fn stride(cols: usize) -> usize {
        cols.div_ceil(2)
    }
    #[inline(always)]
    fn value(row: &[u8], i: usize) -> f32 {
        codec::int4_value(row, i)
    }
}

impl Codes for E4m3Codes {
    type Elem = u8;
    const CHUNK_BYTES: usize = 8;
    const COSTLY_DECODE: bool = true;
    fn stride(cols: usize) -> usize {
        cols
    }
    #[inline(always)]
    fn value(row: &[u8], i: usize) -> f32 {
        codec::e4m3_table()[row[i] as usize]
    }
}

impl Codes for E2m1Codes {
    type Elem = u8;
    const CHUNK_BYTES: usize = 4;
    fn stride(cols: usize) -> usize {
        cols.div_ceil(2)
    }
    #[inline(always)]
    fn value(row: &[u8], i: usize) -> f32 {
        codec::e2m1_doubled_value(row, i)
    }
}

/// How a row's partial sums are scaled.
#[derive(Clone, Copy)]
pub enum Scaling<'a> {
    /// Float formats: the sum is the result.
    None,
    /// One scale per row, applied to the reduced sum.
    Row(&'a [f32]),
    /// One scale per `size` columns (a multiple of 8); row `r`, group `g` uses
    /// `scales[(r / row_div) * per_row + g]` (`row_div` 128 for FP8 blocks, else 1).
    Groups {
        size: usize,
        scales: &'a [f32],
        per_row: usize,
        row_div: usize,
    },
    /// MXFP4: one E8M0 byte per 32 columns, `scales[r * per_row + g]`.
    E8m0 { scales: &'a [u8], per_row: usize },
}

impl Scaling<'_> {
    pub(super) fn group_size(&self) -> Option<usize> {
        match *self {
            Scaling::None | Scaling::Row(_) => None,
            Scaling::Groups { size, .. } => Some(size),
            Scaling::E8m0 { .. } => Some(32),
        }
    }

    /// The group scales of row `row`, looked up once per row rather than once per group
    /// (the FP8 block row is a division).
    #[inline(always)]
    pub(super) fn row_scales(&self, row: usize) -> RowScales<'_> {
        match *self {
            Scaling::None | Scaling::Row(_) => RowScales::One,
            Scaling::Groups {
                scales,
                per_row,
                row_div,
                ..
            } => {
                let start = (row / row_div) * per_row;
                RowScales::F32(&scales[start..start + per_row])
            }
            Scaling::E8m0 { scales, per_row } => {
                RowScales::E8m0(&scales[row * per_row..(row + 1) * per_row])
            }
        }
    }

    fn group_scale(&self, row: usize, group: usize) -> f32 {
        self.row_scales(row).at(group)
    }

    /// The scale that multiplies element `i` of row `row` when the row is written out.
    pub fn element_scale(&self, row: usize, i: usize) -> f32 {
        match *self {
            Scaling::None => 1.0,
            Scaling::Row(scales) => scales[row],
            _ => self.group_scale(row, i / self.group_size().unwrap_or(usize::MAX)),
        }
    }
}

/// One row's group scales.
#[derive(Clone, Copy)]
pub(super) enum RowScales<'a> {
    One,
    F32(&'a [f32]),
    E8m0(&'a [u8]),
}

impl RowScales<'_> {
    #[inline(always)]
    pub(super) fn at(&self, group: usize) -> f32 {
        match *self {
            RowScales::One => 1.0,
            RowScales::F32(scales) => scales[group],
            RowScales::E8m0(scales) => codec::mxfp4_group_scale(scales[group]),
        }
    }

    /// The scales of groups `from..from + 16` ([`RowScales::at`]'s values; zeros past the
    /// row's last group), decoded at once.
    #[inline(always)]
    fn sixteen(&self, from: usize, into: &mut [f32; 16]) {
        match *self {
            RowScales::One => into.fill(1.0),
            RowScales::F32(scales) => {
                let have = &scales[from.min(scales.len())..(from + 16).min(scales.len())];
                into[..have.len()].copy_from_slice(have);
                into[have.len()..].fill(0.0);
            }
            RowScales::E8m0(scales) => {
                let have = &scales[from.min(scales.len())..(from + 16).min(scales.len())];
                for (scale, &code) in into.iter_mut().zip(have) {
                    *scale = codec::mxfp4_group_scale(code);
                }
                into[have.len()..].fill(0.0);
            }
        }
    }
}

/// Elements `start..cols` of a row (fewer than 8) padded with zeros.
#[inline(always)]
unsafe fn tail<V: Lanes, D: Codes>(row: &[D::Elem], start: usize, cols: usize) -> V {
    let mut lanes = [0f32; 8];
    for (lane, i) in lanes.iter_mut().zip(start..cols) {
        *lane = D::value(row, i);
    }
    V::load(lanes.as_ptr())
}

/// Chunk `c` of every row against every input, `into[r][t] += w[r] * x[t]`; with `tail`,
/// the zero-padded elements from `8c` on (against `xs`, the inputs' padded tails). A
/// function, not a closure, so that it inherits the caller's instruction set when inlined.
#[inline(always)]
unsafe fn rows_step<V: Lanes, D: Decode<V>, const R: usize, const T: usize, const TAIL: bool>(
    rows: [&[D::Elem]; R],
    xs: [*const f32; T],
    (c, cols): (usize, usize),
    into: &mut [[V; T]; R],
) {
    let mut xv = [V::zero(); T];
    for t in 0..T {
        xv[t] = V::load(if TAIL { xs[t] } else { xs[t].add(c * 8) });
    }
    for r in 0..R {
        let w = if TAIL {
            tail::<V, D>(rows[r], c * 8, cols)
        } else {
            D::chunk(rows[r], c)
        };
        for t in 0..T {
            into[r][t] = V::fma(w, xv[t], into[r][t]);
        }
    }
}

/// The dot products of `R` rows with each of `T` inputs, `out[r][t]`, each chunk of a row
/// decoded once in registers for all `T` inputs; `scale_row` is the index of the first row
/// in the matrix (for its scales). Every sum is fed the same multiply-adds in the same order
/// whatever `T` is, so a row against an input has the same bits alone or among others.
/// With `WIDE` (32 vector registers), E8M0 group scales are decoded sixteen at a time.
#[inline(always)]
unsafe fn dot_rows<V: Lanes, D: Decode<V>, const R: usize, const T: usize, const WIDE: bool>(
    rows: [&[D::Elem]; R],
    scale_row: usize,
    xs: [&[f32]; T],
    cols: usize,
    scaling: Scaling,
) -> [[f32; T]; R] {
    let full = cols / 8;
    let mut x_tails = [[0f32; 8]; T];
    for (x_tail, x) in x_tails.iter_mut().zip(xs) {
        x_tail[..cols - full * 8].copy_from_slice(&x[full * 8..cols]);
    }
    let x: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
    let x_tail: [*const f32; T] = std::array::from_fn(|t| x_tails[t].as_ptr());
    let chunks = cols.div_ceil(8);
    let mut acc = [[V::zero(); T]; R];
    let mut out = [[0f32; T]; R];
    // Rows of a block are contiguous and read together in short streams, which hardware
    // prefetchers ramp up on too late for narrow codes: ask for the line the same offset
    // into the next block will need, one request per cache line.
    let ahead = R * std::mem::size_of_val(rows[0]);
    let per_line = (64 / D::CHUNK_BYTES).max(1);
    let prefetch = |c: usize| {
        if c.is_multiple_of(per_line) {
            for row in &rows {
                V::prefetch((row.as_ptr() as *const u8).wrapping_add(c * D::CHUNK_BYTES + ahead));
            }
        }
    };
    match scaling.group_size() {
        None => {
            for c in 0..full {
                prefetch(c);
                rows_step::<V, D, R, T, false>(rows, x, (c, cols), &mut acc);
            }
            if full < chunks {
                rows_step::<V, D, R, T, true>(rows, x_tail, (full, cols), &mut acc);
            }
            for r in 0..R {
                for t in 0..T {
                    out[r][t] = acc[r][t].sum();
                    if let Scaling::Row(scales) = scaling {
                        out[r][t] *= scales[scale_row + r];
                    }
                }
            }
        }
        Some(size) => {
            let per_group = size / 8;
            let row_scales: [RowScales; R] =
                std::array::from_fn(|r| scaling.row_scales(scale_row + r));
            let mut group = 0;
            let mut c = 0;
            // One group of every row, scaled by `$scale(r)`. A macro, not a closure, so
            // that it keeps the caller's instruction set, and not a function, whose
            // arguments cost registers the loops need.
            macro_rules! group_step {
                ($scale:expr) => {
                    let end = (c + per_group).min(chunks);
                    let mut partial = [[V::zero(); T]; R];
                    while c < end.min(full) {
                        prefetch(c);
                        rows_step::<V, D, R, T, false>(rows, x, (c, cols), &mut partial);
                        c += 1;
                    }
                    if c < end {
                        rows_step::<V, D, R, T, true>(rows, x_tail, (c, cols), &mut partial);
                        c += 1;
                    }
                    for r in 0..R {
                        let scale = V::splat($scale(r));
                        for t in 0..T {
                            acc[r][t] = V::fma(partial[r][t], scale, acc[r][t]);
                        }
                    }
                    group += 1;
                };
            }
            if WIDE && matches!(row_scales[0], RowScales::E8m0(_)) {
                // E8M0 bytes decoded sixteen groups at a time: decoding (and matching on
                // the format) for every group and row cost MXFP4's groups of 32 about a
                // fifth of the kernel's time. Only with 32 registers: with 16 (AVX2) the
                // nested loop keeps the sums in memory and measured slower.
                let mut sixteen = [[0f32; 16]; R];
                while c < chunks {
                    for (scales, row) in sixteen.iter_mut().zip(&row_scales) {
                        row.sixteen(group, scales);
                    }
                    for _ in 0..16 {
                        group_step!(|r: usize| sixteen[r][group % 16]);
                        if c == chunks {
                            break;
                        }
                    }
                }
            } else {
                while c < chunks {
                    group_step!(|r: usize| row_scales[r].at(group));
                }
            }
            for r in 0..R {
                for t in 0..T {
                    out[r][t] = acc[r][t].sum();
                }
            }
        }
    }
    out
}

/// One chunk of `R` rows against `T` inputs: `into[r][t] += w[r] * x[t]`, lane by lane.
/// A function, not a closure, so that it inherits the caller's instruction set when
/// inlined.
#[inline(always)]
unsafe fn tile_step<V: Lanes, const R: usize, const T: usize>(
    w: [*const f32; R],
    x: [*const f32; T],
    into: &mut [[V; T]; R],
) {
    let mut xv = [V::zero(); T];
    for t in 0..T {
        xv[t] = V::load(x[t]);
    }
    for r in 0..R {
        let wv = V::load(w[r]);
        for t in 0..T {
            into[r][t] = V::fma(wv, xv[t], into[r][t]);
        }
    }
}

/// The dot products of `R` decoded (f32) rows with each of `T` inputs at once, `out[r][t]`:
/// `R x T` accumulators, each fed the same fused multiply-adds in the same column order as
/// [`dot_rows`] feeds its own, so every sum has the same bits; the tile only lets one load
/// of a weight chunk serve `T` inputs and keeps enough independent accumulators in flight
/// to fill the multiply-add units.
#[inline(always)]
unsafe fn dot_tile<V: Lanes, const R: usize, const T: usize>(
    rows: [&[f32]; R],
    scale_row: usize,
    xs: [&[f32]; T],
    cols: usize,
    scaling: Scaling,
) -> [[f32; T]; R] {
    let full = cols / 8;
    let mut x_tail = [[0f32; 8]; T];
    for (tail, x) in x_tail.iter_mut().zip(&xs) {
        tail[..cols - full * 8].copy_from_slice(&x[full * 8..cols]);
    }
    let mut w_tail = [[0f32; 8]; R];
    for (tail, row) in w_tail.iter_mut().zip(&rows) {
        tail[..cols - full * 8].copy_from_slice(&row[full * 8..cols]);
    }
    let mut acc = [[V::zero(); T]; R];
    let mut out = [[0f32; T]; R];
    // Chunk `c` of every row against every input; the last chunk of a row that ends
    // inside one comes from the zero-padded copies.
    let w_at = |c: usize| -> [*const f32; R] {
        std::array::from_fn(|r| {
            if c < full {
                rows[r].as_ptr().add(c * 8)
            } else {
                w_tail[r].as_ptr()
            }
        })
    };
    let x_at = |c: usize| -> [*const f32; T] {
        std::array::from_fn(|t| {
            if c < full {
                xs[t].as_ptr().add(c * 8)
            } else {
                x_tail[t].as_ptr()
            }
        })
    };
    let chunks = cols.div_ceil(8);
    match scaling.group_size() {
        None => {
            for c in 0..chunks {
                tile_step(w_at(c), x_at(c), &mut acc);
            }
            for r in 0..R {
                for t in 0..T {
                    out[r][t] = acc[r][t].sum();
                    if let Scaling::Row(scales) = scaling {
                        out[r][t] *= scales[scale_row + r];
                    }
                }
            }
        }
        Some(size) => {
            let per_group = size / 8;
            let row_scales: [RowScales; R] =
                std::array::from_fn(|r| scaling.row_scales(scale_row + r));
            let mut group = 0;
            let mut c = 0;
            while c < chunks {
                let end = (c + per_group).min(chunks);
                let mut partial = [[V::zero(); T]; R];
                while c < end {
                    tile_step(w_at(c), x_at(c), &mut partial);
                    c += 1;
                }
                for r in 0..R {
                    let scale = V::splat(row_scales[r].at(group));
                    for t in 0..T {
                        acc[r][t] = V::fma(partial[r][t], scale, acc[r][t]);
                    }
                }
                group += 1;
            }
            for r in 0..R {
                for t in 0..T {
                    out[r][t] = acc[r][t].sum();
                }
            }
        }
    }
    out
}

/// Row `row` of a matrix stored as `data` with `D::stride(cols)` units per row.
#[inline(always)]
fn row_of<D: Codes>(data: &[D::Elem], cols: usize, row: usize) -> &[D::Elem] {
    let stride = D::stride(cols);
    &data[row * stride..(row + 1) * stride]
}

/// `out[i] = row(first + i) · x` for every `i`; `WIDE` where the instruction set has 32
/// vector registers ([`dot_rows`]).
#[inline(always)]
pub(super) unsafe fn rows_into<V: Lanes, D: Decode<V>, const WIDE: bool>(
    data: &[D::Elem],
    cols: usize,
    scaling: Scaling,
    first: usize,
    x: &[f32],
    out: &mut [f32],
) {
    let mut i = 0;
    while i + 4 <= out.len() {
        let r = first + i;
        let rows = [0, 1, 2, 3].map(|k| row_of::<D>(data, cols, r + k));
        let sums = dot_rows::<V, D, 4, 1, WIDE>(rows, r, [x], cols, scaling);
        out[i..i + 4].copy_from_slice(sums.as_flattened());
        i += 4;
    }
    while i < out.len() {
        let r = first + i;
        out[i] =
            dot_rows::<V, D, 1, 1, WIDE>([row_of::<D>(data, cols, r)], r, [x], cols, scaling)[0][0];
        i += 1;
    }
}

/// Whether a batch of `n` inputs takes [`rows_few_inputs`]: up to these counts decoding a
/// row again for each tile of inputs costs less than decoding it to memory and reading it
/// back (measured in docs/benchmarks.md). Group scales make each tile dearer, and a
/// `costly_decode` (several multiply-adds a chunk) is paid once only in one tile of three.
/// `wide`: AVX-512, whose batched kernels run two inputs per register and beat the tiles
/// beyond 16 inputs; the 8-lane kernels decoding rows to memory do not, at any count,
/// without group scales.
pub(super) fn few_inputs(n: usize, scaling: Scaling, costly_decode: bool, wide: bool) -> bool {
    n <= match (costly_decode, scaling.group_size()) {
        (true, _) => 3,
        (false, Some(_)) => 8,
        (false, None) if wide => 16,
        (false, None) => usize::MAX,
    }
}

/// Rows `first..first + count` against each of `n` inputs (a few: [`few_inputs`]), written
/// as `out[t * count + row - first]`: each chunk of four rows decoded in registers for a
/// tile of inputs at once, so a prompt's experts, which get a few of its positions each,
/// pay no decoding to memory. A tile is up to three inputs, four where the instruction set
/// has 32 registers (`WIDE`) and there are no group scales (whose partial sums take as many
/// registers again; `WIDE` also has [`dot_rows`] decode E8M0 scales sixteen at a time); the
/// inputs are split into even tiles. The sums are [`dot_rows`]'s, so the bits are a single
/// input's.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_few_inputs<V: Lanes, D: Decode<V>, const WIDE: bool>(
    data: &[D::Elem],
    cols: usize,
    scaling: Scaling,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let most = if WIDE && scaling.group_size().is_none() {
        4
    } else {
        3
    };
    let tile = Tile {
        data,
        cols,
        scaling,
        first,
        count,
        input,
    };
    let mut i = 0;
    while i < count {
        let four = count - i >= 4;
        let mut t = 0;
        while t < n {
            let take = inputs_in_tile(n - t, most);
            match (four, take) {
                (true, 4) => tile.run::<V, D, 4, 4, WIDE>(i, t, out),
                (true, 3) => tile.run::<V, D, 4, 3, WIDE>(i, t, out),
                (true, _) => tile.run::<V, D, 4, 2, WIDE>(i, t, out),
                (false, 4) => tile.run::<V, D, 1, 4, WIDE>(i, t, out),
                (false, 3) => tile.run::<V, D, 1, 3, WIDE>(i, t, out),
                (false, _) => tile.run::<V, D, 1, 2, WIDE>(i, t, out),
            }
            t += take;
        }
        i += if four { 4 } else { 1 };
    }
}

/// How many of the `left` inputs the next tile takes, at most `most`: as many as fit, two
/// even tiles where one is not enough but two are. Of two or more inputs (a batch; one
/// input takes the row kernel) every tile takes two or more, when `most` is at least three.
pub(super) fn inputs_in_tile(left: usize, most: usize) -> usize {
    debug_assert!(
        left >= 2 && most >= 3,
        "a tile of {left} inputs, at most {most}"
    );
    if left <= most {
        left
    } else if left < 2 * most {
        left.div_ceil(2)
    } else {
        most
    }
}

/// One product's rows and inputs, for [`rows_few_inputs`].
struct Tile<'a, E> {
    data: &'a [E],
    cols: usize,
    scaling: Scaling<'a>,
    first: usize,
    count: usize,
    input: &'a [f32],
}

impl<E> Tile<'_, E> {
    /// Rows `first + i..` (`R` of them) against inputs `t..t + T`, into `out`.
    #[inline(always)]
    unsafe fn run<
        V: Lanes,
        D: Decode<V, Elem = E>,
        const R: usize,
        const T: usize,
        const WIDE: bool,
    >(
        &self,
        i: usize,
        t: usize,
        out: &mut [f32],
    ) {
        let (cols, r) = (self.cols, self.first + i);
        let rows: [&[E]; R] = std::array::from_fn(|k| row_of::<D>(self.data, cols, r + k));
        let xs: [&[f32]; T] = std::array::from_fn(|u| &self.input[(t + u) * cols..][..cols]);
        let sums = dot_rows::<V, D, R, T, WIDE>(rows, r, xs, cols, self.scaling);
        for (k, row) in sums.iter().enumerate() {
            for (u, &sum) in row.iter().enumerate() {
                out[(t + u) * self.count + i + k] = sum;
            }
        }
    }
}

/// Rows `first..first + count` against every one of the `n` inputs, written as
/// `out[t * count + row - first]`: each block of four rows is decoded to f32 once and then
/// reused for every input row, where [`few_inputs`] does not send the batch to
/// [`rows_few_inputs`] (with group scales only).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_batched<V: Lanes, D: Decode<V>>(
    data: &[D::Elem],
    cols: usize,
    scaling: Scaling,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) where
    F32Codes: Decode<V>,
{
    if few_inputs(n, scaling, D::COSTLY_DECODE, false) {
        return rows_few_inputs::<V, D, false>(data, cols, scaling, first, count, input, n, out);
    }
    let mut scratch = vec![0f32; 4 * cols];
    let full = cols / 8;
    let mut i = 0;
    while i < count {
        let block = (count - i).min(4);
        for k in 0..block {
            let row = row_of::<D>(data, cols, first + i + k);
            let decoded = &mut scratch[k * cols..(k + 1) * cols];
            for c in 0..full {
                D::chunk(row, c).store(decoded.as_mut_ptr().add(c * 8));
            }
            for (j, value) in decoded.iter_mut().enumerate().skip(full * 8) {
                *value = D::value(row, j);
            }
        }
        let decoded = |k: usize| &scratch[k * cols..(k + 1) * cols];
        let r = first + i;
        let x = |t: usize| &input[t * cols..(t + 1) * cols];
        let mut t = 0;
        while t < n {
            // Inputs two at a time: only formats with group scales get here (each input
            // needs a partial sum beside its accumulator), every other takes the tiles.
            let take = (n - t).min(2);
            if block == 4 {
                let rows = [decoded(0), decoded(1), decoded(2), decoded(3)];
                let mut put = |k: usize, s: &[f32]| {
                    for (j, &sum) in s.iter().enumerate() {
                        out[(t + j) * count + i + k] = sum;
                    }
                };
                match take {
                    2 => {
                        let sums = dot_tile::<V, 4, 2>(rows, r, [x(t), x(t + 1)], cols, scaling);
                        sums.iter().enumerate().for_each(|(k, s)| put(k, s));
                    }
                    _ => {
                        let sums = dot_tile::<V, 4, 1>(rows, r, [x(t)], cols, scaling);
                        sums.iter().enumerate().for_each(|(k, s)| put(k, s));
                    }
                }
            } else {
                for k in 0..block {
                    for u in t..t + take {
                        let s = dot_tile::<V, 1, 1>([decoded(k)], r + k, [x(u)], cols, scaling);
                        out[u * count + i + k] = s[0][0];
                    }
                }
            }
            t += take;
        }
        i += block;
    }
}

/// The scalar reference: eight lanes in an array, `f32::mul_add` for the fused step.
#[derive(Clone, Copy)]
pub struct Scalar([f32; 8]);

impl Lanes for Scalar {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Scalar([0.0; 8])
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        Scalar([value; 8])
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        Scalar(std::ptr::read_unaligned(ptr as *const [f32; 8]))
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        std::ptr::write_unaligned(ptr as *mut [f32; 8], self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Scalar(std::array::from_fn(|l| a.0[l].mul_add(b.0[l], c.0[l])))
    }
    #[inline(always)]
    unsafe fn add_product(a: Self, b: Self, c: Self) -> Self {
        Scalar(std::array::from_fn(|l| c.0[l] + a.0[l] * b.0[l]))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        let a = self.0;
        ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    }
}

/// The scalar reference decodes element by element.
macro_rules! scalar_decode {
    ($($codes:ty),*) => {$(
        impl Decode<Scalar> for $codes {
            #[inline(always)]
            unsafe fn chunk(row: &[Self::Elem], c: usize) -> Scalar {
                Scalar(std::array::from_fn(|l| Self::value(row, c * 8 + l)))
            }
        }
    )*};
}
scalar_decode!(F32Codes, Bf16Codes, F16Codes, I8Codes, Int4Codes, E4m3Codes, E2m1Codes);

/// The instruction set the kernels use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// The portable reference.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 F/BW/DQ/VL beside AVX2: two 8-lane vectors per register.
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    /// The best instruction set this CPU supports.
    pub fn detect() -> Isa {
        *Isa::usable().last().unwrap_or(&Isa::Scalar)
    }

    /// Every instruction set usable on this CPU, the reference first and the best last.
    pub fn available() -> Vec<Isa> {
        Isa::usable().to_vec()
    }

    /// Whether this CPU can run `self`.
    pub fn supported(self) -> bool {
        Isa::usable().contains(&self)
    }

    fn usable() -> &'static [Isa] {
        static USABLE: std::sync::OnceLock<Vec<Isa>> = std::sync::OnceLock::new();
        USABLE.get_or_init(Isa::probe)
    }

    fn probe() -> Vec<Isa> {
        let mut isas = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                isas.push(Isa::Avx2);
                if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") {
                    isas.push(Isa::Avx512);
                }
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            isas.push(Isa::Neon);
        }
        isas
    }

    /// Parse a `COLI_SIMD` value: `auto`, or an instruction set this CPU supports.
    pub fn from_setting(value: &str) -> Result<Isa> {
        let wanted = match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => return Ok(Isa::detect()),
            "scalar" => Isa::Scalar,
            "avx2" => Isa::Avx2,
            "avx512" => Isa::Avx512,
            "neon" => Isa::Neon,
            other => bail!("COLI_SIMD={other:?}: expected auto, scalar, avx2, avx512 or neon"),
        };
        if !Isa::available().contains(&wanted) {
            bail!(
                "COLI_SIMD={}: this CPU does not support it (available: {})",
                wanted.name(),
                Isa::available()
                    .iter()
                    .map(|isa| isa.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(wanted)
    }
}

const UNSET: u8 = u8::MAX;
static SELECTED: AtomicU8 = AtomicU8::new(UNSET);

fn encode(isa: Isa) -> u8 {
    match isa {
        Isa::Scalar => 0,
        Isa::Avx2 => 1,
        Isa::Neon => 2,
        Isa::Avx512 => 3,
    }
}

/// Use `isa` for every kernel from now on.
pub fn select(isa: Isa) {
    SELECTED.store(encode(isa), Ordering::Relaxed);
}

/// The instruction set in use: the one selected, else `COLI_SIMD` from the environment
/// when it names a supported one, else the best detected.
pub fn selected() -> Isa {
    match SELECTED.load(Ordering::Relaxed) {
        0 => Isa::Scalar,
        1 => Isa::Avx2,
        2 => Isa::Neon,
        3 => Isa::Avx512,
        _ => {
            let isa = std::env::var("COLI_SIMD")
                .ok()
                .and_then(|value| Isa::from_setting(&value).ok())
                .unwrap_or_else(Isa::detect);
            select(isa);
            isa
        }
    }
}

/// A matrix as the kernels see it: storage, shape and scaling.
#[derive(Clone, Copy)]
pub struct View<'a, T> {
    pub data: &'a [T],
    pub rows: usize,
    pub cols: usize,
    pub scaling: Scaling<'a>,
}

/// The work of one block of output rows, for one instruction set and format.
pub(super) trait Block: Sync {
    /// `out[i] = row(first + i) · x`.
    fn rows(&self, first: usize, x: &[f32], out: &mut [f32]);
    /// Rows `first..first + count` against `n` inputs, `out[t * count + row - first]`.
    fn batched(&self, first: usize, count: usize, input: &[f32], n: usize, out: &mut [f32]);
}

struct ScalarBlock<'a, D: Codes>(View<'a, D::Elem>);

impl<D: Decode<Scalar>> Block for ScalarBlock<'_, D> {
    fn rows(&self, first: usize, x: &[f32], out: &mut [f32]) {
        let v = &self.0;
        // SAFETY: the scalar lanes need no CPU feature; bounds are the view's.
        unsafe { rows_into::<Scalar, D, false>(v.data, v.cols, v.scaling, first, x, out) }
    }
    fn batched(&self, first: usize, count: usize, input: &[f32], n: usize, out: &mut [f32]) {
        let v = &self.0;
        // SAFETY: as above.
        unsafe { rows_batched::<Scalar, D>(v.data, v.cols, v.scaling, first, count, input, n, out) }
    }
}

/// `out[t] = W · input[t]` for `n` input rows, with `isa`.
pub fn matmul<D>(isa: Isa, view: View<'_, D::Elem>, input: &[f32], n: usize, out: &mut [f32])
where
    D: Decode<Scalar> + SimdDecode,
{
    let isa = if isa.supported() { isa } else { Isa::Scalar };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => drive(&super::x86::Avx2Block::<D>(view), view, input, n, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => drive(
            &super::avx512::Avx512Block::<D>::batch(view, input, n),
            view,
            input,
            n,
            out,
        ),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => drive(&super::neon::NeonBlock::<D>(view), view, input, n, out),
        _ => drive(&ScalarBlock::<D>(view), view, input, n, out),
    }
}

/// Rows `first..first + count` against each of the `n` rows of `input`, with `isa`, as
/// `out[t * count + row - first]` (`count = out.len() / n`): the elements [`matmul`] gives
/// them.
pub fn rows_product<D>(
    isa: Isa,
    view: View<'_, D::Elem>,
    first: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) where
    D: Decode<Scalar> + SimdDecode,
{
    assert!(
        n > 0 && out.len().is_multiple_of(n),
        "rows_product output shape"
    );
    let count = out.len() / n;
    assert_eq!(input.len(), n * view.cols, "rows_product input width");
    assert!(
        first + count <= view.rows,
        "rows {first}..{} of {}",
        first + count,
        view.rows
    );
    let isa = if isa.supported() { isa } else { Isa::Scalar };
    let mut run = |block: &dyn Block| {
        if n == 1 {
            block.rows(first, input, out)
        } else {
            block.batched(first, count, input, n, out)
        }
    };
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => run(&super::x86::Avx2Block::<D>(view)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if n == 1 => run(&super::avx512::Avx512Block::<D>::new(view)),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => run(&super::avx512::Avx512Block::<D>::batch(view, input, n)),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => run(&super::neon::NeonBlock::<D>(view)),
        _ => run(&ScalarBlock::<D>(view)),
    }
}

/// `a · b` for each `b` of `others` (each as long as `a`): element `8c + l` of the product
/// goes to partial sum `l`, the eight are added as [`Lanes::sum`] adds them, then the
/// products of the last `len % 8` elements in order; every step rounds as plain `f32`
/// arithmetic does. Computed together, each chunk of `a` is read once for all of them and
/// their chains of adds run side by side (one dot alone waits on each add).
pub fn dots<const N: usize>(a: &[f32], others: [&[f32]; N]) -> [f32; N] {
    dots_with::<N, false>(selected(), a, others)
}

/// [`dots`] with each product fused into its add (one rounding, [`Lanes::fma`]; the tail's
/// too), in the same lanes and order: half the arithmetic instructions. The expanded
/// attention of a prompt runs on it ([`fused_add_weighted`], [`Queries::fused`]).
pub fn fused_dots<const N: usize>(a: &[f32], others: [&[f32]; N]) -> [f32; N] {
    dots_with::<N, true>(selected(), a, others)
}

/// `c + a * b`: rounded once where `FUSED`, else the product rounded before the add.
#[inline(always)]
pub(super) unsafe fn step<L: Lanes, const FUSED: bool>(a: L, b: L, c: L) -> L {
    if FUSED {
        L::fma(a, b, c)
    } else {
        L::add_product(a, b, c)
    }
}

/// [`step`] on one element.
#[inline(always)]
fn scalar_step<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED {
        a.mul_add(b, c)
    } else {
        c + a * b
    }
}

/// The products of the elements past the last full chunk, in order: plain, or fused from
/// zero.
#[inline(always)]
pub(super) fn tail_dot<const FUSED: bool>(a: &[f32], b: &[f32]) -> f32 {
    if FUSED {
        a.iter().zip(b).fold(0.0, |sum, (x, y)| x.mul_add(*y, sum))
    } else {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }
}

/// Whether [`Queries`] loads each chunk of a key once for several vectors (the AVX2 and
/// AVX-512 kernels); elsewhere it takes the vectors one at a time, and a caller that would
/// make it compute products it does not need gains nothing.
pub fn loads_shared_across_vectors() -> bool {
    matches!(selected(), Isa::Avx2 | Isa::Avx512)
}

/// Whether [`fused_add_weighted_tile`] loads each row once for several sums and pays for
/// the lanes of the sums that skip it (the AVX-512 kernel): worth it only where the sums
/// read most of the rows. Elsewhere each sum goes through only the rows it reads, a part of
/// every row at a time, which costs no more than the sums one by one whatever they read.
pub fn tile_pays_for_skipped_rows() -> bool {
    selected() == Isa::Avx512
}

/// [`dots`] (or [`fused_dots`]) with `isa`.
pub(super) fn dots_with<const N: usize, const FUSED: bool>(
    isa: Isa,
    a: &[f32],
    others: [&[f32]; N],
) -> [f32; N] {
    for b in &others {
        assert_eq!(b.len(), a.len(), "dots: every vector as long as the first");
    }
    let isa = if isa.supported() { isa } else { Isa::Scalar };
    // SAFETY: `isa` is supported, and every vector is as long as `a`.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => super::x86::dots::<N, FUSED>(a, others),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon::dots::<N, FUSED>(a, others),
            _ => dots_on::<Scalar, N, FUSED>(a, others),
        }
    }
}

/// [`dots`] on lanes `L` (with `FUSED`, [`fused_dots`]).
/// # Safety
/// The CPU must have `L`'s instruction set; every `others` as long as `a`.
#[inline(always)]
pub(super) unsafe fn dots_on<L: Lanes, const N: usize, const FUSED: bool>(
    a: &[f32],
    others: [&[f32]; N],
) -> [f32; N] {
    let n = a.len();
    let mut sums = [L::zero(); N];
    for c in 0..n / 8 {
        let x = L::load(a.as_ptr().add(8 * c));
        for (sum, b) in sums.iter_mut().zip(&others) {
            *sum = step::<L, FUSED>(x, L::load(b.as_ptr().add(8 * c)), *sum);
        }
    }
    let body = n / 8 * 8;
    std::array::from_fn(|j| sums[j].sum() + tail_dot::<FUSED>(&a[body..], &others[j][body..]))
}

/// Vectors of one length that are each dotted with many others: a row's query heads
/// against every cached key. [`Queries::dots`] gives the bits of [`dots`]. Where the kernels
/// run AVX-512 the vectors are also kept in pairs, chunk by chunk (eight elements of one,
/// then the same eight of the next), so that one 512-bit load brings a chunk of two of them
/// and a key's chunk, loaded into both halves, serves both: each lane's sum is the one an
/// 8-lane vector keeps, twice as many at a time. With AVX2 two vectors at a time share
/// each load of a key's chunk. Built with [`Queries::fused`], it gives the bits of
/// [`fused_dots`].
pub struct Queries<'a> {
    vectors: &'a [f32],
    count: usize,
    len: usize,
    isa: Isa,
    fused: bool,
    /// Pairs of vectors interleaved chunk by chunk, each chunk of a pair on a cache line of
    /// its own; empty unless the kernels run AVX-512.
    paired: Lines,
}

impl<'a> Queries<'a> {
    /// The `count` vectors of equal length in `vectors` (of any length, none included).
    pub fn new(vectors: &'a [f32], count: usize) -> Queries<'a> {
        Queries::with(selected(), vectors, count, false)
    }

    /// [`Queries::new`], dotted as [`fused_dots`] dots.
    pub fn fused(vectors: &'a [f32], count: usize) -> Queries<'a> {
        Queries::with(selected(), vectors, count, true)
    }

    /// [`Queries::new`] or [`Queries::fused`] for the kernels of `isa`.
    pub(super) fn with(isa: Isa, vectors: &'a [f32], count: usize, fused: bool) -> Queries<'a> {
        assert!(
            count > 0 && vectors.len().is_multiple_of(count),
            "queries: {count} vectors of one length"
        );
        let len = vectors.len() / count;
        let isa = if isa.supported() { isa } else { Isa::Scalar };
        let chunks = len / 8;
        let paired = if isa == Isa::Avx512 && len > 0 {
            let mut paired = Lines::zeroed(count / 2 * chunks * 16);
            let chunks_of_pairs = paired.floats_mut().chunks_exact_mut(16);
            let pair_chunks = vectors.chunks_exact(2 * len).flat_map(|pair| {
                let (low, high) = pair.split_at(len);
                (0..chunks).map(move |c| (&low[8 * c..][..8], &high[8 * c..][..8]))
            });
            for (into, (low, high)) in chunks_of_pairs.zip(pair_chunks) {
                into[..8].copy_from_slice(low);
                into[8..].copy_from_slice(high);
            }
            paired
        } else {
            Lines::zeroed(0)
        };
        Queries {
            vectors,
            count,
            len,
            isa,
            fused,
            paired,
        }
    }

    /// `out[i][j]` = vector `i` · `keys[j]`, for every vector (`out` one entry a vector,
    /// each key as long as a vector), bit for bit as [`dots`] (or [`fused_dots`]) computes it.
    pub fn dots<const K: usize>(&self, keys: [&[f32]; K], out: &mut [[f32; K]]) {
        assert_eq!(out.len(), self.count, "queries: one result per vector");
        for key in &keys {
            assert_eq!(
                key.len(),
                self.len,
                "queries: every key as long as a vector"
            );
        }
        match self.isa {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is supported, `paired` holds every pair, and the lengths match.
            Isa::Avx512 => unsafe {
                let (paired, vectors, len) = (self.paired.floats(), self.vectors, self.len);
                if self.fused {
                    super::avx512::paired_dots::<K, true>(paired, vectors, len, keys, out)
                } else {
                    super::avx512::paired_dots::<K, false>(paired, vectors, len, keys, out)
                }
            },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `isa` is supported, and the lengths match.
            Isa::Avx2 => unsafe {
                if self.fused {
                    super::x86::queries_dots::<K, true>(self.vectors, self.len, keys, out)
                } else {
                    super::x86::queries_dots::<K, false>(self.vectors, self.len, keys, out)
                }
            },
            isa => {
                for (i, out) in out.iter_mut().enumerate() {
                    let vector = &self.vectors[i * self.len..][..self.len];
                    *out = if self.fused {
                        dots_with::<K, true>(isa, vector, keys)
                    } else {
                        dots_with::<K, false>(isa, vector, keys)
                    };
                }
            }
        }
    }
}

/// `acc[i] += weights[j] * rows[j][i]` for `j = 0, 1, ..`, element by element (each row as
/// long as `acc`; each product rounded before its add): `N` passes of plain `f32`
/// arithmetic, bit for bit, reading and writing `acc` once.
pub fn add_weighted<const N: usize>(acc: &mut [f32], weights: [f32; N], rows: [&[f32]; N]) {
    add_weighted_with::<N, false>(selected(), acc, weights, rows)
}

/// [`add_weighted`] with each product fused into its add (`acc[i] = fma(weights[j],
/// rows[j][i], acc[i])`, one rounding), in the same order.
pub fn fused_add_weighted<const N: usize>(acc: &mut [f32], weights: [f32; N], rows: [&[f32]; N]) {
    add_weighted_with::<N, true>(selected(), acc, weights, rows)
}

/// [`add_weighted`] (or [`fused_add_weighted`]) with `isa`.
pub(super) fn add_weighted_with<const N: usize, const FUSED: bool>(
    isa: Isa,
    acc: &mut [f32],
    weights: [f32; N],
    rows: [&[f32]; N],
) {
    for row in &rows {
        assert_eq!(
            row.len(),
            acc.len(),
            "add_weighted: every row as long as the sum"
        );
    }
    let isa = if isa.supported() { isa } else { Isa::Scalar };
    // SAFETY: `isa` is supported, and every row is as long as `acc`.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::x86::add_weighted::<N, FUSED>(acc, weights, rows),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::avx512::add_weighted::<N, FUSED>(acc, weights, rows),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon::add_weighted::<N, FUSED>(acc, weights, rows),
            _ => add_weighted_on::<Scalar, N, FUSED>(acc, weights, rows),
        }
    }
}

/// Several sums over one span of rows (at most 64): for each sum `r` (`sums` holds them one
/// after another, each as long as every row) and each `j` in order whose bit `j` of
/// `reads[r]` is set, `sum_r = fma(weights[r * rows.len() + j], rows[j], sum_r)`. Each sum
/// gets the bits [`fused_add_weighted`] gives it over the rows it reads; a row it does not
/// read is not touched, whatever it holds. Where the kernels run AVX-512 each row's chunk is
/// loaded once for four sums ([`loads_shared_across_vectors`]). Panics if the shapes differ
/// or a mask names a row past the last.
pub fn fused_add_weighted_tile(sums: &mut [f32], weights: &[f32], reads: &[u64], rows: &[&[f32]]) {
    add_weighted_tile_with(selected(), sums, weights, reads, rows)
}

/// [`fused_add_weighted_tile`] with `isa`.
pub(super) fn add_weighted_tile_with(
    isa: Isa,
    sums: &mut [f32],
    weights: &[f32],
    reads: &[u64],
    rows: &[&[f32]],
) {
    let len = sums.len() / reads.len().max(1);
    assert!(rows.len() <= 64, "fused_add_weighted_tile: at most 64 rows");
    assert_eq!(
        sums.len(),
        reads.len() * len,
        "fused_add_weighted_tile: one sum a mask"
    );
    assert_eq!(
        weights.len(),
        reads.len() * rows.len(),
        "fused_add_weighted_tile: one weight a sum and row"
    );
    for row in rows {
        assert_eq!(
            row.len(),
            len,
            "fused_add_weighted_tile: every row as long as a sum"
        );
    }
    if len == 0 {
        return;
    }
    let isa = if isa.supported() { isa } else { Isa::Scalar };
    // SAFETY: `isa` is supported, and the shapes are checked above.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => super::x86::add_weighted_tile(sums, len, weights, reads, rows),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => super::avx512::add_weighted_tile(sums, len, weights, reads, rows),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon::add_weighted_tile(sums, len, weights, reads, rows),
            _ => add_weighted_tile_on::<Scalar>(sums, len, weights, reads, rows),
        }
    }
}

/// Eight-lane chunks of every sum that [`add_weighted_tile_on`] keeps in registers while it
/// goes through the rows the sum reads: 64 elements, so the part of a 64-row span it reads
/// (16 KB) stays in the first-level cache while every sum of the tile reads it again.
const TILE_CHUNKS: usize = 8;

/// [`fused_add_weighted_tile`] on lanes `L`, each sum on its own: [`TILE_CHUNKS`] chunks of
/// every sum at a time, each through the rows it reads, then the elements past the last
/// full chunk one at a time.
/// # Safety
/// The CPU must have `L`'s instruction set; the shapes as [`add_weighted_tile_with`] checks.
#[inline(always)]
pub(super) unsafe fn add_weighted_tile_on<L: Lanes>(
    sums: &mut [f32],
    len: usize,
    weights: &[f32],
    reads: &[u64],
    rows: &[&[f32]],
) {
    let span = rows.len();
    let chunks = len / 8;
    let mut first = 0;
    while first < chunks {
        let group = (chunks - first).min(TILE_CHUNKS);
        for (r, sum) in sums.chunks_exact_mut(len).enumerate() {
            let weights = &weights[r * span..][..span];
            if group == TILE_CHUNKS {
                sum_chunks::<L, TILE_CHUNKS>(sum, 8 * first, weights, reads[r], rows);
            } else {
                for c in first..first + group {
                    sum_chunks::<L, 1>(sum, 8 * c, weights, reads[r], rows);
                }
            }
        }
        first += group;
    }
    for (r, sum) in sums.chunks_exact_mut(len).enumerate() {
        for i in chunks * 8..len {
            let mut bits = reads[r];
            while bits != 0 {
                let j = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                sum[i] = scalar_step::<true>(weights[r * span + j], rows[j][i], sum[i]);
            }
        }
    }
}

/// `G` chunks of one sum of [`add_weighted_tile_on`] from element `at`, held in registers
/// through every row whose bit is set in `reads`, in order.
#[inline(always)]
unsafe fn sum_chunks<L: Lanes, const G: usize>(
    sum: &mut [f32],
    at: usize,
    weights: &[f32],
    reads: u64,
    rows: &[&[f32]],
) {
    let base = sum[at..][..8 * G].as_mut_ptr();
    let mut acc: [L; G] = std::array::from_fn(|c| L::load(base.add(8 * c)));
    let mut bits = reads;
    while bits != 0 {
        let j = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let weight = L::splat(weights[j]);
        let row = rows[j][at..][..8 * G].as_ptr();
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = L::fma(weight, L::load(row.add(8 * c)), *acc);
        }
    }
    for (c, acc) in acc.iter().enumerate() {
        acc.store(base.add(8 * c));
    }
}

/// [`add_weighted`] on lanes `L` (with `FUSED`, [`fused_add_weighted`]).
/// # Safety
/// The CPU must have `L`'s instruction set; every row as long as `acc`.
#[inline(always)]
pub(super) unsafe fn add_weighted_on<L: Lanes, const N: usize, const FUSED: bool>(
    acc: &mut [f32],
    weights: [f32; N],
    rows: [&[f32]; N],
) {
    let n = acc.len();
    let splats = weights.map(|w| L::splat(w));
    for c in 0..n / 8 {
        let at = acc.as_mut_ptr().add(8 * c);
        let mut sum = L::load(at);
        for (w, row) in splats.iter().zip(&rows) {
            sum = step::<L, FUSED>(*w, L::load(row.as_ptr().add(8 * c)), sum);
        }
        sum.store(at);
    }
    for i in n / 8 * 8..n {
        for (w, row) in weights.iter().zip(&rows) {
            acc[i] = scalar_step::<FUSED>(*w, row[i], acc[i]);
        }
    }
}

/// The decoders every compiled instruction set provides.
#[cfg(target_arch = "x86_64")]
pub trait SimdDecode: Decode<super::x86::Avx2> + super::avx512::Pair {}
#[cfg(target_arch = "x86_64")]
impl<T: Decode<super::x86::Avx2> + super::avx512::Pair> SimdDecode for T {}
#[cfg(target_arch = "aarch64")]
pub trait SimdDecode: Decode<super::neon::Neon> {}
#[cfg(target_arch = "aarch64")]
impl<T: Decode<super::neon::Neon>> SimdDecode for T {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub trait SimdDecode {}
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
impl<T> SimdDecode for T {}

fn drive<T>(block: &dyn Block, view: View<'_, T>, input: &[f32], n: usize, out: &mut [f32]) {
    let (rows, cols) = (view.rows, view.cols);
    assert_eq!(input.len(), n * cols, "matmul input shape");
    assert_eq!(out.len(), n * rows, "matmul output shape");
    if rows == 0 || n == 0 {
        return;
    }
    if n == 1 {
        let (chunk, parallel) = row_blocks(rows, cols, n);
        let run = |(b, out): (usize, &mut [f32])| block.rows(b * chunk, input, out);
        if parallel {
            out.par_chunks_mut(chunk).enumerate().for_each(run);
        } else {
            out.chunks_mut(chunk).enumerate().for_each(run);
        }
        return;
    }
    by_weight_rows(rows, cols, n, out, |first, count, block_out| {
        block.batched(first, count, input, n, block_out)
    });
}

/// Rows per block of work and whether blocks run in parallel: whole 4-row groups, a few
/// blocks per thread so uneven rows balance out, once the product is worth the threads.
fn row_blocks(rows: usize, cols: usize, n: usize) -> (usize, bool) {
    let parallel = n * rows * cols >= 1 << 16 && rayon::current_num_threads() > 1;
    let chunk = if parallel {
        rows.div_ceil(rayon::current_num_threads() * 4)
            .next_multiple_of(4)
            .max(16)
    } else {
        rows
    };
    (chunk, parallel)
}

/// A product of `n` inputs computed by blocks of weight rows: `block(first, count, sums)`
/// writes rows `first..first + count` against every input as `sums[t * count + row -
/// first]` (each weight row read once for all inputs), and the task that ran it copies each
/// input's run into its row of `out` (`n x rows`) while the sums are still in its cache.
/// `sums` is the thread's own scratch, reused from product to product; a `block` must
/// write every element of it and must not wait on the thread pool (a job stolen meanwhile
/// could ask for the same scratch).
pub(super) fn by_weight_rows(
    rows: usize,
    cols: usize,
    n: usize,
    out: &mut [f32],
    block: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    assert_eq!(out.len(), rows * n, "matmul output shape");
    let (chunk, parallel) = row_blocks(rows, cols, n);
    let out = OutputRows::new(out, rows);
    let run = |b: usize| {
        let first = b * chunk;
        let count = chunk.min(rows - first);
        BLOCK_SUMS.with_borrow_mut(|scratch| {
            if scratch.len() < count * n {
                scratch.resize(count * n, 0.0);
            }
            let sums = &mut scratch[..count * n];
            block(first, count, sums);
            for (t, run) in sums.chunks_exact(count).enumerate() {
                out.write(t, first, run);
            }
        })
    };
    let blocks = rows.div_ceil(chunk);
    if parallel {
        (0..blocks).into_par_iter().for_each(run);
    } else {
        (0..blocks).for_each(run);
    }
}

thread_local! {
    /// [`by_weight_rows`]'s per-thread block results: a prompt's products would otherwise
    /// each allocate (and fault in) an `n x rows` buffer only to copy it once.
    static BLOCK_SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The `n x rows` output of [`by_weight_rows`], written by several tasks at once, each in
/// its own columns.
struct OutputRows<'a> {
    ptr: *mut f32,
    rows: usize,
    n: usize,
    _out: std::marker::PhantomData<&'a mut [f32]>,
}

// SAFETY: the tasks of one `by_weight_rows` write disjoint columns (their blocks of weight
// rows) through `write`, and `out` stays borrowed for the object's life.
unsafe impl Sync for OutputRows<'_> {}

impl<'a> OutputRows<'a> {
    fn new(out: &'a mut [f32], rows: usize) -> Self {
        OutputRows {
            ptr: out.as_mut_ptr(),
            rows,
            n: out.len() / rows.max(1),
            _out: std::marker::PhantomData,
        }
    }

    /// `out[t][first..first + run.len()] = run`. Callers write each column once, from one
    /// task: [`by_weight_rows`] gives every task its own block of columns.
    fn write(&self, t: usize, first: usize, run: &[f32]) {
        assert!(
            t < self.n && first + run.len() <= self.rows,
            "block outside the output"
        );
        // SAFETY: in bounds (asserted); no other task writes these columns, and nothing
        // reads `out` until every task has finished.
        unsafe {
            std::ptr::copy_nonoverlapping(
                run.as_ptr(),
                self.ptr.add(t * self.rows + first),
                run.len(),
            )
        }
    }
}

/// Row `row` dequantised (`value · scale`) into `out`.
pub fn dequantize_row<D>(isa: Isa, view: View<'_, D::Elem>, row: usize, out: &mut [f32])
where
    D: Decode<Scalar> + SimdDecode,
{
    assert_eq!(out.len(), view.cols, "dequantize_row width");
    assert!(row < view.rows, "row {row} of {}", view.rows);
    let isa = if isa.supported() { isa } else { Isa::Scalar };
    // SAFETY: `isa` is supported and `out` is the row's width.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => super::x86::dequantize_row::<D>(view, row, out),
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => super::neon::dequantize_row::<D>(view, row, out),
            _ => dequantize_row_on::<Scalar, D>(view, row, out),
        }
    }
}

/// [`dequantize_row`] on lanes `L`: eight elements at a time where a group is a whole
/// number of chunks, each `value * scale` (as an FMA onto -0, which adds nothing to any
/// product, so the bits of the scalar product).
/// # Safety
/// The CPU must have `L`'s instruction set; `out` is `view.cols` wide and `row` a row.
#[inline(always)]
pub(super) unsafe fn dequantize_row_on<L: Lanes, D: Decode<L>>(
    view: View<'_, D::Elem>,
    row: usize,
    out: &mut [f32],
) {
    let data = row_of::<D>(view.data, view.cols, row);
    // The scale looked up once per group (once per row without groups): MLA's absorbed
    // decode reads thousands of rows a token this way.
    let group = view.scaling.group_size().unwrap_or(out.len()).max(1);
    for (g, values) in out.chunks_mut(group).enumerate() {
        let scale = view.scaling.element_scale(row, g * group);
        let (splat, nothing) = (L::splat(scale), L::splat(-0.0));
        let whole = if group % 8 == 0 { values.len() / 8 } else { 0 };
        for c in 0..whole {
            let decoded = D::chunk(data, g * group / 8 + c);
            L::fma(decoded, splat, nothing).store(values.as_mut_ptr().add(8 * c));
        }
        for (j, y) in values.iter_mut().enumerate().skip(8 * whole) {
            *y = D::value(data, g * group + j) * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`dots`] and [`add_weighted`] on every instruction set against the plain loops they
    /// stand for, and [`fused_dots`] and [`fused_add_weighted`] against the same loops with
    /// `mul_add`, bit for bit, at lengths with and without a tail and with zeros of both
    /// signs.
    #[test]
    fn dots_and_weighted_sums_are_plain_f32_arithmetic_on_every_instruction_set() {
        let noise = |len: usize, seed: u32| -> Vec<f32> {
            (0..len as u32)
                .map(|i| match (i + seed) % 13 {
                    0 => -0.0,
                    1 => 0.0,
                    _ => {
                        (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 40_503) % 2000) as f32
                            / 997.0
                            - 1.0
                    }
                })
                .collect()
        };
        for len in [0, 1, 7, 8, 9, 63, 64, 65, 130, 576] {
            let a = noise(len, 1);
            let others = [noise(len, 2), noise(len, 3), noise(len, 4)];
            let loop_dot = |b: &[f32], fused: bool| {
                let step = |x: f32, y: f32, acc: f32| {
                    if fused {
                        x.mul_add(y, acc)
                    } else {
                        acc + x * y
                    }
                };
                let mut lanes = [0f32; 8];
                for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
                    for l in 0..8 {
                        lanes[l] = step(x[l], y[l], lanes[l]);
                    }
                }
                let rest = a[len / 8 * 8..].iter().zip(&b[len / 8 * 8..]);
                let tail: f32 = if fused {
                    rest.fold(0.0, |acc, (x, y)| step(*x, *y, acc))
                } else {
                    rest.map(|(x, y)| x * y).sum()
                };
                ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
                    + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
                    + tail
            };
            let weights = [0.75f32, -1.5, -0.0];
            let loop_sum = |fused: bool| {
                let mut sum = noise(len, 5);
                for (w, row) in weights.iter().zip(&others) {
                    for (acc, x) in sum.iter_mut().zip(row) {
                        *acc = if fused {
                            w.mul_add(*x, *acc)
                        } else {
                            *acc + w * x
                        };
                    }
                }
                sum
            };
            let rows = [&others[0][..], &others[1][..], &others[2][..]];
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for isa in Isa::available() {
                let plain = dots_with::<3, false>(isa, &a, rows);
                let fused = dots_with::<3, true>(isa, &a, rows);
                for ((plain, fused), b) in plain.iter().zip(&fused).zip(&others) {
                    let want = (loop_dot(b, false), loop_dot(b, true));
                    assert_eq!(plain.to_bits(), want.0.to_bits(), "{isa:?} dot of {len}");
                    assert_eq!(
                        fused.to_bits(),
                        want.1.to_bits(),
                        "{isa:?} fused dot of {len}"
                    );
                }
                let mut sum = noise(len, 5);
                add_weighted_with::<3, false>(isa, &mut sum, weights, rows);
                assert_eq!(bits(&sum), bits(&loop_sum(false)), "{isa:?} sum of {len}");
                let mut sum = noise(len, 5);
                add_weighted_with::<3, true>(isa, &mut sum, weights, rows);
                assert_eq!(
                    bits(&sum),
                    bits(&loop_sum(true)),
                    "{isa:?} fused sum of {len}"
                );
            }
        }
    }

    /// Values in [-1, 1) that differ from seed to seed.
    fn noise(len: usize, seed: u32) -> Vec<f32> {
        (0..len as u32)
            .map(|i| {
                let x = i.wrapping_mul(2_654_435_761).wrapping_add(seed * 40_503);
                (x % 2000) as f32 / 997.0 - 1.0
            })
            .collect()
    }

    /// [`fused_add_weighted_tile`] on every instruction set against [`fused_add_weighted`]
    /// of the rows each sum reads: sums as long as a register's chunk, longer, and with
    /// tails; counts with and without a last group of fewer than four; masks empty, full and
    /// sparse; rows that nobody reads holding NaN and infinity.
    #[test]
    fn tile_sums_give_the_bits_of_each_sum_over_the_rows_it_reads() {
        for (count, span, len) in [
            (1, 1, 8),
            (4, 64, 256),
            (6, 37, 21),
            (9, 64, 70),
            (3, 5, 3),
            (39, 64, 80),
        ] {
            let mut values: Vec<Vec<f32>> = (0..span).map(|j| noise(len, 10 + j as u32)).collect();
            values[span / 2].fill(f32::NAN);
            values[span - 1][0] = f32::INFINITY;
            let reads: Vec<u64> = (0..count as u64)
                .map(|r| match r % 4 {
                    0 => u64::MAX >> (64 - span),
                    1 => 0,
                    _ => 0x9E37_79B9_7F4A_7C15u64.rotate_left(r as u32 * 7) >> (64 - span),
                })
                .map(|bits| bits & !(1 << (span / 2)) & !(1 << (span - 1)))
                .collect();
            let weights = noise(count * span, 2);
            let start = noise(count * len, 3);
            let rows: Vec<&[f32]> = values.iter().map(|v| &v[..]).collect();
            let mut want = start.clone();
            for (r, sum) in want.chunks_exact_mut(len).enumerate() {
                for (j, row) in rows.iter().enumerate() {
                    if reads[r] >> j & 1 == 1 {
                        let w = [weights[r * span + j]];
                        add_weighted_with::<1, true>(Isa::Scalar, sum, w, [row]);
                    }
                }
            }
            for isa in Isa::available() {
                let mut got = start.clone();
                add_weighted_tile_with(isa, &mut got, &weights, &reads, &rows);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{isa:?} {count}x{span}x{len}");
            }
        }
    }

    /// [`Queries::dots`] on every instruction set against [`dots`] (built with
    /// [`Queries::fused`], [`fused_dots`]) of each vector alone: counts odd and even, lengths
    /// with and without a tail, and empty vectors.
    #[test]
    fn queries_give_the_bits_of_each_vector_alone() {
        for (count, len) in [
            (1, 8),
            (2, 16),
            (3, 21),
            (9, 128),
            (32, 128),
            (17, 43),
            (11, 64),
            (4, 0),
        ] {
            let vectors = noise(count * len, 1);
            let keys: Vec<Vec<f32>> = (0..9u32).map(|j| noise(len, 2 + j)).collect();
            // Three keys (no group of four), four (AVX-512 sums eight vectors' in one go),
            // and nine (two groups of four and one more).
            let three: [&[f32]; 3] = std::array::from_fn(|j| &keys[j][..]);
            let four: [&[f32]; 4] = std::array::from_fn(|j| &keys[j][..]);
            let nine: [&[f32]; 9] = std::array::from_fn(|j| &keys[j][..]);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (isa, fused) in Isa::available()
                .into_iter()
                .flat_map(|isa| [(isa, false), (isa, true)])
            {
                let queries = Queries::with(isa, &vectors, count, fused);
                let (mut got3, mut got9) = (vec![[0f32; 3]; count], vec![[0f32; 9]; count]);
                let mut got4 = vec![[0f32; 4]; count];
                queries.dots(three, &mut got3);
                queries.dots(four, &mut got4);
                queries.dots(nine, &mut got9);
                for i in 0..count {
                    let vector = &vectors[i * len..][..len];
                    let want = if fused {
                        dots_with::<9, true>(Isa::Scalar, vector, nine)
                    } else {
                        dots_with::<9, false>(Isa::Scalar, vector, nine)
                    };
                    assert_eq!(bits(&got9[i]), bits(&want), "{isa:?} {fused}");
                    assert_eq!(bits(&got3[i]), bits(&want[..3]), "{isa:?} {fused}");
                    assert_eq!(bits(&got4[i]), bits(&want[..4]), "{isa:?} {fused}");
                }
            }
        }
    }

    fn reference_dot(w: &[f32], x: &[f32]) -> f32 {
        let mut acc = [0f32; 8];
        for (i, (a, b)) in w.iter().zip(x).enumerate() {
            acc[i % 8] = a.mul_add(*b, acc[i % 8]);
        }
        ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
    }

    #[test]
    fn lane_order_is_the_documented_one() {
        for cols in [1, 7, 8, 9, 19, 64] {
            let w: Vec<f32> = (0..cols).map(|i| i as f32 * 0.37 - 3.0).collect();
            let x: Vec<f32> = (0..cols).map(|i| (i % 5) as f32 * 1.3 - 2.0).collect();
            let view = View {
                data: &w[..],
                rows: 1,
                cols,
                scaling: Scaling::None,
            };
            for isa in Isa::available() {
                let mut y = [0f32];
                matmul::<F32Codes>(isa, view, &x, 1, &mut y);
                assert_eq!(y[0], reference_dot(&w, &x), "{isa:?} cols {cols}");
            }
        }
    }

    #[test]
    fn settings_values_parse() {
        assert_eq!(Isa::from_setting("scalar").unwrap(), Isa::Scalar);
        assert_eq!(Isa::from_setting("auto").unwrap(), Isa::detect());
        assert!(Isa::from_setting("sse9").is_err());
    }
}
