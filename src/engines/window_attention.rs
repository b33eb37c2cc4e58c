//! Causal grouped-query attention with an optional sliding window and an optional additive
//! logit bias that depends on the query row, the head and the backward distance to the key
//! (a learned relative position bias), over a KV cache that forgets the positions the window
//! can no longer reach.
//!
//! Scores are `(q · k) * scale + bias(distance)` over the keys at positions
//! `max(0, qpos - window + 1) ..= qpos`, softmaxed in f32, as the transformers eager
//! attention adds a `position_bias` and a sliding-window mask to the scaled products.

use rayon::prelude::*;

use super::layers::{dot, softmax, AttentionShape};

/// Keys and values by absolute position. With a window, rows older than the window are
/// dropped in batches, so memory stays within about twice the window.
pub struct WindowKvCache {
    width: usize,
    window: Option<usize>,
    /// Absolute position of the first stored row.
    first: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl WindowKvCache {
    /// A cache for `width` (`kv_heads * head_dim`) wide keys and values; `window` is the
    /// number of positions a query sees, its own included (`None`: all of them).
    pub fn new(width: usize, window: Option<usize>) -> WindowKvCache {
        WindowKvCache {
            width,
            window: window.map(|w| w.max(1)),
            first: 0,
            keys: Vec::new(),
            values: Vec::new(),
        }
    }

    /// Number of positions seen so far (stored or already forgotten).
    pub fn positions(&self) -> usize {
        self.first + self.keys.len() / self.width
    }

    pub fn clear(&mut self) {
        self.first = 0;
        self.keys.clear();
        self.values.clear();
    }

    /// Append the keys and values of the next positions (`rows x width` each).
    pub fn push(&mut self, keys: &[f32], values: &[f32]) {
        if let Some(window) = self.window {
            // The first new query sees the `window - 1` positions before it and nothing
            // older; draining only once twice the window is stored keeps the copying at
            // O(1) per position.
            let stored = self.keys.len() / self.width;
            if stored >= 2 * window {
                let drop = stored - (window - 1);
                self.keys.drain(..drop * self.width);
                self.values.drain(..drop * self.width);
                self.first += drop;
            }
        }
        self.keys.extend_from_slice(keys);
        self.values.extend_from_slice(values);
    }

    fn row<'a>(&self, data: &'a [f32], position: usize) -> &'a [f32] {
        &data[(position - self.first) * self.width..][..self.width]
    }
}

/// An additive attention-logit bias by backward distance.
pub trait DistanceBias: Sync {
    /// Fill `out[d]` with the bias of query row `token` (of the current batch) and head
    /// `head` for the key `d` positions back, for every `d < out.len()`.
    fn fill(&self, token: usize, head: usize, out: &mut [f32]);
}

/// Attention of `n` new queries (`n x heads*head_dim`) against `cache`, whose last `n`
/// positions are those queries' own keys. Query head `h` reads key/value head
/// `h / (heads / kv_heads)`; query `t` sees at most the `window` latest positions up to its
/// own.
pub fn windowed_attention(
    shape: AttentionShape,
    window: Option<usize>,
    queries: &[f32],
    n: usize,
    cache: &WindowKvCache,
    bias: Option<&dyn DistanceBias>,
    out: &mut [f32],
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    let group = heads / kv_heads;
    let q_width = heads * head_dim;
    let first_query = cache.positions() - n;
    out.par_chunks_mut(head_dim)
        .enumerate()
        .for_each(|(index, out)| {
            let (token, head) = (index / heads, index % heads);
            let query = &queries[token * q_width + head * head_dim..][..head_dim];
            let kv_offset = (head / group) * head_dim;
            let position = first_query + token;
            let oldest = window.map_or(0, |w| (position + 1).saturating_sub(w));
            let span = position + 1 - oldest;
            let mut by_distance = vec![0f32; span];
            if let Some(bias) = bias {
                bias.fill(token, head, &mut by_distance);
            }
            let mut scores: Vec<f32> = (oldest..=position)
                .map(|pos| {
                    let key = &cache.row(&cache.keys, pos)[kv_offset..][..head_dim];
                    dot(query, key) * scale + by_distance[position - pos]
                })
                .collect();
            softmax(&mut scores);
            out.fill(0.0);
            for (pos, &p) in (oldest..=position).zip(&scores) {
                let value = &cache.row(&cache.values, pos)[kv_offset..][..head_dim];
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
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    fn values(count: usize, seed: f32) -> Vec<f32> {
        (0..count).map(|i| (i as f32 * seed).sin()).collect()
    }

    const SHAPE: AttentionShape = AttentionShape {
        heads: 4,
        kv_heads: 2,
        head_dim: 3,
        scale: 0.5,
    };

    #[test]
    fn grouped_heads_read_their_shared_kv_head() {
        // Two query heads share one kv head of dim 2; two positions.
        let shape = AttentionShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 2,
            scale: 1.0,
        };
        let mut cache = WindowKvCache::new(2, None);
        cache.push(&[1.0, 0.0, 0.0, 1.0], &[10.0, 0.0, 0.0, 20.0]);
        // Only the second position's query (n = 1): head 0 looks along key 0, head 1
        // along key 1.
        let mut out = [0f32; 4];
        windowed_attention(
            shape,
            None,
            &[2.0, 0.0, 0.0, 2.0],
            1,
            &cache,
            None,
            &mut out,
        );
        let (hi, lo) = (2f32.exp() / (2f32.exp() + 1.0), 1.0 / (2f32.exp() + 1.0));
        close(&out, &[10.0 * hi, 20.0 * lo, 10.0 * lo, 20.0 * hi]);
        // With n = 2 the first query sees only the first position.
        let queries = [1.0, 1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 2.0];
        let mut both = [0f32; 8];
        windowed_attention(shape, None, &queries, 2, &cache, None, &mut both);
        close(&both[..4], &[10.0, 0.0, 10.0, 0.0]);
        close(&both[4..], &out);
    }

    struct PreferFar;

    impl DistanceBias for PreferFar {
        fn fill(&self, _token: usize, head: usize, out: &mut [f32]) {
            for (d, b) in out.iter_mut().enumerate() {
                *b = if head == 0 { 100.0 * d as f32 } else { 0.0 };
            }
        }
    }

    #[test]
    fn the_window_and_the_bias_pick_the_keys() {
        // One head, one kv head, head_dim 1, zero queries: without bias every visible key
        // weighs the same; a steep bias on distance puts all weight on the oldest visible.
        let shape = AttentionShape {
            heads: 2,
            kv_heads: 1,
            head_dim: 1,
            scale: 1.0,
        };
        let mut cache = WindowKvCache::new(1, Some(3));
        cache.push(&[0.0; 6], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let mut out = [0f32; 2];
        windowed_attention(
            shape,
            Some(3),
            &[0.0, 0.0],
            1,
            &cache,
            Some(&PreferFar),
            &mut out,
        );
        close(&out, &[4.0, 5.0]);
    }

    #[test]
    fn forgetting_old_rows_changes_nothing() {
        let width = 6;
        let window = 4;
        let mut kept = WindowKvCache::new(width, None);
        let mut windowed = WindowKvCache::new(width, Some(window));
        let mut position = 0;
        for (step, n) in [3usize, 1, 1, 5, 1, 1, 1, 2, 1, 1, 1, 1]
            .into_iter()
            .enumerate()
        {
            let keys = values(n * width, 0.3 + step as f32);
            let vals = values(n * width, 0.9 + step as f32);
            let queries = values(n * 12, 1.3 + step as f32);
            kept.push(&keys, &vals);
            windowed.push(&keys, &vals);
            position += n;
            assert_eq!(windowed.positions(), position);
            let (mut a, mut b) = (vec![0f32; n * 12], vec![0f32; n * 12]);
            windowed_attention(SHAPE, Some(window), &queries, n, &kept, None, &mut a);
            windowed_attention(SHAPE, Some(window), &queries, n, &windowed, None, &mut b);
            assert_eq!(a, b);
        }
        assert!(windowed.keys.len() / width < 2 * window + 2);
    }
}
