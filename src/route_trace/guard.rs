//! The shadow caches behind the abstain rule, and the per-layer cache model they share
//! with `coli trace simulate`.
//!
//! A history's pins are a prior: on text like the history's they beat LRU, on other text
//! they cost slots. The engine cannot know which before it runs, so it watches: per pinned
//! layer, two shadow caches replay the lookups the expert store sees (each MoE call's
//! distinct experts in ascending order), one LRU over all the layer's slots, one the pins
//! plus LRU over the rest. Once the layer has seen [`ABSTAIN_AFTER`] lookups, and again at
//! every doubling, a layer whose pins lost more than 1% of its lookups to what plain LRU
//! would have hit ([`gives_up`]) is given up: its pins are unpinned and the layer serves the
//! text by LRU from then on. Judged between tokens. The shadows hold
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

impl LayerCache {
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

    /// As the store unpins: each pin becomes an LRU entry used "now", in pin order, and
    /// the layer is plain LRU from then on.
    pub fn give_up(&mut self) {
        let now = self.lru.clock;
        for e in std::mem::take(&mut self.pins) {
            self.lru.resident.push((e, now));
        }
    }
}

/// Whether pins that hit `pin_hits` times in `lookups`, where LRU would have hit
/// `lru_hits` times, are given up: when they lose more than 1% of the lookups to LRU. The
/// margin keeps pins that are as good as LRU within noise; the loss it allows is the
/// target's 1 pp.
pub fn gives_up(pin_hits: u64, lru_hits: u64, lookups: u64) -> bool {
    lru_hits > pin_hits + lookups / 100
}

/// One pinned layer's shadows.
#[derive(Debug)]
struct Watched {
    lru: LayerCache,
    pinned: PinnedLru,
    lru_hits: u64,
    pin_hits: u64,
    lookups: u64,
    /// The next judgement, in lookups: [`ABSTAIN_AFTER`], then every doubling.
    next_judgement: u64,
    judged: bool,
}

/// The abstain rule's judge for every pinned layer.
#[derive(Debug)]
pub struct PlacementGuard {
    slots: usize,
    layers: Vec<Option<Watched>>,
}

impl PlacementGuard {
    /// Watches the layers that have pins (`pins[layer]`, empty for none) in caches of
    /// `slots` slots per layer.
    pub fn new(slots: usize, pins: &[Vec<usize>]) -> PlacementGuard {
        let layers = pins
            .iter()
            .map(|p| {
                (!p.is_empty() && p.len() < slots).then(|| Watched {
                    lru: LayerCache::default(),
                    pinned: PinnedLru::new(p.clone()),
                    lru_hits: 0,
                    pin_hits: 0,
                    lookups: 0,
                    next_judgement: ABSTAIN_AFTER,
                    judged: false,
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
        if w.judged {
            return;
        }
        let lru_start = if experts.len() > slots {
            u64::MAX
        } else {
            w.lru.clock + 1
        };
        let pinned_start = w.pinned.call_start(experts, slots);
        for &e in experts {
            w.lookups += 1;
            w.lru_hits += u64::from(w.lru.lookup(e, slots, false, lru_start));
            w.pin_hits += u64::from(w.pinned.lookup(e, slots, pinned_start));
        }
    }

    /// The layers to give up now, each once, with (pin hits, LRU hits, lookups).
    pub fn verdicts(&mut self) -> Vec<(usize, u64, u64, u64)> {
        let mut out = Vec::new();
        for (layer, w) in self.layers.iter_mut().enumerate() {
            let Some(w) = w else { continue };
            if w.judged || w.lookups < w.next_judgement {
                continue;
            }
            w.next_judgement = w.lookups * 2;
            if gives_up(w.pin_hits, w.lru_hits, w.lookups) {
                w.judged = true;
                out.push((layer, w.pin_hits, w.lru_hits, w.lookups));
            }
        }
        out
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
        let mut g = PlacementGuard::new(2, &[vec![7], vec![7]]);
        for i in 0..ABSTAIN_AFTER as usize {
            g.observe(0, &[3 + i % 2]);
            g.observe(1, &[if i % 2 == 0 { 7 } else { 10 + i % 5 }]);
        }
        let v = g.verdicts();
        assert_eq!(v.len(), 1, "{v:?}");
        assert_eq!(v[0].0, 0);
        assert!(v[0].1 < v[0].2);
        assert!(g.verdicts().is_empty(), "judged once");
    }

    #[test]
    fn nothing_is_judged_before_enough_lookups_and_drift_is_judged_later() {
        let mut g = PlacementGuard::new(2, &[vec![7]]);
        for i in 0..ABSTAIN_AFTER as usize - 1 {
            g.observe(0, &[3 + i % 2]);
        }
        assert!(g.verdicts().is_empty());
        g.observe(0, &[3]);
        assert_eq!(g.verdicts().len(), 1);
        // A layer whose pin fits at first and stops fitting is given up at a later doubling.
        let mut g = PlacementGuard::new(2, &[vec![7]]);
        for i in 0..ABSTAIN_AFTER as usize {
            g.observe(0, &[if i % 2 == 0 { 7 } else { 20 + i % 7 }]);
        }
        assert!(g.verdicts().is_empty());
        for i in 0..3 * ABSTAIN_AFTER as usize {
            g.observe(0, &[3 + i % 2]);
        }
        assert_eq!(g.verdicts().len(), 1);
        assert!(gives_up(10, 20, 100) && !gives_up(10, 11, 100));
    }
}
