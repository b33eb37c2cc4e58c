//! The element encodings of every format, as scalar code: the quantisers (float -> codes and
//! scales, as colibri's converters compute them) and the exact decoders (code -> value) that
//! both the reference kernels and the SIMD tails use.
//!
//! Every quantiser is symmetric with no zero point and rounds half to even (`np.rint`,
//! `lrintf`, `torch.round`). A decoded value never includes its scale: kernels accumulate
//! `Σ value·x` per row or per group and apply the scale afterwards, so the value tables
//! below are exactly what the integer or minifloat code means.

/// The floor under a computed scale, so an all-zero row or group quantises to zeros.
const MIN_SCALE: f32 = 1e-12;

/// The magnitudes of an e2m1 (FP4) code doubled, so that they are integers: codes 0..7 are
/// `{0, .5, 1, 1.5, 2, 3, 4, 6}`, codes 8..15 the same negated (bit 3 is the sign). The ½
/// goes into the group scale, which is a power of two, so no rounding changes.
pub const E2M1_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Symmetric per-row int8: `scale = max|row| / 127`, values rounded half to even and clamped
/// to `[-128, 127]`, as the reference converters do.
pub fn quantize_int8_rows(values: &[f32], cols: usize) -> (Vec<i8>, Vec<f32>) {
    let rows = values.len() / cols.max(1);
    let mut quantised = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(rows);
    for row in values.chunks_exact(cols) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = (max / 127.0).max(MIN_SCALE);
        scales.push(scale);
        quantised.extend(
            row.iter()
                .map(|v| (v / scale).round_ties_even().clamp(-128.0, 127.0) as i8),
        );
    }
    (quantised, scales)
}

/// Symmetric int4 in groups of `group` columns (`group >= cols` is one scale per row):
/// `scale = max|group| / 7`, `q = rint(w / scale)` clamped to `[-8, 7]` and stored as the
/// nibble `q + 8`; byte `k` of a row holds element `2k` in its low nibble and `2k + 1` in
/// its high nibble, and an odd row ends in a padding nibble 8 (zero). Returns the packed
/// rows (`ceil(cols / 2)` bytes each) and the row-major `[rows][ceil(cols / group)]` scales.
pub fn quantize_int4_groups(values: &[f32], cols: usize, group: usize) -> (Vec<u8>, Vec<f32>) {
    let group = group.clamp(1, cols.max(1));
    let row_bytes = cols.div_ceil(2);
    let rows = values.len() / cols.max(1);
    let mut packed = vec![0x88u8; rows * row_bytes];
    let mut scales = Vec::with_capacity(rows * cols.div_ceil(group));
    for (row, out) in values
        .chunks_exact(cols)
        .zip(packed.chunks_exact_mut(row_bytes))
    {
        for (g, chunk) in row.chunks(group).enumerate() {
            let max = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = (max / 7.0).max(MIN_SCALE);
            scales.push(scale);
            for (offset, v) in chunk.iter().enumerate() {
                let i = g * group + offset;
                let nibble = ((v / scale).round_ties_even().clamp(-8.0, 7.0) as i32 + 8) as u8;
                let byte = &mut out[i / 2];
                *byte = if i.is_multiple_of(2) {
                    (*byte & 0xF0) | nibble
                } else {
                    (*byte & 0x0F) | (nibble << 4)
                };
            }
        }
    }
    (packed, scales)
}

/// Element `i` of a packed int4 row, `nibble - 8`.
#[inline(always)]
pub fn int4_value(row: &[u8], i: usize) -> f32 {
    let byte = row[i / 2];
    let nibble = if i.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    };
    f32::from(nibble) - 8.0
}

/// The value of an FP8 E4M3 (`e4m3fn`) byte: 1 sign bit, 4 exponent bits with bias 7, 3
/// mantissa bits; exponent 0 is subnormal; `0x7F`/`0xFF` are NaN (the quiet NaN with the
/// code's sign) and there is no infinity.
pub const fn e4m3_to_f32(byte: u8) -> f32 {
    let magnitude = byte & 0x7F;
    let bits = if magnitude == 0x7F {
        f32::NAN.to_bits()
    } else if magnitude < 0x08 {
        // Subnormal: the mantissa times 2^-9, exact in f32.
        (magnitude as f32 / 512.0).to_bits()
    } else {
        // The exponent and mantissa bits in an f32's, the bias 7 raised to 127.
        ((magnitude as u32) << 20) + (120 << 23)
    };
    f32::from_bits(bits | ((byte as u32 & 0x80) << 24))
}

/// Every E4M3 byte decoded, for table lookups.
pub fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

/// The E4M3 byte nearest to `value` (ties to the even code), saturating at ±448; NaN
/// encodes as `0x7F`.
pub fn f32_to_e4m3(value: f32) -> u8 {
    if value.is_nan() {
        return 0x7F;
    }
    let sign = if value.is_sign_negative() { 0x80 } else { 0 };
    let magnitude = value.abs();
    // Non-negative codes 0x00..=0x7E increase monotonically with their value.
    let table = &e4m3_table()[..0x7F];
    let above = table.partition_point(|&v| v < magnitude);
    let code = if above == 0 {
        0
    } else if above == table.len() {
        0x7E
    } else {
        let (low, high) = (above - 1, above);
        let (d_low, d_high) = (magnitude - table[low], table[high] - magnitude);
        if d_low < d_high || (d_low == d_high && low.is_multiple_of(2)) {
            low
        } else {
            high
        }
    };
    sign | code as u8
}

/// FP8 with one f32 scale per 128x128 block (`weight = e4m3 · scale`, the published
/// `weight_scale_inv` convention): `scale = max|block| / 448`. Returns the codes and the
/// row-major `[ceil(rows/128)][ceil(cols/128)]` scales.
pub fn quantize_fp8_blocks(values: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let rows = values.len() / cols.max(1);
    let (block_rows, block_cols) = (rows.div_ceil(128), cols.div_ceil(128));
    let mut scales = vec![0f32; block_rows * block_cols];
    for (r, row) in values.chunks_exact(cols).enumerate() {
        for (c, chunk) in row.chunks(128).enumerate() {
            let max = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let slot = &mut scales[(r / 128) * block_cols + c];
            *slot = slot.max(max);
        }
    }
    for scale in scales.iter_mut() {
        *scale = (*scale / 448.0).max(MIN_SCALE);
    }
    let codes = values
        .chunks_exact(cols)
        .enumerate()
        .flat_map(|(r, row)| {
            let scales = &scales;
            row.iter()
                .enumerate()
                .map(move |(i, v)| f32_to_e4m3(v / scales[(r / 128) * block_cols + i / 128]))
        })
        .collect();
    (codes, scales)
}

/// An E8M0 scale byte as colibri decodes it: `2^(s - 127)` built from the float bits, so
/// `s = 0` is +0 and `s = 255` is +inf (published checkpoints hold neither).
#[inline(always)]
pub fn e8m0_to_f32(scale: u8) -> f32 {
    f32::from_bits(u32::from(scale) << 23)
}

/// The scale a kernel applies to a group of doubled e2m1 values: `2^(s - 127) / 2`.
#[inline(always)]
pub fn mxfp4_group_scale(scale: u8) -> f32 {
    e8m0_to_f32(scale) * 0.5
}

/// Element `i` of an MXFP4 row as its doubled e2m1 value (low nibble = even element).
#[inline(always)]
pub fn e2m1_doubled_value(row: &[u8], i: usize) -> f32 {
    let byte = row[i / 2];
    let code = if i.is_multiple_of(2) {
        byte & 0x0F
    } else {
        byte >> 4
    };
    f32::from(E2M1_DOUBLED[code as usize])
}

/// OCP MX FP4 in groups of 32 columns: the shared exponent is `floor(log2(max|group|)) - 2`
/// (so the largest magnitude lands in `[4, 8)`, the top binade of e2m1), stored biased by
/// 127; each element rounds to the nearest e2m1 value (ties to the even code) and
/// saturates at ±6. Returns packed rows (`ceil(cols/2)` bytes) and `[rows][ceil(cols/32)]`
/// scale bytes.
pub fn quantize_mxfp4(values: &[f32], cols: usize) -> (Vec<u8>, Vec<u8>) {
    let row_bytes = cols.div_ceil(2);
    let rows = values.len() / cols.max(1);
    let mut packed = vec![0u8; rows * row_bytes];
    let mut scales = Vec::with_capacity(rows * cols.div_ceil(32));
    for (row, out) in values
        .chunks_exact(cols)
        .zip(packed.chunks_exact_mut(row_bytes))
    {
        for (g, chunk) in row.chunks(32).enumerate() {
            let max = chunk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let exponent = if max > 0.0 {
                (max.log2().floor() as i32 - 2).clamp(-126, 127)
            } else {
                -126
            };
            scales.push((exponent + 127) as u8);
            let scale = 2f32.powi(exponent);
            for (offset, v) in chunk.iter().enumerate() {
                let i = g * 32 + offset;
                let code = nearest_e2m1(v / scale);
                out[i / 2] |= if i.is_multiple_of(2) { code } else { code << 4 };
            }
        }
    }
    (packed, scales)
}

fn nearest_e2m1(value: f32) -> u8 {
    let doubled = (value * 2.0).abs();
    let mut best = 0u8;
    for code in 1..8u8 {
        let d_new = (f32::from(E2M1_DOUBLED[code as usize]) - doubled).abs();
        let d_best = (f32::from(E2M1_DOUBLED[best as usize]) - doubled).abs();
        if d_new < d_best || (d_new == d_best && code.is_multiple_of(2)) {
            best = code;
        }
    }
    if value.is_sign_negative() && best != 0 {
        best | 8
    } else {
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int8_rows_round_half_to_even() {
        let row = [127.0f32, 0.5, 1.5, -2.5, -127.0];
        let (q, scales) = quantize_int8_rows(&row, 5);
        assert_eq!(scales, vec![1.0]);
        assert_eq!(q, vec![127, 0, 2, -2, -127]);
    }

    #[test]
    fn int4_nibbles_put_the_even_element_low() {
        // scale 1: values -7, 3, 0 -> nibbles 1, 11, 8 (+ padding 8)
        let (packed, scales) = quantize_int4_groups(&[-7.0, 3.0, 0.0], 3, 64);
        assert_eq!(scales, vec![1.0]);
        assert_eq!(packed, vec![0xB1, 0x88]);
        assert_eq!(int4_value(&packed, 0), -7.0);
        assert_eq!(int4_value(&packed, 1), 3.0);
        assert_eq!(int4_value(&packed, 2), 0.0);
    }

    #[test]
    fn e4m3_known_values() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xC0), -2.0);
        assert!(e4m3_to_f32(0xFF).is_nan());
        assert_eq!(e4m3_to_f32(0x80).to_bits(), 0x8000_0000);
        for code in 0..=255u8 {
            if code & 0x7F != 0x7F {
                assert_eq!(
                    f32_to_e4m3(e4m3_to_f32(code)) & 0x7F,
                    code & 0x7F,
                    "{code:#x}"
                );
            }
        }
        assert_eq!(f32_to_e4m3(1000.0), 0x7E);
    }

    #[test]
    fn e2m1_codes_round_trip() {
        for code in 0..16u8 {
            let value = f32::from(E2M1_DOUBLED[code as usize]) / 2.0;
            let back = nearest_e2m1(value);
            assert_eq!(E2M1_DOUBLED[back as usize], E2M1_DOUBLED[code as usize]);
        }
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0), 0.0);
        assert_eq!(e8m0_to_f32(255), f32::INFINITY);
    }
}
