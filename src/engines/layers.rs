//! The layer operations engines share: RMSNorm, rotary embeddings, softmax, top-k
//! selection, SwiGLU, causal attention with grouped key/value heads and its KV cache.
//!
//! Each function computes what the transformers reference computes for that block, in
//! f32 over rows of a row-major batch. Nothing here knows which model calls it.

use rayon::prelude::*;

/// `out = x / sqrt(mean(x^2) + eps) * weight`, for each row of `x` (`weight.len()` wide).
/// The mean square is accumulated in f64 so the result does not depend on the row length's
/// rounding behaviour.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
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
}

/// Numerically stable softmax in place.
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

/// The `k` largest entries of `scores` as `(index, score)`, largest first; ties go to the
/// lower index and NaN never wins over a number.
pub fn top_k(scores: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (scores[a], scores[b]);
        match (x.is_nan(), y.is_nan()) {
            (true, true) => a.cmp(&b),
            (true, false) => std::cmp::Ordering::Greater,
            (false, true) => std::cmp::Ordering::Less,
            _ => y.total_cmp(&x).then(a.cmp(&b)),
        }
    });
    order.into_iter().take(k).map(|i| (i, scores[i])).collect()
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate = silu(gate) * up`, element-wise, leaving the product in `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// Keys and values of one attention layer for every position seen so far.
pub struct KvCache {
    width: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl KvCache {
    /// A cache for `kv_heads * head_dim` wide keys and values.
    pub fn new(width: usize) -> KvCache {
        KvCache {
            width,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len() / self.width
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn clear(&mut self) {
        self.keys.clear();
        self.values.clear();
    }

    pub fn push(&mut self, keys: &[f32], values: &[f32]) {
        self.keys.extend_from_slice(keys);
        self.values.extend_from_slice(values);
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

/// Causal attention of `n` new queries (`n x heads*head_dim`) against `cache`, whose last
/// `n` positions are those queries' own keys. Query head `h` reads key/value head
/// `h / (heads / kv_heads)`, as `repeat_kv` lays them out.
pub fn causal_attention(
    shape: AttentionShape,
    queries: &[f32],
    n: usize,
    cache: &KvCache,
    out: &mut [f32],
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    let group = heads / kv_heads;
    let first = cache.len() - n;
    let q_width = heads * head_dim;
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each(|(index, out)| {
            let (token, head) = (index / heads, index % heads);
            let query = &queries[token * q_width + head * head_dim..][..head_dim];
            let kv_offset = (head / group) * head_dim;
            let visible = first + token + 1;
            let mut scores: Vec<f32> = (0..visible)
                .map(|pos| {
                    let key = &cache.keys[pos * cache.width + kv_offset..][..head_dim];
                    query.iter().zip(key).map(|(a, b)| a * b).sum::<f32>() * scale
                })
                .collect();
            softmax(&mut scores);
            out.fill(0.0);
            for (pos, &p) in scores.iter().enumerate() {
                let value = &cache.values[pos * cache.width + kv_offset..][..head_dim];
                for (y, &v) in out.iter_mut().zip(value) {
                    *y += p * v;
                }
            }
        });
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
    fn swiglu_by_hand() {
        let mut gate = [0.0f32, 2.0];
        swiglu(&mut gate, &[5.0, 3.0]);
        close(&gate, &[0.0, 2.0 / (1.0 + (-2f32).exp()) * 3.0]);
    }

    #[test]
    fn grouped_attention_reads_the_shared_head() {
        // Two query heads share one kv head of dim 2; two positions.
        let mut cache = KvCache::new(2);
        cache.push(&[1.0, 0.0], &[10.0, 0.0]);
        cache.push(&[0.0, 1.0], &[0.0, 20.0]);
        let shape = AttentionShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
        };
        // Only the second position's query (n = 1): head 0 looks along key 0, head 1 along key 1.
        let queries = [2.0, 0.0, 0.0, 2.0];
        let mut out = [0f32; 4];
        causal_attention(shape, &queries, 1, &cache, &mut out);
        let (hi, lo) = (2f32.exp() / (2f32.exp() + 1.0), 1.0 / (2f32.exp() + 1.0));
        close(&out, &[10.0 * hi, 20.0 * lo, 10.0 * lo, 20.0 * hi]);
        // With n = 2 the first query sees only the first position.
        let mut both = [0f32; 8];
        causal_attention(
            shape,
            &[1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 2.0],
            2,
            &cache,
            &mut both,
        );
        close(&both[..4], &[10.0, 0.0, 10.0, 0.0]);
        close(&both[4..], &out);
    }
}
