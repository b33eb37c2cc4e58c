//! The one registry of settings. Every `KEY` the program reads is declared here with its
//! type, default and a one-line description; a value comes from a `KEY=VALUE` argument,
//! else from the environment variable of the same name, else the default.
//!
//! Values are parsed and checked once, into the typed [`Settings`], so a typo or a
//! malformed number stops the run before anything is loaded. This module sits above the
//! modules whose choices it parses (backend, experts, kernels, placement) and below the
//! modes that read it; nothing it parses is read by string anywhere else, except that the
//! kernels fall back to `COLI_SIMD` from the environment for library callers (the
//! benchmarks) that never resolve settings.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Result};
use thiserror::Error;

use crate::backend;
use crate::backend::vulkan::VulkanOptions;
use crate::experts::{ExpertIo, Policy, Sharding};
use crate::quant::Isa;
use crate::route_trace::placement::{PinGb, PinRank, PinSetting};
use crate::route_trace::save::Decay;
use crate::sampling::{SamplingError, Shaping};

/// What a setting holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `1/0`, `true/false`, `on/off`, `yes/no`.
    Bool,
    /// A non-negative integer.
    Count,
    /// A non-negative decimal number.
    Number,
    /// A file or directory path.
    Path,
    /// Whitespace- or comma-separated token ids.
    Ids,
    /// Free text whose meaning the consumer checks (e.g. `PIN=auto|off|<path>`).
    Text,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Bool => "a boolean (1/0, true/false, on/off, yes/no)",
            Kind::Count => "a non-negative integer",
            Kind::Number => "a non-negative number",
            Kind::Path => "a path",
            Kind::Ids => "token ids separated by spaces or commas",
            Kind::Text => "text",
        })
    }
}

/// One declared setting.
pub struct Key {
    pub name: &'static str,
    pub kind: Kind,
    /// The default as it would be typed; empty when the setting is unset by default.
    pub default: &'static str,
    pub doc: &'static str,
}

/// Every setting, in the order `coli settings` prints them.
pub const KEYS: &[Key] = &[
    Key {
        name: "SNAP",
        kind: Kind::Path,
        default: "",
        doc: "model directory: config.json, *.safetensors, ref.json (required)",
    },
    Key {
        name: "CAP",
        kind: Kind::Count,
        default: "0",
        doc: "expert-cache slots per MoE layer; 0 = size from RAM_GB (the first positional wins)",
    },
    Key {
        name: "RAM_GB",
        kind: Kind::Number,
        default: "0",
        doc: "memory budget in GB; 0 = the lower of MemAvailable and the memory cgroup's limit",
    },
    Key {
        name: "EXPERT_IO",
        kind: Kind::Text,
        default: "auto",
        doc: "how experts come into memory: auto (mapped when all fit the budget, else streamed), mmap, pread, direct",
    },
    Key {
        name: "DIRECT",
        kind: Kind::Bool,
        default: "",
        doc: "streamed experts: 1 = O_DIRECT, 0 = buffered reads whose pages are dropped; unset = direct where the file system takes it",
    },
    Key {
        name: "IO_THREADS",
        kind: Kind::Count,
        default: "4",
        doc: "streamed experts: loader threads reading a layer's misses and read-ahead in parallel",
    },
    Key {
        name: "PILOT",
        kind: Kind::Count,
        default: "0",
        doc: "streamed experts: apply the routers of the next N MoE layers to the current hidden state and read their experts ahead",
    },
    Key {
        name: "TRANSITIONS",
        kind: Kind::Bool,
        default: "0",
        doc: "streamed experts: read ahead the next MoE layer's experts that most often followed each row's choice (the history's -3/-4 transition records and this run's)",
    },
    Key {
        name: "COLI_POLICY",
        kind: Kind::Text,
        default: "lru",
        doc: "expert-cache eviction: lru, or lfru (frequency from the history and this run, recency breaking ties)",
    },
    Key {
        name: "REPLAY",
        kind: Kind::Bool,
        default: "0",
        doc: "with IDS: decode the ids one token at a time, no sampling, and print the REPLAY line (the fixed-workload decode benchmark)",
    },
    Key {
        name: "BATCH",
        kind: Kind::Count,
        default: "1",
        doc: "with REPLAY=1: decode this many sequences together in one batched forward a token (sequence i from IDS rotated left by i)",
    },
    Key {
        name: "THREADS",
        kind: Kind::Count,
        default: "0",
        doc: "CPU worker threads; 0 = one per core",
    },
    Key {
        name: "PPL",
        kind: Kind::Bool,
        default: "0",
        doc: "score perplexity (teacher-forced NLL) of PPL_FILE, IDS or the reference's full_ids in windows of CTX tokens; never saves the history",
    },
    Key {
        name: "PPL_FILE",
        kind: Kind::Path,
        default: "",
        doc: "with PPL=1: a text file to score, tokenized with SNAP/tokenizer.json",
    },
    Key {
        name: "CTX",
        kind: Kind::Count,
        default: "512",
        doc: "with PPL=1: tokens per window (each window starts from an empty cache)",
    },
    Key {
        name: "PPL_STRIDE",
        kind: Kind::Count,
        default: "0",
        doc: "with PPL=1: tokens between window starts, at most CTX (0: CTX/2); each target is scored once",
    },
    Key {
        name: "KLD_BASE",
        kind: Kind::Path,
        default: "",
        doc: "with PPL=1: a file of per-position distributions; written when missing (run the f32 reference first), else this run is compared with it (KL divergence, top-1 agreement, PPL ratio)",
    },
    Key {
        name: "REF",
        kind: Kind::Path,
        default: "",
        doc: "oracle reference JSON (default SNAP/ref.json)",
    },
    Key {
        name: "TF",
        kind: Kind::Bool,
        default: "0",
        doc: "oracle: teacher-forced comparison of every position instead of greedy generation",
    },
    Key {
        name: "ORACLE_STRICT",
        kind: Kind::Bool,
        default: "0",
        doc: "oracle: exit 1 on any mismatch or non-finite logit",
    },
    Key {
        name: "IDS",
        kind: Kind::Ids,
        default: "",
        doc: "generate up to NGEN tokens greedily after these token ids (ending at a stop id) and print them",
    },
    Key {
        name: "NGEN",
        kind: Kind::Count,
        default: "32",
        doc: "tokens to generate in IDS and PROMPT modes; both stop early at one of the model's stop ids (its eos_token_id)",
    },
    Key {
        name: "PROMPT",
        kind: Kind::Text,
        default: "",
        doc: "generate text after this prompt and stream it (needs SNAP/tokenizer.json)",
    },
    Key {
        name: "CHAT",
        kind: Kind::Bool,
        default: "0",
        doc: "PROMPT: wrap the prompt in the model's chat template as one user turn",
    },
    Key {
        name: "TEMP",
        kind: Kind::Text,
        default: "0.7",
        doc: "PROMPT: sampling temperature >= 0; 0 = greedy (oracle and IDS modes are always greedy)",
    },
    Key {
        name: "TOP_P",
        kind: Kind::Number,
        default: "0.9",
        doc: "PROMPT: nucleus sampling mass in (0, 1] (colibri's NUCLEUS; not colibri's TOPP, a routing knob)",
    },
    Key {
        name: "TOP_K",
        kind: Kind::Count,
        default: "0",
        doc: "PROMPT, chat: draw only from the K most likely tokens; 0 = no cut (not colibri's TOPK, a routing knob)",
    },
    Key {
        name: "MIN_P",
        kind: Kind::Number,
        default: "0",
        doc: "PROMPT, chat: draw only tokens at least this share (0-1) of the most likely one's probability",
    },
    Key {
        name: "PRESENCE_PENALTY",
        kind: Kind::Number,
        default: "0",
        doc: "PROMPT, chat: subtracted (0-2) from the logit of every token generated so far",
    },
    Key {
        name: "FREQUENCY_PENALTY",
        kind: Kind::Number,
        default: "0",
        doc: "PROMPT, chat: subtracted (0-2) from a token's logit per time it was generated",
    },
    Key {
        name: "REPETITION_PENALTY",
        kind: Kind::Number,
        default: "1",
        doc: "PROMPT, chat: > 0; a positive logit of a token of the prompt or generated so far is divided by it, a negative one multiplied; 1 = none",
    },
    Key {
        name: "SEED",
        kind: Kind::Count,
        default: "",
        doc: "PROMPT: sampling seed; the same seed gives the same text; unset = from the clock",
    },
    Key {
        name: "LONG_CONTEXT",
        kind: Kind::Bool,
        default: "0",
        doc: "allow prompts and generations beyond config.json's max_position_embeddings (positions the model was not trained on)",
    },
    Key {
        name: "API_KEY",
        kind: Kind::Text,
        default: "",
        doc: "coli serve: the bearer token every request but /health must carry; required to listen beyond loopback",
    },
    Key {
        name: "DRAFT",
        kind: Kind::Count,
        default: "",
        doc: "speculative draft depth with a model's MTP head; unset = 1 when the model has one, 0 = off",
    },
    Key {
        name: "DSA_FORCE",
        kind: Kind::Bool,
        default: "0",
        doc: "glm_moe_dsa: run the DSA indexer on every query but keep every key (must equal dense attention)",
    },
    Key {
        name: "COLI_USAGE",
        kind: Kind::Path,
        default: "",
        doc: "expert-usage history to load and save (default SNAP/.coli_usage)",
    },
    Key {
        name: "USAGE_SAVE",
        kind: Kind::Bool,
        default: "1",
        doc: "save the usage history at the end of a generating run; 0 = read-only",
    },
    Key {
        name: "COLI_USAGE_DECAY",
        kind: Kind::Number,
        default: "1",
        doc: "multiply every history count by this factor in (0, 1] at each save",
    },
    Key {
        name: "STATS",
        kind: Kind::Path,
        default: "",
        doc: "write this run's expert counts (history included) to this file at exit",
    },
    Key {
        name: "ROUTE_TRACE",
        kind: Kind::Path,
        default: "",
        doc: "write every routing decision to this file: `<call> <row> <layer> <id>:<gate> ...`",
    },
    Key {
        name: "PIN",
        kind: Kind::Text,
        default: "",
        doc: "pin experts: auto (from the history), off, or a history file to rank from",
    },
    Key {
        name: "PIN_N",
        kind: Kind::Count,
        default: "",
        doc: "pins per MoE layer (instead of PIN_GB), at most CAP-8 (CAP/2 below 16 slots)",
    },
    Key {
        name: "PIN_ABSTAIN",
        kind: Kind::Bool,
        default: "1",
        doc: "with streamed experts, move each layer to the number of history pins (none up to PIN_N, a slot short of CAP) that would have hit most, once that beats what it holds by more than 1% of its lookups (the abstain rule)",
    },
    Key {
        name: "PIN_RANK",
        kind: Kind::Text,
        default: "lifetime",
        doc: "what placement ranks experts by: lifetime (every selection), recent (the -5 records' moving average), or blend (both, each as a share)",
    },
    Key {
        name: "PIN_GB",
        kind: Kind::Text,
        default: "10",
        doc: "memory for pinned experts in GB, or `all` for the whole RAM budget",
    },
    Key {
        name: "AUTOPIN",
        kind: Kind::Bool,
        default: "1",
        doc: "without PIN, pin the hottest experts once the history holds 5000+ selections",
    },
    Key {
        name: "REPIN",
        kind: Kind::Count,
        default: "0",
        doc: "every N generated tokens swap cold pins for hot experts; 0 = never",
    },
    Key {
        name: "EXPERT_SHARDING",
        kind: Kind::Text,
        default: "expert",
        doc: "under mpirun (a build with --features mpi): how the routed experts are spread over ranks 1..N-1: expert (each layer's experts balanced by the history's heat) or layer (whole layers)",
    },
    Key {
        name: "MPI_TIMEOUT",
        kind: Kind::Count,
        default: "120",
        doc: "under mpirun: seconds rank 0 waits for an expert rank, to take a message or to answer, before it ends the run naming that rank",
    },
    Key {
        name: "ACT_BITS",
        kind: Kind::Count,
        default: "32",
        doc: "8: int8 activations for int8, int4 and MXFP4 weights (faster, slightly lossy: measure it with PPL=1 KLD_BASE=); 32: f32 activations everywhere. Refused with EBITS and DBITS >= 16, the exact path",
    },
    Key {
        name: "COLI_SIMD",
        kind: Kind::Text,
        default: "auto",
        doc: "CPU kernels: auto (best detected), scalar (the reference), avx2, avx512, neon; results are identical",
    },
    Key {
        name: "BACKEND",
        kind: Kind::Text,
        default: "cpu",
        doc: "where products run: cpu, vulkan, cuda, or auto (a GPU that starts, else the CPU)",
    },
    Key {
        name: "GPU_DENSE",
        kind: Kind::Bool,
        default: "1",
        doc: "with a GPU backend, run dense products and norms on the GPU too; 0 = only the expert tier",
    },
    Key {
        name: "GPU_EXPERT_GB",
        kind: Kind::Number,
        default: "0",
        doc: "GB of routed experts kept on the GPU, hottest first from the PIN plan; 0 = none",
    },
    Key {
        name: "COLI_VK_DEVICE",
        kind: Kind::Count,
        default: "",
        doc: "Vulkan (BACKEND=vulkan or auto): the device by its index in the loader's list; unset = discrete first, then integrated, virtual, other and CPU devices",
    },
    Key {
        name: "COLI_VK_LOADER",
        kind: Kind::Path,
        default: "",
        doc: "Vulkan: the loader library to open; unset = the system's libvulkan.so.1",
    },
    Key {
        name: "COLI_VK_STAGED",
        kind: Kind::Bool,
        default: "0",
        doc: "Vulkan: upload weights through a staging copy even where device memory is host-visible",
    },
];

/// A setting's parsed value.
#[derive(Debug, Clone, PartialEq)]
enum Value {
    Bool(bool),
    Count(u64),
    Number(f64),
    Text(String),
    Ids(Vec<u32>),
}

/// Where a value came from, for messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Argument,
    Environment,
}

#[derive(Debug, Error, PartialEq)]
pub enum SettingsError {
    #[error("unknown setting {key}; {hint} (`coli settings` lists them all)")]
    UnknownKey { key: String, hint: String },
    #[error("environment variable {key} is not UTF-8 ({value:?}); coli reads settings as UTF-8 text: set it again, or pass {key}=<value> as an argument")]
    NotUnicode { key: &'static str, value: String },
    #[error("{origin} {key}={value:?}: expected {kind}")]
    BadValue {
        origin: String,
        key: &'static str,
        value: String,
        kind: Kind,
    },
}

/// A setting a run was given rather than defaulted: its key, the value as given and where it
/// came from (`-v` lists them; a mode refuses one it would ignore).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Given {
    pub key: &'static str,
    pub value: String,
    pub source: Source,
}

/// Every setting's raw value after resolution: argument over environment over default,
/// parsed by its `Kind`. [`Settings::build`] reads each key out of it exactly once.
struct Resolved {
    values: HashMap<&'static str, Value>,
    given: Vec<Given>,
    read: Vec<&'static str>,
}

impl Resolved {
    fn resolve(
        arguments: &[(String, String)],
        env: impl Fn(&'static Key) -> Result<Option<String>, SettingsError>,
    ) -> Result<Resolved, SettingsError> {
        let mut given: HashMap<&'static str, (String, Source)> = HashMap::new();
        for (name, value) in arguments {
            let key = find(name).ok_or_else(|| SettingsError::UnknownKey {
                key: name.clone(),
                hint: hint(name),
            })?;
            given.insert(key.name, (value.clone(), Source::Argument));
        }
        let mut values = HashMap::new();
        let mut listed = Vec::new();
        for key in KEYS {
            // `None`: the registry's default, which no message or listing calls given.
            let (raw, source) = match given.remove(key.name) {
                Some((value, source)) => (value, Some(source)),
                None => match env(key)? {
                    Some(value) => (value, Some(Source::Environment)),
                    None if key.default.is_empty() => continue,
                    None => (key.default.to_string(), None),
                },
            };
            let value = parse(key.kind, &raw).ok_or_else(|| SettingsError::BadValue {
                origin: match source {
                    Some(Source::Environment) => "environment variable".to_string(),
                    _ => "setting".to_string(),
                },
                key: key.name,
                value: raw.clone(),
                kind: key.kind,
            })?;
            values.insert(key.name, value);
            if let Some(source) = source {
                listed.push(Given {
                    key: key.name,
                    value: raw,
                    source,
                });
            }
        }
        Ok(Resolved {
            values,
            given: listed,
            read: Vec::new(),
        })
    }

    /// The value of `name`, which must be a declared key (the build reads each once).
    fn take(&mut self, name: &'static str) -> Option<Value> {
        debug_assert!(find(name).is_some(), "{name} is not declared in KEYS");
        debug_assert!(!self.read.contains(&name), "{name} is read twice");
        self.read.push(name);
        self.values.remove(name)
    }

    fn flag(&mut self, name: &'static str) -> bool {
        self.flag_if_set(name) == Some(true)
    }

    fn flag_if_set(&mut self, name: &'static str) -> Option<bool> {
        match self.take(name) {
            Some(Value::Bool(b)) => Some(b),
            _ => None,
        }
    }

    fn count(&mut self, name: &'static str) -> usize {
        self.count_if_set(name).unwrap_or(0)
    }

    fn count_if_set(&mut self, name: &'static str) -> Option<usize> {
        match self.take(name) {
            Some(Value::Count(n)) => Some(usize::try_from(n).unwrap_or(usize::MAX)),
            _ => None,
        }
    }

    fn count_u64(&mut self, name: &'static str) -> Option<u64> {
        match self.take(name) {
            Some(Value::Count(n)) => Some(n),
            _ => None,
        }
    }

    fn number(&mut self, name: &'static str) -> f64 {
        match self.take(name) {
            Some(Value::Number(x)) => x,
            _ => 0.0,
        }
    }

    fn text(&mut self, name: &'static str) -> Option<String> {
        match self.take(name) {
            Some(Value::Text(s)) => Some(s),
            _ => None,
        }
    }

    /// A text setting with a registry default: resolution always gives it a value.
    fn text_or_default(&mut self, name: &'static str) -> String {
        self.text(name)
            .unwrap_or_else(|| find(name).map_or("", |key| key.default).to_string())
    }

    fn path(&mut self, name: &'static str) -> Option<PathBuf> {
        self.text(name).map(PathBuf::from)
    }

    fn ids(&mut self, name: &'static str) -> Option<Vec<u32>> {
        match self.take(name) {
            Some(Value::Ids(ids)) => Some(ids),
            _ => None,
        }
    }
}

/// The settings of one run, typed: every key of [`KEYS`] parsed and checked once, before
/// anything is loaded, so that a typo in `BACKEND` or `PIN_RANK` stops the run at once.
/// Only what depends on the model (`ACT_BITS` against the widths, a `PIN` file's contents)
/// is checked where it is used. Fields are named after their keys.
#[derive(Clone)]
pub struct Settings {
    // What the run does.
    pub snap: Option<PathBuf>,
    /// `REF`: the oracle's reference JSON.
    pub reference: Option<PathBuf>,
    pub tf: bool,
    pub oracle_strict: bool,
    pub ids: Option<Vec<u32>>,
    pub ngen: usize,
    pub replay: bool,
    /// `BATCH`: sequences a `REPLAY=1` run decodes together.
    pub batch: usize,
    pub prompt: Option<String>,
    pub chat: bool,
    pub ppl: bool,
    pub ppl_file: Option<PathBuf>,
    pub ctx: usize,
    pub ppl_stride: usize,
    pub kld_base: Option<PathBuf>,
    pub long_context: bool,
    // Sampling and serving.
    /// `TEMP` as given: read by [`Settings::temperature`] only where a mode samples.
    temp: String,
    pub top_p: f64,
    /// `TOP_K`, `MIN_P` and the penalties, read by [`Settings::shaping`].
    top_k: usize,
    min_p: f64,
    presence_penalty: f64,
    frequency_penalty: f64,
    repetition_penalty: f64,
    pub seed: Option<u64>,
    /// `API_KEY`; an empty value is none.
    pub api_key: Option<String>,
    // The engine and where it computes.
    pub cap: usize,
    pub threads: usize,
    pub draft: Option<usize>,
    pub dsa_force: bool,
    /// `COLI_SIMD`, resolved against this CPU.
    pub simd: Isa,
    /// `ACT_BITS=8`: int8 activations asked for (32 or any width from 16: f32).
    pub int8_activations: bool,
    pub backend: backend::Choice,
    pub gpu_dense: bool,
    pub gpu_expert_gb: f64,
    /// `COLI_VK_DEVICE`, `COLI_VK_LOADER`, `COLI_VK_STAGED`.
    pub vulkan: VulkanOptions,
    // The expert store.
    pub ram_gb: f64,
    pub expert_io: ExpertIo,
    pub direct: Option<bool>,
    /// `IO_THREADS`, held to 1..=64.
    pub io_threads: usize,
    pub pilot: usize,
    /// `TRANSITIONS`.
    pub transitions: bool,
    pub expert_sharding: Sharding,
    /// `MPI_TIMEOUT`, in seconds (at least 1).
    pub mpi_timeout: u64,
    /// `COLI_POLICY`.
    pub policy: Policy,
    // The history, the trace and placement.
    /// `COLI_USAGE`: the history's path when not the snapshot's own.
    pub usage: Option<PathBuf>,
    pub usage_save: bool,
    /// `COLI_USAGE_DECAY`, in (0, 1].
    pub usage_decay: Decay,
    pub stats: Option<PathBuf>,
    pub route_trace: Option<PathBuf>,
    pub pin: PinSetting,
    pub pin_n: Option<usize>,
    pub pin_abstain: bool,
    pub pin_rank: PinRank,
    pub pin_gb: PinGb,
    pub autopin: bool,
    pub repin: u64,
    /// The settings given as arguments or in the environment, in [`KEYS`] order.
    given: Vec<Given>,
}

impl Settings {
    /// Resolve `arguments` (`KEY`, `VALUE` pairs) over the process's environment over
    /// defaults; an environment value that is not UTF-8 is refused by name.
    pub fn from_process(arguments: &[(String, String)]) -> Result<Settings> {
        let resolved = Resolved::resolve(arguments, |key| match std::env::var_os(key.name) {
            None => Ok(None),
            Some(raw) => raw
                .into_string()
                .map(Some)
                .map_err(|raw| SettingsError::NotUnicode {
                    key: key.name,
                    value: raw.to_string_lossy().into_owned(),
                }),
        })?;
        Settings::build(resolved)
    }

    /// Resolve `arguments` (`KEY`, `VALUE` pairs) over the environment `env` over defaults.
    pub fn resolve(
        arguments: &[(String, String)],
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings> {
        Settings::build(Resolved::resolve(arguments, |key| Ok(env(key.name)))?)
    }

    fn build(mut r: Resolved) -> Result<Settings> {
        let int8_activations = match r.count("ACT_BITS") {
            16.. => false,
            8 => true,
            other => bail!("ACT_BITS={other}: use 8 (int8 activations) or 32 (f32)"),
        };
        let usage_decay = r.number("COLI_USAGE_DECAY");
        if !(usage_decay > 0.0 && usage_decay <= 1.0) {
            bail!("setting COLI_USAGE_DECAY={usage_decay}: expected a factor in (0, 1]");
        }
        let settings = Settings {
            snap: r.path("SNAP"),
            reference: r.path("REF"),
            tf: r.flag("TF"),
            oracle_strict: r.flag("ORACLE_STRICT"),
            ids: r.ids("IDS"),
            ngen: r.count("NGEN"),
            replay: r.flag("REPLAY"),
            batch: r.count("BATCH"),
            prompt: r.text("PROMPT"),
            chat: r.flag("CHAT"),
            ppl: r.flag("PPL"),
            ppl_file: r.path("PPL_FILE"),
            ctx: r.count("CTX"),
            ppl_stride: r.count("PPL_STRIDE"),
            kld_base: r.path("KLD_BASE"),
            long_context: r.flag("LONG_CONTEXT"),
            temp: r.text_or_default("TEMP"),
            top_p: r.number("TOP_P"),
            top_k: r.count("TOP_K"),
            min_p: r.number("MIN_P"),
            presence_penalty: r.number("PRESENCE_PENALTY"),
            frequency_penalty: r.number("FREQUENCY_PENALTY"),
            repetition_penalty: r.number("REPETITION_PENALTY"),
            seed: r.count_u64("SEED"),
            api_key: r.text("API_KEY").filter(|key| !key.is_empty()),
            cap: r.count("CAP"),
            threads: r.count("THREADS"),
            draft: r.count_if_set("DRAFT"),
            dsa_force: r.flag("DSA_FORCE"),
            simd: Isa::from_setting(&r.text_or_default("COLI_SIMD"))?,
            int8_activations,
            backend: backend::Choice::from_setting(&r.text_or_default("BACKEND"))?,
            gpu_dense: r.flag("GPU_DENSE"),
            gpu_expert_gb: r.number("GPU_EXPERT_GB"),
            vulkan: VulkanOptions {
                device: r.count_if_set("COLI_VK_DEVICE"),
                loader: r.path("COLI_VK_LOADER"),
                staged: r.flag("COLI_VK_STAGED"),
            },
            ram_gb: r.number("RAM_GB"),
            expert_io: ExpertIo::from_setting(&r.text_or_default("EXPERT_IO"))?,
            direct: r.flag_if_set("DIRECT"),
            io_threads: r.count("IO_THREADS").clamp(1, 64),
            pilot: r.count("PILOT"),
            transitions: r.flag("TRANSITIONS"),
            expert_sharding: Sharding::from_setting(&r.text_or_default("EXPERT_SHARDING"))?,
            mpi_timeout: r.count("MPI_TIMEOUT").max(1) as u64,
            policy: Policy::from_setting(&r.text_or_default("COLI_POLICY"))?,
            usage: r.path("COLI_USAGE"),
            usage_save: r.flag("USAGE_SAVE"),
            usage_decay: Decay::new(usage_decay),
            stats: r.path("STATS"),
            route_trace: r.path("ROUTE_TRACE"),
            pin: PinSetting::from_setting(r.text("PIN").as_deref()),
            pin_n: r.count_if_set("PIN_N"),
            pin_abstain: r.flag("PIN_ABSTAIN"),
            pin_rank: PinRank::from_setting(r.text("PIN_RANK").as_deref())
                .map_err(anyhow::Error::msg)?,
            pin_gb: PinGb::from_setting(r.text("PIN_GB").as_deref())?,
            autopin: r.flag("AUTOPIN"),
            repin: r.count_u64("REPIN").unwrap_or(0),
            given: std::mem::take(&mut r.given),
        };
        debug_assert_eq!(r.read.len(), KEYS.len(), "every declared key is read");
        if settings.batch == 0 {
            bail!("BATCH=0: a replay decodes at least one sequence (BATCH=1, the default, is one)");
        }
        if settings.batch > 1 && !settings.replay {
            bail!("BATCH={}: only REPLAY=1 decodes sequences together (add REPLAY=1 and IDS=, or drop BATCH)", settings.batch);
        }
        Ok(settings)
    }

    /// The settings given as arguments or in the environment (not defaulted), in the order
    /// `coli settings` lists them.
    pub fn given(&self) -> &[Given] {
        &self.given
    }

    /// Whether `key` was given as a `KEY=VALUE` argument (or a flag that stands for it).
    pub fn argument(&self, key: &str) -> bool {
        self.given
            .iter()
            .any(|given| given.key == key && given.source == Source::Argument)
    }

    /// `SEED`, else a seed from the clock (the `[sample]` line shows it, so that a run can
    /// be repeated).
    pub fn seed_or_clock(&self) -> u64 {
        self.seed.unwrap_or_else(|| {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |elapsed| elapsed.as_nanos() as u64);
            nanos ^ u64::from(std::process::id()).rotate_left(32)
        })
    }

    /// `TEMP` as a temperature `>= 0` (0 = greedy). The setting is text so that a `TEMP`
    /// environment variable naming a temporary directory troubles only the modes that
    /// sample, where the message says how to override it.
    /// `TOP_K`, `MIN_P` and the penalties, checked (a value out of range names its key).
    pub fn shaping(&self) -> Result<Shaping> {
        let shaping = Shaping {
            top_k: self.top_k,
            min_p: self.min_p,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            logit_bias: Vec::new(),
        };
        shaping.check().map_err(|err| {
            let key = match &err {
                SamplingError::MinP(_) => "MIN_P",
                SamplingError::Penalty("presence_penalty", _) => "PRESENCE_PENALTY",
                SamplingError::Penalty(..) => "FREQUENCY_PENALTY",
                SamplingError::Repetition(_) => "REPETITION_PENALTY",
                _ => "sampling",
            };
            anyhow::anyhow!("{key}: {err}")
        })?;
        Ok(shaping)
    }

    pub fn temperature(&self) -> Result<f64> {
        let raw = self.temp.trim();
        match raw.parse::<f64>() {
            Ok(value) if value.is_finite() && value >= 0.0 => Ok(value),
            Ok(value) if value < 0.0 || !value.is_finite() => {
                bail!("TEMP={raw}: expected a finite temperature >= 0 (0 = greedy)")
            }
            _ => bail!(
                "TEMP={raw:?}: expected a temperature >= 0 (0 = greedy); if the environment's TEMP names a directory, pass TEMP=<number> as an argument, which wins"
            ),
        }
    }
}

fn find(name: &str) -> Option<&'static Key> {
    KEYS.iter().find(|key| key.name == name)
}

fn parse(kind: Kind, raw: &str) -> Option<Value> {
    let trimmed = raw.trim();
    match kind {
        Kind::Bool => match trimmed.to_ascii_lowercase().as_str() {
            "1" | "true" | "on" | "yes" => Some(Value::Bool(true)),
            "0" | "false" | "off" | "no" => Some(Value::Bool(false)),
            _ => None,
        },
        Kind::Count => trimmed.parse().ok().map(Value::Count),
        Kind::Number => trimmed
            .parse::<f64>()
            .ok()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .map(Value::Number),
        Kind::Path => (!trimmed.is_empty()).then(|| Value::Text(raw.to_string())),
        Kind::Text => Some(Value::Text(raw.to_string())),
        Kind::Ids => {
            let ids: Option<Vec<u32>> = trimmed
                .split(|c: char| c.is_whitespace() || c == ',')
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().ok())
                .collect();
            ids.filter(|ids| !ids.is_empty()).map(Value::Ids)
        }
    }
}

/// Names people bring from colibri and other tools, and where they point here.
const FOREIGN_NAMES: &[(&str, &str)] = &[
    ("EBITS", "EBITS is a positional, not a setting: `coli SNAP=<dir> CAP EBITS DBITS`, e.g. `64 8 8`"),
    ("DBITS", "DBITS is a positional, not a setting: `coli SNAP=<dir> CAP EBITS DBITS`, e.g. `64 8 8`"),
    ("MODEL", "the engine is chosen with `--model <engine>` before the settings (by default from config.json's model_type)"),
    ("ENGINE", "the engine is chosen with `--model <engine>` before the settings (by default from config.json's model_type)"),
    ("DECAY", "the history's decay is COLI_USAGE_DECAY"),
    ("USAGE_DECAY", "the history's decay is COLI_USAGE_DECAY"),
    ("NUCLEUS", "colibri's NUCLEUS is TOP_P here"),
    ("COLI_TEMP", "colibri's COLI_TEMP is TEMP here"),
    ("TEMPERATURE", "the sampling temperature is TEMP"),
    ("TOPK", "colibri's TOPK changes how many experts a token is routed to; coli has no routing overrides (a model routes as its config says; TOP_P is the sampling nucleus)"),
    ("TOPP", "colibri's TOPP changes routing, not sampling; coli has no routing overrides (TOP_P is the sampling nucleus)"),
    ("MAX_TOKENS", "the number of tokens to generate is NGEN"),
];

/// What to say about an unknown `name`: where a foreign name points, else the nearest key.
fn hint(name: &str) -> String {
    let upper = name.to_ascii_uppercase();
    match FOREIGN_NAMES.iter().find(|(foreign, _)| *foreign == upper) {
        Some((_, hint)) => hint.to_string(),
        None => format!("did you mean {}?", nearest(name)),
    }
}

/// The declared key closest to `name` by edit distance (case-insensitive).
fn nearest(name: &str) -> &'static str {
    let upper = name.to_ascii_uppercase();
    KEYS.iter()
        .min_by_key(|key| edit_distance(&upper, key.name))
        .map_or("SNAP", |key| key.name)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut previous = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = previous + usize::from(ca != cb);
            previous = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

/// The table `coli settings` prints, each column as wide as its widest entry.
pub fn table() -> String {
    let rows: Vec<[&str; 4]> = KEYS
        .iter()
        .map(|key| {
            let kind = match key.kind {
                Kind::Bool => "bool",
                Kind::Count => "integer",
                Kind::Number => "number",
                Kind::Path => "path",
                Kind::Ids => "ids",
                Kind::Text => "text",
            };
            let default = if key.default.is_empty() {
                "-"
            } else {
                key.default
            };
            [key.name, kind, default, key.doc]
        })
        .collect();
    let header = ["KEY", "TYPE", "DEFAULT", "DESCRIPTION"];
    let width = |column: usize| {
        rows.iter()
            .chain([&header])
            .map(|row| row[column].chars().count())
            .max()
            .unwrap_or(0)
    };
    let (key_width, kind_width, default_width) = (width(0), width(1), width(2));
    let mut out = String::new();
    for [name, kind, default, doc] in std::iter::once(&header).chain(&rows) {
        out.push_str(&format!(
            "{name:<key_width$} {kind:<kind_width$} {default:<default_width$} {doc}\n"
        ));
    }
    out.push_str("\nEvery KEY may be given as a KEY=VALUE argument or as an environment variable; the argument wins.\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(given: &[(&str, &str)]) -> Vec<(String, String)> {
        given
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn the_typed_settings_read_every_declared_key_with_its_default() {
        let resolved = Resolved::resolve(&[], |_| Ok(None)).unwrap();
        let settings = Settings::build(resolved).unwrap();
        assert_eq!(settings.ngen, 32);
        assert_eq!(settings.ctx, 512);
        assert_eq!(settings.io_threads, 4);
        assert_eq!(settings.backend, backend::Choice::Cpu);
        assert_eq!(settings.expert_io, ExpertIo::Auto);
        assert_eq!(settings.policy, Policy::Lru);
        assert_eq!(settings.pin, PinSetting::Unset);
        assert_eq!(settings.pin_gb, PinGb::Gb(10.0));
        assert_eq!(settings.temperature().unwrap(), 0.7);
        assert!(settings.usage_save && settings.autopin && settings.pin_abstain);
        assert!(!settings.int8_activations);
        assert!(settings.snap.is_none() && settings.seed.is_none());
        assert_eq!(settings.vulkan, VulkanOptions::default());
    }

    #[test]
    fn the_vulkan_settings_come_from_their_environment_variables() {
        let env = |name: &str| match name {
            "COLI_VK_DEVICE" => Some("1".to_string()),
            "COLI_VK_LOADER" => Some("/opt/vulkan/libvulkan.so.1".to_string()),
            "COLI_VK_STAGED" => Some("1".to_string()),
            _ => None,
        };
        let settings = Settings::resolve(&[], env).unwrap();
        assert_eq!(
            settings.vulkan,
            VulkanOptions {
                device: Some(1),
                loader: Some(PathBuf::from("/opt/vulkan/libvulkan.so.1")),
                staged: true,
            }
        );
        let err = Settings::resolve(&pairs(&[("COLI_VK_DEVICE", "first")]), no_env)
            .err()
            .unwrap();
        assert!(matches!(
            err.downcast_ref::<SettingsError>(),
            Some(SettingsError::BadValue {
                key: "COLI_VK_DEVICE",
                ..
            })
        ));
    }

    #[test]
    fn a_bad_choice_is_refused_when_the_settings_are_resolved() {
        for (key, value, says) in [
            ("BACKEND", "vulcan", "expected cpu, vulkan, cuda or auto"),
            ("EXPERT_IO", "nmap", "expected auto, mmap, pread or direct"),
            ("COLI_POLICY", "lfu", "expected lru or lfru"),
            ("COLI_SIMD", "sse", "expected auto, scalar"),
            ("PIN_RANK", "hot", "expected lifetime, recent or blend"),
            ("PIN_GB", "lots", "expected a number of gigabytes or `all`"),
            ("ACT_BITS", "4", "use 8 (int8 activations) or 32"),
            ("COLI_USAGE_DECAY", "2", "expected a factor in (0, 1]"),
        ] {
            let err = Settings::resolve(&pairs(&[(key, value)]), no_env)
                .err()
                .unwrap_or_else(|| panic!("{key}={value} was accepted"));
            assert!(err.to_string().contains(says), "{key}: {err}");
        }
        let chosen = Settings::resolve(
            &pairs(&[("BACKEND", "Vulkan"), ("PIN", "auto"), ("ACT_BITS", "8")]),
            no_env,
        )
        .unwrap();
        assert_eq!(chosen.backend, backend::Choice::Vulkan);
        assert_eq!(chosen.pin, PinSetting::Auto);
        assert!(chosen.int8_activations);
    }

    #[test]
    fn temp_is_read_only_where_a_mode_samples() {
        // An environment TEMP naming a directory resolves; only sampling refuses it.
        let env = |name: &str| (name == "TEMP").then(|| "/tmp".to_string());
        let settings = Settings::resolve(&[], env).unwrap();
        let err = settings.temperature().unwrap_err().to_string();
        assert!(err.contains("pass TEMP=<number> as an argument"), "{err}");
        let given = Settings::resolve(&pairs(&[("TEMP", "0")]), env).unwrap();
        assert_eq!(given.temperature().unwrap(), 0.0);
        for bad in ["-1", "inf", "nan"] {
            let settings = Settings::resolve(&pairs(&[("TEMP", bad)]), no_env).unwrap();
            assert!(settings.temperature().is_err(), "TEMP={bad}");
        }
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    #[test]
    fn every_default_parses() {
        for key in KEYS.iter().filter(|k| !k.default.is_empty()) {
            assert!(parse(key.kind, key.default).is_some(), "{}", key.name);
        }
    }

    #[test]
    fn argument_beats_environment_beats_default() {
        let env = |name: &str| (name == "NGEN" || name == "TF").then(|| "7".to_string());
        let args = pairs(&[("NGEN", "3")]);
        let err = Settings::resolve(&args, env).err().unwrap();
        // TF=7 from the environment is not a boolean.
        assert!(matches!(
            err.downcast_ref::<SettingsError>(),
            Some(SettingsError::BadValue { key: "TF", .. })
        ));
        let env = |name: &str| (name == "NGEN" || name == "TF").then(|| "1".to_string());
        let settings = Settings::resolve(&args, env).unwrap();
        assert_eq!(settings.ngen, 3);
        assert!(settings.tf);
        let defaults = Settings::resolve(&[], no_env).unwrap();
        assert_eq!(defaults.ngen, 32);
        assert!(defaults.snap.is_none());
    }

    #[test]
    fn given_lists_arguments_and_environment_but_no_default() {
        let env = |name: &str| (name == "TOP_P").then(|| "0.5".to_string());
        let settings = Settings::resolve(&pairs(&[("NGEN", "3")]), env).unwrap();
        assert_eq!(
            settings.given(),
            [
                Given {
                    key: "NGEN",
                    value: "3".into(),
                    source: Source::Argument
                },
                Given {
                    key: "TOP_P",
                    value: "0.5".into(),
                    source: Source::Environment
                },
            ]
        );
        assert!(settings.argument("NGEN"));
        assert!(!settings.argument("TOP_P") && !settings.argument("CTX"));
    }

    #[test]
    fn unknown_key_names_the_nearest() {
        let err = Settings::resolve(&pairs(&[("NGNE", "3")]), no_env)
            .err()
            .unwrap();
        assert_eq!(
            err.downcast_ref::<SettingsError>(),
            Some(&SettingsError::UnknownKey {
                key: "NGNE".into(),
                hint: "did you mean NGEN?".into()
            })
        );
        assert_eq!(nearest("snap"), "SNAP");
        assert!(hint("EBITS").contains("positional"));
        assert!(hint("model").contains("--model"));
        assert!(hint("DECAY").contains("COLI_USAGE_DECAY"));
        assert!(hint("NUCLEUS").contains("TOP_P"));
    }

    #[test]
    fn ids_and_numbers_parse_strictly() {
        assert_eq!(parse(Kind::Ids, "1, 2 3"), Some(Value::Ids(vec![1, 2, 3])));
        assert_eq!(parse(Kind::Ids, "1 x"), None);
        assert_eq!(parse(Kind::Count, "-1"), None);
        assert_eq!(parse(Kind::Number, "nan"), None);
        assert_eq!(parse(Kind::Number, "2.5"), Some(Value::Number(2.5)));
    }
}
