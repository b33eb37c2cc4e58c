//! `ACT_BITS=8`: int8 activations for int8, int4 and MXFP4 weights, an opt-in fast path that the
//! oracle never takes (with `EBITS`/`DBITS >= 16` every matrix keeps f32 activations and
//! the run refuses `ACT_BITS=8`).
//!
//! Each input row is quantised symmetrically, `s = max|x| / 127`, `q = round(x / s)`, and
//! a weight row's dot product with it is built from exact integer sums: int8 x int8 for
//! int8-row, int4 x int8 for int4-row and int4 in groups, doubled e2m1 (the integers
//! -12..=12) x int8 for MXFP4. The float part is fixed. int8-row: the row's integer sum
//! times the row scale times the activation scale. The group formats keep eight f32
//! lanes, lane `l` owning columns `8l..8l + 8` of every block of 64 (the columns one
//! 32-bit lane of `vpdpbusd` adds up): per scale group, each lane's integer sum times the
//! group's scale is fused into the lane, the lanes are summed in the kernels' order
//! (`((l0+l4)+(l2+l6))+((l1+l5)+(l3+l7))`) and the sum is multiplied by the activation
//! scale. So no group needs a horizontal sum of its own. Integer sums do not depend on
//! the order they are taken in, so the SIMD paths (AVX2 `maddubs` on any CPU that has
//! AVX2, AVX-VNNI `vpdpbusd`, and 512-bit `vpdpbusd` for int4 and int8 batches with
//! AVX-512 VNNI) compute the same bits as the scalar reference, a batch the same as its rows one
//! by one, and the thread count changes nothing.
//!
//! What it costs in quality is measured, not assumed (`PPL=1 KLD_BASE=`; docs/benchmarks.md).

use std::sync::atomic::{AtomicBool, Ordering};

use super::codec::{self, E2M1_DOUBLED};
use super::kernels::{Isa, Lanes, Scalar};

static ENABLED: AtomicBool = AtomicBool::new(false);

/// Turn int8 activations on or off for every int8, int4 and MXFP4 matrix product that runs on the
/// CPU from now on.
pub fn select(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The weights of one int8 or int4 matrix, as the kernels read them.
#[derive(Clone, Copy)]
pub(super) enum Weights<'a> {
    /// `rows x cols` int8, one scale per row.
    Int8Row { values: &'a [i8], scales: &'a [f32] },
    /// Offset-binary nibbles (`q + 8`, low nibble first), `ceil(cols / 2)` bytes a row, one
    /// scale per `group` columns (`group >= cols`: one per row).
    Int4 {
        packed: &'a [u8],
        scales: &'a [f32],
        group: usize,
    },
    /// e2m1 nibbles (low nibble first), `ceil(cols / 2)` bytes a row, one E8M0 exponent
    /// per 32 columns.
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
}

/// Columns per MXFP4 scale.
const MX_GROUP: usize = 32;

/// One input row quantised: `q` in the layout the weights' kernel reads, and its scale.
struct Quantised {
    q: Vec<i8>,
    scale: f32,
    /// Int4 and MXFP4 layout: per whole block of 64 columns, the sum of `q` over each
    /// lane's eight columns (lane `l`: columns `8l..8l + 8` of the block). The weights'
    /// unsigned offset (int4's `+ 8`, MXFP4's `+ 12`) is taken back lane by lane as
    /// `offset * sum`.
    lane_sums: Vec<i32>,
    /// Int8 layout: the sum of `q` over the whole blocks of 64 columns (the offset the
    /// 512-bit int8 path takes back).
    block_sum: i32,
}

/// Columns per block: for int4 and MXFP4, 32 packed bytes whose low nibbles are the even
/// columns and high nibbles the odd ones; for int8, one 512-bit load.
const BLOCK: usize = 64;

/// `s = max|x| / 127` and `q = round(x / s)` (ties to even), 0 for an all-zero row.
fn quantise(x: &[f32]) -> (Vec<i8>, f32) {
    // A NaN makes the scale NaN (and so every output), as the f32 path would.
    let max = x.iter().fold(0f32, |m, v| {
        if v.is_nan() || m.is_nan() {
            f32::NAN
        } else {
            m.max(v.abs())
        }
    });
    if max == 0.0 || !max.is_finite() {
        return (vec![0; x.len()], if max.is_finite() { 0.0 } else { max });
    }
    let scale = max / 127.0;
    let q = x
        .iter()
        .map(|v| (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8)
        .collect();
    (q, scale)
}

/// [`quantise`] in the instruction set `isa` where it has a vector form (the same
/// divisions and roundings, so the same bits).
fn quantise_on(isa: Isa, x: &[f32]) -> (Vec<i8>, f32) {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) && isa.supported() {
        // SAFETY: AVX2 was detected.
        return unsafe { avx2::quantise(x) };
    }
    let _ = isa;
    quantise(x)
}

impl Quantised {
    fn natural(isa: Isa, x: &[f32]) -> Quantised {
        let (q, scale) = quantise_on(isa, x);
        let whole = x.len() / BLOCK * BLOCK;
        let block_sum = q[..whole].iter().map(|&v| i32::from(v)).sum();
        Quantised {
            q,
            scale,
            lane_sums: Vec::new(),
            block_sum,
        }
    }

    /// For int4 and MXFP4 weights: each whole block of 64 columns as its 32 even columns then
    /// its 32 odd ones (the order a block's low and high nibbles come in), the rest as they
    /// are.
    fn deinterleaved(isa: Isa, x: &[f32]) -> Quantised {
        let (natural, scale) = quantise_on(isa, x);
        let mut q = natural.clone();
        let whole = x.len() / BLOCK * BLOCK;
        for (block, src) in q[..whole]
            .chunks_exact_mut(BLOCK)
            .zip(natural.chunks_exact(BLOCK))
        {
            for i in 0..BLOCK / 2 {
                block[i] = src[2 * i];
                block[BLOCK / 2 + i] = src[2 * i + 1];
            }
        }
        let lane_sums = natural[..whole]
            .chunks_exact(LANE_COLS)
            .map(|lane| lane.iter().map(|&v| i32::from(v)).sum())
            .collect();
        Quantised {
            q,
            scale,
            lane_sums,
            block_sum: 0,
        }
    }
}

/// `sum w[i] * x[i]`.
fn dot_i8_scalar(w: &[i8], x: &[i8]) -> i32 {
    w.iter()
        .zip(x)
        .map(|(&a, &b)| i32::from(a) * i32::from(b))
        .sum()
}

/// Columns a lane covers inside a block of 64: lane `l` holds columns `8l..8l + 8`, the
/// columns whose products one 32-bit lane of the integer instructions adds up.
const LANE_COLS: usize = 8;

/// The lane of column `c`.
fn lane_of(c: usize) -> usize {
    c % BLOCK / LANE_COLS
}

/// The eight lanes summed in the order every kernel sums them.
fn lane_sum(lanes: [f32; 8]) -> f32 {
    // SAFETY: the scalar lanes need no CPU feature, and the array holds their eight values.
    unsafe { Scalar::load(lanes.as_ptr()).sum() }
}

/// Nibble `c` of a packed row (low nibble first).
fn nibble(w: &[u8], c: usize) -> u8 {
    if c.is_multiple_of(2) {
        w[c / 2] & 15
    } else {
        w[c / 2] >> 4
    }
}

/// One weight row (`row`) against one quantised input: the scalar reference. The group
/// formats keep eight f32 lanes; each scale group adds each lane's exact integer sum
/// times the group's scale to that lane (one fused step), and the lanes are summed once.
fn row_dot(weights: Weights, row: usize, cols: usize, x: &Quantised) -> f32 {
    let whole = x.q.len() / BLOCK * BLOCK;
    // Adds `code(c) * x[c]` over each group of columns into its lanes, times the group's
    // scale.
    let grouped = |group: usize, code: &dyn Fn(usize) -> i32, scale: &dyn Fn(usize) -> f32| {
        let mut lanes = [0f32; 8];
        for g in 0..cols.div_ceil(group) {
            let mut isums = [0i32; 8];
            let mut touched = [false; 8];
            for c in g * group..((g + 1) * group).min(cols) {
                isums[lane_of(c)] += code(c) * i32::from(x.q[deinterleaved_index(c, whole)]);
                touched[lane_of(c)] = true;
            }
            for l in (0..8).filter(|&l| touched[l]) {
                lanes[l] = (isums[l] as f32).mul_add(scale(g), lanes[l]);
            }
        }
        lane_sum(lanes) * x.scale
    };
    match weights {
        Weights::Int8Row { values, scales } => {
            let w = &values[row * cols..(row + 1) * cols];
            dot_i8_scalar(w, &x.q) as f32 * scales[row] * x.scale
        }
        Weights::Int4 {
            packed,
            scales,
            group,
        } => {
            let stride = cols.div_ceil(2);
            let w = &packed[row * stride..(row + 1) * stride];
            let group = group.min(cols).max(1);
            let per_row = cols.div_ceil(group);
            grouped(group, &|c| i32::from(nibble(w, c)) - 8, &|g| {
                scales[row * per_row + g]
            })
        }
        Weights::Mxfp4 { packed, scales } => {
            let stride = cols.div_ceil(2);
            let w = &packed[row * stride..(row + 1) * stride];
            let per_row = cols.div_ceil(MX_GROUP);
            grouped(
                MX_GROUP,
                &|c| i32::from(E2M1_DOUBLED[nibble(w, c) as usize]),
                &|g| codec::mxfp4_group_scale(scales[row * per_row + g]),
            )
        }
    }
}

/// Where column `c` sits in an input laid out by [`Quantised::deinterleaved`] whose whole
/// blocks end at `whole`: inside a block, its even columns first, then its odd ones.
fn deinterleaved_index(c: usize, whole: usize) -> usize {
    if c >= whole {
        return c;
    }
    let (block, offset) = (c / BLOCK * BLOCK, c % BLOCK);
    block + offset / 2 + (offset % 2) * (BLOCK / 2)
}

/// Whether the AVX2 path may use AVX-VNNI (the same integers, in one instruction).
#[cfg(target_arch = "x86_64")]
fn vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VNNI.get_or_init(|| is_x86_feature_detected!("avxvnni"))
}

/// Whether an AVX-512 CPU has its VNNI: int4 rows and int8 batches take 512-bit
/// `vpdpbusd` (64 bytes at a time), the rest its 256-bit form.
#[cfg(target_arch = "x86_64")]
fn wide_vnni() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| is_x86_feature_detected!("avx512vnni"))
}

/// Rows `first..first + count` against every input, `out[t * count + row - first]`.
fn block(
    isa: Isa,
    weights: Weights,
    first: usize,
    count: usize,
    cols: usize,
    xs: &[Quantised],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    // The integer products are 256 bits wide; an AVX-512 CPU runs them too, and int4 rows
    // and int8 batches at 512 bits where it has VNNI.
    if matches!(isa, Isa::Avx2 | Isa::Avx512) && isa.supported() && avx2::covers(weights, cols) {
        // SAFETY: AVX2 (and for the others, AVX-512 F/BW/DQ/VL with its VNNI, or AVX-VNNI)
        // was detected; the shapes are the matrix's.
        return unsafe {
            if isa == Isa::Avx512 && wide_vnni() {
                avx2::block_wide(weights, first, count, cols, xs, out)
            } else if vnni() {
                avx2::block_vnni(weights, first, count, cols, xs, out)
            } else {
                avx2::block(weights, first, count, cols, xs, out)
            }
        };
    }
    let _ = isa;
    for (sums, x) in out.chunks_exact_mut(count).zip(xs) {
        for (i, y) in sums.iter_mut().enumerate() {
            *y = row_dot(weights, first + i, cols, x);
        }
    }
}

/// Bytes of quantised inputs that one pass over the weight rows runs against. Every block of
/// weight rows reads all of a pass's inputs, so inputs past the last-level cache would come
/// from memory again for each block: a 16,384-token prompt's 6,144-column inputs (100 MB)
/// ran at half the rate of 4,096 tokens' before the passes.
const INPUT_PASS_BYTES: usize = 16 << 20;

/// `out[t] = W · input[t]` for `n` input rows with int8 activations, the inputs in passes
/// of about [`INPUT_PASS_BYTES`] (each output element is one row against one input, so
/// the passes change no bit).
pub(super) fn matmul(
    isa: Isa,
    weights: Weights,
    rows: usize,
    cols: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    assert_eq!(input.len(), n * cols, "matmul input shape");
    assert_eq!(out.len(), n * rows, "matmul output shape");
    if rows == 0 || n == 0 {
        return;
    }
    let per_pass = (INPUT_PASS_BYTES / cols.max(1)).max(1);
    let passes = input
        .chunks(per_pass * cols.max(1))
        .zip(out.chunks_mut(per_pass * rows));
    for (inputs, out) in passes {
        let quantised: Vec<Quantised> = inputs
            .chunks_exact(cols.max(1))
            .map(|x| match weights {
                Weights::Int8Row { .. } => Quantised::natural(isa, x),
                Weights::Int4 { .. } | Weights::Mxfp4 { .. } => Quantised::deinterleaved(isa, x),
            })
            .collect();
        let n = quantised.len();
        super::kernels::by_weight_rows(rows, cols, n, out, |first, count, sums| {
            block(isa, weights, first, count, cols, &quantised, sums)
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Quantised, Weights, BLOCK, MX_GROUP};
    use crate::quant::codec::E2M1_DOUBLED;
    use crate::quant::kernels::Lanes;
    use crate::quant::x86::Avx2;

    /// The doubled e2m1 values plus 12: 0..=24, unsigned bytes for `vpdpbusd`.
    const E2M1_DOUBLED_PLUS_12: [i8; 16] = {
        let mut table = [0i8; 16];
        let mut i = 0;
        while i < 16 {
            table[i] = E2M1_DOUBLED[i] + 12;
            i += 1;
        }
        table
    };

    /// Whether these weights take the AVX2 path: int8 always; int4 when its scale groups
    /// are whole blocks of 64 columns that tile the row (the published int4 layouts);
    /// MXFP4 when the row is whole blocks; else the reference.
    pub fn covers(weights: Weights, cols: usize) -> bool {
        match weights {
            Weights::Int8Row { .. } => true,
            Weights::Int4 { group, .. } => {
                let group = group.min(cols);
                group.is_multiple_of(BLOCK) && cols.is_multiple_of(group)
            }
            Weights::Mxfp4 { .. } => cols.is_multiple_of(BLOCK),
        }
    }

    /// [`super::quantise`] eight columns at a time: the same maximum, and each column's
    /// division by the scale and rounding to even, so the same bytes. A scale below the
    /// normal range (where a division may overflow) takes the scalar code.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantise(x: &[f32]) -> (Vec<i8>, f32) {
        let whole = x.len() / 8 * 8;
        let sign = _mm256_set1_ps(-0.0);
        let (mut max, mut nan) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for c in (0..whole).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(c));
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            max = _mm256_max_ps(max, _mm256_andnot_ps(sign, v));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), max);
        let tail = &x[whole..];
        if _mm256_movemask_ps(nan) != 0 || tail.iter().any(|v| v.is_nan()) {
            return super::quantise(x);
        }
        let max = lanes.iter().chain(tail).fold(0f32, |m, v| m.max(v.abs()));
        let scale = max / 127.0;
        if !scale.is_normal() {
            return super::quantise(x);
        }
        let mut q = vec![0i8; x.len()];
        let (divisor, low, high) = (
            _mm256_set1_ps(scale),
            _mm256_set1_ps(-127.0),
            _mm256_set1_ps(127.0),
        );
        let mut ints = [0i32; 8];
        for c in (0..whole).step_by(8) {
            let v = _mm256_div_ps(_mm256_loadu_ps(x.as_ptr().add(c)), divisor);
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
            let r = _mm256_min_ps(_mm256_max_ps(r, low), high);
            _mm256_storeu_si256(ints.as_mut_ptr().cast(), _mm256_cvtps_epi32(r));
            for (q, &i) in q[c..c + 8].iter_mut().zip(&ints) {
                *q = i as i8;
            }
        }
        for (q, v) in q[whole..].iter_mut().zip(tail) {
            *q = (v / scale).round_ties_even().clamp(-127.0, 127.0) as i8;
        }
        (q, scale)
    }

    /// Sum of the eight i32 lanes.
    #[inline(always)]
    unsafe fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// How [`dot_bytes`] multiplies: `maddubs` then `madd`, AVX-VNNI's `vpdpbusd`, or
    /// AVX-512 VNNI's (its 256-bit EVEX form, on CPUs such as Zen 4 that lack AVX-VNNI).
    const MADDUBS: u8 = 0;
    const AVX_VNNI: u8 = 1;
    const AVX512_VNNI: u8 = 2;

    /// `unsigned * signed` bytes, four products a lane, added to `acc`: one `vpdpbusd`
    /// with VNNI, else `maddubs` then `madd` with ones. The callers keep every pair of
    /// products under `2^15` (where `maddubs` would saturate), so all give the same
    /// integers.
    #[inline(always)]
    unsafe fn dot_bytes<const VNNI: u8>(
        acc: __m256i,
        unsigned: __m256i,
        signed: __m256i,
    ) -> __m256i {
        match VNNI {
            AVX_VNNI => _mm256_dpbusd_avx_epi32(acc, unsigned, signed),
            AVX512_VNNI => _mm256_dpbusd_epi32(acc, unsigned, signed),
            _ => {
                let pairs = _mm256_maddubs_epi16(unsigned, signed);
                _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
            }
        }
    }

    /// `acc + w * x` for 32 columns: `|w|` (as unsigned bytes, so a weight of -128 is
    /// 128) times `x * sign(w)` (activations stay within -127..=127, so negating one never
    /// overflows); no pair exceeds `2 * 128 * 127`.
    #[inline(always)]
    unsafe fn mul_i8<const VNNI: u8>(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        dot_bytes::<VNNI>(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
    }

    /// `acc + nibble * x` for one block of 64 columns: the 32 low nibbles against the even
    /// columns, the 32 high ones against the odd (unsigned nibbles, signed inputs: at most
    /// `2 * 15 * 127` a pair).
    #[inline(always)]
    unsafe fn mul_nibbles<const VNNI: u8>(
        acc: __m256i,
        packed: *const u8,
        x: *const i8,
    ) -> __m256i {
        let bytes = _mm256_loadu_si256(packed as *const __m256i);
        let low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
        let high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
        let even = _mm256_loadu_si256(x as *const __m256i);
        let odd = _mm256_loadu_si256(x.add(BLOCK / 2) as *const __m256i);
        dot_bytes::<VNNI>(dot_bytes::<VNNI>(acc, low, even), high, odd)
    }

    /// Ask for the cache line `ahead` bytes past `ptr` (never faults), into the
    /// second-level cache as [`Lanes::prefetch`] does, for the same reason.
    #[inline(always)]
    unsafe fn prefetch(ptr: *const u8, ahead: usize) {
        _mm_prefetch::<_MM_HINT_T1>(ptr.wrapping_add(ahead) as *const i8);
    }

    /// Four int8 rows against one input: one load of the input serves the four, and the
    /// line the next four rows need at the same offset is asked for.
    #[inline(always)]
    unsafe fn int8_rows<const VNNI: u8>(w: [&[i8]; 4], x: &[i8], cols: usize) -> [i32; 4] {
        let mut acc = [_mm256_setzero_si256(); 4];
        let ahead = 4 * cols;
        let mut c = 0;
        while c + 32 <= cols {
            let xv = _mm256_loadu_si256(x.as_ptr().add(c) as *const __m256i);
            for r in 0..4 {
                let p = w[r].as_ptr().add(c);
                if c.is_multiple_of(64) {
                    prefetch(p as *const u8, ahead);
                }
                let wv = _mm256_loadu_si256(p as *const __m256i);
                acc[r] = mul_i8::<VNNI>(acc[r], wv, xv);
            }
            c += 32;
        }
        // A loop, not a closure, so that the sums inherit the caller's AVX2.
        let mut sums = [0i32; 4];
        for r in 0..4 {
            sums[r] = hsum(acc[r]) + super::dot_i8_scalar(&w[r][c..cols], &x[c..cols]);
        }
        sums
    }

    /// The eight lanes' sums of `x` over blocks `blocks`, times `offset`: what a block's
    /// unsigned codes (`code + offset`) add beyond their signed products.
    #[inline(always)]
    unsafe fn lane_offset(x: &Quantised, blocks: std::ops::Range<usize>, offset: i32) -> __m256i {
        let mut sums = _mm256_setzero_si256();
        for b in blocks {
            let lane = x.lane_sums.as_ptr().add(b * 8) as *const __m256i;
            sums = _mm256_add_epi32(sums, _mm256_loadu_si256(lane));
        }
        _mm256_mullo_epi32(sums, _mm256_set1_epi32(offset))
    }

    /// [`int8_rows`] 64 columns to a 512-bit register, against `T` inputs at once: each
    /// weight taken as the unsigned `w + 128` (a sign-bit flip) against the signed input,
    /// the `128 * sum x` that adds taken back at the end (no `vpsignb` in AVX-512, and one
    /// instruction fewer). The products reach `255 * 127`, which `vpdpbusd` adds without
    /// saturating. Each 64-column block of the four rows is loaded once for the `T` inputs,
    /// so a row's bytes come from the cache once a tile rather than once an input. The
    /// same integers as [`int8_rows`].
    #[inline(always)]
    unsafe fn int8_tile_wide<const T: usize>(
        w: [&[i8]; 4],
        xs: [&Quantised; T],
        cols: usize,
    ) -> [[i32; 4]; T] {
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [[_mm512_setzero_si512(); 4]; T];
        let ahead = 4 * cols;
        let whole = cols / BLOCK * BLOCK;
        let mut c = 0;
        while c < whole {
            let mut wv = [_mm512_setzero_si512(); 4];
            for r in 0..4 {
                let p = w[r].as_ptr().add(c);
                prefetch(p as *const u8, ahead);
                wv[r] = _mm512_xor_si512(_mm512_loadu_si512(p as *const _), flip);
            }
            for t in 0..T {
                let xv = _mm512_loadu_si512(xs[t].q.as_ptr().add(c) as *const _);
                for r in 0..4 {
                    acc[t][r] = _mm512_dpbusd_epi32(acc[t][r], wv[r], xv);
                }
            }
            c += BLOCK;
        }
        let mut sums = [[0i32; 4]; T];
        for t in 0..T {
            for r in 0..4 {
                // Wrapping, as the lanes wrap: the true sum fits, so the wrapped one is it.
                sums[t][r] = _mm512_reduce_add_epi32(acc[t][r])
                    .wrapping_sub(xs[t].block_sum.wrapping_mul(128))
                    .wrapping_add(super::dot_i8_scalar(
                        &w[r][whole..cols],
                        &xs[t].q[whole..cols],
                    ));
            }
        }
        sums
    }

    /// The four int8 rows `w` (block rows `i..i + take`, scaled by `row_scales`) against
    /// every input on the 512-bit path, four inputs a tile ([`int8_tile_wide`]), into
    /// `out[t * count + i + k]` (`count = out.len() / n`), each integer sum times its row's
    /// and its input's scales as the one-input path scales it.
    #[inline(always)]
    unsafe fn int8_rows_wide_into(
        w: [&[i8]; 4],
        row_scales: [f32; 4],
        xs: &[Quantised],
        cols: usize,
        (i, take): (usize, usize),
        out: &mut [f32],
    ) {
        let n = xs.len();
        let count = out.len() / n;
        let mut put = |t: usize, sums: &[[i32; 4]]| {
            for (j, row) in sums.iter().enumerate() {
                let x = &xs[t + j];
                for k in 0..take {
                    out[(t + j) * count + i + k] = row[k] as f32 * row_scales[k] * x.scale;
                }
            }
        };
        let mut t = 0;
        while t < n {
            let tile = |u: usize| -> &Quantised { &xs[t + u] };
            let took = match n - t {
                1 => {
                    put(t, &int8_tile_wide::<1>(w, [tile(0)], cols));
                    1
                }
                2 => {
                    put(t, &int8_tile_wide::<2>(w, [tile(0), tile(1)], cols));
                    2
                }
                3 => {
                    let three = [tile(0), tile(1), tile(2)];
                    put(t, &int8_tile_wide::<3>(w, three, cols));
                    3
                }
                _ => {
                    let four = [tile(0), tile(1), tile(2), tile(3)];
                    put(t, &int8_tile_wide::<4>(w, four, cols));
                    4
                }
            };
            t += took;
        }
    }

    /// Four int4 rows against one input, before the activation scale: per scale group
    /// each lane's exact integer sum (less `8 * sum x` over the lane's columns for the
    /// nibbles' offset) times the group's scale, added to the lane, as the reference adds
    /// them.
    #[inline(always)]
    unsafe fn int4_rows<const VNNI: u8>(
        w: [&[u8]; 4],
        scales: [&[f32]; 4],
        x: &Quantised,
        cols: usize,
        group: usize,
    ) -> [f32; 4] {
        let mut lanes = [_mm256_setzero_ps(); 4];
        let ahead = 4 * cols / 2;
        let blocks_per_group = group / BLOCK;
        for (g, first_block) in (0..cols / BLOCK).step_by(blocks_per_group).enumerate() {
            let mut acc = [_mm256_setzero_si256(); 4];
            let blocks = first_block..first_block + blocks_per_group;
            for b in blocks.clone() {
                let xp = x.q.as_ptr().add(b * BLOCK);
                for r in 0..4 {
                    let p = w[r].as_ptr().add(b * BLOCK / 2);
                    prefetch(p, ahead);
                    acc[r] = mul_nibbles::<VNNI>(acc[r], p, xp);
                }
            }
            let offset = lane_offset(x, blocks, 8);
            for r in 0..4 {
                let isums = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r], offset));
                lanes[r] = _mm256_fmadd_ps(isums, _mm256_set1_ps(scales[r][g]), lanes[r]);
            }
        }
        // A loop, not a closure, so that the lane sums inherit the caller's AVX2.
        let mut sums = [0f32; 4];
        for r in 0..4 {
            sums[r] = Avx2(lanes[r]).sum();
        }
        sums
    }

    /// Block `b` of int4 rows `2p` and `2p + 1` in the low and high halves of a register,
    /// unpacked: the even columns' codes and the odd columns'. Asks for the lines `ahead`
    /// bytes on, as [`prefetch`] does.
    #[inline(always)]
    unsafe fn nibble_pair(w: [&[u8]; 4], p: usize, b: usize, ahead: usize) -> (__m512i, __m512i) {
        let (first, second) = (
            w[2 * p].as_ptr().add(b * BLOCK / 2),
            w[2 * p + 1].as_ptr().add(b * BLOCK / 2),
        );
        prefetch(first, ahead);
        prefetch(second, ahead);
        let bytes = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(first as *const __m256i)),
            _mm256_loadu_si256(second as *const __m256i),
        );
        let nibbles = _mm512_set1_epi8(15);
        (
            _mm512_and_si512(bytes, nibbles),
            _mm512_and_si512(_mm512_srli_epi16::<4>(bytes), nibbles),
        )
    }

    /// Each input's four rows from their lanes (rows `2p` and `2p + 1` in the halves of
    /// `lanes[t][p]`), each half summed in the kernels' order.
    #[inline(always)]
    unsafe fn tile_sums<const T: usize>(lanes: [[__m512; 2]; T]) -> [[f32; 4]; T] {
        // A loop, not a closure, so that the lane sums inherit the caller's features.
        let mut sums = [[0f32; 4]; T];
        for t in 0..T {
            for p in 0..2 {
                sums[t][2 * p] = Avx2(_mm512_castps512_ps256(lanes[t][p])).sum();
                sums[t][2 * p + 1] = Avx2(_mm512_extractf32x8_ps::<1>(lanes[t][p])).sum();
            }
        }
        sums
    }

    /// [`int4_rows`] two rows to a 512-bit register, against `T` inputs at once: rows `2p`
    /// and `2p + 1` in its low and high halves against an input in both, so each half is
    /// one row's eight lanes, summed as [`int4_rows`] sums them (the same bits, half the
    /// instructions); each block's nibbles are unpacked once for the `T` inputs.
    #[inline(always)]
    unsafe fn int4_tile_wide<const T: usize>(
        w: [&[u8]; 4],
        scales: [&[f32]; 4],
        xs: [&Quantised; T],
        cols: usize,
        group: usize,
    ) -> [[f32; 4]; T] {
        let mut lanes = [[_mm512_setzero_ps(); 2]; T];
        let ahead = 4 * cols / 2;
        let blocks_per_group = group / BLOCK;
        for (g, first_block) in (0..cols / BLOCK).step_by(blocks_per_group).enumerate() {
            let mut acc = [[_mm512_setzero_si512(); 2]; T];
            let blocks = first_block..first_block + blocks_per_group;
            for b in blocks.clone() {
                for p in [0, 1] {
                    let (low, high) = nibble_pair(w, p, b, ahead);
                    for t in 0..T {
                        let xp = xs[t].q.as_ptr().add(b * BLOCK);
                        let even = _mm512_broadcast_i64x4(_mm256_loadu_si256(xp as *const __m256i));
                        let odd = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                            xp.add(BLOCK / 2) as *const __m256i
                        ));
                        acc[t][p] = _mm512_dpbusd_epi32(
                            _mm512_dpbusd_epi32(acc[t][p], low, even),
                            high,
                            odd,
                        );
                    }
                }
            }
            let scale: [__m512; 2] = [
                _mm512_insertf32x8::<1>(_mm512_set1_ps(scales[0][g]), _mm256_set1_ps(scales[1][g])),
                _mm512_insertf32x8::<1>(_mm512_set1_ps(scales[2][g]), _mm256_set1_ps(scales[3][g])),
            ];
            for t in 0..T {
                let offset = _mm512_broadcast_i64x4(lane_offset(xs[t], blocks.clone(), 8));
                for p in 0..2 {
                    let isums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[t][p], offset));
                    lanes[t][p] = _mm512_fmadd_ps(isums, scale[p], lanes[t][p]);
                }
            }
        }
        tile_sums(lanes)
    }

    /// [`int4_tile_wide`] for groups of one block (int4-g64, as published), each block
    /// whole in registers: its four rows' nibbles unpacked once for the `T` inputs, and
    /// for each input the sums start from minus the nibbles' offset (`-8 * sum x` over
    /// each lane's columns) and go straight into the lanes at the group's scale. The
    /// integers are [`int4_tile_wide`]'s, so the bits are too; what it saves is the
    /// per-group loop, the offset's loop over the group's blocks, and accumulators that
    /// went through memory.
    #[inline(always)]
    unsafe fn int4_g64_tile_wide<const T: usize>(
        w: [&[u8]; 4],
        scales: [&[f32]; 4],
        xs: [&Quantised; T],
        cols: usize,
    ) -> [[f32; 4]; T] {
        let mut lanes = [[_mm512_setzero_ps(); 2]; T];
        let ahead = 4 * cols / 2;
        let group_scale = |r: usize, b: usize| scales[r][b];
        for b in 0..cols / BLOCK {
            let mut low = [_mm512_setzero_si512(); 2];
            let mut high = [_mm512_setzero_si512(); 2];
            let mut scale = [_mm512_setzero_ps(); 2];
            for p in [0, 1] {
                (low[p], high[p]) = nibble_pair(w, p, b, ahead);
                scale[p] = _mm512_insertf32x8::<1>(
                    _mm512_set1_ps(group_scale(2 * p, b)),
                    _mm256_set1_ps(group_scale(2 * p + 1, b)),
                );
            }
            for t in 0..T {
                let xp = xs[t].q.as_ptr().add(b * BLOCK);
                let even = _mm512_broadcast_i64x4(_mm256_loadu_si256(xp as *const __m256i));
                let odd =
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(xp.add(BLOCK / 2) as *const __m256i));
                let lane_sums = xs[t].lane_sums.as_ptr().add(b * 8) as *const __m256i;
                let start = _mm512_sub_epi32(
                    _mm512_setzero_si512(),
                    _mm512_slli_epi32::<3>(_mm512_broadcast_i64x4(_mm256_loadu_si256(lane_sums))),
                );
                for p in 0..2 {
                    let sums =
                        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, low[p], even), high[p], odd);
                    lanes[t][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale[p], lanes[t][p]);
                }
            }
        }
        tile_sums(lanes)
    }

    /// Int4 rows `rows` against every input on the 512-bit path, into `out[t * count + i +
    /// k]` (`count = out.len() / n`), times each input's scale: groups of one block four
    /// inputs a tile ([`int4_g64_tile_wide`]; four and eight measured alike, six slower),
    /// other groups three.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn int4_rows_wide_into(
        w: [&[u8]; 4],
        scales: [&[f32]; 4],
        xs: &[Quantised],
        cols: usize,
        group: usize,
        i: usize,
        take: usize,
        out: &mut [f32],
    ) {
        let n = xs.len();
        let count = out.len() / n;
        let mut put = |t: usize, sums: &[[f32; 4]]| {
            for (j, row) in sums.iter().enumerate() {
                for k in 0..take {
                    out[(t + j) * count + i + k] = row[k] * xs[t + j].scale;
                }
            }
        };
        let mut t = 0;
        while t < n {
            let tile = |u: usize| -> &Quantised { &xs[t + u] };
            let took = match (group == BLOCK, n - t) {
                (true, 1) => {
                    put(t, &int4_g64_tile_wide::<1>(w, scales, [tile(0)], cols));
                    1
                }
                (true, 2) => {
                    put(
                        t,
                        &int4_g64_tile_wide::<2>(w, scales, [tile(0), tile(1)], cols),
                    );
                    2
                }
                (true, 3) => {
                    let three = [tile(0), tile(1), tile(2)];
                    put(t, &int4_g64_tile_wide::<3>(w, scales, three, cols));
                    3
                }
                (true, _) => {
                    let four = [tile(0), tile(1), tile(2), tile(3)];
                    put(t, &int4_g64_tile_wide::<4>(w, scales, four, cols));
                    4
                }
                (false, 1 | 2) => {
                    put(t, &int4_tile_wide::<1>(w, scales, [tile(0)], cols, group));
                    1
                }
                (false, _) => {
                    let three = [tile(0), tile(1), tile(2)];
                    put(t, &int4_tile_wide::<3>(w, scales, three, cols, group));
                    3
                }
            };
            t += took;
        }
    }

    /// Four MXFP4 rows against one input, before the activation scale. A block of 64
    /// columns is two scale groups: its first 16 bytes hold columns 0..32, its last 16
    /// columns 32..64, so the products' low four lanes are the first group and the high
    /// four the second. Each code is looked up as its doubled value plus 12 (unsigned, so
    /// `vpdpbusd` takes it as it is) and the 12 taken back lane by lane; each lane's exact
    /// integer sum times its group's scale is added to the lane, as the reference adds it.
    #[inline(always)]
    unsafe fn mxfp4_rows<const VNNI: u8>(
        w: [&[u8]; 4],
        scales: [&[u8]; 4],
        x: &Quantised,
        cols: usize,
    ) -> [f32; 4] {
        let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(
            E2M1_DOUBLED_PLUS_12.as_ptr() as *const __m128i
        ));
        let ahead = 4 * cols / 2;
        let mut lanes = [_mm256_setzero_ps(); 4];
        for b in 0..cols / BLOCK {
            let xp = x.q.as_ptr().add(b * BLOCK);
            let even = _mm256_loadu_si256(xp as *const __m256i);
            let odd = _mm256_loadu_si256(xp.add(BLOCK / 2) as *const __m256i);
            let offset = lane_offset(x, b..b + 1, 12);
            let g = b * BLOCK / MX_GROUP;
            for r in 0..4 {
                let p = w[r].as_ptr().add(b * BLOCK / 2);
                prefetch(p, ahead);
                let bytes = _mm256_loadu_si256(p as *const __m256i);
                let low = _mm256_and_si256(bytes, _mm256_set1_epi8(15));
                let high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), _mm256_set1_epi8(15));
                let acc = dot_bytes::<VNNI>(
                    dot_bytes::<VNNI>(
                        offset_negated(offset),
                        _mm256_shuffle_epi8(table, low),
                        even,
                    ),
                    _mm256_shuffle_epi8(table, high),
                    odd,
                );
                // The two exponents, four lanes each, as `2^(s - 127) / 2`
                // (`codec::mxfp4_group_scale`).
                let pair = u32::from(scales[r][g]) | u32::from(scales[r][g + 1]) << 8;
                let bits = _mm256_srlv_epi32(
                    _mm256_set1_epi32(pair as i32),
                    _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8),
                );
                let bits = _mm256_and_si256(bits, _mm256_set1_epi32(255));
                let scale = _mm256_mul_ps(
                    _mm256_castsi256_ps(_mm256_slli_epi32(bits, 23)),
                    _mm256_set1_ps(0.5),
                );
                lanes[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), scale, lanes[r]);
            }
        }
        // A loop, not a closure, so that the lane sums inherit the caller's AVX2.
        let mut sums = [0f32; 4];
        for r in 0..4 {
            sums[r] = Avx2(lanes[r]).sum();
        }
        sums
    }

    /// `-offset`, the start of a block's integer sums.
    #[inline(always)]
    unsafe fn offset_negated(offset: __m256i) -> __m256i {
        _mm256_sub_epi32(_mm256_setzero_si256(), offset)
    }

    /// Rows `first..first + count` against every input, `out[t * count + row - first]`;
    /// rows in fours, the last ones one at a time.
    #[inline(always)]
    unsafe fn rows_block<const VNNI: u8, const WIDE: bool>(
        weights: Weights,
        first: usize,
        count: usize,
        cols: usize,
        xs: &[Quantised],
        out: &mut [f32],
    ) {
        let n = xs.len();
        let mut i = 0;
        while i < count {
            let take = if count - i >= 4 { 4 } else { 1 };
            let rows: [usize; 4] = std::array::from_fn(|k| first + i + k.min(take - 1));
            if let (
                true,
                Weights::Int4 {
                    packed,
                    scales,
                    group,
                },
            ) = (WIDE, weights)
            {
                let group = group.min(cols);
                let (stride, per_row) = (cols / 2, cols / group);
                let w = rows.map(|r| &packed[r * stride..(r + 1) * stride]);
                let s = rows.map(|r| &scales[r * per_row..(r + 1) * per_row]);
                int4_rows_wide_into(w, s, xs, cols, group, i, take, out);
                i += take;
                continue;
            }
            // One input streams its rows at memory speed either way, and measured faster at
            // 256 bits; a batch gains from the wider products and from the tiles.
            if let (true, true, Weights::Int8Row { values, scales }) = (WIDE, n > 1, weights) {
                let w = rows.map(|r| &values[r * cols..(r + 1) * cols]);
                int8_rows_wide_into(w, rows.map(|r| scales[r]), xs, cols, (i, take), out);
                i += take;
                continue;
            }
            for (t, x) in xs.iter().enumerate() {
                let sums: [f32; 4] = match weights {
                    Weights::Int8Row { values, scales } => {
                        let w = rows.map(|r| &values[r * cols..(r + 1) * cols]);
                        let isums = int8_rows::<VNNI>(w, &x.q, cols);
                        std::array::from_fn(|k| isums[k] as f32 * scales[rows[k]] * x.scale)
                    }
                    Weights::Int4 {
                        packed,
                        scales,
                        group,
                    } => {
                        let group = group.min(cols);
                        let (stride, per_row) = (cols / 2, cols / group);
                        let w = rows.map(|r| &packed[r * stride..(r + 1) * stride]);
                        let s = rows.map(|r| &scales[r * per_row..(r + 1) * per_row]);
                        int4_rows::<VNNI>(w, s, x, cols, group).map(|v| v * x.scale)
                    }
                    Weights::Mxfp4 { packed, scales } => {
                        let (stride, per_row) = (cols / 2, cols / MX_GROUP);
                        let w = rows.map(|r| &packed[r * stride..(r + 1) * stride]);
                        let s = rows.map(|r| &scales[r * per_row..(r + 1) * per_row]);
                        mxfp4_rows::<VNNI>(w, s, x, cols).map(|v| v * x.scale)
                    }
                };
                for k in 0..take {
                    out[t * count + i + k] = sums[k];
                }
            }
            i += take;
        }
    }

    /// An entry point: [`rows_block`] compiled for the instruction sets `features`.
    macro_rules! entry {
        ($(#[$doc:meta])* $name:ident, $features:literal, $vnni:ident, $wide:literal) => {
            $(#[$doc])*
            #[target_feature(enable = $features)]
            pub unsafe fn $name(
                weights: Weights,
                first: usize,
                count: usize,
                cols: usize,
                xs: &[Quantised],
                out: &mut [f32],
            ) {
                rows_block::<$vnni, $wide>(weights, first, count, cols, xs, out)
            }
        };
    }

    entry!(
        /// [`rows_block`] with AVX2 alone.
        block, "avx2,fma", MADDUBS, false
    );
    entry!(
        /// [`rows_block`] with AVX-VNNI's `vpdpbusd`.
        block_vnni, "avx2,fma,avxvnni", AVX_VNNI, false
    );
    entry!(
        /// [`rows_block`] with AVX-512 VNNI: int4 rows and int8 batches at 512 bits, the rest
        /// with its 256-bit `vpdpbusd`.
        block_wide,
        "avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni",
        AVX512_VNNI,
        true
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_int4_groups, quantize_int8_rows, quantize_mxfp4, Format, Matrix};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32
                    - 0.5
            })
            .collect()
    }

    /// The product the integer path approximates, from the dequantised weights and inputs.
    fn float_reference(w: &[f32], rows: usize, cols: usize, x: &[f32]) -> Vec<f32> {
        (0..rows)
            .map(|r| (0..cols).map(|c| w[r * cols + c] * x[c]).sum())
            .collect()
    }

    #[test]
    fn simd_and_scalar_agree_bit_for_bit_and_batches_equal_rows() {
        for (rows, cols) in [(7, 64), (5, 130), (9, 256), (3, 33)] {
            let w = values(rows * cols, 1);
            let (q8, s8) = quantize_int8_rows(&w, cols);
            for group in [cols, 64, 32, 128] {
                let (packed, scales) = quantize_int4_groups(&w, cols, group);
                let int4 = Weights::Int4 {
                    packed: &packed,
                    scales: &scales,
                    group,
                };
                let int8 = Weights::Int8Row {
                    values: &q8,
                    scales: &s8,
                };
                let (mx_packed, mx_scales) = quantize_mxfp4(&w, cols);
                let mxfp4 = Weights::Mxfp4 {
                    packed: &mx_packed,
                    scales: &mx_scales,
                };
                // Tiles of four inputs and of one to three (int8, int4 in groups of 64), and of
                // three and one (other groups).
                for (weights, n) in [int8, int4, mxfp4]
                    .into_iter()
                    .flat_map(|weights| [1, 2, 3, 4, 6, 7, 9].map(|n| (weights, n)))
                {
                    let x = values(n * cols, 7);
                    let mut reference = vec![0f32; n * rows];
                    matmul(Isa::Scalar, weights, rows, cols, &x, n, &mut reference);
                    let mut simd = vec![0f32; n * rows];
                    matmul(Isa::detect(), weights, rows, cols, &x, n, &mut simd);
                    assert_eq!(reference, simd, "{rows}x{cols} group {group}");
                    for t in 0..n {
                        let mut one = vec![0f32; rows];
                        matmul(
                            Isa::detect(),
                            weights,
                            rows,
                            cols,
                            &x[t * cols..(t + 1) * cols],
                            1,
                            &mut one,
                        );
                        assert_eq!(one, reference[t * rows..(t + 1) * rows]);
                    }
                }
            }
        }
    }

    /// More inputs than one pass holds (three passes, the last a partial one): each
    /// input's outputs are the bits it gets alone, in its own row of the result.
    #[test]
    fn inputs_past_one_pass_give_the_bits_of_each_input_alone() {
        let (rows, cols) = (3, 4096);
        let per_pass = INPUT_PASS_BYTES / cols;
        let n = 2 * per_pass + 5;
        let w = values(rows * cols, 21);
        let (q8, s8) = quantize_int8_rows(&w, cols);
        let weights = Weights::Int8Row {
            values: &q8,
            scales: &s8,
        };
        let x = values(n * cols, 22);
        let mut batch = vec![0f32; n * rows];
        matmul(Isa::detect(), weights, rows, cols, &x, n, &mut batch);
        for t in [0, per_pass - 1, per_pass, 2 * per_pass, n - 1] {
            let mut one = vec![0f32; rows];
            let input = &x[t * cols..(t + 1) * cols];
            matmul(Isa::detect(), weights, rows, cols, input, 1, &mut one);
            assert_eq!(one, batch[t * rows..(t + 1) * rows], "input {t}");
        }
    }

    /// Every x86 path, with and without VNNI and with 512-bit int4 where the CPU has them,
    /// against the reference.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vnni_and_maddubs_paths_compute_the_same_integers() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
        let (rows, cols) = (9, 256);
        let w = values(rows * cols, 5);
        let (q8, s8) = quantize_int8_rows(&w, cols);
        let (packed, scales) = quantize_int4_groups(&w, cols, 64);
        // Four inputs: a tile of three and one left over.
        let xs: Vec<Quantised> = (0..4)
            .map(|t| values(cols, 20 + t))
            .map(|x| Quantised::natural(Isa::Scalar, &x))
            .collect();
        let x4: Vec<Quantised> = (0..4)
            .map(|t| values(cols, 20 + t))
            .map(|x| Quantised::deinterleaved(Isa::Scalar, &x))
            .collect();
        let int8 = Weights::Int8Row {
            values: &q8,
            scales: &s8,
        };
        let int4 = Weights::Int4 {
            packed: &packed,
            scales: &scales,
            group: 64,
        };
        let (mx_packed, mx_scales) = quantize_mxfp4(&w, cols);
        let mxfp4 = Weights::Mxfp4 {
            packed: &mx_packed,
            scales: &mx_scales,
        };
        for (weights, xs) in [(int8, &xs), (int4, &x4), (mxfp4, &x4)] {
            // Input by input, as `block` writes them.
            let reference: Vec<f32> = xs
                .iter()
                .flat_map(|x| (0..rows).map(move |r| row_dot(weights, r, cols, x)))
                .collect();
            let mut plain = vec![0f32; rows * 4];
            // SAFETY: AVX2 was detected.
            unsafe { avx2::block(weights, 0, rows, cols, xs, &mut plain) };
            assert_eq!(plain, reference);
            if is_x86_feature_detected!("avxvnni") {
                let mut vnni = vec![0f32; rows * 4];
                // SAFETY: AVX-VNNI was detected.
                unsafe { avx2::block_vnni(weights, 0, rows, cols, xs, &mut vnni) };
                assert_eq!(vnni, reference);
            }
            if Isa::Avx512.supported() && wide_vnni() {
                let mut wide = vec![0f32; rows * 4];
                // SAFETY: AVX-512 F/BW/DQ/VL and its VNNI were detected.
                unsafe { avx2::block_wide(weights, 0, rows, cols, xs, &mut wide) };
                assert_eq!(wide, reference);
            }
        }
    }

    /// A grouped product written out plainly, from natural-order activations: per group
    /// each lane's integer sum (lane: the column's eighth of its block of 64) times the
    /// group's scale, fused into the lane; the lanes summed in the kernels' order.
    fn plain_grouped(
        cols: usize,
        group: usize,
        x: &[f32],
        code: impl Fn(usize) -> i32,
        scale: impl Fn(usize) -> f32,
    ) -> f32 {
        let (q, x_scale) = quantise(x);
        let mut lanes = [0f32; 8];
        for g in 0..cols.div_ceil(group) {
            let columns = g * group..((g + 1) * group).min(cols);
            for (l, lane) in lanes.iter_mut().enumerate() {
                let mine: Vec<usize> = columns.clone().filter(|c| c % 64 / 8 == l).collect();
                if !mine.is_empty() {
                    let isum: i32 = mine.iter().map(|&c| code(c) * i32::from(q[c])).sum();
                    *lane = (isum as f32).mul_add(scale(g), *lane);
                }
            }
        }
        let a = lanes;
        (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))) * x_scale
    }

    fn plain_int4(
        packed: &[u8],
        scales: &[f32],
        group: usize,
        cols: usize,
        row: usize,
        x: &[f32],
    ) -> f32 {
        let stride = cols.div_ceil(2);
        let group = group.min(cols);
        let per_row = cols.div_ceil(group);
        let code = |c: usize| {
            let byte = packed[row * stride + c / 2];
            let nibble = if c.is_multiple_of(2) {
                byte & 15
            } else {
                byte >> 4
            };
            i32::from(nibble) - 8
        };
        plain_grouped(cols, group, x, code, |g| scales[row * per_row + g])
    }

    #[test]
    fn every_int4_group_size_computes_the_plain_lane_product() {
        for (rows, cols, group) in [
            (5, 128, 32),
            (6, 192, 48),
            (4, 384, 96),
            (5, 2880, 128),
            (3, 130, 64),
            (7, 256, 256),
        ] {
            let w = values(rows * cols, 9);
            let (packed, scales) = quantize_int4_groups(&w, cols, group);
            let weights = Weights::Int4 {
                packed: &packed,
                scales: &scales,
                group,
            };
            let x = values(cols, 4);
            let mut got = vec![0f32; rows];
            matmul(Isa::detect(), weights, rows, cols, &x, 1, &mut got);
            for (r, &y) in got.iter().enumerate() {
                assert_eq!(
                    y,
                    plain_int4(&packed, &scales, group, cols, r, &x),
                    "{rows}x{cols} g{group} row {r}"
                );
            }
        }
    }

    #[test]
    fn mxfp4_computes_the_plain_lane_product_and_stays_close_to_the_float_one() {
        for (rows, cols) in [(5, 64), (6, 2048), (3, 96), (4, 130)] {
            let w = values(rows * cols, 13);
            let (packed, exponents) = quantize_mxfp4(&w, cols);
            let weights = Weights::Mxfp4 {
                packed: &packed,
                scales: &exponents,
            };
            let x = values(cols, 6);
            let mut got = vec![0f32; rows];
            matmul(Isa::detect(), weights, rows, cols, &x, 1, &mut got);
            let stride = cols.div_ceil(2);
            let per_row = cols.div_ceil(MX_GROUP);
            for (r, &y) in got.iter().enumerate() {
                let code = |c: usize| {
                    let byte = packed[r * stride + c / 2];
                    let code = if c.is_multiple_of(2) {
                        byte & 15
                    } else {
                        byte >> 4
                    };
                    i32::from(E2M1_DOUBLED[code as usize])
                };
                let scale = |g: usize| codec::mxfp4_group_scale(exponents[r * per_row + g]);
                assert_eq!(
                    y,
                    plain_grouped(cols, MX_GROUP, &x, code, scale),
                    "{rows}x{cols} row {r}"
                );
            }
            let dequantised = Matrix::from_f32_as(rows, cols, &w, Format::Mxfp4)
                .unwrap()
                .to_f32();
            let want = float_reference(&dequantised, rows, cols, &x);
            let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 254.0;
            for (r, (g, f)) in got.iter().zip(&want).enumerate() {
                let row = &dequantised[r * cols..(r + 1) * cols];
                let bound = step * row.iter().map(|v| v.abs()).sum::<f32>() + 1e-4;
                assert!(
                    (g - f).abs() <= bound,
                    "row {r}: {g} vs {f} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn the_vector_quantisation_gives_the_scalar_bytes() {
        // Ties to even (a maximum of 127 makes the scale 1), a negative zero, a tail past
        // the last eight, a maximum whose scale is subnormal, NaN, infinity and zeros.
        let mut ties: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 9.0).collect();
        ties[3] = 127.0;
        ties[4] = -0.0;
        let tiny: Vec<f32> = (0..19).map(|i| i as f32 * 1e-39).collect();
        let mut nan = values(24, 3);
        nan[17] = f32::NAN;
        let mut inf = values(24, 4);
        inf[2] = f32::NEG_INFINITY;
        let cases = [
            ties,
            tiny,
            nan,
            inf,
            vec![0.0; 16],
            values(2048, 9),
            values(13, 10),
            vec![],
        ];
        for x in &cases {
            let (want, want_scale) = quantise(x);
            let (got, got_scale) = quantise_on(Isa::detect(), x);
            assert_eq!(got, want, "{x:?}");
            assert_eq!(got_scale.to_bits(), want_scale.to_bits(), "{x:?}");
        }
    }

    #[test]
    fn a_weight_of_minus_128_and_a_nan_input_are_handled() {
        let cols = 64;
        let q8: Vec<i8> = (0..cols)
            .map(|i| if i % 3 == 0 { -128 } else { (i as i8) - 30 })
            .collect();
        let s8 = [0.01f32];
        let weights = Weights::Int8Row {
            values: &q8,
            scales: &s8,
        };
        let x = values(cols, 2);
        let (q, scale) = quantise(&x);
        let want = q8
            .iter()
            .zip(&q)
            .map(|(&a, &b)| i32::from(a) * i32::from(b))
            .sum::<i32>() as f32
            * 0.01
            * scale;
        let mut got = [0f32];
        matmul(Isa::detect(), weights, 1, cols, &x, 1, &mut got);
        assert_eq!(got[0], want);
        let mut nan = x.clone();
        nan[5] = f32::NAN;
        matmul(Isa::detect(), weights, 1, cols, &nan, 1, &mut got);
        assert!(got[0].is_nan());
    }

    #[test]
    fn int8_activations_stay_close_to_the_float_product() {
        let (rows, cols) = (16, 256);
        let w = values(rows * cols, 3);
        let x = values(cols, 11);
        let (q8, s8) = quantize_int8_rows(&w, cols);
        let dequantised: Vec<f32> = q8
            .iter()
            .enumerate()
            .map(|(i, &q)| f32::from(q) * s8[i / cols])
            .collect();
        let want = float_reference(&dequantised, rows, cols, &x);
        let mut got = vec![0f32; rows];
        let weights = Weights::Int8Row {
            values: &q8,
            scales: &s8,
        };
        matmul(Isa::detect(), weights, rows, cols, &x, 1, &mut got);
        // The activation rounding error: at most half a step (max|x| / 254) per element,
        // times the weight it meets.
        let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) / 254.0;
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            let row = &dequantised[r * cols..(r + 1) * cols];
            let bound = step * row.iter().map(|v| v.abs()).sum::<f32>() + 1e-5;
            assert!(
                (g - w).abs() <= bound,
                "row {r}: {g} vs {w} (bound {bound})"
            );
        }
        // A zero row gives zeros.
        let mut zero = vec![1f32; rows];
        matmul(
            Isa::detect(),
            weights,
            rows,
            cols,
            &vec![0.0; cols],
            1,
            &mut zero,
        );
        assert!(zero.iter().all(|&v| v == 0.0));
    }
}
