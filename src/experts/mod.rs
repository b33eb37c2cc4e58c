//! The expert store: for every MoE layer, `CAP` expert slots filled on a miss and evicted
//! by the eviction policy (`COLI_POLICY`: LRU, or LFRU), a pinned set, hit/miss/byte
//! counters, and how experts come into memory.
//!
//! Two ways in (`EXPERT_IO`): when every expert fits the memory budget (or `mmap` is
//! asked for), a slot is a zero-copy view into the mapped shard and the kernel pages it
//! in; otherwise experts *stream*: each slot is a buffer the store owns, read from the
//! shard by a pool of loader threads ([`io`]: one read per contiguous run of the expert's
//! bytes, direct I/O where the file system takes it), so what is resident is exactly what
//! the slots and pins hold, within the budget ([`budget`]), and a miss is a read from
//! disk. A layer's misses are read in parallel; [`ExpertStore::prefetch`] reads experts
//! the router lookahead predicts into a small staging area ahead of their layer: a
//! staged expert that its layer then asks for moves into a slot as a miss would, without
//! the read, and one it does not ask for is dropped, so a wrong prediction costs a read
//! but never displaces a slot (the slots see exactly the lookups they would without it).
//!
//! It owns where experts live in memory and what loading one costs; it does not decide
//! which experts a token uses (the engine's router and lookahead do) and it does not
//! compute with them (the engine runs the FFN on the weights it is handed). No lookup,
//! eviction or read-ahead changes an expert's weights, so none can change a token.

pub mod budget;
pub mod io;
pub mod tier;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::quant::{Matrix, Width};
use crate::snapshot::{Dtype, Snapshot, TensorView};
pub use budget::Budget;
use io::{Files, Loaded, Loader, ReadPlan};

/// The tensors of one expert's SwiGLU FFN in the snapshot: gate and up `[inter, hidden]`,
/// down `[hidden, inter]`.
#[derive(Clone)]
pub struct ExpertTensors {
    pub gate: TensorView,
    pub up: TensorView,
    pub down: TensorView,
}

impl ExpertTensors {
    /// Expert `expert` of the fused transformers 5 layout: `gate_up [E, 2I, D]` with the
    /// gate rows first, and `down [E, D, I]`.
    pub fn from_fused(
        gate_up: &TensorView,
        down: &TensorView,
        expert: usize,
    ) -> Result<ExpertTensors> {
        let pair = gate_up.select(expert)?;
        Ok(ExpertTensors {
            gate: pair.part(0, 2)?,
            up: pair.part(1, 2)?,
            down: down.select(expert)?,
        })
    }

    /// Expert `expert` under `prefix` as Hugging Face publishes one matrix per expert:
    /// `{prefix}.{expert}.gate_proj.weight`, `up_proj` and `down_proj`.
    pub fn published(snapshot: &Snapshot, prefix: &str, expert: usize) -> Result<ExpertTensors> {
        let tensor = |part: &str| snapshot.tensor(&format!("{prefix}.{expert}.{part}.weight"));
        Ok(ExpertTensors {
            gate: tensor("gate_proj")?,
            up: tensor("up_proj")?,
            down: tensor("down_proj")?,
        })
    }

    /// Check the three shapes against the configuration.
    pub fn checked(self, hidden: usize, inter: usize) -> Result<ExpertTensors> {
        // A pre-quantised expert is checked by its byte counts and takes the logical shape.
        let shaped = crate::quant::format::shaped;
        Ok(ExpertTensors {
            gate: shaped(self.gate, &[inter, hidden])?,
            up: shaped(self.up, &[inter, hidden])?,
            down: shaped(self.down, &[hidden, inter])?,
        })
    }

    /// The three matrices and their scale tensors.
    fn views(&self) -> impl Iterator<Item = &TensorView> {
        [&self.gate, &self.up, &self.down]
            .into_iter()
            .flat_map(|view| std::iter::once(view).chain(view.scales.as_deref()))
    }

    fn source_bytes(&self) -> usize {
        self.views().map(|view| view.bytes.len()).sum()
    }

    /// Whether loading at `width` converts a float tensor into another format (so the
    /// slot holds the converted copy, not the bytes read).
    fn converts(&self, width: Width) -> bool {
        width != Width::F32
            && [&self.gate, &self.up, &self.down].iter().any(|view| {
                view.scales.is_none() && matches!(view.dtype, Dtype::F32 | Dtype::BF16 | Dtype::F16)
            })
    }
}

/// An expert's weights in the compute format.
pub struct Expert {
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

impl Expert {
    fn load(tensors: &ExpertTensors, width: Width) -> Result<Expert> {
        Ok(Expert {
            gate: Matrix::load(&tensors.gate, width)?.host_only(),
            up: Matrix::load(&tensors.up, width)?.host_only(),
            down: Matrix::load(&tensors.down, width)?.host_only(),
        })
    }

    pub fn size_bytes(&self) -> usize {
        self.gate.size_bytes() + self.up.size_bytes() + self.down.size_bytes()
    }
}

/// The share of its predictions the lookahead must get right for its reads to be issued:
/// below it a wrong read-ahead (bandwidth taken from the misses) costs more than a right
/// one saves (a wait).
pub const MIN_PRECISION: f64 = 0.5;

/// How slowly the running precision follows each layer's sample.
const PRECISION_KEEP: f64 = 0.95;

/// Which slot a miss replaces when the layer is full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The least recently used slot.
    Lru,
    /// Frequency first: the lowest `(heat << 8) | recent`, where heat counts the expert's
    /// selections in the history plus its lookups in this run and `recent = 255 - age`
    /// (age in lookups of the layer, 0 beyond 255); ties to the least recently used. The
    /// rule `coli trace simulate --policy lfru` replays.
    Lfru,
}

impl Policy {
    pub fn from_setting(value: &str) -> Result<Policy> {
        match value {
            "lru" => Ok(Policy::Lru),
            "lfru" => Ok(Policy::Lfru),
            other => bail!("setting COLI_POLICY={other}: expected lru or lfru"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Lfru => "lfru",
        }
    }
}

/// How experts come into memory (`EXPERT_IO`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertIo {
    /// Mapped when every expert fits the budget, streamed when not.
    Auto,
    /// Views into the shard mapping; the kernel's page cache decides what is resident.
    Mmap,
    /// Streamed into owned slots with buffered reads (pages dropped after each).
    Pread,
    /// Streamed into owned slots with `O_DIRECT`.
    Direct,
}

impl ExpertIo {
    pub fn from_setting(value: &str) -> Result<ExpertIo> {
        match value {
            "auto" => Ok(ExpertIo::Auto),
            "mmap" => Ok(ExpertIo::Mmap),
            "pread" => Ok(ExpertIo::Pread),
            "direct" => Ok(ExpertIo::Direct),
            other => bail!("setting EXPERT_IO={other}: expected auto, mmap, pread or direct"),
        }
    }
}

/// How the routed experts are spread over the expert ranks of an MPI job
/// (`EXPERT_SHARDING`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Each MoE layer's experts over every rank, balanced by the history's heat.
    Expert,
    /// Whole MoE layers, round robin.
    Layer,
}

impl Sharding {
    pub fn from_setting(value: &str) -> Result<Sharding> {
        match value {
            "expert" => Ok(Sharding::Expert),
            "layer" => Ok(Sharding::Layer),
            other => bail!("setting EXPERT_SHARDING={other}: expected expert or layer"),
        }
    }
}

/// How the store is sized and fed.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Slots per MoE layer; 0 sizes them from the budget.
    pub cap: usize,
    /// Width of routed experts stored in float.
    pub width: Width,
    pub budget: Budget,
    pub io: ExpertIo,
    /// `DIRECT`: `None` takes direct I/O where the file system accepts it.
    pub direct: Option<bool>,
    pub io_threads: usize,
    pub policy: Policy,
    /// `PILOT`: MoE layers the router lookahead reads ahead.
    pub pilot: usize,
    /// Whether the trunk's weights stay resident beside the store, so that the budget must
    /// hold them: not on an MPI expert rank, which drops them once loaded.
    pub keeps_trunk: bool,
}

impl StoreOptions {
    /// Mapped experts, `cap` slots, LRU, no lookahead: the oracle setting of tests.
    pub fn mapped(cap: usize, width: Width) -> StoreOptions {
        StoreOptions {
            cap,
            width,
            budget: Budget::fixed(1 << 30),
            io: ExpertIo::Mmap,
            direct: None,
            io_threads: 1,
            policy: Policy::Lru,
            pilot: 0,
            keeps_trunk: true,
        }
    }
}

/// Counters of the whole store. Hits and misses count each distinct expert a layer needs in
/// one forward once, however many rows of the batch route to it. A lookup answered by an
/// expert read ahead is a hit (and a useful read-ahead); a miss is a read on demand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered by the GPU's expert tier (counted by the MoE pass, not the store).
    pub vram_hits: u64,
    pub pin_hits: u64,
    pub lru_hits: u64,
    pub misses: u64,
    /// Bytes of expert tensors loaded (on demand, ahead and for pins).
    pub bytes_loaded: u64,
    /// Bytes the store read from the shard files (ranges rounded for direct I/O); 0 when
    /// experts are mapped and the kernel reads them.
    pub bytes_read: u64,
    /// Experts read ahead by the lookahead; of those, later used and evicted unused.
    pub ahead_reads: u64,
    pub ahead_useful: u64,
    pub ahead_wasted: u64,
    /// Time the loader threads spent reading experts, and the compute thread waiting.
    pub read_nanos: u64,
    pub wait_nanos: u64,
    /// Experts the lookahead predicted that were not resident (read ahead or not), and of
    /// those, taken by their layer.
    pub predicted: u64,
    pub predicted_right: u64,
    /// Recall: the experts layers with a prediction took (resident or not), and of those,
    /// the ones predicted.
    pub foreseeable: u64,
    pub foreseen: u64,
}

impl CacheStats {
    /// Hit rate in percent; 0 before any lookup.
    pub fn hit_rate(&self) -> f64 {
        let hits = self.vram_hits + self.pin_hits + self.lru_hits;
        let total = hits + self.misses;
        if total == 0 {
            0.0
        } else {
            100.0 * hits as f64 / total as f64
        }
    }

    /// `self - earlier`, counter by counter (a window of a run, e.g. REPLAY's timed pass).
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            vram_hits: self.vram_hits - earlier.vram_hits,
            pin_hits: self.pin_hits - earlier.pin_hits,
            lru_hits: self.lru_hits - earlier.lru_hits,
            misses: self.misses - earlier.misses,
            bytes_loaded: self.bytes_loaded - earlier.bytes_loaded,
            bytes_read: self.bytes_read - earlier.bytes_read,
            ahead_reads: self.ahead_reads - earlier.ahead_reads,
            ahead_useful: self.ahead_useful - earlier.ahead_useful,
            ahead_wasted: self.ahead_wasted - earlier.ahead_wasted,
            read_nanos: self.read_nanos - earlier.read_nanos,
            wait_nanos: self.wait_nanos - earlier.wait_nanos,
            predicted: self.predicted - earlier.predicted,
            predicted_right: self.predicted_right - earlier.predicted_right,
            foreseeable: self.foreseeable - earlier.foreseeable,
            foreseen: self.foreseen - earlier.foreseen,
        }
    }

    /// Every counter, in declaration order (what an expert rank sends the trunk).
    pub fn to_words(&self) -> [u64; 15] {
        [
            self.vram_hits,
            self.pin_hits,
            self.lru_hits,
            self.misses,
            self.bytes_loaded,
            self.bytes_read,
            self.ahead_reads,
            self.ahead_useful,
            self.ahead_wasted,
            self.read_nanos,
            self.wait_nanos,
            self.predicted,
            self.predicted_right,
            self.foreseeable,
            self.foreseen,
        ]
    }

    /// The counters [`CacheStats::to_words`] gave.
    pub fn from_words(w: [u64; 15]) -> CacheStats {
        CacheStats {
            vram_hits: w[0],
            pin_hits: w[1],
            lru_hits: w[2],
            misses: w[3],
            bytes_loaded: w[4],
            bytes_read: w[5],
            ahead_reads: w[6],
            ahead_useful: w[7],
            ahead_wasted: w[8],
            read_nanos: w[9],
            wait_nanos: w[10],
            predicted: w[11],
            predicted_right: w[12],
            foreseeable: w[13],
            foreseen: w[14],
        }
    }

    /// Add `other`'s counters to these (the stores of several processes).
    pub fn add(&mut self, other: &CacheStats) {
        let mut sum = self.to_words();
        for (s, o) in sum.iter_mut().zip(other.to_words()) {
            *s += o;
        }
        *self = CacheStats::from_words(sum);
    }
}

enum State {
    Ready(Loaded),
    /// A loader thread is reading it.
    Loading,
}

struct Slot {
    expert: usize,
    /// The layer's lookup clock at its last use.
    last_used: u64,
    state: State,
}

impl Slot {
    fn weights(&self) -> Option<&Expert> {
        match &self.state {
            State::Ready(loaded) => Some(&loaded.weights),
            State::Loading => None,
        }
    }
}

struct LayerCache {
    tensors: Vec<ExpertTensors>,
    /// Experts placed by the pin plan: loaded once, never evicted.
    pinned: Vec<(usize, Loaded)>,
    slots: Vec<Slot>,
    /// Lookups of this layer so far (LFRU ages are counted in them).
    clock: u64,
    /// LFRU: selections from the history plus lookups in this run, per expert.
    heat: Vec<u64>,
}

impl LayerCache {
    fn new(tensors: Vec<ExpertTensors>) -> LayerCache {
        LayerCache {
            heat: vec![0; tensors.len()],
            tensors,
            pinned: Vec::new(),
            slots: Vec::new(),
            clock: 0,
        }
    }

    fn is_pinned(&self, expert: usize) -> bool {
        self.pinned.iter().any(|(e, _)| *e == expert)
    }

    fn slot(&self, expert: usize) -> Option<usize> {
        self.slots.iter().position(|s| s.expert == expert)
    }

    /// The slot `policy` replaces among those `eligible` allows.
    fn victim(&self, policy: Policy, eligible: impl Fn(&Slot) -> bool) -> Option<usize> {
        let now = self.clock;
        let key = |slot: &Slot| match policy {
            Policy::Lru => (0, slot.last_used),
            Policy::Lfru => {
                let recent = 255u64.saturating_sub(now - slot.last_used);
                let heat = self.heat.get(slot.expert).copied().unwrap_or(0);
                (heat << 8 | recent, slot.last_used)
            }
        };
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, slot)| eligible(slot))
            .min_by_key(|(_, slot)| key(slot))
            .map(|(i, _)| i)
    }
}

/// Experts that stream: the loader pool and each expert's read plan.
struct Stream {
    loader: Loader,
    plans: Vec<Vec<Arc<ReadPlan>>>,
}

/// The expert caches of every MoE layer.
pub struct ExpertStore {
    /// Slots per layer; when streaming, pins take slots from it.
    capacity: usize,
    width: Width,
    policy: Policy,
    pilot: usize,
    layers: Vec<LayerCache>,
    stats: CacheStats,
    stream: Option<Stream>,
    /// Pins refused because their layer had no slot to give.
    pins_skipped: usize,
    /// Experts read ahead, not yet asked for: `(layer, expert, state)`.
    staged: Vec<(usize, usize, State)>,
    /// How many experts may be staged at once.
    stage_limit: usize,
    /// Read-aheads the lookahead asked for, queued by the next call behind its own misses.
    wanted: Vec<(usize, Vec<usize>)>,
    /// Per layer: the experts predicted for its coming pass, and those the pass took.
    predicted: Vec<Vec<usize>>,
    taken: Vec<usize>,
    /// Per layer: every expert predicted for its coming pass, resident or not (recall).
    foreseen: Vec<Vec<usize>>,
    /// Running share of predicted experts their layer then took; read-ahead is issued
    /// only while it is at least [`MIN_PRECISION`] (starting at 0: it abstains until its
    /// predictions have proved right).
    precision: f64,
    /// The staging area the lookahead asked for, and the slots per layer beside it; the
    /// slots per layer without it.
    stage_size: usize,
    staged_capacity: usize,
    full_capacity: usize,
    /// What provisioning found: bytes for slots, bytes of one slot, MoE layers.
    room: (u64, u64, u64),
    /// The startup line: budget, slots, how experts are read.
    summary: String,
}

impl ExpertStore {
    /// Mapped experts: `layers[l][e]` are the tensors of expert `e` in MoE layer `l`;
    /// `capacity` slots per layer (at least 1), LRU.
    pub fn new(layers: Vec<Vec<ExpertTensors>>, capacity: usize, width: Width) -> ExpertStore {
        ExpertStore {
            capacity: capacity.max(1),
            width,
            policy: Policy::Lru,
            pilot: 0,
            layers: layers.into_iter().map(LayerCache::new).collect(),
            stats: CacheStats::default(),
            stream: None,
            pins_skipped: 0,
            staged: Vec::new(),
            stage_limit: 0,
            wanted: Vec::new(),
            predicted: Vec::new(),
            taken: Vec::new(),
            foreseen: Vec::new(),
            precision: 0.0,
            stage_size: 0,
            staged_capacity: 1,
            full_capacity: 1,
            room: (0, 0, 0),
            summary: String::new(),
        }
    }

    /// Number of layers the store was built with.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// `PILOT`: how many MoE layers ahead the router lookahead reads (0 when experts are
    /// mapped: there is nothing to read).
    pub fn pilot(&self) -> usize {
        if self.stream.is_some() {
            self.pilot
        } else {
            0
        }
    }

    /// Whether experts stream into owned slots.
    pub fn streams(&self) -> bool {
        self.stream.is_some()
    }

    /// The startup line: the budget and where it came from, the slots, how experts are read.
    pub fn summary(&self) -> &str {
        &self.summary
    }

    /// Pins refused so far because their layer had no slot left for the LRU.
    pub fn pins_skipped(&self) -> usize {
        self.pins_skipped
    }

    /// Experts read ahead that are still waiting for their layer.
    pub fn ahead_unused(&self) -> u64 {
        self.staged.len() as u64
    }

    /// Let the lookahead stage up to `experts` experts at once (its depth times the
    /// experts a row routes to). Their memory comes from the slots, but only while the
    /// read-ahead is on (its predictions mostly right): then each layer has
    /// `staged_capacity` slots, else all of them.
    pub fn set_stage(&mut self, experts: usize) {
        let (free, slot_bytes, moe_layers) = self.room;
        // What one slot per layer leaves; a layer's pass always needs its slot.
        let spare = free.saturating_sub(moe_layers * slot_bytes) / slot_bytes.max(1);
        let experts = experts.min(spare as usize);
        if self.stream.is_none() || experts <= self.stage_size {
            return;
        }
        self.stage_size = experts;
        let staging = experts as u64 * slot_bytes;
        let fits = (free.saturating_sub(staging) / (moe_layers * slot_bytes).max(1)) as usize;
        self.staged_capacity = fits.clamp(1, self.full_capacity);
        self.summary = format!(
            "{} | read-ahead stages up to {experts} experts ({:.1} MB, {} slots/layer) while its predictions are right",
            self.summary,
            staging as f64 / 1e6,
            self.staged_capacity
        );
    }

    /// Turn the read-ahead on or off by its running precision: on, it stages and the slots
    /// give up its room; off, what is staged is dropped and the slots get the room back.
    fn gate_read_ahead(&mut self) {
        let open = self.stage_size > 0 && self.precision >= MIN_PRECISION;
        if open == (self.stage_limit > 0) {
            return;
        }
        if open {
            self.stage_limit = self.stage_size;
            self.capacity = self.staged_capacity;
        } else {
            self.stage_limit = 0;
            self.capacity = self.full_capacity;
            for layer in 0..self.layers.len() {
                self.drop_staged(layer);
            }
        }
    }

    /// Give up the slots of layer `layer` above its capacity (after a pin or the read-ahead
    /// took room), the policy choosing; called outside a pass, when none of them is in use.
    fn fit_capacity(&mut self, layer: usize) {
        while self.layers[layer].slots.len() > self.lru_capacity(layer) {
            let cache = &mut self.layers[layer];
            let Some(index) = cache.victim(self.policy, |s| matches!(s.state, State::Ready(_)))
            else {
                return;
            };
            let old = cache.slots.swap_remove(index);
            self.release(old.state);
        }
    }

    /// Add `count` history selections to expert `expert` of layer `layer` (LFRU's heat).
    pub fn seed_heat(&mut self, layer: usize, expert: usize, count: u64) {
        if let Some(heat) = self
            .layers
            .get_mut(layer)
            .and_then(|cache| cache.heat.get_mut(expert))
        {
            *heat += count;
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// Slots the LRU part of layer `layer` may use: every slot for mapped experts (pins are
    /// views and cost nothing); what the pins leave, at least one, when streaming.
    fn lru_capacity(&self, layer: usize) -> usize {
        match (&self.stream, self.layers.get(layer)) {
            (Some(_), Some(cache)) => self.capacity.saturating_sub(cache.pinned.len()).max(1),
            _ => self.capacity,
        }
    }

    fn tensors(&self, layer: usize, expert: usize) -> Result<&ExpertTensors> {
        let Some(cache) = self.layers.get(layer) else {
            bail!(
                "MoE layer {layer} does not exist ({} layers)",
                self.layers.len()
            );
        };
        match cache.tensors.get(expert) {
            Some(tensors) => Ok(tensors),
            None => bail!(
                "expert {expert} of MoE layer {layer} does not exist ({} experts)",
                cache.tensors.len()
            ),
        }
    }

    /// Load an expert now, on this thread.
    fn load_now(&mut self, layer: usize, expert: usize) -> Result<Loaded> {
        self.stats.bytes_loaded += self.tensors(layer, expert)?.source_bytes() as u64;
        let tensors = &self.layers[layer].tensors[expert];
        match &self.stream {
            None => Ok(Loaded {
                weights: Box::new(Expert::load(tensors, self.width)?),
                buffer: None,
            }),
            Some(stream) => {
                let plan = &stream.plans[layer][expert];
                let started = Instant::now();
                let loaded = stream.loader.load_now(tensors, plan)?;
                self.stats.read_nanos += started.elapsed().as_nanos() as u64;
                self.stats.bytes_read += plan.read_bytes();
                Ok(loaded)
            }
        }
    }

    /// Drop an expert taken out of a slot, the pins or the staging area, recycling its
    /// buffer (a read still under way is recycled when it finishes and finds no place).
    fn release(&mut self, state: State) {
        if let (State::Ready(loaded), Some(stream)) = (state, &self.stream) {
            stream.loader.recycle(loaded);
        }
    }

    /// Drop what was staged for layer `layer` and not asked for.
    fn drop_staged(&mut self, layer: usize) {
        let (unused, kept) = std::mem::take(&mut self.staged)
            .into_iter()
            .partition(|(l, _, _)| *l == layer);
        self.staged = kept;
        for (l, e, state) in unused {
            self.stats.ahead_wasted += 1;
            if let (State::Loading, Some(stream)) = (&state, &self.stream) {
                // Not begun: no read, and nothing will come back for it.
                stream.loader.cancel(l, e);
            }
            self.release(state);
        }
    }

    /// The end of layer `layer`'s expert pass: what was staged for it and not asked for
    /// is dropped, which makes room for the read-ahead the lookahead asked for since.
    pub fn finish_layer(&mut self, layer: usize) -> Result<()> {
        self.drop_staged(layer);
        self.score_prediction(layer);
        self.gate_read_ahead();
        for (ahead, ids) in std::mem::take(&mut self.wanted) {
            self.prefetch(ahead, &ids)?;
        }
        Ok(())
    }

    /// Compare what was predicted for layer `layer` (the experts a read-ahead would have
    /// read: those not resident when predicted) with what its pass took, whether or not it
    /// was read ahead, so that read-ahead stops while it would mostly read in vain (routing
    /// without locality) and resumes when its predictions come right again.
    fn score_prediction(&mut self, layer: usize) {
        let mut taken = std::mem::take(&mut self.taken);
        taken.sort_unstable();
        taken.dedup();
        if let Some(foreseen) = self.foreseen.get_mut(layer) {
            if !foreseen.is_empty() {
                self.stats.foreseeable += taken.len() as u64;
                self.stats.foreseen += taken.iter().filter(|e| foreseen.contains(e)).count() as u64;
                foreseen.clear();
            }
        }
        let Some(predicted) = self.predicted.get_mut(layer) else {
            return;
        };
        let mut predicted = std::mem::take(predicted);
        predicted.sort_unstable();
        predicted.dedup();
        if predicted.is_empty() {
            return;
        }
        let right = predicted.iter().filter(|e| taken.contains(e)).count();
        self.stats.predicted += predicted.len() as u64;
        self.stats.predicted_right += right as u64;
        let sample = right as f64 / predicted.len() as f64;
        self.precision = PRECISION_KEEP * self.precision + (1.0 - PRECISION_KEEP) * sample;
    }

    /// Put `slot` into layer `layer`: into a free slot, else in place of the one the
    /// policy picks among those `eligible` allows.
    fn place(&mut self, layer: usize, slot: Slot, eligible: impl Fn(&Slot) -> bool) {
        let limit = self.lru_capacity(layer);
        let cache = &mut self.layers[layer];
        if cache.slots.len() < limit {
            cache.slots.push(slot);
            return;
        }
        match cache.victim(self.policy, eligible) {
            Some(index) => {
                let old = std::mem::replace(&mut cache.slots[index], slot);
                self.release(old.state);
            }
            // Unreachable while a call takes no more experts than there are slots; holding
            // one more expert is better than failing the token.
            None => cache.slots.push(slot),
        }
    }

    /// File a finished read into its slot (or its place in the staging area). A failed
    /// read is an error for the layer waiting on it; a failed read-ahead still staged only
    /// frees its place (the demand read will say what is wrong).
    fn file(&mut self, done: io::Done) -> Result<()> {
        self.stats.read_nanos += done.service.as_nanos() as u64;
        let cache = &mut self.layers[done.layer];
        let slot = cache
            .slots
            .iter()
            .position(|s| s.expert == done.expert && matches!(s.state, State::Loading));
        let staged = self.staged.iter().position(|(l, e, state)| {
            *l == done.layer && *e == done.expert && matches!(state, State::Loading)
        });
        match (slot, staged, done.result) {
            (Some(index), _, Ok(loaded)) => cache.slots[index].state = State::Ready(loaded),
            (Some(index), _, Err(err)) => {
                cache.slots.swap_remove(index);
                return Err(err);
            }
            (None, Some(index), Ok(loaded)) => self.staged[index].2 = State::Ready(loaded),
            (None, Some(index), Err(_)) => {
                self.staged.swap_remove(index);
                self.stats.ahead_wasted += 1;
            }
            // Replaced or dropped while it was being read.
            (None, None, Ok(loaded)) => self.release(State::Ready(loaded)),
            (None, None, Err(_)) => {}
        }
        Ok(())
    }

    /// File every read that has finished, without waiting.
    fn collect_finished(&mut self) -> Result<()> {
        while let Some(done) = self.stream.as_ref().and_then(|s| s.loader.poll()) {
            self.file(done)?;
        }
        Ok(())
    }

    /// Wait until none of `experts` of layer `layer` is still being read.
    fn settle(&mut self, layer: usize, experts: &[usize]) -> Result<()> {
        loop {
            let cache = &self.layers[layer];
            let pending = experts.iter().any(|&e| {
                cache
                    .slots
                    .iter()
                    .any(|s| s.expert == e && matches!(s.state, State::Loading))
            });
            if !pending {
                return Ok(());
            }
            let Some(stream) = &self.stream else {
                return Ok(());
            };
            let started = Instant::now();
            let done = stream.loader.wait()?;
            self.stats.wait_nanos += started.elapsed().as_nanos() as u64;
            self.file(done)?;
        }
    }

    /// One lookup of a call that began at layer clock `call_start`: a hit refreshes the
    /// slot; a miss takes a free slot or replaces one not used by this call, and is read
    /// (mapped: now; streaming: queued for the loader pool).
    fn lookup(&mut self, layer: usize, expert: usize, call_start: u64) -> Result<()> {
        self.tensors(layer, expert)?;
        self.taken.push(expert);
        let cache = &mut self.layers[layer];
        cache.clock += 1;
        let now = cache.clock;
        cache.heat[expert] += 1;
        if cache.is_pinned(expert) {
            self.stats.pin_hits += 1;
            return Ok(());
        }
        if let Some(index) = cache.slot(expert) {
            cache.slots[index].last_used = now;
            self.stats.lru_hits += 1;
            return Ok(());
        }
        let staged = self
            .staged
            .iter()
            .position(|(l, e, _)| *l == layer && *e == expert);
        let state = match (&self.stream, staged) {
            // Read ahead: a hit, taking its slot as a miss would.
            (stream, Some(index)) => {
                self.stats.lru_hits += 1;
                self.stats.ahead_useful += 1;
                let (_, _, state) = self.staged.swap_remove(index);
                if let (State::Loading, Some(stream)) = (&state, stream) {
                    stream.loader.promote(layer, expert);
                }
                state
            }
            (None, None) => {
                self.stats.misses += 1;
                State::Ready(self.load_now(layer, expert)?)
            }
            (Some(stream), None) => {
                self.stats.misses += 1;
                let tensors = &self.layers[layer].tensors[expert];
                let plan = &stream.plans[layer][expert];
                stream.loader.submit(layer, expert, tensors, plan, false);
                self.stats.bytes_loaded += tensors.source_bytes() as u64;
                self.stats.bytes_read += plan.read_bytes();
                State::Loading
            }
        };
        let slot = Slot {
            expert,
            last_used: now,
            state,
        };
        self.place(layer, slot, |s| s.last_used < call_start);
        Ok(())
    }

    /// Whether expert `expert` of MoE layer `layer` is pinned or in a slot now.
    pub fn is_resident(&self, layer: usize, expert: usize) -> bool {
        self.layers.get(layer).is_some() && self.resident(layer, expert).is_some()
    }

    /// The weights of a resident expert.
    fn resident(&self, layer: usize, expert: usize) -> Option<&Expert> {
        let cache = &self.layers[layer];
        cache
            .pinned
            .iter()
            .find(|(e, _)| *e == expert)
            .map(|(_, loaded)| loaded.weights.as_ref())
            .or_else(|| cache.slots.iter().find(|s| s.expert == expert)?.weights())
    }

    /// Run `compute` with all of `experts` (distinct ids) of MoE layer `layer` at once.
    /// They are looked up in order (counted, and slots replaced, exactly as that sequence
    /// of [`ExpertStore::with_expert`] calls would, except that no expert this call took is
    /// replaced for a later one), their misses read in parallel, then computed. `None`
    /// (nothing loaded, nothing counted) when the layer's slots cannot hold every one that
    /// is not pinned: the caller then takes them one at a time.
    pub fn with_experts<R>(
        &mut self,
        layer: usize,
        experts: &[usize],
        compute: impl FnOnce(&[&Expert]) -> R,
    ) -> Result<Option<R>> {
        self.take(layer, experts, true, compute)
    }

    /// [`ExpertStore::with_experts`]; `whole_layer` when these are all the experts the
    /// layer's pass takes from the store, so that it ends the layer
    /// ([`ExpertStore::finish_layer`]) once its misses are queued.
    fn take<R>(
        &mut self,
        layer: usize,
        experts: &[usize],
        whole_layer: bool,
        compute: impl FnOnce(&[&Expert]) -> R,
    ) -> Result<Option<R>> {
        let Some(cache) = self.layers.get(layer) else {
            bail!(
                "MoE layer {layer} does not exist ({} layers)",
                self.layers.len()
            );
        };
        let unpinned = experts.iter().filter(|&&e| !cache.is_pinned(e)).count();
        if unpinned > self.lru_capacity(layer) {
            return Ok(None);
        }
        self.collect_finished()?;
        self.fit_capacity(layer);
        let call_start = self.layers[layer].clock + 1;
        for &expert in experts {
            self.lookup(layer, expert, call_start)?;
        }
        // This layer's misses are queued first: the next layers' read-ahead is read
        // behind them, while this layer computes.
        if whole_layer {
            self.finish_layer(layer)?;
        }
        self.settle(layer, experts)?;
        let weights: Vec<&Expert> = experts
            .iter()
            .map(|&expert| {
                self.resident(layer, expert)
                    .expect("every requested expert was just made resident")
            })
            .collect();
        Ok(Some(compute(&weights)))
    }

    /// Run `compute` with expert `expert` of MoE layer `layer`, loading it on a miss into a
    /// free slot or in place of the one the policy picks; so a batch may use more distinct
    /// experts than there are slots, one after another (then the caller ends the layer
    /// with [`ExpertStore::finish_layer`]).
    pub fn with_expert<R>(
        &mut self,
        layer: usize,
        expert: usize,
        compute: impl FnOnce(&Expert) -> R,
    ) -> Result<R> {
        let result = self.take(layer, &[expert], false, |weights| compute(weights[0]))?;
        Ok(result.expect("one expert always fits: every layer keeps a slot"))
    }

    /// Ask for `experts` of layer `layer` to be read ahead, once the next call has queued
    /// its own misses (see [`ExpertStore::prefetch`]).
    pub fn want_ahead(&mut self, layer: usize, experts: Vec<usize>) {
        if self.stream.is_none() || layer >= self.layers.len() {
            return;
        }
        if self.predicted.len() < self.layers.len() {
            self.predicted.resize_with(self.layers.len(), Vec::new);
            self.foreseen.resize_with(self.layers.len(), Vec::new);
        }
        self.foreseen[layer].extend(&experts);
        // Scored are the predictions that would be read: those not already resident.
        let cache = &self.layers[layer];
        let reads = experts
            .iter()
            .filter(|&&e| !cache.is_pinned(e) && cache.slot(e).is_none());
        self.predicted[layer].extend(reads);
        self.wanted.push((layer, experts));
    }

    /// Read `experts` of layer `layer` ahead of their use into the staging area (those
    /// not already pinned, in a slot or staged, while there is room). Only when experts
    /// stream; returns how many reads were queued.
    pub fn prefetch(&mut self, layer: usize, experts: &[usize]) -> Result<usize> {
        let Some(stream) = &self.stream else {
            return Ok(0);
        };
        let Some(cache) = self.layers.get(layer) else {
            return Ok(0);
        };
        let mut queued = 0;
        for &expert in experts {
            if self.staged.len() >= self.stage_limit {
                break;
            }
            if expert >= cache.tensors.len()
                || cache.is_pinned(expert)
                || cache.slot(expert).is_some()
                || self
                    .staged
                    .iter()
                    .any(|(l, e, _)| *l == layer && *e == expert)
            {
                continue;
            }
            let plan = &stream.plans[layer][expert];
            let tensors = &cache.tensors[expert];
            stream.loader.submit(layer, expert, tensors, plan, true);
            self.stats.bytes_loaded += tensors.source_bytes() as u64;
            self.stats.bytes_read += plan.read_bytes();
            self.stats.ahead_reads += 1;
            self.staged.push((layer, expert, State::Loading));
            queued += 1;
        }
        Ok(queued)
    }

    /// Load expert `expert` of layer `layer` into the pinned tier (a no-op when it is
    /// already pinned). Returns the bytes it occupies, or 0 when streaming and the layer
    /// has no slot to give it (one is always left for the experts not pinned; counted in
    /// [`ExpertStore::pins_skipped`]).
    pub fn pin(&mut self, layer: usize, expert: usize) -> Result<usize> {
        let Some(cache) = self.layers.get(layer) else {
            bail!(
                "cannot pin expert {expert} of layer {layer}: the model has {} layers",
                self.layers.len()
            );
        };
        if let Some((_, loaded)) = cache.pinned.iter().find(|(e, _)| *e == expert) {
            return Ok(loaded.weights.size_bytes());
        }
        if expert >= cache.tensors.len() {
            bail!(
                "cannot pin expert {expert} of layer {layer}: the layer has {} experts",
                cache.tensors.len()
            );
        }
        if self.stream.is_some() && cache.pinned.len() + 1 >= self.capacity {
            self.pins_skipped += 1;
            return Ok(0);
        }
        self.settle(layer, &[expert])?;
        let cache = &mut self.layers[layer];
        let loaded = match cache.slot(expert) {
            Some(index) => match cache.slots.swap_remove(index).state {
                State::Ready(loaded) => loaded,
                State::Loading => unreachable!("settled above"),
            },
            None => self.load_now(layer, expert)?,
        };
        let bytes = loaded.weights.size_bytes();
        self.layers[layer].pinned.push((expert, loaded));
        // When streaming the pin took a slot: the LRU gives one back.
        self.fit_capacity(layer);
        Ok(bytes)
    }

    /// Take expert `expert` of layer `layer` out of the pinned tier; it stays cached as the
    /// most recently used slot when the layer has room. Returns whether it was pinned.
    pub fn unpin(&mut self, layer: usize, expert: usize) -> bool {
        let Some(cache) = self.layers.get_mut(layer) else {
            return false;
        };
        let Some(index) = cache.pinned.iter().position(|(e, _)| *e == expert) else {
            return false;
        };
        let (_, loaded) = cache.pinned.swap_remove(index);
        let slot = Slot {
            expert,
            last_used: cache.clock,
            state: State::Ready(loaded),
        };
        if self.layers[layer].slots.len() < self.lru_capacity(layer) {
            self.layers[layer].slots.push(slot);
        } else {
            self.release(slot.state);
        }
        true
    }

    /// Bytes one expert of layer `layer` takes once loaded (0 for a layer without experts),
    /// for placement budgets such as `PIN_GB`.
    pub fn expert_bytes(&self, layer: usize) -> u64 {
        let Some(tensors) = self
            .layers
            .get(layer)
            .and_then(|cache| cache.tensors.first())
        else {
            return 0;
        };
        let elements: usize = [&tensors.gate, &tensors.up, &tensors.down]
            .iter()
            .map(|view| view.numel())
            .sum();
        (elements as u64 * u64::from(self.width.bits())).div_ceil(8)
    }

    /// The memory one slot of layer `layer` holds: the converted matrices when the width
    /// converts a float expert, else the buffer its bytes are read into (`buffer`, from its
    /// read plan, or an estimate); plus the f32 copies of scales a load makes.
    fn slot_bytes(&self, layer: usize, buffer: Option<usize>) -> u64 {
        let Some(tensors) = self.layers.get(layer).and_then(|c| c.tensors.first()) else {
            return 0;
        };
        let matrices = [&tensors.gate, &tensors.up, &tensors.down];
        if tensors.converts(self.width) {
            // At most one f32 scale per 64 weights, in every width that converts.
            let elements: usize = matrices.iter().map(|view| view.numel()).sum();
            return self.expert_bytes(layer) + (elements / 64 * 4) as u64;
        }
        let scale_copies: usize = matrices
            .iter()
            .filter_map(|view| view.scales.as_deref())
            .map(|scales| scales.bytes.len() / (scales.dtype.bitsize() / 8).max(1) * 4)
            .sum();
        // Without a plan: one block of rounding at each end of each of up to six ranges.
        let buffer = buffer.unwrap_or(tensors.source_bytes() + 6 * 2 * io::ALIGN);
        (buffer + scale_copies) as u64
    }

    /// The experts pinned in each layer.
    pub fn pinned(&self) -> Vec<Vec<usize>> {
        self.layers
            .iter()
            .map(|cache| cache.pinned.iter().map(|(e, _)| *e).collect())
            .collect()
    }

    /// Whether expert `expert` of layer `layer` is pinned.
    pub fn is_pinned(&self, layer: usize, expert: usize) -> bool {
        self.layers
            .get(layer)
            .is_some_and(|cache| cache.is_pinned(expert))
    }

    /// How many experts MoE layer `layer` has (0 for a layer without experts).
    pub fn experts_in(&self, layer: usize) -> usize {
        self.layers
            .get(layer)
            .map_or(0, |cache| cache.tensors.len())
    }

    pub fn has_expert(&self, layer: usize, expert: usize) -> bool {
        expert < self.experts_in(layer)
    }

    /// Load an expert outside the cache (no slot taken, no counter moved): for a tier
    /// that keeps its own copy elsewhere.
    pub fn load_expert(&self, layer: usize, expert: usize) -> Result<Expert> {
        let tensors = self.tensors(layer, expert)?;
        match &self.stream {
            None => Expert::load(tensors, self.width),
            Some(stream) => Ok(*stream
                .loader
                .load_now(tensors, &stream.plans[layer][expert])?
                .weights),
        }
    }
}

impl ExpertStore {
    /// The store `options` ask for, next to `trunk_bytes` of weights resident outside it:
    /// mapped when every expert fits the budget (or `EXPERT_IO=mmap`), streaming into owned
    /// slots otherwise; `cap` slots per layer (at most the experts, and when streaming at
    /// most what the budget holds), or with `cap == 0` as many as the budget holds. A budget
    /// that cannot hold the trunk and one expert per layer is refused with the numbers.
    pub fn provision(
        layers: Vec<Vec<ExpertTensors>>,
        options: &StoreOptions,
        trunk_bytes: u64,
    ) -> Result<ExpertStore> {
        let moe_layers = layers.iter().filter(|layer| !layer.is_empty()).count() as u64;
        let mut store = ExpertStore::new(layers, 1, options.width);
        store.policy = options.policy;
        // Looking further ahead than the model is deep reads nothing more.
        store.pilot = options.pilot.min(store.layers());
        let estimate = (0..store.layers())
            .map(|l| store.slot_bytes(l, None))
            .max()
            .unwrap_or(0);
        let every_expert: u64 = (0..store.layers())
            .map(|l| store.slot_bytes(l, None) * store.experts_in(l) as u64)
            .sum();
        let streaming = match options.io {
            ExpertIo::Mmap => false,
            ExpertIo::Pread | ExpertIo::Direct => true,
            ExpertIo::Auto => every_expert > store.sizing(options, trunk_bytes, estimate, 0).free,
        } && moe_layers > 0;
        if !streaming {
            let sizing = store.sizing(options, trunk_bytes, estimate, 0);
            store.capacity = match options.cap {
                0 => sizing.fits.max(1),
                cap => cap.min(store.most_experts()).max(1),
            };
            let how = if options.io == ExpertIo::Mmap {
                "mapped (EXPERT_IO=mmap): the page cache decides what is resident"
            } else {
                "every expert fits: mapped, zero-copy"
            };
            store.summary = format!(
                "[experts] {} | {} | {how}",
                sizing.text,
                store.slots_text(estimate, "")
            );
            return Ok(store);
        }

        let mut paths: Vec<PathBuf> = store
            .layers
            .iter()
            .flat_map(|cache| &cache.tensors)
            .flat_map(|t| t.views())
            .map(|view| view.file.clone())
            .collect();
        paths.sort();
        paths.dedup();
        let direct = match options.io {
            ExpertIo::Pread => Some(false),
            ExpertIo::Direct => Some(true),
            _ => options.direct,
        };
        let (files, note) = Files::open(paths, direct)?;
        let plans: Vec<Vec<Arc<ReadPlan>>> = store
            .layers
            .iter()
            .map(|cache| {
                cache
                    .tensors
                    .iter()
                    .map(|t| files.plan(t).map(Arc::new))
                    .collect::<Result<_>>()
            })
            .collect::<Result<_>>()?;
        // The slots' size from the plans: the buffers as read, gaps and rounding included.
        let slot_bytes = (0..store.layers())
            .map(|l| store.slot_bytes(l, plans[l].iter().map(|p| p.buffer_len()).max()))
            .max()
            .unwrap_or(0);
        let sizing = store.sizing(options, trunk_bytes, slot_bytes, moe_layers);
        if sizing.fits == 0 {
            bail!(
                "the memory budget is too small: {}, but one expert per MoE layer needs {:.3} GB ({moe_layers} layers x {:.1} MB); raise RAM_GB or the container's memory limit",
                sizing.text,
                (moe_layers * slot_bytes) as f64 / 1e9,
                slot_bytes as f64 / 1e6
            );
        }
        let experts = store.most_experts();
        store.capacity = match options.cap {
            0 => sizing.fits,
            cap => cap.min(experts).min(sizing.fits),
        }
        .max(1);
        store.full_capacity = store.capacity;
        store.room = (sizing.free, slot_bytes, moe_layers);
        let lowered = if options.cap > store.capacity && options.cap <= experts {
            format!(" (CAP {} lowered to what the budget holds)", options.cap)
        } else {
            String::new()
        };
        let reads = plans
            .iter()
            .flatten()
            .map(|plan| plan.reads())
            .max()
            .unwrap_or(0);
        let mode = files.mode();
        if let Some(note) = note {
            eprintln!("{note}");
        }
        let loader = Loader::start(files, options.width, options.io_threads)?;
        store.summary = format!(
            "[experts] {} | {} | streaming: {}, {reads} read{} per expert, {} loader thread{}, PILOT {}, policy {}",
            sizing.text,
            store.slots_text(slot_bytes, &lowered),
            mode.describe(),
            if reads == 1 { "" } else { "s" },
            loader.threads(),
            if loader.threads() == 1 { "" } else { "s" },
            store.pilot,
            options.policy.name()
        );
        store.stream = Some(Stream { loader, plans });
        Ok(store)
    }

    /// The most experts any layer has.
    fn most_experts(&self) -> usize {
        (0..self.layers())
            .map(|l| self.experts_in(l))
            .max()
            .unwrap_or(0)
    }

    fn slots_text(&self, slot_bytes: u64, lowered: &str) -> String {
        let moe_layers = self.layers.iter().filter(|c| !c.tensors.is_empty()).count();
        format!(
            "{} slots/layer{lowered} x {moe_layers} layers of {:.1} MB",
            self.capacity,
            slot_bytes as f64 / 1e6
        )
    }

    /// What the budget leaves for slots of `slot_bytes` over `moe_layers` layers (when
    /// streaming; 0 for mapped experts, which need no buffers of their own): the reserve
    /// holds the other allocations of the run and, when loading converts float experts,
    /// one read buffer per loader thread.
    fn sizing(
        &self,
        options: &StoreOptions,
        trunk: u64,
        slot_bytes: u64,
        moe_layers: u64,
    ) -> Sizing {
        let budget = &options.budget;
        let largest_source = self
            .layers
            .iter()
            .flat_map(|c| &c.tensors)
            .map(ExpertTensors::source_bytes)
            .max()
            .unwrap_or(0) as u64;
        let converts = self
            .layers
            .iter()
            .flat_map(|c| &c.tensors)
            .next()
            .is_some_and(|t| t.converts(options.width));
        let threads = options.io_threads.max(1) as u64;
        // A read that keeps its format reads into the buffer of the slot it replaces (the
        // loader reuses evicted buffers), so it needs nothing more; one that converts
        // holds its read buffer beside the converted slot, one per loader thread, and the
        // spare pool keeps those buffers for the next reads.
        let buffers = if moe_layers > 0 && converts {
            threads * largest_source
        } else {
            0
        };
        let reserve = budget::reserve(budget.bytes) + buffers;
        let trunk = if options.keeps_trunk { trunk } else { 0 };
        let free = budget.bytes.saturating_sub(trunk + reserve);
        let per_slot = (self.layers.iter().filter(|c| !c.tensors.is_empty()).count() as u64
            * slot_bytes)
            .max(1);
        let gb = |bytes: u64| bytes as f64 / 1e9;
        Sizing {
            free,
            fits: ((free / per_slot) as usize).min(self.most_experts().max(1)),
            text: format!(
                "budget {:.2} GB ({}) - {} - reserve {:.2} GB = {:.2} GB for experts",
                gb(budget.bytes),
                budget.source,
                if options.keeps_trunk {
                    format!("trunk {:.2} GB", gb(trunk))
                } else {
                    "no trunk (an expert rank frees it)".to_string()
                },
                gb(reserve),
                gb(free)
            ),
        }
    }
}

/// The budget worked out for one slot size.
struct Sizing {
    /// Bytes left for slots.
    free: u64,
    /// Slots per layer those bytes hold (at most the experts).
    fits: usize,
    /// `budget … - trunk … - reserve … = … for experts`.
    text: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_and_io_modes_parse_by_name() {
        assert_eq!(Policy::from_setting("lfru").unwrap(), Policy::Lfru);
        assert!(Policy::from_setting("fifo")
            .unwrap_err()
            .to_string()
            .contains("COLI_POLICY=fifo"));
        assert_eq!(ExpertIo::from_setting("direct").unwrap(), ExpertIo::Direct);
        assert!(ExpertIo::from_setting("uring").is_err());
    }
}
