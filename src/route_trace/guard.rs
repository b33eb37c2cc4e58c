//! The shadow caches behind the abstain rule, and the per-layer cache model they share
//! with `coli trace simulate`.
//!
//! A history's pins are a prior: on text like the history's they beat LRU, on other text
//! they cost slots, and how many of them pay depends on the text too. The engine cannot
//! know before it runs, so it watches: per pinned layer, shadow caches replay the lookups
//! the expert store sees (each MoE call's distinct experts in ascending order), one per
//! candidate pin count: none (plain LRU over all the layer's slots), the count the layer
//! started with, and a grid up to the history's ranking (`PIN_N`, one slot short of the
//! layer's), each the top of the ranking pinned plus LRU over the rest. Once the layer has
//! seen [`ABSTAIN_AFTER`] lookups, and again at every doubling, it moves to the count whose
//! shadow hit most, when that beats the count it holds by more than 1% of its lookups
//! ([`moves`]): to none is giving the pins up (they stay as the most recent LRU entries),
//! to more is pinning the next-ranked experts. Judged between tokens. The shadows hold
//! expert ids only; nothing here touches weights or changes a token.

/// A layer is judged once its shadows have seen this many lookups (64 tokens at top-4).
pub const ABSTAIN_AFTER: u64 = 256;

/// One layer of an LRU or LFRU cache.
#[derive(Default, Debug)]
pub struct LayerCache {
    /// (expert, last lookup) of the resident experts.
    pub resident: Vec<(usize, u64)>,
    /// Lookups of this layer so far.
    pub clock: u64,
    /// LFRU: lookups of each expert so far.
    pub heat: Vec<u64>,
}

/// The order a call takes `experts` in: as given when they fit the slots together, else
/// (one at a time, as the expert store then takes them) the resident ones (`held`) first,
/// so that a miss replaces a slot the call no longer needs, then the rest.
pub fn take_order(experts: &[usize], fits: bool, held: impl Fn(usize) -> bool) -> Vec<usize> {
    if fits {
        return experts.to_vec();
    }
    let (mut first, rest): (Vec<usize>, Vec<usize>) = experts.iter().partition(|&&e| held(e));
    first.extend(rest);
    first
}

impl LayerCache {
    /// Whether `expert` is resident.
    pub fn holds(&self, expert: usize) -> bool {
        self.resident.iter().any(|s| s.0 == expert)
    }

    /// One lookup of a call; `together` when the call's experts all fit the slots, so that
    /// (as in the engine's store) none taken earlier in the call is replaced for a later one.
    pub fn lookup(&mut self, expert: usize, slots: usize, lfru: bool, call_start: u64) -> bool {
        self.clock += 1;
        let now = self.clock;
        if lfru {
            if self.heat.len() <= expert {
                self.heat.resize(expert + 1, 0);
            }
            self.heat[expert] += 1;
        }
        if let Some(slot) = self.resident.iter_mut().find(|s| s.0 == expert) {
            slot.1 = now;
            return true;
        }
        if self.resident.len() < slots {
            self.resident.push((expert, now));
            return false;
        }
        let heat = &self.heat;
        let victim = if lfru {
            // `(heat << 8) | recent`, then least recently used.
            let key = |&(e, last): &(usize, u64)| {
                let age = now - last;
                let recent = 255u64.saturating_sub(age);
                (heat.get(e).copied().unwrap_or(0) << 8 | recent, last)
            };
            self.resident
                .iter()
                .enumerate()
                .filter(|(_, s)| s.1 < call_start)
                .min_by_key(|(_, s)| key(s))
        } else {
            self.resident
                .iter()
                .enumerate()
                .filter(|(_, s)| s.1 < call_start)
                .min_by_key(|(_, s)| s.1)
        };
        if let Some((i, _)) = victim {
            self.resident[i] = (expert, now);
        }
        false
    }
}

/// One layer's pins and an LRU over the slots they leave: the expert store's layer when
/// experts stream and pins take slots, as the simulator and the abstain rule's shadow
/// model it.
#[derive(Debug, Default)]
pub struct PinnedLru {
    pins: Vec<usize>,
    lru: LayerCache,
}

impl PinnedLru {
    /// A layer with these pins (fewer than its slots) and an empty LRU.
    pub fn new(pins: Vec<usize>) -> PinnedLru {
        PinnedLru {
            pins,
            lru: LayerCache::default(),
        }
    }

    /// The LRU clock a call of `experts` starts at, or `u64::MAX` when its unpinned
    /// experts do not fit the slots the pins leave (then it takes them one at a time).
    pub fn call_start(&self, experts: &[usize], slots: usize) -> u64 {
        let unpinned = experts.iter().filter(|e| !self.pins.contains(e)).count();
        if unpinned > slots - self.pins.len() {
            u64::MAX
        } else {
            self.lru.clock + 1
        }
    }

    /// Whether `expert` is pinned or in the LRU.
    pub fn holds(&self, expert: usize) -> bool {
        self.pins.contains(&expert) || self.lru.holds(expert)
    }

    /// The experts of a call in the order it takes them (see [`take_order`]).
    pub fn order(&self, experts: &[usize], slots: usize) -> Vec<usize> {
        let fits = self.call_start(experts, slots) != u64::MAX;
        take_order(experts, fits, |e| self.holds(e))
    }

    /// One lookup; a pinned expert is a hit.
    pub fn lookup(&mut self, expert: usize, slots: usize, call_start: u64) -> bool {
        if self.pins.contains(&expert) {
            // The store's layer clock counts pinned hits too.
            self.lru.clock += 1;
            return true;
        }
        self.lru
            .lookup(expert, slots - self.pins.len(), false, call_start)
    }

    /// As the store unpins `expert`: it becomes the most recent LRU entry when the LRU
    /// has room for it.
    pub fn unpin(&mut self, expert: usize, slots: usize) {
        let Some(index) = self.pins.iter().position(|&e| e == expert) else {
            return;
        };
        self.pins.swap_remove(index);
        if self.lru.resident.len() < slots - self.pins.len() {
            self.lru.resident.push((expert, self.lru.clock));
        }
    }

    /// As the store pins `expert`: it leaves the LRU if it was there, and the LRU gives up
    /// its least recently used entries until it fits the slots the pins leave.
    pub fn pin(&mut self, expert: usize, slots: usize) {
        if self.pins.contains(&expert) || self.pins.len() + 1 >= slots {
            return;
        }
        let resident = &mut self.lru.resident;
        if let Some(index) = resident.iter().position(|s| s.0 == expert) {
            resident.swap_remove(index);
        }
        self.pins.push(expert);
        while resident.len() > slots - self.pins.len() {
            let Some((index, _)) = resident.iter().enumerate().min_by_key(|(_, s)| s.1) else {
                break;
            };
            resident.swap_remove(index);
        }
    }
}

/// Whether a layer whose pins hit `held` times in `lookups` moves to a pin count whose
/// shadow hit `best` times: when it would have hit more than 1% of the lookups more. The
/// margin keeps the pins a layer holds while they are as good as the best within noise;
/// the loss it allows is the target's 1 pp.
pub fn moves(held: u64, best: u64, lookups: u64) -> bool {
    best > held + lookups / 100
}

/// A change of one layer's pins the abstain rule decided: unpin `unpin` then pin `pin`,
/// each in order, as the shadows did.
#[derive(Debug, PartialEq)]
pub struct Verdict {
    pub layer: usize,
    /// Pins held before, and their hits over `lookups`.
    pub from: usize,
    pub from_hits: u64,
    /// Pins held from now on, and the hits their shadow had.
    pub to: usize,
    pub to_hits: u64,
    pub lookups: u64,
    pub unpin: Vec<usize>,
    pub pin: Vec<usize>,
}

/// One pinned layer's shadows.
#[derive(Debug)]
struct Watched {
    /// The history's ranking of the layer, as far as the layer may pin.
    ranked: Vec<usize>,
    /// Candidate pin counts, ascending, and each one's shadow and hits.
    counts: Vec<usize>,
    shadows: Vec<PinnedLru>,
    hits: Vec<u64>,
    lookups: u64,
    /// The index in `counts` of the pins the layer holds now.
    held: usize,
    /// The next judgement, in lookups: [`ABSTAIN_AFTER`], then every doubling.
    next_judgement: u64,
}

/// Pin counts a layer holding `start` pins, with `most` ranked, is watched at: none,
/// `start`, and eight steps up to `most` (every count when `most` is at most 8).
fn candidate_counts(start: usize, most: usize) -> Vec<usize> {
    let step = most.div_ceil(8).max(1);
    let mut counts: Vec<usize> = (0..=most).step_by(step).chain([start, most]).collect();
    counts.sort_unstable();
    counts.dedup();
    counts
}

/// The abstain rule's judge for every pinned layer.
#[derive(Debug)]
pub struct PlacementGuard {
    slots: usize,
    layers: Vec<Option<Watched>>,
}

impl PlacementGuard {
    /// Watches the layers that hold pins in caches of `slots` slots per layer: `held[layer]`
    /// pins, the top of `ranked[layer]` (the history's ranking, as far as the layer may
    /// pin; a layer without pins or ranking is not watched).
    pub fn new(slots: usize, ranked: &[Vec<usize>], held: &[usize]) -> PlacementGuard {
        let layers = ranked
            .iter()
            .zip(held)
            .map(|(ranked, &start)| {
                let most = ranked.len().min(slots.saturating_sub(1));
                (start > 0 && start <= most).then(|| {
                    let counts = candidate_counts(start, most);
                    Watched {
                        shadows: counts
                            .iter()
                            .map(|&n| PinnedLru::new(ranked[..n].to_vec()))
                            .collect(),
                        hits: vec![0; counts.len()],
                        held: counts.iter().position(|&n| n == start).unwrap_or(0),
                        counts,
                        ranked: ranked[..most].to_vec(),
                        lookups: 0,
                        next_judgement: ABSTAIN_AFTER,
                    }
                })
            })
            .collect();
        PlacementGuard { slots, layers }
    }

    /// One MoE call of `layer`: its distinct experts, ascending.
    pub fn observe(&mut self, layer: usize, experts: &[usize]) {
        let slots = self.slots;
        let Some(Some(w)) = self.layers.get_mut(layer) else {
            return;
        };
        w.lookups += experts.len() as u64;
        for (shadow, hits) in w.shadows.iter_mut().zip(&mut w.hits) {
            let start = shadow.call_start(experts, slots);
            for e in shadow.order(experts, slots) {
                *hits += u64::from(shadow.lookup(e, slots, start));
            }
        }
    }

    /// The layers whose pins change now.
    pub fn verdicts(&mut self) -> Vec<Verdict> {
        let mut out = Vec::new();
        for (layer, w) in self.layers.iter_mut().enumerate() {
            let Some(w) = w else { continue };
            if w.lookups < w.next_judgement {
                continue;
            }
            w.next_judgement = w.lookups * 2;
            // The most hits; among equals the fewest pins.
            let best = (0..w.counts.len())
                .rev()
                .max_by_key(|&i| w.hits[i])
                .unwrap_or(w.held);
            if !moves(w.hits[w.held], w.hits[best], w.lookups) {
                continue;
            }
            let (from, to) = (w.counts[w.held], w.counts[best]);
            out.push(Verdict {
                layer,
                from,
                from_hits: w.hits[w.held],
                to,
                to_hits: w.hits[best],
                lookups: w.lookups,
                unpin: w.ranked[to.min(from)..from].iter().rev().copied().collect(),
                pin: w.ranked[from..to.max(from)].to_vec(),
            });
            w.held = best;
        }
        out
    }

    /// The store could not carry out `verdict` (it refused a pin: with read-ahead on, its
    /// slots shrink): the layer is back at the pins it held before.
    pub fn undo(&mut self, verdict: &Verdict) {
        if let Some(Some(w)) = self.layers.get_mut(verdict.layer) {
            if let Some(i) = w.counts.iter().position(|&n| n == verdict.from) {
                w.held = i;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pins_that_do_not_fit_are_given_up_and_pins_that_fit_are_kept() {
        // Two slots, one pin. Layer 0's text alternates 3 and 4 (its pin, 7, never comes):
        // LRU holds both, the pinned layer thrashes its one free slot. Layer 1's text is
        // 7 with a stream of others, where the pin wins.
        let mut g = PlacementGuard::new(2, &[vec![7], vec![7]], &[1, 1]);
        for i in 0..ABSTAIN_AFTER as usize {
            g.observe(0, &[3 + i % 2]);
            g.observe(1, &[if i % 2 == 0 { 7 } else { 10 + i % 5 }]);
        }
        let v = g.verdicts();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].layer, v[0].from, v[0].to), (0, 1, 0));
        assert_eq!(
            (v[0].unpin.as_slice(), v[0].pin.as_slice()),
            (&[7][..], &[][..])
        );
        assert!(v[0].from_hits < v[0].to_hits);
        assert!(
            g.verdicts().is_empty(),
            "not judged again before the doubling"
        );
    }

    #[test]
    fn nothing_is_judged_before_enough_lookups_and_drift_is_judged_later() {
        let mut g = PlacementGuard::new(2, &[vec![7]], &[1]);
        for i in 0..ABSTAIN_AFTER as usize - 1 {
            g.observe(0, &[3 + i % 2]);
        }
        assert!(g.verdicts().is_empty());
        g.observe(0, &[3]);
        assert_eq!(g.verdicts().len(), 1);
        // A layer whose pin fits at first and stops fitting is given up at a later doubling.
        let mut g = PlacementGuard::new(2, &[vec![7]], &[1]);
        for i in 0..ABSTAIN_AFTER as usize {
            g.observe(0, &[if i % 2 == 0 { 7 } else { 20 + i % 7 }]);
        }
        assert!(g.verdicts().is_empty());
        for i in 0..3 * ABSTAIN_AFTER as usize {
            g.observe(0, &[3 + i % 2]);
        }
        assert_eq!(g.verdicts().len(), 1);
        assert!(moves(10, 20, 100) && !moves(10, 11, 100));
    }

    #[test]
    fn a_layer_pins_more_of_its_ranking_where_more_pins_pay() {
        // Four slots, one pin of a ranking of three. The text takes 1, 2 and 3 every other
        // call and a stream of others between: three pins hold them, one slot takes the
        // rest; with one pin the LRU's three slots lose 2 and 3 to the stream.
        let mut g = PlacementGuard::new(4, &[vec![1, 2, 3]], &[1]);
        for i in 0..ABSTAIN_AFTER as usize {
            let others = [10 + i % 11, 30 + i % 13, 50 + i % 7];
            g.observe(0, if i % 2 == 0 { &[1, 2, 3] } else { &others });
        }
        let v = g.verdicts();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!((v[0].from, v[0].to), (1, 3));
        assert_eq!(
            (v[0].unpin.as_slice(), v[0].pin.as_slice()),
            (&[][..], &[2, 3][..])
        );
    }

    #[test]
    fn an_undone_move_leaves_the_layer_at_its_old_count() {
        let mut g = PlacementGuard::new(4, &[vec![1, 2, 3]], &[1]);
        let feed = |g: &mut PlacementGuard, calls: usize| {
            for i in 0..calls {
                let others = [10 + i % 11, 30 + i % 13, 50 + i % 7];
                g.observe(0, if i % 2 == 0 { &[1, 2, 3] } else { &others });
            }
        };
        feed(&mut g, ABSTAIN_AFTER as usize);
        let v = g.verdicts();
        assert_eq!((v[0].from, v[0].to), (1, 3));
        g.undo(&v[0]);
        // Judged again at the doubling, from the count it still holds.
        feed(&mut g, ABSTAIN_AFTER as usize);
        let again = g.verdicts();
        assert_eq!((again[0].from, again[0].pin.as_slice()), (1, &[2, 3][..]));
    }

    #[test]
    fn the_model_pins_and_unpins_as_the_store_does() {
        let mut m = PinnedLru::new(vec![9]);
        for e in [1, 2, 3] {
            let start = m.call_start(&[e], 4);
            m.lookup(e, 4, start);
        }
        // Pinning 2 takes it out of the LRU; the LRU then fits the two slots left.
        m.pin(2, 4);
        assert_eq!(m.lru.resident, vec![(1, 1), (3, 3)]);
        // No pin takes the layer's last slot.
        m.pin(5, 4);
        m.pin(6, 4);
        assert_eq!(m.pins, vec![9, 2, 5]);
        m.unpin(5, 4);
        assert_eq!(m.pins, vec![9, 2]);
        assert!(m.lru.resident.iter().any(|s| s.0 == 5));
    }

    #[test]
    fn candidate_counts_span_none_to_the_ranking() {
        assert_eq!(candidate_counts(2, 3), vec![0, 1, 2, 3]);
        assert_eq!(
            candidate_counts(12, 31),
            vec![0, 4, 8, 12, 16, 20, 24, 28, 31]
        );
    }
}
