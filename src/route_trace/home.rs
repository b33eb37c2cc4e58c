//! Where this engine's history lives, decided once per run from the default path
//! (`COLI_USAGE` or `SNAP/.coli_usage`), and the load that reads it back.
//!
//! The default path is this engine's history when it holds nothing or a history this
//! engine reads as its own. When it holds another engine's history, another model's, a
//! file that is not a history, or one that cannot be read, it is left untouched and this
//! engine's history is the per-engine path `<default>.<engine>` beside it. Either way the
//! file saved to is the file loaded, so a history keeps learning wherever it lives.
//!
//! A second file of this engine can exist beside the first: a per-engine file from a time
//! when the default path was not this engine's, or an Inkling IKU1 table that a text file
//! cannot rewrite without loss. It is *frozen*: read at every load and never written, so
//! its counts are neither lost nor counted twice.
//!
//! When the file a save would replace sits in a directory this user cannot write (a
//! read-only mount, a shared `/models`, another user's download), and the path is the
//! snapshot's default rather than a `COLI_USAGE` the user named, the history lives in the
//! user's state directory instead ([`Elsewhere`]), under a name that says which engine,
//! shape and snapshot it counts. The file beside the weights is still read until that
//! state file holds records: the first save carries its records in (see `save`), and from
//! then on only the state file is read, so nothing is lost and nothing is counted twice.
//!
//! Owns the decision and what is said about it; it must not write files (see `save`).

use std::path::{Path, PathBuf};

use super::counters::Counters;
use super::history::{self, usage_line, ReadOutcome, ReadReport, Trust};
use super::save::sibling_path;

/// Where this engine's history is read and written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Home {
    /// The default path (`COLI_USAGE` or `SNAP/.coli_usage`).
    pub default: PathBuf,
    /// The file saves go to.
    pub save_to: PathBuf,
    /// The files whose counts the load read (the frozen file included).
    pub read: Vec<PathBuf>,
    /// A file read at load and never written.
    pub frozen: Option<PathBuf>,
    /// Why `save_to` is not the default path.
    pub why: Option<String>,
    /// Why the history lives in the state directory: the directory that cannot be
    /// written. `None` when it lives beside the weights (or at `COLI_USAGE`).
    pub moved: Option<String>,
    /// The file beside the weights whose records the first save into a state file that
    /// holds none carries in.
    pub carry_from: Option<PathBuf>,
}

impl Home {
    /// A history that lives at `default` until a save finds another's file there.
    pub fn at(default: &Path) -> Home {
        Home {
            default: default.to_path_buf(),
            save_to: default.to_path_buf(),
            read: Vec::new(),
            frozen: None,
            why: None,
            moved: None,
            carry_from: None,
        }
    }

    /// From now on this engine's history is `to`, because of `why`.
    pub(super) fn divert(&mut self, to: PathBuf, why: String) {
        self.save_to = to;
        self.why = Some(why);
    }

    /// The once-per-run line saying which files were read and which one is written;
    /// `not_saving` says why nothing will be written, when nothing will.
    pub fn line(&self, not_saving: Option<&str>) -> String {
        let read = if self.read.is_empty() {
            "nothing yet".to_string()
        } else {
            self.read
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" + ")
        };
        match not_saving {
            Some(why) => format!("[USAGE] history: read {read}; not saved ({why})"),
            None => match &self.moved {
                Some(why) => format!(
                    "[USAGE] history: read {read}; saved to {} ({why})",
                    self.save_to.display()
                ),
                None => format!(
                    "[USAGE] history: read {read}; saved to {}",
                    self.save_to.display()
                ),
            },
        }
    }
}

/// The user's state directory, where a history goes when the model directory cannot be
/// written, and the snapshot whose histories it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Elsewhere {
    /// `$XDG_STATE_HOME/coli`, else `~/.local/state/coli`.
    pub dir: PathBuf,
    /// FNV-1a-64 of the snapshot's canonical path and its `config.json`: two snapshots
    /// of one model in different places, or one place whose model changed, never share
    /// a history.
    snapshot: u64,
}

impl Elsewhere {
    /// The state directory for the snapshot at `snap`, or `None` when the user has none
    /// (no absolute `XDG_STATE_HOME` and no `HOME`). A relative `XDG_STATE_HOME` is
    /// ignored, as the XDG base directory rules say.
    pub fn for_snapshot(snap: &Path) -> Option<Elsewhere> {
        let absolute = |v: std::ffi::OsString| {
            let p = PathBuf::from(v);
            p.is_absolute().then_some(p)
        };
        let base = std::env::var_os("XDG_STATE_HOME")
            .and_then(absolute)
            .or_else(|| {
                std::env::var_os("HOME")
                    .and_then(absolute)
                    .map(|h| h.join(".local").join("state"))
            })?;
        let canonical = std::fs::canonicalize(snap).unwrap_or_else(|_| snap.to_path_buf());
        let mut key = canonical.as_os_str().as_encoded_bytes().to_vec();
        key.push(0);
        key.extend(std::fs::read(snap.join("config.json")).unwrap_or_default());
        Some(Elsewhere {
            dir: base.join("coli"),
            snapshot: fnv1a64(&key),
        })
    }

    /// This engine's history file for a table of `shape`:
    /// `<engine>-<layers>x<experts>-<snapshot hash>.coli_usage`.
    pub fn file(&self, engine: &str, shape: &Counters) -> PathBuf {
        self.dir.join(format!(
            "{engine}-{}x{}-{:016x}.coli_usage",
            shape.n_layers(),
            shape.n_experts(),
            self.snapshot
        ))
    }
}

fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Why a save cannot replace `path` (the end of its symlink chain): its directory cannot
/// be written by this user, or is on a read-only file system. `access(2)` answers both,
/// for root too (root may write anywhere that is not mounted read-only).
pub fn unwritable_dir(path: &Path) -> Option<String> {
    use std::os::unix::ffi::OsStrExt as _;
    let target = crate::files::resolve_link(path).unwrap_or_else(|_| path.to_path_buf());
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0 {
        return None;
    }
    let err = std::io::Error::last_os_error();
    Some(format!("{} cannot be written: {err}", dir.display()))
}

/// Whether a read found no records at all: a missing or empty file.
fn holds_nothing(outcome: &ReadOutcome, counts: &Counters) -> bool {
    match outcome {
        ReadOutcome::Missing => true,
        ReadOutcome::Read(r) => counts.distinct() == 0 && r.is_complete(),
        _ => false,
    }
}

/// What the load found.
#[derive(Debug)]
pub struct Loaded {
    /// Where the history lives.
    pub home: Home,
    /// The outcome of reading the default path.
    pub default_outcome: ReadOutcome,
    /// The counts of every file read.
    pub counts: Counters,
    /// The counts of the frozen file alone.
    pub frozen: Counters,
}

/// Takes a file's counts into the history, with colibri's `[USAGE] expert history` line.
fn use_counts(home: &mut Home, counts: &mut Counters, path: &Path, file: &Counters) {
    if file.total() > 0 {
        crate::note!("{}", usage_line(file.total(), path));
    }
    counts.absorb(file);
    home.read.push(path.to_path_buf());
}

/// Prints what a rewrite keeps of a file read as this engine's history, and what it drops.
fn note_kept(path: &Path, r: &ReadReport) {
    if r.dropped > 0 {
        eprintln!(
            "[USAGE] {}: {} records name rows this model does not route (dense layers, an MTP head it lacks) \u{2014} not counted, and left out when it is rewritten",
            path.display(),
            r.dropped
        );
    }
    if r.transitions_refused > 0 {
        eprintln!(
            "[USAGE] {}: {} transition records refused (a -4 with no -3 group above it, or a group naming rows that do not route in sequence) \u{2014} not used, and left out when it is rewritten",
            path.display(),
            r.transitions_refused
        );
    }
    if !r.is_complete() && r.rewrite_blocker().is_none() {
        eprintln!(
            "[USAGE] {}: {} \u{2014} kept as they are when it is rewritten",
            path.display(),
            r.problems()
        );
    }
}

/// Decides where this engine's history lives, reads it into a table shaped like `shape`
/// and says what it found: refusals, what is kept, what is frozen, and the `[USAGE]
/// expert history` line of each file read. With `elsewhere`, a history whose file cannot
/// be written where it is lives in the state directory (see the module docs).
pub fn load(
    default: &Path,
    elsewhere: Option<&Elsewhere>,
    engine: &str,
    shape: &Counters,
) -> Loaded {
    let sibling = sibling_path(default, engine);
    let mut home = Home::at(default);
    let mut counts = shape.zeroed_like();
    let mut frozen = shape.zeroed_like();

    let mut d_counts = shape.zeroed_like();
    let d = history::read(default, engine, Trust::Found, &mut d_counts);
    history::announce(default, engine, &d);
    let d_foreign = d.not_ours(&d_counts);
    if let (Some(why), ReadOutcome::Read(_)) = (&d_foreign, &d) {
        eprintln!(
            "[USAGE] {}: {why} \u{2014} left untouched",
            default.display()
        );
    }

    // The per-engine file is read only when it exists: a missing one says nothing.
    let mut s_counts = shape.zeroed_like();
    let s = match std::fs::symlink_metadata(&sibling) {
        Ok(_) => {
            let s = history::read(&sibling, engine, Trust::Found, &mut s_counts);
            history::announce(&sibling, engine, &s);
            s
        }
        Err(_) => ReadOutcome::Missing,
    };
    let s_ours = matches!(s, ReadOutcome::Read(_)) && s.not_ours(&s_counts).is_none();
    if let ReadOutcome::Read(r) = &s {
        note_kept(&sibling, r);
    }

    // The file saves go to, when it was read as this engine's: its counts are taken
    // last, once it is known whether the state directory replaces it.
    let mut target: Option<(PathBuf, Counters)> = None;
    match (d_foreign, &d) {
        (Some(why), _) => {
            home.divert(sibling.clone(), why);
            if s_ours {
                target = Some((sibling, s_counts));
            }
        }
        (None, ReadOutcome::Read(r)) if r.rewrite_blocker().is_some() => {
            let why = r.rewrite_blocker().unwrap_or_default();
            eprintln!(
                "[USAGE] {}: {why} \u{2014} read, never written; this engine's history is {}",
                default.display(),
                sibling.display()
            );
            use_counts(&mut home, &mut counts, default, &d_counts);
            frozen.absorb(&d_counts);
            home.frozen = Some(default.to_path_buf());
            home.divert(sibling.clone(), why);
            if s_ours {
                target = Some((sibling, s_counts));
            }
        }
        (None, outcome) => {
            if let ReadOutcome::Read(r) = outcome {
                note_kept(default, r);
                target = Some((default.to_path_buf(), d_counts));
            }
            if s_ours {
                eprintln!(
                    "[USAGE] {}: saved by an earlier run while {} was not this engine's \u{2014} read, never written (`coli usage merge` can fold it in)",
                    sibling.display(),
                    default.display()
                );
                use_counts(&mut home, &mut counts, &sibling, &s_counts);
                frozen.absorb(&s_counts);
                home.frozen = Some(sibling);
            }
        }
    }
    if let Some(e) = elsewhere {
        if let Some(why) = unwritable_dir(&home.save_to) {
            let state = e.file(engine, shape);
            let mut st_counts = shape.zeroed_like();
            let st = history::read(&state, engine, Trust::Found, &mut st_counts);
            history::announce(&state, engine, &st);
            if holds_nothing(&st, &st_counts) {
                home.carry_from = target.as_ref().map(|(p, _)| p.clone());
            } else {
                if let Some((beside, _)) = target.take() {
                    eprintln!(
                        "[USAGE] {}: carried into {} by an earlier run \u{2014} not read again",
                        beside.display(),
                        state.display()
                    );
                }
                if st.not_ours(&st_counts).is_none() {
                    target = Some((state.clone(), st_counts));
                }
            }
            home.save_to = state;
            home.moved = Some(why);
        }
    }
    if let Some((path, file)) = target {
        use_counts(&mut home, &mut counts, &path, &file);
    }
    Loaded {
        home,
        default_outcome: d,
        counts,
        frozen,
    }
}
