//! End-to-end decode on a real-shape OLMoE: hidden 2048, 16 heads, 64 experts (top 8) of
//! width 1024, vocabulary 50304, `--layers` layers (4 by default, about 3.6 GB in bf16).
//! The benchmark writes that model with random bf16 weights, converts it with
//! `coli convert` to int8, to int4 in groups of 64 (embedding and head int8, and once with
//! them int4 too: `int4-g64-all`, the bytes of llama.cpp's `--pure` Q4_0), to FP8 and to
//! MXFP4 (embedding and head int8), and for the bf16 source and each container runs a 32-token prompt and 64 greedy decode steps
//! with every expert resident (64 slots per layer, every page of the shards touched, one
//! untimed warm-up generation first, then the best of `--repeat` runs, 3 by default). It
//! reports prefill and decode tokens per second, the weight bytes one decoded token reads,
//! and the achieved rate as a fraction of the machine's measured memory read bandwidth. A
//! 512-token prompt is timed on its own in each run too (`pp512`: one forward). The
//! containers but FP8 run a second time with int8 activations (`ACT_BITS=8`, rows `act8`).
//!
//! `cargo bench --bench decode` or `cargo bench --bench decode -- --layers 8`;
//! `--only int8-row,fp8` runs those rows alone (`bf16` names the source). The model and
//! containers are kept in `--dir` (default: `coli-olmoe-bench` in the system temporary
//! directory) and reused by later runs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use coli::convert::Precision;
use coli::engines::{self, LoadOptions, Logits};
use coli::experts::{Budget, StoreOptions};
use coli::generate::greedy;
use coli::quant::Width;
use coli::snapshot::Snapshot;
use common::{container, expert_bytes, source_model};
use common::{CONTAINERS, EXPERTS, TOP_K, VOCAB};
use machine::{bandwidth, load_average, touch};
use random_model::stored_bytes;

mod common;
mod machine;
mod random_model;

const PROMPT: usize = 32;
/// A long prompt, timed on its own (one forward, the last position's logits).
const LONG_PROMPT: usize = 512;
const DECODE: usize = 64;

struct Args {
    layers: usize,
    dir: PathBuf,
    repeat: usize,
    /// Row labels to run; empty runs all.
    only: Vec<String>,
}

fn args() -> Args {
    let mut parsed = Args {
        layers: 4,
        dir: common::default_dir(),
        repeat: 3,
        only: Vec::new(),
    };
    let argv: Vec<String> = std::env::args().collect();
    let value = |i: usize| argv.get(i + 1).cloned().unwrap_or_default();
    for (i, arg) in argv.iter().enumerate() {
        match arg.as_str() {
            "--layers" => parsed.layers = value(i).parse().expect("--layers takes a number"),
            "--dir" => parsed.dir = PathBuf::from(value(i)),
            "--repeat" => parsed.repeat = value(i).parse().expect("--repeat takes a number"),
            "--only" => parsed.only = value(i).split(',').map(str::to_string).collect(),
            _ => {}
        }
    }
    parsed
}

/// Weight bytes one decoded token reads: every attention projection and router, the
/// top-k experts of every layer, and the LM head (the embedding row is negligible).
fn bytes_per_token(snapshot: &Snapshot, layers: usize) -> usize {
    let mut total = stored_bytes(snapshot, "lm_head.weight");
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            total += stored_bytes(snapshot, &format!("{p}.self_attn.{proj}.weight"));
        }
        total += stored_bytes(snapshot, &format!("{p}.mlp.gate.weight"));
        total += TOP_K * expert_bytes(snapshot, l);
    }
    total
}

struct Figures {
    prefill: f64,
    long_prefill: f64,
    decode: f64,
    bytes: usize,
}

/// The best of `repeat` measured generations (other work on a shared machine only ever
/// slows a run down).
fn run(dir: &Path, layers: usize, repeat: usize) -> Figures {
    let snapshot = Snapshot::open(dir).expect("open the model");
    touch(&snapshot);
    let options = LoadOptions {
        store: StoreOptions {
            budget: Budget::fixed(20 << 30),
            ..StoreOptions::mapped(EXPERTS, Width::F32)
        },
        ..LoadOptions::exact(EXPERTS)
    };
    let engine = engines::load("olmoe", &snapshot, options).expect("load the model");
    let prompt: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 7919 + 13) % VOCAB as u32)
        .collect();
    // Untimed: loads every expert the prompt and the decode touch.
    greedy(engine.as_ref(), &prompt, DECODE).expect("warm-up generation");
    let long: Vec<u32> = (0..LONG_PROMPT as u32)
        .map(|i| (i * 104_729 + 7) % VOCAB as u32)
        .collect();
    let mut best = Figures {
        prefill: 0.0,
        long_prefill: 0.0,
        decode: 0.0,
        bytes: bytes_per_token(&snapshot, layers),
    };
    for _ in 0..repeat.max(1) {
        let generation = greedy(engine.as_ref(), &prompt, DECODE).expect("generation");
        best.prefill = best.prefill.max(PROMPT as f64 / generation.prefill_seconds);
        best.decode = best.decode.max(generation.decode_tokens_per_second());
        let mut state = engine.new_state();
        let started = Instant::now();
        engine
            .forward_one(&mut state, &long, Logits::Last)
            .expect("long prefill");
        best.long_prefill = best
            .long_prefill
            .max(LONG_PROMPT as f64 / started.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let args = args();
    let source = source_model(&args.dir, args.layers);
    let wanted = |label: &str| args.only.is_empty() || args.only.iter().any(|o| o == label);
    // (label, model, int8 activations)
    let mut rows = Vec::new();
    if wanted("bf16") {
        rows.push(("bf16 (source)".to_string(), source.clone(), false));
    }
    let mut integer = Vec::new();
    for spec in CONTAINERS.iter().filter(|spec| wanted(spec.label)) {
        let dst = container(&source, &args.dir, args.layers, spec);
        rows.push((spec.label.to_string(), dst.clone(), false));
        // `ACT_BITS=8` multiplies integer and MXFP4 weights; FP8 keeps f32 activations.
        if spec.expert_bits != Precision::Fp8 {
            integer.push((format!("{} act8", spec.label), dst, true));
        }
    }
    let bandwidth = bandwidth();
    println!(
        "threads: {} | measured read bandwidth: {:.2} GB/s | load average: {}",
        rayon::current_num_threads(),
        bandwidth / 1e9,
        load_average()
    );
    println!(
        "{:<18} {:>10} {:>11} {:>10} {:>12} {:>9} {:>10}",
        "weights", "pp32/s", "pp512/s", "decode/s", "MB/token", "GB/s", "of bw"
    );
    for (label, dir, act8) in rows.into_iter().chain(integer) {
        coli::quant::act8::select(act8);
        let f = run(&dir, args.layers, args.repeat);
        let achieved = f.bytes as f64 * f.decode;
        println!(
            "{label:<18} {:>10.1} {:>11.1} {:>10.2} {:>12.1} {:>9.2} {:>9.0}%",
            f.prefill,
            f.long_prefill,
            f.decode,
            f.bytes as f64 / 1e6,
            achieved / 1e9,
            100.0 * achieved / bandwidth
        );
    }
    println!("load average after: {}", load_average());
}
