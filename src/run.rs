//! One run of the main job: the mode the settings ask for (`Mode`: perplexity, text from
//! a prompt, a replay or a generation from ids, or the oracle comparison), resolved once
//! before the weights load; the model opened and loaded by `startup`; then that mode run
//! and reported.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::engines::{Engine, Logits, State, Step};
use crate::experts::budget::proc_field;
use crate::generate::{greedy_with, Ending, FailedAfter};
use crate::interrupt;
use crate::oracle::{self, Reference};
use crate::perplexity;
use crate::session::{RunKind, Session};
use crate::settings::{Settings, Source};
use crate::snapshot::Snapshot;
use crate::startup::{self, Loaded, Positionals};
use crate::text::TextMode;

/// The main job; a run that a signal stopped exits `128 + signal` once it has saved.
pub fn main_job(
    model: Option<&str>,
    settings: &Settings,
    positionals: Positionals,
) -> Result<ExitCode> {
    let code = job(model, settings, positionals)?;
    Ok(interrupt::exit_status().map_or(code, ExitCode::from))
}

/// What the main job does, resolved once from the settings before the weights load.
enum Mode<'s> {
    /// `PPL=1`: score the perplexity of windows of `CTX` tokens.
    Perplexity(perplexity::Job),
    /// `PROMPT=`: text after a prompt, sampled (or greedy) and streamed.
    Text(Box<TextMode>),
    /// `REPLAY=1` with `IDS=`: the fixed-workload decode benchmark.
    Replay(&'s [u32]),
    /// `IDS=`: greedy token ids after these.
    Ids(&'s [u32]),
    /// None of those: the comparison with the reference, greedy or teacher-forced (`TF=1`);
    /// `strict` (`ORACLE_STRICT=1`) makes a mismatch exit 1.
    Oracle { teacher_forced: bool, strict: bool },
}

impl<'s> Mode<'s> {
    /// The mode the settings ask for, with the files it reads before the weights are mapped
    /// (text mode's tokenizer, a perplexity run's text and base) checked.
    fn resolve(settings: &'s Settings, dir: &Path) -> Result<Mode<'s>> {
        let text = TextMode::from_settings(settings, dir)?;
        if let Some(job) = perplexity::Job::from_settings(settings, dir)? {
            return Ok(Mode::Perplexity(job));
        }
        if let Some(text) = text {
            return Ok(Mode::Text(Box::new(text)));
        }
        Ok(match (settings.ids.as_deref(), settings.replay) {
            (Some(ids), true) => Mode::Replay(ids),
            (Some(ids), false) => Mode::Ids(ids),
            (None, true) => {
                bail!("REPLAY=1 decodes the ids given with IDS=\"...\"; IDS is not set")
            }
            (None, false) => {
                // A first run often names a model and nothing else: say what this mode is and
                // what to run instead before the weights load, not after.
                if settings.reference.is_none() && !reference_path(settings, dir).exists() {
                    bail!("{}", no_reference(settings, dir));
                }
                Mode::Oracle {
                    teacher_forced: settings.tf,
                    strict: settings.oracle_strict,
                }
            }
        })
    }
}

/// `REF`, else the snapshot's `ref.json`: the oracle's reference.
fn reference_path(settings: &Settings, dir: &Path) -> PathBuf {
    settings
        .reference
        .clone()
        .unwrap_or_else(|| dir.join("ref.json"))
}

/// What a run with no prompt, no ids and no reference is told: that it asked for the oracle
/// check, what that reads, and the commands that generate text instead, with its `SNAP`.
fn no_reference(settings: &Settings, dir: &Path) -> String {
    let snap = shell_word(
        &settings
            .snap
            .as_deref()
            .unwrap_or(dir)
            .display()
            .to_string(),
    );
    let instead = [
        (
            format!("coli SNAP={snap} PROMPT=\"The licence grants you\" NGEN=40"),
            "text after a prompt (or -p TEXT, -f FILE)",
        ),
        (
            format!("coli chat SNAP={snap}"),
            "a conversation in the terminal",
        ),
        (
            format!("coli serve SNAP={snap}"),
            "OpenAI and Anthropic APIs on 127.0.0.1:8080",
        ),
    ];
    let width = instead
        .iter()
        .map(|(command, _)| command.len())
        .max()
        .unwrap_or(0);
    let mut message = format!(
        "no PROMPT=, IDS= or reference: without a prompt or ids a run is the oracle mode, a check of the model against a transformers reference (greedy, or teacher-forced with TF=1), and it reads {} (or REF=<path>), which is not there.\nTo generate text, chat or serve the model instead:",
        reference_path(settings, dir).display()
    );
    for (command, what) in instead {
        message.push_str(&format!("\n  {command:<width$}   {what}"));
    }
    message
}

/// `word` as a shell reads it back: as it is when it holds no character the shell treats
/// specially, else in single quotes.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./,:@%+=".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

fn job(model: Option<&str>, settings: &Settings, positionals: Positionals) -> Result<ExitCode> {
    if crate::verbosity::verbose() {
        for given in settings.given() {
            let from = match given.source {
                Source::Argument => "argument",
                Source::Environment => "environment",
            };
            eprintln!(
                "[settings] {}={} ({from})",
                given.key,
                crate::text::excerpt(&given.value)
            );
        }
    }
    let (snapshot, name) = startup::open(model, settings)?;
    let mode = Mode::resolve(settings, snapshot.dir())?;
    let loaded = startup::load(settings, positionals, &snapshot, name)?;
    // Text mode's stdout is the generated text alone; its report lines go to stderr.
    loaded.print_banner(matches!(mode, Mode::Text(_)));
    let run = Run {
        settings,
        snapshot: &snapshot,
        loaded: &loaded,
    };
    match mode {
        Mode::Perplexity(job) => run.perplexity(job),
        Mode::Text(text) => run.text(&text),
        Mode::Replay(ids) => run.replay(ids),
        Mode::Ids(ids) => run.ids(ids),
        Mode::Oracle {
            teacher_forced,
            strict,
        } => run.oracle(teacher_forced, strict),
    }
}

/// A loaded model and the settings of its run: what every mode starts from.
struct Run<'a> {
    settings: &'a Settings,
    snapshot: &'a Snapshot,
    loaded: &'a Loaded,
}

/// The prompt a mode runs, for the context check.
struct Prompt<'a> {
    /// How a message names it.
    what: &'a str,
    positions: usize,
    /// `NGEN` tokens follow it, cut to what the context leaves.
    then_ngen: bool,
}

/// A run under way: its telemetry, `NGEN` within the context, and when it began.
struct Begun {
    session: Session,
    ngen: usize,
    started: Instant,
}

impl Run<'_> {
    fn engine(&self) -> &dyn Engine {
        self.loaded.engine.as_ref()
    }

    fn reference_path(&self) -> PathBuf {
        reference_path(self.settings, self.snapshot.dir())
    }

    /// What every mode does before its first forward: its prompt checked against the
    /// model's context (refused beyond it; `NGEN` cut to what is left), the signal handlers
    /// installed and the session started. Only generation folds its routing into the
    /// history (`kind`); an oracle or perplexity run scores.
    fn begin(&self, kind: RunKind, prompt: Option<Prompt>) -> Result<Begun> {
        let settings = self.settings;
        let mut ngen = settings.ngen;
        let limit = startup::context_limit(self.snapshot, settings);
        if let (Some(limit), Some(prompt)) = (limit, prompt) {
            let Prompt {
                what,
                positions,
                then_ngen,
            } = prompt;
            if positions > limit {
                bail!("{what} takes {positions} positions, beyond the model's max_position_embeddings ({limit}) in config.json: shorten it, or pass LONG_CONTEXT=1 to run positions it was not trained on");
            }
            if then_ngen && ngen > limit - positions {
                eprintln!(
                    "[context] NGEN={ngen}: generation stops at the model's {limit} positions ({} tokens after this prompt); LONG_CONTEXT=1 goes on",
                    limit - positions
                );
                ngen = limit - positions;
            }
        }
        interrupt::install(interrupt::Stopping::Run);
        let started = Instant::now();
        let session = self
            .loaded
            .start_session(settings, self.snapshot, kind, |engine| {
                spread_experts(engine, settings)
            })?;
        Ok(Begun {
            session,
            ngen,
            started,
        })
    }

    /// The end of a generating run that failed part-way (a shard that changed, an expert
    /// that cannot be read): what it generated is still folded into the history, `STATS`
    /// written and the trace flushed, as at a finished run's end; then `err` ends the run.
    fn failed(&self, session: &mut Session, err: anyhow::Error) -> anyhow::Error {
        session.finish(self.engine(), RunKind::Generating);
        err
    }

    /// [`Run::begin`] of a generating run over `IDS` (then `NGEN` more when `then_ngen`),
    /// every id checked against the vocabulary.
    fn begin_ids(&self, ids: &[u32], then_ngen: bool) -> Result<Begun> {
        let prompt = Prompt {
            what: "IDS",
            positions: ids.len(),
            then_ngen,
        };
        let begun = self.begin(RunKind::Generating, Some(prompt))?;
        self.check_ids(ids)?;
        Ok(begun)
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.engine().vocab_size();
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("IDS: token id {bad} is outside the vocabulary (vocab_size {vocab})");
        }
        Ok(())
    }

    fn perplexity(&self, job: perplexity::Job) -> Result<ExitCode> {
        let engine = self.engine();
        let prompt = Prompt {
            what: "a CTX window",
            positions: self.settings.ctx,
            then_ngen: false,
        };
        let Begun {
            mut session,
            started,
            ..
        } = self.begin(RunKind::Scoring, Some(prompt))?;
        job.run(engine, &self.reference_path())?;
        println!("{}", report_line(engine, 0.0));
        println!("{}", profile_line(engine, &started));
        Ok(session.finish(engine, RunKind::Scoring))
    }

    fn text(&self, text: &TextMode) -> Result<ExitCode> {
        let engine = self.engine();
        let mut job = text.prepare(self.snapshot, engine)?;
        let prompt = Prompt {
            what: "the prompt",
            positions: job.prompt_tokens(),
            then_ngen: true,
        };
        let Begun {
            mut session,
            ngen,
            started,
        } = self.begin(RunKind::Generating, Some(prompt))?;
        let mut on_tokens =
            |engine: &dyn Engine, emitted: u64| session.after_tokens(engine, emitted);
        let generation = match job.run(engine, ngen, &mut on_tokens, &mut std::io::stdout()) {
            Ok(generation) => generation,
            Err(err) => return Err(self.failed(&mut session, err)),
        };
        if generation.non_finite {
            eprintln!("[text] non-finite logits during generation");
        }
        if let Some(speculation) = &generation.speculation {
            crate::note!("{speculation}");
        }
        crate::note!("{}", job.summary(&generation));
        crate::note!(
            "{}",
            report_line(engine, generation.decode_tokens_per_second())
        );
        crate::note!("{}", profile_line(engine, &started));
        Ok(session.finish(engine, RunKind::Generating))
    }

    fn replay(&self, ids: &[u32]) -> Result<ExitCode> {
        let engine = self.engine();
        let Begun {
            mut session,
            started,
            ..
        } = self.begin_ids(ids, false)?;
        let line = match replay(engine, ids, self.settings.batch, &mut session) {
            Ok(line) => line,
            Err(err) => return Err(self.failed(&mut session, err)),
        };
        println!("{line}");
        println!("{}", report_line(engine, 0.0));
        println!("{}", profile_line(engine, &started));
        Ok(session.finish(engine, RunKind::Generating))
    }

    fn ids(&self, ids: &[u32]) -> Result<ExitCode> {
        let engine = self.engine();
        let Begun {
            mut session,
            ngen,
            started,
        } = self.begin_ids(ids, true)?;
        let mut on_tokens =
            |engine: &dyn Engine, emitted: u64| session.after_tokens(engine, emitted);
        // A generation ends where the model says it ends, as in text mode.
        let stops = engine.stop_tokens().to_vec();
        let mut state = engine.new_state();
        let generation = match greedy_with(engine, &mut state, ids, ngen, &stops, &mut on_tokens) {
            Ok(generation) => generation,
            Err(err) => {
                if let Some(failed) = err.downcast_ref::<FailedAfter>() {
                    println!("{}", oracle::join(&failed.tokens));
                }
                return Err(self.failed(&mut session, err));
            }
        };
        if generation.stopped_in_prefill() {
            eprintln!(
                "[coli] stopped during the prefill of {} tokens: nothing generated",
                ids.len()
            );
        }
        if let Ending::Stop(id) = generation.ending {
            eprintln!(
                "[stop] stop id {id} chosen after {} tokens (of NGEN={ngen}); it is not printed",
                generation.tokens.len()
            );
        }
        println!("{}", oracle::join(&generation.tokens));
        if let Some(speculation) = &generation.speculation {
            println!("{speculation}");
        }
        println!(
            "{}",
            report_line(engine, generation.decode_tokens_per_second())
        );
        println!("{}", profile_line(engine, &started));
        Ok(session.finish(engine, RunKind::Generating))
    }

    fn oracle(&self, teacher_forced: bool, strict: bool) -> Result<ExitCode> {
        let engine = self.engine();
        let Begun { mut session, .. } = self.begin(RunKind::Scoring, None)?;
        let reference = Reference::load(&self.reference_path(), engine.vocab_size())?;
        let outcome = if teacher_forced {
            oracle::compare_teacher_forced(engine, &reference)?
        } else {
            oracle::compare_greedy(engine, &reference)?
        };
        println!("{}", report_line(engine, outcome.rate));
        // An oracle run scores the reference's tokens: its routing is traced but not learned.
        let finished = session.finish(engine, RunKind::Scoring);
        if strict && !outcome.passed() {
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
        Ok(finished)
    }
}

/// In an MPI job, the trunk's routed experts spread over the expert ranks: after the history
/// loaded, so that its heat balances the ranks, and before the pins, which go to the ranks
/// that own them. A job of one process has nothing to spread.
fn spread_experts(engine: &dyn Engine, settings: &Settings) -> Result<()> {
    #[cfg(feature = "mpi")]
    if crate::cluster::world_size() > 1 {
        return crate::cluster::Trunk::attach(engine, settings, crate::cluster::world_size());
    }
    let _ = (engine, settings);
    Ok(())
}

/// `Expert cache hit rate: ...`, the line every mode ends with.
fn report_line(engine: &dyn Engine, tokens_per_second: f64) -> String {
    let stats = engine.cache_stats();
    let vram = if stats.vram_hits > 0 {
        format!("{} vram + ", stats.vram_hits)
    } else {
        String::new()
    };
    format!(
        "Expert cache hit rate: {:.1}% ({vram}{} pin + {} lru / {} miss) | RSS: {:.2} GB | {:.1} tok/s",
        stats.hit_rate(),
        stats.pin_hits,
        stats.lru_hits,
        stats.misses,
        resident_set_bytes() as f64 / 1e9,
        tokens_per_second
    )
}

/// `REPLAY=1`: decode `ids` one token at a time (a short untimed warm-up over the first
/// few, then the whole sequence from a fresh state, the expert cache kept), no sampling, and
/// describe the timed pass: tokens per second, hit rate, and what was read from disk (the
/// process's `read_bytes`: expert reads and page faults alike). With `BATCH=N` (`batch`),
/// N sequences decode together, one batched forward a token; sequence `i` is `ids` rotated
/// left by `i`, so that they route differently from the first token.
fn replay(engine: &dyn Engine, ids: &[u32], batch: usize, session: &mut Session) -> Result<String> {
    if ids.is_empty() {
        bail!("REPLAY=1: IDS has no token ids to decode");
    }
    let mut warm = engine.new_state();
    for &id in ids.iter().take(REPLAY_WARMUP) {
        engine.forward_one(&mut warm, &[id], Logits::Last)?;
    }
    let streams: Vec<Vec<u32>> = (0..batch)
        .map(|i| {
            let mut stream = ids.to_vec();
            stream.rotate_left(i % ids.len());
            stream
        })
        .collect();
    let mut states: Vec<State> = (0..batch).map(|_| engine.new_state()).collect();
    let before = engine.cache_stats();
    let read_before = process_read_bytes();
    let started = Instant::now();
    let mut steps_done = 0usize;
    for t in 0..ids.len() {
        if interrupt::requested() {
            break;
        }
        let mut steps: Vec<Step> = states
            .iter_mut()
            .zip(&streams)
            .map(|(state, stream)| Step::new(state, &stream[t..=t], Logits::Last))
            .collect();
        engine.forward_whole(&mut steps)?;
        steps_done += 1;
        session.after_tokens(engine, batch as u64)?;
    }
    let seconds = started.elapsed().as_secs_f64().max(1e-9);
    let window = engine.cache_stats().since(&before);
    let disk = match (read_before, process_read_bytes()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => window.bytes_read,
    };
    let decoded = steps_done * batch;
    let (rate, mb_per_token, gb_per_second) = (
        decoded as f64 / seconds,
        disk as f64 / 1e6 / decoded.max(1) as f64,
        disk as f64 / 1e9 / seconds,
    );
    let what = if batch == 1 {
        format!("{decoded} tokens | {rate:.2} tok/s")
    } else {
        format!("{batch} sequences x {steps_done} tokens | {rate:.2} tok/s aggregate")
    };
    Ok(format!(
        "REPLAY decode: {what} | hit {:.1}% | disk {:.2} GB ({mb_per_token:.1} MB/token, {gb_per_second:.2} GB/s)",
        window.hit_rate(),
        disk as f64 / 1e9,
    ))
}

/// Tokens decoded before REPLAY's timed pass, to fault in the trunk and start the threads.
const REPLAY_WARMUP: usize = 4;

/// The `PROFILE:` line: where the run's time went since `started`.
fn profile_line(engine: &dyn Engine, started: &Instant) -> String {
    use crate::profile::{total, Phase};
    let stats = engine.cache_stats();
    let wall = started.elapsed().as_secs_f64();
    let wait = stats.wait_nanos as f64 / 1e9;
    let matmul = total(Phase::ExpertMatmul).as_secs_f64();
    let attention = total(Phase::Attention).as_secs_f64();
    let head = total(Phase::LmHead).as_secs_f64();
    let exchange = total(Phase::Exchange).as_secs_f64();
    let (shared, dense) = (
        total(Phase::SharedExpert).as_secs_f64(),
        total(Phase::DenseFfn).as_secs_f64(),
    );
    // The indexer runs within attention, whose time holds it.
    let indexer = match total(Phase::Indexer).as_secs_f64() {
        0.0 => String::new(),
        seconds => format!(" (indexer {seconds:.2} s)"),
    };
    let other = (wall - wait - matmul - attention - head - exchange - shared - dense).max(0.0);
    let wasted = stats.ahead_wasted + engine.routed().store.ahead_unused();
    format!(
        "PROFILE: expert-disk {:.2} s service / {wait:.2} s wait | expert-matmul {matmul:.2} s | shared-expert {shared:.2} s | dense-ffn {dense:.2} s | attention {attention:.2} s{indexer} | lm_head {head:.2} s | other {other:.2} s | prefetch {} useful / {wasted} wasted{}{}",
        stats.read_nanos as f64 / 1e9,
        stats.ahead_useful,
        if stats.predicted > 0 {
            format!(
                " ({:.1}% of {} predictions right; {:.1}% of the {} experts predicted layers took were predicted)",
                100.0 * stats.predicted_right as f64 / stats.predicted as f64,
                stats.predicted,
                100.0 * stats.foreseen as f64 / stats.foreseeable.max(1) as f64,
                stats.foreseeable
            )
        } else {
            String::new()
        },
        exchange_part(exchange)
    )
}

/// The `PROFILE:` line's part for an MPI job's trunk: the time its MoE calls spent sending
/// to the expert ranks and waiting for them, in all and per call.
fn exchange_part(seconds: f64) -> String {
    #[cfg(feature = "mpi")]
    if seconds > 0.0 {
        let calls = crate::cluster::exchanges().max(1);
        return format!(
            " | mpi {seconds:.2} s ({:.3} ms a MoE call, {calls} calls)",
            1e3 * seconds / calls as f64
        );
    }
    let _ = seconds;
    String::new()
}

/// Bytes this process has caused to be read from storage (`/proc/self/io`).
fn process_read_bytes() -> Option<u64> {
    proc_field("/proc/self/io", "read_bytes:")
}

fn resident_set_bytes() -> u64 {
    proc_field("/proc/self/status", "VmRSS:").map_or(0, |kib| kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_path_is_quoted_only_where_a_shell_needs_it() {
        assert_eq!(
            shell_word("fixtures/olmoe_trained"),
            "fixtures/olmoe_trained"
        );
        assert_eq!(shell_word("/models/my model"), "'/models/my model'");
        assert_eq!(shell_word("/models/it's"), "'/models/it'\\''s'");
    }
}
