//! The expert store on a real snapshot: LRU eviction order and the hit/miss/byte counters.

use crate::common;

use coli::experts::ExpertStore;
use coli::quant::Width;
use coli::snapshot::Snapshot;

fn store(capacity: usize) -> (ExpertStore, usize) {
    let snapshot = Snapshot::open(&common::fixture("olmoe_tiny")).unwrap();
    let experts = common::olmoe_tiny_experts(&snapshot, 0);
    // Three f32 matrices of 32 x 64 per expert.
    (
        ExpertStore::new(vec![experts], capacity, Width::F32),
        3 * 32 * 64 * 4,
    )
}

fn touch(store: &mut ExpertStore, expert: usize) -> f32 {
    store
        .with_expert(0, expert, |weights| weights.gate.cols() as f32)
        .unwrap()
}

#[test]
fn least_recently_used_slot_is_evicted() {
    let (mut store, expert_bytes) = store(2);
    for expert in [0, 1, 0, 2] {
        touch(&mut store, expert);
    }
    // 0 miss, 1 miss, 0 hit, 2 miss evicting 1 (0 was used more recently).
    let stats = store.stats();
    assert_eq!((stats.lru_hits, stats.misses), (1, 3));
    touch(&mut store, 0);
    assert_eq!(store.stats().lru_hits, 2, "0 survived the eviction");
    touch(&mut store, 1);
    assert_eq!(store.stats().misses, 4, "1 was evicted");
    touch(&mut store, 2);
    assert_eq!(store.stats().misses, 5, "2 was evicted by 1 (0 was newer)");
    assert_eq!(store.stats().bytes_loaded, 5 * expert_bytes as u64);
    assert_eq!(store.stats().pin_hits, 0);
}

#[test]
fn one_slot_still_serves_every_expert() {
    let (mut store, _) = store(1);
    for expert in 0..8 {
        assert_eq!(touch(&mut store, expert), 64.0);
    }
    assert_eq!(store.stats().misses, 8);
    touch(&mut store, 7);
    assert_eq!(store.stats().lru_hits, 1);
}

#[test]
fn a_missing_expert_is_an_error_not_a_panic() {
    let (mut store, _) = store(2);
    let err = store.with_expert(0, 8, |_| ()).unwrap_err();
    assert!(err
        .to_string()
        .contains("expert 8 of MoE layer 0 does not exist"));
}

#[test]
fn pinned_experts_are_never_evicted_and_count_as_pin_hits() {
    let (mut store, expert_bytes) = store(1);
    assert_eq!(store.pin(0, 3).unwrap(), expert_bytes);
    assert!(store.is_pinned(0, 3));
    for expert in [3, 0, 1, 3, 2, 3] {
        touch(&mut store, expert);
    }
    let stats = store.stats();
    assert_eq!((stats.pin_hits, stats.lru_hits, stats.misses), (3, 0, 3));
    // Pinning an expert that sits in the LRU moves it without a reload.
    let loaded = store.stats().bytes_loaded;
    store.pin(0, 2).unwrap();
    assert_eq!(store.stats().bytes_loaded, loaded);
    assert!(store.unpin(0, 3));
    assert!(!store.is_pinned(0, 3));
    touch(&mut store, 3);
    assert_eq!(store.stats().lru_hits, 1, "an unpinned expert stays cached");
    assert!(store.pin(0, 9).is_err());
    assert!(store.pin(5, 0).is_err());
}

#[test]
fn a_layer_s_experts_are_held_together_when_the_slots_allow() {
    let (mut store, _) = store(3);
    store.pin(0, 7).unwrap();
    let ids = |weights: &[&coli::experts::Expert]| weights.len();
    // Three slots and a pin hold four experts at once: 7 from the pins, 0 1 2 loaded.
    assert_eq!(store.with_experts(0, &[0, 1, 2, 7], ids).unwrap(), Some(4));
    let stats = store.stats();
    assert_eq!((stats.pin_hits, stats.lru_hits, stats.misses), (1, 0, 3));
    // 1 and 2 are hits, taken before 3 is loaded: the oldest slot, 0, goes.
    assert_eq!(store.with_experts(0, &[1, 2, 3], ids).unwrap(), Some(3));
    let stats = store.stats();
    assert_eq!((stats.lru_hits, stats.misses), (2, 4));
    touch(&mut store, 0);
    assert_eq!(store.stats().misses, 5, "0 was the one evicted");
    // Slots now 2 (oldest), 3, 0. A later expert of the call may be the oldest slot: 4
    // evicts 2, which is then loaded again over 3, as one-at-a-time lookups would do
    // (`coli trace simulate` replays them); both are held at the end.
    assert_eq!(store.with_experts(0, &[4, 2], ids).unwrap(), Some(2));
    let stats = store.stats();
    assert_eq!((stats.lru_hits, stats.misses), (2, 7));
    touch(&mut store, 0);
    assert_eq!(store.stats().lru_hits, 3, "0 survived");
    // Four unpinned experts cannot share three slots: nothing is loaded or counted.
    let before = store.stats();
    assert_eq!(store.with_experts(0, &[1, 4, 5, 6], ids).unwrap(), None);
    assert_eq!(store.stats(), before);
}
