//! Causal grouped-query attention with an optional sliding window and an optional additive
//! logit bias that depends on the query row, the head and the backward distance to the key
//! (a learned relative position bias), over a KV cache that forgets the positions the window
//! can no longer reach.
//!
//! Scores are `(q · k) * scale + bias(distance)` over the keys at positions
//! `max(0, qpos - window + 1) ..= qpos`, softmaxed in f32, as the transformers eager
//! attention adds a `position_bias` and a sliding-window mask to the scaled products.

use std::io::{self, Read, Write};
use std::ops::Range;

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::layers::{dot, softmax, AttentionShape};
use super::state_io::{self, expect};
#[cfg(target_arch = "x86_64")]
use crate::quant::{selected_simd, Isa};

/// Keys and values by absolute position, each kv head's rows side by side (so that one
/// head's attention reads its keys and values sequentially). With a window, rows older
/// than the window are dropped in batches, so memory stays within about twice the window.
#[derive(Clone)]
pub struct WindowKvCache {
    head_dim: usize,
    window: Option<usize>,
    /// Absolute position of the first stored row.
    first: usize,
    /// Per kv head, `stored x head_dim`.
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

impl WindowKvCache {
    /// A cache for `kv_heads` heads of `head_dim` wide keys and values; `window` is the
    /// number of positions a query sees, its own included (`None`: all of them).
    pub fn new(kv_heads: usize, head_dim: usize, window: Option<usize>) -> WindowKvCache {
        WindowKvCache {
            head_dim,
            window: window.map(|w| w.max(1)),
            first: 0,
            keys: vec![Vec::new(); kv_heads.max(1)],
            values: vec![Vec::new(); kv_heads.max(1)],
        }
    }

    fn stored(&self) -> usize {
        self.keys[0].len() / self.head_dim.max(1)
    }

    /// Number of positions seen so far (stored or already forgotten).
    pub fn positions(&self) -> usize {
        self.first + self.stored()
    }

    /// Bytes of keys and values held.
    pub fn size_bytes(&self) -> usize {
        4 * self
            .keys
            .iter()
            .chain(&self.values)
            .map(Vec::len)
            .sum::<usize>()
    }

    /// Whether every key a query after position `len` may read is still held.
    pub fn can_truncate(&self, len: usize) -> bool {
        let needed = self.window.map_or(0, |w| len.saturating_sub(w - 1));
        len == 0 || len >= self.positions() || needed >= self.first
    }

    /// Keep the first `len` positions, where every key the next query may read is still
    /// held; otherwise the error says how far back this cache can go.
    pub fn truncate(&mut self, len: usize) -> anyhow::Result<()> {
        if len == 0 {
            self.clear();
            return Ok(());
        }
        if !self.can_truncate(len) {
            anyhow::bail!(
                "a sliding-window cache that forgot the positions before {} cannot go back to {len}",
                self.first
            );
        }
        let keep = (len.max(self.first) - self.first) * self.head_dim;
        for head in self.keys.iter_mut().chain(self.values.iter_mut()) {
            head.truncate(keep);
        }
        Ok(())
    }

    pub fn clear(&mut self) {
        self.first = 0;
        self.keys.iter_mut().for_each(Vec::clear);
        self.values.iter_mut().for_each(Vec::clear);
    }

    /// Append the keys and values of the next positions (`rows x kv_heads*head_dim`
    /// each).
    pub fn push(&mut self, keys: &[f32], values: &[f32]) {
        let hd = self.head_dim;
        if let Some(window) = self.window {
            // The first new query sees the `window - 1` positions before it and nothing
            // older; draining only once twice the window is stored keeps the copying at
            // O(1) per position.
            let stored = self.stored();
            if stored >= 2 * window {
                let drop = stored - (window - 1);
                for head in self.keys.iter_mut().chain(self.values.iter_mut()) {
                    head.drain(..drop * hd);
                }
                self.first += drop;
            }
        }
        for (store, rows) in [(&mut self.keys, keys), (&mut self.values, values)] {
            for row in rows.chunks_exact(hd * store.len()) {
                for (head, part) in store.iter_mut().zip(row.chunks_exact(hd)) {
                    head.extend_from_slice(part);
                }
            }
        }
    }

    /// Writes the head width, the window (0 for none), the first stored position, then each
    /// kv head's keys and each one's values ([`state_io`]).
    pub fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.head_dim)?;
        state_io::write_len(out, self.window.unwrap_or(0))?;
        state_io::write_len(out, self.first)?;
        state_io::write_len(out, self.keys.len())?;
        for head in self.keys.iter().chain(&self.values) {
            state_io::write_f32s(out, head)?;
        }
        Ok(())
    }

    /// Reads what [`WindowKvCache::save`] wrote, refused unless its head width, window and
    /// kv heads are this cache's and every head holds the same whole rows.
    pub fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let head_dim = state_io::read_len(input, "the head width")?;
        expect("head width", head_dim, self.head_dim)?;
        let window = state_io::read_len(input, "the window")?;
        let name = |w: usize| match w {
            0 => "none".to_string(),
            w => format!("{w} positions"),
        };
        expect(
            "sliding window",
            name(window),
            name(self.window.unwrap_or(0)),
        )?;
        let first = state_io::read_position(input, "the first stored position")?;
        let heads = state_io::read_len(input, "the number of kv heads")?;
        expect("kv heads", heads, self.keys.len())?;
        let mut read = |kind: &str| -> Result<Vec<Vec<f32>>> {
            (0..heads)
                .map(|h| state_io::read_f32s(input, &format!("kv head {h}'s {kind}")))
                .collect()
        };
        let (keys, values) = (read("keys")?, read("values")?);
        let len = keys[0].len();
        let stored = state_io::rows("keys", len, self.head_dim)?;
        if let Some(h) = keys.iter().chain(&values).position(|v| v.len() != len) {
            let (kind, head) = if h < heads {
                ("keys", h)
            } else {
                ("values", h - heads)
            };
            bail!("kv head {head}'s {kind} hold a different number of positions than kv head 0's keys");
        }
        // Forgetting keeps the `window - 1` keys the next query reads (see `push` and
        // `can_truncate`); a cache that forgot more could not be attended over.
        match self.window {
            None if first > 0 => bail!("a cache without a window that forgot {first} positions"),
            Some(window) if first > 0 && stored + 1 < window => bail!(
                "a {window}-position window that forgot {first} positions and keeps only {stored}"
            ),
            _ => {}
        }
        if first.saturating_add(stored) > state_io::MAX_POSITION {
            bail!(
                "{first} forgotten and {stored} stored positions are beyond any context (at most {})",
                state_io::MAX_POSITION
            );
        }
        (self.first, self.keys, self.values) = (first, keys, values);
        Ok(())
    }

    /// Head `kv_head`'s keys (`values == false`) or values at `positions`, side by side.
    fn rows(&self, values: bool, kv_head: usize, positions: Range<usize>) -> &[f32] {
        let data = if values { &self.values } else { &self.keys };
        let hd = self.head_dim;
        &data[kv_head][(positions.start - self.first) * hd..(positions.end - self.first) * hd]
    }
}

/// An additive attention-logit bias by backward distance.
pub trait DistanceBias: Sync {
    /// Fill `out[d]` with the bias of query row `token` (of the current batch) and head
    /// `head` for the key `d` positions back, for every `d < out.len()`.
    fn fill(&self, token: usize, head: usize, out: &mut [f32]);
}

/// Queries of one head per task: the block reads its head's keys and values once for all
/// of its queries, not once per query.
const QUERY_BLOCK: usize = 16;

/// Attention of `n` new queries (`n x heads*head_dim`) against `cache`, whose last `n`
/// positions are those queries' own keys. Query head `h` reads key/value head
/// `h / (heads / kv_heads)`; query `t` sees at most the `window` latest positions up to its
/// own. Each output is computed as a query alone would compute it (its scores by
/// [`dot`], its weighted values summed in position order), so a batch gives its rows'
/// bits.
pub fn windowed_attention(
    shape: AttentionShape,
    window: Option<usize>,
    queries: &[f32],
    n: usize,
    cache: &WindowKvCache,
    bias: Option<&dyn DistanceBias>,
    out: &mut [f32],
) {
    let (heads, head_dim) = (shape.heads, shape.head_dim);
    let blocks = n.div_ceil(QUERY_BLOCK);
    let contexts: Vec<Vec<f32>> = (0..heads * blocks)
        .into_par_iter()
        .map(|task| {
            let (head, block) = (task / blocks, task % blocks);
            let tokens = block * QUERY_BLOCK..((block + 1) * QUERY_BLOCK).min(n);
            let job = HeadBlock {
                shape,
                window,
                queries,
                n,
                cache,
                bias,
            };
            job.run(head, tokens)
        })
        .collect();
    let q_width = heads * head_dim;
    for (task, context) in contexts.iter().enumerate() {
        let (head, block) = (task / blocks, task % blocks);
        for (i, row) in context.chunks_exact(head_dim).enumerate() {
            let token = block * QUERY_BLOCK + i;
            out[token * q_width + head * head_dim..][..head_dim].copy_from_slice(row);
        }
    }
}

/// What every task of one [`windowed_attention`] call reads.
struct HeadBlock<'a> {
    shape: AttentionShape,
    window: Option<usize>,
    queries: &'a [f32],
    n: usize,
    cache: &'a WindowKvCache,
    bias: Option<&'a dyn DistanceBias>,
}

impl HeadBlock<'_> {
    /// The contexts (`tokens.len() x head_dim`) of query head `head` for the batch rows
    /// `tokens`, in 256-bit vectors where the kernels' instruction set has them. Every step
    /// is a separate multiply and add per lane, so the width does not change the bits.
    fn run(&self, head: usize, tokens: Range<usize>) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        if matches!(selected_simd(), Isa::Avx2 | Isa::Avx512) {
            // SAFETY: the kernels select an instruction set only where the CPU has it.
            return unsafe { self.run_avx2(head, tokens) };
        }
        self.compute(head, tokens, dot, weighted_sum)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn run_avx2(&self, head: usize, tokens: Range<usize>) -> Vec<f32> {
        // SAFETY: this function runs only with AVX2.
        self.compute(
            head,
            tokens,
            |a, b| unsafe { x86::dot(a, b) },
            |rows, weights, out| unsafe { x86::weighted_sum(rows, weights, out) },
        )
    }

    /// `dot` and `weighted` are [`dot`] and [`weighted_sum`] or equals of them (the same
    /// operations per lane, in the same order).
    #[inline(always)]
    fn compute(
        &self,
        head: usize,
        tokens: Range<usize>,
        dot: impl Fn(&[f32], &[f32]) -> f32,
        weighted: impl Fn(&[f32], &[f32], &mut [f32]),
    ) -> Vec<f32> {
        let AttentionShape {
            heads,
            kv_heads,
            head_dim,
            scale,
        } = self.shape;
        let cache = self.cache;
        let q_width = heads * head_dim;
        let kv_head = head / (heads / kv_heads);
        let first_query = cache.positions() - self.n;
        // Query `i` of the block sees positions `seen[i].0 ..= seen[i].1`; both ends grow
        // with `i`.
        let seen: Vec<(usize, usize)> = tokens
            .clone()
            .map(|token| {
                let position = first_query + token;
                let oldest = self.window.map_or(0, |w| (position + 1).saturating_sub(w));
                (oldest, position)
            })
            .collect();
        let query =
            |i: usize| &self.queries[(tokens.start + i) * q_width + head * head_dim..][..head_dim];
        let (lo, hi) = (seen[0].0, seen[seen.len() - 1].1);
        let mut scores: Vec<Vec<f32>> = seen
            .iter()
            .map(|&(oldest, position)| vec![0f32; position + 1 - oldest])
            .collect();
        let by_distance: Vec<Vec<f32>> = match self.bias {
            Some(bias) => scores
                .iter()
                .enumerate()
                .map(|(i, row)| {
                    let mut distances = vec![0f32; row.len()];
                    bias.fill(tokens.start + i, head, &mut distances);
                    distances
                })
                .collect(),
            None => Vec::new(),
        };
        let keys = cache.rows(false, kv_head, lo..hi + 1);
        for (pos, key) in (lo..=hi).zip(keys.chunks_exact(head_dim)) {
            for (i, &(oldest, position)) in seen.iter().enumerate() {
                if (oldest..=position).contains(&pos) {
                    let mut score = dot(query(i), key) * scale;
                    if let Some(distances) = by_distance.get(i) {
                        score += distances[position - pos];
                    }
                    scores[i][pos - oldest] = score;
                }
            }
        }
        scores.iter_mut().for_each(|row| softmax(row));
        let mut context = vec![0f32; seen.len() * head_dim];
        for (i, (&(oldest, position), out)) in seen
            .iter()
            .zip(context.chunks_exact_mut(head_dim))
            .enumerate()
        {
            weighted(
                cache.rows(true, kv_head, oldest..position + 1),
                &scores[i],
                out,
            );
        }
        context
    }
}

/// `out[j] = sum_r weights[r] * rows[r][j]` over the rows (each `out.len()` wide) in
/// order, each product added to a sum that starts at zero.
fn weighted_sum(rows: &[f32], weights: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (row, &p) in rows.chunks_exact(out.len()).zip(weights) {
        for (y, &v) in out.iter_mut().zip(row) {
            *y += p * v;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// [`super::dot`] in one 256-bit register: lane `l` sums the products of elements
    /// `8c + l` in order of `c`, then the same pairwise sum of the lanes and the tail.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let full = n / 8;
        let mut acc = _mm256_setzero_ps();
        for c in 0..full {
            // SAFETY: chunk `c` lies within both slices' first `n` elements.
            let (x, y) = unsafe {
                (
                    _mm256_loadu_ps(a.as_ptr().add(8 * c)),
                    _mm256_loadu_ps(b.as_ptr().add(8 * c)),
                )
            };
            acc = _mm256_add_ps(acc, _mm256_mul_ps(x, y));
        }
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        let tail: f32 = a[full * 8..n]
            .iter()
            .zip(&b[full * 8..n])
            .map(|(x, y)| x * y)
            .sum();
        ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
            + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
            + tail
    }

    /// [`super::weighted_sum`] with each 32 columns' sums held in four registers over all
    /// the rows, the last columns eight and then one at a time.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn weighted_sum(rows: &[f32], weights: &[f32], out: &mut [f32]) {
        let width = out.len();
        let count = weights.len().min(rows.len() / width.max(1));
        let row = |r: usize, c: usize| {
            // SAFETY: row `r < count` has `width` floats and `c + 8 <= width`.
            unsafe { _mm256_loadu_ps(rows.as_ptr().add(r * width + c)) }
        };
        let mut c = 0;
        while c + 32 <= width {
            let mut sums = [_mm256_setzero_ps(); 4];
            for (r, &p) in weights[..count].iter().enumerate() {
                let p = _mm256_set1_ps(p);
                for (k, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm256_add_ps(*sum, _mm256_mul_ps(p, row(r, c + 8 * k)));
                }
            }
            for (k, sum) in sums.into_iter().enumerate() {
                // SAFETY: `c + 8k + 8 <= width`.
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * k), sum) };
            }
            c += 32;
        }
        while c + 8 <= width {
            let mut sum = _mm256_setzero_ps();
            for (r, &p) in weights[..count].iter().enumerate() {
                sum = _mm256_add_ps(sum, _mm256_mul_ps(_mm256_set1_ps(p), row(r, c)));
            }
            // SAFETY: `c + 8 <= width`.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c), sum) };
            c += 8;
        }
        for (j, y) in out.iter_mut().enumerate().skip(c) {
            *y = 0.0;
            for (r, &p) in weights[..count].iter().enumerate() {
                *y += p * rows[r * width + j];
            }
        }
    }
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
        let mut cache = WindowKvCache::new(1, 2, None);
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
        let mut cache = WindowKvCache::new(1, 1, Some(3));
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

    /// One query at a time, the whole cache per query: the order of operations
    /// `windowed_attention` must keep.
    fn one_query_at_a_time(
        shape: AttentionShape,
        window: Option<usize>,
        queries: &[f32],
        n: usize,
        cache: &WindowKvCache,
        bias: Option<&dyn DistanceBias>,
    ) -> Vec<f32> {
        let (hd, q_width) = (shape.head_dim, shape.heads * shape.head_dim);
        let first_query = cache.positions() - n;
        let mut out = vec![0f32; n * q_width];
        for (index, out) in out.chunks_exact_mut(hd).enumerate() {
            let (token, head) = (index / shape.heads, index % shape.heads);
            let query = &queries[token * q_width + head * hd..][..hd];
            let kv_head = head / (shape.heads / shape.kv_heads);
            let position = first_query + token;
            let oldest = window.map_or(0, |w| (position + 1).saturating_sub(w));
            let mut by_distance = vec![0f32; position + 1 - oldest];
            if let Some(bias) = bias {
                bias.fill(token, head, &mut by_distance);
            }
            let mut scores: Vec<f32> = (oldest..=position)
                .map(|pos| {
                    let key = cache.rows(false, kv_head, pos..pos + 1);
                    dot(query, key) * shape.scale + by_distance[position - pos]
                })
                .collect();
            softmax(&mut scores);
            for (pos, &p) in (oldest..=position).zip(&scores) {
                let value = cache.rows(true, kv_head, pos..pos + 1);
                for (y, &v) in out.iter_mut().zip(value) {
                    *y += p * v;
                }
            }
        }
        out
    }

    struct Slope;

    impl DistanceBias for Slope {
        fn fill(&self, token: usize, head: usize, out: &mut [f32]) {
            for (d, b) in out.iter_mut().enumerate() {
                *b = ((token * 7 + head * 3 + d) as f32 * 0.37).sin();
            }
        }
    }

    #[test]
    fn blocks_of_queries_keep_the_bits_of_one_query_at_a_time() {
        // Head dim 20 (two chunks of eight and a tail), two query heads per kv head; 40
        // new queries after 5 cached positions span three query blocks, the last partial.
        let shape = AttentionShape {
            heads: 4,
            kv_heads: 2,
            head_dim: 20,
            scale: 0.3,
        };
        let width = shape.kv_heads * shape.head_dim;
        for (window, bias) in [
            (None, None),
            (Some(7), None),
            (Some(23), Some(&Slope as &dyn DistanceBias)),
            (None, Some(&Slope as &dyn DistanceBias)),
        ] {
            let mut cache = WindowKvCache::new(shape.kv_heads, shape.head_dim, window);
            cache.push(&values(5 * width, 0.11), &values(5 * width, 0.23));
            let n = 40;
            cache.push(&values(n * width, 0.7), &values(n * width, 1.9));
            let queries = values(n * shape.heads * shape.head_dim, 0.53);
            let mut out = vec![0f32; queries.len()];
            windowed_attention(shape, window, &queries, n, &cache, bias, &mut out);
            let expected = one_query_at_a_time(shape, window, &queries, n, &cache, bias);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&expected), "window {window:?}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_products_keep_the_portable_bits() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            return;
        }
        // Widths with a tail after the 8-lane chunks and after the 32-column runs.
        for width in [1, 7, 8, 20, 32, 45, 128] {
            let (a, b) = (values(width, 0.37), values(width, 1.13));
            // SAFETY: AVX2 was detected above.
            let wide = unsafe { x86::dot(&a, &b) };
            assert_eq!(wide.to_bits(), dot(&a, &b).to_bits(), "dot of {width}");
            let rows = values(9 * width, 0.61);
            let weights = values(9, 2.3);
            let (mut portable, mut vector) = (vec![1f32; width], vec![1f32; width]);
            weighted_sum(&rows, &weights, &mut portable);
            // SAFETY: as above.
            unsafe { x86::weighted_sum(&rows, &weights, &mut vector) };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&vector), bits(&portable), "weighted sum of {width}");
        }
    }

    #[test]
    fn forgetting_old_rows_changes_nothing() {
        let width = 6;
        let window = 4;
        let mut kept = WindowKvCache::new(2, 3, None);
        let mut windowed = WindowKvCache::new(2, 3, Some(window));
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
        assert!(windowed.stored() < 2 * window + 2);
    }

    #[test]
    fn a_saved_window_comes_back_and_one_that_forgot_too_much_is_refused() {
        let mut cache = WindowKvCache::new(2, 3, Some(4));
        for step in 0..11 {
            cache.push(&values(6, step as f32 + 0.5), &values(6, step as f32 - 0.5));
        }
        assert!(cache.first > 0);
        let mut bytes = Vec::new();
        cache.save(&mut bytes).unwrap();
        let mut back = WindowKvCache::new(2, 3, Some(4));
        back.restore(&mut &bytes[..]).unwrap();
        assert_eq!(
            (back.first, back.positions()),
            (cache.first, cache.positions())
        );
        assert_eq!((&back.keys, &back.values), (&cache.keys, &cache.values));

        let err = |cache: &mut WindowKvCache, bytes: &[u8]| {
            cache.restore(&mut &bytes[..]).unwrap_err().to_string()
        };
        let mut wider = WindowKvCache::new(2, 3, Some(5));
        assert_eq!(
            err(&mut wider, &bytes),
            "sliding window: the saved state has 4 positions, this model's has 5 positions"
        );
        // Two positions kept after forgetting some: the next query needs three.
        let mut short = WindowKvCache::new(2, 3, Some(4));
        short.first = 9;
        short
            .keys
            .iter_mut()
            .chain(short.values.iter_mut())
            .for_each(|h| h.resize(6, 0.0));
        let mut bytes = Vec::new();
        short.save(&mut bytes).unwrap();
        assert_eq!(
            err(&mut back, &bytes),
            "a 4-position window that forgot 9 positions and keeps only 2"
        );
    }
}
