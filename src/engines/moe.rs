//! The routed mixture-of-experts block shared by the engines: routers that turn router
//! logits into `(expert, gate)` choices per row, and the expert pass that runs every chosen
//! expert once over the rows routed to it and sums the gated outputs.

use anyhow::Result;

use super::layers::{softmax, swiglu, top_k};
use crate::experts::ExpertStore;

/// The experts one row of the batch routes to, with the gates the layer applies.
pub type Route = Vec<(usize, f32)>;

/// Softmax over all experts, top `k`, optionally renormalised over the chosen `k`.
pub fn softmax_top_k(logits: &[f32], k: usize, normalise: bool) -> Route {
    let mut probs = logits.to_vec();
    softmax(&mut probs);
    let mut route = top_k(&probs, k);
    if normalise {
        let sum: f32 = route.iter().map(|&(_, p)| p).sum();
        for (_, p) in route.iter_mut() {
            *p /= sum;
        }
    }
    route
}

/// `out[row] = Σ gate · down(silu(gate_proj x) * up_proj x)` over each row's route.
/// Experts run in ascending id order, each once over all its rows, so a distinct expert is
/// looked up once per call and the sum order matches the reference's expert loop.
pub fn run_experts(
    store: &mut ExpertStore,
    layer: usize,
    input: &[f32],
    routes: &[Route],
    hidden: usize,
    out: &mut [f32],
) -> Result<()> {
    out.fill(0.0);
    let mut experts: Vec<usize> = routes.iter().flatten().map(|&(e, _)| e).collect();
    experts.sort_unstable();
    experts.dedup();
    for expert in experts {
        let rows: Vec<(usize, f32)> = routes
            .iter()
            .enumerate()
            .filter_map(|(row, route)| {
                route
                    .iter()
                    .find(|&&(e, _)| e == expert)
                    .map(|&(_, gate)| (row, gate))
            })
            .collect();
        let n = rows.len();
        let mut batch = Vec::with_capacity(n * hidden);
        for &(row, _) in &rows {
            batch.extend_from_slice(&input[row * hidden..][..hidden]);
        }
        let result = store.with_expert(layer, expert, |weights| {
            let inter = weights.gate.rows();
            let mut gate = vec![0f32; n * inter];
            let mut up = vec![0f32; n * inter];
            weights.gate.matmul(&batch, n, &mut gate);
            weights.up.matmul(&batch, n, &mut up);
            swiglu(&mut gate, &up);
            let mut down = vec![0f32; n * hidden];
            weights.down.matmul(&gate, n, &mut down);
            down
        })?;
        for (&(row, weight), y) in rows.iter().zip(result.chunks_exact(hidden)) {
            for (o, &v) in out[row * hidden..][..hidden].iter_mut().zip(y) {
                *o += v * weight;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_top_k_renormalises_only_when_asked() {
        let logits = [0.0f32, 2f32.ln(), 3f32.ln(), 0.0];
        // probabilities 1/7, 2/7, 3/7, 1/7
        let raw = softmax_top_k(&logits, 2, false);
        assert_eq!(raw.iter().map(|r| r.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!((raw[0].1 - 3.0 / 7.0).abs() < 1e-6 && (raw[1].1 - 2.0 / 7.0).abs() < 1e-6);
        let normalised = softmax_top_k(&logits, 2, true);
        assert!((normalised[0].1 - 0.6).abs() < 1e-6 && (normalised[1].1 - 0.4).abs() < 1e-6);
    }
}
