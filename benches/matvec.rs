//! Matrix-vector throughput per weight format, next to the machine's memory read bandwidth.
//! Decode reads every weight once per token, so bytes of weights per second is the figure
//! that matters; criterion reports it as throughput.
//!
//! `cargo bench --bench matvec`

use std::hint::black_box;

use coli::quant::{Matrix, Width};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const ROWS: usize = 4096;
const COLS: usize = 4096;

fn weights() -> Vec<f32> {
    // A cheap deterministic pattern; values do not affect the speed of these kernels.
    (0..ROWS * COLS)
        .map(|i| ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

fn memory_bandwidth(c: &mut Criterion) {
    let buffer = vec![1u64; 256 << 20 >> 3];
    let mut group = c.benchmark_group("memory");
    group.throughput(Throughput::Bytes((buffer.len() * 8) as u64));
    group.bench_function("read 256 MiB", |b| {
        b.iter(|| {
            use rayon::prelude::*;
            black_box(
                buffer
                    .par_chunks(1 << 16)
                    .map(|c| c.iter().fold(0u64, |a, &v| a ^ v))
                    .reduce(|| 0, |a, b| a ^ b),
            )
        })
    });
    group.finish();
}

fn matvec(c: &mut Criterion) {
    let x: Vec<f32> = (0..COLS).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut y = vec![0f32; ROWS];
    let mut group = c.benchmark_group("matvec 4096x4096");
    for (label, width) in [("f32", Width::F32), ("int8-row", Width::Int8Row)] {
        let matrix = Matrix::from_f32(ROWS, COLS, weights(), width);
        group.throughput(Throughput::Bytes(matrix.size_bytes() as u64));
        group.bench_function(label, |b| {
            b.iter(|| matrix.matmul(black_box(&x), 1, &mut y))
        });
    }
    group.finish();
}

criterion_group!(benches, memory_bandwidth, matvec);
criterion_main!(benches);
