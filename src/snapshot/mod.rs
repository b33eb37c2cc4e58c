//! A model directory (`SNAP`): its `config.json`, its memory-mapped safetensors shards and
//! the lookup of tensors by name.
//!
//! This module owns the mapping of files and the validation of what they declare: every
//! `*.safetensors` file in the directory is mapped once, its header parsed, and every tensor
//! becomes a [`TensorView`], a window into the mapping that costs nothing to clone. It does
//! not interpret weights (that is `quant`) and it never copies tensor data. A shard that
//! changes under the running process is caught by `guard` and said by
//! [`guard::check`].

pub mod guard;
mod shard;
mod stamp;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;

use shard::Shard;
pub use shard::{Dtype, MappedBytes, Mapping, TensorView};

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
    /// Formats the shards' `colibri.fmt` stamps claim, by tensor name.
    stamps: HashMap<String, String>,
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
        let mut stamps = HashMap::new();
        for (index, path) in shard_paths.iter().enumerate() {
            let shard = Shard::open(path)?;
            if let Some(stamp) = shard.metadata("colibri.fmt") {
                stamp::merge_stamp(&mut stamps, path, stamp)?;
            }
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
            stamps,
        })
    }

    /// Every tensor name, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Every shard's path and size in bytes, in path order.
    pub fn shard_files(&self) -> impl Iterator<Item = (&Path, u64)> {
        self.shards
            .iter()
            .map(|shard| (shard.path(), shard.mapping().len() as u64))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The raw `config.json` object.
    pub fn config_json(&self) -> &serde_json::Value {
        &self.config
    }

    /// The ids that end a generation by the model's own files ([`model_stop_ids`], each
    /// checked against `vocab`, the logits' width); `absent`: what the engine's transformers
    /// config class defaults to when `config.json` has no `eos_token_id`. Read once, at
    /// load: everything after asks the engine for them.
    pub fn stop_ids(&self, absent: &[u32], vocab: usize) -> Result<Vec<u32>> {
        let key = "eos_token_id";
        let given = self.config.get(key).is_some()
            || self
                .config
                .get("text_config")
                .and_then(|t| t.get(key))
                .is_some();
        let read = model_stop_ids(&self.dir, &self.config, vocab)?;
        let defaults = if given { &[][..] } else { absent };
        Ok(first_seen(defaults.iter().chain(&read).copied()))
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

    /// The tensor `name`, whatever its shape, with its scale tensor when it is a
    /// pre-quantised weight and the format the container stamp claims for it.
    pub fn tensor(&self, name: &str) -> Result<TensorView> {
        let mut view = self.raw_tensor(name)?;
        let scales = [format!("{name}.qs"), format!("{name}_scale_inv")]
            .into_iter()
            .chain(
                name.strip_suffix(".weight_packed")
                    .map(|stem| format!("{stem}.weight_scale")),
            )
            .find(|candidate| self.tensors.contains_key(candidate));
        if let Some(scales) = scales {
            view.scales = Some(Box::new(self.raw_tensor(&scales)?));
        }
        view.stamp = self.stamps.get(name).cloned();
        Ok(view)
    }

    fn raw_tensor(&self, name: &str) -> Result<TensorView> {
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
            scales: None,
            stamp: None,
        })
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

/// The most ids a stop list may hold: a model has a handful, and every generated token is
/// looked up in the list.
pub const MAX_STOP_IDS: usize = 4096;

/// How many ids of a long list a report line shows.
const SHOWN_STOP_IDS: usize = 16;

/// The ids that end a generation by the files of the model in `dir` (`config`: its
/// `config.json`): `eos_token_id` of `config.json` (the top level, else its `text_config`),
/// then of `generation_config.json` when there is one, each id once, first seen first.
/// Every id must be below `vocab`. Every engine's stop list and text mode's start from
/// these.
pub fn model_stop_ids(dir: &Path, config: &serde_json::Value, vocab: usize) -> Result<Vec<u32>> {
    let key = "eos_token_id";
    let top = config.get(key).filter(|v| !v.is_null());
    let text = config.get("text_config").and_then(|t| t.get(key));
    let config_path = dir.join("config.json");
    let mut ids = stop_ids_in(top.or(text), key, &config_path, vocab)?;
    let path = dir.join("generation_config.json");
    if path.is_file() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        ids.extend(stop_ids_in(json.get(key), key, &path, vocab)?);
    }
    Ok(first_seen(ids))
}

/// The stop ids of `key` in the file at `path` ([`token_ids`]), at most [`MAX_STOP_IDS`]
/// of them, each below `vocab`.
fn stop_ids_in(
    value: Option<&serde_json::Value>,
    key: &str,
    path: &Path,
    vocab: usize,
) -> Result<Vec<u32>> {
    if let Some(items) = value.and_then(|v| v.as_array()) {
        if items.len() > MAX_STOP_IDS {
            bail!(
                "{}: {key} lists {} ids; at most {MAX_STOP_IDS} are taken (a model ends its text with a handful)",
                path.display(),
                items.len()
            );
        }
    }
    let ids = token_ids(value, key, path)?;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        bail!(
            "{}: {key} holds {bad}, outside the model's vocabulary (vocab_size {vocab})",
            path.display()
        );
    }
    Ok(ids)
}

/// `ids` without repeats, each where it first appears.
fn first_seen(ids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut seen = std::collections::HashSet::new();
    ids.into_iter().filter(|id| seen.insert(*id)).collect()
}

/// `ids` for a report line: all of a short list, else the first [`SHOWN_STOP_IDS`] and how
/// many more there are.
pub fn show_stop_ids(ids: &[u32]) -> String {
    let shown: Vec<String> = ids
        .iter()
        .take(SHOWN_STOP_IDS)
        .map(u32::to_string)
        .collect();
    match ids.len().saturating_sub(SHOWN_STOP_IDS) {
        0 => shown.join(" "),
        more => format!("{} ... ({more} more)", shown.join(" ")),
    }
}

/// The token ids of `key` in the file at `path`: one id, a list of ids, or null or absent
/// (none).
pub fn token_ids(value: Option<&serde_json::Value>, key: &str, path: &Path) -> Result<Vec<u32>> {
    let as_id = |v: &serde_json::Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
    let expected = "must be a token id or a list of token ids (or null)";
    match value {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(at, item)| {
                as_id(item).ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}: {key} {expected}, found {item} at index {at}",
                        path.display()
                    )
                })
            })
            .collect(),
        Some(single) => match as_id(single) {
            Some(id) => Ok(vec![id]),
            None => bail!("{}: {key} {expected}, found {single}", path.display()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_are_an_id_a_list_or_null() {
        let path = Path::new("config.json");
        let ids = |value: serde_json::Value| token_ids(Some(&value), "eos_token_id", path);
        assert_eq!(ids(serde_json::json!(7)).unwrap(), vec![7]);
        assert_eq!(ids(serde_json::json!([3, 9])).unwrap(), vec![3, 9]);
        assert!(ids(serde_json::Value::Null).unwrap().is_empty());
        assert!(token_ids(None, "eos_token_id", path).unwrap().is_empty());
        let err = ids(serde_json::json!("x")).unwrap_err().to_string();
        assert!(
            err.contains("config.json: eos_token_id must be a token id or a list of token ids"),
            "{err}"
        );
    }

    #[test]
    fn stop_ids_come_from_the_top_level_first_then_the_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        let stops = |config: serde_json::Value| model_stop_ids(dir.path(), &config, 16).unwrap();
        let text = serde_json::json!({"eos_token_id": 4});
        assert_eq!(stops(serde_json::json!({"text_config": text})), vec![4]);
        assert_eq!(
            stops(serde_json::json!({"eos_token_id": [3, 5], "text_config": text})),
            vec![3, 5]
        );
        assert_eq!(
            stops(serde_json::json!({"eos_token_id": null, "text_config": text})),
            vec![4]
        );
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [5, 8]}"#,
        )
        .unwrap();
        assert_eq!(
            stops(serde_json::json!({"eos_token_id": [3, 5]})),
            vec![3, 5, 8]
        );
    }
}
