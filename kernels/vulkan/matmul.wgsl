// out[t][r] = sum over c of W[r][c] * x[t][c], for every weight format coli uploads.
//
// The weights are read as u32 words (no 8- or 16-bit storage feature is needed): each row
// starts on a word, holds PER_WORD elements of the format per word, and the host pads its
// last word. Scales follow the rows in the same buffer. One workgroup computes one weight
// row for up to TOKENS input rows at a time: its threads stride over the row's words and
// decode each word once for all of those input rows (a batch of n rows reads a weight row
// ceil(n / TOKENS) times, from cache after the first); one thread per input row then adds
// the threads' partial sums from shared memory (no subgroup operation is used).
//
// FORMAT is fixed when the shader is compiled (build.rs writes one SPIR-V per format), so
// the decoder below folds to one format's code. A word decodes into two vec4s, never an
// array: arrays indexed by a variable leave registers on some drivers (lavapipe among them).

const F32: u32 = 0u;
const BF16: u32 = 1u;
const F16: u32 = 2u;
const INT8: u32 = 3u;
const INT4: u32 = 4u;
const MXFP4: u32 = 5u;
const FP8: u32 = 6u;

override FORMAT: u32;
override PER_WORD: u32 = select(select(select(8u, 4u, FORMAT == INT8 || FORMAT == FP8), 2u,
    FORMAT == BF16 || FORMAT == F16), 1u, FORMAT == F32);

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

// Up to eight elements of one word, low element first; unused lanes are zero.
struct Word {
    low: vec4<f32>,
    high: vec4<f32>,
}

// Four nibbles (a half word) as offset-binary int4 values.
fn int4(nibbles: u32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(nibbles) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u)) - 8.0;
}

// Four nibbles as e2m1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and their negatives), so
// that they are integers; the halving is in the MXFP4 scale. Magnitude code m = 2e + b is
// b when e = 0, else (2 + b) * 2^(e - 1).
fn e2m1_doubled(nibbles: u32) -> vec4<f32> {
    let code = (vec4<u32>(nibbles) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    let e = (code >> vec4<u32>(1u)) & vec4<u32>(3u);
    let b = code & vec4<u32>(1u);
    let shifted = (vec4<u32>(2u) + b) << (max(e, vec4<u32>(1u)) - vec4<u32>(1u));
    let magnitude = vec4<f32>(select(shifted, b, e == vec4<u32>(0u)));
    return select(magnitude, -magnitude, (code & vec4<u32>(8u)) != vec4<u32>(0u));
}

// Four FP8 E4M3 (e4m3fn) bytes: bias 7, exponent 0 subnormal, 0x7F and 0xFF NaN.
fn e4m3(word: u32) -> vec4<f32> {
    let bytes = (vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u);
    let sign = (bytes & vec4<u32>(0x80u)) << vec4<u32>(24u);
    let exponent = (bytes >> vec4<u32>(3u)) & vec4<u32>(15u);
    let mantissa = bytes & vec4<u32>(7u);
    let normal = sign | ((exponent + vec4<u32>(120u)) << vec4<u32>(23u)) | (mantissa << vec4<u32>(20u));
    // mantissa / 8 * 2^-6, exact in f32.
    let subnormal = sign | bitcast<vec4<u32>>(vec4<f32>(mantissa) * 0.001953125);
    let finite = select(normal, subnormal, exponent == vec4<u32>(0u));
    let nan = (bytes & vec4<u32>(0x7Fu)) == vec4<u32>(0x7Fu);
    return bitcast<vec4<f32>>(select(finite, vec4<u32>(0x7FC00000u), nan));
}

// The elements of one weight word, without their scale.
fn decode(word: u32) -> Word {
    var v = Word(vec4<f32>(0.0), vec4<f32>(0.0));
    switch FORMAT {
        case F32: {
            v.low.x = bitcast<f32>(word);
        }
        case BF16: {
            v.low.x = bitcast<f32>(word << 16u);
            v.low.y = bitcast<f32>(word & 0xFFFF0000u);
        }
        case F16: {
            let pair = unpack2x16float(word);
            v.low.x = pair.x;
            v.low.y = pair.y;
        }
        case INT8: {
            let bytes = vec4<i32>(bitcast<i32>(word)) << vec4<u32>(24u, 16u, 8u, 0u);
            v.low = vec4<f32>(bytes >> vec4<u32>(24u));
        }
        case INT4: {
            v.low = int4(word & 0xFFFFu);
            v.high = int4(word >> 16u);
        }
        case MXFP4: {
            v.low = e2m1_doubled(word & 0xFFFFu);
            v.high = e2m1_doubled(word >> 16u);
        }
        default: {
            v.low = e4m3(word);
        }
    }
    return v;
}

// Row `r`'s word `w` decoded; the padding past the row's last column reads as zero.
fn row_word(r: u32, w: u32) -> Word {
    var v = decode(weights[r * p.row_words + w]);
    let col = w * PER_WORD;
    if col + PER_WORD > p.cols {
        let left = vec4<u32>(p.cols - col);
        v.low = select(vec4<f32>(0.0), v.low, vec4<u32>(0u, 1u, 2u, 3u) < left);
        v.high = select(vec4<f32>(0.0), v.high, vec4<u32>(4u, 5u, 6u, 7u) < left);
    }
    return v;
}

// Input element `col` of the row starting at `base`, or its last element past the end (a
// padding element, which is zero).
fn input_at(base: u32, col: u32) -> f32 {
    return x[base + min(col, p.cols - 1u)];
}

// The word's elements dotted with input columns `col..` of the input row at `base`.
fn word_dot(v: Word, base: u32, col: u32) -> f32 {
    switch PER_WORD {
        case 1u: {
            return v.low.x * input_at(base, col);
        }
        case 2u: {
            return v.low.x * input_at(base, col) + v.low.y * input_at(base, col + 1u);
        }
        case 4u: {
            return dot(v.low, vec4<f32>(
                input_at(base, col),
                input_at(base, col + 1u),
                input_at(base, col + 2u),
                input_at(base, col + 3u),
            ));
        }
        default: {
            return dot(v.low, vec4<f32>(
                input_at(base, col),
                input_at(base, col + 1u),
                input_at(base, col + 2u),
                input_at(base, col + 3u),
            )) + dot(v.high, vec4<f32>(
                input_at(base, col + 4u),
                input_at(base, col + 5u),
                input_at(base, col + 6u),
                input_at(base, col + 7u),
            ));
        }
    }
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

// Where input row `t` starts in `x`.
fn input_base(t: u32) -> u32 {
    var source = t;
    if p.gather != 0u {
        source = index[p.index_offset + t];
    }
    return p.x_offset + source * p.x_stride;
}

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(num_workgroups) workgroups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    for (var r = workgroup.x; r < p.rows; r += workgroups.x) {
        for (var t0 = 0u; t0 < p.n; t0 += TOKENS) {
            let count = min(TOKENS, p.n - t0);
            let last = t0 + count - 1u;
            // Slots past `count` repeat the last input row; their sums are never written.
            let low = vec4<u32>(
                input_base(t0),
                input_base(min(t0 + 1u, last)),
                input_base(min(t0 + 2u, last)),
                input_base(min(t0 + 3u, last)),
            );
            let high = vec4<u32>(
                input_base(min(t0 + 4u, last)),
                input_base(min(t0 + 5u, last)),
                input_base(min(t0 + 6u, last)),
                input_base(min(t0 + 7u, last)),
            );
            var acc_low = vec4<f32>(0.0);
            var acc_high = vec4<f32>(0.0);
            if count == 1u {
                for (var w = lane; w < p.row_words; w += THREADS) {
                    let col = w * PER_WORD;
                    acc_low.x += scale_at(r, col) * word_dot(row_word(r, w), low.x, col);
                }
            } else {
                for (var w = lane; w < p.row_words; w += THREADS) {
                    let col = w * PER_WORD;
                    let v = row_word(r, w);
                    let s = scale_at(r, col);
                    acc_low += s * vec4<f32>(
                        word_dot(v, low.x, col),
                        word_dot(v, low.y, col),
                        word_dot(v, low.z, col),
                        word_dot(v, low.w, col),
                    );
                    acc_high += s * vec4<f32>(
                        word_dot(v, high.x, col),
                        word_dot(v, high.y, col),
                        word_dot(v, high.z, col),
                        word_dot(v, high.w, col),
                    );
                }
            }
            partial[lane] = acc_low.x;
            partial[THREADS + lane] = acc_low.y;
            partial[2u * THREADS + lane] = acc_low.z;
            partial[3u * THREADS + lane] = acc_low.w;
            partial[4u * THREADS + lane] = acc_high.x;
            partial[5u * THREADS + lane] = acc_high.y;
            partial[6u * THREADS + lane] = acc_high.z;
            partial[7u * THREADS + lane] = acc_high.w;
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
