//! Opening a `.coli_usage` history of any engine, for the tools that inspect and combine
//! histories.
//!
//! An engine reads a history against its own shape and identity; a tool has neither. So it
//! first learns what the file declares (the first `-1` and `-2` records, as the C loop
//! tokenises them, or the IKU1 header) and then reads the file with `route_trace`'s own
//! reader, as the declaring engine would. Every rule about what is admitted, totalled or
//! refused is the reader's; nothing here interprets a data record.

use std::io::{BufRead, BufReader, Read as _};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::files;
use crate::route_trace::history::{self, Layout, ReadReport, Refusal, Trust};
use crate::route_trace::{iku1, scan, Counters, EngineId};

/// The engine that owns IKU1 files.
const IKU1_OWNER: &str = "inkling";

/// What a history says about itself before any record is read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Declared {
    /// `(n_layers, n_experts)` from the first `-1` record or the IKU1 header, when they
    /// can describe a table.
    pub dims: Option<(usize, usize)>,
    /// The first `-2` record's format version.
    pub version: Option<i64>,
    /// The writer: the first `-2` record's id, or inkling for IKU1.
    pub writer: Option<EngineId>,
    /// A `-2` record is present but its id is not a u32 (no engine has it).
    pub writer_invalid: bool,
}

impl Declared {
    /// The writer as messages name it.
    pub fn writer_name(&self) -> Option<&'static str> {
        if self.writer_invalid {
            return Some(crate::route_trace::UNKNOWN_ENGINE);
        }
        self.writer.map(EngineId::describe)
    }
}

/// A history read as its writer would read it.
#[derive(Clone, Debug)]
pub struct History {
    /// The file.
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: usize,
    /// Its header.
    pub declared: Declared,
    /// Every admitted record, summed. Its shape is the declared one, or for a file without
    /// a `-1` record the smallest that holds every record.
    pub counts: Counters,
    /// The reader's report (layout, totals, completeness).
    pub report: ReadReport,
}

impl History {
    /// The file's layout.
    pub fn layout(&self) -> Layout {
        self.report.layout
    }
}

/// The outcome of opening a history.
#[derive(Clone, Debug)]
pub enum Opened {
    /// Read; see the report for whether it was read completely.
    Read(History),
    /// Refused by the engine that declared it (and so by every engine): a newer format
    /// version, or header records that contradict each other.
    Refused {
        /// The file.
        path: PathBuf,
        /// Its header.
        declared: Declared,
        /// The reader's refusal.
        refusal: Refusal,
    },
}

/// Opens and reads the history at `path`, streaming: its header is learned in a first
/// pass, its records read in a second, and a table of a huge declared shape is sparse, so
/// memory follows what the file holds. Errors only when the file cannot be read (a FIFO
/// or another non-regular file is refused without blocking).
pub fn open(path: &Path) -> Result<Opened> {
    let read_err = || format!("cannot read history {}", path.display());
    let bytes = std::fs::metadata(path).with_context(read_err)?.len() as usize;
    let mut magic = Vec::new();
    files::open_input(path)
        .with_context(read_err)?
        .take(4)
        .read_to_end(&mut magic)
        .with_context(read_err)?;
    let (declared, shape, engine) = if iku1::sniff(&magic) {
        let mut header = Vec::new();
        files::open_input(path)
            .with_context(read_err)?
            .take(12)
            .read_to_end(&mut header)
            .with_context(read_err)?;
        let dims = iku1::word(&header, 4)
            .zip(iku1::word(&header, 8))
            .map(|(l, e)| (l as usize, e as usize));
        let declared = Declared {
            dims: dims.filter(|&(l, e)| Counters::new(l, e).is_ok()),
            writer: Some(EngineId::of(IKU1_OWNER)),
            ..Declared::default()
        };
        (declared, dims.unwrap_or((0, 1)), IKU1_OWNER)
    } else {
        let file = BufReader::new(files::open_input(path).with_context(read_err)?);
        let (declared, inferred) = declared_text(file).with_context(read_err)?;
        let engine = declared.writer.and_then(EngineId::name).unwrap_or("");
        (declared.clone(), declared.dims.unwrap_or(inferred), engine)
    };
    let mut counts = match Counters::new(shape.0, shape.1) {
        Ok(c) => c,
        // A declared shape no table can have: any table refuses it by its dimensions.
        Err(_) => Counters::new(0, 1).context("the smallest table")?,
    };
    // A writer no engine name hashes to can only be read the way `PIN=<path>` reads it.
    let trust = if (declared.writer.is_some() && engine.is_empty()) || declared.writer_invalid {
        Trust::Named
    } else {
        Trust::Found
    };
    let file = files::open_input(path).with_context(read_err)?;
    let read = history::read_from(file, engine, trust, &mut counts, None).with_context(read_err)?;
    Ok(match read {
        Ok(report) => Opened::Read(History {
            path: path.to_path_buf(),
            bytes,
            declared,
            counts,
            report,
        }),
        Err(refusal) => Opened::Refused {
            path: path.to_path_buf(),
            declared,
            refusal,
        },
    })
}

/// Opens a history that must be readable: a refusal becomes an error naming the file.
pub fn open_readable(path: &Path) -> Result<History> {
    match open(path)? {
        Opened::Read(h) => Ok(h),
        Opened::Refused { refusal, .. } => Err(anyhow::anyhow!(
            "{}: refused by every engine: {}",
            path.display(),
            refusal.reason()
        )),
    }
}

/// The header of a text history and the smallest shape holding its data records.
fn declared_text(src: impl BufRead) -> std::io::Result<(Declared, (usize, usize))> {
    let mut d = Declared::default();
    let mut seen_dims = false;
    let (mut max_layer, mut max_expert) = (0usize, 0usize);
    let mut sc = scan::Scanner::new(src);
    while let Some(t) = sc.next_triple()? {
        let [f0, f1, f2] = t.fields;
        match f0.as_int() {
            Some(-1) if !seen_dims => {
                seen_dims = true;
                let dim = |f: scan::Field| f.exact().and_then(|v| usize::try_from(v).ok());
                d.dims = dim(f1)
                    .zip(dim(f2))
                    .filter(|&(l, e)| Counters::new(l, e).is_ok());
            }
            Some(-2) if d.version.is_none() && !d.writer_invalid => {
                d.version = f1.exact();
                d.writer = f2.as_count().map(EngineId);
                d.writer_invalid = d.writer.is_none();
            }
            Some(l) if l >= 0 => {
                if let (Ok(l), Some(e)) = (usize::try_from(l), f1.as_int()) {
                    if let Ok(e) = usize::try_from(e) {
                        max_layer = max_layer.max(l);
                        max_expert = max_expert.max(e);
                    }
                }
            }
            _ => {}
        }
    }
    Ok((d, (max_layer, max_expert + 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_the_header_first() {
        let (d, inferred) = declared_text(&b"-1 5 8\n-2 1 3815245270\n3 2 2\n"[..]).expect("slice");
        assert_eq!(d.dims, Some((5, 8)));
        assert_eq!(d.version, Some(1));
        assert_eq!(d.writer.and_then(EngineId::name), Some("glm_moe_dsa"));
        assert_eq!(inferred, (3, 3));
        let (d, inferred) = declared_text(&b"3 2 2\n9 1 5\n"[..]).expect("slice");
        assert_eq!(d, Declared::default());
        assert_eq!(inferred, (9, 3));
        let (d, _) = declared_text(&b"-1 5 8\n-2 1 -7\n"[..]).expect("slice");
        assert!(d.writer_invalid);
        assert_eq!(d.writer_name(), Some("an unknown engine"));
    }
}
