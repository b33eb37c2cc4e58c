//! The prefill/decode loop: the prompt in one batched forward, then one token at a time,
//! greedy (the first maximum wins, as `torch.argmax`) or drawn by a [`Sampler`], until the
//! count, a stop id or a Ctrl-C; with an engine that drafts, several tokens per forward by
//! speculative decoding, which gives the same tokens.

use std::fmt;
use std::time::Instant;

use anyhow::{bail, Result};

use crate::engines::{Engine, Logits, State};
use crate::interrupt;
use crate::sampling::Sampler;

/// The context of a forward's failure after the prompt: the tokens generated before it,
/// for a caller that still shows them (`anyhow`'s `downcast_ref` finds it).
#[derive(Debug)]
pub struct FailedAfter {
    pub tokens: Vec<u32>,
}

impl fmt::Display for FailedAfter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the generation stopped after {} tokens",
            self.tokens.len()
        )
    }
}

/// `err` of a decode forward, with the tokens generated before it.
fn failed_after(err: anyhow::Error, tokens: &[u32]) -> anyhow::Error {
    err.context(FailedAfter {
        tokens: tokens.to_vec(),
    })
}

/// Called after each forward that emitted tokens, with how many it emitted (placement
/// passes such as `REPIN` run here).
pub type OnTokens<'a> = &'a mut dyn FnMut(&dyn Engine, u64) -> Result<()>;

/// What a generation produced and what it cost.
pub struct Generation {
    pub tokens: Vec<u32>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Whether any logit along the way was NaN or infinite.
    pub non_finite: bool,
    /// How speculative decoding went, when the engine drafted.
    pub speculation: Option<Speculation>,
    /// Why it ended.
    pub ending: Ending,
}

/// Speculative decoding's bookkeeping: verifying forwards after the prefill, the tokens
/// they produced, and the draft tokens proposed and accepted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Speculation {
    pub depth: usize,
    pub forwards: usize,
    pub tokens: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl fmt::Display for Speculation {
    /// `speculation (DRAFT=d): T tokens/forward (F forwards per N tokens) | MTP acceptance P% (A/D)`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
        write!(
            f,
            "speculation (DRAFT={}): {:.2} tokens/forward ({} forwards per {} tokens) | MTP acceptance {:.0}% ({}/{})",
            self.depth,
            ratio(self.tokens, self.forwards),
            self.forwards,
            self.tokens,
            100.0 * ratio(self.accepted, self.drafted),
            self.accepted,
            self.drafted
        )
    }
}

impl Generation {
    /// Whether a signal stopped the prefill, so that nothing was generated.
    pub fn stopped_in_prefill(&self) -> bool {
        self.ending == Ending::Interrupted && self.tokens.is_empty()
    }

    /// A generation whose prefill (started at `started`) a signal stopped: no tokens.
    fn interrupted_in_prefill(started: Instant, speculation: Option<Speculation>) -> Generation {
        Generation {
            tokens: Vec::new(),
            prefill_seconds: started.elapsed().as_secs_f64(),
            decode_seconds: 0.0,
            non_finite: false,
            speculation,
            ending: Ending::Interrupted,
        }
    }

    /// Decode throughput: tokens after the first (which comes from the prefill) per second.
    pub fn decode_tokens_per_second(&self) -> f64 {
        let decoded = self.tokens.len().saturating_sub(1);
        if decoded == 0 || self.decode_seconds <= 0.0 {
            0.0
        } else {
            decoded as f64 / self.decode_seconds
        }
    }
}

/// Greedily generate `count` tokens after `prompt`, from a new state; speculatively (same
/// tokens) when the engine drafts.
pub fn greedy(engine: &dyn Engine, prompt: &[u32], count: usize) -> Result<Generation> {
    let mut state = engine.new_state();
    greedy_with(engine, &mut state, prompt, count, &[], &mut |_, _| Ok(()))
}

/// [`greedy`], ending early when it chooses one of `stops` (not kept in the tokens) and
/// calling `on_tokens` as tokens come out. A Ctrl-C stops it after the current forward
/// with the tokens so far.
pub fn greedy_with(
    engine: &dyn Engine,
    state: &mut State,
    prompt: &[u32],
    count: usize,
    stops: &[u32],
    on_tokens: OnTokens,
) -> Result<Generation> {
    let policy = Policy {
        count,
        sampler: &mut Sampler::greedy(),
        stops,
    };
    generate_with(engine, state, prompt, policy, on_tokens, &mut |_| {
        Ok(Flow::Continue)
    })
}

/// Called with each generated token as soon as it is chosen (streaming); stop tokens are
/// not passed. [`Flow::Halt`] ends the generation after this token.
pub type OnToken<'a> = &'a mut dyn FnMut(u32) -> Result<Flow>;

/// Whether a generation goes on after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Halt,
}

/// How tokens are chosen and when generation ends.
pub struct Policy<'a> {
    /// At most this many tokens.
    pub count: usize,
    pub sampler: &'a mut Sampler,
    /// Ids that end the generation when chosen; they are not part of the output.
    pub stops: &'a [u32],
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// `count` tokens were produced.
    Limit,
    /// This stop id was chosen.
    Stop(u32),
    /// A Ctrl-C asked to stop.
    Interrupted,
    /// The caller's [`OnToken`] halted it (a stop string, a client gone).
    Halted,
}

/// Generate up to `policy.count` tokens after `prompt` into `state`, emptied first, each
/// chosen by the policy's sampler, ending early on a stop id or a Ctrl-C (after the current
/// forward); through [`speculate`] when the engine drafts.
pub fn generate_with(
    engine: &dyn Engine,
    state: &mut State,
    prompt: &[u32],
    policy: Policy,
    on_tokens: OnTokens,
    on_token: OnToken,
) -> Result<Generation> {
    *state = engine.new_state();
    generate_after(engine, state, prompt, policy, on_tokens, on_token)
}

/// [`generate_with`] where `state` already holds the first positions of `prompt` (a
/// conversation's earlier turns): only the rest is prefilled. The state must hold fewer
/// positions than the prompt has tokens.
pub fn generate_after(
    engine: &dyn Engine,
    state: &mut State,
    prompt: &[u32],
    policy: Policy,
    on_tokens: OnTokens,
    on_token: OnToken,
) -> Result<Generation> {
    let cached = state.position();
    if cached >= prompt.len() {
        bail!(
            "{cached} cached positions cannot be reused for a {}-token prompt",
            prompt.len()
        );
    }
    let depth = engine.draft_depth();
    if depth > 0 {
        return speculate(
            engine,
            state,
            &prompt[cached..],
            depth,
            policy,
            on_tokens,
            on_token,
        );
    }
    let started = Instant::now();
    let Some(mut logits) = prefill(engine, state, &prompt[cached..])? else {
        return Ok(Generation::interrupted_in_prefill(started, None));
    };
    let prefill_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    // Reserved up to a bound: a count may be far larger than any generation gets.
    let mut tokens = Vec::with_capacity(policy.count.min(4096));
    let mut non_finite = false;
    let mut ending = Ending::Limit;
    while tokens.len() < policy.count {
        non_finite |= logits.iter().any(|v| !v.is_finite());
        let token = policy.sampler.pick(&logits);
        if policy.stops.contains(&token) {
            ending = Ending::Stop(token);
            break;
        }
        tokens.push(token);
        let flow = on_token(token)?;
        on_tokens(engine, 1)?;
        if flow == Flow::Halt {
            ending = Ending::Halted;
            break;
        }
        if tokens.len() == policy.count {
            break;
        }
        if interrupt::requested() {
            ending = Ending::Interrupted;
            break;
        }
        logits = engine
            .forward_one(state, &[token], Logits::Last)
            .map_err(|err| failed_after(err, &tokens))?;
    }
    Ok(Generation {
        tokens,
        prefill_seconds,
        decode_seconds: started.elapsed().as_secs_f64(),
        non_finite,
        speculation: None,
        ending,
    })
}

/// The prompt's forward, which a signal may stop between layers: then the state, which
/// holds part of it, is emptied and there are no logits.
fn prefill(engine: &dyn Engine, state: &mut State, tokens: &[u32]) -> Result<Option<Vec<f32>>> {
    match interrupt::abortable(|| engine.forward_one(state, tokens, Logits::Last)) {
        Ok(logits) => Ok(Some(logits)),
        Err(err) if err.is::<interrupt::Interrupted>() => {
            *state = engine.new_state();
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

/// Speculative decoding with the engine's draft head: each forward feeds the token chosen
/// last plus up to `depth` drafted ones; the sampler chooses a token at every fed position
/// in turn, and the drafts are kept while they equal what it chose. Every token is thus
/// chosen from the model's distribution after exactly the tokens before it, one draw per
/// token, so with the same sampler state the tokens are those of one-token-per-forward
/// decoding (given that a forward over several positions computes what single-position
/// forwards would). Rejected positions are dropped from the cache. `fresh` is the part of
/// the prompt the cache does not hold yet.
fn speculate(
    engine: &dyn Engine,
    state: &mut State,
    fresh: &[u32],
    depth: usize,
    policy: Policy,
    on_tokens: OnTokens,
    on_token: OnToken,
) -> Result<Generation> {
    let count = policy.count;
    let started = Instant::now();
    let stats = Speculation {
        depth,
        ..Speculation::default()
    };
    let Some(logits) = prefill(engine, state, fresh)? else {
        return Ok(Generation::interrupted_in_prefill(started, Some(stats)));
    };
    let prefill_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut non_finite = logits.iter().any(|v| !v.is_finite());
    let mut tokens = Vec::with_capacity(count.min(4096));
    let mut stats = stats;
    let mut ending = Ending::Limit;
    if count > 0 {
        let token = policy.sampler.pick(&logits);
        if policy.stops.contains(&token) {
            ending = Ending::Stop(token);
        } else {
            tokens.push(token);
            if on_token(token)? == Flow::Halt {
                ending = Ending::Halted;
            }
            on_tokens(engine, 1)?;
        }
    }
    let vocab = engine.vocab_size();
    while ending == Ending::Limit && tokens.len() < count {
        if interrupt::requested() {
            ending = Ending::Interrupted;
            break;
        }
        let next = tokens[tokens.len() - 1];
        // No draft beyond the last token asked for.
        let drafts = engine.propose(state, next, depth.min(count - tokens.len() - 1))?;
        let start = state.position();
        let mut feed = Vec::with_capacity(drafts.len() + 1);
        feed.push(next);
        feed.extend_from_slice(&drafts);
        let rows = engine
            .forward_one(state, &feed, Logits::All)
            .map_err(|err| failed_after(err, &tokens))?;
        stats.forwards += 1;
        stats.drafted += drafts.len();
        let mut kept = 0;
        let mut emitted = 0;
        for (j, row) in rows.chunks_exact(vocab).enumerate() {
            non_finite |= row.iter().any(|v| !v.is_finite());
            let token = policy.sampler.pick(row);
            if policy.stops.contains(&token) {
                ending = Ending::Stop(token);
                break;
            }
            tokens.push(token);
            emitted += 1;
            let flow = on_token(token)?;
            let hit = drafts.get(j) == Some(&token);
            if hit {
                kept += 1;
            }
            if flow == Flow::Halt {
                ending = Ending::Halted;
                break;
            }
            if !hit || tokens.len() == count {
                break;
            }
        }
        stats.accepted += kept;
        if kept < drafts.len() {
            state.truncate(start + kept + 1)?;
        }
        if emitted > 0 {
            on_tokens(engine, emitted)?;
        }
    }
    stats.tokens = tokens.len().saturating_sub(1);
    Ok(Generation {
        tokens,
        prefill_seconds,
        decode_seconds: started.elapsed().as_secs_f64(),
        non_finite,
        speculation: Some(stats),
        ending,
    })
}
