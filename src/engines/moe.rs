//! The routed mixture-of-experts block shared by the engines: each MoE layer's router and
//! its rule for choosing experts, and the one call ([`RoutedExperts::forward`]) that routes
//! a layer's rows, reports them to the telemetry, looks ahead for the layers after it, and
//! runs every chosen expert once over the rows routed to it (on the CPU, or on the GPU for
//! experts in the VRAM tier), summing the gated outputs.
//!
//! An engine says only how its layers choose ([`Choice`]) and what it does around the
//! routed sum (shared experts, a latent projection); it never calls the store itself.

use std::collections::BTreeMap;

use anyhow::Result;
use rayon::prelude::*;

use super::layers::{add_in_place, glu_ffn, softmax, top_k};
use crate::activation::Activation;
use crate::backend::{self, ExpertGroup, GroupExpert};
use crate::experts::tier::ExpertTier;
use crate::experts::{CacheStats, Expert, ExpertStore, ExpertTensors, Residence, StoreOptions};
use crate::profile::{self, Phase};
use crate::quant::{Matrix, Width};
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
#[derive(Clone)]
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

/// How a MoE layer chooses its experts from one row of its router's logits.
pub enum Choice {
    /// Softmax over every expert, the top `top_k`, renormalised over them when `normalise`
    /// (OLMoE).
    Softmax { top_k: usize, normalise: bool },
    /// Sigmoid scores with a score-correction bias (GLM-5.2, Kimi K3).
    Sigmoid(SigmoidRouter),
    /// Inkling's: the router's first `routed` logits score the routed experts, the rest the
    /// shared ones. The top `top_k` routed experts by `sigmoid(logit) + bias` are chosen;
    /// they and every shared expert are weighed by their unbiased sigmoid, normalised over
    /// all of them together, times `scale`.
    Sink {
        routed: usize,
        bias: Vec<f32>,
        top_k: usize,
        scale: f32,
    },
}

impl Choice {
    /// Experts a row routes to.
    fn top_k(&self) -> usize {
        match self {
            Choice::Softmax { top_k, .. } | Choice::Sink { top_k, .. } => *top_k,
            Choice::Sigmoid(router) => router.top_k,
        }
    }

    /// The routed experts of one row of logits, and the weights of the shared experts the
    /// router also scores (none but for [`Choice::Sink`]).
    pub fn choose(&self, logits: &[f32]) -> (Route, Vec<f32>) {
        match self {
            Choice::Softmax { top_k, normalise } => {
                (softmax_top_k(logits, *top_k, *normalise), Vec::new())
            }
            Choice::Sigmoid(router) => (router.route(logits), Vec::new()),
            Choice::Sink {
                routed,
                bias,
                top_k,
                scale,
            } => {
                let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
                let scores: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
                let ids = biased_top_k(&scores[..*routed], bias, *top_k, 1, 1);
                let total: f32 = ids.iter().map(|&e| scores[e]).sum::<f32>()
                    + scores[*routed..].iter().sum::<f32>();
                let weight = |score: f32| score / total * scale;
                let route = ids.into_iter().map(|e| (e, weight(scores[e]))).collect();
                let shared = scores[*routed..].iter().map(|&s| weight(s)).collect();
                (route, shared)
            }
        }
    }
}

/// A MoE layer's router: its weight (f32, one row per expert it scores) and its choice.
pub struct Router {
    pub weight: Matrix,
    pub choice: Choice,
}

impl Router {
    /// The router's logits for `n` rows `h`.
    fn logits(&self, h: &[f32], n: usize) -> Vec<f32> {
        let mut logits = vec![0f32; n * self.weight.rows()];
        self.weight.matmul(h, n, &mut logits);
        logits
    }
}

/// What the experts of one MoE call run on: the router's input itself (`width` = its row
/// width, SwiGLU), or a projection of it (Kimi K3's latent, with its own activation).
#[derive(Clone, Copy)]
pub struct ExpertInput<'a> {
    pub rows: &'a [f32],
    pub width: usize,
    pub activation: Activation,
}

/// One MoE call's result: the gated sum of the routed experts, per row, and the weights the
/// router gives each row's shared experts (empty rows unless the router scores them).
pub struct MoeOutput {
    pub routed: Vec<f32>,
    pub shared_weights: Vec<Vec<f32>>,
}

/// Rows of a forward above which the lookahead stays idle: a prompt's chunk already touches
/// most experts of every layer, and its reads are better spent on demand. A decode batch of
/// up to sixteen sequences (or four checking three drafts each) is below it.
const LOOKAHEAD_ROWS: usize = 16;

/// The routed half of a MoE model: every MoE layer's router, the expert store, the experts
/// resident on a GPU, and the telemetry its routing feeds.
pub struct RoutedExperts {
    pub store: ExpertStore,
    pub tier: ExpertTier,
    pub telemetry: RouteTrace,
    /// Expert lookups the VRAM tier answered.
    pub tier_hits: u64,
    /// By layer: its router, which routes its rows and, applied by the layers before it,
    /// predicts them (`PILOT`); `None` for a dense layer.
    routers: Vec<Option<Router>>,
    /// The experts other processes compute (the expert ranks of an MPI job).
    pub remote: Option<Box<dyn RemoteExperts>>,
}

/// An expert and the `(row, gate)` pairs routed to it in one MoE call.
pub type Assignment = (usize, Vec<(usize, f32)>);

/// Routed experts that other processes hold and compute: the expert ranks of an MPI job.
/// Each MoE call sends one request per process ([`RemoteExperts::send`]) before the local
/// experts run, and collects the answers after ([`RemoteExperts::receive`]); the outputs
/// are ungated, so the caller adds every expert's share in one order wherever it ran.
pub trait RemoteExperts: Send {
    /// Whether expert `expert` of MoE layer `layer` runs elsewhere.
    fn is_remote(&self, layer: usize, expert: usize) -> bool;
    /// Ask for `assignments` (all remote) over `input` (`width` columns a row).
    fn send(
        &mut self,
        layer: usize,
        input: &[f32],
        width: usize,
        activation: Activation,
        assignments: &[&Assignment],
    ) -> Result<()>;
    /// Each assignment's output (its rows times `width`, ungated), in the order sent.
    fn receive(&mut self) -> Result<Vec<Vec<f32>>>;
    /// Pin (`true`) or unpin (`false`) each `(layer, expert, pin)` in the store of the
    /// process that computes it, every process working on its share at once; whether each
    /// expert is pinned afterwards, in the order given.
    fn place(&mut self, changes: &[(usize, usize, bool)]) -> Result<Vec<bool>>;
    /// Start LFRU's frequencies of each `(layer, expert, selections)` where it runs.
    fn seed_heat(&mut self, seeds: &[(usize, usize, u64)]) -> Result<()>;
    /// The experts pinned on other processes, by layer.
    fn pinned(&self) -> Vec<Vec<usize>>;
    /// Pins the other processes had no slot for (see [`ExpertStore::pins_skipped`]).
    fn pins_skipped(&self) -> usize;
    /// The fewest cache slots per layer of the processes holding experts, and whether any
    /// of them streams its experts (so that a pin takes a slot).
    fn slots(&self) -> (usize, bool);
    /// The other processes' store counters, added up.
    fn stats(&self) -> Result<CacheStats>;
}

impl RoutedExperts {
    /// The routed experts of an engine still loading its trunk: `telemetry`, and a store
    /// with no experts until [`RoutedExperts::provision`] sizes it against the trunk.
    pub fn unprovisioned(width: Width, telemetry: RouteTrace) -> RoutedExperts {
        RoutedExperts::new(ExpertStore::new(Vec::new(), 1, width), telemetry)
    }

    /// The store for `experts` that `options` ask for, beside `trunk_bytes` of resident
    /// weights (what [`ExpertStore::provision`] sizes the budget against), with room to
    /// stage what the routers already set predict.
    pub fn provision(
        &mut self,
        experts: Vec<Vec<ExpertTensors>>,
        options: &StoreOptions,
        trunk_bytes: usize,
    ) -> Result<()> {
        self.store = ExpertStore::provision(experts, options, trunk_bytes as u64)?;
        let widest = self
            .routers
            .iter()
            .flatten()
            .map(|r| r.choice.top_k())
            .max();
        self.store
            .set_stage(self.store.ahead_layers() * widest.unwrap_or(0));
        Ok(())
    }

    pub fn new(store: ExpertStore, telemetry: RouteTrace) -> RoutedExperts {
        RoutedExperts {
            store,
            tier: ExpertTier::default(),
            telemetry,
            tier_hits: 0,
            routers: Vec::new(),
            remote: None,
        }
    }

    /// Pin each `(layer, expert)` in the store that computes it (this process's, or an
    /// expert rank's); whether each is pinned afterwards (a streaming store may have no
    /// slot for it).
    pub fn pin(&mut self, experts: &[(usize, usize)]) -> Result<Vec<bool>> {
        self.place(experts, true)
    }

    /// Take each `(layer, expert)` out of the pinned tier of the store that computes it.
    pub fn unpin(&mut self, experts: &[(usize, usize)]) -> Result<()> {
        self.place(experts, false).map(drop)
    }

    fn place(&mut self, experts: &[(usize, usize)], pin: bool) -> Result<Vec<bool>> {
        let remote = self.remote.as_mut();
        let (elsewhere, here): (Vec<usize>, Vec<usize>) = (0..experts.len()).partition(|&i| {
            remote
                .as_ref()
                .is_some_and(|r| r.is_remote(experts[i].0, experts[i].1))
        });
        let mut placed = vec![false; experts.len()];
        if let Some(remote) = remote.filter(|_| !elsewhere.is_empty()) {
            let changes: Vec<_> = elsewhere
                .iter()
                .map(|&i| (experts[i].0, experts[i].1, pin))
                .collect();
            for (i, now) in elsewhere.iter().zip(remote.place(&changes)?) {
                placed[*i] = now;
            }
        }
        for i in here {
            let (layer, expert) = experts[i];
            if pin {
                self.store.pin(layer, expert)?;
            } else {
                self.store.unpin(layer, expert);
            }
            placed[i] = self.store.is_pinned(layer, expert);
        }
        Ok(placed)
    }

    /// The experts pinned in each layer, wherever they are computed.
    pub fn pinned(&self) -> Vec<Vec<usize>> {
        let mut pinned = self.store.pinned();
        if let Some(remote) = &self.remote {
            for (layer, experts) in remote.pinned().into_iter().enumerate() {
                if let Some(mine) = pinned.get_mut(layer) {
                    mine.extend(experts);
                }
            }
        }
        pinned
    }

    /// Where each expert of each layer lives now: the VRAM tier, pinned, a cache slot, or
    /// nowhere (the store's view; experts other processes compute are not resident here).
    pub fn residence(&self) -> Vec<Vec<Residence>> {
        let mut residence = self.store.residence();
        for (layer, experts) in residence.iter_mut().enumerate() {
            for (expert, place) in experts.iter_mut().enumerate() {
                if self.tier.contains(layer, expert) {
                    *place = Residence::Vram;
                }
            }
        }
        residence
    }

    /// Pins a store had no slot for.
    pub fn pins_skipped(&self) -> usize {
        self.store.pins_skipped() + self.remote.as_ref().map_or(0, |r| r.pins_skipped())
    }

    /// Cache slots per MoE layer, and whether experts stream (so a pin takes a slot): of
    /// the expert ranks when other processes compute the experts.
    pub fn slots(&self) -> (usize, bool) {
        match &self.remote {
            Some(remote) => remote.slots(),
            None => (self.store.capacity(), self.store.streams()),
        }
    }

    /// Start LFRU's frequencies from `seeds` (`(layer, expert, selections)`), in the store
    /// that computes each expert.
    pub fn seed_heat(&mut self, seeds: &[(usize, usize, u64)]) -> Result<()> {
        let (elsewhere, here): (Vec<_>, Vec<_>) = seeds.iter().partition(|&&(layer, expert, _)| {
            self.remote
                .as_ref()
                .is_some_and(|r| r.is_remote(layer, expert))
        });
        for (layer, expert, count) in here {
            self.store.seed_heat(layer, expert, count);
        }
        match self.remote.as_mut() {
            Some(remote) if !elsewhere.is_empty() => remote.seed_heat(&elsewhere),
            _ => Ok(()),
        }
    }

    /// The store's counters with the VRAM tier's hits and the expert ranks' counters.
    pub fn stats(&self) -> CacheStats {
        let mut stats = CacheStats {
            vram_hits: self.tier_hits,
            ..self.store.stats()
        };
        if let Some(remote) = &self.remote {
            match remote.stats() {
                Ok(theirs) => stats.add(&theirs),
                Err(err) => {
                    eprintln!("[mpi] the expert ranks' cache counters are not counted: {err:#}")
                }
            }
        }
        stats
    }

    /// MoE layer `layer` routes with `router`; the store gets room to stage what a decode
    /// step predicts (`PILOT` layers of the router's `top_k` experts).
    pub fn set_router(&mut self, layer: usize, router: Router) {
        self.store
            .set_stage(self.store.ahead_layers() * router.choice.top_k());
        if self.routers.len() <= layer {
            self.routers.resize_with(layer + 1, || None);
        }
        self.routers[layer] = Some(router);
    }

    /// Layer `layer` as loaded: where it routes (`router`), the router is set and its
    /// experts (`experts`) are returned for the store; a dense layer has none.
    pub fn add_layer(
        &mut self,
        layer: usize,
        router: Option<Router>,
        experts: impl FnOnce() -> Result<Vec<ExpertTensors>>,
    ) -> Result<Vec<ExpertTensors>> {
        match router {
            Some(router) => {
                self.set_router(layer, router);
                experts()
            }
            None => Ok(Vec::new()),
        }
    }

    /// MoE layer `layer` over `n` rows `h` (its normalised input), the experts running on
    /// `h` itself with SwiGLU. See [`RoutedExperts::forward_on`].
    pub fn forward(&mut self, layer: usize, h: &[f32], n: usize) -> Result<MoeOutput> {
        let input = ExpertInput {
            rows: h,
            width: h.len() / n.max(1),
            activation: Activation::SwiGlu,
        };
        self.forward_on(layer, h, n, input)
    }

    /// MoE layer `layer` over `n` rows `h`: its router chooses each row's experts, the
    /// telemetry hears every row's choice, the lookahead applies the next layers' routers
    /// to `h`, and each chosen expert runs once over `input`'s rows routed to it.
    pub fn forward_on(
        &mut self,
        layer: usize,
        h: &[f32],
        n: usize,
        input: ExpertInput,
    ) -> Result<MoeOutput> {
        let Some(Some(router)) = self.routers.get(layer) else {
            anyhow::bail!("layer {layer} has no router: it is not a MoE layer");
        };
        let logits = router.logits(h, n);
        let (routes, shared_weights): (Vec<Route>, Vec<Vec<f32>>) = logits
            .chunks_exact(router.weight.rows())
            .map(|row| router.choice.choose(row))
            .unzip();
        self.look_ahead(layer, h, n, &routes);
        let mut routed = vec![0f32; n * input.width];
        self.run(layer, &input, &routes, &mut routed)?;
        Ok(MoeOutput {
            routed,
            shared_weights,
        })
    }

    /// The read-ahead, called by MoE layer `layer` with its router input `h` (`n` rows) and
    /// the routes its router chose: the router lookahead (`PILOT=N`) applies the routers of
    /// layers `layer+1..=layer+N` to `h`; the transitions (`TRANSITIONS=1`) name, for each
    /// row, the experts of the next routing layer that most often followed its choice. The
    /// store reads what they predict ahead, behind this layer's own misses. It changes only
    /// what is resident, never a routing decision, so never a token.
    pub fn look_ahead(&mut self, layer: usize, h: &[f32], n: usize, routes: &[Route]) {
        let depth = self.store.pilot();
        let transitions = self.store.transitions_ahead();
        if (depth == 0 && !transitions) || n == 0 || n > LOOKAHEAD_ROWS {
            return;
        }
        let mut wanted: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        if transitions {
            let counts = self.telemetry.counts();
            let next = counts.next_routing(layer);
            let k = next
                .and_then(|l| self.routers.get(l))
                .and_then(Option::as_ref)
                .map_or(0, |r| r.choice.top_k());
            for route in routes {
                let chosen: Vec<usize> = route.iter().map(|&(e, _)| e).collect();
                let predicted = counts
                    .transitions()
                    .predict(counts.n_experts(), layer, &chosen, k);
                if let Some((target, ids)) = predicted {
                    wanted.entry(target).or_default().extend(ids);
                }
            }
        }
        for target in layer + 1..=layer + depth {
            let Some(Some(router)) = self.routers.get(target) else {
                continue;
            };
            if h.len() != n * router.weight.cols() {
                continue;
            }
            let logits = router.logits(h, n);
            let ids = logits
                .chunks_exact(router.weight.rows())
                .flat_map(|row| router.choice.choose(row).0)
                .map(|(expert, _)| expert);
            wanted.entry(target).or_default().extend(ids);
        }
        for (target, mut ids) in wanted {
            ids.sort_unstable();
            ids.dedup();
            // Experts on the GPU are never read from disk, nor are those other processes
            // compute.
            let remote = self.remote.as_ref();
            ids.retain(|&e| {
                !self.tier.contains(target, e) && !remote.is_some_and(|r| r.is_remote(target, e))
            });
            self.store.want_ahead(target, ids);
        }
    }

    /// `out[row] = sum of gate * down(act(gate_proj x, up_proj x))` over each row's route,
    /// for experts that map `width` inputs to `width` outputs (the hidden size, or a latent
    /// space narrower than it, as Kimi K3's).
    ///
    /// This is the one place every router loop ends: each row's final choice is reported to
    /// the telemetry (one MoE call, one routing decision per row) before any expert runs.
    /// Each distinct expert runs once over all its rows. Experts resident in the VRAM tier
    /// run as one device group while the CPU runs the others, each from the store in
    /// ascending id order (the reference's expert loop); the two partial sums are added at
    /// the end. Without a tier the sum order is exactly the reference's.
    fn run(
        &mut self,
        layer: usize,
        input: &ExpertInput,
        routes: &[Route],
        out: &mut [f32],
    ) -> Result<()> {
        let ExpertInput {
            rows: input,
            width,
            activation,
        } = *input;
        {
            let mut call = self.telemetry.moe_call(layer);
            for (row, route) in routes.iter().enumerate() {
                let (ids, gates): (Vec<usize>, Vec<f32>) = route.iter().copied().unzip();
                call.route(row, &ids, &gates);
            }
        }
        let mut experts: Vec<usize> = routes.iter().flatten().map(|&(e, _)| e).collect();
        experts.sort_unstable();
        experts.dedup();
        let assignments: Vec<Assignment> = experts
            .into_iter()
            .map(|expert| (expert, rows_of(routes, expert)))
            .collect();
        out.fill(0.0);
        if let Some(remote) = self.remote.as_mut() {
            // An MPI job's trunk: the tier is this process's, the rest is split by owner.
            let (elsewhere, here): (Vec<_>, Vec<_>) = assignments
                .iter()
                .partition(|(expert, _)| remote.is_remote(layer, *expert));
            if !elsewhere.is_empty() {
                return run_spread(
                    &mut self.store,
                    remote.as_mut(),
                    layer,
                    input,
                    (&here, &elsewhere),
                    width,
                    activation,
                    out,
                );
            }
        }
        let device = backend::active().filter(|_| !self.tier.is_empty());
        let (resident, host): (Vec<_>, Vec<_>) = assignments
            .iter()
            .partition(|(expert, _)| device.is_some() && self.tier.contains(layer, *expert));

        let store = &mut self.store;
        let Some(device) = device.filter(|_| !resident.is_empty()) else {
            return run_on_host(store, layer, input, &host, width, activation, out);
        };
        let group: Vec<GroupExpert<'_>> = resident
            .iter()
            .filter_map(|(expert, rows)| {
                let (gate, up, down) = self.tier.get(layer, *expert)?.ids();
                Some(GroupExpert {
                    gate,
                    up,
                    down,
                    rows,
                })
            })
            .collect();
        let group = ExpertGroup {
            experts: &group,
            input,
            rows: routes.len(),
            width,
            activation,
        };
        let mut on_device = vec![0f32; out.len()];
        let (device_result, host_result) = rayon::join(
            || device.expert_group(&group, &mut on_device),
            || run_on_host(store, layer, input, &host, width, activation, out),
        );
        host_result?;
        match device_result {
            Ok(()) => {
                self.tier_hits += resident.len() as u64;
                add_in_place(out, &on_device);
                Ok(())
            }
            Err(error) => {
                backend::fell_back(error);
                let mut recomputed = vec![0f32; out.len()];
                run_on_host(
                    store,
                    layer,
                    input,
                    &resident,
                    width,
                    activation,
                    &mut recomputed,
                )?;
                add_in_place(out, &recomputed);
                Ok(())
            }
        }
    }
}

/// `(row, gate)` for every row of `routes` that names `expert`.
fn rows_of(routes: &[Route], expert: usize) -> Vec<(usize, f32)> {
    routes
        .iter()
        .enumerate()
        .filter_map(|(row, route)| {
            route
                .iter()
                .find(|&&(e, _)| e == expert)
                .map(|&(_, gate)| (row, gate))
        })
        .collect()
}

/// The experts of an MPI job's trunk: the remote ones asked for first, then the local ones
/// computed from the store while the other ranks compute theirs, then every expert's gated
/// output added in ascending id order, as one process adds them. (The VRAM tier is not
/// used for these calls.)
#[allow(clippy::too_many_arguments)]
fn run_spread(
    store: &mut ExpertStore,
    remote: &mut dyn RemoteExperts,
    layer: usize,
    input: &[f32],
    (here, elsewhere): (&[&Assignment], &[&Assignment]),
    width: usize,
    activation: Activation,
    out: &mut [f32],
) -> Result<()> {
    remote.send(layer, input, width, activation, elsewhere)?;
    let local = host_outputs(store, layer, input, here, width, activation)?;
    let answers = remote.receive()?;
    let mut all: Vec<(&Assignment, Vec<f32>)> = here
        .iter()
        .copied()
        .zip(local)
        .chain(elsewhere.iter().copied().zip(answers))
        .collect();
    all.sort_by_key(|(assignment, _)| assignment.0);
    for (assignment, result) in &all {
        accumulate(out, width, &assignment.1, result);
    }
    Ok(())
}

/// Add `result` (one output row of `width` per routed row) times each row's gate to `out`.
fn accumulate(out: &mut [f32], width: usize, rows: &[(usize, f32)], result: &[f32]) {
    for (&(row, weight), y) in rows.iter().zip(result.chunks_exact(width)) {
        for (o, &v) in out[row * width..][..width].iter_mut().zip(y) {
            *o += v * weight;
        }
    }
}

/// Add each expert's gated output over its rows to `out`, in the order given, with the
/// experts taken from (and cached by) the CPU store.
fn run_on_host(
    store: &mut ExpertStore,
    layer: usize,
    input: &[f32],
    assignments: &[&Assignment],
    width: usize,
    activation: Activation,
    out: &mut [f32],
) -> Result<()> {
    let results = host_outputs(store, layer, input, assignments, width, activation)?;
    for ((_, rows), result) in assignments.iter().map(|a| (a.0, &a.1)).zip(results) {
        accumulate(out, width, rows, &result);
    }
    Ok(())
}

/// Each expert's output over its rows (ungated), in the order given, with the experts
/// taken from (and cached by) the CPU store. When the layer's slots hold them all at once
/// the experts run side by side on the thread pool (one wait for the layer rather than one
/// per product); each output is the same either way.
pub fn host_outputs(
    store: &mut ExpertStore,
    layer: usize,
    input: &[f32],
    assignments: &[&Assignment],
    width: usize,
    activation: Activation,
) -> Result<Vec<Vec<f32>>> {
    let batches: Vec<Vec<f32>> = assignments
        .iter()
        .map(|(_, rows)| {
            rows.iter()
                .flat_map(|&(row, _)| &input[row * width..][..width])
                .copied()
                .collect()
        })
        .collect();
    let ffn = |weights: &Expert, batch: &[f32]| {
        glu_ffn(
            &weights.gate,
            &weights.up,
            &weights.down,
            batch,
            batch.len() / width,
            |g, u| activation.apply(g, u),
        )
    };
    let ids: Vec<usize> = assignments.iter().map(|(expert, _)| *expert).collect();
    let together = store.with_experts(layer, &ids, |weights| {
        profile::time(Phase::ExpertMatmul, || {
            weights
                .par_iter()
                .zip(&batches)
                .map(|(weights, batch)| ffn(weights, batch))
                .collect::<Vec<_>>()
        })
    })?;
    if let Some(results) = together {
        return Ok(results);
    }
    // More experts than slots (a batch of many sequences): those already resident go
    // first, so that the misses replace slots this call no longer needs instead of the
    // ones it is about to use. Each result keeps its place, so the sums are unchanged.
    let (mut order, missing): (Vec<usize>, Vec<usize>) =
        (0..ids.len()).partition(|&i| store.is_resident(layer, ids[i]));
    order.extend(missing);
    let mut results: Vec<Option<Vec<f32>>> = vec![None; ids.len()];
    for i in order {
        results[i] = Some(store.with_expert(layer, ids[i], |w| {
            profile::time(Phase::ExpertMatmul, || ffn(w, &batches[i]))
        })?);
    }
    store.finish_layer(layer)?;
    Ok(results.into_iter().flatten().collect())
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
    fn shared_experts_share_the_normalisation() {
        // Routed logits 2, 0, -1 with bias favouring expert 2; one shared expert at logit 1.
        let logits = [2.0f32, 0.0, -1.0, 1.0];
        let sink = Choice::Sink {
            routed: 3,
            bias: vec![0.0, 0.0, 0.5],
            top_k: 2,
            scale: 3.0,
        };
        let (route, shared) = sink.choose(&logits);
        let s = |x: f32| 1.0 / (1.0 + (-x).exp());
        let total = s(2.0) + s(-1.0) + s(1.0);
        assert_eq!(route.iter().map(|r| r.0).collect::<Vec<_>>(), vec![0, 2]);
        assert!((route[0].1 - 3.0 * s(2.0) / total).abs() < 1e-6);
        assert!((route[1].1 - 3.0 * s(-1.0) / total).abs() < 1e-6);
        assert!((shared[0] - 3.0 * s(1.0) / total).abs() < 1e-6);
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
