//! Read-ahead: the experts the router lookahead predicts for a coming layer
//! ([`ExpertStore::want_ahead`]), read into a small staging area while the current layer
//! computes ([`ExpertStore::prefetch`]), and the scoring of those predictions against what
//! each layer then took, which turns the read-ahead off while it would mostly read in vain
//! and gives its room back to the slots.
//!
//! It owns the staging area, the share of memory it borrows from the slots and the running
//! precision; it does not predict (the engine's lookahead does), and a staged expert never
//! displaces a slot: the slots see exactly the lookups they would without it.

use anyhow::Result;

use super::{ExpertStore, State};

/// The share of its predictions the lookahead must get right for its reads to be issued:
/// below it a wrong read-ahead (bandwidth taken from the misses) costs more than a right
/// one saves (a wait).
pub const MIN_PRECISION: f64 = 0.5;

/// How slowly the running precision follows each layer's sample.
const PRECISION_KEEP: f64 = 0.95;

impl ExpertStore {
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
}
