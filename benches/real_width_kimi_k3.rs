//! Kimi K3 (`kimi_k3`) at its published width, measured per phase against the machine's
//! limits measured in the same run ([`per_phase`]).
//!
//! The model is Kimi K3's text configuration (`moonshotai/Kimi-K3` `config.json`,
//! `text_config` of `model_type` `kimi_linear`, in ../shared/reference/engines.md §3.1):
//! hidden 7168; gated NoPE MLA of 96 heads (q/kv LoRA ranks 1536/512, qk 128+64, v 128,
//! with the output gate); Kimi Delta Attention of 96 heads of 128 with short convolutions
//! of 4; LatentMoE of 896 experts, top 16 of width 3072 in a 3584-wide latent (with its down
//! and up projections and norm), and the 2 shared experts fused (gate/up `[6144, 7168]`); a
//! dense first layer of width 33792; vocabulary 163,840; attention residuals in blocks of
//! 12 layers. The release has 93 layers, KDA but for every 4th (1-indexed) and the last,
//! which are MLA. Here: the dense layer 0 (KDA) and `--moe-layers` (2) with experts, KDA
//! but for every 4th and the last (so with 2: dense KDA, KDA + MoE, MLA + MoE; with 3 the
//! published pattern's first four), and `--experts` (16) experts per layer instead of 896,
//! because the disk is short: a token's work is the same (its top 16, the shared experts,
//! the latent projections, the same attention), only the router's 7168-wide rows are fewer.
//! The weights are random bf16, converted with `coli convert` to MXFP4 routed experts (as
//! published; the rest int8 per row) and int8 per row throughout.
//!
//! For each container it reports, with every expert resident and every page touched:
//! - decode: each phase's time per token (attention, KDA's and MLA's, routed experts,
//!   shared experts, dense MLP, LM head) against the bytes it reads at the measured memory
//!   bandwidth; the latent projections, which no phase of the `PROFILE:` line times, are
//!   the bytes of the `other` row;
//! - prefill of `--prefill` tokens (512 and 4096 by default) against the measured FMA peak,
//!   with f32 and (`act8` rows) int8 activations;
//! - the state: the MLA latent cache's bytes per token of context, and apart KDA's
//!   recurrent and convolution states, which do not grow with the context;
//! - a decode step after `--context` tokens of context (none by default).
//!
//! `cargo bench --bench real_width_kimi_k3`, `-- --only mxfp4 --prefill 512`. The models
//! are kept in `--dir` (default: `coli-kimi-k3-bench` in the system temporary directory;
//! about 11 GB of bf16 source and 5-6 GB per container) and reused.

use coli::convert::Precision;
use coli::profile::Phase;
use coli::snapshot::Snapshot;
use per_phase::{mla_matrices, mlp_tensors, Model, Shape, Work, INT8_ROW, ROWS};
use random_model::Container;

mod machine;
mod per_phase;
mod random_model;

const HIDDEN: usize = 7168;
const HEADS: usize = 96;
const Q_LORA: usize = 1536;
const KV_LORA: usize = 512;
const QK_NOPE: usize = 128;
const QK_ROPE: usize = 64;
const V_HEAD: usize = 128;
const KDA_HEADS: usize = 96;
const KDA_DIM: usize = 128;
const KDA_WIDTH: usize = KDA_HEADS * KDA_DIM;
const CONV: usize = 4;
const EXPERT_WIDTH: usize = 3072;
const LATENT: usize = 3584;
const TOP_K: usize = 16;
const SHARED_WIDTH: usize = 2 * EXPERT_WIDTH;
const DENSE_WIDTH: usize = 33792;
const VOCAB: usize = 163_840;

/// Kimi K3's routed experts as published, and int8 throughout.
const CONTAINERS: [Container; 2] = [
    Container {
        label: "mxfp4",
        expert_bits: Precision::Mxfp4,
        dense_bits: Precision::Bits(8),
        io_bits: Precision::Bits(8),
    },
    INT8_ROW,
];

const MODEL: Model = Model {
    engine: "kimi_k3",
    rows: &ROWS,
    vocab: VOCAB,
    containers: &CONTAINERS,
    state_parts: Some((
        "the MLA latent cache",
        "KDA's recurrent and convolution states",
    )),
    dir: "coli-kimi-k3-bench",
    top_k: TOP_K,
    config: Shape::config,
    tensors: Shape::tensors,
    work,
    long_context: None,
};

/// The text model's tensors are under this prefix, as in the release.
const PREFIX: &str = "language_model.";

impl Shape {
    /// Layer `l` (0-based) is KDA but for every 4th (1-indexed) and the last.
    fn kda(self, l: usize) -> bool {
        !(l + 1).is_multiple_of(4) && l + 1 != self.layers()
    }

    fn config(self) -> serde_json::Value {
        let layers = self.layers();
        let (kda, full): (Vec<usize>, Vec<usize>) = (1..=layers).partition(|&i| self.kda(i - 1));
        let linear_attention = serde_json::json!({
            "kda_layers": kda,
            "full_attn_layers": full,
            "num_heads": KDA_HEADS,
            "head_dim": KDA_DIM,
            "short_conv_kernel_size": CONV,
            "gate_lower_bound": -5.0,
            "use_full_rank_gate": true,
        });
        let text = serde_json::json!({
            "model_type": "kimi_linear",
            "architectures": ["KimiLinearForCausalLM"],
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": layers,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "intermediate_size": DENSE_WIDTH,
            "num_attention_heads": HEADS,
            "num_key_value_heads": HEADS,
            "q_lora_rank": Q_LORA,
            "kv_lora_rank": KV_LORA,
            "qk_nope_head_dim": QK_NOPE,
            "qk_rope_head_dim": QK_ROPE,
            "v_head_dim": V_HEAD,
            "mla_use_nope": true,
            "mla_use_output_gate": true,
            "num_experts": self.experts,
            "num_experts_per_token": TOP_K,
            "moe_intermediate_size": EXPERT_WIDTH,
            "routed_expert_hidden_size": LATENT,
            "latent_moe_use_norm": true,
            "num_shared_experts": 2,
            "moe_router_activation_func": "sigmoid",
            "topk_method": "noaux_tc",
            "use_grouped_topk": true,
            "num_expert_group": 1,
            "topk_group": 1,
            "moe_renormalize": true,
            "routed_scaling_factor": 1.0,
            "hidden_act": "situ",
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": 12,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": false,
            "linear_attn_config": linear_attention,
        });
        serde_json::json!({
            "architectures": ["KimiK3ForConditionalGeneration"],
            "model_type": "kimi_k3",
            "eos_token_id": 163_586,
            "text_config": text,
        })
    }

    /// Name and shape of every tensor, in file order.
    fn tensors(self) -> Vec<(String, Vec<usize>)> {
        let model = format!("{PREFIX}model");
        let mut list = vec![
            (format!("{model}.embed_tokens.weight"), vec![VOCAB, HIDDEN]),
            (format!("{PREFIX}lm_head.weight"), vec![VOCAB, HIDDEN]),
            (format!("{model}.norm.weight"), vec![HIDDEN]),
            (format!("{model}.output_attn_res_norm.weight"), vec![HIDDEN]),
            (
                format!("{model}.output_attn_res_proj.weight"),
                vec![1, HIDDEN],
            ),
        ];
        for l in 0..self.layers() {
            let p = format!("{model}.layers.{l}");
            let mut vectors = vec![
                ("input_layernorm.weight", HIDDEN),
                ("post_attention_layernorm.weight", HIDDEN),
                ("self_attention_res_norm.weight", HIDDEN),
                ("mlp_res_norm.weight", HIDDEN),
            ];
            for name in ["self_attention_res_proj.weight", "mlp_res_proj.weight"] {
                list.push((format!("{p}.{name}"), vec![1, HIDDEN]));
            }
            if self.kda(l) {
                vectors.extend([
                    ("self_attn.dt_bias", KDA_WIDTH),
                    // One decay rate per head, unpadded.
                    ("self_attn.A_log", KDA_HEADS),
                    ("self_attn.o_norm.weight", KDA_DIM),
                ]);
                for conv in ["q", "k", "v"] {
                    let name = format!("{p}.self_attn.{conv}_conv1d.weight");
                    list.push((name, vec![KDA_WIDTH, 1, CONV]));
                }
            } else {
                vectors.extend([
                    ("self_attn.q_a_layernorm.weight", Q_LORA),
                    ("self_attn.kv_a_layernorm.weight", KV_LORA),
                ]);
            }
            for (name, len) in vectors {
                list.push((format!("{p}.{name}"), vec![len]));
            }
            for (name, shape) in attention_matrices(self.kda(l)) {
                list.push((format!("{p}.{name}"), shape.to_vec()));
            }
            if l == 0 {
                list.extend(mlp_tensors(&format!("{p}.mlp"), (HIDDEN, DENSE_WIDTH)));
                continue;
            }
            let m = format!("{p}.block_sparse_moe");
            list.extend([
                (format!("{m}.gate.weight"), vec![self.experts, HIDDEN]),
                (
                    format!("{m}.gate.e_score_correction_bias"),
                    vec![self.experts],
                ),
                (format!("{m}.routed_expert_norm.weight"), vec![LATENT]),
            ]);
            for (name, shape) in latent_matrices() {
                list.push((format!("{m}.{name}"), shape.to_vec()));
            }
            list.extend(mlp_tensors(
                &format!("{m}.shared_experts"),
                (HIDDEN, SHARED_WIDTH),
            ));
            for e in 0..self.experts {
                for (w, shape) in [
                    ("w1", [EXPERT_WIDTH, LATENT]),
                    ("w2", [LATENT, EXPERT_WIDTH]),
                    ("w3", [EXPERT_WIDTH, LATENT]),
                ] {
                    list.push((format!("{m}.experts.{e}.{w}.weight"), shape.to_vec()));
                }
            }
        }
        list
    }
}

/// A layer's attention matrices, KDA's or gated MLA's: name under the layer and shape.
fn attention_matrices(kda: bool) -> Vec<(&'static str, [usize; 2])> {
    if kda {
        vec![
            ("self_attn.q_proj.weight", [KDA_WIDTH, HIDDEN]),
            ("self_attn.k_proj.weight", [KDA_WIDTH, HIDDEN]),
            ("self_attn.v_proj.weight", [KDA_WIDTH, HIDDEN]),
            ("self_attn.g_proj.weight", [KDA_WIDTH, HIDDEN]),
            ("self_attn.o_proj.weight", [HIDDEN, KDA_WIDTH]),
            ("self_attn.b_proj.weight", [KDA_HEADS, HIDDEN]),
            ("self_attn.f_a_proj.weight", [KDA_DIM, HIDDEN]),
            ("self_attn.f_b_proj.weight", [KDA_WIDTH, KDA_DIM]),
        ]
    } else {
        let ranks = [Q_LORA, KV_LORA, QK_NOPE, QK_ROPE, V_HEAD];
        let mut list = mla_matrices(HIDDEN, HEADS, ranks).to_vec();
        // The output gate.
        list.push(("self_attn.g_proj.weight", [HEADS * V_HEAD, HIDDEN]));
        list
    }
}

/// The LatentMoE's projections into the experts' latent and back, under `block_sparse_moe`.
fn latent_matrices() -> [(&'static str, [usize; 2]); 2] {
    [
        ("routed_expert_down_proj.weight", [LATENT, HIDDEN]),
        ("routed_expert_up_proj.weight", [HIDDEN, LATENT]),
    ]
}

/// Weight bytes and multiply-adds per row of each phase of [`ROWS`], and of the latent
/// projections (timed by no phase).
fn work(snapshot: &Snapshot, shape: Shape) -> Work {
    let mut work = Work::new(&ROWS);
    for l in 0..shape.layers() {
        let p = format!("{PREFIX}model.layers.{l}");
        work.add_attention(snapshot, &p, &attention_matrices(shape.kda(l)));
        if l == 0 {
            let dense = (HIDDEN, DENSE_WIDTH);
            work.add_mlp(snapshot, Phase::DenseFfn, &format!("{p}.mlp"), dense);
            continue;
        }
        let m = format!("{p}.block_sparse_moe");
        for (name, [rows, cols]) in latent_matrices() {
            work.add(snapshot, None, &format!("{m}.{name}"), rows * cols);
        }
        for _ in 0..TOP_K {
            // Every expert of a layer has the same format and size.
            for w in ["w1", "w2", "w3"] {
                let name = format!("{m}.experts.0.{w}.weight");
                work.add(
                    snapshot,
                    Some(Phase::ExpertMatmul),
                    &name,
                    EXPERT_WIDTH * LATENT,
                );
            }
        }
        let shared = (HIDDEN, SHARED_WIDTH);
        let name = format!("{m}.shared_experts");
        work.add_mlp(snapshot, Phase::SharedExpert, &name, shared);
    }
    let head = format!("{PREFIX}lm_head.weight");
    work.add(snapshot, Some(Phase::LmHead), &head, VOCAB * HIDDEN);
    work
}

fn main() {
    per_phase::run(&MODEL);
}
