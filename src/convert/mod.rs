//! `coli convert SRC DST`: a Hugging Face checkpoint (f32/bf16/f16, or FP8 with
//! `weight_scale_inv` 128x128 block scales) to a colibri-style container, the format every
//! engine reads with no change (see [`crate::quant::format`]).
//!
//! Each tensor falls into a class: norms, routers, biases and every other non-matrix
//! tensor are kept in f32, and so is what the checkpoint's engine declares it reads only in
//! f32 ([`crate::engines::kept_in_f32`]: convolution taps, the DSA indexer's head weights,
//! KDA's beta and decay-gate projections, ...; a checkpoint of no engine coli runs is
//! refused); the embedding and LM head (`io`) take `--io-bits`;
//! routed experts `--expert-bits`; every other matrix `--dense-bits`. A class at `>= 16`
//! bits keeps the source float dtype (FP8 is dequantised to f32), `5..8` bits is int8 with
//! one scale per row, `4` is int4 in groups of `--group-size` columns (0: one scale per row);
//! `fp8` is E4M3 with one f32 scale per 128x128 block (DeepSeek's and GLM's published
//! layout), `mxfp4` is OCP MX FP4 (Kimi K3's experts). A quantised weight is written as
//! colibri writes it: a flat U8 (FP8: F8_E4M3) `name` and a flat `name.qs` (F32; MXFP4's
//! E8M0 exponents as U8); each shard's `__metadata__` carries the `colibri.fmt` stamp naming
//! every matrix's format. Tensors already quantised in the source (an MXFP4 `weight_packed` with
//! its `weight_scale`, a container's `.qs` pair) are copied byte for byte.
//!
//! Layout: float tensors first (widest dtype first, so every one stays aligned), then the
//! quantised ones in name order, with each routed expert's three matrices written
//! back to back and followed by their three scale tensors, so an expert is one contiguous
//! read. The plan (which tensor goes to which shard, at which offset) is fixed before any
//! byte is written and recorded in `DST/.coli-convert.json`; a rerun with the same source
//! and options skips every shard already complete, so an interrupted conversion resumes.
//! Shards are written under a hidden temporary name and renamed when complete.

mod writer;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::str::FromStr;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;

use crate::engines;
use crate::quant::{self, Format, Matrix, Width};
use crate::snapshot::{guard, Dtype, Snapshot, TensorView};
use writer::{Entry, ShardWriter};

/// The group sizes a reader can detect from the scale count.
const GROUP_SIZES: [usize; 8] = quant::format::INT4_GROUP_SIZES;

/// What one tensor class is written as: a bit width (`>= 16` keeps float, `5..=15` int8
/// per row, `4` int4) or one of the published minifloat formats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Precision {
    Bits(u32),
    /// E4M3 with one f32 scale per 128x128 block.
    Fp8,
    /// OCP MX FP4: e2m1 in groups of 32 with one E8M0 exponent each.
    Mxfp4,
}

impl Precision {
    /// The embedding and LM head's default for dense weights at `self`: never below 8
    /// bits, since those two matrices carry most of a 4-bit model's loss
    /// (docs/benchmarks.md).
    pub fn for_io(self) -> Precision {
        match self {
            Precision::Bits(bits) => Precision::Bits(bits.max(8)),
            Precision::Fp8 => Precision::Fp8,
            Precision::Mxfp4 => Precision::Bits(8),
        }
    }

    /// How the conversion manifest records it: a number of bits, or the format's name.
    fn manifest(self) -> serde_json::Value {
        match self {
            Precision::Bits(bits) => bits.into(),
            other => other.to_string().into(),
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Precision::Bits(bits) => write!(f, "{bits}"),
            Precision::Fp8 => f.write_str("fp8"),
            Precision::Mxfp4 => f.write_str("mxfp4"),
        }
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(text: &str) -> Result<Precision, String> {
        match text {
            "fp8" => Ok(Precision::Fp8),
            "mxfp4" => Ok(Precision::Mxfp4),
            _ => text.parse().map(Precision::Bits).map_err(|_| {
                format!("{text:?} is not a bit count or a format: expected a number, fp8 or mxfp4")
            }),
        }
    }
}

/// What `coli convert` was asked for.
#[derive(Debug, Clone, PartialEq)]
pub struct Options {
    /// Routed experts.
    pub expert_bits: Precision,
    /// Every other matrix except the embedding and LM head.
    pub dense_bits: Precision,
    /// The embedding and LM head.
    pub io_bits: Precision,
    /// Columns per int4 scale; 0 for one scale per row.
    pub group_size: usize,
    /// Largest shard, in bytes (a routed expert is never split across shards).
    pub shard_bytes: u64,
    /// `--model`: the engine whose f32 tensors are kept (default: from `model_type`).
    pub model: Option<String>,
}

/// Where a tensor class goes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Target {
    /// Keep the source float dtype (FP8 becomes f32).
    Float,
    Quantised(Format),
}

impl Options {
    fn target(&self, precision: Precision, what: &str) -> Result<Target> {
        let bits = match precision {
            Precision::Bits(bits) => bits,
            Precision::Fp8 => return Ok(Target::Quantised(Format::Fp8E4m3B128)),
            Precision::Mxfp4 => return Ok(Target::Quantised(Format::Mxfp4)),
        };
        Ok(match bits {
            16.. => Target::Float,
            5..=15 => Target::Quantised(Format::Int8Row),
            4 if self.group_size == 0 => Target::Quantised(Format::Int4Row),
            4 if GROUP_SIZES.contains(&self.group_size) => {
                Target::Quantised(Format::Int4Grouped {
                    group: self.group_size,
                })
            }
            4 => bail!(
                "--group-size {}: readers find the group size from the scale count, so it must be 0 (per row) or one of {GROUP_SIZES:?}",
                self.group_size
            ),
            _ => bail!(
                "{what} {bits}: use 16 or more (float), 5..8 (int8 per row), 4 (int4), fp8 or mxfp4"
            ),
        })
    }
}

/// The format a matrix of `cols` columns is written in for `target`, chosen so that a
/// reader without the stamp infers it from the byte counts. Readers find an int4 group size
/// from the scale count, trying the listed sizes from the smallest, so a group count that a
/// smaller size also gives is written with that smaller size (96 columns at
/// `--group-size 64` become two groups of 48: the same bytes and scale count); and where
/// that layout has int3-g64's byte counts (96 or 144 columns), which readers check first,
/// the next smaller size is used. One group per row is int4-row.
fn effective(target: Target, cols: usize) -> Format {
    let int3_counts = |group: usize| {
        cols.div_ceil(2) == cols.div_ceil(64) * 24 && cols.div_ceil(group) == cols.div_ceil(64)
    };
    match target {
        Target::Quantised(Format::Int4Grouped { group }) if cols <= group => Format::Int4Row,
        Target::Quantised(Format::Int4Grouped { group }) => {
            let detected = GROUP_SIZES
                .iter()
                .copied()
                .find(|&gs| cols.div_ceil(gs) == cols.div_ceil(group))
                .unwrap_or(group);
            let group = GROUP_SIZES
                .iter()
                .rev()
                .copied()
                .filter(|&gs| gs <= detected && !int3_counts(gs))
                .find(|&gs| {
                    GROUP_SIZES
                        .iter()
                        .find(|&&g| cols.div_ceil(g) == cols.div_ceil(gs))
                        == Some(&gs)
                })
                .unwrap_or(GROUP_SIZES[0]);
            Format::Int4Grouped { group }
        }
        Target::Quantised(format) => format,
        Target::Float => unreachable!("only quantised targets have a format"),
    }
}

/// A tensor's role, which decides its width.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Class {
    /// Norms, routers, biases, conv taps, scalars: f32 always.
    Keep,
    Io,
    Expert,
    Dense,
}

/// A tensor's class: what every engine keeps in f32 (vectors, norms, routers, biases), what
/// the engine declares it reads only in f32 (`kept`: name fragments,
/// [`engines::kept_in_f32`]), else by role.
fn classify(name: &str, rank: usize, kept: &[&str]) -> Class {
    let keep = rank < 2
        || name.contains("norm")
        || name.ends_with(".gate.weight")
        || name.contains(".router.")
        || name.ends_with(".bias")
        || kept.iter().any(|fragment| name.contains(fragment));
    let matrix = name.ends_with(".weight") || name.ends_with("_proj");
    if keep || !matrix {
        Class::Keep
    } else if name.ends_with("embed_tokens.weight") || name.ends_with("lm_head.weight") {
        Class::Io
    } else if name.contains(".experts.") && !name.contains("shared_experts") {
        Class::Expert
    } else {
        Class::Dense
    }
}

/// One unit of writing.
#[derive(Debug, Clone)]
enum Job {
    /// Bytes copied verbatim: the tensor and, for a pre-quantised weight, its scales.
    Copy { names: Vec<String> },
    /// A float tensor widened (or an FP8 one dequantised) to f32.
    Widen { name: String },
    /// Matrices quantised, each to its format: each weight in order, then each `.qs`.
    Quantise {
        names: Vec<String>,
        formats: Vec<Format>,
    },
}

/// A job with the shard entries it produces and the source bytes it reads.
struct Planned {
    job: Job,
    entries: Vec<Entry>,
    source_bytes: u64,
    stamps: Vec<(String, &'static str)>,
}

/// `[rows, cols]` of a tensor read as a matrix: leading dimensions folded into rows.
fn matrix_shape(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&cols, leading)) => (leading.iter().product(), cols),
        None => (1, 1),
    }
}

fn quantised_entries(name: &str, format: Format, rows: usize, cols: usize) -> (Entry, Entry) {
    let nibbles = rows * cols.div_ceil(2);
    let (weight_dtype, weight_bytes, scale_dtype, scales) = match format {
        Format::Int8Row => (Dtype::U8, rows * cols, Dtype::F32, rows),
        Format::Int4Row => (Dtype::U8, nibbles, Dtype::F32, rows),
        Format::Int4Grouped { group } => {
            (Dtype::U8, nibbles, Dtype::F32, rows * cols.div_ceil(group))
        }
        Format::Fp8E4m3B128 => (
            Dtype::F8_E4M3,
            rows * cols,
            Dtype::F32,
            rows.div_ceil(128) * cols.div_ceil(128),
        ),
        Format::Mxfp4 => (Dtype::U8, nibbles, Dtype::U8, rows * cols.div_ceil(32)),
        other => unreachable!("the converter never writes {other}"),
    };
    (
        Entry {
            name: name.to_string(),
            dtype: weight_dtype,
            shape: vec![weight_bytes],
            bytes: weight_bytes,
        },
        Entry {
            name: format!("{name}.qs"),
            dtype: scale_dtype,
            shape: vec![scales],
            bytes: scales * scale_dtype.bitsize() / 8,
        },
    )
}

fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
}

/// The jobs for every tensor of `snapshot`, in write order.
/// Every tensor's job; `kept`: what the engine reads only in f32.
fn plan(snapshot: &Snapshot, options: &Options, kept: &[&str]) -> Result<Vec<Planned>> {
    let mut names: Vec<&str> = snapshot.names().collect();
    names.sort_unstable();
    let mut views = HashMap::new();
    let mut sidecars = HashSet::new();
    for &name in &names {
        let view = snapshot.tensor(name)?;
        if let Some(scales) = &view.scales {
            sidecars.insert(scales.name.clone());
        }
        views.insert(name, view);
    }
    let expert_target = options.target(options.expert_bits, "--expert-bits")?;
    let dense_target = options.target(options.dense_bits, "--dense-bits")?;
    let io_target = options.target(options.io_bits, "--io-bits")?;

    let mut floats = Vec::new();
    let mut quantised: Vec<(String, Planned)> = Vec::new();
    let mut experts: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for &name in names.iter().filter(|n| !sidecars.contains(**n)) {
        let view = &views[name];
        let source_bytes =
            (view.bytes.len() + view.scales.as_ref().map_or(0, |s| s.bytes.len())) as u64;
        let fp8 = view.dtype == Dtype::F8_E4M3 && view.scales.is_some();
        if view.scales.is_some() && !fp8 {
            let scales = view
                .scales
                .as_deref()
                .map(|s| s.name.clone())
                .unwrap_or_default();
            let entries = [view, &views[scales.as_str()]]
                .iter()
                .map(|v| Entry {
                    name: v.name.clone(),
                    dtype: v.dtype,
                    shape: v.shape.clone(),
                    bytes: v.bytes.len(),
                })
                .collect();
            let planned = Planned {
                job: Job::Copy {
                    names: vec![name.to_string(), scales],
                },
                entries,
                source_bytes,
                stamps: Vec::new(),
            };
            quantised.push((name.to_string(), planned));
            continue;
        }
        if !is_float(view.dtype) && !fp8 {
            if view.dtype == Dtype::F8_E4M3 {
                bail!(
                    "{}: tensor {name} is F8_E4M3 without its {name}_scale_inv block scales",
                    view.file.display()
                );
            }
            if classify(name, view.shape.len(), kept) != Class::Keep {
                bail!(
                    "{}: tensor {name} is a weight matrix stored as {:?}; expected F32, BF16 or F16 (or quantised bytes with their scales): the checkpoint is damaged or not a model's",
                    view.file.display(),
                    view.dtype
                );
            }
            floats.push(Planned {
                job: Job::Copy {
                    names: vec![name.to_string()],
                },
                entries: vec![Entry {
                    name: name.to_string(),
                    dtype: view.dtype,
                    shape: view.shape.clone(),
                    bytes: view.bytes.len(),
                }],
                source_bytes,
                stamps: Vec::new(),
            });
            continue;
        }
        let class = classify(name, view.shape.len(), kept);
        let target = match class {
            Class::Keep => Target::Float,
            Class::Io => io_target,
            Class::Expert => expert_target,
            Class::Dense => dense_target,
        };
        let matrix_stamp = if class == Class::Keep {
            Vec::new()
        } else {
            vec![(name.to_string(), "f32")]
        };
        let numel: usize = view.shape.iter().product();
        match target {
            Target::Float if view.dtype == Dtype::F32 || (class != Class::Keep && !fp8) => floats
                .push(Planned {
                    job: Job::Copy {
                        names: vec![name.to_string()],
                    },
                    entries: vec![Entry {
                        name: name.to_string(),
                        dtype: view.dtype,
                        shape: view.shape.clone(),
                        bytes: view.bytes.len(),
                    }],
                    source_bytes,
                    stamps: matrix_stamp,
                }),
            Target::Float => floats.push(Planned {
                job: Job::Widen {
                    name: name.to_string(),
                },
                entries: vec![Entry {
                    name: name.to_string(),
                    dtype: Dtype::F32,
                    shape: view.shape.clone(),
                    bytes: numel * 4,
                }],
                source_bytes,
                stamps: matrix_stamp,
            }),
            Target::Quantised(_) => {
                if class == Class::Expert {
                    if let Some(prefix) = expert_prefix(name) {
                        experts.entry(prefix.to_string()).or_default().push(name);
                        continue;
                    }
                }
                let (rows, cols) = matrix_shape(&view.shape);
                let format = effective(target, cols);
                let (weights, scales) = quantised_entries(name, format, rows, cols);
                quantised.push((
                    name.to_string(),
                    Planned {
                        job: Job::Quantise {
                            names: vec![name.to_string()],
                            formats: vec![format],
                        },
                        entries: vec![weights, scales],
                        source_bytes,
                        stamps: vec![(name.to_string(), format.name())],
                    },
                ));
            }
        }
    }
    for (prefix, mut members) in experts {
        // gate, up, down: the order an expert's FFN reads them.
        members.sort_by_key(|name| {
            ["gate_proj", "up_proj", "down_proj"]
                .iter()
                .position(|p| name.contains(p))
        });
        let mut weights = Vec::new();
        let mut scales = Vec::new();
        let mut formats = Vec::new();
        let mut source_bytes = 0;
        for &name in &members {
            let view = &views[name];
            let (rows, cols) = matrix_shape(&view.shape);
            let format = effective(expert_target, cols);
            let (w, s) = quantised_entries(name, format, rows, cols);
            weights.push(w);
            scales.push(s);
            formats.push(format);
            source_bytes +=
                (view.bytes.len() + view.scales.as_ref().map_or(0, |s| s.bytes.len())) as u64;
        }
        weights.extend(scales);
        quantised.push((
            prefix,
            Planned {
                stamps: members
                    .iter()
                    .zip(&formats)
                    .map(|(n, f)| (n.to_string(), f.name()))
                    .collect(),
                job: Job::Quantise {
                    names: members.iter().map(|n| n.to_string()).collect(),
                    formats,
                },
                entries: weights,
                source_bytes,
            },
        ));
    }
    // Widest float dtype first keeps every float tensor aligned after the 8-aligned header.
    floats.sort_by_key(|p| {
        let entry = &p.entries[0];
        (std::cmp::Reverse(entry.dtype.bitsize()), entry.name.clone())
    });
    quantised.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(floats
        .into_iter()
        .chain(quantised.into_iter().map(|(_, p)| p))
        .collect())
}

/// `model.layers.3.mlp.experts.17` for `model.layers.3.mlp.experts.17.up_proj.weight`.
fn expert_prefix(name: &str) -> Option<&str> {
    let stem = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))?
        .strip_suffix('.')?;
    let (parent, id) = stem.rsplit_once('.')?;
    (parent.ends_with(".experts") && id.parse::<usize>().is_ok()).then_some(stem)
}

/// Jobs grouped into shards of at most `shard_bytes` (a job is never split).
fn shards(jobs: Vec<Planned>, shard_bytes: u64) -> Vec<Vec<Planned>> {
    let mut shards: Vec<Vec<Planned>> = Vec::new();
    let mut size = 0u64;
    for job in jobs {
        let bytes: u64 = job.entries.iter().map(|e| e.bytes as u64).sum();
        if shards.is_empty() || (size > 0 && size + bytes > shard_bytes) {
            shards.push(Vec::new());
            size = 0;
        }
        size += bytes;
        shards
            .last_mut()
            .expect("a shard was just pushed")
            .push(job);
    }
    shards
}

fn shard_name(index: usize, count: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", index + 1, count)
}

const MANIFEST: &str = ".coli-convert.json";

/// FNV-1a over the source's tensor list, so a resume can tell it is the same source.
fn fingerprint(snapshot: &Snapshot) -> String {
    let mut names: Vec<&str> = snapshot.names().collect();
    names.sort_unstable();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for name in names {
        let line = match snapshot.tensor(name) {
            Ok(view) => format!(
                "{name} {:?} {:?} {}\n",
                view.dtype,
                view.shape,
                view.bytes.len()
            ),
            Err(_) => format!("{name}\n"),
        };
        for byte in line.bytes() {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

/// Whether `path` is a complete shard holding exactly `entries` (only its header is read).
fn shard_complete(path: &Path, entries: &[Entry]) -> bool {
    use std::io::Read;
    let read_header = || -> Option<(u64, serde_json::Value)> {
        let mut file = std::fs::File::open(path).ok()?;
        let mut prefix = [0u8; 8];
        file.read_exact(&mut prefix).ok()?;
        let len = u64::from_le_bytes(prefix);
        let mut header = vec![0u8; usize::try_from(len).ok()?];
        file.read_exact(&mut header).ok()?;
        Some((len, serde_json::from_slice(&header).ok()?))
    };
    let Some((len, header)) = read_header() else {
        return false;
    };
    let data: usize = entries.iter().map(|e| e.bytes).sum();
    let size_ok = std::fs::metadata(path).is_ok_and(|m| m.len() == 8 + len + data as u64);
    let names: HashSet<&str> = header
        .as_object()
        .map(|o| {
            o.keys()
                .map(String::as_str)
                .filter(|k| *k != "__metadata__")
                .collect()
        })
        .unwrap_or_default();
    size_ok
        && names.len() == entries.len()
        && entries.iter().all(|e| names.contains(e.name.as_str()))
}

/// Files beside the weights that a model directory needs (config, tokenizer, templates).
fn is_side_file(name: &str) -> bool {
    !name.starts_with('.')
        && !name.ends_with(".safetensors.index.json")
        && [".json", ".model", ".tiktoken", ".jinja", ".txt"]
            .iter()
            .any(|ext| name.ends_with(ext))
}

/// What a finished conversion did.
#[derive(Debug)]
pub struct Summary {
    pub shards: usize,
    pub shards_skipped: usize,
    pub tensors: usize,
    pub source_bytes: u64,
    pub written_bytes: u64,
    pub seconds: f64,
}

/// Convert the checkpoint in `src` to a container in `dst`.
pub fn convert(src: &Path, dst: &Path, options: &Options) -> Result<Summary> {
    let started = Instant::now();
    if let (Ok(a), Ok(b)) = (src.canonicalize(), dst.canonicalize()) {
        if a == b {
            bail!("convert: source and destination are both {}", src.display());
        }
    }
    let snapshot = Snapshot::open(src).context("convert: the source checkpoint")?;
    let engine = engines::resolve(options.model.as_deref(), &snapshot)
        .context("convert: the engine decides which tensors stay f32")?;
    let kept = engines::kept_in_f32(engine);
    let shard_plan = shards(plan(&snapshot, options, kept)?, options.shard_bytes.max(1));
    let count = shard_plan.len();
    let manifest = serde_json::json!({
        "source": fingerprint(&snapshot),
        "engine": engine,
        "expert_bits": options.expert_bits.manifest(),
        "dense_bits": options.dense_bits.manifest(),
        "io_bits": options.io_bits.manifest(),
        "group_size": options.group_size,
        "shards": shard_plan.iter().enumerate().map(|(i, jobs)| {
            serde_json::json!({
                "file": shard_name(i, count),
                "tensors": jobs.iter().flat_map(|j| j.entries.iter().map(|e| e.name.clone())).collect::<Vec<_>>(),
            })
        }).collect::<Vec<_>>(),
    });
    prepare_destination(dst, &manifest)?;
    // From here the destination is this conversion's: what stops it leaves complete shards
    // that the same command resumes from.
    let mut summary = write_shards(&snapshot, src, dst, &shard_plan).with_context(|| {
        format!(
            "{}: the conversion stopped; rerun the same command to resume from its complete shards (the .partial files are removed then)",
            dst.display()
        )
    })?;
    summary.seconds = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// Write the shards of `shard_plan` into `dst` (those already complete are skipped), then
/// copy the side files of `src`.
fn write_shards(
    snapshot: &Snapshot,
    src: &Path,
    dst: &Path,
    shard_plan: &[Vec<Planned>],
) -> Result<Summary> {
    let count = shard_plan.len();
    let total: u64 = shard_plan.iter().flatten().map(|j| j.source_bytes).sum();
    let bar = progress_bar(total);
    let mut summary = Summary {
        shards: count,
        shards_skipped: 0,
        tensors: 0,
        source_bytes: total,
        written_bytes: 0,
        seconds: 0.0,
    };
    for (index, jobs) in shard_plan.iter().enumerate() {
        let path = dst.join(shard_name(index, count));
        let entries: Vec<Entry> = jobs
            .iter()
            .flat_map(|j| j.entries.iter().cloned())
            .collect();
        summary.tensors += entries.len();
        summary.written_bytes += entries.iter().map(|e| e.bytes as u64).sum::<u64>();
        if shard_complete(&path, &entries) {
            summary.shards_skipped += 1;
            bar.inc(jobs.iter().map(|j| j.source_bytes).sum());
            continue;
        }
        let mut metadata = BTreeMap::new();
        metadata.insert("format".to_string(), "pt".to_string());
        let stamps: BTreeMap<&str, &str> = jobs
            .iter()
            .flat_map(|j| j.stamps.iter().map(|(n, f)| (n.as_str(), *f)))
            .collect();
        if !stamps.is_empty() {
            let formats: std::collections::BTreeSet<&str> = stamps.values().copied().collect();
            metadata.insert("colibri.fmt".to_string(), serde_json::to_string(&stamps)?);
            metadata.insert(
                "colibri.container.formats".to_string(),
                serde_json::to_string(&formats)?,
            );
        }
        let mut writer = ShardWriter::create(&path, entries, &metadata)?;
        for job in jobs {
            // A source shard that changed under the job made its bytes meaningless (and a
            // read of a truncated mapping may fail as a bad address): that is what is said,
            // and the shard is never finished.
            let done = run_job(snapshot, &job.job, &mut writer);
            guard::check()?;
            done?;
            bar.inc(job.source_bytes);
        }
        writer.finish()?;
    }
    bar.finish_and_clear();
    for entry in std::fs::read_dir(src).with_context(|| format!("cannot list {}", src.display()))? {
        let entry = entry.with_context(|| format!("cannot list {}", src.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if entry.path().is_file() && is_side_file(&name) {
            let bytes = std::fs::read(entry.path())
                .with_context(|| format!("cannot read {}", entry.path().display()))?;
            writer::write_atomic(&dst.join(&name), &bytes)?;
        }
    }
    Ok(summary)
}

/// Make `dst` ready: create it, or check that what it holds is this conversion's earlier,
/// interrupted run (its manifest matches), and clear stale temporary files.
fn prepare_destination(dst: &Path, manifest: &serde_json::Value) -> Result<()> {
    let manifest_path = dst.join(MANIFEST);
    if dst.exists() {
        let has_files = std::fs::read_dir(dst)
            .with_context(|| format!("cannot list {}", dst.display()))?
            .next()
            .is_some();
        if manifest_path.exists() {
            let previous = read_manifest(&manifest_path)?;
            if previous != *manifest {
                bail!(
                    "{} holds {}; remove it or choose another destination",
                    dst.display(),
                    describe_other(dst, &previous, manifest)
                );
            }
        } else if has_files {
            bail!(
                "{} exists and is not empty; convert writes into a new or empty directory (or resumes its own unfinished run)",
                dst.display()
            );
        }
        for entry in
            std::fs::read_dir(dst).with_context(|| format!("cannot list {}", dst.display()))?
        {
            let path = entry
                .with_context(|| format!("cannot list {}", dst.display()))?
                .path();
            if path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().ends_with(".partial"))
            {
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove {}", path.display()))?;
            }
        }
    } else {
        std::fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
    }
    writer::write_atomic(
        &manifest_path,
        serde_json::to_string_pretty(manifest)?.as_bytes(),
    )
}

/// The manifest an earlier run left at `path`: a JSON object, or an error that says the
/// file cannot tell what the directory holds.
fn read_manifest(path: &Path) -> Result<serde_json::Value> {
    let unreadable = |why: String| {
        anyhow::anyhow!(
            "{}: {why}, so what its directory holds is unknown (a conversion's record is a JSON object written by coli convert); remove the directory, or choose another destination",
            path.display()
        )
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| unreadable(format!("cannot read it ({e})")))?;
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(value) if value.is_object() => Ok(value),
        Ok(_) => Err(unreadable("it is JSON but not an object".to_string())),
        Err(e) => Err(unreadable(format!("it is not valid JSON ({e})"))),
    }
}

/// What the conversion recorded in `previous` is, said against the one `wanted` asks for:
/// finished (every planned shard written) or not, and each setting that differs.
fn describe_other(dst: &Path, previous: &serde_json::Value, wanted: &serde_json::Value) -> String {
    let planned: Vec<&str> = previous
        .get("shards")
        .and_then(|s| s.as_array())
        .map(|shards| {
            shards
                .iter()
                .filter_map(|s| s.get("file").and_then(|f| f.as_str()))
                .collect()
        })
        .unwrap_or_default();
    let finished = !planned.is_empty() && planned.iter().all(|f| dst.join(f).is_file());
    let state = if finished {
        "a finished conversion"
    } else {
        "an unfinished conversion"
    };
    let mut differences = Vec::new();
    if previous.get("source") != wanted.get("source") {
        differences.push("of another source (its tensors differ)".to_string());
    }
    for (key, flag) in [
        ("engine", "--model"),
        ("expert_bits", "--expert-bits"),
        ("dense_bits", "--dense-bits"),
        ("io_bits", "--io-bits"),
        ("group_size", "--group-size"),
    ] {
        let (there, here) = (previous.get(key), wanted.get(key));
        if there != here {
            let show = |v: Option<&serde_json::Value>| match v {
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(v) => v.to_string(),
                None => "unset".to_string(),
            };
            differences.push(format!(
                "{flag} {} (this command: {})",
                show(there),
                show(here)
            ));
        }
    }
    if differences.is_empty() && previous.get("shards") != wanted.get("shards") {
        differences.push("another shard layout (--shard-gb)".to_string());
    }
    format!("{state} made with {}", differences.join(", "))
}

fn progress_bar(total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "convert [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    ) {
        bar.set_style(style);
    }
    bar
}

/// The matrix a float or FP8 source tensor holds, read as `[rows, cols]`.
fn source_matrix(snapshot: &Snapshot, name: &str) -> Result<Matrix> {
    let view = snapshot.tensor(name)?;
    let (rows, cols) = matrix_shape(&view.shape);
    let shaped = quant::format::shaped(
        TensorView {
            shape: if view.scales.is_some() {
                view.shape.clone()
            } else {
                vec![rows, cols]
            },
            ..view
        },
        &[rows, cols],
    )?;
    Matrix::load(&shaped, Width::F32)
}

fn run_job(snapshot: &Snapshot, job: &Job, writer: &mut ShardWriter) -> Result<()> {
    match job {
        Job::Copy { names } => {
            for name in names {
                let view = snapshot.tensor(name)?;
                for chunk in view.bytes.as_slice().chunks(64 << 20) {
                    writer.write(name, chunk)?;
                }
            }
        }
        Job::Widen { name } => {
            let view = snapshot.tensor(name)?;
            let values = if view.dtype == Dtype::F8_E4M3 {
                source_matrix(snapshot, name)?.to_f32()
            } else {
                quant::read_f32(&view)?
            };
            writer.write(name, bytemuck::cast_slice(&values))?;
        }
        Job::Quantise { names, formats } => {
            let mut all_scales = Vec::with_capacity(names.len());
            for (name, format) in names.iter().zip(formats) {
                let matrix = source_matrix(snapshot, name)?;
                all_scales.push(quantise_into(&matrix, *format, name, writer)?);
            }
            for (name, scales) in names.iter().zip(all_scales) {
                writer.write(&format!("{name}.qs"), &scales)?;
            }
        }
    }
    Ok(())
}

/// Quantise `matrix` block by block (units of rows in parallel), streaming the weight bytes
/// to `writer`; returns the scale tensor's bytes.
fn quantise_into(
    matrix: &Matrix,
    format: Format,
    name: &str,
    writer: &mut ShardWriter,
) -> Result<Vec<u8>> {
    let (rows, cols) = (matrix.rows(), matrix.cols());
    // FP8's scales cover 128x128 blocks, so it is quantised 128 rows at a time.
    let unit = if format == Format::Fp8E4m3B128 {
        128
    } else {
        1
    };
    let block = ((16 << 20) / cols.max(1))
        .clamp(1, rows.max(1))
        .next_multiple_of(unit);
    let encode = |values: &[f32]| -> (Vec<u8>, Vec<u8>) {
        let f32_bytes = |scales: Vec<f32>| bytemuck::cast_slice(&scales).to_vec();
        match format {
            Format::Int8Row => {
                let (q, s) = quant::quantize_int8_rows(values, cols);
                (bytemuck::cast_slice(&q).to_vec(), f32_bytes(s))
            }
            Format::Int4Grouped { group } => {
                let (q, s) = quant::quantize_int4_groups(values, cols, group);
                (q, f32_bytes(s))
            }
            Format::Int4Row => {
                let (q, s) = quant::quantize_int4_groups(values, cols, cols);
                (q, f32_bytes(s))
            }
            Format::Fp8E4m3B128 => {
                let (q, s) = quant::quantize_fp8_blocks(values, cols);
                (q, f32_bytes(s))
            }
            Format::Mxfp4 => quant::quantize_mxfp4(values, cols),
            other => unreachable!("the converter never writes {other}"),
        }
    };
    let mut scales = Vec::new();
    for first in (0..rows).step_by(block) {
        let last = (first + block).min(rows);
        let quantised: Vec<(Vec<u8>, Vec<u8>)> = (first..last)
            .step_by(unit)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|start| {
                let end = (start + unit).min(last);
                let mut values = vec![0f32; (end - start) * cols];
                for (row, out) in (start..end).zip(values.chunks_exact_mut(cols.max(1))) {
                    matrix.row_into(row, out);
                }
                encode(&values)
            })
            .collect();
        let mut bytes = Vec::with_capacity(quantised.iter().map(|(b, _)| b.len()).sum());
        for (b, s) in quantised {
            bytes.extend_from_slice(&b);
            scales.extend_from_slice(&s);
        }
        writer.write(name, &bytes)?;
    }
    Ok(scales)
}

/// `coli convert` output lines.
pub fn report(summary: &Summary, dst: &Path) -> String {
    format!(
        "converted {} tensors into {} shards ({} already complete) in {}: {:.2} GB read, {:.2} GB written, {:.1} s",
        summary.tensors,
        summary.shards,
        summary.shards_skipped,
        dst.display(),
        summary.source_bytes as f64 / 1e9,
        summary.written_bytes as f64 / 1e9,
        summary.seconds
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        // What an engine declares is kept; without the declaration it would be quantised.
        let indexer = "model.layers.0.self_attn.indexer.weights_proj.weight";
        assert_eq!(classify(indexer, 2, &[]), Class::Dense);
        assert_eq!(
            classify(indexer, 2, engines::glm_moe_dsa::KEPT_F32),
            Class::Keep
        );
        for name in [
            "model.layers.0.self_attn.f_a_proj.weight",
            "model.layers.2.self_attention_res_proj.weight",
        ] {
            assert_eq!(
                classify(name, 2, engines::kimi_k3::KEPT_F32),
                Class::Keep,
                "{name}"
            );
        }
        assert_eq!(
            classify("model.layers.0.input_layernorm.weight", 1, &[]),
            Class::Keep
        );
        assert_eq!(
            classify("model.layers.0.mlp.gate.weight", 2, &[]),
            Class::Keep
        );
        assert_eq!(
            classify("model.layers.0.self_attn.q_a_layernorm.weight", 1, &[]),
            Class::Keep
        );
        assert_eq!(
            classify(
                "model.layers.0.attn_sconv.conv1d.weight",
                3,
                engines::inkling::KEPT_F32
            ),
            Class::Keep
        );
        assert_eq!(
            classify(
                "model.layers.0.self_attn.rel_logits_proj.proj",
                2,
                engines::inkling::KEPT_F32
            ),
            Class::Keep
        );
        assert_eq!(classify("model.embed_tokens.weight", 2, &[]), Class::Io);
        assert_eq!(classify("lm_head.weight", 2, &[]), Class::Io);
        assert_eq!(
            classify("model.layers.1.mlp.experts.3.down_proj.weight", 2, &[]),
            Class::Expert
        );
        assert_eq!(
            classify("model.layers.1.mlp.experts.gate_up_proj", 3, &[]),
            Class::Expert
        );
        assert_eq!(
            classify("model.layers.1.mlp.shared_experts.gate_proj", 3, &[]),
            Class::Dense
        );
        assert_eq!(
            classify("model.layers.1.self_attn.q_proj.weight", 2, &[]),
            Class::Dense
        );
        assert_eq!(
            classify("model.layers.1.mlp.gate_proj.weight", 2, &[]),
            Class::Dense
        );
    }

    #[test]
    fn fp8_quantised_in_units_of_128_rows_is_the_whole_matrix_encoding() {
        let (rows, cols) = (300, 200);
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) * (1.0 + (i / cols) as f32))
            .collect();
        let matrix = Matrix::from_f32(rows, cols, values.clone(), Width::F32);
        let (weights, scales) = quantised_entries("w", Format::Fp8E4m3B128, rows, cols);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shard.safetensors");
        let mut writer =
            ShardWriter::create(&path, vec![weights, scales], &BTreeMap::new()).unwrap();
        let written = quantise_into(&matrix, Format::Fp8E4m3B128, "w", &mut writer).unwrap();
        writer.write("w.qs", &written).unwrap();
        writer.finish().unwrap();
        let (codes, expected) = quant::quantize_fp8_blocks(&values, cols);
        assert_eq!(written, bytemuck::cast_slice::<f32, u8>(&expected));
        let bytes = std::fs::read(&path).unwrap();
        let stored = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(stored.tensor("w").unwrap().data(), codes.as_slice());
        assert_eq!(stored.tensor("w").unwrap().dtype(), Dtype::F8_E4M3);
    }

    #[test]
    fn int4_layouts_are_what_a_reader_infers() {
        let g64 = Target::Quantised(Format::Int4Grouped { group: 64 });
        assert_eq!(effective(g64, 64), Format::Int4Row);
        assert_eq!(effective(g64, 2048), Format::Int4Grouped { group: 64 });
        assert_eq!(effective(g64, 200), Format::Int4Grouped { group: 64 });
        // Two groups of 48 would have int3-g64's byte counts; three of 32 do not.
        assert_eq!(effective(g64, 96), Format::Int4Grouped { group: 32 });
        assert_eq!(effective(g64, 144), Format::Int4Grouped { group: 32 });
        assert_eq!(effective(g64, 100), Format::Int4Grouped { group: 64 });
    }

    #[test]
    fn expert_prefixes() {
        assert_eq!(
            expert_prefix("model.layers.3.mlp.experts.17.up_proj.weight"),
            Some("model.layers.3.mlp.experts.17")
        );
        assert_eq!(
            expert_prefix("model.layers.3.mlp.shared_experts.up_proj.weight"),
            None
        );
        assert_eq!(
            expert_prefix("model.layers.3.mlp.experts.gate_up_proj"),
            None
        );
    }
}
