//! `coli chat`: a conversation in the terminal, on the engine thread `coli serve` uses
//! ([`super::worker`]): each turn's prompt is the whole conversation through the model's
//! chat template, so the KV cache of the turns before is reused, and the history is saved
//! after every turn. The answer streams to stdout; prompts and turn lines go to stderr.
//! Ctrl-C ends the answer in progress (twice: the program); `/reset` starts a new
//! conversation; `/exit` or end of input ends the run as a run ends.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tokio::sync::mpsc;

use super::api::{Finish, Input};
use super::metrics::Metrics;
use super::worker::{self, Event, Job};
use crate::interrupt;
use crate::sampling::Sampler;
use crate::settings::Settings;
use crate::startup::Positionals;
use crate::text::ChatMessage;

pub fn run(model: Option<&str>, settings: Settings, positionals: Positionals) -> Result<ExitCode> {
    let temperature = settings.temperature()?;
    let top_p = settings.top_p;
    Sampler::new(temperature, top_p, 0)?;
    let shaping = settings.shaping()?;
    let seed = settings.seed_or_clock();
    let (jobs, queue) = mpsc::channel(1);
    let (engine_thread, info) = worker::spawn(
        model.map(str::to_string),
        settings,
        positionals,
        worker::Serving::one(),
        queue,
        Arc::new(Metrics::default()),
    )?;
    interrupt::install();
    eprintln!(
        "[chat] {}: type a message, then Enter; /reset starts over, /exit or end of input quits",
        info.id
    );
    let mut messages: Vec<ChatMessage> = Vec::new();
    let mut lines = std::io::stdin().lock().lines();
    for turn in 0u64.. {
        eprint!("> ");
        let Some(line) = lines.next() else { break };
        let line = line.context("reading the message from stdin")?;
        match line.trim() {
            "" => continue,
            "/exit" => break,
            "/reset" => {
                messages.clear();
                eprintln!("[chat] a new conversation");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::text("user", line));
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let job = Job {
            input: Input::Chat(messages.clone().into()),
            max_tokens: None,
            temperature,
            top_p,
            seed: seed.wrapping_add(turn),
            stop: Vec::new(),
            routed_experts: false,
            clamp_tokens: false,
            choices: 1,
            shaping: shaping.clone(),
            logprobs: None,
            tools: None,
            grammar: None,
            thinking_budget: None,
            echo: false,
            events: events_tx,
            received: Instant::now(),
        };
        // A Ctrl-C at the prompt is not meant for this answer.
        interrupt::clear();
        if jobs.blocking_send(job).is_err() {
            bail!("the engine thread stopped");
        }
        let mut answer = String::new();
        let mut stdout = std::io::stdout();
        loop {
            match events.blocking_recv() {
                // A chat gives no tools, so no answer calls one.
                Some(Event::Started(_)) | Some(Event::Call { .. }) => {}
                // Thinking (a model's own template that opens it) goes beside the answer.
                Some(Event::Reasoning { text, .. }) => eprint!("{text}"),
                Some(Event::Text { text: piece, .. }) => {
                    stdout.write_all(piece.as_bytes())?;
                    stdout.flush()?;
                    answer.push_str(&piece);
                }
                Some(Event::Done { usage, .. })
                    if usage.completion == 0 && interrupt::requested() =>
                {
                    // Stopped during the prefill: nothing was answered, so the turn is not
                    // kept (an empty answer would be in every later prompt).
                    eprintln!("[chat] stopped during the prefill; the message is not kept");
                    messages.pop();
                    break;
                }
                Some(Event::Done { finish, usage, .. }) => {
                    writeln!(stdout)?;
                    let ending = match finish {
                        Finish::Stop | Finish::StopString(_) | Finish::ToolCalls => "stopped",
                        Finish::Length => "NGEN reached",
                    };
                    eprintln!(
                        "[chat] {} prompt tokens ({} cached) | {} generated ({ending})",
                        usage.prompt, usage.cached, usage.completion
                    );
                    messages.push(ChatMessage::text("assistant", std::mem::take(&mut answer)));
                    break;
                }
                Some(Event::Failed(err)) => {
                    eprintln!("[chat] {}", err.message);
                    messages.pop();
                    break;
                }
                None => bail!("the engine thread stopped"),
            }
        }
        interrupt::clear();
    }
    drop(jobs);
    engine_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))
}
