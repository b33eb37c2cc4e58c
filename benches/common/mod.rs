//! The real-shape OLMoE both end-to-end benchmarks run (`decode` and `offload`): hidden 2048,
//! 16 heads, 64 experts (top 8) of width 1024, vocabulary 50304, with random bf16 weights,
//! and its `coli convert` containers. Everything is kept in one directory and reused.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use coli::convert::{self, Options, Precision};
use coli::snapshot::Snapshot;
use half::bf16;
use rayon::prelude::*;

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
        bits: Precision::Bits(8),
        io_bits: Precision::Bits(8),
    },
    Container {
        label: "int4-g64",
        bits: Precision::Bits(4),
        io_bits: Precision::Bits(8),
    },
    // The embedding and head in int4 too: the bytes of llama.cpp's `--pure` Q4_0.
    Container {
        label: "int4-g64-all",
        bits: Precision::Bits(4),
        io_bits: Precision::Bits(4),
    },
    Container {
        label: "fp8",
        bits: Precision::Fp8,
        io_bits: Precision::Fp8,
    },
    Container {
        label: "mxfp4",
        bits: Precision::Mxfp4,
        io_bits: Precision::Bits(8),
    },
];

/// One `coli convert` of the source model: every matrix but the embedding and head at
/// `bits`, those two at `io_bits`.
pub struct Container {
    pub label: &'static str,
    pub bits: Precision,
    pub io_bits: Precision,
}

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

/// The bf16 model of `layers` layers in `dir` (`bf16-<layers>l`), written unless already
/// there; prints where it is and how long that took.
pub fn source_model(dir: &Path, layers: usize) -> PathBuf {
    let source = dir.join(format!("bf16-{layers}l"));
    let started = Instant::now();
    generate(&source, layers);
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
    let dst = dir.join(format!("{}-{layers}l", spec.label));
    let options = Options {
        expert_bits: spec.bits,
        dense_bits: spec.bits,
        io_bits: spec.io_bits,
        group_size: 64,
        shard_bytes: 4_000_000_000,
        model: None,
    };
    let summary = convert::convert(source, &dst, &options).expect("convert");
    println!("{}", convert::report(&summary, &dst));
    dst
}

/// Bytes of `name` and its scale tensor, if any.
pub fn stored_bytes(snapshot: &Snapshot, name: &str) -> usize {
    let view = snapshot.tensor(name).expect("tensor");
    view.bytes.len() + view.scales.map_or(0, |s| s.bytes.len())
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

/// The 1-, 5- and 15-minute load averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}
