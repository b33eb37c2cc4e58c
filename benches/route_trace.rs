//! What routing telemetry costs per routing decision: counting (the per-expert counters
//! and the expert transitions) alone, and counting plus the `ROUTE_TRACE` line; and what a
//! history save costs once a run has routed 4,000 tokens. GLM-5.2's shape (78 layers, 256
//! experts, top-8) and a decode step's single row.
//!
//! `cargo bench --bench route_trace`

use std::hint::black_box;

use coli::route_trace::{RouteTrace, SaveOptions};
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

/// Token `t`'s experts at `layer`: skewed towards low ids and correlated with the layer
/// before, as trained routers are, so that transitions have hot successors.
fn skewed(t: usize, layer: usize) -> Vec<usize> {
    let mut x = (t as u64 / 3).wrapping_mul(6364136223846793005) ^ (layer as u64 * 0x9E37);
    let mut ids = Vec::with_capacity(TOP_K);
    while ids.len() < TOP_K {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = (x >> 33) as f64 / f64::from(1u32 << 31);
        let id = ((u * u * EXPERTS as f64) as usize + layer * 7) % EXPERTS;
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

fn saves(c: &mut Criterion) {
    let gates = [0.125f32; TOP_K];
    let mut rt = RouteTrace::new("glm_moe_dsa", LAYERS, EXPERTS).expect("shape");
    for t in 0..4000 {
        for layer in 0..LAYERS {
            rt.moe_call(layer).route(0, &skewed(t, layer), &gates);
        }
    }
    let dir = tempfile::tempdir().expect("temporary directory");
    let path = dir.path().join(".coli_usage");
    rt.save_history(&path, SaveOptions::default())
        .expect("save");
    let text = std::fs::read_to_string(&path).expect("history");
    let transitions: usize = text
        .lines()
        .filter(|l| l.starts_with("-3 ") || l.starts_with("-4 "))
        .map(|l| l.len() + 1)
        .sum();
    eprintln!(
        "history after 4,000 tokens: {} bytes, of which transitions {transitions} bytes ({} groups)",
        text.len(),
        text.lines().filter(|l| l.starts_with("-3 ")).count()
    );
    c.bench_function("history save (GLM-5.2 shape, 4,000 tokens routed)", |b| {
        b.iter(|| {
            rt.save_history(&path, SaveOptions::default())
                .expect("save")
        })
    });
}

criterion_group!(benches, decisions, saves);
criterion_main!(benches);
