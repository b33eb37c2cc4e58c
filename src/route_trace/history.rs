//! Reading a `.coli_usage` history: the v1 text format (`-1`/`-2` header records), legacy
//! headerless text, and Inkling's IKU1 binary.
//!
//! Owns the record rules (dispatch on the first field, which checks trust may relax, what
//! is admitted and totalled), the refusal and notice texts, and the `[USAGE] expert
//! history` line. It must not write files (see `save`) and must not decide placement.
//!
//! Reading is validate-then-commit: records are collected first and added to the caller's
//! table only when the whole file was accepted. colibri streams records into the table as
//! it reads, so a refusing header after some data leaves that data counted although the
//! read reports a refusal; nothing relies on that and it is not reproduced.

use std::fmt::Write as _;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::counters::Counters;
use super::identity::{EngineId, FORMAT_VERSION, UNKNOWN_ENGINE};
use super::iku1;
use super::scan::{self, End, Field};

/// How the path to a history was reached, which decides whether a file written by another
/// engine is honoured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trust {
    /// Found by the engine itself (`SNAP/.coli_usage`, `COLI_USAGE`, `PIN=auto`, the
    /// AUTOPIN seed): another engine's history is refused by name.
    Found,
    /// Typed by the user as `PIN=<path>`: another engine's history is honoured for
    /// placement, with the override notice. Version and geometry are never relaxed.
    Named,
}

/// Which layout the file turned out to have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Text with at least one header record.
    Text,
    /// Text without header records (written before headers existed, or `stats.txt`).
    Legacy,
    /// Inkling's binary table.
    Iku1,
}

/// What an accepted read found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadReport {
    /// The file's layout.
    pub layout: Layout,
    /// Sum of the admitted counts (what `[USAGE] expert history` prints).
    pub total: i64,
    /// Records added to the table.
    pub admitted: u64,
    /// Well-formed records the table cannot hold (dropped row, layer or expert out of
    /// range). Neither added nor totalled.
    pub rejected: u64,
    /// Records with a field outside its C type, which a C reader would silently wrap
    /// (a negative or too-large count, a layer beyond `int`). Skipped.
    pub malformed: u64,
    /// Header records with a first field below -2, reserved for future use. Skipped.
    pub unknown_headers: u64,
    /// Byte offset where reading stopped before the end of the file (a non-numeric token,
    /// a record cut short, a truncated IKU1 table or trailing bytes after it).
    pub stopped_at: Option<usize>,
    /// The writer, when a different engine's history was honoured because it was named.
    pub overridden: Option<&'static str>,
}

impl ReadReport {
    /// True when every byte was understood and every record admitted: rewriting such a
    /// file loses nothing. A history that is not complete is never overwritten.
    pub fn is_complete(&self) -> bool {
        self.rejected == 0
            && self.malformed == 0
            && self.unknown_headers == 0
            && self.stopped_at.is_none()
    }

    /// Why the file is not complete, for messages; empty when it is.
    pub fn problems(&self) -> String {
        let mut parts = Vec::new();
        if let Some(at) = self.stopped_at {
            parts.push(format!("unreadable from byte {at}"));
        }
        if self.rejected > 0 {
            parts.push(format!(
                "{} records this engine has no expert for",
                self.rejected
            ));
        }
        if self.malformed > 0 {
            parts.push(format!(
                "{} records with out-of-range numbers",
                self.malformed
            ));
        }
        if self.unknown_headers > 0 {
            parts.push(format!("{} unknown header records", self.unknown_headers));
        }
        parts.join(", ")
    }
}

/// Why a history was refused. Nothing from a refused file is added to the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// An IKU1 file read, untrusted, by an engine other than inkling.
    Iku1Foreign {
        /// This engine's name.
        engine: String,
    },
    /// The file's geometry differs from this engine's (`-1` record or IKU1 header).
    Dimensions {
        /// The file's layer count, as spelled in the file.
        file_layers: String,
        /// The file's expert count, as spelled in the file.
        file_experts: String,
        /// This engine's `n_layers`.
        n_layers: usize,
        /// This engine's `n_experts`.
        n_experts: usize,
    },
    /// A format version newer than this build reads.
    Version {
        /// The version, as spelled in the file.
        version: String,
    },
    /// A `-2` record naming another engine, read untrusted.
    Foreign {
        /// The writer's id; `None` when the field is not even a u32.
        writer: Option<EngineId>,
        /// This engine's name.
        engine: String,
    },
}

impl Refusal {
    /// The exact line colibri prints for this refusal (without the newline).
    pub fn message(&self, path: &Path) -> String {
        format!("[USAGE] {}: {}", path.display(), self.reason())
    }

    /// The message after its `[USAGE] <path>: ` prefix.
    pub fn reason(&self) -> String {
        match self {
            Refusal::Iku1Foreign { engine } => format!(
                "written by inkling, this engine is {engine} \u{2014} refusing (pass PIN=<path> to use it anyway)"
            ),
            Refusal::Dimensions {
                file_layers,
                file_experts,
                n_layers,
                n_experts,
            } => format!(
                "history is {file_layers} layers x {file_experts} experts, this engine is {n_layers} x {n_experts} \u{2014} refusing rather than misreading it"
            ),
            Refusal::Version { version } => format!(
                "format version {version}, this build reads {FORMAT_VERSION} \u{2014} refusing rather than misreading it"
            ),
            Refusal::Foreign { writer, engine } => format!(
                "written by {}, this engine is {engine} \u{2014} refusing (pass PIN=<path> to use it anyway)",
                writer.map_or(UNKNOWN_ENGINE, EngineId::describe)
            ),
        }
    }
}

/// The result of reading a history file.
#[derive(Debug)]
pub enum ReadOutcome {
    /// No file at that path: an empty history.
    Missing,
    /// The file exists but could not be read.
    Unreadable(io::Error),
    /// The file was refused; the table is untouched.
    Refused(Refusal),
    /// The file was accepted and its admitted records added to the table.
    Read(ReadReport),
}

impl ReadOutcome {
    /// Selections added to the table (0 unless the file was read).
    pub fn total(&self) -> i64 {
        match self {
            ReadOutcome::Read(r) => r.total,
            _ => 0,
        }
    }

    /// Whether replacing this file with a rewritten history loses nothing: there is no
    /// file, or it was read completely.
    pub fn may_replace(&self) -> bool {
        self.replace_blocker().is_none()
    }

    /// Why replacing this file would lose something, or `None` when it would not.
    pub fn replace_blocker(&self) -> Option<String> {
        match self {
            ReadOutcome::Missing => None,
            ReadOutcome::Read(r) if r.is_complete() => None,
            ReadOutcome::Read(r) => Some(r.problems()),
            ReadOutcome::Unreadable(e) => Some(format!("cannot read it: {e}")),
            ReadOutcome::Refused(r) => Some(r.reason()),
        }
    }
}

/// The three-line notice for an honoured foreign history (without the final newline).
pub fn override_notice(path: &Path, writer: &str, engine: &str) -> String {
    format!(
        "[USAGE] {}: written by {writer}, this engine is {engine}\n        \u{2014} honouring it because you named it explicitly\n          (placement only; expert ids do not transfer between engines)",
        path.display()
    )
}

/// The line printed after a load that admitted selections.
pub fn usage_line(total: i64, path: &Path) -> String {
    format!(
        "[USAGE] expert history: {total} selections ({})",
        path.display()
    )
}

/// Records accepted so far, applied to the table only when the whole file is accepted.
pub(super) struct Pending {
    records: Vec<(i64, i64, u32)>,
    pub(super) report: ReadReport,
}

impl Pending {
    pub(super) fn new(layout: Layout) -> Pending {
        Pending {
            records: Vec::new(),
            report: ReadReport {
                layout,
                total: 0,
                admitted: 0,
                rejected: 0,
                malformed: 0,
                unknown_headers: 0,
                stopped_at: None,
                overridden: None,
            },
        }
    }

    /// Offers one data record; admitted records are totalled, others only counted.
    pub(super) fn offer(&mut self, table: &Counters, layer: i64, expert: i64, count: u32) {
        if table.holds(layer, expert) {
            self.records.push((layer, expert, count));
            self.report.admitted += 1;
            self.report.total += i64::from(count);
        } else {
            self.report.rejected += 1;
        }
    }

    fn commit(self, table: &mut Counters) -> ReadReport {
        for (l, e, c) in self.records {
            table.admit(l, e, c);
        }
        self.report
    }
}

/// An exact field value as the file spells it.
fn spelled(bytes: &[u8], f: Field) -> String {
    String::from_utf8_lossy(&bytes[f.span.0..f.span.1]).into_owned()
}

/// Whether an exact field equals `want` (a field too large for i64 equals nothing).
fn field_is(f: Field, want: i64) -> bool {
    f.exact() == Some(want)
}

fn parse_text(
    bytes: &[u8],
    engine: &str,
    trust: Trust,
    table: &Counters,
) -> Result<Pending, Refusal> {
    let id = EngineId::of(engine);
    let sc = scan::scan(bytes);
    let mut p = Pending::new(Layout::Legacy);
    if let End::Stopped(at) = sc.end {
        p.report.stopped_at = Some(at);
    }
    for t in &sc.triples {
        let [f0, f1, f2] = t.fields;
        let Some(l) = f0.as_int() else {
            p.report.malformed += 1;
            continue;
        };
        match l {
            -1 => {
                p.report.layout = Layout::Text;
                if !field_is(f1, table.n_layers() as i64) || !field_is(f2, table.n_experts() as i64)
                {
                    return Err(Refusal::Dimensions {
                        file_layers: spelled(bytes, f1),
                        file_experts: spelled(bytes, f2),
                        n_layers: table.n_layers(),
                        n_experts: table.n_experts(),
                    });
                }
            }
            -2 => {
                p.report.layout = Layout::Text;
                // A version too large for i64 is positive and so newer than ours.
                let newer = match f1.exact() {
                    Some(v) => v > i64::from(FORMAT_VERSION),
                    None => !f1.negative,
                };
                if newer {
                    return Err(Refusal::Version {
                        version: spelled(bytes, f1),
                    });
                }
                if !field_is(f2, i64::from(id.0)) {
                    let writer = f2.as_count().map(EngineId);
                    match trust {
                        Trust::Found => {
                            return Err(Refusal::Foreign {
                                writer,
                                engine: engine.to_string(),
                            })
                        }
                        Trust::Named => {
                            p.report.overridden =
                                Some(writer.map_or(UNKNOWN_ENGINE, EngineId::describe))
                        }
                    }
                }
            }
            l if l < -2 => p.report.unknown_headers += 1,
            l => match (f1.as_int(), f2.as_count()) {
                (Some(e), Some(c)) => p.offer(table, i64::from(l), i64::from(e), c),
                _ => p.report.malformed += 1,
            },
        }
    }
    Ok(p)
}

/// Parses a history held in memory and, if it is accepted, adds its admitted records to
/// `table`. Prints nothing.
pub fn parse(
    bytes: &[u8],
    engine: &str,
    trust: Trust,
    table: &mut Counters,
) -> Result<ReadReport, Refusal> {
    let pending = if iku1::sniff(bytes) {
        iku1::parse(bytes, engine, trust, table)?
    } else {
        parse_text(bytes, engine, trust, table)?
    };
    Ok(pending.commit(table))
}

/// Reads a history file into `table`. Prints nothing.
pub fn read(path: &Path, engine: &str, trust: Trust, table: &mut Counters) -> ReadOutcome {
    match std::fs::read(path) {
        Ok(bytes) => match parse(&bytes, engine, trust, table) {
            Ok(r) => ReadOutcome::Read(r),
            Err(refusal) => ReadOutcome::Refused(refusal),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => ReadOutcome::Missing,
        Err(e) => ReadOutcome::Unreadable(e),
    }
}

static OVERRIDE_SHOWN: AtomicBool = AtomicBool::new(false);

/// What a file is being read for, which decides what is said about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The history this run adds to and saves back.
    History,
    /// A file read only to choose pins (`PIN=<path>`, `PIN=auto`); never written.
    PinSource,
}

/// Prints what a user must see about a read: the refusal, the override notice (once per
/// process), and for a history a note when the file is not complete and the
/// `[USAGE] expert history` line when selections were admitted.
pub fn announce(path: &Path, engine: &str, outcome: &ReadOutcome, role: Role) {
    let mut out = String::new();
    match outcome {
        ReadOutcome::Missing => {}
        ReadOutcome::Unreadable(e) => {
            let _ = writeln!(
                out,
                "[USAGE] {}: cannot read it ({e}) \u{2014} going on without it",
                path.display()
            );
        }
        ReadOutcome::Refused(r) => {
            let _ = writeln!(out, "{}", r.message(path));
        }
        ReadOutcome::Read(r) => {
            if let Some(writer) = r.overridden {
                if !OVERRIDE_SHOWN.swap(true, Ordering::Relaxed) {
                    let _ = writeln!(out, "{}", override_notice(path, writer, engine));
                }
            }
            if role == Role::History && !r.is_complete() {
                let _ = writeln!(
                    out,
                    "[USAGE] {}: {} \u{2014} using what was read; this file will not be overwritten",
                    path.display(),
                    r.problems()
                );
            }
            if role == Role::History && r.total > 0 {
                let _ = writeln!(out, "{}", usage_line(r.total, path));
            }
        }
    }
    eprint!("{out}");
}

/// Reads a history this run will add to (untrusted: the engine found the path) and
/// announces the result.
pub fn load(path: &Path, engine: &str, table: &mut Counters) -> ReadOutcome {
    let outcome = read(path, engine, Trust::Found, table);
    announce(path, engine, &outcome, Role::History);
    outcome
}
