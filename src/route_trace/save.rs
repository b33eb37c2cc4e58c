//! Writing a `.coli_usage` history: the exact v1 bytes, `COLI_USAGE_DECAY`, `USAGE_SAVE`,
//! and the merge-on-save that keeps concurrent processes from losing each other's counts.
//!
//! Owns the file bytes and the merge. A rewrite loses nothing the file held: the records
//! this engine cannot hold and an unread tail are written back as they were (see
//! `history::Keep`). A file that is not this engine's history at all (refused, unreadable,
//! another model's, or an IKU1 table a text file cannot express) is never replaced; the
//! counts go to the per-engine path `<path>.<engine>` instead, which `home` reads back.
//!
//! How a file is replaced is `crate::files`' rule, shared with every other writer: under an
//! advisory lock on `<target>.lock`, held from the re-read to the rename, the new bytes go
//! to an exclusively created `<target>.tmp` with the target's mode and owner, are fsynced
//! and renamed over the target, so a process killed at any point leaves the old file or
//! the new one. A symlinked history is written through to its target.

use std::collections::BTreeMap;
use std::io::{self, Read as _, Seek as _, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::counters::Counters;
use super::history::{self, Keep, Trust};
use super::home::Home;
use super::identity::{EngineId, FORMAT_VERSION, RECENT_RECORD};
use crate::files::{self, FileLock, WriteError};

/// The `COLI_USAGE_DECAY` multiplier, applied to every counter at every save.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decay(f64);

impl Decay {
    /// No decay; byte-identical to a build without the setting.
    pub const NONE: Decay = Decay(1.0);

    /// A factor in (0, 1]; anything else (0, negative, above 1, NaN) means no decay, as
    /// colibri ignores such values.
    pub fn new(d: f64) -> Decay {
        if d > 0.0 && d <= 1.0 {
            Decay(d)
        } else {
            Decay::NONE
        }
    }

    /// The factor.
    pub fn value(self) -> f64 {
        self.0
    }

    /// One decayed counter: `(uint32_t)(c * d + 0.5)`, i.e. round half up, so a count of 1
    /// survives any `d >= 0.5` and the forgetting falls on the large counters.
    pub fn apply(self, c: u32) -> u32 {
        (f64::from(c) * self.0 + 0.5) as u32
    }
}

/// How a history save behaves: the two settings that govern it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SaveOptions {
    /// `USAGE_SAVE`: false makes the save a successful no-op (and skips the decay).
    pub enabled: bool,
    /// `COLI_USAGE_DECAY`.
    pub decay: Decay,
}

impl Default for SaveOptions {
    fn default() -> SaveOptions {
        SaveOptions {
            enabled: true,
            decay: Decay::NONE,
        }
    }
}

/// Where a save's counts went instead of the history path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diverted {
    /// The history that was left untouched.
    pub from: PathBuf,
    /// Why it could not be replaced.
    pub reason: String,
}

/// What a save did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SaveOutcome {
    /// `USAGE_SAVE` disabled saving; nothing was touched.
    Skipped,
    /// A history was written.
    Saved {
        /// The file written: the history path, or the per-engine path.
        path: PathBuf,
        /// Selections in the file.
        total: i64,
        /// Non-zero counters in the file.
        distinct: u64,
        /// Set when this save found the default path holding a file it must not replace
        /// and wrote the per-engine path instead.
        diverted: Option<Diverted>,
    },
}

/// Why a save wrote nothing. The history on disk is unchanged in every case.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// Locking or replacing the file failed (see [`files::WriteError`]).
    #[error(transparent)]
    File(#[from] WriteError),
    /// The file is not one this writer may replace.
    #[error("{}: {why}; refusing to replace it", path.display())]
    Refused {
        /// The file.
        path: PathBuf,
        /// What it is.
        why: String,
    },
    /// Neither the history nor the per-engine path can be replaced without losing data.
    #[error("{} ({reason}) and {} ({sibling_reason}) both hold data this run cannot write back; counts not saved", path.display(), sibling.display())]
    NoSafeTarget {
        /// The history path.
        path: PathBuf,
        /// Why it cannot be replaced.
        reason: String,
        /// The per-engine path.
        sibling: PathBuf,
        /// Why it cannot be replaced either.
        sibling_reason: String,
    },
}

/// `<path><suffix>` in the same directory.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// This engine's own history beside a default path that holds another's:
/// `<path>.<engine>`.
pub fn sibling_path(path: &Path, engine: &str) -> PathBuf {
    with_suffix(path, &format!(".{engine}"))
}

/// Appends one record. Taking exactly three integers is what guarantees every record has
/// exactly three fields: a fourth field would shift every old reader's triple alignment
/// and fabricate records from the leftovers.
fn record(out: &mut String, fields: [i64; 3]) {
    use std::fmt::Write as _;
    let [a, b, c] = fields;
    let _ = writeln!(out, "{a} {b} {c}");
}

/// The `-1` (shape) and `-2` (version, engine id) records.
fn headers(out: &mut String, table: &Counters, engine: EngineId) {
    record(out, [-1, table.n_layers() as i64, table.n_experts() as i64]);
    record(out, [-2, i64::from(FORMAT_VERSION), i64::from(engine.0)]);
}

/// The v1 text bytes of a table: `-1` and `-2` headers, then the non-zero counters in
/// layer-then-expert order, then the non-zero recent heat as `-5 <cell> <heat>` records
/// (cell `layer * n_experts + expert`, ascending), then the expert transitions as `-3`
/// groups of `-4` successors (see [`super::transitions`]); every classic reader skips
/// both. An all-zero table renders as nothing at all, not even the headers, so that "is
/// there a history?" can be answered by the file size.
pub fn render(table: &Counters, engine: EngineId) -> String {
    let mut out = String::new();
    if table.distinct() == 0 {
        return out;
    }
    headers(&mut out, table, engine);
    for (l, e, c) in table.nonzero() {
        record(&mut out, [l as i64, e as i64, i64::from(c)]);
    }
    let ne = table.n_experts() as i64;
    for (l, e, h) in table.recent().into_iter().flat_map(Counters::nonzero) {
        record(
            &mut out,
            [
                i64::from(RECENT_RECORD),
                l as i64 * ne + e as i64,
                i64::from(h),
            ],
        );
    }
    // Only hot sources' groups are written, so the transitions stay a fraction of the
    // file: a source whose expert was chosen at least as often as its layer's mean. (By
    // row present, not by declared shape, which a crafted file can make huge.)
    if !table.transitions().is_empty() {
        let ne = table.n_experts();
        let layer_total: BTreeMap<usize, u64> = table
            .nonzero_rows()
            .map(|(l, row)| (l, row.iter().map(|&(_, c)| u64::from(c)).sum()))
            .collect();
        let hot = |cell: usize| {
            let (l, e) = (cell / ne, cell % ne);
            let total = layer_total.get(&l).copied().unwrap_or(0);
            total > 0 && u64::from(table.get(l, e)) * ne as u64 >= total
        };
        for r in table.transitions().records(hot) {
            record(&mut out, r);
        }
    }
    out
}

/// A history as a rewrite writes it: [`render`]'s bytes, then the records the read kept
/// (each a triple as the file spelled it, so every old reader stays aligned), then the
/// unread tail of `old` byte for byte, so a C reader still stops where it stopped. With
/// anything kept the headers are written even for an all-zero table.
fn write_history(
    out: &mut dyn Write,
    table: &Counters,
    engine: EngineId,
    keep: &Keep,
    old: &Path,
) -> io::Result<()> {
    let mut text = render(table, engine);
    if text.is_empty() && (!keep.records.is_empty() || keep.tail_from.is_some()) {
        headers(&mut text, table, engine);
    }
    out.write_all(text.as_bytes())?;
    for r in &keep.records {
        writeln!(out, "{r}")?;
    }
    if let Some(from) = keep.tail_from {
        let mut f = files::open_input(old)?;
        f.seek(SeekFrom::Start(from as u64))?;
        io::copy(&mut f, out)?;
    }
    Ok(())
}

/// Writes `bytes` as the whole content of `path` the way every coli writer replaces a
/// file: through a symlink to its target, under the target's lock, atomically, keeping
/// mode and owner (see [`files::replace`]). Returns the file written.
pub fn write_file(path: &Path, bytes: &[u8]) -> Result<PathBuf, WriteError> {
    let target = resolve(path)?;
    let lock = files::lock_for(&target)?;
    files::replace(&target, &lock, |w| w.write_all(bytes))?;
    Ok(target)
}

/// Why `path` must not be replaced by a counts file (`STATS=`, `coli usage merge -o`), or
/// `None`: it may be missing or empty, hold text records ending cleanly (a history or a
/// stats dump, of any engine), or be an IKU1 table (which `coli usage migrate` rewrites in
/// place). Anything else, such as a config, weights or a trace, is
/// not a counts file and is never replaced. Reads at most the first 64 KiB and never
/// blocks.
pub fn counts_file_problem(path: &Path) -> Option<String> {
    let mut f = match files::open_input(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(e) => return Some(format!("cannot check what it holds ({e})")),
    };
    let mut head = Vec::new();
    if let Err(e) = (&mut f).take(1 << 16).read_to_end(&mut head) {
        return Some(format!("cannot check what it holds ({e})"));
    }
    if super::iku1::sniff(&head) {
        return None;
    }
    let full = head.len() < 1 << 16;
    let sc = super::scan::scan(&head);
    let records = !sc.triples.is_empty();
    match sc.end {
        _ if head.iter().all(u8::is_ascii_whitespace) => None,
        super::scan::End::Clean if records => None,
        // A cut at the 64 KiB boundary is not damage.
        super::scan::End::Stopped(_) if records && !full => None,
        _ => Some("it is not a usage history or stats file".to_string()),
    }
}

/// The file a write to `path` lands in: the end of its symlink chain.
fn resolve(path: &Path) -> Result<PathBuf, WriteError> {
    files::resolve_link(path).map_err(|source| WriteError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// Creates the state directory a moved history lives in (and its parents), readable by
/// this user only: a history says what the user ran.
fn create_state_dir(dir: &Path) -> Result<(), WriteError> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| WriteError::Write {
            path: dir.to_path_buf(),
            source,
        })
}

/// The `[STATS]` line printed after a successful save.
pub fn stats_line(total: i64, distinct: u64, path: &Path) -> String {
    format!(
        "[STATS] {total} selections across {distinct} distinct experts -> {}",
        path.display()
    )
}

/// The line printed when a save was diverted to the per-engine path.
pub fn diverted_line(d: &Diverted, to: &Path) -> String {
    format!(
        "[USAGE] {}: {} \u{2014} left untouched; this engine's history is {}",
        d.from.display(),
        d.reason,
        to.display()
    )
}

/// One file a save may write, read under its lock.
struct Candidate {
    target: PathBuf,
    lock: FileLock,
    disk: Counters,
    keep: Keep,
    /// The file `keep` was read from: the target, or the file carried into it.
    source: PathBuf,
}

/// Locks `path`'s target and reads it; `Err(reason)` when it holds something a rewrite
/// would lose.
fn lock_and_read(
    path: &Path,
    engine: &str,
    shape: &Counters,
) -> Result<Result<Candidate, String>, SaveError> {
    let target = resolve(path)?;
    let lock = files::lock_for(&target)?;
    let mut disk = shape.zeroed_like();
    let mut keep = Keep::default();
    let outcome = history::read_kept(&target, engine, Trust::Found, &mut disk, Some(&mut keep));
    Ok(match outcome.replace_blocker(&disk) {
        Some(reason) => Err(reason),
        None => Ok(Candidate {
            source: target.clone(),
            target,
            lock,
            disk,
            keep,
        }),
    })
}

/// A history moved to the state directory starts, on the save that finds it holding
/// nothing, from the records of the file beside the weights (`from`, read as it is now):
/// everything it held, kept records and unread tail included. Under the state file's
/// lock, so of two processes that both loaded before it existed, only the first carries.
/// Returns the selections carried.
fn carry_in(c: &mut Candidate, from: &Path, engine: &str) -> i64 {
    let empty = c.disk.distinct() == 0 && c.keep.records.is_empty() && c.keep.tail_from.is_none();
    if !empty {
        return 0;
    }
    let mut disk = c.disk.zeroed_like();
    let mut keep = Keep::default();
    let outcome = history::read_kept(from, engine, Trust::Found, &mut disk, Some(&mut keep));
    if let Some(why) = outcome.replace_blocker(&disk) {
        eprintln!(
            "[USAGE] {}: {why} \u{2014} not carried into {}",
            from.display(),
            c.target.display()
        );
        return 0;
    }
    c.disk = disk;
    c.keep = keep;
    c.source = from.to_path_buf();
    c.disk.total()
}

/// Merge-on-save into `home.save_to`. Under its lock: re-read it, add the counts this
/// process gained since its last save (`current - baseline`), apply the decay, write the
/// result atomically with everything the file held that this engine cannot (see
/// [`write_history`]), and print `[STATS]`. When the default path turns out to hold a
/// file this engine must not replace, the save goes to the per-engine path instead and
/// `home` says so from then on. Returns the merged table of the file written.
pub(super) fn merge_save(
    home: &mut Home,
    engine: &str,
    current: &Counters,
    baseline: &Counters,
    opts: SaveOptions,
) -> Result<(SaveOutcome, Option<Counters>), SaveError> {
    if !opts.enabled {
        return Ok((SaveOutcome::Skipped, None));
    }
    let mut diverted = None;
    if home.moved.is_some() {
        if let Some(dir) = home.save_to.parent() {
            create_state_dir(dir)?;
        }
    }
    let mut c = match lock_and_read(&home.save_to, engine, current)? {
        Ok(c) => c,
        Err(reason) if home.moved.is_some() => {
            return Err(SaveError::Refused {
                path: home.save_to.clone(),
                why: reason,
            })
        }
        Err(reason) => {
            let sibling = sibling_path(&home.default, engine);
            if home.save_to == sibling {
                return Err(SaveError::NoSafeTarget {
                    path: home.default.clone(),
                    reason: home.why.clone().unwrap_or_default(),
                    sibling,
                    sibling_reason: reason,
                });
            }
            match lock_and_read(&sibling, engine, current)? {
                Ok(c) => {
                    diverted = Some(Diverted {
                        from: home.save_to.clone(),
                        reason: reason.clone(),
                    });
                    home.divert(sibling, reason);
                    c
                }
                Err(sibling_reason) => {
                    return Err(SaveError::NoSafeTarget {
                        path: home.save_to.clone(),
                        reason,
                        sibling,
                        sibling_reason,
                    })
                }
            }
        }
    };
    let carried = match &home.carry_from {
        Some(from) => carry_in(&mut c, from, engine),
        None => 0,
    };
    c.disk.update_recent(current, baseline);
    c.disk.add_gain(current, baseline);
    c.disk.decay(opts.decay);
    let id = EngineId::of(engine);
    files::replace(&c.target, &c.lock, |w| {
        write_history(w, &c.disk, id, &c.keep, &c.source)
    })?;
    if carried > 0 {
        if let Some(from) = &home.carry_from {
            eprintln!(
                "[USAGE] carried {carried} selections from {} into {}",
                from.display(),
                home.save_to.display()
            );
        }
    }
    let (total, distinct) = (c.disk.total(), c.disk.distinct());
    if let Some(d) = &diverted {
        eprintln!("{}", diverted_line(d, &home.save_to));
    }
    crate::note!("{}", stats_line(total, distinct, &home.save_to));
    Ok((
        SaveOutcome::Saved {
            path: home.save_to.clone(),
            total,
            distinct,
            diverted,
        },
        Some(c.disk),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_rounding() {
        let d = Decay::new(0.99);
        assert_eq!(d.apply(1), 1);
        assert_eq!(d.apply(200), 198);
        assert_eq!(d.apply(0), 0);
        assert_eq!(Decay::new(0.5).apply(1), 1);
        assert_eq!(Decay::new(0.4).apply(1), 0);
        assert_eq!(Decay::new(0.5).apply(3), 2);
    }

    #[test]
    fn exact_bytes() {
        let mut t = Counters::new(5, 8).expect("shape");
        t.count(3, &[2, 5, 7]);
        t.count(3, &[2]);
        let s = render(&t, EngineId::of("glm_moe_dsa"));
        assert_eq!(s, "-1 5 8\n-2 1 3815245270\n3 2 2\n3 5 1\n3 7 1\n");
        assert_eq!(render(&t.zeroed_like(), EngineId(1)), "");
    }
}
