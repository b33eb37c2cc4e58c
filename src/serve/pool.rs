//! The prefix cache of `coli serve`: conversation states kept after their turns, each
//! with the token ids it holds, bounded in bytes with least-recently-used eviction. A new
//! prompt starts from the kept state that shares the longest prefix with it — the same
//! request again, a regenerated or edited last message, another client with the same
//! system prompt — cut back to that prefix where the model allows it exactly.
//!
//! With `--kv-dir`, a state evicted, and every state at shutdown, is written to the
//! directory ([`KvDir`]), and a prompt that shares more with a state there than with any
//! in memory starts from it: an agent's preamble survives a restart.
//!
//! Owns the choice of a state and the byte bound; it runs no forward and knows no engine
//! beyond [`State`]'s own answers (its size, whether it can go back to a position).

use super::kv_dir::{KvDir, Saved};
use crate::engines::{Engine, State};

/// A state kept after a turn.
struct Kept {
    /// The token ids at the state's positions, in order.
    tokens: Vec<u32>,
    state: State,
    /// The logits after the last position, for a state kept at the end of a prompt: a
    /// request with exactly these tokens then computes nothing.
    logits: Option<Vec<f32>>,
    /// When it was last put or taken, on the pool's clock.
    used: u64,
}

impl Kept {
    fn bytes(&self) -> u64 {
        (self.state.size_bytes() + 4 * self.tokens.len()) as u64
            + self.logits.as_ref().map_or(0, |l| 4 * l.len() as u64)
    }
}

/// What a prompt starts from.
pub struct Start {
    pub state: State,
    /// Prompt tokens the state already holds (not computed again).
    pub cached: usize,
    /// The logits after the whole prompt, when a kept state held all of it.
    pub logits: Option<Vec<f32>>,
}

/// Kept states, at most `limit` bytes together.
pub struct Pool {
    kept: Vec<Kept>,
    limit: u64,
    clock: u64,
    /// `--kv-dir`: where evicted states go, and are found again.
    disk: Option<KvDir>,
}

impl Pool {
    pub fn new(limit: u64, disk: Option<KvDir>) -> Pool {
        Pool {
            kept: Vec::new(),
            limit,
            clock: 0,
            disk,
        }
    }

    /// Write every kept state to the directory, when there is one (at shutdown).
    pub fn persist(&mut self) {
        for kept in std::mem::take(&mut self.kept) {
            self.write(kept);
        }
    }

    fn write(&mut self, kept: Kept) {
        let Some(disk) = self.disk.as_mut() else {
            return;
        };
        // A checkpoint's logits are not part of a state file; the state after its
        // prompt still serves the prompts that extend it.
        match disk.save(&kept.tokens, &kept.state) {
            Ok(Saved::Written { .. }) => {}
            Ok(Saved::TooLarge { bytes, limit }) => eprintln!(
                "[serve] a kept state of {bytes} bytes is larger than --kv-dir-mb ({limit} bytes): not written"
            ),
            Err(err) => eprintln!("[serve] a kept state was not written: {err:#}"),
        }
    }

    /// The state on disk sharing more than `usable` tokens with `prompt`, cut back to its
    /// usable prefix, if there is one.
    fn start_on_disk(
        &mut self,
        prompt: &[u32],
        usable: usize,
        engine: &dyn Engine,
    ) -> Option<Start> {
        let disk = self.disk.as_mut()?;
        let (entry, common) = disk.best(prompt)?;
        let wanted = common.min(prompt.len() - 1);
        if wanted <= usable {
            return None;
        }
        let (_, mut state) = match disk.load(entry, engine) {
            Ok(found) => found,
            Err(err) => {
                eprintln!("[serve] a kept state on disk was not used: {err:#}");
                return None;
            }
        };
        if !state.can_truncate(wanted) || state.truncate(wanted).is_err() {
            return None;
        }
        Some(Start {
            state,
            cached: wanted,
            logits: None,
        })
    }

    /// States kept and their bytes.
    pub fn size(&self) -> (usize, u64) {
        (self.kept.len(), self.kept.iter().map(Kept::bytes).sum())
    }

    /// The start for `prompt` (non-empty): the kept state sharing its longest usable prefix,
    /// taken out when the prompt extends all of it and forked otherwise, so that the kept
    /// one still serves the prompts it shares less with; `fresh` when none shares anything.
    /// A whole-prompt match with kept logits is used only when `whole` allows it.
    pub fn start(&mut self, prompt: &[u32], whole: bool, engine: &dyn Engine) -> Start {
        let memory = self.best(prompt, whole);
        let usable = memory.map_or(0, |(_, usable)| usable);
        if let Some(start) = self.start_on_disk(prompt, usable, engine) {
            return start;
        }
        self.start_from(memory, prompt, || engine.new_state())
    }

    /// The kept state in memory with the longest usable prefix of `prompt`, and its length.
    fn best(&self, prompt: &[u32], whole: bool) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, kept) in self.kept.iter().enumerate() {
            let usable = usable_prefix(kept, prompt, whole);
            let better = match best {
                None => usable > 0,
                Some((j, len)) => usable > len || (usable == len && kept.used > self.kept[j].used),
            };
            if better {
                best = Some((i, usable));
            }
        }
        best
    }

    /// The start from `best` ([`Pool::best`]), or `fresh` without one.
    fn start_from(
        &mut self,
        best: Option<(usize, usize)>,
        prompt: &[u32],
        fresh: impl FnOnce() -> State,
    ) -> Start {
        let Some((i, usable)) = best else {
            return Start {
                state: fresh(),
                cached: 0,
                logits: None,
            };
        };
        self.clock += 1;
        let kept = &mut self.kept[i];
        kept.used = self.clock;
        if usable == prompt.len() {
            return Start {
                state: kept.state.clone(),
                cached: usable,
                logits: kept.logits.clone(),
            };
        }
        // A state that can go back keeps nothing the prompt's own state will not hold again:
        // it is taken. One that cannot stays, for the prompts that fork from it.
        let takes = usable == kept.tokens.len() && kept.state.can_truncate(0) && {
            let position = kept.state.position();
            position == 0 || kept.state.can_truncate(position - 1)
        };
        let mut state = if takes {
            self.kept.swap_remove(i).state
        } else {
            kept.state.clone()
        };
        if state.truncate(usable).is_err() {
            // `usable_prefix` asked the state first; this cannot happen, but a fresh state
            // is always right.
            return Start {
                state: fresh(),
                cached: 0,
                logits: None,
            };
        }
        Start {
            state,
            cached: usable,
            logits: None,
        }
    }

    /// Keep `state`, which holds `tokens` (and, with `logits`, the logits after them).
    /// Kept states that it makes useless go: one with the same tokens, and, when this one
    /// can go back to any of its positions, those whose tokens are a prefix of these.
    /// Then the least recently used go until the pool fits its bound; a state larger than
    /// the bound is not kept.
    pub fn put(&mut self, tokens: Vec<u32>, state: State, logits: Option<Vec<f32>>) {
        if tokens.is_empty() || state.position() != tokens.len() {
            return;
        }
        self.kept.retain(|k| {
            let same = k.tokens == tokens && k.logits.is_some() == logits.is_some();
            let covered = k.logits.is_none()
                && tokens.starts_with(&k.tokens)
                && state.can_truncate(k.tokens.len());
            !(same || covered)
        });
        self.clock += 1;
        self.kept.push(Kept {
            tokens,
            state,
            logits,
            used: self.clock,
        });
        let mut total: u64 = self.kept.iter().map(Kept::bytes).sum();
        while total > self.limit {
            let Some(oldest) = (0..self.kept.len()).min_by_key(|&i| self.kept[i].used) else {
                break;
            };
            let evicted = self.kept.swap_remove(oldest);
            total -= evicted.bytes();
            self.write(evicted);
        }
    }
}

/// The prompt tokens `kept` can give a prompt: the longest common prefix, short of the
/// whole prompt (whose last logits must be computed) unless the kept logits are those
/// after exactly this prompt, and only as far back as the state can go.
fn usable_prefix(kept: &Kept, prompt: &[u32], whole: bool) -> usize {
    let common = kept
        .tokens
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    if whole && kept.logits.is_some() && common == prompt.len() && common == kept.tokens.len() {
        return common;
    }
    if kept.logits.is_some() {
        // A checkpoint serves only the exact prompt it was kept for, or one it begins.
        return if common == kept.tokens.len() && common < prompt.len() {
            common
        } else {
            0
        };
    }
    let usable = common.min(prompt.len() - 1);
    if kept.state.can_truncate(usable) {
        usable
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::state::SequenceState;

    /// A state that can go back only to 0, or to anything.
    #[derive(Clone)]
    struct Toy {
        position: usize,
        recurrent: bool,
    }

    impl SequenceState for Toy {
        fn position(&self) -> usize {
            self.position
        }
        fn size_bytes(&self) -> usize {
            100 * self.position
        }
        fn can_truncate(&self, len: usize) -> bool {
            !self.recurrent || len == 0
        }
        fn truncate(&mut self, len: usize) -> anyhow::Result<()> {
            anyhow::ensure!(self.can_truncate(len), "recurrent");
            self.position = len;
            Ok(())
        }
        fn save(&self, _out: &mut dyn std::io::Write) -> std::io::Result<()> {
            unreachable!("the pool never saves")
        }
        fn restore(&mut self, _input: &mut dyn std::io::Read) -> anyhow::Result<()> {
            unreachable!("the pool never restores")
        }
    }

    fn toy(position: usize, recurrent: bool) -> State {
        State::new(
            "toy",
            Toy {
                position,
                recurrent,
            },
        )
    }

    /// [`Pool::start`] without a directory, and so without an engine.
    fn start_in(pool: &mut Pool, prompt: &[u32], whole: bool) -> Start {
        let best = pool.best(prompt, whole);
        pool.start_from(best, prompt, || toy(0, false))
    }

    #[test]
    fn the_longest_shared_prefix_is_used_and_cut_back() {
        let mut pool = Pool::new(1 << 20, None);
        pool.put(vec![1, 2, 3, 4, 5], toy(5, false), None);
        pool.put(vec![1, 2, 9], toy(3, false), None);
        // An edited last message: 1 2 3 shared.
        let start = start_in(&mut pool, &[1, 2, 3, 7, 7], true);
        assert_eq!((start.cached, start.state.position()), (3, 3));
        // Forked, not taken: both are still kept.
        assert_eq!(pool.size().0, 2);
        // The same prompt again: all but the last token.
        let start = start_in(&mut pool, &[1, 2, 3, 4, 5], true);
        assert_eq!(start.cached, 4);
        // A prompt that extends a kept state takes it.
        let start = start_in(&mut pool, &[1, 2, 3, 4, 5, 6], true);
        assert_eq!(start.cached, 5);
        assert_eq!(pool.size().0, 1);
        // Nothing shared: a fresh state.
        let start = start_in(&mut pool, &[8], true);
        assert_eq!(start.cached, 0);
    }

    #[test]
    fn a_recurrent_state_is_used_only_where_it_stands() {
        let mut pool = Pool::new(1 << 20, None);
        pool.put(vec![1, 2, 3], toy(3, true), None);
        assert_eq!(start_in(&mut pool, &[1, 2, 4], true).cached, 0);
        assert_eq!(start_in(&mut pool, &[1, 2, 3], true).cached, 0);
        let start = start_in(&mut pool, &[1, 2, 3, 4], true);
        assert_eq!((start.cached, start.state.position()), (3, 3));
        // Forked: it stays for the next prompt that starts with it.
        assert_eq!(pool.size().0, 1);
        // A checkpoint with its logits serves the very same prompt whole.
        pool.put(vec![5, 6], toy(2, true), Some(vec![0.5; 4]));
        let start = start_in(&mut pool, &[5, 6], true);
        assert_eq!((start.cached, start.logits.map(|l| l.len())), (2, Some(4)));
        assert_eq!(start_in(&mut pool, &[5, 6], false).cached, 0);
        assert_eq!(start_in(&mut pool, &[5, 6, 7], false).cached, 2);
    }

    #[test]
    fn the_bound_evicts_the_least_recently_used() {
        // 100 bytes a position plus 4 a token.
        let mut pool = Pool::new(2 * 312, None);
        pool.put(vec![1, 1, 1], toy(3, false), None);
        pool.put(vec![2, 2, 2], toy(3, false), None);
        // Used (forked at 2 positions), so [2, 2, 2] is the least recently used.
        assert_eq!(start_in(&mut pool, &[1, 1, 9], true).cached, 2);
        pool.put(vec![3, 3, 3], toy(3, false), None);
        assert_eq!(pool.size(), (2, 624));
        assert_eq!(start_in(&mut pool, &[2, 2, 2, 2], true).cached, 0);
        // Larger than the bound: not kept.
        pool.put(vec![4; 7], toy(7, false), None);
        assert_eq!(start_in(&mut pool, &[4; 8], true).cached, 0);
    }

    #[test]
    fn a_longer_state_replaces_its_prefixes() {
        let mut pool = Pool::new(1 << 20, None);
        pool.put(vec![1, 2], toy(2, false), None);
        pool.put(vec![1, 2, 3, 4], toy(4, false), None);
        assert_eq!(pool.size().0, 1);
        pool.put(vec![7, 8], toy(2, true), None);
        pool.put(vec![7, 8, 9], toy(3, true), None);
        assert_eq!(pool.size().0, 3);
    }
}
