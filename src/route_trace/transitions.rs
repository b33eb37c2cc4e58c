//! Order-1 expert transitions: how often an expert chosen at one MoE layer was followed, in
//! the same row, by each expert of the next routing layer. A history keeps them as `-3`
//! (group) and `-4` (successor) records; the read-ahead (`TRANSITIONS=1`) predicts the next
//! layer's experts from them.
//!
//! Owns the table, its arithmetic (wrapping `u32`, as the counters), what a file keeps of
//! it and the prediction. It must not know about files, the store or settings: the counters
//! carry it (see `counters`), the reader admits its records (see `history`).

use std::collections::BTreeMap;

use super::save::Decay;

/// `-3 <src_layer * n_experts + src_expert> <dst_layer>`: opens a source's group.
pub const GROUP_RECORD: i32 = -3;
/// `-4 <dst_expert> <count>`: one successor of the group above it.
pub const EDGE_RECORD: i32 = -4;

/// Successors a file keeps per source, hottest first: the prediction reads at most a
/// layer's top-k of them, and a cut file keeps the most useful edges.
pub const TOP_SUCCESSORS: usize = 8;

/// The successors of one source expert.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Source {
    dst_layer: usize,
    next: BTreeMap<usize, u32>,
}

/// Transition counts by source cell (`layer * n_experts + expert`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Transitions {
    sources: BTreeMap<usize, Source>,
}

impl Transitions {
    /// Whether no transition is counted.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// Every edge as (source cell, destination layer, successor, count), in cell order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, usize, usize, u32)> + '_ {
        self.sources
            .iter()
            .flat_map(|(&cell, s)| s.next.iter().map(move |(&e, &c)| (cell, s.dst_layer, e, c)))
    }

    /// Wrapping `+= count` on one edge. A source follows one destination layer: an edge to
    /// another is refused (`false`), as is the first edge of a group whose layer differs.
    pub fn add(&mut self, cell: usize, dst_layer: usize, expert: usize, count: u32) -> bool {
        let source = self.sources.entry(cell).or_insert_with(|| Source {
            dst_layer,
            next: BTreeMap::new(),
        });
        if source.dst_layer != dst_layer {
            return false;
        }
        let c = source.next.entry(expert).or_insert(0);
        *c = c.wrapping_add(count);
        if *c == 0 {
            source.next.remove(&expert);
        }
        true
    }

    /// One row's step from `src` (the experts layer `src_layer` chose) to `dst` (those of
    /// the next routing layer `dst_layer`): every pair counts once.
    pub fn observe(
        &mut self,
        n_experts: usize,
        src_layer: usize,
        src: &[usize],
        dst_layer: usize,
        dst: &[usize],
    ) {
        for &s in src {
            for &d in dst {
                self.add(src_layer * n_experts + s, dst_layer, d, 1);
            }
        }
    }

    /// `self += other`, edge by edge.
    pub fn absorb(&mut self, other: &Transitions) {
        for (&cell, s) in &other.sources {
            for (&e, &c) in &s.next {
                self.add(cell, s.dst_layer, e, c);
            }
        }
    }

    /// `self += current - baseline`, edge by edge (wrapping, as the counters' gain).
    pub fn add_gain(&mut self, current: &Transitions, baseline: &Transitions) {
        for (&cell, s) in &current.sources {
            let base = baseline.sources.get(&cell);
            for (&e, &c) in &s.next {
                let before = base.and_then(|b| b.next.get(&e)).copied().unwrap_or(0);
                let gain = c.wrapping_sub(before);
                if gain != 0 {
                    self.add(cell, s.dst_layer, e, gain);
                }
            }
        }
    }

    /// The decay every counter takes at a save.
    pub fn decay(&mut self, d: Decay) {
        for s in self.sources.values_mut() {
            s.next.values_mut().for_each(|c| *c = d.apply(*c));
            s.next.retain(|_, c| *c != 0);
        }
        self.sources.retain(|_, s| !s.next.is_empty());
    }

    /// Forgets every edge from or to `layer` (a row that does not route).
    pub fn drop_layer(&mut self, n_experts: usize, layer: usize) {
        self.sources
            .retain(|&cell, s| cell / n_experts != layer && s.dst_layer != layer);
    }

    /// A source's successors, hottest first (ties: the lower id).
    fn ranked(source: &Source) -> Vec<(usize, u32)> {
        let mut next: Vec<(usize, u32)> = source.next.iter().map(|(&e, &c)| (e, c)).collect();
        next.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        next
    }

    /// What a file keeps, as records: for each source `hot` accepts, in ascending cell
    /// order, its `-3` group and its top [`TOP_SUCCESSORS`] successors as `-4` records,
    /// hottest first.
    pub fn records(&self, hot: impl Fn(usize) -> bool) -> Vec<[i64; 3]> {
        let mut out = Vec::new();
        for (&cell, s) in &self.sources {
            if !hot(cell) {
                continue;
            }
            out.push([i64::from(GROUP_RECORD), cell as i64, s.dst_layer as i64]);
            for (e, c) in Self::ranked(s).into_iter().take(TOP_SUCCESSORS) {
                out.push([i64::from(EDGE_RECORD), e as i64, i64::from(c)]);
            }
        }
        out
    }

    /// The `k` experts of the next routing layer that most often followed `ids` (chosen at
    /// `layer`), and that layer; `None` when no chosen expert has successors. Each
    /// source's successors are weighed by their share of its count, so a hot source does
    /// not drown the others.
    pub fn predict(
        &self,
        n_experts: usize,
        layer: usize,
        ids: &[usize],
        k: usize,
    ) -> Option<(usize, Vec<usize>)> {
        let mut score: BTreeMap<usize, f64> = BTreeMap::new();
        let mut dst_layer = None;
        for &id in ids {
            let Some(s) = self.sources.get(&(layer * n_experts + id)) else {
                continue;
            };
            if *dst_layer.get_or_insert(s.dst_layer) != s.dst_layer {
                continue;
            }
            let seen: f64 = s.next.values().map(|&c| f64::from(c)).sum();
            for (e, c) in Self::ranked(s).into_iter().take(TOP_SUCCESSORS) {
                *score.entry(e).or_insert(0.0) += f64::from(c) / seen;
            }
        }
        let mut ranked: Vec<(usize, f64)> = score.into_iter().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let dst = dst_layer?;
        Some((dst, ranked.into_iter().take(k).map(|(e, _)| e).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_keep_the_top_successors_of_sources_seen_enough() {
        let mut t = Transitions::default();
        // Source (0, 1) in an 4-expert table: followed 20 times.
        for (e, n) in [(0, 2), (1, 9), (2, 9), (3, 0)] {
            for _ in 0..n {
                t.observe(4, 0, &[1], 1, &[e]);
            }
        }
        // Source (0, 2): not hot enough to be written.
        t.observe(4, 0, &[2], 1, &[0, 1, 3]);
        assert_eq!(
            t.records(|cell| cell == 1),
            vec![[-3, 1, 1], [-4, 1, 9], [-4, 2, 9], [-4, 0, 2]]
        );
        assert_eq!(t.predict(4, 0, &[1], 2), Some((1, vec![1, 2])));
        assert_eq!(t.predict(4, 0, &[3], 2), None);
    }

    #[test]
    fn a_source_follows_one_layer_and_gains_add_up() {
        let mut t = Transitions::default();
        assert!(t.add(5, 2, 0, 3));
        assert!(!t.add(5, 3, 0, 1), "a second destination layer is refused");
        let base = t.clone();
        t.add(5, 2, 1, 4);
        let mut disk = Transitions::default();
        disk.add(5, 2, 0, 10);
        disk.add_gain(&t, &base);
        let mut want = Transitions::default();
        want.add(5, 2, 0, 10);
        want.add(5, 2, 1, 4);
        assert_eq!(disk, want);
        disk.drop_layer(4, 1);
        assert!(disk.is_empty(), "cell 5 is layer 1 of a 4-expert table");
    }
}
