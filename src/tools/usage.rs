//! `coli usage show | merge | migrate`: inspecting and combining `.coli_usage` histories.
//!
//! Reading goes through `history_file` (so through `route_trace`'s reader) and writing
//! through `route_trace::save::render` and `files::replace`, so a merged or migrated file
//! is byte for byte what an engine would have written for the same counts, replaces its
//! destination only by a rename of a complete file, and does so under the destination's
//! lock, the one an engine's save takes.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Serialize;

use super::history_file::{self, Declared, History, Opened};
use crate::files;
use crate::route_trace::history::Layout;
use crate::route_trace::{save, Counters, EngineId};

/// `coli usage show`.
#[derive(clap::Args, Debug)]
pub struct ShowArgs {
    /// The history: `.coli_usage` text, a headerless legacy file (`stats.txt`), or
    /// Inkling's binary IKU1.
    pub path: PathBuf,
    /// Experts listed per layer, hottest first.
    #[arg(long, default_value_t = 8)]
    pub top: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `coli usage merge`.
#[derive(clap::Args, Debug)]
pub struct MergeArgs {
    /// Histories to add up: same engine and same shape.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,
    /// The merged history. An existing file is replaced (atomically, under the lock an
    /// engine's save takes) only with --force, and only when it is a history; it may be
    /// one of the inputs.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Replace an existing output, and merge even when the inputs name different engines
    /// or shapes, or were not read completely; says what it did.
    #[arg(long)]
    pub force: bool,
}

/// `coli usage migrate`.
#[derive(clap::Args, Debug)]
pub struct MigrateArgs {
    /// An Inkling IKU1 binary history.
    pub input: PathBuf,
    /// The text history to write. An existing file is replaced (atomically, under the
    /// lock an engine's save takes) only with --force; it may be the input.
    #[arg(short, long)]
    pub output: PathBuf,
    /// The Inkling model the history counts (its directory, with `config.json`): which
    /// rows route depends on it. Default: the input's directory, where Inkling keeps it.
    #[arg(long, value_name = "DIR")]
    pub snap: Option<PathBuf>,
    /// Replace an existing output, and write what was read even when the IKU1 table is
    /// cut short or has trailing bytes.
    #[arg(long)]
    pub force: bool,
}

/// One expert in a layer's top list.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct TopExpert {
    /// Expert id.
    pub expert: usize,
    /// Selections.
    pub count: u32,
    /// Share of the layer's selections.
    pub share: f64,
}

/// One counter row in `show`.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct LayerSummary {
    /// Layer (counter row).
    pub layer: usize,
    /// Selections on the layer.
    pub selections: u64,
    /// Experts with at least one selection.
    pub experts: usize,
    /// The hottest experts (count descending, then id ascending).
    pub top: Vec<TopExpert>,
}

/// Everything `show` reports.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct ShowReport {
    /// The file.
    pub path: String,
    /// Its size.
    pub bytes: usize,
    /// `text`, `legacy`, `iku1` or `empty`; `refused` when no engine reads it.
    pub layout: String,
    /// The `-2` record's format version.
    pub format_version: Option<i64>,
    /// The writer by name (`an unknown engine` when its id is not a known name).
    pub engine: Option<String>,
    /// The writer's id.
    pub engine_id: Option<u32>,
    /// Declared `n_layers` (the last counter row; the table has `n_layers + 1` rows).
    pub n_layers: Option<usize>,
    /// Declared experts per layer.
    pub n_experts: Option<usize>,
    /// Admitted selections.
    pub selections: i64,
    /// Non-zero counters.
    pub distinct: u64,
    /// Whether every byte was understood and every record admitted.
    pub complete: bool,
    /// Why not, when not.
    pub problems: Option<String>,
    /// What an engine does with the file, and why.
    pub verdict: String,
    /// Counter rows with selections.
    pub layers: Vec<LayerSummary>,
}

fn layout_name(h: &History) -> &'static str {
    match h.layout() {
        _ if h.bytes == 0 => "empty",
        Layout::Text => "text",
        Layout::Legacy => "legacy",
        Layout::Iku1 => "iku1",
    }
}

/// The `top` hottest experts of every row with selections.
pub fn layer_summaries(counts: &Counters, top: usize) -> Vec<LayerSummary> {
    counts
        .nonzero_rows()
        .map(|(layer, mut hot)| {
            let selections: u64 = hot.iter().map(|&(_, c)| u64::from(c)).sum();
            let experts = hot.len();
            hot.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            hot.truncate(top);
            LayerSummary {
                layer,
                selections,
                experts,
                top: hot
                    .into_iter()
                    .map(|(expert, count)| TopExpert {
                        expert,
                        count,
                        share: f64::from(count) / selections as f64,
                    })
                    .collect(),
            }
        })
        .collect()
}

/// What the engine that wrote `h` (and every other engine) does with it.
pub fn verdict(h: &History) -> String {
    let d = &h.declared;
    let total = h.report.total;
    let mut v = String::new();
    if h.bytes == 0 {
        v.push_str(
            "an empty history: every engine starts from nothing, and PIN=auto falls back to \
             SNAP/stats.txt",
        );
        return v;
    }
    let shape = d
        .dims
        .map(|(l, e)| format!("{l} layers x {e} experts"))
        .unwrap_or_default();
    match (h.layout(), d.writer_name(), d.dims) {
        (Layout::Iku1, _, None) => v.push_str(
            "the IKU1 header is cut short: inkling reads it as empty and never overwrites it",
        ),
        (Layout::Iku1, _, Some(_)) => {
            let _ = write!(
                v,
                "inkling with {shape} reads it ({total} selections) and its next save \
                 rewrites it as text (`coli usage migrate` does that now). inkling with \
                 another shape refuses it, named or not; any other engine refuses it unless \
                 it is named with PIN=<path> (placement only)"
            );
        }
        (Layout::Legacy, _, _) => {
            let _ = write!(
                v,
                "no header: every engine reads it without shape or identity checks and \
                 admits the records that fit its table ({total} selections here); the \
                 first save adds the headers"
            );
        }
        (Layout::Text, Some(name), _) if d.writer.and_then(EngineId::name).is_none() => {
            let id = d.writer.map_or("not a u32".to_string(), |w| w.to_string());
            let _ = write!(
                v,
                "written by {name} (id {id}): every engine refuses it unless it is named \
                 with PIN=<path> (placement only)"
            );
        }
        (Layout::Text, Some(name), Some(_)) => {
            let _ = write!(
                v,
                "{name} with {shape} loads it ({total} selections) and adds its own \
                 counts at every save. {name} with another shape refuses it, named or not; \
                 any other engine refuses it unless it is named with PIN=<path> (placement \
                 only)"
            );
        }
        (Layout::Text, Some(name), None) => {
            let _ = write!(
                v,
                "{name} loads it whatever its shape (there is no -1 record), admitting the \
                 records that fit its table ({total} selections here); any other engine \
                 refuses it unless it is named with PIN=<path>"
            );
        }
        (Layout::Text, None, _) => {
            let _ = write!(
                v,
                "any engine with {shape} loads it ({total} selections): it has no -2 \
                 record to say which engine wrote it; an engine of another shape refuses it"
            );
        }
    }
    if !h.report.is_complete() {
        let owner = d.writer.and_then(EngineId::name).unwrap_or("the engine");
        let _ = match h.report.rewrite_blocker() {
            Some(why) => write!(
                v,
                ". Not read completely ({}): {owner} reads it at every load but never \
                 writes it ({why}); its saves go to {}.{owner}",
                h.report.problems(),
                h.path.display()
            ),
            None => write!(
                v,
                ". Not read completely ({}): {owner} uses what was read and keeps the rest \
                 as it is when it rewrites the file",
                h.report.problems()
            ),
        };
    }
    v
}

/// Builds the `show` report.
pub fn show_report(path: &Path, top: usize) -> Result<ShowReport> {
    Ok(match history_file::open(path)? {
        Opened::Read(h) => ShowReport {
            path: path.display().to_string(),
            bytes: h.bytes,
            layout: layout_name(&h).to_string(),
            format_version: h.declared.version,
            engine: h.declared.writer_name().map(str::to_string),
            engine_id: h.declared.writer.map(|w| w.0),
            n_layers: h.declared.dims.map(|d| d.0),
            n_experts: h.declared.dims.map(|d| d.1),
            selections: h.report.total,
            distinct: h.counts.distinct(),
            complete: h.report.is_complete(),
            problems: (!h.report.is_complete()).then(|| h.report.problems()),
            verdict: verdict(&h),
            layers: layer_summaries(&h.counts, top),
        },
        Opened::Refused {
            path,
            declared,
            refusal,
        } => ShowReport {
            bytes: std::fs::metadata(&path).map_or(0, |m| m.len() as usize),
            path: path.display().to_string(),
            layout: "refused".to_string(),
            format_version: declared.version,
            engine: declared.writer_name().map(str::to_string),
            engine_id: declared.writer.map(|w| w.0),
            n_layers: declared.dims.map(|d| d.0),
            n_experts: declared.dims.map(|d| d.1),
            selections: 0,
            distinct: 0,
            complete: false,
            problems: None,
            verdict: format!(
                "every engine refuses it and reads nothing from it: {}",
                refusal.message(&path)
            ),
            layers: Vec::new(),
        },
    })
}

/// The `show` report as text.
pub fn render_show(r: &ShowReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "history     {} ({} bytes)", r.path, r.bytes);
    let layout = match r.layout.as_str() {
        "text" => format!(
            "v1 text, format version {}",
            r.format_version
                .map_or("not declared".to_string(), |v| v.to_string())
        ),
        "legacy" => "legacy text (no header records)".to_string(),
        "iku1" => "Inkling IKU1 binary (read only)".to_string(),
        other => other.to_string(),
    };
    let _ = writeln!(s, "layout      {layout}");
    match (&r.engine, r.engine_id) {
        (Some(name), Some(id)) => {
            let _ = writeln!(s, "engine      {name} (id {id})");
        }
        (Some(name), None) => {
            let _ = writeln!(s, "engine      {name}");
        }
        _ => {
            let _ = writeln!(s, "engine      not declared");
        }
    }
    match (r.n_layers, r.n_experts) {
        (Some(l), Some(e)) => {
            let _ = writeln!(
                s,
                "shape       {l} layers x {e} experts (counter rows 0..={l})"
            );
        }
        _ => {
            let _ = writeln!(s, "shape       not declared");
        }
    }
    let _ = writeln!(
        s,
        "selections  {} across {} distinct experts",
        r.selections, r.distinct
    );
    let _ = writeln!(s, "verdict     {}", r.verdict);
    if r.layers.is_empty() {
        return s;
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "layer  selections  experts  top experts (id:count share)"
    );
    for l in &r.layers {
        let top: Vec<String> = l
            .top
            .iter()
            .map(|t| format!("{}:{} {:.1}%", t.expert, t.count, 100.0 * t.share))
            .collect();
        let _ = writeln!(
            s,
            "{:>5}  {:>10}  {:>7}  {}",
            l.layer,
            l.selections,
            l.experts,
            top.join("  ")
        );
    }
    s
}

/// `coli usage show`.
pub fn show(args: &ShowArgs) -> Result<()> {
    let report = show_report(&args.path, args.top)?;
    super::emit_report(&report, args.json, render_show)
}

fn dims_text(d: (usize, usize)) -> String {
    format!("{} layers x {} experts", d.0, d.1)
}

fn not_complete(h: &History) -> String {
    format!(
        "{} was not read completely ({})",
        h.path.display(),
        h.report.problems()
    )
}

/// `coli usage merge`: the sum of histories of one engine and shape. Returns what it did,
/// one line per `--force` decision, then the summary.
pub fn merge(inputs: &[PathBuf], output: &Path, force: bool) -> Result<Vec<String>> {
    for (i, a) in inputs.iter().enumerate() {
        if let Some(b) = inputs[..i].iter().find(|b| files::same_file(a, b)) {
            bail!(
                "{} and {} are the same file: merging it with itself would count its selections twice",
                b.display(),
                a.display()
            );
        }
    }
    let out_file = OutputHistory::claim(output)?;
    let hs = inputs
        .iter()
        .map(|p| history_file::open_readable(p))
        .collect::<Result<Vec<_>>>()?;
    let mut notes = Vec::new();
    for h in hs.iter().filter(|h| !h.report.is_complete()) {
        if !force {
            bail!(
                "{}: merging would lose what could not be read; --force merges what was read",
                not_complete(h)
            );
        }
        notes.push(format!(
            "--force: {}; merged what was read",
            not_complete(h)
        ));
    }
    let id = merged_identity(&hs, force, &mut notes)?;
    for h in hs
        .iter()
        .filter(|h| h.declared.writer.is_none() && !h.declared.writer_invalid)
    {
        notes.push(format!(
            "note: {} has no -2 record (any engine reads it); merged as {}'s",
            h.path.display(),
            id.describe()
        ));
    }
    let dims = merged_dims(&hs, force, &mut notes)?;
    let mut out = Counters::new(dims.0, dims.1)?;
    for h in &hs {
        let mut dropped = 0u64;
        for (l, e, c) in h.counts.nonzero() {
            if !out.holds(l as i64, e as i64) {
                dropped += u64::from(c);
                continue;
            }
            if out.get(l, e).checked_add(c).is_none() {
                bail!(
                    "layer {l} expert {e}: the sum exceeds a u32 counter at {}; nothing was written",
                    h.path.display()
                );
            }
            out.admit(l as i64, e as i64, c);
        }
        // Recent heat (`-5` records) adds up like the counts; a cell outside the merged
        // shape goes with its counts.
        for (l, e, heat) in h.counts.recent().into_iter().flat_map(Counters::nonzero) {
            out.admit_recent(l as i64, e as i64, heat);
        }
        // Expert transitions (`-3`/`-4` groups) add up edge by edge; the output keeps
        // each hot source's top successors, as an engine's save does.
        let ne = h.counts.n_experts();
        for (cell, dst, e, c) in h.counts.transitions().iter() {
            let (l, src) = ((cell / ne) as i64, (cell % ne) as i64);
            out.admit_transition(l * out.n_experts() as i64 + src, dst as i64, e as i64, c);
        }
        if dropped > 0 {
            if !force {
                bail!(
                    "{} has {dropped} selections outside {}; --force leaves them out",
                    h.path.display(),
                    dims_text(dims)
                );
            }
            notes.push(format!(
                "--force: left out {dropped} selections of {} outside {}",
                h.path.display(),
                dims_text(dims)
            ));
        }
    }
    out_file.write(&save::render(&out, id), force)?;
    notes.push(format!(
        "merged {} histories ({}, {}): {} selections across {} distinct experts -> {}",
        hs.len(),
        id.describe(),
        dims_text(dims),
        out.total(),
        out.distinct(),
        output.display()
    ));
    Ok(notes)
}

/// The output of `merge` or `migrate`, claimed before any input is read: its symlink
/// followed to the target and the target's lock held (the lock an engine's save takes), so
/// that a run saving the same history waits for the tool, or the tool for it, and no
/// selection either of them wrote is lost.
struct OutputHistory {
    output: PathBuf,
    target: PathBuf,
    lock: files::FileLock,
}

impl OutputHistory {
    /// Resolves and locks the output; refuses a file that is not a counts file.
    fn claim(output: &Path) -> Result<OutputHistory> {
        let target = files::resolve_link(output)
            .with_context(|| format!("cannot resolve {}", output.display()))?;
        if let Some(why) = save::counts_file_problem(&target) {
            bail!("{}: {why}; refusing to replace it", output.display());
        }
        let lock = files::lock_for(&target)?;
        Ok(OutputHistory {
            output: output.to_path_buf(),
            target,
            lock,
        })
    }

    /// Writes `text` over the output; an existing non-empty file only with `force`.
    fn write(&self, text: &str, force: bool) -> Result<()> {
        let exists = std::fs::metadata(&self.target).is_ok_and(|m| m.len() > 0);
        if exists && !force {
            bail!(
                "{} exists: --force replaces it (or choose another output path); nothing was written",
                self.output.display()
            );
        }
        files::replace(&self.target, &self.lock, |w| w.write_all(text.as_bytes()))?;
        Ok(())
    }
}

/// The writer's name for messages, from a header.
fn who(d: &Declared) -> String {
    match (d.writer_name(), d.writer) {
        (Some(n), Some(id)) if EngineId::name(id).is_none() => format!("{n} {id}"),
        (Some(n), _) => n.to_string(),
        (None, _) => "no engine".to_string(),
    }
}

fn merged_identity(hs: &[History], force: bool, notes: &mut Vec<String>) -> Result<EngineId> {
    let named: Vec<&History> = hs
        .iter()
        .filter(|h| h.declared.writer.is_some() || h.declared.writer_invalid)
        .collect();
    let Some(first) = named.iter().find_map(|h| h.declared.writer) else {
        if named.is_empty() && hs.iter().all(|h| h.counts.total() == 0) {
            bail!(
                "{} hold no records: there is nothing to merge; nothing was written",
                list(hs)
            );
        }
        bail!(
            "none of {} names its engine (no valid -2 record): the merge could not say whose \
             history it is",
            list(hs)
        );
    };
    let odd: Vec<&&History> = named
        .iter()
        .filter(|h| h.declared.writer != Some(first))
        .collect();
    if let Some(h) = odd.first() {
        let first_path = named
            .iter()
            .find(|h| h.declared.writer == Some(first))
            .map_or(String::new(), |h| h.path.display().to_string());
        let what = format!(
            "{first_path} is {}'s history, {} is {}'s",
            first.describe(),
            h.path.display(),
            who(&h.declared)
        );
        if !force {
            bail!(
                "{what}: expert ids do not transfer between engines, refusing; --force writes \
                 the merge under {}'s identity",
                first.describe()
            );
        }
        notes.push(format!(
            "--force: {what}; wrote the merge under {}'s identity",
            first.describe()
        ));
    }
    Ok(first)
}

fn merged_dims(hs: &[History], force: bool, notes: &mut Vec<String>) -> Result<(usize, usize)> {
    let declared: Vec<(&History, (usize, usize))> = hs
        .iter()
        .filter_map(|h| h.declared.dims.map(|d| (h, d)))
        .collect();
    let Some(&(first_h, first)) = declared.first() else {
        bail!(
            "none of {} declares its shape (no -1 record): the merge could not write one",
            list(hs)
        );
    };
    if let Some((h, d)) = declared.iter().find(|(_, d)| *d != first) {
        let what = format!(
            "{} is {}, {} is {}",
            first_h.path.display(),
            dims_text(first),
            h.path.display(),
            dims_text(*d)
        );
        if !force {
            bail!("{what}: refusing to merge histories of different shapes; --force writes the largest of each");
        }
        let max = declared
            .iter()
            .fold((0, 0), |m, (_, d)| (m.0.max(d.0), m.1.max(d.1)));
        notes.push(format!("--force: {what}; wrote {}", dims_text(max)));
        return Ok(max);
    }
    Ok(first)
}

fn list(hs: &[History]) -> String {
    hs.iter()
        .map(|h| h.path.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The rows of an IKU1 table of `dims` that the Inkling model at `snap` (else the input's
/// directory) does not route. A history of another model's shape is refused.
fn inkling_non_routing_rows(
    input: &Path,
    snap: Option<&Path>,
    dims: (usize, usize),
) -> Result<Vec<usize>> {
    let dir = match snap {
        Some(dir) => dir.to_path_buf(),
        None => match input.parent() {
            Some(d) if d.join("config.json").is_file() => d.to_path_buf(),
            Some(d) if d.as_os_str().is_empty() && Path::new("config.json").is_file() => {
                PathBuf::from(".")
            }
            _ => bail!(
                "{}: which rows Inkling routes depends on the model, and there is no config.json beside the history; name the model's directory with --snap DIR",
                input.display()
            ),
        },
    };
    let snapshot = crate::snapshot::Snapshot::open(&dir)
        .with_context(|| format!("--snap {}: cannot open the model", dir.display()))?;
    let engine = crate::engines::registry::resolve(None, &snapshot)?;
    if engine != "inkling" {
        bail!(
            "{} holds a {engine} model; an IKU1 history counts an Inkling model's experts (name it with --snap DIR)",
            dir.display()
        );
    }
    let config = crate::engines::inkling::Config::read(&snapshot)?;
    let model = (config.num_hidden_layers, config.n_routed_experts);
    if model != dims {
        bail!(
            "{} is {}, the model in {} is {}: it is another model's history",
            input.display(),
            dims_text(dims),
            dir.display(),
            dims_text(model)
        );
    }
    config.non_routing_rows()
}

/// `coli usage migrate`: an IKU1 history rewritten as text, count for count on the rows
/// the model routes; records on its dense layers (and the row after the last layer) are
/// left out, as Inkling's load leaves them out, and said. Returns the lines to print.
pub fn migrate(
    input: &Path,
    output: &Path,
    snap: Option<&Path>,
    force: bool,
) -> Result<Vec<String>> {
    let out_file = OutputHistory::claim(output)?;
    let h = history_file::open_readable(input)?;
    if h.layout() != Layout::Iku1 {
        bail!(
            "{} is not an IKU1 history (it is {} text): nothing to migrate",
            input.display(),
            if h.layout() == Layout::Text {
                "v1"
            } else {
                "legacy"
            }
        );
    }
    let Some(dims) = h.declared.dims else {
        bail!(
            "{}: the IKU1 header is cut short, so its shape is unknown",
            input.display()
        );
    };
    let non_routing = inkling_non_routing_rows(input, snap, dims)?;
    let mut counts = h.counts.clone();
    for &row in &non_routing {
        counts.drop_row(row);
    }
    let mut notes = Vec::new();
    let left_out = h.counts.total() - counts.total();
    if left_out > 0 {
        let rows: Vec<String> = non_routing
            .iter()
            .filter(|&&l| h.counts.nonzero().any(|(row, _, _)| row == l))
            .map(usize::to_string)
            .collect();
        notes.push(format!(
            "left out {left_out} selections on {} {} (dense layers, or the row after the last layer), which Inkling does not route",
            if rows.len() == 1 { "row" } else { "rows" },
            rows.join(", ")
        ));
    }
    if !h.report.is_complete() {
        if !force {
            bail!(
                "{}: migrating would lose what could not be read; --force writes what was read",
                not_complete(&h)
            );
        }
        notes.push(format!(
            "--force: {}; wrote what was read",
            not_complete(&h)
        ));
    }
    let id = h.declared.writer.unwrap_or(EngineId::of("inkling"));
    out_file.write(&save::render(&counts, id), force)?;
    notes.push(format!(
        "migrated {} selections across {} distinct experts ({}, {}) -> {}",
        counts.total(),
        counts.distinct(),
        id.describe(),
        dims_text(dims),
        output.display()
    ));
    Ok(notes)
}
