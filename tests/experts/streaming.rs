//! Experts that stream from disk into slots the store owns: every fixture stays exact
//! under every I/O, loader, lookahead and policy setting; the counts of a streamed store
//! are those of a mapped one (and of `coli trace simulate`); REPLAY and PROFILE report;
//! a budget that cannot hold one expert per layer, or a truncated shard, is refused.

use crate::common;

use common::{coli, fixture, stderr, stdout};

use coli::experts::{Budget, ExpertIo, ExpertStore, ExpertTensors, Policy, StoreOptions};
use coli::quant::Width;
use coli::snapshot::Snapshot;
use coli::tools::simulate::{self, Policy as SimPolicy, SimOptions};

/// Every fixture with a reference, and its experts per layer (`64` stands for "all").
const FIXTURES: &[&str] = &[
    "olmoe_tiny",
    "olmoe_tiny_b",
    "glm_moe_dsa_tiny",
    "glm_moe_dsa_tiny_b",
    "glm_moe_dsa_tiny_mtp",
    "inkling_tiny",
    "inkling_tiny_b",
    "kimi_k3_tiny",
    "kimi_k3_tiny_b",
];

/// Between them every value of every setting the issue names: DIRECT 0|1, PILOT 0|2,
/// IO_THREADS 1|8, COLI_POLICY lru|lfru.
const SETTINGS: &[&[&str]] = &[
    &[
        "EXPERT_IO=direct",
        "PILOT=2",
        "IO_THREADS=8",
        "COLI_POLICY=lfru",
    ],
    &[
        "EXPERT_IO=pread",
        "PILOT=0",
        "IO_THREADS=1",
        "COLI_POLICY=lru",
    ],
    &[
        "EXPERT_IO=auto",
        "DIRECT=0",
        "PILOT=2",
        "IO_THREADS=1",
        "COLI_POLICY=lfru",
    ],
    &["EXPERT_IO=direct", "DIRECT=1", "PILOT=0", "IO_THREADS=8"],
];

#[test]
fn every_fixture_is_exact_when_experts_stream() {
    for name in FIXTURES {
        for settings in SETTINGS {
            for cap in [1, 2, 64] {
                for teacher_forced in [true, false] {
                    let (text, errors) =
                        common::oracle_exact_with(None, name, cap, teacher_forced, settings);
                    let streams = settings[0] != "EXPERT_IO=auto";
                    assert_eq!(
                        errors.contains("| streaming: "),
                        streams,
                        "{name} {settings:?}: {errors}"
                    );
                    assert!(text.contains("Expert cache hit rate: "), "{text}");
                }
            }
        }
    }
}

fn olmoe_experts(snapshot: &Snapshot) -> Vec<ExpertTensors> {
    common::olmoe_tiny_experts(snapshot, 0)
}

fn store(io: ExpertIo, cap: usize, policy: Policy, pilot: usize) -> ExpertStore {
    let snapshot = Snapshot::open(&fixture("olmoe_tiny")).unwrap();
    let options = StoreOptions {
        io,
        policy,
        pilot,
        io_threads: 3,
        budget: Budget::fixed(1 << 30),
        ..StoreOptions::mapped(cap, Width::F32)
    };
    ExpertStore::provision(vec![olmoe_experts(&snapshot)], &options, 0).unwrap()
}

/// The sum of an expert's gate matrix, as a fingerprint of its weights.
fn fingerprint(expert: &coli::experts::Expert) -> f32 {
    expert.gate.to_f32().iter().sum()
}

#[test]
fn streamed_slots_hold_the_same_weights_and_counts_as_mapped_ones() {
    let calls: &[&[usize]] = &[&[0, 3], &[3, 5], &[1, 2], &[0, 5], &[6, 7], &[3, 0]];
    for policy in [Policy::Lru, Policy::Lfru] {
        let mut mapped = store(ExpertIo::Mmap, 2, policy, 0);
        let mut direct = store(ExpertIo::Direct, 2, policy, 0);
        let mut buffered = store(ExpertIo::Pread, 2, policy, 0);
        assert!(!mapped.streams() && direct.streams() && buffered.streams());
        for call in calls {
            let prints = |store: &mut ExpertStore| {
                store
                    .with_experts(0, call, |w| {
                        w.iter().map(|e| fingerprint(e)).collect::<Vec<_>>()
                    })
                    .unwrap()
                    .unwrap()
            };
            let expected = prints(&mut mapped);
            assert_eq!(prints(&mut direct), expected, "{policy:?} {call:?}");
            assert_eq!(prints(&mut buffered), expected, "{policy:?} {call:?}");
        }
        let (m, d) = (mapped.stats(), direct.stats());
        assert_eq!((m.lru_hits, m.misses), (d.lru_hits, d.misses), "{policy:?}");
        assert_eq!(m.bytes_loaded, d.bytes_loaded);
        assert_eq!(m.bytes_read, 0, "mapped experts are read by the kernel");
        // One read per expert, each rounded out to whole 4 KiB blocks.
        assert!(d.bytes_read >= d.bytes_loaded && d.bytes_read <= d.bytes_loaded + d.misses * 8192);
    }
}

#[test]
fn a_streamed_pin_takes_a_slot_and_one_is_left_for_the_rest() {
    let mut store = store(ExpertIo::Direct, 2, Policy::Lru, 0);
    let bytes = store.pin(0, 3).unwrap();
    assert!(bytes >= 3 * 32 * 64 * 4);
    assert_eq!(
        store.pin(0, 4).unwrap(),
        0,
        "the last slot stays with the LRU"
    );
    assert_eq!(store.pins_skipped(), 1);
    let ids = |w: &[&coli::experts::Expert]| w.len();
    // One LRU slot: two unpinned experts cannot be held together.
    assert_eq!(store.with_experts(0, &[0, 1], ids).unwrap(), None);
    assert_eq!(store.with_experts(0, &[0, 3], ids).unwrap(), Some(2));
    assert!(store.unpin(0, 3));
    assert_eq!(store.with_experts(0, &[0, 1], ids).unwrap(), Some(2));
}

#[test]
fn a_budget_below_the_trunk_and_one_expert_per_layer_is_refused() {
    let snapshot = Snapshot::open(&fixture("olmoe_tiny")).unwrap();
    let options = StoreOptions {
        io: ExpertIo::Direct,
        budget: Budget::fixed(100 << 20),
        ..StoreOptions::mapped(2, Width::F32)
    };
    let Err(err) = ExpertStore::provision(vec![olmoe_experts(&snapshot)], &options, 40 << 20)
    else {
        panic!("a 100 MB budget with a 42 MB trunk and 69 MB of reserve holds no expert");
    };
    let message = format!("{err:#}");
    assert!(message.contains("memory budget is too small"), "{message}");
    assert!(message.contains("trunk 0.04 GB"), "{message}");
    // An MPI expert rank frees its trunk once loaded: the same budget then holds experts.
    let freed = StoreOptions {
        keeps_trunk: false,
        ..options
    };
    let store = ExpertStore::provision(vec![olmoe_experts(&snapshot)], &freed, 40 << 20).unwrap();
    assert!(store.summary().contains("no trunk"), "{}", store.summary());

    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    let out = coli(
        &[&snap, "EXPERT_IO=direct", "RAM_GB=0.05", "2", "16", "16"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("raise RAM_GB"), "{}", stderr(&out));
}

#[test]
fn auto_streams_when_the_experts_do_not_fit_and_maps_when_they_do() {
    let snapshot = Snapshot::open(&fixture("olmoe_tiny")).unwrap();
    let experts = olmoe_experts(&snapshot);
    let expert = 3 * 32 * 64 * 4 + 6 * 2 * 4096;
    let options = |budget: u64| StoreOptions {
        io: ExpertIo::Auto,
        budget: Budget::fixed(budget),
        ..StoreOptions::mapped(0, Width::F32)
    };
    // Trunk 0, reserve 64 MiB + 5% + a spare buffer: room for about three of the eight
    // experts streams into a few slots.
    let tight = ((64u64 << 20) + 3 * expert as u64 + 1) * 20 / 19 + 1;
    let store = ExpertStore::provision(vec![experts.clone()], &options(tight), 0).unwrap();
    assert!(store.streams(), "{}", store.summary());
    assert!((2..8).contains(&store.capacity()), "{}", store.summary());
    let store = ExpertStore::provision(vec![experts], &options(1 << 30), 0).unwrap();
    assert!(!store.streams());
    assert_eq!(store.capacity(), 8);
    assert!(store.summary().contains("every expert fits"));
}

#[test]
fn a_truncated_shard_is_refused_at_load() {
    let dir = common::copy_fixture("olmoe_tiny");
    let shard = dir.path().join("model.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    file.set_len(len - 1000).unwrap();
    let snap = format!("SNAP={}", dir.path().display());
    for io in ["EXPERT_IO=direct", "EXPERT_IO=mmap"] {
        let out = coli(&[&snap, io, "2", "16", "16"], &[]);
        assert_eq!(out.status.code(), Some(2), "{io}");
        assert!(stderr(&out).contains("truncated"), "{io}: {}", stderr(&out));
    }
}

/// The line of `text` that starts with `start`, holding every one of `parts`.
fn replay_line(text: &str, start: &str, parts: &[&str]) {
    let line = text
        .lines()
        .find(|l| l.starts_with(start))
        .unwrap_or_else(|| panic!("{text}"));
    for part in parts {
        assert!(line.contains(part), "{line}");
    }
}

#[test]
fn replay_decodes_the_ids_and_reports_with_a_profile() {
    let dir = tempfile::tempdir().unwrap();
    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    let usage = format!("COLI_USAGE={}", dir.path().join("usage").display());
    let out = coli(
        &[
            &snap,
            &usage,
            "IDS=3 11 29 7 41 19 5 2",
            "REPLAY=1",
            "EXPERT_IO=direct",
            "PILOT=2",
            "2",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    replay_line(
        &text,
        "REPLAY decode: 8 tokens | ",
        &[" tok/s | hit ", "% | disk ", " MB/token, ", " GB/s)"],
    );
    let profile = text
        .lines()
        .find(|l| l.starts_with("PROFILE: expert-disk "))
        .unwrap_or_else(|| panic!("{text}"));
    for part in [
        " s service / ",
        " s wait | expert-matmul ",
        " | shared-expert 0.00 s | dense-ffn 0.00 s | attention ",
        " | lm_head ",
        " | other ",
        " | prefetch ",
        " useful / ",
        " wasted",
    ] {
        assert!(profile.contains(part), "{profile}");
    }
    // OLMoE has neither shared experts, nor dense layers, nor an indexer.
    assert!(!profile.contains("(indexer "), "{profile}");
    let out = coli(&[&snap, "REPLAY=1", "2", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("IDS"), "{}", stderr(&out));
}

/// The time of `phase` in a `PROFILE:` line (`... | phase X s ...`).
fn phase_seconds(profile: &str, phase: &str) -> f64 {
    let after = profile
        .split(&format!("{phase} "))
        .nth(1)
        .unwrap_or_else(|| panic!("no {phase} in {profile}"));
    after.split(' ').next().unwrap().parse().unwrap()
}

#[test]
fn the_profile_times_the_indexer_the_shared_experts_and_the_dense_layers() {
    // GLM's fixture: a dense first layer, one shared expert beside the routed ones, and a
    // DSA indexer that runs within attention (so its time is at most attention's).
    let snap = format!("SNAP={}", fixture("glm_moe_dsa_tiny").display());
    let ids = (0..40).map(|i| ((i * 7) % 100 + 3).to_string());
    let ids = format!("IDS={}", ids.collect::<Vec<_>>().join(" "));
    let out = coli(
        &[&snap, "USAGE_SAVE=0", &ids, "REPLAY=1", "8", "16", "16"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let profile = text
        .lines()
        .find(|l| l.starts_with("PROFILE: "))
        .unwrap_or_else(|| panic!("{text}"));
    let indexer = phase_seconds(profile, "(indexer");
    assert!(indexer <= phase_seconds(profile, "attention"), "{profile}");
    // Present, with a number of seconds (too small on a fixture to compare).
    for phase in ["shared-expert", "dense-ffn"] {
        phase_seconds(profile, phase);
    }
}

#[test]
fn a_batched_replay_decodes_every_sequence_and_traces_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    let trace = dir.path().join("trace");
    let out = coli(
        &[
            &snap,
            &format!("ROUTE_TRACE={}", trace.display()),
            "USAGE_SAVE=0",
            "IDS=3 11 29 7 41 19 5 2",
            "REPLAY=1",
            "BATCH=3",
            "EXPERT_IO=direct",
            "PILOT=1",
            "2",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    replay_line(
        &stdout(&out),
        "REPLAY decode: 3 sequences x 8 tokens | ",
        &[" tok/s aggregate | hit ", "% | disk ", " MB/token, "],
    );
    // `call row layer choices`: the four warm-up tokens one row each, then eight calls per
    // layer of three rows, one per sequence.
    let trace = std::fs::read_to_string(&trace).unwrap();
    let rows = |row: &str| {
        trace
            .lines()
            .filter(|l| l.split_whitespace().nth(1) == Some(row))
            .count()
    };
    assert_eq!(
        (rows("0"), rows("1"), rows("2")),
        ((4 + 8) * 3, 8 * 3, 8 * 3)
    );

    let out = coli(&[&snap, "IDS=3 11", "BATCH=2", "2", "16", "16"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("REPLAY=1"), "{}", stderr(&out));
}

#[test]
fn the_simulator_replays_a_streamed_cache_under_either_policy() {
    let dir = tempfile::tempdir().unwrap();
    for (policy, sim) in [("lru", SimPolicy::Lru), ("lfru", SimPolicy::Lfru)] {
        for cap in ["1", "2", "3"] {
            let trace = dir.path().join(format!("trace-{policy}-{cap}"));
            let out = coli(
                &[
                    &format!("SNAP={}", fixture("olmoe_tiny_b").display()),
                    "IDS=3 11 29 7 41 19",
                    "NGEN=10",
                    "EXPERT_IO=direct",
                    &format!("COLI_POLICY={policy}"),
                    &format!("ROUTE_TRACE={}", trace.display()),
                    &format!(
                        "COLI_USAGE={}",
                        dir.path().join(format!("usage-{policy}-{cap}")).display()
                    ),
                    cap,
                    "16",
                    "16",
                ],
                &[],
            );
            assert!(out.status.success(), "{}", stderr(&out));
            let text = stdout(&out);
            let counts = text
                .lines()
                .find_map(|l| l.strip_prefix("Expert cache hit rate: "))
                .unwrap();
            let number = |after: &str| -> u64 {
                let rest = &counts[counts.find(after).unwrap() + after.len()..];
                rest.split_whitespace().next().unwrap().parse().unwrap()
            };
            let (lru, miss) = (number("pin + "), number("lru / "));
            let mut opts = SimOptions::new(vec![cap.parse().unwrap()]);
            opts.include_prefill = true;
            opts.policies = vec![sim];
            let s = simulate::simulate(&trace, &opts).unwrap();
            assert_eq!(s.lookups, lru + miss, "{policy} CAP {cap}");
            assert_eq!(
                s.hits(s.sizes[0].slots, sim),
                Some(lru),
                "{policy} CAP {cap}"
            );
        }
    }
}

#[test]
fn the_lookahead_reads_ahead_only_while_its_predictions_are_right() {
    use coli::engines::moe::{Choice, RoutedExperts, Router};
    use coli::quant::Matrix;
    use coli::route_trace::RouteTrace;

    let snapshot = Snapshot::open(&fixture("olmoe_tiny")).unwrap();
    let layer = |l: usize| common::olmoe_tiny_experts(&snapshot, l);
    let options = StoreOptions {
        io: ExpertIo::Direct,
        pilot: 1,
        budget: Budget::fixed(1 << 30),
        ..StoreOptions::mapped(2, Width::F32)
    };
    let store = ExpertStore::provision(vec![layer(0), layer(1)], &options, 0).unwrap();
    let mut routed = RoutedExperts::new(store, RouteTrace::new("olmoe", 2, 8).unwrap());
    // Layer 1's router reads expert e's logit from input column e.
    let mut weights = vec![0f32; 8 * 64];
    for e in 0..8 {
        weights[e * 64 + e] = 1.0;
    }
    routed.set_router(
        1,
        Router {
            weight: Matrix::from_f32(8, 64, weights, Width::F32),
            choice: Choice::Softmax {
                top_k: 2,
                normalise: false,
            },
        },
    );
    let ids = |w: &[&coli::experts::Expert]| w.len();
    // One decode step: layer 0 predicts `predicted` for layer 1, which then takes `taken`.
    let step = |routed: &mut RoutedExperts, predicted: [usize; 2], taken: [usize; 2]| {
        let mut h = vec![0f32; 64];
        h[predicted[0]] = 3.0;
        h[predicted[1]] = 2.0;
        routed.look_ahead(0, &h, 1, &[]);
        routed.store.with_experts(0, &[0, 1], ids).unwrap();
        routed.store.with_experts(1, &taken, ids).unwrap();
    };
    let pairs = [[0, 1], [2, 3], [4, 5], [6, 7]];

    // Right predictions: it abstains at first, scoring them, then reads ahead.
    let mut steps = 0;
    while routed.store.stats().ahead_reads == 0 {
        step(&mut routed, pairs[steps % 4], pairs[steps % 4]);
        steps += 1;
        assert!(steps < 40, "read-ahead never started");
    }
    assert!(steps > 5, "read ahead after {steps} steps");
    let before = routed.store.stats();
    step(&mut routed, pairs[steps % 4], pairs[steps % 4]);
    let after = routed.store.stats().since(&before);
    // Read behind layer 0's lookups (two hits), then layer 1's two lookups are hits too.
    assert_eq!((after.ahead_reads, after.ahead_useful), (2, 2), "{after:?}");
    assert_eq!((after.lru_hits, after.misses), (4, 0), "{after:?}");
    // Recall counts every expert the layer took, resident or read ahead.
    assert_eq!((after.foreseeable, after.foreseen), (2, 2), "{after:?}");
    assert_eq!(routed.store.ahead_unused(), 0);

    // Decode batches only (up to sixteen rows): a prompt's chunk is not looked ahead for.
    let before = routed.store.stats();
    routed.look_ahead(0, &vec![0.5; 17 * 64], 17, &[]);
    routed.store.with_experts(0, &[0, 1], ids).unwrap();
    assert_eq!(routed.store.stats().since(&before).ahead_reads, 0);

    // Wrong predictions: the reads are wasted, then stop; the slots are whole again.
    let mut steps = 0;
    loop {
        let before = routed.store.stats();
        step(&mut routed, pairs[steps % 4], pairs[(steps + 2) % 4]);
        steps += 1;
        let window = routed.store.stats().since(&before);
        if window.ahead_reads == 0 {
            break;
        }
        assert_eq!(window.ahead_useful, 0);
        assert_eq!((window.foreseeable, window.foreseen), (2, 0), "{window:?}");
        assert!(steps < 40, "read-ahead never stopped");
    }
    assert!(steps > 2, "stopped after {steps} wrong steps");
    assert_eq!(routed.store.capacity(), 2);
    assert_eq!(routed.store.ahead_unused(), 0);
    let stats = routed.store.stats();
    assert_eq!(
        stats.ahead_reads,
        stats.ahead_useful + stats.ahead_wasted,
        "{stats:?}"
    );
    assert!(stats.predicted > stats.ahead_reads, "{stats:?}");
}
