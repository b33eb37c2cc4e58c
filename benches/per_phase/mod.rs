//! What the published-width benchmarks (`real_width` for GLM-5.2, `real_width_kimi_k3`,
//! `real_width_inkling`) share: their command line ([`Args`]), the forward's time per phase
//! of the `PROFILE:` line ([`Row`]), each phase's weight bytes and multiply-adds a row
//! ([`Work`]), and the run over a model's containers ([`run`]) that reports decode against
//! the measured memory bandwidth, prefill against the measured FMA peak, and the state's
//! bytes per token of context. A benchmark brings its model: config, tensors, containers
//! and the [`Work`] of a container.
//!
//! Every benchmark takes `--dir`, `--experts` (per MoE layer), `--moe-layers`, `--repeat`
//! (decode runs, the best kept), `--prefill` and `--context` (comma-separated token counts),
//! `--long-context` (token counts, where the model measures a layer's growing work) and
//! `--only` (container labels).
// Each benchmark uses a different subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use coli::convert::Precision;
use coli::engines::{self, Engine, LoadOptions, Logits, State};
use coli::experts::{Budget, StoreOptions};
use coli::profile::{self, Phase};
use coli::quant::Width;
use coli::sampling::argmax;
use coli::snapshot::Snapshot;

use crate::machine::{bandwidth, fma_peak, load_average, touch};
use crate::random_model::{convert, stored_bytes, write_bf16, Container};

/// Prompt tokens before the timed decode steps.
const PROMPT: usize = 32;
/// Timed decode steps.
const DECODE: usize = 16;

struct Args {
    dir: PathBuf,
    experts: usize,
    moe_layers: usize,
    repeat: usize,
    prefill: Vec<usize>,
    context: Vec<usize>,
    /// Contexts at which [`Model::long_context`] measures a layer's growing work.
    long_context: Vec<usize>,
    /// Container labels to run; empty runs all.
    only: Vec<String>,
}

/// The command line, with `dir` (in the system temporary directory) as the default;
/// `--experts` must be at least `top_k`.
fn args(dir: &str, top_k: usize) -> Args {
    let mut parsed = Args {
        dir: std::env::temp_dir().join(dir),
        experts: 16,
        moe_layers: 2,
        repeat: 2,
        prefill: vec![512, 4096],
        context: Vec::new(),
        long_context: Vec::new(),
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
            "--long-context" => parsed.long_context = list(i, "--long-context"),
            "--only" => parsed.only = value(i).split(',').map(str::to_string).collect(),
            _ => {}
        }
    }
    assert!(
        parsed.experts >= top_k,
        "--experts must be at least the top-k ({top_k})"
    );
    assert!(parsed.moe_layers >= 1, "--moe-layers must be at least 1");
    parsed
}

/// The shape of a benchmark model: 1 dense layer, then `moe_layers` with `experts`.
#[derive(Clone, Copy)]
pub struct Shape {
    pub experts: usize,
    pub moe_layers: usize,
}

impl Shape {
    pub fn layers(self) -> usize {
        1 + self.moe_layers
    }
}

/// One phase of the `PROFILE:` line a forward is split into, and its label in the report.
#[derive(Clone, Copy)]
pub struct Row {
    pub phase: Phase,
    pub name: &'static str,
    /// Timed within another row's phase (the DSA indexer within attention), so left out of
    /// the totals.
    pub within: bool,
}

pub const ATTENTION: Row = Row {
    phase: Phase::Attention,
    name: "attention",
    within: false,
};
pub const ROUTED: Row = Row {
    phase: Phase::ExpertMatmul,
    name: "routed experts",
    within: false,
};
pub const DENSE: Row = Row {
    phase: Phase::DenseFfn,
    name: "dense MLP",
    within: false,
};
pub const LM_HEAD: Row = Row {
    phase: Phase::LmHead,
    name: "LM head",
    within: false,
};

/// The rows of a model with two shared experts and no phase within another.
pub const ROWS: [Row; 5] = [
    ATTENTION,
    ROUTED,
    Row {
        phase: Phase::SharedExpert,
        name: "shared experts",
        within: false,
    },
    DENSE,
    LM_HEAD,
];

/// Weight bytes and multiply-adds per row of each phase of a model's [`Row`]s, and of the
/// matrices no phase times (`other`: Kimi K3's latent projections); the LM head's bytes
/// are read once per forward.
pub struct Work {
    rows: &'static [Row],
    bytes: Vec<usize>,
    multiply_adds: Vec<usize>,
    other_bytes: usize,
    other_multiply_adds: usize,
}

impl Work {
    pub fn new(rows: &'static [Row]) -> Work {
        Work {
            rows,
            bytes: vec![0; rows.len()],
            multiply_adds: vec![0; rows.len()],
            other_bytes: 0,
            other_multiply_adds: 0,
        }
    }

    /// `bytes` and `params` multiply-adds a row to `phase`'s row, or to `other` for `None`.
    pub fn add_bytes(&mut self, phase: Option<Phase>, bytes: usize, params: usize) {
        let row = phase.map(|phase| {
            self.rows
                .iter()
                .position(|r| r.phase == phase)
                .expect("a phase of the model's rows")
        });
        match row {
            Some(i) => {
                self.bytes[i] += bytes;
                self.multiply_adds[i] += params;
            }
            None => {
                self.other_bytes += bytes;
                self.other_multiply_adds += params;
            }
        }
    }

    /// The tensor `name` of `snapshot` (and its scales), read whole by `phase`.
    pub fn add(&mut self, snapshot: &Snapshot, phase: Option<Phase>, name: &str, params: usize) {
        self.add_bytes(phase, stored_bytes(snapshot, name), params);
    }

    /// A layer's attention `matrices` (name under the layer `prefix` and shape).
    pub fn add_attention(
        &mut self,
        snapshot: &Snapshot,
        prefix: &str,
        matrices: &[(&str, [usize; 2])],
    ) {
        for (name, [rows, cols]) in matrices {
            let name = format!("{prefix}.{name}");
            self.add(snapshot, Some(Phase::Attention), &name, rows * cols);
        }
    }

    /// A gated MLP `prefix.{gate,up,down}_proj.weight` of `width` over `hidden`.
    pub fn add_mlp(
        &mut self,
        snapshot: &Snapshot,
        phase: Phase,
        prefix: &str,
        (hidden, width): (usize, usize),
    ) {
        for m in ["gate_proj", "up_proj", "down_proj"] {
            let name = format!("{prefix}.{m}.weight");
            self.add(snapshot, Some(phase), &name, width * hidden);
        }
    }

    /// Bytes a decode step reads: every row's but those timed within another, and `other`.
    fn total_bytes(&self) -> usize {
        self.rows
            .iter()
            .zip(&self.bytes)
            .filter(|(row, _)| !row.within)
            .map(|(_, &b)| b)
            .sum::<usize>()
            + self.other_bytes
    }

    /// Multiply-adds of a forward over `n` rows; the LM head runs on the last row alone.
    fn multiply_adds_over(&self, n: usize) -> usize {
        let (mut rows, mut once) = (self.other_multiply_adds, 0);
        for (row, &m) in self.rows.iter().zip(&self.multiply_adds) {
            match row.phase {
                _ if row.within => {}
                Phase::LmHead => once += m,
                _ => rows += m,
            }
        }
        rows * n + once
    }
}

/// int8 with one scale per row, every matrix.
pub const INT8_ROW: Container = Container {
    label: "int8-row",
    expert_bits: Precision::Bits(8),
    dense_bits: Precision::Bits(8),
    io_bits: Precision::Bits(8),
};

/// int4 experts in groups of 64, the rest int8 per row.
pub const INT4_G64: Container = Container {
    label: "int4-g64",
    expert_bits: Precision::Bits(4),
    dense_bits: Precision::Bits(8),
    io_bits: Precision::Bits(8),
};

/// The projections of an MLA layer of `heads` over `hidden`, with LoRA ranks `q_lora` and
/// `kv_lora` and head widths `qk_nope + qk_rope` (queries and keys) and `v_head`: name
/// under the layer and shape.
pub fn mla_matrices(
    hidden: usize,
    heads: usize,
    [q_lora, kv_lora, qk_nope, qk_rope, v_head]: [usize; 5],
) -> [(&'static str, [usize; 2]); 5] {
    [
        ("self_attn.q_a_proj.weight", [q_lora, hidden]),
        (
            "self_attn.q_b_proj.weight",
            [heads * (qk_nope + qk_rope), q_lora],
        ),
        (
            "self_attn.kv_a_proj_with_mqa.weight",
            [kv_lora + qk_rope, hidden],
        ),
        (
            "self_attn.kv_b_proj.weight",
            [heads * (qk_nope + v_head), kv_lora],
        ),
        ("self_attn.o_proj.weight", [hidden, heads * v_head]),
    ]
}

/// The tensors of a gated MLP `prefix.{gate,up,down}_proj.weight` of `width` over `hidden`.
pub fn mlp_tensors(prefix: &str, (hidden, width): (usize, usize)) -> [(String, Vec<usize>); 3] {
    [
        (format!("{prefix}.gate_proj.weight"), vec![width, hidden]),
        (format!("{prefix}.up_proj.weight"), vec![width, hidden]),
        (format!("{prefix}.down_proj.weight"), vec![hidden, width]),
    ]
}

/// A model the run measures: its engine, rows, vocabulary and containers, what its state
/// holds, the command line's defaults, and how to write it and count its [`Work`].
pub struct Model {
    pub engine: &'static str,
    /// `--dir`'s default, in the system temporary directory.
    pub dir: &'static str,
    /// Experts a row takes: the least `--experts`.
    pub top_k: usize,
    pub rows: &'static [Row],
    pub vocab: usize,
    pub containers: &'static [Container],
    /// What grows with the context and what a new state already holds, for a state that
    /// holds something before its first token (recurrent and convolution states).
    pub state_parts: Option<(&'static str, &'static str)>,
    pub config: fn(Shape) -> serde_json::Value,
    /// Name and shape of every tensor, in file order.
    pub tensors: fn(Shape) -> Vec<(String, Vec<usize>)>,
    /// The [`Work`] of a container.
    pub work: fn(&Snapshot, Shape) -> Work,
    /// Where the model's decode step grows with the context: the part of one layer's step
    /// that grows, measured at each of `--long-context` tokens (a container's directory and
    /// label, the contexts).
    pub long_context: Option<fn(&Path, &str, &[usize])>,
}

/// Each row's time over `f`, and its wall time.
fn phase_times(rows: &[Row], f: impl FnOnce()) -> (Vec<Duration>, Duration) {
    let before: Vec<Duration> = rows.iter().map(|r| profile::total(r.phase)).collect();
    let started = Instant::now();
    f();
    let wall = started.elapsed();
    let times = rows
        .iter()
        .zip(before)
        .map(|(r, before)| profile::total(r.phase) - before)
        .collect();
    (times, wall)
}

fn tokens(count: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..count as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(seed)) % vocab as u32)
        .collect()
}

/// `DECODE` greedy steps after `state`'s context: per-phase time and wall time per step.
fn decode(
    engine: &dyn Engine,
    rows: &[Row],
    state: &mut State,
    first: u32,
) -> (Vec<Duration>, Duration) {
    let mut token = first;
    let (times, wall) = phase_times(rows, || {
        for _ in 0..DECODE {
            let logits = engine
                .forward_one(state, &[token], Logits::Last)
                .expect("decode step");
            token = argmax(&logits);
        }
    });
    (
        times.into_iter().map(|t| t / DECODE as u32).collect(),
        wall / DECODE as u32,
    )
}

fn load(engine: &str, dir: &Path, experts: usize) -> Box<dyn Engine> {
    let snapshot = Snapshot::open(dir).expect("open the model");
    touch(&snapshot);
    let options = LoadOptions {
        store: StoreOptions {
            budget: Budget::fixed(40 << 30),
            ..StoreOptions::mapped(experts, Width::F32)
        },
        ..LoadOptions::exact(experts)
    };
    engines::load(engine, &snapshot, options).expect("load the model")
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn report_decode(
    label: &str,
    rows: &[Row],
    work: &Work,
    times: &[Duration],
    wall: Duration,
    bw: f64,
) {
    let bytes = work.total_bytes();
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
    let line = |name: &str, time: Duration, bytes: usize| {
        let rate = bytes as f64 / time.as_secs_f64();
        println!(
            "  {name:<16} {:>9.2} {:>9.1} {:>8.1} {:>6.0}%",
            ms(time),
            bytes as f64 / 1e6,
            rate / 1e9,
            100.0 * rate / bw
        );
    };
    for ((row, &time), &bytes) in rows.iter().zip(times).zip(&work.bytes) {
        line(row.name, time, bytes);
    }
    let timed: Duration = rows
        .iter()
        .zip(times)
        .filter(|(row, _)| !row.within)
        .map(|(_, &t)| t)
        .sum();
    let other = wall.saturating_sub(timed);
    match work.other_bytes {
        0 => println!("  {:<16} {:>9.2}", "other", ms(other)),
        bytes => line("other", other, bytes),
    }
}

fn report_prefill(
    label: &str,
    n: usize,
    (rows, work): (&[Row], &Work),
    times: &[Duration],
    wall: Duration,
    peak: Option<f64>,
) {
    let madds = work.multiply_adds_over(n) as f64;
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
    let parts: Vec<String> = rows
        .iter()
        .zip(times)
        .map(|(row, t)| format!("{} {:.2} s", row.name.trim(), t.as_secs_f64()))
        .collect();
    println!("  {}", parts.join(" | "));
}

/// The state after `n` tokens: its bytes a token of context, and apart what a new state
/// (`fresh` bytes) already held, where the model has such a part.
fn report_state(model: &Model, state: &State, fresh: usize, n: usize) {
    let bytes = state.size_bytes();
    match model.state_parts {
        Some((growing, fixed)) => {
            let grown = bytes - fresh;
            println!(
                "  state: {:.1} KB a token of context ({:.1} MB at {n}: {growing}) + {:.1} MB that does not grow ({fixed})",
                grown as f64 / n as f64 / 1e3,
                grown as f64 / 1e6,
                fresh as f64 / 1e6
            );
        }
        None => println!(
            "  state: {:.1} KB a token of context ({:.1} MB at {n})",
            bytes as f64 / n as f64 / 1e3,
            bytes as f64 / 1e6
        ),
    }
}

/// The benchmark of `model`: writes its bf16 source (the shape from the command line)
/// unless there, then for each container (`--only`): converts it, measures decode and prefill
/// with f32 and, but for FP8, int8 activations, the state, and decode after `--context`
/// (f32 activations).
pub fn run(model: &Model) {
    let args = args(model.dir, model.top_k);
    let shape = Shape {
        experts: args.experts,
        moe_layers: args.moe_layers,
    };
    let rows = model.rows;
    let name = format!("{}e-{}l", shape.experts, shape.layers());
    let source = args.dir.join(format!("bf16-{name}"));
    let started = Instant::now();
    write_bf16(&source, &(model.config)(shape), &(model.tensors)(shape));
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
    for spec in model.containers.iter().filter(|spec| wanted(spec.label)) {
        let dir = convert(
            &source,
            args.dir.join(format!("{}-{name}", spec.label)),
            spec,
        );
        let snapshot = Snapshot::open(&dir).expect("open the container");
        let work = (model.work)(&snapshot, shape);
        drop(snapshot);
        let engine = load(model.engine, &dir, shape.experts);
        let prompt = tokens(PROMPT, 13, model.vocab);
        // Untimed: the first forwards fault in and warm what the timed ones use.
        let mut state = engine.new_state();
        engine
            .forward_one(&mut state, &prompt, Logits::Last)
            .expect("prefill");
        decode(engine.as_ref(), rows, &mut state, 3);
        let activations: &[bool] = if spec.expert_bits == Precision::Fp8 {
            // FP8 weights multiply f32 activations only.
            &[false]
        } else {
            &[false, true]
        };
        let fresh = engine.new_state().size_bytes();
        // The f32 decode step, which the context steps below are compared with.
        let mut wall = Duration::ZERO;
        for &act8 in activations {
            coli::quant::act8::select(act8);
            let label = format!("{}{}", spec.label, if act8 { " act8" } else { "" });
            let mut best: Option<(Vec<Duration>, Duration)> = None;
            for _ in 0..args.repeat.max(1) {
                let mut state = engine.new_state();
                let logits = engine
                    .forward_one(&mut state, &prompt, Logits::Last)
                    .expect("prefill");
                let run = decode(engine.as_ref(), rows, &mut state, argmax(&logits));
                if best.as_ref().is_none_or(|(_, wall)| run.1 < *wall) {
                    best = Some(run);
                }
            }
            let (times, step) = best.expect("at least one run");
            report_decode(&label, rows, &work, &times, step, bw);
            if !act8 {
                wall = step;
            }
            for &n in &args.prefill {
                let long = tokens(n, 7, model.vocab);
                let mut state = engine.new_state();
                let (times, wall) = phase_times(rows, || {
                    engine
                        .forward_one(&mut state, &long, Logits::Last)
                        .expect("prefill");
                });
                report_prefill(&label, n, (rows, &work), &times, wall, peak);
                report_state(model, &state, fresh, n);
            }
        }
        coli::quant::act8::select(false);
        for &context in &args.context {
            let mut state = engine.new_state();
            engine
                .forward_one(&mut state, &tokens(context, 11, model.vocab), Logits::Last)
                .expect("context prefill");
            // The first step after a prefill also grows every cache's allocation past the
            // prompt's length: reported apart, so that `step` is the one every later token pays.
            let started = Instant::now();
            engine
                .forward_one(&mut state, &[5], Logits::Last)
                .expect("first decode step");
            let first_step = started.elapsed();
            let (times, step) = decode(engine.as_ref(), rows, &mut state, 5);
            let attention: Vec<String> = rows
                .iter()
                .zip(&times)
                .filter(|(row, _)| row.phase == Phase::Attention || row.within)
                .map(|(row, &t)| format!("{} {:.2} ms", row.name.trim(), ms(t)))
                .collect();
            println!(
                "{}: decode step after {context} tokens of context: {:.1} ms ({:.2}x the {PROMPT}-token one; {}); the first after the prefill {:.1} ms",
                spec.label,
                ms(step),
                step.as_secs_f64() / wall.as_secs_f64(),
                attention.join(", "),
                ms(first_step)
            );
        }
        if let (Some(measure), false) = (model.long_context, args.long_context.is_empty()) {
            measure(&dir, spec.label, &args.long_context);
        }
    }
    println!("load average after: {}", load_average());
}
