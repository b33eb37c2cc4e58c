//! The routed mixture-of-experts block shared by the engines: routers that turn router
//! logits into `(expert, gate)` choices per row, and the expert pass that runs every chosen
//! expert once over the rows routed to it and sums the gated outputs.

use anyhow::Result;

use super::layers::{softmax, swiglu_ffn, top_k};
use crate::experts::{Expert, ExpertStore};
use crate::route_trace::RouteTrace;

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

/// The experts with the highest `score + bias`, in descending order of that sum (ties to
/// the lower index). With `n_group > 1`, only experts in the `topk_group` groups whose two
/// best biased scores sum highest are eligible, as DeepSeek-style routers limit them.
pub fn biased_top_k(
    scores: &[f32],
    bias: &[f32],
    k: usize,
    n_group: usize,
    topk_group: usize,
) -> Vec<usize> {
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if n_group > 1 {
        let per_group = choice.len() / n_group;
        let group_scores: Vec<f32> = choice
            .chunks(per_group)
            .map(|group| top_k(group, 2).iter().map(|&(_, s)| s).sum())
            .collect();
        let kept: Vec<usize> = top_k(&group_scores, topk_group)
            .iter()
            .map(|&(g, _)| g)
            .collect();
        for (g, group) in choice.chunks_mut(per_group).enumerate() {
            if !kept.contains(&g) {
                group.fill(f32::NEG_INFINITY);
            }
        }
    }
    top_k(&choice, k).into_iter().map(|(i, _)| i).collect()
}

/// The sigmoid router with a score-correction bias: choose by `sigmoid(logit) + bias`
/// (optionally group-limited), weigh by the unbiased sigmoid, optionally renormalise over
/// the chosen experts, then scale.
pub struct SigmoidRouter {
    pub bias: Vec<f32>,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub normalise: bool,
    pub scale: f32,
}

impl SigmoidRouter {
    pub fn route(&self, logits: &[f32]) -> Route {
        let scores: Vec<f32> = logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
        let ids = biased_top_k(
            &scores,
            &self.bias,
            self.top_k,
            self.n_group,
            self.topk_group,
        );
        let mut route: Route = ids.into_iter().map(|e| (e, scores[e])).collect();
        if self.normalise {
            let sum: f32 = route.iter().map(|&(_, w)| w).sum::<f32>() + 1e-20;
            route.iter_mut().for_each(|(_, w)| *w /= sum);
        }
        route.iter_mut().for_each(|(_, w)| *w *= self.scale);
        route
    }
}

/// The routed half of a MoE model: the expert store and the telemetry its routing feeds.
pub struct RoutedExperts {
    pub store: ExpertStore,
    pub telemetry: RouteTrace,
}

impl RoutedExperts {
    /// See [`run_experts`].
    pub fn run(
        &mut self,
        layer: usize,
        input: &[f32],
        routes: &[Route],
        hidden: usize,
        out: &mut [f32],
    ) -> Result<()> {
        run_experts(
            &mut self.store,
            &mut self.telemetry,
            layer,
            input,
            routes,
            hidden,
            out,
        )
    }

    /// See [`run_experts_with`].
    pub fn run_with(
        &mut self,
        layer: usize,
        input: &[f32],
        routes: &[Route],
        width: usize,
        out: &mut [f32],
        ffn: impl Fn(&Expert, &[f32], usize) -> Vec<f32>,
    ) -> Result<()> {
        run_experts_with(
            &mut self.store,
            &mut self.telemetry,
            layer,
            input,
            routes,
            width,
            out,
            ffn,
        )
    }
}

/// `out[row] = Σ gate · down(silu(gate_proj x) * up_proj x)` over each row's route.
///
/// This is the one place every router loop ends: each row's final choice is reported to
/// `telemetry` (one MoE call, one routing decision per row) before any expert runs.
/// Experts run in ascending id order, each once over all its rows, so a distinct expert is
/// looked up once per call and the sum order matches the reference's expert loop.
pub fn run_experts(
    store: &mut ExpertStore,
    telemetry: &mut RouteTrace,
    layer: usize,
    input: &[f32],
    routes: &[Route],
    hidden: usize,
    out: &mut [f32],
) -> Result<()> {
    run_experts_with(
        store,
        telemetry,
        layer,
        input,
        routes,
        hidden,
        out,
        |weights, batch, n| swiglu_ffn(&weights.gate, &weights.up, &weights.down, batch, n),
    )
}

/// [`run_experts`] with the expert FFN given: `ffn(expert, rows, n)` maps `n` rows of
/// `width` inputs to `n` rows of `width` outputs (a SiTU-GLU expert, or experts working in a
/// latent space narrower than the hidden size, as Kimi K3's).
#[allow(clippy::too_many_arguments)]
pub fn run_experts_with(
    store: &mut ExpertStore,
    telemetry: &mut RouteTrace,
    layer: usize,
    input: &[f32],
    routes: &[Route],
    width: usize,
    out: &mut [f32],
    ffn: impl Fn(&Expert, &[f32], usize) -> Vec<f32>,
) -> Result<()> {
    {
        let mut call = telemetry.moe_call(layer);
        for (row, route) in routes.iter().enumerate() {
            let (ids, gates): (Vec<usize>, Vec<f32>) = route.iter().copied().unzip();
            call.route(row, &ids, &gates);
        }
    }
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
        let mut batch = Vec::with_capacity(n * width);
        for &(row, _) in &rows {
            batch.extend_from_slice(&input[row * width..][..width]);
        }
        let result = store.with_expert(layer, expert, |weights| ffn(weights, &batch, n))?;
        for (&(row, weight), y) in rows.iter().zip(result.chunks_exact(width)) {
            for (o, &v) in out[row * width..][..width].iter_mut().zip(y) {
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
    fn biased_choice_weighs_by_unbiased_scores() {
        let router = SigmoidRouter {
            bias: vec![0.0, 0.0, 1.0, 0.0],
            top_k: 2,
            n_group: 1,
            topk_group: 1,
            normalise: true,
            scale: 2.0,
        };
        // sigmoid(0) = 0.5 for expert 2, but its bias makes it the first choice.
        let route = router.route(&[3.0, 1.0, 0.0, -1.0]);
        assert_eq!(route.iter().map(|r| r.0).collect::<Vec<_>>(), vec![2, 0]);
        let s0 = 1.0 / (1.0 + (-3f32).exp());
        assert!((route[0].1 - 2.0 * 0.5 / (0.5 + s0)).abs() < 1e-6);
        assert!((route[1].1 - 2.0 * s0 / (0.5 + s0)).abs() < 1e-6);
    }

    #[test]
    fn group_limit_excludes_weak_groups() {
        // Groups {0,1} (best two sum 1.0), {2,3} (1.3), {4,5} (0.7); keep two groups.
        let scores = [0.9, 0.1, 0.65, 0.65, 0.6, 0.1];
        let ids = biased_top_k(&scores, &[0.0; 6], 3, 3, 2);
        assert_eq!(ids, vec![0, 2, 3]);
        // Without the limit expert 4 (0.6) would beat nothing in group {0,1} but is excluded.
        assert_eq!(biased_top_k(&scores, &[0.0; 6], 4, 3, 2), vec![0, 2, 3, 1]);
    }

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
