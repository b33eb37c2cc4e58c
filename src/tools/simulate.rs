//! `coli trace simulate`: replays a trace through a per-layer expert cache of each size and
//! reports the hit rate of each placement policy.
//!
//! The stream replayed is the one the engine's expert store sees: one lookup per distinct
//! expert of each MoE call, in ascending id order (how `RoutedExperts::run` visits them), so that
//! `lru` at `CAP` slots reproduces the engine's own hit and miss counts. By default only
//! single-row (decode) calls are replayed; `--include-prefill` adds the multi-row calls.
//!
//! Policies, each with the same number of slots in every layer:
//! - `lru`: evict the least recently used expert (the engine's cache).
//! - `lfru`: frequency first: evict the lowest `(heat << 8) | recent`, where heat counts
//!   every lookup of the expert so far (plus its selections in `--history`, as the engine's
//!   `COLI_POLICY=lfru` starts from its history) and `recent = 255 - age` (age in lookups of that
//!   layer, 0 beyond 255); ties go to the least recently used. colibri's REPIN and tier
//!   score, used as an eviction rule. Heat is never decayed here.
//! - `pinned`: a fixed set, the hottest experts of each layer in a history (`--history`)
//!   or in the first part of the trace (`--train-frac`); nothing else is ever resident (a
//!   miss is read and dropped, so an engine would need a buffer beyond the slots for it).
//! - `pin+lru`: the hottest `placement::clamp_pin_n(slots, slots)` of that set pinned
//!   (half the slots below 16, all but 8 from 16 on), the other slots LRU over everything
//!   else: the engine's `PIN=auto PIN_N=<slots>` when experts stream and pins take slots.
//! - `guarded`: `pin+lru` with the engine's abstain rule (`route_trace::guard`): once a
//!   layer has seen `ABSTAIN_AFTER` lookups, and at every doubling, judged at the start of
//!   a forward (the engine judges between tokens), a layer moves to the pin count (none,
//!   up to a slot short of its slots) whose shadow hit most when that beats the pins it
//!   holds by more than 1% of its lookups: unpinned experts stay resident as the most
//!   recent LRU entries, newly pinned ones leave the LRU.
//! - `belady`: the optimal offline bound. Evict whichever of the resident experts and the
//!   one being looked up is needed again furthest in the future (bypassing the cache when
//!   that is the new one), starting from the best possible contents. Bypass and the free
//!   start make it an upper bound on every policy above, the pinned set included; a plain
//!   demand-paging Belady (cold start, always admit) can lose to a pinned set.
//!
//! With `--train-frac F` the first `F` of the replayed forwards only train: they choose the
//! pins and warm `lru` and `lfru`, and every policy is scored on the remaining forwards.
//!
//! Memory: the caches and per-expert state (layers x experts). `belady` needs each lookup's
//! next use, so it spills the scored lookups to two anonymous temporary files (8 bytes per
//! lookup each), read back forwards and backwards in blocks.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::history_file;
use super::trace::{Call, CallGrouper, TraceReader, MAX_INDEX};
use crate::route_trace::guard::{take_order, LayerCache, PinnedLru, PlacementGuard};
use crate::route_trace::{placement, Counters};

/// A placement policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Frequency first, then recency.
    Lfru,
    /// A fixed set seeded from a history or the training part.
    Pinned,
    /// The hottest `clamp_pin_n(slots, slots)` of that set pinned, LRU in the other slots:
    /// what the engine does with `PIN=auto PIN_N=<slots>` when experts stream.
    #[value(name = "pin+lru")]
    #[serde(rename = "pin+lru")]
    PinLru,
    /// `pin+lru` with the abstain rule (`route_trace::guard`): a layer moves to the pin
    /// count, none included, whose shadow does best, as the engine does by default.
    Guarded,
    /// The optimal offline bound.
    Belady,
}

impl Policy {
    /// The name used on the command line and in tables.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfru => "lfru",
            Policy::Pinned => "pinned",
            Policy::PinLru => "pin+lru",
            Policy::Guarded => "guarded",
            Policy::Belady => "belady",
        }
    }
}

/// What to replay and how; shared by `simulate` and `plot --hit-curve`.
#[derive(clap::Args, Debug, Clone)]
pub struct SimOptions {
    /// Expert slots per layer, one simulation each.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32")]
    pub slots: Vec<usize>,
    /// Policies to compare [default: lru,lfru,belady, and pinned when --history or
    /// --train-frac is given].
    #[arg(long = "policy", value_delimiter = ',', value_enum)]
    pub policies: Vec<Policy>,
    /// Seed `pinned` with the hottest experts of each layer in this `.coli_usage` history.
    #[arg(long, conflicts_with = "train_frac")]
    pub history: Option<PathBuf>,
    /// Seed `pinned` from this fraction of the replayed forwards and score every policy on
    /// the rest.
    #[arg(long)]
    pub train_frac: Option<f64>,
    /// Replay multi-row (prefill) calls too, not only single-row decode calls.
    #[arg(long)]
    pub include_prefill: bool,
}

impl SimOptions {
    /// These sizes, with every other option at its default.
    pub fn new(slots: Vec<usize>) -> SimOptions {
        SimOptions {
            slots,
            policies: Vec::new(),
            history: None,
            train_frac: None,
            include_prefill: false,
        }
    }
}

/// `coli trace simulate`.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {
    /// The trace written with ROUTE_TRACE=<path>.
    pub trace: PathBuf,
    #[command(flatten)]
    pub options: SimOptions,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One policy at one size.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct PolicyResult {
    /// The policy.
    pub policy: Policy,
    /// Lookups served from the cache.
    pub hits: u64,
    /// `hits / lookups` (0 when nothing was looked up).
    pub hit_rate: f64,
}

/// Every policy at one size.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct SizeResult {
    /// Slots per layer.
    pub slots: usize,
    /// In the order the policies were asked for.
    pub results: Vec<PolicyResult>,
}

/// Everything `simulate` reports.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct SimReport {
    /// The trace.
    pub trace: String,
    /// `decode` or `all`.
    pub replayed: String,
    /// Calls scored.
    pub calls: u64,
    /// Lookups scored (distinct experts per call).
    pub lookups: u64,
    /// Calls that only trained (`--train-frac`).
    pub train_calls: u64,
    /// Forwards that only trained.
    pub train_forwards: u64,
    /// Where the pins came from.
    pub pins_from: Option<String>,
    /// Malformed lines skipped.
    pub malformed: u64,
    /// One entry per size, in the order given.
    pub sizes: Vec<SizeResult>,
}

impl SimReport {
    /// The hit rate of `policy` at `slots`.
    pub fn rate(&self, slots: usize, policy: Policy) -> Option<f64> {
        self.sizes
            .iter()
            .find(|s| s.slots == slots)?
            .results
            .iter()
            .find(|r| r.policy == policy)
            .map(|r| r.hit_rate)
    }

    /// The hits of `policy` at `slots`.
    pub fn hits(&self, slots: usize, policy: Policy) -> Option<u64> {
        self.sizes
            .iter()
            .find(|s| s.slots == slots)?
            .results
            .iter()
            .find(|r| r.policy == policy)
            .map(|r| r.hits)
    }
}

fn layer_mut<T: Default>(v: &mut Vec<T>, layer: usize) -> &mut T {
    if v.len() <= layer {
        v.resize_with(layer + 1, T::default);
    }
    &mut v[layer]
}

/// The calls of a trace that are replayed, each with the ordinal of its forward among the
/// replayed forwards.
struct Replay {
    reader: TraceReader,
    calls: CallGrouper,
    include_prefill: bool,
    forward: Option<u64>,
    forwards: u64,
    pending: Option<Call>,
}

impl Replay {
    fn open(path: &Path, include_prefill: bool, quiet: bool) -> Result<Replay> {
        Ok(Replay {
            reader: TraceReader::open(path, quiet, "simulate")?,
            calls: CallGrouper::default(),
            include_prefill,
            forward: None,
            forwards: 0,
            pending: None,
        })
    }

    /// The next replayed call and the ordinal of its forward among replayed forwards.
    fn next_call(&mut self) -> Result<Option<(Call, u64)>> {
        loop {
            let call = match self.pending.take() {
                Some(c) => Some(c),
                None => match self.reader.next_route()? {
                    Some(r) => {
                        self.pending = self.calls.push(r);
                        continue;
                    }
                    None => self.calls.finish(),
                },
            };
            let Some(call) = call else {
                return Ok(None);
            };
            if call.rows != 1 && !self.include_prefill {
                continue;
            }
            if self.forward != Some(call.forward) {
                self.forward = Some(call.forward);
                self.forwards += 1;
            }
            return Ok(Some((call, self.forwards - 1)));
        }
    }
}

/// Pins per layer, hottest first, from a count table.
fn ranked_pins(table: &Counters, most: usize) -> Vec<Vec<usize>> {
    let mut per_layer: Vec<Vec<usize>> = Vec::new();
    for p in placement::select_per_layer(table, most) {
        if p.layer < MAX_INDEX && p.expert < MAX_INDEX {
            layer_mut(&mut per_layer, p.layer).push(p.expert);
        }
    }
    per_layer
}

/// The selections counted while training, as the table pins are chosen from.
fn training_table(counts: &[Vec<u64>]) -> Result<Counters> {
    let n_layers = counts.len().saturating_sub(1);
    let n_experts = counts.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut t = Counters::new(n_layers, n_experts)?;
    for (l, row) in counts.iter().enumerate() {
        for (e, &c) in row.iter().enumerate() {
            t.admit(l as i64, e as i64, u32::try_from(c).unwrap_or(u32::MAX));
        }
    }
    Ok(t)
}

/// The scored lookups spilled for `belady`: `(layer, expert)` as two little-endian u32.
struct Spill {
    out: BufWriter<File>,
    n: u64,
}

impl Spill {
    fn new() -> Result<Spill> {
        let f = tempfile::tempfile().context("cannot create a temporary file for belady")?;
        Ok(Spill {
            out: BufWriter::with_capacity(1 << 20, f),
            n: 0,
        })
    }

    fn push(&mut self, layer: usize, expert: usize) -> io::Result<()> {
        let mut rec = [0u8; 8];
        rec[..4].copy_from_slice(&(layer as u32).to_le_bytes());
        rec[4..].copy_from_slice(&(expert as u32).to_le_bytes());
        self.n += 1;
        self.out.write_all(&rec)
    }
}

/// Reads 8-byte records of a file from the last to the first, in blocks.
struct Backward {
    file: File,
    /// Bytes before the block in `buf`.
    before: u64,
    buf: Vec<u8>,
    /// Records of `buf` not yet returned.
    left: usize,
}

impl Backward {
    fn new(mut file: File) -> io::Result<Backward> {
        let len = file.seek(SeekFrom::End(0))?;
        Ok(Backward {
            file,
            before: len - len % 8,
            buf: Vec::new(),
            left: 0,
        })
    }

    fn next(&mut self) -> io::Result<Option<[u8; 8]>> {
        if self.left == 0 {
            if self.before == 0 {
                return Ok(None);
            }
            let take = self.before.min(1 << 20);
            self.before -= take;
            self.buf.resize(take as usize, 0);
            self.file.seek(SeekFrom::Start(self.before))?;
            self.file.read_exact(&mut self.buf)?;
            self.left = self.buf.len() / 8;
        }
        self.left -= 1;
        let mut rec = [0u8; 8];
        rec.copy_from_slice(&self.buf[self.left * 8..self.left * 8 + 8]);
        Ok(Some(rec))
    }
}

fn decode(rec: [u8; 8]) -> (usize, usize) {
    let l = u32::from_le_bytes([rec[0], rec[1], rec[2], rec[3]]);
    let e = u32::from_le_bytes([rec[4], rec[5], rec[6], rec[7]]);
    (l as usize, e as usize)
}

/// Optimal offline hits for each size over the spilled lookups.
fn belady(spill: Spill, sizes: &[usize]) -> Result<Vec<u64>> {
    let io_err = |e: io::Error| anyhow::anyhow!("belady's temporary file: {e}");
    let mut lookups = spill.out.into_inner().map_err(|e| io_err(e.into_error()))?;
    lookups.flush().map_err(io_err)?;
    // Backwards: each lookup's next use of the same (layer, expert), written in reverse.
    let mut next_rev = BufWriter::with_capacity(
        1 << 20,
        tempfile::tempfile().context("cannot create a temporary file for belady")?,
    );
    let mut next_seen: Vec<Vec<u64>> = Vec::new();
    let mut back = Backward::new(lookups.try_clone().map_err(io_err)?).map_err(io_err)?;
    let mut i = spill.n;
    while let Some(rec) = back.next().map_err(io_err)? {
        i -= 1;
        let (l, e) = decode(rec);
        let row = layer_mut(&mut next_seen, l);
        if row.len() <= e {
            row.resize(e + 1, u64::MAX);
        }
        next_rev.write_all(&row[e].to_le_bytes()).map_err(io_err)?;
        row[e] = i;
    }
    let next_rev = next_rev.into_inner().map_err(|e| io_err(e.into_error()))?;
    // `next_seen` now holds every expert's first use: the best start keeps, per layer,
    // the experts needed soonest.
    let first_use = next_seen;
    let mut caches: Vec<Vec<Vec<(usize, u64)>>> = sizes
        .iter()
        .map(|&s| {
            first_use
                .iter()
                .map(|row| {
                    let mut v: Vec<(usize, u64)> = row
                        .iter()
                        .copied()
                        .enumerate()
                        .filter(|&(_, t)| t != u64::MAX)
                        .collect();
                    v.sort_by_key(|&(e, t)| (t, e));
                    v.truncate(s);
                    v
                })
                .collect()
        })
        .collect();
    let mut hits = vec![0u64; sizes.len()];
    lookups.seek(SeekFrom::Start(0)).map_err(io_err)?;
    let mut fwd = BufReader::with_capacity(1 << 20, lookups);
    let mut nexts = Backward::new(next_rev).map_err(io_err)?;
    let mut rec = [0u8; 8];
    for _ in 0..spill.n {
        fwd.read_exact(&mut rec).map_err(io_err)?;
        let (l, e) = decode(rec);
        let Some(n) = nexts.next().map_err(io_err)? else {
            bail!("belady's temporary files disagree in length");
        };
        let next = u64::from_le_bytes(n);
        for ((cache, &slots), hit) in caches.iter_mut().zip(sizes).zip(hits.iter_mut()) {
            let layer = layer_mut(cache, l);
            if let Some(slot) = layer.iter_mut().find(|s| s.0 == e) {
                slot.1 = next;
                *hit += 1;
                continue;
            }
            if layer.len() < slots {
                layer.push((e, next));
                continue;
            }
            if let Some(far) = layer.iter_mut().max_by_key(|s| s.1) {
                if far.1 > next {
                    *far = (e, next);
                }
            }
        }
    }
    Ok(hits)
}

/// Checks the options and fills in the default policies.
fn policies(opts: &SimOptions) -> Result<Vec<Policy>> {
    if opts.slots.is_empty() || opts.slots.contains(&0) {
        bail!("--slots needs one or more sizes of at least 1 slot per layer");
    }
    if let Some(f) = opts.train_frac {
        if !(f > 0.0 && f < 1.0) {
            bail!("--train-frac {f}: expected a fraction strictly between 0 and 1");
        }
    }
    let seeded = opts.history.is_some() || opts.train_frac.is_some();
    let mut p = opts.policies.clone();
    if p.is_empty() {
        p = vec![Policy::Lru, Policy::Lfru, Policy::Belady];
        if seeded {
            p.insert(2, Policy::Pinned);
            p.insert(3, Policy::PinLru);
            p.insert(4, Policy::Guarded);
        }
    }
    if let Some(needs) = p
        .iter()
        .find(|&&x| matches!(x, Policy::Pinned | Policy::PinLru | Policy::Guarded))
    {
        if !seeded {
            bail!(
                "--policy {} needs the pins' source: --history <.coli_usage> or --train-frac <F>",
                needs.name()
            );
        }
    }
    p.dedup();
    Ok(p)
}

/// Replays `trace` under every policy and size of `opts`.
pub fn simulate(trace: &Path, opts: &SimOptions) -> Result<SimReport> {
    let policies = policies(opts)?;
    let sizes = &opts.slots;
    let most = sizes.iter().copied().max().unwrap_or(1);
    let mut heat_prior: Vec<Vec<u64>> = Vec::new();
    let (mut pins, pins_from) = match &opts.history {
        Some(h) => {
            let hist = history_file::open_readable(h)?;
            // A trace's ids are below MAX_INDEX, so a history cell beyond it (a crafted
            // or foreign shape) can meet no lookup and is not held.
            for (layer, expert, count) in hist.counts.nonzero() {
                if layer < MAX_INDEX && expert < MAX_INDEX {
                    *layer_mut(layer_mut(&mut heat_prior, layer), expert) += u64::from(count);
                }
            }
            (
                Some(ranked_pins(&hist.counts, most)),
                Some(h.display().to_string()),
            )
        }
        None => (None, None),
    };
    let train_forwards = match opts.train_frac {
        Some(f) => {
            let mut count = Replay::open(trace, opts.include_prefill, false)?;
            while count.next_call()?.is_some() {}
            let n = count.forwards;
            let train = (f * n as f64).floor() as u64;
            if train == 0 || train >= n {
                bail!(
                    "--train-frac {f} of {n} replayed forwards in {} leaves {} to train on and {} to score",
                    trace.display(),
                    train,
                    n - train.min(n)
                );
            }
            train
        }
        None => 0,
    };
    let mut replay = Replay::open(trace, opts.include_prefill, opts.train_frac.is_some())?;
    let want = |p: Policy| policies.contains(&p);
    let mut lru: Vec<Vec<LayerCache>> = sizes.iter().map(|_| Vec::new()).collect();
    let mut lfru: Vec<Vec<LayerCache>> = sizes.iter().map(|_| Vec::new()).collect();
    // Per size and layer, created at the layer's first scored call (when the pins exist).
    let mut pinlru: Vec<Vec<Option<PinnedLru>>> = sizes.iter().map(|_| Vec::new()).collect();
    let mut guarded: Vec<Vec<Option<PinnedLru>>> = sizes.iter().map(|_| Vec::new()).collect();
    let mut judges: Vec<PlacementGuard> = Vec::new();
    let mut hits = vec![[0u64; 6]; sizes.len()];
    let mut last_forward = None;
    let mut spill = if want(Policy::Belady) {
        Some(Spill::new()?)
    } else {
        None
    };
    let mut training: Vec<Vec<u64>> = Vec::new();
    let (mut calls, mut lookups, mut train_calls) = (0u64, 0u64, 0u64);
    while let Some((call, forward)) = replay.next_call()? {
        let scored = forward >= train_forwards;
        if !scored {
            train_calls += 1;
            let row = layer_mut(&mut training, call.layer);
            for &e in &call.selections {
                *layer_mut(row, e) += 1;
            }
        } else {
            if pins.is_none()
                && (want(Policy::Pinned) || want(Policy::PinLru) || want(Policy::Guarded))
            {
                pins = Some(ranked_pins(&training_table(&training)?, most));
            }
            calls += 1;
            lookups += call.experts.len() as u64;
        }
        // The clock each size's caches start this call at: a call whose experts fit takes
        // them together, and none it took is replaced for a later one.
        let layer_pins = |slots: usize| -> &[usize] {
            let held = pins.as_ref().and_then(|p| p.get(call.layer));
            held.map_or(&[], |p| {
                &p[..p.len().min(placement::clamp_pin_n(slots, slots))]
            })
        };
        let starts: Vec<(u64, u64)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &slots)| {
                if call.experts.len() > slots {
                    return (u64::MAX, u64::MAX);
                }
                let start = |caches: &mut Vec<LayerCache>| layer_mut(caches, call.layer).clock + 1;
                (start(&mut lru[i]), start(&mut lfru[i]))
            })
            .collect();
        if want(Policy::Guarded) && scored {
            if judges.is_empty() {
                // The pins are known from the first scored call on: what `PIN=auto
                // PIN_N=<slots>` holds at start, and the ranking up to a slot short.
                judges = sizes
                    .iter()
                    .map(|&slots| {
                        let held = pins.as_deref().unwrap_or_default();
                        let ranked: Vec<Vec<usize>> = held
                            .iter()
                            .map(|p| p[..p.len().min(slots.saturating_sub(1))].to_vec())
                            .collect();
                        let start: Vec<usize> = held
                            .iter()
                            .map(|p| p.len().min(placement::clamp_pin_n(slots, slots)))
                            .collect();
                        PlacementGuard::new(slots, &ranked, &start)
                    })
                    .collect();
            }
            if last_forward != Some(forward) {
                // The engine judges between tokens.
                last_forward = Some(forward);
                for ((judge, layers), &slots) in
                    judges.iter_mut().zip(guarded.iter_mut()).zip(sizes)
                {
                    for verdict in judge.verdicts() {
                        if let Some(g) = layers.get_mut(verdict.layer).and_then(Option::as_mut) {
                            for &e in &verdict.unpin {
                                g.unpin(e, slots);
                            }
                            for &e in &verdict.pin {
                                g.pin(e, slots);
                            }
                        }
                    }
                }
            }
            for judge in &mut judges {
                judge.observe(call.layer, &call.experts);
            }
        }
        // Pins plus LRU, plain and guarded, only once the pins exist (scored calls): warmed
        // in training with every slot free, the LRU part would hold more than the slots
        // the pins leave it.
        for (policy, caches, at) in [
            (Policy::PinLru, &mut pinlru, 4),
            (Policy::Guarded, &mut guarded, 5),
        ] {
            if !(want(policy) && scored) {
                continue;
            }
            for (i, &slots) in sizes.iter().enumerate() {
                let cache = layer_mut(&mut caches[i], call.layer)
                    .get_or_insert_with(|| PinnedLru::new(layer_pins(slots).to_vec()));
                let start = cache.call_start(&call.experts, slots);
                for e in cache.order(&call.experts, slots) {
                    hits[i][at] += u64::from(cache.lookup(e, slots, start));
                }
            }
        }
        // Each size's caches take the call's experts in their own order.
        let orders: Vec<(Vec<usize>, Vec<usize>)> = sizes
            .iter()
            .enumerate()
            .map(|(i, &slots)| {
                let fits = call.experts.len() <= slots;
                let order = |caches: &mut Vec<LayerCache>| {
                    let cache = layer_mut(caches, call.layer);
                    take_order(&call.experts, fits, |e| cache.holds(e))
                };
                (order(&mut lru[i]), order(&mut lfru[i]))
            })
            .collect();
        for (k, &e) in call.experts.iter().enumerate() {
            for (i, &slots) in sizes.iter().enumerate() {
                let (lru_start, lfru_start) = starts[i];
                let (lru_e, lfru_e) = (orders[i].0[k], orders[i].1[k]);
                if want(Policy::Lru)
                    && layer_mut(&mut lru[i], call.layer).lookup(lru_e, slots, false, lru_start)
                {
                    hits[i][0] += u64::from(scored);
                }
                if want(Policy::Lfru) {
                    let cache = layer_mut(&mut lfru[i], call.layer);
                    if cache.heat.is_empty() {
                        cache.heat = heat_prior.get(call.layer).cloned().unwrap_or_default();
                    }
                    if cache.lookup(lfru_e, slots, true, lfru_start) {
                        hits[i][1] += u64::from(scored);
                    }
                }
                if scored {
                    let pinned = pins
                        .as_ref()
                        .and_then(|p| p.get(call.layer))
                        .is_some_and(|p| p[..p.len().min(slots)].contains(&e));
                    hits[i][2] += u64::from(pinned);
                }
            }
            if scored {
                if let Some(s) = spill.as_mut() {
                    s.push(call.layer, e)
                        .context("cannot write belady's temporary file")?;
                }
            }
        }
    }
    if let Some(s) = spill {
        for (h, b) in hits.iter_mut().zip(belady(s, sizes)?) {
            h[3] = b;
        }
    }
    let index = |p: Policy| match p {
        Policy::Lru => 0,
        Policy::Lfru => 1,
        Policy::Pinned => 2,
        Policy::Belady => 3,
        Policy::PinLru => 4,
        Policy::Guarded => 5,
    };
    let pins_from = match (pins_from, opts.train_frac) {
        (Some(h), _) => Some(h),
        (None, Some(_)) => Some(format!(
            "the first {train_forwards} replayed forwards of {}",
            trace.display()
        )),
        (None, None) => None,
    };
    Ok(SimReport {
        trace: trace.display().to_string(),
        replayed: if opts.include_prefill {
            "all"
        } else {
            "decode"
        }
        .to_string(),
        calls,
        lookups,
        train_calls,
        train_forwards,
        pins_from,
        malformed: replay.reader.malformed(),
        sizes: sizes
            .iter()
            .zip(&hits)
            .map(|(&slots, h)| SizeResult {
                slots,
                results: policies
                    .iter()
                    .map(|&policy| {
                        let n = h[index(policy)];
                        PolicyResult {
                            policy,
                            hits: n,
                            hit_rate: if lookups == 0 {
                                0.0
                            } else {
                                n as f64 / lookups as f64
                            },
                        }
                    })
                    .collect(),
            })
            .collect(),
    })
}

/// The report as text: a header and one table.
pub fn render(r: &SimReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "trace     {}", r.trace);
    let what = if r.replayed == "all" {
        "MoE calls (decode and prefill)"
    } else {
        "single-row decode calls (--include-prefill adds prefill calls)"
    };
    let _ = writeln!(
        s,
        "scored    {} {what}: {} expert lookups",
        r.calls, r.lookups
    );
    if r.train_forwards > 0 {
        let _ = writeln!(
            s,
            "trained   on the first {} forwards ({} calls): pins chosen, lru and lfru warmed",
            r.train_forwards, r.train_calls
        );
    }
    if let Some(p) = &r.pins_from {
        let _ = writeln!(s, "pinned    the hottest experts of each layer in {p}");
    }
    let _ = writeln!(s);
    let _ = write!(s, "hit rate by slots per layer\n{:>6}", "slots");
    let policies: Vec<Policy> = r
        .sizes
        .first()
        .map(|z| z.results.iter().map(|x| x.policy).collect())
        .unwrap_or_default();
    for p in &policies {
        let _ = write!(s, "  {:>7}", p.name());
    }
    s.push('\n');
    for z in &r.sizes {
        let _ = write!(s, "{:>6}", z.slots);
        for x in &z.results {
            let _ = write!(s, "  {:>6.1}%", 100.0 * x.hit_rate);
        }
        s.push('\n');
    }
    s
}

/// `coli trace simulate`.
pub fn run(args: &SimulateArgs) -> Result<()> {
    let report = simulate(&args.trace, &args.options)?;
    super::emit_report(&report, args.json, render)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_oldest() {
        let mut c = LayerCache::default();
        let seq = [1, 2, 1, 3, 2];
        let hits: Vec<bool> = seq
            .iter()
            .map(|&e| c.lookup(e, 2, false, u64::MAX))
            .collect();
        // 1 2 | 1 hit | 3 evicts 2 | 2 misses
        assert_eq!(hits, vec![false, false, true, false, false]);
    }

    #[test]
    fn lfru_keeps_the_frequent() {
        let mut c = LayerCache::default();
        let seq = [1, 1, 1, 2, 3, 1];
        let hits: Vec<bool> = seq
            .iter()
            .map(|&e| c.lookup(e, 2, true, u64::MAX))
            .collect();
        // 3 evicts 2 (heat 1) rather than 1 (heat 3), so 1 still hits.
        assert_eq!(hits, vec![false, true, true, false, false, true]);
    }

    #[test]
    fn backward_reads_every_record_in_reverse() {
        let mut f = tempfile::tempfile().expect("temp");
        for i in 0u64..5 {
            f.write_all(&i.to_le_bytes()).expect("write");
        }
        let mut b = Backward::new(f).expect("open");
        let mut got = Vec::new();
        while let Some(r) = b.next().expect("read") {
            got.push(u64::from_le_bytes(r));
        }
        assert_eq!(got, vec![4, 3, 2, 1, 0]);
    }
}
