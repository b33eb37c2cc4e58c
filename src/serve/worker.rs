//! The engine thread of `coli serve` and `coli chat`: it loads the model, then runs the
//! [`Scheduler`] over the queue of jobs until it closes, and ends as a run ends (history,
//! `STATS`, trace). The engine and telemetry live on this thread only (the HTTP side
//! gets a [`Texts`] to count and read tokens without the engine). Also the
//! jobs and events the HTTP side exchanges with it, and the stop-string scan.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use tokio::sync::mpsc::{Receiver, UnboundedSender};

use super::api::{ApiError, Finish, Input, Routed, TokenLogprob, Tools, Usage};
use super::kv_dir::{KvDir, KvIdentity};
use super::metrics::Metrics;
use super::routing::{Feed, Routing};
use super::scheduler::Scheduler;
use crate::engines::PromptConvention;
use crate::experts::budget;
use crate::guide::Grammar;
use crate::quant::Width;
use crate::sampling::Shaping;
use crate::session::RunKind;
use crate::settings::Settings;
use crate::startup::{self, Positionals};
use crate::text::tool_calls::ParsedCall;
use crate::text::{TextModel, TextTokenizer};

/// One generation asked for (of one choice or more).
#[derive(Clone)]
pub struct Job {
    pub input: Input,
    pub max_tokens: Option<usize>,
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    pub stop: Vec<String>,
    /// Return, per generated token, the experts each MoE layer chose.
    pub routed_experts: bool,
    /// A `max_tokens` beyond the context is cut to what fits (Anthropic's clients send a
    /// large one with every request), not refused.
    pub clamp_tokens: bool,
    /// `n`: the choices, each generated from the one prompt's state with the seed
    /// `seed + index`; the request takes as many of the `--parallel` places.
    pub choices: usize,
    /// `top_k`, `min_p`, the penalties and `logit_bias`.
    pub shaping: Shaping,
    /// Log-probabilities of the chosen tokens with this many alternatives.
    pub logprobs: Option<usize>,
    /// How the answer calls the conversation's tools, if it may.
    pub tools: Option<Tools>,
    /// What the answer must match.
    pub grammar: Option<Grammar>,
    /// Thinking asked for, with at most this many tokens of it.
    pub thinking_budget: Option<usize>,
    /// The prompt's text (with `logprobs`, its tokens' log-probabilities) before the answer.
    pub echo: bool,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

/// What the engine thread tells a request's handler, in this order: `Failed`, or
/// `Started`, then for each choice (`choice` is its index; choices interleave) any number
/// of `Text` and its `Done`; a `Failed` after `Started` ends the whole request.
#[derive(Debug)]
pub enum Event {
    Failed(ApiError),
    /// With the prompt's tokens, and those a kept state held.
    Started(Usage),
    /// Text of the choice, with the log-probabilities (when asked) of the tokens chosen
    /// since its last `Text`.
    Text {
        choice: usize,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// Reasoning of the choice: what it wrote in its thinking block.
    Reasoning {
        choice: usize,
        text: String,
    },
    /// A call of a tool the choice made (its text in no `Text`).
    Call {
        choice: usize,
        call: ParsedCall,
    },
    Done {
        choice: usize,
        finish: Finish,
        usage: Usage,
        routed: Option<Routed>,
        /// Those of the last tokens, whose text came in no `Text`.
        logprobs: Vec<TokenLogprob>,
        /// Seconds from the request's arrival to its first token.
        first_token: Option<f64>,
        /// Tokens a second after the first.
        decode_rate: Option<f64>,
    },
}

/// What the HTTP side needs to turn text into the model's ids and back as the engine
/// thread does (`/tokenize`, `/detokenize`, `count_tokens`): the tokenizer and what
/// [`TextModel`] reads of the model.
#[derive(Clone)]
pub struct Texts {
    pub tokenizer: Arc<TextTokenizer>,
    pub dir: PathBuf,
    pub config: Arc<serde_json::Value>,
    pub engine: &'static str,
    pub convention: PromptConvention,
    /// The engine's `vocab_size`: ids at or beyond it are not the model's.
    pub vocab: usize,
}

impl Texts {
    pub fn model(&self) -> TextModel<'_> {
        TextModel {
            tokenizer: &self.tokenizer,
            dir: &self.dir,
            config: &self.config,
            engine: self.engine,
            convention: self.convention,
        }
    }
}

impl std::fmt::Debug for Texts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Texts({})", self.tokenizer.path().display())
    }
}

/// What the loaded model is, for `/v1/models` and request checks.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id requests name: the model directory's name.
    pub id: String,
    pub engine: &'static str,
    /// The positions a request may use: `max_position_embeddings` of the text config, unless
    /// `LONG_CONTEXT=1` ([`startup::context_limit`]).
    pub context: Option<usize>,
    pub texts: Texts,
    /// The engine's routing as `GET /routing` streams it.
    pub routing: Routing,
}

/// How the engine thread serves: `--parallel`, `--prefill-chunk`, `--cache-mb`.
#[derive(Debug, Clone)]
pub struct Serving {
    pub parallel: usize,
    pub prefill_chunk: usize,
    /// Bytes of kept conversation states; `None`: half of what the expert store leaves
    /// beside its slots for the rest of the run ([`budget::reserve`]).
    pub cache_bytes: Option<u64>,
    /// `--kv-dir` and `--kv-dir-mb`: where kept states go when evicted and at shutdown,
    /// and the bytes its files of this model may take.
    pub kv_dir: Option<(PathBuf, u64)>,
    /// Who the engine thread serves, which its messages on stderr begin with.
    pub front: Front,
}

/// Who the engine thread serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// `coli serve`: HTTP clients.
    Server,
    /// `coli chat`: a person at a terminal.
    Chat,
}

impl Front {
    /// What the engine thread's messages begin with.
    pub fn tag(self) -> &'static str {
        match self {
            Front::Server => "[serve]",
            Front::Chat => "[chat]",
        }
    }
}

impl Serving {
    /// One conversation at a time (`coli chat`), with the default cache.
    pub fn chat() -> Serving {
        Serving {
            parallel: 1,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
            cache_bytes: None,
            kv_dir: None,
            front: Front::Chat,
        }
    }

    fn cache_bytes(&self, settings: &Settings) -> u64 {
        self.cache_bytes
            .unwrap_or_else(|| budget::reserve(budget::Budget::detect(settings.ram_gb).bytes) / 2)
    }
}

/// Prompt tokens a step feeds when `--prefill-chunk` is not given.
pub const DEFAULT_PREFILL_CHUNK: usize = 512;

/// Load the model on this thread and report it on `ready`, then serve `jobs` until the
/// queue closes; the end of the run (history, `STATS`, trace) follows, as a run's does.
fn run(
    model: Option<String>,
    settings: Settings,
    positionals: Positionals,
    serving: Serving,
    mut jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    ready: std::sync::mpsc::Sender<Result<ModelInfo>>,
) -> ExitCode {
    let tag = serving.front.tag();
    let loaded = (|| -> Result<_> {
        let (snapshot, name) = startup::open(model.as_deref(), &settings)?;
        let tokenizer = Arc::new(TextTokenizer::load(snapshot.dir())?);
        // Checked before minutes of loading: a directory that cannot be used.
        let disk = match &serving.kv_dir {
            Some((dir, limit)) => {
                let dense = Width::from_bits(positionals.dense_bits).context("DBITS")?;
                let experts = Width::from_bits(positionals.expert_bits).context("EBITS")?;
                let identity = KvIdentity::of(&snapshot, name, dense, experts)?;
                let (disk, notes) = KvDir::open(dir, *limit, identity)?;
                for note in notes {
                    eprintln!("{tag} --kv-dir {note}");
                }
                eprintln!(
                    "{tag} --kv-dir {}: {} kept states of this model, {:.1} MB",
                    dir.display(),
                    disk.entries(),
                    disk.bytes() as f64 / 1e6
                );
                Some(disk)
            }
            None => None,
        };
        let loaded = startup::load(&settings, positionals, &snapshot, name)?;
        loaded.print_banner(true);
        let session =
            loaded.start_session(&settings, &snapshot, RunKind::Generating, |_| Ok(()))?;
        Ok((snapshot, name, tokenizer, loaded.engine, session, disk))
    })();
    let (snapshot, name, tokenizer, engine, mut session, disk) = match loaded {
        Ok(parts) => parts,
        Err(err) => {
            let _ = ready.send(Err(err));
            return ExitCode::from(2);
        }
    };
    let (feed, routing) = Feed::new(engine.as_ref());
    let info = ModelInfo {
        id: model_id(snapshot.dir()),
        engine: name,
        context: startup::context_limit(&snapshot, &settings),
        texts: Texts {
            tokenizer: tokenizer.clone(),
            dir: snapshot.dir().to_path_buf(),
            config: Arc::new(snapshot.config_json().clone()),
            engine: engine.name(),
            convention: engine.prompt_convention(),
            vocab: engine.vocab_size(),
        },
        routing,
    };
    if ready.send(Ok(info.clone())).is_err() {
        return ExitCode::from(2);
    }
    let cache_bytes = serving.cache_bytes(&settings);
    // A chat runs one conversation, with none of the flags this line speaks of.
    if serving.front == Front::Server {
        eprintln!(
            "{tag} up to {} sequences a step, prompts fed {} tokens a step, {:.0} MB of kept conversation states{}",
            serving.parallel,
            serving.prefill_chunk,
            cache_bytes as f64 / 1e6,
            if serving.cache_bytes.is_none() {
                " (half the memory the expert store leaves for the rest of the run; --cache-mb sets it)"
            } else {
                ""
            }
        );
    }
    let mut scheduler = match Scheduler::new(
        engine.as_ref(),
        &tokenizer,
        &snapshot,
        info.context,
        &metrics,
        settings.ngen,
        &serving,
        cache_bytes,
        disk,
        feed,
    ) {
        Ok(scheduler) => scheduler,
        Err(err) => {
            eprintln!("{tag} {err:#}");
            return ExitCode::from(2);
        }
    };
    scheduler.serve(&mut jobs, &mut session);
    match serving.front {
        Front::Server => eprintln!("{tag} queue closed; saving"),
        Front::Chat => crate::note!("{tag} saving"),
    }
    // Every turn saved its selections; saving again would decay the history once more.
    let kind = if engine.routed().telemetry.unsaved_selections() > 0 {
        RunKind::Generating
    } else {
        RunKind::Scoring
    };
    session.finish(engine.as_ref(), kind)
}

/// The id `/v1/models` lists: the model directory's last component.
fn model_id(dir: &Path) -> String {
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    canonical
        .file_name()
        .map_or_else(|| "model".to_string(), |n| n.to_string_lossy().into_owned())
}

/// Generated text on its way out, held back while it could still become one of the
/// request's stop strings; cut before the first stop string found.
pub struct StopScan {
    stops: Vec<String>,
    /// Text not handed out yet.
    pending: String,
    longest: usize,
    /// The index of the stop string met, once one is.
    matched: Option<usize>,
}

impl StopScan {
    pub fn new(stops: Vec<String>) -> StopScan {
        StopScan {
            longest: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            pending: String::new(),
            matched: None,
        }
    }

    /// Which of the request's stop strings ended the text, if one did.
    pub fn matched(&self) -> Option<usize> {
        self.matched
    }

    /// Add `piece`; returns the text safe to hand out and whether a stop string was met
    /// (the text then ends before it, and nothing more is to be sent).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| self.pending.find(stop.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, index)) = found {
            self.matched = Some(index);
            let ready = self.pending[..at].to_string();
            self.pending.clear();
            return (ready, true);
        }
        // Keep the longest tail that could still start a stop string.
        let mut keep_from = self
            .pending
            .len()
            .saturating_sub(self.longest.saturating_sub(1));
        while !self.pending.is_char_boundary(keep_from) {
            keep_from -= 1;
        }
        let ready = self.pending[..keep_from].to_string();
        self.pending.drain(..keep_from);
        (ready, false)
    }

    /// Whatever is held back, at the end of the generation.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Start the engine thread; returns its handle and the model it loaded (or why it could
/// not).
pub fn spawn(
    model: Option<String>,
    settings: Settings,
    positionals: Positionals,
    serving: Serving,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
) -> Result<(std::thread::JoinHandle<ExitCode>, ModelInfo)> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("coli-engine".to_string())
        .spawn(move || {
            run(
                model,
                settings,
                positionals,
                serving,
                jobs,
                metrics,
                ready_tx,
            )
        })
        .context("cannot start the engine thread")?;
    match ready_rx.recv() {
        Ok(Ok(info)) => Ok((handle, info)),
        Ok(Err(err)) => {
            let _ = handle.join();
            Err(err)
        }
        Err(_) => {
            let _ = handle.join();
            anyhow::bail!("the engine thread stopped while loading the model")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let stops = vec!["END".to_string()];
        let mut scan = StopScan::new(stops.clone());
        assert_eq!(scan.push("hello E"), ("hello".to_string(), false));
        assert_eq!(scan.push("N"), (" ".to_string(), false));
        assert_eq!(scan.push("Dless"), (String::new(), true));
        let mut scan = StopScan::new(stops.clone());
        assert_eq!(scan.push("ab"), (String::new(), false));
        assert_eq!(scan.push("c"), ("a".to_string(), false));
        assert_eq!(scan.flush(), "bc");
        let mut scan = StopScan::new(Vec::new());
        assert_eq!(scan.push("é!"), ("é!".to_string(), false));
        let mut scan = StopScan::new(stops.clone());
        // A multi-byte character is never split.
        assert_eq!(scan.push("éa"), (String::new(), false));
    }
}
