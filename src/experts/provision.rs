//! Provisioning: the store a run asks for (`StoreOptions`, `EXPERT_IO`), sized against the
//! memory budget next to the trunk: mapped when every expert fits, else streaming into
//! owned slots through a loader pool with one read plan per expert; how many slots each
//! layer gets, what one slot costs, and the startup line that says so.
//!
//! It owns the arithmetic of slots against the budget; it does not measure the budget
//! (`budget`) and it does not read experts (`io`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};

use super::io::{self, Files, Loader, ReadPlan};
use super::{budget, Budget, ExpertStore, ExpertTensors, Policy, Stream};
use crate::quant::Width;

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
    /// `TRANSITIONS`: read the next layer's experts ahead from the history's transitions.
    pub transitions: bool,
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
            transitions: false,
            keeps_trunk: true,
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
        store.transitions = options.transitions;
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
            "[experts] {} | {} | streaming: {}, {reads} read{} per expert, {} loader thread{}, PILOT {}, TRANSITIONS {}, policy {}",
            sizing.text,
            store.slots_text(slot_bytes, &lowered),
            mode.describe(),
            if reads == 1 { "" } else { "s" },
            loader.threads(),
            if loader.threads() == 1 { "" } else { "s" },
            store.pilot,
            u8::from(store.transitions),
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
