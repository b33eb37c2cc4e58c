//! Choosing the next token from logits: greedy, or temperature + nucleus (top-p) sampling with
//! a seeded generator, as colibri's `sample.h` does it, so that the same seed gives the same
//! tokens. Before the choice, the [`Shaping`] a request asks for: logit biases, repetition,
//! presence and frequency penalties, then top-k and min-p cuts (the order of vLLM's and
//! transformers' logits processors).
//!
//! These are *sampling* knobs (`TEMP`, `TOP_P`, `SEED`). colibri's `TOPK`/`TOPP` are expert
//! *routing* knobs (how many experts a token visits), unrelated to these.

use thiserror::Error;

/// Temperatures below this are treated as this when sampling (colibri's floor), so a tiny
/// positive `TEMP` is near-greedy rather than a division by zero.
const MIN_TEMPERATURE: f64 = 1e-4;

/// Index of the first maximum, skipping NaN; 0 when every value is NaN (the first maximum
/// wins, as `torch.argmax`).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in values.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i as u32)
}

#[derive(Debug, Error, PartialEq)]
pub enum SamplingError {
    #[error("TEMP={0}: expected a finite temperature >= 0 (0 = greedy)")]
    Temperature(f64),
    #[error("TOP_P={0}: expected a probability mass in (0, 1] (1 = no nucleus cut)")]
    TopP(f64),
    #[error("min_p {0}: expected a probability in [0, 1] (0 = no cut)")]
    MinP(f64),
    #[error("{0} {1}: expected a number in [-2, 2] (0 = none)")]
    Penalty(&'static str, f64),
    #[error("repetition_penalty {0}: expected a number > 0 (1 = none)")]
    Repetition(f64),
    #[error("logit_bias {0}: expected a bias in [-100, 100]")]
    Bias(f64),
}

/// What changes the logits before a token is chosen. The default changes nothing.
#[derive(Debug, Clone, PartialEq)]
pub struct Shaping {
    /// Only the `top_k` most likely tokens may be drawn (0: no cut).
    pub top_k: usize,
    /// Only tokens at least `min_p` times as likely as the most likely one (0: no cut).
    pub min_p: f64,
    /// Subtracted once from the logit of every token generated so far (OpenAI's).
    pub presence_penalty: f64,
    /// Subtracted from a token's logit once per time it was generated (OpenAI's).
    pub frequency_penalty: f64,
    /// A positive logit of a token of the prompt or generated so far is divided by it, a
    /// negative one multiplied (transformers' and vLLM's; 1: none).
    pub repetition_penalty: f64,
    /// Added to the logits of these ids.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Shaping {
    fn default() -> Shaping {
        Shaping {
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl Shaping {
    /// Every value in its range.
    pub fn check(&self) -> Result<(), SamplingError> {
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return Err(SamplingError::Penalty(name, value));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingError::Repetition(self.repetition_penalty));
        }
        if let Some(&(_, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(SamplingError::Bias(bias as f64));
        }
        Ok(())
    }

    /// Whether the logits must be changed before the choice (the cuts need no copy).
    fn rewrites(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// Picks tokens: the first maximum when the temperature is 0, otherwise a draw from the
/// softmax at that temperature restricted to the smallest set of most likely tokens whose
/// mass reaches `top_p`.
#[derive(Debug, Clone)]
pub struct Sampler {
    temperature: f64,
    top_p: f64,
    shaping: Shaping,
    /// Per token id, the times it was chosen (for the presence and frequency penalties).
    chosen: std::collections::HashMap<u32, u32>,
    /// The ids of the prompt (for the repetition penalty).
    prompt: std::collections::HashSet<u32>,
    /// The logits as the shaping leaves them (vocabulary-sized, when it rewrites them).
    shaped: Vec<f32>,
    rng: XorShift,
    /// Scratch space reused across draws (vocabulary-sized).
    probs: Vec<f32>,
    order: Vec<u32>,
}

impl Sampler {
    /// Always the first maximum.
    pub fn greedy() -> Sampler {
        Sampler {
            temperature: 0.0,
            top_p: 1.0,
            shaping: Shaping::default(),
            chosen: Default::default(),
            prompt: Default::default(),
            shaped: Vec::new(),
            rng: XorShift::new(0),
            probs: Vec::new(),
            order: Vec::new(),
        }
    }

    /// Temperature + nucleus sampling; `temperature == 0` is greedy.
    pub fn new(temperature: f64, top_p: f64, seed: u64) -> Result<Sampler, SamplingError> {
        if !(temperature.is_finite() && temperature >= 0.0) {
            return Err(SamplingError::Temperature(temperature));
        }
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(SamplingError::TopP(top_p));
        }
        Ok(Sampler {
            temperature,
            top_p,
            shaping: Shaping::default(),
            chosen: Default::default(),
            prompt: Default::default(),
            shaped: Vec::new(),
            rng: XorShift::new(seed),
            probs: Vec::new(),
            order: Vec::new(),
        })
    }

    /// The same sampler with `shaping` (checked), after a prompt of `prompt` ids.
    pub fn shaped(mut self, shaping: Shaping, prompt: &[u32]) -> Result<Sampler, SamplingError> {
        shaping.check()?;
        if shaping.repetition_penalty != 1.0 {
            self.prompt = prompt.iter().copied().collect();
        }
        self.shaping = shaping;
        Ok(self)
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// The next token (remembered for the penalties). Non-finite logits get no mass; when
    /// no logit is finite the pick falls back to [`argmax`].
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        let token = if self.shaping.rewrites() {
            let mut shaped = std::mem::take(&mut self.shaped);
            shaped.clear();
            shaped.extend_from_slice(logits);
            self.rewrite(&mut shaped);
            let token = self.choose(&shaped);
            self.shaped = shaped;
            token
        } else {
            self.choose(logits)
        };
        if self.shaping.presence_penalty != 0.0
            || self.shaping.frequency_penalty != 0.0
            || self.shaping.repetition_penalty != 1.0
        {
            *self.chosen.entry(token).or_insert(0) += 1;
        }
        token
    }

    /// Biases, then the repetition penalty, then presence and frequency penalties.
    fn rewrite(&self, logits: &mut [f32]) {
        let shaping = &self.shaping;
        for &(id, bias) in &shaping.logit_bias {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit += bias;
            }
        }
        let repetition = shaping.repetition_penalty as f32;
        if repetition != 1.0 {
            // Each id once, whether in the prompt, chosen, or both.
            let chosen_only = self.chosen.keys().filter(|id| !self.prompt.contains(id));
            for &id in self.prompt.iter().chain(chosen_only) {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit = if *logit > 0.0 {
                        *logit / repetition
                    } else {
                        *logit * repetition
                    };
                }
            }
        }
        for (&id, &count) in &self.chosen {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit -= shaping.presence_penalty as f32
                    + shaping.frequency_penalty as f32 * count as f32;
            }
        }
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return argmax(logits);
        }
        let Some(max) = logits
            .iter()
            .copied()
            .filter(|v| v.is_finite())
            .reduce(f32::max)
        else {
            return argmax(logits);
        };
        let scale = 1.0 / self.temperature.max(MIN_TEMPERATURE);
        self.probs.clear();
        let mut sum = 0.0f64;
        for &logit in logits {
            let p = if logit.is_finite() {
                (((logit - max) as f64) * scale).exp() as f32
            } else {
                0.0
            };
            sum += p as f64;
            self.probs.push(p);
        }
        if !(sum > 0.0 && sum.is_finite()) {
            return argmax(logits);
        }
        for p in &mut self.probs {
            *p = (*p as f64 / sum) as f32;
        }
        if self.shaping.top_k > 0 && self.shaping.top_k < self.probs.len() {
            self.sort_by_mass();
            let k = self.shaping.top_k.min(self.order.len());
            for &i in &self.order[k..] {
                self.probs[i as usize] = 0.0;
            }
            renormalise(&mut self.probs);
        }
        if self.top_p < 1.0 {
            self.keep_nucleus();
        }
        if self.shaping.min_p > 0.0 {
            let most = self.probs.iter().copied().fold(0.0f32, f32::max);
            let floor = (self.shaping.min_p * most as f64) as f32;
            for p in &mut self.probs {
                if *p < floor {
                    *p = 0.0;
                }
            }
            renormalise(&mut self.probs);
        }
        self.draw()
    }

    /// `order`: the ids with mass, most likely first, ties to the lower id.
    fn sort_by_mass(&mut self) {
        let probs = &self.probs;
        self.order.clear();
        self.order
            .extend((0..probs.len() as u32).filter(|&i| probs[i as usize] > 0.0));
        self.order.sort_unstable_by(|&a, &b| {
            probs[b as usize]
                .total_cmp(&probs[a as usize])
                .then(a.cmp(&b))
        });
    }

    /// Zero every token outside the nucleus (most likely first, ties to the lower id, until
    /// the kept mass reaches `top_p`) and renormalise the rest.
    fn keep_nucleus(&mut self) {
        self.sort_by_mass();
        let probs = &self.probs;
        let mut mass = 0.0f64;
        let mut kept = self.order.len();
        for (n, &i) in self.order.iter().enumerate() {
            mass += probs[i as usize] as f64;
            if mass >= self.top_p {
                kept = n + 1;
                break;
            }
        }
        for &i in &self.order[kept..] {
            self.probs[i as usize] = 0.0;
        }
        for p in &mut self.probs {
            *p = (*p as f64 / mass) as f32;
        }
    }

    /// A draw from `probs` by a scan of the cumulative mass in token-id order; rounding that
    /// leaves the total just under the draw takes the last token with mass.
    fn draw(&mut self) -> u32 {
        let u = self.rng.next_unit();
        let mut cumulative = 0.0f64;
        let mut last = 0;
        for (i, &p) in self.probs.iter().enumerate() {
            if p <= 0.0 {
                continue;
            }
            cumulative += p as f64;
            last = i as u32;
            if u < cumulative {
                return last;
            }
        }
        last
    }
}

/// A row of logits with its log-sum-exp: each token's log-probability under the model
/// (a log-softmax; non-finite logits have no mass). `PPL=1` scores with it and `coli serve`
/// reports `logprobs` with it, so the two agree to the bit.
pub struct LogProbs<'a> {
    logits: &'a [f32],
    lse: f64,
}

impl<'a> LogProbs<'a> {
    pub fn new(logits: &'a [f32]) -> LogProbs<'a> {
        let finite = || logits.iter().copied().filter(|x| x.is_finite());
        let max = finite().fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = finite().map(|x| (x as f64 - max).exp()).sum();
        LogProbs {
            logits,
            lse: max + sum.ln(),
        }
    }

    /// The log of the row's total mass, in logit units.
    pub fn lse(&self) -> f64 {
        self.lse
    }

    pub fn of(&self, id: u32) -> f32 {
        (self.logits[id as usize] as f64 - self.lse) as f32
    }

    /// The `k` most probable tokens with their log-probabilities, most probable first,
    /// the lower id first among equals.
    pub fn top(&self, k: usize) -> Vec<(u32, f32)> {
        let row = self.logits;
        let by_logit =
            |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
        let mut order: Vec<u32> = (0..row.len() as u32)
            .filter(|&i| row[i as usize].is_finite())
            .collect();
        let k = k.min(order.len());
        if k < order.len() {
            order.select_nth_unstable_by(k, by_logit);
            order.truncate(k);
        }
        order.sort_by(by_logit);
        order.iter().map(|&i| (i, self.of(i))).collect()
    }
}

/// Scale `probs` to sum to 1 (left alone when nothing has mass).
fn renormalise(probs: &mut [f32]) {
    let sum: f64 = probs.iter().map(|&p| p as f64).sum();
    if sum > 0.0 {
        for p in probs {
            *p = (*p as f64 / sum) as f32;
        }
    }
}

/// xorshift64 (13, 7, 17), seeded through splitmix64 so that small or zero seeds still start
/// from a well-mixed, non-zero state.
#[derive(Debug, Clone)]
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        XorShift(if z == 0 { 0x2545_F491_4F6C_DD1D } else { z })
    }

    /// Uniform in [0, 1) with 53 random bits.
    fn next_unit(&mut self) -> f64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, -2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    }

    #[test]
    fn zero_temperature_is_argmax() {
        let mut sampler = Sampler::new(0.0, 0.9, 7).unwrap();
        assert!(sampler.is_greedy());
        assert_eq!(sampler.pick(&[0.5, 2.0, 2.0, f32::NAN]), 1);
    }

    #[test]
    fn bad_values_are_refused() {
        assert_eq!(
            Sampler::new(-1.0, 0.9, 0).unwrap_err(),
            SamplingError::Temperature(-1.0)
        );
        assert_eq!(
            Sampler::new(0.7, 2.0, 0).unwrap_err(),
            SamplingError::TopP(2.0)
        );
        assert_eq!(
            Sampler::new(0.7, 0.0, 0).unwrap_err(),
            SamplingError::TopP(0.0)
        );
        assert!(Sampler::new(f64::INFINITY, 0.9, 0).is_err());
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draws = |seed| {
            let mut sampler = Sampler::new(1.0, 0.95, seed).unwrap();
            (0..200).map(|_| sampler.pick(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draws(42), draws(42));
        assert_ne!(draws(42), draws(43));
    }

    #[test]
    fn nucleus_keeps_only_the_most_likely_tokens() {
        // Softmax at T=1 of [3, 2, 0, -5]: 0.705, 0.259, 0.035, 0.0002. top_p 0.9 keeps ids 0
        // and 1 (0.705 < 0.9 <= 0.964).
        let mut sampler = Sampler::new(1.0, 0.9, 1).unwrap();
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[sampler.pick(&[3.0, 2.0, 0.0, -5.0]) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0, "{seen:?}");
        // Renormalised: id 0 has 0.705/0.964 = 0.73 of the draws.
        let share = seen[0] as f64 / 2000.0;
        assert!((share - 0.731).abs() < 0.04, "{seen:?}");
    }

    #[test]
    fn non_finite_logits_get_no_mass() {
        let mut sampler = Sampler::new(1.0, 1.0, 3).unwrap();
        for _ in 0..200 {
            let token = sampler.pick(&[f32::NEG_INFINITY, 0.0, f32::NAN, 0.0]);
            assert!(token == 1 || token == 3);
        }
        assert_eq!(sampler.pick(&[f32::NAN, f32::INFINITY]), 1);
    }

    #[test]
    fn low_temperature_approaches_greedy() {
        let mut sampler = Sampler::new(1e-6, 1.0, 9).unwrap();
        for _ in 0..100 {
            assert_eq!(sampler.pick(&[0.1, 0.9, 0.5]), 1);
        }
    }

    #[test]
    fn unit_draws_stay_in_range() {
        let mut rng = XorShift::new(0);
        for _ in 0..10_000 {
            let u = rng.next_unit();
            assert!((0.0..1.0).contains(&u));
        }
    }

    #[test]
    fn shaping_cuts_and_rewrites_the_logits() {
        let logits = [1.0f32, 3.0, 2.5, -1.0, 2.9];
        let shaped = |shaping: Shaping, temperature: f64, prompt: &[u32]| {
            Sampler::new(temperature, 1.0, 5)
                .unwrap()
                .shaped(shaping, prompt)
                .unwrap()
        };
        // top_k 1 and min_p 1 leave only the most likely token, whatever the temperature.
        for shaping in [
            Shaping {
                top_k: 1,
                ..Shaping::default()
            },
            Shaping {
                min_p: 1.0,
                ..Shaping::default()
            },
        ] {
            let mut sampler = shaped(shaping, 50.0, &[]);
            assert!((0..200).all(|_| sampler.pick(&logits) == 1));
        }
        // top_k 2 draws only the two most likely.
        let mut sampler = shaped(
            Shaping {
                top_k: 2,
                ..Shaping::default()
            },
            50.0,
            &[],
        );
        let drawn: std::collections::BTreeSet<u32> =
            (0..400).map(|_| sampler.pick(&logits)).collect();
        assert_eq!(drawn, [1, 4].into());
        // A bias moves the greedy choice; a presence penalty stops a repeat.
        let mut sampler = shaped(
            Shaping {
                logit_bias: vec![(3, 10.0)],
                ..Shaping::default()
            },
            0.0,
            &[],
        );
        assert_eq!(sampler.pick(&logits), 3);
        let mut sampler = shaped(
            Shaping {
                presence_penalty: 0.2,
                ..Shaping::default()
            },
            0.0,
            &[],
        );
        assert_eq!(sampler.pick(&logits), 1);
        assert_eq!(sampler.pick(&logits), 4, "3.0 - 0.2 < 2.9");
        assert_eq!(sampler.pick(&logits), 1, "2.8 > 2.9 - 0.2 = 2.7");
        let mut sampler = shaped(
            Shaping {
                frequency_penalty: 2.0,
                ..Shaping::default()
            },
            0.0,
            &[],
        );
        let picks: Vec<u32> = (0..3).map(|_| sampler.pick(&logits)).collect();
        assert_eq!(picks, [1, 4, 2]);
        // The repetition penalty divides the prompt's positive logits.
        let mut sampler = shaped(
            Shaping {
                repetition_penalty: 1.5,
                ..Shaping::default()
            },
            0.0,
            &[1, 4],
        );
        assert_eq!(sampler.pick(&logits), 2, "3.0 / 1.5 and 2.9 / 1.5 < 2.5");
        // Out of range values are refused by name.
        for (shaping, name) in [
            (
                Shaping {
                    min_p: 1.5,
                    ..Shaping::default()
                },
                "min_p",
            ),
            (
                Shaping {
                    presence_penalty: 3.0,
                    ..Shaping::default()
                },
                "presence_penalty",
            ),
            (
                Shaping {
                    repetition_penalty: 0.0,
                    ..Shaping::default()
                },
                "repetition_penalty",
            ),
            (
                Shaping {
                    logit_bias: vec![(0, 101.0)],
                    ..Shaping::default()
                },
                "logit_bias",
            ),
        ] {
            let err = Sampler::greedy().shaped(shaping, &[]).unwrap_err();
            assert!(err.to_string().starts_with(name), "{err}");
        }
    }
}
