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
//! - `history`: reading (v1 text, legacy text, IKU1 via `iku1`), refusals, notices, and
//!   what a rewrite must keep.
//! - `home`: which file is this engine's history (the default path or the per-engine
//!   path beside it), and the load.
//! - `save`: the writer, decay, `USAGE_SAVE`, lock + re-read + merge + atomic replace.
//! - `trace_stream`: the `ROUTE_TRACE` file; `cfmt`: C `%.Nf` number text.
//! - `placement`: PIN / PIN=auto / PIN_N / PIN_GB / AUTOPIN plans; `repin`: live REPIN;
//!   `guard`: the abstain rule's shadow caches, which give up pins that do not fit the text.

mod cfmt;
mod counters;
pub mod guard;
pub mod history;
pub mod home;
mod identity;
pub mod iku1;
pub mod placement;
pub mod repin;
pub mod save;
pub mod scan;
mod trace_stream;
pub mod transitions;

use std::collections::BTreeMap;
use std::io;
use std::ops::Range;
use std::path::Path;

pub use cfmt::{fixed, push_fixed, push_fixed_f32};
pub use counters::{Counters, ShapeError};
pub use history::{Keep, Layout, ReadOutcome, ReadReport, Refusal, Trust};
pub use home::{Elsewhere, Home};
pub use identity::{EngineId, FORMAT_VERSION, KNOWN_ENGINES, UNKNOWN_ENGINE};
pub use placement::{PinGb, PinPlan, PinRank, PinRequest, PinSetting, PinSource};
pub use repin::{RepinSchedule, SessionHeat, Swap};
pub use save::{Decay, Diverted, SaveError, SaveOptions, SaveOutcome};
pub use trace_stream::{TraceLost, TraceStream};

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
    /// The counts of a frozen file (read at load, never written; see `home`), which a
    /// save adds back to the merged table it wrote.
    frozen: Counters,
    /// Where the history lives, once loaded or saved.
    home: Option<Home>,
    heat: SessionHeat,
    trace: Option<TraceStream>,
    /// The abstain rule's shadows, when history pins are watched, and the distinct
    /// experts of the MoE call in progress.
    guard: Option<guard::PlacementGuard>,
    call_experts: Vec<usize>,
    /// The rows of the forward in progress that sequences own ([`RouteTrace::own_rows`]).
    owners: Owners,
    /// The batch row of each row an engine routes, while it runs part of a batch as a
    /// batch of its own ([`RouteTrace::map_rows`]).
    row_map: Option<Vec<usize>>,
    /// By batch row: the layer of its last routing decision and the experts chosen, from
    /// which its next decision counts a transition.
    last_routes: Vec<(usize, Vec<usize>)>,
    /// When a live view asked ([`RouteTrace::count_steps`]): the selections of each
    /// (layer, expert) since the last [`RouteTrace::take_steps`], row-major.
    steps: Option<Vec<u32>>,
}

/// A sequence's rows in the forward in progress (`coli serve`'s batches): their
/// selections are held apart, per sequence, until its turn ends ([`RouteTrace::end_turn`]),
/// so that a history saved while other turns run holds exactly the turns that finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowOwner {
    pub rows: Range<usize>,
    pub sequence: u64,
}

/// The sequence that owns a run's forward while [`RouteTrace::hold_step`] holds it (a
/// server's sequences are numbered from 0 and never reach it).
const RUN_STEP: u64 = u64::MAX;

/// Who owns the rows of the forward in progress, and the rows whose routing is kept.
#[derive(Debug, Default)]
struct Owners {
    owners: Vec<RowOwner>,
    /// Selections of sequences whose turns have not ended.
    held: Vec<(u64, Counters)>,
    /// Per kept row: each MoE call's selected ids, in call order.
    kept: BTreeMap<usize, Vec<Vec<u32>>>,
}

impl RouteTrace {
    /// Counters for rows `0..=n_layers` (the last row is an MTP head) of `n_experts`.
    pub fn new(engine: &str, n_layers: usize, n_experts: usize) -> Result<Self, ShapeError> {
        let counts = Counters::new(n_layers, n_experts)?;
        Ok(RouteTrace {
            engine: engine.to_string(),
            baseline: counts.clone(),
            frozen: counts.clone(),
            home: None,
            heat: SessionHeat::new(n_layers + 1, n_experts),
            counts,
            trace: None,
            guard: None,
            call_experts: Vec::new(),
            owners: Owners::default(),
            row_map: None,
            last_routes: Vec::new(),
            steps: None,
        })
    }

    /// From now on, also count each routing layer's selections apart, until they are
    /// taken with [`RouteTrace::take_steps`] (`coli serve`'s live view of the routing).
    pub fn count_steps(&mut self) {
        let cells = (self.counts.n_layers() + 1).saturating_mul(self.counts.n_experts());
        self.steps.get_or_insert_with(|| vec![0; cells]);
    }

    /// The selections of each (layer, expert) since the last call (row-major, rows
    /// `0..=n_layers` of `n_experts`), swapped into `into` (whose old values are zeroed
    /// and become the next count); `into` is left empty when [`RouteTrace::count_steps`]
    /// was never called.
    pub fn take_steps(&mut self, into: &mut Vec<u32>) {
        match self.steps.as_mut() {
            Some(steps) => {
                into.clear();
                into.resize(steps.len(), 0);
                std::mem::swap(steps, into);
            }
            None => into.clear(),
        }
    }

    /// The next forwards' rows `owners[i].rows` belong to sequence `owners[i].sequence`
    /// until the next call: their selections are held for the sequence (see
    /// [`RouteTrace::end_turn`]) and, for the rows in `keep`, their routing kept for
    /// [`RouteTrace::row_routes`]. Rows no owner names are counted at once, as in a run.
    pub fn own_rows(&mut self, owners: Vec<RowOwner>, keep: &[usize]) {
        for owner in &owners {
            if !self.owners.held.iter().any(|(s, _)| *s == owner.sequence) {
                let empty = self.counts.zeroed_like();
                self.owners.held.push((owner.sequence, empty));
            }
        }
        self.owners.owners = owners;
        self.owners.kept = keep.iter().map(|&row| (row, Vec::new())).collect();
    }

    /// While an engine runs part of a batch as a batch of its own (Kimi K3's prefill
    /// rounds), its row `r` is the batch's row `map[r]`: routes, owners, kept routing and
    /// the trace then speak of batch rows. `None` ends it.
    pub fn map_rows(&mut self, map: Option<Vec<usize>>) {
        self.row_map = map;
    }

    /// Each MoE call's selected ids for row `row` of the last forward, when
    /// [`RouteTrace::own_rows`] asked to keep it.
    pub fn row_routes(&self, row: usize) -> Option<&[Vec<u32>]> {
        self.owners.kept.get(&row).map(Vec::as_slice)
    }

    /// The turn of `sequence` ended: its held selections join the counts (and the next
    /// save) when it `finished`, and are dropped when it failed part-way.
    pub fn end_turn(&mut self, sequence: u64, finished: bool) {
        let held = &mut self.owners.held;
        if let Some(at) = held.iter().position(|(s, _)| *s == sequence) {
            let (_, counts) = held.swap_remove(at);
            if finished {
                self.counts.absorb(&counts);
            }
        }
        self.owners.owners.retain(|o| o.sequence != sequence);
    }

    /// A forward of a run's own (not a server sequence's) begins: its selections are held
    /// until [`RouteTrace::end_step`], so that a forward that fails part-way (an expert rank
    /// that stopped answering, a shard that changed under it) adds nothing to the history.
    pub fn hold_step(&mut self) {
        let whole = RowOwner {
            rows: 0..usize::MAX,
            sequence: RUN_STEP,
        };
        self.own_rows(vec![whole], &[]);
    }

    /// The forward begun by [`RouteTrace::hold_step`] ended: its selections join the counts
    /// when it `completed`, and are dropped when it failed.
    pub fn end_step(&mut self, completed: bool) {
        self.end_turn(RUN_STEP, completed);
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
        self.frozen.drop_row(layer);
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

    /// Watches history pins with the abstain rule (see [`guard`]): from now on every MoE
    /// call feeds its shadows.
    pub fn watch_pins(&mut self, guard: guard::PlacementGuard) {
        self.guard = Some(guard);
    }

    /// The layers whose pins the abstain rule changes now (see
    /// [`guard::PlacementGuard::verdicts`]); empty when nothing is watched.
    pub fn pin_verdicts(&mut self) -> Vec<guard::Verdict> {
        self.guard
            .as_mut()
            .map_or_else(Vec::new, guard::PlacementGuard::verdicts)
    }

    /// A verdict the store could not carry out (see [`guard::PlacementGuard::undo`]).
    pub fn undo_pin_verdict(&mut self, verdict: &guard::Verdict) {
        if let Some(guard) = self.guard.as_mut() {
            guard.undo(verdict);
        }
    }

    /// Halves the session heat; call after each REPIN pass.
    pub fn cool_session_heat(&mut self) {
        self.heat.halve();
    }

    /// Opens the trace file (see [`TraceStream::create`]) and prints `[ROUTE_TRACE] logging
    /// routing to <path>`, or `[ROUTE_TRACE] cannot open <path>` and returns the error: an
    /// `InvalidInput` error is a refusal (the file holds something a trace must not
    /// replace), any other a failure to create it, after which the run can go on untraced.
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
    /// returns the first write error the trace met, if any, with what it cost.
    pub fn flush_trace(&mut self) -> Result<(), TraceLost> {
        self.trace.as_mut().map_or(Ok(()), TraceStream::flush)
    }

    /// Starts one MoE-layer invocation. Route each of its rows through the returned
    /// [`MoeCall`]; dropping it ends the invocation, which advances the trace's `call`
    /// number (also when no row was routed, e.g. a device-side router).
    pub fn moe_call(&mut self, layer: usize) -> MoeCall<'_> {
        MoeCall { rt: self, layer }
    }

    /// Loads this engine's history from the default path `path` into the counters: the
    /// file there when it is this engine's, else the per-engine path beside it (see
    /// [`home`]), and prints what it found, including `[USAGE] expert history: N
    /// selections (<path>)`. Returns the outcome of reading `path` itself, so the caller
    /// can tell a missing, refused or partial history apart. With `elsewhere`, a history
    /// that cannot be written where it is lives in the user's state directory.
    pub fn load_history(&mut self, path: &Path, elsewhere: Option<&Elsewhere>) -> ReadOutcome {
        let loaded = home::load(path, elsewhere, &self.engine, &self.counts);
        self.counts.absorb(&loaded.counts);
        self.baseline.absorb(&loaded.counts);
        self.frozen.absorb(&loaded.frozen);
        self.home = Some(loaded.home);
        loaded.default_outcome
    }

    /// Selections counted since the last load or save: what a save would add.
    pub fn unsaved_selections(&self) -> i64 {
        self.counts.total() - self.baseline.total()
    }

    /// Where the history lives, once [`RouteTrace::load_history`] or a save decided it.
    pub fn home(&self) -> Option<&Home> {
        self.home.as_ref()
    }

    /// Saves the history whose default path is `path` (where the load found it, see
    /// [`home`]): under the file's lock, re-reads it, adds the selections gained since the
    /// last load or save, applies the decay, writes the result atomically with everything
    /// the file held that this engine cannot, and prints `[STATS] <total> selections
    /// across <n> distinct experts -> <path>`. A default path found holding another's
    /// file is left untouched and the counts go to `<path>.<engine>` (reported in the
    /// outcome and on stderr).
    pub fn save_history(
        &mut self,
        path: &Path,
        opts: SaveOptions,
    ) -> Result<SaveOutcome, SaveError> {
        let home = match &mut self.home {
            Some(h) if h.default == path => h,
            slot => slot.insert(Home::at(path)),
        };
        let (outcome, merged) =
            save::merge_save(home, &self.engine, &self.counts, &self.baseline, opts)?;
        if let Some(mut m) = merged {
            m.absorb(&self.frozen);
            self.baseline = m.clone();
            self.counts = m;
        }
        Ok(outcome)
    }

    /// Why `STATS=<path>` must not be written, or `None`: it may be missing, empty, or a
    /// counts file (a stats dump or any history text) other than this run's history.
    /// Checked before the first token and again at the dump.
    pub fn stats_target_problem(&self, path: &Path) -> Option<String> {
        let ours = self
            .home
            .iter()
            .flat_map(|h| [&h.default, &h.save_to].into_iter().chain(&h.frozen));
        for file in ours {
            if crate::files::same_file(path, file) {
                return Some(format!(
                    "it is this run's history ({}); STATS writes a separate snapshot of the counts",
                    file.display()
                ));
            }
        }
        save::counts_file_problem(path)
    }

    /// `STATS=<file>`: writes the counters as they are (no merge, no decay) atomically and
    /// prints the `[STATS]` line. Returns (total, distinct). A file that is not a counts
    /// file, or is this run's history, is refused and left as it is.
    pub fn dump_stats(&self, path: &Path) -> Result<(i64, u64), SaveError> {
        if let Some(why) = self.stats_target_problem(path) {
            return Err(SaveError::Refused {
                path: path.to_path_buf(),
                why,
            });
        }
        let written = save::write_file(
            path,
            save::render(&self.counts, self.engine_id()).as_bytes(),
        )?;
        let (total, distinct) = (self.counts.total(), self.counts.distinct());
        eprintln!("{}", save::stats_line(total, distinct, &written));
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
        let row = rt
            .row_map
            .as_ref()
            .and_then(|map| map.get(row).copied())
            .unwrap_or(row);
        if rt.last_routes.len() <= row {
            rt.last_routes
                .resize_with(row + 1, || (usize::MAX, Vec::new()));
        }
        let last = &mut rt.last_routes[row];
        if rt.counts.routes(self.layer) {
            let owners = &mut rt.owners;
            let owner = owners.owners.iter().find(|o| o.rows.contains(&row));
            let held = owner.and_then(|o| {
                let sequence = o.sequence;
                owners.held.iter_mut().find(|(s, _)| *s == sequence)
            });
            let counts = match held {
                Some((_, counts)) => counts,
                None => &mut rt.counts,
            };
            counts.count(self.layer, ids);
            // Only a step to the next routing layer counts (a new forward starts over).
            counts.count_transition(last.0, &last.1, self.layer, ids);
            rt.heat.record(self.layer, ids);
            if let Some(steps) = rt.steps.as_mut() {
                let n_experts = rt.counts.n_experts();
                for &id in ids.iter().filter(|&&id| id < n_experts) {
                    if let Some(cell) = steps.get_mut(self.layer * n_experts + id) {
                        *cell = cell.saturating_add(1);
                    }
                }
            }
        }
        last.0 = self.layer;
        last.1.clear();
        last.1.extend_from_slice(ids);
        if let Some(t) = rt.trace.as_mut() {
            t.write(row, self.layer, ids, gates);
        }
        if rt.guard.is_some() {
            rt.call_experts.extend_from_slice(ids);
        }
        if let Some(kept) = rt.owners.kept.get_mut(&row) {
            kept.push(ids.iter().map(|&id| id as u32).collect());
        }
    }
}

impl Drop for MoeCall<'_> {
    fn drop(&mut self) {
        if let Some(t) = self.rt.trace.as_mut() {
            t.end_call();
        }
        if let Some(g) = self.rt.guard.as_mut() {
            // The store looks up a call's distinct experts in ascending order.
            let experts = &mut self.rt.call_experts;
            experts.sort_unstable();
            experts.dedup();
            g.observe(self.layer, experts);
            experts.clear();
        }
    }
}
