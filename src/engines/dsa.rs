//! The DSA lightning indexer (DeepSeek sparse attention, as GLM-5.2 uses it): per query row a
//! cheap multi-head score over every cached position picks the `top_k` positions the
//! attention then reads; the rest of the context is skipped.
//!
//! For a query at position `p` and a key at `t <= p`:
//! `score_t = Σ_h w_h · ReLU(q_h · k_t / sqrt(head_dim))`, with `q = wq_b · q_resid` (the
//! normalised q-LoRA activation, `heads x head_dim`), `k_t = LayerNorm(wk · x_t)` (one head,
//! cached per position), `w = weights_proj · x / sqrt(heads)`, and RoPE (interleaved) on the
//! first `rope` dimensions of each q head and of k. A row that sees at most `top_k`
//! positions reads them all, as a top-k over the masked scores keeps them all.

use std::io::{self, Read, Write};
use std::ops::Range;

use anyhow::Result;
use rayon::prelude::*;

use super::layers::{dot, layer_norm, top_k_positions, Rope};
use super::state_io::{self, expect};
use super::weights::Weights;
use crate::profile::{self, Phase};
use crate::quant::{Matrix, Queries};

/// Positions a task of [`Indexer::select`] scores.
const SCORE_BLOCK: usize = 1024;

/// `nn.LayerNorm` epsilon of the indexer's key norm.
const K_NORM_EPS: f64 = 1e-6;

/// The indexer keys of one layer, one `head_dim` vector per position.
#[derive(Clone)]
pub struct IndexKeys {
    dim: usize,
    keys: Vec<f32>,
}

impl IndexKeys {
    pub fn new(dim: usize) -> IndexKeys {
        IndexKeys {
            dim,
            keys: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.keys.len() / self.dim
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    pub fn size_bytes(&self) -> usize {
        4 * self.keys.len()
    }

    /// Keep the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.keys.truncate(len * self.dim);
    }

    /// Writes the key width, then the keys ([`state_io`]).
    pub fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.dim)?;
        state_io::write_f32s(out, &self.keys)
    }

    /// Reads what [`IndexKeys::save`] wrote, refused unless its key width is this one's and
    /// it holds whole keys.
    pub fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let dim = state_io::read_len(input, "the indexer key width")?;
        expect("indexer key width (index_head_dim)", dim, self.dim)?;
        let keys = state_io::read_f32s(input, "the indexer keys")?;
        state_io::rows("indexer keys", keys.len(), self.dim)?;
        self.keys = keys;
        Ok(())
    }

    fn key(&self, pos: usize) -> &[f32] {
        &self.keys[pos * self.dim..][..self.dim]
    }
}

/// The indexer's products over a batch's rows ([`Indexer::project`]).
pub struct IndexerRows {
    /// `n x head_dim`, normalised, not rotated yet.
    keys: Vec<f32>,
    /// `n x heads x head_dim`, not rotated yet; empty when no row selects.
    queries: Vec<f32>,
    /// `n x heads`; empty when no row selects.
    weights: Vec<f32>,
}

/// Sizes of the indexer.
#[derive(Debug, Clone, Copy)]
pub struct IndexerShape {
    pub hidden: usize,
    pub q_lora: usize,
    pub heads: usize,
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates.
    pub rope: usize,
    /// Positions a query keeps once it sees more than this many.
    pub top_k: usize,
}

/// The indexer weights of one layer (`{prefix}.{wq_b,wk,k_norm,weights_proj}`).
pub struct Indexer {
    shape: IndexerShape,
    wq_b: Matrix,
    wk: Matrix,
    weights_proj: Matrix,
    k_norm_weight: Vec<f32>,
    k_norm_bias: Vec<f32>,
}

impl Indexer {
    /// Whether `prefix` holds indexer tensors at all.
    pub fn present(w: &Weights) -> bool {
        w.contains("wq_b.weight")
    }

    /// The indexer under `w` (a layer's `self_attn.indexer`).
    pub fn load(w: &Weights, shape: IndexerShape) -> Result<Indexer> {
        let IndexerShape {
            hidden,
            q_lora,
            heads,
            head_dim,
            ..
        } = shape;
        Ok(Indexer {
            shape,
            wq_b: w.matrix("wq_b.weight", [heads * head_dim, q_lora])?,
            wk: w.matrix("wk.weight", [head_dim, hidden])?,
            // The head weights decide the ranking on their own; transformers keeps them f32.
            weights_proj: w.matrix_f32("weights_proj.weight", [heads, hidden])?,
            k_norm_weight: w.vector("k_norm.weight", head_dim)?,
            k_norm_bias: w.vector("k_norm.bias", head_dim)?,
        })
    }

    /// The indexer's products over `n` rows of the normalised layer input `x` (and their
    /// normalised low-rank queries `q_resid`), once for every sequence of a batch: the keys
    /// always, the queries and head weights only `with_queries` (some row sees more than
    /// `top_k` positions, or `DSA_FORCE`).
    pub fn project(&self, x: &[f32], q_resid: &[f32], n: usize, with_queries: bool) -> IndexerRows {
        profile::time(Phase::Indexer, || {
            self.project_untimed(x, q_resid, n, with_queries)
        })
    }

    fn project_untimed(
        &self,
        x: &[f32],
        q_resid: &[f32],
        n: usize,
        with_queries: bool,
    ) -> IndexerRows {
        let IndexerShape {
            heads, head_dim, ..
        } = self.shape;
        let mut projected = vec![0f32; n * head_dim];
        self.wk.matmul(x, n, &mut projected);
        let mut keys = vec![0f32; n * head_dim];
        layer_norm(
            &projected,
            &self.k_norm_weight,
            &self.k_norm_bias,
            K_NORM_EPS,
            &mut keys,
        );
        let (mut queries, mut weights) = (Vec::new(), Vec::new());
        if with_queries {
            queries = vec![0f32; n * heads * head_dim];
            self.wq_b.matmul(q_resid, n, &mut queries);
            weights = vec![0f32; n * heads];
            self.weights_proj.matmul(x, n, &mut weights);
        }
        IndexerRows {
            keys,
            queries,
            weights,
        }
    }

    /// Append the keys of rows `rows` of `projected` at positions `start..` to `cache`.
    pub fn push_keys(
        &self,
        projected: &IndexerRows,
        rows: Range<usize>,
        start: usize,
        rope: &Rope,
        cache: &mut IndexKeys,
    ) {
        let dim = self.shape.head_dim;
        let mut keys = projected.keys[rows.start * dim..rows.end * dim].to_vec();
        for (t, key) in keys.chunks_exact_mut(dim).enumerate() {
            rope.apply_interleaved(&mut key[..self.shape.rope], start + t);
        }
        cache.keys.extend_from_slice(&keys);
    }

    /// The positions each query row of `rows` of `projected` (the last `rows.len()`
    /// positions of `cache`) reads, ascending: the `top_k` best-scoring ones (ties to the
    /// earlier position), or every visible one when the row sees no more than `top_k`, or
    /// always with `keep_all`. `None` when no row has anything to drop and `keep_all` is
    /// off: plain causal attention.
    pub fn select(
        &self,
        projected: &IndexerRows,
        rows: Range<usize>,
        rope: &Rope,
        cache: &IndexKeys,
        keep_all: bool,
    ) -> Option<Vec<Vec<usize>>> {
        profile::time(Phase::Indexer, || {
            self.select_untimed(projected, rows, rope, cache, keep_all)
        })
    }

    fn select_untimed(
        &self,
        projected: &IndexerRows,
        rows: Range<usize>,
        rope: &Rope,
        cache: &IndexKeys,
        keep_all: bool,
    ) -> Option<Vec<Vec<usize>>> {
        let IndexerShape {
            heads,
            head_dim,
            top_k: keep,
            ..
        } = self.shape;
        let n = rows.len();
        let first = cache.len() - n;
        if !keep_all && first + n <= keep {
            return None;
        }
        let queries =
            &projected.queries[rows.start * heads * head_dim..rows.end * heads * head_dim];
        let weights = &projected.weights[rows.start * heads..rows.end * heads];
        let head_scale = (heads as f32).powf(-0.5);
        let softmax_scale = (head_dim as f32).powf(-0.5);
        let selection = (0..n)
            .into_par_iter()
            .map(|row| {
                let visible = first + row + 1;
                if !keep_all && visible <= keep {
                    return (0..visible).collect();
                }
                let mut query = queries[row * heads * head_dim..][..heads * head_dim].to_vec();
                for head in query.chunks_exact_mut(head_dim) {
                    rope.apply_interleaved(&mut head[..self.shape.rope], first + row);
                }
                let w: Vec<f32> = weights[row * heads..][..heads]
                    .iter()
                    .map(|&w| w * head_scale)
                    .collect();
                // A decoded row is one task of the loop over rows: its positions are
                // scored by every thread, four at a time (each head's query read once for
                // the four keys; each score summed over the heads in order as alone).
                let queries = Queries::new(&query, heads);
                let mut scores = vec![0f32; visible];
                scores
                    .par_chunks_mut(SCORE_BLOCK)
                    .enumerate()
                    .for_each(|(block, scores)| {
                        let mut products = vec![[0f32; 4]; heads];
                        for (quad, scores) in scores.chunks_mut(4).enumerate() {
                            let first = block * SCORE_BLOCK + 4 * quad;
                            // Each of the four positions' heads summed in order from
                            // -0.0, as f32's `Sum` does, four positions side by side.
                            let score = |products: &[[f32; 4]]| {
                                let mut sums = [-0.0f32; 4];
                                for (p, &w) in products.iter().zip(&w) {
                                    for (sum, p) in sums.iter_mut().zip(p) {
                                        *sum += w * (p * softmax_scale).max(0.0);
                                    }
                                }
                                sums
                            };
                            if let [a, b, c, d] = scores {
                                let keys = std::array::from_fn(|j| cache.key(first + j));
                                queries.dots(keys, &mut products);
                                [*a, *b, *c, *d] = score(&products);
                            } else {
                                for (j, s) in scores.iter_mut().enumerate() {
                                    let key = cache.key(first + j);
                                    for (p, q) in
                                        products.iter_mut().zip(query.chunks_exact(head_dim))
                                    {
                                        p[0] = dot(q, key);
                                    }
                                    *s = score(&products)[0];
                                }
                            }
                        }
                    });
                let quota = if keep_all { visible } else { keep.min(visible) };
                top_k_positions(&scores, quota)
            })
            .collect();
        Some(selection)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Width;

    fn indexer(top_k: usize) -> Indexer {
        // hidden 2, q_lora 2, one head of dim 2 with no rotated dimensions; wq_b and wk are
        // identities so query = q_resid and key = LayerNorm(x).
        let shape = IndexerShape {
            hidden: 2,
            q_lora: 2,
            heads: 1,
            head_dim: 2,
            rope: 0,
            top_k,
        };
        let eye = || Matrix::from_f32(2, 2, vec![1.0, 0.0, 0.0, 1.0], Width::F32);
        Indexer {
            shape,
            wq_b: eye(),
            wk: eye(),
            weights_proj: Matrix::from_f32(1, 2, vec![1.0, 0.0], Width::F32),
            k_norm_weight: vec![1.0, 1.0],
            k_norm_bias: vec![0.0, 0.0],
        }
    }

    #[test]
    fn keeps_the_best_scoring_positions_in_order() {
        let ix = indexer(2);
        let rope = Rope::new(0, 10000.0);
        let mut cache = IndexKeys::new(2);
        // LayerNorm of (a, b) with a != b is (+-1, -+1): keys alternate "up" and "down".
        let x = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        ix.push_keys(
            &ix.project(&x, &[0.0; 8], 4, false),
            0..4,
            0,
            &rope,
            &mut cache,
        );
        assert_eq!(cache.len(), 4);
        // A query along "up", weighted by x[0] = 1.
        let q_resid = [1.0, -1.0];
        let last = ix.project(&[1.0, 0.0], &q_resid, 1, true);
        let picked = ix.select(&last, 0..1, &rope, &cache, false).unwrap();
        // Scores: up keys (0, 2) score ~2/sqrt(2), down keys (1, 3) ReLU to 0.
        assert_eq!(picked, vec![vec![0, 2]]);
        // Keeping every key, or seeing no more than top_k, reads all visible positions.
        let all = ix.select(&last, 0..1, &rope, &cache, true).unwrap();
        assert_eq!(all, vec![vec![0, 1, 2, 3]]);
        let wide = indexer(4);
        assert!(wide.select(&last, 0..1, &rope, &cache, false).is_none());
    }

    #[test]
    fn ties_go_to_the_earlier_position() {
        let ix = indexer(1);
        let rope = Rope::new(0, 10000.0);
        let mut cache = IndexKeys::new(2);
        let x = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0];
        ix.push_keys(
            &ix.project(&x, &[0.0; 6], 3, false),
            0..3,
            0,
            &rope,
            &mut cache,
        );
        let last = ix.project(&[1.0, 0.0], &[1.0, -1.0], 1, true);
        let picked = ix.select(&last, 0..1, &rope, &cache, false).unwrap();
        assert_eq!(picked, vec![vec![0]]);
        cache.truncate(1);
        assert_eq!(cache.len(), 1);
    }
}
