// out[t][r] = sum over c of W[r][c] * x[t][c], for every weight format coli uploads.
//
// The weights are read as u32 words (no 8- or 16-bit storage feature is needed): each row
// starts on a word, holds `per_word` elements of the format per word, and the host pads its
// last word. Scales follow the rows in the same buffer. One workgroup computes one weight
// row for up to TOKENS input rows at a time: its threads stride over the row's words,
// decode each word once for all of those input rows, and a shared-memory tree adds the
// threads' partial sums (no subgroup operation is used).

const F32: u32 = 0u;
const BF16: u32 = 1u;
const F16: u32 = 2u;
const INT8: u32 = 3u;
const INT4: u32 = 4u;
const MXFP4: u32 = 5u;
const FP8: u32 = 6u;

override FORMAT: u32;

const THREADS: u32 = 64u;
const TOKENS: u32 = 8u;

struct Params {
    rows: u32,
    cols: u32,
    n: u32,
    row_words: u32,
    // Word offset of the scales in `weights`.
    scale_offset: u32,
    // Scales (MXFP4: words of scale bytes) per scale row.
    scale_stride: u32,
    // Columns sharing one scale.
    group: u32,
    // Weight rows sharing one scale row (128 for FP8 blocks, else 1).
    scale_row_div: u32,
    x_offset: u32,
    x_stride: u32,
    out_offset: u32,
    out_stride: u32,
    // When 1, input row t is x row index[index_offset + t] (the rows routed to an expert).
    gather: u32,
    index_offset: u32,
}

@group(0) @binding(0) var<storage, read> weights: array<u32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> index: array<u32>;
var<immediate> p: Params;

var<workgroup> partial: array<f32, 512>;

// e2m1 magnitudes doubled so they are integers; the halving is in the MXFP4 scale.
var<private> E2M1_DOUBLED: array<f32, 16> = array<f32, 16>(
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
    0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0,
);

override PER_WORD: u32 = select(select(select(8u, 4u, FORMAT == INT8 || FORMAT == FP8), 2u,
    FORMAT == BF16 || FORMAT == F16), 1u, FORMAT == F32);

// FP8 E4M3 (e4m3fn): bias 7, exponent 0 subnormal, 0x7F and 0xFF NaN.
fn e4m3(byte: u32) -> f32 {
    let sign = (byte & 0x80u) << 24u;
    let exponent = (byte >> 3u) & 15u;
    let mantissa = byte & 7u;
    if (byte & 0x7Fu) == 0x7Fu {
        return bitcast<f32>(0x7FC00000u);
    }
    if exponent == 0u {
        // mantissa / 8 * 2^-6, exact in f32.
        return bitcast<f32>(sign | bitcast<u32>(f32(mantissa) * 0.001953125));
    }
    return bitcast<f32>(sign | ((exponent + 120u) << 23u) | (mantissa << 20u));
}

// The elements of one weight word, without their scale.
fn decode(word: u32) -> array<f32, 8> {
    var v: array<f32, 8>;
    switch FORMAT {
        case F32: {
            v[0] = bitcast<f32>(word);
        }
        case BF16: {
            v[0] = bitcast<f32>(word << 16u);
            v[1] = bitcast<f32>(word & 0xFFFF0000u);
        }
        case F16: {
            let pair = unpack2x16float(word);
            v[0] = pair.x;
            v[1] = pair.y;
        }
        case INT8: {
            for (var k = 0u; k < 4u; k++) {
                v[k] = f32(extractBits(bitcast<i32>(word), 8u * k, 8u));
            }
        }
        case INT4: {
            for (var k = 0u; k < 8u; k++) {
                v[k] = f32((word >> (4u * k)) & 15u) - 8.0;
            }
        }
        case MXFP4: {
            for (var k = 0u; k < 8u; k++) {
                v[k] = E2M1_DOUBLED[(word >> (4u * k)) & 15u];
            }
        }
        default: {
            for (var k = 0u; k < 4u; k++) {
                v[k] = e4m3((word >> (8u * k)) & 255u);
            }
        }
    }
    return v;
}

// The scale of the elements of row `r` from column `col` on; a word never straddles two
// scale groups (groups are multiples of 8 columns).
fn scale_at(r: u32, col: u32) -> f32 {
    switch FORMAT {
        case INT8, INT4, FP8: {
            let slot = (r / p.scale_row_div) * p.scale_stride + col / p.group;
            return bitcast<f32>(weights[p.scale_offset + slot]);
        }
        case MXFP4: {
            let g = col / 32u;
            let word = weights[p.scale_offset + r * p.scale_stride + g / 4u];
            let exponent = (word >> (8u * (g % 4u))) & 255u;
            return bitcast<f32>(exponent << 23u) * 0.5;
        }
        default: {
            return 1.0;
        }
    }
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(num_workgroups) workgroups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    for (var r = workgroup.x; r < p.rows; r += workgroups.x) {
        let row = r * p.row_words;
        for (var t0 = 0u; t0 < p.n; t0 += TOKENS) {
            let count = min(TOKENS, p.n - t0);
            // Past `count`, a slot repeats the last input row; its sum is never written.
            var base: array<u32, TOKENS>;
            for (var t = 0u; t < TOKENS; t++) {
                var source = t0 + min(t, count - 1u);
                if p.gather != 0u {
                    source = index[p.index_offset + source];
                }
                base[t] = p.x_offset + source * p.x_stride;
            }
            var acc: array<f32, TOKENS>;
            for (var w = lane; w < p.row_words; w += THREADS) {
                let col = w * PER_WORD;
                let v = decode(weights[row + w]);
                let s = scale_at(r, col);
                if col + PER_WORD <= p.cols {
                    for (var t = 0u; t < TOKENS; t++) {
                        if t < count {
                            var dot = 0.0;
                            for (var k = 0u; k < PER_WORD; k++) {
                                dot += v[k] * x[base[t] + col + k];
                            }
                            acc[t] += s * dot;
                        }
                    }
                } else {
                    // The padding of a row's last word is not an element.
                    for (var t = 0u; t < TOKENS; t++) {
                        if t < count {
                            var dot = 0.0;
                            for (var k = 0u; k < PER_WORD; k++) {
                                if col + k < p.cols {
                                    dot += v[k] * x[base[t] + col + k];
                                }
                            }
                            acc[t] += s * dot;
                        }
                    }
                }
            }
            for (var t = 0u; t < TOKENS; t++) {
                partial[t * THREADS + lane] = acc[t];
            }
            workgroupBarrier();
            if lane < count {
                var sum = 0.0;
                for (var i = 0u; i < THREADS; i++) {
                    sum += partial[lane * THREADS + i];
                }
                out[p.out_offset + (t0 + lane) * p.out_stride + r] = sum;
            }
            workgroupBarrier();
        }
    }
}
