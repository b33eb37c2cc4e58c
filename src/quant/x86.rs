//! The AVX2 + FMA + F16C instantiation of the kernels: one `__m256` is the eight lanes, and
//! each format decodes eight elements with a few integer instructions. Entered only after
//! runtime detection ([`super::kernels::Isa::detect`]).

use std::arch::x86_64::*;

use super::codec::E2M1_DOUBLED;
use super::kernels::{
    step, tail_dot, Bf16Codes, Block, Decode, E2m1Codes, E4m3Codes, F16Codes, F32Codes, I8Codes,
    Int4Codes, Lanes, View,
};

#[derive(Clone, Copy)]
pub struct Avx2(pub(super) __m256);

impl Lanes for Avx2 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Avx2(_mm256_setzero_ps())
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        Avx2(_mm256_set1_ps(value))
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        Avx2(_mm256_loadu_ps(ptr))
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        _mm256_storeu_ps(ptr, self.0)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Avx2(_mm256_fmadd_ps(a.0, b.0, c.0))
    }
    #[inline(always)]
    unsafe fn add_product(a: Self, b: Self, c: Self) -> Self {
        Avx2(_mm256_add_ps(c.0, _mm256_mul_ps(a.0, b.0)))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // (l0+l4, l1+l5, l2+l6, l3+l7), then pairs two apart, then the last two.
        let halves = _mm_add_ps(
            _mm256_castps256_ps128(self.0),
            _mm256_extractf128_ps(self.0, 1),
        );
        let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)))
    }
    #[inline(always)]
    unsafe fn prefetch(ptr: *const u8) {
        _mm_prefetch::<_MM_HINT_T1>(ptr as *const i8)
    }
}

impl Decode<Avx2> for F32Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[f32], c: usize) -> Avx2 {
        Avx2(_mm256_loadu_ps(row.as_ptr().add(c * 8)))
    }
}

impl Decode<Avx2> for Bf16Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u16], c: usize) -> Avx2 {
        let bits = _mm_loadu_si128(row.as_ptr().add(c * 8) as *const __m128i);
        Avx2(_mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(bits),
            16,
        )))
    }
}

impl Decode<Avx2> for F16Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u16], c: usize) -> Avx2 {
        Avx2(_mm256_cvtph_ps(_mm_loadu_si128(
            row.as_ptr().add(c * 8) as *const __m128i
        )))
    }
}

impl Decode<Avx2> for I8Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[i8], c: usize) -> Avx2 {
        let bytes = _mm_loadl_epi64(row.as_ptr().add(c * 8) as *const __m128i);
        Avx2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)))
    }
}

impl Decode<Avx2> for Int4Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u8], c: usize) -> Avx2 {
        // Four bytes hold eight nibbles, element 2k low in byte k: shift each lane's copy
        // by 4 * lane and keep the low nibble.
        let word = std::ptr::read_unaligned(row.as_ptr().add(c * 4) as *const i32);
        let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        let nibbles = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts),
            _mm256_set1_epi32(0x0F),
        );
        Avx2(_mm256_cvtepi32_ps(_mm256_sub_epi32(
            nibbles,
            _mm256_set1_epi32(8),
        )))
    }
}

impl Decode<Avx2> for E4m3Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u8], c: usize) -> Avx2 {
        // The byte sign-extended and shifted up 20 has its exponent and mantissa where an
        // f32's go and the sign at bit 31 (copies at 27-30, cleared): the value times
        // 2^-120, subnormals included. Scale back, and turn the NaN code 0x7F into a NaN.
        let bits = _mm256_and_si256(
            _mm256_slli_epi32(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64(row.as_ptr().add(c * 8) as *const __m128i)),
                20,
            ),
            _mm256_set1_epi32(0x87F0_0000_u32 as i32),
        );
        let value = _mm256_mul_ps(
            _mm256_castsi256_ps(bits),
            _mm256_set1_ps(f32::from_bits(0x7B80_0000)),
        );
        let nan = _mm256_and_si256(
            _mm256_cmpeq_epi32(
                _mm256_and_si256(bits, _mm256_set1_epi32(0x07F0_0000)),
                _mm256_set1_epi32(0x07F0_0000),
            ),
            _mm256_set1_epi32(0x7FC0_0000),
        );
        Avx2(_mm256_or_ps(value, _mm256_castsi256_ps(nan)))
    }
}

impl Decode<Avx2> for E2m1Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u8], c: usize) -> Avx2 {
        let word = std::ptr::read_unaligned(row.as_ptr().add(c * 4) as *const i32);
        let bytes = _mm_cvtsi32_si128(word);
        let low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
        let high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        let codes = _mm_unpacklo_epi8(low, high);
        let table = _mm_loadu_si128(E2M1_DOUBLED.as_ptr() as *const __m128i);
        let values = _mm_shuffle_epi8(table, codes);
        Avx2(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values)))
    }
}

/// [`super::kernels::dots`] in 256-bit registers.
/// # Safety
/// As [`super::kernels::dots_on`], with AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dots<const N: usize, const FUSED: bool>(
    a: &[f32],
    others: [&[f32]; N],
) -> [f32; N] {
    super::kernels::dots_on::<Avx2, N, FUSED>(a, others)
}

/// [`super::kernels::Queries::dots`] in 256-bit registers: two vectors at a time against
/// every key, each chunk of a key loaded once for both (one vector alone loads every key
/// for itself), each sum the one [`super::kernels::dots_on`] keeps.
/// # Safety
/// The CPU must have AVX2 and FMA; `vectors` holds `out.len()` vectors of `len`, and every
/// key is `len` long.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn queries_dots<const K: usize, const FUSED: bool>(
    vectors: &[f32],
    len: usize,
    keys: [&[f32]; K],
    out: &mut [[f32; K]],
) {
    if len == 0 {
        out.fill(super::kernels::dots_on::<Avx2, K, FUSED>(&[], keys));
        return;
    }
    let chunks = len / 8;
    let body = chunks * 8;
    for (pair, out) in vectors.chunks_exact(2 * len).zip(out.chunks_exact_mut(2)) {
        let (a, b) = pair.split_at(len);
        let mut sums = [[Avx2::zero(); K]; 2];
        for c in 0..chunks {
            let key: [Avx2; K] = std::array::from_fn(|j| Avx2::load(keys[j].as_ptr().add(8 * c)));
            for (sums, vector) in sums.iter_mut().zip([a, b]) {
                let x = Avx2::load(vector.as_ptr().add(8 * c));
                for (sum, key) in sums.iter_mut().zip(&key) {
                    *sum = step::<Avx2, FUSED>(x, *key, *sum);
                }
            }
        }
        for ((out, sums), vector) in out.iter_mut().zip(&sums).zip([a, b]) {
            *out = std::array::from_fn(|j| {
                sums[j].sum() + tail_dot::<FUSED>(&vector[body..], &keys[j][body..])
            });
        }
    }
    if out.len() % 2 == 1 {
        let last = &vectors[(out.len() - 1) * len..][..len];
        out[out.len() - 1] = super::kernels::dots_on::<Avx2, K, FUSED>(last, keys);
    }
}

/// [`super::kernels::add_weighted`] in 256-bit registers.
/// # Safety
/// As [`super::kernels::add_weighted_on`], with AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn add_weighted<const N: usize, const FUSED: bool>(
    acc: &mut [f32],
    weights: [f32; N],
    rows: [&[f32]; N],
) {
    super::kernels::add_weighted_on::<Avx2, N, FUSED>(acc, weights, rows)
}

/// [`super::kernels::fused_add_weighted_tile`] in 256-bit registers.
/// # Safety
/// As [`super::kernels::add_weighted_tile_on`], with AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn add_weighted_tile(
    sums: &mut [f32],
    len: usize,
    weights: &[f32],
    reads: &[u64],
    rows: &[&[f32]],
) {
    super::kernels::add_weighted_tile_on::<Avx2>(sums, len, weights, reads, rows)
}

/// [`super::kernels::dequantize_row`] in 256-bit registers.
/// # Safety
/// As [`super::kernels::dequantize_row_on`], with AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_row<D: Decode<Avx2>>(
    view: View<'_, D::Elem>,
    row: usize,
    out: &mut [f32],
) {
    super::kernels::dequantize_row_on::<Avx2, D>(view, row, out)
}

pub(super) struct Avx2Block<'a, D: Decode<Avx2>>(pub View<'a, D::Elem>);

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows<D: Decode<Avx2>>(
    view: &View<'_, D::Elem>,
    first: usize,
    x: &[f32],
    out: &mut [f32],
) {
    super::kernels::rows_into::<Avx2, D, false>(view.data, view.cols, view.scaling, first, x, out)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn batched<D: Decode<Avx2>>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    super::kernels::rows_batched::<Avx2, D>(
        view.data,
        view.cols,
        view.scaling,
        first,
        count,
        input,
        n,
        out,
    )
}

impl<D: Decode<Avx2>> Block for Avx2Block<'_, D> {
    fn rows(&self, first: usize, x: &[f32], out: &mut [f32]) {
        // SAFETY: an Avx2Block is built only when `Isa::detect` found AVX2, FMA and F16C.
        unsafe { rows::<D>(&self.0, first, x, out) }
    }
    fn batched(&self, first: usize, count: usize, input: &[f32], n: usize, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { batched::<D>(&self.0, first, count, input, n, out) }
    }
}
