//! One run of the main job: resolve the snapshot and engine from the settings, load, then
//! run the mode the settings ask for (oracle comparison, generation from ids, or text from
//! a prompt) and report.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::backend;
use crate::engines::{self, Engine, LoadOptions};
use crate::generate::greedy_with;
use crate::interrupt;
use crate::oracle::{self, Reference};
use crate::quant::Width;
use crate::session::{RunKind, Session};
use crate::settings::Settings;
use crate::snapshot::Snapshot;
use crate::text::TextMode;

/// The numeric positionals `CAP [EBITS [DBITS]]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Positionals {
    pub cap: Option<u32>,
    pub expert_bits: u32,
    pub dense_bits: u32,
}

impl Positionals {
    /// EBITS defaults to 8 and DBITS to EBITS, as colibri's positionals do.
    pub fn from_numbers(numbers: &[u32]) -> Positionals {
        let expert_bits = numbers.get(1).copied().unwrap_or(8);
        Positionals {
            cap: numbers.first().copied(),
            expert_bits,
            dense_bits: numbers.get(2).copied().unwrap_or(expert_bits),
        }
    }
}

pub fn main_job(
    model: Option<&str>,
    settings: &Settings,
    positionals: Positionals,
) -> Result<ExitCode> {
    let Some(snap) = settings.text("SNAP") else {
        bail!("SNAP is not set: pass SNAP=<model directory>, e.g. `coli SNAP=fixtures/olmoe_tiny 64 16 16`");
    };
    let threads = settings.count("THREADS") as usize;
    if threads > 0 {
        // Fails only if a pool already exists, which cannot happen before the first job.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
    }
    let snapshot = Snapshot::open(&PathBuf::from(snap))?;
    let name = engines::resolve(model, &snapshot)?;
    // Text mode's tokenizer and settings are checked before the weights are mapped.
    let text = TextMode::from_settings(settings, snapshot.dir())?;
    let cap = match positionals.cap {
        Some(cap) if cap > 0 => cap as usize,
        _ => settings.count("CAP") as usize,
    };
    let expert_width = Width::from_bits(positionals.expert_bits).context("EBITS")?;
    let dense_width = Width::from_bits(positionals.dense_bits).context("DBITS")?;
    crate::quant::select_simd(crate::quant::Isa::from_setting(
        settings.text("COLI_SIMD").unwrap_or("auto"),
    )?);
    backend::start(
        backend::Choice::from_setting(settings.text("BACKEND").unwrap_or("cpu"))?,
        settings.flag("GPU_DENSE"),
    )?;
    let options = LoadOptions {
        cap,
        expert_width,
        dense_width,
        ram_budget: ram_budget(settings.number("RAM_GB")),
        draft: settings.count_if_set("DRAFT").map(|depth| depth as usize),
        dsa_force: settings.flag("DSA_FORCE"),
    };

    let started = Instant::now();
    let loading = loading_spinner(name);
    let loaded = engines::load(name, &snapshot, options);
    loading.finish_and_clear();
    let mut engine = loaded?;
    println!(
        "== coli {name} | cache={} experts/layer | experts@{}-bit dense@{}-bit ==",
        engine.cache_capacity(),
        expert_width.bits(),
        dense_width.bits()
    );
    println!(
        "loaded in {:.2}s | resident dense: {:.2} MB",
        started.elapsed().as_secs_f64(),
        engine.resident_bytes() as f64 / 1e6
    );
    for note in engine.notes() {
        eprintln!("{note}");
    }
    let stops = engine.stop_tokens();
    if !stops.is_empty() {
        eprintln!(
            "[stop] {} stop tokens: {}",
            stops.len(),
            oracle::join(stops)
        );
    }

    let mut text_job = match &text {
        Some(mode) => Some(mode.prepare(&snapshot, engine.as_ref())?),
        None => None,
    };

    interrupt::install();
    let mut session = Session::start(
        settings,
        snapshot.dir(),
        engine.as_mut(),
        options.ram_budget,
    )?;

    if let Some(job) = text_job.as_mut() {
        let mut on_tokens =
            |engine: &mut dyn Engine, emitted: u64| session.after_tokens(engine, emitted);
        let generation = job.run(
            engine.as_mut(),
            settings.count("NGEN") as usize,
            &mut on_tokens,
            &mut std::io::stdout(),
        )?;
        if generation.non_finite {
            eprintln!("[text] non-finite logits during generation");
        }
        if let Some(speculation) = &generation.speculation {
            println!("{speculation}");
        }
        println!("{}", job.summary(&generation));
        report(engine.as_ref(), generation.decode_tokens_per_second());
        session.finish(engine.as_mut(), RunKind::Generating)?;
        return Ok(ExitCode::SUCCESS);
    }

    if let Some(ids) = settings.ids("IDS") {
        let vocab = engine.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("IDS: token id {bad} is outside the vocabulary (vocab_size {vocab})");
        }
        let mut on_tokens =
            |engine: &mut dyn Engine, emitted: u64| session.after_tokens(engine, emitted);
        let generation = greedy_with(
            engine.as_mut(),
            ids,
            settings.count("NGEN") as usize,
            &mut on_tokens,
        )?;
        println!("{}", oracle::join(&generation.tokens));
        if let Some(speculation) = &generation.speculation {
            println!("{speculation}");
        }
        report(engine.as_ref(), generation.decode_tokens_per_second());
        session.finish(engine.as_mut(), RunKind::Generating)?;
        return Ok(ExitCode::SUCCESS);
    }

    let ref_path = settings
        .text("REF")
        .map(PathBuf::from)
        .unwrap_or_else(|| snapshot.dir().join("ref.json"));
    let reference = Reference::load(&ref_path, engine.vocab_size())?;
    let outcome = if settings.flag("TF") {
        oracle::compare_teacher_forced(engine.as_mut(), &reference)?
    } else {
        oracle::compare_greedy(engine.as_mut(), &reference)?
    };
    report(engine.as_ref(), outcome.rate);
    // An oracle run scores the reference's tokens: its routing is traced but not learned.
    session.finish(engine.as_mut(), RunKind::Scoring)?;
    if settings.flag("ORACLE_STRICT") && !outcome.passed() {
        eprintln!(
            "ORACLE_STRICT: {}/{} matching{}",
            outcome.matching,
            outcome.compared,
            if outcome.non_finite {
                ", non-finite logits"
            } else {
                ""
            }
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}

fn report(engine: &dyn Engine, tokens_per_second: f64) {
    let stats = engine.cache_stats();
    let vram = if stats.vram_hits > 0 {
        format!("{} vram + ", stats.vram_hits)
    } else {
        String::new()
    };
    println!(
        "Expert cache hit rate: {:.1}% ({vram}{} pin + {} lru / {} miss) | RSS: {:.2} GB | {:.1} tok/s",
        stats.hit_rate(),
        stats.pin_hits,
        stats.lru_hits,
        stats.misses,
        resident_set_bytes() as f64 / 1e9,
        tokens_per_second
    );
}

/// A spinner on stderr while the engine maps and prepares its weights; drawn only when
/// stderr is a terminal.
fn loading_spinner(name: &str) -> ProgressBar {
    let spinner = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template("{spinner} loading {msg} ({elapsed})") {
        spinner.set_style(style);
    }
    spinner.set_message(name.to_string());
    spinner.enable_steady_tick(Duration::from_millis(120));
    spinner
}

/// `RAM_GB` in bytes, or 88% of the memory available now.
fn ram_budget(ram_gb: f64) -> u64 {
    if ram_gb > 0.0 {
        return (ram_gb * 1e9) as u64;
    }
    let available = meminfo_kib("MemAvailable:").map_or(8 << 30, |kib| kib * 1024);
    available / 100 * 88
}

fn resident_set_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| field_kib(&status, "VmRSS:"))
        .map_or(0, |kib| kib * 1024)
}

fn meminfo_kib(field: &str) -> Option<u64> {
    field_kib(&std::fs::read_to_string("/proc/meminfo").ok()?, field)
}

fn field_kib(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positionals_default_like_colibri() {
        assert_eq!(
            Positionals::from_numbers(&[]),
            Positionals {
                cap: None,
                expert_bits: 8,
                dense_bits: 8
            }
        );
        assert_eq!(Positionals::from_numbers(&[64, 16]).dense_bits, 16);
        assert_eq!(Positionals::from_numbers(&[64, 4, 16]).dense_bits, 16);
    }

    #[test]
    fn proc_fields_parse() {
        assert_eq!(
            field_kib("VmPeak:  10 kB\nVmRSS:\t  2048 kB\n", "VmRSS:"),
            Some(2048)
        );
    }
}
