//! The VRAM expert tier: routed experts uploaded to the GPU once at startup, hottest
//! first, until `GPU_EXPERT_GB` is spent. A resident expert never touches the CPU cache
//! again; each MoE layer sends its resident experts to the device as one group while the
//! CPU computes the rest (see [`RoutedExperts::run`](crate::engines::moe::RoutedExperts::run)).
//!
//! A `REPIN` pass may then trade a resident expert for a hotter one pinned in RAM
//! ([`ExpertTier::swap`]; the rule is [`plan_vram_repin`](crate::route_trace::repin::plan_vram_repin)).
//! This module chooses and holds the uploads; it does not compute.

use std::collections::HashMap;

use anyhow::{bail, Result};

use super::{Expert, ExpertStore};
use crate::backend::{self, Device, DeviceError, DeviceWeight, WeightId};
use crate::quant::Matrix;

/// One expert's three projections on the device.
pub struct ResidentExpert {
    pub gate: DeviceWeight,
    pub up: DeviceWeight,
    pub down: DeviceWeight,
}

impl ResidentExpert {
    pub fn ids(&self) -> (WeightId, WeightId, WeightId) {
        (self.gate.id(), self.up.id(), self.down.id())
    }
}

/// The experts resident on the device, by MoE layer and expert id.
#[derive(Default)]
pub struct ExpertTier {
    /// Each resident expert, with its bytes.
    resident: HashMap<(usize, usize), (ResidentExpert, u64)>,
    bytes: u64,
    /// `GPU_EXPERT_GB` in bytes: what a swap may not exceed.
    budget: u64,
}

impl ExpertTier {
    /// Upload experts of `store` in `order` (hottest first; repeats and experts that do not
    /// exist are skipped) while their compute-format bytes fit in `budget` bytes.
    ///
    /// A budget beyond the device's free memory is refused before anything is uploaded, as
    /// is an expert format the device cannot compute: both are mistakes the user fixes with
    /// a setting, so the run stops there rather than half-filling the tier.
    pub fn fill(
        device: &dyn Device,
        store: &ExpertStore,
        order: impl IntoIterator<Item = (usize, usize)>,
        budget: u64,
    ) -> Result<ExpertTier> {
        let memory = device.memory();
        if budget > memory.free {
            bail!(
                "GPU_EXPERT_GB asks for {:.2} GB of experts on {}, which has {:.2} GB free \
                 (of {:.2} GB): lower GPU_EXPERT_GB",
                budget as f64 / 1e9,
                device.description(),
                memory.free as f64 / 1e9,
                memory.total as f64 / 1e9
            );
        }
        let mut tier = ExpertTier {
            budget,
            ..ExpertTier::default()
        };
        for (layer, expert) in order {
            if tier.resident.contains_key(&(layer, expert)) || !store.has_expert(layer, expert) {
                continue;
            }
            let weights = store.load_expert(layer, expert)?;
            let bytes = weights.size_bytes() as u64;
            if tier.bytes + bytes > budget {
                break;
            }
            let resident =
                upload_expert(device, &weights).map_err(|(error, matrix)| match error {
                    DeviceError::Unsupported(why) => anyhow::anyhow!(
                        "the experts are {} ({why}); {} cannot hold them: \
                     set GPU_EXPERT_GB=0, or convert them to a format it computes",
                        matrix.format(),
                        device.description()
                    ),
                    DeviceError::Failed(error) => {
                        error.context(format!("uploading expert {expert} of MoE layer {layer}"))
                    }
                })?;
            tier.bytes += bytes;
            tier.resident.insert((layer, expert), (resident, bytes));
        }
        Ok(tier)
    }

    /// Put expert `admit` of MoE layer `layer` on the device in place of `evict`, which
    /// leaves it. `Ok(false)`, with nothing changed, when `evict` is not resident, `admit`
    /// already is or does not exist, or the trade would exceed the budget. The new expert
    /// is uploaded before the old one is released, so a failed upload leaves the tier as
    /// it was; the failure is the device's as anywhere after startup
    /// ([`backend::fell_back`]: one warning, and the CPU computes from then on).
    pub fn swap(
        &mut self,
        device: &dyn Device,
        store: &ExpertStore,
        layer: usize,
        evict: usize,
        admit: usize,
    ) -> Result<bool> {
        if !self.contains(layer, evict)
            || self.contains(layer, admit)
            || !store.has_expert(layer, admit)
        {
            return Ok(false);
        }
        let weights = store.load_expert(layer, admit)?;
        let admitted = weights.size_bytes() as u64;
        let bytes = self.bytes - self.resident[&(layer, evict)].1 + admitted;
        if bytes > self.budget {
            return Ok(false);
        }
        let resident = match upload_expert(device, &weights) {
            Ok(resident) => resident,
            Err((error, _)) => {
                backend::fell_back(error);
                return Ok(false);
            }
        };
        self.resident.remove(&(layer, evict));
        self.resident.insert((layer, admit), (resident, admitted));
        self.bytes = bytes;
        Ok(true)
    }

    /// The resident experts of each of `layers` MoE layers, in ascending order.
    pub fn by_layer(&self, layers: usize) -> Vec<Vec<usize>> {
        let mut by_layer = vec![Vec::new(); layers];
        for &(layer, expert) in self.resident.keys() {
            if let Some(experts) = by_layer.get_mut(layer) {
                experts.push(expert);
            }
        }
        by_layer
            .iter_mut()
            .for_each(|experts| experts.sort_unstable());
        by_layer
    }

    pub fn get(&self, layer: usize, expert: usize) -> Option<&ResidentExpert> {
        self.resident
            .get(&(layer, expert))
            .map(|(resident, _)| resident)
    }

    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        self.resident.contains_key(&(layer, expert))
    }

    pub fn len(&self) -> usize {
        self.resident.len()
    }

    pub fn is_empty(&self) -> bool {
        self.resident.is_empty()
    }

    /// Bytes of expert weights on the device.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Upload one expert's three projections; an error names the matrix the device refused.
fn upload_expert<'a>(
    device: &dyn Device,
    weights: &'a Expert,
) -> Result<ResidentExpert, (DeviceError, &'a Matrix)> {
    let upload = |matrix: &'a Matrix| {
        DeviceWeight::upload(device, &matrix.raw()).map_err(|error| (error, matrix))
    };
    Ok(ResidentExpert {
        gate: upload(&weights.gate)?,
        up: upload(&weights.up)?,
        down: upload(&weights.down)?,
    })
}
