//! The AVX-512 instantiation of the kernels: one 512-bit register holds *two* of the
//! kernels' 8-lane vectors, each with its own sum, so every result keeps the bits the
//! 8-lane contract ([`super::kernels`]) defines while each instruction does twice the work.
//!
//! - One input row (decode): the halves are two weight rows against the same input. FP8's
//!   E4M3, whose decoding costs more than its multiply-add, decodes both rows' chunks with
//!   one set of instructions ([`Pair`]), by byte table lookups where the CPU has AVX-512
//!   VBMI ([`Pair::pair_vbmi`]), four chunks of both rows from one register
//!   ([`Pair::quad_vbmi`]). The nibble formats (int4, MXFP4's E2M1)
//!   run one row per 256-bit register instead, each nibble looked up by one two-table
//!   permute ([`Pair::row_chunk`]): fewer steps than a pair's, which must first bring two
//!   rows' words into one register.
//! - A batch (prefill): the halves are two input rows against the same decoded weight row;
//!   blocks of eight weight rows, decoded a column block at a time, run against three input
//!   pairs a tile ([`blocked_rows`]).
//!   A few inputs (an expert's share of a prompt) have each chunk decoded in registers for
//!   a tile of inputs instead: on the row kernel's decoding ([`kernels::rows_few_inputs`]),
//!   or for the formats decoded in pairs, two pairs of rows decoded once for up to four
//!   inputs ([`few_inputs_rows_on`]).
//!
//! Entered only after runtime detection (AVX-512 F, BW, DQ and VL beside AVX2, FMA and F16C:
//! [`super::kernels::Isa::detect`]; VBMI on its own, [`with_vbmi`]); a lone last row goes to
//! the AVX2 kernels, which compute the same bits.

use std::arch::x86_64::*;
use std::ops::Range;

use super::codec::{self, E2M1_DOUBLED};
use super::kernels::{
    self, Bf16Codes, Block, Codes, Decode, E2m1Codes, E4m3Codes, F16Codes, F32Codes, I8Codes,
    Int4Codes, Lanes, RowScales, Scaling, View,
};
use super::lines::Lines;
use super::x86::Avx2;
use rayon::prelude::*;

/// Two 8-lane vectors: lanes 0-7 are the first, 8-15 the second.
#[derive(Clone, Copy)]
pub(super) struct Two(__m512);

impl Two {
    #[inline(always)]
    unsafe fn zero() -> Two {
        Two(_mm512_setzero_ps())
    }
    #[inline(always)]
    unsafe fn fma(a: Two, b: Two, c: Two) -> Two {
        Two(_mm512_fmadd_ps(a.0, b.0, c.0))
    }
    /// The same eight floats in both halves.
    #[inline(always)]
    unsafe fn both(ptr: *const f32) -> Two {
        Two(_mm512_broadcast_f32x8(_mm256_loadu_ps(ptr)))
    }
    /// Eight floats from `low` and eight from `high`.
    #[inline(always)]
    unsafe fn halves(low: *const f32, high: *const f32) -> Two {
        Two(_mm512_insertf32x8::<1>(
            _mm512_castps256_ps512(_mm256_loadu_ps(low)),
            _mm256_loadu_ps(high),
        ))
    }
    /// Each half summed in the 8-lane order.
    #[inline(always)]
    unsafe fn sums(self) -> [f32; 2] {
        [
            Avx2(_mm512_castps512_ps256(self.0)).sum(),
            Avx2(_mm512_extractf32x8_ps::<1>(self.0)).sum(),
        ]
    }

    /// [`Two::sums`] of eight registers at once: the same adds of the same lanes, done
    /// across the registers side by side (21 shuffles and adds for the sixteen sums, where
    /// one register's two take 13). Lane `4g + k` of the result is half `g % 2` of register
    /// `2k + g / 2`: fed the sums of two pairs of vectors (`p` = 0, 1) against four keys
    /// (`j`) as register `2j + p`, lane `4(2p + h) + j` is vector `2p + h` against key `j`,
    /// the order of four rows of four dots.
    #[inline(always)]
    unsafe fn sums_of_eight(regs: [Two; 8]) -> __m512 {
        // Lanes `i` and `i + 4` of each half: 128-bit lanes of register pairs side by side,
        // `[a.0, a.2, b.0, b.2] + [a.1, a.3, b.1, b.3]`, so lane `g` of `fours[k]` holds half
        // `g % 2` of register `2k + g / 2`.
        let fours: [__m512; 4] = std::array::from_fn(|k| {
            let (a, b) = (regs[2 * k].0, regs[2 * k + 1].0);
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0x88>(a, b),
                _mm512_shuffle_f32x4::<0xDD>(a, b),
            )
        });
        // Then the pairs two apart: `(s0 + s2, s1 + s3)` of two registers in each lane.
        let twos: [__m512; 2] = std::array::from_fn(|m| {
            let (c, d) = (fours[2 * m], fours[2 * m + 1]);
            _mm512_add_ps(
                _mm512_shuffle_ps::<0x44>(c, d),
                _mm512_shuffle_ps::<0xEE>(c, d),
            )
        });
        // And the last two: element `k` of 128-bit lane `g` is the sum of `fours[k]`'s lane `g`.
        _mm512_add_ps(
            _mm512_shuffle_ps::<0x88>(twos[0], twos[1]),
            _mm512_shuffle_ps::<0xDD>(twos[0], twos[1]),
        )
    }
}

/// How a format decodes with AVX-512: chunk `c` of two rows into the two halves, and of one
/// row for the row kernel ([`Pair::row_chunk`]).
pub(super) trait Pair: Decode<Avx2> {
    /// Whether one input row runs two weight rows per register. Only formats whose
    /// decoding costs more than their multiply-add gain from it; a format that streams at
    /// memory speed keeps the AVX2 row kernel (measured no faster in pairs), and so does
    /// one whose [`Pair::row_chunk`] decodes a row in fewer steps than a pair costs.
    const ROWS_IN_PAIRS: bool;
    /// # Safety
    /// `8c + 8` must not exceed either row's element count, and the CPU must have AVX-512.
    unsafe fn pair(low: &[Self::Elem], high: &[Self::Elem], c: usize) -> Two;
    /// Whether [`Pair::pair_vbmi`] decodes a pair in fewer steps than [`Pair::pair`]: the
    /// kernels of one input and of a few run it ([`Vbmi`]) where the CPU has AVX-512 VBMI.
    const VBMI: bool = false;
    /// [`Pair::pair`] with AVX-512 VBMI's byte permutes, the same bits.
    /// # Safety
    /// As [`Pair::pair`], and the CPU must have AVX-512 VBMI.
    #[inline(always)]
    unsafe fn pair_vbmi(low: &[Self::Elem], high: &[Self::Elem], c: usize) -> Two {
        Self::pair(low, high, c)
    }
    /// Chunks `c..c + 4` of both rows, each as [`Pair::pair`] gives it.
    /// # Safety
    /// As [`Pair::pair`], for chunk `c + 3`.
    #[inline(always)]
    unsafe fn quad(low: &[Self::Elem], high: &[Self::Elem], c: usize) -> [Two; 4] {
        std::array::from_fn(|k| Self::pair(low, high, c + k))
    }
    /// [`Pair::quad`] with AVX-512 VBMI's byte permutes, the same bits.
    /// # Safety
    /// As [`Pair::quad`], and the CPU must have AVX-512 VBMI.
    #[inline(always)]
    unsafe fn quad_vbmi(low: &[Self::Elem], high: &[Self::Elem], c: usize) -> [Two; 4] {
        std::array::from_fn(|k| Self::pair_vbmi(low, high, c + k))
    }
    /// Chunk `c` of one row for the row kernel, with AVX-512VL's 256-bit instructions
    /// where they decode it in fewer steps than AVX2's (the same bits).
    /// # Safety
    /// As [`Pair::pair`].
    #[inline(always)]
    unsafe fn row_chunk(row: &[Self::Elem], c: usize) -> Avx2 {
        <Self as Decode<Avx2>>::chunk(row, c)
    }
}

/// The codes of format `D` under a wrapper that changes only how they are decoded.
macro_rules! codes_of {
    ($wrapper:ident) => {
        impl<D: Pair> Codes for $wrapper<D> {
            type Elem = D::Elem;
            const CHUNK_BYTES: usize = D::CHUNK_BYTES;
            const COSTLY_DECODE: bool = D::COSTLY_DECODE;
            fn stride(cols: usize) -> usize {
                D::stride(cols)
            }
            #[inline(always)]
            fn value(row: &[Self::Elem], i: usize) -> f32 {
                D::value(row, i)
            }
        }
    };
}

/// Format `D` with its chunks decoded by [`Pair::row_chunk`], for the AVX2 row kernel.
#[derive(Clone, Copy)]
struct OneRow<D>(std::marker::PhantomData<D>);

codes_of!(OneRow);

impl<D: Pair> Decode<Avx2> for OneRow<D> {
    #[inline(always)]
    unsafe fn chunk(row: &[Self::Elem], c: usize) -> Avx2 {
        D::row_chunk(row, c)
    }
}

/// Format `D` with its pairs decoded by [`Pair::pair_vbmi`], for kernels compiled with
/// AVX-512 VBMI ([`with_vbmi`]): its `pair` needs a CPU with VBMI, not only AVX-512.
#[derive(Clone, Copy)]
struct Vbmi<D>(std::marker::PhantomData<D>);

codes_of!(Vbmi);

impl<D: Pair> Decode<Avx2> for Vbmi<D> {
    #[inline(always)]
    unsafe fn chunk(row: &[Self::Elem], c: usize) -> Avx2 {
        D::chunk(row, c)
    }
}

impl<D: Pair> Pair for Vbmi<D> {
    const ROWS_IN_PAIRS: bool = D::ROWS_IN_PAIRS;
    #[inline(always)]
    unsafe fn pair(low: &[Self::Elem], high: &[Self::Elem], c: usize) -> Two {
        D::pair_vbmi(low, high, c)
    }
    #[inline(always)]
    unsafe fn quad(low: &[Self::Elem], high: &[Self::Elem], c: usize) -> [Two; 4] {
        D::quad_vbmi(low, high, c)
    }
    #[inline(always)]
    unsafe fn row_chunk(row: &[Self::Elem], c: usize) -> Avx2 {
        D::row_chunk(row, c)
    }
}

/// Whether format `D`'s kernels run [`Vbmi`]`<D>`: it has a VBMI decoder and the CPU
/// has AVX-512 VBMI (Ice Lake, Zen 4 and later; not Skylake-X).
fn with_vbmi<D: Pair>() -> bool {
    static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    D::VBMI && *VBMI.get_or_init(|| is_x86_feature_detected!("avx512vbmi"))
}

/// Chunk `c` of a row of nibbles, each looked up in `values`: every lane shifts its copy of
/// the row's word by 4 * lane, and `vpermi2ps`, which reads only an index's low four bits,
/// picks the nibble's float from the sixteen in two registers.
///
/// Written out because LLVM turns the intrinsic (`_mm256_permutex2var_ps`) into a 512-bit
/// `vpermd` over the two halves joined, which Zen 4 runs at half the rate: the one-thread
/// kernel measured 20.5 G weights/s that way and 25.4 this way (docs/benchmarks.md).
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx2")]
unsafe fn row_nibble_lookup(row: &[u8], c: usize, values: &[f32; 16]) -> Avx2 {
    let word = std::ptr::read_unaligned(row.as_ptr().add(c * 4) as *const i32);
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let index = _mm256_srlv_epi32(_mm256_set1_epi32(word), shifts);
    let looked: __m256;
    std::arch::asm!(
        "vpermi2ps {index}, {low}, {high}",
        index = inout(ymm_reg) _mm256_castsi256_ps(index) => looked,
        low = in(ymm_reg) _mm256_loadu_ps(values.as_ptr()),
        high = in(ymm_reg) _mm256_loadu_ps(values.as_ptr().add(8)),
        options(pure, nomem, nostack, preserves_flags),
    );
    Avx2(looked)
}

impl Pair for F32Codes {
    const ROWS_IN_PAIRS: bool = false;
    #[inline(always)]
    unsafe fn pair(low: &[f32], high: &[f32], c: usize) -> Two {
        Two::halves(low.as_ptr().add(c * 8), high.as_ptr().add(c * 8))
    }
}

/// Eight 16-bit codes of each row, `low`'s first.
#[inline(always)]
unsafe fn sixteen_u16(low: &[u16], high: &[u16], c: usize) -> __m256i {
    _mm256_inserti128_si256::<1>(
        _mm256_castsi128_si256(_mm_loadu_si128(low.as_ptr().add(c * 8) as *const __m128i)),
        _mm_loadu_si128(high.as_ptr().add(c * 8) as *const __m128i),
    )
}

/// Eight bytes of each row, `low`'s first.
#[inline(always)]
unsafe fn sixteen_bytes(low: &[u8], high: &[u8], c: usize) -> __m128i {
    let a = std::ptr::read_unaligned(low.as_ptr().add(c * 8) as *const i64);
    let b = std::ptr::read_unaligned(high.as_ptr().add(c * 8) as *const i64);
    _mm_set_epi64x(b, a)
}

/// Four bytes (eight nibbles) of each row: `low`'s word in lanes 0-7, `high`'s in 8-15.
#[inline(always)]
unsafe fn nibble_words(low: &[u8], high: &[u8], c: usize) -> (i32, i32) {
    (
        std::ptr::read_unaligned(low.as_ptr().add(c * 4) as *const i32),
        std::ptr::read_unaligned(high.as_ptr().add(c * 4) as *const i32),
    )
}

/// What each 4-bit code of the signed int4 format decodes to: `code - 8`.
const INT4_VALUES: [f32; 16] = {
    let mut values = [0f32; 16];
    let mut code = 0;
    while code < 16 {
        values[code] = code as f32 - 8.0;
        code += 1;
    }
    values
};

/// What each E2M1 code decodes to, doubled as the other kernels decode it (the block scale
/// halves it): [`E2M1_DOUBLED`] as floats, `+0.0` for both zeros as their conversion gives.
const E2M1_VALUES: [f32; 16] = {
    let mut values = [0f32; 16];
    let mut code = 0;
    while code < 16 {
        values[code] = E2M1_DOUBLED[code] as f32;
        code += 1;
    }
    values
};

/// Chunk `c` of two rows of nibbles, each looked up in `values`: every lane shifts its copy
/// of the row's word by 4 * lane, and `vpermps`, which reads only an index's low four bits,
/// turns the nibble into its float in one instruction (no mask, offset or conversion).
#[inline(always)]
unsafe fn nibble_lookup(low: &[u8], high: &[u8], c: usize, values: &[f32; 16]) -> Two {
    let (a, b) = nibble_words(low, high, c);
    let words = _mm512_mask_set1_epi32(_mm512_set1_epi32(a), 0xFF00, b);
    let shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    let table = _mm512_loadu_ps(values.as_ptr());
    Two(_mm512_permutexvar_ps(
        _mm512_srlv_epi32(words, shifts),
        table,
    ))
}

impl Pair for Bf16Codes {
    const ROWS_IN_PAIRS: bool = false;
    #[inline(always)]
    unsafe fn pair(low: &[u16], high: &[u16], c: usize) -> Two {
        let bits = _mm512_cvtepu16_epi32(sixteen_u16(low, high, c));
        Two(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(bits)))
    }
}

impl Pair for F16Codes {
    const ROWS_IN_PAIRS: bool = false;
    #[inline(always)]
    unsafe fn pair(low: &[u16], high: &[u16], c: usize) -> Two {
        Two(_mm512_cvtph_ps(sixteen_u16(low, high, c)))
    }
}

impl Pair for I8Codes {
    const ROWS_IN_PAIRS: bool = false;
    #[inline(always)]
    unsafe fn pair(low: &[i8], high: &[i8], c: usize) -> Two {
        let a = std::ptr::read_unaligned(low.as_ptr().add(c * 8) as *const i64);
        let b = std::ptr::read_unaligned(high.as_ptr().add(c * 8) as *const i64);
        Two(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_set_epi64x(
            b, a,
        ))))
    }
}

impl Pair for Int4Codes {
    const ROWS_IN_PAIRS: bool = false;
    #[inline(always)]
    unsafe fn pair(low: &[u8], high: &[u8], c: usize) -> Two {
        nibble_lookup(low, high, c, &INT4_VALUES)
    }
    #[inline(always)]
    unsafe fn row_chunk(row: &[u8], c: usize) -> Avx2 {
        row_nibble_lookup(row, c, &INT4_VALUES)
    }
}

impl Pair for E4m3Codes {
    const ROWS_IN_PAIRS: bool = true;
    #[inline(always)]
    unsafe fn pair(low: &[u8], high: &[u8], c: usize) -> Two {
        // E4M3 is a half-precision float with a 4-bit exponent and 3 mantissa bits: the
        // byte, sign-extended to 16 bits and shifted up 7, has its sign at bit 15 (and a
        // copy at bit 14, cleared), exponent and mantissa where a half's high ones go.
        // That half is the value times 2^-8 (exponent bias 15 against 7), subnormals
        // included; the conversion and the power-of-two product are exact.
        let bytes = sixteen_bytes(low, high, c);
        let halves = _mm256_and_si256(
            _mm256_slli_epi16::<7>(_mm256_cvtepi8_epi16(bytes)),
            _mm256_set1_epi16(0xBFFF_u16 as i16),
        );
        let value = _mm512_mul_ps(_mm512_cvtph_ps(halves), _mm512_set1_ps(256.0));
        // Magnitude 0x7F is NaN; as the other decoders: 480's bits or the quiet NaN's.
        let nan = _mm_cmpeq_epi8_mask(
            _mm_and_si128(bytes, _mm_set1_epi8(0x7F)),
            _mm_set1_epi8(0x7F),
        );
        Two(_mm512_mask_or_ps(
            value,
            nan,
            value,
            _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC0_0000)),
        ))
    }
    const VBMI: bool = true;
    #[inline(always)]
    unsafe fn pair_vbmi(low: &[u8], high: &[u8], c: usize) -> Two {
        // Code `k` goes to bytes 4k + 2 and 4k + 3 (the rest zero, from the zeros above the
        // sixteen codes).
        let codes = _mm512_zextsi128_si512(sixteen_bytes(low, high, c));
        e4m3_spread(_mm512_permutexvar_epi8(table64(&E4M3_SPREAD), codes))
    }
    #[inline(always)]
    unsafe fn quad_vbmi(low: &[u8], high: &[u8], c: usize) -> [Two; 4] {
        // Four chunks of both rows in one register (the first row's 32 codes, then the
        // second's), so one load and one byte permute a chunk spread them: a pair's two
        // loads, the permute that joins them and the spread took four.
        let codes = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(low[c * 8..][..32].as_ptr().cast())),
            _mm256_loadu_si256(high[c * 8..][..32].as_ptr().cast()),
        );
        std::array::from_fn(|k| {
            let spread = _mm512_maskz_permutexvar_epi8(
                0xCCCC_CCCC_CCCC_CCCC,
                table64(&E4M3_QUAD_SPREAD[k]),
                codes,
            );
            e4m3_spread(spread)
        })
    }
}

/// The E4M3 values whose codes `spread` holds in bytes `4k + 2` and `4k + 3` (bytes `4k`
/// and `4k + 1` zero). Every E4M3 value is an f32 whose low sixteen bits are zero: its
/// bytes 2 and 3, each looked up by the code's seven magnitude bits in 128-byte tables,
/// then the sign. Each lookup rewrites its byte in place (the index's bit 7, the sign, is
/// ignored). Three byte permutes for sixteen values with the spread, where
/// [`Pair::pair`] takes a widening, a conversion, a product and the NaN code's mask.
#[inline(always)]
unsafe fn e4m3_spread(spread: __m512i) -> Two {
    let [byte2, byte3] = &E4M3_BYTES;
    let low_bytes = _mm512_mask2_permutex2var_epi8(
        table64(&byte2[0]),
        spread,
        0x4444_4444_4444_4444,
        table64(&byte2[1]),
    );
    let magnitude = _mm512_mask2_permutex2var_epi8(
        table64(&byte3[0]),
        low_bytes,
        0x8888_8888_8888_8888,
        table64(&byte3[1]),
    );
    // magnitude | (spread & sign bit)
    Two(_mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xF8>(
        magnitude,
        spread,
        _mm512_set1_epi32(i32::MIN),
    )))
}

/// A 64-byte table in a register.
#[inline(always)]
unsafe fn table64(bytes: &[u8; 64]) -> __m512i {
    _mm512_loadu_si512(bytes.as_ptr() as *const __m512i)
}

/// Bytes `4k + 2` and `4k + 3` of [`E4m3Codes::pair_vbmi`]'s spread pick code `k`, the
/// others byte 16 (zero).
const E4M3_SPREAD: [u8; 64] = {
    let mut bytes = [16u8; 64];
    let mut i = 0;
    while i < 64 {
        if i % 4 >= 2 {
            bytes[i] = (i / 4) as u8;
        }
        i += 1;
    }
    bytes
};

/// [`E4m3Codes::quad_vbmi`]'s spreads of chunk `k`: bytes `4i + 2` and `4i + 3` pick the
/// first row's code `8k + i` (lanes `i` 0-7) or the second row's `8k + i - 8` (lanes 8-15,
/// 32 bytes on); bytes `4i` and `4i + 1` are masked to zero.
const E4M3_QUAD_SPREAD: [[u8; 64]; 4] = {
    let mut tables = [[0u8; 64]; 4];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 64 {
            let lane = i / 4;
            tables[k][i] = if lane < 8 {
                8 * k + lane
            } else {
                32 + 8 * k + lane - 8
            } as u8;
            i += 1;
        }
        k += 1;
    }
    tables
};

/// Byte `byte` of the f32 that each magnitude code `64 * half .. 64 * half + 64` decodes
/// to: [`E4m3Codes::pair_vbmi`]'s tables.
const fn e4m3_bytes(byte: u32, half: usize) -> [u8; 64] {
    let mut bytes = [0u8; 64];
    let mut i = 0;
    while i < 64 {
        let bits = codec::e4m3_to_f32((64 * half + i) as u8).to_bits();
        assert!(
            bits & 0xFFFF == 0,
            "every E4M3 value has sixteen zero low bits"
        );
        bytes[i] = (bits >> (8 * byte)) as u8;
        i += 1;
    }
    bytes
}

/// `[byte 2, byte 3][half]`, as [`e4m3_bytes`] gives them.
static E4M3_BYTES: [[[u8; 64]; 2]; 2] = [
    [e4m3_bytes(2, 0), e4m3_bytes(2, 1)],
    [e4m3_bytes(3, 0), e4m3_bytes(3, 1)],
];

impl Pair for E2m1Codes {
    const ROWS_IN_PAIRS: bool = false;
    #[inline(always)]
    unsafe fn pair(low: &[u8], high: &[u8], c: usize) -> Two {
        nibble_lookup(low, high, c, &E2M1_VALUES)
    }
    #[inline(always)]
    unsafe fn row_chunk(row: &[u8], c: usize) -> Avx2 {
        row_nibble_lookup(row, c, &E2M1_VALUES)
    }
}

/// Row `row` of a matrix stored as `data`.
#[inline(always)]
fn row_of<D: Codes>(data: &[D::Elem], cols: usize, row: usize) -> &[D::Elem] {
    let stride = D::stride(cols);
    &data[row * stride..(row + 1) * stride]
}

/// A row's last `cols % 8` elements (decoded) beside zeros, as the 8-lane kernels pad them.
#[inline(always)]
fn padded_tail<D: Codes>(row: &[D::Elem], start: usize, cols: usize) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for (lane, i) in lanes.iter_mut().zip(start..cols) {
        *lane = D::value(row, i);
    }
    lanes
}

/// Where chunk `c` starts a cache line of the rows, asks for the line `ahead` bytes on in
/// each row (the next block's, see `dot_rows`).
#[inline(always)]
unsafe fn prefetch_pairs<D: Pair, const P: usize>(
    rows: &[[&[D::Elem]; 2]; P],
    c: usize,
    ahead: usize,
) {
    if c.is_multiple_of((64 / D::CHUNK_BYTES).max(1)) {
        for row in rows.iter().flatten() {
            let line = (row.as_ptr() as *const u8).wrapping_add(c * D::CHUNK_BYTES);
            Avx2::prefetch(line.wrapping_add(ahead));
        }
    }
}

/// Chunk `c` of each pair of rows against each input `x[t]`, into `into[p][t]`, after
/// [`prefetch_pairs`]. A function, not a closure, so that it inherits the caller's
/// instruction set.
#[inline(always)]
unsafe fn pairs_step<D: Pair, const P: usize, const T: usize>(
    rows: &[[&[D::Elem]; 2]; P],
    x: [*const f32; T],
    c: usize,
    ahead: usize,
    into: &mut [[Two; T]; P],
) {
    prefetch_pairs::<D, P>(rows, c, ahead);
    let mut xv = [Two::zero(); T];
    for t in 0..T {
        xv[t] = Two::both(x[t].add(c * 8));
    }
    for p in 0..P {
        let w = D::pair(rows[p][0], rows[p][1], c);
        for t in 0..T {
            into[p][t] = Two::fma(w, xv[t], into[p][t]);
        }
    }
}

/// [`pairs_step`] for chunks `c..c + 4`, each pair's four chunks decoded together
/// ([`Pair::quad`]) and fed to its sums in order, so the bits are four steps'.
#[inline(always)]
unsafe fn pairs_quad_step<D: Pair, const P: usize, const T: usize>(
    rows: &[[&[D::Elem]; 2]; P],
    x: [*const f32; T],
    c: usize,
    ahead: usize,
    into: &mut [[Two; T]; P],
) {
    for k in 0..4 {
        prefetch_pairs::<D, P>(rows, c + k, ahead);
    }
    for p in 0..P {
        let w = D::quad(rows[p][0], rows[p][1], c);
        for (k, w) in w.into_iter().enumerate() {
            for t in 0..T {
                let xv = Two::both(x[t].add((c + k) * 8));
                into[p][t] = Two::fma(w, xv, into[p][t]);
            }
        }
    }
}

/// The zero-padded last chunk of each pair of rows against each input's.
#[inline(always)]
unsafe fn tails_step<const P: usize, const T: usize>(
    tails: &[[[f32; 8]; 2]; P],
    x_tails: &[[f32; 8]; T],
    into: &mut [[Two; T]; P],
) {
    let mut xv = [Two::zero(); T];
    for t in 0..T {
        xv[t] = Two::both(x_tails[t].as_ptr());
    }
    for p in 0..P {
        let rows = Two::halves(tails[p][0].as_ptr(), tails[p][1].as_ptr());
        for t in 0..T {
            into[p][t] = Two::fma(rows, xv[t], into[p][t]);
        }
    }
}

/// The scales of groups `from..from + 16` of one row (zeros past its last group), the
/// values [`RowScales::at`] gives, loaded sixteen at a time.
#[inline(always)]
unsafe fn sixteen_scales(scales: RowScales, from: usize) -> __m512 {
    let present = |count: usize| ((1u32 << count.saturating_sub(from).min(16)) - 1) as __mmask16;
    match scales {
        RowScales::One => _mm512_set1_ps(1.0),
        RowScales::F32(scales) => {
            _mm512_maskz_loadu_ps(present(scales.len()), scales.as_ptr().wrapping_add(from))
        }
        RowScales::E8m0(scales) => {
            let bytes = _mm_maskz_loadu_epi8(
                present(scales.len()),
                scales.as_ptr().wrapping_add(from) as *const i8,
            );
            // `mxfp4_group_scale`: the byte as an f32's exponent, halved.
            let powers = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_cvtepu8_epi32(bytes)));
            _mm512_mul_ps(powers, _mm512_set1_ps(0.5))
        }
    }
}

/// The dot products of `P` pairs of rows (rows `first + 2p` and `first + 2p + 1`) with
/// each of `T` inputs, `out[p][t]`: each half fed what the 8-lane `dot_rows` feeds one row,
/// in the same order, and each chunk of a pair decoded once for the `T` inputs.
#[inline(always)]
unsafe fn dot_pairs<D: Pair, const P: usize, const T: usize>(
    data: &[D::Elem],
    first: usize,
    xs: [&[f32]; T],
    cols: usize,
    scaling: Scaling,
) -> [[[f32; 2]; T]; P] {
    let rows: [[&[D::Elem]; 2]; P] = std::array::from_fn(|p| {
        [
            row_of::<D>(data, cols, first + 2 * p),
            row_of::<D>(data, cols, first + 2 * p + 1),
        ]
    });
    let full = cols / 8;
    let mut x_tails = [[0f32; 8]; T];
    for (x_tail, x) in x_tails.iter_mut().zip(xs) {
        x_tail[..cols - full * 8].copy_from_slice(&x[full * 8..cols]);
    }
    let x: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
    let tails: [[[f32; 8]; 2]; P] = std::array::from_fn(|p| {
        [
            padded_tail::<D>(rows[p][0], full * 8, cols),
            padded_tail::<D>(rows[p][1], full * 8, cols),
        ]
    });
    // The rows of the next block, one request per cache line (see `dot_rows`).
    let ahead = 2 * P * std::mem::size_of_val(rows[0][0]);
    let mut acc = [[Two::zero(); T]; P];
    let mut out = [[[0f32; 2]; T]; P];
    match scaling {
        Scaling::None | Scaling::Row(_) => {
            let mut c = 0;
            while c + 4 <= full {
                pairs_quad_step::<D, P, T>(&rows, x, c, ahead, &mut acc);
                c += 4;
            }
            while c < full {
                pairs_step::<D, P, T>(&rows, x, c, ahead, &mut acc);
                c += 1;
            }
            if full * 8 < cols {
                tails_step(&tails, &x_tails, &mut acc);
            }
            for p in 0..P {
                for t in 0..T {
                    out[p][t] = acc[p][t].sums();
                    if let Scaling::Row(scales) = scaling {
                        for h in 0..2 {
                            out[p][t][h] *= scales[first + 2 * p + h];
                        }
                    }
                }
            }
        }
        _ => {
            let per_group = scaling.group_size().unwrap_or(8) / 8;
            let chunks = cols.div_ceil(8);
            let row_scales: [[RowScales; 2]; P] = std::array::from_fn(|p| {
                [
                    scaling.row_scales(first + 2 * p),
                    scaling.row_scales(first + 2 * p + 1),
                ]
            });
            let mut sixteen = [[_mm512_setzero_ps(); 2]; P];
            let mut group = 0usize;
            let mut c = 0;
            while c < chunks {
                let end = (c + per_group).min(chunks);
                let mut partial = [[Two::zero(); T]; P];
                while c + 4 <= end.min(full) {
                    pairs_quad_step::<D, P, T>(&rows, x, c, ahead, &mut partial);
                    c += 4;
                }
                while c < end.min(full) {
                    pairs_step::<D, P, T>(&rows, x, c, ahead, &mut partial);
                    c += 1;
                }
                if c < end {
                    tails_step(&tails, &x_tails, &mut partial);
                    c += 1;
                }
                if group.is_multiple_of(16) {
                    for p in 0..P {
                        sixteen[p] = [
                            sixteen_scales(row_scales[p][0], group),
                            sixteen_scales(row_scales[p][1], group),
                        ];
                    }
                }
                // Lanes 0-7 pick group `group % 16` of the first row, 8-15 of the second.
                let pick = _mm512_add_epi32(
                    _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16),
                    _mm512_set1_epi32((group % 16) as i32),
                );
                for p in 0..P {
                    let scale = Two(_mm512_permutex2var_ps(sixteen[p][0], pick, sixteen[p][1]));
                    for t in 0..T {
                        acc[p][t] = Two::fma(partial[p][t], scale, acc[p][t]);
                    }
                }
                group += 1;
            }
            for p in 0..P {
                for t in 0..T {
                    out[p][t] = acc[p][t].sums();
                }
            }
        }
    }
    out
}

/// [`kernels::Queries::dots`]: every pair of vectors (`paired`, interleaved chunk by chunk)
/// against each key, four pairs at a time; an odd last vector on AVX2. `FUSED` rounds each
/// product with its add ([`kernels::fused_dots`]).
/// # Safety
/// The CPU must have AVX-512; `paired` holds `vectors`' pairs, `out` one entry per vector,
/// every key `len` long.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn paired_dots<const K: usize, const FUSED: bool>(
    paired: &[f32],
    vectors: &[f32],
    len: usize,
    keys: [&[f32]; K],
    out: &mut [[f32; K]],
) {
    let pairs = out.len() / 2;
    let mut pair = 0;
    while pair + 4 <= pairs {
        pairs_against::<4, K, FUSED>(paired, vectors, len, pair, keys, out);
        pair += 4;
    }
    while pair < pairs {
        pairs_against::<1, K, FUSED>(paired, vectors, len, pair, keys, out);
        pair += 1;
    }
    if out.len() % 2 == 1 {
        let last = &vectors[(out.len() - 1) * len..];
        out[out.len() - 1] = kernels::dots_on::<Avx2, K, FUSED>(last, keys);
    }
}

/// Pairs `first..first + P` of [`paired_dots`] against every key, `P x K` sums in registers.
#[inline(always)]
unsafe fn pairs_against<const P: usize, const K: usize, const FUSED: bool>(
    paired: &[f32],
    vectors: &[f32],
    len: usize,
    first: usize,
    keys: [&[f32]; K],
    out: &mut [[f32; K]],
) {
    let chunks = len / 8;
    let mut sums = [[Two::zero(); K]; P];
    for c in 0..chunks {
        let key: [Two; K] = std::array::from_fn(|j| Two::both(keys[j].as_ptr().add(8 * c)));
        for (p, sums) in sums.iter_mut().enumerate() {
            let two = Two(_mm512_loadu_ps(
                paired.as_ptr().add(((first + p) * chunks + c) * 16),
            ));
            for (sum, key) in sums.iter_mut().zip(&key) {
                *sum = Two(if FUSED {
                    _mm512_fmadd_ps(two.0, key.0, sum.0)
                } else {
                    _mm512_add_ps(sum.0, _mm512_mul_ps(two.0, key.0))
                });
            }
        }
    }
    let body = chunks * 8;
    if K == 4 && P.is_multiple_of(2) && body == len {
        // No tails: two pairs' sixteen dots are summed together, in the order of `out`.
        let tail = _mm512_set1_ps(kernels::tail_dot::<FUSED>(&[], &[]));
        for p in (0..P).step_by(2) {
            let totals = Two::sums_of_eight(std::array::from_fn(|r| sums[p + r % 2][r / 2]));
            let rows = &mut out[2 * (first + p)..][..4].as_flattened_mut()[..16];
            _mm512_storeu_ps(rows.as_mut_ptr(), _mm512_add_ps(totals, tail));
        }
        return;
    }
    for (p, sums) in sums.iter().enumerate() {
        for (j, sum) in sums.iter().enumerate() {
            for (half, total) in sum.sums().into_iter().enumerate() {
                let vector = 2 * (first + p) + half;
                let tail = &vectors[vector * len + body..(vector + 1) * len];
                out[vector][j] = total + kernels::tail_dot::<FUSED>(tail, &keys[j][body..]);
            }
        }
    }
}

/// [`kernels::add_weighted`] (with `FUSED`, [`kernels::fused_add_weighted`]) sixteen
/// elements to a register (each element's sum is its own, so the width changes no bit), the
/// last fewer than sixteen on AVX2.
/// # Safety
/// As [`kernels::add_weighted_on`], with AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn add_weighted<const N: usize, const FUSED: bool>(
    acc: &mut [f32],
    weights: [f32; N],
    rows: [&[f32]; N],
) {
    let body = acc.len() / 16 * 16;
    let splats = weights.map(|w| _mm512_set1_ps(w));
    for i in (0..body).step_by(16) {
        let at = acc.as_mut_ptr().add(i);
        let mut sum = _mm512_loadu_ps(at);
        for (w, row) in splats.iter().zip(&rows) {
            let x = _mm512_loadu_ps(row.as_ptr().add(i));
            sum = if FUSED {
                _mm512_fmadd_ps(*w, x, sum)
            } else {
                _mm512_add_ps(sum, _mm512_mul_ps(*w, x))
            };
        }
        _mm512_storeu_ps(at, sum);
    }
    kernels::add_weighted_on::<Avx2, N, FUSED>(
        &mut acc[body..],
        weights,
        rows.map(|row| &row[body..]),
    );
}

/// [`kernels::fused_add_weighted_tile`] four sums at a time, sixty-four elements of each (four
/// registers) in registers while every row goes by: a row's chunk is loaded once for the
/// four, and a sum that does not read the row keeps its value (a masked fused
/// multiply-add). Sixty-four elements of every sum of a group of up to [`TILE_GROUP`] are
/// summed before the next sixty-four, so the part of the rows they read (16 KiB for 64
/// rows) stays in the first-level cache for all of them. Tails are masked loads and
/// stores, and each element's sum is its own, so no width changes a bit.
/// # Safety
/// As [`kernels::add_weighted_tile_on`], with AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn add_weighted_tile(
    sums: &mut [f32],
    len: usize,
    weights: &[f32],
    reads: &[u64],
    rows: &[&[f32]],
) {
    for group in (0..reads.len()).step_by(TILE_GROUP) {
        let end = (group + TILE_GROUP).min(reads.len());
        let fours = (end - group) / 4;
        let tiles: [Packed<4>; TILE_GROUP / 4] = std::array::from_fn(|q| {
            let first = group + 4 * q;
            if q < fours {
                Packed::new(weights, reads, rows.len(), first)
            } else {
                Packed::EMPTY
            }
        });
        let left = end - group - 4 * fours;
        let ones: [Packed<1>; 3] = std::array::from_fn(|o| {
            if o < left {
                Packed::new(weights, reads, rows.len(), group + 4 * fours + o)
            } else {
                Packed::EMPTY
            }
        });
        for at in (0..len).step_by(64) {
            for (q, tile) in tiles.iter().enumerate().take(fours) {
                sums_of_block(sums, len, rows, group + 4 * q, tile, at);
            }
            // Only the sums there are: an empty one would still load and store back its
            // sixty-four elements, past the end of `sums` for the last group.
            for (o, one) in ones.iter().enumerate().take(left) {
                sums_of_block(sums, len, rows, group + 4 * fours + o, one, at);
            }
        }
    }
}

/// Sums [`add_weighted_tile`] takes together, sixty-four elements at a time.
const TILE_GROUP: usize = 32;

/// The weights of `S` sums of [`add_weighted_tile`] packed row by row, with which of the
/// sums read each row: in the loop over rows the general-purpose registers then hold a
/// handful of pointers, not every sum's mask and weights (which spilled to the stack).
struct Packed<const S: usize> {
    weights: [[f32; S]; 64],
    /// Bit `s` of row `j`'s: sum `s` reads it.
    readers: [u8; 64],
    /// The rows any of the sums reads.
    any: u64,
}

impl<const S: usize> Packed<S> {
    const EMPTY: Packed<S> = Packed {
        weights: [[0.0; S]; 64],
        readers: [0; 64],
        any: 0,
    };

    fn new(weights: &[f32], reads: &[u64], span: usize, first: usize) -> Packed<S> {
        let mut packed = Packed::EMPTY;
        let reads = &reads[first..first + S];
        for (j, (row, readers)) in packed
            .weights
            .iter_mut()
            .zip(&mut packed.readers)
            .enumerate()
            .take(span)
        {
            for (s, bits) in reads.iter().enumerate() {
                row[s] = weights[(first + s) * span + j];
                *readers |= ((bits >> j) as u8 & 1) << s;
            }
        }
        packed.any = reads.iter().fold(0, |any, bits| any | bits);
        packed
    }
}

/// Elements `at..at + 64` of sums `first..first + S` of [`add_weighted_tile`]. A row every
/// sum reads takes plain multiply-adds.
#[inline(always)]
unsafe fn sums_of_block<const S: usize>(
    sums: &mut [f32],
    len: usize,
    rows: &[&[f32]],
    first: usize,
    tile: &Packed<S>,
    at: usize,
) {
    debug_assert!(
        (first + S) * len <= sums.len(),
        "sums_of_block: sums past the end"
    );
    let every = (1u8 << S) - 1;
    let base = sums.as_mut_ptr();
    let sum_at = |s: usize, at: usize| base.wrapping_add((first + s) * len + at);
    // Lanes of each of the four registers that lie inside the sums.
    let lanes: [__mmask16; 4] = std::array::from_fn(|c| {
        let inside = len.saturating_sub(at + 16 * c).min(16);
        ((1u32 << inside) - 1) as __mmask16
    });
    let mut acc = [[_mm512_setzero_ps(); 4]; S];
    for (s, acc) in acc.iter_mut().enumerate() {
        for (c, acc) in acc.iter_mut().enumerate() {
            *acc = _mm512_maskz_loadu_ps(lanes[c], sum_at(s, at + 16 * c));
        }
    }
    let mut bits = tile.any;
    while bits != 0 {
        let j = bits.trailing_zeros() as usize;
        bits &= bits - 1;
        let row = rows[j].as_ptr();
        let chunk: [__m512; 4] =
            std::array::from_fn(|c| _mm512_maskz_loadu_ps(lanes[c], row.wrapping_add(at + 16 * c)));
        let (weights, readers) = (&tile.weights[j], tile.readers[j]);
        if readers == every {
            for (acc, &weight) in acc.iter_mut().zip(weights) {
                let weight = _mm512_set1_ps(weight);
                for (acc, chunk) in acc.iter_mut().zip(&chunk) {
                    *acc = _mm512_fmadd_ps(weight, *chunk, *acc);
                }
            }
        } else {
            for (s, (acc, &weight)) in acc.iter_mut().zip(weights).enumerate() {
                let reads_row = ((readers >> s) as u16 & 1).wrapping_neg();
                let weight = _mm512_set1_ps(weight);
                for (acc, chunk) in acc.iter_mut().zip(&chunk) {
                    *acc = _mm512_mask3_fmadd_ps(weight, *chunk, *acc, reads_row);
                }
            }
        }
    }
    for (s, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            _mm512_mask_storeu_ps(sum_at(s, at + 16 * c), lanes[c], *acc);
        }
    }
}

/// [`rows_on`] compiled for AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn rows<D: Pair>(view: &View<'_, D::Elem>, first: usize, x: &[f32], out: &mut [f32]) {
    rows_on::<D>(view, first, x, out)
}

/// [`rows_on`] compiled for AVX-512 with VBMI, its pairs decoded by [`Pair::pair_vbmi`].
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn rows_vbmi<D: Pair>(view: &View<'_, D::Elem>, first: usize, x: &[f32], out: &mut [f32]) {
    rows_on::<Vbmi<D>>(view, first, x, out)
}

/// `out[i] = row(first + i) · x`: four pairs of rows at a time, then one pair, then a last
/// row on the AVX2 kernel (every row there where the format does not run in pairs).
#[inline(always)]
unsafe fn rows_on<D: Pair>(view: &View<'_, D::Elem>, first: usize, x: &[f32], out: &mut [f32]) {
    let (data, cols, scaling) = (view.data, view.cols, view.scaling);
    let mut i = 0;
    if !D::ROWS_IN_PAIRS {
        return kernels::rows_into::<Avx2, OneRow<D>, true>(data, cols, scaling, first, x, out);
    }
    while i + 8 <= out.len() {
        let sums = dot_pairs::<D, 4, 1>(data, first + i, [x], cols, scaling);
        out[i..i + 8].copy_from_slice(sums.as_flattened().as_flattened());
        i += 8;
    }
    while i + 2 <= out.len() {
        let sums = dot_pairs::<D, 1, 1>(data, first + i, [x], cols, scaling);
        out[i..i + 2].copy_from_slice(sums.as_flattened().as_flattened());
        i += 2;
    }
    if i < out.len() {
        kernels::rows_into::<Avx2, OneRow<D>, true>(
            data,
            cols,
            scaling,
            first + i,
            x,
            &mut out[i..],
        );
    }
}

/// Floats between consecutive rows of the batched kernels' buffers: a row's floats and one
/// cache line more, so that rows a power of two apart do not all fall in the same sets of
/// the first-level cache (input pairs, and four whole decoded rows, are read side by side).
fn padded(floats: usize) -> usize {
    floats + 16
}

fn pair_stride(chunks: usize) -> usize {
    padded(chunks * 16)
}

/// `n` inputs laid out as pairs: pair `p` starts at `p * pair_stride(chunks)`, its chunk
/// `c` is 16 floats, input `2p`'s chunk `c` then input `2p + 1`'s (zeros past the last
/// column and for a missing last input). The pairs are laid out on the thread pool: the
/// product's blocks all wait for them.
fn interleave_pairs(input: &[f32], n: usize, cols: usize) -> Lines {
    let chunks = cols.div_ceil(8);
    let stride = pair_stride(chunks);
    let mut lines = Lines::zeroed(n.div_ceil(2) * stride);
    let pairs = lines.floats_mut();
    let lay_out = |(p, pair): (usize, &mut [f32])| {
        let inputs = input.chunks_exact(cols.max(1)).take(n);
        for (half, x) in inputs.skip(2 * p).take(2).enumerate() {
            for (c, values) in x.chunks(8).enumerate() {
                pair[c * 16 + half * 8..][..values.len()].copy_from_slice(values);
            }
        }
    };
    if pairs.len() >= 1 << 16 {
        pairs.par_chunks_mut(stride).enumerate().for_each(lay_out);
    } else {
        pairs.chunks_mut(stride).enumerate().for_each(lay_out);
    }
    lines
}

/// Chunk `c` of `R` decoded rows against `T` input pairs, `into[r][t] += w[r] * x[t]`,
/// row `r`'s chunk read at `chunk(r, c)`. A function, not a closure, so that it inherits
/// the caller's instruction set when inlined.
#[inline(always)]
unsafe fn pair_step<const R: usize, const T: usize>(
    chunk: impl Fn(usize, usize) -> *const f32,
    pairs: [&[f32]; T],
    c: usize,
    into: &mut [[Two; T]; R],
) {
    let mut xv = [Two::zero(); T];
    for t in 0..T {
        xv[t] = Two(_mm512_loadu_ps(pairs[t].as_ptr().add(c * 16)));
    }
    for (r, into) in into.iter_mut().enumerate() {
        let wv = Two::both(chunk(r, c));
        for t in 0..T {
            into[t] = Two::fma(wv, xv[t], into[t]);
        }
    }
}

/// `R` decoded rows (each `chunks * 8` floats, zero-padded) against `T` input pairs:
/// `R x T` accumulators, each half fed the multiply-adds `dot_tile` feeds its own.
#[inline(always)]
unsafe fn pair_tile<const R: usize, const T: usize>(
    decoded: [&[f32]; R],
    scale_row: usize,
    pairs: [&[f32]; T],
    chunks: usize,
    scaling: Scaling,
) -> [[[f32; 2]; T]; R] {
    let mut acc = [[Two::zero(); T]; R];
    let mut out = [[[0f32; 2]; T]; R];
    let decoded = |r: usize, c: usize| decoded[r].as_ptr().add(c * 8);
    match scaling {
        Scaling::None | Scaling::Row(_) => {
            for c in 0..chunks {
                pair_step(decoded, pairs, c, &mut acc);
            }
            for r in 0..R {
                for t in 0..T {
                    out[r][t] = acc[r][t].sums();
                    if let Scaling::Row(scales) = scaling {
                        out[r][t] = out[r][t].map(|s| s * scales[scale_row + r]);
                    }
                }
            }
        }
        _ => {
            let per_group = scaling.group_size().unwrap_or(8) / 8;
            let row_scales: [RowScales; R] =
                std::array::from_fn(|r| scaling.row_scales(scale_row + r));
            let mut group = 0;
            let mut c = 0;
            while c < chunks {
                let end = (c + per_group).min(chunks);
                let mut partial = [[Two::zero(); T]; R];
                while c < end {
                    pair_step(decoded, pairs, c, &mut partial);
                    c += 1;
                }
                for r in 0..R {
                    let scale = _mm512_set1_ps(row_scales[r].at(group));
                    for t in 0..T {
                        acc[r][t] = Two::fma(partial[r][t], Two(scale), acc[r][t]);
                    }
                }
                group += 1;
            }
            for r in 0..R {
                for t in 0..T {
                    out[r][t] = acc[r][t].sums();
                }
            }
        }
    }
    out
}

/// Where [`decode_rows`] puts chunk `c` of row `k` of its span: at `k * row + c * chunk`.
#[derive(Clone, Copy)]
struct Layout {
    row: usize,
    chunk: usize,
}

/// Rows in a block of [`blocked_rows`].
const BLOCK_ROWS: usize = 8;
/// How [`blocked_rows`] lays out a decoded block, chunk by chunk: chunk `c` of row `k` at
/// `c * 64 + k * 8`, so the tile reads every row's chunk at a constant offset from one
/// pointer. Eight rows a padded row apart took one more load a multiply-add (the compiler
/// kept the stride on the stack), and the loads, not the multiply-adds, bound the loop.
const INTERLEAVED: Layout = Layout {
    row: 8,
    chunk: BLOCK_ROWS * 8,
};

/// Chunks `span` of rows `first..first + count` of `view` decoded into `scratch` as `at`
/// lays them out (`span.len() * 8` floats a row, zero-padded past the last column): two
/// chunks of a row per register (the pair decoder given the row and the row one chunk on),
/// a last odd chunk alone.
#[inline(always)]
unsafe fn decode_rows<D: Pair>(
    view: &View<'_, D::Elem>,
    (first, count): (usize, usize),
    span: Range<usize>,
    at: Layout,
    scratch: &mut [f32],
) {
    let (data, cols) = (view.data, view.cols);
    let full = cols / 8;
    let whole = span.end.min(full);
    assert!(
        span.is_empty()
            || count == 0
            || (count - 1) * at.row + (span.len() - 1) * at.chunk + 8 <= scratch.len(),
        "the decoded chunks fit the scratch"
    );
    let base = scratch.as_mut_ptr();
    for k in 0..count {
        let row = row_of::<D>(data, cols, first + k);
        let chunk = |c: usize| base.add(k * at.row + (c - span.start) * at.chunk);
        let next = &row[D::stride(8).min(row.len())..];
        let mut c = span.start;
        while c + 2 <= whole {
            let two = D::pair(row, next, c).0;
            if at.chunk == 8 {
                _mm512_storeu_ps(chunk(c), two);
            } else {
                _mm256_storeu_ps(chunk(c), _mm512_castps512_ps256(two));
                _mm256_storeu_ps(chunk(c + 1), _mm512_extractf32x8_ps::<1>(two));
            }
            c += 2;
        }
        if c < whole {
            D::chunk(row, c).store(chunk(c));
            c += 1;
        }
        if c < span.end {
            // The chunk the row ends inside.
            for j in 0..8 {
                let column = c * 8 + j;
                let value = if column < cols {
                    D::value(row, column)
                } else {
                    0.0
                };
                *chunk(c).add(j) = value;
            }
        }
    }
}

/// Asks for chunks `span` of the [`BLOCK_ROWS`] rows from `first` on to be brought into the
/// second-level cache: the next column block, while the tiles run on this one. Eight rows
/// read a block's 512 bytes each and then jump a whole row on, which the hardware's
/// prefetchers do not follow in time: without the requests, about a tenth of the kernel's
/// samples fell on the decoding's loads.
#[inline(always)]
unsafe fn prefetch_rows<D: Pair>(view: &View<'_, D::Elem>, first: usize, span: Range<usize>) {
    let (from, to) = (span.start * D::CHUNK_BYTES, span.end * D::CHUNK_BYTES);
    for k in 0..BLOCK_ROWS {
        let row = row_of::<D>(view.data, view.cols, first + k).as_ptr() as *const u8;
        for line in (from..to).step_by(64) {
            Avx2::prefetch(row.wrapping_add(line));
        }
    }
}

/// Chunks per column block of [`blocked_rows`]: eight rows of 512 columns, decoded (16
/// KiB), stay in the first-level cache while every input pair's share streams past them.
const COLUMN_BLOCK: usize = 64;

/// The column blocks of [`blocked_rows`] under `scaling`: chunks per block (about
/// [`COLUMN_BLOCK`], a whole number of groups where there are group scales, so that no
/// group straddles two blocks).
fn column_block(scaling: Scaling) -> usize {
    scaling.group_size().map_or(COLUMN_BLOCK, |size| {
        (COLUMN_BLOCK / (size / 8)).max(1) * (size / 8)
    })
}

/// Chunks `from..to` of `R` rows of a decoded block (laid out [`INTERLEAVED`] from chunk
/// `from`; the rows from `rows` on) against input pairs `p..p + T`, continuing the
/// accumulators `acc[(p + t) * 8 + row + r]` (from zero in the first block, `from == 0`). With `groups` (chunks per group, each row's
/// scales), each group's products go into a partial sum of their own, folded in at its
/// scale as [`pair_tile`] folds them.
#[inline(always)]
unsafe fn block_step<const R: usize, const T: usize>(
    (block, rows): (&[f32], usize),
    (pairs, chunks, p): (&[f32], usize, usize),
    (from, to): (usize, usize),
    groups: Option<(usize, [RowScales; R])>,
    (acc, row): (&mut [Two], usize),
) {
    assert!(rows + R <= BLOCK_ROWS && (to - from) * INTERLEAVED.chunk <= block.len());
    let first = block.as_ptr().add(rows * INTERLEAVED.row);
    let decoded = |r: usize, c: usize| first.add(r * INTERLEAVED.row + c * INTERLEAVED.chunk);
    let mut tile = [[Two::zero(); T]; R];
    let mut xs = [&pairs[..0]; T];
    for t in 0..T {
        xs[t] = &pairs[(p + t) * pair_stride(chunks) + from * 16..][..(to - from) * 16];
        if from > 0 {
            for r in 0..R {
                tile[r][t] = acc[(p + t) * 8 + row + r];
            }
        }
    }
    match groups {
        None => {
            for c in 0..to - from {
                pair_step(decoded, xs, c, &mut tile);
            }
        }
        Some((per_group, row_scales)) => {
            let mut c = 0;
            while c < to - from {
                let group = (from + c) / per_group;
                let end = (c + per_group).min(to - from);
                let mut partial = [[Two::zero(); T]; R];
                while c < end {
                    pair_step(decoded, xs, c, &mut partial);
                    c += 1;
                }
                for r in 0..R {
                    let scale = Two(_mm512_set1_ps(row_scales[r].at(group)));
                    for t in 0..T {
                        tile[r][t] = Two::fma(partial[r][t], scale, tile[r][t]);
                    }
                }
            }
        }
    }
    for t in 0..T {
        for r in 0..R {
            acc[(p + t) * 8 + row + r] = tile[r][t];
        }
    }
}

/// Rows `first..first + 8` of `view` against every input pair: each column block
/// ([`column_block`]) decoded into `scratch`, where it stays in the first-level cache
/// (decoding whole rows wrote them out to the second-level cache, and those writes cost a
/// quarter of the kernel's time), then run in tiles against three pairs, each accumulator
/// carried from block to block, so every lane is fed its chunks in order and the bits are
/// [`pair_tile`]'s. Without group scales a tile is all eight rows (24 accumulators); with
/// them, a partial sum beside each accumulator, four rows and then the other four against
/// the same pairs, which the first four brought into the first-level cache (four rows
/// alone read the pairs from the second-level cache twice as often). Leaves row `r`
/// against pair `p` in `acc[p * 8 + r]` (`pair_count * 8` accumulators).
#[inline(always)]
unsafe fn blocked_rows<D: Pair>(
    view: &View<'_, D::Elem>,
    first: usize,
    (pairs, pair_count): (&[f32], usize),
    scratch: &mut [f32],
    acc: &mut [Two],
) {
    let chunks = view.cols.div_ceil(8);
    if chunks == 0 {
        // No column block starts them from zero.
        acc.fill(Two::zero());
    }
    let per_group = view.scaling.group_size().map(|size| size / 8);
    let scales_from = |row: usize| std::array::from_fn(|r| view.scaling.row_scales(row + r));
    let halves = per_group.map(|g| [(g, scales_from(first)), (g, scales_from(first + 4))]);
    let block = column_block(view.scaling);
    let mut from = 0;
    while from < chunks {
        let span = (from, (from + block).min(chunks));
        decode_rows::<D>(
            view,
            (first, BLOCK_ROWS),
            from..span.1,
            INTERLEAVED,
            scratch,
        );
        prefetch_rows::<D>(view, first, span.1..(span.1 + block).min(chunks));
        let decoded = &scratch[..(span.1 - from) * INTERLEAVED.chunk];
        let half = |h: usize| (decoded, 4 * h);
        let mut p = 0;
        while p < pair_count {
            let take = (pair_count - p).min(3);
            let at = (pairs, chunks, p);
            match (halves, take) {
                (None, 3) => block_step::<8, 3>((decoded, 0), at, span, None, (acc, 0)),
                (None, 2) => block_step::<8, 2>((decoded, 0), at, span, None, (acc, 0)),
                (None, _) => block_step::<8, 1>((decoded, 0), at, span, None, (acc, 0)),
                (Some(groups), take) => {
                    for (h, groups) in groups.into_iter().enumerate() {
                        let into = (&mut *acc, 4 * h);
                        match take {
                            3 => block_step::<4, 3>(half(h), at, span, Some(groups), into),
                            2 => block_step::<4, 2>(half(h), at, span, Some(groups), into),
                            _ => block_step::<4, 1>(half(h), at, span, Some(groups), into),
                        }
                    }
                }
            }
            p += take;
        }
        from = span.1;
    }
}

/// Rows `first..first + count` against every one of the `n` inputs (`pairs`, as
/// [`interleave_pairs`] lays them out), written as `out[t * count + row - first]`: each block
/// of rows decoded to f32 (exact), then run against the inputs two per register: eight
/// rows at a time ([`blocked_rows`]); the rows left over, and formats without group scales
/// against fewer than three pairs, four rows or one, decoded whole ([`pair_tile`]).
///
/// The input pairs go in groups of about [`GROUP_BYTES`] (at least [`GROUP_PAIRS`]), each
/// group against all the rows before the next: a long prompt's inputs (4 MiB for 512 rows
/// of 2048 columns) would otherwise stream from memory again for every block of eight
/// rows. Every accumulator belongs to one pair, and [`blocked_rows`] and [`pair_tile`] (a
/// last group of fewer than three pairs) give the same bits, so the grouping leaves the
/// bits as they are.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn batched<D: Pair>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    pairs: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let chunks = view.cols.div_ceil(8);
    let per_group = (GROUP_BYTES / (4 * pair_stride(chunks))).max(GROUP_PAIRS) / 3 * 3;
    let pair_count = n.div_ceil(2);
    let mut from = 0;
    while from < pair_count {
        let to = (from + per_group).min(pair_count);
        pair_group::<D>(view, first, count, pairs, n, from..to, out);
        from = to;
    }
}

/// Whether `n` inputs take [`few_inputs_rows_on`] ([`kernels::few_inputs`]); a format decoded
/// two rows at a time, whose decoding costs several multiply-adds even so, only where one
/// tile holds every input.
fn few_inputs<D: Pair>(n: usize, scaling: Scaling) -> bool {
    if D::ROWS_IN_PAIRS {
        n <= PAIR_TILE_INPUTS
    } else {
        kernels::few_inputs(n, scaling, false, true)
    }
}

/// Inputs in one tile of [`few_inputs_rows_on`] for the formats decoded two rows at a time.
const PAIR_TILE_INPUTS: usize = 4;

/// A few inputs against rows `first..first + count`, no rows decoded to memory and no
/// inputs laid out in pairs: with the row kernel's decoding ([`kernels::rows_few_inputs`]),
/// or for the formats decoded two rows at a time ([`Pair::ROWS_IN_PAIRS`]) with each chunk
/// of four rows decoded as two pairs for all the inputs at once (a lone last row on the row
/// kernel).
#[inline(always)]
unsafe fn few_inputs_rows_on<D: Pair>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    let (data, cols, scaling) = (view.data, view.cols, view.scaling);
    if !D::ROWS_IN_PAIRS {
        return kernels::rows_few_inputs::<Avx2, OneRow<D>, true>(
            data, cols, scaling, first, count, input, n, out,
        );
    }
    let mut i = 0;
    while i + 2 <= count {
        let four = count - i >= 4;
        let mut t = 0;
        while t < n {
            let take = kernels::inputs_in_tile(n - t, PAIR_TILE_INPUTS);
            let tile = PairTile {
                view,
                first: first + i,
                input,
                t,
            };
            let into = (&mut *out, count, i);
            match (four, take) {
                (true, 4) => tile.run::<D, 2, 4>(into),
                (true, 3) => tile.run::<D, 2, 3>(into),
                (true, _) => tile.run::<D, 2, 2>(into),
                (false, 4) => tile.run::<D, 1, 4>(into),
                (false, 3) => tile.run::<D, 1, 3>(into),
                (false, _) => tile.run::<D, 1, 2>(into),
            }
            t += take;
        }
        i += if four { 4 } else { 2 };
    }
    if i < count {
        let mut lone = [0f32; PAIR_TILE_INPUTS];
        kernels::rows_few_inputs::<Avx2, OneRow<D>, true>(
            data,
            cols,
            scaling,
            first + i,
            1,
            input,
            n,
            &mut lone[..n],
        );
        for (t, &sum) in lone[..n].iter().enumerate() {
            out[t * count + i] = sum;
        }
    }
}

/// [`few_inputs_rows_on`] compiled for AVX-512.
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")]
unsafe fn few_inputs_rows<D: Pair>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    few_inputs_rows_on::<D>(view, first, count, input, n, out)
}

/// [`few_inputs_rows_on`] compiled for AVX-512 with VBMI, its pairs decoded by
/// [`Pair::pair_vbmi`].
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma,f16c")]
unsafe fn few_inputs_rows_vbmi<D: Pair>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    input: &[f32],
    n: usize,
    out: &mut [f32],
) {
    few_inputs_rows_on::<Vbmi<D>>(view, first, count, input, n, out)
}

/// `P` pairs of rows from `first` against the inputs from `t`, for [`few_inputs_rows_on`].
struct PairTile<'a, 'v, E> {
    view: &'a View<'v, E>,
    first: usize,
    input: &'a [f32],
    t: usize,
}

impl<E> PairTile<'_, '_, E> {
    /// Writes row `first + k` against input `t + u` into `out[(t + u) * count + i + k]`.
    #[inline(always)]
    unsafe fn run<D: Pair<Elem = E>, const P: usize, const T: usize>(
        &self,
        (out, count, i): (&mut [f32], usize, usize),
    ) {
        let cols = self.view.cols;
        let xs: [&[f32]; T] = std::array::from_fn(|u| &self.input[(self.t + u) * cols..][..cols]);
        let sums = dot_pairs::<D, P, T>(self.view.data, self.first, xs, cols, self.view.scaling);
        for (p, pair) in sums.iter().enumerate() {
            for (u, halves) in pair.iter().enumerate() {
                for (h, &sum) in halves.iter().enumerate() {
                    out[(self.t + u) * count + i + 2 * p + h] = sum;
                }
            }
        }
    }
}

/// Bytes of interleaved inputs [`batched`] runs against all of its rows at a time: within
/// a second-level cache of 1 MiB, and enough for the 64 inputs of 2048 columns an expert
/// gets from a 512-token prompt in one group.
const GROUP_BYTES: usize = 640 << 10;

/// Input pairs in a group of [`batched`] however wide the rows. Every group reads and
/// decodes the whole matrix again, so in groups of three pairs (what [`GROUP_BYTES`] gives
/// GLM-5.2's attention output, 16,384 columns) a wide matrix streams from memory and is
/// decoded once for every six inputs: its int8 form ran 66-76 G multiply-adds/s on two
/// threads against 1,024 inputs, 101-107 in groups of nine (int4 in groups: 62-70, 82-87).
/// Nine pairs of 16,384 columns take 1.1 MiB, within the 2 MiB second-level cache a core of
/// the Xeon this was measured on (a 1 MiB one holds them up to about 14,500 columns).
/// A multiple of three: [`pair_group`] runs the pairs three at a time.
const GROUP_PAIRS: usize = 9;
const _: () = assert!(GROUP_PAIRS.is_multiple_of(3));

/// [`batched`] for the input pairs `group`.
#[inline(always)]
unsafe fn pair_group<D: Pair>(
    view: &View<'_, D::Elem>,
    first: usize,
    count: usize,
    pairs: &[f32],
    n: usize,
    group: Range<usize>,
    out: &mut [f32],
) {
    let (cols, scaling) = (view.cols, view.scaling);
    let chunks = cols.div_ceil(8);
    let width = chunks * 8;
    let pair = |p: usize| &pairs[p * pair_stride(chunks)..][..chunks * 16];
    let pair_count = group.len();
    // Without group scales, eight rows need three input pairs to beat four rows by three
    // pairs; with them, blocks of eight rows run as two halves of four at any count.
    let blocked = match scaling.group_size() {
        None if pair_count < 3 => 0,
        _ => 8,
    };
    let decoded_block = column_block(scaling) * INTERLEAVED.chunk;
    let mut lines = Lines::zeroed(decoded_block.max(4 * padded(width)));
    let scratch = lines.floats_mut();
    let mut acc = vec![Two::zero(); pair_count * blocked];
    let mut i = 0;
    while i < count {
        let block = if blocked > 0 && count - i >= blocked {
            blocked
        } else {
            (count - i).min(4)
        };
        let r = first + i;
        let mut put = |k: usize, p: usize, sums: [f32; 2]| {
            for (h, s) in sums.into_iter().enumerate() {
                if 2 * p + h < n {
                    out[(2 * p + h) * count + i + k] = s;
                }
            }
        };
        if block == blocked {
            let group_pairs = (&pairs[group.start * pair_stride(chunks)..], pair_count);
            blocked_rows::<D>(view, r, group_pairs, scratch, &mut acc);
            for p in 0..pair_count {
                for k in 0..blocked {
                    let mut sums = acc[p * blocked + k].sums();
                    if let Scaling::Row(scales) = scaling {
                        sums = sums.map(|s| s * scales[r + k]);
                    }
                    put(k, group.start + p, sums);
                }
            }
            i += block;
            continue;
        }
        let whole_rows = Layout {
            row: padded(width),
            chunk: 8,
        };
        decode_rows::<D>(view, (r, block), 0..chunks, whole_rows, scratch);
        let decoded = |k: usize| &scratch[k * padded(width)..][..width];
        let mut p = group.start;
        while p < group.end {
            let take = (group.end - p).min(3);
            if block == 4 {
                let rows = [decoded(0), decoded(1), decoded(2), decoded(3)];
                match take {
                    3 => {
                        let xs = [pair(p), pair(p + 1), pair(p + 2)];
                        let sums = pair_tile::<4, 3>(rows, r, xs, chunks, scaling);
                        for (k, row) in sums.iter().enumerate() {
                            row.iter().enumerate().for_each(|(t, &s)| put(k, p + t, s));
                        }
                    }
                    2 => {
                        let sums =
                            pair_tile::<4, 2>(rows, r, [pair(p), pair(p + 1)], chunks, scaling);
                        for (k, row) in sums.iter().enumerate() {
                            row.iter().enumerate().for_each(|(t, &s)| put(k, p + t, s));
                        }
                    }
                    _ => {
                        let sums = pair_tile::<4, 1>(rows, r, [pair(p)], chunks, scaling);
                        for (k, row) in sums.iter().enumerate() {
                            put(k, p, row[0]);
                        }
                    }
                }
            } else {
                for k in 0..block {
                    for u in p..p + take {
                        let sums =
                            pair_tile::<1, 1>([decoded(k)], r + k, [pair(u)], chunks, scaling);
                        put(k, u, sums[0][0]);
                    }
                }
            }
            p += take;
        }
        i += block;
    }
}

/// One product's blocks on AVX-512: for a batch, its inputs interleaved in pairs once,
/// before the blocks, and shared by them all.
pub(super) struct Avx512Block<'a, D: Pair> {
    view: View<'a, D::Elem>,
    pairs: Lines,
}

impl<'a, D: Pair> Avx512Block<'a, D> {
    /// The blocks of one input row at a time.
    pub(super) fn new(view: View<'a, D::Elem>) -> Self {
        Avx512Block {
            view,
            pairs: Lines::zeroed(0),
        }
    }

    /// The blocks of a product of `n` inputs (`n x cols`).
    pub(super) fn batch(view: View<'a, D::Elem>, input: &[f32], n: usize) -> Self {
        let pairs = if !few_inputs::<D>(n, view.scaling) {
            interleave_pairs(input, n, view.cols)
        } else {
            Lines::zeroed(0)
        };
        Avx512Block { view, pairs }
    }
}

impl<D: Pair> Block for Avx512Block<'_, D> {
    fn rows(&self, first: usize, x: &[f32], out: &mut [f32]) {
        // SAFETY: an Avx512Block is built only when `Isa::detect` found AVX-512 F/BW/DQ/VL,
        // AVX2, FMA and F16C; `with_vbmi` checks for VBMI.
        unsafe {
            if with_vbmi::<D>() {
                rows_vbmi::<D>(&self.view, first, x, out)
            } else {
                rows::<D>(&self.view, first, x, out)
            }
        }
    }
    fn batched(&self, first: usize, count: usize, input: &[f32], n: usize, out: &mut [f32]) {
        let chunks = self.view.cols.div_ceil(8);
        assert_eq!(input.len(), n * self.view.cols, "matmul input shape");
        if few_inputs::<D>(n, self.view.scaling) {
            // SAFETY: as `rows`.
            return unsafe {
                if with_vbmi::<D>() {
                    few_inputs_rows_vbmi::<D>(&self.view, first, count, input, n, out)
                } else {
                    few_inputs_rows::<D>(&self.view, first, count, input, n, out)
                }
            };
        }
        assert_eq!(
            self.pairs.floats().len(),
            n.div_ceil(2) * pair_stride(chunks),
            "the pairs Avx512Block::batch laid out for these inputs"
        );
        // SAFETY: as above.
        unsafe { batched::<D>(&self.view, first, count, self.pairs.floats(), n, out) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kernels::Isa;

    /// FP8 rows against one input and against a few, with the VBMI decoder and without,
    /// against each input alone on the scalar kernel, bit for bit: on a CPU with VBMI the
    /// product tests reach only the first.
    #[test]
    fn e4m3_kernels_with_and_without_vbmi_match_the_scalar_reference() {
        if !Isa::Avx512.supported() || !with_vbmi::<E4m3Codes>() {
            eprintln!("skipped: this CPU has no AVX-512 VBMI");
            return;
        }
        // 139 rows (two FP8 block rows, pairs of four rows and a lone last one) by 300
        // columns (a partial block and chunk); magnitudes down to E4M3's subnormals.
        let (count, cols) = (139, 300);
        let spread = |i: usize, seed: usize| {
            let v = ((i * 2_654_435_761 + seed) % 2001) as f32 / 1000.0 - 1.0;
            v * if i.is_multiple_of(7) { 1e-4 } else { 1.0 }
        };
        let weights: Vec<f32> = (0..count * cols).map(|i| spread(i, 0)).collect();
        let (codes, scales) = codec::quantize_fp8_blocks(&weights, cols);
        let view = View {
            data: &codes[..],
            rows: count,
            cols,
            scaling: Scaling::Groups {
                size: 128,
                scales: &scales,
                per_row: cols.div_ceil(128),
                row_div: 128,
            },
        };
        for n in 1..=PAIR_TILE_INPUTS {
            let x: Vec<f32> = (0..n * cols).map(|i| spread(i, 17 * n)).collect();
            let mut reference = vec![0f32; n * count];
            for (input, out) in x.chunks_exact(cols).zip(reference.chunks_exact_mut(count)) {
                kernels::matmul::<E4m3Codes>(Isa::Scalar, view, input, 1, out);
            }
            let (mut plain, mut vbmi) = (vec![0f32; n * count], vec![0f32; n * count]);
            // SAFETY: AVX-512 and VBMI checked above; the outputs hold `n * count` sums.
            unsafe {
                if n == 1 {
                    rows::<E4m3Codes>(&view, 0, &x, &mut plain);
                    rows_vbmi::<E4m3Codes>(&view, 0, &x, &mut vbmi);
                } else {
                    few_inputs_rows::<E4m3Codes>(&view, 0, count, &x, n, &mut plain);
                    few_inputs_rows_vbmi::<E4m3Codes>(&view, 0, count, &x, n, &mut vbmi);
                }
            }
            for (kernel, got) in [("without VBMI", &plain), ("with VBMI", &vbmi)] {
                for (k, (a, b)) in reference.iter().zip(got.iter()).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{kernel}, {n} inputs, element {k}"
                    );
                }
            }
        }
    }

    /// Every byte 0-255 as two rows of 128 codes: `low` the first half, `high` the second.
    fn every_byte() -> (Vec<u8>, Vec<u8>) {
        let bytes: Vec<u8> = (0..=255).collect();
        (bytes[..128].to_vec(), bytes[128..].to_vec())
    }

    /// Each chunk of `D::pair`, of `D::quad`, of `D::row_chunk` and (where the CPU has
    /// VBMI) of `D::pair_vbmi` and `D::quad_vbmi` over every byte, against `D::value` bit
    /// for bit (NaN for NaN).
    fn decodes_as_the_scalar_code<D: Pair<Elem = u8>>(elements_per_byte: usize) {
        if !Isa::Avx512.supported() {
            eprintln!("skipped: this CPU has no AVX-512");
            return;
        }
        let (low, high) = every_byte();
        let lanes_of = |two: Two| {
            let mut lanes = [0f32; 16];
            // SAFETY: AVX-512 checked above.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), two.0) };
            lanes
        };
        let chunks = 128 * elements_per_byte / 8;
        for c in 0..chunks {
            let mut decoded = Vec::new();
            let quad = c - c % 4;
            // SAFETY: AVX-512 checked above, and VBMI by `with_vbmi`; chunk `c`, and the
            // quad of chunks it is in, lie within both rows.
            let one_row = unsafe {
                decoded.push(("pair", lanes_of(D::pair(&low, &high, c))));
                if quad + 4 <= chunks {
                    let four = D::quad(&low, &high, quad);
                    decoded.push(("quad", lanes_of(four[c % 4])));
                }
                if with_vbmi::<D>() {
                    decoded.push(("pair_vbmi", lanes_of(D::pair_vbmi(&low, &high, c))));
                    if quad + 4 <= chunks {
                        let four = D::quad_vbmi(&low, &high, quad);
                        decoded.push(("quad_vbmi", lanes_of(four[c % 4])));
                    }
                }
                decode_as_rows::<D>(&low, &high, c)
            };
            decoded.push(("row_chunk", one_row));
            for (kernel, lanes) in decoded {
                for (lane, got) in lanes.into_iter().enumerate() {
                    let row = if lane < 8 { &low } else { &high };
                    let want = D::value(row, 8 * c + lane % 8);
                    assert!(
                        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                        "{kernel}: chunk {c} lane {lane}: {got} ({:#x}) against {want}",
                        got.to_bits()
                    );
                }
            }
        }
    }

    /// Chunk `c` of `low` and of `high` by `D::row_chunk`, in a pair's lane order.
    #[target_feature(enable = "avx512f,avx512vl,avx2")]
    unsafe fn decode_as_rows<D: Pair<Elem = u8>>(low: &[u8], high: &[u8], c: usize) -> [f32; 16] {
        let mut lanes = [0f32; 16];
        D::row_chunk(low, c).store(lanes.as_mut_ptr());
        D::row_chunk(high, c).store(lanes.as_mut_ptr().add(8));
        lanes
    }

    #[test]
    fn every_int4_code_decodes_as_the_scalar_code() {
        decodes_as_the_scalar_code::<Int4Codes>(2);
    }

    #[test]
    fn every_e2m1_code_decodes_as_the_scalar_code() {
        decodes_as_the_scalar_code::<E2m1Codes>(2);
    }

    #[test]
    fn every_e4m3_code_decodes_as_the_scalar_code() {
        decodes_as_the_scalar_code::<E4m3Codes>(1);
    }
}
