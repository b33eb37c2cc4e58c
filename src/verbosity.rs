//! How much a run of the main job says on stderr besides its errors and warnings: at the
//! normal level its start-up lines (the expert store, the banner, the prompt and sampler, the
//! history read) and its closing statistics; with `-q` none of them, so that a script sees
//! the generated text and what went wrong alone; with `-v` also the settings the run was
//! given and where each came from, and the prompt's token ids. The command line sets the
//! level once, before anything runs; errors and warnings are printed at every level.

use std::sync::atomic::{AtomicU8, Ordering};

/// How much is said, least first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Quiet,
    Normal,
    Verbose,
}

static LEVEL: AtomicU8 = AtomicU8::new(Level::Normal as u8);

/// Set the level for the rest of the process.
pub fn set(level: Level) {
    LEVEL.store(level as u8, Ordering::Relaxed);
}

pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        0 => Level::Quiet,
        1 => Level::Normal,
        _ => Level::Verbose,
    }
}

/// Whether start-up and statistics lines are printed (not `-q`).
pub fn notes() -> bool {
    level() >= Level::Normal
}

/// Whether `-v`'s lines are printed.
pub fn verbose() -> bool {
    level() >= Level::Verbose
}

/// `eprintln!` for a start-up or statistics line: printed unless the run is quiet (`-q`).
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {
        if $crate::verbosity::notes() {
            eprintln!($($arg)*);
        }
    };
}
