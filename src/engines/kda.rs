//! Kimi Delta Attention (KDA): a linear-attention layer whose per-head state `S [d_k, d_v]`
//! decays per key channel and is corrected by a delta rule, as Kimi K3 (and transformers'
//! `kimi_linear` / `glm5_next` KDA layers) compute it.
//!
//! For `n` normalised rows `x` of one layer:
//! 1. `q, k, v = W{q,k,v} x`, each through its own short causal depthwise convolution (state
//!    carried across forwards) and SiLU; `g_out = W_g x` (the full-rank output gate);
//!    `z = W_fb (W_fa x) + dt_bias`; `beta = sigmoid(W_b x)`, one per head.
//! 2. The decay is the lower-bounded gate `g = lb * sigmoid(exp(A_log[head]) * z)`, so each
//!    channel keeps `alpha = exp(g)` in `(e^lb, 1)` of its state row per token.
//! 3. Token by token, per head ([`delta_rule`]): `q` and `k` are L2-normalised (`+1e-6` inside
//!    the root, `q` then scaled by `d^-1/2`), then `S = diag(alpha) S`, `S += k (beta (v - k^T S))^T`
//!    and the output is `q^T S`, read after the write.
//! 4. Each head's output goes through the sigmoid-gated RMSNorm with `g_out`, then `o_proj`.
//!
//! The projections and convolutions are batched over the rows; only the recurrence is
//! sequential, so a prefill in chunks and one token at a time compute the same thing.
//!
//! The checkpoint stores `A_log` with more entries than heads (Kimi K3: 128 for 96 heads). The
//! vendor code reads `A_log[:heads]` as one decay rate per head; that reading is only safe when
//! the remaining entries are exactly zero padding, so loading checks it.

use std::io::{self, Read, Write};

use anyhow::{bail, Result};
use rayon::prelude::*;

use super::gated_norm::rms_norm_sigmoid_gated;
use super::short_conv::{ConvState, ShortConv};
use super::state::{per_sequence, Rows};
use super::state_io::{self, part};
use super::weights::Weights;
use crate::activation::silu;
use crate::quant::Matrix;

/// The sizes of one KDA layer.
#[derive(Debug, Clone, Copy)]
pub struct KdaShape {
    pub heads: usize,
    pub head_dim: usize,
    pub kernel: usize,
    /// `gate_lower_bound`: the log decay per token lies in `(lower_bound, 0)`.
    pub lower_bound: f32,
    /// Epsilon of the output's gated RMSNorm.
    pub eps: f64,
}

impl KdaShape {
    /// Width of the q, k, v and gate projections.
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }
}

/// What a KDA layer remembers between forwards: the per-head state and the inputs the three
/// convolutions still need.
#[derive(Clone)]
pub struct KdaState {
    recurrent: Vec<f32>,
    q_conv: ConvState,
    k_conv: ConvState,
    v_conv: ConvState,
}

impl KdaState {
    /// Back to the start of a sequence.
    pub fn clear(&mut self) {
        self.recurrent.fill(0.0);
        self.q_conv.clear();
        self.k_conv.clear();
        self.v_conv.clear();
    }

    pub fn size_bytes(&self) -> usize {
        4 * self.recurrent.len()
            + self.q_conv.size_bytes()
            + self.k_conv.size_bytes()
            + self.v_conv.size_bytes()
    }

    /// Writes the per-head state, then the q, k and v convolutions' inputs ([`state_io`]).
    pub fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_f32s(out, &self.recurrent)?;
        for conv in [&self.q_conv, &self.k_conv, &self.v_conv] {
            conv.save(out)?;
        }
        Ok(())
    }

    /// Reads what [`KdaState::save`] wrote, refused unless every part has this layer's size
    /// (`heads x head_dim x head_dim` for the recurrent state).
    pub fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let len = self.recurrent.len();
        self.recurrent = state_io::read_f32s_exact(input, len, "the recurrent state")?;
        part("q convolution", self.q_conv.restore(input))?;
        part("k convolution", self.k_conv.restore(input))?;
        part("v convolution", self.v_conv.restore(input))
    }
}

/// The weights of one KDA layer (`{prefix}.{q,k,v,g,o,b,f_a,f_b}_proj.weight`,
/// `{prefix}.{q,k,v}_conv1d.weight`, `{prefix}.{dt_bias,A_log}`, `{prefix}.o_norm.weight`).
pub struct Kda {
    shape: KdaShape,
    q: Matrix,
    k: Matrix,
    v: Matrix,
    g: Matrix,
    o: Matrix,
    b: Matrix,
    f_a: Matrix,
    f_b: Matrix,
    q_conv: ShortConv,
    k_conv: ShortConv,
    v_conv: ShortConv,
    dt_bias: Vec<f32>,
    /// `exp(A_log[head])`.
    decay_rate: Vec<f32>,
    o_norm: Vec<f32>,
}

impl Kda {
    /// The KDA layer under `w` (a layer's `self_attn`).
    pub fn load(w: &Weights, hidden: usize, shape: KdaShape) -> Result<Kda> {
        let (p, d, h) = (shape.width(), shape.head_dim, shape.heads);
        let matrix = |name: &str, rows: usize, cols: usize| {
            w.matrix(&format!("{name}.weight"), [rows, cols])
        };
        let kept = |name: &str, rows: usize, cols: usize| {
            w.matrix_f32(&format!("{name}.weight"), [rows, cols])
        };
        let conv =
            |name: &str| ShortConv::load(w, &format!("{name}_conv1d.weight"), p, shape.kernel);
        Ok(Kda {
            q: matrix("q_proj", p, hidden)?,
            k: matrix("k_proj", p, hidden)?,
            v: matrix("v_proj", p, hidden)?,
            g: matrix("g_proj", p, hidden)?,
            o: matrix("o_proj", hidden, p)?,
            // The gate's low-rank factors and beta are small and steer every decay: kept f32.
            b: kept("b_proj", h, hidden)?,
            f_a: kept("f_a_proj", d, hidden)?,
            f_b: kept("f_b_proj", p, d)?,
            q_conv: conv("q")?,
            k_conv: conv("k")?,
            v_conv: conv("v")?,
            dt_bias: w.vector("dt_bias", p)?,
            decay_rate: per_head_a_log(w, "A_log", h)?
                .iter()
                .map(|a| a.exp())
                .collect(),
            o_norm: w.vector("o_norm.weight", d)?,
            shape,
        })
    }

    /// A zero state, as at the start of a sequence.
    pub fn state(&self) -> KdaState {
        let d = self.shape.head_dim;
        KdaState {
            recurrent: vec![0.0; self.shape.heads * d * d],
            q_conv: self.q_conv.state(),
            k_conv: self.k_conv.state(),
            v_conv: self.v_conv.state(),
        }
    }

    /// The layer's output (`n x hidden`) for the normalised rows `x` of a batch, each
    /// sequence continuing its own state in `states`: the projections once over every row,
    /// the convolutions and the recurrence per sequence.
    pub fn forward(&self, x: &[f32], rows: &Rows, states: &mut [&mut KdaState]) -> Vec<f32> {
        let n = rows.len();
        let KdaShape {
            heads,
            head_dim: d,
            lower_bound,
            eps,
            ..
        } = self.shape;
        let p = self.shape.width();
        let project = |m: &Matrix| {
            let mut out = vec![0f32; n * m.rows()];
            m.matmul(x, n, &mut out);
            out
        };
        let (q, k, v) = (project(&self.q), project(&self.k), project(&self.v));
        let gate_out = project(&self.g);
        let beta: Vec<f32> = project(&self.b)
            .iter()
            .map(|&b| 1.0 / (1.0 + (-b).exp()))
            .collect();
        let mut z = vec![0f32; n * p];
        self.f_b.matmul(&project(&self.f_a), n, &mut z);
        // g = lb * sigmoid(exp(A_log[head]) * (z + dt_bias)), the log decay of each channel.
        for row in z.chunks_exact_mut(p) {
            for (c, g) in row.iter_mut().enumerate() {
                let scaled = self.decay_rate[c / d] * (*g + self.dt_bias[c]);
                *g = lower_bound * (1.0 / (1.0 + (-scaled).exp()));
            }
        }
        let mut core = vec![0f32; n * p];
        per_sequence(rows, states, &mut core, p, |segment, state, core| {
            let m = segment.len();
            let convolved = |input: &[f32], conv: &ShortConv, conv_state: &mut ConvState| {
                let mut y = conv.forward(segment.of(input, p), m, conv_state);
                y.iter_mut().for_each(|v| *v = silu(*v));
                y
            };
            let q = convolved(&q, &self.q_conv, &mut state.q_conv);
            let k = convolved(&k, &self.k_conv, &mut state.k_conv);
            let v = convolved(&v, &self.v_conv, &mut state.v_conv);
            let (z, beta) = (segment.of(&z, p), segment.of(&beta, heads));
            for t in 0..m {
                let at = |v: &[f32]| v[t * p..][..p].to_vec();
                delta_rule(
                    heads,
                    d,
                    &at(&q),
                    &at(&k),
                    &at(&v),
                    &at(z),
                    &beta[t * heads..][..heads],
                    &mut state.recurrent,
                    &mut core[t * p..][..p],
                );
            }
        });
        let mut normed = vec![0f32; n * p];
        rms_norm_sigmoid_gated(&core, &self.o_norm, &gate_out, eps, &mut normed);
        let mut out = vec![0f32; n * self.o.rows()];
        self.o.matmul(&normed, n, &mut out);
        out
    }
}

/// One token of the delta rule for every head, as transformers'
/// `recurrent_kimi_delta_attention` with the qk L2 norm inside: `q`, `k`, `v` and the log
/// decay `g` are `heads x dim`, `beta` one per head, `state` is `heads x dim_k x dim_v`; the
/// output `out` (`heads x dim`) is read from the state after this token's write.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    heads: usize,
    dim: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let scale = 1.0 / (dim as f32).sqrt();
    let l2 = |x: &[f32]| -> Vec<f32> {
        let norm = (x.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
        x.iter().map(|a| a / norm).collect()
    };
    state
        .par_chunks_mut(dim * dim)
        .zip(out.par_chunks_mut(dim))
        .enumerate()
        .take(heads)
        .for_each(|(h, (s, o))| {
            let range = h * dim..(h + 1) * dim;
            let k = l2(&k[range.clone()]);
            let q: Vec<f32> = l2(&q[range.clone()]).iter().map(|a| a * scale).collect();
            let (v, g) = (&v[range.clone()], &g[range]);
            for (row, &gi) in s.chunks_exact_mut(dim).zip(g) {
                let alpha = gi.exp();
                row.iter_mut().for_each(|x| *x *= alpha);
            }
            // u = k^T S, then S += k (beta (v - u))^T.
            let mut delta = vec![0f32; dim];
            for (i, row) in s.chunks_exact(dim).enumerate() {
                for (u, &x) in delta.iter_mut().zip(row) {
                    *u += x * k[i];
                }
            }
            for (u, &x) in delta.iter_mut().zip(v) {
                *u = (x - *u) * beta[h];
            }
            for (row, &ki) in s.chunks_exact_mut(dim).zip(&k) {
                for (x, &u) in row.iter_mut().zip(&delta) {
                    *x += ki * u;
                }
            }
            o.fill(0.0);
            for (row, &qi) in s.chunks_exact(dim).zip(&q) {
                for (y, &x) in o.iter_mut().zip(row) {
                    *y += x * qi;
                }
            }
        });
}

/// `A_log` as one value per head: its first `heads` entries. Any further entries are the
/// checkpoint's padding and must be zero; anything else means the tensor is not per head.
fn per_head_a_log(w: &Weights, name: &str, heads: usize) -> Result<Vec<f32>> {
    let values = w.flat_any(name)?;
    let view = w.snapshot().tensor(&w.name(name))?;
    let (len, name) = (values.len(), &view.name);
    if len < heads {
        bail!(
            "{}: tensor {name} has {len} entries ({:?}); expected at least one per KDA head ({heads})",
            view.file.display(),
            view.shape
        );
    }
    if let Some(i) = values[heads..].iter().position(|&a| a != 0.0) {
        bail!(
            "{}: tensor {name} has {len} entries for {heads} KDA heads and entry {} is {} rather than zero padding; coli reads A_log as one decay rate per head and cannot tell what a per-channel value means",
            view.file.display(),
            heads + i,
            values[heads + i]
        );
    }
    Ok(values[..heads].to_vec())
}
