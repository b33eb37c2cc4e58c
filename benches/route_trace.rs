//! What routing telemetry costs per routing decision: counting alone, and counting plus
//! the `ROUTE_TRACE` line. GLM-5.2's shape (78 layers, 256 experts, top-8) and a decode
//! step's single row.
//!
//! `cargo bench --bench route_trace`

use std::hint::black_box;

use coli::route_trace::RouteTrace;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const LAYERS: usize = 78;
const EXPERTS: usize = 256;
const TOP_K: usize = 8;

fn decisions(c: &mut Criterion) {
    let ids: Vec<Vec<usize>> = (0..LAYERS)
        .map(|l| (0..TOP_K).map(|k| (l * 31 + k * 37) % EXPERTS).collect())
        .collect();
    let gates = [0.125f32; TOP_K];
    let mut group = c.benchmark_group("route_trace per token (78 MoE layers)");
    group.throughput(Throughput::Elements(LAYERS as u64));
    let mut counting = RouteTrace::new("glm_moe_dsa", LAYERS, EXPERTS).expect("shape");
    group.bench_function("count", |b| {
        b.iter(|| {
            for (layer, ids) in ids.iter().enumerate() {
                counting.moe_call(layer).route(0, black_box(ids), &gates);
            }
        })
    });
    let dir = tempfile::tempdir().expect("temporary directory");
    let mut tracing = RouteTrace::new("glm_moe_dsa", LAYERS, EXPERTS).expect("shape");
    tracing
        .open_trace(&dir.path().join("trace.txt"))
        .expect("trace file");
    group.bench_function("count + ROUTE_TRACE", |b| {
        b.iter(|| {
            for (layer, ids) in ids.iter().enumerate() {
                tracing.moe_call(layer).route(0, black_box(ids), &gates);
            }
        })
    });
    group.finish();
}

criterion_group!(benches, decisions);
criterion_main!(benches);
