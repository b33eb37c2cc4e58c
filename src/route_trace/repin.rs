//! REPIN: live re-pinning from this session's routing heat.
//!
//! Owns the session heat map (frequency and recency per expert, never persisted, separate
//! from the history counters), the swap rule and the pass schedule. It produces a list of
//! swaps; performing them (loading the admitted expert into the evicted one's slot) is the
//! expert cache's job. The persistent history is never decayed by REPIN.

use super::cfmt::fixed;

/// Frequency and recency of each expert's selections this session.
#[derive(Clone, Debug)]
pub struct SessionHeat {
    n_experts: usize,
    heat: Vec<u32>,
    last: Vec<u32>,
    clock: u32,
}

impl SessionHeat {
    /// A cold map for `rows` rows of `n_experts`.
    pub(super) fn new(rows: usize, n_experts: usize) -> SessionHeat {
        SessionHeat {
            n_experts,
            heat: vec![0; rows * n_experts],
            last: vec![0; rows * n_experts],
            clock: 0,
        }
    }

    /// One routing decision: each in-range id gains one heat (saturating) and the next
    /// clock tick as its last use.
    pub(super) fn record(&mut self, layer: usize, ids: &[usize]) {
        let start = layer * self.n_experts;
        for &id in ids.iter().filter(|&&id| id < self.n_experts) {
            let i = start + id;
            if i < self.heat.len() {
                self.heat[i] = self.heat[i].saturating_add(1);
                self.clock = self.clock.wrapping_add(1);
                self.last[i] = self.clock;
            }
        }
    }

    /// Selections of (layer, expert) this session, halved at every pass.
    pub fn heat(&self, layer: usize, expert: usize) -> u32 {
        self.index(layer, expert).map_or(0, |i| self.heat[i])
    }

    fn index(&self, layer: usize, expert: usize) -> Option<usize> {
        let i = layer.checked_mul(self.n_experts)?.checked_add(expert)?;
        (expert < self.n_experts && i < self.heat.len()).then_some(i)
    }

    /// `(heat << 8) | recent`, where `recent = 255 - age` for an expert used within the
    /// last 255 selections and 0 otherwise. Frequency dominates; recency breaks near-ties.
    /// An expert never selected this session has no recency at all.
    pub fn score(&self, layer: usize, expert: usize) -> u64 {
        let Some(i) = self.index(layer, expert) else {
            return 0;
        };
        let last = self.last[i];
        let age = self.clock.wrapping_sub(last);
        let recent = if last != 0 && age < 255 { 255 - age } else { 0 };
        (u64::from(self.heat[i]) << 8) | u64::from(recent)
    }

    /// Halves every heat; called after each pass so old bursts fade.
    pub fn halve(&mut self) {
        for h in &mut self.heat {
            *h >>= 1;
        }
    }
}

/// One planned swap in a layer's pinned set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Swap {
    /// The layer.
    pub layer: usize,
    /// The pinned expert to unpin.
    pub evict: usize,
    /// Its heat.
    pub evict_heat: u32,
    /// The expert to pin in its place.
    pub admit: usize,
    /// Its heat.
    pub admit_heat: u32,
    /// `(score(admit) - score(evict)) >> 8`: roughly the heat gained.
    pub gain: u64,
}

impl Swap {
    /// `[REPIN] <tier> layer <l>: evict <old> (heat=<h>) <- admit <new> (heat=<h>) in <ms> ms`.
    pub fn line(&self, tier: &str, millis: f64) -> String {
        format!(
            "[REPIN] {tier} layer {}: evict {} (heat={}) <- admit {} (heat={}) in {} ms",
            self.layer,
            self.evict,
            self.evict_heat,
            self.admit,
            self.admit_heat,
            fixed(millis, 0)
        )
    }
}

/// Swaps per pass during decode.
pub const REPIN_PASS_LIMIT: usize = 16;
/// Swaps in the pass right after prefill, when the heat map has just filled.
pub const REPIN_PREFILL_LIMIT: usize = 32;

/// Plans one REPIN pass. For every layer with pins, the coldest pinned expert (lowest
/// score, first in `pinned[layer]` on a tie) is swapped for the hottest unpinned one
/// (highest score, lowest id on a tie) only when the hot score beats the cold one by 25%
/// plus four selections (`hot > cold + cold/4 + 4·256`), so two experts of similar heat do
/// not trade places on every pass. At most `limit` swaps are kept, largest gain first
/// (lower layer first on equal gain). Call [`SessionHeat::halve`] after the pass.
pub fn plan_repin(heat: &SessionHeat, pinned: &[Vec<usize>], limit: usize) -> Vec<Swap> {
    let mut swaps = Vec::new();
    for (layer, pins) in pinned.iter().enumerate() {
        let Some(&cold) = pins.iter().min_by_key(|&&e| heat.score(layer, e)) else {
            continue;
        };
        let cold_score = heat.score(layer, cold);
        let hot = (0..heat.n_experts)
            .filter(|e| !pins.contains(e))
            .map(|e| (heat.score(layer, e), e))
            .fold(None, |best: Option<(u64, usize)>, (s, e)| match best {
                Some((bs, _)) if bs >= s => best,
                _ => Some((s, e)),
            });
        let Some((hot_score, hot)) = hot else {
            continue;
        };
        if hot_score > cold_score + cold_score / 4 + (4 << 8) {
            swaps.push(Swap {
                layer,
                evict: cold,
                evict_heat: heat.heat(layer, cold),
                admit: hot,
                admit_heat: heat.heat(layer, hot),
                gain: (hot_score - cold_score) >> 8,
            });
        }
    }
    swaps.sort_by(|a, b| b.gain.cmp(&a.gain).then(a.layer.cmp(&b.layer)));
    swaps.truncate(limit);
    swaps
}

/// Plans the VRAM half of a REPIN pass, where a GPU holds an expert tier: for every layer,
/// the coldest resident expert (lowest heat, first in `resident[layer]` on a tie) is traded
/// for the hottest expert pinned in RAM (highest heat, first in `pinned[layer]` on a tie)
/// when the RAM pin's heat exceeds the resident one's by more than one, colibri's rule for
/// its CUDA tier. The RAM pins are the candidates because the RAM half of the pass has just
/// pinned the session's hottest experts. At most `limit` trades, largest gain first (lower
/// layer first on equal gain); `gain` is the difference in heat.
pub fn plan_vram_repin(
    heat: &SessionHeat,
    resident: &[Vec<usize>],
    pinned: &[Vec<usize>],
    limit: usize,
) -> Vec<Swap> {
    let mut swaps = Vec::new();
    for (layer, (resident, pinned)) in resident.iter().zip(pinned).enumerate() {
        let Some(&cold) = resident.iter().min_by_key(|&&e| heat.heat(layer, e)) else {
            continue;
        };
        let hot = pinned.iter().copied().reduce(|best, e| {
            if heat.heat(layer, e) > heat.heat(layer, best) {
                e
            } else {
                best
            }
        });
        let Some(hot) = hot else {
            continue;
        };
        let (cold_heat, hot_heat) = (heat.heat(layer, cold), heat.heat(layer, hot));
        if hot_heat > cold_heat.saturating_add(1) {
            swaps.push(Swap {
                layer,
                evict: cold,
                evict_heat: cold_heat,
                admit: hot,
                admit_heat: hot_heat,
                gain: u64::from(hot_heat - cold_heat),
            });
        }
    }
    swaps.sort_by(|a, b| b.gain.cmp(&a.gain).then(a.layer.cmp(&b.layer)));
    swaps.truncate(limit);
    swaps
}

/// When passes run: `REPIN=N` runs one after every N emitted tokens (0 = never).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RepinSchedule {
    every: u64,
    since: u64,
}

impl RepinSchedule {
    /// `REPIN=every`.
    pub fn new(every: u64) -> RepinSchedule {
        RepinSchedule { every, since: 0 }
    }

    /// Records `n` emitted tokens; true when a pass is due (the count then restarts).
    pub fn tokens(&mut self, n: u64) -> bool {
        if self.every == 0 {
            return false;
        }
        self.since += n;
        if self.since >= self.every {
            self.since = 0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heat_with(n: usize, picks: &[(usize, usize, u32)]) -> SessionHeat {
        let mut h = SessionHeat::new(2, n);
        for &(l, e, times) in picks {
            for _ in 0..times {
                h.record(l, &[e]);
            }
        }
        h
    }

    #[test]
    fn hysteresis_blocks_small_gains() {
        // Pinned 0 has heat 10, unpinned 1 has heat 14: 14*256+r vs 10*256*1.25+1024.
        let h = heat_with(4, &[(0, 0, 10), (0, 1, 14)]);
        assert!(plan_repin(&h, &[vec![0]], 16).is_empty());
        let h = heat_with(4, &[(0, 0, 10), (0, 1, 30)]);
        let s = plan_repin(&h, &[vec![0]], 16);
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].evict, s[0].admit), (0, 1));
        assert_eq!((s[0].evict_heat, s[0].admit_heat), (10, 30));
    }

    #[test]
    fn cold_is_least_score_and_limit_keeps_largest_gains() {
        let h = heat_with(4, &[(0, 0, 50), (0, 3, 80), (1, 2, 40)]);
        let pinned = vec![vec![0, 1], vec![0]];
        let s = plan_repin(&h, &pinned, 16);
        assert_eq!(s.len(), 2);
        assert_eq!((s[0].layer, s[0].evict, s[0].admit), (0, 1, 3));
        assert_eq!((s[1].layer, s[1].evict, s[1].admit), (1, 0, 2));
        assert_eq!(plan_repin(&h, &pinned, 1).len(), 1);
    }

    #[test]
    fn vram_trades_its_coldest_for_the_hottest_ram_pin_past_one_selection() {
        // Layer 0: resident 0 (heat 5) and 1 (heat 2); RAM pins 2 (heat 3) and 3 (heat 9).
        // Layer 1: resident 0 (heat 4), RAM pin 1 (heat 5): a gain of one is no trade.
        let h = heat_with(
            4,
            &[
                (0, 0, 5),
                (0, 1, 2),
                (0, 2, 3),
                (0, 3, 9),
                (1, 0, 4),
                (1, 1, 5),
            ],
        );
        let resident = vec![vec![0, 1], vec![0]];
        let pinned = vec![vec![2, 3], vec![1]];
        let s = plan_vram_repin(&h, &resident, &pinned, 16);
        assert_eq!(s.len(), 1);
        assert_eq!(
            (s[0].layer, s[0].evict, s[0].admit, s[0].gain),
            (0, 1, 3, 7)
        );
        assert_eq!((s[0].evict_heat, s[0].admit_heat), (2, 9));
        // A layer without RAM pins or without residents trades nothing; ties go to the
        // first listed on both sides; the limit keeps the largest gains.
        let h = heat_with(4, &[(0, 2, 3), (0, 3, 3), (1, 1, 8)]);
        let s = plan_vram_repin(&h, &[vec![0, 1], vec![0]], &[vec![3, 2], vec![1]], 16);
        assert_eq!(
            s.iter()
                .map(|s| (s.layer, s.evict, s.admit))
                .collect::<Vec<_>>(),
            [(1, 0, 1), (0, 0, 3)]
        );
        assert_eq!(
            plan_vram_repin(&h, &[vec![0, 1], vec![0]], &[vec![3, 2], vec![1]], 1).len(),
            1
        );
        assert!(plan_vram_repin(&h, &[vec![], vec![0]], &[vec![3], vec![]], 16).is_empty());
    }

    #[test]
    fn recency_and_halving() {
        let mut h = heat_with(4, &[(0, 1, 1)]);
        assert_eq!(h.score(0, 1), (1 << 8) | 255);
        assert_eq!(h.score(0, 2), 0);
        h.halve();
        assert_eq!(h.heat(0, 1), 0);
        assert_eq!(h.score(0, 1), 255);
    }

    #[test]
    fn schedule() {
        let mut s = RepinSchedule::new(3);
        assert!(!s.tokens(2));
        assert!(s.tokens(1));
        assert!(!s.tokens(1));
        assert!(!RepinSchedule::new(0).tokens(100));
    }

    #[test]
    fn swap_line() {
        let s = Swap {
            layer: 4,
            evict: 7,
            evict_heat: 2,
            admit: 9,
            admit_heat: 40,
            gain: 38,
        };
        assert_eq!(
            s.line("RAM", 12.4),
            "[REPIN] RAM layer 4: evict 7 (heat=2) <- admit 9 (heat=40) in 12 ms"
        );
    }
}
