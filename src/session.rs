//! The routing telemetry of one run, around the engine: before the first token it opens
//! `ROUTE_TRACE`, loads the usage history and pins the experts the placement plan names
//! (in the store of whichever process computes each);
//! between tokens it runs `REPIN`; at the end it saves the history (generating runs only),
//! writes `STATS` and flushes the trace.
//!
//! The formats and the placement rules live in `route_trace`; this module only decides when
//! each happens and which settings feed it.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::backend;
use crate::engines::moe::RoutedExperts;
use crate::engines::Engine;
use crate::experts::tier::ExpertTier;
use crate::experts::Policy;
use crate::route_trace::guard::{PlacementGuard, Verdict};
use crate::route_trace::placement::rank;
use crate::route_trace::repin::{plan_repin, plan_vram_repin, RepinSchedule, REPIN_PASS_LIMIT};
use crate::route_trace::{Elsewhere, PinPlan, PinRequest, PinSetting, PinSource, SaveOptions};
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

/// The history's default path: `COLI_USAGE`, else `SNAP/.coli_usage`.
fn history_path(settings: &Settings, snap: &Path) -> PathBuf {
    settings
        .usage
        .clone()
        .unwrap_or_else(|| snap.join(".coli_usage"))
}

/// Refuses a path that names something other than a regular file (a FIFO would block the
/// read forever; a directory or device is no history).
fn regular_or_missing(key: &str, path: &Path) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(m) if !m.is_file() => bail!(
            "{key}: {} is not a regular file ({}); a history is a regular file",
            path.display(),
            crate::files::file_kind(&m).unwrap_or("not a file")
        ),
        _ => Ok(()),
    }
}

/// Whether `path` is one of the snapshot's own files: weights, configs, tokenizer.
fn is_model_file(path: &Path, snap: &Path) -> bool {
    let in_snap = path
        .parent()
        .map(|d| {
            if d.as_os_str().is_empty() {
                Path::new(".")
            } else {
                d
            }
        })
        .is_some_and(|d| crate::files::same_file(d, snap));
    let named_like_model = path.extension().is_some_and(|e| {
        ["safetensors", "json", "gguf", "bin", "model", "jinja"]
            .iter()
            .any(|m| e == *m)
    });
    in_snap && named_like_model
}

impl Session {
    /// The checks of every file the session will read or write that can be made before
    /// the weights load, so that a run that must be refused is refused at once: the
    /// history (and this engine's file beside it, neither of which may link into the
    /// snapshot's model files), `PIN=<path>`, and the `ROUTE_TRACE` and `STATS` outputs,
    /// which must not name the snapshot's model files or the history.
    pub fn preflight(settings: &Settings, snap: &Path, engine: &str) -> Result<()> {
        let history = history_path(settings, snap);
        regular_or_missing(
            if settings.usage.is_some() {
                "COLI_USAGE"
            } else {
                "the history"
            },
            &history,
        )?;
        // The history and this engine's file beside it are the files a save may write: a
        // link from either into the weights is refused now, before the start-up line says
        // where the counts will be saved.
        let own = crate::route_trace::save::sibling_path(&history, engine);
        for file in [&history, &own] {
            let Ok(target) = crate::files::resolve_link(file) else {
                continue;
            };
            if target != *file && is_model_file(&target, snap) {
                bail!(
                    "the history {} links to {}, one of the snapshot's model files; coli never writes into them (remove the link, or set COLI_USAGE to another path)",
                    file.display(),
                    target.display()
                );
            }
        }
        if let PinSetting::Path(p) = &settings.pin {
            regular_or_missing("PIN", p)?;
        }
        for (key, out) in [
            ("ROUTE_TRACE", &settings.route_trace),
            ("STATS", &settings.stats),
        ] {
            let Some(out) = out else {
                continue;
            };
            let target = crate::files::resolve_link(out).unwrap_or_else(|_| out.clone());
            if is_model_file(&target, snap) {
                bail!(
                    "{key}={}: that is one of the snapshot's model files; coli never writes into them (choose another path)",
                    out.display()
                );
            }
            for file in [&history, &own] {
                let lock = crate::files::lock_path(file);
                if [file, &lock]
                    .iter()
                    .any(|f| target == **f || crate::files::same_file(&target, f))
                {
                    bail!(
                        "{key}={}: that is the usage history {} or its lock; {key} needs a file of its own",
                        out.display(),
                        file.display()
                    );
                }
            }
        }
        Ok(())
    }

    /// What happens before placement: the trace opened, the history loaded, the `STATS`
    /// target checked. [`Session::place`] follows, once it is known which process computes
    /// each expert (an MPI job's placement balances the history this loads).
    pub fn start(
        settings: &Settings,
        snap: &Path,
        engine: &dyn Engine,
        kind: RunKind,
    ) -> Result<Session> {
        let history = history_path(settings, snap);

        let mut routed = engine.routed();
        let telemetry = &mut routed.telemetry;
        if let Some(trace) = &settings.route_trace {
            // A trace was asked for: one that cannot be created (or must not replace the
            // file there) stops the run before the first token.
            if let Err(e) = telemetry.open_trace(trace) {
                bail!(
                    "ROUTE_TRACE={}: {e}; choose a path coli can create",
                    trace.display()
                );
            }
        }
        // A history the user named stays where it was named; only the default beside the
        // weights moves to the state directory when that directory cannot be written.
        let elsewhere = settings
            .usage
            .is_none()
            .then(|| Elsewhere::for_snapshot(snap))
            .flatten();
        telemetry.load_history(&history, elsewhere.as_ref());
        let stats = settings.stats.clone();
        if let Some(why) = stats
            .as_ref()
            .and_then(|p| telemetry.stats_target_problem(p))
        {
            bail!(
                "STATS={}: {why}; refusing to replace it",
                stats
                    .as_ref()
                    .map_or(String::new(), |p| p.display().to_string())
            );
        }
        let save = SaveOptions {
            enabled: settings.usage_save,
            decay: settings.usage_decay,
        };
        if let Some(home) = telemetry.home() {
            let not_saving = match (save.enabled, kind) {
                (false, _) => Some("USAGE_SAVE=0"),
                (true, RunKind::Scoring) => Some("a scoring run folds nothing into the history"),
                (true, RunKind::Generating) => None,
            };
            crate::note!("{}", home.line(not_saving));
        }
        let every = settings.repin;
        Ok(Session {
            history,
            save,
            stats,
            repin: (every > 0).then(|| RepinSchedule::new(every)),
        })
    }

    /// The last of what happens before the first token: LFRU's frequencies seeded and the
    /// experts the placement plan names pinned, each in the store of the process that
    /// computes it, and the abstain rule armed.
    pub fn place(
        &self,
        settings: &Settings,
        snap: &Path,
        engine: &dyn Engine,
        ram_budget: u64,
    ) -> Result<()> {
        let history = &self.history;
        let mut routed = engine.routed();
        if routed.store.policy() == Policy::Lfru {
            // LFRU's frequencies start from the history's selections.
            let seeds: Vec<(usize, usize, u64)> = routed
                .telemetry
                .counts()
                .nonzero()
                .map(|(layer, expert, count)| (layer, expert, u64::from(count)))
                .collect();
            routed.seed_heat(&seeds)?;
        }

        let cap = routed.slots().0;
        // PIN=auto ranks from the file this engine's history lives in: the per-engine path
        // when the default one holds another's.
        let in_use = routed
            .telemetry
            .home()
            .map_or_else(|| history.clone(), |h| h.save_to.clone());
        let request = PinRequest {
            pin: &settings.pin,
            pin_n: settings.pin_n,
            pin_gb: settings.pin_gb,
            ram_avail_bytes: ram_budget,
            autopin: settings.autopin,
            cap,
            snap,
            history: Some(&in_use),
            rank: settings.pin_rank,
        };
        let sizes: Vec<u64> = {
            let store = &routed.store;
            (0..=store.layers())
                .map(|layer| store.expert_bytes(layer))
                .collect()
        };
        let plan = routed
            .telemetry
            .plan_pins(&request, &|layer| sizes.get(layer).copied().unwrap_or(0));
        let started = Instant::now();
        let tier = fill_expert_tier(settings, &routed, &plan)?;
        let vram = plan
            .pins
            .iter()
            .filter(|pin| tier.contains(pin.layer, pin.expert))
            .count();
        // The MTP row of a model whose draft head is absent has no experts to pin.
        let in_ram: Vec<(usize, usize)> = plan
            .pins
            .iter()
            .filter(|pin| !tier.contains(pin.layer, pin.expert))
            .filter(|pin| layer_has_experts(&sizes, pin.layer))
            .map(|pin| (pin.layer, pin.expert))
            .collect();
        routed.pin(&in_ram)?;
        routed.tier = tier;
        let skipped = routed.pins_skipped();
        if skipped > 0 {
            eprintln!(
                "[PIN] {skipped} pins skipped: with streamed experts a pin takes one of its layer's {} slots, and each layer keeps one for the rest (raise the budget or lower PIN_N/PIN_GB)",
                routed.slots().0
            );
        }
        if let Some(line) = plan.line(vram, started.elapsed().as_secs_f64()) {
            crate::note!("{line}");
        }

        // The abstain rule watches pins chosen from a history, where experts stream and
        // pins take slots; with mapped experts a pin costs no slot and cannot lose to LRU.
        let from_history = matches!(
            plan.source,
            Some(PinSource::Auto(_) | PinSource::Autopin { .. })
        );
        if from_history && settings.pin_abstain && routed.slots().1 {
            // Each layer's ranking: what it holds, then the plan's reserve.
            let mut ranked = routed.pinned();
            let held: Vec<usize> = ranked.iter().map(Vec::len).collect();
            for pin in &plan.reserve {
                if let Some(layer) = ranked.get_mut(pin.layer) {
                    layer.push(pin.expert);
                }
            }
            let slots = routed.slots().0;
            routed
                .telemetry
                .watch_pins(PlacementGuard::new(slots, &ranked, &held));
        }
        Ok(())
    }

    /// After each generated token: the abstain rule's changes of pins, and a `REPIN` pass
    /// when one is due. Either may leave a RAM pin hotter than an expert of the VRAM tier,
    /// so each is followed by the tier's half of a pass ([`trade_vram`]).
    pub fn after_tokens(&mut self, engine: &dyn Engine, emitted: u64) -> Result<()> {
        let mut routed = engine.routed();
        let routed = &mut *routed;
        let verdicts = routed.telemetry.pin_verdicts();
        let moved = !verdicts.is_empty();
        for verdict in verdicts {
            let layer = verdict.layer;
            let unpin: Vec<_> = verdict.unpin.iter().map(|&e| (layer, e)).collect();
            routed.unpin(&unpin)?;
            let mut pinned = Vec::new();
            for &expert in &verdict.pin {
                if !routed.pin(&[(layer, expert)])?.iter().all(|&now| now) {
                    break;
                }
                pinned.push((layer, expert));
            }
            if pinned.len() < verdict.pin.len() {
                // The store had no slot for a pin (read-ahead holds part of them): the
                // layer keeps the pins it had, and the rule judges on from there.
                routed.unpin(&pinned)?;
                routed.telemetry.undo_pin_verdict(&verdict);
                continue;
            }
            eprintln!("{}", verdict_line(&verdict));
        }
        let due = self
            .repin
            .as_mut()
            .is_some_and(|schedule| schedule.tokens(emitted));
        if !due {
            if moved {
                trade_vram(routed)?;
            }
            return Ok(());
        }
        let started = Instant::now();
        let pinned = routed.pinned();
        let swaps = plan_repin(routed.telemetry.session_heat(), &pinned, REPIN_PASS_LIMIT);
        for swap in &swaps {
            routed.unpin(&[(swap.layer, swap.evict)])?;
            routed.pin(&[(swap.layer, swap.admit)])?;
        }
        let millis = started.elapsed().as_secs_f64() * 1e3;
        for swap in &swaps {
            eprintln!("{}", swap.line("RAM", millis));
        }
        trade_vram(routed)?;
        routed.telemetry.cool_session_heat();
        Ok(())
    }

    /// `coli serve`'s save after each turn: the history, and the trace flushed, so that a
    /// killed server loses at most the turn in progress. `COLI_USAGE_DECAY` applies at
    /// every save, as colibri's serve modes apply it: a half-life in turns. A failure is
    /// said on stderr and the server goes on; the next save carries the counts.
    pub fn save_turn(&mut self, engine: &dyn Engine) {
        let mut routed = engine.routed();
        let telemetry = &mut routed.telemetry;
        let unsaved = telemetry.unsaved_selections();
        if let Err(err) = telemetry.save_history(&self.history, self.save) {
            eprintln!(
                "[USAGE] save failed: {err} \u{2014} {unsaved} selections wait for the next turn's save"
            );
        }
        if let Err(err) = telemetry.flush_trace() {
            eprintln!("[ROUTE_TRACE] write failed: {err}");
        }
    }

    /// The end of a run (also after an interrupted generation): the history save
    /// (generating runs only), the `STATS` dump and the trace flush. Each is attempted
    /// whatever happened to the others; a failure is said on stderr with what was lost,
    /// and makes the exit status 1 (the run itself finished; 2 stays "refused").
    pub fn finish(&mut self, engine: &dyn Engine, kind: RunKind) -> ExitCode {
        let mut routed = engine.routed();
        let telemetry = &mut routed.telemetry;
        let mut failed = false;
        if kind == RunKind::Generating {
            let unsaved = telemetry.unsaved_selections();
            // The outcome's lines are printed by the save itself.
            if let Err(err) = telemetry.save_history(&self.history, self.save) {
                eprintln!(
                    "[USAGE] save failed: {err} \u{2014} this run's {unsaved} selections are in no history (what is on disk is unchanged)"
                );
                failed = true;
            }
        }
        if let Some(stats) = &self.stats {
            if let Err(err) = telemetry.dump_stats(stats) {
                eprintln!("[STATS] not written: {err}");
                failed = true;
            }
        }
        if let Err(err) = telemetry.flush_trace() {
            eprintln!("[ROUTE_TRACE] write failed: {err}");
            failed = true;
        }
        if failed {
            ExitCode::from(1)
        } else {
            ExitCode::SUCCESS
        }
    }
}

/// The VRAM tier `GPU_EXPERT_GB` asks for: the plan's pins first (hottest first), then the
/// rest of the history by heat, then every other expert layer by layer, until the budget is
/// spent; so a budget that holds the whole model holds it with or without a history.
fn fill_expert_tier(
    settings: &Settings,
    routed: &RoutedExperts,
    plan: &PinPlan,
) -> Result<ExpertTier> {
    let gb = settings.gpu_expert_gb;
    if gb == 0.0 {
        return Ok(ExpertTier::default());
    }
    let Some(device) = backend::active() else {
        eprintln!("[GPU] GPU_EXPERT_GB={gb} ignored: no GPU backend is computing (see BACKEND)");
        return Ok(ExpertTier::default());
    };
    if routed.remote.is_some() {
        // The ranks compute every routed expert; a tier here would hold pins they lack.
        eprintln!("[GPU] GPU_EXPERT_GB={gb} ignored: in an MPI job the expert ranks compute the routed experts");
        return Ok(ExpertTier::default());
    }
    let ranked = rank(routed.telemetry.counts());
    let store = &routed.store;
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

/// The VRAM tier's half of a pass ([`plan_vram_repin`]): each trade puts a hot RAM pin on
/// the device and pins the expert it replaces in RAM in its stead, then prints its
/// `[REPIN] VRAM` line. Nothing without a tier.
fn trade_vram(routed: &mut RoutedExperts) -> Result<()> {
    let Some(device) = backend::active().filter(|_| !routed.tier.is_empty()) else {
        return Ok(());
    };
    let resident = routed.tier.by_layer(routed.store.layers());
    let heat = routed.telemetry.session_heat();
    let swaps = plan_vram_repin(heat, &resident, &routed.pinned(), REPIN_PASS_LIMIT);
    for swap in swaps {
        let started = Instant::now();
        let (layer, evict, admit) = (swap.layer, swap.evict, swap.admit);
        if !routed
            .tier
            .swap(device, &routed.store, layer, evict, admit)?
        {
            continue;
        }
        routed.unpin(&[(layer, admit)])?;
        routed.pin(&[(layer, evict)])?;
        let millis = started.elapsed().as_secs_f64() * 1e3;
        eprintln!("{}", swap.line("VRAM", millis));
    }
    Ok(())
}

fn layer_has_experts(sizes: &[u64], layer: usize) -> bool {
    sizes.get(layer).is_some_and(|&bytes| bytes > 0)
}

/// The `[PIN]` line for a change of a layer's pins by the abstain rule.
fn verdict_line(v: &Verdict) -> String {
    let Verdict {
        layer,
        from,
        from_hits,
        to,
        to_hits,
        lookups,
        ..
    } = v;
    let held = match from {
        0 => format!("LRU alone hit {from_hits} of {lookups} lookups"),
        n => format!("with {n} pinned it hit {from_hits} of {lookups} lookups"),
    };
    let (other, outcome) = match to {
        0 => ("LRU alone".to_string(), "given up, LRU for now".to_string()),
        n => (
            format!("with the history's top {n} pinned it"),
            format!("{n} pinned from here"),
        ),
    };
    format!(
        "[PIN] layer {layer}: {held}; {other} would have hit {to_hits} \u{2014} {outcome} (PIN_ABSTAIN=0 keeps the pins fixed)"
    )
}
