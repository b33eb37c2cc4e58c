//! `PPL=1`: teacher-forced perplexity of a token stream in windows of `CTX` tokens every
//! `PPL_STRIDE`, and `KLD_BASE`: the file of one run's per-position distributions that a
//! later run (another weight format, `ACT_BITS`, another backend) is compared against, as
//! llama.cpp's `llama-perplexity --kl-divergence` does.
//!
//! It owns the windowing, the statistics and the base file's format. It runs the engine
//! only through [`Engine::forward`] and never touches the history: a scoring run does not
//! learn (the session does not save it).
//!
//! Windows: the first starts at token 0, each next one `stride` tokens later, each `ctx`
//! tokens long (the last may be shorter). A window scores the targets after the previous
//! window's end (the first window from its second token), with at least `ctx - stride`
//! tokens of context once the first window is past: the sliding-window perplexity of
//! transformers' guide, which the fixture generator computes the same way. With `stride
//! < ctx` every token but the first is scored exactly once; with `stride = ctx` the
//! windows do not overlap and each window's first token is context only.
//!
//! The base file (`KLD_BASE`, little-endian): the magic `COLIKLD1`, then `u32` vocabulary
//! size, `u32` top-k, `u32` ctx, `u32` stride, `u32` token count, `u64` FNV-1a of the
//! token ids, `u32` scored positions; then per position the target's log-probability,
//! the log of the probability mass outside the top k (both `f32`), and k pairs of `u32`
//! token id and `f32` log-probability, most probable first. The divergence is computed
//! over those k tokens and the rest taken as one outcome, which is never more than the
//! full divergence (coarser outcomes lose information), and equal to it when the rest
//! mass is negligible; both runs round log-probabilities to `f32` the same way, so a run
//! compared with its own base gives exactly 0.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::engines::{Engine, Logits};
use crate::files;
use crate::interrupt;
use crate::oracle::Reference;
use crate::sampling::LogProbs;
use crate::settings::Settings;
use crate::text::tokenizer::TextTokenizer;

/// Tokens per [`Engine::forward`] call within a window: the logits of every position are
/// kept for one call at a time, so memory is bounded for large vocabularies and long
/// windows.
const CHUNK: usize = 256;

/// Tokens of each base position's distribution kept by `KLD_BASE`.
pub const BASE_TOP: usize = 32;

const MAGIC: &[u8; 8] = b"COLIKLD1";

/// A `PPL=1` run, checked before the weights load.
pub struct Job {
    /// The tokens to score, and where they came from; `None`: the reference's `full_ids`.
    ids: Option<(Vec<u32>, String)>,
    windows: Windows,
    base_path: Option<PathBuf>,
    base: Option<Base>,
}

impl Job {
    /// `None` unless `PPL=1`. Reads `PPL_FILE` (tokenized with the snapshot's tokenizer)
    /// and an existing `KLD_BASE`, so that bad input stops the run before anything loads.
    pub fn from_settings(settings: &Settings, dir: &Path) -> Result<Option<Job>> {
        if !settings.ppl {
            let given = [
                ("PPL_FILE", settings.ppl_file.is_some()),
                ("KLD_BASE", settings.kld_base.is_some()),
            ];
            if let Some((key, _)) = given.iter().find(|(_, given)| *given) {
                bail!("{key} is read by perplexity runs only: add PPL=1");
            }
            // The windows' keys have defaults, so only an argument says they were meant; an
            // environment's CTX may be another program's.
            if let Some(key) = ["CTX", "PPL_STRIDE"]
                .into_iter()
                .find(|key| settings.argument(key))
            {
                bail!("{key} sets the windows of a perplexity run (PPL=1) and nothing else: a PROMPT or IDS run generates NGEN tokens within config.json's max_position_embeddings (LONG_CONTEXT=1 goes beyond), and an oracle run reads its reference; drop {key}, or add PPL=1 to score windows of CTX tokens");
            }
            return Ok(None);
        }
        let other_mode = if settings.prompt.is_some() {
            Some("PROMPT")
        } else if settings.replay {
            Some("REPLAY")
        } else {
            None
        };
        if let Some(key) = other_mode {
            bail!("PPL=1 scores PPL_FILE, IDS or the reference's tokens; {key} is another mode: drop one of them");
        }
        let windows = Windows::new(settings.ctx, settings.ppl_stride)?;
        let ids = match (&settings.ppl_file, &settings.ids) {
            (Some(_), Some(_)) => bail!("PPL_FILE and IDS are two sources of tokens: give one"),
            (Some(path), None) => {
                let bytes = files::read_input(path)
                    .with_context(|| format!("PPL_FILE: cannot read {}", path.display()))?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    anyhow::anyhow!(
                        "PPL_FILE: {} is not UTF-8 text (byte {})",
                        path.display(),
                        e.utf8_error().valid_up_to()
                    )
                })?;
                let tokenizer = TextTokenizer::load(dir)?;
                let ids = tokenizer.encode(&text, true)?;
                Some((ids, path.display().to_string()))
            }
            (None, Some(ids)) => Some((ids.to_vec(), "IDS".to_string())),
            (None, None) => None,
        };
        let base_path = settings.kld_base.clone();
        let base = match &base_path {
            Some(path) => Base::open(path)?,
            None => None,
        };
        Ok(Some(Job {
            ids,
            windows,
            base_path,
            base,
        }))
    }

    /// Score the tokens (the reference's `full_ids` at `reference` when none were given),
    /// print the `PPL:` line and, with a base, the `KLD:` line; write the base when it
    /// was missing.
    pub fn run(self, engine: &dyn Engine, reference: &Path) -> Result<()> {
        let vocab = engine.vocab_size();
        let (ids, from) = match self.ids {
            Some(given) => given,
            None => (
                Reference::load(reference, vocab)?.full_ids,
                reference.display().to_string(),
            ),
        };
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            bail!("{from}: token id {bad} is outside the vocabulary (vocab_size {vocab})");
        }
        if let Some(base) = &self.base {
            base.check(vocab, &ids, self.windows)?;
        }
        eprintln!(
            "[PPL] {} tokens of {from}, windows of {} every {}",
            ids.len(),
            self.windows.ctx,
            self.windows.stride
        );
        let measured = measure(engine, &ids, self.windows, self.base.as_ref())?;
        println!("{}", measured.line());
        match (&self.base, &self.base_path) {
            (Some(base), _) => println!("{}", base.compare(&measured)?.line()),
            // A base is every position of the text: a part of it would refuse the next run.
            (None, Some(path)) if measured.stopped.is_some() => eprintln!(
                "[KLD_BASE] {} not written: the run was stopped before every position was scored",
                path.display()
            ),
            (None, Some(path)) => {
                Base::write(path, vocab, &ids, self.windows, &measured)?;
                eprintln!(
                    "[KLD_BASE] wrote {}: {} positions, the top {} of each",
                    path.display(),
                    measured.tokens(),
                    BASE_TOP.min(vocab)
                );
            }
            (None, None) => {}
        }
        Ok(())
    }
}

/// How a token stream is cut into windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Windows {
    pub ctx: usize,
    pub stride: usize,
}

impl Windows {
    /// `CTX` (at least 2) and `PPL_STRIDE` (0: half of `CTX`; at most `CTX`).
    pub fn new(ctx: usize, stride: usize) -> Result<Windows> {
        if ctx < 2 {
            bail!("CTX={ctx}: a perplexity window needs at least 2 tokens");
        }
        let stride = if stride == 0 { ctx / 2 } else { stride };
        if stride > ctx {
            bail!("PPL_STRIDE={stride} is longer than CTX={ctx}: tokens between windows would never be scored");
        }
        Ok(Windows { ctx, stride })
    }

    /// `(begin, end, first scored target)` of each window over `n` tokens.
    pub fn spans(&self, n: usize) -> Vec<(usize, usize, usize)> {
        let mut out = Vec::new();
        if n < 2 {
            return out;
        }
        let (mut begin, mut scored_to) = (0, 1);
        loop {
            let end = (begin + self.ctx).min(n);
            out.push((begin, end, scored_to.max(begin + 1)));
            scored_to = end;
            if end == n {
                return out;
            }
            begin += self.stride;
        }
    }
}

/// One scored position's distribution, as the base file keeps it.
#[derive(Debug, Clone, PartialEq)]
struct Position {
    target_logp: f32,
    rest_logp: f32,
    top: Vec<(u32, f32)>,
}

/// What a `PPL=1` run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Measured {
    /// Negative log-likelihood of each scored target, in nats.
    pub nll: Vec<f64>,
    positions: Vec<Position>,
    /// With a base: KL(base || this run) at each position, and whether the two agree on
    /// the most probable token.
    kld: Vec<f64>,
    same_top: Vec<bool>,
    /// Tokens the engine ran (context included) and the seconds it took.
    forwarded: usize,
    seconds: f64,
    /// When a signal stopped the run: the windows scored, of how many.
    pub stopped: Option<(usize, usize)>,
}

impl Measured {
    pub fn tokens(&self) -> usize {
        self.nll.len()
    }

    /// Keep the first `n` scored positions.
    fn truncate(&mut self, n: usize) {
        self.nll.truncate(n);
        self.positions.truncate(n);
        self.kld.truncate(n);
        self.same_top.truncate(n);
    }

    pub fn mean_nll(&self) -> f64 {
        self.nll.iter().sum::<f64>() / self.nll.len().max(1) as f64
    }

    pub fn perplexity(&self) -> f64 {
        self.mean_nll().exp()
    }

    /// The standard error of the perplexity (delta method over the per-token NLLs, as
    /// llama-perplexity reports it).
    pub fn perplexity_error(&self) -> f64 {
        let n = self.nll.len();
        if n < 2 {
            return 0.0;
        }
        let mean = self.mean_nll();
        let var = self.nll.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        self.perplexity() * (var / n as f64).sqrt()
    }

    /// `PPL: X over N tokens (±err)`, and where a signal stopped the run, after how many
    /// windows.
    pub fn line(&self) -> String {
        let mut line = format!(
            "PPL: {:.4} over {} tokens (\u{b1}{:.4}) | mean NLL {:.6} nats | {} tokens forwarded at {:.1} tok/s",
            self.perplexity(),
            self.tokens(),
            self.perplexity_error(),
            self.mean_nll(),
            self.forwarded,
            self.forwarded as f64 / self.seconds.max(1e-9)
        );
        if let Some((done, of)) = self.stopped {
            line.push_str(&format!(
                " | stopped by a signal after {done} of {of} windows"
            ));
        }
        line
    }
}

/// Score `ids` in `windows`: one teacher-forced pass per window from an empty cache; with
/// a `base` (already [`Base::check`]ed), compare each position with it. A signal stops it
/// between windows (a window's forward stops between layers and the window is dropped):
/// what was scored is every position of the windows before.
pub fn measure(
    engine: &dyn Engine,
    ids: &[u32],
    windows: Windows,
    base: Option<&Base>,
) -> Result<Measured> {
    if ids.len() < 2 {
        bail!(
            "PPL=1 needs at least 2 tokens to score (got {}): pass PPL_FILE=<text> or IDS=\"...\"",
            ids.len()
        );
    }
    let vocab = engine.vocab_size();
    let mut measured = Measured {
        nll: Vec::new(),
        positions: Vec::new(),
        kld: Vec::new(),
        same_top: Vec::new(),
        forwarded: 0,
        seconds: 0.0,
        stopped: None,
    };
    let started = Instant::now();
    let spans = windows.spans(ids.len());
    'windows: for (done, &(begin, end, first)) in spans.iter().enumerate() {
        let scored = measured.positions.len();
        let mut state = engine.new_state();
        let mut at = begin;
        while at < end {
            let upto = (at + CHUNK).min(end);
            let forward = interrupt::abortable(|| {
                if interrupt::requested() {
                    return Err(interrupt::Interrupted.into());
                }
                engine.forward_one(&mut state, &ids[at..upto], Logits::All)
            });
            let logits = match forward {
                Ok(logits) => logits,
                Err(err) if err.is::<interrupt::Interrupted>() => {
                    measured.truncate(scored);
                    measured.stopped = Some((done, spans.len()));
                    break 'windows;
                }
                Err(err) => return Err(err),
            };
            measured.forwarded += upto - at;
            // Row r of this call predicts token at + r + 1.
            for (r, row) in logits.chunks_exact(vocab).enumerate() {
                let target = at + r + 1;
                if target < first || target >= end {
                    continue;
                }
                let row = Row::new(row)
                    .with_context(|| format!("PPL: non-finite logits predicting token {target}"))?;
                let position = row.position(ids[target]);
                if let Some(base) = base {
                    let Some(p) = base.positions.get(measured.positions.len()) else {
                        bail!(
                            "KLD_BASE: {} holds fewer positions than this run scores",
                            base.path.display()
                        );
                    };
                    measured.kld.push(divergence(p, &row));
                    measured
                        .same_top
                        .push(p.top.first().map(|t| t.0) == position.top.first().map(|t| t.0));
                }
                measured.nll.push(-f64::from(position.target_logp));
                measured.positions.push(position);
            }
            at = upto;
        }
    }
    measured.seconds = started.elapsed().as_secs_f64();
    Ok(measured)
}

/// One row of logits and its log-probabilities ([`LogProbs`]). Every log-probability is
/// rounded to `f32` the same way, in the base run and in the runs compared with it.
struct Row<'a> {
    logits: &'a [f32],
    probs: LogProbs<'a>,
}

impl<'a> Row<'a> {
    fn new(logits: &'a [f32]) -> Result<Row<'a>> {
        if logits.iter().any(|x| !x.is_finite()) {
            bail!("a logit is NaN or infinite");
        }
        Ok(Row {
            logits,
            probs: LogProbs::new(logits),
        })
    }

    /// The log of the probability of every token outside `top`.
    fn rest_logp(&self, top: &[(u32, f32)]) -> f32 {
        let mut outside = vec![true; self.logits.len()];
        for &(id, _) in top {
            outside[id as usize] = false;
        }
        let rest: f64 = self
            .logits
            .iter()
            .zip(&outside)
            .filter(|(_, &o)| o)
            .map(|(&x, _)| (x as f64 - self.probs.lse()).exp())
            .sum();
        rest.ln() as f32
    }

    /// The target's log-probability, the top [`BASE_TOP`] (most probable first, lowest id
    /// first among equals) and the rest mass's.
    fn position(&self, target: u32) -> Position {
        let top = self.probs.top(BASE_TOP);
        Position {
            target_logp: self.probs.of(target),
            rest_logp: self.rest_logp(&top),
            top,
        }
    }
}

/// FNV-1a of the token ids: the base and a later run must score the same text.
fn ids_hash(ids: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in ids.iter().flat_map(|id| id.to_le_bytes()) {
        h ^= u64::from(byte);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The header fields a base and a run must agree on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header {
    vocab: u32,
    top: u32,
    ctx: u32,
    stride: u32,
    tokens: u32,
    hash: u64,
    positions: u32,
}

impl Header {
    fn of(vocab: usize, ids: &[u32], windows: Windows, positions: usize) -> Result<Header> {
        let n = |x: usize, what: &str| {
            u32::try_from(x).with_context(|| format!("KLD_BASE: {what} {x} does not fit the file"))
        };
        Ok(Header {
            vocab: n(vocab, "vocabulary size")?,
            top: n(BASE_TOP.min(vocab), "top-k")?,
            ctx: n(windows.ctx, "CTX")?,
            stride: n(windows.stride, "PPL_STRIDE")?,
            tokens: n(ids.len(), "token count")?,
            hash: ids_hash(ids),
            positions: n(positions, "position count")?,
        })
    }
}

/// A base file read back.
pub struct Base {
    path: PathBuf,
    header: Header,
    positions: Vec<Position>,
}

impl Base {
    /// Read the base at `path`; `Ok(None)` when there is no file there yet.
    pub fn open(path: &Path) -> Result<Option<Base>> {
        let mut file = match files::open_input(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(e).with_context(|| format!("KLD_BASE: cannot read {}", path.display()))
            }
        };
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .with_context(|| format!("KLD_BASE: cannot read {}", path.display()))?;
        let base = Base::parse(&bytes).with_context(|| {
            format!(
                "KLD_BASE: {} is not a base file this build wrote (left untouched; name a new file to write one)",
                path.display()
            )
        })?;
        Ok(Some(Base {
            path: path.to_path_buf(),
            header: base.0,
            positions: base.1,
        }))
    }

    fn parse(bytes: &[u8]) -> Result<(Header, Vec<Position>)> {
        let mut r = Cursor { bytes, at: 0 };
        if r.take(8)? != MAGIC {
            bail!("no COLIKLD1 magic at the start");
        }
        let header = Header {
            vocab: r.u32()?,
            top: r.u32()?,
            ctx: r.u32()?,
            stride: r.u32()?,
            tokens: r.u32()?,
            hash: r.u64()?,
            positions: r.u32()?,
        };
        if header.top == 0 || header.top > header.vocab {
            bail!("top-k {} for a vocabulary of {}", header.top, header.vocab);
        }
        let per = 8 + 8 * header.top as usize;
        let expected = (header.positions as usize).checked_mul(per);
        if expected != Some(r.bytes.len() - r.at) {
            bail!(
                "{} bytes of positions where the header promises {} x {per}",
                r.bytes.len() - r.at,
                header.positions
            );
        }
        let mut positions = Vec::with_capacity(header.positions as usize);
        for _ in 0..header.positions {
            let target_logp = r.f32()?;
            let rest_logp = r.f32()?;
            let mut top = Vec::with_capacity(header.top as usize);
            for _ in 0..header.top {
                let id = r.u32()?;
                if id >= header.vocab {
                    bail!("token id {id} outside the vocabulary of {}", header.vocab);
                }
                top.push((id, r.f32()?));
            }
            positions.push(Position {
                target_logp,
                rest_logp,
                top,
            });
        }
        Ok((header, positions))
    }

    /// Write `measured` as the base for `ids` at `path`, which must not exist yet.
    pub fn write(
        path: &Path,
        vocab: usize,
        ids: &[u32],
        windows: Windows,
        measured: &Measured,
    ) -> Result<()> {
        let h = Header::of(vocab, ids, windows, measured.positions.len())?;
        let mut out = Vec::with_capacity(44 + measured.positions.len() * (8 + 8 * h.top as usize));
        out.extend_from_slice(MAGIC);
        for x in [h.vocab, h.top, h.ctx, h.stride, h.tokens] {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out.extend_from_slice(&h.hash.to_le_bytes());
        out.extend_from_slice(&h.positions.to_le_bytes());
        for p in &measured.positions {
            out.extend_from_slice(&p.target_logp.to_le_bytes());
            out.extend_from_slice(&p.rest_logp.to_le_bytes());
            for &(id, logp) in &p.top {
                out.extend_from_slice(&id.to_le_bytes());
                out.extend_from_slice(&logp.to_le_bytes());
            }
        }
        files::replace_alone(path, |w: &mut dyn Write| w.write_all(&out))
            .with_context(|| format!("KLD_BASE: cannot write {}", path.display()))
    }

    /// Refuse a base of another text, vocabulary or windowing (before anything is scored).
    pub fn check(&self, vocab: usize, ids: &[u32], windows: Windows) -> Result<()> {
        let mine = Header::of(vocab, ids, windows, 0)?;
        let theirs = self.header;
        let name = self.path.display();
        if theirs.vocab != mine.vocab {
            bail!(
                "KLD_BASE: {name} is of a vocabulary of {}, this model's is {}",
                theirs.vocab,
                mine.vocab
            );
        }
        if (theirs.ctx, theirs.stride) != (mine.ctx, mine.stride) {
            bail!(
                "KLD_BASE: {name} was scored with CTX={} PPL_STRIDE={}, this run asks CTX={} PPL_STRIDE={}",
                theirs.ctx, theirs.stride, mine.ctx, mine.stride
            );
        }
        if (theirs.tokens, theirs.hash) != (mine.tokens, mine.hash) {
            bail!(
                "KLD_BASE: {name} scored another text ({} tokens), this run has {} tokens that differ from it",
                theirs.tokens, mine.tokens
            );
        }
        Ok(())
    }

    /// This run against the base it was measured with: over every position, or over those
    /// scored before a signal stopped the run.
    pub fn compare(&self, measured: &Measured) -> Result<Divergence> {
        let scored = measured.kld.len();
        let whole = scored == self.positions.len();
        let stopped_early = measured.stopped.is_some() && scored < self.positions.len();
        if !(whole || stopped_early) {
            bail!(
                "KLD_BASE: {} holds {} positions, this run scored {}",
                self.path.display(),
                self.positions.len(),
                scored
            );
        }
        let n = scored.max(1) as f64;
        let base_nll = -self.positions[..scored]
            .iter()
            .map(|p| f64::from(p.target_logp))
            .sum::<f64>()
            / n;
        let mut sorted = measured.kld.clone();
        sorted.sort_by(f64::total_cmp);
        let p99 = sorted
            .get(((sorted.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0);
        Ok(Divergence {
            positions: sorted.len(),
            mean: sorted.iter().sum::<f64>() / n,
            p99,
            max: sorted.last().copied().unwrap_or(0.0),
            same_top: measured.same_top.iter().filter(|&&s| s).count() as f64 / n,
            base_ppl: base_nll.exp(),
            ppl_ratio: measured.perplexity() / base_nll.exp(),
        })
    }
}

/// KL(base || this run) at one position, over the base's top tokens and the rest.
fn divergence(p: &Position, q: &Row) -> f64 {
    let term = |lp: f32, lq: f32| {
        let pp = f64::from(lp).exp();
        if pp > 0.0 {
            pp * (f64::from(lp) - f64::from(lq))
        } else {
            0.0
        }
    };
    let kl: f64 = p
        .top
        .iter()
        .map(|&(id, lp)| term(lp, q.probs.of(id)))
        .sum::<f64>()
        + term(p.rest_logp, q.rest_logp(&p.top));
    kl.max(0.0)
}

/// The comparison llama-perplexity prints.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    pub positions: usize,
    pub mean: f64,
    pub p99: f64,
    pub max: f64,
    pub same_top: f64,
    pub base_ppl: f64,
    pub ppl_ratio: f64,
}

impl Divergence {
    pub fn line(&self) -> String {
        format!(
            "KLD: mean {:.6}, 99th percentile {:.6}, max {:.6} over {} positions | top-1 agreement {:.2}% | PPL ratio {:.5} (base PPL {:.4})",
            self.mean,
            self.p99,
            self.max,
            self.positions,
            100.0 * self.same_top,
            self.ppl_ratio,
            self.base_ppl
        )
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let Some(slice) = self.bytes.get(self.at..self.at + n) else {
            bail!("cut short at byte {}", self.at);
        };
        self.at += n;
        Ok(slice)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }

    fn f32(&mut self) -> Result<f32> {
        Ok(f32::from_le_bytes(self.take(4)?.try_into()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_score_every_target_once() {
        let w = Windows::new(128, 64).unwrap();
        assert_eq!(
            w.spans(256),
            vec![(0, 128, 1), (64, 192, 128), (128, 256, 192)]
        );
        // Non-overlapping: each window's first token is context only.
        let w = Windows::new(4, 4).unwrap();
        assert_eq!(w.spans(10), vec![(0, 4, 1), (4, 8, 5), (8, 10, 9)]);
        for (ctx, stride, n) in [(5, 2, 17), (8, 0, 30), (3, 3, 3), (16, 5, 2)] {
            let w = Windows::new(ctx, stride).unwrap();
            let scored: usize = w.spans(n).iter().map(|(_, e, f)| e - f).sum();
            let contextless = w.spans(n).iter().filter(|(b, _, f)| f == &(b + 1)).count();
            assert_eq!(scored, n - contextless, "{ctx} {stride} {n}");
        }
        assert!(Windows::new(1, 1).is_err());
        assert!(Windows::new(4, 5).is_err());
        assert_eq!(Windows::new(8, 0).unwrap().stride, 4);
    }

    #[test]
    fn a_position_keeps_the_top_and_the_rest() {
        let logits: Vec<f32> = (0..40)
            .map(|i| (i % 7) as f32 * 0.5 - (i as f32) * 0.01)
            .collect();
        let row = Row::new(&logits).unwrap();
        let p = row.position(3);
        assert_eq!(p.top.len(), BASE_TOP);
        let mass: f64 =
            p.top.iter().map(|t| f64::from(t.1).exp()).sum::<f64>() + f64::from(p.rest_logp).exp();
        assert!((mass - 1.0).abs() < 1e-5, "{mass}");
        assert!(p.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(Row::new(&[0.0, f32::NAN]).is_err());
        // Against itself: exactly zero.
        assert_eq!(divergence(&p, &row), 0.0);
        // A shifted distribution diverges, even where the top sets differ.
        let mut shifted = logits.clone();
        shifted[6] += 1.0;
        shifted[39] += 5.0;
        assert!(divergence(&p, &Row::new(&shifted).unwrap()) > 1e-3);
    }

    #[test]
    fn a_base_file_round_trips_and_refuses_another_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base.kld");
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let row = Row::new(&logits).unwrap();
        let positions: Vec<Position> = (0..3).map(|t| row.position(t)).collect();
        let mut measured = Measured {
            nll: positions
                .iter()
                .map(|p| -f64::from(p.target_logp))
                .collect(),
            positions,
            kld: Vec::new(),
            same_top: Vec::new(),
            forwarded: 0,
            seconds: 0.0,
            stopped: None,
        };
        let ids = [1, 2, 3, 4];
        let w = Windows::new(4, 2).unwrap();
        assert!(Base::open(&path).unwrap().is_none());
        Base::write(&path, 50, &ids, w, &measured).unwrap();
        let base = Base::open(&path).unwrap().unwrap();
        base.check(50, &ids, w).unwrap();
        assert!(
            base.compare(&measured).is_err(),
            "measured without the base"
        );
        measured.kld = base.positions.iter().map(|p| divergence(p, &row)).collect();
        measured.same_top = vec![true; 3];
        let d = base.compare(&measured).unwrap();
        assert_eq!((d.mean, d.max, d.same_top), (0.0, 0.0, 1.0));
        assert!((d.ppl_ratio - 1.0).abs() < 1e-12);
        let other = base.check(50, &[1, 2, 3, 5], w).unwrap_err().to_string();
        assert!(other.contains("another text"), "{other}");
        assert!(base.check(51, &ids, w).is_err());
        assert!(base.check(50, &ids, Windows::new(4, 4).unwrap()).is_err());
        // A file that is not a base is refused and left as it was.
        std::fs::write(&path, b"not a base").unwrap();
        let err = format!("{:#}", Base::open(&path).err().unwrap());
        assert!(err.contains("not a base file"), "{err}");
        assert_eq!(std::fs::read(&path).unwrap(), b"not a base");
        // A header whose sizes multiply past the address space is refused, not allocated.
        let mut huge = MAGIC.to_vec();
        for x in [1u32 << 31, (1 << 30) - 1, 4, 2, 4] {
            huge.extend_from_slice(&x.to_le_bytes());
        }
        huge.extend_from_slice(&0u64.to_le_bytes());
        huge.extend_from_slice(&(1u32 << 31).to_le_bytes());
        std::fs::write(&path, &huge).unwrap();
        assert!(Base::open(&path).is_err());
        // Cut short.
        Base::write(&dir.path().join("b2"), 50, &ids, w, &measured).unwrap();
        let mut bytes = std::fs::read(dir.path().join("b2")).unwrap();
        bytes.pop();
        std::fs::write(&path, &bytes).unwrap();
        assert!(Base::open(&path).is_err());
    }
}
