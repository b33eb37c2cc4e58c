//! Ctrl-C and SIGTERM: the first one asks the running generation to stop after the current
//! token, so the run ends normally and still saves its routing history and flushes its
//! trace; a second one exits at once.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Install the handler (once per process; later calls do nothing).
pub fn install() {
    // An error means a handler is already installed, which is what we want.
    let _ = ctrlc::set_handler(|| {
        if REQUESTED.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\n[coli] stopping after this token (press Ctrl-C again to quit at once)");
    });
}

/// Forget a stop that was asked for and honoured, so that the next generation runs
/// (`coli chat`: Ctrl-C ends one answer, not the conversation).
pub fn clear() {
    REQUESTED.store(false, Ordering::SeqCst);
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
