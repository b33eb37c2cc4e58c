//! Inkling (`inkling`) at its published width, measured per phase against the machine's
//! limits measured in the same run ([`per_phase`]).
//!
//! The model is the 975B Inkling's text configuration (`thinkingmachines/Inkling`
//! `config.json`, in ../shared/reference/engines.md §2.1): hidden 6144; 64 query heads of
//! 128, with 8 key/value heads on the global layers and 16 on the sliding-window ones
//! (window 512); relative-bias features of 16 over 1024 positions on the global layers; short
//! convolutions of 4; 256 routed experts, top 6 of width 3072, and 2 shared ones weighed by
//! the router; dense layers of width 24576; vocabulary 201,024 (200,058 unpadded); route
//! scale 8, muP width multiplier 24, log-length scaling from 128,000 tokens. The release
//! has 66 layers, the first 2 dense, every 6th (1-indexed) global. Here: one dense layer
//! and `--moe-layers` (2) with experts, sliding but for every 6th and the last (so one global
//! layer at least), and `--experts` (16) experts per layer instead of 256, because the disk
//! is short: a token's work is the same (its top 6, the shared experts, the same attention),
//! only the router's 6144-wide rows are fewer. The weights are random bf16, converted with
//! `coli convert` to int4 experts in groups of 64 (the rest int8 per row) and int8 per row
//! throughout.
//!
//! For each container it reports, with every expert resident and every page touched:
//! - decode: each phase's time per token (attention, routed experts, shared experts, dense
//!   MLP, LM head) against the bytes it reads at the measured memory bandwidth;
//! - prefill of `--prefill` tokens (512 and 4096 by default) against the measured FMA peak,
//!   with f32 and (`act8` rows) int8 activations;
//! - the state: the key/value caches' bytes per token of context (a sliding layer's stop
//!   growing at its window), and apart the short convolutions' states;
//! - a decode step after `--context` tokens of context (none by default).
//!
//! `cargo bench --bench real_width_inkling`, `-- --only int4-g64 --prefill 512`. The
//! models are kept in `--dir` (default: `coli-inkling-bench` in the system temporary
//! directory; about 11 GB of bf16 source and 4-6 GB per container) and reused.

use coli::profile::Phase;
use coli::snapshot::Snapshot;
use per_phase::{mlp_tensors, Model, Shape, Work, INT4_G64, INT8_ROW, ROWS};
use random_model::{stored_bytes, Container};

mod machine;
mod per_phase;
mod random_model;

const HIDDEN: usize = 6144;
const HEADS: usize = 64;
const HEAD_DIM: usize = 128;
const GLOBAL_KV_HEADS: usize = 8;
const SLIDING_KV_HEADS: usize = 16;
const WINDOW: usize = 512;
const D_REL: usize = 16;
const REL_EXTENT: usize = 1024;
const CONV: usize = 4;
const EXPERT_WIDTH: usize = 3072;
const TOP_K: usize = 6;
const SHARED: usize = 2;
const DENSE_WIDTH: usize = 24576;
const VOCAB: usize = 201_024;
const UNPADDED_VOCAB: usize = 200_058;

/// The int4 experts of colibri's Inkling containers (in groups of 64 here), and int8
/// throughout.
const CONTAINERS: [Container; 2] = [INT4_G64, INT8_ROW];

const MODEL: Model = Model {
    engine: "inkling",
    rows: &ROWS,
    vocab: UNPADDED_VOCAB,
    containers: &CONTAINERS,
    state_parts: Some(("the key/value caches", "the short convolutions' states")),
    dir: "coli-inkling-bench",
    top_k: TOP_K,
    config: Shape::config,
    tensors: Shape::tensors,
    work,
    long_context: None,
};

impl Shape {
    /// Layer `l` (0-based) attends within the window but for every 6th (1-indexed) and the
    /// last.
    fn sliding(self, l: usize) -> bool {
        !(l + 1).is_multiple_of(6) && l + 1 != self.layers()
    }

    fn config(self) -> serde_json::Value {
        let layers = self.layers();
        let layer_types: Vec<&str> = (0..layers)
            .map(|l| {
                if self.sliding(l) {
                    "hybrid_sliding"
                } else {
                    "hybrid"
                }
            })
            .collect();
        let mlp_types: Vec<&str> = (0..layers)
            .map(|l| if l == 0 { "dense" } else { "sparse" })
            .collect();
        serde_json::json!({
            "architectures": ["InklingForCausalLM"],
            "model_type": "inkling_text",
            "vocab_size": VOCAB,
            "unpadded_vocab_size": UNPADDED_VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": layers,
            "num_attention_heads": HEADS,
            "num_key_value_heads": GLOBAL_KV_HEADS,
            "head_dim": HEAD_DIM,
            "swa_num_attention_heads": HEADS,
            "swa_num_key_value_heads": SLIDING_KV_HEADS,
            "swa_head_dim": HEAD_DIM,
            "sliding_window_size": WINDOW,
            "d_rel": D_REL,
            "rel_extent": REL_EXTENT,
            "log_scaling_n_floor": 128_000,
            "log_scaling_alpha": 0.1,
            "layer_types": layer_types,
            "mlp_layer_types": mlp_types,
            "intermediate_size": DENSE_WIDTH,
            "moe_intermediate_size": EXPERT_WIDTH,
            "conv_kernel_size": CONV,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "n_routed_experts": self.experts,
            "num_experts_per_tok": TOP_K,
            "n_shared_experts": SHARED,
            "shared_expert_sink": true,
            "route_scale": 8.0,
            "logits_mup_width_multiplier": 24.0,
            "eos_token_id": 200_006,
        })
    }

    /// Name and shape of every tensor, in file order.
    fn tensors(self) -> Vec<(String, Vec<usize>)> {
        let mut list = vec![
            ("model.embed_tokens.weight".to_string(), vec![VOCAB, HIDDEN]),
            ("lm_head.weight".to_string(), vec![VOCAB, HIDDEN]),
            (
                "model.embed_tokens.embed_norm.weight".to_string(),
                vec![HIDDEN],
            ),
            ("model.norm.weight".to_string(), vec![HIDDEN]),
        ];
        for l in 0..self.layers() {
            let p = format!("model.layers.{l}");
            let sliding = self.sliding(l);
            let kv = kv_heads(sliding) * HEAD_DIM;
            let extent = if sliding { WINDOW } else { REL_EXTENT };
            for (name, shape) in [
                ("input_layernorm.weight", vec![HIDDEN]),
                ("post_attention_layernorm.weight", vec![HIDDEN]),
                ("attn_sconv.conv1d.weight", vec![HIDDEN, 1, CONV]),
                ("mlp_sconv.conv1d.weight", vec![HIDDEN, 1, CONV]),
                ("self_attn.q_norm.weight", vec![HEAD_DIM]),
                ("self_attn.k_norm.weight", vec![HEAD_DIM]),
                ("self_attn.rel_logits_proj.proj", vec![D_REL, extent]),
                ("self_attn.k_sconv.conv1d.weight", vec![kv, 1, CONV]),
                ("self_attn.v_sconv.conv1d.weight", vec![kv, 1, CONV]),
            ] {
                list.push((format!("{p}.{name}"), shape));
            }
            for (name, shape) in attention_matrices(sliding) {
                list.push((format!("{p}.{name}"), shape.to_vec()));
            }
            if l == 0 {
                list.extend(mlp_tensors(&format!("{p}.mlp"), (HIDDEN, DENSE_WIDTH)));
                continue;
            }
            let (e, i) = (self.experts, EXPERT_WIDTH);
            for (name, shape) in [
                ("gate.weight", vec![e + SHARED, HIDDEN]),
                ("gate.e_score_correction_bias", vec![e]),
                ("shared_experts.gate_proj", vec![SHARED, i, HIDDEN]),
                ("shared_experts.up_proj", vec![SHARED, i, HIDDEN]),
                ("shared_experts.down_proj", vec![SHARED, HIDDEN, i]),
                ("experts.gate_up_proj", vec![e, 2 * i, HIDDEN]),
                ("experts.down_proj", vec![e, HIDDEN, i]),
            ] {
                list.push((format!("{p}.mlp.{name}"), shape));
            }
        }
        list
    }
}

fn kv_heads(sliding: bool) -> usize {
    if sliding {
        SLIDING_KV_HEADS
    } else {
        GLOBAL_KV_HEADS
    }
}

/// A layer's attention matrices: name under the layer and shape.
fn attention_matrices(sliding: bool) -> [(&'static str, [usize; 2]); 5] {
    let kv = kv_heads(sliding) * HEAD_DIM;
    [
        ("self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN]),
        ("self_attn.k_proj.weight", [kv, HIDDEN]),
        ("self_attn.v_proj.weight", [kv, HIDDEN]),
        ("self_attn.r_proj.weight", [HEADS * D_REL, HIDDEN]),
        ("self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM]),
    ]
}

/// Weight bytes and multiply-adds per row of each phase of [`ROWS`].
fn work(snapshot: &Snapshot, shape: Shape) -> Work {
    let mut work = Work::new(&ROWS);
    let expert = EXPERT_WIDTH * HIDDEN;
    for l in 0..shape.layers() {
        let p = format!("model.layers.{l}");
        work.add_attention(snapshot, &p, &attention_matrices(shape.sliding(l)));
        if l == 0 {
            let dense = (HIDDEN, DENSE_WIDTH);
            work.add_mlp(snapshot, Phase::DenseFfn, &format!("{p}.mlp"), dense);
            continue;
        }
        // The experts are fused, each a same-sized slice of the layer's tensors.
        for (name, params) in [("gate_up_proj", 2 * expert), ("down_proj", expert)] {
            let bytes = stored_bytes(snapshot, &format!("{p}.mlp.experts.{name}"));
            let routed = bytes / shape.experts * TOP_K;
            work.add_bytes(Some(Phase::ExpertMatmul), routed, TOP_K * params);
        }
        for m in ["gate_proj", "up_proj", "down_proj"] {
            let name = format!("{p}.mlp.shared_experts.{m}");
            work.add(snapshot, Some(Phase::SharedExpert), &name, SHARED * expert);
        }
    }
    let head = "lm_head.weight";
    work.add(snapshot, Some(Phase::LmHead), head, VOCAB * HIDDEN);
    work
}

fn main() {
    per_phase::run(&MODEL);
}
