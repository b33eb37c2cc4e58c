//! The `ROUTE_TRACE` stream and startup placement through the public API.

use std::fs;
use std::path::Path;

use coli::route_trace::{
    EngineId, PinGb, PinPlan, PinRank, PinRequest, PinSetting, PinSource, RouteTrace, SaveOptions,
};

const ENGINE: &str = "olmoe";

#[test]
fn one_line_per_row_and_call_advances_per_moe_invocation() {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join("trace.txt");
    fs::write(&p, "0 0 0 1:1.0000\n1 0 1 4:0.5000 2:0.5000\n").expect("an old trace");
    let mut rt = RouteTrace::new(ENGINE, 2, 8).expect("shape");
    rt.drop_row(2);
    rt.open_trace(&p).expect("open");
    assert!(rt.tracing());
    {
        let mut call = rt.moe_call(0);
        call.route(0, &[3, 1], &[0.75, 0.25]);
        call.route(1, &[2, 6], &[0.6, -0.00001]);
    }
    // An invocation that traced nothing still advances the call number.
    drop(rt.moe_call(1));
    rt.moe_call(1).route(0, &[], &[]);
    // A dropped row is traced (the line is what the router did) but counts nothing.
    rt.moe_call(2).route(0, &[5], &[f32::NAN]);
    rt.flush_trace().expect("flush");
    assert_eq!(
        fs::read_to_string(&p).expect("read"),
        "0 0 0 3:0.7500 1:0.2500\n0 1 0 2:0.6000 6:-0.0000\n2 0 1\n3 0 2 5:nan\n"
    );
    assert_eq!(rt.counts().total(), 4);
    assert_eq!(rt.counts().get(0, 3), 1);
}

#[test]
fn counting_without_a_trace() {
    let mut rt = RouteTrace::new(ENGINE, 1, 4).expect("shape");
    assert!(!rt.tracing());
    rt.moe_call(0).route(0, &[1, 1, 9], &[0.5, 0.5, 0.0]);
    assert_eq!(rt.counts().get(0, 1), 2);
    assert_eq!(rt.counts().total(), 2);
    assert_eq!(rt.session_heat().heat(0, 1), 2);
    rt.cool_session_heat();
    assert_eq!(rt.session_heat().heat(0, 1), 1);
    rt.flush_trace().expect("nothing to flush");
}

#[test]
#[should_panic(expected = "one gate per routed expert")]
fn ids_and_gates_must_pair() {
    let mut rt = RouteTrace::new(ENGINE, 1, 4).expect("shape");
    rt.moe_call(0).route(0, &[1, 2], &[1.0]);
}

fn request<'a>(pin: &'a PinSetting, snap: &'a Path, history: &'a Path) -> PinRequest<'a> {
    PinRequest {
        pin,
        pin_n: None,
        pin_gb: PinGb::DEFAULT,
        ram_avail_bytes: 0,
        autopin: true,
        cap: 16,
        snap,
        history: Some(history),
        rank: PinRank::Lifetime,
    }
}

fn pins(plan: &PinPlan) -> Vec<(usize, usize)> {
    plan.pins.iter().map(|p| (p.layer, p.expert)).collect()
}

fn history_text(engine: &str, records: &[(usize, usize, u32)]) -> String {
    let mut s = format!("-1 2 8\n-2 1 {}\n", EngineId::of(engine).0);
    for (l, e, c) in records {
        s.push_str(&format!("{l} {e} {c}\n"));
    }
    s
}

#[test]
fn pin_auto_prefers_the_history_and_falls_back_to_stats() {
    let d = tempfile::tempdir().expect("tempdir");
    let snap = d.path();
    let hist = snap.join(".coli_usage");
    let rt = RouteTrace::new(ENGINE, 2, 8).expect("shape");
    let auto = PinSetting::Auto;
    let req = request(&auto, snap, &hist);
    // Neither file: no pins.
    let plan = rt.plan_pins(&req, &|_| 1);
    assert!(plan.pins.is_empty() && plan.source.is_none());
    // An empty (zero-byte) history falls back to stats.txt.
    fs::write(&hist, "").expect("empty");
    fs::write(snap.join("stats.txt"), "1 4 9\n0 2 3\n").expect("stats");
    let plan = rt.plan_pins(&req, &|_| 1);
    assert_eq!(pins(&plan), vec![(1, 4), (0, 2)]);
    assert_eq!(plan.source, Some(PinSource::Auto(snap.join("stats.txt"))));
    // A non-empty history wins, ranked by count then layer then expert.
    fs::write(
        &hist,
        history_text(ENGINE, &[(0, 1, 5), (1, 0, 5), (0, 7, 8)]),
    )
    .expect("hist");
    let plan = rt.plan_pins(&req, &|_| 1);
    assert_eq!(pins(&plan), vec![(0, 7), (0, 1), (1, 0)]);
    // The byte budget takes a ranked prefix.
    let small = PinRequest {
        pin_gb: PinGb::Gb(2e-9),
        ..request(&auto, snap, &hist)
    };
    assert_eq!(pins(&rt.plan_pins(&small, &|_| 1)), vec![(0, 7), (0, 1)]);
    // PIN_N picks per layer instead, keeping eight adaptive slots.
    let per_layer = PinRequest {
        pin_n: Some(1),
        cap: 9,
        ..request(&auto, snap, &hist)
    };
    assert_eq!(
        pins(&rt.plan_pins(&per_layer, &|_| 1)),
        vec![(0, 7), (1, 0)]
    );
}

#[test]
fn pin_auto_refuses_a_foreign_history_but_a_named_path_is_honoured() {
    let d = tempfile::tempdir().expect("tempdir");
    let snap = d.path();
    let hist = snap.join(".coli_usage");
    fs::write(&hist, history_text("kimi_k3", &[(1, 3, 4)])).expect("hist");
    let rt = RouteTrace::new(ENGINE, 2, 8).expect("shape");
    let auto = PinSetting::Auto;
    assert!(rt
        .plan_pins(&request(&auto, snap, &hist), &|_| 1)
        .pins
        .is_empty());
    let named = PinSetting::Path(hist.clone());
    let plan = rt.plan_pins(&request(&named, snap, &hist), &|_| 1);
    assert_eq!(pins(&plan), vec![(1, 3)]);
    assert_eq!(plan.source, Some(PinSource::Named(hist.clone())));
    let off = PinSetting::Off;
    assert_eq!(
        rt.plan_pins(&request(&off, snap, &hist), &|_| 1).source,
        None
    );
}

#[test]
fn autopin_needs_five_thousand_selections_and_pin_unset() {
    let d = tempfile::tempdir().expect("tempdir");
    let hist = d.path().join(".coli_usage");
    let mut rt = RouteTrace::new(ENGINE, 2, 8).expect("shape");
    fs::write(
        &hist,
        history_text(ENGINE, &[(0, 1, 4000), (0, 2, 998), (1, 5, 1)]),
    )
    .expect("hist");
    rt.load_history(&hist, None);
    let unset = PinSetting::Unset;
    let req = PinRequest {
        cap: 64,
        ..request(&unset, d.path(), &hist)
    };
    assert!(
        rt.plan_pins(&req, &|_| 1).pins.is_empty(),
        "4999 selections"
    );

    rt.moe_call(1).route(0, &[6], &[1.0]);
    rt.save_history(&hist, SaveOptions::default())
        .expect("save");
    let mut rt = RouteTrace::new(ENGINE, 2, 8).expect("shape");
    assert_eq!(rt.load_history(&hist, None).total(), 5000);
    // confidence 0.025 -> quota floor(64 * 0.5 * 0.025) = 0: nothing yet.
    assert!(rt.plan_pins(&req, &|_| 1).pins.is_empty());
    let big = PinRequest {
        cap: 1000,
        ..req.clone()
    };
    // quota floor(1000 * 0.5 * 0.025) = 12 per layer: every expert with a count.
    let plan = rt.plan_pins(&big, &|_| 1);
    assert_eq!(pins(&plan), vec![(0, 1), (0, 2), (1, 5), (1, 6)]);
    assert_eq!(
        plan.line(0, 0.0).as_deref(),
        Some("[PIN] 4 experts pinned from history (5000 selections, 2% confidence)")
    );
    let no = PinRequest {
        autopin: false,
        ..big.clone()
    };
    assert!(rt.plan_pins(&no, &|_| 1).pins.is_empty());
}
