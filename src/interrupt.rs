//! SIGINT, SIGTERM and SIGHUP (Ctrl-C elsewhere): the first one asks the running generation
//! to stop after the current token, so the run ends normally, still saves its routing
//! history and flushes its trace, and then exits `128 + signal` (130, 143, 129) so a script
//! can tell it from a finished run; a second one exits at once.

use std::sync::atomic::{AtomicI32, Ordering};

/// The signal that asked for a stop, 0 for none.
static REQUESTED: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
const SIGNALS: [(i32, &str); 3] = [
    (signal_hook::consts::SIGINT, "SIGINT"),
    (signal_hook::consts::SIGTERM, "SIGTERM"),
    (signal_hook::consts::SIGHUP, "SIGHUP"),
];

fn received(signal: i32, name: &str) {
    if REQUESTED.swap(signal, Ordering::SeqCst) != 0 {
        std::process::exit(128 + signal);
    }
    eprintln!("\n[coli] {name}: stopping after this token (send it again to quit at once)");
}

/// Install the handler (once per process; later calls do nothing).
pub fn install() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        #[cfg(unix)]
        match signal_hook::iterator::Signals::new(SIGNALS.map(|(signal, _)| signal)) {
            Ok(mut signals) => {
                std::thread::spawn(move || {
                    for signal in signals.forever() {
                        let name = SIGNALS
                            .iter()
                            .find(|(s, _)| *s == signal)
                            .map_or("signal", |(_, name)| name);
                        received(signal, name);
                    }
                });
            }
            Err(err) => {
                eprintln!("[coli] no signal handler ({err}): Ctrl-C ends the run without saving")
            }
        }
        #[cfg(not(unix))]
        if let Err(err) = ctrlc::set_handler(|| received(2, "Ctrl-C")) {
            eprintln!("[coli] no Ctrl-C handler ({err}): Ctrl-C ends the run without saving");
        }
    });
}

/// Forget a stop that was asked for and honoured, so that the next generation runs
/// (`coli chat`: Ctrl-C ends one answer, not the conversation).
pub fn clear() {
    REQUESTED.store(0, Ordering::SeqCst);
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst) != 0
}

/// The exit status of a run that a signal stopped: `128 + signal`; `None` without one.
pub fn exit_status() -> Option<u8> {
    match REQUESTED.load(Ordering::SeqCst) {
        0 => None,
        signal => u8::try_from(128 + signal).ok(),
    }
}
