//! What needs more than one thread or process: concurrent saves lose no counts, a process
//! killed mid-save leaves a complete history, the override notice appears once per
//! process, and the exact stderr lines of a run.
//!
//! Child processes are this test binary re-run with `COLI_RT_CHILD=<role>` selecting
//! [`child_entry`], which does nothing in a normal run.

use crate::common;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

use coli::route_trace::history::{self, Trust};
use coli::route_trace::{
    Counters, EngineId, PinGb, PinRank, PinRequest, PinSetting, ReadOutcome, RouteTrace,
    SaveOptions, SaveOutcome,
};

const ENGINE: &str = "glm_moe_dsa";
const ROLE: &str = "COLI_RT_CHILD";
const PATH: &str = "COLI_RT_PATH";
const SAVES_PER_CHILD: usize = 40;

fn child(role: &str, path: &Path) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary"));
    c.args([
        &common::test_name(module_path!(), "child_entry"),
        "--exact",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(ROLE, role)
    .env(PATH, path)
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    c
}

fn run_child(role: &str, path: &Path) -> Output {
    let out = child(role, path).output().expect("spawn child");
    assert!(out.status.success(), "child {role} failed: {out:?}");
    out
}

fn route(rt: &mut RouteTrace, layer: usize, ids: &[usize]) {
    let gates = vec![0.5; ids.len()];
    rt.moe_call(layer).route(0, ids, &gates);
}

/// Reads a history that must be complete, returning its table.
fn read_complete(path: &Path) -> Counters {
    let mut t = Counters::new(5, 8).expect("shape");
    match history::read(path, ENGINE, Trust::Found, &mut t) {
        ReadOutcome::Read(r) => assert!(r.is_complete(), "{}: {r:?}", path.display()),
        other => panic!("{}: {other:?}", path.display()),
    }
    t
}

#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let path = PathBuf::from(std::env::var(PATH).expect("COLI_RT_PATH"));
    match role.as_str() {
        "saver" => {
            let mut rt = RouteTrace::new(ENGINE, 5, 8).expect("shape");
            for i in 0..SAVES_PER_CHILD {
                route(&mut rt, i % 6, &[i % 8, (i + 3) % 8, 7]);
                rt.save_history(&path, SaveOptions::default())
                    .expect("save");
            }
        }
        "saver-forever" => {
            let mut rt = RouteTrace::new(ENGINE, 5, 8).expect("shape");
            for i in 0.. {
                route(&mut rt, i % 6, &[i % 8]);
                rt.save_history(&path, SaveOptions::default())
                    .expect("save");
            }
        }
        "notice" => {
            let req = |pin: &'static PinSetting| PinRequest {
                pin,
                pin_n: None,
                pin_gb: PinGb::DEFAULT,
                ram_avail_bytes: 0,
                autopin: true,
                cap: 16,
                snap: Path::new("/nonexistent"),
                history: None,
                rank: PinRank::Lifetime,
            };
            let pin = Box::leak(Box::new(PinSetting::Path(path.clone())));
            let mut rt = RouteTrace::new(ENGINE, 5, 8).expect("shape");
            assert_eq!(rt.load_history(&path, None).total(), 0);
            for _ in 0..3 {
                let plan = rt.plan_pins(&req(pin), &|_| 1);
                assert_eq!(plan.pins.len(), 1);
            }
        }
        "lines" => {
            let dir = path;
            let hist = dir.join(".coli_usage");
            let mut rt = RouteTrace::new(ENGINE, 5, 8).expect("shape");
            rt.open_trace(&dir.join("trace.txt")).expect("trace");
            assert!(rt.open_trace(&dir.join("no/such/dir/trace")).is_err());
            rt.load_history(&hist, None);
            let pin = PinSetting::Auto;
            let req = PinRequest {
                pin: &pin,
                pin_n: None,
                pin_gb: PinGb::DEFAULT,
                ram_avail_bytes: 0,
                autopin: true,
                cap: 16,
                snap: &dir,
                history: Some(&hist),
                rank: PinRank::Lifetime,
            };
            let plan = rt.plan_pins(&req, &|_| 1_000_000);
            eprintln!("{}", plan.line(0, 0.0).expect("pinned"));
            route(&mut rt, 3, &[2, 5]);
            rt.save_history(&hist, SaveOptions::default())
                .expect("save");
            rt.flush_trace().expect("flush");
        }
        other => panic!("unknown child role {other}"),
    }
}

#[test]
fn two_processes_saving_together_lose_no_counts() {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join(".coli_usage");
    let kids: Vec<Child> = (0..2)
        .map(|_| child("saver", &p).spawn().expect("spawn"))
        .collect();
    for k in kids {
        let out = k.wait_with_output().expect("wait");
        assert!(out.status.success(), "{out:?}");
    }
    let t = read_complete(&p);
    assert_eq!(t.total(), (2 * SAVES_PER_CHILD * 3) as i64);
}

#[test]
fn two_threads_with_their_own_handles_lose_no_counts() {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join(".coli_usage");
    std::thread::scope(|s| {
        for t in 0..2 {
            let p = &p;
            s.spawn(move || {
                let mut rt = RouteTrace::new(ENGINE, 5, 8).expect("shape");
                for i in 0..SAVES_PER_CHILD {
                    route(&mut rt, (i + t) % 6, &[i % 8, 1]);
                    rt.save_history(p, SaveOptions::default()).expect("save");
                }
            });
        }
    });
    assert_eq!(read_complete(&p).total(), (2 * SAVES_PER_CHILD * 2) as i64);
}

#[test]
fn a_process_killed_mid_save_leaves_a_complete_history() {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join(".coli_usage");
    let mut last = 0;
    for round in 0..12u64 {
        let mut k = child("saver-forever", &p).spawn().expect("spawn");
        std::thread::sleep(Duration::from_millis(20 + round * 7));
        k.kill().expect("kill");
        k.wait().expect("reap");
        if !p.exists() {
            continue;
        }
        // Old or new, never torn: every save of the same history is a complete file whose
        // total only grows (each child adds its selections to what is there).
        let total = read_complete(&p).total();
        assert!(total >= last, "history went back from {last} to {total}");
        last = total;
    }
    assert!(last > 0, "no child completed a save");
    // The lock died with the killed process and a stale temp file does not matter.
    let mut rt = RouteTrace::new(ENGINE, 5, 8).expect("shape");
    route(&mut rt, 1, &[1]);
    let out = rt.save_history(&p, SaveOptions::default()).expect("save");
    assert!(
        matches!(out, SaveOutcome::Saved { total, diverted: None, .. } if total == last + 1),
        "{out:?}"
    );
}

#[test]
fn override_notice_is_printed_once_per_process() {
    let d = tempfile::tempdir().expect("tempdir");
    let p = d.path().join("kimi_usage");
    let kimi = EngineId::of("kimi_k3").0;
    fs::write(&p, format!("-1 5 8\n-2 1 {kimi}\n3 2 6\n")).expect("seed");
    let out = run_child("notice", &p);
    let err = String::from_utf8(out.stderr).expect("utf8");
    let ps = p.display();
    let notice = format!(
        "[USAGE] {ps}: written by kimi_k3, this engine is glm_moe_dsa\n        \u{2014} honouring it because you named it explicitly\n          (placement only; expert ids do not transfer between engines)\n"
    );
    let refusal = format!(
        "[USAGE] {ps}: written by kimi_k3, this engine is glm_moe_dsa \u{2014} refusing (pass PIN=<path> to use it anyway)\n"
    );
    assert_eq!(err.matches(&notice).count(), 1, "{err}");
    assert_eq!(err.matches(&refusal).count(), 1, "{err}");
    assert_eq!(err.matches("[USAGE]").count(), 2, "{err}");
}

#[test]
fn stderr_lines_of_a_run() {
    let d = tempfile::tempdir().expect("tempdir");
    let dir = d.path();
    let glm = EngineId::of(ENGINE).0;
    fs::write(
        dir.join(".coli_usage"),
        format!("-1 5 8\n-2 1 {glm}\n3 2 2\n3 5 1\n3 7 1\n"),
    )
    .expect("seed");
    let out = run_child("lines", dir);
    let err = String::from_utf8(out.stderr).expect("utf8");
    let ds = dir.display();
    let expected = format!(
        "[ROUTE_TRACE] logging routing to {ds}/trace.txt\n\
         [ROUTE_TRACE] cannot open {ds}/no/such/dir/trace\n\
         [USAGE] expert history: 4 selections ({ds}/.coli_usage)\n\
         [PIN] auto: seeding from {ds}/.coli_usage\n\
         [PIN] placement: 0 VRAM + 3 RAM expert (0.0 GB warm) in 0s da {ds}/.coli_usage\n\
         [STATS] 6 selections across 3 distinct experts -> {ds}/.coli_usage\n"
    );
    let ours: String = err
        .lines()
        .filter(|l| l.starts_with('['))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_eq!(ours, expected);
    assert_eq!(
        fs::read_to_string(dir.join("trace.txt")).expect("trace"),
        "0 0 3 2:0.5000 5:0.5000\n"
    );
}
