//! Experts over MPI (`cargo test --features mpi --test mpi`, with Open MPI's `mpirun`):
//! every fixture under `mpirun -np 2` and `-np 3` gives the single process's results, bit
//! for bit (the perplexity to six digits, the teacher-forced and greedy oracle, the generated
//! ids), and writes the same `.coli_usage` bytes; only rank 0 writes.

#![cfg(feature = "mpi")]

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{coli, copy_fixture, fixture, stderr, stdout};

const FIXTURES: &[&str] = &[
    "olmoe_tiny",
    "olmoe_tiny_b",
    "olmoe_trained",
    "inkling_tiny",
    "inkling_tiny_b",
    "kimi_k3_tiny",
    "kimi_k3_tiny_b",
    "glm_moe_dsa_tiny",
    "glm_moe_dsa_tiny_b",
    "glm_moe_dsa_tiny_mtp",
];

/// `coli args` under `mpirun -np ranks` on this machine, with none of the settings'
/// variables inherited from the caller.
fn mpirun(ranks: usize, args: &[&str]) -> Output {
    mpirun_command(ranks, args)
        .output()
        .expect("mpirun runs (install openmpi-bin)")
}

/// [`coli`] and [`mpirun`] over an owned argument list.
fn coli_with(args: &[String]) -> Output {
    coli(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[])
}

fn mpirun_with(ranks: usize, args: &[String]) -> Output {
    mpirun(ranks, &args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn mpirun_command(ranks: usize, args: &[&str]) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(["--oversubscribe", "-np", &ranks.to_string()])
        .arg(env!("CARGO_BIN_EXE_coli"))
        .args(args)
        // The suite runs as root in CI; Open MPI refuses that unless told twice.
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        // Containers often forbid the cross-memory attach of Open MPI's shared-memory
        // transport; plain copies work everywhere.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    for key in coli::settings::KEYS {
        command.env_remove(key.name);
    }
    command
}

/// stdout without what depends on time.
fn untimed(out: &Output) -> Vec<String> {
    stdout(out)
        .lines()
        .filter(|line| {
            !(line.starts_with("loaded in")
                || line.starts_with("Expert cache hit rate")
                || line.starts_with("PROFILE:"))
        })
        .map(|line| match line.find(" | ") {
            // The oracle's and the perplexity's lines end in a rate.
            Some(at) if line.starts_with("PREFILL") || line.starts_with("Matching") => {
                line[..at].to_string()
            }
            _ if line.starts_with("PPL:") => {
                line.split(" | ").take(2).collect::<Vec<_>>().join(" | ")
            }
            _ => line.to_string(),
        })
        .collect()
}

fn succeeded(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what}: {}{}",
        stdout(out),
        stderr(out)
    );
}

#[test]
fn every_fixture_gives_the_single_process_results() {
    for name in FIXTURES {
        let snap = format!("SNAP={}", fixture(name).display());
        for mode in [
            &["PPL=1", "CTX=64"][..],
            &["TF=1", "ORACLE_STRICT=1"],
            &["ORACLE_STRICT=1"],
        ] {
            let mut args = vec![snap.as_str()];
            args.extend(mode);
            args.extend(["2", "16", "16"]);
            let single = coli(&args, &[]);
            succeeded(&single, &format!("{name} {mode:?}"));
            for ranks in [2, 3] {
                let spread = mpirun(ranks, &args);
                succeeded(&spread, &format!("{name} {mode:?} -np {ranks}"));
                assert_eq!(
                    untimed(&spread),
                    untimed(&single),
                    "{name} {mode:?} -np {ranks}"
                );
                // The ranks' stderr interleaves; rank 0's stdout is its own. A perplexity
                // run's PROFILE line shows the exchanges with the expert ranks.
                if mode[0] == "PPL=1" {
                    assert!(
                        stdout(&spread).contains("| mpi "),
                        "{name} -np {ranks}: {}",
                        stdout(&spread)
                    );
                }
            }
        }
    }
}

/// The ids an `IDS=` run generated (the all-number line of its stdout).
fn generated(out: &Output) -> String {
    stdout(out)
        .lines()
        .find(|line| {
            !line.is_empty() && line.split_whitespace().all(|id| id.parse::<u32>().is_ok())
        })
        .unwrap_or_default()
        .to_string()
}

fn history(dir: &Path) -> Vec<u8> {
    std::fs::read(dir.join(".coli_usage")).expect("a history was saved")
}

#[test]
fn generation_writes_the_same_history_from_rank_0_alone() {
    for name in FIXTURES {
        let ids = "IDS=3 11 29 7";
        for sharding in ["EXPERT_SHARDING=expert", "EXPERT_SHARDING=layer"] {
            let one = copy_fixture(name);
            let spread_dirs = [(2, copy_fixture(name)), (3, copy_fixture(name))];
            let args = |dir: &Path| {
                vec![
                    format!("SNAP={}", dir.display()),
                    ids.to_string(),
                    "NGEN=12".to_string(),
                    sharding.to_string(),
                    "2".to_string(),
                    "16".to_string(),
                    "16".to_string(),
                ]
            };
            // Twice, so that the second run places its experts from the first's history.
            for round in 0..2 {
                let single = coli_with(&args(one.path()));
                succeeded(&single, name);
                for (ranks, dir) in &spread_dirs {
                    let spread = mpirun_with(*ranks, &args(dir.path()));
                    let what = format!("{name} {sharding} -np {ranks} round {round}");
                    succeeded(&spread, &what);
                    assert_eq!(generated(&spread), generated(&single), "{what}");
                    assert_eq!(history(dir.path()), history(one.path()), "{what}");
                    assert!(
                        stdout(&spread).contains("| mpi "),
                        "the PROFILE line gives the exchanges: {}",
                        stdout(&spread)
                    );
                }
            }
            // Only rank 0 wrote: the same history files as one process leaves.
            let names = |dir: &Path| {
                let mut names: Vec<String> = std::fs::read_dir(dir)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(".coli_usage"))
                    .collect();
                names.sort();
                names
            };
            for (ranks, dir) in &spread_dirs {
                assert_eq!(names(dir.path()), names(one.path()), "{name} -np {ranks}");
            }
        }
    }
}

/// The report line's `(pin hits, lookups)`: `... (P pin + L lru / M miss) ...`.
fn pin_hits_and_lookups(out: &Output) -> (u64, u64) {
    let text = stdout(out);
    let line = text
        .lines()
        .find(|line| line.starts_with("Expert cache hit rate"))
        .unwrap_or_else(|| panic!("no report line: {text}"));
    let counts = line.split(['(', ')']).nth(1).unwrap_or_default();
    let numbers: Vec<u64> = counts
        .split_whitespace()
        .filter_map(|word| word.parse().ok())
        .collect();
    let [pin, lru, miss] = numbers[..] else {
        panic!("unexpected report line: {line}");
    };
    (pin, pin + lru + miss)
}

#[test]
fn pins_are_held_by_the_ranks_that_compute_the_experts() {
    for name in ["olmoe_trained", "glm_moe_dsa_tiny"] {
        for io in ["EXPERT_IO=mmap", "EXPERT_IO=pread", "COLI_POLICY=lfru"] {
            let one = copy_fixture(name);
            let three = copy_fixture(name);
            let args = |dir: &Path, round: usize| {
                let mut args = vec![format!("SNAP={}", dir.display()), io.to_string()];
                if round == 0 {
                    args.extend(["IDS=3 11 29 7", "NGEN=24"].map(String::from));
                } else {
                    // Placed from the first round's history, and moved between tokens by
                    // REPIN as another prompt's routing departs from it.
                    args.extend(
                        ["IDS=5 17 40 2", "NGEN=48", "PIN=auto", "PIN_N=3", "REPIN=4"]
                            .map(String::from),
                    );
                }
                args.extend(["4", "16", "16"].map(String::from));
                args
            };
            for round in 0..2 {
                let single = coli_with(&args(one.path(), round));
                succeeded(&single, name);
                let spread = mpirun_with(3, &args(three.path(), round));
                let what = format!("{name} {io} round {round}");
                succeeded(&spread, &what);
                assert_eq!(generated(&spread), generated(&single), "{what}");
                assert_eq!(history(three.path()), history(one.path()), "{what}");
                // Every lookup is counted where it happened, and the pins the trunk
                // planned answer on the expert ranks exactly as in the one process.
                let (pins, lookups) = pin_hits_and_lookups(&single);
                assert_eq!(
                    pin_hits_and_lookups(&spread),
                    (pins, lookups),
                    "{what}: {}",
                    stdout(&spread)
                );
                assert!(lookups > 0, "{what}");
                assert_eq!(pins > 0, round > 0, "{what}: {}", stdout(&single));
                // The same swaps, decided on rank 0 and made on the ranks.
                let swaps = |out: &Output| -> Vec<String> {
                    stderr(out)
                        .lines()
                        .filter(|line| line.starts_with("[REPIN]"))
                        .map(|line| line.split(" in ").next().unwrap_or(line).to_string())
                        .collect()
                };
                assert_eq!(swaps(&spread), swaps(&single), "{what}");
                if round > 0 && name.starts_with("olmoe") {
                    assert!(!swaps(&single).is_empty(), "{what}: {}", stderr(&single));
                }
            }
        }
    }
}

#[test]
fn serving_under_mpirun_is_refused() {
    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    let out = mpirun(2, &["chat", &snap]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("coli chat runs as one process"),
        "{}",
        stderr(&out)
    );
}

/// The pid of the rank-`rank` coli process of the mpirun whose environment holds `mark`.
fn rank_pid(mark: &str, rank: usize) -> Option<u32> {
    let wanted = [
        format!("COLI_TEST_MARK={mark}"),
        format!("OMPI_COMM_WORLD_RANK={rank}"),
    ];
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let entry = entry.ok()?;
        let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
        let exe = std::fs::read_link(entry.path().join("exe")).ok()?;
        if exe.file_name()? != "coli" {
            return None;
        }
        let environ = std::fs::read(entry.path().join("environ")).ok()?;
        let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        wanted
            .iter()
            .all(|w| vars.contains(&w.as_bytes()))
            .then_some(pid)
    })
}

/// A generation far longer than the signal tests wait, so that it is running at the signal.
const GENERATION: [&str; 3] = ["IDS=3 11 29 7", "NGEN=10000000", "LONG_CONTEXT=1"];

/// How long the signal tests wait for the run to get under way, and then for it to end.
const JOB_DEADLINE: std::time::Duration = std::time::Duration::from_secs(180);

/// A long run on a copy of olmoe_tiny under `mpirun -np 3` (with the settings `run`, a
/// generation or a perplexity far longer than the test waits): once it is under way,
/// `kill -SIGNAL` goes to rank `rank`; then the job's output, and the copy, once mpirun has
/// ended.
///
/// The signal waits for the run, not for a time: the route trace of rank 0 reaches disk
/// only when its buffer fills, hundreds of tokens in, after every rank has answered. A
/// fixed wait is not enough: a rank stopped inside `MPI_Init` stops the
/// others' `MPI_Init` with it, where no `MPI_TIMEOUT` can reach, and a loaded machine can
/// spend seconds there. A job that neither starts nor ends within [`JOB_DEADLINE`] is
/// killed, every rank with it, and the test fails saying so.
fn signal_rank_mid_run(rank: usize, signal: &str, run: &[&str]) -> (Output, tempfile::TempDir) {
    use std::io::Read;
    use std::sync::{Arc, Mutex};

    let dir = copy_fixture("olmoe_tiny");
    let mark = format!(
        "{}-{:?}-{signal}",
        std::process::id(),
        std::time::Instant::now()
    );
    let snap = format!("SNAP={}", dir.path().display());
    let trace_path = dir.path().join("route.trace");
    let trace = format!("ROUTE_TRACE={}", trace_path.display());
    let mut args = vec![snap.as_str(), trace.as_str()];
    args.extend(run);
    args.extend(["2", "16", "16"]);
    let mut command = mpirun_command(3, &args);
    command.env("COLI_TEST_MARK", &mark);
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("mpirun starts");
    // Both pipes drain as the job writes, so that it never blocks on a full one.
    let collect = |mut pipe: Box<dyn Read + Send>| {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let into = Arc::clone(&seen);
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                into.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        (seen, reader)
    };
    let (out, out_reader) = collect(Box::new(child.stdout.take().unwrap()));
    let (err, err_reader) = collect(Box::new(child.stderr.take().unwrap()));
    let give_up = |child: &mut std::process::Child, why: &str| -> ! {
        for r in 0..3 {
            if let Some(pid) = rank_pid(&mark, r) {
                let _ = Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "{why}; stdout: {}\nstderr: {}",
            String::from_utf8_lossy(&out.lock().unwrap()),
            String::from_utf8_lossy(&err.lock().unwrap())
        );
    };

    let started = std::time::Instant::now();
    let under_way = || std::fs::metadata(&trace_path).is_ok_and(|m| m.len() > 0);
    while !under_way() {
        if let Some(status) = child.try_wait().unwrap() {
            give_up(
                &mut child,
                &format!("mpirun ended ({status}) before the run was under way"),
            );
        }
        if started.elapsed() > JOB_DEADLINE {
            give_up(&mut child, "the run never got under way");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let Some(pid) = rank_pid(&mark, rank) else {
        give_up(&mut child, &format!("no rank {rank} in a job under way"));
    };
    let sent = Command::new("kill")
        .args([format!("-{signal}"), pid.to_string()])
        .status()
        .unwrap();
    if !sent.success() {
        give_up(&mut child, &format!("kill -{signal} {pid} failed"));
    }
    let signalled = std::time::Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if signalled.elapsed() > JOB_DEADLINE {
            give_up(
                &mut child,
                &format!(
                    "the job did not end within {JOB_DEADLINE:?} of SIG{signal} to rank {rank}"
                ),
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    out_reader.join().unwrap();
    err_reader.join().unwrap();
    let take = |seen: Arc<Mutex<Vec<u8>>>| std::mem::take(&mut *seen.lock().unwrap());
    let output = Output {
        status,
        stdout: take(out),
        stderr: take(err),
    };
    (output, dir)
}

#[test]
fn a_rank_that_stops_answering_ends_the_run_naming_it_saving_the_tokens_before() {
    // Rank 1 frozen, as a hung machine would be.
    let (out, dir) =
        signal_rank_mid_run(1, "STOP", &[&GENERATION[..], &["MPI_TIMEOUT=2"]].concat());
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("expert rank 1 did not answer") && err.contains("MPI_TIMEOUT=2s"),
        "{err}"
    );
    // The tokens generated before the stop are printed and their selections saved, as when
    // any generating run fails part-way; the forward the stop cut short adds nothing: the
    // prompt's 4 rows and one row for each token but the last (whose forward failed), each
    // routed by 3 layers to 2 experts.
    let tokens = generated(&out).split_whitespace().count();
    assert!(tokens > 0, "{}", stdout(&out));
    let saved = std::fs::read_to_string(dir.path().join(".coli_usage")).expect("saved");
    assert_eq!(selections(&saved), 6 * (4 + tokens as u64 - 1), "{saved}");
}

/// The selections a history holds, as the C reader's loop totals them (records with a
/// layer of 0 or more).
fn selections(history: &str) -> u64 {
    history
        .lines()
        .filter_map(|line| {
            let fields: Vec<i64> = line
                .split_whitespace()
                .map(|f| f.parse().ok())
                .collect::<Option<_>>()?;
            match fields[..] {
                [layer, _, count] if layer >= 0 => u64::try_from(count).ok(),
                _ => None,
            }
        })
        .sum()
}

#[test]
fn a_rank_that_stops_during_a_perplexity_run_ends_it_naming_the_rank() {
    // Rank 1 frozen while a perplexity run sends it windows of 64 rows. The stop lands while
    // the rank waits for rows, which are more than MPI sends before the rank takes them (a
    // plain send would wait for ever), or while it computes or sends its answer, which then
    // never comes whole (a plain receive of a message begun would wait for ever: the ranks
    // here copy through shared memory, `btl_vader_single_copy_mechanism=none`, so the
    // receiver cannot pull the rest itself).
    let text = tempfile::NamedTempFile::new().expect("temporary file");
    std::fs::write(
        text.path(),
        "the cat sat on a mat and it was fine ".repeat(12_000),
    )
    .unwrap();
    let file = format!("PPL_FILE={}", text.path().display());
    let (out, _) = signal_rank_mid_run(1, "STOP", &["PPL=1", &file, "CTX=64", "MPI_TIMEOUT=2"]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    let named = [
        "did not take the rows of MoE layer",
        "did not answer for MoE layer",
    ]
    .iter()
    .any(|what| err.contains(&format!("expert rank 1 {what}")));
    assert!(named && err.contains("MPI_TIMEOUT=2s"), "{err}");
}

#[test]
fn a_signal_to_rank_0_ends_the_job_as_one_process_ends_and_saves() {
    let (out, dir) = signal_rank_mid_run(0, "TERM", &GENERATION);
    let err = stderr(&out);
    // Rank 0 exits 128 + SIGTERM after saving, and the expert ranks stop when told.
    assert_eq!(out.status.code(), Some(143), "{err}");
    assert!(err.contains("[coli] SIGTERM"), "{err}");
    let saved = std::fs::read_to_string(dir.path().join(".coli_usage")).expect("saved");
    assert!(saved.lines().count() > 1, "{saved}");
    assert!(!generated(&out).is_empty(), "{}", stdout(&out));
}
