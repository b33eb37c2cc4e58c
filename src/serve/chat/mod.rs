//! `coli chat`: a conversation in the terminal, on the engine thread `coli serve` uses
//! ([`super::worker`]): each turn's prompt is the whole conversation (the system prompt
//! first) through the model's chat template, so the KV cache of the turns before is reused,
//! and the history is saved after every turn.
//!
//! Lines are read with rustyline. At a terminal the line is edited with the usual keys and
//! earlier lines come back with Up (the session's lines, kept in memory only); the prompt and
//! the line being edited go to the terminal itself, so stdout holds the answers alone. From a
//! pipe or a file the lines are read one by one, with no prompt. A line beginning with `/` is
//! one of the chat's commands ([`commands`]), which never reach the model.
//!
//! The answer streams to stdout, and each ends with a newline there; the turn's line and the
//! chat's messages go to stderr. Ctrl-C while an answer streams stops it: what it said so far
//! stays in the conversation (it is what the person saw, and the KV cache holds it); stopped
//! before its first token, the message is taken back. Ctrl-C at the prompt says how to leave;
//! `/exit`, Ctrl-D at the prompt or the end of input end the run as a run ends (the history
//! saved, `STATS`, the trace), exit status 0.

mod commands;
mod conversation;

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rustyline::error::ReadlineError;
use rustyline::history::MemHistory;
use rustyline::{Behavior, Editor};
use tokio::sync::mpsc;

use super::api::{Finish, Input};
use super::metrics::Metrics;
use super::worker::{self, Event, Job};
use crate::interrupt;
use crate::sampling::{Sampler, Shaping};
use crate::settings::Settings;
use crate::startup::Positionals;
use commands::{Command, Line};
use conversation::Conversation;

/// Lines the session's history keeps for Up and Down.
const HISTORY_LINES: usize = 1000;

/// `coli chat`, with `system` as the first system prompt (`--system`).
pub fn run(
    model: Option<&str>,
    settings: Settings,
    positionals: Positionals,
    system: Option<String>,
) -> Result<ExitCode> {
    let temperature = settings.temperature()?;
    let top_p = settings.top_p;
    Sampler::new(temperature, top_p, 0)?;
    let shaping = settings.shaping()?;
    let seed = settings.seed_or_clock();
    let (jobs, queue) = mpsc::channel(1);
    let metrics = Arc::new(Metrics::default());
    let (engine_thread, info) = worker::spawn(
        model.map(str::to_string),
        settings,
        positionals,
        worker::Serving::chat(),
        queue,
        metrics.clone(),
    )?;
    interrupt::install(interrupt::Stopping::Answer);
    let mut editor = line_editor()?;
    eprintln!(
        "[chat] {}: type a message, then Enter; /help lists the commands, /exit or Ctrl-D leaves",
        info.id
    );
    let mut chat = Chat {
        jobs,
        temperature,
        top_p,
        shaping,
        seed,
        turns: 0,
        conversation: Conversation::new(system),
        last: None,
        metrics,
    };
    loop {
        let line = match editor.readline("> ") {
            Ok(line) => line,
            Err(ReadlineError::Interrupted) => {
                eprintln!("[chat] to leave: /exit, or Ctrl-D on an empty line");
                continue;
            }
            Err(ReadlineError::Eof) => break,
            Err(err) => return Err(err).context("cannot read the next line"),
        };
        if line.trim().is_empty() {
            continue;
        }
        match commands::parse(&line) {
            Line::Message(text) => chat.turn(text)?,
            Line::Command(command) => {
                if !chat.command(command) {
                    break;
                }
            }
        }
    }
    drop(chat);
    engine_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))
}

/// The line editor: at a terminal, on the terminal itself (the prompt and the line being
/// edited stay out of stdout, which may be a file); otherwise standard input line by line.
fn line_editor() -> Result<Editor<(), MemHistory>> {
    let behavior = if std::io::stdin().is_terminal() {
        Behavior::PreferTerm
    } else {
        Behavior::Stdio
    };
    let config = rustyline::Config::builder()
        .max_history_size(HISTORY_LINES)?
        .history_ignore_dups(true)?
        .auto_add_history(true)
        .behavior(behavior)
        .build();
    Editor::with_history(config, MemHistory::new()).context("cannot start the line editor")
}

/// What the last turn did, for `/stats`.
struct Figures {
    prompt: usize,
    cached: usize,
    generated: usize,
    /// Tokens a second after the first; `None` with fewer than two.
    rate: Option<f64>,
}

/// The conversation and what each turn's job is made of.
struct Chat {
    jobs: mpsc::Sender<Job>,
    temperature: f64,
    top_p: f64,
    shaping: Shaping,
    seed: u64,
    /// Turns asked for so far (each samples with its own seed).
    turns: u64,
    conversation: Conversation,
    last: Option<Figures>,
    metrics: Arc<Metrics>,
}

/// Where an answer's pieces left the cursor: the turn's line must start a line of its own.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cursor {
    LineStart,
    /// After answer text on stdout that did not end a line.
    InAnswer,
    /// After thinking on stderr that did not end a line.
    InThinking,
}

impl Cursor {
    /// Where the cursor is once `piece` is written after it (`thinking`: to stderr).
    fn after(self, piece: &str, thinking: bool) -> Cursor {
        match piece.chars().next_back() {
            None => self,
            Some('\n') => Cursor::LineStart,
            Some(_) if thinking => Cursor::InThinking,
            Some(_) => Cursor::InAnswer,
        }
    }

    /// End the line the cursor is in, on the stream that left it there.
    fn end_line(self) -> Result<()> {
        match self {
            Cursor::LineStart => {}
            Cursor::InAnswer => {
                let mut stdout = std::io::stdout();
                writeln!(stdout)?;
                stdout.flush()?;
            }
            Cursor::InThinking => eprintln!(),
        }
        Ok(())
    }
}

impl Chat {
    /// One turn: `message` answered, the answer streamed to stdout and kept.
    fn turn(&mut self, message: &str) -> Result<()> {
        self.conversation.ask(message);
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let job = Job {
            input: Input::Chat(self.conversation.prompt().into()),
            max_tokens: None,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed.wrapping_add(self.turns),
            stop: Vec::new(),
            routed_experts: false,
            clamp_tokens: false,
            choices: 1,
            shaping: self.shaping.clone(),
            logprobs: None,
            tools: None,
            grammar: None,
            thinking_budget: None,
            echo: false,
            events: events_tx,
            received: Instant::now(),
        };
        self.turns += 1;
        // A signal at the prompt was not meant for this answer.
        interrupt::clear();
        if self.jobs.blocking_send(job).is_err() {
            bail!("the engine thread stopped");
        }
        let mut answer = String::new();
        let mut cursor = Cursor::LineStart;
        let mut stdout = std::io::stdout();
        let mut ended = false;
        // The turn is over when the engine thread lets go of its events: after `Done` it
        // saves the history and counts the turn, and what it says then comes before the
        // next prompt.
        while let Some(event) = events.blocking_recv() {
            match event {
                // A chat gives no tools, so no answer calls one.
                Event::Started(_) | Event::Call { .. } => {}
                // Thinking (a model's own template that opens it) goes beside the answer.
                Event::Reasoning { text, .. } => {
                    eprint!("{text}");
                    cursor = cursor.after(&text, true);
                }
                Event::Text { text, .. } => {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                    cursor = cursor.after(&text, false);
                    answer.push_str(&text);
                }
                Event::Done {
                    finish,
                    usage,
                    decode_rate,
                    ..
                } => {
                    ended = true;
                    cursor.end_line()?;
                    let stopped = interrupt::requested();
                    if stopped && usage.completion == 0 {
                        // Nothing was answered, so the turn is not kept (an empty answer
                        // would be in every later prompt).
                        eprintln!(
                            "[chat] stopped before the answer began; the message is not kept"
                        );
                        self.conversation.withdraw();
                        continue;
                    }
                    let ending = match finish {
                        _ if stopped => "interrupted",
                        Finish::Stop | Finish::StopString(_) | Finish::ToolCalls => "end of answer",
                        Finish::Length => "NGEN reached",
                    };
                    let rate = decode_rate.map_or(String::new(), |r| format!(" | {r:.1} tok/s"));
                    eprintln!(
                        "[chat] {} prompt tokens ({} cached) | {} generated ({ending}){rate}",
                        usage.prompt, usage.cached, usage.completion
                    );
                    self.conversation.answer(std::mem::take(&mut answer));
                    self.last = Some(Figures {
                        prompt: usage.prompt,
                        cached: usage.cached,
                        generated: usage.completion,
                        rate: decode_rate,
                    });
                }
                Event::Failed(err) => {
                    ended = true;
                    cursor.end_line()?;
                    eprintln!("[chat] {}; the message is not kept", err.message);
                    self.conversation.withdraw();
                }
            }
        }
        interrupt::clear();
        if !ended {
            self.conversation.withdraw();
            bail!("the engine thread stopped");
        }
        Ok(())
    }

    /// Answer `command` on stderr; whether the chat goes on (not after `/exit`).
    fn command(&mut self, command: Command) -> bool {
        match command {
            Command::Exit => return false,
            Command::Help => eprintln!("[chat] {}", commands::HELP),
            Command::System(Some(text)) => {
                self.conversation.system = Some(text.to_string());
                eprintln!("[chat] system prompt set: the next message's prompt begins with it");
            }
            Command::System(None) => match &self.conversation.system {
                Some(text) => eprintln!("[chat] system prompt: {text}"),
                None => eprintln!("[chat] no system prompt (/system TEXT sets one)"),
            },
            Command::Reset => {
                self.conversation.reset();
                let kept = if self.conversation.system.is_some() {
                    " (the system prompt kept)"
                } else {
                    ""
                };
                eprintln!("[chat] a new conversation{kept}");
            }
            Command::Save(path) => match self.conversation.save(Path::new(path)) {
                Ok(()) => eprintln!(
                    "[chat] {} messages saved to {path}",
                    self.conversation.message_count()
                ),
                Err(err) => eprintln!("[chat] /save: {err:#}"),
            },
            Command::Load(path) => match Conversation::load(Path::new(path)) {
                Ok(loaded) => {
                    self.conversation = loaded;
                    let system = if self.conversation.system.is_some() {
                        "a system prompt and "
                    } else {
                        ""
                    };
                    eprintln!(
                        "[chat] loaded {system}{} messages from {path}",
                        self.conversation.message_count()
                    );
                }
                Err(err) => eprintln!("[chat] /load: {err:#}; the conversation is unchanged"),
            },
            Command::Stats => self.stats(),
            Command::Wrong(message) => eprintln!("[chat] {message}"),
        }
        true
    }

    /// `/stats`.
    fn stats(&self) {
        match &self.last {
            Some(last) => eprintln!(
                "[chat] last turn: {} prompt tokens ({} cached), {} generated{}",
                last.prompt,
                last.cached,
                last.generated,
                last.rate
                    .map_or(String::new(), |rate| format!(", {rate:.1} tok/s"))
            ),
            None => eprintln!("[chat] no turn yet"),
        }
        let (generated, cache) = self.metrics.totals();
        eprintln!(
            "[chat] this conversation: {} messages; this run: {generated} tokens generated",
            self.conversation.message_count()
        );
        let lookups = cache.vram_hits + cache.pin_hits + cache.lru_hits + cache.misses;
        if lookups == 0 {
            eprintln!("[chat] expert cache: no lookups yet");
        } else {
            eprintln!(
                "[chat] expert cache: {:.1}% of {lookups} expert lookups answered from memory",
                cache.hit_rate()
            );
        }
    }
}
