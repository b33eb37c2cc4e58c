//! Matrix-vector throughput per weight format at real shapes, next to the machine's memory
//! read bandwidth. Decode reads every weight once per token, so bytes of weights (scales
//! included) per second is the figure that matters; criterion reports it as throughput.
//!
//! Each case cycles through enough copies of the matrix to fill 256 MiB (eight times the last-level cache), so the weights
//! come from memory and not from cache, as they do in decode.
//!
//! The same kernels on a matrix that stays in cache show what each computes when memory is
//! not the limit (weights per second).
//!
//! Batched products (a prompt) are compute-bound instead: they are measured in
//! multiply-adds per second, next to the machine's register-only FMA peak.
//!
//! `cargo bench --bench matvec` (all), `cargo bench --bench matvec -- 'int8-row'` (one
//! format), `COLI_SIMD=scalar` for the reference kernels.

use std::hint::black_box;
use std::time::Duration;

use coli::quant::{Format, Matrix};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

mod machine;

/// Shapes `[rows, cols]`: an OLMoE expert's gate/up, a GLM-5.2 attention projection, a
/// Kimi-style wide projection.
const SHAPES: [(usize, usize); 3] = [(2048, 1024), (6144, 2048), (7168, 3584)];

const WORKING_SET: usize = 256 << 20;

const FORMATS: [Format; 8] = [
    Format::F32,
    Format::Bf16,
    Format::F16,
    Format::Int8Row,
    Format::Int4Row,
    Format::Int4Grouped { group: 64 },
    Format::Fp8E4m3B128,
    Format::Mxfp4,
];

fn weights(rows: usize, cols: usize, seed: usize) -> Vec<f32> {
    // A cheap deterministic spread; values do not change the speed of these kernels.
    (0..rows * cols)
        .map(|i| (((i + seed) * 2654435761) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

fn label(format: Format) -> String {
    match format {
        Format::Int4Grouped { group } => format!("int4-g{group}"),
        other => other.name().to_string(),
    }
}

/// Sum a buffer far larger than the caches, on every thread: the read bandwidth the
/// kernels are measured against.
fn memory_bandwidth(c: &mut Criterion) {
    let buffer: Vec<u64> = (0..(1usize << 30) / 8).map(|i| i as u64).collect();
    let mut group = c.benchmark_group("memory");
    group.throughput(Throughput::Bytes((buffer.len() * 8) as u64));
    group.bench_function("read 1 GiB", |b| {
        b.iter(|| black_box(machine::sum(&buffer)))
    });
    group.finish();
}

/// Fused multiply-adds from registers only (twelve independent chains per thread, no
/// memory traffic), on every thread, at 256 and (where the CPU has it) 512 bits: the
/// compute ceiling the batched (prefill) kernels are measured against, in multiply-adds
/// per second.
fn fma_peak(c: &mut Criterion) {
    let threads = rayon::current_num_threads();
    let mut group = c.benchmark_group("compute");
    for kernel in machine::fma_kernels() {
        group.throughput(Throughput::Elements(kernel.multiply_adds(threads) as u64));
        group.bench_function(kernel.name, |b| {
            b.iter(|| black_box(kernel.run_on(threads)))
        });
    }
    group.finish();
}

fn matvec(c: &mut Criterion) {
    for (rows, cols) in SHAPES {
        let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        let mut y = vec![0f32; rows];
        let mut group = c.benchmark_group(format!("matvec {rows}x{cols}"));
        for format in FORMATS {
            let first = Matrix::from_f32_as(rows, cols, &weights(rows, cols, 0), format)
                .expect("every listed format encodes");
            let copies = WORKING_SET.div_ceil(first.size_bytes()).max(2);
            let mut matrices = vec![first];
            for seed in 1..copies {
                matrices.push(
                    Matrix::from_f32_as(rows, cols, &weights(rows, cols, seed), format)
                        .expect("every listed format encodes"),
                );
            }
            group.throughput(Throughput::Bytes(matrices[0].size_bytes() as u64));
            // Integer and MXFP4 weights also with int8 activations (`ACT_BITS=8`).
            let integer = matches!(
                format,
                Format::Int8Row | Format::Int4Row | Format::Int4Grouped { .. } | Format::Mxfp4
            );
            for act8 in [false, true].into_iter().filter(|&a| !a || integer) {
                coli::quant::act8::select(act8);
                let name = format!("{}{}", label(format), if act8 { " act8" } else { "" });
                let mut next = 0;
                group.bench_function(name, |b| {
                    b.iter(|| {
                        matrices[next].matmul(black_box(&x), 1, &mut y);
                        next = (next + 1) % matrices.len();
                    })
                });
            }
            coli::quant::act8::select(false);
        }
        group.finish();
    }
}

/// One input row against one small matrix (512 rows by 1024 columns) read again and again
/// from the cache by one thread: what each decode kernel computes per core when memory is
/// not the limit, in weights per second. A format whose two-thread rate of weights in memory
/// (bytes per second above over bytes per weight) comes near twice this rate is
/// compute-bound in decode.
fn matvec_in_cache(c: &mut Criterion) {
    let (rows, cols) = (512, 1024);
    let x: Vec<f32> = (0..cols).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
    let mut y = vec![0f32; rows];
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool builds");
    let mut group = c.benchmark_group(format!("matvec {rows}x{cols} in cache, one thread"));
    group.throughput(Throughput::Elements((rows * cols) as u64));
    for format in FORMATS {
        let matrix = Matrix::from_f32_as(rows, cols, &weights(rows, cols, 0), format)
            .expect("every listed format encodes");
        group.bench_function(label(format), |b| {
            one_thread.install(|| b.iter(|| matrix.matmul(black_box(&x), 1, &mut y)))
        });
    }
    group.finish();
}

/// A batch of rows against one matrix, the weights read once for all rows: 32 (a prompt
/// through a dense projection) and 4 (the rows one expert of 64 at top-8 gets from it),
/// 64 rows through an expert's 2048-column gate (its share of a 512-token prompt), where
/// the inputs no longer fit the first-level cache beside the weights, and 16,384 rows of
/// 6,144 columns (a long prompt into GLM-5.2's projections: 100 MB of inputs even as int8,
/// past the last-level cache) against a slice of 256 weight rows.
fn batched(c: &mut Criterion) {
    for (rows, cols, n) in [
        (2048, 1024, 32),
        (2048, 1024, 4),
        (1024, 2048, 64),
        (256, 6144, 16384),
    ] {
        let x: Vec<f32> = (0..n * cols).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
        let mut y = vec![0f32; n * rows];
        let mut group = c.benchmark_group(format!("matmul {rows}x{cols} x{n} rows"));
        for format in [
            Format::F32,
            Format::Int8Row,
            Format::Int4Grouped { group: 64 },
            Format::Mxfp4,
        ] {
            let matrix = Matrix::from_f32_as(rows, cols, &weights(rows, cols, 0), format)
                .expect("every listed format encodes");
            group.throughput(Throughput::Elements((n * rows * cols) as u64));
            for act8 in [false, true]
                .into_iter()
                .filter(|&a| !a || format != Format::F32)
            {
                coli::quant::act8::select(act8);
                let name = format!("{}{}", label(format), if act8 { " act8" } else { "" });
                group.bench_function(name, |b| b.iter(|| matrix.matmul(black_box(&x), n, &mut y)));
            }
            coli::quant::act8::select(false);
        }
        group.finish();
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
}

criterion_group! {
    name = benches;
    config = config();
    targets = memory_bandwidth, fma_peak, matvec, matvec_in_cache, batched
}
criterion_main!(benches);
