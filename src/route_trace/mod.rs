//! Routing telemetry shared by every engine: selection counters, the persistent
//! `.coli_usage` history, the `ROUTE_TRACE` stream, and the pin placement that reads them.
//!
//! Engines own no counters and no file format. An engine creates one [`RouteTrace`], drops
//! the rows of its non-routing layers, and calls [`MoeCall::route`] once per routing
//! decision, after the final gate normalisation. Everything else (file bytes, trust,
//! merging, tracing, placement) lives here:
//!
//! - `identity`: the engine id (FNV-1a-32 of the name) and the known-name table.
//! - `counters`: the count table and the dropped-row admission rule.
//! - `scan`: the history text exactly as the classic C `fscanf` loop tokenises it.
//! - `history`: reading (v1 text, legacy text, IKU1 via `iku1`), refusals, notices.
//! - `save`: the writer, decay, `USAGE_SAVE`, lock + re-read + merge + atomic replace.
//! - `trace_stream`: the `ROUTE_TRACE` file; `cfmt`: C `%.Nf` number text.
//! - `placement`: PIN / PIN=auto / PIN_N / PIN_GB / AUTOPIN plans; `repin`: live REPIN.

mod cfmt;
mod counters;
pub mod history;
mod identity;
pub mod iku1;
pub mod placement;
pub mod repin;
pub mod save;
pub mod scan;
mod trace_stream;

use std::io;
use std::path::Path;

pub use cfmt::{fixed, push_fixed, push_fixed_f32};
pub use counters::{Counters, ShapeError};
pub use history::{Layout, ReadOutcome, ReadReport, Refusal, Role, Trust};
pub use identity::{EngineId, FORMAT_VERSION, KNOWN_ENGINES, UNKNOWN_ENGINE};
pub use placement::{PinGb, PinPlan, PinRequest, PinSetting, PinSource};
pub use repin::{RepinSchedule, SessionHeat, Swap};
pub use save::{Decay, Diverted, SaveError, SaveOptions, SaveOutcome};
pub use trace_stream::TraceStream;

/// The per-run telemetry facility: one per process, owned by the engine's driver.
///
/// Order of use: [`RouteTrace::new`], [`RouteTrace::drop_row`] for each non-routing
/// layer, [`RouteTrace::open_trace`] when `ROUTE_TRACE` is set, [`RouteTrace::load_history`],
/// then placement ([`RouteTrace::plan_pins`]) before the first token; during the run one
/// [`RouteTrace::moe_call`] per MoE-layer invocation with one [`MoeCall::route`] per row;
/// at the end (and on SIGINT/SIGTERM) [`RouteTrace::save_history`] and
/// [`RouteTrace::flush_trace`].
#[derive(Debug)]
pub struct RouteTrace {
    engine: String,
    counts: Counters,
    /// The counts as they were at the last load or save: what the history on disk already
    /// holds of ours, so a save adds only what was gained since.
    baseline: Counters,
    heat: SessionHeat,
    trace: Option<TraceStream>,
}

impl RouteTrace {
    /// Counters for rows `0..=n_layers` (the last row is an MTP head) of `n_experts`.
    pub fn new(engine: &str, n_layers: usize, n_experts: usize) -> Result<Self, ShapeError> {
        let counts = Counters::new(n_layers, n_experts)?;
        Ok(RouteTrace {
            engine: engine.to_string(),
            baseline: counts.clone(),
            heat: SessionHeat::new(n_layers + 1, n_experts),
            counts,
            trace: None,
        })
    }

    /// The engine name given at construction.
    pub fn engine(&self) -> &str {
        &self.engine
    }

    /// The engine's id, as written in the `-2` record.
    pub fn engine_id(&self) -> EngineId {
        EngineId::of(&self.engine)
    }

    /// Marks a layer that does not route (a dense layer, an absent MTP row): it admits no
    /// history record, counts nothing and is never written.
    pub fn drop_row(&mut self, layer: usize) {
        self.counts.drop_row(layer);
        self.baseline.drop_row(layer);
    }

    /// The counters: the loaded history plus this run's selections (after a save, the
    /// merged history as written).
    pub fn counts(&self) -> &Counters {
        &self.counts
    }

    /// This session's routing heat, for REPIN.
    pub fn session_heat(&self) -> &SessionHeat {
        &self.heat
    }

    /// Halves the session heat; call after each REPIN pass.
    pub fn cool_session_heat(&mut self) {
        self.heat.halve();
    }

    /// Opens (truncating) the trace file and prints `[ROUTE_TRACE] logging routing to
    /// <path>`, or `[ROUTE_TRACE] cannot open <path>` and returns the error; the run can go
    /// on untraced.
    pub fn open_trace(&mut self, path: &Path) -> io::Result<()> {
        match TraceStream::create(path) {
            Ok(t) => {
                eprintln!("{}", trace_stream::opened_line(path));
                self.trace = Some(t);
                Ok(())
            }
            Err(e) => {
                eprintln!("{}", trace_stream::failed_line(path));
                Err(e)
            }
        }
    }

    /// Whether a trace is being written.
    pub fn tracing(&self) -> bool {
        self.trace.is_some()
    }

    /// Pushes buffered trace lines to the file (call at exit and on SIGINT/SIGTERM);
    /// returns the first write error the trace met, if any.
    pub fn flush_trace(&mut self) -> io::Result<()> {
        self.trace.as_mut().map_or(Ok(()), TraceStream::flush)
    }

    /// Starts one MoE-layer invocation. Route each of its rows through the returned
    /// [`MoeCall`]; dropping it ends the invocation, which advances the trace's `call`
    /// number (also when no row was routed, e.g. a device-side router).
    pub fn moe_call(&mut self, layer: usize) -> MoeCall<'_> {
        MoeCall { rt: self, layer }
    }

    /// Loads the history at `path` into the counters (untrusted: the engine found the path)
    /// and prints the outcome, including `[USAGE] expert history: N selections (<path>)`.
    /// Returns the outcome so the caller can tell a missing, refused or partial history
    /// apart; a save never overwrites a file that was not read completely.
    pub fn load_history(&mut self, path: &Path) -> ReadOutcome {
        let mut loaded = self.counts.zeroed_like();
        let outcome = history::load(path, &self.engine, &mut loaded);
        self.counts.absorb(&loaded);
        self.baseline.absorb(&loaded);
        outcome
    }

    /// Saves the history at `path`: under the lock `<path>.lock`, re-reads the file, adds
    /// the selections gained since the last load or save, applies the decay, writes the
    /// result atomically and prints `[STATS] <total> selections across <n> distinct
    /// experts -> <path>`. A file that cannot be read completely is left untouched and the
    /// counts go to `<path>.<engine>` (reported in the outcome and on stderr).
    pub fn save_history(
        &mut self,
        path: &Path,
        opts: SaveOptions,
    ) -> Result<SaveOutcome, SaveError> {
        let (outcome, merged) =
            save::merge_save(path, &self.engine, &self.counts, &self.baseline, opts)?;
        if let Some(m) = merged {
            self.baseline = m.clone();
            self.counts = m;
        }
        Ok(outcome)
    }

    /// `STATS=<file>`: writes the counters as they are (no merge, no decay) atomically and
    /// prints the `[STATS]` line. Returns (total, distinct).
    pub fn dump_stats(&self, path: &Path) -> Result<(i64, u64), SaveError> {
        save::write_atomically(
            path,
            save::render(&self.counts, self.engine_id()).as_bytes(),
        )?;
        let (total, distinct) = (self.counts.total(), self.counts.distinct());
        eprintln!("{}", save::stats_line(total, distinct, path));
        Ok((total, distinct))
    }

    /// Decides the startup pins from `PIN`, `PIN_N`, `PIN_GB` and `AUTOPIN` (see
    /// [`placement::plan_pins`]). Call after [`RouteTrace::load_history`] and before routing.
    pub fn plan_pins(&self, req: &PinRequest<'_>, expert_bytes: &dyn Fn(usize) -> u64) -> PinPlan {
        placement::plan_pins(&self.counts, &self.engine, req, expert_bytes)
    }
}

/// One MoE-layer invocation in progress (see [`RouteTrace::moe_call`]).
#[derive(Debug)]
pub struct MoeCall<'a> {
    rt: &'a mut RouteTrace,
    layer: usize,
}

impl MoeCall<'_> {
    /// One routing decision for batch row `row`: the selected expert ids in selection
    /// order and the gates the layer applies to them (after top-p, renormalisation and
    /// routed scaling). Counts each id on this layer (a dropped row counts nothing), feeds
    /// the session heat, and writes the trace line when tracing.
    ///
    /// # Panics
    /// If `ids` and `gates` differ in length: a router always has one gate per expert.
    pub fn route(&mut self, row: usize, ids: &[usize], gates: &[f32]) {
        assert_eq!(ids.len(), gates.len(), "one gate per routed expert");
        let rt = &mut *self.rt;
        if rt.counts.routes(self.layer) {
            rt.counts.count(self.layer, ids);
            rt.heat.record(self.layer, ids);
        }
        if let Some(t) = rt.trace.as_mut() {
            t.write(row, self.layer, ids, gates);
        }
    }
}

impl Drop for MoeCall<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.rt.trace.as_mut() {
            t.end_call();
        }
    }
}
