//! GLM-5.2 (`GlmMoeDsaForCausalLM`, model_type `glm_moe_dsa`): multi-head latent attention
//! with interleaved RoPE and a compressed KV cache ([`super::mla`]), the DSA lightning
//! indexer choosing the keys each query reads ([`super::dsa`]; "shared" layers reuse the
//! choice of the last "full" layer), dense SwiGLU MLPs in the first layers, then a sigmoid
//! router with a score-correction bias (optionally group-limited) over SwiGLU experts plus a
//! shared expert.
//!
//! When the checkpoint carries the multi-token-prediction layer (index
//! `num_hidden_layers`, which transformers does not run), it drafts tokens for speculative
//! decoding: `eh_proj [enorm(embed(next)); hnorm(h)]` through one more MLA + MoE layer with
//! its own latent cache, then `shared_head.norm` and the main LM head.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use serde::Deserialize;

use super::dsa::{IndexKeys, Indexer, IndexerShape};
use super::layers::{
    add_in_place, embed_tokens, final_norm, lm_head, pre_norm_residual, rms_norm, GatedMlp, Rope,
    Sublayer,
};
use super::mla::{
    attend_absorbed, attend_plain, Keys, LatentCache, MlaProjections, MlaShape, Projected,
};
use super::moe::{Predictor, Route, RoutedExperts, SigmoidRouter};
use super::{Engine, LoadOptions};
use crate::activation::Activation;
use crate::experts::ExpertTensors;
use crate::generate::argmax;
use crate::interrupt;
use crate::quant::{load_vector, Matrix, Width};
use crate::route_trace::RouteTrace;
use crate::snapshot::Snapshot;
use crate::text::PromptConvention;

pub const NAME: &str = "glm_moe_dsa";

/// Name fragments of the tensors this engine reads only in f32, beyond what every engine
/// keeps (vectors, norms, routers, biases): the DSA indexer's head weights, which weigh
/// the scores its top-k selection compares, and the router's score correction.
pub const KEPT_F32: &[&str] = &["weights_proj.weight", "e_score_correction"];

/// GLM prompts start with `[gMASK]<sop>`; every special token (`<|user|>`, `<|endoftext|>`,
/// ...) ends an answer.
const PROMPT: PromptConvention = PromptConvention {
    bos: false,
    prefix: &["[gMASK]", "<sop>"],
    chat_template: Some(CHAT_TEMPLATE),
    stop_on_special: true,
};

/// GLM's chat prompt as colibri's server writes it: the prefix, `<|role|>` and the text of
/// each turn, then `<|assistant|>` with an empty thinking block (thinking off).
const CHAT_TEMPLATE: &str = concat!(
    "[gMASK]<sop>",
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}{% endfor %}",
    "{% if add_generation_prompt %}<|assistant|><think></think>{% endif %}",
);

/// transformers builds `q_a_layernorm` and `kv_a_layernorm` with its RMSNorm default
/// epsilon, not `rms_norm_eps`.
const LORA_NORM_EPS: f64 = 1e-6;

/// The keys of `config.json` this engine reads. A missing key takes `GlmMoeDsaConfig`'s
/// default (GLM-5's value), as transformers would.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub n_shared_experts: usize,
    pub n_routed_experts: usize,
    pub routed_scaling_factor: f32,
    pub kv_lora_rank: usize,
    pub q_lora_rank: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub qk_nope_head_dim: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub hidden_act: String,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub rope_parameters: Option<RopeParameters>,
    /// The pre-transformers-5 spelling of `rope_parameters.rope_theta`.
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    pub first_k_dense_replace: usize,
    pub mlp_layer_types: Option<Vec<String>>,
    pub index_topk: usize,
    pub index_head_dim: usize,
    pub index_n_heads: usize,
    pub indexer_types: Option<Vec<String>>,
    pub index_topk_pattern: Option<serde_json::Value>,
    pub index_topk_freq: usize,
    pub index_skip_topk_offset: usize,
}

/// transformers' `GlmMoeDsaConfig` default `eos_token_id`, for a `config.json` without one.
const DEFAULT_EOS: &[u32] = &[1];

impl Default for Config {
    fn default() -> Config {
        Config {
            vocab_size: 154_880,
            hidden_size: 6144,
            intermediate_size: 12288,
            moe_intermediate_size: 2048,
            num_hidden_layers: 78,
            num_attention_heads: 64,
            num_key_value_heads: None,
            n_shared_experts: 1,
            n_routed_experts: 256,
            routed_scaling_factor: 2.5,
            kv_lora_rank: 512,
            q_lora_rank: 2048,
            qk_rope_head_dim: 64,
            v_head_dim: 256,
            qk_nope_head_dim: 192,
            n_group: 1,
            topk_group: 1,
            num_experts_per_tok: 8,
            norm_topk_prob: true,
            hidden_act: "silu".to_string(),
            rms_norm_eps: 1e-5,
            tie_word_embeddings: false,
            attention_bias: false,
            rope_parameters: None,
            rope_theta: None,
            rope_scaling: None,
            first_k_dense_replace: 3,
            mlp_layer_types: None,
            index_topk: 2048,
            index_head_dim: 128,
            index_n_heads: 32,
            indexer_types: None,
            index_topk_pattern: None,
            index_topk_freq: 1,
            index_skip_topk_offset: 2,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
}

impl Config {
    fn mla_shape(&self) -> MlaShape {
        MlaShape::new(
            self.num_attention_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        )
    }

    /// `rope_parameters.rope_theta`, else the legacy top-level `rope_theta`, else 10000.
    fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10000.0)
    }

    /// Per layer: whether its MLP is the routed MoE (`mlp_layer_types`, else every layer
    /// from `first_k_dense_replace` on).
    fn sparse_layers(&self) -> Result<Vec<bool>> {
        let n = self.num_hidden_layers;
        match &self.mlp_layer_types {
            Some(types) => {
                if types.len() != n {
                    bail!("config.json: mlp_layer_types has {} entries, expected num_hidden_layers = {n}", types.len());
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sparse" => Ok(true),
                        "dense" => Ok(false),
                        other => bail!("config.json: mlp_layer_types entry {other:?} is neither \"dense\" nor \"sparse\""),
                    })
                    .collect()
            }
            None => Ok((0..n).map(|l| l >= self.first_k_dense_replace).collect()),
        }
    }

    /// Per layer: whether it runs its own indexer ("full") or reuses the last full layer's
    /// selection ("shared"): `indexer_types`, else `index_topk_pattern` (`F`/`S` per layer),
    /// else `full` iff `max(0, i - index_skip_topk_offset + 1) % index_topk_freq == 0`.
    fn full_indexer_layers(&self) -> Result<Vec<bool>> {
        let n = self.num_hidden_layers;
        let from_names = |names: Vec<String>, key: &str| -> Result<Vec<bool>> {
            if names.len() != n {
                bail!(
                    "config.json: {key} has {} entries, expected num_hidden_layers = {n}",
                    names.len()
                );
            }
            names
                .iter()
                .map(|t| match t.as_str() {
                    "full" => Ok(true),
                    "shared" => Ok(false),
                    other => bail!(
                        "config.json: {key} entry {other:?} is neither \"full\" nor \"shared\""
                    ),
                })
                .collect()
        };
        if let Some(types) = &self.indexer_types {
            return from_names(types.clone(), "indexer_types");
        }
        match &self.index_topk_pattern {
            None | Some(serde_json::Value::Null) => {}
            Some(serde_json::Value::String(pattern)) => {
                let names = pattern
                    .chars()
                    .map(|c| match c {
                        'F' => Ok("full".to_string()),
                        'S' => Ok("shared".to_string()),
                        other => bail!(
                            "config.json: index_topk_pattern has {other:?}; expected only F and S"
                        ),
                    })
                    .collect::<Result<Vec<_>>>()?;
                return from_names(names, "index_topk_pattern");
            }
            Some(other) => {
                let names: Vec<String> = serde_json::from_value(other.clone()).map_err(|_| {
                    anyhow!("config.json: index_topk_pattern must be a string of F/S or a list of \"full\"/\"shared\"")
                })?;
                return from_names(names, "index_topk_pattern");
            }
        }
        let freq = self.index_topk_freq.max(1);
        let offset = self.index_skip_topk_offset;
        Ok((0..n)
            .map(|i| (i + 1).saturating_sub(offset) % freq == 0)
            .collect())
    }

    fn validate(&self) -> Result<()> {
        let heads = self.num_attention_heads;
        if heads == 0 || self.num_hidden_layers == 0 || self.hidden_size == 0 {
            bail!("config.json: hidden_size, num_hidden_layers and num_attention_heads must be positive");
        }
        if let Some(kv_heads) = self.num_key_value_heads {
            if kv_heads != heads {
                bail!("config.json: num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads}): MLA decompresses one key and value per head");
            }
        }
        let (experts, groups) = (self.n_routed_experts, self.n_group);
        if groups == 0 || experts == 0 || !experts.is_multiple_of(groups) {
            bail!("config.json: n_routed_experts ({experts}) must be a positive multiple of n_group ({groups})");
        }
        if self.topk_group == 0 || self.topk_group > groups {
            bail!(
                "config.json: topk_group ({}) must be between 1 and n_group ({groups})",
                self.topk_group
            );
        }
        let eligible = self.topk_group * (experts / groups);
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > eligible {
            bail!(
                "config.json: num_experts_per_tok ({}) must be between 1 and the experts of topk_group groups ({eligible})",
                self.num_experts_per_tok
            );
        }
        if self.q_lora_rank == 0 || self.kv_lora_rank == 0 {
            bail!("config.json: q_lora_rank and kv_lora_rank must be positive (GLM-5 projects q and kv through low-rank latents)");
        }
        if self.qk_rope_head_dim == 0 || !self.qk_rope_head_dim.is_multiple_of(2) {
            bail!(
                "config.json: qk_rope_head_dim ({}) must be positive and even for RoPE",
                self.qk_rope_head_dim
            );
        }
        if let Some(kind) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
        {
            if kind != "default" {
                bail!("config.json: rope_parameters.rope_type {kind:?} is not supported by {NAME} (only \"default\")");
            }
        }
        if self.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            bail!("config.json: rope_scaling is not supported by {NAME} (only unscaled RoPE)");
        }
        if self.hidden_act != "silu" {
            bail!(
                "config.json: hidden_act {:?} is not supported by {NAME} (only \"silu\")",
                self.hidden_act
            );
        }
        if self.attention_bias {
            bail!("config.json: attention_bias true is not supported by {NAME}");
        }
        if self.index_topk == 0
            || self.index_n_heads == 0
            || self.index_head_dim < self.qk_rope_head_dim
        {
            bail!(
                "config.json: index_topk ({}) and index_n_heads ({}) must be positive and index_head_dim ({}) at least qk_rope_head_dim ({})",
                self.index_topk,
                self.index_n_heads,
                self.index_head_dim,
                self.qk_rope_head_dim
            );
        }
        if self.full_indexer_layers()?.first() == Some(&false) {
            bail!("config.json: layer 0 is a \"shared\" indexer layer, but a shared layer reuses the selection of an earlier \"full\" layer");
        }
        Ok(())
    }
}

/// The MLA projections of one layer and its output projection.
struct Attention {
    mla: MlaProjections,
    o: Matrix,
}

/// How a layer's attention picks its keys.
enum Selection {
    /// Runs its own indexer.
    Full(Box<Indexer>),
    /// Reuses the selection of the last full layer of the same forward.
    Shared,
    /// Every causal position (no indexer: the MTP layer, or a checkpoint without one).
    Dense,
}

enum Ffn {
    Dense(GatedMlp),
    Moe {
        router: Arc<Matrix>,
        gate: SigmoidRouter,
        shared: Option<GatedMlp>,
    },
}

struct Layer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    attention: Attention,
    selection: Selection,
    ffn: Ffn,
}

/// The multi-token-prediction layer's own weights; its decoder layer is a [`Layer`].
struct MtpHead {
    eh_proj: Matrix,
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    head_norm: Vec<f32>,
    layer: Layer,
}

/// What one layer remembers between forwards.
struct LayerCache {
    latents: LatentCache,
    index_keys: Option<IndexKeys>,
}

impl LayerCache {
    fn truncate(&mut self, len: usize) {
        self.latents.truncate(len);
        if let Some(keys) = &mut self.index_keys {
            keys.truncate(len);
        }
    }
}

/// Everything the layers of one forward share.
struct Pass<'a> {
    config: &'a Config,
    shape: MlaShape,
    rope: &'a Rope,
    n: usize,
    start: usize,
    /// Attend through the expanded cache (a forward from position 0) or the absorbed path.
    plain: bool,
    /// `DSA_FORCE`: run the indexer on every query but keep every key.
    keep_all: bool,
    /// The last full indexer layer's choice, for the shared layers after it.
    selected: Option<Vec<Vec<usize>>>,
    routed: &'a mut RoutedExperts,
}

impl Layer {
    fn load(
        snapshot: &Snapshot,
        config: &Config,
        l: usize,
        sparse: bool,
        selection: Selection,
        width: Width,
    ) -> Result<Layer> {
        let d = config.hidden_size;
        let heads = config.num_attention_heads;
        let p = format!("model.layers.{l}");
        let matrix = |name: &str, shape: [usize; 2], width: Width| -> Result<Matrix> {
            Matrix::load(
                &snapshot.tensor_shaped(&format!("{p}.{name}"), &shape)?,
                width,
            )
        };
        let vector =
            |name: &str, len: usize| load_vector(&snapshot.tensor(&format!("{p}.{name}"))?, len);
        let attention = Attention {
            mla: MlaProjections::load(
                snapshot,
                &format!("{p}.self_attn"),
                d,
                config.q_lora_rank,
                config.mla_shape(),
                width,
            )?,
            o: matrix(
                "self_attn.o_proj.weight",
                [d, heads * config.v_head_dim],
                width,
            )?,
        };
        let ffn = if sparse {
            let shared_inter = config.moe_intermediate_size * config.n_shared_experts;
            Ffn::Moe {
                router: Arc::new(matrix(
                    "mlp.gate.weight",
                    [config.n_routed_experts, d],
                    Width::F32,
                )?),
                gate: SigmoidRouter {
                    bias: vector("mlp.gate.e_score_correction_bias", config.n_routed_experts)?,
                    top_k: config.num_experts_per_tok,
                    n_group: config.n_group,
                    topk_group: config.topk_group,
                    normalise: config.norm_topk_prob,
                    scale: config.routed_scaling_factor,
                },
                shared: match shared_inter {
                    0 => None,
                    inter => Some(GatedMlp::load(
                        snapshot,
                        &format!("{p}.mlp.shared_experts"),
                        (d, inter),
                        Activation::SwiGlu,
                        width,
                    )?),
                },
            }
        } else {
            Ffn::Dense(GatedMlp::load(
                snapshot,
                &format!("{p}.mlp"),
                (d, config.intermediate_size),
                Activation::SwiGlu,
                width,
            )?)
        };
        Ok(Layer {
            input_norm: vector("input_layernorm.weight", d)?,
            post_attention_norm: vector("post_attention_layernorm.weight", d)?,
            attention,
            selection,
            ffn,
        })
    }

    fn size_bytes(&self) -> usize {
        let vectors = self.input_norm.len() + self.post_attention_norm.len();
        let matrices = self.attention.mla.size_bytes() + self.attention.o.size_bytes();
        let selection = match &self.selection {
            Selection::Full(indexer) => indexer.size_bytes(),
            Selection::Shared | Selection::Dense => 0,
        };
        let ffn = match &self.ffn {
            Ffn::Dense(mlp) => mlp.size_bytes(),
            Ffn::Moe {
                router,
                gate,
                shared,
            } => {
                router.size_bytes()
                    + 4 * gate.bias.len()
                    + shared.as_ref().map_or(0, GatedMlp::size_bytes)
            }
        };
        4 * vectors + matrices + selection + ffn
    }

    /// `x += attention(norm(x)); x += ffn(norm(x))` for the `pass.n` rows of `x`; `id` is
    /// the layer's index (the MTP layer's is `num_hidden_layers`).
    fn forward(
        &self,
        id: usize,
        cache: &mut LayerCache,
        pass: &mut Pass,
        x: &mut [f32],
    ) -> Result<()> {
        let norms = [&self.input_norm[..], &self.post_attention_norm];
        pre_norm_residual(x, norms, pass.config.rms_norm_eps, |step, h| match step {
            Sublayer::Attention => Ok(self.attention(cache, pass, h)),
            Sublayer::Ffn => self.ffn(id, pass, h),
        })
    }

    fn attention(&self, cache: &mut LayerCache, pass: &mut Pass, h: &[f32]) -> Vec<f32> {
        let a = &self.attention;
        let (config, shape, rope) = (pass.config, pass.shape, pass.rope);
        let (n, start) = (pass.n, pass.start);
        let (qk, nope) = (shape.qk(), shape.nope);

        let Projected {
            q_low_rank,
            mut queries,
            latents,
            mut rope_keys,
        } = a.mla.project(h, n, LORA_NORM_EPS);
        for (t, row) in queries.chunks_exact_mut(shape.heads * qk).enumerate() {
            for head in row.chunks_exact_mut(qk) {
                rope.apply_interleaved(&mut head[nope..], start + t);
            }
        }
        for (t, key) in rope_keys.chunks_exact_mut(shape.rope).enumerate() {
            rope.apply_interleaved(key, start + t);
        }
        cache.latents.push(&latents, &rope_keys);

        if let (Selection::Full(indexer), Some(keys)) = (&self.selection, cache.index_keys.as_mut())
        {
            indexer.push_keys(h, n, start, rope, keys);
            pass.selected = indexer.select(h, &q_low_rank, n, rope, keys, pass.keep_all);
        }
        let keys = match (&self.selection, &pass.selected) {
            (Selection::Dense, _) | (_, None) => Keys::Causal,
            (_, Some(rows)) => Keys::Selected(rows),
        };
        let mut context = vec![0f32; n * shape.heads * shape.v];
        let attend = if pass.plain {
            attend_plain
        } else {
            attend_absorbed
        };
        attend(
            shape,
            a.mla.kv_b(),
            &queries,
            n,
            &cache.latents,
            &keys,
            &mut context,
        );
        let mut out = vec![0f32; n * config.hidden_size];
        a.o.matmul(&context, n, &mut out);
        out
    }

    fn ffn(&self, id: usize, pass: &mut Pass, h: &[f32]) -> Result<Vec<f32>> {
        let (n, d) = (pass.n, pass.config.hidden_size);
        match &self.ffn {
            Ffn::Dense(mlp) => Ok(mlp.forward(h, n)),
            Ffn::Moe {
                router,
                gate,
                shared,
            } => {
                let experts = pass.config.n_routed_experts;
                let mut logits = vec![0f32; n * experts];
                router.matmul(h, n, &mut logits);
                let routes: Vec<Route> = logits
                    .chunks_exact(experts)
                    .map(|row| gate.route(row))
                    .collect();
                let mut out = vec![0f32; n * d];
                pass.routed.look_ahead(id, h, n);
                pass.routed.run(id, h, &routes, d, &mut out)?;
                // transformers adds the shared expert after the routed sum.
                if let Some(shared) = shared {
                    add_in_place(&mut out, &shared.forward(h, n));
                }
                Ok(out)
            }
        }
    }
}

/// The per-expert tensors of MoE layer `l`, in the published layout.
fn layer_experts(snapshot: &Snapshot, config: &Config, l: usize) -> Result<Vec<ExpertTensors>> {
    let p = format!("model.layers.{l}.mlp.experts");
    (0..config.n_routed_experts)
        .map(|e| {
            ExpertTensors::published(snapshot, &p, e)?
                .checked(config.hidden_size, config.moe_intermediate_size)
        })
        .collect()
}

/// The tensors (besides the experts) that make layer `l` an MTP head; it is used only when
/// every one of them, and every expert, is present.
fn mtp_present(snapshot: &Snapshot, config: &Config, l: usize) -> bool {
    let p = format!("model.layers.{l}");
    let last = config.n_routed_experts.saturating_sub(1);
    [
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "self_attn.q_a_proj.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.gate.weight",
        "mlp.experts.0.gate_proj.weight",
    ]
    .iter()
    .map(|name| format!("{p}.{name}"))
    .chain([format!("{p}.mlp.experts.{last}.down_proj.weight")])
    .all(|name| snapshot.contains(&name))
}

pub struct GlmMoeDsa {
    config: Config,
    shape: MlaShape,
    rope: Rope,
    embed: Matrix,
    final_norm: Vec<f32>,
    lm_head: Matrix,
    layers: Vec<Layer>,
    /// Each layer's state across forwards: its latent (and index-key) cache.
    states: Vec<LayerCache>,
    mtp: Option<MtpHead>,
    mtp_cache: LayerCache,
    routed: RoutedExperts,
    stop: Vec<u32>,
    dsa_force: bool,
    /// Draft depth for speculative decoding (0 without an MTP head).
    draft: usize,
    /// The token at every cached position.
    tokens: Vec<u32>,
    /// Where the last forward started: the earliest position `truncate` may cut to plus one.
    last_start: usize,
    /// MTP positions whose (hidden state, next token) pair is in the MTP cache for good.
    mtp_done: usize,
    /// Final-normalised hidden states of main positions `mtp_done..`, waiting for the MTP.
    pending: Vec<f32>,
}

impl GlmMoeDsa {
    pub fn load(snapshot: &Snapshot, options: LoadOptions) -> Result<GlmMoeDsa> {
        let config: Config = snapshot.config()?;
        config.validate()?;
        let stop = snapshot.stop_ids(DEFAULT_EOS)?;
        // The MTP head, when the checkpoint has it, is layer `num_hidden_layers`.
        super::check_config(
            snapshot,
            "model.layers.",
            config.num_hidden_layers,
            1,
            ("n_routed_experts", config.n_routed_experts),
            config.rms_norm_eps,
        )?;
        super::check_positive("rope_theta", config.rope_theta())?;
        let sparse = config.sparse_layers()?;
        let full = config.full_indexer_layers()?;
        let (d, n_layers) = (config.hidden_size, config.num_hidden_layers);
        let dense = options.dense_width;
        let io_width = dense.for_embeddings();

        // A checkpoint converted without the indexer attends densely, exact while the
        // context stays within index_topk; one with only some indexers is broken.
        let indexer_prefix = |l: usize| format!("model.layers.{l}.self_attn.indexer");
        let full_layers: Vec<usize> = (0..n_layers).filter(|&l| full[l]).collect();
        let with_indexer = full_layers
            .iter()
            .filter(|&&l| Indexer::present(snapshot, &indexer_prefix(l)))
            .count();
        let dsa = with_indexer > 0;
        if dsa && with_indexer < full_layers.len() {
            let missing = full_layers
                .iter()
                .find(|&&l| !Indexer::present(snapshot, &indexer_prefix(l)))
                .copied();
            bail!(
                "{}: tensor {}.wq_b.weight not found, but other full indexer layers have one",
                snapshot.dir().display(),
                indexer_prefix(missing.unwrap_or(0))
            );
        }
        let index_shape = IndexerShape {
            hidden: d,
            q_lora: config.q_lora_rank,
            heads: config.index_n_heads,
            head_dim: config.index_head_dim,
            rope: config.qk_rope_head_dim,
            top_k: config.index_topk,
        };

        let mut layers = Vec::with_capacity(n_layers);
        let mut expert_tensors = Vec::with_capacity(n_layers + 1);
        for l in 0..n_layers {
            let selection = match (dsa, full[l]) {
                (false, _) => Selection::Dense,
                (true, true) => Selection::Full(Box::new(Indexer::load(
                    snapshot,
                    &indexer_prefix(l),
                    index_shape,
                    dense,
                )?)),
                (true, false) => Selection::Shared,
            };
            layers.push(Layer::load(
                snapshot, &config, l, sparse[l], selection, dense,
            )?);
            expert_tensors.push(if sparse[l] {
                layer_experts(snapshot, &config, l)?
            } else {
                Vec::new()
            });
        }
        let mtp = if mtp_present(snapshot, &config, n_layers) {
            let p = format!("model.layers.{n_layers}");
            let vector = |name: &str| load_vector(&snapshot.tensor(&format!("{p}.{name}"))?, d);
            expert_tensors.push(layer_experts(snapshot, &config, n_layers)?);
            Some(MtpHead {
                eh_proj: Matrix::load(
                    &snapshot.tensor_shaped(&format!("{p}.eh_proj.weight"), &[d, 2 * d])?,
                    dense,
                )?,
                enorm: vector("enorm.weight")?,
                hnorm: vector("hnorm.weight")?,
                head_norm: vector("shared_head.norm.weight")?,
                // Drafts never change the output, so the head attends densely.
                layer: Layer::load(snapshot, &config, n_layers, true, Selection::Dense, dense)?,
            })
        } else {
            None
        };
        let embed = Matrix::load(
            &snapshot.tensor_shaped("model.embed_tokens.weight", &[config.vocab_size, d])?,
            io_width,
        )?;
        let head_name = if snapshot.contains("lm_head.weight") || !config.tie_word_embeddings {
            "lm_head.weight"
        } else {
            "model.embed_tokens.weight"
        };
        let lm_head = Matrix::load(
            &snapshot.tensor_shaped(head_name, &[config.vocab_size, d])?,
            io_width,
        )?;

        let mut telemetry = RouteTrace::new(NAME, n_layers, config.n_routed_experts)?;
        for (l, &routes) in sparse.iter().enumerate() {
            if !routes {
                telemetry.drop_row(l);
            }
        }
        if mtp.is_none() {
            telemetry.drop_row(n_layers);
        }
        let cache = |indexed: bool| LayerCache {
            latents: LatentCache::new(config.kv_lora_rank, config.qk_rope_head_dim),
            index_keys: indexed.then(|| IndexKeys::new(config.index_head_dim)),
        };
        let states = layers
            .iter()
            .map(|layer| cache(matches!(layer.selection, Selection::Full(_))))
            .collect();
        let draft = match (&mtp, options.draft) {
            (None, _) => 0,
            (Some(_), requested) => requested.unwrap_or(1),
        };
        let mut engine = GlmMoeDsa {
            shape: config.mla_shape(),
            rope: Rope::new(config.qk_rope_head_dim, config.rope_theta()),
            stop,
            embed,
            final_norm: load_vector(&snapshot.tensor("model.norm.weight")?, d)?,
            lm_head,
            layers,
            states,
            mtp_cache: cache(false),
            mtp,
            routed: RoutedExperts::unprovisioned(options.store.width, telemetry),
            dsa_force: options.dsa_force,
            draft,
            tokens: Vec::new(),
            last_start: 0,
            mtp_done: 0,
            pending: Vec::new(),
            config,
        };
        let trunk = engine.resident_bytes();
        engine
            .routed
            .provision(expert_tensors, &options.store, trunk)?;
        for (l, layer) in engine.layers.iter().enumerate() {
            if let Ffn::Moe { router, gate, .. } = &layer.ffn {
                engine
                    .routed
                    .predict_with(l, Predictor::sigmoid(router, gate));
            }
        }
        Ok(engine)
    }

    /// Whether the checkpoint carries the indexer (else attention is dense at every length).
    fn has_indexer(&self) -> bool {
        self.layers
            .iter()
            .any(|l| matches!(l.selection, Selection::Full(_)))
    }

    fn embed_rows(&self, tokens: &[u32]) -> Result<Vec<f32>> {
        embed_tokens(&self.embed, tokens, self.config.vocab_size)
    }

    /// One MTP step over `n` rows: `hidden` (the main model's final-normalised states, or
    /// the head's own previous output) paired with the token that follows each; returns the
    /// layer's output rows.
    fn mtp_rows(&mut self, hidden: &[f32], next: &[u32]) -> Result<Vec<f32>> {
        let d = self.config.hidden_size;
        let n = next.len();
        let eps = self.config.rms_norm_eps;
        let embedded = self.embed_rows(next)?;
        let Some(mtp) = &self.mtp else {
            bail!("{NAME}: this checkpoint has no MTP layer");
        };
        let mut joined = vec![0f32; n * 2 * d];
        for ((row, e), h) in joined
            .chunks_exact_mut(2 * d)
            .zip(embedded.chunks_exact(d))
            .zip(hidden.chunks_exact(d))
        {
            let (left, right) = row.split_at_mut(d);
            rms_norm(e, &mtp.enorm, eps, left);
            rms_norm(h, &mtp.hnorm, eps, right);
        }
        let mut x = vec![0f32; n * d];
        mtp.eh_proj.matmul(&joined, n, &mut x);
        let start = self.mtp_cache.latents.len();
        let mut pass = Pass {
            config: &self.config,
            shape: self.shape,
            rope: &self.rope,
            n,
            start,
            plain: start == 0,
            keep_all: false,
            selected: None,
            routed: &mut self.routed,
        };
        mtp.layer.forward(
            self.config.num_hidden_layers,
            &mut self.mtp_cache,
            &mut pass,
            &mut x,
        )?;
        Ok(x)
    }

    /// The MTP head's greedy token for one output row of [`GlmMoeDsa::mtp_rows`].
    fn mtp_token(&self, row: &[f32]) -> Result<u32> {
        let Some(mtp) = &self.mtp else {
            bail!("{NAME}: this checkpoint has no MTP layer");
        };
        let mut normed = vec![0f32; row.len()];
        rms_norm(row, &mtp.head_norm, self.config.rms_norm_eps, &mut normed);
        let mut logits = vec![0f32; self.config.vocab_size];
        self.lm_head.matmul(&normed, 1, &mut logits);
        Ok(argmax(&logits))
    }
}

impl Engine for GlmMoeDsa {
    fn name(&self) -> &'static str {
        NAME
    }

    fn prompt_convention(&self) -> PromptConvention {
        PROMPT
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn position(&self) -> usize {
        self.tokens.len()
    }

    fn forward(&mut self, tokens: &[u32], all_positions: bool) -> Result<Vec<f32>> {
        let (n, d) = (tokens.len(), self.config.hidden_size);
        let start = self.position();
        let mut x = self.embed_rows(tokens)?;
        let mut pass = Pass {
            config: &self.config,
            shape: self.shape,
            rope: &self.rope,
            n,
            start,
            // A forward from an empty cache expands the latents once for all its queries;
            // every later forward (decode, draft verification) takes the absorbed path, so
            // verifying k drafts at once computes exactly what k single steps would.
            plain: start == 0,
            keep_all: self.dsa_force,
            selected: None,
            routed: &mut self.routed,
        };
        for (l, (layer, cache)) in self.layers.iter().zip(self.states.iter_mut()).enumerate() {
            interrupt::checkpoint()?;
            layer.forward(l, cache, &mut pass, &mut x)?;
        }
        self.tokens.extend_from_slice(tokens);
        self.last_start = start;

        let drafting = self.mtp.is_some() && self.draft > 0;
        let normed = final_norm(
            &x,
            &self.final_norm,
            self.config.rms_norm_eps,
            all_positions || drafting,
        );
        let rows = normed.len() / d;
        if drafting {
            self.pending.extend_from_slice(&normed);
        }
        let heads = if all_positions {
            &normed[..]
        } else {
            &normed[(rows - 1) * d..]
        };
        Ok(lm_head(&self.lm_head, heads))
    }

    fn reset(&mut self) {
        self.states.iter_mut().for_each(|c| c.truncate(0));
        self.mtp_cache.truncate(0);
        self.tokens.clear();
        self.pending.clear();
        self.last_start = 0;
        self.mtp_done = 0;
    }

    fn routed(&self) -> &RoutedExperts {
        &self.routed
    }

    fn routed_mut(&mut self) -> &mut RoutedExperts {
        &mut self.routed
    }

    fn resident_bytes(&self) -> usize {
        let layers: usize = self.layers.iter().map(Layer::size_bytes).sum();
        let mtp = self.mtp.as_ref().map_or(0, |m| {
            m.layer.size_bytes()
                + m.eh_proj.size_bytes()
                + 4 * (m.enorm.len() + m.hnorm.len() + m.head_norm.len())
        });
        layers
            + mtp
            + self.embed.size_bytes()
            + self.lm_head.size_bytes()
            + 4 * self.final_norm.len()
    }

    fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    fn notes(&self) -> Vec<String> {
        let mut notes = vec![match (&self.mtp, self.draft) {
            (Some(_), 0) => "[MTP] present, drafting off (DRAFT=0)".to_string(),
            (Some(_), depth) => {
                format!("[MTP] active: native speculative decoding (draft={depth})")
            }
            (None, _) => "[MTP] absent (draft=0)".to_string(),
        }];
        let topk = self.config.index_topk;
        notes.push(match (self.has_indexer(), self.dsa_force) {
            (true, false) => format!("[DSA] indexer active: top-{topk} sparse attention beyond {topk} context tokens"),
            (true, true) => "[DSA] DSA_FORCE=1: the indexer runs on every query and keeps every key (dense attention)".to_string(),
            (false, _) => format!("[DSA] no indexer weights: dense attention, exact up to {topk} context tokens"),
        });
        notes
    }

    fn draft_depth(&self) -> usize {
        self.draft
    }

    fn propose(&mut self, next: u32, depth: usize) -> Result<Vec<u32>> {
        if self.mtp.is_none() || self.draft == 0 || depth == 0 {
            return Ok(Vec::new());
        }
        let len = self.position();
        if len == self.mtp_done {
            bail!("{NAME}: a draft needs a forward since the last one");
        }
        // Pairs (hidden state at i, token at i + 1) for every position the MTP cache lacks;
        // the token after the last position is `next`. Rows that earlier chained drafts left
        // in the MTP cache go first.
        let next_tokens: Vec<u32> = (self.mtp_done..len)
            .map(|i| self.tokens.get(i + 1).copied().unwrap_or(next))
            .collect();
        self.mtp_cache.truncate(self.mtp_done);
        let hidden = std::mem::take(&mut self.pending);
        let out = self.mtp_rows(&hidden, &next_tokens)?;
        self.mtp_done = len;
        let d = self.config.hidden_size;
        let mut state = out[out.len() - d..].to_vec();
        let mut drafts = vec![self.mtp_token(&state)?];
        while drafts.len() < depth {
            let last = drafts[drafts.len() - 1];
            state = self.mtp_rows(&state, &[last])?;
            drafts.push(self.mtp_token(&state)?);
        }
        Ok(drafts)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        let end = self.position();
        if len <= self.last_start || len > end {
            bail!(
                "{NAME}: cannot keep {len} positions: only positions the last forward added ({}..{end}) can be dropped, and at least one of them stays",
                self.last_start
            );
        }
        self.states.iter_mut().for_each(|c| c.truncate(len));
        self.tokens.truncate(len);
        if self.mtp.is_some() && self.draft > 0 {
            self.pending
                .truncate((len - self.mtp_done) * self.config.hidden_size);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: serde_json::Value) -> Config {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn indexer_layers_follow_transformers_rules() {
        // GLM-5.2: freq 4, offset 3 gives full layers 0, 1, 2, 6, 10, ...
        let c = config(
            serde_json::json!({"num_hidden_layers": 12, "index_topk_freq": 4, "index_skip_topk_offset": 3}),
        );
        let full: Vec<usize> = c
            .full_indexer_layers()
            .unwrap()
            .iter()
            .enumerate()
            .filter(|(_, &f)| f)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(full, vec![0, 1, 2, 6, 10]);
        let c = config(serde_json::json!({"num_hidden_layers": 3, "index_topk_pattern": "FSF"}));
        assert_eq!(c.full_indexer_layers().unwrap(), vec![true, false, true]);
        let c = config(
            serde_json::json!({"num_hidden_layers": 2, "indexer_types": ["full", "shared"], "index_topk_pattern": "SS"}),
        );
        assert_eq!(c.full_indexer_layers().unwrap(), vec![true, false]);
        let c = config(serde_json::json!({"num_hidden_layers": 2, "indexer_types": ["full"]}));
        assert!(c
            .full_indexer_layers()
            .unwrap_err()
            .to_string()
            .contains("indexer_types has 1 entries"));
        // Defaults: every layer full.
        assert!(config(serde_json::json!({"num_hidden_layers": 5}))
            .full_indexer_layers()
            .unwrap()
            .iter()
            .all(|&f| f));
    }

    #[test]
    fn dense_layers_from_either_key() {
        let c = config(serde_json::json!({"num_hidden_layers": 4, "first_k_dense_replace": 2}));
        assert_eq!(c.sparse_layers().unwrap(), vec![false, false, true, true]);
        let c = config(
            serde_json::json!({"num_hidden_layers": 3, "first_k_dense_replace": 2, "mlp_layer_types": ["dense", "sparse", "sparse"]}),
        );
        assert_eq!(c.sparse_layers().unwrap(), vec![false, true, true]);
    }

    #[test]
    fn rope_theta_reads_both_spellings() {
        assert_eq!(
            config(serde_json::json!({"rope_theta": 8e6})).rope_theta(),
            8e6
        );
        let both = serde_json::json!({"rope_theta": 1.0, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}});
        assert_eq!(config(both).rope_theta(), 5e5);
        assert_eq!(config(serde_json::json!({})).rope_theta(), 10000.0);
        let yarn = config(
            serde_json::json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}),
        );
        assert!(yarn
            .validate()
            .unwrap_err()
            .to_string()
            .contains("rope_type \"yarn\""));
    }

    #[test]
    fn group_settings_are_checked() {
        let bad = config(serde_json::json!({"n_routed_experts": 10, "n_group": 3}));
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("multiple of n_group"));
        let bad = config(
            serde_json::json!({"n_routed_experts": 8, "n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}),
        );
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("num_experts_per_tok (3)"));
        let shared_first = config(
            serde_json::json!({"num_hidden_layers": 2, "indexer_types": ["shared", "full"]}),
        );
        assert!(shared_first
            .validate()
            .unwrap_err()
            .to_string()
            .contains("layer 0 is a \"shared\""));
    }
}
