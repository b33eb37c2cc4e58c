//! SIGINT, SIGTERM and SIGHUP (Ctrl-C elsewhere): the first one asks the running generation
//! to stop after the current token, so the run ends normally, still saves its routing
//! history and flushes its trace, and then exits `128 + signal` (130, 143, 129) so a script
//! can tell it from a finished run; a second one exits at once. In `coli chat` the first one
//! stops the answer in progress and the chat goes on ([`Stopping::Answer`]).
//!
//! A prefill is one forward over the whole prompt (each layer's experts read once for every
//! token, which is what makes it affordable when they stream from disk), so it stops between
//! layers instead: its forward runs inside [`abortable`], the engines call [`checkpoint`]
//! before each layer, and the forward ends with [`Interrupted`].

use std::cell::Cell;
use std::fmt;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::OnceLock;

/// The signal that asked for a stop, 0 for none.
static REQUESTED: AtomicI32 = AtomicI32::new(0);

/// What a first signal stops, which its line on stderr says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stopping {
    /// The run (or the server's generations, or a rank's work).
    Run,
    /// `coli chat`'s answer in progress; the chat goes on.
    Answer,
}

/// Set once, by [`install`].
static STOPPING: OnceLock<Stopping> = OnceLock::new();

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
    match STOPPING.get() {
        Some(Stopping::Answer) => eprintln!(
            "\n[chat] {name}: the answer stops after this token (send it again to quit at once)"
        ),
        _ => eprintln!(
            "\n[coli] {name}: stopping after this token, or in a prefill after this layer (send it again to quit at once)"
        ),
    }
}

/// Install the handler, for a first signal to stop what `stopping` says (once per process;
/// later calls do nothing).
pub fn install(stopping: Stopping) {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let _ = STOPPING.set(stopping);
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

/// The error of a forward that a stop ended between two layers (inside [`abortable`]): the
/// forward did not finish, and the engine's cache holds a part of it.
#[derive(Debug)]
pub struct Interrupted;

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the forward was stopped by a signal between two layers")
    }
}

impl std::error::Error for Interrupted {}

thread_local! {
    /// Whether the forward running on this thread may stop between layers.
    static ABORTABLE: Cell<bool> = const { Cell::new(false) };
}

/// Run `forward` (a prefill) so that a stop asked for meanwhile ends it at the next
/// [`checkpoint`]. Other forwards (a decode step, a speculative check) always finish: the
/// loops around them stop between tokens, with the cache consistent.
pub fn abortable<T>(forward: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ABORTABLE.set(self.0);
        }
    }
    let _restore = Restore(ABORTABLE.replace(true));
    forward()
}

/// Called by the engines before each layer: [`Interrupted`] inside [`abortable`] once a stop
/// was asked for, otherwise nothing.
pub fn checkpoint() -> anyhow::Result<()> {
    if ABORTABLE.get() && requested() {
        return Err(Interrupted.into());
    }
    Ok(())
}
