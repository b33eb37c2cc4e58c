//! The selection-count table: rows `0..=n_layers` of `n_experts` u32 counters.
//!
//! Owns the shape, the dropped-row admission rule and the counter arithmetic (u32 with
//! wrap-around, as colibri's `uint32_t` counters; totals in i64). It knows nothing about
//! files, tracing or placement.
//!
//! The row count is `n_layers + 1` because the last row is a multi-token-prediction head on
//! the models that have one; every engine drops the rows that do not route (dense layers,
//! an absent MTP head). A dropped row is the *admission rule*, not an optimisation: it
//! admits no history record, counts nothing and is never written, so a record naming a
//! dense layer can neither inflate a total nor be written back.

use std::collections::{BTreeMap, BTreeSet};

use super::save::Decay;
use super::transitions::Transitions;

/// Tables up to this many cells are dense; larger shapes (which no model has, but a
/// history file may declare) keep only their non-zero cells, so that a one-line file
/// claiming two billion layers costs one entry, not terabytes.
const DENSE_CELLS: usize = 1 << 24;

/// Why a table of this shape cannot exist.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    /// A MoE model has at least one expert.
    #[error("a routing table needs at least one expert (got n_experts = 0)")]
    NoExperts,
    /// Header records print both dimensions with `%d`.
    #[error("n_layers = {n_layers} and n_experts = {n_experts} must both fit a C int")]
    TooLarge {
        /// Layers requested.
        n_layers: usize,
        /// Experts requested.
        n_experts: usize,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Cells {
    /// Row-major, `(n_layers + 1) * n_experts` counters.
    Dense(Vec<u32>),
    /// The non-zero counters by (layer, expert).
    Sparse(BTreeMap<(usize, usize), u32>),
}

/// Per-(layer, expert) selection counts with dropped rows: the lifetime counts, and the
/// recent heat of a history's `-5` records (an integer moving average of the selections
/// per save, see [`Counters::update_recent`]) in a table of the same shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counters {
    n_layers: usize,
    n_experts: usize,
    dropped: BTreeSet<usize>,
    cells: Cells,
    /// Created on the first recent count; `None` is all zero.
    recent: Option<Box<Counters>>,
    /// Which experts followed which, from one routing layer to the next.
    transitions: Transitions,
}

impl Counters {
    /// A zeroed table with rows `0..=n_layers`, all live.
    pub fn new(n_layers: usize, n_experts: usize) -> Result<Counters, ShapeError> {
        if n_experts == 0 {
            return Err(ShapeError::NoExperts);
        }
        let max = i32::MAX as usize;
        if n_layers >= max || n_experts > max {
            return Err(ShapeError::TooLarge {
                n_layers,
                n_experts,
            });
        }
        let cells = match (n_layers + 1).checked_mul(n_experts) {
            Some(n) if n <= DENSE_CELLS => Cells::Dense(vec![0; n]),
            _ => Cells::Sparse(BTreeMap::new()),
        };
        Ok(Counters {
            n_layers,
            n_experts,
            dropped: BTreeSet::new(),
            cells,
            recent: None,
            transitions: Transitions::default(),
        })
    }

    /// A zeroed table with the same shape and the same dropped rows.
    pub fn zeroed_like(&self) -> Counters {
        let cells = match &self.cells {
            Cells::Dense(v) => Cells::Dense(vec![0; v.len()]),
            Cells::Sparse(_) => Cells::Sparse(BTreeMap::new()),
        };
        Counters {
            n_layers: self.n_layers,
            n_experts: self.n_experts,
            dropped: self.dropped.clone(),
            cells,
            recent: None,
            transitions: Transitions::default(),
        }
    }

    /// The `n_layers` given at construction: the index of the last row, and the value of
    /// a history's `-1` record.
    pub fn n_layers(&self) -> usize {
        self.n_layers
    }

    /// Experts per row.
    pub fn n_experts(&self) -> usize {
        self.n_experts
    }

    /// Marks a layer as non-routing; out-of-range layers are ignored. Permanent.
    pub fn drop_row(&mut self, layer: usize) {
        if layer > self.n_layers {
            return;
        }
        self.dropped.insert(layer);
        if let Some(r) = self.recent.as_mut() {
            r.drop_row(layer);
        }
        self.transitions.drop_layer(self.n_experts, layer);
        let ne = self.n_experts;
        match &mut self.cells {
            Cells::Dense(v) => v[layer * ne..(layer + 1) * ne].fill(0),
            Cells::Sparse(m) => m.retain(|&(l, _), _| l != layer),
        }
    }

    /// Whether `layer` is a live (routing) row.
    pub fn routes(&self, layer: usize) -> bool {
        layer <= self.n_layers && !self.dropped.contains(&layer)
    }

    /// The non-zero counters grouped by row, row ascending, experts ascending within
    /// one; rows without a selection are skipped, so a sparse table of a huge declared
    /// shape is walked in the time its entries take.
    pub fn nonzero_rows(&self) -> impl Iterator<Item = (usize, Vec<(usize, u32)>)> + '_ {
        let mut cells = self.nonzero().peekable();
        std::iter::from_fn(move || {
            let (layer, e, c) = cells.next()?;
            let mut row = vec![(e, c)];
            while let Some((_, e, c)) = cells.next_if(|&(l, _, _)| l == layer) {
                row.push((e, c));
            }
            Some((layer, row))
        })
    }

    /// One counter; 0 for a dropped row or an index outside the table.
    pub fn get(&self, layer: usize, expert: usize) -> u32 {
        if !self.routes(layer) || expert >= self.n_experts {
            return 0;
        }
        match &self.cells {
            Cells::Dense(v) => v[layer * self.n_experts + expert],
            Cells::Sparse(m) => m.get(&(layer, expert)).copied().unwrap_or(0),
        }
    }

    /// (layer, expert) if the table can hold a record for it: a live row and an expert in
    /// range.
    fn cell_of(&self, layer: i64, expert: i64) -> Option<(usize, usize)> {
        let l = usize::try_from(layer).ok()?;
        let e = usize::try_from(expert).ok()?;
        (self.routes(l) && e < self.n_experts).then_some((l, e))
    }

    /// Whether a history record for (layer, expert) would be admitted.
    pub fn holds(&self, layer: i64, expert: i64) -> bool {
        self.cell_of(layer, expert).is_some()
    }

    /// Whether (layer, expert) lies outside the table's shape altogether (a layer above
    /// `n_layers` or an expert id of `n_experts` or more), as opposed to on a dropped row.
    pub fn beyond_shape(&self, layer: i64, expert: i64) -> bool {
        let (Ok(l), Ok(e)) = (usize::try_from(layer), usize::try_from(expert)) else {
            return true;
        };
        l > self.n_layers || e >= self.n_experts
    }

    /// Wrapping `+= by` on one cell already known to be in the table.
    fn bump(&mut self, (l, e): (usize, usize), by: u32) {
        match &mut self.cells {
            Cells::Dense(v) => {
                let c = &mut v[l * self.n_experts + e];
                *c = c.wrapping_add(by);
            }
            Cells::Sparse(m) => {
                let c = m.entry((l, e)).or_insert(0);
                *c = c.wrapping_add(by);
                if *c == 0 {
                    m.remove(&(l, e));
                }
            }
        }
    }

    /// Adds a history record if the table can hold it (live row, expert in range);
    /// duplicates are summed. Returns whether it was admitted: only admitted counts may be
    /// totalled.
    pub fn admit(&mut self, layer: i64, expert: i64, count: u32) -> bool {
        match self.cell_of(layer, expert) {
            Some(cell) => {
                self.bump(cell, count);
                true
            }
            None => false,
        }
    }

    /// Counts one routing decision: each in-range id once (duplicates each count).
    pub fn count(&mut self, layer: usize, ids: &[usize]) {
        if !self.routes(layer) {
            return;
        }
        let ne = self.n_experts;
        for &id in ids.iter().filter(|&&id| id < ne) {
            self.bump((layer, id), 1);
        }
    }

    /// Sum of every counter, as the `[STATS]` and `[USAGE]` lines print it.
    pub fn total(&self) -> i64 {
        self.nonzero().map(|(_, _, c)| i64::from(c)).sum()
    }

    /// Number of non-zero counters.
    pub fn distinct(&self) -> u64 {
        self.nonzero().count() as u64
    }

    /// Non-zero counters in write order: layer ascending, then expert ascending.
    pub fn nonzero(&self) -> Box<dyn Iterator<Item = (usize, usize, u32)> + '_> {
        let ne = self.n_experts;
        match &self.cells {
            Cells::Dense(v) => Box::new(
                v.iter()
                    .enumerate()
                    .filter(|&(_, &c)| c != 0)
                    .map(move |(i, &c)| (i / ne, i % ne, c)),
            ),
            Cells::Sparse(m) => Box::new(m.iter().map(|(&(l, e), &c)| (l, e, c))),
        }
    }

    /// The recent heat (`-5` records), if any cell has some.
    pub fn recent(&self) -> Option<&Counters> {
        self.recent.as_deref()
    }

    /// Adds a `-5` record's recent heat if the table can hold the cell; returns whether it
    /// was admitted.
    pub fn admit_recent(&mut self, layer: i64, expert: i64, heat: u32) -> bool {
        if !self.holds(layer, expert) {
            return false;
        }
        self.recent_mut().admit(layer, expert, heat)
    }

    fn recent_mut(&mut self) -> &mut Counters {
        let like = self.zeroed_like();
        self.recent.get_or_insert_with(|| Box::new(like))
    }

    /// `self += other`, cell by cell (wrapping), recent heat included; both tables have the
    /// same shape.
    pub(crate) fn absorb(&mut self, other: &Counters) {
        for (l, e, c) in other.nonzero() {
            if self.routes(l) {
                self.bump((l, e), c);
            }
        }
        if let Some(r) = other.recent() {
            self.recent_mut().absorb(r);
        }
        self.transitions.absorb(&other.transitions);
    }

    /// The expert transitions counted with this table.
    pub fn transitions(&self) -> &Transitions {
        &self.transitions
    }

    /// The routing row after `layer`: the next row that routes.
    pub fn next_routing(&self, layer: usize) -> Option<usize> {
        (layer + 1..=self.n_layers).find(|&l| self.routes(l))
    }

    /// Adds a `-4` record's count to the edge from cell `src_cell` (of a `-3` group) to
    /// expert `expert` of `dst_layer`, when the table can hold it: both rows route, the
    /// destination comes after the source, and the ids are in range. (An engine counts
    /// only steps to the next routing row; a tool that merges histories does not know
    /// which rows route, so it must not ask for more.)
    pub fn admit_transition(
        &mut self,
        src_cell: i64,
        dst_layer: i64,
        expert: i64,
        count: u32,
    ) -> bool {
        let ne = self.n_experts as i64;
        let Some((src, _)) = self.cell_of(src_cell.div_euclid(ne), src_cell.rem_euclid(ne)) else {
            return false;
        };
        if src_cell < 0 || dst_layer <= src as i64 {
            return false;
        }
        match self.cell_of(dst_layer, expert) {
            Some((dst, e)) => self.transitions.add(src_cell as usize, dst, e, count),
            None => false,
        }
    }

    /// Counts one row's step from the experts `src` chose at `src_layer` to those `dst`
    /// chose at `dst_layer`, when `dst_layer` is the next routing row after `src_layer`.
    pub fn count_transition(
        &mut self,
        src_layer: usize,
        src: &[usize],
        dst_layer: usize,
        dst: &[usize],
    ) {
        if !self.routes(src_layer) || self.next_routing(src_layer) != Some(dst_layer) {
            return;
        }
        let ne = self.n_experts;
        let (src, dst): (Vec<usize>, Vec<usize>) = (
            src.iter().copied().filter(|&e| e < ne).collect(),
            dst.iter().copied().filter(|&e| e < ne).collect(),
        );
        self.transitions
            .observe(ne, src_layer, &src, dst_layer, &dst);
    }

    /// Per cell, `current - baseline` in wrapping u32 arithmetic where it is not zero: the
    /// selections counted since `baseline` was taken.
    fn gains<'a>(
        current: &'a Counters,
        baseline: &'a Counters,
    ) -> impl Iterator<Item = (usize, usize, u32)> + 'a {
        let grown = current
            .nonzero()
            .map(|(l, e, c)| (l, e, c.wrapping_sub(baseline.get(l, e))));
        // A cell that fell to zero in `current` (a wrapped counter) gains 0 - baseline.
        let wrapped = baseline
            .nonzero()
            .filter(|&(l, e, _)| current.get(l, e) == 0)
            .map(|(l, e, b)| (l, e, 0u32.wrapping_sub(b)));
        grown.chain(wrapped).filter(|&(_, _, g)| g != 0)
    }

    /// `self += current - baseline`: the counts `current` gained since `baseline` was
    /// taken, added onto a table re-read from disk.
    pub(crate) fn add_gain(&mut self, current: &Counters, baseline: &Counters) {
        for (l, e, g) in Self::gains(current, baseline) {
            if self.routes(l) {
                self.bump((l, e), g);
            }
        }
        self.transitions
            .add_gain(&current.transitions, &baseline.transitions);
    }

    /// One save's step of the recent heat, on a table re-read from disk: every cell
    /// becomes `recent - (recent >> 6) + gain`, the gain being the selections counted since
    /// the last save (`current - baseline`). A cell's heat so halves in about 44 saves
    /// without selections, and a workload that switches stops ranking by a month-old past.
    pub(crate) fn update_recent(&mut self, current: &Counters, baseline: &Counters) {
        let mut next = self.zeroed_like();
        if let Some(old) = self.recent.take() {
            for (l, e, r) in old.nonzero() {
                next.bump((l, e), r - (r >> 6));
            }
        }
        for (l, e, g) in Self::gains(current, baseline) {
            if next.routes(l) {
                next.bump((l, e), g);
            }
        }
        self.recent = (next.distinct() > 0).then(|| Box::new(next));
    }

    /// Applies `COLI_USAGE_DECAY` to every counter (`(u32)(c * d + 0.5)`).
    pub(crate) fn decay(&mut self, d: Decay) {
        if d == Decay::NONE {
            return;
        }
        self.transitions.decay(d);
        match &mut self.cells {
            Cells::Dense(v) => {
                for c in v.iter_mut().filter(|c| **c != 0) {
                    *c = d.apply(*c);
                }
            }
            Cells::Sparse(m) => {
                for c in m.values_mut() {
                    *c = d.apply(*c);
                }
                m.retain(|_, c| *c != 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_shape() {
        let c = Counters::new(5, 8).expect("shape");
        assert!(c.routes(0));
        assert!(c.routes(5));
        assert!(!c.routes(6));
        assert!(!c.clone().admit(-1, 0, 1));
    }

    #[test]
    fn shape_errors() {
        assert_eq!(Counters::new(3, 0), Err(ShapeError::NoExperts));
        assert!(Counters::new(i32::MAX as usize, 4).is_err());
    }

    #[test]
    fn dropped_row_admits_nothing() {
        let mut c = Counters::new(5, 8).expect("shape");
        c.drop_row(2);
        assert!(!c.admit(2, 3, 50));
        c.count(2, &[1, 2, 3]);
        assert_eq!(c.total(), 0);
        assert!(c.admit(3, 4, 7));
        assert_eq!(c.total(), 7);
        assert_eq!(c.nonzero().collect::<Vec<_>>(), vec![(3, 4, 7)]);
    }

    #[test]
    fn count_ignores_out_of_range_and_counts_duplicates() {
        let mut c = Counters::new(1, 4).expect("shape");
        c.count(0, &[1, 1, 9]);
        assert_eq!(c.get(0, 1), 2);
        assert_eq!(c.total(), 2);
    }

    #[test]
    fn wraps_like_uint32() {
        let mut c = Counters::new(0, 2).expect("shape");
        assert!(c.admit(0, 0, u32::MAX));
        c.count(0, &[0]);
        assert_eq!(c.get(0, 0), 0);
    }

    #[test]
    fn huge_declared_shapes_are_sparse() {
        let mut c = Counters::new(2_000_000_000, 2_000_000_000).expect("shape");
        assert!(c.admit(1_999_999_999, 1_999_999_999, 7));
        assert!(!c.admit(2_000_000_001, 0, 1));
        assert!(c.beyond_shape(2_000_000_001, 0));
        c.drop_row(5);
        assert!(!c.admit(5, 0, 1));
        assert!(!c.beyond_shape(5, 0));
        assert_eq!(c.total(), 7);
        let rows: Vec<_> = c.nonzero_rows().collect();
        assert_eq!(rows, vec![(1_999_999_999, vec![(1_999_999_999, 7)])]);
        let mut z = c.zeroed_like();
        z.absorb(&c);
        assert_eq!(z, c);
    }

    #[test]
    fn recent_heat_is_an_integer_moving_average_per_save() {
        let mut disk = Counters::new(1, 4).expect("shape");
        let base = disk.clone();
        let mut cur = disk.clone();
        cur.count(0, &[1, 1, 2]);
        disk.update_recent(&cur, &base);
        let r = disk.recent().expect("heat");
        assert_eq!((r.get(0, 1), r.get(0, 2)), (2, 1));
        // No selections since: 200 - (200 >> 6) = 197; 1 - 0 = 1.
        let mut disk = Counters::new(1, 4).expect("shape");
        disk.admit_recent(0, 1, 200);
        disk.admit_recent(0, 2, 1);
        let same = disk.zeroed_like();
        disk.update_recent(&same, &same);
        let r = disk.recent().expect("heat");
        assert_eq!((r.get(0, 1), r.get(0, 2)), (197, 1));
        assert_eq!(disk.total(), 0, "recent heat is not a lifetime count");
    }

    #[test]
    fn gain_adds_only_new_counts() {
        let mut cur = Counters::new(0, 3).expect("shape");
        cur.admit(0, 1, 5);
        let base = cur.clone();
        cur.count(0, &[1, 2]);
        let mut disk = cur.zeroed_like();
        disk.admit(0, 1, 10);
        disk.add_gain(&cur, &base);
        assert_eq!(disk.get(0, 1), 11);
        assert_eq!(disk.get(0, 2), 1);
    }
}
