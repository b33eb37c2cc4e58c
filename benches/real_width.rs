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
//!   prefill of that length), against the step at the 32-token prompt;
//! - the part of one layer's decode step that grows with the context, at `--long-context`
//!   tokens ([`long_context`]: 65,536 tokens of prefill would take hours here).
//!
//! `cargo bench --bench real_width`, `-- --only int8-row --prefill 512 --context 2048`.
//! The models are kept in `--dir` (default: `coli-glm52-bench` in the system temporary
//! directory; about 8 GB of bf16 source and 3-4 GB per container) and reused.

use std::path::Path;
use std::time::{Duration, Instant};

use coli::convert::Precision;
use coli::engines::dsa::{IndexKeys, Indexer, IndexerShape};
use coli::engines::layers::Rope;
use coli::engines::mla::{attend_absorbed, Keys, LatentCache, MlaShape};
use coli::engines::weights::Weights;
use coli::profile::Phase;
use coli::quant::Width;
use coli::snapshot::Snapshot;
use per_phase::{
    mla_matrices, mlp_tensors, Model, Row, Shape, Work, ATTENTION, DENSE, INT4_G64, INT8_ROW,
    LM_HEAD, ROUTED,
};
use random_model::{random_value, Container};

mod machine;
mod per_phase;
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

/// The phases of the `PROFILE:` line a forward is split into here.
const ROWS: [Row; 6] = [
    ATTENTION,
    Row {
        phase: Phase::Indexer,
        name: "  indexer",
        within: true,
    },
    ROUTED,
    Row {
        phase: Phase::SharedExpert,
        name: "shared expert",
        within: false,
    },
    DENSE,
    LM_HEAD,
];

/// The published containers, and int8 throughout.
const CONTAINERS: [Container; 3] = [
    INT8_ROW,
    INT4_G64,
    Container {
        label: "fp8",
        expert_bits: Precision::Fp8,
        dense_bits: Precision::Fp8,
        io_bits: Precision::Fp8,
    },
];

const MODEL: Model = Model {
    engine: "glm_moe_dsa",
    rows: &ROWS,
    vocab: VOCAB,
    containers: &CONTAINERS,
    state_parts: None,
    dir: "coli-glm52-bench",
    top_k: TOP_K,
    config: Shape::config,
    tensors: Shape::tensors,
    work,
    long_context: Some(long_context),
};

impl Shape {
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
                list.extend(mlp_tensors(&format!("{p}.mlp"), (HIDDEN, DENSE_WIDTH)));
                continue;
            }
            list.push((format!("{p}.mlp.gate.weight"), vec![self.experts, HIDDEN]));
            list.push((
                format!("{p}.mlp.gate.e_score_correction_bias"),
                vec![self.experts],
            ));
            let expert = (HIDDEN, EXPERT_WIDTH);
            list.extend(mlp_tensors(&format!("{p}.mlp.shared_experts"), expert));
            for e in 0..self.experts {
                list.extend(mlp_tensors(&format!("{p}.mlp.experts.{e}"), expert));
            }
        }
        list
    }
}

/// A layer's attention matrices (MLA and the DSA indexer): name under the layer and shape.
fn attention_matrices() -> Vec<(&'static str, [usize; 2])> {
    let ranks = [Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD];
    let mut list = mla_matrices(HIDDEN, HEADS, ranks).to_vec();
    list.extend([
        (
            "self_attn.indexer.wq_b.weight",
            [INDEX_HEADS * INDEX_DIM, Q_LORA],
        ),
        ("self_attn.indexer.wk.weight", [INDEX_DIM, HIDDEN]),
        (
            "self_attn.indexer.weights_proj.weight",
            [INDEX_HEADS, HIDDEN],
        ),
    ]);
    list
}

/// Weight bytes and multiply-adds per row of each phase of [`ROWS`].
fn work(snapshot: &Snapshot, shape: Shape) -> Work {
    let mut work = Work::new(&ROWS);
    for l in 0..shape.layers() {
        let p = format!("model.layers.{l}");
        let attention = attention_matrices();
        work.add_attention(snapshot, &p, &attention);
        for (name, [rows, cols]) in attention {
            if name.contains("indexer") {
                let name = format!("{p}.{name}");
                work.add(snapshot, Some(Phase::Indexer), &name, rows * cols);
            }
        }
        if l == 0 {
            let dense = (HIDDEN, DENSE_WIDTH);
            work.add_mlp(snapshot, Phase::DenseFfn, &format!("{p}.mlp"), dense);
            continue;
        }
        let expert = (HIDDEN, EXPERT_WIDTH);
        for _ in 0..TOP_K {
            // Every expert of a layer has the same format and size.
            let name = format!("{p}.mlp.experts.0");
            work.add_mlp(snapshot, Phase::ExpertMatmul, &name, expert);
        }
        let shared = format!("{p}.mlp.shared_experts");
        work.add_mlp(snapshot, Phase::SharedExpert, &shared, expert);
    }
    let head = "lm_head.weight";
    work.add(snapshot, Some(Phase::LmHead), head, VOCAB * HIDDEN);
    work
}

fn main() {
    per_phase::run(&MODEL);
}

/// Rows of random hidden states projected to indexer keys at a time while a long context is
/// filled.
const FILL: usize = 4096;

/// Bytes read before each timed step of [`long_context`], so that it finds its caches
/// cold, as after the other layers' weights.
const FLUSH: usize = 256 << 20;

/// The part of a decode step that grows with the context, for one layer (layer 1, its own
/// weights from the container at `dir`): the DSA indexer (the new row's projections, its key
/// appended, every cached position scored and the top 2,048 kept) and MLA's absorbed
/// attention over the kept positions, at each of `contexts` positions of cached keys and
/// latents. The keys are the layer's own projection of random hidden states and the
/// latents random (no value changes the time), and each timed step finds them out of the
/// processor's caches, as in a forward. Everything else a step does is the same at
/// any context, so a step at a long context is the step at 2,048 tokens plus each layer's
/// difference measured here.
fn long_context(dir: &Path, label: &str, contexts: &[usize]) {
    let snapshot = Snapshot::open(dir).expect("open the container");
    let weights = Weights::new(&snapshot, Width::Int8Row);
    let attention = weights.at("model.layers.1.self_attn");
    let shape = IndexerShape {
        hidden: HIDDEN,
        q_lora: Q_LORA,
        heads: INDEX_HEADS,
        head_dim: INDEX_DIM,
        rope: QK_ROPE,
        top_k: INDEX_TOP_K,
    };
    let indexer = Indexer::load(&attention.at("indexer"), shape).expect("the indexer");
    let kv_rows = HEADS * (QK_NOPE + V_HEAD);
    let kv_b = attention
        .matrix("kv_b_proj.weight", [kv_rows, KV_LORA])
        .expect("kv_b_proj");
    let mla = MlaShape::new(HEADS, QK_NOPE, QK_ROPE, V_HEAD, KV_LORA);
    let rope = Rope::new(QK_ROPE, 8e6);
    let (x, q_resid) = (noise(HIDDEN, 1), noise(Q_LORA, 2));
    let queries = noise(HEADS * (QK_NOPE + QK_ROPE), 3);
    let (latent, rope_key) = (noise(KV_LORA, 4), noise(QK_ROPE, 5));
    let mut out = vec![0f32; HEADS * V_HEAD];
    let flush: Vec<u64> = (0..FLUSH / 8).map(|i| i as u64).collect();
    for &context in contexts {
        let mut keys = IndexKeys::new(INDEX_DIM);
        let mut latents = LatentCache::new(KV_LORA, QK_ROPE);
        for start in (0..context).step_by(FILL) {
            let n = FILL.min(context - start);
            let rows = indexer.project(&noise(n * HIDDEN, start as u32), &[], n, false);
            indexer.push_keys(&rows, 0..n, start, &rope, &mut keys);
            let seed = start as u32 + 7;
            latents.push(&noise(n * KV_LORA, seed), &noise(n * QK_ROPE, seed + 1));
        }
        let (mut indexing, mut attending) = (Duration::MAX, Duration::MAX);
        for _ in 0..5 {
            // In a step the layer's caches come cold, after the other layers' weights.
            std::hint::black_box(machine::sum(&flush));
            let started = Instant::now();
            let rows = indexer.project(&x, &q_resid, 1, true);
            indexer.push_keys(&rows, 0..1, context, &rope, &mut keys);
            let selected = indexer.select(&rows, 0..1, &rope, &keys, false);
            let indexed = started.elapsed();
            latents.push(&latent, &rope_key);
            let read = match &selected {
                Some(lists) => Keys::Selected(lists),
                None => Keys::Causal,
            };
            attend_absorbed(mla, &kv_b, &queries, 1, &latents, &read, &mut out);
            indexing = indexing.min(indexed);
            attending = attending.min(started.elapsed() - indexed);
            keys.truncate(context);
            latents.truncate(context);
        }
        println!(
            "{label}: one layer's decode work that grows with the context, at {context} tokens: indexer {:.2} ms, attention {:.2} ms",
            indexing.as_secs_f64() * 1e3,
            attending.as_secs_f64() * 1e3
        );
    }
}

/// `len` values in [-1, 1) from `seed`.
fn noise(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| 2.0 * random_value(u64::from(seed), i as u64))
        .collect()
}
