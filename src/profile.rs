//! Where a run's time goes, for the `PROFILE:` line: wall time accumulated per phase by
//! the code that runs it (attention in the engines and the DSA indexer within it, the
//! expert FFNs in the MoE pass, shared experts, dense MLPs, the LM head, an MPI job's
//! exchanges with its expert ranks), as process-wide counters. The expert store's own read and wait times are in
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
    /// The DSA indexer's projections and its scan over the keys: part of `Attention`, which
    /// contains it.
    Indexer,
    /// Shared experts, run on every row beside the routed ones.
    SharedExpert,
    /// The dense MLP of a layer without experts.
    DenseFfn,
}

static NANOS: [AtomicU64; 7] = [const { AtomicU64::new(0) }; 7];

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
