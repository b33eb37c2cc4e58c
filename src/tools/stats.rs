//! `coli trace stats`: what a `ROUTE_TRACE` says about routing.
//!
//! Forwards, MoE calls and rows; per layer the tokens routed, the routing entropy (how
//! evenly the selections spread over the layer's experts, in bits, and as a share of the
//! maximum `log2(experts)`) and the load balance (the hottest expert's selections over the
//! mean); and how predictable layer `l + 1`'s (and `l + 2`'s) experts are from layer `l`'s
//! (see `pairs`), next to the marginal baseline (always predicting the layer's hottest
//! experts). Optionally writes the co-activation table as `.coli_pairs`.
//!
//! Two streaming passes: the first counts and builds the table, the second measures the
//! predictions the finished table makes. Memory is bounded by the model's shape.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::Serialize;

use super::pairs::{self, CoTable, Predictor, Recall, RowWindow, DEPTH};
use super::trace::{CallGrouper, TraceReader};

/// `coli trace stats`.
#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// The trace written with ROUTE_TRACE=<path>.
    pub trace: PathBuf,
    /// Experts per layer of the model (default: the highest id in the trace + 1). Ids at or
    /// above it are reported as malformed lines.
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts predicted per token for the predictability measure (default: the most
    /// experts one line routes, i.e. the model's top-k).
    #[arg(long)]
    pub top: Option<usize>,
    /// Also write the co-activation table to this file in colibri's `.coli_pairs` format
    /// (what `COUPLE=<file>` reads).
    #[arg(long, value_name = "OUT")]
    pub pairs: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// One layer's routing.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct LayerStats {
    /// The layer.
    pub layer: usize,
    /// Rows (tokens) routed at this layer.
    pub tokens: u64,
    /// Expert selections (ids in its lines).
    pub selections: u64,
    /// Experts selected at least once.
    pub experts_used: usize,
    /// Shannon entropy of the selection distribution, in bits.
    pub entropy_bits: f64,
    /// `entropy_bits / log2(experts)`: 1 is perfectly even.
    pub entropy_share: f64,
    /// The hottest expert's selections over the mean (`selections / experts`).
    pub max_over_mean: f64,
    /// Recall of this layer's co-occurrence predictions for layer + 1.
    pub next_layer_recall: Option<f64>,
    /// Recall of predicting layer + 1's hottest experts regardless of this layer.
    pub next_layer_marginal: Option<f64>,
}

/// Predictability at one depth.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct Predictability {
    /// Layers ahead.
    pub depth: usize,
    /// Share of the routed experts contained in the co-occurrence prediction.
    pub recall: Option<f64>,
    /// The same for the marginal prediction (the layer's hottest experts).
    pub marginal: Option<f64>,
    /// Routed experts measured.
    pub measured: u64,
}

/// Everything `stats` reports.
#[derive(Serialize, Debug, Clone, PartialEq)]
pub struct StatsReport {
    /// The trace.
    pub trace: String,
    /// Well-formed lines (rows).
    pub rows: u64,
    /// Malformed lines, reported and skipped.
    pub malformed: u64,
    /// Forwards (a new one starts where the layer number decreases).
    pub forwards: u64,
    /// Forwards with a call of more than one row (prefill or a batch).
    pub prefill_forwards: u64,
    /// MoE-layer invocations.
    pub calls: u64,
    /// Calls with a single row (decode).
    pub decode_calls: u64,
    /// Experts per layer used for entropy and balance.
    pub experts: usize,
    /// Whether `experts` was inferred from the trace.
    pub experts_inferred: bool,
    /// The most experts one line routes.
    pub top_k: usize,
    /// Experts predicted per token.
    pub predicted: usize,
    /// Per layer, ascending; layers without lines are left out.
    pub layers: Vec<LayerStats>,
    /// One and two layers ahead.
    pub predictability: Vec<Predictability>,
    /// Entries in the co-activation table.
    pub pair_entries: usize,
    /// Where the table was written.
    pub pairs_file: Option<String>,
}

#[derive(Default)]
struct Pass1 {
    layer_tokens: Vec<u64>,
    /// `[layer][expert]` selections.
    counts: Vec<Vec<u64>>,
    forwards: u64,
    prefill_forwards: u64,
    calls: u64,
    decode_calls: u64,
    top_k: usize,
    max_id: Option<usize>,
    table: CoTable,
}

fn grow<T: Default + Clone>(v: &mut Vec<T>, len: usize) {
    if v.len() < len {
        v.resize(len, T::default());
    }
}

fn first_pass(path: &Path, experts: Option<usize>) -> Result<(Pass1, u64, u64)> {
    let mut rd = TraceReader::open(path, false, "stats")?;
    rd.limit_experts(experts);
    let mut p = Pass1::default();
    let mut window = RowWindow::default();
    let mut calls = CallGrouper::default();
    let mut forward_is_prefill: Option<(u64, bool)> = None;
    let mut on_call = |p: &mut Pass1, c: super::trace::Call| {
        p.calls += 1;
        if c.rows == 1 {
            p.decode_calls += 1;
        }
        match &mut forward_is_prefill {
            Some((f, prefill)) if *f == c.forward => *prefill |= c.rows > 1,
            slot => {
                if let Some((_, true)) = slot {
                    p.prefill_forwards += 1;
                }
                p.forwards += 1;
                *slot = Some((c.forward, c.rows > 1));
            }
        }
    };
    while let Some(r) = rd.next_route()? {
        grow(&mut p.layer_tokens, r.layer + 1);
        grow(&mut p.counts, r.layer + 1);
        p.layer_tokens[r.layer] += 1;
        let row = &mut p.counts[r.layer];
        for &id in &r.ids {
            grow(row, id + 1);
            row[id] += 1;
            p.max_id = Some(p.max_id.map_or(id, |m| m.max(id)));
        }
        p.top_k = p.top_k.max(r.ids.len());
        let table = &mut p.table;
        window.feed(r, |l, d, a, b| table.add(l, d, a, b));
        if let Some(c) = calls.push(r) {
            on_call(&mut p, c);
        }
    }
    if let Some(c) = calls.finish() {
        on_call(&mut p, c);
    }
    if let Some((_, true)) = forward_is_prefill {
        p.prefill_forwards += 1;
    }
    Ok((p, rd.lines(), rd.malformed()))
}

/// The `n` hottest experts of every layer (count descending, id ascending).
fn marginal_tops(counts: &[Vec<u64>], n: usize) -> Vec<Vec<usize>> {
    counts
        .iter()
        .map(|row| {
            let mut v: Vec<(usize, u64)> = row
                .iter()
                .copied()
                .enumerate()
                .filter(|&(_, c)| c > 0)
                .collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            v.truncate(n);
            v.into_iter().map(|(e, _)| e).collect()
        })
        .collect()
}

/// Recall per depth (index `dL - 1`), and for depth 1 per source layer; each as
/// (co-occurrence, marginal).
type Measured = ([(Recall, Recall); DEPTH], Vec<(Recall, Recall)>);

fn second_pass(
    path: &Path,
    experts: Option<usize>,
    entries: &[pairs::Entry],
    marginal: &[Vec<usize>],
    n: usize,
) -> Result<Measured> {
    let mut rd = TraceReader::open(path, true, "predictability")?;
    rd.limit_experts(experts);
    let mut predictor = Predictor::new(entries);
    let mut window = RowWindow::default();
    let mut by_depth = [(Recall::default(), Recall::default()); DEPTH];
    let mut by_layer: Vec<(Recall, Recall)> = Vec::new();
    while let Some(r) = rd.next_route()? {
        window.feed(r, |l, d, from, to| {
            let predicted = predictor.predict(l, d, from, n);
            let base = marginal.get(l + d).map_or(&[][..], Vec::as_slice);
            let slot = &mut by_depth[d - 1];
            slot.0.add(&predicted, to);
            slot.1.add(base, to);
            if d == 1 {
                grow(&mut by_layer, l + 1);
                by_layer[l].0.add(&predicted, to);
                by_layer[l].1.add(base, to);
            }
        });
    }
    Ok((by_depth, by_layer))
}

fn entropy(row: &[u64], experts: usize) -> (f64, f64, f64) {
    let total: u64 = row.iter().sum();
    if total == 0 {
        return (0.0, 0.0, 0.0);
    }
    let t = total as f64;
    let bits: f64 = row
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / t;
            -p * p.log2()
        })
        .sum();
    let max_bits = (experts as f64).log2();
    let share = if max_bits > 0.0 { bits / max_bits } else { 1.0 };
    let max = row.iter().copied().max().unwrap_or(0) as f64;
    (bits, share, max / (t / experts as f64))
}

/// Measures a trace (and writes the `.coli_pairs` table when asked).
pub fn stats(
    path: &Path,
    experts: Option<usize>,
    top: Option<usize>,
    pairs_out: Option<&Path>,
) -> Result<StatsReport> {
    if experts == Some(0) {
        bail!("--experts 0: a MoE layer has at least one expert");
    }
    let (p, rows, malformed) = first_pass(path, experts)?;
    let n_experts = experts.unwrap_or(p.max_id.map_or(0, |m| m + 1));
    let n = top.unwrap_or(p.top_k);
    let entries = p.table.entries();
    if let Some(out) = pairs_out {
        super::write_output(
            out,
            "a co-activation table (COLIPAIRS)",
            |h| h.starts_with(b"COLIPAIRS "),
            pairs::render(&entries).as_bytes(),
        )?;
    }
    let marginal = marginal_tops(&p.counts, n);
    let (by_depth, by_layer) = if entries.is_empty() {
        Default::default()
    } else {
        second_pass(path, experts, &entries, &marginal, n)?
    };
    let layers = p
        .layer_tokens
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t > 0)
        .map(|(layer, &tokens)| {
            let row = &p.counts[layer];
            let (entropy_bits, entropy_share, max_over_mean) = entropy(row, n_experts.max(1));
            let (next, base) = by_layer.get(layer).copied().unwrap_or_default();
            LayerStats {
                layer,
                tokens,
                selections: row.iter().sum(),
                experts_used: row.iter().filter(|&&c| c > 0).count(),
                entropy_bits,
                entropy_share,
                max_over_mean,
                next_layer_recall: next.rate(),
                next_layer_marginal: base.rate(),
            }
        })
        .collect();
    Ok(StatsReport {
        trace: path.display().to_string(),
        rows,
        malformed,
        forwards: p.forwards,
        prefill_forwards: p.prefill_forwards,
        calls: p.calls,
        decode_calls: p.decode_calls,
        experts: n_experts,
        experts_inferred: experts.is_none(),
        top_k: p.top_k,
        predicted: n,
        layers,
        predictability: by_depth
            .iter()
            .enumerate()
            .map(|(i, (co, base))| Predictability {
                depth: i + 1,
                recall: co.rate(),
                marginal: base.rate(),
                measured: co.total,
            })
            .collect(),
        pair_entries: entries.len(),
        pairs_file: pairs_out.map(|p| p.display().to_string()),
    })
}

fn pct(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |v| format!("{:.1}%", 100.0 * v))
}

/// The report as text.
pub fn render(r: &StatsReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "trace       {}", r.trace);
    let _ = writeln!(
        s,
        "rows        {} ({} malformed lines skipped)",
        r.rows, r.malformed
    );
    let _ = writeln!(
        s,
        "forwards    {} ({} with prefill rows, {} decode)",
        r.forwards,
        r.prefill_forwards,
        r.forwards - r.prefill_forwards
    );
    let _ = writeln!(
        s,
        "MoE calls   {} ({} single-row decode calls)",
        r.calls, r.decode_calls
    );
    let _ = writeln!(
        s,
        "experts     {} per layer{}, up to {} per token",
        r.experts,
        if r.experts_inferred {
            " (highest id seen + 1; --experts sets it)"
        } else {
            ""
        },
        r.top_k
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "layer  tokens  selections  used  entropy bits (of max)  max/mean  next-layer recall@{}  marginal",
        r.predicted
    );
    for l in &r.layers {
        let _ = writeln!(
            s,
            "{:>5}  {:>6}  {:>10}  {:>4}  {:>12.3} ({:>5.1}%)  {:>8.2}  {:>19}  {:>8}",
            l.layer,
            l.tokens,
            l.selections,
            l.experts_used,
            l.entropy_bits,
            100.0 * l.entropy_share,
            l.max_over_mean,
            pct(l.next_layer_recall),
            pct(l.next_layer_marginal)
        );
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "predictability (top-{} co-occurrence predictions from the table below, in sample):",
        r.predicted
    );
    for p in &r.predictability {
        let ahead = if p.depth == 1 {
            "one layer ahead: "
        } else {
            "two layers ahead:"
        };
        let _ = writeln!(
            s,
            "  {ahead} {} of the routed experts predicted (marginal top-{}: {}) over {} selections",
            pct(p.recall),
            r.predicted,
            pct(p.marginal),
            p.measured
        );
    }
    let _ = write!(s, "co-activation table: {} entries", r.pair_entries);
    match &r.pairs_file {
        Some(f) => {
            let _ = writeln!(s, " -> {f}");
        }
        None => {
            let _ = writeln!(s, " (--pairs OUT writes it as .coli_pairs)");
        }
    }
    s
}

/// `coli trace stats`.
pub fn run(args: &StatsArgs) -> Result<()> {
    let report = stats(&args.trace, args.experts, args.top, args.pairs.as_deref())?;
    super::emit_report(&report, args.json, render)
}
