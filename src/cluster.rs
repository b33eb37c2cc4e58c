//! Routed experts spread over the processes of an MPI job (`--features mpi`):
//! `mpirun -np N coli SNAP=... [settings]`.
//!
//! Rank 0 is the trunk: it runs the whole run as one process would (attention, dense
//! layers, norms, head, KV cache, the routers), and it alone reports to `route_trace`, so
//! the history and the trace are written exactly as a single process writes them. The
//! routed experts belong to ranks 1..N-1 ([`plan`], `EXPERT_SHARDING`): per MoE call the
//! trunk sends each rank that owns a chosen expert one request (the union of the rows
//! routed to its experts, and each expert's rows), computes nothing of theirs, and adds
//! every expert's gated output in ascending expert order, as one process adds them, so the
//! tokens are the same. Each expert rank keeps its experts in its own store (budget,
//! streaming, pins of its own) and only answers requests ([`serve`]).
//!
//! A rank that does not take a message or answer one within `MPI_TIMEOUT` seconds ends the
//! job: the error names it, the step it held up is not saved, nothing more is asked of the
//! ranks, and rank 0 aborts them all as the run ends ([`timed_out`]). A rank that dies ends
//! the job through `mpirun`.
//! This module owns the protocol and the placement; it does not compute experts.

use std::mem::ManuallyDrop;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use mpi::datatype::Equivalence;
use mpi::request::{self, Scope};
use mpi::topology::{Process, Rank, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use crate::activation::{Activation, Situ};
use crate::engines::moe::{host_outputs, Assignment, RemoteExperts};
use crate::engines::Engine;
use crate::experts::{CacheStats, ExpertStore, Sharding};
use crate::profile::{self, Phase};
use crate::quant::Width;
use crate::settings::Settings;
use crate::startup::{self, Positionals};

const TAG_REQUEST: i32 = 1;
const TAG_INPUT: i32 = 2;
const TAG_OUTPUT: i32 = 3;
const TAG_PLACED: i32 = 4;
const TAG_STATE: i32 = 5;
const OP_STOP: u64 = 0;
const OP_RUN: u64 = 1;
/// `[OP_PLACE, n, (layer, expert, pin)...]`: pin (1) or unpin (0) each in turn, answering
/// after each whether it is pinned (`TAG_PLACED`).
const OP_PLACE: u64 = 2;
/// `[OP_SEED, n, (layer, expert, selections)...]`: LFRU's starting frequencies; no answer.
const OP_SEED: u64 = 3;
/// `[OP_STATE]`: answered with the store's slots a layer, whether it streams, and its
/// counters (`TAG_STATE`).
const OP_STATE: u64 = 4;

/// The MPI job this process is part of, when `mpirun` started it with more than one rank.
pub struct Job {
    // Finalises MPI when dropped, after every message of the run.
    universe: mpi::environment::Universe,
    pub rank: Rank,
    pub size: Rank,
}

static SIZE: OnceLock<Rank> = OnceLock::new();
static EXCHANGES: AtomicU64 = AtomicU64::new(0);
/// An expert rank ran past `MPI_TIMEOUT`. Nothing more is asked of the ranks (a message to
/// a rank that hangs could wait as long again), and the job is aborted when the run ends,
/// even where the timeout only cost a report (the cache counters at the end).
static TIMED_OUT: AtomicBool = AtomicBool::new(false);

/// Whether an expert rank ran past `MPI_TIMEOUT` in this run: the job must be aborted.
pub fn timed_out() -> bool {
    TIMED_OUT.load(Ordering::Relaxed)
}

/// The MoE calls whose experts went to other ranks so far.
pub fn exchanges() -> u64 {
    EXCHANGES.load(Ordering::Relaxed)
}

/// Join the MPI job when `mpirun` started this process; `None` for a plain run or a job of
/// one rank.
pub fn start() -> Result<Option<Job>> {
    if !startup::launched_by_mpirun() {
        return Ok(None);
    }
    let Some((universe, threading)) = mpi::initialize_with_threading(Threading::Serialized) else {
        bail!("MPI was already started in this process");
    };
    if threading < Threading::Serialized {
        bail!("this MPI library offers thread level {threading:?}; coli needs Serialized (its expert calls come from the thread pool)");
    }
    let world = universe.world();
    let (rank, size) = (world.rank(), world.size());
    if size < 2 {
        return Ok(None);
    }
    let _ = SIZE.set(size);
    Ok(Some(Job {
        universe,
        rank,
        size,
    }))
}

impl Job {
    /// End every rank of the job now with `code` (after an error on the trunk, whose
    /// expert ranks may not be answering).
    pub fn abort(&self, code: i32) -> ! {
        self.universe.world().abort(code)
    }
}

/// The ranks of this process's MPI job (1 outside one).
pub fn world_size() -> Rank {
    SIZE.get().copied().unwrap_or(1)
}

/// Which rank computes each expert: `owners[layer][expert]`, ranks 1..size-1. `heat` is
/// each expert's selections in the history (`heat(layer, expert)`). With `Layer` whole
/// layers go round robin; with `Expert` each layer's experts go, hottest first, to the
/// rank holding the least heat of that layer so far (each expert counting one more than its
/// heat, so that without a history the experts are dealt out evenly).
pub fn plan(
    sharding: Sharding,
    size: Rank,
    experts_per_layer: &[usize],
    heat: impl Fn(usize, usize) -> u64,
) -> Vec<Vec<Rank>> {
    let workers = (size - 1).max(1) as usize;
    experts_per_layer
        .iter()
        .enumerate()
        .map(|(layer, &count)| match sharding {
            Sharding::Layer => vec![1 + (layer % workers) as Rank; count],
            Sharding::Expert => {
                let mut order: Vec<usize> = (0..count).collect();
                order.sort_by_key(|&e| (std::cmp::Reverse(heat(layer, e)), e));
                let mut load = vec![0u64; workers];
                let mut owners = vec![1; count];
                for e in order {
                    let rank = (0..workers).min_by_key(|&r| (load[r], r)).unwrap_or(0);
                    load[rank] += heat(layer, e) + 1;
                    owners[e] = 1 + rank as Rank;
                }
                owners
            }
        })
        .collect()
}

/// The trunk's side: requests out, answers in, with the time they took.
pub struct Trunk {
    owners: Vec<Vec<Rank>>,
    size: Rank,
    timeout: Duration,
    /// Per rank asked in the current call: the positions of its assignments in the order
    /// sent, and the floats each answer holds.
    pending: Vec<(Rank, Vec<(usize, usize)>)>,
    sent: usize,
    layer: usize,
    /// The expert ranks' stores: the fewest slots a layer, and whether any streams.
    slots: (usize, bool),
    /// The experts pinned on the expert ranks, by layer, as their answers said.
    pinned: Vec<Vec<usize>>,
    pins_skipped: usize,
}

impl Trunk {
    /// The trunk of an MPI job of `size` ranks for `engine`, placed as `settings` ask from
    /// the history the engine has loaded; the placement is said on stderr.
    pub fn attach(engine: &dyn Engine, settings: &Settings, size: Rank) -> Result<()> {
        let (per_layer, counts) = {
            let routed = engine.routed();
            let store = &routed.store;
            let per_layer: Vec<usize> = (0..store.layers()).map(|l| store.experts_in(l)).collect();
            (per_layer, routed.telemetry.counts().clone())
        };
        let owners = plan(settings.expert_sharding, size, &per_layer, |l, e| {
            u64::from(counts.get(l, e))
        });
        let held: Vec<usize> = (1..size)
            .map(|rank| owners.iter().flatten().filter(|&&r| r == rank).count())
            .collect();
        eprintln!(
            "[mpi] {size} ranks: rank 0 the trunk, experts by {} over ranks 1..{} ({} experts each)",
            match settings.expert_sharding {
                Sharding::Expert => "expert, balanced by the history's heat",
                Sharding::Layer => "layer",
            },
            size - 1,
            held.iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join("/")
        );
        let mut trunk = Trunk {
            pinned: vec![Vec::new(); owners.len()],
            owners,
            size,
            timeout: Duration::from_secs(settings.mpi_timeout),
            pending: Vec::new(),
            sent: 0,
            layer: 0,
            slots: (0, false),
            pins_skipped: 0,
        };
        let states = trunk.states()?;
        trunk.slots = (
            states.iter().map(|s| s.0).min().unwrap_or(0),
            states.iter().any(|s| s.1),
        );
        engine.routed().remote = Some(Box::new(trunk));
        Ok(())
    }

    /// `rank`'s next message under `tag`, waiting at most `MPI_TIMEOUT` for all of it; `what`
    /// says what the answer was for when it does not come. A large message arrives in parts
    /// as its sender runs, so a plain receive would wait for ever on a rank that hangs
    /// partway through its answer.
    fn receive_within<T: Equivalence + Default + Clone>(
        &self,
        rank: Rank,
        tag: i32,
        what: impl Fn() -> String,
    ) -> Result<Vec<T>> {
        self.not_after_a_timeout(rank)?;
        let late = || self.late(rank, format!("did not answer {}", what()));
        let world = SimpleCommunicator::world();
        let process = rank_process(&world, rank);
        let started = Instant::now();
        let mut waited = 0u32;
        let (message, status) = loop {
            if let Some(matched) = process.immediate_matched_probe_with_tag(tag) {
                break matched;
            }
            if started.elapsed() > self.timeout {
                TIMED_OUT.store(true, Ordering::Relaxed);
                return Err(late());
            }
            // The answer waits on the rank's experts: spin a little, then sleep between looks.
            waited += 1;
            if waited < 1000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        };
        let Ok(count) = usize::try_from(status.count(T::equivalent_datatype())) else {
            // Unreceived, the message would panic as it drops: left to MPI, as the job ends.
            std::mem::forget(message);
            TIMED_OUT.store(true, Ordering::Relaxed);
            bail!("expert rank {rank} answered {} with a message that is not a whole number of values; are all ranks running the same coli?", what());
        };
        let mut data = ManuallyDrop::new(vec![T::default(); count]);
        let received = request::scope(|scope| {
            let request = message.immediate_matched_receive_into(scope, &mut data[..]);
            // SAFETY: on a timeout `data` is never freed (it stays in its `ManuallyDrop`).
            unsafe { self.complete_within(started, request) }
        });
        if !received {
            return Err(late());
        }
        Ok(ManuallyDrop::into_inner(data))
    }

    /// Send `data` to `rank` under `tag`, waiting at most `MPI_TIMEOUT` for it to leave;
    /// `what` says what it was when it does not. A message larger than MPI buffers (an
    /// MoE call's rows of a real model) leaves only as the rank receives it, so a plain
    /// send to a rank that hangs would never return.
    fn send_within<T: Equivalence>(
        &self,
        rank: Rank,
        tag: i32,
        data: Vec<T>,
        what: impl Fn() -> String,
    ) -> Result<()> {
        self.not_after_a_timeout(rank)?;
        let late = || self.late(rank, format!("did not take {}", what()));
        let world = SimpleCommunicator::world();
        let process = rank_process(&world, rank);
        let started = Instant::now();
        let data = ManuallyDrop::new(data);
        let sent = request::scope(|scope| {
            let request = process.immediate_send_with_tag(scope, &data[..], tag);
            // SAFETY: on a timeout `data` is never freed (it stays in its `ManuallyDrop`).
            unsafe { self.complete_within(started, request) }
        });
        if !sent {
            return Err(late());
        }
        drop(ManuallyDrop::into_inner(data));
        Ok(())
    }

    /// Once a rank ran past `MPI_TIMEOUT`, `rank` is not waited on again ([`TIMED_OUT`]).
    fn not_after_a_timeout(&self, rank: Rank) -> Result<()> {
        if timed_out() {
            bail!(
                "expert rank {rank} was not asked again: a rank already ran past MPI_TIMEOUT={}s",
                self.timeout.as_secs()
            );
        }
        Ok(())
    }

    /// The error for `rank` having `happened` (what it did not do) within `MPI_TIMEOUT`.
    fn late(&self, rank: Rank, happened: String) -> anyhow::Error {
        anyhow!(
            "expert rank {rank} {happened} within MPI_TIMEOUT={}s; the run ends here and this step is not saved (is rank {rank} alive, or does it need more time?)",
            self.timeout.as_secs()
        )
    }

    /// Drive `request` until it completes (true) or `MPI_TIMEOUT` has passed since
    /// `started` (false, and [`timed_out`] from then on).
    ///
    /// # Safety
    /// An unfinished request is left to MPI with its buffer: after `false` the caller must
    /// never free that buffer. The job is aborted at the end of the run ([`timed_out`]).
    unsafe fn complete_within<'a, D: ?Sized, S: Scope<'a>>(
        &self,
        started: Instant,
        mut request: request::Request<'a, D, S>,
    ) -> bool {
        loop {
            match request.test() {
                Ok(_) => return true,
                Err(pending) if started.elapsed() > self.timeout => {
                    TIMED_OUT.store(true, Ordering::Relaxed);
                    // SAFETY: the request leaves its scope unfinished; the caller never
                    // frees its buffer (this function's contract).
                    let _ = unsafe { pending.into_raw() };
                    return false;
                }
                Err(pending) => request = pending,
            }
            // Each test moves the transfer on, so no sleeping between them (unlike the wait
            // for an answer, which waits on the rank's experts).
            std::thread::yield_now();
        }
    }

    /// Each expert rank's store: slots a layer, whether it streams, and its counters.
    fn states(&self) -> Result<Vec<(usize, bool, CacheStats)>> {
        for rank in 1..self.size {
            self.send_within(rank, TAG_REQUEST, vec![OP_STATE], || {
                "a question about its expert store".into()
            })?;
        }
        (1..self.size)
            .map(|rank| {
                let words: Vec<u64> = self.receive_within(rank, TAG_STATE, || {
                    "a question about its expert store".into()
                })?;
                let Some((&[slots, streams], counters)) = words.split_first_chunk::<2>() else {
                    bail!("expert rank {rank} described its store in {} words; are all ranks running the same coli?", words.len());
                };
                let counters: [u64; 15] = counters.try_into().with_context(|| {
                    format!("expert rank {rank} sent {} counters where the trunk reads 15; are all ranks running the same coli?", counters.len())
                })?;
                Ok((slots as usize, streams == 1, CacheStats::from_words(counters)))
            })
            .collect()
    }

    fn owner(&self, layer: usize, expert: usize) -> Rank {
        self.owners
            .get(layer)
            .and_then(|owners| owners.get(expert))
            .copied()
            .unwrap_or(0)
    }
}

fn rank_process(world: &SimpleCommunicator, rank: Rank) -> Process<'_> {
    world.process_at_rank(rank)
}

impl RemoteExperts for Trunk {
    fn is_remote(&self, layer: usize, expert: usize) -> bool {
        self.owner(layer, expert) != 0
    }

    fn send(
        &mut self,
        layer: usize,
        input: &[f32],
        width: usize,
        activation: Activation,
        assignments: &[&Assignment],
    ) -> Result<()> {
        profile::time(Phase::Exchange, || {
            EXCHANGES.fetch_add(1, Ordering::Relaxed);
            self.pending.clear();
            self.sent = assignments.len();
            self.layer = layer;
            for rank in 1..self.size {
                let mine: Vec<usize> = (0..assignments.len())
                    .filter(|&i| self.owners[layer][assignments[i].0] == rank)
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                // The union of the rows, in row order; each expert's rows index into it.
                let mut rows: Vec<usize> = mine
                    .iter()
                    .flat_map(|&i| assignments[i].1.iter().map(|&(row, _)| row))
                    .collect();
                rows.sort_unstable();
                rows.dedup();
                let mut request = vec![OP_RUN, layer as u64, width as u64];
                request.extend(encode(activation));
                request.extend([rows.len() as u64, mine.len() as u64]);
                for &i in &mine {
                    let (expert, routed) = assignments[i];
                    request.extend([*expert as u64, routed.len() as u64]);
                    request.extend(
                        routed
                            .iter()
                            .map(|(row, _)| rows.binary_search(row).unwrap_or(0) as u64),
                    );
                }
                let batch: Vec<f32> = rows
                    .iter()
                    .flat_map(|&row| &input[row * width..][..width])
                    .copied()
                    .collect();
                let what = || format!("the rows of MoE layer {layer}");
                self.send_within(rank, TAG_REQUEST, request, what)?;
                self.send_within(rank, TAG_INPUT, batch, what)?;
                let expected = mine
                    .iter()
                    .map(|&i| (i, assignments[i].1.len() * width))
                    .collect();
                self.pending.push((rank, expected));
            }
            Ok(())
        })
    }

    fn receive(&mut self) -> Result<Vec<Vec<f32>>> {
        profile::time(Phase::Exchange, || {
            let mut outputs = vec![Vec::new(); self.sent];
            for (rank, expected) in std::mem::take(&mut self.pending) {
                let layer = self.layer;
                let answer: Vec<f32> =
                    self.receive_within(rank, TAG_OUTPUT, || format!("for MoE layer {layer}"))?;
                let total: usize = expected.iter().map(|&(_, len)| len).sum();
                if answer.len() != total {
                    bail!(
                        "expert rank {rank} answered MoE layer {} with {} values where {total} were asked for; are all ranks running the same coli and model?",
                        self.layer,
                        answer.len()
                    );
                }
                let mut at = 0;
                for (position, len) in expected {
                    outputs[position] = answer[at..at + len].to_vec();
                    at += len;
                }
            }
            Ok(outputs)
        })
    }

    fn place(&mut self, changes: &[(usize, usize, bool)]) -> Result<Vec<bool>> {
        let mut asked: Vec<(Rank, Vec<usize>)> = Vec::new();
        for rank in 1..self.size {
            let mine: Vec<usize> = (0..changes.len())
                .filter(|&i| self.owner(changes[i].0, changes[i].1) == rank)
                .collect();
            if mine.is_empty() {
                continue;
            }
            let mut request = vec![OP_PLACE, mine.len() as u64];
            for &i in &mine {
                let (layer, expert, pin) = changes[i];
                request.extend([layer as u64, expert as u64, u64::from(pin)]);
            }
            self.send_within(rank, TAG_REQUEST, request, || "pins and unpins".into())?;
            asked.push((rank, mine));
        }
        // Every rank loads its share at once; each answer comes as its expert is placed,
        // so MPI_TIMEOUT bounds one expert's read, not the whole placement's.
        let mut placed = vec![false; changes.len()];
        for (rank, mine) in asked {
            for i in mine {
                let (layer, expert, _) = changes[i];
                let answer: Vec<u64> = self.receive_within(rank, TAG_PLACED, || {
                    format!("for the pin of expert {expert} of layer {layer}")
                })?;
                placed[i] = answer.first() == Some(&1);
            }
        }
        // Each layer's pins listed as one store lists them (pins appended in the order
        // asked, an unpin swapping the last into its place), so that the abstain rule and
        // REPIN see the order a single process gives them.
        for (&(layer, expert, pin), &now) in changes.iter().zip(&placed) {
            let held = &mut self.pinned[layer];
            match (held.iter().position(|&e| e == expert), now) {
                (Some(at), false) => {
                    held.swap_remove(at);
                }
                (None, true) => held.push(expert),
                _ => {}
            }
            if pin && !now {
                self.pins_skipped += 1;
            }
        }
        Ok(placed)
    }

    fn seed_heat(&mut self, seeds: &[(usize, usize, u64)]) -> Result<()> {
        for rank in 1..self.size {
            let mine: Vec<u64> = seeds
                .iter()
                .filter(|&&(layer, expert, _)| self.owner(layer, expert) == rank)
                .flat_map(|&(layer, expert, count)| [layer as u64, expert as u64, count])
                .collect();
            if !mine.is_empty() {
                let mut request = vec![OP_SEED, (mine.len() / 3) as u64];
                request.extend(mine);
                self.send_within(rank, TAG_REQUEST, request, || {
                    "the history's heat of its experts".into()
                })?;
            }
        }
        Ok(())
    }

    fn pinned(&self) -> Vec<Vec<usize>> {
        self.pinned.clone()
    }

    fn pins_skipped(&self) -> usize {
        self.pins_skipped
    }

    fn slots(&self) -> (usize, bool) {
        self.slots
    }

    fn stats(&self) -> Result<CacheStats> {
        let mut total = CacheStats::default();
        for (_, _, stats) in self.states()? {
            total.add(&stats);
        }
        Ok(total)
    }
}

impl Drop for Trunk {
    /// The expert ranks stop when the trunk's engine goes, whether the run ended or failed;
    /// after a timeout the abort that follows stops them.
    fn drop(&mut self) {
        if timed_out() {
            return;
        }
        let world = SimpleCommunicator::world();
        for rank in 1..self.size {
            rank_process(&world, rank).send_with_tag(&[OP_STOP][..], TAG_REQUEST);
        }
    }
}

/// An activation as request words: a code, then SiTU's two parameters as f32 bits.
fn encode(activation: Activation) -> [u64; 4] {
    match activation {
        Activation::SwiGlu => [0, 0, 0, 0],
        Activation::Situ(Situ { beta, linear_beta }) => [
            1,
            u64::from(beta.to_bits()),
            u64::from(linear_beta.is_some()),
            u64::from(linear_beta.unwrap_or(0.0).to_bits()),
        ],
    }
}

fn decode(words: &[u64]) -> Result<Activation> {
    let bits = |w: u64| f32::from_bits(w as u32);
    Ok(match words {
        [0, ..] => Activation::SwiGlu,
        [1, beta, has_linear, linear] => Activation::Situ(Situ {
            beta: bits(*beta),
            linear_beta: (*has_linear == 1).then(|| bits(*linear)),
        }),
        _ => bail!("a request from rank 0 names an unknown activation {words:?}"),
    })
}

/// An expert rank: load the model as rank 0 does and keep only its expert store, then
/// compute, pin and describe the experts rank 0 asks for until it says stop. It keeps no
/// history, trace or report of its own.
pub fn serve(
    model: Option<&str>,
    settings: &Settings,
    positionals: Positionals,
    job: &Job,
) -> Result<ExitCode> {
    // A Ctrl-C or SIGTERM reaches every rank; only the trunk acts on it (it ends the run
    // between tokens and saves), and this rank answers until the trunk says stop.
    crate::interrupt::install(crate::interrupt::Stopping::Run);
    let (snapshot, name) = startup::open(model, settings)?;
    let engine = startup::load_for(settings, positionals, &snapshot, name, false)?.engine;
    // Only the store answers requests: the trunk's weights go before any expert is read,
    // and the store's budget was sized without them.
    let placeholder = ExpertStore::new(Vec::new(), 1, Width::F32);
    let mut store = std::mem::replace(&mut engine.routed().store, placeholder);
    drop(engine);
    let world = SimpleCommunicator::world();
    let root = world.process_at_rank(0);
    loop {
        let (request, _) = root.receive_vec_with_tag::<u64>(TAG_REQUEST);
        match request.first() {
            Some(&OP_STOP) => return Ok(ExitCode::SUCCESS),
            Some(&OP_RUN) => {}
            Some(&OP_PLACE) => {
                for [layer, expert, pin] in triples(&request, job.rank)? {
                    let (layer, expert) = (layer as usize, expert as usize);
                    if pin == 1 {
                        store.pin(layer, expert)?;
                    } else {
                        store.unpin(layer, expert);
                    }
                    let now = u64::from(store.is_pinned(layer, expert));
                    root.send_with_tag(&[now][..], TAG_PLACED);
                }
                continue;
            }
            Some(&OP_SEED) => {
                for [layer, expert, count] in triples(&request, job.rank)? {
                    store.seed_heat(layer as usize, expert as usize, count);
                }
                continue;
            }
            Some(&OP_STATE) => {
                let mut answer = vec![store.capacity() as u64, u64::from(store.streams())];
                answer.extend(store.stats().to_words());
                root.send_with_tag(&answer[..], TAG_STATE);
                continue;
            }
            _ => bail!("rank {}: a request it cannot read: {request:?}", job.rank),
        }
        let (input, _) = root.receive_vec_with_tag::<f32>(TAG_INPUT);
        let (layer, width, activation, assignments) =
            parse(&request).with_context(|| format!("rank {}: request {request:?}", job.rank))?;
        let rows = input.len() / width.max(1);
        if assignments
            .iter()
            .flat_map(|(_, routed)| routed)
            .any(|&(row, _)| row >= rows)
        {
            bail!("rank {}: a request names a row beyond its {rows}", job.rank);
        }
        let refs: Vec<&Assignment> = assignments.iter().collect();
        let outputs = host_outputs(&mut store, layer, &input, &refs, width, activation)?;
        // Experts this rank computed from a shard that changed are not the model's.
        crate::snapshot::guard::check().with_context(|| format!("rank {}", job.rank))?;
        root.send_with_tag(&outputs.concat()[..], TAG_OUTPUT);
    }
}

/// The `n` triples of `[op, n, triples...]`.
fn triples(request: &[u64], rank: Rank) -> Result<Vec<[u64; 3]>> {
    let n = request.get(1).copied().unwrap_or(0) as usize;
    let body = request.get(2..).unwrap_or(&[]);
    if body.len() != 3 * n {
        bail!(
            "rank {rank}: a request of {n} changes holds {} words: {request:?}",
            body.len()
        );
    }
    Ok(body.chunks_exact(3).map(|w| [w[0], w[1], w[2]]).collect())
}

type Request = (usize, usize, Activation, Vec<Assignment>);

/// `[OP_RUN, layer, width, activation x4, union rows, experts, (expert, n, rows...)...]`.
fn parse(request: &[u64]) -> Result<Request> {
    let word = |i: usize| -> Result<usize> {
        request
            .get(i)
            .map(|&w| w as usize)
            .context("the request ends early")
    };
    let (layer, width) = (word(1)?, word(2)?);
    let activation = decode(request.get(3..7).context("the request ends early")?)?;
    let experts = word(8)?;
    let mut at = 9;
    let mut assignments = Vec::with_capacity(experts.min(4096));
    for _ in 0..experts {
        let (expert, count) = (word(at)?, word(at + 1)?);
        at += 2;
        let rows = (0..count)
            .map(|k| word(at + k).map(|row| (row, 0.0)))
            .collect::<Result<Vec<_>>>()?;
        at += count;
        assignments.push((expert, rows));
    }
    Ok((layer, width, activation, assignments))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_balances_heat_and_deals_evenly_without_it() {
        let even = plan(Sharding::Expert, 3, &[4], |_, _| 0);
        assert_eq!(even, vec![vec![1, 2, 1, 2]]);
        // Expert 0 is as hot as the other three together.
        let hot = plan(Sharding::Expert, 3, &[4], |_, e| [30, 10, 10, 10][e]);
        assert_eq!(hot, vec![vec![1, 2, 2, 2]]);
        let layers = plan(Sharding::Layer, 3, &[2, 2, 2], |_, _| 0);
        assert_eq!(layers, vec![vec![1, 1], vec![2, 2], vec![1, 1]]);
    }

    #[test]
    fn requests_round_trip() {
        let situ = Activation::Situ(Situ {
            beta: 1.5,
            linear_beta: Some(0.25),
        });
        for activation in [Activation::SwiGlu, situ] {
            let mut request = vec![OP_RUN, 3, 64];
            request.extend(encode(activation));
            request.extend([2, 1, 7, 2, 0, 1]);
            let (layer, width, decoded, assignments) = parse(&request).unwrap();
            assert_eq!((layer, width), (3, 64));
            assert_eq!(format!("{decoded:?}"), format!("{activation:?}"));
            assert_eq!(assignments, vec![(7, vec![(0, 0.0), (1, 0.0)])]);
        }
        assert!(parse(&[OP_RUN, 3]).is_err());
    }
}
