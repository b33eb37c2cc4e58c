//! The `.coli_usage` reader and writer through the public API: colibri's own test cases
//! (`rt_init("glm_moe_dsa", 5, 8)`), the refusal texts, IKU1, trust, decay, `USAGE_SAVE`,
//! merge-on-save and the never-overwrite rule.

use crate::support;

use std::fs;
use std::path::{Path, PathBuf};

use coli::route_trace::history::{self, Layout, Trust};
use coli::route_trace::save;
use coli::route_trace::{
    Counters, Decay, EngineId, ReadOutcome, Refusal, RouteTrace, SaveOptions, SaveOutcome,
};
use support::every_record_has_three_fields;

const ENGINE: &str = "glm_moe_dsa";

fn glm() -> RouteTrace {
    RouteTrace::new(ENGINE, 5, 8).expect("shape")
}

fn table() -> Counters {
    Counters::new(5, 8).expect("shape")
}

fn id(name: &str) -> u32 {
    EngineId::of(name).0
}

/// Reads `text` as a history of the 5x8 GLM test shape.
fn parse_as(
    engine: &str,
    bytes: &[u8],
    trust: Trust,
) -> (Result<coli::route_trace::ReadReport, Refusal>, Counters) {
    let mut t = table();
    let r = history::parse(bytes, engine, trust, &mut t);
    (r, t)
}

fn route(rt: &mut RouteTrace, layer: usize, ids: &[usize]) {
    let gates = vec![1.0 / ids.len() as f32; ids.len()];
    rt.moe_call(layer).route(0, ids, &gates);
}

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn saved(o: SaveOutcome) -> (PathBuf, i64, u64) {
    match o {
        SaveOutcome::Saved {
            path,
            total,
            distinct,
            diverted: None,
        } => (path, total, distinct),
        other => panic!("expected a plain save, got {other:?}"),
    }
}

#[test]
fn empty_history_is_a_zero_byte_file() {
    let d = dir();
    let p = d.path().join(".coli_usage");
    fs::write(&p, "-1 5 8\n-2 1 3815245270\n").expect("seed");
    let mut rt = glm();
    let (_, total, distinct) = saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    assert_eq!((total, distinct), (0, 0));
    assert_eq!(fs::metadata(&p).expect("meta").len(), 0);
}

#[test]
fn header_sparse_data_and_round_trip() {
    let d = dir();
    let p = d.path().join(".coli_usage");
    let mut rt = glm();
    route(&mut rt, 3, &[2, 5, 7]);
    route(&mut rt, 3, &[2]);
    let (_, total, distinct) = saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    assert_eq!((total, distinct), (4, 3));
    let text = fs::read_to_string(&p).expect("read");
    // The lifetime counts, then this save's recent heat (cell = layer * 8 + expert).
    assert_eq!(
        text,
        "-1 5 8\n-2 1 3815245270\n3 2 2\n3 5 1\n3 7 1\n-5 26 2\n-5 29 1\n-5 31 1\n"
    );
    assert!(every_record_has_three_fields(text.as_bytes()));

    let mut back = glm();
    let outcome = back.load_history(&p, None);
    assert_eq!(outcome.total(), 4);
    assert_eq!(back.counts().get(3, 2), 2);
    match outcome {
        ReadOutcome::Read(r) => {
            assert_eq!(r.layout, Layout::Text);
            assert!(r.is_complete());
            assert_eq!(r.admitted, 3);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn legacy_headerless_and_crlf() {
    let (r, _) = parse_as(ENGINE, b"3 2 2\n3 5 1\n3 7 1\n", Trust::Found);
    let r = r.expect("legacy accepted");
    assert_eq!((r.total, r.layout), (4, Layout::Legacy));
    let crlf = format!("-1 5 8\r\n-2 1 {}\r\n3 2 2\r\n3 5 1\r\n", id(ENGINE));
    let (r, t) = parse_as(ENGINE, crlf.as_bytes(), Trust::Found);
    assert_eq!(r.expect("crlf").total, 3);
    assert_eq!(t.get(3, 2), 2);
}

#[test]
fn wrong_dimensions_refused_before_any_record() {
    let p = Path::new("/m/.coli_usage");
    let (r, t) = parse_as(ENGINE, b"-1 99 512\n3 2 2\n", Trust::Found);
    let refusal = r.expect_err("refused");
    assert_eq!(t.total(), 0);
    assert_eq!(
        refusal.message(p),
        "[USAGE] /m/.coli_usage: history is 99 layers x 512 experts, this engine is 5 x 8 \u{2014} refusing rather than misreading it"
    );
    // Never relaxed by trust, and data before the header is not kept either.
    let (r, t) = parse_as(ENGINE, b"3 2 6\n-1 99 512\n", Trust::Named);
    assert!(matches!(r, Err(Refusal::Dimensions { .. })));
    assert_eq!(t.total(), 0);
}

#[test]
fn other_engine_refused_by_name() {
    let p = Path::new("/m/.coli_usage");
    let text = format!("-1 5 8\n-2 1 {}\n3 2 2\n", id("kimi_k3"));
    let (r, t) = parse_as(ENGINE, text.as_bytes(), Trust::Found);
    assert_eq!(
        r.expect_err("refused").message(p),
        "[USAGE] /m/.coli_usage: written by kimi_k3, this engine is glm_moe_dsa \u{2014} refusing (pass PIN=<path> to use it anyway)"
    );
    assert_eq!(t.total(), 0);
    let text = "-1 5 8\n-2 1 12345\n3 2 2\n";
    let (r, _) = parse_as(ENGINE, text.as_bytes(), Trust::Found);
    assert_eq!(
        r.expect_err("refused").message(p),
        "[USAGE] /m/.coli_usage: written by an unknown engine, this engine is glm_moe_dsa \u{2014} refusing (pass PIN=<path> to use it anyway)"
    );
    assert_eq!(EngineId::of("deepseek_v4").name(), Some("deepseek_v4"));
    assert_eq!(EngineId::of("qwen38").name(), Some("qwen38"));
}

#[test]
fn trusted_read_honours_identity_only() {
    let text = format!("-1 5 8\n-2 1 {}\n3 2 6\n", id("kimi_k3"));
    let (r, _) = parse_as(ENGINE, text.as_bytes(), Trust::Found);
    assert!(r.is_err());
    for _ in 0..2 {
        let (r, t) = parse_as(ENGINE, text.as_bytes(), Trust::Named);
        let r = r.expect("honoured");
        assert_eq!((r.total, r.admitted), (6, 1));
        assert_eq!(r.overridden, Some("kimi_k3"));
        assert_eq!(t.get(3, 2), 6);
    }
    let text = format!("-1 99 512\n-2 1 {}\n3 2 6\n", id(ENGINE));
    let (r, t) = parse_as(ENGINE, text.as_bytes(), Trust::Named);
    assert!(r.is_err());
    assert_eq!(t.total(), 0);
}

#[test]
fn future_version_refused_even_when_trusted() {
    let p = Path::new("h");
    let text = format!("-1 5 8\n-2 2 {}\n3 2 9\n", id(ENGINE));
    for trust in [Trust::Found, Trust::Named] {
        let (r, t) = parse_as(ENGINE, text.as_bytes(), trust);
        assert_eq!(
            r.expect_err("refused").message(p),
            "[USAGE] h: format version 2, this build reads 1 \u{2014} refusing rather than misreading it"
        );
        assert_eq!(t.total(), 0);
    }
    // Versions up to ours, zero and negative included, are read.
    for v in ["1", "0", "-7"] {
        let text = format!("-1 5 8\n-2 {v} {}\n3 2 9\n", id(ENGINE));
        assert_eq!(
            parse_as(ENGINE, text.as_bytes(), Trust::Found)
                .0
                .expect("ok")
                .total,
            9
        );
    }
}

fn iku1(dims: (u32, u32), cells: &[(usize, usize, u32)]) -> Vec<u8> {
    let mut words = vec![0x3155_4B49, dims.0, dims.1];
    let mut body = vec![0u32; (dims.0 * dims.1) as usize];
    for &(l, e, c) in cells {
        body[l * dims.1 as usize + e] = c;
    }
    words.extend(body);
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

#[test]
fn iku1_refused_by_other_engines() {
    let p = Path::new("/m/.coli_usage");
    let bytes = iku1((5, 8), &[]);
    assert_eq!(&bytes[..4], b"IKU1");
    let (r, _) = parse_as(ENGINE, &bytes, Trust::Found);
    assert_eq!(
        r.expect_err("refused").message(p),
        "[USAGE] /m/.coli_usage: written by inkling, this engine is glm_moe_dsa \u{2014} refusing (pass PIN=<path> to use it anyway)"
    );
    let (r, t) = parse_as(ENGINE, &iku1((5, 8), &[(3, 2, 4)]), Trust::Named);
    let r = r.expect("named");
    assert_eq!((r.total, r.overridden), (4, Some("inkling")));
    assert_eq!(t.get(3, 2), 4);
}

#[test]
fn iku1_accepted_by_inkling() {
    let bytes = iku1((5, 8), &[(3, 2, 7), (1, 5, 4)]);
    let (r, t) = parse_as("inkling", &bytes, Trust::Found);
    let r = r.expect("inkling reads its own file");
    assert_eq!((r.total, r.layout, r.overridden), (11, Layout::Iku1, None));
    assert!(r.is_complete());
    assert_eq!((t.get(3, 2), t.get(1, 5), t.get(0, 0)), (7, 4, 0));
}

#[test]
fn iku1_dimensions_never_relaxed_and_truncation_partial() {
    let p = Path::new("x");
    let (r, _) = parse_as("inkling", &iku1((6, 8), &[]), Trust::Named);
    assert_eq!(
        r.expect_err("dims").message(p),
        "[USAGE] x: history is 6 layers x 8 experts, this engine is 5 x 8 \u{2014} refusing rather than misreading it"
    );
    let mut bytes = iku1((5, 8), &[(0, 1, 3), (4, 0, 9)]);
    bytes.truncate(12 + 8 * 4 * 2 + 5);
    let (r, t) = parse_as("inkling", &bytes, Trust::Found);
    let r = r.expect("partial");
    assert_eq!(r.total, 3);
    assert_eq!(r.stopped_at, Some(12 + 8 * 4 * 2));
    assert!(!r.is_complete());
    assert_eq!(t.get(4, 0), 0);
    let (r, _) = parse_as("inkling", b"IKU1\x05\0\0", Trust::Found);
    assert_eq!(r.expect("short header").stopped_at, Some(4));
}

#[test]
fn only_admitted_records_are_totalled() {
    let (r, t) = parse_as(ENGINE, b"3 2 5\n9 1 100\n1 99 200\n", Trust::Found);
    let r = r.expect("read");
    assert_eq!((r.total, r.admitted, r.rejected), (5, 1, 2));
    assert_eq!((t.get(3, 2), t.get(1, 7)), (5, 0));
    assert!(!r.is_complete());
}

#[test]
fn dropped_row_admits_nothing_and_is_not_written() {
    let d = dir();
    let p = d.path().join("h");
    fs::write(&p, "2 3 50\n3 4 7\n").expect("seed");
    let mut rt = glm();
    rt.drop_row(2);
    assert_eq!(rt.load_history(&p, None).total(), 7);
    assert_eq!(rt.counts().get(3, 4), 7);
    route(&mut rt, 2, &[3]);
    assert_eq!(rt.counts().total(), 7);
    route(&mut rt, 3, &[1]);
    // The file held a record for the dropped row: a record no engine would emit, which the
    // rewrite leaves out, as the format says, so a C reader's total is the one counted.
    let (path, total, _) = saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    assert_eq!(path, p);
    assert_eq!(total, 8);
    let text = fs::read_to_string(&p).expect("read");
    assert_eq!(text, "-1 5 8\n-2 1 3815245270\n3 1 1\n3 4 7\n-5 25 1\n");
    route(&mut rt, 3, &[1]);
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    assert_eq!(
        fs::read_to_string(&p).expect("read"),
        "-1 5 8\n-2 1 3815245270\n3 1 2\n3 4 7\n-5 25 2\n"
    );
}

#[test]
fn usage_save_zero_is_read_only() {
    let d = dir();
    let p = d.path().join("h");
    let mut rt = glm();
    route(&mut rt, 3, &[4]);
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    let before = fs::read(&p).expect("read");
    route(&mut rt, 3, &[4, 5]);
    let off = SaveOptions {
        enabled: false,
        decay: Decay::new(0.5),
    };
    assert_eq!(
        rt.save_history(&p, off).expect("skip"),
        SaveOutcome::Skipped
    );
    assert_eq!(fs::read(&p).expect("read"), before);
    assert_eq!(rt.counts().get(3, 4), 2, "a skipped save does not decay");
    let on = SaveOptions {
        enabled: true,
        decay: Decay::NONE,
    };
    saved(rt.save_history(&p, on).expect("save"));
    assert_ne!(fs::read(&p).expect("read"), before);
}

#[test]
fn decay_rounds_half_up_at_every_save() {
    let d = dir();
    let p = d.path().join("h");
    fs::write(&p, format!("-1 5 8\n-2 1 {}\n1 0 1\n1 1 200\n", id(ENGINE))).expect("seed");
    let mut rt = glm();
    rt.load_history(&p, None);
    let opts = SaveOptions {
        enabled: true,
        decay: Decay::new(0.99),
    };
    saved(rt.save_history(&p, opts).expect("save"));
    assert_eq!(
        fs::read_to_string(&p).expect("read"),
        format!("-1 5 8\n-2 1 {}\n1 0 1\n1 1 198\n", id(ENGINE))
    );
    assert_eq!(rt.counts().get(1, 1), 198);
}

#[test]
fn repeated_saves_do_not_double_count_and_merge_foreign_progress() {
    let d = dir();
    let p = d.path().join("h");
    let mut a = glm();
    let mut b = glm();
    route(&mut a, 1, &[1]);
    route(&mut b, 1, &[2]);
    saved(a.save_history(&p, SaveOptions::default()).expect("a"));
    saved(a.save_history(&p, SaveOptions::default()).expect("a again"));
    saved(b.save_history(&p, SaveOptions::default()).expect("b"));
    route(&mut a, 1, &[1]);
    let (_, total, _) = saved(a.save_history(&p, SaveOptions::default()).expect("a"));
    assert_eq!(total, 3);
    let mut t = table();
    history::parse(&fs::read(&p).expect("read"), ENGINE, Trust::Found, &mut t).expect("ok");
    assert_eq!((t.get(1, 1), t.get(1, 2)), (2, 1));
}

#[test]
fn never_overwrites_another_engines_or_models_history() {
    let d = dir();
    for (name, content) in [
        (
            "foreign",
            format!("-1 5 8\n-2 1 {}\n3 2 6\n", id("kimi_k3")),
        ),
        ("future", format!("-1 5 8\n-2 9 {}\n3 2 6\n", id(ENGINE))),
        ("shape", "-1 6 8\n3 2 6\n".to_string()),
        ("larger model", "3 2 6\n40 1 9\n".to_string()),
        (
            "not a history",
            "{\"model_type\": \"glm_moe_dsa\"}\n".to_string(),
        ),
    ] {
        let p = d.path().join(name);
        fs::write(&p, &content).expect("seed");
        let mut rt = glm();
        rt.load_history(&p, None);
        assert_eq!(
            rt.counts().total(),
            0,
            "{name}: another's counts are not ours"
        );
        let sibling = d.path().join(format!("{name}.glm_moe_dsa"));
        assert_eq!(rt.home().expect("home").save_to, sibling, "{name}");
        route(&mut rt, 4, &[1]);
        let out = rt.save_history(&p, SaveOptions::default()).expect("save");
        assert!(
            matches!(&out, SaveOutcome::Saved { path, total: 1, .. } if *path == sibling),
            "{name}: {out:?}"
        );
        assert_eq!(fs::read_to_string(&p).expect("kept"), content, "{name}");
        // The next save of the same run accumulates there without double counting.
        route(&mut rt, 4, &[1]);
        let out = rt.save_history(&p, SaveOptions::default()).expect("save");
        assert!(
            matches!(out, SaveOutcome::Saved { total: 2, .. }),
            "{name}: {out:?}"
        );
        // And the next run reads the per-engine file back: the history keeps learning.
        let mut next = glm();
        next.load_history(&p, None);
        assert_eq!(next.counts().get(4, 1), 2, "{name}");
        route(&mut next, 4, &[1]);
        saved_to(
            next.save_history(&p, SaveOptions::default()).expect("save"),
            &sibling,
        );
        let mut third = glm();
        third.load_history(&p, None);
        assert_eq!(third.counts().get(4, 1), 3, "{name}");
        assert_eq!(fs::read_to_string(&p).expect("kept"), content, "{name}");
    }
}

fn saved_to(o: SaveOutcome, want: &Path) {
    assert!(
        matches!(&o, SaveOutcome::Saved { path, .. } if path == want),
        "{o:?}"
    );
}

#[test]
fn what_this_engine_cannot_hold_is_kept_verbatim_and_the_file_keeps_learning() {
    let d = dir();
    let h = format!("-1 5 8\n-2 1 {}\n", id(ENGINE));
    for (name, content, kept) in [
        (
            "garbage tail",
            "3 2 6\nnot a number\n3 1 1\n".to_string(),
            "not a number\n3 1 1\n",
        ),
        ("cut short", "3 2 6\n4 1".to_string(), "4 1"),
        // A reserved header is kept; transition records that name no valid group (a
        // group to its own layer, a -4 after a data record ended it) are refused.
        (
            "future headers",
            "-3 0 0\n3 2 6\n-4 1 2\n-6 7 7\n".to_string(),
            "-6 7 7\n",
        ),
        (
            "wrapped",
            "3 2 6\n3 2 -5\n4294967299 1 1\n".to_string(),
            "3 2 -5\n4294967299 1 1\n",
        ),
        // Rows the model does not route: not kept (the format drops them).
        ("mtp row", format!("{h}3 2 6\n5 0 11\n5 7 2\n"), ""),
        ("dense row", format!("{h}0 3 4\n3 2 6\n"), ""),
        (
            "expert out of range",
            format!("{h}3 2 6\n3 99 4\n"),
            "3 99 4\n",
        ),
    ] {
        let p = d.path().join(name);
        fs::write(&p, &content).expect("seed");
        for run in 1..=3u32 {
            let mut rt = glm();
            rt.drop_row(5);
            rt.drop_row(0);
            rt.load_history(&p, None);
            assert_eq!(rt.counts().get(3, 2), 6 + run - 1, "{name} run {run}");
            assert_eq!(rt.home().expect("home").save_to, p, "{name}");
            route(&mut rt, 3, &[2]);
            let (path, _, _) = saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
            assert_eq!(path, p, "{name}");
            let text = fs::read_to_string(&p).expect("read");
            assert_eq!(
                text,
                format!("{h}3 2 {}\n-5 26 {run}\n{kept}", 6 + run),
                "{name} run {run}"
            );
        }
        assert!(!d.path().join(format!("{name}.glm_moe_dsa")).exists());
    }
}

#[test]
fn a_per_engine_file_beside_our_own_history_is_read_and_never_written() {
    let d = dir();
    let p = d.path().join("h");
    let s = save::sibling_path(&p, ENGINE);
    fs::write(&p, format!("-1 5 8\n-2 1 {}\n3 2 6\n", id(ENGINE))).expect("seed");
    fs::write(&s, format!("-1 5 8\n-2 1 {}\n1 1 4\n", id(ENGINE))).expect("seed");
    let frozen = fs::read(&s).expect("read");
    for run in 1..=2 {
        let mut rt = glm();
        rt.load_history(&p, None);
        assert_eq!(rt.counts().get(1, 1), 4, "run {run}");
        let home = rt.home().expect("home").clone();
        assert_eq!((home.save_to, home.frozen), (p.clone(), Some(s.clone())));
        route(&mut rt, 3, &[2]);
        let (_, total, _) = saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
        assert_eq!(total, 6 + run);
        // The merged counts in memory still hold the frozen file's.
        assert_eq!(rt.counts().get(1, 1), 4);
        assert_eq!(fs::read(&s).expect("read"), frozen);
    }
}

#[test]
fn no_safe_target_is_an_error_and_touches_nothing() {
    let d = dir();
    let p = d.path().join("h");
    let s = save::sibling_path(&p, ENGINE);
    fs::write(&p, "junk").expect("seed");
    fs::write(&s, "more junk").expect("seed");
    let mut rt = glm();
    route(&mut rt, 1, &[1]);
    let err = rt
        .save_history(&p, SaveOptions::default())
        .expect_err("refused");
    assert!(err.to_string().contains("counts not saved"), "{err}");
    assert_eq!(fs::read_to_string(&p).expect("kept"), "junk");
    assert_eq!(fs::read_to_string(&s).expect("kept"), "more junk");
}

#[test]
fn legacy_and_iku1_histories_are_converted_on_save() {
    let d = dir();
    let p = d.path().join("h");
    fs::write(&p, "3 2 2\n3 5 1\n").expect("seed");
    let mut rt = glm();
    rt.load_history(&p, None);
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    assert_eq!(
        fs::read_to_string(&p).expect("read"),
        format!("-1 5 8\n-2 1 {}\n3 2 2\n3 5 1\n", id(ENGINE))
    );
    fs::write(&p, iku1((5, 8), &[(1, 5, 4)])).expect("seed");
    let mut rt = RouteTrace::new("inkling", 5, 8).expect("shape");
    assert_eq!(rt.load_history(&p, None).total(), 4);
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    assert_eq!(
        fs::read_to_string(&p).expect("read"),
        format!("-1 5 8\n-2 1 {}\n1 5 4\n", id("inkling"))
    );
}

#[test]
fn stats_dump_writes_counters_as_they_are() {
    let d = dir();
    let p = d.path().join("stats.txt");
    let mut rt = glm();
    route(&mut rt, 0, &[0, 0, 7]);
    assert_eq!(rt.dump_stats(&p).expect("dump"), (3, 2));
    assert_eq!(
        fs::read_to_string(&p).expect("read"),
        format!("-1 5 8\n-2 1 {}\n0 0 2\n0 7 1\n", id(ENGINE))
    );
}

#[test]
fn missing_and_unreadable_histories() {
    let d = dir();
    let mut rt = glm();
    assert!(matches!(
        rt.load_history(&d.path().join("none"), None),
        ReadOutcome::Missing
    ));
    let o = rt.load_history(d.path(), None);
    assert!(matches!(o, ReadOutcome::Unreadable(_)), "{o:?}");
    assert!(o.not_ours(&table()).is_some());
}

#[test]
fn out_of_range_fields_are_skipped_not_wrapped() {
    // glibc would read `-5` as 4294967291 and 4294967299 as layer 3; we admit neither.
    let (r, t) = parse_as(ENGINE, b"3 2 -5\n4294967299 1 1\n3 1 1\n", Trust::Found);
    let r = r.expect("read");
    assert_eq!((r.malformed, r.rejected, r.total), (2, 0, 1));
    assert_eq!(t.total(), 1);
}

#[test]
fn header_after_data_is_still_checked() {
    let text = format!("3 2 2\n-2 1 {}\n", id("olmoe"));
    let (r, t) = parse_as(ENGINE, text.as_bytes(), Trust::Found);
    assert!(r.is_err());
    assert_eq!(t.total(), 0);
}

/// The `-5` recent heat: written beside the lifetime counts, stepped once per save as
/// `recent - (recent >> 6) + gain`, and what `PIN_RANK=recent` ranks by.
#[test]
fn recent_heat_follows_the_workload_and_ranks_when_asked() {
    use coli::route_trace::PinRank;
    let d = dir();
    let p = d.path().join("h");
    let mut rt = glm();
    for _ in 0..100 {
        route(&mut rt, 1, &[1]);
    }
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    let text = fs::read_to_string(&p).expect("read");
    assert_eq!(
        text,
        format!("-1 5 8\n-2 1 {}\n1 1 100\n-5 9 100\n", id(ENGINE))
    );
    // A month of another workload: many selections of expert 1, little recent heat left.
    fs::write(
        &p,
        format!("-1 5 8\n-2 1 {}\n1 1 1000\n-5 9 10\n", id(ENGINE)),
    )
    .expect("seed");
    // The workload switches: expert 2 from now on, one save per "turn".
    for _ in 0..3 {
        let mut next = glm();
        next.load_history(&p, None);
        for _ in 0..40 {
            route(&mut next, 1, &[2]);
        }
        saved(next.save_history(&p, SaveOptions::default()).expect("save"));
    }
    let mut t = table();
    history::parse(&fs::read(&p).expect("read"), ENGINE, Trust::Found, &mut t).expect("ok");
    // Lifetime: 1000 vs 120. Recent: 10 stays 10 (10 >> 6 = 0); 40 -> 80 -> 119.
    assert_eq!((t.get(1, 1), t.get(1, 2)), (1000, 120));
    let r = t.recent().expect("recent heat");
    assert_eq!((r.get(1, 1), r.get(1, 2)), (10, 119));
    let top = |rank: PinRank| {
        let ranked = coli::route_trace::placement::rank(&rank.table(&t));
        (ranked[0].layer, ranked[0].expert)
    };
    assert_eq!(top(PinRank::Lifetime), (1, 1));
    assert_eq!(top(PinRank::Recent), (1, 2));
    // Blend: 1000/1120 + 10/129 = 0.97 vs 120/1120 + 119/129 = 1.03 of a share.
    assert_eq!(top(PinRank::Blend), (1, 2));
    assert_eq!(PinRank::from_setting(Some("blend")), Ok(PinRank::Blend));
    assert!(PinRank::from_setting(Some("newest")).is_err());
}

/// A `-3` group: source cell, destination layer, [(expert, count)].
type Group = (i64, i64, Vec<(i64, i64)>);

/// The `-3`/`-4` records of a saved history, as groups in file order.
fn transition_groups(text: &str) -> Vec<Group> {
    let mut groups: Vec<Group> = Vec::new();
    for line in text.lines() {
        let f: Vec<i64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
        match f[0] {
            -3 => groups.push((f[1], f[2], Vec::new())),
            -4 => groups
                .last_mut()
                .expect("a -4 inside a group")
                .2
                .push((f[1], f[2])),
            _ => {}
        }
    }
    groups
}

#[test]
fn expert_transitions_are_counted_saved_grouped_and_read_back() {
    let d = dir();
    let p = d.path().join(".coli_usage");
    let mut rt = glm();
    rt.drop_row(2); // a dense layer: 1 -> 3 is a step to the next routing layer
                    // 20 tokens: layer 0 chooses {1, 2}; layer 1 chooses {3, 4} (15 times) or {5, 6};
                    // layer 3 chooses {7}.
    for t in 0..20 {
        route(&mut rt, 0, &[1, 2]);
        route(&mut rt, 1, if t % 4 == 3 { &[5, 6] } else { &[3, 4] });
        route(&mut rt, 3, &[7]);
    }
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    let text = fs::read_to_string(&p).unwrap();
    assert!(every_record_has_three_fields(text.as_bytes()), "{text}");
    // Cells: layer * 8 + expert. A source is written when its expert was chosen at least
    // as often as its layer's mean (here 40 / 8 = 5 on layers 0 and 1).
    assert_eq!(
        transition_groups(&text),
        vec![
            (1, 1, vec![(3, 15), (4, 15), (5, 5), (6, 5)]),
            (2, 1, vec![(3, 15), (4, 15), (5, 5), (6, 5)]),
            (11, 3, vec![(7, 15)]),
            (12, 3, vec![(7, 15)]),
            (13, 3, vec![(7, 5)]),
            (14, 3, vec![(7, 5)]),
        ],
        "{text}"
    );

    // A second process adds its own on top (merge-on-save), and a classic reader's total
    // is still the selections alone.
    let mut again = glm();
    again.drop_row(2);
    again.load_history(&p, None);
    for _ in 0..12 {
        route(&mut again, 1, &[3, 4]);
        route(&mut again, 3, &[7]);
    }
    saved(
        again
            .save_history(&p, SaveOptions::default())
            .expect("save"),
    );
    let text = fs::read_to_string(&p).unwrap();
    let groups = transition_groups(&text);
    assert_eq!(groups[0], (1, 1, vec![(3, 15), (4, 15), (5, 5), (6, 5)]));
    // 1:3 and 1:4 were followed by 3:7 15 + 12 = 27 times; 1:5 and 1:6, chosen 5 times
    // against a layer mean of 64 / 8 = 8 now, are no longer written.
    assert_eq!(groups[2], (11, 3, vec![(7, 27)]), "{text}");
    assert_eq!(groups[3], (12, 3, vec![(7, 27)]), "{text}");
    assert_eq!(groups.len(), 4, "{text}");
    let c_total: i64 = text
        .lines()
        .map(|l| {
            l.split(' ')
                .map(|x| x.parse::<i64>().unwrap())
                .collect::<Vec<_>>()
        })
        .filter(|f| f[0] >= 0)
        .map(|f| f[2])
        .sum();
    assert_eq!(c_total, 20 * 5 + 12 * 3);
}

#[test]
fn a_transition_record_outside_a_group_is_refused_and_not_written_back() {
    let d = dir();
    let p = d.path().join(".coli_usage");
    let head = format!("-1 5 8\n-2 1 {}\n0 2 4\n", id(ENGINE));
    // An orphan -4; a group on the dense row 2; a group cut by a data record; a group from
    // layer 1 back to layer 0; then a good group.
    let body = "-4 3 9\n-3 17 3\n-4 1 5\n-3 1 1\n1 3 2\n-4 2 7\n-3 9 0\n-4 2 7\n-3 2 1\n-4 6 40\n-4 5 20\n";
    fs::write(&p, format!("{head}{body}")).unwrap();
    let mut rt = glm();
    rt.drop_row(2);
    let outcome = rt.load_history(&p, None);
    let ReadOutcome::Read(report) = &outcome else {
        panic!("{outcome:?}");
    };
    assert_eq!(report.transitions_refused, 4);
    assert_eq!(report.total, 6);
    assert!(report.is_complete(), "refused transitions are not kept");
    assert_eq!(
        rt.counts().transitions().predict(8, 0, &[2], 1),
        Some((1, vec![6]))
    );
    saved(rt.save_history(&p, SaveOptions::default()).expect("save"));
    let text = fs::read_to_string(&p).unwrap();
    // The good group is written back; nothing refused is.
    assert_eq!(
        transition_groups(&text),
        vec![(2, 1, vec![(6, 40), (5, 20)])],
        "{text}"
    );
}
