//! Cross-layer co-activation: the table colibri's `COUPLE=` prefetch reads (`.coli_pairs`),
//! and how well it predicts the next layers' experts.
//!
//! The table is built as colibri's `tools/route_pairs.py` builds it: the trace is regrouped
//! per (forward, row); for every layer `L` of a token and `dL` in {1, 2}, when layer
//! `L + dL` is present too, every expert `e` routed at `L` and every expert `f` routed at
//! `L + dL` add one to `count[L][dL][e][f]`. The file keeps, per `(L, dL, e)`, the 16 `f`
//! with the largest counts.
//!
//! Predictability is measured the way `COUPLE=` uses the file: for a token whose layer-`L`
//! set is `S`, every `f` scores the sum of the stored counts `count[L][dL][e][f]` over
//! `e` in `S`; the top-N positive scores are the prediction, and the measure is the share of
//! the experts actually routed at `L + dL` that the prediction contains (recall@N).
//!
//! Memory is the table (layers x 2 x experts x experts counters), whatever the trace length.

use std::collections::HashMap;
use std::fmt::Write as _;

use super::trace::Route;

/// Pairs kept per entry in the file (colibri's `M`).
pub const PAIRS_PER_ENTRY: usize = 16;

/// How many layers ahead the table looks (`dL` in 1..=2).
pub const DEPTH: usize = 2;

/// Per token, the routed sets of the last layers seen in the current forward, so that
/// every `(L, L + dL)` pair of a token is visited exactly once.
#[derive(Default)]
pub struct RowWindow {
    forward: Option<u64>,
    rows: HashMap<u64, Vec<(usize, Vec<usize>)>>,
}

impl RowWindow {
    /// Feeds one line; calls `visit(L, dL, set at L, set at L + dL)` for each earlier layer
    /// of the same token within reach.
    pub fn feed(&mut self, r: &Route, mut visit: impl FnMut(usize, usize, &[usize], &[usize])) {
        if self.forward != Some(r.forward) {
            self.rows.clear();
            self.forward = Some(r.forward);
        }
        let set = r.id_set();
        let recent = self.rows.entry(r.row).or_default();
        for (l, s) in recent.iter() {
            if r.layer > *l && r.layer - *l <= DEPTH {
                visit(*l, r.layer - *l, s, &set);
            }
        }
        // Later layers are deeper still, so only this layer and the one before stay in reach.
        recent.retain(|(l, _)| *l + DEPTH > r.layer && *l != r.layer);
        recent.push((r.layer, set));
    }
}

/// One `(L, dL, e)` entry of the file: its strongest successors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The conditioning layer `L`.
    pub layer: usize,
    /// How many layers ahead (1 or 2).
    pub depth: usize,
    /// The expert routed at `L`.
    pub expert: usize,
    /// `(f, count)`, count descending then `f` ascending, at most [`PAIRS_PER_ENTRY`].
    pub pairs: Vec<(usize, u32)>,
}

/// The full co-activation counts.
#[derive(Default, Debug)]
pub struct CoTable {
    /// `[L * DEPTH + dL - 1][e][f]`.
    blocks: Vec<Vec<Vec<u32>>>,
}

impl CoTable {
    /// Counts one token's pair of layers.
    pub fn add(&mut self, layer: usize, depth: usize, from: &[usize], to: &[usize]) {
        let b = layer * DEPTH + depth - 1;
        if self.blocks.len() <= b {
            self.blocks.resize_with(b + 1, Vec::new);
        }
        let block = &mut self.blocks[b];
        for &e in from {
            if block.len() <= e {
                block.resize_with(e + 1, Vec::new);
            }
            let row = &mut block[e];
            for &f in to {
                if row.len() <= f {
                    row.resize(f + 1, 0);
                }
                row[f] = row[f].saturating_add(1);
            }
        }
    }

    /// The entries the file holds, in file order `(L, dL, e)`.
    pub fn entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        for (b, block) in self.blocks.iter().enumerate() {
            for (expert, row) in block.iter().enumerate() {
                let mut pairs: Vec<(usize, u32)> = row
                    .iter()
                    .copied()
                    .enumerate()
                    .filter(|&(_, c)| c > 0)
                    .collect();
                if pairs.is_empty() {
                    continue;
                }
                pairs.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                pairs.truncate(PAIRS_PER_ENTRY);
                pairs.shrink_to_fit();
                out.push(Entry {
                    layer: b / DEPTH,
                    depth: b % DEPTH + 1,
                    expert,
                    pairs,
                });
            }
        }
        out
    }
}

/// The `.coli_pairs` text: `COLIPAIRS 1 <n>` then one `<L> <dL> <e> <f>:<c> ...` line per
/// entry, newline-terminated.
pub fn render(entries: &[Entry]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "COLIPAIRS 1 {}", entries.len());
    for e in entries {
        let _ = write!(s, "{} {} {}", e.layer, e.depth, e.expert);
        for (f, c) in &e.pairs {
            let _ = write!(s, " {f}:{c}");
        }
        s.push('\n');
    }
    s
}

/// Predictions from the entries as written (what `COUPLE=` has at inference).
pub struct Predictor {
    /// `[L * DEPTH + dL - 1][e]` -> stored pairs.
    table: Vec<Vec<Vec<(usize, u32)>>>,
    scores: Vec<u64>,
    touched: Vec<usize>,
}

impl Predictor {
    /// Indexes the entries.
    pub fn new(entries: &[Entry]) -> Predictor {
        let mut table: Vec<Vec<Vec<(usize, u32)>>> = Vec::new();
        for e in entries {
            let b = e.layer * DEPTH + e.depth - 1;
            if table.len() <= b {
                table.resize_with(b + 1, Vec::new);
            }
            if table[b].len() <= e.expert {
                table[b].resize_with(e.expert + 1, Vec::new);
            }
            table[b][e.expert].clone_from(&e.pairs);
        }
        Predictor {
            table,
            scores: Vec::new(),
            touched: Vec::new(),
        }
    }

    /// The top `n` experts of layer `L + dL` given the set routed at `L`: highest summed
    /// count first, ties to the lower id, positive scores only.
    pub fn predict(&mut self, layer: usize, depth: usize, from: &[usize], n: usize) -> Vec<usize> {
        let Some(block) = self.table.get(layer * DEPTH + depth - 1) else {
            return Vec::new();
        };
        for &e in from {
            for &(f, c) in block.get(e).map_or(&[][..], Vec::as_slice) {
                if self.scores.len() <= f {
                    self.scores.resize(f + 1, 0);
                }
                if self.scores[f] == 0 {
                    self.touched.push(f);
                }
                self.scores[f] += u64::from(c);
            }
        }
        let mut ranked: Vec<(usize, u64)> =
            self.touched.iter().map(|&f| (f, self.scores[f])).collect();
        for &f in &self.touched {
            self.scores[f] = 0;
        }
        self.touched.clear();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.truncate(n);
        ranked.into_iter().map(|(f, _)| f).collect()
    }
}

/// Hits and totals of a recall measure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recall {
    /// Routed experts that were predicted.
    pub hits: u64,
    /// Routed experts.
    pub total: u64,
}

impl Recall {
    /// Adds one token: how many of `actual` are in `predicted`.
    pub fn add(&mut self, predicted: &[usize], actual: &[usize]) {
        self.total += actual.len() as u64;
        self.hits += actual.iter().filter(|f| predicted.contains(f)).count() as u64;
    }

    /// `hits / total`, or `None` when nothing was measured.
    pub fn rate(&self) -> Option<f64> {
        (self.total > 0).then(|| self.hits as f64 / self.total as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(forward: u64, row: u64, layer: usize, ids: &[usize]) -> Route {
        Route {
            forward,
            row,
            layer,
            ids: ids.to_vec(),
            ..Route::default()
        }
    }

    #[test]
    fn table_and_file_bytes() {
        let mut w = RowWindow::default();
        let mut t = CoTable::default();
        for r in [
            route(0, 0, 0, &[1, 2]),
            route(0, 0, 1, &[3]),
            route(0, 0, 2, &[4]),
            route(1, 0, 0, &[1]),
            route(1, 0, 1, &[3]),
        ] {
            w.feed(&r, |l, d, a, b| t.add(l, d, a, b));
        }
        let entries = t.entries();
        assert_eq!(
            render(&entries),
            "COLIPAIRS 1 5\n0 1 1 3:2\n0 1 2 3:1\n0 2 1 4:1\n0 2 2 4:1\n1 1 3 4:1\n"
        );
        let mut p = Predictor::new(&entries);
        assert_eq!(p.predict(0, 1, &[1, 2], 8), vec![3]);
        assert_eq!(p.predict(0, 2, &[2], 8), vec![4]);
        assert!(p.predict(5, 1, &[2], 8).is_empty());
    }

    #[test]
    fn entry_keeps_the_sixteen_strongest() {
        let mut t = CoTable::default();
        let to: Vec<usize> = (0..20).collect();
        t.add(0, 1, &[0], &to);
        t.add(0, 1, &[0], &[19]);
        let e = t.entries();
        assert_eq!(e[0].pairs.len(), PAIRS_PER_ENTRY);
        assert_eq!(e[0].pairs[0], (19, 2));
        assert_eq!(e[0].pairs[1], (0, 1));
    }
}
