//! Offline tools over the routing telemetry files, with no model loaded: `coli usage`
//! (show, merge and migrate `.coli_usage` histories) and `coli trace` (statistics, cache
//! policy simulation and plots over a `ROUTE_TRACE` stream).
//!
//! Histories are read and written only through `route_trace`: its reader decides what an
//! engine admits or refuses, its renderer and atomic writer produce the bytes, so a file
//! these tools write is one every engine reads. The trace reader here is the one reader of
//! `ROUTE_TRACE` text. Everything streams: a trace of any length is processed in memory
//! bounded by the model's shape (layers x experts), never by the number of lines.
//!
//! - `history_file`: opening a history of any engine, learning its header first.
//! - `usage`: `coli usage show | merge | migrate`.
//! - `trace`: the trace reader (lines, MoE calls, forwards, malformed lines, progress).
//! - `stats` and `pairs`: `coli trace stats` and the `.coli_pairs` co-activation table.
//! - `simulate`: `coli trace simulate`, the per-layer cache replay.
//! - `plot`: `coli trace plot`, the heat map and the hit-rate curve.

pub mod history_file;
pub mod pairs;
pub mod plot;
pub mod simulate;
pub mod stats;
pub mod trace;
pub mod usage;

use std::io::{Read as _, Write as _};
use std::path::Path;

use anyhow::{bail, Context, Result};

/// `coli usage ...`.
#[derive(clap::Subcommand, Debug)]
pub enum UsageCommand {
    /// Header, totals, per-layer top experts, and what an engine does with the file.
    Show(usage::ShowArgs),
    /// Add up histories of one engine and shape into one file (written atomically).
    Merge(usage::MergeArgs),
    /// Rewrite an Inkling IKU1 binary history in the shared text format, count for count.
    Migrate(usage::MigrateArgs),
}

/// `coli trace ...`.
#[derive(clap::Subcommand, Debug)]
pub enum TraceCommand {
    /// Forwards, rows, tokens per layer, routing entropy, load balance, cross-layer
    /// predictability; optionally the `.coli_pairs` co-activation table.
    Stats(stats::StatsArgs),
    /// Replay the trace through per-layer expert caches (lru, lfru, pinned, belady) of
    /// each size and report the hit rates.
    Simulate(simulate::SimulateArgs),
    /// Draw the layers x experts heat map of a trace or history (PNG or SVG), or with
    /// --hit-curve the hit rate against slots per layer.
    Plot(plot::PlotArgs),
}

/// Runs a `coli usage` subcommand; errors name the file and become exit code 2.
pub fn run_usage(cmd: &UsageCommand) -> Result<()> {
    match cmd {
        UsageCommand::Show(a) => usage::show(a),
        UsageCommand::Merge(a) => print_notes(usage::merge(&a.inputs, &a.output, a.force)?),
        UsageCommand::Migrate(a) => print_notes(usage::migrate(
            &a.input,
            &a.output,
            a.snap.as_deref(),
            a.force,
        )?),
    }
}

/// Runs a `coli trace` subcommand; errors name the file and become exit code 2.
pub fn run_trace(cmd: &TraceCommand) -> Result<()> {
    match cmd {
        TraceCommand::Stats(a) => stats::run(a),
        TraceCommand::Simulate(a) => simulate::run(a),
        TraceCommand::Plot(a) => {
            let line = plot::run(a)?;
            emit(&format!("{line}\n"))
        }
    }
}

/// Writes a tool's output file: refused when `path` exists holding something other than
/// what this tool writes (`looks_like` judges the first 64 KiB; an empty file is
/// nothing), otherwise replaced as every coli writer replaces a file, without a lock since
/// nothing merges into it (see [`crate::files::replace_alone`]).
pub fn write_output(
    path: &Path,
    what: &str,
    looks_like: fn(&[u8]) -> bool,
    bytes: &[u8],
) -> Result<()> {
    match crate::files::open_input(path) {
        Ok(f) => {
            let mut head = Vec::new();
            f.take(1 << 16)
                .read_to_end(&mut head)
                .with_context(|| format!("cannot read {}", path.display()))?;
            if !head.iter().all(u8::is_ascii_whitespace) && !looks_like(&head) {
                bail!(
                    "{} exists and is not {what}: refusing to replace it (choose another output path)",
                    path.display()
                );
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => bail!("{}: {e}; refusing to write it", path.display()),
    }
    let target = crate::files::resolve_link(path)
        .with_context(|| format!("cannot resolve {}", path.display()))?;
    crate::files::replace_alone(&target, |w| w.write_all(bytes))?;
    Ok(())
}

/// `--force` decisions go to stderr, the summary (the last line) to stdout.
fn print_notes(notes: Vec<String>) -> Result<()> {
    if let Some((summary, forced)) = notes.split_last() {
        for n in forced {
            eprintln!("{n}");
        }
        emit(&format!("{summary}\n"))?;
    }
    Ok(())
}

/// Writes a report to stdout. A reader that went away (`coli trace stats T | head`) is not
/// an error: the report was simply not wanted any further.
pub fn emit(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        r => r.context("cannot write to standard output"),
    }
}

/// A report as text, or as pretty JSON with `--json`.
pub fn emit_report<T: serde::Serialize>(
    report: &T,
    json: bool,
    text: impl FnOnce(&T) -> String,
) -> Result<()> {
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(report)?))
    } else {
        emit(&text(report))
    }
}
