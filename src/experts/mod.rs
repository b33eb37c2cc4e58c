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
//!
//! One file per job: `slots` (the slot cache, its eviction policies and the pins),
//! `ahead` (read-ahead, its staging area and the scoring of the lookahead's predictions),
//! `provision` (the store's options and its sizing against the budget), `stats` (the
//! counters), [`io`] (reading), [`budget`] (the memory limit) and [`tier`] (the GPU's
//! copies). This file holds the store itself and a pass through it: the lookups of a call,
//! its reads filed as they finish, and the weights handed to the engine.

pub mod budget;
pub mod io;
pub mod tier;

mod ahead;
mod provision;
mod slots;
mod stats;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::quant::{Format, Matrix, Width};
use crate::snapshot::{Dtype, Snapshot, TensorView};
pub use ahead::MIN_PRECISION;
pub use budget::Budget;
use io::{Loaded, Loader, ReadPlan};
pub use provision::{ExpertIo, StoreOptions};
use slots::LayerCache;
pub use slots::{Policy, Residence};
pub use stats::CacheStats;

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

enum State {
    Ready(Loaded),
    /// A loader thread is reading it.
    Loading,
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
    /// `TRANSITIONS`: read ahead what the history's transitions predict.
    transitions: bool,
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
            transitions: false,
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

    /// The format the routed experts compute in: a pre-quantised container's own (the
    /// first expert's stands for all: a container quantises every expert alike), else the
    /// store's width applied to float weights; `None` for a store without experts.
    pub fn format(&self) -> Option<Format> {
        let gate = &self.layers.first()?.tensors.first()?.gate;
        let [rows, cols] = gate.shape[..] else {
            return None;
        };
        let stored = crate::quant::format::infer(gate, rows, cols).ok()?;
        Some(if stored.is_float() && self.width != Width::F32 {
            self.width.format()
        } else {
            stored
        })
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

    /// `TRANSITIONS`: whether the next layer's experts are read ahead from the history's
    /// transitions (false when experts are mapped).
    pub fn transitions_ahead(&self) -> bool {
        self.stream.is_some() && self.transitions
    }

    /// Layers' worth of predictions the read-ahead stages at once: `PILOT`'s, and one for
    /// the transitions.
    pub fn ahead_layers(&self) -> usize {
        self.pilot() + usize::from(self.transitions_ahead())
    }

    /// Whether experts stream into owned slots.
    pub fn streams(&self) -> bool {
        self.stream.is_some()
    }

    /// The startup line: the budget and where it came from, the slots, how experts are read.
    pub fn summary(&self) -> &str {
        &self.summary
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
