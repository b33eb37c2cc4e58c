//! End-to-end decode on a real-shape OLMoE: hidden 2048, 16 heads, 64 experts (top 8) of
//! width 1024, vocabulary 50304, `--layers` layers (4 by default, about 3.6 GB in bf16).
//! The benchmark writes that model with random bf16 weights, converts it with
//! `coli convert` to int8 and to int4 in groups of 64 (embedding and head int8), and for
//! the bf16 source and each container runs a 32-token prompt and 64 greedy decode steps
//! with every expert resident (64 slots per layer, every page of the shards touched, one
//! untimed warm-up generation first, then the best of `--repeat` runs, 3 by default). It
//! reports prefill and decode tokens per second, the weight bytes one decoded token reads,
//! and the achieved rate as a fraction of the machine's measured memory read bandwidth.
//!
//! `cargo bench --bench decode` or `cargo bench --bench decode -- --layers 8`; the model and
//! containers are kept in `--dir` (default: `coli-olmoe-bench` in the system temporary
//! directory) and reused by later runs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use coli::convert::{self, Options};
use coli::engines::{self, LoadOptions};
use coli::generate::greedy;
use coli::quant::Width;
use coli::snapshot::Snapshot;
use half::bf16;
use rayon::prelude::*;

const HIDDEN: usize = 2048;
const HEADS: usize = 16;
const EXPERTS: usize = 64;
const TOP_K: usize = 8;
const INTER: usize = 1024;
const VOCAB: usize = 50304;
const PROMPT: usize = 32;
const DECODE: usize = 64;

struct Args {
    layers: usize,
    dir: PathBuf,
    repeat: usize,
}

fn args() -> Args {
    let mut parsed = Args {
        layers: 4,
        dir: std::env::temp_dir().join("coli-olmoe-bench"),
        repeat: 3,
    };
    let argv: Vec<String> = std::env::args().collect();
    let value = |i: usize| argv.get(i + 1).cloned().unwrap_or_default();
    for (i, arg) in argv.iter().enumerate() {
        match arg.as_str() {
            "--layers" => parsed.layers = value(i).parse().expect("--layers takes a number"),
            "--dir" => parsed.dir = PathBuf::from(value(i)),
            "--repeat" => parsed.repeat = value(i).parse().expect("--repeat takes a number"),
            _ => {}
        }
    }
    parsed
}

/// The model's tensors: name and shape, in file order.
fn tensors(layers: usize) -> Vec<(String, Vec<usize>)> {
    let mut list = vec![
        ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("lm_head.weight".to_string(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".to_string(), vec![HIDDEN]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_norm",
            "self_attn.k_norm",
        ] {
            list.push((format!("{p}.{norm}.weight"), vec![HIDDEN]));
        }
        for proj in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            list.push((format!("{p}.self_attn.{proj}.weight"), vec![HIDDEN, HIDDEN]));
        }
        list.push((format!("{p}.mlp.gate.weight"), vec![EXPERTS, HIDDEN]));
        for e in 0..EXPERTS {
            let x = format!("{p}.mlp.experts.{e}");
            list.push((format!("{x}.gate_proj.weight"), vec![INTER, HIDDEN]));
            list.push((format!("{x}.up_proj.weight"), vec![INTER, HIDDEN]));
            list.push((format!("{x}.down_proj.weight"), vec![HIDDEN, INTER]));
        }
    }
    list
}

/// Random bf16 weights (uniform, standard deviation about 0.03; norm weights 1), written as
/// one safetensors file with a `config.json`, unless already there.
fn generate(dir: &Path, layers: usize) {
    let shard = dir.join("model.safetensors");
    if shard.exists() {
        return;
    }
    std::fs::create_dir_all(dir).expect("create the model directory");
    let config = serde_json::json!({
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "num_experts": EXPERTS,
        "num_experts_per_tok": TOP_K,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "norm_topk_prob": false,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config.json");
    let list = tensors(layers);
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in &list {
        let bytes = shape.iter().product::<usize>() * 2;
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut json = serde_json::to_vec(&header).expect("header");
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let partial = dir.join(".model.safetensors.partial");
    let mut out =
        BufWriter::with_capacity(16 << 20, File::create(&partial).expect("create the shard"));
    out.write_all(&(json.len() as u64).to_le_bytes())
        .expect("write");
    out.write_all(&json).expect("write");
    for (index, (name, shape)) in list.iter().enumerate() {
        let count: usize = shape.iter().product();
        let norm = name.contains("norm");
        let bytes: Vec<u8> = (0..count)
            .into_par_iter()
            .with_min_len(1 << 16)
            .flat_map_iter(|i| {
                let value = if norm {
                    1.0
                } else {
                    // A counter-based hash, so the weights do not depend on thread timing.
                    let mut z =
                        ((index as u64) << 40 ^ i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                    z ^= z >> 29;
                    ((z >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1
                };
                bf16::from_f32(value).to_le_bytes()
            })
            .collect();
        out.write_all(&bytes).expect("write");
    }
    out.flush().expect("write");
    drop(out);
    std::fs::rename(&partial, &shard).expect("rename the shard");
}

/// Read bandwidth: a multi-threaded sum over 1 GiB, best of five.
fn bandwidth() -> f64 {
    let buffer: Vec<u64> = (0..(1usize << 30) / 8).map(|i| i as u64).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let started = Instant::now();
        let sum = buffer
            .par_chunks(1 << 16)
            .map(|chunk| {
                let mut acc = [0u64; 4];
                for quad in chunk.chunks_exact(4) {
                    for lane in 0..4 {
                        acc[lane] = acc[lane].wrapping_add(quad[lane]);
                    }
                }
                acc.iter().fold(0u64, |a, &v| a.wrapping_add(v))
            })
            .reduce(|| 0, u64::wrapping_add);
        std::hint::black_box(sum);
        best = best.max((buffer.len() * 8) as f64 / started.elapsed().as_secs_f64());
    }
    best
}

/// Bytes of `name` and its scale tensor, if any.
fn stored_bytes(snapshot: &Snapshot, name: &str) -> usize {
    let view = snapshot.tensor(name).expect("tensor");
    view.bytes.len() + view.scales.map_or(0, |s| s.bytes.len())
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
        let expert: usize = ["gate_proj", "up_proj", "down_proj"]
            .iter()
            .map(|m| stored_bytes(snapshot, &format!("{p}.mlp.experts.0.{m}.weight")))
            .sum();
        total += TOP_K * expert;
    }
    total
}

/// Touch every page of every tensor through the snapshot's mappings, so no decode step
/// pays a page fault.
fn touch(snapshot: &Snapshot) {
    let names: Vec<&str> = snapshot.names().collect();
    let sum: u64 = names
        .par_iter()
        .map(|name| {
            let view = snapshot.tensor(name).expect("tensor");
            view.bytes
                .as_slice()
                .iter()
                .step_by(4096)
                .map(|&b| u64::from(b))
                .sum::<u64>()
        })
        .sum();
    std::hint::black_box(sum);
}

struct Figures {
    prefill: f64,
    decode: f64,
    bytes: usize,
}

/// The best of `repeat` measured generations (other work on a shared machine only ever
/// slows a run down).
fn run(dir: &Path, layers: usize, repeat: usize) -> Figures {
    let snapshot = Snapshot::open(dir).expect("open the model");
    touch(&snapshot);
    let options = LoadOptions {
        cap: EXPERTS,
        expert_width: Width::F32,
        dense_width: Width::F32,
        ram_budget: 20 << 30,
        ..LoadOptions::exact(EXPERTS)
    };
    let mut engine = engines::load("olmoe", &snapshot, options).expect("load the model");
    let prompt: Vec<u32> = (0..PROMPT as u32)
        .map(|i| (i * 7919 + 13) % VOCAB as u32)
        .collect();
    // Untimed: loads every expert the prompt and the decode touch.
    greedy(engine.as_mut(), &prompt, DECODE).expect("warm-up generation");
    let mut best = Figures {
        prefill: 0.0,
        decode: 0.0,
        bytes: bytes_per_token(&snapshot, layers),
    };
    for _ in 0..repeat.max(1) {
        engine.reset();
        let generation = greedy(engine.as_mut(), &prompt, DECODE).expect("generation");
        best.prefill = best.prefill.max(PROMPT as f64 / generation.prefill_seconds);
        best.decode = best.decode.max(generation.decode_tokens_per_second());
    }
    best
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}

fn main() {
    let args = args();
    let source = args.dir.join(format!("bf16-{}l", args.layers));
    let started = Instant::now();
    generate(&source, args.layers);
    println!(
        "model: {} ({:.1} s)",
        source.display(),
        started.elapsed().as_secs_f64()
    );
    let containers = [("int8-row", 8, 8), ("int4-g64", 4, 8)];
    let mut rows = vec![("bf16 (source)".to_string(), source.clone())];
    for (label, bits, io_bits) in containers {
        let dst = args.dir.join(format!("{label}-{}l", args.layers));
        let options = Options {
            expert_bits: bits,
            dense_bits: bits,
            io_bits,
            group_size: 64,
            shard_bytes: 4_000_000_000,
        };
        let summary = convert::convert(&source, &dst, &options).expect("convert");
        println!("{}", convert::report(&summary, &dst));
        rows.push((label.to_string(), dst));
    }
    let bandwidth = bandwidth();
    println!(
        "threads: {} | measured read bandwidth: {:.2} GB/s | load average: {}",
        rayon::current_num_threads(),
        bandwidth / 1e9,
        load_average()
    );
    println!(
        "{:<14} {:>10} {:>10} {:>12} {:>9} {:>10}",
        "weights", "prefill/s", "decode/s", "MB/token", "GB/s", "of bw"
    );
    for (label, dir) in rows {
        let f = run(&dir, args.layers, args.repeat);
        let achieved = f.bytes as f64 * f.decode;
        println!(
            "{label:<14} {:>10.1} {:>10.2} {:>12.1} {:>9.2} {:>9.0}%",
            f.prefill,
            f.decode,
            f.bytes as f64 / 1e6,
            achieved / 1e9,
            100.0 * achieved / bandwidth
        );
    }
    println!("load average after: {}", load_average());
}
