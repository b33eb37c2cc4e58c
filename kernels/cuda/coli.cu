// coli's CUDA kernels, compiled at run time by NVRTC (no headers, no fast math, no
// flush-to-zero). Every product accumulates in f32 over f32 activations.
//
// Layouts the host prepares (src/backend/cuda/plan.rs):
// - A weight row is `stride` bytes, a multiple of 16, zero-padded past the format's row
//   bytes; a thread reads one 16-byte unit at a time. `units` per row = ceil(cols / E),
//   where E is the elements one unit holds (f32 4, bf16/f16 8, int8/fp8 16, int4/mxfp4 32).
// - An activation row is `xstride` floats, a multiple of 32, zero past `cols`, so a unit's
//   activations are whole float4 loads with no bounds test.
// - A product is described by a `Job`; one launch runs any number of jobs (one plain
//   matmul, or the gate and up products of every expert of a group).
//
// No atomics: every output element is written by one thread after a fixed-order sum.

#define FMT_F32 0
#define FMT_BF16 1
#define FMT_F16 2
#define FMT_INT8_ROW 3
#define FMT_INT4_ROW 4
#define FMT_INT4_GROUPED 5
#define FMT_FP8_B128 6
#define FMT_MXFP4 7

// Rows per block: one warp per output row.
#define WARPS 8

// Threads per block of rms_norm, glu and combine.
#define THREADS 256

typedef unsigned int u32;
typedef unsigned long long u64;

// 80 bytes; the host writes this layout field by field (Job::write in cuda.rs).
struct Job {
    const unsigned char* w;  // rows x stride bytes
    const void* scales;      // f32 (int8, int4, fp8) or E8M0 bytes (mxfp4); unused for floats
    const float* x;          // input rows, xstride floats apart
    const int* x_rows;       // input row of each product row, or null for 0, 1, 2, ...
    float* y;                // y[t * ystride + r]
    int format;
    int rows;
    int cols;
    int stride;              // bytes per weight row
    int group;               // int4-grouped group size (a multiple of 8)
    int per_row;             // scales per row: int4-grouped, fp8 (per 128-row block), mxfp4
    int xstride;
    int ystride;
    int n;                   // product rows
    int block0;              // first blockIdx.x of this job
};
static_assert(sizeof(Job) == 80, "Job layout is shared with the host");

__device__ __forceinline__ float warp_sum(float v)
{
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

__device__ __forceinline__ float bf16_value(u32 bits16)
{
    return __uint_as_float(bits16 << 16);
}

// IEEE binary16 to f32, exact (subnormals, infinities and NaN kept).
__device__ __forceinline__ float f16_value(u32 h)
{
    u32 sign = (h & 0x8000u) << 16;
    u32 exponent = (h >> 10) & 0x1fu;
    u32 mantissa = h & 0x3ffu;
    if (exponent == 0) {
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;  // 2^-24
        return sign ? -magnitude : magnitude;
    }
    if (exponent == 31) {
        return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// FP8 E4M3 (e4m3fn) to f32, exact: bias 7, subnormals at exponent 0, 0x7f/0xff NaN.
__device__ __forceinline__ float e4m3_value(u32 byte)
{
    u32 sign = (byte & 0x80u) << 24;
    u32 exponent = (byte >> 3) & 0xfu;
    u32 mantissa = byte & 0x7u;
    if ((byte & 0x7fu) == 0x7fu) {
        return __uint_as_float(0x7fc00000u);
    }
    if (exponent == 0) {
        float magnitude = (float)mantissa * 0.001953125f;  // 2^-9
        return sign ? -magnitude : magnitude;
    }
    return __uint_as_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// An e2m1 code doubled, as an integer: {0, 1, 2, 3, 4, 6, 8, 12}, bit 3 the sign.
__device__ __forceinline__ float e2m1_doubled(u32 code)
{
    int m = (int)(code & 7u);
    int magnitude = m < 4 ? m : (m < 6 ? 2 * m - 4 : 4 * m - 16);
    return (float)((code & 8u) ? -magnitude : magnitude);
}

__device__ __forceinline__ float4 load_x4(const float* x)
{
    return __ldg(reinterpret_cast<const float4*>(x));
}

// sum + v[0..8] . x[0..8], in order.
__device__ __forceinline__ float dot8(const float* v, const float* x, float sum)
{
    float4 a = load_x4(x);
    float4 b = load_x4(x + 4);
    sum = fmaf(v[0], a.x, sum);
    sum = fmaf(v[1], a.y, sum);
    sum = fmaf(v[2], a.z, sum);
    sum = fmaf(v[3], a.w, sum);
    sum = fmaf(v[4], b.x, sum);
    sum = fmaf(v[5], b.y, sum);
    sum = fmaf(v[6], b.z, sum);
    sum = fmaf(v[7], b.w, sum);
    return sum;
}

__device__ __forceinline__ u32 word_of(const uint4& w, int k)
{
    return k == 0 ? w.x : (k == 1 ? w.y : (k == 2 ? w.z : w.w));
}

// Each decoder turns unit `u` of row `row` (16 bytes in `w`) into products with the NT
// input rows at `x[t] + u * E`, accumulating into acc[t] for t < nt.

template <int NT>
__device__ __forceinline__ void unit_f32(const uint4& w, const float* const* x, int nt, float* acc)
{
    float v[4] = {__uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z),
                  __uint_as_float(w.w)};
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < nt) {
            float4 a = load_x4(x[t]);
            acc[t] = fmaf(v[0], a.x, acc[t]);
            acc[t] = fmaf(v[1], a.y, acc[t]);
            acc[t] = fmaf(v[2], a.z, acc[t]);
            acc[t] = fmaf(v[3], a.w, acc[t]);
        }
    }
}

// bf16 and f16: two elements per word, the even one in the low half.
template <int NT, bool HALF>
__device__ __forceinline__ void unit_16bit(const uint4& w, const float* const* x, int nt, float* acc)
{
    float v[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 word = word_of(w, k);
        v[2 * k] = HALF ? f16_value(word & 0xffffu) : bf16_value(word & 0xffffu);
        v[2 * k + 1] = HALF ? f16_value(word >> 16) : bf16_value(word >> 16);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < nt) {
            acc[t] = dot8(v, x[t], acc[t]);
        }
    }
}

// int8 (scale applied per row by the caller) or fp8 with its 128x128 block scale.
template <int NT, bool FP8>
__device__ __forceinline__ void unit_bytes(const uint4& w, const float* const* x, int nt, float* acc,
                                           float scale)
{
    float v[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        u32 word = word_of(w, k);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            u32 byte = (word >> (8 * b)) & 0xffu;
            v[4 * k + b] = FP8 ? e4m3_value(byte) : (float)((int)(word << (24 - 8 * b)) >> 24);
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < nt) {
            float partial = dot8(v, x[t], 0.0f);
            partial = dot8(v + 8, x[t] + 8, partial);
            acc[t] = FP8 ? fmaf(partial, scale, acc[t]) : acc[t] + partial;
        }
    }
}

// Eight nibbles of one word, element i in bits 4i..4i+3: int4 as nibble - 8, e2m1 doubled.
template <bool E2M1>
__device__ __forceinline__ void nibbles(u32 word, float* v)
{
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        u32 code = (word >> (4 * i)) & 0xfu;
        v[i] = E2M1 ? e2m1_doubled(code) : (float)((int)code - 8);
    }
}

// int4, per-row scale (applied by the caller) or one f32 scale per `group` columns.
template <int NT, bool GROUPED>
__device__ __forceinline__ void unit_int4(const Job& job, int row, int u, const uint4& w,
                                          const float* const* x, int nt, float* acc)
{
    const float* scales = reinterpret_cast<const float*>(job.scales);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        int c0 = u * 32 + 8 * k;
        if (c0 >= job.cols) {
            break;
        }
        float v[8];
        nibbles<false>(word_of(w, k), v);
        float scale = GROUPED ? scales[(u64)row * job.per_row + c0 / job.group] : 1.0f;
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if (t < nt) {
                float partial = dot8(v, x[t] + 8 * k, 0.0f);
                acc[t] = GROUPED ? fmaf(partial, scale, acc[t]) : acc[t] + partial;
            }
        }
    }
}

// MXFP4: one unit is exactly one 32-column group with one E8M0 scale byte.
template <int NT>
__device__ __forceinline__ void unit_mxfp4(const Job& job, int row, int u, const uint4& w,
                                           const float* const* x, int nt, float* acc)
{
    const unsigned char* scales = reinterpret_cast<const unsigned char*>(job.scales);
    u32 exponent = scales[(u64)row * job.per_row + u];
    // 2^(s - 127) from the float bits (s = 0 is +0, s = 255 is +inf), halved for the
    // doubled e2m1 values.
    float scale = __uint_as_float(exponent << 23) * 0.5f;
    float v[32];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        nibbles<true>(word_of(w, k), v + 8 * k);
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        if (t < nt) {
            float partial = 0.0f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                partial = dot8(v + 8 * k, x[t] + 8 * k, partial);
            }
            acc[t] = fmaf(partial, scale, acc[t]);
        }
    }
}

template <int NT, int FMT>
__device__ __forceinline__ void row_products(const Job& job, int row, int t0, int nt, int lane)
{
    constexpr int E = FMT == FMT_F32 ? 4
                    : (FMT == FMT_BF16 || FMT == FMT_F16) ? 8
                    : (FMT == FMT_INT8_ROW || FMT == FMT_FP8_B128) ? 16
                    : 32;
    const unsigned char* wrow = job.w + (u64)row * job.stride;
    const int units = (job.cols + E - 1) / E;
    const float* xrow[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        int r = t < nt ? t0 + t : t0;
        int source = job.x_rows ? job.x_rows[r] : r;
        xrow[t] = job.x + (u64)source * job.xstride;
    }
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        acc[t] = 0.0f;
    }
    const float* fp8_scales = reinterpret_cast<const float*>(job.scales);
#pragma unroll 2
    for (int u = lane; u < units; u += 32) {
        uint4 w = __ldg(reinterpret_cast<const uint4*>(wrow + (u64)u * 16));
        const float* x[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            x[t] = xrow[t] + u * E;
        }
        if (FMT == FMT_F32) {
            unit_f32<NT>(w, x, nt, acc);
        } else if (FMT == FMT_BF16) {
            unit_16bit<NT, false>(w, x, nt, acc);
        } else if (FMT == FMT_F16) {
            unit_16bit<NT, true>(w, x, nt, acc);
        } else if (FMT == FMT_INT8_ROW) {
            unit_bytes<NT, false>(w, x, nt, acc, 1.0f);
        } else if (FMT == FMT_FP8_B128) {
            float scale = fp8_scales[(u64)(row / 128) * job.per_row + (u * 16) / 128];
            unit_bytes<NT, true>(w, x, nt, acc, scale);
        } else if (FMT == FMT_INT4_ROW) {
            unit_int4<NT, false>(job, row, u, w, x, nt, acc);
        } else if (FMT == FMT_INT4_GROUPED) {
            unit_int4<NT, true>(job, row, u, w, x, nt, acc);
        } else {
            unit_mxfp4<NT>(job, row, u, w, x, nt, acc);
        }
    }
    float row_scale = 1.0f;
    if (FMT == FMT_INT8_ROW || FMT == FMT_INT4_ROW) {
        row_scale = reinterpret_cast<const float*>(job.scales)[row];
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float sum = warp_sum(acc[t]);
        if (lane == 0 && t < nt) {
            job.y[(u64)(t0 + t) * job.ystride + row] = sum * row_scale;
        }
    }
}

// grid.x: WARPS-row blocks of every job, in job order; grid.y: NT-row tiles of the input.
template <int NT>
__device__ __forceinline__ void matmul_jobs(const Job* jobs, int njobs)
{
    int j = njobs - 1;
    while (j > 0 && jobs[j].block0 > (int)blockIdx.x) {
        --j;
    }
    const Job job = jobs[j];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int row = ((int)blockIdx.x - job.block0) * WARPS + warp;
    const int t0 = (int)blockIdx.y * NT;
    // Whole warps leave together, so the shuffles below always see 32 lanes.
    if (row >= job.rows || t0 >= job.n) {
        return;
    }
    const int nt = min(NT, job.n - t0);
    switch (job.format) {
    case FMT_F32: row_products<NT, FMT_F32>(job, row, t0, nt, lane); break;
    case FMT_BF16: row_products<NT, FMT_BF16>(job, row, t0, nt, lane); break;
    case FMT_F16: row_products<NT, FMT_F16>(job, row, t0, nt, lane); break;
    case FMT_INT8_ROW: row_products<NT, FMT_INT8_ROW>(job, row, t0, nt, lane); break;
    case FMT_INT4_ROW: row_products<NT, FMT_INT4_ROW>(job, row, t0, nt, lane); break;
    case FMT_INT4_GROUPED: row_products<NT, FMT_INT4_GROUPED>(job, row, t0, nt, lane); break;
    case FMT_FP8_B128: row_products<NT, FMT_FP8_B128>(job, row, t0, nt, lane); break;
    case FMT_MXFP4: row_products<NT, FMT_MXFP4>(job, row, t0, nt, lane); break;
    default: break;
    }
}

// One input row per block row (decode).
extern "C" __global__ void __launch_bounds__(WARPS * 32) matmul_1(const Job* jobs, int njobs)
{
    matmul_jobs<1>(jobs, njobs);
}

// Eight input rows per block row: each weight unit is read once for eight rows (prefill).
extern "C" __global__ void __launch_bounds__(WARPS * 32) matmul_8(const Job* jobs, int njobs)
{
    matmul_jobs<8>(jobs, njobs);
}

// out = x / sqrt(mean(x^2) + eps) * weight, one block of THREADS threads per row. The mean
// square accumulates in double, as the CPU reference does.
extern "C" __global__ void __launch_bounds__(THREADS) rms_norm(const float* x, const float* weight,
                                                              float* out, int width, float eps)
{
    __shared__ double partial[THREADS / 32];
    const float* xr = x + (u64)blockIdx.x * width;
    float* yr = out + (u64)blockIdx.x * width;
    double sum = 0.0;
    for (int i = threadIdx.x; i < width; i += THREADS) {
        double v = (double)xr[i];
        sum = fma(v, v, sum);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if ((threadIdx.x & 31) == 0) {
        partial[threadIdx.x >> 5] = sum;
    }
    __syncthreads();
    double total = 0.0;
    for (int k = 0; k < THREADS / 32; ++k) {
        total += partial[k];
    }
    const float inv = (float)(1.0 / sqrt(total / (double)width + (double)eps));
    for (int i = threadIdx.x; i < width; i += THREADS) {
        yr[i] = weight[i] * (xr[i] * inv);
    }
}

#define ACT_SWIGLU 0
#define ACT_SITU 1

// gate = act(gate, up) over `count` elements, in place. SiTU-GLU:
// beta tanh(g / beta) sigmoid(g) * (linear_beta tanh(u / linear_beta), or u without one).
extern "C" __global__ void __launch_bounds__(THREADS) glu(float* gate, const float* up, int count,
                                                         int kind, float beta, float linear_beta,
                                                         int has_linear_beta)
{
    // 64-bit: the last block of a count near 2^31 reaches past the int range.
    const u64 i = (u64)blockIdx.x * THREADS + threadIdx.x;
    if (i >= (u64)count) {
        return;
    }
    const float g = gate[i];
    const float u = up[i];
    if (kind == ACT_SWIGLU) {
        gate[i] = __fmul_rn(g / (1.0f + expf(-g)), u);
    } else {
        float bounded = __fmul_rn(__fmul_rn(beta, tanhf(g / beta)), 1.0f / (1.0f + expf(-g)));
        float linear = has_linear_beta ? __fmul_rn(linear_beta, tanhf(u / linear_beta)) : u;
        gate[i] = __fmul_rn(bounded, linear);
    }
}

// out[r][c] = sum over the entries of row r, in order, of weight * y[slot][c]; zero for a
// row with no entries. Rounded as the CPU's `o += v * weight` (no fused multiply-add).
extern "C" __global__ void __launch_bounds__(THREADS) combine(const float* y, int width,
                                                             const int* row_start,
                                                             const int* entry_slot,
                                                             const float* entry_weight, float* out)
{
    const int c = blockIdx.x * THREADS + threadIdx.x;
    const int r = blockIdx.y;
    if (c >= width) {
        return;
    }
    float sum = 0.0f;
    for (int e = row_start[r]; e < row_start[r + 1]; ++e) {
        sum = __fadd_rn(sum, __fmul_rn(y[(u64)entry_slot[e] * width + c], entry_weight[e]));
    }
    out[(u64)r * width + c] = sum;
}
