//! The prefix cache of `coli serve`: conversation states kept after their turns, each
//! with the token ids it holds, bounded in bytes with least-recently-used eviction. A new
//! prompt starts from the kept state that shares the longest prefix with it — the same
//! request again, a regenerated or edited last message, another client with the same
//! system prompt — cut back to that prefix where the model allows it exactly.
//!
//! Owns the choice of a state and the byte bound; it runs no forward and knows no engine
//! beyond [`State`]'s own answers (its size, whether it can go back to a position).

use crate::engines::State;

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
}

impl Pool {
    pub fn new(limit: u64) -> Pool {
        Pool {
            kept: Vec::new(),
            limit,
            clock: 0,
        }
    }

    /// States kept and their bytes.
    pub fn size(&self) -> (usize, u64) {
        (self.kept.len(), self.kept.iter().map(Kept::bytes).sum())
    }

    /// The start for `prompt` (non-empty): the kept state sharing its longest usable prefix,
    /// taken out when the prompt extends all of it and forked otherwise, so that the kept
    /// one still serves the prompts it shares less with; `fresh` when none shares anything.
    /// A whole-prompt match with kept logits is used only when `whole` allows it.
    pub fn start(&mut self, prompt: &[u32], whole: bool, fresh: impl FnOnce() -> State) -> Start {
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
            total -= self.kept.swap_remove(oldest).bytes();
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

    fn fresh() -> State {
        toy(0, false)
    }

    #[test]
    fn the_longest_shared_prefix_is_used_and_cut_back() {
        let mut pool = Pool::new(1 << 20);
        pool.put(vec![1, 2, 3, 4, 5], toy(5, false), None);
        pool.put(vec![1, 2, 9], toy(3, false), None);
        // An edited last message: 1 2 3 shared.
        let start = pool.start(&[1, 2, 3, 7, 7], true, fresh);
        assert_eq!((start.cached, start.state.position()), (3, 3));
        // Forked, not taken: both are still kept.
        assert_eq!(pool.size().0, 2);
        // The same prompt again: all but the last token.
        let start = pool.start(&[1, 2, 3, 4, 5], true, fresh);
        assert_eq!(start.cached, 4);
        // A prompt that extends a kept state takes it.
        let start = pool.start(&[1, 2, 3, 4, 5, 6], true, fresh);
        assert_eq!(start.cached, 5);
        assert_eq!(pool.size().0, 1);
        // Nothing shared: a fresh state.
        let start = pool.start(&[8], true, fresh);
        assert_eq!(start.cached, 0);
    }

    #[test]
    fn a_recurrent_state_is_used_only_where_it_stands() {
        let mut pool = Pool::new(1 << 20);
        pool.put(vec![1, 2, 3], toy(3, true), None);
        assert_eq!(pool.start(&[1, 2, 4], true, fresh).cached, 0);
        assert_eq!(pool.start(&[1, 2, 3], true, fresh).cached, 0);
        let start = pool.start(&[1, 2, 3, 4], true, fresh);
        assert_eq!((start.cached, start.state.position()), (3, 3));
        // Forked: it stays for the next prompt that starts with it.
        assert_eq!(pool.size().0, 1);
        // A checkpoint with its logits serves the very same prompt whole.
        pool.put(vec![5, 6], toy(2, true), Some(vec![0.5; 4]));
        let start = pool.start(&[5, 6], true, fresh);
        assert_eq!((start.cached, start.logits.map(|l| l.len())), (2, Some(4)));
        assert_eq!(pool.start(&[5, 6], false, fresh).cached, 0);
        assert_eq!(pool.start(&[5, 6, 7], false, fresh).cached, 2);
    }

    #[test]
    fn the_bound_evicts_the_least_recently_used() {
        // 100 bytes a position plus 4 a token.
        let mut pool = Pool::new(2 * 312);
        pool.put(vec![1, 1, 1], toy(3, false), None);
        pool.put(vec![2, 2, 2], toy(3, false), None);
        // Used (forked at 2 positions), so [2, 2, 2] is the least recently used.
        assert_eq!(pool.start(&[1, 1, 9], true, fresh).cached, 2);
        pool.put(vec![3, 3, 3], toy(3, false), None);
        assert_eq!(pool.size(), (2, 624));
        assert_eq!(pool.start(&[2, 2, 2, 2], true, fresh).cached, 0);
        // Larger than the bound: not kept.
        pool.put(vec![4; 7], toy(7, false), None);
        assert_eq!(pool.start(&[4; 8], true, fresh).cached, 0);
    }

    #[test]
    fn a_longer_state_replaces_its_prefixes() {
        let mut pool = Pool::new(1 << 20);
        pool.put(vec![1, 2], toy(2, false), None);
        pool.put(vec![1, 2, 3, 4], toy(4, false), None);
        assert_eq!(pool.size().0, 1);
        pool.put(vec![7, 8], toy(2, true), None);
        pool.put(vec![7, 8, 9], toy(3, true), None);
        assert_eq!(pool.size().0, 3);
    }
}
