//! `coli trace stats | simulate` on synthetic traces with known answers, on malformed
//! input, and on traces the engine wrote for the committed OLMoE fixture.

use crate::common;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use coli::tools::simulate::{self, Policy, SimOptions};
use coli::tools::stats;
use common::{coli, fixture, stderr, stdout};
use proptest::prelude::*;

/// A trace from `(call, row, layer, ids)` lines, gates all 0.5.
fn trace_text(lines: &[(u64, u64, usize, Vec<usize>)]) -> String {
    let mut s = String::new();
    for (call, row, layer, ids) in lines {
        let _ = write!(s, "{call} {row} {layer}");
        for id in ids {
            let _ = write!(s, " {id}:0.5000");
        }
        s.push('\n');
    }
    s
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// Decode-only forwards over `layers` layers, one line per layer, with the call number
/// advancing per line as the engine writes it.
fn decode_trace(forwards: &[Vec<Vec<usize>>]) -> String {
    let mut lines = Vec::new();
    let mut call = 0;
    for f in forwards {
        for (layer, ids) in f.iter().enumerate() {
            lines.push((call, 0, layer, ids.clone()));
            call += 1;
        }
    }
    trace_text(&lines)
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn a_following_layer_is_fully_predictable() {
    // Layer l+1 always routes (e + 3) mod 8 after layer l routed e.
    let forwards: Vec<Vec<Vec<usize>>> = (0..40)
        .map(|t| {
            let e0 = (t * 5 + t / 3) % 8;
            (0..3).map(|l| vec![(e0 + 3 * l) % 8]).collect()
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let t = write(dir.path(), "t", &decode_trace(&forwards));
    let r = stats::stats(&t, None, None, None).unwrap();
    assert_eq!(r.forwards, 40);
    assert_eq!(r.predictability[0].recall, Some(1.0));
    assert_eq!(r.predictability[1].recall, Some(1.0));
    assert_eq!(r.predictability[0].measured, 80);
    assert_eq!(r.layers[0].next_layer_recall, Some(1.0));
}

#[test]
fn a_uniform_trace_has_maximal_entropy() {
    let pairs = [vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]];
    let forwards: Vec<Vec<Vec<usize>>> = (0..16)
        .map(|t| (0..2).map(|l| pairs[(t + l) % 4].clone()).collect())
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let t = write(dir.path(), "t", &decode_trace(&forwards));
    let r = stats::stats(&t, Some(8), None, None).unwrap();
    for l in &r.layers {
        assert!((l.entropy_bits - 3.0).abs() < 1e-12, "{l:?}");
        assert!((l.entropy_share - 1.0).abs() < 1e-12, "{l:?}");
        assert!((l.max_over_mean - 1.0).abs() < 1e-12, "{l:?}");
        assert_eq!(l.tokens, 16);
        assert_eq!(l.selections, 32);
    }
    // A skewed layer is below the maximum.
    let skewed = write(
        dir.path(),
        "s",
        &decode_trace(&[vec![vec![0, 1]], vec![vec![0, 2]]]),
    );
    let r = stats::stats(&skewed, Some(8), None, None).unwrap();
    assert!((r.layers[0].entropy_bits - 1.5).abs() < 1e-12);
    assert!((r.layers[0].max_over_mean - 4.0).abs() < 1e-12);
}

#[test]
fn stats_counts_forwards_calls_and_writes_coli_pairs() {
    // One prefill forward of 2 rows, then two decode forwards, over 2 layers.
    let lines = vec![
        (0, 0, 0, vec![1, 2]),
        (0, 1, 0, vec![1, 3]),
        (1, 0, 1, vec![4, 5]),
        (1, 1, 1, vec![4, 6]),
        (2, 0, 0, vec![1, 2]),
        (3, 0, 1, vec![4, 5]),
        (4, 0, 0, vec![3, 2]),
        (5, 0, 1, vec![6, 4]),
    ];
    let dir = tempfile::tempdir().unwrap();
    let t = write(dir.path(), "t", &trace_text(&lines));
    let out_pairs = dir.path().join("t.coli_pairs");
    let out = coli(
        &["trace", "stats", p(&t), "--pairs", p(&out_pairs), "--json"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["rows"], 8);
    assert_eq!(j["forwards"], 3);
    assert_eq!(j["prefill_forwards"], 1);
    assert_eq!(j["calls"], 6);
    assert_eq!(j["decode_calls"], 4);
    assert_eq!(j["top_k"], 2);
    assert_eq!(j["layers"][0]["tokens"], 4);
    assert_eq!(j["layers"][1]["selections"], 8);
    // (layer 0 set -> layer 1 set) per token: {1,2}->{4,5} twice, {1,3}->{4,6}, {2,3}->{4,6}.
    assert_eq!(
        std::fs::read_to_string(&out_pairs).unwrap(),
        "COLIPAIRS 1 3\n0 1 1 4:3 5:2 6:1\n0 1 2 4:3 5:2 6:1\n0 1 3 4:2 6:2\n"
    );
    // Predictions for {1,2}: 4 (6), 5 (4) -> both right; {1,3}: 4 (5), 5 (2)/6 (3) -> 4, 6.
    assert_eq!(j["predictability"][0]["recall"], 1.0);
}

#[test]
fn malformed_lines_are_named_and_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let text = "0 0 0 1:0.5 2:0.5\n\
                garbage\n\
                1 0 1 3:0.5 x:0.2\n\
                \n\
                2 0 0 1:nan\n\
                3 0 1 7:0.1 9\n\
                4 0 1 2:0.5\n";
    let t = dir.path().join("t");
    std::fs::write(&t, text.as_bytes()).unwrap();
    let out = coli(&["trace", "stats", p(&t), "--json"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let e = stderr(&out);
    for n in [2, 3, 4, 6] {
        assert!(e.contains(&format!("{}:{n}: ", p(&t))), "line {n}: {e}");
    }
    assert!(
        e.contains("`garbage`") || e.contains("call `garbage`"),
        "{e}"
    );
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["rows"], 3);
    assert_eq!(j["malformed"], 4);

    let bytes: Vec<u8> = b"0 0 0 1:0.5\n1 0 1 \xff\xfe:0.5\n2 0 0 2:0.5\n".to_vec();
    std::fs::write(&t, bytes).unwrap();
    let out = coli(
        &["trace", "simulate", p(&t), "--json", "--include-prefill"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!("{}:2: the line is not UTF-8", p(&t))));

    let out = coli(&["trace", "stats", p(&t), "--experts", "2"], &[]);
    assert!(out.status.success());
    assert!(
        stderr(&out).contains("expert id 2 is not below the 2 experts"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn missing_trace_and_bad_options_are_exit_2() {
    let out = coli(&["trace", "stats", "/nonexistent/t"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("/nonexistent/t"));
    let dir = tempfile::tempdir().unwrap();
    let t = write(dir.path(), "t", &decode_trace(&[vec![vec![1]]]));
    for args in [
        vec!["--policy", "pinned"],
        vec!["--slots", "0"],
        vec!["--train-frac", "1.5"],
    ] {
        let mut a = vec!["trace", "simulate", p(&t)];
        a.extend(args.iter().copied());
        let out = coli(&a, &[]);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
    }
}

/// One layer, one expert per token: 1 2 1 3 2 1 4 1.
fn hand_trace(dir: &Path) -> PathBuf {
    let f: Vec<Vec<Vec<usize>>> = [1, 2, 1, 3, 2, 1, 4, 1]
        .iter()
        .map(|&e| vec![vec![e]])
        .collect();
    write(dir, "hand", &decode_trace(&f))
}

#[test]
fn hand_worked_hits_per_policy() {
    let dir = tempfile::tempdir().unwrap();
    let t = hand_trace(dir.path());
    let h = write(
        dir.path(),
        "h",
        "-1 0 8\n-2 1 3841822045\n0 1 10\n0 2 5\n0 3 1\n",
    );
    let mut opts = SimOptions::new(vec![1, 2, 3]);
    opts.history = Some(h);
    let r = simulate::simulate(&t, &opts).unwrap();
    assert_eq!(r.lookups, 8);
    let want = [
        // slots, lru, lfru, pinned, belady
        (1, 0, 0, 4, 4),
        // lru: hits at the 3rd and 8th lookup; lfru keeps the frequent 1, so also the 6th;
        // pinned {1, 2}; belady starts with {1, 2} and bypasses 3 and 4.
        (2, 2, 3, 6, 6),
        (3, 4, 4, 7, 7),
    ];
    for (slots, lru, lfru, pinned, belady) in want {
        assert_eq!(r.hits(slots, Policy::Lru), Some(lru), "lru at {slots}");
        assert_eq!(r.hits(slots, Policy::Lfru), Some(lfru), "lfru at {slots}");
        assert_eq!(
            r.hits(slots, Policy::Pinned),
            Some(pinned),
            "pinned at {slots}"
        );
        assert_eq!(
            r.hits(slots, Policy::Belady),
            Some(belady),
            "belady at {slots}"
        );
    }
    let out = coli(&["trace", "simulate", p(&t), "--slots", "2", "--json"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let results = &j["sizes"][0]["results"];
    assert_eq!(results[0]["policy"], "lru");
    assert_eq!(results[0]["hits"], 2);
    assert_eq!(results[1]["policy"], "lfru");
    assert_eq!(results[2]["policy"], "belady");
    let out = coli(&["trace", "simulate", p(&t), "--slots", "1,2"], &[]);
    let text = stdout(&out);
    assert!(text.contains(" slots      lru     lfru   belady"), "{text}");
    assert!(text.contains("     2    25.0%    37.5%    75.0%"), "{text}");
}

#[test]
fn train_frac_learns_pins_from_the_first_forwards() {
    // Forwards (layer 0, layer 1): (1,5) (1,6) | (2,5) (1,5).
    let f = vec![
        vec![vec![1], vec![5]],
        vec![vec![1], vec![6]],
        vec![vec![2], vec![5]],
        vec![vec![1], vec![5]],
    ];
    let dir = tempfile::tempdir().unwrap();
    let t = write(dir.path(), "t", &decode_trace(&f));
    let mut opts = SimOptions::new(vec![1]);
    opts.train_frac = Some(0.5);
    let r = simulate::simulate(&t, &opts).unwrap();
    assert_eq!(
        (r.train_forwards, r.train_calls, r.calls, r.lookups),
        (2, 4, 4, 4)
    );
    // Pins {1} and {5} (5 and 6 tie; the lower id wins): 2 misses at layer 0, then hits.
    assert_eq!(r.hits(1, Policy::Pinned), Some(3));
    // LRU warmed by the training forwards holds 1 and 6: only the last 5 hits.
    assert_eq!(r.hits(1, Policy::Lru), Some(1));
    assert_eq!(r.hits(1, Policy::Belady), Some(3));
}

/// The `Expert cache hit rate: ... (P pin + H lru / M miss)` numbers.
fn engine_hits(text: &str) -> (u64, u64, u64) {
    let rest = text
        .split("Expert cache hit rate: ")
        .nth(1)
        .expect("hit-rate line");
    let nums: Vec<u64> = rest
        .split(['(', ' ', '/', ')'])
        .filter_map(|w| w.parse().ok())
        .take(3)
        .collect();
    (nums[0], nums[1], nums[2])
}

#[test]
fn engine_traces_are_counted_once_and_lru_replays_the_engine_cache() {
    let dir = tempfile::tempdir().unwrap();
    for cap in ["1", "2", "8"] {
        let trace = dir.path().join(format!("trace{cap}"));
        let usage = dir.path().join(format!("usage{cap}"));
        let out = coli(
            &[
                &format!("SNAP={}", fixture("olmoe_tiny").display()),
                "IDS=3 11 29 7 41 19",
                "NGEN=8",
                &format!("ROUTE_TRACE={}", trace.display()),
                &format!("COLI_USAGE={}", usage.display()),
                cap,
                "16",
                "16",
            ],
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        let (pin, lru, miss) = engine_hits(&stdout(&out));
        assert_eq!(pin, 0);

        let lines = std::fs::read_to_string(&trace).unwrap().lines().count() as u64;
        let r = stats::stats(&trace, None, None, None).unwrap();
        assert_eq!(r.malformed, 0);
        assert_eq!(r.rows, lines);
        assert_eq!(r.layers.iter().map(|l| l.tokens).sum::<u64>(), lines);
        // Every selection in the trace is one the engine counted into its history.
        let shown = coli(&["usage", "show", p(&usage), "--json", "--top", "0"], &[]);
        let h: serde_json::Value = serde_json::from_str(&stdout(&shown)).unwrap();
        for (l, hl) in r.layers.iter().zip(h["layers"].as_array().unwrap()) {
            assert_eq!(hl["layer"], l.layer);
            assert_eq!(hl["selections"], l.selections);
        }
        assert_eq!(
            h["selections"].as_u64().unwrap(),
            r.layers.iter().map(|l| l.selections).sum::<u64>()
        );

        let mut opts = SimOptions::new(vec![cap.parse().unwrap()]);
        opts.include_prefill = true;
        opts.policies = vec![Policy::Lru, Policy::Belady];
        let s = simulate::simulate(&trace, &opts).unwrap();
        assert_eq!(s.lookups, lru + miss, "CAP {cap}");
        assert_eq!(
            s.hits(s.sizes[0].slots, Policy::Lru),
            Some(lru),
            "CAP {cap}"
        );
        assert!(s.hits(s.sizes[0].slots, Policy::Belady) >= Some(lru));
    }
}

/// The most hits any policy can get on one layer's lookups `seq` with `slots` slots:
/// every choice of starting contents, and at each miss every choice of admitting (in place
/// of any resident) or not, explored exhaustively.
fn brute_force_best(seq: &[usize], slots: usize, experts: usize) -> u64 {
    use std::collections::HashMap;
    let mut best: HashMap<u32, u64> = (0u32..1 << experts)
        .filter(|m| m.count_ones() as usize <= slots)
        .map(|m| (m, 0))
        .collect();
    for &x in seq {
        let bit = 1u32 << x;
        let mut next: HashMap<u32, u64> = HashMap::new();
        let mut offer = |m: u32, h: u64| {
            let e = next.entry(m).or_insert(h);
            *e = (*e).max(h);
        };
        for (&m, &h) in &best {
            if m & bit != 0 {
                offer(m, h + 1);
                continue;
            }
            offer(m, h);
            if (m.count_ones() as usize) < slots {
                offer(m | bit, h);
            }
            for y in 0..experts {
                if m & (1 << y) != 0 {
                    offer((m & !(1 << y)) | bit, h);
                }
            }
        }
        best = next;
    }
    best.values().copied().max().unwrap_or(0)
}

fn arb_trace() -> impl Strategy<Value = Vec<Vec<Vec<usize>>>> {
    // Forwards of 1..4 layers, each routing 1..3 of 6 experts (duplicates allowed).
    prop::collection::vec(
        prop::collection::vec(prop::collection::vec(0usize..6, 1..4), 1..4),
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn belady_bounds_every_policy(f in arb_trace(), frac in prop::option::of(0.2f64..0.8)) {
        let dir = tempfile::tempdir().unwrap();
        let t = write(dir.path(), "t", &decode_trace(&f));
        let mut opts = SimOptions::new(vec![1, 2, 3, 5]);
        opts.train_frac = frac.filter(|_| f.len() >= 5);
        if opts.train_frac.is_none() {
            opts.history = Some(write(dir.path(), "h", "-1 3 6\n-2 1 3841822045\n0 1 4\n1 2 3\n2 0 9\n"));
        }
        let r = match simulate::simulate(&t, &opts) {
            Ok(r) => r,
            // Forwards of one layer merge with the next, so a split can come out empty.
            Err(e) if opts.train_frac.is_some() && e.to_string().contains("--train-frac") => {
                return Ok(());
            }
            Err(e) => panic!("{e:#}"),
        };
        for z in &r.sizes {
            let best = z.results.iter().find(|x| x.policy == Policy::Belady).unwrap().hits;
            for x in &z.results {
                prop_assert!(x.hits <= best, "{:?} beats belady at {}: {:?}", x.policy, z.slots, r);
                prop_assert!(x.hits <= r.lookups);
            }
        }
    }

    #[test]
    fn belady_is_the_optimum(seq in prop::collection::vec(0usize..5, 1..14)) {
        let dir = tempfile::tempdir().unwrap();
        let f: Vec<Vec<Vec<usize>>> = seq.iter().map(|&e| vec![vec![e]]).collect();
        let t = write(dir.path(), "t", &decode_trace(&f));
        let mut opts = SimOptions::new(vec![1, 2, 3]);
        opts.policies = vec![Policy::Belady];
        let r = simulate::simulate(&t, &opts).unwrap();
        for slots in 1..=3 {
            prop_assert_eq!(
                r.hits(slots, Policy::Belady),
                Some(brute_force_best(&seq, slots, 5)),
                "{:?} at {} slots", seq, slots
            );
        }
    }

    #[test]
    fn arbitrary_lines_never_panic(lines in prop::collection::vec("[0-9a-z: .\\-]{0,24}", 0..30)) {
        let dir = tempfile::tempdir().unwrap();
        let t = write(dir.path(), "t", &lines.join("\n"));
        let r = stats::stats(&t, None, None, None).unwrap();
        prop_assert_eq!(r.rows + r.malformed, lines.len() as u64 - u64::from(lines.last().is_some_and(String::is_empty)));
        let s = simulate::simulate(&t, &SimOptions::new(vec![1, 2])).unwrap();
        prop_assert!(s.lookups <= r.rows * 24);
    }
}
