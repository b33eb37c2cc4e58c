//! The expert store: for every MoE layer, a cache of `CAP` expert slots filled from the
//! mapped shards on a miss and evicted least-recently-used, with hit/miss/byte counters.
//!
//! It owns where experts live in memory and what loading one costs; it does not decide
//! which experts a token uses (the engine's router does) and it does not compute with them
//! (the engine runs the FFN on the weights it is handed).

use anyhow::{bail, Result};

use crate::quant::{Matrix, Width};
use crate::snapshot::TensorView;

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

    fn source_bytes(&self) -> usize {
        self.gate.bytes.len() + self.up.bytes.len() + self.down.bytes.len()
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

/// Counters of the whole store. Hits and misses count each distinct expert a layer needs in
/// one forward once, however many rows of the batch route to it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered by the GPU's expert tier (counted by the MoE pass, not the store).
    pub vram_hits: u64,
    pub pin_hits: u64,
    pub lru_hits: u64,
    pub misses: u64,
    pub bytes_loaded: u64,
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
}

struct Slot {
    expert: usize,
    last_used: u64,
    weights: Expert,
}

struct LayerCache {
    tensors: Vec<ExpertTensors>,
    /// Experts placed by the pin plan: loaded once, never evicted, outside `CAP`.
    pinned: Vec<(usize, Expert)>,
    slots: Vec<Slot>,
}

/// The per-layer LRU caches of every MoE layer.
pub struct ExpertStore {
    capacity: usize,
    width: Width,
    layers: Vec<LayerCache>,
    clock: u64,
    stats: CacheStats,
}

impl ExpertStore {
    /// `layers[l][e]` are the tensors of expert `e` in MoE layer `l`; `capacity` slots per
    /// layer (at least 1).
    pub fn new(layers: Vec<Vec<ExpertTensors>>, capacity: usize, width: Width) -> ExpertStore {
        ExpertStore {
            capacity: capacity.max(1),
            width,
            layers: layers
                .into_iter()
                .map(|tensors| LayerCache {
                    tensors,
                    pinned: Vec::new(),
                    slots: Vec::new(),
                })
                .collect(),
            clock: 0,
            stats: CacheStats::default(),
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

    /// Load expert `expert` of layer `layer` into the pinned tier (a no-op when it is
    /// already pinned). Returns the bytes it occupies.
    pub fn pin(&mut self, layer: usize, expert: usize) -> Result<usize> {
        let Some(cache) = self.layers.get_mut(layer) else {
            bail!(
                "cannot pin expert {expert} of layer {layer}: the model has {} layers",
                self.layers.len()
            );
        };
        if let Some((_, weights)) = cache.pinned.iter().find(|(e, _)| *e == expert) {
            return Ok(weights.size_bytes());
        }
        let Some(tensors) = cache.tensors.get(expert) else {
            bail!(
                "cannot pin expert {expert} of layer {layer}: the layer has {} experts",
                cache.tensors.len()
            );
        };
        let weights = match cache.slots.iter().position(|s| s.expert == expert) {
            Some(slot) => cache.slots.swap_remove(slot).weights,
            None => {
                self.stats.bytes_loaded += tensors.source_bytes() as u64;
                Expert::load(tensors, self.width)?
            }
        };
        let bytes = weights.size_bytes();
        cache.pinned.push((expert, weights));
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
        let (_, weights) = cache.pinned.swap_remove(index);
        if cache.slots.len() < self.capacity {
            self.clock += 1;
            cache.slots.push(Slot {
                expert,
                last_used: self.clock,
                weights,
            });
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
            .is_some_and(|cache| cache.pinned.iter().any(|(e, _)| *e == expert))
    }

    /// Run `compute` with all of `experts` (distinct ids) of MoE layer `layer` at once,
    /// loading the missing ones in order; looked up, evicted and counted exactly as that
    /// sequence of [`ExpertStore::with_expert`] calls would be. `None`
    /// (nothing loaded, nothing counted) when the layer's slots cannot hold every one that
    /// is not pinned: the caller then takes them one at a time.
    pub fn with_experts<R>(
        &mut self,
        layer: usize,
        experts: &[usize],
        compute: impl FnOnce(&[&Expert]) -> R,
    ) -> Result<Option<R>> {
        let Some(cache) = self.layers.get_mut(layer) else {
            bail!(
                "MoE layer {layer} does not exist ({} layers)",
                self.layers.len()
            );
        };
        let is_pinned = |cache: &LayerCache, e: usize| cache.pinned.iter().any(|(p, _)| *p == e);
        let unpinned = experts.iter().filter(|&&e| !is_pinned(cache, e)).count();
        if unpinned > self.capacity {
            return Ok(None);
        }
        for &expert in experts {
            self.clock += 1;
            if is_pinned(cache, expert) {
                self.stats.pin_hits += 1;
                continue;
            }
            if let Some(slot) = cache.slots.iter_mut().find(|s| s.expert == expert) {
                slot.last_used = self.clock;
                self.stats.lru_hits += 1;
                continue;
            }
            let Some(tensors) = cache.tensors.get(expert) else {
                bail!(
                    "expert {expert} of MoE layer {layer} does not exist ({} experts)",
                    cache.tensors.len()
                );
            };
            let slot = Slot {
                expert,
                last_used: self.clock,
                weights: Expert::load(tensors, self.width)?,
            };
            self.stats.misses += 1;
            self.stats.bytes_loaded += tensors.source_bytes() as u64;
            if cache.slots.len() < self.capacity {
                cache.slots.push(slot);
            } else if let Some(victim) = cache.slots.iter_mut().min_by_key(|s| s.last_used) {
                // The same choice one-at-a-time lookups make, so `coli trace simulate`
                // replays this cache exactly. It never evicts an expert this call already
                // took: while fewer than `capacity` of them are taken, an older slot exists.
                *victim = slot;
            }
        }
        let weights: Vec<&Expert> = experts
            .iter()
            .map(|&expert| {
                cache
                    .pinned
                    .iter()
                    .find(|(e, _)| *e == expert)
                    .map(|(_, weights)| weights)
                    .or_else(|| {
                        cache
                            .slots
                            .iter()
                            .find(|s| s.expert == expert)
                            .map(|s| &s.weights)
                    })
                    .expect("every requested expert was just made resident")
            })
            .collect();
        Ok(Some(compute(&weights)))
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
        match self
            .layers
            .get(layer)
            .and_then(|cache| cache.tensors.get(expert))
        {
            Some(tensors) => Expert::load(tensors, self.width),
            None => bail!("expert {expert} of MoE layer {layer} does not exist"),
        }
    }

    /// Run `compute` with expert `expert` of MoE layer `layer`, loading it on a miss. A
    /// loaded expert takes a slot afterwards, evicting the least recently used one when the
    /// layer is full; so a batch may use more distinct experts than there are slots.
    pub fn with_expert<R>(
        &mut self,
        layer: usize,
        expert: usize,
        compute: impl FnOnce(&Expert) -> R,
    ) -> Result<R> {
        self.clock += 1;
        let cache = &mut self.layers[layer];
        if let Some((_, weights)) = cache.pinned.iter().find(|(e, _)| *e == expert) {
            self.stats.pin_hits += 1;
            return Ok(compute(weights));
        }
        if let Some(slot) = cache.slots.iter_mut().find(|s| s.expert == expert) {
            slot.last_used = self.clock;
            self.stats.lru_hits += 1;
            return Ok(compute(&slot.weights));
        }
        let Some(tensors) = cache.tensors.get(expert) else {
            bail!(
                "expert {expert} of MoE layer {layer} does not exist ({} experts)",
                cache.tensors.len()
            );
        };
        let weights = Expert::load(tensors, self.width)?;
        self.stats.misses += 1;
        self.stats.bytes_loaded += tensors.source_bytes() as u64;
        let result = compute(&weights);
        let slot = Slot {
            expert,
            last_used: self.clock,
            weights,
        };
        if cache.slots.len() < self.capacity {
            cache.slots.push(slot);
        } else if let Some(victim) = cache.slots.iter_mut().min_by_key(|s| s.last_used) {
            *victim = slot;
        }
        Ok(result)
    }
}

impl ExpertStore {
    /// A store sized by the `CAP` setting: `cap` slots per layer (at most the number of
    /// experts), or with `cap == 0` as many as [`auto_capacity`] finds room for in
    /// `ram_budget` next to `resident_bytes` of other weights.
    pub fn provision(
        layers: Vec<Vec<ExpertTensors>>,
        cap: usize,
        width: Width,
        ram_budget: u64,
        resident_bytes: u64,
    ) -> ExpertStore {
        let n_experts = layers.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = match cap {
            0 => {
                let moe_layers = layers.iter().filter(|layer| !layer.is_empty()).count();
                let probe = ExpertStore::new(layers, 1, width);
                let expert_bytes = (0..probe.layers())
                    .map(|l| probe.expert_bytes(l))
                    .max()
                    .unwrap_or(0);
                let capacity = auto_capacity(
                    ram_budget,
                    resident_bytes,
                    moe_layers,
                    expert_bytes,
                    n_experts,
                );
                return ExpertStore { capacity, ..probe };
            }
            cap => cap.min(n_experts),
        };
        ExpertStore::new(layers, capacity, width)
    }
}

/// `CAP=0`: as many slots per layer as the RAM budget holds after the resident weights and
/// a fixed reserve, between 1 and the number of experts.
pub fn auto_capacity(
    budget_bytes: u64,
    resident_bytes: u64,
    moe_layers: usize,
    expert_bytes: u64,
    n_experts: usize,
) -> usize {
    const RESERVE: u64 = 2 << 30;
    let free = budget_bytes.saturating_sub(resident_bytes + RESERVE);
    let per_slot = (moe_layers as u64 * expert_bytes).max(1);
    ((free / per_slot) as usize).clamp(1, n_experts.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_capacity_is_bounded_by_budget_and_experts() {
        let gib = 1u64 << 30;
        assert_eq!(auto_capacity(100 * gib, gib, 10, gib / 10, 64), 64);
        assert_eq!(auto_capacity(4 * gib, gib, 10, gib / 10, 64), 1);
        assert_eq!(auto_capacity(5 * gib, gib, 10, gib / 10, 64), 2);
        assert_eq!(auto_capacity(0, 0, 1, 1, 8), 1);
    }
}
