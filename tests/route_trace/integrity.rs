//! What a run and the offline tools must never do to the files around them: overwrite
//! another engine's history or records this engine cannot hold, replace a file that is
//! not theirs, write through a planted or followed symlink to the wrong file, drop a
//! history's mode or owner, hang on a FIFO, crash on a crafted history, lose counts to a
//! concurrent merge, or skip the other outputs when a save fails.
//!
//! Every binary run goes through [`run`] / [`try_run`], which kill the child after
//! [`LIMIT`] so that a regression that blocks fails instead of hanging the suite.

use crate::common;

use std::ffi::CString;
use std::fs;
use std::io::Read as _;
use std::os::unix::ffi::OsStrExt as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use coli::route_trace::history::{self, Trust};
use coli::route_trace::save::render;
use coli::route_trace::{Counters, EngineId, ReadReport};

use common::{coli_command, copy_fixture, fixture, read_json, stderr, stdout};

const PROMPT: &str = "IDS=3 11 29 7 41 19";
const OLMOE_ID: u32 = 3841822045;
const GLM_ID: u32 = 3815245270;
/// How long any one binary run may take before it is killed and the test fails.
const LIMIT: Duration = Duration::from_secs(20);
/// What "promptly" means for a refusal that must not wait on anything.
const PROMPT_LIMIT: Duration = Duration::from_secs(10);

/// Runs `command` to the end, or kills it after [`LIMIT`] and says so (with the stderr it
/// had written). Returns the output and how long it ran.
fn try_run(mut command: Command, what: &str) -> Result<(Output, Duration), String> {
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let started = Instant::now();
    let mut child = command.spawn().expect("the coli binary starts");
    let drain = |pipe: Option<Box<dyn std::io::Read + Send>>| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let out_reader = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let err_reader = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for coli") {
            break Some(status);
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(5));
    };
    let elapsed = started.elapsed();
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    match status {
        Some(status) => Ok((
            Output {
                status,
                stdout,
                stderr,
            },
            elapsed,
        )),
        None => Err(format!(
            "{what}: still running after {LIMIT:?}, killed; stderr so far: {}",
            String::from_utf8_lossy(&stderr)
        )),
    }
}

/// [`try_run`] of `coli args` that fails the test if the run had to be killed.
fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    match try_run(coli_command(args, env), &format!("coli {args:?}")) {
        Ok((out, _)) => out,
        Err(e) => panic!("{e}"),
    }
}

fn snap(dir: &Path) -> String {
    format!("SNAP={}", dir.display())
}

/// A generating run of `NGEN` tokens on `dir` with extra settings.
fn generate(dir: &Path, ngen: u32, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let snap = snap(dir);
    let ngen = format!("NGEN={ngen}");
    let mut args = vec![snap.as_str(), PROMPT, ngen.as_str()];
    args.extend_from_slice(extra);
    args.extend(["64", "16", "16"]);
    run(&args, env)
}

/// The total of the `[STATS] N selections across ... -> <path>` line for `path`.
fn stats_to(err: &str, path: &Path) -> Option<i64> {
    let tail = format!("-> {}", path.display());
    err.lines()
        .filter(|l| l.starts_with("[STATS] ") && l.ends_with(&tail))
        .find_map(|l| l.split(' ').nth(1)?.parse().ok())
}

/// A zeroed table of `olmoe_tiny`'s shape, read from the fixture's config.json.
fn olmoe_table() -> Counters {
    let config = read_json(&fixture("olmoe_tiny").join("config.json"));
    let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
    let experts = config["num_experts"].as_u64().unwrap() as usize;
    Counters::new(layers, experts).unwrap()
}

/// Parses `path` as an olmoe history found by the engine; panics on a refusal.
fn read_olmoe(path: &Path) -> ReadReport {
    let bytes = fs::read(path).unwrap();
    let mut table = olmoe_table();
    history::parse(&bytes, "olmoe", Trust::Found, &mut table)
        .unwrap_or_else(|r| panic!("{}: refused: {r:?}", path.display()))
}

/// An olmoe history of `olmoe_tiny`'s shape holding `cells` (layer, expert, count).
fn olmoe_history(cells: &[(i64, i64, u32)]) -> String {
    assert_eq!(EngineId::of("olmoe"), EngineId(OLMOE_ID));
    let mut table = olmoe_table();
    for &(l, e, c) in cells {
        assert!(table.admit(l, e, c));
    }
    render(&table, EngineId::of("olmoe"))
}

fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
}

/// A small trace of `olmoe_tiny`'s shape: single-row decode calls, top-2.
fn small_trace() -> String {
    let mut text = String::new();
    for call in 0..12u32 {
        let layer = call % 3;
        let (a, b) = (call % 8, (call * 3 + 1) % 8);
        text.push_str(&format!("{call} 0 {layer} {a}:0.5000 {b}:0.5000\n"));
    }
    text
}

/// A history in a shared directory written by another engine (`glm_moe_dsa`, of
/// olmoe_tiny's shape or not) is never touched: an olmoe run saves to
/// `<path>.olmoe`, the next run loads that file back and keeps adding to it, and each run
/// says once which file it read and which it saves to.
#[test]
fn another_engines_history_is_left_alone_and_ours_keeps_learning_beside_it() {
    assert_eq!(EngineId::of("glm_moe_dsa"), EngineId(GLM_ID));
    for shape in ["-1 3 8", "-1 5 8"] {
        let dir = copy_fixture("olmoe_tiny");
        let history = dir.path().join(".coli_usage");
        let own = dir.path().join(".coli_usage.olmoe");
        let foreign = format!("{shape}\n-2 1 {GLM_ID}\n0 1 5\n2 7 9\n3 2 4\n");
        fs::write(&history, &foreign).unwrap();
        let saved_line = format!("saved to {}", own.display());
        let history_lines = |err: &str| -> Vec<String> {
            err.lines()
                .filter(|l| l.starts_with("[USAGE] history: read "))
                .map(str::to_string)
                .collect()
        };

        let first = generate(dir.path(), 4, &[], &[]);
        let err = stderr(&first);
        assert!(first.status.success(), "{shape}: {err}");
        assert_eq!(fs::read_to_string(&history).unwrap(), foreign, "{shape}");
        let n1 = stats_to(&err, &own).unwrap_or_else(|| panic!("{shape}: no [STATS]: {err}"));
        assert!(n1 > 0, "{shape}: {err}");
        let lines = history_lines(&err);
        assert_eq!(lines.len(), 1, "{shape}: {err}");
        assert!(lines[0].ends_with(&saved_line), "{shape}: {err}");

        let second = generate(dir.path(), 4, &[], &[]);
        let err = stderr(&second);
        assert!(second.status.success(), "{shape}: {err}");
        assert!(
            err.contains(&format!(
                "[USAGE] expert history: {n1} selections ({})",
                own.display()
            )),
            "{shape}: the second run does not load {}: {err}",
            own.display()
        );
        let n2 = stats_to(&err, &own).unwrap_or_else(|| panic!("{shape}: no [STATS]: {err}"));
        assert!(n2 > n1, "{shape}: {n2} after {n1}: {err}");
        let lines = history_lines(&err);
        assert_eq!(lines.len(), 1, "{shape}: {err}");
        assert!(lines[0].ends_with(&saved_line), "{shape}: {err}");
        assert_eq!(fs::read_to_string(&history).unwrap(), foreign, "{shape}");
        let report = read_olmoe(&own);
        assert!(report.is_complete(), "{shape}: {report:?}");
        assert_eq!(report.total, n2, "{shape}");
    }
}

/// A rewrite of this engine's history keeps, verbatim, every record the engine cannot
/// hold (unknown negative records, an expert id out of range, an out-of-range count), and
/// still adds this run's counts to the file itself rather than beside it.
#[test]
fn records_this_engine_cannot_hold_survive_rewrites_verbatim() {
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    // (`-5` is the recent-heat record and `-3`/`-4` the transitions this build reads;
    // `-6` and below are unknown.)
    let kept = ["-6 9 9", "1 999 5", "0 1 -5"];
    let mut text = format!("-1 3 8\n-2 1 {OLMOE_ID}\n0 1 5\n");
    for line in kept {
        text.push_str(line);
        text.push('\n');
    }
    fs::write(&history, &text).unwrap();

    let mut totals = Vec::new();
    for _ in 0..2 {
        let out = generate(dir.path(), 4, &[], &[]);
        let err = stderr(&out);
        assert!(out.status.success(), "{err}");
        totals.push(stats_to(&err, &history).unwrap_or_else(|| panic!("no [STATS]: {err}")));
    }
    assert!(totals[0] > 5, "{totals:?}");
    assert!(totals[1] > totals[0], "{totals:?}");
    let after = fs::read_to_string(&history).unwrap();
    assert_ne!(after, text, "the history was not rewritten");
    for line in kept {
        assert_eq!(
            after.lines().filter(|l| *l == line).count(),
            1,
            "`{line}` is not in the rewritten history exactly once:\n{after}"
        );
    }
    assert!(!dir.path().join(".coli_usage.olmoe").exists());
    let report = read_olmoe(&history);
    assert_eq!(report.total, totals[1]);
}

/// `ROUTE_TRACE` and `STATS` never replace a file that is not theirs (the history, the
/// weights, the config, someone's notes): the run exits 2 naming the path and the file is
/// unchanged. A previous trace or stats dump is replaced.
#[test]
fn route_trace_and_stats_replace_only_their_own_files() {
    let dir = copy_fixture("olmoe_tiny");
    let other = tempfile::tempdir().unwrap();
    let history = dir.path().join(".coli_usage");
    fs::write(&history, olmoe_history(&[(0, 1, 5), (2, 3, 7)])).unwrap();
    let weights = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .expect("the fixture has a .safetensors file");
    let config = dir.path().join("config.json");
    let notes = other.path().join("notes.txt");
    fs::write(&notes, "my notes\n").unwrap();

    for (key, victim) in [
        ("ROUTE_TRACE", &history),
        ("ROUTE_TRACE", &weights),
        ("STATS", &config),
        ("ROUTE_TRACE", &notes),
    ] {
        let before = fs::read(victim).unwrap();
        let setting = format!("{key}={}", victim.display());
        let out = generate(dir.path(), 4, &[&setting], &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{setting}: {err}");
        assert!(
            err.contains(&victim.display().to_string()),
            "{setting}: the refusal does not name the path: {err}"
        );
        assert!(fs::read(victim).unwrap() == before, "{setting} changed it");
    }

    // A trace from a previous run is replaced: 6 prompt rows + NGEN-1 decoded rows, 3 layers.
    let trace = other.path().join("trace.txt");
    let setting = format!("ROUTE_TRACE={}", trace.display());
    let out = generate(dir.path(), 4, &[&setting], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(fs::read_to_string(&trace).unwrap().lines().count(), 9 * 3);
    let out = generate(dir.path(), 2, &[&setting], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(fs::read_to_string(&trace).unwrap().lines().count(), 7 * 3);

    // A previous stats dump is replaced with this run's counts.
    let stats = other.path().join("stats.txt");
    let setting = format!("STATS={}", stats.display());
    let out = generate(dir.path(), 4, &[&setting], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let first = fs::read(&stats).unwrap();
    let out = generate(dir.path(), 2, &[&setting], &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_ne!(
        fs::read(&stats).unwrap(),
        first,
        "the stats dump was not replaced"
    );
    let total = stats_to(&err, &stats).unwrap_or_else(|| panic!("no [STATS]: {err}"));
    assert_eq!(read_olmoe(&stats).total, total);
}

/// A symlinked history is saved through the link: the link stays a link and its target
/// holds the grown history.
#[test]
fn a_symlinked_history_is_saved_through_the_link() {
    let dir = copy_fixture("olmoe_tiny");
    let other = tempfile::tempdir().unwrap();
    let target = other.path().join("shared.coli_usage");
    fs::write(&target, olmoe_history(&[(0, 1, 5), (1, 4, 3)])).unwrap();
    let link = dir.path().join(".coli_usage");
    std::os::unix::fs::symlink(&target, &link).unwrap();

    let out = generate(dir.path(), 4, &[], &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let meta = fs::symlink_metadata(&link).unwrap();
    assert!(
        meta.file_type().is_symlink(),
        "the link was replaced: {err}"
    );
    assert_eq!(fs::read_link(&link).unwrap(), target);
    let report = read_olmoe(&target);
    assert!(
        report.total > 8,
        "the target did not grow: {report:?}; {err}"
    );
    assert!(!dir.path().join(".coli_usage.olmoe").exists());
}

/// This engine's history beside another's (`.coli_usage.olmoe`), when it is a link into
/// the snapshot's weights, is refused before the model loads (exit 2, naming the link and
/// its target), before any line says where the counts will be saved; the weights are
/// unchanged.
#[test]
fn a_history_linked_to_the_weights_is_refused_before_the_run() {
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    fs::write(&history, format!("-1 3 8\n-2 1 {GLM_ID}\n0 1 5\n")).unwrap();
    let weights = dir.path().join("model.safetensors");
    let before = fs::read(&weights).unwrap();
    let link = dir.path().join(".coli_usage.olmoe");
    std::os::unix::fs::symlink(&weights, &link).unwrap();

    let out = generate(dir.path(), 4, &[], &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&link.display().to_string()) && err.contains("model.safetensors"),
        "the refusal does not name the link and its target: {err}"
    );
    assert!(!err.contains("[USAGE] history:"), "{err}");
    assert!(fs::read(&weights).unwrap() == before, "{err}");
}

/// A saved history keeps its mode and its owner.
#[test]
fn a_saved_history_keeps_its_mode_and_owner() {
    // Giving a file to another user needs root; the suite runs as root here and in CI.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return;
    }
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    fs::write(&history, olmoe_history(&[(0, 1, 5)])).unwrap();
    fs::set_permissions(&history, fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::chown(&history, Some(1234), Some(1234)).unwrap();

    let out = generate(dir.path(), 4, &[], &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(read_olmoe(&history).total > 5, "not saved: {err}");
    let meta = fs::metadata(&history).unwrap();
    assert_eq!(meta.mode() & 0o7777, 0o600);
    assert_eq!((meta.uid(), meta.gid()), (1234, 1234));
}

/// A symlink planted at `<history>.tmp` is not written through: the file it points at is
/// unchanged and the history is saved, both when the save creates it and when it
/// rewrites it.
#[test]
fn a_planted_temp_symlink_is_not_written_through() {
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    let tmp = dir.path().join(".coli_usage.tmp");
    let config = dir.path().join("config.json");
    let before = fs::read(&config).unwrap();
    let mut last = 0;
    for round in 0..2 {
        if fs::symlink_metadata(&tmp).is_ok() {
            fs::remove_file(&tmp).unwrap();
        }
        std::os::unix::fs::symlink(&config, &tmp).unwrap();
        let out = generate(dir.path(), 4, &[], &[]);
        let err = stderr(&out);
        assert!(out.status.success(), "round {round}: {err}");
        assert!(fs::read(&config).unwrap() == before, "round {round}: {err}");
        let total = read_olmoe(&history).total;
        assert!(total > last, "round {round}: not saved: {err}");
        last = total;
    }
}

/// A FIFO named as the history, found as the history, named as `PIN`, or handed to the
/// offline tools is refused at once (exit 2), never waited on.
#[test]
fn fifos_are_refused_without_hanging() {
    let dir = copy_fixture("olmoe_tiny");
    let fresh = copy_fixture("olmoe_tiny");
    let other = tempfile::tempdir().unwrap();
    let fifo = other.path().join("fifo");
    mkfifo(&fifo);
    let found = dir.path().join(".coli_usage");
    mkfifo(&found);
    let trace = other.path().join("trace.txt");
    fs::write(&trace, small_trace()).unwrap();
    let history = other.path().join("h.coli_usage");
    fs::write(&history, olmoe_history(&[(0, 1, 5)])).unwrap();

    let text = |p: &Path| p.display().to_string();
    let (f, t, h) = (text(&fifo), text(&trace), text(&history));
    let png = text(&other.path().join("x.png"));
    let merged = text(&other.path().join("m.coli_usage"));
    let run_on = |d: &Path, extra: &[&str]| -> Vec<String> {
        let mut args = vec![snap(d), PROMPT.to_string(), "NGEN=4".to_string()];
        args.extend(extra.iter().map(|s| s.to_string()));
        args.extend(["64", "16", "16"].map(String::from));
        args
    };
    let tool = |args: &[&str]| -> Vec<String> { args.iter().map(|s| s.to_string()).collect() };
    let cases = vec![
        FifoCase {
            what: "COLI_USAGE=<fifo>",
            args: run_on(fresh.path(), &[]),
            env: vec![("COLI_USAGE", f.clone())],
            names: Some(f.clone()),
        },
        FifoCase {
            what: "SNAP/.coli_usage is a FIFO",
            args: run_on(dir.path(), &[]),
            env: vec![],
            names: Some(text(&found)),
        },
        FifoCase {
            what: "PIN=<fifo>",
            args: run_on(fresh.path(), &[&format!("PIN={f}")]),
            env: vec![],
            names: Some(f.clone()),
        },
        FifoCase::tool("usage show <fifo>", tool(&["usage", "show", &f])),
        FifoCase::tool("trace stats <fifo>", tool(&["trace", "stats", &f])),
        FifoCase::tool(
            "trace simulate <trace> --history <fifo>",
            tool(&["trace", "simulate", &t, "--history", &f]),
        ),
        FifoCase::tool("trace simulate <fifo>", tool(&["trace", "simulate", &f])),
        FifoCase::tool(
            "trace plot <fifo>",
            tool(&["trace", "plot", &f, "-o", &png]),
        ),
        FifoCase::tool(
            "usage merge <fifo> <history>",
            tool(&["usage", "merge", &f, &h, "-o", &merged]),
        ),
    ];
    // All at once: a case that hangs costs LIMIT once, not once per case.
    let handles: Vec<_> = cases
        .into_iter()
        .map(|case| thread::spawn(move || case.check()))
        .collect();
    let failures: Vec<String> = handles
        .into_iter()
        .filter_map(|h| h.join().unwrap())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One FIFO case: a run that must exit 2 within [`PROMPT_LIMIT`], its stderr naming
/// `names` when given.
struct FifoCase {
    what: &'static str,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    names: Option<String>,
}

impl FifoCase {
    fn tool(what: &'static str, args: Vec<String>) -> FifoCase {
        FifoCase {
            what,
            args,
            env: Vec::new(),
            names: None,
        }
    }

    /// What went wrong, or `None`.
    fn check(&self) -> Option<String> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let env: Vec<(&str, &str)> = self.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let what = self.what;
        let (out, took) = match try_run(coli_command(&args, &env), what) {
            Ok(done) => done,
            Err(e) => return Some(e),
        };
        let err = stderr(&out);
        if out.status.code() != Some(2) {
            return Some(format!("{what}: {}, not exit 2: {err}", out.status));
        }
        if took > PROMPT_LIMIT {
            return Some(format!("{what}: took {took:?}"));
        }
        let unnamed = self.names.as_ref().filter(|n| !err.contains(n.as_str()));
        unnamed.map(|n| format!("{what}: stderr does not name {n}: {err}"))
    }
}

/// Crafted histories (huge ids, huge declared shapes, records outside the shape) do not
/// crash or exhaust the offline tools under a 2 GB address-space limit: every run exits 0
/// or 2, with no panic and no failed allocation.
#[test]
fn crafted_histories_do_not_crash_the_tools() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let trace = d.join("T");
    fs::write(&trace, small_trace()).unwrap();
    let small = d.join("F2");
    fs::write(&small, olmoe_history(&[(0, 1, 5), (1, 2, 3)])).unwrap();
    let crafted = [
        "999999 999999 1\n",
        "2000000000 2000000000 1\n",
        "-1 2000000000 2000000000\n",
        "-1 100000 100000\n",
        "-1 1000 1000\n-2 1 3841822045\n5 999 3\n",
    ];
    let mut failures = Vec::new();
    for (i, content) in crafted.iter().enumerate() {
        let f = d.join(format!("F{i}"));
        fs::write(&f, content).unwrap();
        let (f, f2, t) = (
            f.display().to_string(),
            small.display().to_string(),
            trace.display().to_string(),
        );
        let out = d.join(format!("OUT{i}")).display().to_string();
        let forced = d.join(format!("OUTF{i}")).display().to_string();
        let png = d.join(format!("OUT{i}.png")).display().to_string();
        let commands: [Vec<&str>; 5] = [
            vec!["usage", "show", &f],
            vec!["usage", "merge", &f, &f2, "-o", &out],
            vec!["usage", "merge", &f, &f2, "-o", &forced, "--force"],
            vec!["trace", "plot", &f, "-o", &png],
            vec!["trace", "simulate", &t, "--history", &f],
        ];
        for args in commands {
            let mut command = Command::new("sh");
            command
                .args(["-c", "ulimit -v 2000000; exec \"$0\" \"$@\""])
                .arg(env!("CARGO_BIN_EXE_coli"))
                .args(&args);
            for key in coli::settings::KEYS {
                command.env_remove(key.name);
            }
            let what = format!("{content:?}: coli {}", args.join(" "));
            match try_run(command, &what) {
                Err(e) => failures.push(e),
                Ok((output, _)) => {
                    let err = stderr(&output);
                    if !matches!(output.status.code(), Some(0 | 2))
                        || err.contains("panicked")
                        || err.contains("memory allocation")
                    {
                        failures.push(format!("{what}: {:?}: {err}", output.status));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `coli usage merge` never replaces an input without `--force`, never merges a file
/// with itself, never replaces a non-history even with `--force`; and merges into a
/// history that generating runs are saving to at the same time lose no count.
#[test]
fn merges_are_safe_and_lose_nothing_to_concurrent_saves() {
    let dir = copy_fixture("olmoe_tiny");
    let other = tempfile::tempdir().unwrap();
    let a = other.path().join("a.coli_usage");
    let b = other.path().join("b.coli_usage");
    let a_text = olmoe_history(&[(0, 1, 5), (1, 2, 3)]);
    fs::write(&a, &a_text).unwrap();
    fs::write(&b, olmoe_history(&[(0, 2, 10)])).unwrap();
    let (a_s, b_s) = (a.display().to_string(), b.display().to_string());

    let out = run(&["usage", "merge", &a_s, &b_s, "-o", &a_s], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert_eq!(fs::read_to_string(&a).unwrap(), a_text);

    let same = other.path().join("out.coli_usage");
    let out = run(
        &[
            "usage",
            "merge",
            &a_s,
            &a_s,
            "-o",
            &same.display().to_string(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("same file"), "{}", stderr(&out));
    assert!(!same.exists());

    let config = dir.path().join("config.json");
    let before = fs::read(&config).unwrap();
    let out = run(
        &[
            "usage",
            "merge",
            &a_s,
            &b_s,
            "-o",
            &config.display().to_string(),
            "--force",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(fs::read(&config).unwrap() == before);

    // What one generating run adds, measured alone on a fresh copy.
    let solo = copy_fixture("olmoe_tiny");
    let out = generate(solo.path(), 4, &[], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let gain = stats_to(&stderr(&out), &solo.path().join(".coli_usage")).expect("[STATS]");
    assert!(gain > 0);

    // Four generating runs at once on one history that starts with 10 selections, while
    // four threads merge `extra` (10 selections) into it again and again until the runs
    // are done (at least once each, at most MERGES_PER_THREAD), so that merges land inside
    // the runs' load-to-save windows.
    const MERGES_PER_THREAD: usize = 25;
    let history = dir.path().join(".coli_usage");
    let extra = other.path().join("extra.coli_usage");
    let extra_text = olmoe_history(&[(0, 1, 4), (1, 2, 3), (2, 3, 3)]);
    fs::write(&extra, &extra_text).unwrap();
    fs::write(&history, &extra_text).unwrap();
    let running = Arc::new(AtomicUsize::new(4));
    let mut runs = Vec::new();
    let mut mergers = Vec::new();
    for _ in 0..4 {
        let (snap_dir, left) = (dir.path().to_path_buf(), Arc::clone(&running));
        runs.push(thread::spawn(move || {
            let out = generate(&snap_dir, 4, &[], &[]);
            left.fetch_sub(1, Ordering::SeqCst);
            out
        }));
        let (h, e, left) = (
            history.display().to_string(),
            extra.display().to_string(),
            Arc::clone(&running),
        );
        mergers.push(thread::spawn(move || {
            let mut outs = Vec::new();
            while outs.is_empty()
                || (left.load(Ordering::SeqCst) > 0 && outs.len() < MERGES_PER_THREAD)
            {
                outs.push(run(&["usage", "merge", &h, &e, "-o", &h, "--force"], &[]));
            }
            outs
        }));
    }
    for handle in runs {
        let out = handle.join().unwrap();
        assert!(out.status.success(), "generate: {}", stderr(&out));
    }
    let mut merges = 0;
    for handle in mergers {
        for out in handle.join().unwrap() {
            assert!(out.status.success(), "merge: {}", stderr(&out));
            merges += 1;
        }
    }
    let report = read_olmoe(&history);
    assert!(report.is_complete(), "{report:?}");
    assert_eq!(
        report.total,
        10 + 4 * gain + 10 * merges,
        "4 runs of {gain} and {merges} merges of 10: {report:?}"
    );
}

/// A save that fails (the history's directory does not exist) does not skip the other
/// outputs: the tokens are printed, `STATS` and the trace are written, the failure is said
/// naming the path, and the exit status is 1.
#[test]
fn a_failed_save_still_writes_stats_and_the_trace() {
    let dir = copy_fixture("olmoe_tiny");
    let other = tempfile::tempdir().unwrap();
    let missing = other.path().join("no/such/dir/h");
    let stats = other.path().join("stats.txt");
    let trace = other.path().join("t.txt");
    let (st, tr) = (
        format!("STATS={}", stats.display()),
        format!("ROUTE_TRACE={}", trace.display()),
    );
    let out = generate(
        dir.path(),
        4,
        &[&st, &tr],
        &[("COLI_USAGE", missing.to_str().unwrap())],
    );
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{text}{err}");
    let tokens = text
        .lines()
        .find(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_digit() || c == ' '));
    assert!(tokens.is_some(), "no tokens printed: {text}");
    let failed = err
        .lines()
        .find(|l| l.starts_with("[USAGE] save failed:"))
        .unwrap_or_else(|| panic!("no save failure line: {err}"));
    assert!(
        failed.contains(&missing.display().to_string()),
        "the failure does not name the path: {failed}"
    );
    let total = stats_to(&err, &stats).unwrap_or_else(|| panic!("no [STATS] for stats: {err}"));
    // 6 prompt rows + 3 decoded tokens, 3 layers, top-2.
    assert_eq!(total, 9 * 3 * 2);
    assert_eq!(read_olmoe(&stats).total, total);
    assert!(fs::metadata(&trace).unwrap().len() > 0);
}

/// A trace the disk refuses (`/dev/full` fails every write with "no space left") makes the
/// run exit 1, as a failed save does, saying how many trace lines were lost; the history is
/// still saved and the tokens printed.
#[test]
fn a_trace_that_cannot_be_written_fails_the_run_and_says_what_was_lost() {
    let full = Path::new("/dev/full");
    if !full.exists() {
        eprintln!("skipped: this system has no /dev/full to refuse the trace's writes");
        return;
    }
    let dir = copy_fixture("olmoe_tiny");
    let out = generate(dir.path(), 4, &["ROUTE_TRACE=/dev/full"], &[]);
    let (text, err) = (stdout(&out), stderr(&out));
    assert_eq!(out.status.code(), Some(1), "{text}{err}");
    let failed = err
        .lines()
        .find(|l| l.starts_with("[ROUTE_TRACE] write failed: /dev/full: "))
        .unwrap_or_else(|| panic!("no trace failure line: {err}"));
    // 6 prompt rows + 3 decoded tokens, 3 layers: every line lost.
    assert!(
        failed.ends_with("0 trace lines reached the file, 27 were lost"),
        "{failed}"
    );
    assert!(
        read_olmoe(&dir.path().join(".coli_usage")).total > 0,
        "{err}"
    );
    assert!(
        text.lines()
            .any(|l| !l.is_empty() && l.chars().all(|c| c.is_ascii_digit() || c == ' ')),
        "no tokens printed: {text}"
    );
}

/// A history that arrived with records on rows the model does not route (a dense layer,
/// an MTP row it has no head for) is saved without them: the classic C reader's total of
/// the saved file is the `[STATS]` total, on every engine with dense layers.
#[test]
fn records_on_rows_that_do_not_route_are_not_written_back() {
    let bin = crate::support::c_program("old_reader");
    for (fixture_name, engine) in [
        ("glm_moe_dsa_tiny", "glm_moe_dsa"),
        ("inkling_tiny", "inkling"),
    ] {
        let dir = copy_fixture(fixture_name);
        let config = read_json(&dir.path().join("config.json"));
        let layers = config["num_hidden_layers"].as_u64().unwrap() as usize;
        let experts = config["n_routed_experts"].as_u64().unwrap() as usize;
        let id = EngineId::of(engine).0;
        let history = dir.path().join(".coli_usage");
        // Layer 0 is dense on both; row `layers` is an MTP head neither fixture has.
        let seeded = format!("-1 {layers} {experts}\n-2 1 {id}\n0 1 50\n{layers} 2 70\n1 3 4\n");
        fs::write(&history, &seeded).unwrap();
        let out = generate(dir.path(), 4, &[], &[]);
        let err = stderr(&out);
        assert!(out.status.success(), "{engine}: {err}");
        assert!(
            err.contains("2 records name rows this model does not route"),
            "{engine}: {err}"
        );
        let saved = stats_to(&err, &history).unwrap_or_else(|| panic!("{engine}: {err}"));
        let bytes = fs::read(&history).unwrap();
        let old = crate::support::old_read(&bin, dir.path(), &bytes, layers, experts);
        assert_eq!(
            old.total,
            saved,
            "{engine}: {}",
            String::from_utf8_lossy(&bytes)
        );
        let text = String::from_utf8(bytes).unwrap();
        assert!(
            !text.contains("\n0 1 50\n") && !text.contains(&format!("\n{layers} 2 70\n")),
            "{engine}: {text}"
        );
    }
}
