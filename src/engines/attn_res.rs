//! Block attention residuals (AttnRes, Kimi K3): the residual stream is replaced by a
//! softmax mix, over depth, of block snapshots and the running sum of the current block.
//!
//! Per token the stream keeps `blocks` (the hidden entering every `block_size`-th layer: the
//! token embedding first, then the sum of each finished block's sublayer outputs) and
//! `prefix` (the sum of the sublayer outputs since the last snapshot). Each sublayer reads a
//! mix of the snapshots and the prefix:
//!
//! ```text
//! mix(prefix) = Σ_e p_e v_e,  v = [blocks.., prefix],  p = softmax_e( (v_e · w) / rms(v_e) )
//! ```
//!
//! with `w = res_norm.weight ⊙ res_proj.weight` (an RMSNorm followed by a `[1, D]`
//! projection scores each entry; the entries themselves are mixed un-normalised). The
//! vendor decoder layer's `_forward_attn_residual` drives it, as [`ResidualStream`] does:
//!
//! ```text
//! attention input: mix(prefix) over the snapshots so far (the plain prefix when there are
//!                  none); then, at a block boundary, prefix becomes a snapshot and restarts
//! prefix = (restarted ? 0 : prefix) + attention;  MLP input: mix(prefix);  prefix += MLP
//! output: mix(prefix) with the output weights, before the final norm
//! ```
//!
//! The mix is per token and across depth only, so nothing is carried between positions.

use anyhow::Result;

use super::layers::add_in_place;
use super::weights::Weights;

/// One AttnRes scoring vector: `res_norm.weight ⊙ res_proj.weight` and the norm's epsilon.
pub struct ResMix {
    weight: Vec<f32>,
    eps: f64,
}

impl ResMix {
    /// From `{prefix}_norm.weight` (`[D]`) and `{prefix}_proj.weight` (`[1, D]`), e.g.
    /// `model.layers.3.self_attention_res` or `model.output_attn_res`.
    pub fn load(w: &Weights, prefix: &str, hidden: usize, eps: f64) -> Result<ResMix> {
        let norm = w.vector(&format!("{prefix}_norm.weight"), hidden)?;
        let proj = w.flat(&format!("{prefix}_proj.weight"), &[1, hidden])?;
        Ok(ResMix::new(&norm, &proj, eps))
    }

    /// The scoring vector as the reference forms it: the f32 product of the two weights.
    pub fn new(norm: &[f32], proj: &[f32], eps: f64) -> ResMix {
        ResMix {
            weight: norm.iter().zip(proj).map(|(a, b)| a * b).collect(),
            eps,
        }
    }

    /// `out = Σ_e p_e v_e` over `entries` (each one token's row), scores in f64.
    fn mix_row(&self, entries: &[&[f32]], out: &mut [f32]) {
        let scores: Vec<f64> = entries
            .iter()
            .map(|v| {
                let (mut dot, mut square) = (0f64, 0f64);
                for (&x, &w) in v.iter().zip(&self.weight) {
                    dot += f64::from(x) * f64::from(w);
                    square += f64::from(x) * f64::from(x);
                }
                dot / (square / v.len() as f64 + self.eps).sqrt()
            })
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for (i, y) in out.iter_mut().enumerate() {
            let sum: f64 = entries
                .iter()
                .zip(&weights)
                .map(|(v, p)| p * f64::from(v[i]))
                .sum();
            *y = (sum / total) as f32;
        }
    }
}

/// The attention-residual stream of `n` tokens through the layers of one forward.
pub struct ResidualStream {
    width: usize,
    block_size: usize,
    blocks: Vec<Vec<f32>>,
    prefix: Vec<f32>,
    restarted: bool,
}

impl ResidualStream {
    /// The stream entering layer 0: `embeddings` (`n x width`) is the prefix and no snapshot
    /// is taken yet.
    pub fn new(embeddings: Vec<f32>, width: usize, block_size: usize) -> ResidualStream {
        ResidualStream {
            width,
            block_size: block_size.max(1),
            blocks: Vec::new(),
            prefix: embeddings,
            restarted: false,
        }
    }

    fn mix(&self, mix: &ResMix) -> Vec<f32> {
        let w = self.width;
        let mut out = vec![0f32; self.prefix.len()];
        for (t, row) in out.chunks_exact_mut(w).enumerate() {
            let entries: Vec<&[f32]> = self
                .blocks
                .iter()
                .chain(std::iter::once(&self.prefix))
                .map(|v| &v[t * w..][..w])
                .collect();
            mix.mix_row(&entries, row);
        }
        out
    }

    /// The input of layer `layer`'s attention (before its input norm); at a block boundary
    /// the prefix then becomes a snapshot and the next sum starts from the attention output.
    pub fn attention_input(&mut self, layer: usize, mix: &ResMix) -> Vec<f32> {
        let input = if self.blocks.is_empty() {
            self.prefix.clone()
        } else {
            self.mix(mix)
        };
        self.restarted = layer.is_multiple_of(self.block_size);
        if self.restarted {
            self.blocks.push(self.prefix.clone());
        }
        input
    }

    /// Add the attention output and return the MLP input (before its norm).
    pub fn after_attention(&mut self, attention: &[f32], mix: &ResMix) -> Vec<f32> {
        if self.restarted {
            self.prefix.copy_from_slice(attention);
        } else {
            add_in_place(&mut self.prefix, attention);
        }
        self.mix(mix)
    }

    /// Add the MLP output: the prefix is the layer's output.
    pub fn after_mlp(&mut self, mlp: &[f32]) {
        add_in_place(&mut self.prefix, mlp);
    }

    /// The hidden state after the last layer (before the final norm).
    pub fn output(&self, mix: &ResMix) -> Vec<f32> {
        self.mix(mix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_weighs_raw_entries_by_normalised_scores() {
        // w = [1, 0]: an entry scores its first coordinate over its RMS.
        let mix = ResMix::new(&[2.0, 1.0], &[0.5, 0.0], 0.0);
        let a = [3.0f32, 4.0];
        let b = [-1.0f32, 0.0];
        let mut out = [0f32; 2];
        mix.mix_row(&[&a, &b], &mut out);
        let sa = 3.0 / 12.5f64.sqrt();
        let sb = -1.0 / 0.5f64.sqrt();
        let pa = sa.exp() / (sa.exp() + sb.exp());
        let want = [pa * 3.0 - (1.0 - pa), pa * 4.0];
        for (o, w) in out.iter().zip(want) {
            assert!((f64::from(*o) - w).abs() < 1e-6, "{out:?} vs {want:?}");
        }
        // Scaling an entry leaves its score alone but scales what it contributes.
        let a2 = [30.0f32, 40.0];
        let mut scaled = [0f32; 2];
        mix.mix_row(&[&a2, &b], &mut scaled);
        assert!((f64::from(scaled[1]) - pa * 40.0).abs() < 1e-5);
    }

    #[test]
    fn the_stream_follows_the_block_schedule() {
        // Block size 2, one token of width 1, every score 0 (w = 0): mixes are plain means.
        let mix = ResMix::new(&[1.0], &[0.0], 1e-6);
        let mut stream = ResidualStream::new(vec![8.0], 1, 2);
        // Layer 0: no snapshot yet, so the attention reads the embedding; then it is block 0.
        assert_eq!(stream.attention_input(0, &mix), vec![8.0]);
        // The prefix restarts at the attention output: MLP input = mean(8, 2).
        assert_eq!(stream.after_attention(&[2.0], &mix), vec![5.0]);
        stream.after_mlp(&[1.0]); // prefix 3
                                  // Layer 1: mean(8, 3); the prefix accumulates.
        assert_eq!(stream.attention_input(1, &mix), vec![5.5]);
        assert_eq!(stream.after_attention(&[1.0], &mix), vec![6.0]); // mean(8, 4)
        stream.after_mlp(&[2.0]); // prefix 6
                                  // Layer 2: a boundary; the input mixes the old blocks only, then 6 becomes block 1.
        assert_eq!(stream.attention_input(2, &mix), vec![7.0]);
        assert_eq!(stream.after_attention(&[5.0], &mix), vec![19.0 / 3.0]);
        stream.after_mlp(&[1.0]); // prefix 6
        assert_eq!(stream.output(&mix), vec![20.0 / 3.0]);
    }
}
