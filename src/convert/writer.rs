//! Writing one safetensors shard whose layout is fixed in advance: the header (offsets,
//! `__metadata__`) is computed from the planned sizes, then the data is streamed in the
//! planned order, so tensors can be placed where readers want them (an expert's matrices
//! adjacent) and nothing needs to be held in memory whole.
//!
//! The file is written under a temporary name in the destination directory and renamed
//! into place only when complete and synced, so an interrupted or failed write never leaves
//! a half-written shard under its final name.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::snapshot::Dtype;

/// One tensor of a planned shard.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: usize,
}

/// The safetensors dtype name.
fn dtype_name(dtype: Dtype) -> Result<&'static str> {
    Ok(match dtype {
        Dtype::F32 => "F32",
        Dtype::BF16 => "BF16",
        Dtype::F16 => "F16",
        Dtype::U8 => "U8",
        Dtype::I8 => "I8",
        Dtype::F8_E4M3 => "F8_E4M3",
        Dtype::F8_E8M0 => "F8_E8M0",
        Dtype::I32 => "I32",
        Dtype::I64 => "I64",
        Dtype::F64 => "F64",
        Dtype::BOOL => "BOOL",
        other => bail!("cannot write dtype {other:?}"),
    })
}

/// The header bytes (length prefix included) for `entries` in order, padded with spaces so
/// the data starts 8-byte aligned.
fn header(entries: &[Entry], metadata: &BTreeMap<String, String>) -> Result<Vec<u8>> {
    let mut object = serde_json::Map::new();
    if !metadata.is_empty() {
        object.insert(
            "__metadata__".to_string(),
            serde_json::to_value(metadata).context("shard metadata")?,
        );
    }
    let mut offset = 0usize;
    for entry in entries {
        object.insert(
            entry.name.clone(),
            serde_json::json!({
                "dtype": dtype_name(entry.dtype)?,
                "shape": entry.shape,
                "data_offsets": [offset, offset + entry.bytes],
            }),
        );
        offset += entry.bytes;
    }
    let mut json = serde_json::to_vec(&object).context("shard header")?;
    while !(8 + json.len()).is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    Ok(out)
}

/// A shard being written: data must arrive exactly in the planned order and sizes.
pub struct ShardWriter {
    final_path: PathBuf,
    temp_path: PathBuf,
    out: BufWriter<File>,
    entries: Vec<Entry>,
    current: usize,
    written_in_current: usize,
}

impl ShardWriter {
    pub fn create(
        final_path: &Path,
        entries: Vec<Entry>,
        metadata: &BTreeMap<String, String>,
    ) -> Result<ShardWriter> {
        let temp_path = temp_path_for(final_path);
        let file = File::create(&temp_path)
            .with_context(|| format!("cannot create {}", temp_path.display()))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&header(&entries, metadata)?)
            .with_context(|| format!("cannot write {}", temp_path.display()))?;
        Ok(ShardWriter {
            final_path: final_path.to_path_buf(),
            temp_path,
            out,
            entries,
            current: 0,
            written_in_current: 0,
        })
    }

    /// Append bytes of the tensor `name`, which must be the one the plan expects next.
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let Some(entry) = self.entries.get(self.current) else {
            bail!(
                "{}: {name} written after the last planned tensor",
                self.final_path.display()
            );
        };
        if entry.name != name || self.written_in_current + bytes.len() > entry.bytes {
            bail!(
                "{}: expected {} more bytes of {}, got {} bytes of {name}",
                self.final_path.display(),
                entry.bytes - self.written_in_current,
                entry.name,
                bytes.len()
            );
        }
        self.out
            .write_all(bytes)
            .with_context(|| format!("cannot write {}", self.temp_path.display()))?;
        self.written_in_current += bytes.len();
        if self.written_in_current == entry.bytes {
            self.current += 1;
            self.written_in_current = 0;
        }
        Ok(())
    }

    /// Check that every planned byte arrived, sync, and rename into place.
    pub fn finish(mut self) -> Result<()> {
        if self.current != self.entries.len() {
            bail!(
                "{}: {} of {} planned tensors written",
                self.final_path.display(),
                self.current,
                self.entries.len()
            );
        }
        self.out
            .flush()
            .with_context(|| format!("cannot write {}", self.temp_path.display()))?;
        let file = self.out.into_inner().map_err(|err| {
            anyhow::anyhow!("cannot write {}: {}", self.temp_path.display(), err.error())
        })?;
        file.sync_all()
            .with_context(|| format!("cannot sync {}", self.temp_path.display()))?;
        std::fs::rename(&self.temp_path, &self.final_path).with_context(|| {
            format!(
                "cannot rename {} to {}",
                self.temp_path.display(),
                self.final_path.display()
            )
        })
    }
}

/// Where `final_path` is written before it is complete: a hidden name that no reader takes
/// for a shard.
pub fn temp_path_for(final_path: &Path) -> PathBuf {
    let name = final_path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    final_path.with_file_name(format!(".{name}.partial"))
}

/// Write `bytes` to `path` through a temporary file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let temp = temp_path_for(path);
    std::fs::write(&temp, bytes).with_context(|| format!("cannot write {}", temp.display()))?;
    std::fs::rename(&temp, path)
        .with_context(|| format!("cannot rename {} to {}", temp.display(), path.display()))
}
