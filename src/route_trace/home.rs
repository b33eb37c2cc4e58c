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
            None => format!(
                "[USAGE] history: read {read}; saved to {}",
                self.save_to.display()
            ),
        }
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
        eprintln!("{}", usage_line(file.total(), path));
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
/// expert history` line of each file read.
pub fn load(default: &Path, engine: &str, shape: &Counters) -> Loaded {
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

    match (d_foreign, &d) {
        (Some(why), _) => {
            home.divert(sibling.clone(), why);
            if s_ours {
                use_counts(&mut home, &mut counts, &sibling, &s_counts);
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
                use_counts(&mut home, &mut counts, &sibling, &s_counts);
            }
        }
        (None, outcome) => {
            if let ReadOutcome::Read(r) = outcome {
                note_kept(default, r);
                use_counts(&mut home, &mut counts, default, &d_counts);
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
    Loaded {
        home,
        default_outcome: d,
        counts,
        frozen,
    }
}
