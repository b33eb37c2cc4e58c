//! The real-shape OLMoE both end-to-end benchmarks run (`decode` and `offload`): hidden 2048,
//! 16 heads, 64 experts (top 8) of width 1024, vocabulary 50304, with random bf16 weights,
//! and its `coli convert` containers. Everything is kept in one directory and reused.
//! A benchmark that uses it declares `mod random_model;` beside it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use coli::convert::Precision;
use coli::snapshot::Snapshot;

use crate::random_model::{convert, stored_bytes, write_bf16, Container};

const HIDDEN: usize = 2048;
const HEADS: usize = 16;
pub const EXPERTS: usize = 64;
pub const TOP_K: usize = 8;
const INTER: usize = 1024;
pub const VOCAB: usize = 50304;

/// The containers written from the bf16 source: label, bits of the experts and dense
/// matrices, bits of the embedding and LM head. int8 per row first, then int4 in groups
/// of 64.
pub const CONTAINERS: [Container; 5] = [
    Container {
        label: "int8-row",
        expert_bits: Precision::Bits(8),
        dense_bits: Precision::Bits(8),
        io_bits: Precision::Bits(8),
    },
    Container {
        label: "int4-g64",
        expert_bits: Precision::Bits(4),
        dense_bits: Precision::Bits(4),
        io_bits: Precision::Bits(8),
    },
    // The embedding and head in int4 too: the bytes of llama.cpp's `--pure` Q4_0.
    Container {
        label: "int4-g64-all",
        expert_bits: Precision::Bits(4),
        dense_bits: Precision::Bits(4),
        io_bits: Precision::Bits(4),
    },
    Container {
        label: "fp8",
        expert_bits: Precision::Fp8,
        dense_bits: Precision::Fp8,
        io_bits: Precision::Fp8,
    },
    Container {
        label: "mxfp4",
        expert_bits: Precision::Mxfp4,
        dense_bits: Precision::Mxfp4,
        io_bits: Precision::Bits(8),
    },
];

/// Where the models live unless `--dir` says otherwise.
pub fn default_dir() -> PathBuf {
    std::env::temp_dir().join("coli-olmoe-bench")
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

/// The model's `config.json`.
fn config(layers: usize) -> serde_json::Value {
    serde_json::json!({
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
    })
}

/// The bf16 model of `layers` layers in `dir` (`bf16-<layers>l`), written unless already
/// there; prints where it is and how long that took.
pub fn source_model(dir: &Path, layers: usize) -> PathBuf {
    let source = dir.join(format!("bf16-{layers}l"));
    let started = Instant::now();
    write_bf16(&source, &config(layers), &tensors(layers));
    println!(
        "model: {} ({:.1} s)",
        source.display(),
        started.elapsed().as_secs_f64()
    );
    source
}

/// `coli convert` of `source` to one of [`CONTAINERS`] in `dir` (`<label>-<layers>l`);
/// shards already written are kept. Prints the converter's report.
pub fn container(source: &Path, dir: &Path, layers: usize, spec: &Container) -> PathBuf {
    convert(source, dir.join(format!("{}-{layers}l", spec.label)), spec)
}

/// Bytes of one routed expert of layer `layer` (gate, up and down, scales included).
pub fn expert_bytes(snapshot: &Snapshot, layer: usize) -> usize {
    ["gate_proj", "up_proj", "down_proj"]
        .iter()
        .map(|m| {
            stored_bytes(
                snapshot,
                &format!("model.layers.{layer}.mlp.experts.0.{m}.weight"),
            )
        })
        .sum()
}
