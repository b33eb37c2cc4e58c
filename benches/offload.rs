//! Out-of-core decode: the real-shape OLMoE of the `decode` benchmark (int8-row container)
//! decoded one token at a time inside a memory cgroup that holds only part of its shards.
//!
//! For each `--layers` count (4 and 16 by default), each `--limits` percentage of the
//! container's shard bytes (100, 60, 40, 25 by default) and each expert-I/O configuration
//! (`EXPERT_IO=mmap PILOT=0`, `EXPERT_IO=auto PILOT=0`, `EXPERT_IO=auto PILOT=2`), it drops
//! the page cache, then runs the release `coli` under `scripts/membox.sh <limit>` with
//! `REPLAY=1` over `--tokens` ids (128 by default, from a fixed seed) and reports tokens per
//! second, the expert-cache hit rate, the bytes read from disk per token and their rate
//! against the device's sequential read bandwidth (measured first with O_DIRECT reads of the
//! largest shard, one stream of 8 MiB reads and four of 2 MiB, the better of the two),
//! the cgroup's peak memory and OOM kills. The `auto PILOT=0` run also writes a
//! `ROUTE_TRACE`, which `coli trace simulate` replays at the same slots per layer: Belady's
//! hit rate there gives the disk traffic per token that no eviction policy can beat.
//!
//! `--batch 1,2,4,8` adds an axis: each configuration also decodes that many sequences
//! together (`REPLAY=1 BATCH=N`, sequence `i` the ids rotated by `i`), and the table gives
//! the aggregate tokens per second and the bytes read per token of all of them.
//!
//! `cargo bench --bench offload` (as root, for the cgroups and the cache drops; without them
//! it says so and runs without limits). `-- --quick` is a smoke run (4 layers, 40%, 32
//! tokens); `--layers 4,16`, `--limits 100,60,40,25`, `--batch 1`, `--tokens N` and `--dir
//! DIR` (default: `coli-olmoe-bench` in the system temporary directory, shared with
//! `decode`, whose models are reused) choose the rest.

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use coli::snapshot::Snapshot;
use common::{container, expert_bytes, source_model, CONTAINERS, VOCAB};
use machine::load_average;

mod common;
mod machine;
mod random_model;

/// The configurations compared at every limit; the second one is traced.
const CONFIGS: [[&str; 2]; 3] = [
    ["EXPERT_IO=mmap", "PILOT=0"],
    ["EXPERT_IO=auto", "PILOT=0"],
    ["EXPERT_IO=auto", "PILOT=2"],
];
const TRACED: usize = 1;

struct Args {
    layers: Vec<usize>,
    dir: PathBuf,
    limits: Vec<u32>,
    batches: Vec<usize>,
    tokens: usize,
}

fn list<T: std::str::FromStr>(flag: &str, value: Option<&String>) -> Vec<T> {
    let parsed: Option<Vec<T>> = value.and_then(|v| v.split(',').map(|x| x.parse().ok()).collect());
    parsed.unwrap_or_else(|| {
        eprintln!("{flag} takes a comma-separated list of numbers");
        std::process::exit(2)
    })
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let quick = argv.iter().any(|a| a == "--quick");
    let mut parsed = Args {
        layers: if quick { vec![4] } else { vec![4, 16] },
        dir: common::default_dir(),
        limits: if quick {
            vec![40]
        } else {
            vec![100, 60, 40, 25]
        },
        batches: vec![1],
        tokens: if quick { 32 } else { 128 },
    };
    let mut argv = argv.iter();
    while let Some(flag) = argv.next() {
        match flag.as_str() {
            "--layers" => parsed.layers = list(flag, argv.next()),
            "--limits" => parsed.limits = list(flag, argv.next()),
            "--batch" => parsed.batches = list(flag, argv.next()),
            "--tokens" => parsed.tokens = list(flag, argv.next())[0],
            "--dir" => parsed.dir = PathBuf::from(argv.next().cloned().unwrap_or_default()),
            // `cargo bench` passes `--bench`.
            "--quick" | "--bench" => {}
            other => {
                eprintln!(
                    "unknown argument {other} (--layers, --limits, --batch, --tokens, --dir, --quick)"
                );
                std::process::exit(2)
            }
        }
    }
    parsed
}

/// `count` token ids in `0..VOCAB` from a fixed seed (splitmix64).
fn token_ids(count: usize) -> String {
    let mut state = 0x00FF_10ADu64;
    let ids: Vec<String> = (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % VOCAB as u64).to_string()
        })
        .collect();
    ids.join(" ")
}

/// The container's shards, largest first.
fn shards(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut found: Vec<(PathBuf, u64)> = std::fs::read_dir(dir)
        .expect("read the container")
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let bytes = path.metadata().ok()?.len();
            (path.extension()? == "safetensors").then_some((path, bytes))
        })
        .collect();
    found.sort_by_key(|s| std::cmp::Reverse(s.1));
    found
}

/// `sync` and drop the page cache; false where that is not allowed.
fn drop_caches() -> bool {
    let synced = Command::new("sync").status().is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

/// Sequential read bandwidth of the device holding `path`, in GB/s: the file read with
/// O_DIRECT (past the page cache) by `streams` threads, each its own contiguous part in
/// `block`-byte reads; the best figure of one stream and of several is the device's.
fn device_bandwidth(path: &Path, streams: usize, block: usize) -> std::io::Result<f64> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let len = file.metadata()?.len();
    let part = (len / streams as u64) / block as u64 * block as u64;
    let started = Instant::now();
    let total = std::thread::scope(|scope| {
        let readers: Vec<_> = (0..streams as u64)
            .map(|i| {
                let file = &file;
                scope.spawn(move || -> std::io::Result<u64> {
                    // Anonymous mappings are page-aligned, as O_DIRECT needs.
                    let mut buffer = memmap2::MmapOptions::new().len(block).map_anon()?;
                    let mut done = 0;
                    while done < part {
                        let n = file.read_at(&mut buffer, i * part + done)?;
                        if n == 0 {
                            break;
                        }
                        done += n as u64;
                    }
                    Ok(done)
                })
            })
            .collect();
        readers.into_iter().try_fold(0u64, |sum, reader| {
            reader
                .join()
                .unwrap_or_else(|_| Err(std::io::Error::other("a probe thread panicked")))
                .map(|n| sum + n)
        })
    })?;
    Ok(total as f64 / started.elapsed().as_secs_f64() / 1e9)
}

fn numeric(c: char) -> bool {
    c.is_ascii_digit() || c == '.'
}

/// The number that ends just before `unit` in `text` (spaces between allowed).
fn number_before(text: &str, unit: &str) -> Option<f64> {
    let head = text[..text.find(unit)?].trim_end();
    let start = head
        .char_indices()
        .rev()
        .find(|&(_, c)| !numeric(c))
        .map_or(0, |(i, c)| i + c.len_utf8());
    head[start..].parse().ok()
}

/// The number that follows `key` in `text` (spaces, `=` or `:` between allowed).
fn number_after(text: &str, key: &str) -> Option<f64> {
    let tail = text[text.find(key)? + key.len()..].trim_start_matches([' ', '=', ':']);
    let end = tail.find(|c| !numeric(c)).unwrap_or(tail.len());
    tail[..end].parse().ok()
}

/// The `REPLAY decode:` figures.
struct Replay {
    tokens_per_second: f64,
    hit: f64,
    mb_per_token: f64,
    disk_gbs: f64,
}

/// What one run of `coli` printed.
#[derive(Default)]
struct Outcome {
    replay: Option<Replay>,
    experts: Option<String>,
    profile: Option<String>,
    slots: Option<usize>,
    peak_mb: Option<f64>,
    oom_kills: Option<f64>,
    error: Option<String>,
}

fn parse_run(stdout: &str, stderr: &str) -> Outcome {
    let line = |text: &str, start: &str| {
        text.lines()
            .find(|l| l.starts_with(start))
            .map(str::to_string)
    };
    let replay = line(stdout, "REPLAY decode:").and_then(|l| {
        Some(Replay {
            tokens_per_second: number_before(&l, "tok/s")?,
            hit: number_after(&l, "hit")?,
            mb_per_token: number_before(&l, "MB/token")?,
            disk_gbs: number_before(&l, "GB/s")?,
        })
    });
    let experts = line(stderr, "[experts]");
    let slots = experts
        .as_deref()
        .and_then(|l| {
            number_before(l, "slots")
                .or_else(|| number_after(l, "slots/layer"))
                .or_else(|| number_after(l, "slots"))
        })
        // The banner: `== coli olmoe | cache=N experts/layer | ...`.
        .or_else(|| number_after(&line(stdout, "== coli")?, "cache="))
        .map(|s| s as usize);
    let membox = line(stderr, "membox:").unwrap_or_default();
    Outcome {
        replay,
        profile: line(stdout, "PROFILE:"),
        experts,
        slots,
        peak_mb: number_after(&membox, "peak"),
        oom_kills: number_after(&membox, "oom_kill"),
        error: None,
    }
}

/// One REPLAY run of `coli`, under `membox` with `limit` bytes when given.
fn run_coli(coli: &Path, limit: Option<(&Path, u64)>, settings: &[String]) -> Outcome {
    let mut command = match limit {
        Some((membox, bytes)) => {
            let mut c = Command::new(membox);
            c.arg(bytes.to_string()).arg(coli);
            c
        }
        None => Command::new(coli),
    };
    for key in coli::settings::KEYS {
        command.env_remove(key.name);
    }
    let output = match command.args(settings).output() {
        Ok(output) => output,
        Err(err) => {
            return Outcome {
                error: Some(format!("cannot start: {err}")),
                ..Outcome::default()
            }
        }
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let mut outcome = parse_run(&stdout, &stderr);
    if !output.status.success() || outcome.replay.is_none() {
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty() && !l.starts_with("membox:"))
            .unwrap_or("no REPLAY line");
        let code = output
            .status
            .code()
            .map_or("signal".to_string(), |c| c.to_string());
        let last = last.trim();
        outcome.error = Some(format!(
            "exit {code}: {}",
            last.strip_prefix("error: ").unwrap_or(last)
        ));
    }
    outcome
}

/// `coli trace simulate` at `slots`: (lru hit rate, belady hit rate, lookups per token).
fn simulate(
    coli: &Path,
    trace: &Path,
    slots: usize,
    layers: usize,
) -> Result<(f64, f64, f64), String> {
    let output = Command::new(coli)
        .args(["trace", "simulate"])
        .arg(trace)
        .args([
            "--slots",
            &slots.to_string(),
            "--policy",
            "lru,belady",
            "--json",
        ])
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(stderr.lines().last().unwrap_or("failed").to_string());
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())?;
    let rate = |policy: &str| {
        report["sizes"][0]["results"]
            .as_array()?
            .iter()
            .find(|r| r["policy"] == policy)?["hit_rate"]
            .as_f64()
    };
    let lookups = report["lookups"].as_f64().unwrap_or(0.0);
    let calls = report["calls"].as_f64().unwrap_or(0.0);
    match (rate("lru"), rate("belady")) {
        (Some(lru), Some(belady)) if calls > 0.0 => {
            Ok((lru, belady, lookups * layers as f64 / calls))
        }
        _ => Err("no lru/belady result in the report".to_string()),
    }
}

struct Row {
    layers: usize,
    /// Sequences decoded together.
    batch: usize,
    /// Percent of the shard bytes and the limit in bytes; `None` without cgroups.
    limit: Option<(u32, u64)>,
    config: String,
    outcome: Outcome,
    /// Belady's disk traffic at this row's slots, in MB/token.
    belady_mb: Option<f64>,
}

fn cell(value: Option<f64>, digits: usize) -> String {
    value.map_or("-".to_string(), |v| format!("{v:.digits$}"))
}

fn print_table(rows: &[Row], device_gbs: Option<f64>) {
    println!(
        "\n| layers | limit % (MB) | batch | config | tok/s | hit % | MB/token | disk GB/s | % of device seq BW | peak MB | OOM | belady MB/token |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for row in rows {
        let limit = row.limit.map_or("none".to_string(), |(pct, bytes)| {
            format!("{pct}% ({:.0})", bytes as f64 / 1e6)
        });
        let o = &row.outcome;
        let r = o.replay.as_ref();
        let speed = match (&o.error, r) {
            (Some(err), _) => format!("error: {err}"),
            (None, Some(r)) => format!("{:.2}", r.tokens_per_second),
            (None, None) => "-".to_string(),
        };
        let of_device = r.zip(device_gbs).map(|(r, d)| 100.0 * r.disk_gbs / d);
        println!(
            "| {} | {limit} | {} | {} | {speed} | {} | {} | {} | {} | {} | {} | {} |",
            row.layers,
            row.batch,
            row.config,
            cell(r.map(|r| r.hit), 1),
            cell(r.map(|r| r.mb_per_token), 1),
            cell(r.map(|r| r.disk_gbs), 2),
            cell(of_device, 0),
            cell(o.peak_mb, 0),
            cell(o.oom_kills, 0),
            cell(row.belady_mb, 1),
        );
    }
}

fn main() {
    let args = args();
    let coli = PathBuf::from(env!("CARGO_BIN_EXE_coli"));
    let membox = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/membox.sh");
    let probe = Command::new(&membox).args(["1G", "true"]).output();
    let limited = match probe {
        Ok(out) if out.status.success() => true,
        Ok(out) => {
            let why = String::from_utf8_lossy(&out.stderr);
            println!("no memory cgroup ({}): running without limits", why.trim());
            false
        }
        Err(err) => {
            println!(
                "cannot run {}: {err}: running without limits",
                membox.display()
            );
            false
        }
    };

    // The int8 containers: path, shard bytes, bytes per expert.
    let models: Vec<(usize, PathBuf, u64, usize)> = args
        .layers
        .iter()
        .map(|&layers| {
            let source = source_model(&args.dir, layers);
            let dst = container(&source, &args.dir, layers, &CONTAINERS[0]);
            let total = shards(&dst).iter().map(|s| s.1).sum();
            let expert = expert_bytes(&Snapshot::open(&dst).expect("open the container"), 0);
            (layers, dst, total, expert)
        })
        .collect();

    let cache_drops = drop_caches();
    if !cache_drops {
        println!("cannot drop the page cache (needs root): runs are not cold");
    }
    let largest = models.iter().flat_map(|m| shards(&m.1)).max_by_key(|s| s.1);
    let device_gbs = largest.and_then(|(path, bytes)| {
        let mut best: Option<f64> = None;
        for (streams, block) in [(1, 8 << 20), (4, 2 << 20)] {
            drop_caches();
            match device_bandwidth(&path, streams, block) {
                Ok(gbs) => {
                    println!(
                        "device sequential read (O_DIRECT, {streams} stream(s) of {} MiB reads, {:.2} GB of {}): {gbs:.2} GB/s",
                        block >> 20,
                        bytes as f64 / 1e9,
                        path.display()
                    );
                    best = Some(best.map_or(gbs, |b: f64| b.max(gbs)));
                }
                Err(err) => println!("device read probe on {} failed: {err}", path.display()),
            }
        }
        best
    });
    println!(
        "threads: 2 | tokens: {} | load average: {}",
        args.tokens,
        load_average()
    );

    let ids = token_ids(args.tokens);
    let mut rows = Vec::new();
    for (layers, dst, total, expert) in &models {
        let limits: Vec<Option<(u32, u64)>> = if limited {
            let limit = |pct: u32| Some((pct, total * u64::from(pct) / 100));
            args.limits.iter().map(|&pct| limit(pct)).collect()
        } else {
            vec![None]
        };
        for (limit, &batch) in limits
            .iter()
            .flat_map(|limit| args.batches.iter().map(move |b| (*limit, b)))
        {
            let label = limit.map_or("none".to_string(), |l| l.0.to_string());
            let trace = args.dir.join(format!("trace-{layers}-{label}.txt"));
            let first = rows.len();
            for (index, config) in CONFIGS.iter().enumerate() {
                let mut settings = vec![
                    format!("SNAP={}", dst.display()),
                    format!("IDS={ids}"),
                    "REPLAY=1".to_string(),
                    "NGEN=0".to_string(),
                    "THREADS=2".to_string(),
                    "USAGE_SAVE=0".to_string(),
                    "CAP=0".to_string(),
                    format!("BATCH={batch}"),
                ];
                settings.extend(config.iter().map(|s| s.to_string()));
                // One sequence's trace is the one `coli trace simulate` replays.
                let traced = index == TRACED && batch == 1;
                if traced {
                    // A trace left by an earlier run is replaced, never appended to.
                    let _ = std::fs::remove_file(&trace);
                    settings.push(format!("ROUTE_TRACE={}", trace.display()));
                }
                if cache_drops {
                    drop_caches();
                }
                let outcome = run_coli(&coli, limit.map(|l| (membox.as_path(), l.1)), &settings);
                eprintln!(
                    "[offload] {layers} layers, limit {label}%, batch {batch}, {}: {}",
                    config.join(" "),
                    match (&outcome.error, &outcome.replay) {
                        (Some(err), _) => err.clone(),
                        (None, Some(r)) => format!("{:.2} tok/s", r.tokens_per_second),
                        (None, None) => "-".to_string(),
                    }
                );
                rows.push(Row {
                    layers: *layers,
                    batch,
                    limit,
                    config: config.join(" "),
                    outcome,
                    belady_mb: None,
                });
            }
            if batch != 1 {
                continue;
            }
            let traced_slots = rows[first + TRACED].outcome.slots;
            match traced_slots.filter(|_| trace.exists()) {
                Some(slots) => match simulate(&coli, &trace, slots, *layers) {
                    Ok((lru, belady, per_token)) => {
                        let mb = (1.0 - belady) * per_token * *expert as f64 / 1e6;
                        println!(
                            "trace {}: {slots} slots/layer, {per_token:.1} lookups/token, {:.2} MB/expert | lru hit {:.1}% | belady hit {:.1}%, {mb:.1} MB/token",
                            trace.display(),
                            *expert as f64 / 1e6,
                            100.0 * lru,
                            100.0 * belady
                        );
                        for row in &mut rows[first..] {
                            if row.outcome.slots == Some(slots) {
                                row.belady_mb = Some(mb);
                            }
                        }
                    }
                    Err(err) => println!("trace {}: simulate failed: {err}", trace.display()),
                },
                None => println!(
                    "trace {}: not simulated (no trace or no slots/layer reported)",
                    trace.display()
                ),
            }
        }
    }

    print_table(&rows, device_gbs);
    if let Some(gbs) = device_gbs {
        println!("\ndevice sequential read bandwidth: {gbs:.2} GB/s");
    }
    println!("\nauto/mmap tok/s:");
    for group in rows.chunks(CONFIGS.len()) {
        let speed = |row: &Row| row.outcome.replay.as_ref().map(|r| r.tokens_per_second);
        let label = group[0]
            .limit
            .map_or("no limit".to_string(), |l| format!("limit {}%", l.0));
        let ratios: Vec<String> = group[1..]
            .iter()
            .map(|row| {
                let ratio = speed(row).zip(speed(&group[0])).map(|(a, m)| a / m);
                format!("{}: {}", row.config, cell(ratio, 2))
            })
            .collect();
        println!(
            "- {} layers, {label}, batch {}: {}",
            group[0].layers,
            group[0].batch,
            ratios.join(", ")
        );
    }
    println!("\nper run:");
    for row in &rows {
        let o = &row.outcome;
        let limit = row
            .limit
            .map_or("none".to_string(), |l| format!("{}%", l.0));
        println!(
            "- {} layers, {limit}, batch {}, {}:",
            row.layers, row.batch, row.config
        );
        for line in [&o.experts, &o.profile].into_iter().flatten() {
            println!("  {line}");
        }
    }
    println!("load average after: {}", load_average());
}
