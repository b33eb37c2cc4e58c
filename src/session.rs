//! The routing telemetry of one run, around the engine: before the first token it opens
//! `ROUTE_TRACE`, loads the usage history and pins the experts the placement plan names;
//! between tokens it runs `REPIN`; at the end it saves the history (generating runs only),
//! writes `STATS` and flushes the trace.
//!
//! The formats and the placement rules live in `route_trace`; this module only decides when
//! each happens and which settings feed it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Result};

use crate::backend::{self, tier::ExpertTier};
use crate::engines::Engine;
use crate::experts::Policy;
use crate::route_trace::placement::rank;
use crate::route_trace::repin::{plan_repin, RepinSchedule, REPIN_PASS_LIMIT};
use crate::route_trace::{Decay, PinGb, PinPlan, PinRequest, PinSetting, SaveOptions};
use crate::settings::Settings;

/// Why a run generated tokens or only scored them: only generation folds its routing into
/// the saved history, so an oracle run never trains placement on its own reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunKind {
    Generating,
    Scoring,
}

pub struct Session {
    history: PathBuf,
    save: SaveOptions,
    stats: Option<PathBuf>,
    repin: Option<RepinSchedule>,
}

impl Session {
    /// Everything that happens before the first token.
    pub fn start(
        settings: &Settings,
        snap: &Path,
        engine: &mut dyn Engine,
        ram_budget: u64,
    ) -> Result<Session> {
        let decay = settings.number("COLI_USAGE_DECAY");
        if !(decay > 0.0 && decay <= 1.0) {
            bail!("setting COLI_USAGE_DECAY={decay}: expected a factor in (0, 1]");
        }
        let pin_gb = PinGb::from_setting(settings.text("PIN_GB"))?;
        let history = settings
            .text("COLI_USAGE")
            .map(PathBuf::from)
            .unwrap_or_else(|| snap.join(".coli_usage"));

        let telemetry = engine.telemetry();
        if let Some(trace) = settings.text("ROUTE_TRACE") {
            // The run goes on untraced when the file cannot be created; the message says so.
            let _ = telemetry.open_trace(Path::new(trace));
        }
        telemetry.load_history(&history);
        if engine.expert_store().policy() == Policy::Lfru {
            // LFRU's frequencies start from the history's selections.
            let seeds: Vec<(usize, usize, u32)> = engine.telemetry().counts().nonzero().collect();
            let store = engine.expert_store();
            for (layer, expert, count) in seeds {
                store.seed_heat(layer, expert, u64::from(count));
            }
        }

        let pin = PinSetting::from_setting(settings.text("PIN"));
        let cap = engine.cache_capacity();
        let request = PinRequest {
            pin: &pin,
            pin_n: settings.count_if_set("PIN_N").map(|n| n as usize),
            pin_gb,
            ram_avail_bytes: ram_budget,
            autopin: settings.flag("AUTOPIN"),
            cap,
            snap,
            history: Some(&history),
        };
        let sizes: Vec<u64> = {
            let store = engine.expert_store();
            (0..=store.layers())
                .map(|layer| store.expert_bytes(layer))
                .collect()
        };
        let plan = engine
            .telemetry()
            .plan_pins(&request, &|layer| sizes.get(layer).copied().unwrap_or(0));
        let started = Instant::now();
        let tier = fill_expert_tier(settings, engine, &plan)?;
        let store = engine.expert_store();
        let mut vram = 0;
        for pin in &plan.pins {
            if tier.contains(pin.layer, pin.expert) {
                vram += 1;
            } else if layer_has_experts(&sizes, pin.layer) {
                // The MTP row of a model whose draft head is absent has no experts to pin.
                store.pin(pin.layer, pin.expert)?;
            }
        }
        engine.routed_mut().tier = tier;
        let skipped = engine.expert_store().pins_skipped();
        if skipped > 0 {
            eprintln!(
                "[PIN] {skipped} pins skipped: with streamed experts a pin takes one of its layer's {} slots, and each layer keeps one for the rest (raise the budget or lower PIN_N/PIN_GB)",
                engine.cache_capacity()
            );
        }
        if let Some(line) = plan.line(vram, started.elapsed().as_secs_f64()) {
            eprintln!("{line}");
        }

        let every = settings.count("REPIN");
        Ok(Session {
            history,
            save: SaveOptions {
                enabled: settings.flag("USAGE_SAVE"),
                decay: Decay::new(decay),
            },
            stats: settings.text("STATS").map(PathBuf::from),
            repin: (every > 0).then(|| RepinSchedule::new(every)),
        })
    }

    /// After each generated token: a `REPIN` pass when one is due.
    pub fn after_tokens(&mut self, engine: &mut dyn Engine, emitted: u64) -> Result<()> {
        let Some(schedule) = self.repin.as_mut() else {
            return Ok(());
        };
        if !schedule.tokens(emitted) {
            return Ok(());
        }
        let started = Instant::now();
        let pinned = engine.expert_store().pinned();
        let swaps = plan_repin(engine.telemetry().session_heat(), &pinned, REPIN_PASS_LIMIT);
        let store = engine.expert_store();
        for swap in &swaps {
            store.unpin(swap.layer, swap.evict);
            store.pin(swap.layer, swap.admit)?;
        }
        engine.telemetry().cool_session_heat();
        let millis = started.elapsed().as_secs_f64() * 1e3;
        for swap in &swaps {
            eprintln!("{}", swap.line("RAM", millis));
        }
        Ok(())
    }

    /// The end of a run (also after an interrupted generation).
    pub fn finish(&mut self, engine: &mut dyn Engine, kind: RunKind) -> Result<()> {
        let telemetry = engine.telemetry();
        if kind == RunKind::Generating {
            // The outcome's lines are printed by the save itself.
            telemetry.save_history(&self.history, self.save)?;
        }
        if let Some(stats) = &self.stats {
            telemetry.dump_stats(stats)?;
        }
        if let Err(err) = telemetry.flush_trace() {
            eprintln!("[ROUTE_TRACE] write failed: {err}");
        }
        Ok(())
    }
}

/// The VRAM tier `GPU_EXPERT_GB` asks for: the plan's pins first (hottest first), then the
/// rest of the history by heat, then every other expert layer by layer, until the budget is
/// spent; so a budget that holds the whole model holds it with or without a history.
fn fill_expert_tier(
    settings: &Settings,
    engine: &mut dyn Engine,
    plan: &PinPlan,
) -> Result<ExpertTier> {
    let gb = settings.number("GPU_EXPERT_GB");
    if gb == 0.0 {
        return Ok(ExpertTier::default());
    }
    let Some(device) = backend::active() else {
        eprintln!("[GPU] GPU_EXPERT_GB={gb} ignored: no GPU backend is computing (see BACKEND)");
        return Ok(ExpertTier::default());
    };
    let ranked = rank(engine.telemetry().counts());
    let store = engine.expert_store();
    let every =
        (0..store.layers()).flat_map(|layer| (0..store.experts_in(layer)).map(move |e| (layer, e)));
    let order = plan
        .pins
        .iter()
        .chain(&ranked)
        .map(|pin| (pin.layer, pin.expert))
        .chain(every);
    let started = Instant::now();
    let tier = ExpertTier::fill(device, store, order, (gb * 1e9) as u64)?;
    eprintln!(
        "[GPU] expert tier: {} experts ({:.2} GB) on {} in {:.1}s",
        tier.len(),
        tier.bytes() as f64 / 1e9,
        device.description(),
        started.elapsed().as_secs_f64()
    );
    Ok(tier)
}

fn layer_has_experts(sizes: &[u64], layer: usize) -> bool {
    sizes.get(layer).is_some_and(|&bytes| bytes > 0)
}
