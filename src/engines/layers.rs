//! The layer operations engines share: the embedding lookup and the LM head every forward
//! begins and ends with, RMSNorm and LayerNorm, rotary embeddings, softmax,
//! top-k selection, SwiGLU and the gated FFN, the attention shape. Causal attention and its
//! KV cache are `window_attention`'s.
//!
//! Each function computes what the transformers reference computes for that block, in
//! f32 over rows of a row-major batch. Nothing here knows which model calls it.

use anyhow::{bail, Result};

use super::state::Rows;
use super::weights::Weights;
use crate::activation::{swiglu, Activation};
use crate::profile::{self, Phase};
use crate::quant::{matmul_shared_input, Matrix};
use crate::snapshot::guard;

/// The embedding rows of `tokens`, `tokens.len() x embed.cols()`: a forward's first step in
/// every engine, refusing an empty forward and an id outside the config's `vocab`.
pub fn embed_tokens(embed: &Matrix, tokens: &[u32], vocab: usize) -> Result<Vec<f32>> {
    if tokens.is_empty() {
        bail!("forward needs at least one token");
    }
    let d = embed.cols();
    let mut x = vec![0f32; tokens.len() * d];
    for (row, &token) in x.chunks_exact_mut(d).zip(tokens) {
        if token as usize >= vocab {
            bail!("token id {token} is outside the vocabulary (vocab_size {vocab})");
        }
        embed.row_into(token as usize, row);
    }
    Ok(x)
}

/// The two sublayers of a transformer layer, for [`pre_norm_residual`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sublayer {
    Attention,
    Ffn,
}

/// The pre-norm residual layer every engine but Kimi K3 (block attention residuals) runs:
/// `x += attention(norm(x)); x += ffn(norm(x))`, the norms' weights `norms` (input, then
/// post-attention). `sublayer` computes either step from the normed rows; the attention
/// step is timed as the `PROFILE:` line's `attention`.
pub fn pre_norm_residual(
    x: &mut [f32],
    norms: [&[f32]; 2],
    eps: f64,
    mut sublayer: impl FnMut(Sublayer, &[f32]) -> Result<Vec<f32>>,
) -> Result<()> {
    let mut h = vec![0f32; x.len()];
    rms_norm(x, norms[0], eps, &mut h);
    let attention = profile::time(Phase::Attention, || sublayer(Sublayer::Attention, &h))?;
    add_in_place(x, &attention);
    rms_norm(x, norms[1], eps, &mut h);
    let ffn = sublayer(Sublayer::Ffn, &h)?;
    add_in_place(x, &ffn);
    Ok(())
}

/// The final norm of the hidden rows `x` (each `weight.len()` wide) that the LM head reads:
/// the rows `picked`, in that order.
pub fn final_norm(x: &[f32], weight: &[f32], eps: f64, picked: &[usize]) -> Vec<f32> {
    let rows = Rows::gather(x, weight.len(), picked);
    let mut normed = vec![0f32; rows.len()];
    rms_norm(&rows, weight, eps, &mut normed);
    normed
}

/// The LM head over the final-normalised `rows` (each `head.cols()` wide): one row of
/// `head.rows()` logits each, timed as the `PROFILE:` line's `lm_head`. It ends every
/// forward, so it is where a shard that changed under the forward is said
/// ([`guard::check`]), before any of the logits is used.
pub fn lm_head(head: &Matrix, rows: &[f32]) -> Result<Vec<f32>> {
    let m = rows.len() / head.cols();
    let mut logits = vec![0f32; m * head.rows()];
    profile::time(Phase::LmHead, || head.matmul(rows, m, &mut logits));
    guard::check()?;
    Ok(logits)
}

/// `a · b` over the shorter length, in eight interleaved partial sums (element `8c + l`
/// goes to sum `l`; the eight are added pairwise at the end, the tail last;
/// [`crate::quant::dots`]): independent chains in one vector register, where one running
/// sum is a chain of dependent adds. The order is fixed, so prefill and decode give the
/// same bits.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let [product] = crate::quant::dots(&a[..n], [&b[..n]]);
    product
}

/// `out = x / sqrt(mean(x^2) + eps) * weight`, for each row of `x` (`weight.len()` wide).
/// The mean square is accumulated in f64 so the result does not depend on the row length's
/// rounding behaviour. With a GPU backend installed the norm runs there (in f32).
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    if crate::backend::rms_norm(x, weight, eps, out) {
        return;
    }
    let width = weight.len();
    for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean_square = row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / width as f64;
        let inv = (1.0 / (mean_square + eps).sqrt()) as f32;
        for ((y, &v), &w) in out.iter_mut().zip(row).zip(weight) {
            *y = w * (v * inv);
        }
    }
}

/// In-place variant of [`rms_norm`].
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f64) {
    let copy = x.to_vec();
    rms_norm(&copy, weight, eps, x);
}

/// Rotary position embedding in the "rotate half" layout: dimension `i` of the first half
/// pairs with dimension `i + d/2`.
pub struct Rope {
    inv_freq: Vec<f32>,
}

impl Rope {
    /// Frequencies `theta^(-2i/d)` for a head dimension `d` (the rotated dimensions).
    pub fn new(head_dim: usize, theta: f64) -> Rope {
        let inv_freq = (0..head_dim / 2)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        Rope { inv_freq }
    }

    /// Rotate every head of `x` (`heads * head_dim` wide) for absolute position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = head_dim / 2;
        let angles: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|&f| {
                let angle = pos as f32 * f;
                (angle.cos(), angle.sin())
            })
            .collect();
        for head in x.chunks_exact_mut(head_dim) {
            let (first, second) = head.split_at_mut(half);
            for ((a, b), &(cos, sin)) in first.iter_mut().zip(second.iter_mut()).zip(&angles) {
                let (x1, x2) = (*a, *b);
                *a = x1 * cos - x2 * sin;
                *b = x2 * cos + x1 * sin;
            }
        }
    }

    /// Rotate one vector `x` (exactly the rotated width) in the interleaved layout for
    /// absolute position `pos`: pair `(x[2i], x[2i+1])` turns by frequency `i`, and the result
    /// is written de-interleaved (`out[i]`, `out[i + d/2]`), as DeepSeek-style checkpoints
    /// and transformers' `apply_rotary_pos_emb_interleave` lay it out. Queries and keys both
    /// go through it, so their dot products are those of the interleaved rotation.
    pub fn apply_interleaved(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let pairs: Vec<(f32, f32)> = x.chunks_exact(2).map(|p| (p[0], p[1])).collect();
        for (i, (&(a, b), &f)) in pairs.iter().zip(&self.inv_freq).enumerate() {
            let angle = pos as f32 * f;
            let (cos, sin) = (angle.cos(), angle.sin());
            x[i] = a * cos - b * sin;
            x[half + i] = b * cos + a * sin;
        }
    }
}

/// `out = (x - mean) / sqrt(var + eps) * weight + bias` for each row of `x` (`weight.len()`
/// wide), the biased variance as `nn.LayerNorm` takes it; moments accumulate in f64.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f64, out: &mut [f32]) {
    let width = weight.len();
    for (row, out) in x.chunks_exact(width).zip(out.chunks_exact_mut(width)) {
        let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / width as f64;
        let var = row
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / width as f64;
        let inv = 1.0 / (var + eps).sqrt();
        for (((y, &v), &w), &b) in out.iter_mut().zip(row).zip(weight).zip(bias) {
            *y = ((f64::from(v) - mean) * inv) as f32 * w + b;
        }
    }
}

/// `x += y`, element-wise (a residual connection).
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Numerically stable softmax in place.
#[inline]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// How index `a` ranks against `b` in [`top_k`]: the larger score first, NaN after every
/// number, the lower index first among equals.
fn ranked(scores: &[f32], a: usize, b: usize) -> std::cmp::Ordering {
    let (x, y) = (scores[a], scores[b]);
    match (x.is_nan(), y.is_nan()) {
        (true, true) => a.cmp(&b),
        (true, false) => std::cmp::Ordering::Greater,
        (false, true) => std::cmp::Ordering::Less,
        _ => y.total_cmp(&x).then(a.cmp(&b)),
    }
}

/// The `k` largest entries of `scores` as `(index, score)`, largest first; ties go to the
/// lower index and NaN never wins over a number.
///
/// The order is total (no two indices compare equal), so the `k` are found by a selection
/// and only they are sorted: the same entries in the same order as sorting all of them, in
/// time linear in `scores`.
pub fn top_k(scores: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut best = best_k(scores, k);
    best.sort_by(|&a, &b| ranked(scores, a, b));
    best.into_iter().map(|i| (i, scores[i])).collect()
}

/// The indices of [`top_k`]'s `k` entries in ascending order, without ranking them among
/// themselves: what a sparse attention reads (the DSA indexer keeps 2,048 of a context's
/// positions for every row).
pub fn top_k_positions(scores: &[f32], k: usize) -> Vec<usize> {
    let mut best = best_k(scores, k);
    best.sort_unstable();
    best
}

/// The indices of the `k` best-ranked entries (all of them if there are no more), in no
/// particular order: found by a selection, in time linear in `scores`.
fn best_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, |&a, &b| ranked(scores, a, b));
    }
    order.truncate(k);
    order
}

/// `down(silu(gate x) * up x)` for `n` rows of `input`.
pub fn swiglu_ffn(gate: &Matrix, up: &Matrix, down: &Matrix, input: &[f32], n: usize) -> Vec<f32> {
    glu_ffn(gate, up, down, input, n, swiglu)
}

/// `down(act(gate x, up x))` for `n` rows of `input`, where `act` combines the gate and up
/// projections element-wise into the first (SwiGLU, SiTU-GLU, ...).
pub fn glu_ffn(
    gate: &Matrix,
    up: &Matrix,
    down: &Matrix,
    input: &[f32],
    n: usize,
    act: impl Fn(&mut [f32], &[f32]),
) -> Vec<f32> {
    let inter = gate.rows();
    let mut gated = vec![0f32; n * inter];
    let mut upped = vec![0f32; n * inter];
    matmul_shared_input(vec![(gate, &mut gated), (up, &mut upped)], input, n);
    act(&mut gated, &upped);
    let mut out = vec![0f32; n * down.rows()];
    down.matmul(&gated, n, &mut out);
    out
}

/// A dense gated MLP (`{prefix}.{gate,up,down}_proj.weight`), `down(act(gate x, up x))`:
/// dense layers and shared experts, SwiGLU or SiTU-GLU.
pub struct GatedMlp {
    act: Activation,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

impl GatedMlp {
    /// From matrices already loaded, e.g. one expert sliced from a stacked tensor.
    pub fn from_matrices(act: Activation, gate: Matrix, up: Matrix, down: Matrix) -> GatedMlp {
        GatedMlp {
            act,
            gate,
            up,
            down,
        }
    }

    /// `gate_proj`, `up_proj` and `down_proj` under `w`, at the dense width.
    pub fn load(w: &Weights, (hidden, inter): (usize, usize), act: Activation) -> Result<GatedMlp> {
        Ok(GatedMlp {
            act,
            gate: w.matrix("gate_proj.weight", [inter, hidden])?,
            up: w.matrix("up_proj.weight", [inter, hidden])?,
            down: w.matrix("down_proj.weight", [hidden, inter])?,
        })
    }

    /// `n` rows of a layer's dense MLP, timed as the `PROFILE:` line's `dense-ffn`.
    pub fn forward_dense(&self, input: &[f32], n: usize) -> Vec<f32> {
        profile::time(Phase::DenseFfn, || self.forward(input, n))
    }

    /// `n` rows of a shared expert, timed as the `PROFILE:` line's `shared-expert`.
    pub fn forward_shared(&self, input: &[f32], n: usize) -> Vec<f32> {
        profile::time(Phase::SharedExpert, || self.forward(input, n))
    }

    fn forward(&self, input: &[f32], n: usize) -> Vec<f32> {
        glu_ffn(&self.gate, &self.up, &self.down, input, n, |g, u| {
            self.act.apply(g, u)
        })
    }
}

/// Shape of a grouped-query attention: query heads share key/value heads in groups.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) {
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn rms_norm_by_hand() {
        // mean square of [3, 4] is 12.5; 1/sqrt(12.5) = 0.282842...
        let mut out = [0f32; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        close(&out, &[0.848_528_1, 2.262_741_7]);
    }

    #[test]
    fn rope_rotates_pairs_across_halves() {
        let rope = Rope::new(4, 10000.0);
        // inv_freq = [1, 0.01]; position 1 rotates pair (0,2) by 1 rad and (1,3) by 0.01 rad.
        let mut x = [1.0, 1.0, 0.0, 0.0];
        rope.apply(&mut x, 4, 1);
        close(&x, &[1f32.cos(), 0.01f32.cos(), 1f32.sin(), 0.01f32.sin()]);
        let mut at_zero = [0.3, -0.2, 0.5, 0.7];
        rope.apply(&mut at_zero, 4, 0);
        close(&at_zero, &[0.3, -0.2, 0.5, 0.7]);
    }

    #[test]
    fn softmax_and_top_k_break_ties_low() {
        let mut p = [1.0f32, 3.0, 3.0, 0.0];
        softmax(&mut p);
        close(&[p.iter().sum::<f32>()], &[1.0]);
        let picked = top_k(&p, 2);
        assert_eq!(
            picked.iter().map(|&(i, _)| i).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert_eq!(top_k(&[f32::NAN, 0.5, 0.25], 2)[0].0, 1);
    }

    #[test]
    fn top_k_by_selection_is_the_head_of_the_full_sort() {
        // Ties, NaNs and both signs of zero, at every k.
        let scores: Vec<f32> = (0..97u32)
            .map(|i| match i % 11 {
                0 => f32::NAN,
                1 => 0.5,
                2 => -0.0,
                3 => 0.0,
                _ => (i.wrapping_mul(2_654_435_761) % 1000) as f32 / 100.0 - 5.0,
            })
            .collect();
        let mut sorted: Vec<usize> = (0..scores.len()).collect();
        sorted.sort_by(|&a, &b| ranked(&scores, a, b));
        for k in 0..=scores.len() + 1 {
            let picked: Vec<usize> = top_k(&scores, k).iter().map(|&(i, _)| i).collect();
            assert_eq!(picked, sorted[..k.min(scores.len())], "k = {k}");
            let mut positions = picked;
            positions.sort_unstable();
            assert_eq!(top_k_positions(&scores, k), positions, "k = {k}");
        }
    }

    #[test]
    fn swiglu_by_hand() {
        let mut gate = [0.0f32, 2.0];
        swiglu(&mut gate, &[5.0, 3.0]);
        close(&gate, &[0.0, 2.0 / (1.0 + (-2f32).exp()) * 3.0]);
    }

    #[test]
    fn interleaved_rope_turns_adjacent_pairs_and_splits_the_halves() {
        let rope = Rope::new(4, 10000.0);
        // Pairs (x0, x1) at frequency 1 and (x2, x3) at 0.01; position 1.
        let mut x = [1.0, 0.0, 0.0, 1.0];
        rope.apply_interleaved(&mut x, 1);
        let (c1, s1, c2, s2) = (1f32.cos(), 1f32.sin(), 0.01f32.cos(), 0.01f32.sin());
        // Out: [a0 cos - b0 sin, a1 cos - b1 sin, b0 cos + a0 sin, b1 cos + a1 sin].
        close(&x, &[c1, -s2, s1, c2]);
    }

    #[test]
    fn layer_norm_by_hand() {
        // mean 2, biased variance 1 for [1, 3]: normalised [-1, 1].
        let mut out = [0f32; 2];
        layer_norm(&[1.0, 3.0], &[2.0, 1.0], &[0.5, -0.5], 0.0, &mut out);
        close(&out, &[-1.5, 0.5]);
    }
}
