//! The engine thread of `coli serve`: it loads the model, then takes one job at a time from
//! the queue (first come, first served), generates, streams the text back as events, and
//! saves the history after every turn. The engine, tokenizer and telemetry live here only.
//!
//! KV reuse: the thread remembers which token ids the engine's KV cache holds. A prompt
//! that starts with all of them (a conversation's next turn: the earlier prompt, the answer
//! and the new message) prefills only the rest; any other prompt starts from an empty
//! cache. The cached positions hold what a fresh prefill computes, except that on the
//! latent-attention engines (GLM-5.2, Kimi K3) the answer's positions came from the decode
//! path, whose sums are ordered differently: equal up to rounding.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use tokio::sync::mpsc::{Receiver, UnboundedSender};

use super::api::{ApiError, Finish, Input, Routed, Usage};
use super::metrics::{Metrics, Turn};
use crate::engines::{Engine, State};
use crate::generate::{generate_after, Ending, Flow, Policy};
use crate::sampling::Sampler;
use crate::session::{RunKind, Session};
use crate::settings::Settings;
use crate::snapshot::Snapshot;
use crate::startup::{self, Positionals};
use crate::text::{TextModel, TextTokenizer};

/// One generation asked for.
pub struct Job {
    pub input: Input,
    pub max_tokens: Option<usize>,
    pub temperature: f64,
    pub top_p: f64,
    pub seed: u64,
    pub stop: Vec<String>,
    /// Return, per generated token, the experts each MoE layer chose.
    pub routed_experts: bool,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

/// What the engine thread tells a request's handler, in this order: `Failed`, or
/// `Started`, any number of `Text`, then `Done`.
#[derive(Debug)]
pub enum Event {
    Failed(ApiError),
    Started,
    Text(String),
    Done {
        finish: Finish,
        usage: Usage,
        routed: Option<Routed>,
    },
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
}

/// Load the model on this thread and report it on `ready`, then serve `jobs` until the
/// queue closes; the end of the run (history, `STATS`, trace) follows, as a run's does.
pub fn run(
    model: Option<String>,
    settings: Settings,
    positionals: Positionals,
    mut jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    ready: std::sync::mpsc::Sender<Result<ModelInfo>>,
) -> ExitCode {
    let loaded = (|| -> Result<_> {
        let (snapshot, name) = startup::open(model.as_deref(), &settings)?;
        let tokenizer = TextTokenizer::load(snapshot.dir())?;
        let loaded = startup::load(&settings, positionals, &snapshot, name)?;
        loaded.print_banner(true);
        let session =
            loaded.start_session(&settings, &snapshot, RunKind::Generating, |_| Ok(()))?;
        Ok((snapshot, name, tokenizer, loaded.engine, session))
    })();
    let (snapshot, name, tokenizer, engine, mut session) = match loaded {
        Ok(parts) => parts,
        Err(err) => {
            let _ = ready.send(Err(err));
            return ExitCode::from(2);
        }
    };
    let info = ModelInfo {
        id: model_id(snapshot.dir()),
        engine: name,
        context: startup::context_limit(&snapshot, &settings),
    };
    if ready.send(Ok(info.clone())).is_err() {
        return ExitCode::from(2);
    }
    let mut worker = Worker {
        snapshot: &snapshot,
        tokenizer: &tokenizer,
        info,
        default_tokens: settings.ngen,
        cached: Vec::new(),
        state: engine.new_state(),
    };
    while let Some(job) = jobs.blocking_recv() {
        metrics.queue(-1, 1);
        let events = job.events.clone();
        // A panic in one generation answers that request and leaves the server serving.
        let turn = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            worker.turn(engine.as_ref(), &mut session, job)
        }))
        .unwrap_or_else(|_| {
            worker.forget(engine.as_ref());
            let _ = events.send(Event::Failed(ApiError::server(
                500,
                "the generation failed (the engine's KV cache was reset)",
            )));
            None
        });
        if let Some(turn) = turn {
            // A turn that routed nothing (its client left while it waited) saves nothing,
            // so it cannot decay the history.
            if engine.routed().telemetry.unsaved_selections() > 0 {
                session.save_turn(engine.as_ref());
            }
            let pinned = engine.routed().pinned().iter().map(Vec::len).sum();
            metrics.turn(&turn, engine.cache_stats(), pinned);
        }
        metrics.queue(0, -1);
    }
    eprintln!("[serve] queue closed; saving");
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

struct Worker<'a> {
    snapshot: &'a Snapshot,
    tokenizer: &'a TextTokenizer,
    info: ModelInfo,
    /// `max_tokens` when a request gives none: `NGEN`.
    default_tokens: usize,
    /// The token ids `state` holds, in order.
    cached: Vec<u32>,
    /// The conversation kept from the last turn.
    state: State,
}

impl Worker<'_> {
    /// Keep nothing from earlier turns.
    fn forget(&mut self, engine: &dyn Engine) {
        self.cached.clear();
        self.state = engine.new_state();
    }

    /// One job: its prompt checked, generated, streamed. `None` when it failed before a
    /// token was generated (the handler got `Failed`).
    fn turn(&mut self, engine: &dyn Engine, session: &mut Session, job: Job) -> Option<Turn> {
        let events = job.events.clone();
        match self.generate(engine, session, job) {
            Ok(turn) => Some(turn),
            Err(Failure::Request(err)) => {
                let _ = events.send(Event::Failed(err));
                None
            }
            Err(Failure::Engine(err)) => {
                eprintln!("[serve] generation failed: {err:#}");
                // What the state holds is unknown now.
                self.forget(engine);
                let _ = events.send(Event::Failed(ApiError::server(
                    500,
                    format!("generation failed: {err:#}"),
                )));
                None
            }
        }
    }

    fn prompt_ids(&self, engine: &dyn Engine, input: &Input) -> Result<Vec<u32>, Failure> {
        let model = TextModel::new(self.tokenizer, self.snapshot, engine);
        let ids = match input {
            Input::Chat(messages) => model.chat_prompt(messages).map(|p| p.ids),
            Input::Text(text) => model.prompt(text, false).map(|p| p.ids),
            Input::Ids(ids) => Ok(ids.clone()),
        }
        .map_err(|err| Failure::Request(ApiError::invalid(format!("{err:#}"))))?;
        let vocab = engine.vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Failure::Request(ApiError::invalid(format!(
                "prompt token id {bad} is outside the model's vocabulary (vocab_size {vocab})"
            ))));
        }
        if ids.is_empty() {
            return Err(Failure::Request(ApiError::invalid(
                "the prompt encodes to no tokens; give some text",
            )));
        }
        Ok(ids)
    }

    fn generate(
        &mut self,
        engine: &dyn Engine,
        session: &mut Session,
        job: Job,
    ) -> Result<Turn, Failure> {
        let prompt = self.prompt_ids(engine, &job.input)?;
        let room = self
            .info
            .context
            .map_or(usize::MAX, |c| c.saturating_sub(prompt.len()));
        if room == 0 {
            return Err(Failure::Request(context_error(format!(
                "the prompt takes {} tokens, the model's whole context of {} (max_position_embeddings in config.json)",
                prompt.len(),
                self.info.context.unwrap_or(0)
            ))));
        }
        let count = match job.max_tokens {
            Some(n) if n > room => {
                return Err(Failure::Request(context_error(format!(
                    "max_tokens {n}: the prompt takes {} of the model's {} positions (max_position_embeddings in config.json), so at most {room} tokens can follow",
                    prompt.len(),
                    self.info.context.unwrap_or(0)
                ))))
            }
            Some(n) => n,
            None => self.default_tokens.min(room),
        };
        let mut sampler = Sampler::new(job.temperature, job.top_p, job.seed)
            .map_err(|err| Failure::Request(ApiError::invalid(err.to_string())))?;
        let model = TextModel::new(self.tokenizer, self.snapshot, engine);
        let stops = model
            .stop_ids(engine.stop_tokens())
            .map_err(Failure::Engine)?;

        let common = self
            .cached
            .iter()
            .zip(&prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let reuse =
            common == self.cached.len() && common < prompt.len() && self.state.position() == common;
        if !reuse {
            self.forget(engine);
        }
        let reused = self.state.position();
        if job.events.send(Event::Started).is_err() {
            // The client left while queued.
            return Ok(Turn {
                prompt_tokens: 0,
                cached_tokens: 0,
                completion_tokens: 0,
                first_token_seconds: None,
                decode_rate: None,
                abandoned: true,
            });
        }

        engine.routed().telemetry.keep_routes(job.routed_experts);
        let mut routed: Routed = Vec::new();
        let mut text = StopScan::new(&job.stop);
        let mut stream = self.tokenizer.stream();
        let mut first_token = None;
        let mut abandoned = false;
        let mut stopped_by_text = false;
        let generation = {
            let mut on_token = |token: u32| -> Result<Flow> {
                first_token.get_or_insert_with(|| job.received.elapsed().as_secs_f64());
                if job.events.is_closed() {
                    abandoned = true;
                    return Ok(Flow::Halt);
                }
                let Some(piece) = stream.step(token)? else {
                    return Ok(Flow::Continue);
                };
                let (ready, stopped) = text.push(&piece);
                if !ready.is_empty() && job.events.send(Event::Text(ready)).is_err() {
                    abandoned = true;
                    return Ok(Flow::Halt);
                }
                if stopped {
                    stopped_by_text = true;
                    return Ok(Flow::Halt);
                }
                Ok(Flow::Continue)
            };
            // The token a forward's row chose was computed by that row's experts: the last
            // row of the prefill, then the rows of each later forward in order.
            let mut prefill = true;
            let mut on_tokens = |engine: &dyn Engine, emitted: u64| {
                if let Some(routes) = engine.routed().telemetry.last_routes() {
                    if std::mem::replace(&mut prefill, false) {
                        routed.push(routes.row(routes.rows().saturating_sub(1)));
                    } else {
                        routed.extend((0..emitted as usize).map(|row| routes.row(row)));
                    }
                }
                session.after_tokens(engine, emitted)
            };
            let policy = Policy {
                count,
                sampler: &mut sampler,
                stops: &stops,
            };
            let result = generate_after(
                engine,
                &mut self.state,
                &prompt,
                policy,
                &mut on_tokens,
                &mut on_token,
            );
            match result {
                Ok(generation) => generation,
                Err(err) => {
                    engine.routed().telemetry.keep_routes(false);
                    return Err(Failure::Engine(err));
                }
            }
        };
        engine.routed().telemetry.keep_routes(false);
        // What the state holds now: the prompt and the generated tokens it has seen.
        let mut held = prompt.clone();
        held.extend_from_slice(&generation.tokens);
        if self.state.position() <= held.len() {
            held.truncate(self.state.position());
            self.cached = held;
        } else {
            self.forget(engine);
        }
        if !stopped_by_text && !abandoned {
            let rest = stream.finish().map_err(Failure::Engine)?;
            let (ready, stopped) = text.push(&rest);
            stopped_by_text = stopped;
            let tail = if stopped {
                ready
            } else {
                ready + &text.flush()
            };
            if !tail.is_empty() {
                let _ = job.events.send(Event::Text(tail));
            }
        }
        let finish = match generation.ending {
            Ending::Limit if !stopped_by_text => Finish::Length,
            _ => Finish::Stop,
        };
        let usage = Usage {
            prompt: prompt.len(),
            completion: generation.tokens.len(),
            cached: reused,
        };
        let routed = job.routed_experts.then_some(routed);
        let _ = job.events.send(Event::Done {
            finish,
            usage,
            routed,
        });
        Ok(Turn {
            prompt_tokens: usage.prompt,
            cached_tokens: usage.cached,
            completion_tokens: usage.completion,
            first_token_seconds: first_token,
            decode_rate: (generation.tokens.len() > 1)
                .then(|| generation.decode_tokens_per_second()),
            abandoned,
        })
    }
}

fn context_error(message: String) -> ApiError {
    ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(message)
    }
}

enum Failure {
    /// The request cannot be served as asked (HTTP 400).
    Request(ApiError),
    /// The engine failed (HTTP 500).
    Engine(anyhow::Error),
}

/// Generated text on its way out, held back while it could still become one of the
/// request's stop strings; cut before the first stop string found.
struct StopScan<'a> {
    stops: &'a [String],
    /// Text not handed out yet.
    pending: String,
    longest: usize,
}

impl<'a> StopScan<'a> {
    fn new(stops: &'a [String]) -> StopScan<'a> {
        StopScan {
            stops,
            pending: String::new(),
            longest: stops.iter().map(String::len).max().unwrap_or(0),
        }
    }

    /// Add `piece`; returns the text safe to hand out and whether a stop string was met
    /// (the text then ends before it, and nothing more is to be sent).
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let found = self
            .stops
            .iter()
            .filter_map(|stop| self.pending.find(stop.as_str()))
            .min();
        if let Some(at) = found {
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
    fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Start the engine thread; returns its handle and the model it loaded (or why it could
/// not).
pub fn spawn(
    model: Option<String>,
    settings: Settings,
    positionals: Positionals,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
) -> Result<(std::thread::JoinHandle<ExitCode>, ModelInfo)> {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name("coli-engine".to_string())
        .spawn(move || run(model, settings, positionals, jobs, metrics, ready_tx))
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
        let mut scan = StopScan::new(&stops);
        assert_eq!(scan.push("hello E"), ("hello".to_string(), false));
        assert_eq!(scan.push("N"), (" ".to_string(), false));
        assert_eq!(scan.push("Dless"), (String::new(), true));
        let mut scan = StopScan::new(&stops);
        assert_eq!(scan.push("ab"), (String::new(), false));
        assert_eq!(scan.push("c"), ("a".to_string(), false));
        assert_eq!(scan.flush(), "bc");
        let none: Vec<String> = Vec::new();
        let mut scan = StopScan::new(&none);
        assert_eq!(scan.push("é!"), ("é!".to_string(), false));
        let mut scan = StopScan::new(&stops);
        // A multi-byte character is never split.
        assert_eq!(scan.push("éa"), (String::new(), false));
    }
}
