//! Reading a `.coli_usage` history: the v1 text format (`-1`/`-2` header records), legacy
//! headerless text, and Inkling's IKU1 binary.
//!
//! Owns the record rules (dispatch on the first field, which checks trust may relax, what
//! is admitted and totalled, what a rewrite must keep), the refusal and notice texts, and
//! the `[USAGE] expert history` line. It must not write files (see `save`) and must not
//! decide placement.
//!
//! Reading streams the file (memory for the table, not for the file) and is
//! validate-then-commit: admitted records are collected in a scratch table of the same
//! shape and added to the caller's only when the whole file was accepted. colibri streams
//! records into the table as it reads, so a refusing header after some data leaves that
//! data counted although the read reports a refusal; nothing relies on that and it is not
//! reproduced.
//!
//! What this engine cannot hold is not dropped: a reader asked to [`Keep`] collects every
//! record it did not admit (records on a dropped row or outside the table, records with
//! out-of-range numbers, unknown negative records) exactly as spelled, and where the scan
//! stopped, so that a rewrite can put them back and a history never loses what another
//! build or engine wrote into it.

use std::fmt::Write as _;
use std::io::{self, BufRead, BufReader, Read};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

use super::counters::Counters;
use super::identity::{EngineId, FORMAT_VERSION, RECENT_RECORD, UNKNOWN_ENGINE};
use super::iku1;
use super::scan::{End, Field, Scanner};
use super::transitions::{EDGE_RECORD, GROUP_RECORD};

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
    /// Well-formed records outside the table's shape (a layer above `n_layers`, an expert
    /// id of `n_experts` or more). Neither added nor totalled; kept by a rewrite.
    pub rejected: u64,
    /// Of `rejected`, the data records (not `-5` heat).
    pub beyond_shape: u64,
    /// Records on a row the model does not route (a dense layer, an MTP row it has no head
    /// for): records no engine would emit, so, as the format says, neither added, nor
    /// totalled, nor written back by a rewrite.
    pub dropped: u64,
    /// Transition records (`-3`, `-4`) not admitted: a `-4` with no `-3` group above it, a
    /// group naming a row that does not route or is not the next routing row, an id out
    /// of range. Never attributed to another group, so neither used nor written back.
    pub transitions_refused: u64,
    /// Records with a field outside its C type, which a C reader would silently wrap
    /// (a negative or too-large count, a layer beyond `int`). Skipped; kept by a rewrite.
    pub malformed: u64,
    /// Header records with a first field below -2, reserved for future use. Skipped; kept
    /// by a rewrite.
    pub unknown_headers: u64,
    /// Byte offset where reading stopped before the end of the file (a non-numeric token,
    /// a record cut short, a truncated IKU1 table or trailing bytes after it).
    pub stopped_at: Option<usize>,
    /// The writer, when a different engine's history was honoured because it was named.
    pub overridden: Option<&'static str>,
}

impl ReadReport {
    /// True when every byte was understood and every record admitted.
    pub fn is_complete(&self) -> bool {
        self.kept() == 0 && self.stopped_at.is_none()
    }

    /// Records read but not admitted, which a rewrite keeps as they are spelled.
    pub fn kept(&self) -> u64 {
        self.rejected + self.malformed + self.unknown_headers
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

    /// Why this file is evidently not a history of this engine although nothing in it
    /// refused the read: no record at all before unreadable bytes (it is not a history),
    /// or, with no `-1` record to declare a shape, records outside this engine's shape
    /// (it is another model's). `None` when it may be this engine's.
    pub fn not_ours(&self, table: &Counters) -> Option<String> {
        let records = self.admitted + self.kept();
        if let (0, Some(at)) = (records, self.stopped_at) {
            return Some(format!("not a usage history (no record before byte {at})"));
        }
        (self.layout == Layout::Legacy && self.beyond_shape > 0).then(|| {
            format!(
                "{} records outside this engine's {} layers x {} experts and no -1 record: another model's history",
                self.beyond_shape,
                table.n_layers(),
                table.n_experts()
            )
        })
    }

    /// Why a rewritten file could not hold everything this one holds, or `None`. Text
    /// always can (unadmitted records and an unread tail are put back); an IKU1 table cut
    /// short or followed by other bytes cannot be expressed as text.
    pub fn rewrite_blocker(&self) -> Option<String> {
        match (self.layout, self.stopped_at) {
            (Layout::Iku1, Some(at)) => Some(format!(
                "the IKU1 table is cut short or followed by other bytes at byte {at}, which a text history cannot keep"
            )),
            _ => None,
        }
    }
}

/// What a rewrite must put back: the records a read did not admit, and where it stopped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Keep {
    /// Each unadmitted record as one line, its three fields spelled as in the file, in
    /// file order.
    pub records: Vec<String>,
    /// Where the text scan stopped: the bytes from here to the end are kept as they are.
    pub tail_from: Option<usize>,
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

    /// Why this engine's history cannot live in this file, or `None` when it can: a
    /// missing file, or one read as this engine's. The counts of such a file are this
    /// engine's; a file that is refused, unreadable or evidently another's holds none.
    pub fn not_ours(&self, table: &Counters) -> Option<String> {
        match self {
            ReadOutcome::Missing => None,
            ReadOutcome::Read(r) => r.not_ours(table),
            ReadOutcome::Unreadable(e) => Some(format!("cannot read it: {e}")),
            ReadOutcome::Refused(r) => Some(r.reason()),
        }
    }

    /// Why replacing this file with a rewritten history would lose something, or `None`.
    pub fn replace_blocker(&self, table: &Counters) -> Option<String> {
        self.not_ours(table).or_else(|| match self {
            ReadOutcome::Read(r) => r.rewrite_blocker(),
            _ => None,
        })
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

/// Records accepted so far, applied to the table only when the whole file is accepted,
/// and what a rewrite must keep.
pub(super) struct Pending<'k> {
    scratch: Counters,
    pub(super) report: ReadReport,
    keep: Option<&'k mut Keep>,
}

impl<'k> Pending<'k> {
    pub(super) fn new(layout: Layout, table: &Counters, keep: Option<&'k mut Keep>) -> Self {
        Pending {
            scratch: table.zeroed_like(),
            report: ReadReport {
                layout,
                total: 0,
                admitted: 0,
                rejected: 0,
                beyond_shape: 0,
                dropped: 0,
                transitions_refused: 0,
                malformed: 0,
                unknown_headers: 0,
                stopped_at: None,
                overridden: None,
            },
            keep,
        }
    }

    /// Offers one data record; admitted records are totalled, others counted and kept.
    pub(super) fn offer(
        &mut self,
        layer: i64,
        expert: i64,
        count: u32,
        spelled: impl FnOnce() -> String,
    ) {
        if self.scratch.admit(layer, expert, count) {
            self.report.admitted += 1;
            self.report.total += i64::from(count);
        } else if self.scratch.beyond_shape(layer, expert) {
            self.report.rejected += 1;
            self.report.beyond_shape += 1;
            self.keep_record(spelled);
        } else {
            self.report.dropped += 1;
        }
    }

    /// Offers one `-5` record (recent heat); like a data record it is admitted or kept, but
    /// never totalled: recent heat is not a count of selections.
    pub(super) fn offer_recent(
        &mut self,
        layer: i64,
        expert: i64,
        heat: u32,
        spelled: impl FnOnce() -> String,
    ) {
        if self.scratch.admit_recent(layer, expert, heat) {
            return;
        }
        if self.scratch.beyond_shape(layer, expert) {
            self.report.rejected += 1;
            self.keep_record(spelled);
        } else {
            self.report.dropped += 1;
        }
    }

    /// Keeps a record this read does not admit.
    pub(super) fn keep_record(&mut self, spelled: impl FnOnce() -> String) {
        if let Some(k) = self.keep.as_deref_mut() {
            k.records.push(spelled());
        }
    }

    /// Records where reading stopped.
    pub(super) fn stop(&mut self, at: usize) {
        self.report.stopped_at = Some(at);
    }

    fn commit(self, table: &mut Counters) -> ReadReport {
        table.absorb(&self.scratch);
        if let Some(k) = self.keep {
            if self.report.layout != Layout::Iku1 {
                k.tail_from = self.report.stopped_at;
            }
        }
        self.report
    }
}

/// Whether an exact field equals `want` (a field too large for i64 equals nothing).
fn field_is(f: Field, want: i64) -> bool {
    f.exact() == Some(want)
}

fn parse_text<'k>(
    src: impl BufRead,
    engine: &str,
    trust: Trust,
    table: &Counters,
    keep: Option<&'k mut Keep>,
) -> io::Result<Result<Pending<'k>, Refusal>> {
    let id = EngineId::of(engine);
    let mut sc = Scanner::new(src);
    let mut p = Pending::new(Layout::Legacy, table, keep);
    // The `-3` group the next `-4` records belong to: `None` outside a group, `Some(None)`
    // in a group whose header is unreadable. Any other record ends a group.
    let mut group: Option<Option<(i64, i64)>> = None;
    while let Some(t) = sc.next_triple()? {
        let [f0, f1, f2] = t.fields;
        let Some(l) = f0.as_int() else {
            group = None;
            p.report.malformed += 1;
            p.keep_record(|| sc.record_text());
            continue;
        };
        if l != EDGE_RECORD {
            group = None;
        }
        match l {
            GROUP_RECORD => group = Some(f1.exact().zip(f2.exact())),
            EDGE_RECORD => {
                let admitted = match (group, f1.exact(), f2.as_count()) {
                    (Some(Some((cell, dst))), Some(e), Some(c)) => {
                        p.scratch.admit_transition(cell, dst, e, c)
                    }
                    _ => false,
                };
                if !admitted {
                    p.report.transitions_refused += 1;
                }
            }
            -1 => {
                p.report.layout = Layout::Text;
                if !field_is(f1, table.n_layers() as i64) || !field_is(f2, table.n_experts() as i64)
                {
                    return Ok(Err(Refusal::Dimensions {
                        file_layers: sc.spelled(1).to_string(),
                        file_experts: sc.spelled(2).to_string(),
                        n_layers: table.n_layers(),
                        n_experts: table.n_experts(),
                    }));
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
                    return Ok(Err(Refusal::Version {
                        version: sc.spelled(1).to_string(),
                    }));
                }
                if !field_is(f2, i64::from(id.0)) {
                    let writer = f2.as_count().map(EngineId);
                    match trust {
                        Trust::Found => {
                            return Ok(Err(Refusal::Foreign {
                                writer,
                                engine: engine.to_string(),
                            }))
                        }
                        Trust::Named => {
                            p.report.overridden =
                                Some(writer.map_or(UNKNOWN_ENGINE, EngineId::describe))
                        }
                    }
                }
            }
            RECENT_RECORD => match (
                f1.as_int().and_then(|c| u32::try_from(c).ok()),
                f2.as_count(),
            ) {
                (Some(cell), Some(heat)) => {
                    let ne = table.n_experts() as i64;
                    let (layer, expert) = (i64::from(cell) / ne, i64::from(cell) % ne);
                    p.offer_recent(layer, expert, heat, || sc.record_text());
                }
                _ => {
                    p.report.malformed += 1;
                    p.keep_record(|| sc.record_text());
                }
            },
            l if l < -2 => {
                p.report.unknown_headers += 1;
                p.keep_record(|| sc.record_text());
            }
            l => match (f1.as_int(), f2.as_count()) {
                (Some(e), Some(c)) => p.offer(i64::from(l), i64::from(e), c, || sc.record_text()),
                _ => {
                    p.report.malformed += 1;
                    p.keep_record(|| sc.record_text());
                }
            },
        }
    }
    if let Some(End::Stopped(at)) = sc.end() {
        p.stop(at);
    }
    Ok(Ok(p))
}

/// Reads a history from `src` and, if it is accepted, adds its admitted records to
/// `table`; with `keep`, also collects what a rewrite must put back. Prints nothing.
pub fn read_from(
    mut src: impl Read,
    engine: &str,
    trust: Trust,
    table: &mut Counters,
    keep: Option<&mut Keep>,
) -> io::Result<Result<ReadReport, Refusal>> {
    let mut magic = Vec::with_capacity(4);
    (&mut src).take(4).read_to_end(&mut magic)?;
    let is_iku1 = iku1::sniff(&magic);
    let src = BufReader::with_capacity(1 << 16, io::Cursor::new(magic).chain(src));
    let pending = if is_iku1 {
        iku1::parse(src, engine, trust, table, keep)?
    } else {
        parse_text(src, engine, trust, table, keep)?
    };
    Ok(pending.map(|p| p.commit(table)))
}

/// Parses a history held in memory and, if it is accepted, adds its admitted records to
/// `table`. Prints nothing.
pub fn parse(
    bytes: &[u8],
    engine: &str,
    trust: Trust,
    table: &mut Counters,
) -> Result<ReadReport, Refusal> {
    match read_from(bytes, engine, trust, table, None) {
        Ok(r) => r,
        Err(e) => unreachable!("reading from memory cannot fail: {e}"),
    }
}

/// Reads a history file into `table` (see [`read_from`]). Never blocks on a FIFO: a path
/// that is not a regular file is unreadable. Prints nothing.
pub fn read_kept(
    path: &Path,
    engine: &str,
    trust: Trust,
    table: &mut Counters,
    keep: Option<&mut Keep>,
) -> ReadOutcome {
    let file = match crate::files::open_input(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return ReadOutcome::Missing,
        Err(e) => return ReadOutcome::Unreadable(e),
    };
    match read_from(file, engine, trust, table, keep) {
        Ok(Ok(r)) => ReadOutcome::Read(r),
        Ok(Err(refusal)) => ReadOutcome::Refused(refusal),
        Err(e) => ReadOutcome::Unreadable(e),
    }
}

/// Reads a history file into `table`. Prints nothing.
pub fn read(path: &Path, engine: &str, trust: Trust, table: &mut Counters) -> ReadOutcome {
    read_kept(path, engine, trust, table, None)
}

static OVERRIDE_SHOWN: AtomicBool = AtomicBool::new(false);

/// Prints what a user must see about a read: the refusal, an unreadable file, the override
/// notice (once per process). Which counts are used, what a rewrite keeps and where the
/// history lives are `home`'s to say.
pub fn announce(path: &Path, engine: &str, outcome: &ReadOutcome) {
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
        }
    }
    eprint!("{out}");
}
