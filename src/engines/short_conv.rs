//! Short causal depthwise convolutions over time (`nn.Conv1d` with `groups = channels`,
//! left padding `kernel - 1`), as the transformers `causal_conv1d_fn` /
//! `causal_conv1d_update` pair computes them, with the state that carries the last inputs
//! from one forward to the next so that a batched prefill and token-by-token decode agree.
//!
//! The convolution has no bias and no activation; a model adds its own residual or
//! activation around it.

use std::io::{self, Read, Write};

use anyhow::Result;

use super::state_io;
use super::weights::Weights;

/// One depthwise convolution: `taps[c * kernel + j]` weighs input `t + j - (kernel - 1)` of
/// channel `c` for output `t`, so the last tap lands on the current token.
pub struct ShortConv {
    channels: usize,
    kernel: usize,
    taps: Vec<f32>,
}

/// The inputs a convolution still needs from earlier positions: the last `kernel - 1` rows,
/// oldest first; zero before the first token.
#[derive(Clone)]
pub struct ConvState {
    rows: Vec<f32>,
}

impl ConvState {
    /// Forget every earlier position.
    pub fn clear(&mut self) {
        self.rows.fill(0.0);
    }

    pub fn size_bytes(&self) -> usize {
        4 * self.rows.len()
    }

    /// Writes the inputs kept ([`state_io`]).
    pub fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_f32s(out, &self.rows)
    }

    /// Reads what [`ConvState::save`] wrote, refused unless it holds as many inputs as this
    /// convolution keeps (`kernel - 1` rows of its channels).
    pub fn restore(&mut self, input: &mut dyn Read) -> anyhow::Result<()> {
        self.rows = state_io::read_f32s_exact(input, self.rows.len(), "the inputs kept")?;
        Ok(())
    }
}

impl ShortConv {
    /// The `[channels, 1, kernel]` weight `name` (an `nn.Conv1d` depthwise weight).
    pub fn load(w: &Weights, name: &str, channels: usize, kernel: usize) -> Result<ShortConv> {
        Ok(ShortConv {
            channels,
            kernel,
            taps: w.flat(name, &[channels, 1, kernel])?,
        })
    }

    /// A zero state, as at the start of a sequence.
    pub fn state(&self) -> ConvState {
        ConvState {
            rows: vec![0.0; (self.kernel - 1) * self.channels],
        }
    }

    /// The convolution of `n` rows of `input` (`n x channels`), continuing from `state`,
    /// which then holds the last `kernel - 1` inputs.
    pub fn forward(&self, input: &[f32], n: usize, state: &mut ConvState) -> Vec<f32> {
        let (c, k) = (self.channels, self.kernel);
        let history = k - 1;
        // The state followed by this batch: row `history + t` is input `t`.
        let mut padded = Vec::with_capacity((history + n) * c);
        padded.extend_from_slice(&state.rows);
        padded.extend_from_slice(&input[..n * c]);
        let mut out = vec![0f32; n * c];
        for (t, row) in out.chunks_exact_mut(c).enumerate() {
            for (channel, y) in row.iter_mut().enumerate() {
                let taps = &self.taps[channel * k..][..k];
                let mut sum = 0f32;
                for (j, &w) in taps.iter().enumerate() {
                    sum += w * padded[(t + j) * c + channel];
                }
                *y = sum;
            }
        }
        let total = history + n;
        state
            .rows
            .copy_from_slice(&padded[(total - history) * c..total * c]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conv(channels: usize, kernel: usize, taps: Vec<f32>) -> ShortConv {
        assert_eq!(taps.len(), channels * kernel);
        ShortConv {
            channels,
            kernel,
            taps,
        }
    }

    #[test]
    fn causal_taps_by_hand() {
        // Two channels, kernel 3: y[t] = w0 x[t-2] + w1 x[t-1] + w2 x[t].
        let conv = conv(2, 3, vec![1.0, 10.0, 100.0, 0.5, 0.0, -1.0]);
        let mut state = conv.state();
        let out = conv.forward(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3, &mut state);
        assert_eq!(out, vec![100.0, -2.0, 310.0, -4.0, 531.0, -5.0]);
    }

    #[test]
    fn decode_continues_the_prefill() {
        let taps: Vec<f32> = (0..12).map(|i| (i as f32 * 0.37).sin()).collect();
        let conv = conv(3, 4, taps);
        let input: Vec<f32> = (0..21).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut whole = conv.state();
        let all = conv.forward(&input, 7, &mut whole);
        let mut parts = conv.state();
        let mut pieces = conv.forward(&input[..6], 2, &mut parts);
        for t in 2..7 {
            pieces.extend(conv.forward(&input[t * 3..(t + 1) * 3], 1, &mut parts));
        }
        assert_eq!(all, pieces);
        assert_eq!(whole.rows, parts.rows);
        parts.clear();
        assert_eq!(conv.forward(&input[..6], 2, &mut parts), all[..6]);
    }
}
