// Runs the kernels of kernels/cuda/coli.cu on the CPU, so that their decoding, indexing,
// padding and synchronisation, and the host's layout of their inputs, are checked where
// there is no GPU.
//
// The device is an arena: a "device address" is an offset into it (0 is the null
// pointer), and the host side (tests/gpu/cuda_kernels_emulated.rs) lays out buffers, jobs and
// tables in it exactly as src/backend/cuda/plan.rs does on a GPU. The threads of a block are
// fibers taking turns on one OS thread: a fiber runs until it waits at a barrier (a warp
// shuffle, or __syncthreads), then the next one runs. Blocks run on a few OS threads at
// once, as they may on a GPU.
//
// Usage: harness FILE. FILE (little-endian, written by the test): u64 arena bytes and the
// arena; u32 command count; commands, each a u32 code:
//   0 clear:  u64 address, u64 bytes
//   1 launch: u32 name length, name, u32 grid x, grid y, threads, u32 argument count,
//             then per argument u32 kind (0 address, 1 int, 2 float) and u64 bits
//   2 check:  u32 label length, label, u64 address, u64 count, count f32 expected,
//             count f32 allowed errors (the output must be within them, NaN where expected)
// Prints one line per check and exits with 1 if any is off, 2 on bad input or a deadlock.

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(threads)
// One block at a time per OS thread, so a thread-local is the block's shared memory.
#define __shared__ static thread_local

// The arena's first byte, for messages.
static const unsigned char* arena_base;

// Aligned as CUDA's, whose 16-byte loads fault on an address that is not.
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct dim3 {
    unsigned x, y, z;
};

template <class T> T __ldg(const T* p)
{
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) != 0) {
        std::fprintf(stderr, "misaligned %zu-byte load at arena + %zu\n", sizeof(T),
                     (size_t)(reinterpret_cast<const unsigned char*>(p) - arena_base));
        std::abort();
    }
    return *p;
}
inline float __uint_as_float(unsigned u)
{
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
using std::min;

// ---- Fibers: the threads of one block ----

constexpr size_t STACK_BYTES = 64 << 10;

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack{new char[STACK_BYTES]};
    dim3 index;
    int shuffles;
    bool done;
};

struct Block;
thread_local Block* this_block;
thread_local Fiber* this_fiber;

// Waits until `expected` fibers have arrived; the last to arrive releases the others.
struct Barrier {
    int expected;
    int arrived = 0;
    unsigned generation = 0;
    void wait();
};

// The lanes' values of a shuffle, in two sets used in turn: a lane that has left one
// shuffle writes the other set, which no lane still reads.
struct Warp {
    Barrier barrier{32};
    double lanes[2][32];
};

struct Block {
    ucontext_t scheduler;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    Barrier sync;
    dim3 index;
    const std::function<void()>* kernel;
    // Barrier arrivals and finished fibers: a round of turns that changes neither is a
    // deadlock (lanes of a warp, or threads of a block, that diverged at a barrier).
    long progress;
};

#define threadIdx (this_fiber->index)
#define blockIdx (this_block->index)

static void yield() { swapcontext(&this_fiber->context, &this_block->scheduler); }

void Barrier::wait()
{
    ++this_block->progress;
    if (++arrived == expected) {
        arrived = 0;
        ++generation;
        return;
    }
    const unsigned waiting_for = generation;
    while (generation == waiting_for) {
        yield();
    }
}

inline void __syncthreads() { this_block->sync.wait(); }

template <class T> T __shfl_xor_sync(unsigned, T value, int offset)
{
    Warp& warp = this_block->warps[threadIdx.x / 32];
    const int lane = threadIdx.x % 32;
    double* lanes = warp.lanes[this_fiber->shuffles++ % 2];
    lanes[lane] = (double)value;
    warp.barrier.wait();
    return (T)lanes[lane ^ offset];
}

#include "coli.cu"

static void fiber_main()
{
    (*this_block->kernel)();
    this_fiber->done = true;
    ++this_block->progress;
}

// Runs block `index` of `kernel` to the end; false on a deadlock.
static bool run_block(Block& block, dim3 index)
{
    block.index = index;
    block.sync = Barrier{(int)block.fibers.size()};
    for (Warp& warp : block.warps) {
        warp.barrier = Barrier{32};
    }
    for (size_t t = 0; t < block.fibers.size(); ++t) {
        Fiber& fiber = block.fibers[t];
        fiber.index = {unsigned(t), 0, 0};
        fiber.shuffles = 0;
        fiber.done = false;
        getcontext(&fiber.context);
        fiber.context.uc_stack.ss_sp = fiber.stack.get();
        fiber.context.uc_stack.ss_size = STACK_BYTES;
        fiber.context.uc_link = &block.scheduler;
        makecontext(&fiber.context, fiber_main, 0);
    }
    for (;;) {
        const long before = block.progress;
        bool live = false;
        for (Fiber& fiber : block.fibers) {
            if (!fiber.done) {
                this_fiber = &fiber;
                swapcontext(&block.scheduler, &fiber.context);
                live = live || !fiber.done;
            }
        }
        if (!live) {
            return true;
        }
        if (block.progress == before) {
            return false;
        }
    }
}

// Runs `kernel` on a grid of blocks of `threads` threads; false on a deadlock.
static bool launch(dim3 grid, unsigned threads, const std::function<void()>& kernel)
{
    const unsigned blocks = grid.x * grid.y;
    std::atomic<unsigned> next{0};
    std::atomic<bool> ok{true};
    auto work = [&] {
        Block block;
        block.fibers = std::vector<Fiber>(threads);
        block.warps = std::vector<Warp>((threads + 31) / 32);
        block.kernel = &kernel;
        block.progress = 0;
        this_block = &block;
        for (unsigned b = next++; b < blocks && ok; b = next++) {
            if (!run_block(block, {b % grid.x, b / grid.x, 0})) {
                ok = false;
            }
        }
    };
    const unsigned workers = std::min({std::max(std::thread::hardware_concurrency(), 1u), 4u, blocks});
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; ++w) {
        pool.emplace_back(work);
    }
    work();
    for (auto& thread : pool) {
        thread.join();
    }
    return ok;
}

// ---- The arena and the commands ----

struct Input {
    FILE* file;
    bool ok = true;
    template <class T> T get()
    {
        T value{};
        ok = ok && std::fread(&value, sizeof(T), 1, file) == 1;
        return value;
    }
    template <class T> std::vector<T> get(size_t count)
    {
        std::vector<T> values(count);
        ok = ok && std::fread(values.data(), sizeof(T), count, file) == count;
        return values;
    }
    std::string text()
    {
        auto bytes = get<char>(get<uint32_t>());
        return std::string(bytes.begin(), bytes.end());
    }
};

struct Arena {
    std::vector<uint4> words;  // 16-byte aligned, as a device allocation (256 on a GPU)
    size_t bytes;
    unsigned char* base() { return reinterpret_cast<unsigned char*>(words.data()); }
    template <class T> T* at(uint64_t address) { return address ? reinterpret_cast<T*>(base() + address) : nullptr; }
    bool holds(uint64_t address, uint64_t length) { return address <= bytes && length <= bytes - address; }
};

struct Arg {
    uint32_t kind;
    uint64_t bits;
};

static bool run_kernel(Arena& arena, const std::string& name, dim3 grid, unsigned threads, const std::vector<Arg>& args)
{
    auto address = [&](size_t k) { return arena.at<void>(args[k].bits); };
    auto integer = [&](size_t k) { return (int)(int32_t)args[k].bits; };
    auto real = [&](size_t k) {
        uint32_t bits = (uint32_t)args[k].bits;
        return __uint_as_float(bits);
    };
    if (name == "matmul_1" || name == "matmul_8") {
        // The jobs hold device addresses; the kernel gets a copy with real pointers.
        const int count = integer(1);
        if (args[0].bits % alignof(Job) != 0 || !arena.holds(args[0].bits, count * sizeof(Job))) {
            std::fprintf(stderr, "%s: jobs at %llu are misaligned or outside the arena\n", name.c_str(),
                         (unsigned long long)args[0].bits);
            return false;
        }
        std::vector<Job> jobs(count);
        std::memcpy(jobs.data(), address(0), count * sizeof(Job));
        for (Job& job : jobs) {
            job.w = arena.at<const unsigned char>((uint64_t)job.w);
            job.scales = arena.at<const void>((uint64_t)job.scales);
            job.x = arena.at<const float>((uint64_t)job.x);
            job.x_rows = arena.at<const int>((uint64_t)job.x_rows);
            job.y = arena.at<float>((uint64_t)job.y);
        }
        if (name == "matmul_1") {
            return launch(grid, threads, [&] { matmul_1(jobs.data(), count); });
        }
        return launch(grid, threads, [&] { matmul_8(jobs.data(), count); });
    }
    if (name == "rms_norm") {
        return launch(grid, threads, [&] {
            rms_norm((const float*)address(0), (const float*)address(1), (float*)address(2), integer(3), real(4));
        });
    }
    if (name == "glu") {
        return launch(grid, threads, [&] {
            glu((float*)address(0), (const float*)address(1), integer(2), integer(3), real(4), real(5), integer(6));
        });
    }
    if (name == "combine") {
        return launch(grid, threads, [&] {
            combine((const float*)address(0), integer(1), (const int*)address(2), (const int*)address(3),
                    (const float*)address(4), (float*)address(5));
        });
    }
    std::fprintf(stderr, "no kernel %s\n", name.c_str());
    return false;
}

int main(int argc, char** argv)
{
    if (argc != 2) {
        std::fprintf(stderr, "usage: harness FILE\n");
        return 2;
    }
    Input in{std::fopen(argv[1], "rb")};
    if (!in.file) {
        std::fprintf(stderr, "cannot open %s\n", argv[1]);
        return 2;
    }
    Arena arena;
    arena.bytes = in.get<uint64_t>();
    arena.words.resize((arena.bytes + 15) / 16);
    arena_base = arena.base();
    in.ok = in.ok && std::fread(arena.base(), 1, arena.bytes, in.file) == arena.bytes;
    const uint32_t commands = in.get<uint32_t>();
    int checks = 0, off = 0;
    for (uint32_t c = 0; c < commands && in.ok; ++c) {
        const uint32_t code = in.get<uint32_t>();
        if (code == 0) {
            const uint64_t address = in.get<uint64_t>(), bytes = in.get<uint64_t>();
            if (!arena.holds(address, bytes)) {
                std::fprintf(stderr, "command %u: clear outside the arena\n", c);
                return 2;
            }
            std::memset(arena.at<unsigned char>(address), 0, bytes);
        } else if (code == 1) {
            const std::string name = in.text();
            const uint32_t gx = in.get<uint32_t>(), gy = in.get<uint32_t>(), threads = in.get<uint32_t>();
            std::vector<Arg> args(in.get<uint32_t>());
            for (Arg& arg : args) {
                arg.kind = in.get<uint32_t>();
                arg.bits = in.get<uint64_t>();
            }
            if (in.ok && !run_kernel(arena, name, {gx, gy, 1}, threads, args)) {
                std::fprintf(stderr, "command %u: %s failed (a deadlock, or the reason above)\n", c, name.c_str());
                return 2;
            }
        } else if (code == 2) {
            const std::string label = in.text();
            const uint64_t address = in.get<uint64_t>(), count = in.get<uint64_t>();
            const auto want = in.get<float>(count), allowed = in.get<float>(count);
            if (!in.ok || !arena.holds(address, count * 4)) {
                break;
            }
            const float* got = arena.at<const float>(address);
            double worst = 0.0;
            size_t nan = 0, beyond = 0;
            for (size_t i = 0; i < count; ++i) {
                const double error = std::fabs((double)got[i] - (double)want[i]);
                if (std::isnan(got[i]) != std::isnan(want[i])) {
                    ++nan;
                } else if (!std::isnan(error)) {
                    beyond += error > allowed[i] ? 1 : 0;
                    worst = std::max(worst, error / std::max((double)allowed[i], 1e-30));
                }
            }
            const bool ok = nan == 0 && beyond == 0;
            std::printf("%s: worst error %.3f of allowed, %zu NaN where the other is a number%s\n", label.c_str(),
                        worst, nan, ok ? "" : "  OFF");
            ++checks;
            off += ok ? 0 : 1;
        } else {
            in.ok = false;
        }
    }
    if (!in.ok) {
        std::fprintf(stderr, "%s: truncated or malformed\n", argv[1]);
        return 2;
    }
    std::printf("%d of %d checks off\n", off, checks);
    return off == 0 ? 0 : 1;
}
