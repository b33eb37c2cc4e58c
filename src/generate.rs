//! The prefill/decode loop: the prompt in one batched forward, then one token at a time,
//! greedy (the first maximum wins, as `torch.argmax`).

use std::time::Instant;

use anyhow::Result;

use crate::engines::Engine;

/// What a generation produced and what it cost.
pub struct Generation {
    pub tokens: Vec<u32>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Whether any logit along the way was NaN or infinite.
    pub non_finite: bool,
}

impl Generation {
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

/// Greedily generate `count` tokens after `prompt`, starting from an empty KV cache.
pub fn greedy(engine: &mut dyn Engine, prompt: &[u32], count: usize) -> Result<Generation> {
    engine.reset();
    let started = Instant::now();
    let mut logits = engine.forward(prompt, false)?;
    let prefill_seconds = started.elapsed().as_secs_f64();
    let started = Instant::now();
    let mut tokens = Vec::with_capacity(count);
    let mut non_finite = false;
    for step in 0..count {
        non_finite |= logits.iter().any(|v| !v.is_finite());
        let token = argmax(&logits);
        tokens.push(token);
        if step + 1 < count {
            logits = engine.forward(&[token], false)?;
        }
    }
    Ok(Generation {
        tokens,
        prefill_seconds,
        decode_seconds: started.elapsed().as_secs_f64(),
        non_finite,
    })
}

/// Index of the first maximum, skipping NaN; 0 when every value is NaN.
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

#[cfg(test)]
mod tests {
    use super::argmax;

    #[test]
    fn argmax_takes_first_maximum_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, -1.0, -2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
    }
}
