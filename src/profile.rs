//! Where a run's time goes, for the `PROFILE:` line: wall time accumulated per phase by
//! the code that runs it (attention in the engines, the expert FFNs in the MoE pass, the
//! LM head, an MPI job's exchanges with its expert ranks), as process-wide counters. The expert store's own read and wait times are in
//! its [`CacheStats`](crate::experts::CacheStats).
//!
//! It only measures; nothing reads it to decide anything.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A timed part of a forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Attention,
    ExpertMatmul,
    LmHead,
    /// An MPI job's trunk sending requests to the expert ranks and waiting for answers.
    Exchange,
}

static NANOS: [AtomicU64; 4] = [
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
    AtomicU64::new(0),
];

/// Run `f`, adding its wall time to `phase`.
pub fn time<R>(phase: Phase, f: impl FnOnce() -> R) -> R {
    let started = Instant::now();
    let result = f();
    NANOS[phase as usize].fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    result
}

/// The time spent in `phase` so far.
pub fn total(phase: Phase) -> Duration {
    Duration::from_nanos(NANOS[phase as usize].load(Ordering::Relaxed))
}
