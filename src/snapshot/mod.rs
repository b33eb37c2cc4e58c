//! A model directory (`SNAP`): its `config.json`, its memory-mapped safetensors shards and
//! the lookup of tensors by name.
//!
//! This module owns the mapping of files and the validation of what they declare: every
//! `*.safetensors` file in the directory is mapped once, its header parsed, and every tensor
//! becomes a [`TensorView`], a window into the mapping that costs nothing to clone. It does
//! not interpret weights (that is `quant`) and it never copies tensor data.

mod shard;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;

use shard::Shard;
pub use shard::{Dtype, MappedBytes, TensorView};

/// Where a tensor lives: which shard, and its header entry.
#[derive(Debug, Clone)]
struct TensorEntry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    start: usize,
    end: usize,
}

/// An opened model directory.
pub struct Snapshot {
    dir: PathBuf,
    config: serde_json::Value,
    shards: Vec<Arc<Shard>>,
    tensors: HashMap<String, TensorEntry>,
}

impl Snapshot {
    /// Open `dir`: read `config.json`, map every shard and index its tensors.
    pub fn open(dir: &Path) -> Result<Snapshot> {
        if !dir.is_dir() {
            bail!(
                "SNAP={}: not a directory; point SNAP at a model directory holding config.json and *.safetensors",
                dir.display()
            );
        }
        let config_path = dir.join("config.json");
        let text = std::fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", config_path.display()))?;
        if !config.is_object() {
            bail!("{}: expected a JSON object", config_path.display());
        }

        let mut shard_paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .with_context(|| format!("cannot list {}", dir.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|ext| ext == "safetensors"))
            .collect();
        shard_paths.sort();
        check_index(dir, &shard_paths)?;
        if shard_paths.is_empty() {
            bail!("{}: no *.safetensors shards found", dir.display());
        }

        let mut shards = Vec::with_capacity(shard_paths.len());
        let mut tensors = HashMap::new();
        for (index, path) in shard_paths.iter().enumerate() {
            let shard = Shard::open(path)?;
            for (name, info) in shard.entries() {
                let entry = TensorEntry {
                    shard: index,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: info.start,
                    end: info.end,
                };
                if let Some(previous) = tensors.insert(name.clone(), entry) {
                    bail!(
                        "tensor {name} appears in both {} and {}",
                        shard_paths[previous.shard].display(),
                        path.display()
                    );
                }
            }
            shards.push(Arc::new(shard));
        }
        Ok(Snapshot {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensors,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The raw `config.json` object.
    pub fn config_json(&self) -> &serde_json::Value {
        &self.config
    }

    /// `config.json` as a typed engine configuration; serde's message names the key.
    pub fn config<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(self.config.clone())
            .map_err(|err| anyhow::anyhow!("{}: {err}", self.dir.join("config.json").display()))
    }

    /// `model_type` from `config.json`, when present.
    pub fn model_type(&self) -> Option<&str> {
        self.config.get("model_type").and_then(|v| v.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The tensor `name`, whatever its shape.
    pub fn tensor(&self, name: &str) -> Result<TensorView> {
        let Some(entry) = self.tensors.get(name) else {
            bail!(
                "{}: tensor {name} not found in any shard ({} tensors indexed)",
                self.dir.display(),
                self.tensors.len()
            );
        };
        let shard = &self.shards[entry.shard];
        Ok(TensorView {
            name: name.to_string(),
            file: shard.path().to_path_buf(),
            dtype: entry.dtype,
            shape: entry.shape.clone(),
            bytes: MappedBytes::new(shard.mapping(), entry.start, entry.end),
        })
    }

    /// The tensor `name`, which must have exactly `shape`.
    pub fn tensor_shaped(&self, name: &str, shape: &[usize]) -> Result<TensorView> {
        let view = self.tensor(name)?;
        if view.shape != shape {
            bail!(
                "{}: tensor {name} has shape {:?}, expected {:?} from config.json",
                view.file.display(),
                view.shape,
                shape
            );
        }
        Ok(view)
    }
}

/// When `model.safetensors.index.json` exists, every shard it names must be present.
fn check_index(dir: &Path, shard_paths: &[PathBuf]) -> Result<()> {
    let index_path = dir.join("model.safetensors.index.json");
    if !index_path.exists() {
        return Ok(());
    }
    let text = std::fs::read_to_string(&index_path)
        .with_context(|| format!("cannot read {}", index_path.display()))?;
    let index: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index_path.display()))?;
    let Some(weight_map) = index.get("weight_map").and_then(|m| m.as_object()) else {
        bail!("{}: expected a \"weight_map\" object", index_path.display());
    };
    for (tensor, file) in weight_map {
        let Some(file) = file.as_str() else {
            bail!(
                "{}: weight_map[{tensor}] is not a file name",
                index_path.display()
            );
        };
        if !shard_paths
            .iter()
            .any(|p| p.file_name().is_some_and(|n| n == file))
        {
            bail!(
                "{}: tensor {tensor} is in shard {file}, which is missing from {}",
                index_path.display(),
                dir.display()
            );
        }
    }
    Ok(())
}
