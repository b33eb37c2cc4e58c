//! GLM-5.2 (`glm_moe_dsa`) at its published width, measured per phase against the
//! machine's limits measured in the same run.
//!
//! The model is GLM-5.2's configuration (`zai-org/GLM-5.2` `config.json`, in
//! ../shared/reference/glm_cli_formats.md §3.1): hidden 6144, 64 MLA heads (q/kv LoRA ranks
//! 2048/512, qk 192+64, v 256), a DSA indexer of 32 heads of 128 keeping the top 2048 keys,
//! routed experts of width 2048 (top 8, sigmoid with a correction bias, scaling 2.5) plus
//! one shared expert, dense layers of width 12288, vocabulary 154,880, RoPE theta 8e6. It
//! has one dense layer and `--moe-layers` (2) with experts instead of 3 + 75, and
//! `--experts` (16) experts per layer instead of 256, because the disk is short: a token's
//! work is the same (its top 8, the shared expert, the same attention), only the router's
//! 6144-wide rows are fewer. The weights are random bf16 (their values do not change a
//! forward's speed), converted with `coli convert` to int8 per row, int4 in groups of 64
//! (experts; the rest int8) and FP8 with 128x128 block scales (`weight_scale_inv`, as
//! published).
//!
//! For each container it reports, with every expert resident and every page touched:
//! - decode: each phase's time per token (attention with the indexer inside it, routed
//!   experts, shared expert, dense MLP, LM head) against the bytes it reads at the measured
//!   memory bandwidth;
//! - prefill of `--prefill` tokens (512 and 4096 by default): the matrices' multiply-adds
//!   per second against the measured FMA peak, with f32 and (`act8` rows) int8 activations;
//! - the state's bytes per token of context;
//! - a decode step after `--context` tokens of context (none by default: each costs a
//!   prefill of that length), against the step at the 32-token prompt.
//!
//! `cargo bench --bench real_width`, `-- --only int8-row --prefill 512 --context 2048`.
//! The models are kept in `--dir` (default: `coli-glm52-bench` in the system temporary
//! directory; about 8 GB of bf16 source and 3-4 GB per container) and reused.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use coli::convert::Precision;
use coli::engines::{self, Engine, LoadOptions, Logits, State};
use coli::experts::{Budget, StoreOptions};
use coli::profile::{self, Phase};
use coli::quant::Width;
use coli::sampling::argmax;
use coli::snapshot::Snapshot;
use machine::{bandwidth, fma_peak, load_average, touch};
use random_model::{convert, stored_bytes, write_bf16, Container};

mod machine;
mod random_model;

const HIDDEN: usize = 6144;
const HEADS: usize = 64;
const Q_LORA: usize = 2048;
const KV_LORA: usize = 512;
const QK_NOPE: usize = 192;
const QK_ROPE: usize = 64;
const V_HEAD: usize = 256;
const INDEX_HEADS: usize = 32;
const INDEX_DIM: usize = 128;
const INDEX_TOP_K: usize = 2048;
const EXPERT_WIDTH: usize = 2048;
const TOP_K: usize = 8;
const DENSE_WIDTH: usize = 12288;
const VOCAB: usize = 154_880;

const PROMPT: usize = 32;
const DECODE: usize = 16;

/// The published containers, and int8 throughout.
const CONTAINERS: [Container; 3] = [
    Container {
        label: "int8-row",
        expert_bits: Precision::Bits(8),
        dense_bits: Precision::Bits(8),
        io_bits: Precision::Bits(8),
    },
    Container {
        label: "int4-g64",
        expert_bits: Precision::Bits(4),
        dense_bits: Precision::Bits(8),
        io_bits: Precision::Bits(8),
    },
    Container {
        label: "fp8",
        expert_bits: Precision::Fp8,
        dense_bits: Precision::Fp8,
        io_bits: Precision::Fp8,
    },
];

struct Args {
    dir: PathBuf,
    experts: usize,
    moe_layers: usize,
    repeat: usize,
    prefill: Vec<usize>,
    context: Vec<usize>,
    /// Container labels to run; empty runs all.
    only: Vec<String>,
}

fn args() -> Args {
    let mut parsed = Args {
        dir: std::env::temp_dir().join("coli-glm52-bench"),
        experts: 16,
        moe_layers: 2,
        repeat: 2,
        prefill: vec![512, 4096],
        context: Vec::new(),
        only: Vec::new(),
    };
    let argv: Vec<String> = std::env::args().collect();
    let value = |i: usize| argv.get(i + 1).cloned().unwrap_or_default();
    let list = |i: usize, flag: &str| -> Vec<usize> {
        value(i)
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap_or_else(|_| panic!("{flag} takes numbers")))
            .collect()
    };
    for (i, arg) in argv.iter().enumerate() {
        match arg.as_str() {
            "--dir" => parsed.dir = PathBuf::from(value(i)),
            "--experts" => parsed.experts = value(i).parse().expect("--experts takes a number"),
            "--moe-layers" => {
                parsed.moe_layers = value(i).parse().expect("--moe-layers takes a number")
            }
            "--repeat" => parsed.repeat = value(i).parse().expect("--repeat takes a number"),
            "--prefill" => parsed.prefill = list(i, "--prefill"),
            "--context" => parsed.context = list(i, "--context"),
            "--only" => parsed.only = value(i).split(',').map(str::to_string).collect(),
            _ => {}
        }
    }
    assert!(
        parsed.experts >= TOP_K,
        "--experts must be at least the top-k ({TOP_K})"
    );
    parsed
}

/// The shape of the benchmark model: 1 dense layer, then `moe_layers` with `experts`.
#[derive(Clone, Copy)]
struct Shape {
    experts: usize,
    moe_layers: usize,
}

impl Shape {
    fn layers(self) -> usize {
        1 + self.moe_layers
    }

    fn config(self) -> serde_json::Value {
        let layers = self.layers();
        let mlp_types: Vec<&str> = (0..layers)
            .map(|l| if l == 0 { "dense" } else { "sparse" })
            .collect();
        serde_json::json!({
            "architectures": ["GlmMoeDsaForCausalLM"],
            "model_type": "glm_moe_dsa",
            "attention_bias": false,
            "first_k_dense_replace": 1,
            "head_dim": QK_ROPE,
            "hidden_act": "silu",
            "hidden_size": HIDDEN,
            "index_head_dim": INDEX_DIM,
            "index_n_heads": INDEX_HEADS,
            "index_topk": INDEX_TOP_K,
            // GLM-5.2's first layers all run their own indexer.
            "indexer_types": vec!["full"; layers],
            "intermediate_size": DENSE_WIDTH,
            "kv_lora_rank": KV_LORA,
            "layer_types": vec!["indexed_attention"; layers],
            "max_position_embeddings": 1_048_576,
            "mlp_layer_types": mlp_types,
            "moe_intermediate_size": EXPERT_WIDTH,
            "n_group": 1,
            "n_routed_experts": self.experts,
            "n_shared_experts": 1,
            "norm_topk_prob": true,
            "num_attention_heads": HEADS,
            "num_experts_per_tok": TOP_K,
            "num_hidden_layers": layers,
            "num_key_value_heads": HEADS,
            "q_lora_rank": Q_LORA,
            "qk_head_dim": QK_NOPE + QK_ROPE,
            "qk_nope_head_dim": QK_NOPE,
            "qk_rope_head_dim": QK_ROPE,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_theta": 8_000_000.0, "rope_type": "default"},
            "routed_scaling_factor": 2.5,
            "tie_word_embeddings": false,
            "topk_group": 1,
            "v_head_dim": V_HEAD,
            "vocab_size": VOCAB,
            "eos_token_id": 2,
        })
    }

    /// Name and shape of every tensor, in file order.
    fn tensors(self) -> Vec<(String, Vec<usize>)> {
        let mut list = vec![
            ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
            ("lm_head.weight".to_string(), vec![VOCAB, HIDDEN]),
            ("model.norm.weight".to_string(), vec![HIDDEN]),
        ];
        let mlp = |list: &mut Vec<(String, Vec<usize>)>, prefix: String, width: usize| {
            list.push((format!("{prefix}.gate_proj.weight"), vec![width, HIDDEN]));
            list.push((format!("{prefix}.up_proj.weight"), vec![width, HIDDEN]));
            list.push((format!("{prefix}.down_proj.weight"), vec![HIDDEN, width]));
        };
        for l in 0..self.layers() {
            let p = format!("model.layers.{l}");
            for (name, shape) in [
                ("input_layernorm.weight", vec![HIDDEN]),
                ("post_attention_layernorm.weight", vec![HIDDEN]),
                ("self_attn.q_a_layernorm.weight", vec![Q_LORA]),
                ("self_attn.kv_a_layernorm.weight", vec![KV_LORA]),
                ("self_attn.indexer.k_norm.weight", vec![INDEX_DIM]),
                ("self_attn.indexer.k_norm.bias", vec![INDEX_DIM]),
            ] {
                list.push((format!("{p}.{name}"), shape));
            }
            for (name, shape) in attention_matrices() {
                list.push((format!("{p}.{name}"), shape.to_vec()));
            }
            if l == 0 {
                mlp(&mut list, format!("{p}.mlp"), DENSE_WIDTH);
                continue;
            }
            list.push((format!("{p}.mlp.gate.weight"), vec![self.experts, HIDDEN]));
            list.push((
                format!("{p}.mlp.gate.e_score_correction_bias"),
                vec![self.experts],
            ));
            mlp(&mut list, format!("{p}.mlp.shared_experts"), EXPERT_WIDTH);
            for e in 0..self.experts {
                mlp(&mut list, format!("{p}.mlp.experts.{e}"), EXPERT_WIDTH);
            }
        }
        list
    }
}

/// A layer's attention matrices (MLA and the DSA indexer): name under the layer and shape.
fn attention_matrices() -> [(&'static str, [usize; 2]); 8] {
    [
        ("self_attn.q_a_proj.weight", [Q_LORA, HIDDEN]),
        (
            "self_attn.q_b_proj.weight",
            [HEADS * (QK_NOPE + QK_ROPE), Q_LORA],
        ),
        (
            "self_attn.kv_a_proj_with_mqa.weight",
            [KV_LORA + QK_ROPE, HIDDEN],
        ),
        (
            "self_attn.kv_b_proj.weight",
            [HEADS * (QK_NOPE + V_HEAD), KV_LORA],
        ),
        ("self_attn.o_proj.weight", [HIDDEN, HEADS * V_HEAD]),
        (
            "self_attn.indexer.wq_b.weight",
            [INDEX_HEADS * INDEX_DIM, Q_LORA],
        ),
        ("self_attn.indexer.wk.weight", [INDEX_DIM, HIDDEN]),
        (
            "self_attn.indexer.weights_proj.weight",
            [INDEX_HEADS, HIDDEN],
        ),
    ]
}

/// The phases of the `PROFILE:` line a forward is split into here.
const PHASES: [(Phase, &str); 6] = [
    (Phase::Attention, "attention"),
    (Phase::Indexer, "  indexer"),
    (Phase::ExpertMatmul, "routed experts"),
    (Phase::SharedExpert, "shared expert"),
    (Phase::DenseFfn, "dense MLP"),
    (Phase::LmHead, "LM head"),
];

/// Weight bytes and multiply-adds per row of each phase in [`PHASES`] (the indexer's
/// within attention's); the LM head's bytes are read once per forward.
struct Work {
    bytes: [usize; 6],
    multiply_adds: [usize; 6],
}

fn work(snapshot: &Snapshot, shape: Shape) -> Work {
    let mut bytes = [0usize; 6];
    let mut multiply_adds = [0usize; 6];
    let mut add = |phase: usize, name: &str, params: usize| {
        bytes[phase] += stored_bytes(snapshot, name);
        multiply_adds[phase] += params;
    };
    let mlp = |add: &mut dyn FnMut(usize, &str, usize), phase, prefix: &str, width| {
        for m in ["gate_proj", "up_proj", "down_proj"] {
            add(phase, &format!("{prefix}.{m}.weight"), width * HIDDEN);
        }
    };
    for l in 0..shape.layers() {
        let p = format!("model.layers.{l}");
        for (name, [rows, cols]) in attention_matrices() {
            let name = format!("{p}.{name}");
            add(0, &name, rows * cols);
            if name.contains("indexer") {
                add(1, &name, rows * cols);
            }
        }
        if l == 0 {
            mlp(&mut add, 4, &format!("{p}.mlp"), DENSE_WIDTH);
            continue;
        }
        for _ in 0..TOP_K {
            // Every expert of a layer has the same format and size.
            mlp(&mut add, 2, &format!("{p}.mlp.experts.0"), EXPERT_WIDTH);
        }
        mlp(
            &mut add,
            3,
            &format!("{p}.mlp.shared_experts"),
            EXPERT_WIDTH,
        );
    }
    add(5, "lm_head.weight", VOCAB * HIDDEN);
    Work {
        bytes,
        multiply_adds,
    }
}

/// Each phase's time over `f`.
fn phase_times(f: impl FnOnce()) -> ([Duration; 6], Duration) {
    let before = PHASES.map(|(phase, _)| profile::total(phase));
    let started = Instant::now();
    f();
    let wall = started.elapsed();
    let mut times = [Duration::ZERO; 6];
    for (i, (phase, _)) in PHASES.iter().enumerate() {
        times[i] = profile::total(*phase) - before[i];
    }
    (times, wall)
}

fn tokens(count: usize, seed: u32) -> Vec<u32> {
    (0..count as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(seed)) % VOCAB as u32)
        .collect()
}

/// `DECODE` greedy steps after `state`'s context: per-phase time and wall time per step.
fn decode(engine: &dyn Engine, state: &mut State, first: u32) -> ([Duration; 6], Duration) {
    let mut token = first;
    let (times, wall) = phase_times(|| {
        for _ in 0..DECODE {
            let logits = engine
                .forward_one(state, &[token], Logits::Last)
                .expect("decode step");
            token = argmax(&logits);
        }
    });
    (times.map(|t| t / DECODE as u32), wall / DECODE as u32)
}

fn load(dir: &Path, experts: usize) -> Box<dyn Engine> {
    let snapshot = Snapshot::open(dir).expect("open the model");
    touch(&snapshot);
    let options = LoadOptions {
        store: StoreOptions {
            budget: Budget::fixed(40 << 30),
            ..StoreOptions::mapped(experts, Width::F32)
        },
        ..LoadOptions::exact(experts)
    };
    engines::load("glm_moe_dsa", &snapshot, options).expect("load the model")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report_decode(label: &str, work: &Work, times: &[Duration; 6], wall: Duration, bw: f64) {
    let bytes: usize = work.bytes.iter().sum::<usize>() - work.bytes[1];
    println!(
        "{label}: decode {:.1} ms/token ({:.2} tok/s), {:.0} MB of weights a token: {:.1} GB/s, {:.0}% of the bandwidth",
        ms(wall),
        1.0 / wall.as_secs_f64(),
        bytes as f64 / 1e6,
        bytes as f64 / wall.as_secs_f64() / 1e9,
        100.0 * bytes as f64 / wall.as_secs_f64() / bw
    );
    println!(
        "  {:<16} {:>9} {:>9} {:>8} {:>7}",
        "phase", "ms/token", "MB", "GB/s", "of bw"
    );
    for (i, (_, name)) in PHASES.iter().enumerate() {
        let rate = work.bytes[i] as f64 / times[i].as_secs_f64();
        println!(
            "  {name:<16} {:>9.2} {:>9.1} {:>8.1} {:>6.0}%",
            ms(times[i]),
            work.bytes[i] as f64 / 1e6,
            rate / 1e9,
            100.0 * rate / bw
        );
    }
    let timed: Duration = times.iter().sum::<Duration>() - times[1];
    println!("  {:<16} {:>9.2}", "other", ms(wall.saturating_sub(timed)));
}

fn report_prefill(
    label: &str,
    n: usize,
    work: &Work,
    times: &[Duration; 6],
    wall: Duration,
    peak: Option<f64>,
) {
    // The LM head runs on the last row alone.
    let rows_madds: usize = work.multiply_adds[..5].iter().sum::<usize>() - work.multiply_adds[1];
    let madds = (rows_madds * n + work.multiply_adds[5]) as f64;
    let rate = madds / wall.as_secs_f64();
    let of_peak = peak.map_or(String::new(), |p| {
        format!(", {:.0}% of the FMA peak", 100.0 * rate / p)
    });
    println!(
        "{label}: prefill {n} tokens in {:.2} s ({:.1} tok/s): {:.1} G matrix multiply-adds/s{of_peak}",
        wall.as_secs_f64(),
        n as f64 / wall.as_secs_f64(),
        rate / 1e9
    );
    let parts: Vec<String> = PHASES
        .iter()
        .zip(times)
        .map(|((_, name), t)| format!("{} {:.2} s", name.trim(), t.as_secs_f64()))
        .collect();
    println!("  {}", parts.join(" | "));
}

fn main() {
    let args = args();
    let shape = Shape {
        experts: args.experts,
        moe_layers: args.moe_layers,
    };
    let name = format!("{}e-{}l", shape.experts, shape.layers());
    let source = args.dir.join(format!("bf16-{name}"));
    let started = Instant::now();
    write_bf16(&source, &shape.config(), &shape.tensors());
    println!(
        "model: {} ({:.1} s)",
        source.display(),
        started.elapsed().as_secs_f64()
    );
    let bw = bandwidth();
    let peak = fma_peak();
    println!(
        "threads: {} | measured read bandwidth: {:.2} GB/s | f32 FMA peak: {} | load average: {}",
        rayon::current_num_threads(),
        bw / 1e9,
        peak.map_or("none".to_string(), |p| format!(
            "{:.1} G multiply-adds/s",
            p / 1e9
        )),
        load_average()
    );
    let wanted = |label: &str| args.only.is_empty() || args.only.iter().any(|o| o == label);
    for spec in CONTAINERS.iter().filter(|spec| wanted(spec.label)) {
        let dir = convert(
            &source,
            args.dir.join(format!("{}-{name}", spec.label)),
            spec,
        );
        let snapshot = Snapshot::open(&dir).expect("open the container");
        let work = work(&snapshot, shape);
        drop(snapshot);
        let engine = load(&dir, shape.experts);
        let prompt = tokens(PROMPT, 13);
        // Untimed: the first forwards fault in and warm what the timed ones use.
        let mut state = engine.new_state();
        engine
            .forward_one(&mut state, &prompt, Logits::Last)
            .expect("prefill");
        decode(engine.as_ref(), &mut state, 3);
        let mut best: Option<([Duration; 6], Duration)> = None;
        for _ in 0..args.repeat.max(1) {
            let mut state = engine.new_state();
            let logits = engine
                .forward_one(&mut state, &prompt, Logits::Last)
                .expect("prefill");
            let run = decode(engine.as_ref(), &mut state, argmax(&logits));
            if best.is_none_or(|(_, wall)| run.1 < wall) {
                best = Some(run);
            }
        }
        let (times, wall) = best.expect("at least one run");
        report_decode(spec.label, &work, &times, wall, bw);
        let activations: &[bool] = if spec.expert_bits == Precision::Fp8 {
            // FP8 weights multiply f32 activations only.
            &[false]
        } else {
            &[false, true]
        };
        for &act8 in activations {
            coli::quant::act8::select(act8);
            let label = format!("{}{}", spec.label, if act8 { " act8" } else { "" });
            for &n in &args.prefill {
                let long = tokens(n, 7);
                let mut state = engine.new_state();
                let (times, wall) = phase_times(|| {
                    engine
                        .forward_one(&mut state, &long, Logits::Last)
                        .expect("prefill");
                });
                report_prefill(&label, n, &work, &times, wall, peak);
                println!(
                    "  state: {:.1} KB a token of context ({:.1} MB at {n})",
                    state.size_bytes() as f64 / n as f64 / 1e3,
                    state.size_bytes() as f64 / 1e6
                );
            }
        }
        coli::quant::act8::select(false);
        for &context in &args.context {
            let mut state = engine.new_state();
            engine
                .forward_one(&mut state, &tokens(context, 11), Logits::Last)
                .expect("context prefill");
            let (times, step) = decode(engine.as_ref(), &mut state, 5);
            println!(
                "{}: decode step at {context} tokens of context: {:.1} ms ({:.2}x the {PROMPT}-token one; attention {:.2} ms, indexer {:.2} ms)",
                spec.label,
                ms(step),
                step.as_secs_f64() / wall.as_secs_f64(),
                ms(times[0]),
                ms(times[1])
            );
        }
    }
    println!("load average after: {}", load_average());
}
