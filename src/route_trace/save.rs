//! Writing a `.coli_usage` history: the exact v1 bytes, `COLI_USAGE_DECAY`, `USAGE_SAVE`,
//! and the merge-on-save that keeps concurrent processes from losing each other's counts.
//!
//! Owns the file bytes, the lock, the temporary file and the rename. It must never replace
//! a file it cannot read completely (refused, unreadable, or holding anything this engine
//! could not write back): such a file is left untouched and the counts go to a sibling
//! file `<path>.<engine>` instead.
//!
//! Crash safety comes from the order of operations: the new history is written to
//! `<path>.tmp` in the same directory, fsynced, and renamed over the target, so a process
//! killed at any point leaves either the old file or the new one. Concurrency comes from
//! an advisory lock on the side file `<path>.lock`, held from the re-read of the target to
//! the rename. The lock is on a side file rather than the history itself because the
//! history's inode is replaced by every save: a process waiting on the old inode's lock
//! would wake holding a lock nobody else can see.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use super::counters::Counters;
use super::history::{self, Trust};
use super::identity::{EngineId, FORMAT_VERSION};

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

    /// The setting's text read as C `atof` reads it (the longest decimal prefix; no
    /// number means 0), then validated as [`Decay::new`]. Unset means no decay.
    pub fn from_setting(value: Option<&str>) -> Decay {
        value.map_or(Decay::NONE, |v| Decay::new(c_atof(v)))
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

/// Whether `USAGE_SAVE` allows saving: unset, or C `atoi(value) != 0`. So `0`, `off`, the
/// empty string and any other non-numeric text make the run read-only.
pub fn usage_save_enabled(value: Option<&str>) -> bool {
    value.is_none_or(|v| c_atoi(v) != 0)
}

/// C `isspace` in the "C" locale.
fn c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\u{b}' | '\u{c}' | '\r')
}

/// glibc `atoi`: `(int)strtol(s, NULL, 10)`; strtol saturates at the i64 range.
fn c_atoi(s: &str) -> i32 {
    let s = s.trim_start_matches(c_space);
    let (neg, digits) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let mut v: i64 = 0;
    for d in digits.bytes().take_while(u8::is_ascii_digit) {
        let d = i64::from(d - b'0');
        v = v
            .checked_mul(10)
            .and_then(|v| {
                if neg {
                    v.checked_sub(d)
                } else {
                    v.checked_add(d)
                }
            })
            .unwrap_or(if neg { i64::MIN } else { i64::MAX });
    }
    v as i32
}

/// C `atof` for decimal text: the longest prefix of the form
/// `[sign] digits [. digits] [e [sign] digits]` (digits on at least one side of the
/// point). Hexadecimal, `inf` and `nan` spellings read as 0, which [`Decay::new`] then
/// treats as "no decay" just as it treats the values atof would give them.
fn c_atof(s: &str) -> f64 {
    let s = s.trim_start_matches(c_space);
    let b = s.as_bytes();
    let digits_from = |mut i: usize| {
        while b.get(i).is_some_and(u8::is_ascii_digit) {
            i += 1;
        }
        i
    };
    let mut i = usize::from(matches!(b.first(), Some(b'+' | b'-')));
    let int_end = digits_from(i);
    let mut end = int_end;
    let mut mantissa = int_end > i;
    i = int_end;
    if b.get(i) == Some(&b'.') {
        let frac_end = digits_from(i + 1);
        if mantissa || frac_end > i + 1 {
            mantissa = true;
            end = frac_end;
        }
        i = frac_end;
    }
    if !mantissa {
        return 0.0;
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        let mut j = i + 1;
        if matches!(b.get(j), Some(b'+' | b'-')) {
            j += 1;
        }
        let exp_end = digits_from(j);
        if exp_end > j {
            end = exp_end;
        }
    }
    s[..end].parse().unwrap_or(0.0)
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
        /// The file written: the history path, or its sibling when diverted.
        path: PathBuf,
        /// Selections in the file.
        total: i64,
        /// Non-zero counters in the file.
        distinct: u64,
        /// Set when the history path was left untouched.
        diverted: Option<Diverted>,
    },
}

/// Why a save wrote nothing. The history on disk is unchanged in every case.
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The lock side file could not be created or locked.
    #[error("cannot lock {}: {source}", path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Writing, syncing or renaming the new file failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file being written.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Neither the history nor its sibling can be replaced without losing data.
    #[error("{} ({reason}) and {} ({sibling_reason}) both hold data this run cannot write back; counts not saved", path.display(), sibling.display())]
    NoSafeTarget {
        /// The history path.
        path: PathBuf,
        /// Why it cannot be replaced.
        reason: String,
        /// The sibling path.
        sibling: PathBuf,
        /// Why the sibling cannot be replaced either.
        sibling_reason: String,
    },
}

/// `<path><suffix>` in the same directory.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Where a save goes when the history path holds a file this run must not replace.
pub fn sibling_path(path: &Path, engine: &str) -> PathBuf {
    with_suffix(path, &format!(".{engine}"))
}

/// The advisory lock side file guarding a history and its sibling.
pub fn lock_path(path: &Path) -> PathBuf {
    with_suffix(path, ".lock")
}

/// Appends one record. Taking exactly three integers is what guarantees every record has
/// exactly three fields: a fourth field would shift every old reader's triple alignment
/// and fabricate records from the leftovers.
fn record(out: &mut String, fields: [i64; 3]) {
    use std::fmt::Write as _;
    let [a, b, c] = fields;
    let _ = writeln!(out, "{a} {b} {c}");
}

/// The v1 text bytes of a table: `-1` and `-2` headers, then the non-zero counters in
/// layer-then-expert order. An all-zero table renders as nothing at all, not even the
/// headers, so that "is there a history?" can be answered by the file size.
pub fn render(table: &Counters, engine: EngineId) -> String {
    let mut out = String::new();
    if table.distinct() == 0 {
        return out;
    }
    record(
        &mut out,
        [-1, table.n_layers() as i64, table.n_experts() as i64],
    );
    record(
        &mut out,
        [-2, i64::from(FORMAT_VERSION), i64::from(engine.0)],
    );
    for (l, e, c) in table.nonzero() {
        record(&mut out, [l as i64, e as i64, i64::from(c)]);
    }
    out
}

/// Replaces `path` with `bytes` so that a crash leaves the old file or the new one:
/// `<path>.tmp` is written and fsynced, then renamed over `path`, then the directory is
/// fsynced so the rename itself survives a power cut.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), SaveError> {
    let tmp = with_suffix(path, ".tmp");
    let write = |p: &Path| -> io::Result<()> {
        let mut f = File::create(p)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    if let Err(source) = write(&tmp) {
        // Best effort: a leftover temp file is harmless (the next save truncates it).
        let _ = fs::remove_file(&tmp);
        return Err(SaveError::Write { path: tmp, source });
    }
    fs::rename(&tmp, path).map_err(|source| {
        let _ = fs::remove_file(&tmp);
        SaveError::Write {
            path: path.to_path_buf(),
            source,
        }
    })?;
    sync_parent(path);
    Ok(())
}

/// Makes a rename durable. Failure is ignored: some filesystems cannot fsync a directory,
/// and the rename has already happened.
fn sync_parent(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// Holds the advisory lock for the life of the value (closing the file releases it).
struct HistoryLock {
    _file: Option<File>,
}

fn lock_history(path: &Path) -> Result<HistoryLock, SaveError> {
    let lp = lock_path(path);
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lp)
        .map_err(|source| SaveError::Lock {
            path: lp.clone(),
            source,
        })?;
    match file.lock() {
        Ok(()) => Ok(HistoryLock { _file: Some(file) }),
        // A filesystem without advisory locks still gets the atomic replace; only the
        // protection against a concurrent writer is lost, and losing this run's counts
        // instead would be worse.
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
            eprintln!(
                "[USAGE] {}: advisory locks are not supported here ({e}) \u{2014} saving without one",
                lp.display()
            );
            Ok(HistoryLock { _file: None })
        }
        Err(source) => Err(SaveError::Lock { path: lp, source }),
    }
}

/// The `[STATS]` line printed after a successful save.
pub fn stats_line(total: i64, distinct: u64, path: &Path) -> String {
    format!(
        "[STATS] {total} selections across {distinct} distinct experts -> {}",
        path.display()
    )
}

/// The line printed when a save was diverted to the sibling file.
pub fn diverted_line(d: &Diverted, to: &Path) -> String {
    format!(
        "[USAGE] {}: {} \u{2014} left untouched; this run's counts were saved to {}",
        d.from.display(),
        d.reason,
        to.display()
    )
}

/// Merge-on-save. Under the lock: re-read the history from disk, add the counts this
/// process gained since its last save (`current - baseline`), apply the decay, write the
/// result atomically, and print `[STATS]`. Returns the merged table, which becomes the
/// caller's new `current` and `baseline`.
pub(super) fn merge_save(
    path: &Path,
    engine: &str,
    current: &Counters,
    baseline: &Counters,
    opts: SaveOptions,
) -> Result<(SaveOutcome, Option<Counters>), SaveError> {
    if !opts.enabled {
        return Ok((SaveOutcome::Skipped, None));
    }
    let _lock = lock_history(path)?;
    let mut disk = current.zeroed_like();
    let outcome = history::read(path, engine, Trust::Found, &mut disk);
    let (target, diverted) = match outcome.replace_blocker() {
        None => (path.to_path_buf(), None),
        Some(reason) => {
            let sibling = sibling_path(path, engine);
            disk = current.zeroed_like();
            let s_outcome = history::read(&sibling, engine, Trust::Found, &mut disk);
            if let Some(sibling_reason) = s_outcome.replace_blocker() {
                return Err(SaveError::NoSafeTarget {
                    path: path.to_path_buf(),
                    reason,
                    sibling,
                    sibling_reason,
                });
            }
            let from = path.to_path_buf();
            (sibling, Some(Diverted { from, reason }))
        }
    };
    disk.add_gain(current, baseline);
    disk.decay(opts.decay);
    write_atomically(&target, render(&disk, EngineId::of(engine)).as_bytes())?;
    let (total, distinct) = (disk.total(), disk.distinct());
    if let Some(d) = &diverted {
        eprintln!("{}", diverted_line(d, &target));
    }
    eprintln!("{}", stats_line(total, distinct, &target));
    Ok((
        SaveOutcome::Saved {
            path: target,
            total,
            distinct,
            diverted,
        },
        Some(disk),
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
    fn decay_setting_like_atof() {
        assert_eq!(Decay::from_setting(None), Decay::NONE);
        assert_eq!(Decay::from_setting(Some("0.99")).value(), 0.99);
        assert_eq!(Decay::from_setting(Some("  0.5x")).value(), 0.5);
        assert_eq!(Decay::from_setting(Some(".25")).value(), 0.25);
        assert_eq!(Decay::from_setting(Some("5e-1")).value(), 0.5);
        assert_eq!(Decay::from_setting(Some("9e-1e")).value(), 0.9);
        assert_eq!(Decay::from_setting(Some("0")), Decay::NONE);
        assert_eq!(Decay::from_setting(Some("-0.5")), Decay::NONE);
        assert_eq!(Decay::from_setting(Some("1.5")), Decay::NONE);
        assert_eq!(Decay::from_setting(Some("abc")), Decay::NONE);
        assert_eq!(Decay::from_setting(Some("nan")), Decay::NONE);
        assert_eq!(Decay::new(f64::NAN), Decay::NONE);
    }

    #[test]
    fn usage_save_like_atoi() {
        assert!(usage_save_enabled(None));
        assert!(usage_save_enabled(Some("1")));
        assert!(usage_save_enabled(Some(" 2abc")));
        assert!(usage_save_enabled(Some("-1")));
        assert!(!usage_save_enabled(Some("0")));
        assert!(!usage_save_enabled(Some("")));
        assert!(!usage_save_enabled(Some("off")));
        assert!(!usage_save_enabled(Some("yes")));
        // strtol gives 2^32, and the int conversion keeps the low 32 bits.
        assert!(!usage_save_enabled(Some("4294967296")));
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
