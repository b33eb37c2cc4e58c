//! The start of every job that runs a model (`coli` itself, `coli serve` and `coli chat`, an
//! MPI job's ranks): the positionals, the snapshot opened and its engine resolved, the
//! engine loaded with its banner, the context limit, and the telemetry session started.
//! It owns the order of these steps and the lines they print; it runs no mode and imports
//! none of the modules that do (`run`, `serve`, `cluster`), which all import it.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::backend;
use crate::engines::{self, Engine, LoadOptions};
use crate::experts::{Budget, StoreOptions};
use crate::quant::{Format, Width};
use crate::session::{RunKind, Session};
use crate::settings::Settings;
use crate::snapshot::Snapshot;

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

/// Whether the process manager of an MPI launch (Open MPI, MPICH, PMIx) started this process.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|key| std::env::var_os(key).is_some())
}

/// The snapshot `SNAP` names and the engine that runs it, checked (with the files the run
/// will write) before anything is loaded; the thread pool sized by `THREADS`.
pub fn open(model: Option<&str>, settings: &Settings) -> Result<(Snapshot, &'static str)> {
    let Some(snap) = &settings.snap else {
        bail!("SNAP is not set: pass SNAP=<model directory>, e.g. `coli SNAP=fixtures/olmoe_tiny 64 16 16`");
    };
    let mut threads = settings.threads;
    let available = std::thread::available_parallelism().map_or(1, usize::from);
    if threads > available {
        eprintln!(
            "[threads] THREADS={threads} is more than the {available} CPUs this process may use; using {available}"
        );
        threads = available;
    }
    if threads > 0 {
        // Fails only if a pool already exists, which cannot happen before the first job.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
    }
    let snapshot = Snapshot::open(snap)?;
    let name = engines::resolve(model, &snapshot)?;
    Session::preflight(settings, snapshot.dir(), name)?;
    Ok((snapshot, name))
}

/// The model's text config: `config.json`'s `text_config` object where the release nests
/// the language model's keys there (Inkling's multimodal release config, Kimi K3), else the
/// top level.
pub fn text_config(snapshot: &Snapshot) -> &serde_json::Value {
    let config = snapshot.config_json();
    config
        .get("text_config")
        .filter(|text| text.is_object())
        .unwrap_or(config)
}

/// `max_position_embeddings` of the [`text_config`]: the positions a run or a server request
/// may use, unless `LONG_CONTEXT=1` allows more (`None`: no limit).
pub fn context_limit(snapshot: &Snapshot, settings: &Settings) -> Option<usize> {
    if settings.long_context {
        return None;
    }
    text_config(snapshot)
        .get("max_position_embeddings")
        .and_then(serde_json::Value::as_u64)
        .map(|limit| limit as usize)
}

/// A loaded engine, the RAM budget its store was sized from (which placement divides), and
/// the two banner lines (`== coli ... ==`, `loaded in ...`) for the caller to print where
/// its mode prints them.
pub struct Loaded {
    pub engine: Box<dyn Engine>,
    budget: u64,
    banner: [String; 2],
}

impl Loaded {
    /// The banner, on stdout, or on stderr where stdout carries the mode's output alone
    /// (text mode, the server); not at all in a quiet run (`-q`).
    pub fn print_banner(&self, on_stderr: bool) {
        if !crate::verbosity::notes() {
            return;
        }
        for line in &self.banner {
            if on_stderr {
                eprintln!("{line}");
            } else {
                println!("{line}");
            }
        }
    }

    /// The run's telemetry started on this engine: the trace opened and the history loaded
    /// ([`Session::start`]), then `before_pins` (where an MPI job's trunk spreads the
    /// experts over its ranks, balanced by the history just loaded), then the placement
    /// plan's pins, each in the store of the process that computes it ([`Session::place`]).
    pub fn start_session(
        &self,
        settings: &Settings,
        snapshot: &Snapshot,
        kind: RunKind,
        before_pins: impl FnOnce(&dyn Engine) -> Result<()>,
    ) -> Result<Session> {
        let engine = self.engine.as_ref();
        let session = Session::start(settings, snapshot.dir(), engine, kind)?;
        before_pins(engine)?;
        session.place(settings, snapshot.dir(), engine, self.budget)?;
        Ok(session)
    }
}

/// Load `name` from `snapshot` as the settings and positionals ask: widths, kernels,
/// backend, expert store. The store's summary, the engine's notes and its stop tokens go
/// to stderr.
pub fn load(
    settings: &Settings,
    positionals: Positionals,
    snapshot: &Snapshot,
    name: &'static str,
) -> Result<Loaded> {
    load_for(settings, positionals, snapshot, name, true)
}

/// [`load`], for a caller that keeps the trunk's weights (`keeps_trunk`) or drops them once
/// loaded and keeps only the expert store (an MPI expert rank), whose budget then holds
/// experts alone.
pub fn load_for(
    settings: &Settings,
    positionals: Positionals,
    snapshot: &Snapshot,
    name: &'static str,
    keeps_trunk: bool,
) -> Result<Loaded> {
    let cap = match positionals.cap {
        Some(cap) if cap > 0 => cap as usize,
        _ => settings.cap,
    };
    let expert_width = Width::from_bits(positionals.expert_bits).context("EBITS")?;
    let dense_width = Width::from_bits(positionals.dense_bits).context("DBITS")?;
    crate::quant::select_simd(settings.simd);
    crate::quant::act8::select(int8_activations(settings, &positionals)?);
    backend::start(settings.backend, settings.gpu_dense, &settings.vulkan)?;
    let options = LoadOptions {
        store: StoreOptions {
            cap,
            width: expert_width,
            budget: Budget::detect(settings.ram_gb),
            io: settings.expert_io,
            direct: settings.direct,
            io_threads: settings.io_threads,
            policy: settings.policy,
            pilot: settings.pilot,
            transitions: settings.transitions,
            keeps_trunk,
        },
        dense_width,
        draft: settings.draft,
        dsa_force: settings.dsa_force,
    };

    let started = Instant::now();
    let loading = loading_spinner(name);
    let budget = options.store.budget.bytes;
    let loaded = engines::load(name, snapshot, options);
    loading.finish_and_clear();
    let engine = loaded?;
    let banner = [
        format!(
            "== coli {name} | cache={} experts/layer | experts@{} dense@{}-bit ==",
            engine.cache_capacity(),
            expert_label(engine.routed().store.format(), expert_width),
            dense_width.bits()
        ),
        format!(
            "loaded in {:.2}s | resident dense: {:.2} MB",
            started.elapsed().as_secs_f64(),
            engine.resident_bytes() as f64 / 1e6
        ),
    ];
    crate::note!("{}", engine.routed().store.summary());
    for note in engine.notes() {
        crate::note!("{note}");
    }
    let stops = engine.stop_tokens();
    if !stops.is_empty() {
        crate::note!(
            "[stop] {} stop tokens: {}",
            stops.len(),
            crate::snapshot::show_stop_ids(stops)
        );
    }
    Ok(Loaded {
        engine,
        budget,
        banner,
    })
}

/// The banner's width of the routed experts: what they compute in, which for a
/// pre-quantised container is its own format whatever EBITS asks; float experts keep the
/// width EBITS gives them (32 on the exact path, bf16 and f16 included, which compute
/// exactly).
fn expert_label(format: Option<Format>, width: Width) -> String {
    match format {
        Some(Format::Int8Row) => "8-bit".to_string(),
        Some(Format::Int4Row | Format::Int4Grouped { .. }) => "4-bit".to_string(),
        Some(format) if !format.is_float() => format.name().to_string(),
        _ => format!("{}-bit", width.bits()),
    }
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

/// `ACT_BITS=8`, refused where every matrix is float (the exact path: there is nothing to
/// quantise against).
fn int8_activations(settings: &Settings, positionals: &Positionals) -> Result<bool> {
    if settings.int8_activations && positionals.expert_bits >= 16 && positionals.dense_bits >= 16 {
        bail!(
            "ACT_BITS=8 quantises activations for int8, int4 and MXFP4 weights; EBITS and DBITS >= 16 is the exact f32 path: lower EBITS or DBITS (e.g. `64 4 8`), or drop ACT_BITS"
        );
    }
    Ok(settings.int8_activations)
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
}
