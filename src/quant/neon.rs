//! The aarch64 Advanced SIMD instantiation of the kernels: two `float32x4_t` are the eight
//! lanes (lanes 0-3, then 4-7), so the arithmetic is the same as every other
//! instantiation's.

use std::arch::aarch64::*;

use super::codec::E2M1_DOUBLED;
use super::kernels::{
    Bf16Codes, Block, Decode, E2m1Codes, E4m3Codes, F16Codes, F32Codes, I8Codes, Int4Codes, Lanes,
    View,
};

#[derive(Clone, Copy)]
pub struct Neon(float32x4_t, float32x4_t);

impl Lanes for Neon {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Neon(vdupq_n_f32(0.0), vdupq_n_f32(0.0))
    }
    #[inline(always)]
    unsafe fn splat(value: f32) -> Self {
        Neon(vdupq_n_f32(value), vdupq_n_f32(value))
    }
    #[inline(always)]
    unsafe fn load(ptr: *const f32) -> Self {
        Neon(vld1q_f32(ptr), vld1q_f32(ptr.add(4)))
    }
    #[inline(always)]
    unsafe fn store(self, ptr: *mut f32) {
        vst1q_f32(ptr, self.0);
        vst1q_f32(ptr.add(4), self.1);
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Neon(vfmaq_f32(c.0, a.0, b.0), vfmaq_f32(c.1, a.1, b.1))
    }
    #[inline(always)]
    unsafe fn add_product(a: Self, b: Self, c: Self) -> Self {
        Neon(
            vaddq_f32(c.0, vmulq_f32(a.0, b.0)),
            vaddq_f32(c.1, vmulq_f32(a.1, b.1)),
        )
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        // (l0+l4, l1+l5, l2+l6, l3+l7), then pairs two apart, then the last two.
        let halves = vaddq_f32(self.0, self.1);
        let pairs = vadd_f32(vget_low_f32(halves), vget_high_f32(halves));
        vpadds_f32(pairs)
    }
}

/// [`super::kernels::dots`] in Advanced SIMD registers.
/// # Safety
/// As [`super::kernels::dots_on`].
pub(super) unsafe fn dots<const N: usize, const FUSED: bool>(
    a: &[f32],
    others: [&[f32]; N],
) -> [f32; N] {
    super::kernels::dots_on::<Neon, N, FUSED>(a, others)
}

/// [`super::kernels::add_weighted`] in Advanced SIMD registers.
/// # Safety
/// As [`super::kernels::add_weighted_on`].
pub(super) unsafe fn add_weighted<const N: usize, const FUSED: bool>(
    acc: &mut [f32],
    weights: [f32; N],
    rows: [&[f32]; N],
) {
    super::kernels::add_weighted_on::<Neon, N, FUSED>(acc, weights, rows)
}

/// [`super::kernels::fused_add_weighted_tile`] in Advanced SIMD registers.
/// # Safety
/// As [`super::kernels::add_weighted_tile_on`].
pub(super) unsafe fn add_weighted_tile(
    sums: &mut [f32],
    len: usize,
    weights: &[f32],
    reads: &[u64],
    rows: &[&[f32]],
) {
    super::kernels::add_weighted_tile_on::<Neon>(sums, len, weights, reads, rows)
}

/// [`super::kernels::dequantize_row`] in Advanced SIMD registers.
/// # Safety
/// As [`super::kernels::dequantize_row_on`].
pub(super) unsafe fn dequantize_row<D: Decode<Neon>>(
    view: View<'_, D::Elem>,
    row: usize,
    out: &mut [f32],
) {
    super::kernels::dequantize_row_on::<Neon, D>(view, row, out)
}

/// Eight u16 widened to two u32x4.
#[inline(always)]
unsafe fn widen(bits: uint16x8_t) -> (uint32x4_t, uint32x4_t) {
    (vmovl_u16(vget_low_u16(bits)), vmovl_high_u16(bits))
}

/// Eight i8 in the low half of a vector, as f32 lanes.
#[inline(always)]
unsafe fn i8_lanes(bytes: int8x8_t) -> Neon {
    let wide = vmovl_s8(bytes);
    Neon(
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))),
        vcvtq_f32_s32(vmovl_high_s16(wide)),
    )
}

/// Four bytes split into their eight nibbles, element 2k (low nibble of byte k) first.
#[inline(always)]
unsafe fn nibbles(row: &[u8], c: usize) -> uint8x8_t {
    let word = std::ptr::read_unaligned(row.as_ptr().add(c * 4) as *const u32);
    let bytes = vcreate_u8(u64::from(word));
    vzip1_u8(vand_u8(bytes, vdup_n_u8(0x0F)), vshr_n_u8(bytes, 4))
}

impl Decode<Neon> for F32Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[f32], c: usize) -> Neon {
        Neon::load(row.as_ptr().add(c * 8))
    }
}

impl Decode<Neon> for Bf16Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u16], c: usize) -> Neon {
        let (low, high) = widen(vld1q_u16(row.as_ptr().add(c * 8)));
        Neon(
            vreinterpretq_f32_u32(vshlq_n_u32(low, 16)),
            vreinterpretq_f32_u32(vshlq_n_u32(high, 16)),
        )
    }
}

/// f16 bits (in u32 lanes) to f32: the exponent and mantissa shifted into place give the
/// value times 2^-112 (subnormals included); scale back, restore infinities and NaNs, and
/// add the sign.
#[inline(always)]
unsafe fn f16_lanes(bits: uint32x4_t) -> float32x4_t {
    let magnitude = vandq_u32(bits, vdupq_n_u32(0x7FFF));
    let value = vmulq_f32(
        vreinterpretq_f32_u32(vshlq_n_u32(magnitude, 13)),
        vdupq_n_f32(f32::from_bits(0x7780_0000)),
    );
    let special = vcgeq_u32(magnitude, vdupq_n_u32(0x7C00));
    let value = vorrq_u32(
        vreinterpretq_u32_f32(value),
        vandq_u32(special, vdupq_n_u32(0x7F80_0000)),
    );
    let sign = vshlq_n_u32(vandq_u32(bits, vdupq_n_u32(0x8000)), 16);
    vreinterpretq_f32_u32(vorrq_u32(value, sign))
}

impl Decode<Neon> for F16Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u16], c: usize) -> Neon {
        let (low, high) = widen(vld1q_u16(row.as_ptr().add(c * 8)));
        Neon(f16_lanes(low), f16_lanes(high))
    }
}

impl Decode<Neon> for I8Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[i8], c: usize) -> Neon {
        i8_lanes(vld1_s8(row.as_ptr().add(c * 8)))
    }
}

impl Decode<Neon> for Int4Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u8], c: usize) -> Neon {
        i8_lanes(vsub_s8(vreinterpret_s8_u8(nibbles(row, c)), vdup_n_s8(8)))
    }
}

/// E4M3 bytes (in u32 lanes) to f32: the seven magnitude bits shifted into an f32's
/// exponent and mantissa give the value times 2^-120 (subnormals included).
#[inline(always)]
unsafe fn e4m3_lanes(bytes: uint32x4_t) -> float32x4_t {
    let magnitude = vandq_u32(bytes, vdupq_n_u32(0x7F));
    let value = vmulq_f32(
        vreinterpretq_f32_u32(vshlq_n_u32(magnitude, 20)),
        vdupq_n_f32(f32::from_bits(0x7B80_0000)),
    );
    let sign = vshlq_n_u32(vandq_u32(bytes, vdupq_n_u32(0x80)), 24);
    let nan = vandq_u32(
        vceqq_u32(magnitude, vdupq_n_u32(0x7F)),
        vdupq_n_u32(0x7FC0_0000),
    );
    vreinterpretq_f32_u32(vorrq_u32(
        vreinterpretq_u32_f32(value),
        vorrq_u32(sign, nan),
    ))
}

impl Decode<Neon> for E4m3Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u8], c: usize) -> Neon {
        let (low, high) = widen(vmovl_u8(vld1_u8(row.as_ptr().add(c * 8))));
        Neon(e4m3_lanes(low), e4m3_lanes(high))
    }
}

impl Decode<Neon> for E2m1Codes {
    #[inline(always)]
    unsafe fn chunk(row: &[u8], c: usize) -> Neon {
        let table = vld1q_s8(E2M1_DOUBLED.as_ptr());
        i8_lanes(vqtbl1_s8(table, nibbles(row, c)))
    }
}

pub(super) struct NeonBlock<'a, D: Decode<Neon>>(pub View<'a, D::Elem>);

#[target_feature(enable = "neon")]
unsafe fn rows<D: Decode<Neon>>(
    view: &View<'_, D::Elem>,
    first: usize,
    x: &[f32],
    out: &mut [f32],
) {
    super::kernels::rows_into::<Neon, D, false>(view.data, view.cols, view.scaling, first, x, out)
}

#[target_feature(enable = "neon")]
unsafe fn batched<D: Decode<Neon>>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    super::kernels::rows_batched::<Neon, D>(
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

impl<D: Decode<Neon>> Block for NeonBlock<'_, D> {
    fn rows(&self, first: usize, x: &[f32], out: &mut [f32]) {
        // SAFETY: a NeonBlock is built only when `Isa::detect` found NEON.
        unsafe { rows::<D>(&self.0, first, x, out) }
    }
    fn batched(&self, first: usize, count: usize, input: &[f32], n: usize, out: &mut [f32]) {
        // SAFETY: as above.
        unsafe { batched::<D>(&self.0, first, count, input, n, out) }
    }
}
