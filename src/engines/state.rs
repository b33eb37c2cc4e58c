//! What a conversation holds between forwards, apart from the weights: a [`State`] (every
//! layer's caches and recurrent states, the position, a draft head's window), created by
//! the engine it belongs to, and the [`Step`]s of one batched forward with the row layout
//! ([`Rows`]) that every engine reads them through.
//!
//! This module owns the shape of a batch; it computes nothing and knows no model. An
//! engine's own state type lives in its file and implements [`SequenceState`], writing and
//! reading its fields with [`state_io`].

use std::any::Any;
use std::io::{self, Read, Write};
use std::ops::Range;

use anyhow::{anyhow, bail, Result};

use super::state_io;

/// One engine's per-sequence state. Implemented by each engine's state type; callers see
/// it only through [`State`], whose clone is the type's.
pub trait SequenceState: Clone + Send + Sync + 'static {
    /// Positions the state holds.
    fn position(&self) -> usize;

    /// Bytes the state holds (caches, recurrent states, pending draft rows).
    fn size_bytes(&self) -> usize;

    /// Whether [`SequenceState::truncate`] to `len` (at most the position) would succeed.
    fn can_truncate(&self, len: usize) -> bool;

    /// Keep the first `len` positions, exactly as if the later ones had never been fed, or
    /// refuse with the reason when the model cannot (a recurrent state keeps no earlier
    /// positions). `len` is at most [`SequenceState::position`].
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Writes every field the state holds (caches, recurrent states, position, draft
    /// window), with [`state_io`]'s lengths and exact bits, so that
    /// [`SequenceState::restore`] gives back a state that continues bit for bit as this one.
    fn save(&self, out: &mut dyn Write) -> io::Result<()>;

    /// Reads what [`SequenceState::save`] wrote into this state, a fresh one of the engine
    /// that wrote it, checking every count and dimension against this state's own shape;
    /// refuses, naming what did not match, and never allocates for a length the stream does
    /// not hold. On an error the state is left partly read: [`State::restore`] keeps it
    /// from being seen.
    fn restore(&mut self, input: &mut dyn Read) -> Result<()>;
}

/// A [`SequenceState`] of any engine, behind one pointer.
trait AnyState: Send + Sync {
    fn position(&self) -> usize;
    fn size_bytes(&self) -> usize;
    fn can_truncate(&self, len: usize) -> bool;
    fn truncate(&mut self, len: usize) -> Result<()>;
    fn save(&self, out: &mut dyn Write) -> io::Result<()>;
    fn restore(&mut self, input: &mut dyn Read) -> Result<()>;
    fn fork(&self) -> Box<dyn AnyState>;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<S: SequenceState> AnyState for S {
    fn position(&self) -> usize {
        SequenceState::position(self)
    }

    fn size_bytes(&self) -> usize {
        SequenceState::size_bytes(self)
    }

    fn can_truncate(&self, len: usize) -> bool {
        SequenceState::can_truncate(self, len)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        SequenceState::truncate(self, len)
    }

    fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        SequenceState::save(self, out)
    }

    fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        SequenceState::restore(self, input)
    }

    fn fork(&self) -> Box<dyn AnyState> {
        Box::new(self.clone())
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A conversation's state: what an engine's forwards add to and read, owned by the caller.
/// Cloning forks the conversation at its current position; both continue exactly as the
/// original would have.
pub struct State {
    engine: &'static str,
    inner: Box<dyn AnyState>,
}

impl State {
    /// The state `inner` of engine `engine` (its `--model` name).
    pub fn new(engine: &'static str, inner: impl SequenceState) -> State {
        State {
            engine,
            inner: Box::new(inner),
        }
    }

    /// The engine the state belongs to.
    pub fn engine(&self) -> &'static str {
        self.engine
    }

    /// Positions the state holds.
    pub fn position(&self) -> usize {
        self.inner.position()
    }

    /// Bytes the state holds.
    pub fn size_bytes(&self) -> usize {
        self.inner.size_bytes()
    }

    /// Keep the first `len` positions, as if the later ones had never been fed; refused
    /// (naming the engine and why) where the model cannot do it exactly. Keeping every
    /// position, or none, is always possible.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        let position = self.position();
        if len > position {
            bail!(
                "cannot keep {len} positions of a {} state that holds {position}",
                self.engine
            );
        }
        if len == position {
            return Ok(());
        }
        self.inner.truncate(len)
    }

    /// Whether [`State::truncate`] to `len` would succeed.
    pub fn can_truncate(&self, len: usize) -> bool {
        let position = self.position();
        len == position || len == 0 || (len < position && self.inner.can_truncate(len))
    }

    /// Writes the engine's name, then every field of the state ([`SequenceState::save`]).
    pub fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.engine.len())?;
        out.write_all(self.engine.as_bytes())?;
        self.inner.save(out)
    }

    /// Reads what [`State::save`] wrote into this state, a fresh one from the engine's
    /// `new_state`. A state another engine wrote, or one whose counts or dimensions differ
    /// from this state's shape, is refused with what did not match; on any error this state
    /// is unchanged.
    pub fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let refused =
            |e: anyhow::Error| anyhow!("cannot restore a saved {} state: {e:#}", self.engine);
        let len = state_io::read_len(input, "the engine's name").map_err(refused)?;
        // The longest engine name is far shorter; more is a corrupt length, not a name.
        if len > 64 {
            return Err(refused(anyhow!("an engine name of {len} bytes")));
        }
        let mut name = vec![0u8; len];
        input
            .read_exact(&mut name)
            .map_err(|_| refused(anyhow!("the saved state ends inside the engine's name")))?;
        if name != self.engine.as_bytes() {
            bail!(
                "a saved {} state cannot be restored into a {} state",
                String::from_utf8_lossy(&name),
                self.engine
            );
        }
        let mut inner = self.inner.fork();
        inner.restore(input).map_err(refused)?;
        self.inner = inner;
        Ok(())
    }

    /// The engine's own state type, or an error when the state belongs to another engine.
    pub fn downcast_mut<S: SequenceState>(&mut self, engine: &'static str) -> Result<&mut S> {
        if self.engine != engine {
            bail!("a {} state was given to the {engine} engine", self.engine);
        }
        match self.inner.as_any_mut().downcast_mut::<S>() {
            Some(state) => Ok(state),
            None => bail!("a {engine} state of another kind was given to the {engine} engine"),
        }
    }
}

impl Clone for State {
    fn clone(&self) -> State {
        State {
            engine: self.engine,
            inner: self.inner.fork(),
        }
    }
}

/// Which logits a step wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// The last position's (a prompt's end, a decode step).
    Last,
    /// Every position's, in order (teacher forcing, a speculative check, perplexity).
    All,
}

/// One sequence's part of a batched forward: its state and the tokens it adds at the
/// positions after those the state holds (one for a decoding sequence, a chunk of a prompt
/// being filled).
pub struct Step<'a> {
    pub state: &'a mut State,
    pub tokens: &'a [u32],
    pub logits: Logits,
}

impl<'a> Step<'a> {
    pub fn new(state: &'a mut State, tokens: &'a [u32], logits: Logits) -> Step<'a> {
        Step {
            state,
            tokens,
            logits,
        }
    }
}

/// One sequence's rows in a batch: where they are among the batch's rows, and the position
/// of the first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    pub rows: Range<usize>,
    pub start: usize,
    pub logits: Logits,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows of `data` (`width` values a row) that are this sequence's.
    pub fn of<'d>(&self, data: &'d [f32], width: usize) -> &'d [f32] {
        &data[self.rows.start * width..self.rows.end * width]
    }

    /// [`Segment::of`], mutable.
    pub fn of_mut<'d>(&self, data: &'d mut [f32], width: usize) -> &'d mut [f32] {
        &mut data[self.rows.start * width..self.rows.end * width]
    }
}

/// The row layout of a batch: every step's tokens one after another, in step order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rows {
    pub segments: Vec<Segment>,
    /// Every step's tokens, in order.
    pub tokens: Vec<u32>,
}

impl Rows {
    /// The layout of `batch`; an empty batch or a step with no tokens is refused.
    pub fn of(batch: &[Step]) -> Result<Rows> {
        if batch.is_empty() {
            bail!("a forward needs at least one sequence");
        }
        if batch.iter().any(|step| step.tokens.is_empty()) {
            bail!("forward needs at least one token");
        }
        let parts: Vec<(&[u32], usize, Logits)> = batch
            .iter()
            .map(|step| (step.tokens, step.state.position(), step.logits))
            .collect();
        Ok(Rows::from_parts(&parts))
    }

    /// The layout of sequences given as (tokens, position of the first, logits wanted).
    pub fn from_parts(parts: &[(&[u32], usize, Logits)]) -> Rows {
        let mut segments = Vec::with_capacity(parts.len());
        let mut tokens = Vec::new();
        for &(part, start, logits) in parts {
            let first = tokens.len();
            tokens.extend_from_slice(part);
            segments.push(Segment {
                rows: first..tokens.len(),
                start,
                logits,
            });
        }
        Rows { segments, tokens }
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The rows whose logits are asked for, in batch order: every row of an
    /// [`Logits::All`] step, the last of a [`Logits::Last`] one.
    pub fn output_rows(&self) -> Vec<usize> {
        self.segments
            .iter()
            .flat_map(|s| match s.logits {
                Logits::All => s.rows.clone(),
                Logits::Last => s.rows.end - 1..s.rows.end,
            })
            .collect()
    }

    /// The rows `picked` of `data` (`width` values a row), side by side.
    pub fn gather(data: &[f32], width: usize, picked: &[usize]) -> Vec<f32> {
        let mut out = Vec::with_capacity(picked.len() * width);
        for &row in picked {
            out.extend_from_slice(&data[row * width..(row + 1) * width]);
        }
        out
    }

    /// `logits` of [`Rows::output_rows`] (`vocab` a row) cut into each step's share.
    pub fn split_logits(&self, logits: Vec<f32>, vocab: usize) -> Vec<Vec<f32>> {
        let mut rest = &logits[..];
        self.segments
            .iter()
            .map(|s| {
                let rows = match s.logits {
                    Logits::All => s.len(),
                    Logits::Last => 1,
                };
                let (mine, after) = rest.split_at(rows * vocab);
                rest = after;
                mine.to_vec()
            })
            .collect()
    }
}

/// The row layout of `batch` and each step's state as engine `engine`'s own type `S`.
pub fn states_of<'b, S: SequenceState>(
    batch: &'b mut [Step],
    engine: &'static str,
) -> Result<(Rows, Vec<&'b mut S>)> {
    let rows = Rows::of(batch)?;
    let states = batch
        .iter_mut()
        .map(|step| step.state.downcast_mut::<S>(engine))
        .collect::<Result<Vec<_>>>()?;
    Ok((rows, states))
}

/// `work` for every sequence of a batch on its own state and rows, side by side on the
/// thread pool: `work(segment, state, out)` with `out` the sequence's rows of `out`
/// (`width` values a row). Each sequence computes what it computes alone.
pub fn per_sequence<S: Send>(
    rows: &Rows,
    states: &mut [S],
    out: &mut [f32],
    width: usize,
    work: impl Fn(&Segment, &mut S, &mut [f32]) + Sync,
) {
    use rayon::prelude::*;
    let mut parts = Vec::with_capacity(rows.segments.len());
    let mut rest = out;
    for segment in &rows.segments {
        let (mine, after) = rest.split_at_mut(segment.len() * width);
        parts.push(mine);
        rest = after;
    }
    rows.segments
        .par_iter()
        .zip(states.par_iter_mut())
        .zip(parts.into_par_iter())
        .for_each(|((segment, state), part)| work(segment, state, part));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct Counter(usize);

    impl SequenceState for Counter {
        fn position(&self) -> usize {
            self.0
        }
        fn size_bytes(&self) -> usize {
            8
        }
        fn can_truncate(&self, _len: usize) -> bool {
            true
        }
        fn truncate(&mut self, len: usize) -> Result<()> {
            self.0 = len;
            Ok(())
        }
        fn save(&self, out: &mut dyn Write) -> io::Result<()> {
            state_io::write_len(out, self.0)
        }
        fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
            self.0 = state_io::read_position(input, "the position")?;
            Ok(())
        }
    }

    #[test]
    fn rows_lay_steps_out_in_order_and_pick_their_logit_rows() {
        let (mut a, mut b) = (State::new("t", Counter(5)), State::new("t", Counter(0)));
        let batch = [
            Step::new(&mut a, &[7], Logits::Last),
            Step::new(&mut b, &[1, 2, 3], Logits::All),
        ];
        let rows = Rows::of(&batch).unwrap();
        assert_eq!(rows.tokens, vec![7, 1, 2, 3]);
        assert_eq!(rows.segments[0].start, 5);
        assert_eq!(rows.segments[1].rows, 1..4);
        assert_eq!(rows.output_rows(), vec![0, 1, 2, 3]);
        let split = rows.split_logits((0..8).map(|v| v as f32).collect(), 2);
        assert_eq!(
            split,
            vec![vec![0.0, 1.0], vec![2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
        );
    }

    #[test]
    fn a_state_refuses_another_engine_and_growth_by_truncation() {
        let mut state = State::new("t", Counter(3));
        assert!(state.downcast_mut::<Counter>("u").is_err());
        assert!(state.truncate(4).is_err());
        let mut fork = state.clone();
        fork.truncate(1).unwrap();
        assert_eq!((state.position(), fork.position()), (3, 1));
    }

    #[test]
    fn a_saved_state_comes_back_into_its_own_engine_only() {
        let mut bytes = Vec::new();
        State::new("t", Counter(7)).save(&mut bytes).unwrap();
        let mut back = State::new("t", Counter(0));
        back.restore(&mut &bytes[..]).unwrap();
        assert_eq!(back.position(), 7);

        let mut other = State::new("u", Counter(0));
        let err = other.restore(&mut &bytes[..]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "a saved t state cannot be restored into a u state"
        );
        // Every cut refuses, and leaves the state as it was.
        for cut in 0..bytes.len() {
            let mut state = State::new("t", Counter(3));
            let err = state.restore(&mut &bytes[..cut]).unwrap_err();
            assert!(
                err.to_string()
                    .starts_with("cannot restore a saved t state: "),
                "{err}"
            );
            assert_eq!(state.position(), 3);
        }
        let mut huge = Vec::new();
        state_io::write_u64(&mut huge, u64::MAX).unwrap();
        let err = back.restore(&mut &huge[..]).unwrap_err();
        assert!(err.to_string().contains("engine name of"), "{err}");
    }

    #[test]
    fn empty_batches_and_steps_are_refused() {
        assert!(Rows::of(&[]).is_err());
        let mut a = State::new("t", Counter(0));
        assert!(Rows::of(&[Step::new(&mut a, &[], Logits::Last)]).is_err());
    }
}
