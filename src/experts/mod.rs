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
    /// Check the three shapes against the configuration.
    pub fn checked(self, hidden: usize, inter: usize) -> Result<ExpertTensors> {
        for (view, shape) in [
            (&self.gate, [inter, hidden]),
            (&self.up, [inter, hidden]),
            (&self.down, [hidden, inter]),
        ] {
            if view.shape != shape {
                bail!(
                    "{}: tensor {} has shape {:?}, expected {:?} from config.json",
                    view.file.display(),
                    view.name,
                    view.shape,
                    shape
                );
            }
        }
        Ok(self)
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
            gate: Matrix::load(&tensors.gate, width)?,
            up: Matrix::load(&tensors.up, width)?,
            down: Matrix::load(&tensors.down, width)?,
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
    pub pin_hits: u64,
    pub lru_hits: u64,
    pub misses: u64,
    pub bytes_loaded: u64,
}

impl CacheStats {
    /// Hit rate in percent; 0 before any lookup.
    pub fn hit_rate(&self) -> f64 {
        let hits = self.pin_hits + self.lru_hits;
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
                    slots: Vec::new(),
                })
                .collect(),
            clock: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
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
