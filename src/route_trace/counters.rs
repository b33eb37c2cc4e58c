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

use super::save::Decay;

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

/// Per-(layer, expert) selection counts with dropped rows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Counters {
    n_layers: usize,
    n_experts: usize,
    live: Vec<bool>,
    cells: Vec<u32>,
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
        let rows = n_layers + 1;
        let cells = rows.checked_mul(n_experts).ok_or(ShapeError::TooLarge {
            n_layers,
            n_experts,
        })?;
        Ok(Counters {
            n_layers,
            n_experts,
            live: vec![true; rows],
            cells: vec![0; cells],
        })
    }

    /// A zeroed table with the same shape and the same dropped rows.
    pub fn zeroed_like(&self) -> Counters {
        Counters {
            n_layers: self.n_layers,
            n_experts: self.n_experts,
            live: self.live.clone(),
            cells: vec![0; self.cells.len()],
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
        if let Some(live) = self.live.get_mut(layer) {
            *live = false;
            let start = layer * self.n_experts;
            self.cells[start..start + self.n_experts].fill(0);
        }
    }

    /// Whether `layer` is a live (routing) row.
    pub fn routes(&self, layer: usize) -> bool {
        self.live.get(layer).copied().unwrap_or(false)
    }

    /// The counters of a live row.
    pub fn row(&self, layer: usize) -> Option<&[u32]> {
        if self.routes(layer) {
            let start = layer * self.n_experts;
            Some(&self.cells[start..start + self.n_experts])
        } else {
            None
        }
    }

    /// One counter; 0 for a dropped row or an index outside the table.
    pub fn get(&self, layer: usize, expert: usize) -> u32 {
        self.row(layer)
            .and_then(|r| r.get(expert).copied())
            .unwrap_or(0)
    }

    /// The cell index of (layer, expert) if the table can hold a record for it: a live
    /// row and an expert in range.
    fn cell_of(&self, layer: i64, expert: i64) -> Option<usize> {
        let l = usize::try_from(layer).ok()?;
        let e = usize::try_from(expert).ok()?;
        (self.routes(l) && e < self.n_experts).then_some(l * self.n_experts + e)
    }

    /// Whether a history record for (layer, expert) would be admitted.
    pub fn holds(&self, layer: i64, expert: i64) -> bool {
        self.cell_of(layer, expert).is_some()
    }

    /// Adds a history record if the table can hold it (live row, expert in range);
    /// duplicates are summed. Returns whether it was admitted: only admitted counts may be
    /// totalled.
    pub fn admit(&mut self, layer: i64, expert: i64, count: u32) -> bool {
        match self.cell_of(layer, expert) {
            Some(i) => {
                self.cells[i] = self.cells[i].wrapping_add(count);
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
        let start = layer * self.n_experts;
        let row = &mut self.cells[start..start + self.n_experts];
        for &id in ids {
            if let Some(c) = row.get_mut(id) {
                *c = c.wrapping_add(1);
            }
        }
    }

    /// Sum of every counter, as the `[STATS]` and `[USAGE]` lines print it.
    pub fn total(&self) -> i64 {
        self.cells.iter().map(|&c| i64::from(c)).sum()
    }

    /// Number of non-zero counters.
    pub fn distinct(&self) -> u64 {
        self.cells.iter().filter(|&&c| c != 0).count() as u64
    }

    /// Non-zero counters in write order: layer ascending, then expert ascending.
    pub fn nonzero(&self) -> impl Iterator<Item = (usize, usize, u32)> + '_ {
        let ne = self.n_experts;
        self.cells
            .iter()
            .enumerate()
            .filter(|&(_, &c)| c != 0)
            .map(move |(i, &c)| (i / ne, i % ne, c))
    }

    /// `self += other`, cell by cell (wrapping).
    pub(crate) fn absorb(&mut self, other: &Counters) {
        for (d, &o) in self.cells.iter_mut().zip(&other.cells) {
            *d = d.wrapping_add(o);
        }
    }

    /// `self += current - baseline`, cell by cell, in wrapping u32 arithmetic: the counts
    /// `current` gained since `baseline` was taken, added onto a table re-read from disk.
    pub(crate) fn add_gain(&mut self, current: &Counters, baseline: &Counters) {
        for ((d, &c), &b) in self
            .cells
            .iter_mut()
            .zip(&current.cells)
            .zip(&baseline.cells)
        {
            *d = d.wrapping_add(c.wrapping_sub(b));
        }
    }

    /// Applies `COLI_USAGE_DECAY` to every counter (`(u32)(c * d + 0.5)`).
    pub(crate) fn decay(&mut self, d: Decay) {
        if d != Decay::NONE {
            for c in self.cells.iter_mut().filter(|c| **c != 0) {
                *c = d.apply(*c);
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
        assert!(c.row(6).is_none());
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
