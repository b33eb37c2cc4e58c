//! Multi-head latent attention (MLA, DeepSeek-V2 style): the keys and values of every head
//! are decompressed from one normalised latent per position, plus one rotary key that all
//! heads share. The cache ([`LatentCache`]) keeps only those two vectors per position.
//!
//! Two ways to attend compute the same function:
//! - [`attend_plain`] expands the cached latents with `kv_b` into per-head keys and values
//!   and attends as usual: cheap per query when many queries share the expansion (prefill,
//!   teacher forcing), and the form transformers computes;
//! - [`attend_absorbed`] folds `kv_b` into the query (`q_nope · W_k`, a latent-space query)
//!   and into the output (`W_v · Σ a_t latent_t`), so the cache is never expanded: the
//!   decode path.
//!
//! Both read the positions a [`Keys`] names, so a sparse selection (DSA) plugs into either.

use std::io::{self, Read, Write};
use std::ops::Range;

use rayon::prelude::*;

use anyhow::Result;

use super::layers::{rms_norm, rms_norm_in_place, softmax};
use super::state_io::{self, expect};
use super::weights::Weights;
use crate::quant::{
    add_weighted, fused_add_weighted, fused_add_weighted_tile, fused_dots,
    loads_shared_across_vectors, tile_pays_for_skipped_rows, Lines, Matrix, Queries,
};

/// Sizes of one MLA layer. A query head is `[nope | rope]` wide; `kv_b` maps a latent to
/// `heads x [nope key | v value]`.
#[derive(Debug, Clone, Copy)]
pub struct MlaShape {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kv_lora: usize,
    /// Softmax scale, `1/sqrt(nope + rope)`.
    pub scale: f32,
}

impl MlaShape {
    /// The shape of `heads` heads with `nope` + `rope` wide queries and keys, `v` wide
    /// values and a `kv_lora` wide latent, scaled by `1/sqrt(nope + rope)`.
    pub fn new(heads: usize, nope: usize, rope: usize, v: usize, kv_lora: usize) -> MlaShape {
        MlaShape {
            heads,
            nope,
            rope,
            v,
            kv_lora,
            scale: ((nope + rope) as f32).powf(-0.5),
        }
    }

    /// Width of one query head.
    pub fn qk(&self) -> usize {
        self.nope + self.rope
    }

    /// Rows of `kv_b` per head: its key part, then its value part.
    fn kv_rows(&self) -> usize {
        self.nope + self.v
    }
}

/// The projections of an MLA layer with a low-rank query (`q_a_proj`, `q_a_layernorm`,
/// `q_b_proj`) and the compressed key/value (`kv_a_proj_with_mqa` to `[latent | rope key]`,
/// the latent through `kv_a_layernorm`; `kv_b_proj` expands it), under `{prefix}` as
/// DeepSeek-style checkpoints name them (e.g. `model.layers.3.self_attn`).
pub struct MlaProjections {
    shape: MlaShape,
    q_a: Matrix,
    q_a_norm: Vec<f32>,
    q_b: Matrix,
    kv_a: Matrix,
    kv_a_norm: Vec<f32>,
    kv_b: Matrix,
}

/// What [`MlaProjections::project`] gives for `n` rows; nothing is rotated yet.
pub struct Projected {
    /// `n x q_lora`: the normalised low-rank query (a DSA indexer reads it).
    pub q_low_rank: Vec<f32>,
    /// `n x heads x [nope | rope]`.
    pub queries: Vec<f32>,
    /// `n x kv_lora`, normalised.
    pub latents: Vec<f32>,
    /// `n x rope`, the key part shared by every head.
    pub rope_keys: Vec<f32>,
}

impl MlaProjections {
    /// The projections under `w` (a layer's `self_attn`).
    pub fn load(
        w: &Weights,
        hidden: usize,
        q_lora: usize,
        shape: MlaShape,
    ) -> Result<MlaProjections> {
        let matrix = |name: &str, rows: usize, cols: usize| {
            w.matrix(&format!("{name}.weight"), [rows, cols])
        };
        let norm = |name: &str, len: usize| w.vector(&format!("{name}.weight"), len);
        Ok(MlaProjections {
            q_a: matrix("q_a_proj", q_lora, hidden)?,
            q_a_norm: norm("q_a_layernorm", q_lora)?,
            q_b: matrix("q_b_proj", shape.heads * shape.qk(), q_lora)?,
            kv_a: matrix("kv_a_proj_with_mqa", shape.kv_lora + shape.rope, hidden)?,
            kv_a_norm: norm("kv_a_layernorm", shape.kv_lora)?,
            kv_b: matrix("kv_b_proj", shape.heads * shape.kv_rows(), shape.kv_lora)?,
            shape,
        })
    }

    /// `kv_b_proj`, for [`attend_plain`] and [`attend_absorbed`].
    pub fn kv_b(&self) -> &Matrix {
        &self.kv_b
    }

    /// Queries, normalised latents and rope keys of `n` rows `h`; `eps` is the epsilon of
    /// both low-rank norms.
    pub fn project(&self, h: &[f32], n: usize, eps: f64) -> Projected {
        let (kv_lora, rope) = (self.shape.kv_lora, self.shape.rope);
        let mut q_resid = vec![0f32; n * self.q_a.rows()];
        self.q_a.matmul(h, n, &mut q_resid);
        rms_norm_in_place(&mut q_resid, &self.q_a_norm, eps);
        let mut queries = vec![0f32; n * self.q_b.rows()];
        self.q_b.matmul(&q_resid, n, &mut queries);
        let mut compressed = vec![0f32; n * (kv_lora + rope)];
        self.kv_a.matmul(h, n, &mut compressed);
        let mut latents = vec![0f32; n * kv_lora];
        let mut rope_keys = Vec::with_capacity(n * rope);
        for (row, latent) in compressed
            .chunks_exact(kv_lora + rope)
            .zip(latents.chunks_exact_mut(kv_lora))
        {
            rms_norm(&row[..kv_lora], &self.kv_a_norm, eps, latent);
            rope_keys.extend_from_slice(&row[kv_lora..]);
        }
        Projected {
            q_low_rank: q_resid,
            queries,
            latents,
            rope_keys,
        }
    }
}

/// The compressed KV cache of one MLA layer: per position the normalised latent
/// (`kv_lora`) and the rotated shared key (`rope`).
#[derive(Clone)]
pub struct LatentCache {
    kv_lora: usize,
    rope: usize,
    latents: Vec<f32>,
    rope_keys: Vec<f32>,
}

impl LatentCache {
    pub fn new(kv_lora: usize, rope: usize) -> LatentCache {
        LatentCache {
            kv_lora,
            rope,
            latents: Vec::new(),
            rope_keys: Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.latents.len() / self.kv_lora
    }

    pub fn is_empty(&self) -> bool {
        self.latents.is_empty()
    }

    pub fn clear(&mut self) {
        self.truncate(0);
    }

    pub fn size_bytes(&self) -> usize {
        4 * (self.latents.len() + self.rope_keys.len())
    }

    /// Keep the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.latents.truncate(len * self.kv_lora);
        self.rope_keys.truncate(len * self.rope);
    }

    /// Append rows: `latents` is `n x kv_lora`, `rope_keys` is `n x rope`.
    pub fn push(&mut self, latents: &[f32], rope_keys: &[f32]) {
        self.latents.extend_from_slice(latents);
        self.rope_keys.extend_from_slice(rope_keys);
    }

    /// Writes the latent and rope widths, then the latents and the rope keys
    /// ([`state_io`]).
    pub fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.kv_lora)?;
        state_io::write_len(out, self.rope)?;
        state_io::write_f32s(out, &self.latents)?;
        state_io::write_f32s(out, &self.rope_keys)
    }

    /// Reads what [`LatentCache::save`] wrote, refused unless its widths are this cache's
    /// and the latents and rope keys hold the same number of positions.
    pub fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let kv_lora = state_io::read_len(input, "the latent width")?;
        expect("latent width (kv_lora_rank)", kv_lora, self.kv_lora)?;
        let rope = state_io::read_len(input, "the rope key width")?;
        expect("rope key width (qk_rope_head_dim)", rope, self.rope)?;
        let latents = state_io::read_f32s(input, "the latents")?;
        let positions = state_io::rows("latents", latents.len(), self.kv_lora)?;
        let rope_keys = state_io::read_f32s(input, "the rope keys")?;
        expect(
            "rope key values for the latents' positions",
            rope_keys.len(),
            positions * self.rope,
        )?;
        (self.latents, self.rope_keys) = (latents, rope_keys);
        Ok(())
    }

    fn latent(&self, pos: usize) -> &[f32] {
        &self.latents[pos * self.kv_lora..][..self.kv_lora]
    }

    fn rope_key(&self, pos: usize) -> &[f32] {
        &self.rope_keys[pos * self.rope..][..self.rope]
    }
}

/// The cached positions each query row reads.
pub enum Keys<'a> {
    /// Every position up to and including the row's own.
    Causal,
    /// One strictly ascending list per query row (a sparse selection; each list ends at or
    /// before the row's own position).
    Selected(&'a [Vec<usize>]),
}

/// `0..len`, what [`positions`] hands causal rows; nothing for a selection, which never
/// reads it (a decode step past the DSA's top-k would otherwise build it every layer).
fn every_position(keys: &Keys, len: usize) -> Vec<usize> {
    match keys {
        Keys::Causal => (0..len).collect(),
        Keys::Selected(_) => Vec::new(),
    }
}

/// The `n` query rows are the last `n` positions of `cache`.
fn positions<'a>(keys: &'a Keys, every: &'a [usize], first: usize, row: usize) -> &'a [usize] {
    match keys {
        Keys::Causal => &every[..first + row + 1],
        Keys::Selected(rows) => &rows[row],
    }
}

/// The positions of the ascending `seen` from its `next`-th on that come before `end`.
/// Counted from the front, not searched: the caller reads each of them next, while a binary
/// search over a long selection misses the cache at every step.
fn in_block(seen: &[usize], next: usize, end: usize) -> &[usize] {
    let rest = &seen[next..];
    &rest[..rest.iter().take_while(|&&pos| pos < end).count()]
}

/// `vector` of each of four positions.
fn quad_of<'a>(quad: &[usize], vector: impl Fn(usize) -> &'a [f32]) -> [&'a [f32]; 4] {
    std::array::from_fn(|j| vector(quad[j]))
}

/// Query rows of one head that [`attend_plain`] attends together, so that each block of
/// keys and values is read once for all of them. Past the DSA's top-k a row reads fewer of
/// each block's positions the longer the prompt (an eighth at 16,384 tokens), and every
/// query block walks the head's whole slab (33 MB at 16,384 positions): 128 rows walk it a
/// quarter as often as 32 did, with the same time at 1,024 and 4,096 positions.
const QUERY_BLOCK: usize = 128;
/// Positions whose keys and values [`attend_plain`] reads as one block: 64 of GLM-5.2's
/// (192 + 64 + 256 floats and a padding line) take 132 KiB, which stays in the
/// second-level cache while every row of a query block reads it.
const KEY_BLOCK: usize = 64;

/// Floats after each position of [`attend_plain`]'s slab: one cache line.
const SLAB_PADDING: usize = 16;

/// Where the kernels load a key once for several rows ([`loads_shared_across_vectors`]:
/// two rows against each key), a key block's span is scored for every row of a query block
/// at once when the rows read at least one in `DENSE_SHARE` of its row-by-position pairs;
/// otherwise each row scores only the positions it reads. The sums follow the scores where
/// the tile of sums pays for the rows a sum skips ([`tile_pays_for_skipped_rows`]: four
/// sums against each value); elsewhere the tile always sums, each sum over only what it
/// reads. Every score and sum has the same bits either way, so this only trades wasted
/// products against loads.
const DENSE_SHARE: usize = 4;

/// Attention of `n` query rows (`n x heads*(nope+rope)`, rope part already rotated) against
/// `cache`, whose last `n` positions are theirs, by expanding every cached latent with
/// `kv_b`. Writes `n x heads*v` into `out`.
///
/// One task per head: it gathers the head's keys and values into one slab (in the expansion
/// consecutive positions are `heads x (nope + v)` floats apart, a page or more), then takes
/// its query rows [`QUERY_BLOCK`] at a time and walks the positions [`KEY_BLOCK`] at a time,
/// every row of the block scoring (then summing) the positions it reads in that key block,
/// or all the rows together over the span they read ([`DENSE_SHARE`]).
/// Each row still scores and sums its positions in ascending order with the same
/// operations, so the result does not depend on the blocking. Scores and weighted sums fuse
/// each product into its add ([`fused_dots`], [`fused_add_weighted`]): half the arithmetic
/// instructions of plain `f32` products.
pub fn attend_plain(
    shape: MlaShape,
    kv_b: &Matrix,
    queries: &[f32],
    n: usize,
    cache: &LatentCache,
    keys: &Keys,
    out: &mut [f32],
) {
    let (heads, v) = (shape.heads, shape.v);
    let total = cache.len();
    let first = total - n;
    let mut expanded = vec![0f32; total * heads * shape.kv_rows()];
    kv_b.matmul(&cache.latents, total, &mut expanded);
    let every = every_position(keys, total);
    let heads_of = ExpandedHeads {
        shape,
        queries,
        first,
        cache,
        keys,
        every: &every,
        expanded: &expanded,
    };
    let mut by_head = vec![0f32; n * heads * v];
    by_head
        .par_chunks_mut(n * v)
        .enumerate()
        .for_each(|(head, head_out)| heads_of.attend(head, head_out));
    for (index, head_out) in by_head.chunks_exact(v).enumerate() {
        let (head, row) = (index / n, index % n);
        out[(row * heads + head) * v..][..v].copy_from_slice(head_out);
    }
}

/// What every head's task of [`attend_plain`] reads.
struct ExpandedHeads<'a> {
    shape: MlaShape,
    queries: &'a [f32],
    /// The position of the first query row.
    first: usize,
    cache: &'a LatentCache,
    keys: &'a Keys<'a>,
    /// `0..cache.len()`, the causal rows' positions.
    every: &'a [usize],
    /// `kv_b` times every cached latent: per position, every head's key then value.
    expanded: &'a [f32],
}

impl ExpandedHeads<'_> {
    /// Head `head`'s context for every query row into `out` (`n x v`).
    fn attend(&self, head: usize, head_out: &mut [f32]) {
        let MlaShape {
            heads,
            nope,
            v,
            scale,
            ..
        } = self.shape;
        let (qk, rows) = (self.shape.qk(), self.shape.kv_rows());
        let total = self.cache.len();
        let width = heads * rows;
        // Per position: the head's whole key (its part of the expansion, then the shared
        // rotary key), then its value, then one unused cache line. Without it GLM-5.2's
        // positions lie 2 KiB apart, so the same part of every position's value falls in
        // the same two sets of the first-level cache and a block's values cannot stay there
        // while the query rows sum them.
        let stride = qk + v + SLAB_PADDING;
        let mut lines = Lines::zeroed(total * stride);
        let slab = lines.floats_mut();
        for (pos, key_value) in slab.chunks_exact_mut(stride).enumerate() {
            let expanded = &self.expanded[pos * width + head * rows..][..rows];
            key_value[..nope].copy_from_slice(&expanded[..nope]);
            key_value[nope..qk].copy_from_slice(self.cache.rope_key(pos));
            key_value[qk..qk + v].copy_from_slice(&expanded[nope..]);
        }
        for (block, block_out) in head_out.chunks_mut(QUERY_BLOCK * v).enumerate() {
            let block_rows = block * QUERY_BLOCK..block * QUERY_BLOCK + block_out.len() / v;
            let count = block_rows.len();
            let seen: Vec<&[usize]> = block_rows
                .clone()
                .map(|row| positions(self.keys, self.every, self.first, row))
                .collect();
            let query =
                |i: usize| &self.queries[((block_rows.start + i) * heads + head) * qk..][..qk];
            let mut block_queries = Vec::with_capacity(count * qk);
            (0..count).for_each(|i| block_queries.extend_from_slice(query(i)));
            let mut together = Tile::new(&block_queries, count, scale);
            let key = |pos: usize| &slab[pos * stride..][..qk];
            let mut scores: Vec<Vec<f32>> = seen
                .iter()
                .map(|list| Vec::with_capacity(list.len()))
                .collect();
            let mut next = vec![0usize; count];
            let mut these: Vec<&[usize]> = Vec::with_capacity(count);
            let mut tile = vec![0f32; count * KEY_BLOCK];
            for end in (KEY_BLOCK..total + KEY_BLOCK).step_by(KEY_BLOCK) {
                these.clear();
                these.extend((0..count).map(|i| in_block(seen[i], next[i], end)));
                let Some((span, shared)) = span_read(&these) else {
                    continue;
                };
                if shared {
                    let lo = span.start;
                    together.score(span, key, &mut tile);
                    for (i, list) in these.iter().enumerate() {
                        let row = &tile[i * KEY_BLOCK..][..KEY_BLOCK];
                        match run_of(list) {
                            Some(run) => {
                                scores[i].extend_from_slice(&row[run.start - lo..run.end - lo])
                            }
                            None => scores[i].extend(list.iter().map(|&pos| row[pos - lo])),
                        }
                    }
                } else {
                    for (i, list) in these.iter().enumerate() {
                        // Four keys a pass, each query chunk read once for them.
                        let mut quads = list.chunks_exact(4);
                        for quad in &mut quads {
                            let dots = fused_dots(query(i), quad_of(quad, key));
                            scores[i].extend(dots.map(|dot| dot * scale));
                        }
                        for &pos in quads.remainder() {
                            scores[i].push(fused_dots(query(i), [key(pos)])[0] * scale);
                        }
                    }
                }
                for (next, list) in next.iter_mut().zip(&these) {
                    *next += list.len();
                }
            }
            scores.iter_mut().for_each(|row| softmax(row));
            block_out.fill(0.0);
            next.fill(0);
            let value = |pos: usize| &slab[pos * stride + qk..][..v];
            let (mut weights, mut reads, mut values) = (Vec::new(), Vec::new(), Vec::new());
            for end in (KEY_BLOCK..total + KEY_BLOCK).step_by(KEY_BLOCK) {
                these.clear();
                these.extend((0..count).map(|i| in_block(seen[i], next[i], end)));
                let Some((span, shared)) = span_read(&these) else {
                    continue;
                };
                if shared || !tile_pays_for_skipped_rows() {
                    // Every row's sum over the span at once; a row skips the positions it
                    // does not read.
                    let width = span.len();
                    weights.clear();
                    weights.resize(count * width, 0.0);
                    reads.clear();
                    for (i, list) in these.iter().enumerate() {
                        let p = &scores[i][next[i]..][..list.len()];
                        let row = &mut weights[i * width..][..width];
                        let Some(run) = run_of(list) else {
                            let mut bits = 0u64;
                            for (&pos, &p) in list.iter().zip(p) {
                                let bit = 1 << (pos - span.start);
                                debug_assert_eq!(bits & bit, 0, "a row's positions are distinct");
                                row[pos - span.start] = p;
                                bits |= bit;
                            }
                            reads.push(bits);
                            continue;
                        };
                        let run = run.start - span.start..run.end - span.start;
                        row[run.clone()].copy_from_slice(p);
                        reads.push((u64::MAX >> (64 - run.len())) << run.start);
                    }
                    values.clear();
                    values.extend(span.map(value));
                    fused_add_weighted_tile(block_out, &weights, &reads, &values);
                } else {
                    for (i, row_out) in block_out.chunks_exact_mut(v).enumerate() {
                        let (list, p) = (these[i], &scores[i][next[i]..]);
                        // Eight values a pass (the sum read and written once for them),
                        // then four, then one at a time: the same adds in the same order.
                        let mut at = 0;
                        while at + 8 <= list.len() {
                            let eight: [f32; 8] = p[at..at + 8].try_into().expect("eight");
                            let rows = std::array::from_fn(|j| value(list[at + j]));
                            fused_add_weighted(row_out, eight, rows);
                            at += 8;
                        }
                        if at + 4 <= list.len() {
                            let four: [f32; 4] = p[at..at + 4].try_into().expect("four");
                            fused_add_weighted(row_out, four, quad_of(&list[at..], value));
                            at += 4;
                        }
                        for (&pos, &p) in list[at..].iter().zip(&p[at..]) {
                            fused_add_weighted(row_out, [p], [value(pos)]);
                        }
                    }
                }
                for (next, list) in next.iter_mut().zip(&these) {
                    *next += list.len();
                }
            }
        }
    }
}

/// The positions of an ascending `list` as one range, where they follow each other (every
/// causal row's, and none of a sparse one's but by chance); `None` for an empty list.
fn run_of(list: &[usize]) -> Option<Range<usize>> {
    let (&first, &last) = (list.first()?, list.last()?);
    (last - first + 1 == list.len()).then_some(first..last + 1)
}

/// The positions from the first to the last that any of a query block's rows read in one
/// key block, and whether to run the rows together over all of them ([`DENSE_SHARE`]);
/// `None` if no row reads any.
fn span_read(these: &[&[usize]]) -> Option<(Range<usize>, bool)> {
    let lo = these.iter().filter_map(|list| list.first()).min()?;
    let hi = these.iter().filter_map(|list| list.last()).max()?;
    let read: usize = these.iter().map(|list| list.len()).sum();
    let dense = read * DENSE_SHARE >= these.len() * (hi + 1 - lo);
    Some((*lo..hi + 1, dense && loads_shared_across_vectors()))
}

/// One head's query rows of a query block, kept for scoring against keys they share.
struct Tile<'a> {
    queries: Queries<'a>,
    scale: f32,
    dots: Vec<[f32; 4]>,
}

impl<'a> Tile<'a> {
    fn new(queries: &'a [f32], count: usize, scale: f32) -> Tile<'a> {
        Tile {
            queries: Queries::fused(queries, count),
            scale,
            dots: vec![[0.0; 4]; count],
        }
    }

    /// Every row's score of every position of `span` (no longer than [`KEY_BLOCK`]), four
    /// positions a pass: row `i`'s score of `pos` at `out[i * KEY_BLOCK + pos - span.start]`,
    /// the bits of [`attend_plain`]'s row-by-row score.
    fn score<'k>(&mut self, span: Range<usize>, key: impl Fn(usize) -> &'k [f32], out: &mut [f32]) {
        let last = span.end - 1;
        for start in span.clone().step_by(4) {
            // A last pass of fewer than four positions repeats the last one.
            let quad: [usize; 4] = std::array::from_fn(|j| (start + j).min(last));
            self.queries.dots(quad.map(&key), &mut self.dots);
            let width = (span.end - start).min(4);
            for (i, dots) in self.dots.iter().enumerate() {
                let row = &mut out[i * KEY_BLOCK + start - span.start..][..width];
                for (score, dot) in row.iter_mut().zip(dots) {
                    *score = dot * self.scale;
                }
            }
        }
    }
}

/// Selected positions one task of [`attend_absorbed`] scores for every head, reading each
/// latent once for all of them.
const LATENT_BLOCK: usize = 64;
/// Heads whose contexts one task of [`attend_absorbed`] sums, reading each selected latent
/// once for all of them: eight of GLM-5.2's 512-wide contexts take 16 KB, which stays in
/// the first-level cache.
const HEAD_BLOCK: usize = 8;

/// The same attention as [`attend_plain`] without expanding the cache: per head the query
/// becomes `W_k^T q_nope` in latent space, scores are `(q_lat · latent_t + q_rope · rope_t)
/// * scale`, and the output is `W_v (Σ a_t latent_t)`.
///
/// A decoded row's heads all read the same positions, so each position's latent is read
/// from memory once for every head ([`LatentRow`]) rather than once per head: with 64
/// heads and a DSA selection scattered over a long cache, reading per head made the step
/// grow with the cache's length (every head's pass missing the address translations of
/// its 2,048 scattered positions again). Each score and each context element is computed
/// with the operations in the order of one head alone.
pub fn attend_absorbed(
    shape: MlaShape,
    kv_b: &Matrix,
    queries: &[f32],
    n: usize,
    cache: &LatentCache,
    keys: &Keys,
    out: &mut [f32],
) {
    let MlaShape {
        heads,
        nope,
        v,
        kv_lora,
        ..
    } = shape;
    let (qk, rows) = (shape.qk(), shape.kv_rows());
    assert_eq!(
        queries.len(),
        n * heads * qk,
        "absorbed attention's queries"
    );
    assert_eq!(out.len(), n * heads * v, "absorbed attention's output");
    let first = cache.len() - n;
    let every = every_position(keys, cache.len());
    let windows = queries
        .chunks(ABSORB_ROWS * heads * qk)
        .zip(out.chunks_mut(ABSORB_ROWS * heads * v));
    // Kept from window to window: fresh pages for every window cost more than the
    // decoding they save.
    let (mut by_head, mut by_row) = (Vec::new(), Vec::new());
    let (mut contexts, mut head_outs) = (Vec::new(), Vec::new());
    let (mut scores, mut weights, mut q_ropes) = (Vec::new(), Vec::new(), Vec::new());
    for (window, (queries, out)) in windows.enumerate() {
        let count = out.len() / (heads * v);
        latent_queries(shape, kv_b, queries, &mut by_head, &mut by_row);
        let q_latents = if by_row.is_empty() { &by_head } else { &by_row };
        contexts.resize(count * heads * kv_lora, 0.0);
        for (i, context) in contexts.chunks_exact_mut(heads * kv_lora).enumerate() {
            q_ropes.clear();
            for query in queries[i * heads * qk..][..heads * qk].chunks_exact(qk) {
                q_ropes.extend_from_slice(&query[nope..]);
            }
            let row = LatentRow {
                shape,
                q_latents: Queries::new(
                    &q_latents[i * heads * kv_lora..][..heads * kv_lora],
                    heads,
                ),
                q_ropes: Queries::new(&q_ropes, heads),
                cache,
                seen: positions(keys, &every, first, window * ABSORB_ROWS + i),
            };
            row.context(&mut scores, &mut weights, context);
        }
        // Each head's value rows against all the window's contexts at once: the bits of one
        // context at a time, each row decoded once for all of them.
        head_outs.clear();
        head_outs.resize(heads * count * v, 0.0);
        head_outs
            .par_chunks_mut(count * v)
            .enumerate()
            .for_each_init(Vec::new, |of_head, (head, head_out)| {
                of_head.clear();
                for context in contexts.chunks_exact(heads * kv_lora) {
                    of_head.extend_from_slice(&context[head * kv_lora..][..kv_lora]);
                }
                kv_b.rows_product(head * rows + nope, of_head, count, head_out);
            });
        for (index, out) in out.chunks_exact_mut(v).enumerate() {
            let (i, head) = (index / heads, index % heads);
            out.copy_from_slice(&head_outs[(head * count + i) * v..][..v]);
        }
    }
}

/// Query rows whose latent-space queries [`attend_absorbed`] works out together, each
/// head's rows of `W_k` decoded once for all of them: a decode step has one, a chunk of a
/// long prompt after the first (`coli serve` fills prompts 512 rows at a time) hundreds,
/// and decoding the rows again for each of them was a tenth of such a chunk's attention.
const ABSORB_ROWS: usize = 64;

/// Every head's query in latent space, `W_k^T q_nope`, for each row of `queries` (`rows x
/// heads*(nope+rope)`): per head, four rows of `W_k` decoded at a time and added in order
/// into every row's, in `by_head` (`heads x rows x kv_lora`); with more than one row, also
/// row by row in `by_row` (`rows x heads x kv_lora`), which is otherwise left empty.
fn latent_queries(
    shape: MlaShape,
    kv_b: &Matrix,
    queries: &[f32],
    by_head: &mut Vec<f32>,
    by_row: &mut Vec<f32>,
) {
    let MlaShape {
        heads,
        nope,
        kv_lora,
        ..
    } = shape;
    let (qk, rows) = (shape.qk(), shape.kv_rows());
    let count = queries.len() / (heads * qk);
    by_head.clear();
    by_head.resize(heads * count * kv_lora, 0.0);
    by_row.clear();
    by_head
        .par_chunks_mut(count * kv_lora)
        .enumerate()
        .for_each_init(
            || vec![0f32; 4 * kv_lora],
            |w_rows, (head, q_latents)| {
                for from in (0..nope).step_by(4) {
                    let take = (nope - from).min(4);
                    let w_rows = &mut w_rows[..take * kv_lora];
                    for (j, w_row) in w_rows.chunks_exact_mut(kv_lora).enumerate() {
                        kv_b.row_into(head * rows + from + j, w_row);
                    }
                    let w = |j: usize| &w_rows[j * kv_lora..][..kv_lora];
                    for (i, q_latent) in q_latents.chunks_exact_mut(kv_lora).enumerate() {
                        match queries[(i * heads + head) * qk + from..][..take] {
                            [q0, q1, q2, q3] => {
                                add_weighted(q_latent, [q0, q1, q2, q3], std::array::from_fn(w))
                            }
                            ref q => {
                                for (j, &q) in q.iter().enumerate() {
                                    add_weighted(q_latent, [q], [w(j)]);
                                }
                            }
                        }
                    }
                }
            },
        );
    if count > 1 {
        by_row.resize(count * heads * kv_lora, 0.0);
        for (index, q_latent) in by_row.chunks_exact_mut(kv_lora).enumerate() {
            let (row, head) = (index / heads, index % heads);
            q_latent.copy_from_slice(&by_head[(head * count + row) * kv_lora..][..kv_lora]);
        }
    }
}

/// One query row of [`attend_absorbed`]: every head's latent-space query against the
/// positions the row reads.
struct LatentRow<'a> {
    shape: MlaShape,
    /// Every head's latent-space query (`kv_lora` wide).
    q_latents: Queries<'a>,
    /// Every head's rotated rope query (`rope` wide).
    q_ropes: Queries<'a>,
    cache: &'a LatentCache,
    seen: &'a [usize],
}

impl LatentRow<'_> {
    /// Every head's `Σ_t a_t latent_t` into `context` (`heads x kv_lora`): the scores of
    /// [`LATENT_BLOCK`] positions a task, every head's softmax, then the sums of
    /// [`HEAD_BLOCK`] heads a task. `scores` and `weights` are the caller's, kept from row
    /// to row (a row's are a megabyte at 2,048 positions, fresh pages every row).
    fn context(&self, scores: &mut Vec<f32>, weights: &mut Vec<f32>, context: &mut [f32]) {
        let heads = self.shape.heads;
        let count = self.seen.len();
        // With no position to attend to, softmax over nothing sums nothing.
        context.fill(0.0);
        if count == 0 {
            return;
        }
        let by_position = scores;
        by_position.resize(count * heads, 0.0);
        by_position
            .par_chunks_mut(LATENT_BLOCK * heads)
            .enumerate()
            .for_each(|(block, scores)| self.score(block, scores));
        weights.resize(heads * count, 0.0);
        weights
            .par_chunks_mut(count)
            .enumerate()
            .for_each(|(head, weights)| {
                for (w, scores) in weights.iter_mut().zip(by_position.chunks_exact(heads)) {
                    *w = scores[head];
                }
                softmax(weights);
            });
        context
            .par_chunks_mut(HEAD_BLOCK * self.shape.kv_lora)
            .enumerate()
            .for_each(|(block, context)| self.sum(block, weights, context));
    }

    /// Every head's score of the positions of block `block` into `scores` (position-major):
    /// four positions a pass, each head's query read once for the four.
    fn score(&self, block: usize, scores: &mut [f32]) {
        let MlaShape { heads, scale, .. } = self.shape;
        let positions = &self.seen
            [block * LATENT_BLOCK..(block * LATENT_BLOCK + LATENT_BLOCK).min(self.seen.len())];
        let (mut by_latent, mut by_rope) = (vec![[0f32; 4]; heads], vec![[0f32; 4]; heads]);
        let quads = positions.chunks_exact(4);
        let rest = quads.remainder();
        for (quad, scores) in quads.zip(scores.chunks_exact_mut(4 * heads)) {
            let latents = quad_of(quad, |pos| self.cache.latent(pos));
            let ropes = quad_of(quad, |pos| self.cache.rope_key(pos));
            self.q_latents.dots(latents, &mut by_latent);
            self.q_ropes.dots(ropes, &mut by_rope);
            for (j, scores) in scores.chunks_exact_mut(heads).enumerate() {
                for ((score, latent), rope) in scores.iter_mut().zip(&by_latent).zip(&by_rope) {
                    *score = (latent[j] + rope[j]) * scale;
                }
            }
        }
        let done = positions.len() - rest.len();
        let (mut by_latent, mut by_rope) = (vec![[0f32; 1]; heads], vec![[0f32; 1]; heads]);
        for (&pos, scores) in rest
            .iter()
            .zip(scores[done * heads..].chunks_exact_mut(heads))
        {
            self.q_latents
                .dots([self.cache.latent(pos)], &mut by_latent);
            self.q_ropes.dots([self.cache.rope_key(pos)], &mut by_rope);
            for ((score, [latent]), [rope]) in scores.iter_mut().zip(&by_latent).zip(&by_rope) {
                *score = (latent + rope) * scale;
            }
        }
    }

    /// `Σ_t weights_t latent_t` of the heads of block `block` into `context`, in ascending
    /// position order. `weights` is `heads x seen`.
    fn sum(&self, block: usize, weights: &[f32], context: &mut [f32]) {
        let (count, kv_lora) = (self.seen.len(), self.shape.kv_lora);
        let weights = &weights[block * HEAD_BLOCK * count..];
        let quads = self.seen.chunks_exact(4);
        let done = count - quads.remainder().len();
        for (q, quad) in quads.enumerate() {
            let latents = quad_of(quad, |pos| self.cache.latent(pos));
            for (i, context) in context.chunks_exact_mut(kv_lora).enumerate() {
                let p: [f32; 4] = weights[i * count + 4 * q..][..4].try_into().expect("four");
                add_weighted(context, p, latents);
            }
        }
        for (t, &pos) in self.seen.iter().enumerate().skip(done) {
            let latent = self.cache.latent(pos);
            for (i, context) in context.chunks_exact_mut(kv_lora).enumerate() {
                add_weighted(context, [weights[i * count + t]], [latent]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::layers::dot;
    use crate::quant::Width;

    /// A deterministic pseudo-random vector in [-1, 1).
    fn noise(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(12345);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state % 20000) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    fn setup() -> (MlaShape, Matrix, LatentCache, Vec<f32>) {
        let shape = MlaShape {
            heads: 3,
            nope: 4,
            rope: 2,
            v: 5,
            kv_lora: 6,
            scale: 0.4,
        };
        let (kv_b, cache) = random_layer(shape, 7, Width::F32, 1, 2);
        let queries = noise(2 * shape.heads * shape.qk(), 4);
        (shape, kv_b, cache, queries)
    }

    /// A `kv_b` of `width` from noise seeded `kv_seed`, and a cache of `positions` latents
    /// and rotary keys from the seeds `cache_seed` and `cache_seed + 1`.
    fn random_layer(
        shape: MlaShape,
        positions: usize,
        width: Width,
        kv_seed: u32,
        cache_seed: u32,
    ) -> (Matrix, LatentCache) {
        let rows = shape.heads * shape.kv_rows();
        let kv_b = Matrix::from_f32(
            rows,
            shape.kv_lora,
            noise(rows * shape.kv_lora, kv_seed),
            width,
        );
        let mut cache = LatentCache::new(shape.kv_lora, shape.rope);
        cache.push(
            &noise(positions * shape.kv_lora, cache_seed),
            &noise(positions * shape.rope, cache_seed + 1),
        );
        (kv_b, cache)
    }

    #[test]
    fn absorbed_equals_plain() {
        let (shape, kv_b, cache, queries) = setup();
        let selected = vec![vec![0, 2, 5], vec![1, 3, 4, 6]];
        for keys in [Keys::Causal, Keys::Selected(&selected)] {
            let mut plain = vec![0f32; 2 * shape.heads * shape.v];
            let mut absorbed = plain.clone();
            attend_plain(shape, &kv_b, &queries, 2, &cache, &keys, &mut plain);
            attend_absorbed(shape, &kv_b, &queries, 2, &cache, &keys, &mut absorbed);
            for (a, b) in plain.iter().zip(&absorbed) {
                assert!((a - b).abs() < 1e-5, "{plain:?} vs {absorbed:?}");
            }
        }
    }

    #[test]
    fn selecting_every_position_is_causal_attention_bit_for_bit() {
        let (shape, kv_b, cache, queries) = setup();
        let every = vec![(0..6).collect::<Vec<_>>(), (0..7).collect()];
        for attend in [attend_plain, attend_absorbed] {
            let mut causal = vec![0f32; 2 * shape.heads * shape.v];
            let mut selected = causal.clone();
            attend(
                shape,
                &kv_b,
                &queries,
                2,
                &cache,
                &Keys::Causal,
                &mut causal,
            );
            attend(
                shape,
                &kv_b,
                &queries,
                2,
                &cache,
                &Keys::Selected(&every),
                &mut selected,
            );
            assert_eq!(causal, selected);
        }
    }

    /// `attend_plain` one query row and head at a time, each position read where the
    /// expansion left it: what the blocked version must equal bit for bit.
    fn attend_row_by_row(
        shape: MlaShape,
        kv_b: &Matrix,
        queries: &[f32],
        n: usize,
        cache: &LatentCache,
        keys: &Keys,
    ) -> Vec<f32> {
        let (qk, rows, total) = (shape.qk(), shape.kv_rows(), cache.len());
        let width = shape.heads * rows;
        let mut expanded = vec![0f32; total * width];
        kv_b.matmul(&cache.latents, total, &mut expanded);
        let every: Vec<usize> = (0..total).collect();
        let mut out = vec![0f32; n * shape.heads * shape.v];
        for row in 0..n {
            for head in 0..shape.heads {
                let query = &queries[(row * shape.heads + head) * qk..][..qk];
                let seen = positions(keys, &every, total - n, row);
                let mut scores: Vec<f32> = seen
                    .iter()
                    .map(|&pos| {
                        let key = &expanded[pos * width + head * rows..][..shape.nope];
                        let key = [key, cache.rope_key(pos)].concat();
                        fused_dots(query, [&key[..]])[0] * shape.scale
                    })
                    .collect();
                softmax(&mut scores);
                let y = &mut out[(row * shape.heads + head) * shape.v..][..shape.v];
                for (&pos, &p) in seen.iter().zip(&scores) {
                    let value = &expanded[pos * width + head * rows + shape.nope..][..shape.v];
                    for (y, &x) in y.iter_mut().zip(value) {
                        *y = p.mul_add(x, *y);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn blocks_of_queries_and_keys_give_the_bits_of_one_row_at_a_time() {
        // More query rows than a query block and positions over several key blocks, with a
        // partial block of each; causal, and a selection that reads a third of the first key
        // block, skips the second, reads one in eleven of the third (row by row) and of the
        // last a run from its `row % 4`-th position on (the second query block's rows
        // together, most runs starting after the span; with AVX-512 kernels). Widths with
        // eight-lane chunks and tails.
        let shape = MlaShape::new(3, 19, 9, 21, 6);
        let (n, total) = (QUERY_BLOCK + 5, 3 * KEY_BLOCK + 9);
        let (kv_b, cache) = random_layer(shape, total, Width::F32, 1, 5);
        let queries = noise(n * shape.heads * shape.qk(), 7);
        let first = total - n;
        let selected: Vec<Vec<usize>> = (0..n)
            .map(|row| {
                (0..=first + row)
                    .filter(|&pos| match pos / KEY_BLOCK {
                        0 => pos % 3 == row % 3,
                        1 => false,
                        2 => pos % 11 == row % 11,
                        _ => pos % KEY_BLOCK >= row % 4,
                    })
                    .chain([first + row])
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect()
            })
            .collect();
        for keys in [Keys::Causal, Keys::Selected(&selected)] {
            let mut blocked = vec![0f32; n * shape.heads * shape.v];
            attend_plain(shape, &kv_b, &queries, n, &cache, &keys, &mut blocked);
            let reference = attend_row_by_row(shape, &kv_b, &queries, n, &cache, &keys);
            assert_eq!(
                blocked.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                reference.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    /// [`attend_absorbed`] one head at a time with one position at a time: the form its
    /// blocks of positions and heads must give the bits of.
    fn absorbed_head_by_head(
        shape: MlaShape,
        kv_b: &Matrix,
        queries: &[f32],
        n: usize,
        cache: &LatentCache,
        keys: &Keys,
    ) -> Vec<f32> {
        let (qk, rows) = (shape.qk(), shape.kv_rows());
        let first = cache.len() - n;
        let every: Vec<usize> = (0..cache.len()).collect();
        let mut out = vec![0f32; n * shape.heads * shape.v];
        for (index, out) in out.chunks_exact_mut(shape.v).enumerate() {
            let (row, head) = (index / shape.heads, index % shape.heads);
            let query = &queries[index * qk..][..qk];
            let (q_nope, q_rope) = query.split_at(shape.nope);
            let mut q_latent = vec![0f32; shape.kv_lora];
            let mut w_row = vec![0f32; shape.kv_lora];
            for (d, &q) in q_nope.iter().enumerate() {
                kv_b.row_into(head * rows + d, &mut w_row);
                for (acc, &w) in q_latent.iter_mut().zip(&w_row) {
                    *acc += q * w;
                }
            }
            let seen = positions(keys, &every, first, row);
            let mut scores: Vec<f32> = seen
                .iter()
                .map(|&pos| {
                    (dot(&q_latent, cache.latent(pos)) + dot(q_rope, cache.rope_key(pos)))
                        * shape.scale
                })
                .collect();
            softmax(&mut scores);
            let mut context = vec![0f32; shape.kv_lora];
            for (&pos, &p) in seen.iter().zip(&scores) {
                for (c, &l) in context.iter_mut().zip(cache.latent(pos)) {
                    *c += p * l;
                }
            }
            kv_b.rows_product(head * rows + shape.nope, &context, 1, out);
        }
        out
    }

    #[test]
    fn absorbed_blocks_of_positions_and_heads_give_the_bits_of_one_head_at_a_time() {
        // Heads not a multiple of the head block, a latent width with a tail past its
        // chunks of eight, and positions over several blocks with a partial last quad.
        let shape = MlaShape::new(11, 12, 4, 6, 21);
        let total = 2 * LATENT_BLOCK + 23;
        let (kv_b, cache) = random_layer(shape, total, Width::Int8Row, 5, 6);
        let n = 2;
        let queries = noise(n * shape.heads * shape.qk(), 8);
        let picked: Vec<Vec<usize>> = (0..n)
            .map(|row| {
                (0..total - n + row + 1)
                    .filter(|pos| pos % 3 != row)
                    .collect()
            })
            .collect();
        // A row may also be given no position at all: it attends to nothing.
        let none_for_the_first = vec![Vec::new(), picked[1].clone()];
        for keys in [
            Keys::Causal,
            Keys::Selected(&picked),
            Keys::Selected(&none_for_the_first),
        ] {
            let mut out = vec![0f32; n * shape.heads * shape.v];
            attend_absorbed(shape, &kv_b, &queries, n, &cache, &keys, &mut out);
            let want = absorbed_head_by_head(shape, &kv_b, &queries, n, &cache, &keys);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want));
        }
    }

    #[test]
    fn absorbed_rows_in_windows_give_the_bits_of_one_head_at_a_time() {
        // More rows than a window of latent queries, with a partial last window; a query
        // width with a remainder past its fours.
        let shape = MlaShape::new(3, 7, 4, 5, 10);
        let n = ABSORB_ROWS + 9;
        let total = n + 20;
        let (kv_b, cache) = random_layer(shape, total, Width::Int8Row, 9, 10);
        let queries = noise(n * shape.heads * shape.qk(), 11);
        let picked: Vec<Vec<usize>> = (0..n)
            .map(|row| {
                (0..total - n + row + 1)
                    .filter(|pos| pos % 5 != row % 5)
                    .collect()
            })
            .collect();
        for keys in [Keys::Causal, Keys::Selected(&picked)] {
            let mut out = vec![0f32; n * shape.heads * shape.v];
            attend_absorbed(shape, &kv_b, &queries, n, &cache, &keys, &mut out);
            let want = absorbed_head_by_head(shape, &kv_b, &queries, n, &cache, &keys);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out), bits(&want));
        }
    }

    #[test]
    fn one_key_reads_its_value() {
        // With a single visible position the softmax is 1 and the output is that position's
        // value: kv_b's value rows times the latent.
        let (shape, kv_b, cache, queries) = setup();
        let only = vec![vec![3], vec![3]];
        let mut out = vec![0f32; 2 * shape.heads * shape.v];
        attend_plain(
            shape,
            &kv_b,
            &queries,
            2,
            &cache,
            &Keys::Selected(&only),
            &mut out,
        );
        for head in 0..shape.heads {
            let mut want = vec![0f32; shape.v];
            kv_b.rows_product(
                head * shape.kv_rows() + shape.nope,
                cache.latent(3),
                1,
                &mut want,
            );
            for (got, want) in out[head * shape.v..][..shape.v].iter().zip(&want) {
                assert!((got - want).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn truncate_forgets_positions() {
        let (_, _, mut cache, _) = setup();
        cache.truncate(4);
        assert_eq!(cache.len(), 4);
        assert_eq!(cache.rope_key(3).len(), 2);
        cache.clear();
        assert!(cache.is_empty());
    }
}
