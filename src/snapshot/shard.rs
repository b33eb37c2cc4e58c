//! One mapped safetensors file and the views into it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{SafeTensorError, SafeTensors};

pub use safetensors::Dtype;

/// A tensor's entry in a shard header, with offsets relative to the start of the file.
pub struct ShardEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub start: usize,
    pub end: usize,
}

/// Bytes the views point into: a shard's mapping, watched for as long as it lives (see
/// `guard`), or a buffer the expert store read an expert into.
pub struct Mapping {
    /// Declared before the map, so that the watch ends before the pages are unmapped.
    watch: Option<super::guard::Watch>,
    map: Mmap,
}

impl Mapping {
    /// A buffer that is no file's mapping.
    pub fn buffer(map: Mmap) -> Mapping {
        Mapping { watch: None, map }
    }

    /// The buffer back, for reuse.
    pub fn into_buffer(self) -> Mmap {
        let Mapping { watch, map } = self;
        drop(watch);
        map
    }
}

impl std::ops::Deref for Mapping {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map
    }
}

pub struct Shard {
    path: PathBuf,
    mapping: Arc<Mapping>,
    entries: Vec<(String, ShardEntry)>,
    /// The header's `__metadata__` strings (e.g. the `colibri.fmt` container stamp).
    metadata: std::collections::HashMap<String, String>,
}

impl Shard {
    pub fn open(path: &Path) -> Result<Shard> {
        // Looked at before opening: opening a named pipe waits for a writer, forever.
        let kind = std::fs::metadata(path)
            .with_context(|| format!("cannot open {}", path.display()))?
            .file_type();
        if !kind.is_file() {
            bail!(
                "{} is {}, not a safetensors file",
                path.display(),
                if kind.is_dir() {
                    "a directory"
                } else {
                    "a pipe, socket or device"
                }
            );
        }
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the mapping is read-only; a shard truncated underneath the process reads as
        // zeros from then on and is reported by `guard::check` (see `guard`).
        let map = unsafe { Mmap::map(&file) }
            .with_context(|| format!("cannot memory-map {}", path.display()))?;
        let mapping = Mapping {
            watch: Some(super::guard::watch(&map, file, path)),
            map,
        };
        let (header_len, metadata) =
            SafeTensors::read_metadata(&mapping).map_err(|err| describe(path, &mapping, err))?;
        let data_start = 8 + header_len;
        let entries = metadata
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (begin, end) = info.data_offsets;
                let entry = ShardEntry {
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + begin,
                    end: data_start + end,
                };
                (name, entry)
            })
            .collect();
        Ok(Shard {
            path: path.to_path_buf(),
            metadata: metadata.metadata().clone().unwrap_or_default(),
            mapping: Arc::new(mapping),
            entries,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn mapping(&self) -> Arc<Mapping> {
        Arc::clone(&self.mapping)
    }

    pub fn entries(&self) -> impl Iterator<Item = (&String, &ShardEntry)> {
        self.entries.iter().map(|(name, entry)| (name, entry))
    }

    /// A `__metadata__` value of the header.
    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }
}

/// Turn a safetensors parse error into a message that tells the user what is wrong with
/// which file; a truncated download is by far the most common cause.
fn describe(path: &Path, bytes: &[u8], err: SafeTensorError) -> anyhow::Error {
    match err {
        SafeTensorError::MetadataIncompleteBuffer => {
            let declared = declared_data_len(bytes);
            match declared {
                Some((header_len, data_len)) => anyhow!(
                    "{}: shard is truncated or has trailing bytes: its header declares {} bytes \
                     ({} header + {} data), the file has {} bytes; re-download or re-convert it",
                    path.display(),
                    8 + header_len + data_len,
                    8 + header_len,
                    data_len,
                    bytes.len()
                ),
                None => anyhow!("{}: shard size does not match its header", path.display()),
            }
        }
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => anyhow!(
            "{}: not a safetensors file, or truncated inside its header ({} bytes)",
            path.display(),
            bytes.len()
        ),
        other => match bad_entry(bytes) {
            Some(detail) => anyhow!("{}: invalid safetensors header: {detail}", path.display()),
            None => anyhow!("{}: invalid safetensors header: {other:?}", path.display()),
        },
    }
}

/// The first tensor entry whose declared size or place is wrong, said with its name: its
/// dtype and shape against its `data_offsets`, or offsets beyond the data.
fn bad_entry(bytes: &[u8]) -> Option<String> {
    let header_len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(header_len)?)?).ok()?;
    let data_len = bytes.len().saturating_sub(8 + header_len) as u64;
    for (name, info) in header.as_object()? {
        if name == "__metadata__" {
            continue;
        }
        let offsets: Vec<u64> = info
            .get("data_offsets")
            .and_then(|o| o.as_array())
            .map(|o| o.iter().filter_map(|v| v.as_u64()).collect())
            .unwrap_or_default();
        let [start, end] = offsets[..] else {
            return Some(format!(
                "tensor {name}: data_offsets {:?} is not [start, end]",
                info.get("data_offsets")
            ));
        };
        if start > end || end > data_len {
            return Some(format!(
                "tensor {name}: data_offsets [{start}, {end}] lie beyond the {data_len} data bytes the file holds"
            ));
        }
        let width = match info.get("dtype").and_then(|d| d.as_str()) {
            Some("F64" | "I64" | "U64") => 8,
            Some("F32" | "I32" | "U32") => 4,
            Some("F16" | "BF16" | "I16" | "U16") => 2,
            Some("I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0") => 1,
            _ => continue,
        };
        let shape: Option<Vec<u64>> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .map(|s| s.iter().filter_map(|v| v.as_u64()).collect());
        let Some(shape) = shape else { continue };
        let needed = shape
            .iter()
            .try_fold(width, |acc: u64, &d| acc.checked_mul(d));
        if needed != Some(end - start) {
            return Some(format!(
                "tensor {name}: dtype {} and shape {shape:?} need {} bytes, its data_offsets [{start}, {end}] hold {}",
                info["dtype"].as_str().unwrap_or("?"),
                needed.map_or("more than 2^64".to_string(), |n| n.to_string()),
                end - start
            ));
        }
    }
    None
}

/// The header length and the data length a header declares, read without validation.
fn declared_data_len(bytes: &[u8]) -> Option<(usize, usize)> {
    let header_len = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..8usize.checked_add(header_len)?)?).ok()?;
    let data_len = header
        .as_object()?
        .iter()
        .filter(|(name, _)| name.as_str() != "__metadata__")
        .filter_map(|(_, info)| info.get("data_offsets")?.get(1)?.as_u64())
        .max()
        .unwrap_or(0) as usize;
    Some((header_len, data_len))
}

/// A window into a mapped shard; cloning it shares the mapping.
#[derive(Clone)]
pub struct MappedBytes {
    mapping: Arc<Mapping>,
    start: usize,
    end: usize,
}

impl MappedBytes {
    pub fn new(mapping: Arc<Mapping>, start: usize, end: usize) -> MappedBytes {
        MappedBytes {
            mapping,
            start,
            end,
        }
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.mapping[self.start..self.end]
    }

    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }

    /// `[start, end)` of the window in its mapping: the byte offsets in the shard file for
    /// a window of a shard.
    pub fn range(&self) -> (usize, usize) {
        (self.start, self.end)
    }

    /// A sub-window `[offset, offset + len)` of this window.
    pub fn slice(&self, offset: usize, len: usize) -> MappedBytes {
        debug_assert!(offset + len <= self.len());
        MappedBytes {
            mapping: Arc::clone(&self.mapping),
            start: self.start + offset,
            end: self.start + offset + len,
        }
    }
}

/// A tensor in a shard: its name, dtype, shape and bytes.
#[derive(Clone)]
pub struct TensorView {
    pub name: String,
    pub file: PathBuf,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: MappedBytes,
    /// For a pre-quantised weight, its scale tensor (`name.qs`, an FP8 `name_scale_inv`,
    /// an MXFP4 `*.weight_scale`); `quant` reads the pair.
    pub scales: Option<Box<TensorView>>,
    /// The format the container's `colibri.fmt` stamp claims for this tensor.
    pub stamp: Option<String>,
}

impl TensorView {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Split the leading dimension: the `index`-th of `count` equal parts, e.g. one expert of
    /// a fused `[experts, rows, cols]` tensor, or the gate half of a fused gate/up matrix.
    pub fn part(&self, index: usize, count: usize) -> Result<TensorView> {
        let Some(&lead) = self.shape.first() else {
            bail!("{}: tensor {} is a scalar", self.file.display(), self.name);
        };
        if count == 0 || lead % count != 0 || index >= count {
            bail!(
                "{}: tensor {} with shape {:?} cannot be split into {count} parts",
                self.file.display(),
                self.name,
                self.shape
            );
        }
        let part_bytes = self.bytes.len() / count;
        let mut shape = self.shape.clone();
        shape[0] = lead / count;
        // A quantised weight's scales split with its rows.
        let scales = match &self.scales {
            Some(scales)
                if !scales.bytes.len().is_multiple_of(count)
                    || !self.bytes.len().is_multiple_of(count) =>
            {
                bail!(
                    "{}: quantised tensor {} ({} bytes, {} scale bytes) cannot be split into {count} parts",
                    self.file.display(),
                    self.name,
                    self.bytes.len(),
                    scales.bytes.len()
                )
            }
            Some(scales) => {
                let len = scales.bytes.len() / count;
                Some(Box::new(TensorView {
                    name: format!("{}[{index}/{count}]", scales.name),
                    shape: vec![len / (scales.dtype.bitsize() / 8).max(1)],
                    bytes: scales.bytes.slice(index * len, len),
                    ..(**scales).clone()
                }))
            }
            None => None,
        };
        Ok(TensorView {
            name: format!("{}[{index}/{count}]", self.name),
            file: self.file.clone(),
            dtype: self.dtype,
            shape,
            bytes: self.bytes.slice(index * part_bytes, part_bytes),
            scales,
            stamp: self.stamp.clone(),
        })
    }

    /// Elements `[first, first + product(shape))` of this tensor, read in storage order, as
    /// a tensor of `shape`: a window into a container that packs several matrices into one
    /// tensor. The scales and the stamp are not carried over; the caller pairs the window
    /// with its own scales.
    pub fn span(&self, first: usize, shape: &[usize]) -> Result<TensorView> {
        let size = self.dtype.bitsize() / 8;
        let count = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(usize::MAX);
        let fits = size > 0
            && first
                .checked_add(count)
                .is_some_and(|end| end <= self.bytes.len() / size);
        if !fits {
            bail!(
                "{}: tensor {} ({} bytes of {:?}) has no elements {first}..{} for a {shape:?} part",
                self.file.display(),
                self.name,
                self.bytes.len(),
                self.dtype,
                first.saturating_add(count)
            );
        }
        Ok(TensorView {
            name: format!("{}[{first}..{}]", self.name, first + count),
            file: self.file.clone(),
            dtype: self.dtype,
            shape: shape.to_vec(),
            bytes: self.bytes.slice(first * size, count * size),
            scales: None,
            // A stamp speaks of the whole tensor, not of a window's format.
            stamp: None,
        })
    }

    /// `[a, b, c]` viewed as `[b, c]` after taking part `index` of `a`.
    pub fn select(&self, index: usize) -> Result<TensorView> {
        let count = self.shape.first().copied().unwrap_or(0);
        let mut view = self.part(index, count)?;
        view.shape.remove(0);
        Ok(view)
    }
}
