//! Reading a `ROUTE_TRACE` stream, one routing decision at a time.
//!
//! A line is `<call> <row> <layer> <id>:<gate> ...` (format in `FORMATS.md`). Owns the line
//! parser, the report of malformed lines (named by file and line number, then skipped:
//! a bad line never stops a run and never panics), the progress bar on large files, and
//! the two groupings every measurement needs:
//!
//! - the **MoE call** (one layer invocation): consecutive lines with the same `call` and
//!   layer and increasing rows. Rows restarting also start a call, so traces whose `call`
//!   never advances (kimi_k3 in colibri) still split correctly.
//! - the **forward**: a new one starts when the layer number decreases, which is how
//!   colibri's `route_pairs.py` splits the stream (it ignores `call`).
//!
//! Memory is one line; the stream can be of any length.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Traces at least this large show a progress bar (on a terminal).
const PROGRESS_FROM_BYTES: u64 = 32 << 20;

/// Malformed lines printed one by one; the rest are only counted.
const MALFORMED_SHOWN: u64 = 10;

/// Layers and expert ids must be below this unless the caller gives the expert count: no
/// MoE model comes near it, so a larger number is a corrupt line, and tables indexed by it
/// stay bounded.
pub const MAX_INDEX: usize = 1 << 16;

/// One routing decision.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Route {
    /// 1-based line number in the file.
    pub line: u64,
    /// The `call` field as written.
    pub call: u64,
    /// The batch row within the call.
    pub row: u64,
    /// The layer.
    pub layer: usize,
    /// Selected expert ids in selection order (duplicates kept, as the counters count them).
    pub ids: Vec<usize>,
    /// Ordinal of the forward this line belongs to (0 for the first).
    pub forward: u64,
    /// Ordinal of the MoE call this line belongs to (0 for the first).
    pub invocation: u64,
}

impl Route {
    /// The selected ids, sorted and without duplicates.
    pub fn id_set(&self) -> Vec<usize> {
        let mut v = self.ids.clone();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// Parses one line into `out` (its `line`, `forward` and `invocation` are left alone).
/// The error says what is wrong, for the malformed-line report.
pub fn parse_line(text: &str, out: &mut Route) -> Result<(), String> {
    let mut fields = text.split_ascii_whitespace();
    let mut number = |name: &str| -> Result<u64, String> {
        let Some(tok) = fields.next() else {
            return Err(format!(
                "expected `<call> <row> <layer> <id>:<gate> ...`, the {name} field is missing"
            ));
        };
        tok.parse::<u64>()
            .map_err(|_| format!("{name} `{tok}` is not a non-negative integer"))
    };
    out.call = number("call")?;
    out.row = number("row")?;
    let layer = number("layer")?;
    out.layer =
        usize::try_from(layer).map_err(|_| format!("layer {layer} does not fit this machine"))?;
    out.ids.clear();
    for pair in fields {
        let Some((id, gate)) = pair.split_once(':') else {
            return Err(format!("`{pair}` is not `<id>:<gate>`"));
        };
        let id = id
            .parse::<usize>()
            .map_err(|_| format!("expert id `{id}` in `{pair}` is not a non-negative integer"))?;
        gate.parse::<f32>()
            .map_err(|_| format!("gate `{gate}` in `{pair}` is not a number"))?;
        out.ids.push(id);
    }
    Ok(())
}

/// Counts malformed lines and prints the first few as `<file>:<line>: <why> — skipped`.
#[derive(Debug, Default)]
struct Malformed {
    count: u64,
    quiet: bool,
}

impl Malformed {
    fn report(&mut self, path: &Path, line: u64, why: &str) {
        self.count += 1;
        if !self.quiet && self.count <= MALFORMED_SHOWN {
            eprintln!("{}:{line}: {why} \u{2014} skipped", path.display());
        }
    }
}

/// A streaming reader of one trace file.
pub struct TraceReader {
    path: PathBuf,
    src: BufReader<File>,
    buf: Vec<u8>,
    route: Route,
    line: u64,
    malformed: Malformed,
    /// (call, row, layer) of the last good line.
    prev: Option<(u64, u64, usize)>,
    forward: u64,
    invocation: u64,
    progress: Option<ProgressBar>,
    unreported_bytes: u64,
    lines: u64,
    expert_limit: Option<usize>,
    at_end: bool,
}

impl TraceReader {
    /// Opens `path`. With `quiet`, malformed lines are counted but not printed (for a
    /// second pass over a file already reported). `label` names the pass on the progress
    /// bar.
    pub fn open(path: &Path, quiet: bool, label: &str) -> Result<TraceReader> {
        let file = crate::files::open_input(path)
            .with_context(|| format!("cannot open trace {}", path.display()))?;
        let len = file
            .metadata()
            .with_context(|| format!("cannot read trace {}", path.display()))?
            .len();
        let progress = (len >= PROGRESS_FROM_BYTES).then(|| progress_bar(len, label));
        Ok(TraceReader {
            path: path.to_path_buf(),
            src: BufReader::with_capacity(1 << 20, file),
            buf: Vec::with_capacity(256),
            route: Route::default(),
            line: 0,
            malformed: Malformed { count: 0, quiet },
            prev: None,
            forward: 0,
            invocation: 0,
            progress,
            unreported_bytes: 0,
            lines: 0,
            expert_limit: None,
            at_end: false,
        })
    }

    /// Reports lines naming an expert id at or above `limit` as malformed (the model's
    /// expert count, when the caller knows it).
    pub fn limit_experts(&mut self, limit: Option<usize>) {
        self.expert_limit = limit;
    }

    /// The file being read.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next well-formed line, or `None` at the end of the file. Malformed lines are
    /// reported and skipped; only an I/O error is an error.
    pub fn next_route(&mut self) -> Result<Option<&Route>> {
        if self.at_end {
            return Ok(None);
        }
        loop {
            self.buf.clear();
            let n = self.src.read_until(b'\n', &mut self.buf).with_context(|| {
                format!(
                    "cannot read trace {} after line {}",
                    self.path.display(),
                    self.line
                )
            })?;
            if n == 0 {
                self.at_end = true;
                self.finish();
                return Ok(None);
            }
            self.line += 1;
            self.tick(n as u64);
            let parsed = match std::str::from_utf8(&self.buf) {
                Err(_) => Err("the line is not UTF-8 text".to_string()),
                Ok(text) if text.trim().is_empty() => Err("empty line".to_string()),
                Ok(text) => parse_line(text, &mut self.route)
                    .and_then(|()| check_range(&self.route, self.expert_limit)),
            };
            if let Err(why) = parsed {
                self.malformed.report(&self.path, self.line, &why);
                continue;
            }
            self.lines += 1;
            let r = &mut self.route;
            r.line = self.line;
            if let Some((call, row, layer)) = self.prev {
                if r.layer < layer {
                    self.forward += 1;
                }
                if r.call != call || r.layer != layer || r.row <= row {
                    self.invocation += 1;
                }
            }
            self.prev = Some((r.call, r.row, r.layer));
            r.forward = self.forward;
            r.invocation = self.invocation;
            return Ok(Some(&self.route));
        }
    }

    /// Well-formed lines read so far.
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Malformed lines skipped so far.
    pub fn malformed(&self) -> u64 {
        self.malformed.count
    }

    fn tick(&mut self, bytes: u64) {
        if let Some(bar) = &self.progress {
            self.unreported_bytes += bytes;
            if self.unreported_bytes >= 1 << 20 {
                bar.inc(self.unreported_bytes);
                self.unreported_bytes = 0;
            }
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = self.progress.take() {
            bar.finish_and_clear();
        }
        let m = &self.malformed;
        if !m.quiet && m.count > MALFORMED_SHOWN {
            eprintln!(
                "{}: {} malformed lines skipped in all ({} shown above)",
                self.path.display(),
                m.count,
                MALFORMED_SHOWN
            );
        }
    }
}

/// Rejects a layer or an expert id that no model of the given (or any) size has.
fn check_range(r: &Route, expert_limit: Option<usize>) -> Result<(), String> {
    if r.layer >= MAX_INDEX {
        return Err(format!(
            "layer {} is beyond any model (limit {MAX_INDEX})",
            r.layer
        ));
    }
    match (expert_limit, r.ids.iter().max()) {
        (Some(n), Some(&id)) if id >= n => Err(format!(
            "expert id {id} is not below the {n} experts per layer given"
        )),
        (None, Some(&id)) if id >= MAX_INDEX => Err(format!(
            "expert id {id} is beyond any model (limit {MAX_INDEX}; --experts sets a larger one)"
        )),
        _ => Ok(()),
    }
}

fn progress_bar(total: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let template = format!(
        "{label} [{{elapsed_precise}}] {{wide_bar}} {{bytes}}/{{total_bytes}} {{bytes_per_sec}} ETA {{eta}}"
    );
    if let Ok(style) = ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar
}

/// One MoE-layer invocation: its layer, how many rows it routed, and the distinct experts
/// it needed (sorted), which is what an expert cache is asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Call {
    /// The layer.
    pub layer: usize,
    /// Rows (trace lines) in the call.
    pub rows: u64,
    /// Distinct experts over all rows, ascending (the order the engine visits them).
    pub experts: Vec<usize>,
    /// Every selection of every row, duplicates included.
    pub selections: Vec<usize>,
    /// The forward the call belongs to.
    pub forward: u64,
}

/// Groups the routes of a reader into calls.
#[derive(Default)]
pub struct CallGrouper {
    current: Option<(u64, Call)>,
}

impl CallGrouper {
    /// Adds a route; returns the previous call when this route starts a new one.
    pub fn push(&mut self, r: &Route) -> Option<Call> {
        let done = match &self.current {
            Some((inv, _)) if *inv == r.invocation => None,
            _ => self.finish(),
        };
        let (_, call) = self.current.get_or_insert_with(|| {
            (
                r.invocation,
                Call {
                    layer: r.layer,
                    forward: r.forward,
                    ..Call::default()
                },
            )
        });
        call.rows += 1;
        call.selections.extend_from_slice(&r.ids);
        done
    }

    /// The call in progress, closed (at the end of the stream, or when the next begins).
    pub fn finish(&mut self) -> Option<Call> {
        self.current.take().map(|(_, mut c)| {
            c.experts.clone_from(&c.selections);
            c.experts.sort_unstable();
            c.experts.dedup();
            c
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_engine_lines() {
        let mut r = Route::default();
        parse_line("17 0 42 131:0.3120 7:0.2211\n", &mut r).expect("good line");
        assert_eq!((r.call, r.row, r.layer), (17, 0, 42));
        assert_eq!(r.ids, vec![131, 7]);
        parse_line("0 3 1\r\n", &mut r).expect("k = 0");
        assert!(r.ids.is_empty());
        parse_line("1 0 0 5:nan 6:-nan 7:inf 8:-0.0000", &mut r).expect("C spellings");
        assert_eq!(r.ids, vec![5, 6, 7, 8]);
    }

    #[test]
    fn names_what_is_wrong() {
        let mut r = Route::default();
        let e = parse_line("1 2", &mut r).unwrap_err();
        assert!(e.contains("layer field is missing"), "{e}");
        let e = parse_line("1 2 x 3:0.1", &mut r).unwrap_err();
        assert!(e.contains("layer `x`"), "{e}");
        let e = parse_line("1 2 3 4", &mut r).unwrap_err();
        assert!(e.contains("`4` is not `<id>:<gate>`"), "{e}");
        let e = parse_line("1 2 3 4:zz", &mut r).unwrap_err();
        assert!(e.contains("gate `zz`"), "{e}");
        let e = parse_line("1 2 3 -4:0.5", &mut r).unwrap_err();
        assert!(e.contains("expert id `-4`"), "{e}");
    }
}
