//! The scheduler on the engine thread of `coli serve` and `coli chat`: up to `parallel`
//! sequences are active; each step is one batched forward over every decoding sequence's
//! next token (with its drafts, on an engine that drafts) and one chunk of at most
//! `prefill_chunk` tokens of one prompt being filled, so a long prompt holds the others up
//! by one chunk at a time. Requests join at the next step and leave (finished, stopped,
//! disconnected) at the end of the step that ended them; each samples with its own
//! settings and seed. A sequence computes the bits it computes alone ([`Engine::forward`]).
//!
//! A prompt starts from the kept state sharing its longest prefix ([`Pool`]); a finished
//! turn's state is kept. A turn's expert selections are held apart until it ends
//! ([`RouteTrace::own_rows`](crate::route_trace::RouteTrace::own_rows)), and the history is
//! saved after every finished turn, so that it holds exactly the turns that finished.
//!
//! Owns the sequences, the steps and the pool; the HTTP side only sends jobs and reads
//! their events.

use std::time::Instant;

use anyhow::Result;

use super::api::{ApiError, Finish, Input, Routed, TokenLogprob, ToolChoice, Usage};
use super::kv_dir::KvDir;
use super::metrics::{Metrics, StepFigures, Turn};
use super::pool::{Pool, Start};
use super::routing::Feed;
use super::worker::{Event, Job, Serving, StopScan};
use crate::engines::{Engine, Logits, State, Step};
use crate::experts::CacheStats;
use crate::guide::{Grammar, Guide, Guides, Mask};
use crate::interrupt;
use crate::route_trace::RowOwner;
use crate::sampling::{LogProbs, Sampler};
use crate::session::Session;
use crate::snapshot::Snapshot;
use crate::text::reasoning::ThinkScan;
use crate::text::tool_calls::{self, Marker, Scanned, ToolScan};
use crate::text::{excerpt, PromptText, TextModel, TextStream, TextTokenizer};

/// A request made ready to start ([`Scheduler::check`]).
struct Checked {
    prompt: Vec<u32>,
    count: usize,
    /// One per choice.
    samplers: Vec<Sampler>,
    /// With tools: the scanner of the answer's calls.
    calls: Option<ToolScan>,
    /// With a grammar (or calls it must make): where the answer stands in it.
    guide: Option<Guide>,
    /// When the prompt opened a thinking block: the scan that finds where it closes.
    think: Option<ThinkScan>,
    /// With `echo`: the prompt's text.
    echo: Option<String>,
}

/// What a sequence feeds next.
enum Next {
    /// The prompt from this position on, a chunk a step.
    Prompt(usize),
    /// The logits after the whole prompt, which a kept state held: nothing to feed.
    Kept(Vec<f32>),
    /// The last token chosen, then the drafts proposed after it.
    Tokens(Vec<u32>),
}

/// One choice of a request being answered.
struct Sequence<'t> {
    id: u64,
    job: Job,
    /// What the engine thread's messages begin with ([`super::worker::Front::tag`]).
    tag: &'static str,
    /// Which of the request's choices (`n`) this is.
    choice: usize,
    /// The samplers of the request's other choices, forked from this one's state when its
    /// prompt is filled.
    forks: Vec<Sampler>,
    prompt: Vec<u32>,
    state: State,
    next: Next,
    /// Prompt tokens a kept state held.
    cached: usize,
    /// At most this many tokens.
    count: usize,
    sampler: Sampler,
    tokens: Vec<u32>,
    text: StopScan,
    stream: Option<TextStream<'t>>,
    /// With tools: the calls found in the text (which is then decoded with special tokens).
    calls: Option<ToolScan>,
    /// Calls handed out.
    called: usize,
    /// With a grammar: where the answer stands in it, and the mask of the next token when
    /// it was computed beside the forward.
    guide: Option<Guide>,
    mask: Option<Mask>,
    /// The masked logits row a guided choice samples from, kept to be written again.
    masked: Vec<f32>,
    /// When the prompt opened a thinking block: where it closes, and the tokens spent in it.
    think: Option<ThinkScan>,
    reasoning_tokens: usize,
    /// Tokens that come next whatever the logits say, last first (the closing tag of a
    /// thinking block whose budget is spent).
    forced: Vec<u32>,
    /// With `echo`: the prompt's text and (with `logprobs`) its tokens' log-probabilities,
    /// handed out before the first token.
    echo: Option<(String, Vec<TokenLogprob>)>,
    /// Per generated token, when asked: the experts each MoE layer chose for it.
    routed: Option<Routed>,
    /// When asked: the log-probabilities of the tokens chosen since the last text sent.
    logprobs: Vec<TokenLogprob>,
    first_token: Option<f64>,
    decode_started: Option<Instant>,
}

/// Why a sequence ends.
#[derive(Debug, Clone, PartialEq, Eq)]
enum End {
    Limit,
    StopToken,
    /// A stop string (the text after it is not sent).
    StopString,
    /// A call was made and `parallel_tool_calls` is false.
    Called,
    /// A Ctrl-C (`coli chat`).
    Interrupted,
    /// The client went away.
    Abandoned,
    /// Its state could not be cut back or drafted on: the request gets a server error,
    /// and its state and the turn's selections are dropped.
    Failed(String),
}

/// What a step did with a sequence's part.
#[derive(Debug, PartialEq, Eq)]
enum Part {
    Decode,
    Prefill(usize),
}

pub struct Scheduler<'a> {
    engine: &'a dyn Engine,
    tokenizer: &'a TextTokenizer,
    snapshot: &'a Snapshot,
    /// The positions a request may use.
    context: Option<usize>,
    metrics: &'a Metrics,
    /// `max_tokens` when a request gives none: `NGEN`.
    default_tokens: usize,
    parallel: usize,
    prefill_chunk: usize,
    /// What the engine thread's messages begin with ([`super::worker::Front::tag`]).
    tag: &'static str,
    /// Ids that end an answer.
    stops: Vec<u32>,
    pool: Pool,
    active: Vec<Sequence<'a>>,
    /// A request taken from the queue that waits for as many free places as its choices.
    held: Option<Job>,
    next_id: u64,
    /// The grammar compiler, built for the first request with a grammar.
    guides: Option<Guides>,
    /// What `GET /routing` streams: each step's routing, residence and rates.
    feed: Feed,
}

impl<'a> Scheduler<'a> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        engine: &'a dyn Engine,
        tokenizer: &'a TextTokenizer,
        snapshot: &'a Snapshot,
        context: Option<usize>,
        metrics: &'a Metrics,
        default_tokens: usize,
        serving: &Serving,
        cache_bytes: u64,
        disk: Option<KvDir>,
        feed: Feed,
    ) -> Result<Scheduler<'a>> {
        let stops = TextModel::new(tokenizer, snapshot, engine).stop_ids(engine.stop_tokens())?;
        Ok(Scheduler {
            engine,
            tokenizer,
            snapshot,
            context,
            metrics,
            default_tokens,
            parallel: serving.parallel.max(1),
            prefill_chunk: serving.prefill_chunk.max(1),
            tag: serving.front.tag(),
            pool: Pool::new(cache_bytes, disk),
            stops,
            active: Vec::new(),
            held: None,
            next_id: 1,
            guides: None,
            feed,
        })
    }

    /// Serve `jobs` until the queue closes and every active sequence has ended.
    pub fn serve(&mut self, jobs: &mut tokio::sync::mpsc::Receiver<Job>, session: &mut Session) {
        let mut open = true;
        loop {
            while open && self.places() < self.parallel {
                let job = if let Some(job) = self.held.take() {
                    Some(job)
                } else if self.active.is_empty() {
                    // Nothing to do until a job comes: the routing view gets the last
                    // step's state now.
                    self.feed.idle(self.engine);
                    jobs.blocking_recv()
                } else {
                    match jobs.try_recv() {
                        Ok(job) => Some(job),
                        Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                        Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => None,
                    }
                };
                match job {
                    Some(job) => {
                        // More choices than places is refused when admitted: it waits
                        // for nothing.
                        let places = if job.choices > self.parallel {
                            0
                        } else {
                            job.choices.max(1)
                        };
                        if !self.active.is_empty() && self.places() + places > self.parallel {
                            self.held = Some(job);
                            break;
                        }
                        self.metrics.queue(-1, 1);
                        self.metrics.waited(job.received.elapsed().as_secs_f64());
                        let events = job.events.clone();
                        // A panic while admitting (a template, a state read from disk)
                        // answers that request and leaves the server serving.
                        let admitted =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                self.admit(job, session)
                            }));
                        if admitted.is_err() {
                            let _ = events.send(Event::Failed(ApiError::server(
                                500,
                                "the request could not be started",
                            )));
                            self.metrics.queue(0, -1);
                        }
                    }
                    None => open = false,
                }
            }
            if self.active.is_empty() {
                if open {
                    continue;
                }
                self.pool.persist();
                return;
            }
            // A panic in a step answers its sequences and leaves the server serving.
            let stepped =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step(session)));
            if let Err(message) = stepped.map_err(|_| "the generation failed".to_string()) {
                self.fail_all(&message);
            }
        }
    }

    /// The `--parallel` places the active sequences take, with the choices still to be
    /// forked.
    fn places(&self) -> usize {
        self.active.iter().map(|s| 1 + s.forks.len()).sum()
    }

    /// Start `job`: its prompt checked, its start found in the pool. A request that cannot
    /// be served is answered here.
    fn admit(&mut self, job: Job, session: &mut Session) {
        let checked = self.check(&job);
        let Checked {
            prompt,
            count,
            mut samplers,
            calls,
            guide,
            think,
            echo,
        } = match checked {
            Ok(parts) => parts,
            Err(err) => {
                let _ = job.events.send(Event::Failed(err));
                self.metrics.queue(0, -1);
                return;
            }
        };
        if count == 0 && !(echo.is_some() && job.logprobs.is_some()) {
            self.answer_without_forward(&job, prompt.len(), echo);
            return;
        }
        let engine = self.engine;
        let echo = echo.map(|text| {
            // The first token's log-probability: nothing predicts it.
            let first = job.logprobs.map(|_| TokenLogprob {
                token: self.tokenizer.decode_all(&prompt[..1]).unwrap_or_default(),
                logprob: f32::NAN,
                top: Vec::new(),
            });
            (text, first.into_iter().collect())
        });
        // A whole-prompt match has no routing to report for the first token's row; the
        // log-probabilities of an echoed prompt need every position computed.
        let start = if echo.is_some() && job.logprobs.is_some() {
            Start {
                state: engine.new_state(),
                cached: 0,
                logits: None,
            }
        } else {
            self.pool.start(&prompt, !job.routed_experts, engine)
        };
        let id = self.next_id;
        self.next_id += 1;
        let next = match start.logits {
            Some(logits) => Next::Kept(logits),
            None => Next::Prompt(start.cached),
        };
        let sampler = samplers.remove(0);
        let sequence = Sequence {
            id,
            tag: self.tag,
            choice: 0,
            forks: samplers,
            routed: job.routed_experts.then(Vec::new),
            logprobs: Vec::new(),
            text: StopScan::new(job.stop.clone()),
            job,
            prompt,
            state: start.state,
            next,
            cached: start.cached,
            count,
            sampler,
            tokens: Vec::new(),
            stream: Some(self.tokenizer.stream_keeping(calls.is_some())),
            calls,
            called: 0,
            guide,
            mask: None,
            masked: Vec::new(),
            think,
            reasoning_tokens: 0,
            forced: Vec::new(),
            echo,
            first_token: None,
            decode_started: None,
        };
        let started = Event::Started(Usage {
            prompt: sequence.prompt.len(),
            cached: sequence.cached,
            ..Usage::default()
        });
        if sequence.job.events.send(started).is_err() {
            // The client left while queued: nothing was computed.
            self.retire(sequence, End::Abandoned, session);
            return;
        }
        self.active.push(sequence);
    }

    /// A request for no tokens and no scores of its prompt (`max_tokens` 0): every choice is
    /// its echo, if asked, and ends at its length; the prompt is counted, never computed, so
    /// the history and the kept states are as they were.
    fn answer_without_forward(&mut self, job: &Job, prompt: usize, echo: Option<String>) {
        let usage = Usage {
            prompt,
            ..Usage::default()
        };
        let _ = job.events.send(Event::Started(usage));
        for choice in 0..job.choices.max(1) {
            if let Some(text) = &echo {
                let _ = job.events.send(Event::Text {
                    choice,
                    text: text.clone(),
                    logprobs: Vec::new(),
                });
            }
            let _ = job.events.send(Event::Done {
                choice,
                finish: Finish::Length,
                usage,
                routed: job.routed_experts.then(Vec::new),
                logprobs: Vec::new(),
                first_token: None,
                decode_rate: None,
            });
        }
        self.metrics.queue(0, -1);
    }

    /// The prompt's ids, the token count, the sampler of each choice of `job` and the
    /// scanner of its calls (with tools), or why it cannot be served (HTTP 400).
    fn check(&mut self, job: &Job) -> Result<Checked, ApiError> {
        let engine = self.engine;
        if job.choices > self.parallel {
            return Err(ApiError::invalid(format!(
                "n {}: this server generates at most {} sequences at once (--parallel), so a request may ask for at most {} choices",
                job.choices, self.parallel, self.parallel
            )));
        }
        let model = TextModel::new(self.tokenizer, self.snapshot, engine);
        let (prompt, text) = match &job.input {
            Input::Chat(messages) => {
                let rendered = model
                    .render(messages)
                    .map_err(|err| ApiError::invalid(format!("{err:#}")))?;
                self.encode(&model, rendered)?
            }
            Input::Text(text) => self.encode(&model, PromptText::plain(text.clone()))?,
            Input::Ids(ids) => (ids.clone(), String::new()),
        };
        // A prompt that ends by opening the model's thinking block: the answer thinks first.
        let think = engine
            .prompt_convention()
            .thinking
            .filter(|(open, _)| matches!(job.input, Input::Chat(_)) && text.ends_with(open))
            .map(|(_, close)| ThinkScan::new(close));
        let think = match think {
            Some(mut scan) if job.thinking_budget.is_some() => {
                scan.close_ids = self
                    .tokenizer
                    .encode(scan.close(), false)
                    .map_err(|err| ApiError::server(500, format!("{err:#}")))?;
                Some(scan)
            }
            other => other,
        };
        let vocab = engine.vocab_size();
        if let Some((bad, _)) = job
            .shaping
            .logit_bias
            .iter()
            .find(|&&(id, _)| id as usize >= vocab)
        {
            return Err(ApiError::invalid(format!(
                "logit_bias: token id {bad} is outside the model's vocabulary (vocab_size {vocab})"
            )));
        }
        if let Some(bad) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(format!(
                "prompt token id {bad} is outside the model's vocabulary (vocab_size {vocab})"
            )));
        }
        if prompt.is_empty() {
            return Err(ApiError::invalid(
                "the prompt encodes to no tokens; give some text",
            ));
        }
        let context = self.context;
        let room = context.map_or(usize::MAX, |c| c.saturating_sub(prompt.len()));
        if room == 0 {
            return Err(context_error(format!(
                "the prompt takes {} tokens, the model's whole context of {} (max_position_embeddings in config.json)",
                prompt.len(),
                context.unwrap_or(0)
            )));
        }
        let count = match job.max_tokens {
            Some(n) if n > room && job.clamp_tokens => room,
            Some(n) if n > room => {
                return Err(context_error(format!(
                    "max_tokens {n}: the prompt takes {} of the model's {} positions (max_position_embeddings in config.json), so at most {room} tokens can follow",
                    prompt.len(),
                    context.unwrap_or(0)
                )))
            }
            Some(n) => n,
            None => self.default_tokens.min(room),
        };
        let samplers = (0..job.choices.max(1) as u64)
            .map(|index| {
                Sampler::new(job.temperature, job.top_p, job.seed.wrapping_add(index))?
                    .shaped(job.shaping.clone(), &prompt)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| ApiError::invalid(err.to_string()))?;
        let calls = match (&job.tools, &job.input) {
            (Some(_), Input::Chat(conversation)) => {
                let Some(syntax) = engine.prompt_convention().tools else {
                    return Err(ApiError::invalid(format!(
                        "tools: the {} engine's model has no syntax for calls of tools; leave tools out (or give tool_choice \"none\")",
                        engine.name()
                    )));
                };
                Some(ToolScan::new(syntax, conversation.tools.clone()))
            }
            _ => None,
        };
        let grammar = match (&job.tools, &job.input, engine.prompt_convention().tools) {
            (Some(tools), Input::Chat(conversation), Some(syntax)) => {
                let only = match &tools.choice {
                    ToolChoice::Auto => None,
                    ToolChoice::Required => Some(None),
                    ToolChoice::Named(name) => Some(Some(name.as_str())),
                };
                match only {
                    None => None,
                    Some(only) => {
                        let specials = self.tokenizer.special_ids();
                        let marker = |text: &str| match self.tokenizer.token_id(text) {
                            Some(id) if self.stops.contains(&id) => Marker::Stop,
                            Some(id) if specials.contains(&id) => Marker::Special,
                            _ => Marker::Text,
                        };
                        let lark = tool_calls::call_grammar(
                            syntax,
                            &conversation.tools,
                            only,
                            tools.parallel,
                            marker,
                        )
                        .map_err(ApiError::invalid)?;
                        Some(Grammar::Lark(lark))
                    }
                }
            }
            _ => job.grammar.clone(),
        };
        if job.thinking_budget.is_some() && think.is_none() {
            return Err(ApiError::invalid(format!(
                "thinking: the {} engine's prompt opens no thinking block for the answer",
                engine.name()
            )));
        }
        if think.is_some() && grammar.is_some() {
            return Err(ApiError::invalid(
                "thinking with a required call or a response format: the answer would have to think inside the grammar; turn thinking off for this request (chat_template_kwargs.enable_thinking false, or Anthropic's thinking disabled)",
            ));
        }
        let guide = match grammar {
            Some(grammar) => Some(self.start_guide(&grammar, job)?),
            None => None,
        };
        let echo = job.echo.then(|| match &job.input {
            Input::Ids(ids) => self.tokenizer.decode_all(ids).unwrap_or_default(),
            _ => text,
        });
        Ok(Checked {
            prompt,
            count,
            samplers,
            calls,
            guide,
            think,
            echo,
        })
    }

    /// A prompt's ids and text, encoded once; refused before that, its tokenizer's time and
    /// memory unspent, when its length alone shows it cannot fit the context.
    fn encode(&self, model: &TextModel, text: PromptText) -> Result<(Vec<u32>, String), ApiError> {
        if let (Some(context), Some(longest)) = (self.context, self.tokenizer.bytes_per_token()) {
            let bytes = text.text.len();
            let fewest = bytes.div_ceil(longest);
            if fewest >= context {
                return Err(context_error(format!(
                    "the prompt's {bytes} bytes are at least {fewest} tokens (no token of {} stands for more than {longest} bytes), beyond the model's whole context of {context} (max_position_embeddings in config.json)",
                    self.tokenizer.path().display(),
                )));
            }
        }
        let prompt = model
            .encode(text)
            .map_err(|err| ApiError::invalid(format!("{err:#}")))?;
        if let Some(read) = &prompt.misread {
            // The request's own text: only at -v, and only its start.
            tracing::debug!(
                "[prompt] {} cannot represent all of a prompt; the model reads {}",
                self.tokenizer.path().display(),
                excerpt(read)
            );
        }
        Ok((prompt.ids, prompt.text))
    }

    /// `grammar` started for `job`'s answer; an invalid one is the request's fault: of a
    /// tool's parameters (named by trying each alone) when the grammar is its calls'.
    fn start_guide(&mut self, grammar: &Grammar, job: &Job) -> Result<Guide, ApiError> {
        let guides = match &mut self.guides {
            Some(guides) => guides,
            none => {
                let built = Guides::new(self.tokenizer, self.engine.vocab_size(), &self.stops)
                    .map_err(|err| {
                        ApiError::server(500, format!("constrained decoding cannot start: {err:#}"))
                    })?;
                none.insert(built)
            }
        };
        let failed = match guides.start(grammar) {
            Ok(guide) => return Ok(guide),
            Err(err) => err,
        };
        let tools = match (&job.tools, &job.input) {
            (Some(_), Input::Chat(conversation)) => &conversation.tools[..],
            _ => {
                return Err(ApiError::invalid(format!(
                    "response_format/grammar: {failed}"
                )))
            }
        };
        for (i, tool) in tools.iter().enumerate() {
            let parameters = tool.pointer("/function/parameters").cloned();
            if let Some(Err(err)) = parameters.map(|p| guides.start(&Grammar::JsonSchema(p))) {
                return Err(ApiError::invalid(format!(
                    "tools[{i}].function.parameters: {err}"
                )));
            }
        }
        Err(ApiError::invalid(format!(
            "tools (the calls the answer must make): {failed}"
        )))
    }

    /// One step: sequences whose client left or that a Ctrl-C stopped end; those holding
    /// a kept prompt's logits choose their first token; then one forward over every
    /// decoding sequence's tokens and a chunk of the first prompt being filled.
    fn step(&mut self, session: &mut Session) {
        let stop_all = interrupt::requested();
        let mut i = 0;
        while i < self.active.len() {
            let sequence = &self.active[i];
            let end = if sequence.job.events.is_closed() {
                Some(End::Abandoned)
            } else if stop_all {
                Some(End::Interrupted)
            } else {
                None
            };
            match end {
                Some(end) => {
                    let sequence = self.active.swap_remove(i);
                    self.retire(sequence, end, session);
                }
                None => i += 1,
            }
        }
        let mut ended = Vec::new();
        let mut forked = Vec::new();
        for i in 0..self.active.len() {
            let sequence = &mut self.active[i];
            if let Next::Kept(_) = &sequence.next {
                // `choose` sets what the sequence feeds next, or ends it.
                let Next::Kept(logits) = std::mem::replace(&mut sequence.next, Next::Prompt(0))
                else {
                    unreachable!("matched above")
                };
                sequence.decode_started = Some(Instant::now());
                let forks = fork_choices(sequence, &mut self.next_id, self.tokenizer);
                if let Some(end) =
                    choose(sequence, self.tokenizer, &self.stops, &[&logits], None, &[])
                {
                    ended.push((i, end));
                }
                let chosen = first_tokens(forks, self.tokenizer, &self.stops, &logits, None);
                forked.extend(chosen);
            }
        }
        self.join_forks(forked, &mut ended);
        self.retire_all(ended, session);
        if self.active.is_empty() {
            return;
        }
        if let Err(err) = self.forward(session) {
            self.fail_all(&format!("generation failed: {err:#}"));
        }
    }

    /// The batched forward of a step and what each sequence does with its logits.
    fn forward(&mut self, session: &mut Session) -> Result<()> {
        let engine = self.engine;
        let chunk = self.prefill_chunk;
        let filling = self
            .active
            .iter()
            .position(|s| matches!(s.next, Next::Prompt(_)));
        let mut parts: Vec<(usize, Part)> = Vec::new();
        let mut owners = Vec::new();
        let mut keep = Vec::new();
        let mut steps = Vec::new();
        // The grammars' next masks, computed on a thread of their own while the forward runs.
        let mut masking: Vec<(&mut Guide, &mut Option<Mask>)> = Vec::new();
        let mut rows = 0;
        for (i, sequence) in self.active.iter_mut().enumerate() {
            let Sequence {
                state,
                next,
                prompt,
                id,
                routed,
                guide,
                mask,
                echo,
                ..
            } = sequence;
            let (tokens, logits, part) = match next {
                Next::Tokens(tokens) => {
                    let logits = if tokens.len() > 1 {
                        Logits::All
                    } else {
                        Logits::Last
                    };
                    (&tokens[..], logits, Part::Decode)
                }
                Next::Prompt(fed) if Some(i) == filling => {
                    let end = (*fed + chunk).min(prompt.len());
                    // An echoed prompt's log-probabilities: a row for every position.
                    let logits = match echo {
                        Some((_, scored)) if !scored.is_empty() => Logits::All,
                        _ => Logits::Last,
                    };
                    (&prompt[*fed..end], logits, Part::Prefill(end))
                }
                _ => continue,
            };
            let span = rows..rows + tokens.len();
            rows = span.end;
            if routed.is_some() {
                match part {
                    Part::Decode => keep.extend(span.clone()),
                    Part::Prefill(end) if end == prompt.len() => keep.push(span.end - 1),
                    Part::Prefill(_) => {}
                }
            }
            owners.push(RowOwner {
                rows: span,
                sequence: *id,
            });
            parts.push((i, part));
            steps.push(Step::new(state, tokens, logits));
            if let (Some(guide), None) = (guide.as_mut(), &mask) {
                masking.push((guide, mask));
            }
        }
        let before = engine.cache_stats();
        engine.routed().telemetry.own_rows(owners, &keep);
        let started = Instant::now();
        let outputs = std::thread::scope(|scope| {
            if !masking.is_empty() {
                scope.spawn(|| {
                    for (guide, mask) in masking {
                        // A failure is met again, and reported, when the token is chosen.
                        *mask = guide.mask().ok();
                    }
                });
            }
            engine.forward(&mut steps)
        })?;
        let seconds = started.elapsed().as_secs_f64();
        drop(steps);
        let after = engine.cache_stats();
        let (experts_taken, experts_read) = experts_taken(&before, &after);
        self.metrics.step(StepFigures {
            sequences: parts.len(),
            rows,
            experts_taken,
            experts_read,
            seconds,
        });

        let mut ended = Vec::new();
        let mut forked = Vec::new();
        let mut emitted = 0u64;
        let mut row = 0;
        let depth = engine.draft_depth();
        for ((i, part), logits) in parts.into_iter().zip(outputs) {
            let sequence = &mut self.active[i];
            match part {
                Part::Prefill(end) => {
                    let start = fed_before(sequence);
                    row += end - start;
                    let vocab = engine.vocab_size();
                    let logits = match sequence.echo.as_mut() {
                        Some((_, scored)) if !scored.is_empty() => {
                            let top = sequence.job.logprobs.unwrap_or(0);
                            let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
                            // Row r predicts the token at position start + r + 1.
                            for (r, row) in rows.iter().enumerate() {
                                if let Some(&next) = sequence.prompt.get(start + r + 1) {
                                    scored.push(token_logprob(self.tokenizer, row, next, top));
                                }
                            }
                            rows.last().map_or_else(Vec::new, |row| row.to_vec())
                        }
                        _ => logits,
                    };
                    if end < sequence.prompt.len() {
                        sequence.next = Next::Prompt(end);
                        continue;
                    }
                    keep_checkpoint(&mut self.pool, sequence, &logits);
                    sequence.decode_started = Some(Instant::now());
                    let routes = route_rows(engine, &[row - 1]);
                    let forks = fork_choices(sequence, &mut self.next_id, self.tokenizer);
                    let before = sequence.tokens.len();
                    let end = choose(
                        sequence,
                        self.tokenizer,
                        &self.stops,
                        &[&logits],
                        Some(routes.clone()),
                        &[],
                    );
                    emitted += (sequence.tokens.len() - before) as u64;
                    if let Some(end) = end {
                        ended.push((i, end));
                    }
                    let chosen =
                        first_tokens(forks, self.tokenizer, &self.stops, &logits, Some(routes));
                    emitted += chosen
                        .iter()
                        .map(|(f, _)| f.tokens.len() as u64)
                        .sum::<u64>();
                    forked.extend(chosen);
                }
                Part::Decode => {
                    let Next::Tokens(fed) = &sequence.next else {
                        unreachable!("a decoding part feeds tokens")
                    };
                    let fed = fed.clone();
                    let vocab = engine.vocab_size();
                    let rows_of: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
                    let routes = route_rows(engine, &(row..row + fed.len()).collect::<Vec<_>>());
                    row += fed.len();
                    let start = sequence.state.position() - fed.len();
                    let before = sequence.tokens.len();
                    let end = choose(
                        sequence,
                        self.tokenizer,
                        &self.stops,
                        &rows_of,
                        Some(routes),
                        &fed[1..],
                    );
                    let accepted = sequence.tokens.len() - before;
                    emitted += accepted as u64;
                    // Rejected drafts leave the cache: it holds the fed token and the drafts
                    // kept, each of which is a token chosen.
                    let keep_positions = start + accepted.max(1);
                    let cut = if sequence.state.position() > keep_positions {
                        sequence.state.truncate(keep_positions)
                    } else {
                        Ok(())
                    };
                    match (cut, end) {
                        (Err(err), _) => ended.push((i, End::Failed(format!("{err:#}")))),
                        (Ok(()), Some(end)) => ended.push((i, end)),
                        (Ok(()), None) => {}
                    }
                }
            }
        }
        self.join_forks(forked, &mut ended);
        // The drafts for the next step, on the sequences that go on.
        if depth > 0 {
            let ending: Vec<usize> = ended.iter().map(|&(i, _)| i).collect();
            for (i, sequence) in self.active.iter_mut().enumerate() {
                let Next::Tokens(fed) = &sequence.next else {
                    continue;
                };
                if ending.contains(&i) || fed.len() != 1 {
                    continue;
                }
                let left = sequence.count - sequence.tokens.len();
                if left <= 1 {
                    continue;
                }
                let next = fed[0];
                engine.routed().telemetry.own_rows(
                    vec![RowOwner {
                        rows: 0..usize::MAX,
                        sequence: sequence.id,
                    }],
                    &[],
                );
                match engine.propose(&mut sequence.state, next, depth.min(left - 1)) {
                    Ok(drafts) => {
                        let mut feed = vec![next];
                        feed.extend(drafts);
                        sequence.next = Next::Tokens(feed);
                    }
                    Err(err) => ended.push((i, End::Failed(format!("{err:#}")))),
                }
            }
        }
        self.feed.step(engine, started, &before, &after, emitted);
        if emitted > 0 {
            if let Err(err) = session.after_tokens(engine, emitted) {
                eprintln!("{} placement after a step failed: {err:#}", self.tag);
            }
        }
        self.retire_all(ended, session);
        Ok(())
    }

    /// Make the choices forked this step active; those their first token ended join
    /// `ended`.
    fn join_forks(
        &mut self,
        forked: Vec<(Sequence<'a>, Option<End>)>,
        ended: &mut Vec<(usize, End)>,
    ) {
        for (fork, end) in forked {
            self.metrics.queue(0, 1);
            self.active.push(fork);
            if let Some(end) = end {
                ended.push((self.active.len() - 1, end));
            }
        }
    }

    /// End the sequences at `ended` (indices into the active ones).
    fn retire_all(&mut self, mut ended: Vec<(usize, End)>, session: &mut Session) {
        // Highest index first, so that each removal leaves the others' indices alone.
        ended.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, end) in ended {
            let sequence = self.active.swap_remove(i);
            self.retire(sequence, end, session);
        }
    }

    /// A sequence's end: the rest of its text and `Done` to its client, its selections into
    /// the history (saved), its state kept.
    fn retire(&mut self, mut sequence: Sequence, end: End, session: &mut Session) {
        let engine = self.engine;
        if let End::Failed(message) = end {
            eprintln!("{} generation failed: {message}", self.tag);
            engine.routed().telemetry.end_turn(sequence.id, false);
            let _ = sequence.job.events.send(Event::Failed(ApiError::server(
                500,
                format!("generation failed: {message} (the request's cache was dropped)"),
            )));
            self.metrics.queue(0, -1);
            return;
        }
        if end == End::StopString {
            // What the call and thinking scans hold back, up to the stop string.
            send_text(&mut sequence, String::new(), true);
        }
        if ![End::Abandoned, End::StopString, End::Called].contains(&end) {
            let rest = sequence
                .stream
                .take()
                .map_or(Ok(String::new()), TextStream::finish);
            match rest {
                Ok(rest) => {
                    let (ready, stopped) = sequence.text.push(&rest);
                    let tail = if stopped {
                        ready
                    } else {
                        ready + &sequence.text.flush()
                    };
                    send_text(&mut sequence, tail, true);
                }
                Err(err) => eprintln!(
                    "{} the answer's last text cannot be decoded: {err:#}",
                    self.tag
                ),
            }
        }
        let finish = match (sequence.text.matched(), &end) {
            (Some(index), _) => Finish::StopString(index),
            (None, End::Limit) => Finish::Length,
            _ if sequence.called > 0 => Finish::ToolCalls,
            _ => Finish::Stop,
        };
        let usage = Usage {
            prompt: sequence.prompt.len(),
            completion: sequence.tokens.len(),
            cached: sequence.cached,
            reasoning: sequence.reasoning_tokens,
        };
        let decode_seconds = sequence
            .decode_started
            .map_or(0.0, |t| t.elapsed().as_secs_f64());
        let decoded = sequence.tokens.len().saturating_sub(1);
        let decode_rate =
            (decoded > 0 && decode_seconds > 0.0).then(|| decoded as f64 / decode_seconds);
        let _ = sequence.job.events.send(Event::Done {
            choice: sequence.choice,
            logprobs: std::mem::take(&mut sequence.logprobs),
            finish,
            usage,
            routed: sequence.routed.take(),
            first_token: sequence.first_token,
            decode_rate,
        });
        engine.routed().telemetry.end_turn(sequence.id, true);
        // A turn that routed nothing (its client left while it waited) saves nothing, so
        // it cannot decay the history.
        if engine.routed().telemetry.unsaved_selections() > 0 {
            session.save_turn(engine);
        }
        let turn = Turn {
            prompt_tokens: usage.prompt,
            cached_tokens: usage.cached,
            completion_tokens: usage.completion,
            first_token_seconds: sequence.first_token,
            decode_rate,
            abandoned: end == End::Abandoned,
        };
        let pinned = engine.routed().pinned().iter().map(Vec::len).sum();
        self.metrics.turn(&turn, engine.cache_stats(), pinned);
        self.metrics.queue(0, -1);
        // What the state holds: the prompt and the generated tokens fed so far.
        let mut held = sequence.prompt;
        held.extend_from_slice(&sequence.tokens);
        let position = sequence.state.position();
        if position <= held.len() {
            held.truncate(position);
            self.pool.put(held, sequence.state, None);
        }
        self.metrics.kept(self.pool.size());
    }

    /// Answer every active sequence with a server error; their states are unknown now and
    /// their selections of the turn are dropped.
    fn fail_all(&mut self, message: &str) {
        eprintln!("{} {message}", self.tag);
        let engine = self.engine;
        for sequence in self.active.drain(..) {
            engine.routed().telemetry.end_turn(sequence.id, false);
            let _ = sequence.job.events.send(Event::Failed(ApiError::server(
                500,
                format!("{message} (the request's cache was dropped)"),
            )));
            self.metrics.queue(0, -1);
        }
    }
}

/// The prompt position a prefilling sequence's chunk starts at.
fn fed_before(sequence: &Sequence) -> usize {
    match sequence.next {
        Next::Prompt(fed) => fed,
        _ => sequence.prompt.len(),
    }
}

/// A state that cannot go back to earlier positions is kept at the end of its prompt,
/// with the prompt's last logits: the same prompt again (a regenerated answer) then
/// computes nothing, and a prompt that extends it starts there.
fn keep_checkpoint(pool: &mut Pool, sequence: &Sequence, logits: &[f32]) {
    let position = sequence.state.position();
    if position < 2 || sequence.state.can_truncate(position - 1) {
        return;
    }
    pool.put(
        sequence.prompt.clone(),
        sequence.state.clone(),
        Some(logits.to_vec()),
    );
}

/// The request's other choices, forked from `sequence` at the end of its prompt: each a
/// copy of its state with a sampler of its own, choosing its first token from the same
/// logits. The prompt's expert selections stay with `sequence`'s turn.
fn fork_choices<'t>(
    sequence: &mut Sequence<'t>,
    next_id: &mut u64,
    tokenizer: &'t TextTokenizer,
) -> Vec<Sequence<'t>> {
    let samplers = std::mem::take(&mut sequence.forks);
    samplers
        .into_iter()
        .enumerate()
        .map(|(j, sampler)| {
            let id = *next_id;
            *next_id += 1;
            Sequence {
                id,
                tag: sequence.tag,
                job: sequence.job.clone(),
                choice: j + 1,
                forks: Vec::new(),
                prompt: sequence.prompt.clone(),
                state: sequence.state.clone(),
                next: Next::Prompt(sequence.prompt.len()),
                cached: sequence.cached,
                count: sequence.count,
                sampler,
                tokens: Vec::new(),
                text: StopScan::new(sequence.job.stop.clone()),
                stream: Some(tokenizer.stream_keeping(sequence.calls.is_some())),
                calls: sequence.calls.as_ref().map(ToolScan::fresh),
                called: 0,
                guide: sequence.guide.as_ref().map(Guide::fork),
                mask: None,
                masked: Vec::new(),
                think: sequence.think.as_ref().map(ThinkScan::fresh),
                reasoning_tokens: 0,
                forced: Vec::new(),
                echo: sequence.echo.clone(),
                routed: sequence.routed.is_some().then(Vec::new),
                logprobs: Vec::new(),
                first_token: None,
                decode_started: sequence.decode_started,
            }
        })
        .collect()
}

/// Each fork's first token, chosen from its prompt's `logits` (with the prompt's last
/// row's `routes`), and why the fork ends, if it does.
fn first_tokens<'t>(
    forks: Vec<Sequence<'t>>,
    tokenizer: &TextTokenizer,
    stops: &[u32],
    logits: &[f32],
    routes: Option<Vec<Vec<Vec<u32>>>>,
) -> Vec<(Sequence<'t>, Option<End>)> {
    forks
        .into_iter()
        .map(|mut fork| {
            let end = choose(&mut fork, tokenizer, stops, &[logits], routes.clone(), &[]);
            (fork, end)
        })
        .collect()
}

/// The kept routing of `rows` of the last forward (empty where none was kept).
fn route_rows(engine: &dyn Engine, rows: &[usize]) -> Vec<Vec<Vec<u32>>> {
    let routed = engine.routed();
    rows.iter()
        .map(|&row| {
            routed
                .telemetry
                .row_routes(row)
                .map_or_else(Vec::new, <[Vec<u32>]>::to_vec)
        })
        .collect()
}

/// Choose tokens from `rows` of logits, in order (one row, or a verifying forward's rows
/// after the drafts `drafts`): each chosen token is handed out; the next row is used while
/// the token equals its draft. Returns why the sequence ends, if it does; otherwise it
/// feeds the last token chosen next.
fn choose(
    sequence: &mut Sequence,
    tokenizer: &TextTokenizer,
    stops: &[u32],
    rows: &[&[f32]],
    routes: Option<Vec<Vec<Vec<u32>>>>,
    drafts: &[u32],
) -> Option<End> {
    if let Some((text, logprobs)) = sequence.echo.take() {
        let echo = Event::Text {
            choice: sequence.choice,
            text,
            logprobs,
        };
        if sequence.job.events.send(echo).is_err() {
            return Some(End::Abandoned);
        }
    }
    if sequence.tokens.len() >= sequence.count {
        return Some(End::Limit);
    }
    for (j, logits) in rows.iter().enumerate() {
        let token = match sequence.forced.pop() {
            Some(token) => token,
            None => match guided_pick(sequence, logits) {
                Ok(token) => token,
                Err(err) => return Some(End::Failed(err)),
            },
        };
        if stops.contains(&token) {
            return Some(End::StopToken);
        }
        if let Some(top) = sequence.job.logprobs {
            sequence
                .logprobs
                .push(token_logprob(tokenizer, logits, token, top));
        }
        sequence.tokens.push(token);
        if let (Some(routed), Some(routes)) = (sequence.routed.as_mut(), routes.as_ref()) {
            routed.push(routes.get(j).cloned().unwrap_or_default());
        }
        if let Some(end) = hand_out(sequence, token) {
            return Some(end);
        }
        close_thinking_at_budget(sequence);
        if sequence.tokens.len() >= sequence.count {
            return Some(End::Limit);
        }
        if drafts.get(j) != Some(&token) {
            sequence.next = Next::Tokens(vec![token]);
            return None;
        }
    }
    // Every draft was kept: the last row's token was chosen above and is fed next.
    let last = *sequence.tokens.last().expect("a row chose a token");
    sequence.next = Next::Tokens(vec![last]);
    None
}

/// The next token from `logits`: sampled as the sequence samples, among the tokens its
/// grammar allows when it has one (then accepted by the grammar).
fn guided_pick(sequence: &mut Sequence, logits: &[f32]) -> Result<u32, String> {
    let Some(guide) = sequence.guide.as_mut() else {
        return Ok(sequence.sampler.pick(logits));
    };
    let mask = match sequence.mask.take() {
        Some(mask) => mask,
        None => guide.mask().map_err(|err| err.to_string())?,
    };
    let allowed = &mut sequence.masked;
    allowed.clear();
    allowed.extend_from_slice(logits);
    mask.apply(allowed);
    let token = sequence.sampler.pick(allowed);
    guide.accept(token).map_err(|err| err.to_string())?;
    Ok(token)
}

/// Hand `token`'s text to the client; why the sequence ends, if it does (a stop string,
/// a client gone).
fn hand_out(sequence: &mut Sequence, token: u32) -> Option<End> {
    sequence
        .first_token
        .get_or_insert_with(|| sequence.job.received.elapsed().as_secs_f64());
    if sequence.job.events.is_closed() {
        return Some(End::Abandoned);
    }
    if sequence.think.as_ref().is_some_and(ThinkScan::thinking) {
        sequence.reasoning_tokens += 1;
    }
    let stream = sequence.stream.as_mut()?;
    let piece = match stream.step(token) {
        Ok(Some(piece)) => piece,
        Ok(None) => return None,
        Err(err) => {
            eprintln!(
                "{} a generated token cannot be decoded: {err:#}",
                sequence.tag
            );
            return Some(End::StopString);
        }
    };
    let (ready, stopped) = sequence.text.push(&piece);
    if let Some(end) = send_text(sequence, ready, false) {
        return Some(end);
    }
    stopped.then_some(End::StopString)
}

/// Where the thinking budget is spent and the model has not closed its block, the closing
/// tag comes next, whatever the model would say.
fn close_thinking_at_budget(sequence: &mut Sequence) {
    let Some(scan) = sequence.think.as_ref().filter(|scan| scan.thinking()) else {
        return;
    };
    if sequence.job.thinking_budget == Some(sequence.reasoning_tokens) && sequence.forced.is_empty()
    {
        sequence.forced = scan.close_ids.iter().rev().copied().collect();
    }
}

/// Hand `text` to the client: as it is, or with tools as the text and calls found in it
/// (all that is held back too when `last`). Why the sequence ends, if it does: the client
/// left, or a call was made where only one may be.
fn send_text(sequence: &mut Sequence, text: String, last: bool) -> Option<End> {
    let choice = sequence.choice;
    let text = match sequence.think.as_mut() {
        None => text,
        Some(scan) => {
            let mut split = scan.push(&text);
            if last {
                split.reasoning += &scan.finish().reasoning;
            }
            if !split.reasoning.is_empty() {
                let reasoning = Event::Reasoning {
                    choice,
                    text: split.reasoning,
                };
                if sequence.job.events.send(reasoning).is_err() {
                    return Some(End::Abandoned);
                }
            }
            split.text
        }
    };
    let pieces = match sequence.calls.as_mut() {
        None => vec![Scanned::Text(text)],
        Some(scan) => {
            let mut pieces = scan.push(&text);
            if last {
                pieces.extend(scan.finish());
            }
            pieces
        }
    };
    for piece in pieces {
        let event = match piece {
            Scanned::Text(text) if text.is_empty() => continue,
            Scanned::Text(text) => Event::Text {
                choice,
                text,
                logprobs: std::mem::take(&mut sequence.logprobs),
            },
            Scanned::Call(call) => {
                sequence.called += 1;
                Event::Call { choice, call }
            }
        };
        if sequence.job.events.send(event).is_err() {
            return Some(End::Abandoned);
        }
        let single = sequence.job.tools.as_ref().is_some_and(|t| !t.parallel);
        if single && sequence.called > 0 {
            return Some(End::Called);
        }
    }
    None
}

/// `token`'s log-probability under `logits`, with the `top` most likely tokens'.
fn token_logprob(
    tokenizer: &TextTokenizer,
    logits: &[f32],
    token: u32,
    top: usize,
) -> TokenLogprob {
    let probs = LogProbs::new(logits);
    let text = |id: u32| tokenizer.decode_all(&[id]).unwrap_or_default();
    TokenLogprob {
        token: text(token),
        logprob: probs.of(token),
        top: probs
            .top(top)
            .into_iter()
            .map(|(id, logprob)| (text(id), logprob))
            .collect(),
    }
}

/// Distinct experts the step's MoE calls took (from memory or read), from the store's
/// figures before and after.
fn experts_taken(before: &CacheStats, after: &CacheStats) -> (u64, u64) {
    let lookups = |s: &CacheStats| s.pin_hits + s.lru_hits + s.vram_hits + s.misses;
    (
        lookups(after).saturating_sub(lookups(before)),
        after.misses.saturating_sub(before.misses),
    )
}

fn context_error(message: String) -> ApiError {
    ApiError {
        code: Some("context_length_exceeded"),
        ..ApiError::invalid(message)
    }
}
