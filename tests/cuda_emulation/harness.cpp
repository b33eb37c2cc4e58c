// Runs the matmul kernels of kernels/cuda/coli.cu on the CPU, so that their decoding,
// indexing and padding are checked where there is no GPU. The CUDA built-ins the kernels
// use are given CPU meanings below: a block is WARPS warps of 32 threads, each warp's
// threads meet at a barrier for every shuffle. Only the matmul kernels are run; they
// synchronise within a warp only, so __syncthreads has nothing to do here.
//
// Usage: harness CASES. CASES (little-endian, written by tests/cuda_kernels_emulated.rs):
// u32 count, then per case: i32 format code, u32 rows, cols, group, per_row, n,
// u64 data bytes, u64 scale bytes; the data (rows x row_bytes), the scales, the input
// (n x cols f32), the expected output and the allowed error (n x rows f32 each).
// Prints one line per case and exits with 1 if any output is off.

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
#define __shared__ static thread_local

struct uint4 {
    unsigned x, y, z, w;
};
struct float4 {
    float x, y, z, w;
};
struct dim3 {
    unsigned x, y, z;
};
thread_local dim3 threadIdx, blockIdx;

template <class T> T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u)
{
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline void __syncthreads() {}
using std::min;

struct Warp {
    std::barrier<> step{32};
    double lanes[32];
};
thread_local Warp* this_warp;
thread_local int this_lane;

template <class T> T __shfl_xor_sync(unsigned, T value, int offset)
{
    this_warp->lanes[this_lane] = value;
    this_warp->step.arrive_and_wait();
    T other = (T)this_warp->lanes[this_lane ^ offset];
    this_warp->step.arrive_and_wait();
    return other;
}

#include "coli.cu"

template <class T> static bool read(FILE* f, T* out, size_t count)
{
    return std::fread(out, sizeof(T), count, f) == count;
}

static size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

// Bytes of one weight row as the host holds it, by format code.
static size_t row_bytes(int code, size_t cols)
{
    switch (code) {
    case FMT_F32: return cols * 4;
    case FMT_BF16:
    case FMT_F16: return cols * 2;
    case FMT_INT8_ROW:
    case FMT_FP8_B128: return cols;
    default: return (cols + 1) / 2;
    }
}

int main(int argc, char** argv)
{
    if (argc != 2) {
        std::fprintf(stderr, "usage: harness CASES\n");
        return 2;
    }
    FILE* f = std::fopen(argv[1], "rb");
    uint32_t count = 0;
    if (!f || !read(f, &count, 1)) {
        std::fprintf(stderr, "cannot read %s\n", argv[1]);
        return 2;
    }
    int off = 0;
    for (uint32_t c = 0; c < count; ++c) {
        int32_t code;
        uint32_t shape[5];
        uint64_t lengths[2];
        if (!read(f, &code, 1) || !read(f, shape, 5) || !read(f, lengths, 2)) {
            std::fprintf(stderr, "case %u: truncated header\n", c);
            return 2;
        }
        const size_t rows = shape[0], cols = shape[1], group = shape[2], per_row = shape[3], n = shape[4];
        const size_t bytes = row_bytes(code, cols), stride = round_up(bytes, 16), xstride = round_up(cols, 32);
        std::vector<unsigned char> data(lengths[0]);
        std::vector<float> scales(lengths[1] / 4 + 4);
        std::vector<float> x(n * cols), want(n * rows), allowed(n * rows);
        if (lengths[0] != rows * bytes || !read(f, data.data(), data.size()) ||
            !read(f, reinterpret_cast<unsigned char*>(scales.data()), lengths[1]) ||
            !read(f, x.data(), x.size()) || !read(f, want.data(), want.size()) ||
            !read(f, allowed.data(), allowed.size())) {
            std::fprintf(stderr, "case %u: truncated or mis-sized body\n", c);
            return 2;
        }
        // The device layout the host prepares: rows padded to 16 bytes, inputs to 32 floats.
        std::vector<uint4> weights(rows * stride / 16);
        std::memset(weights.data(), 0, rows * stride);
        for (size_t r = 0; r < rows; ++r) {
            std::memcpy(reinterpret_cast<unsigned char*>(weights.data()) + r * stride, data.data() + r * bytes, bytes);
        }
        std::vector<float4> input(n * xstride / 4);
        std::memset(input.data(), 0, n * xstride * 4);
        for (size_t t = 0; t < n; ++t) {
            std::memcpy(reinterpret_cast<float*>(input.data()) + t * xstride, x.data() + t * cols, cols * 4);
        }
        std::vector<float> y(n * rows, NAN);
        Job job{reinterpret_cast<const unsigned char*>(weights.data()), scales.data(),
                reinterpret_cast<const float*>(input.data()), nullptr, y.data(), code, (int)rows, (int)cols,
                (int)stride, (int)group, (int)per_row, (int)xstride, (int)rows, (int)n, 0};
        const int tile = n == 1 ? 1 : 8;
        for (size_t bx = 0; bx < (rows + WARPS - 1) / WARPS; ++bx) {
            for (size_t by = 0; by < (n + tile - 1) / tile; ++by) {
                std::vector<Warp> warps(WARPS);
                std::vector<std::thread> threads;
                for (int t = 0; t < WARPS * 32; ++t) {
                    threads.emplace_back([&, t] {
                        this_warp = &warps[t / 32];
                        this_lane = t % 32;
                        threadIdx = {unsigned(t), 0, 0};
                        blockIdx = {unsigned(bx), unsigned(by), 0};
                        if (tile == 1) {
                            matmul_1(&job, 1);
                        } else {
                            matmul_8(&job, 1);
                        }
                    });
                }
                for (auto& thread : threads) {
                    thread.join();
                }
            }
        }
        double worst = 0.0;
        bool ok = true;
        for (size_t i = 0; i < y.size(); ++i) {
            double error = std::fabs((double)y[i] - (double)want[i]);
            if (std::isnan(y[i]) != std::isnan(want[i]) || error > allowed[i]) {
                ok = false;
            }
            if (!std::isnan(error)) {
                worst = std::max(worst, error / std::max((double)allowed[i], 1e-30));
            }
        }
        std::printf("format %d %zux%zu group %zu n %zu: worst error %.3f of allowed%s\n", code, rows, cols, group,
                    n, worst, ok ? "" : "  OFF");
        off += ok ? 0 : 1;
    }
    std::printf("%d of %u cases off\n", off, count);
    return off == 0 ? 0 : 1;
}
