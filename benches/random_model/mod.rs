//! Models with random weights the end-to-end benchmarks write and convert: one bf16
//! safetensors shard with its `config.json` from a tensor list, and its `coli convert`
//! containers. The speed of a forward does not depend on the weights' values, so random
//! weights at a model's published shapes measure what the real model would.
// Each benchmark uses a different subset of these.
#![allow(dead_code)]

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use coli::convert::{self, Options, Precision};
use coli::snapshot::Snapshot;
use half::bf16;
use rayon::prelude::*;

/// Random bf16 weights for `tensors` (name and shape, in file order; uniform, standard
/// deviation about 0.03; norm weights 1, norm biases 0), written to `dir` as one
/// safetensors file with `config`, unless already there.
pub fn write_bf16(dir: &Path, config: &serde_json::Value, tensors: &[(String, Vec<usize>)]) {
    let shard = dir.join("model.safetensors");
    if shard.exists() {
        return;
    }
    std::fs::create_dir_all(dir).expect("create the model directory");
    std::fs::write(dir.join("config.json"), config.to_string()).expect("write config.json");
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in tensors {
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
    for (index, (name, shape)) in tensors.iter().enumerate() {
        let count: usize = shape.iter().product();
        let constant = match (name.contains("norm"), name.ends_with(".bias")) {
            (true, true) => Some(0.0),
            (true, false) => Some(1.0),
            _ => None,
        };
        let bytes: Vec<u8> = (0..count)
            .into_par_iter()
            .with_min_len(1 << 16)
            .flat_map_iter(|i| {
                let value = constant.unwrap_or_else(|| random_value(index as u64, i as u64) * 0.1);
                bf16::from_f32(value).to_le_bytes()
            })
            .collect();
        out.write_all(&bytes).expect("write");
    }
    out.flush().expect("write");
    drop(out);
    std::fs::rename(&partial, &shard).expect("rename the shard");
}

/// A value in [-0.5, 0.5) for element `i` of stream `stream`: a counter-based hash, so that
/// the values do not depend on thread timing.
pub fn random_value(stream: u64, i: u64) -> f32 {
    let mut z = (stream << 40 ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 29;
    (z >> 40) as f32 / (1u64 << 24) as f32 - 0.5
}

/// One `coli convert` of a source model: the routed experts at `expert_bits`, the other
/// matrices at `dense_bits`, the embedding and head at `io_bits`.
pub struct Container {
    pub label: &'static str,
    pub expert_bits: Precision,
    pub dense_bits: Precision,
    pub io_bits: Precision,
}

/// `coli convert` of `source` to `spec` as `dst`; shards already written are kept. Prints
/// the converter's report.
pub fn convert(source: &Path, dst: PathBuf, spec: &Container) -> PathBuf {
    let options = Options {
        expert_bits: spec.expert_bits,
        dense_bits: spec.dense_bits,
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
