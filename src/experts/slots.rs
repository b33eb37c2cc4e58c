//! The slot cache of each MoE layer: the slots a miss fills and the eviction policy
//! (`COLI_POLICY`) empties, the pinned set beside them, and one lookup's hit or miss.
//!
//! It owns which resident expert gives way to which and what a pin costs the slots; it does
//! not read experts (the loader pool in `io` does, the store files what comes back) and it
//! does not choose what to read ahead (`ahead`).

use anyhow::{bail, Result};

use super::io::Loaded;
use super::{Expert, ExpertStore, ExpertTensors, State};

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

/// Where a routed expert lives, from the farthest to the nearest the compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Residence {
    /// Not in memory: a lookup reads it (or, mapped, the kernel faults it in).
    Absent,
    /// In one of its layer's cache slots, which the policy may give to another.
    Slot,
    /// Pinned in memory, never evicted.
    Pinned,
    /// Uploaded to the GPU's expert tier (`GPU_EXPERT_GB`).
    Vram,
}

impl Residence {
    /// The name the server's routing events give it.
    pub fn name(self) -> &'static str {
        match self {
            Residence::Absent => "none",
            Residence::Slot => "slot",
            Residence::Pinned => "pin",
            Residence::Vram => "vram",
        }
    }
}

pub(super) struct Slot {
    pub(super) expert: usize,
    /// The layer's lookup clock at its last use.
    pub(super) last_used: u64,
    pub(super) state: State,
}

impl Slot {
    pub(super) fn weights(&self) -> Option<&Expert> {
        match &self.state {
            State::Ready(loaded) => Some(&loaded.weights),
            State::Loading => None,
        }
    }
}

pub(super) struct LayerCache {
    pub(super) tensors: Vec<ExpertTensors>,
    /// Experts placed by the pin plan: loaded once, never evicted.
    pub(super) pinned: Vec<(usize, Loaded)>,
    pub(super) slots: Vec<Slot>,
    /// Lookups of this layer so far (LFRU ages are counted in them).
    pub(super) clock: u64,
    /// LFRU: selections from the history plus lookups in this run, per expert.
    heat: Vec<u64>,
}

impl LayerCache {
    pub(super) fn new(tensors: Vec<ExpertTensors>) -> LayerCache {
        LayerCache {
            heat: vec![0; tensors.len()],
            tensors,
            pinned: Vec::new(),
            slots: Vec::new(),
            clock: 0,
        }
    }

    pub(super) fn is_pinned(&self, expert: usize) -> bool {
        self.pinned.iter().any(|(e, _)| *e == expert)
    }

    pub(super) fn slot(&self, expert: usize) -> Option<usize> {
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

impl ExpertStore {
    /// Pins refused so far because their layer had no slot left for the LRU.
    pub fn pins_skipped(&self) -> usize {
        self.pins_skipped
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
    pub(super) fn lru_capacity(&self, layer: usize) -> usize {
        match (&self.stream, self.layers.get(layer)) {
            (Some(_), Some(cache)) => self.capacity.saturating_sub(cache.pinned.len()).max(1),
            _ => self.capacity,
        }
    }

    /// Give up the slots of layer `layer` above its capacity (after a pin or the read-ahead
    /// took room), the policy choosing; called outside a pass, when none of them is in use.
    pub(super) fn fit_capacity(&mut self, layer: usize) {
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

    /// One lookup of a call that began at layer clock `call_start`: a hit refreshes the
    /// slot; a miss takes a free slot or replaces one not used by this call, and is read
    /// (mapped: now; streaming: queued for the loader pool).
    pub(super) fn lookup(&mut self, layer: usize, expert: usize, call_start: u64) -> Result<()> {
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

    /// The experts pinned in each layer.
    pub fn pinned(&self) -> Vec<Vec<usize>> {
        self.layers
            .iter()
            .map(|cache| cache.pinned.iter().map(|(e, _)| *e).collect())
            .collect()
    }

    /// Where each expert of each layer is now: pinned, in a slot (or being read into one),
    /// or not resident; by layer, one entry per expert of the layer (none for a layer
    /// without experts).
    pub fn residence(&self) -> Vec<Vec<Residence>> {
        self.layers
            .iter()
            .map(|cache| {
                let mut layer = vec![Residence::Absent; cache.tensors.len()];
                for slot in &cache.slots {
                    if let Some(place) = layer.get_mut(slot.expert) {
                        *place = Residence::Slot;
                    }
                }
                for (expert, _) in &cache.pinned {
                    if let Some(place) = layer.get_mut(*expert) {
                        *place = Residence::Pinned;
                    }
                }
                layer
            })
            .collect()
    }

    /// Whether expert `expert` of layer `layer` is pinned.
    pub fn is_pinned(&self, layer: usize, expert: usize) -> bool {
        self.layers
            .get(layer)
            .is_some_and(|cache| cache.is_pinned(expert))
    }
}
