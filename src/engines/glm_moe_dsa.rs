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

use std::io::{self, Read, Write};
use std::sync::{Mutex, MutexGuard};

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
use super::moe::{Choice, RoutedExperts, Router, SigmoidRouter};
use super::prompt::{PromptConvention, ToolSyntax};
use super::state::{per_sequence, states_of, Logits, Rows, SequenceState, State, Step};
use super::state_io::{self, expect, part};
use super::weights::Weights;
use super::{lock, Engine, LoadOptions};
use crate::activation::Activation;
use crate::experts::ExpertTensors;
use crate::interrupt;
use crate::quant::Matrix;
use crate::route_trace::RouteTrace;
use crate::sampling::argmax;
use crate::snapshot::Snapshot;

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
    tools: Some(ToolSyntax::GlmXml),
    thinking: Some(("<think>", "</think>")),
};

/// GLM's chat prompt as colibri's server writes it: the prefix, `<|role|>` and the text of
/// each turn (an assistant's after an empty thinking block, as it was generated), then
/// `<|assistant|>` with an empty thinking block (thinking off; `enable_thinking` true leaves
/// the block open for the answer to think in). Tools as GLM-4.7 and GLM-5
/// lay them out: declared in a first system turn (one `tojson` line each), a past call as
/// `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>` (strings raw),
/// a run of results after one `<|observation|>`, each in `<tool_response>`.
const CHAT_TEMPLATE: &str = concat!(
    "[gMASK]<sop>",
    "{% if tools %}<|system|># Tools\n\nYou may call one or more functions to assist with the user query.\n\n",
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n",
    "{% for tool in tools %}{{ tool | tojson(ensure_ascii=False) }}\n{% endfor %}</tools>\n\n",
    "For each function call, output the function name and arguments within the following XML format:\n",
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>",
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>{% endif %}",
    "{% for message in messages %}",
    "{% if message['role'] == 'tool' %}",
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|observation|>{% endif %}",
    "<tool_response>{{ message['content'] }}</tool_response>",
    "{% else %}<|{{ message['role'] }}|>",
    "{% if message['role'] == 'assistant' %}<think></think>{% endif %}{{ message['content'] }}",
    "{% for call in message['tool_calls'] or [] %}<tool_call>{{ call['function']['name'] }}",
    "{% for key, value in call['function']['arguments'].items() %}<arg_key>{{ key }}</arg_key>",
    "<arg_value>{{ value if value is string else value | tojson(ensure_ascii=False) }}</arg_value>",
    "{% endfor %}</tool_call>{% endfor %}",
    "{% endif %}{% endfor %}",
    "{% if add_generation_prompt %}<|assistant|><think>",
    "{% if not (enable_thinking is defined and enable_thinking) %}</think>{% endif %}{% endif %}",
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
    /// The routed experts (their router is in [`RoutedExperts`]) and the shared expert.
    Moe {
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
#[derive(Clone)]
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

    fn size_bytes(&self) -> usize {
        self.latents.size_bytes() + self.index_keys.as_ref().map_or(0, IndexKeys::size_bytes)
    }

    /// The latent cache, then 1 and the indexer keys, or 0 for a layer without them.
    fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        self.latents.save(out)?;
        state_io::write_len(out, usize::from(self.index_keys.is_some()))?;
        match &self.index_keys {
            Some(keys) => keys.save(out),
            None => Ok(()),
        }
    }

    /// What [`LayerCache::save`] wrote, refused unless it has indexer keys exactly where
    /// this layer has them, as many as latents.
    fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        self.latents.restore(input)?;
        let indexed = state_io::read_len(input, "whether the layer has indexer keys")?;
        let says = |flag: usize| match flag {
            0 => "no indexer keys".to_string(),
            1 => "indexer keys".to_string(),
            _ => format!("an unknown indexer flag {flag}"),
        };
        expect(
            "indexer",
            says(indexed),
            says(usize::from(self.index_keys.is_some())),
        )?;
        if let Some(keys) = &mut self.index_keys {
            keys.restore(input)?;
            expect(
                "indexer keys for the latents",
                keys.len(),
                self.latents.len(),
            )?;
        }
        Ok(())
    }
}

/// A conversation's state: each layer's caches, the tokens fed, and the MTP head's window.
#[derive(Clone)]
struct GlmState {
    layers: Vec<LayerCache>,
    /// The token at every cached position.
    tokens: Vec<u32>,
    /// `hidden_size`, when the engine drafts: forwards then keep their final hidden states
    /// for the MTP; 0 when it does not.
    drafting: usize,
    mtp_cache: LayerCache,
    /// MTP positions whose (hidden state, next token) pair is in the MTP cache for good.
    mtp_done: usize,
    /// Final-normalised hidden states of main positions `mtp_done..`, waiting for the MTP.
    pending: Vec<f32>,
}

impl SequenceState for GlmState {
    fn position(&self) -> usize {
        self.tokens.len()
    }

    fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(LayerCache::size_bytes)
            .sum::<usize>()
            + self.mtp_cache.size_bytes()
            + 4 * (self.tokens.len() + self.pending.len())
    }

    /// Latent and index-key caches go back to any position. With a draft head, the MTP's
    /// pair for position `mtp_done - 1` was made with the token after it, so a cut must
    /// keep that token (or go back to nothing).
    fn can_truncate(&self, len: usize) -> bool {
        len == 0 || self.drafting == 0 || len > self.mtp_done
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len == 0 {
            self.layers.iter_mut().for_each(|c| c.truncate(0));
            self.mtp_cache.truncate(0);
            self.tokens.clear();
            self.pending.clear();
            self.mtp_done = 0;
            return Ok(());
        }
        if !self.can_truncate(len) {
            bail!(
                "{NAME}: cannot go back to position {len}: the draft head has already paired position {} with the token after it (keep more than {} positions)",
                self.mtp_done - 1,
                self.mtp_done
            );
        }
        self.layers.iter_mut().for_each(|c| c.truncate(len));
        self.tokens.truncate(len);
        self.pending.truncate((len - self.mtp_done) * self.drafting);
        Ok(())
    }

    /// The number of layers and each layer's caches, the tokens, the MTP window (the
    /// drafting width, the MTP cache, `mtp_done`, the pending hidden states).
    fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.layers.len())?;
        self.layers.iter().try_for_each(|c| c.save(out))?;
        state_io::write_u32s(out, &self.tokens)?;
        state_io::write_len(out, self.drafting)?;
        self.mtp_cache.save(out)?;
        state_io::write_len(out, self.mtp_done)?;
        state_io::write_f32s(out, &self.pending)
    }

    /// Refused unless every layer holds a latent per token and the MTP window is one this
    /// engine's forwards and drafts could have left: drafting as this engine does, at most
    /// every position paired, the hidden state of every other one pending.
    fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let layers = state_io::read_len(input, "the number of layers")?;
        expect("layers", layers, self.layers.len())?;
        for (l, cache) in self.layers.iter_mut().enumerate() {
            part(format_args!("layer {l}"), cache.restore(input))?;
        }
        self.tokens = state_io::read_u32s(input, "the tokens")?;
        if let Some(l) = self
            .layers
            .iter()
            .position(|c| c.latents.len() != self.tokens.len())
        {
            bail!(
                "layer {l} holds {} positions for {} tokens",
                self.layers[l].latents.len(),
                self.tokens.len()
            );
        }
        let drafting = state_io::read_len(input, "the drafting width")?;
        let says = |width: usize| match width {
            0 => "drafting off".to_string(),
            d => format!("drafting with {d}-wide hidden states"),
        };
        expect("MTP head", says(drafting), says(self.drafting))?;
        part("MTP cache", self.mtp_cache.restore(input))?;
        self.mtp_done = state_io::read_len(input, "the MTP positions paired")?;
        self.pending = state_io::read_f32s(input, "the pending hidden states")?;
        let waiting = self.tokens.len().checked_sub(self.mtp_done);
        let Some(waiting) = waiting.filter(|_| self.mtp_cache.latents.len() >= self.mtp_done)
        else {
            bail!(
                "the MTP head paired {} positions of {} tokens, with {} in its cache",
                self.mtp_done,
                self.tokens.len(),
                self.mtp_cache.latents.len()
            );
        };
        expect(
            "pending hidden-state values",
            self.pending.len(),
            waiting * self.drafting,
        )?;
        if self.drafting == 0 && (self.mtp_done > 0 || !self.mtp_cache.latents.is_empty()) {
            bail!(
                "an MTP window ({} positions paired, {} cached) without drafting",
                self.mtp_done,
                self.mtp_cache.latents.len()
            );
        }
        Ok(())
    }
}

/// Everything the layers of one forward share.
struct Pass<'a> {
    config: &'a Config,
    shape: MlaShape,
    rope: &'a Rope,
    rows: &'a Rows,
    /// `DSA_FORCE`: run the indexer on every query but keep every key.
    keep_all: bool,
    /// By sequence: the last full indexer layer's choice, for the shared layers after it.
    selected: Vec<Option<Vec<Vec<usize>>>>,
    routed: &'a mut RoutedExperts,
}

impl Layer {
    /// Layer `w` (`model.layers.N`) and, for a MoE layer, its router.
    fn load(
        w: &Weights,
        config: &Config,
        sparse: bool,
        selection: Selection,
    ) -> Result<(Layer, Option<Router>)> {
        let d = config.hidden_size;
        let heads = config.num_attention_heads;
        let a = w.at("self_attn");
        let attention = Attention {
            mla: MlaProjections::load(&a, d, config.q_lora_rank, config.mla_shape())?,
            o: a.matrix("o_proj.weight", [d, heads * config.v_head_dim])?,
        };
        let m = w.at("mlp");
        let (ffn, router) = if sparse {
            let experts = config.n_routed_experts;
            let router = Router {
                weight: m.matrix_f32("gate.weight", [experts, d])?,
                choice: Choice::Sigmoid(SigmoidRouter {
                    bias: m.vector("gate.e_score_correction_bias", experts)?,
                    top_k: config.num_experts_per_tok,
                    n_group: config.n_group,
                    topk_group: config.topk_group,
                    normalise: config.norm_topk_prob,
                    scale: config.routed_scaling_factor,
                }),
            };
            let shared = match config.moe_intermediate_size * config.n_shared_experts {
                0 => None,
                inter => Some(GatedMlp::load(
                    &m.at("shared_experts"),
                    (d, inter),
                    Activation::SwiGlu,
                )?),
            };
            (Ffn::Moe { shared }, Some(router))
        } else {
            let inter = config.intermediate_size;
            let mlp = GatedMlp::load(&m, (d, inter), Activation::SwiGlu)?;
            (Ffn::Dense(mlp), None)
        };
        let layer = Layer {
            input_norm: w.vector("input_layernorm.weight", d)?,
            post_attention_norm: w.vector("post_attention_layernorm.weight", d)?,
            attention,
            selection,
            ffn,
        };
        Ok((layer, router))
    }

    /// `x += attention(norm(x)); x += ffn(norm(x))` for the rows of `x`, with `caches`
    /// this layer's cache of each sequence; `id` is the layer's index (the MTP layer's is
    /// `num_hidden_layers`).
    fn forward(
        &self,
        id: usize,
        caches: &mut [&mut LayerCache],
        pass: &mut Pass,
        x: &mut [f32],
    ) -> Result<()> {
        let norms = [&self.input_norm[..], &self.post_attention_norm];
        pre_norm_residual(x, norms, pass.config.rms_norm_eps, |step, h| match step {
            Sublayer::Attention => Ok(self.attention(caches, pass, h)),
            Sublayer::Ffn => self.ffn(id, pass, h),
        })
    }

    fn attention(&self, caches: &mut [&mut LayerCache], pass: &mut Pass, h: &[f32]) -> Vec<f32> {
        let a = &self.attention;
        let (config, shape, rope, rows) = (pass.config, pass.shape, pass.rope, pass.rows);
        let n = rows.len();
        let (qk, nope) = (shape.qk(), shape.nope);

        let Projected {
            q_low_rank,
            mut queries,
            latents,
            mut rope_keys,
        } = a.mla.project(h, n, LORA_NORM_EPS);
        for segment in &rows.segments {
            for (i, t) in segment.rows.clone().enumerate() {
                let row = &mut queries[t * shape.heads * qk..][..shape.heads * qk];
                for head in row.chunks_exact_mut(qk) {
                    rope.apply_interleaved(&mut head[nope..], segment.start + i);
                }
                let key = &mut rope_keys[t * shape.rope..][..shape.rope];
                rope.apply_interleaved(key, segment.start + i);
            }
        }
        let index = match &self.selection {
            Selection::Full(indexer) => {
                let top_k = config.index_topk;
                let selects =
                    pass.keep_all || rows.segments.iter().any(|s| s.start + s.len() > top_k);
                Some((indexer, indexer.project(h, &q_low_rank, n, selects)))
            }
            _ => None,
        };
        let dense = matches!(self.selection, Selection::Dense);
        let keep_all = pass.keep_all;
        let mut context = vec![0f32; n * shape.heads * shape.v];
        let mut work: Vec<_> = caches.iter_mut().zip(pass.selected.iter_mut()).collect();
        let width = shape.heads * shape.v;
        per_sequence(
            rows,
            &mut work,
            &mut context,
            width,
            |segment, (cache, selected), context| {
                let latents = segment.of(&latents, shape.kv_lora);
                cache
                    .latents
                    .push(latents, segment.of(&rope_keys, shape.rope));
                if let (Some((indexer, projected)), Some(keys)) =
                    (&index, cache.index_keys.as_mut())
                {
                    let own = segment.rows.clone();
                    indexer.push_keys(projected, own.clone(), segment.start, rope, keys);
                    **selected = indexer.select(projected, own, rope, keys, keep_all);
                }
                let keys = match (dense, &**selected) {
                    (true, _) | (_, None) => Keys::Causal,
                    (false, Some(picked)) => Keys::Selected(picked),
                };
                // A forward from an empty cache expands the latents once for all its queries;
                // every later forward (decode, draft verification) takes the absorbed path, so
                // verifying k drafts at once computes exactly what k single steps would.
                let attend = if segment.start == 0 {
                    attend_plain
                } else {
                    attend_absorbed
                };
                attend(
                    shape,
                    a.mla.kv_b(),
                    segment.of(&queries, shape.heads * qk),
                    segment.len(),
                    &cache.latents,
                    &keys,
                    context,
                );
            },
        );
        let mut out = vec![0f32; n * config.hidden_size];
        a.o.matmul(&context, n, &mut out);
        out
    }

    fn ffn(&self, id: usize, pass: &mut Pass, h: &[f32]) -> Result<Vec<f32>> {
        let n = pass.rows.len();
        match &self.ffn {
            Ffn::Dense(mlp) => Ok(mlp.forward_dense(h, n)),
            Ffn::Moe { shared } => {
                let mut out = pass.routed.forward(id, h, n)?.routed;
                // transformers adds the shared expert after the routed sum.
                if let Some(shared) = shared {
                    add_in_place(&mut out, &shared.forward_shared(h, n));
                }
                Ok(out)
            }
        }
    }
}

/// The per-expert tensors of MoE layer `w` (`model.layers.N`), in the published layout.
fn layer_experts(w: &Weights, config: &Config) -> Result<Vec<ExpertTensors>> {
    let p = w.name("mlp.experts");
    (0..config.n_routed_experts)
        .map(|e| {
            ExpertTensors::published(w.snapshot(), &p, e)?
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
    mtp: Option<MtpHead>,
    routed: Mutex<RoutedExperts>,
    /// Bytes of the weights above.
    resident: usize,
    stop: Vec<u32>,
    dsa_force: bool,
    /// Draft depth for speculative decoding (0 without an MTP head).
    draft: usize,
}

impl GlmMoeDsa {
    pub fn load(snapshot: &Snapshot, options: LoadOptions) -> Result<GlmMoeDsa> {
        let config: Config = snapshot.config()?;
        config.validate()?;
        let stop = snapshot.stop_ids(DEFAULT_EOS, config.vocab_size)?;
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
        let weights = Weights::new(snapshot, options.dense_width);
        let layer_weights = |l: usize| weights.at(&format!("model.layers.{l}"));

        // A checkpoint converted without the indexer attends densely, exact while the
        // context stays within index_topk; one with only some indexers is broken.
        let indexer = |l: usize| layer_weights(l).at("self_attn.indexer");
        let full_layers: Vec<usize> = (0..n_layers).filter(|&l| full[l]).collect();
        let with_indexer = full_layers
            .iter()
            .filter(|&&l| Indexer::present(&indexer(l)))
            .count();
        let dsa = with_indexer > 0;
        if dsa && with_indexer < full_layers.len() {
            let missing = full_layers
                .iter()
                .find(|&&l| !Indexer::present(&indexer(l)))
                .copied();
            bail!(
                "{}: tensor {} not found, but other full indexer layers have one",
                snapshot.dir().display(),
                indexer(missing.unwrap_or(0)).name("wq_b.weight")
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

        let mut telemetry = RouteTrace::new(NAME, n_layers, config.n_routed_experts)?;
        for (l, &routes) in sparse.iter().enumerate() {
            if !routes {
                telemetry.drop_row(l);
            }
        }
        let mut routed = RoutedExperts::unprovisioned(options.store.width, telemetry);
        let mut layers = Vec::with_capacity(n_layers);
        let mut expert_tensors = Vec::with_capacity(n_layers + 1);
        for l in 0..n_layers {
            let w = layer_weights(l);
            let selection = match (dsa, full[l]) {
                (false, _) => Selection::Dense,
                (true, true) => Selection::Full(Box::new(Indexer::load(&indexer(l), index_shape)?)),
                (true, false) => Selection::Shared,
            };
            let (layer, router) = Layer::load(&w, &config, sparse[l], selection)?;
            layers.push(layer);
            expert_tensors.push(routed.add_layer(l, router, || layer_experts(&w, &config))?);
        }
        let mtp = if mtp_present(snapshot, &config, n_layers) {
            let w = layer_weights(n_layers);
            expert_tensors.push(layer_experts(&w, &config)?);
            // Drafts never change the output, so the head attends densely.
            let (layer, router) = Layer::load(&w, &config, true, Selection::Dense)?;
            Some((
                MtpHead {
                    eh_proj: w.matrix("eh_proj.weight", [d, 2 * d])?,
                    enorm: w.vector("enorm.weight", d)?,
                    hnorm: w.vector("hnorm.weight", d)?,
                    head_norm: w.vector("shared_head.norm.weight", d)?,
                    layer,
                },
                router,
            ))
        } else {
            routed.telemetry.drop_row(n_layers);
            None
        };
        let draft = match (&mtp, options.draft) {
            (None, _) => 0,
            (Some(_), requested) => requested.unwrap_or(1),
        };
        // The draft head's router routes only while it drafts: registered then, so that
        // the lookahead never reads experts for a layer that does not run.
        let mtp = mtp.map(|(head, router)| {
            if let Some(router) = router.filter(|_| draft > 0) {
                routed.set_router(n_layers, router);
            }
            head
        });
        let vocab = [config.vocab_size, d];
        let embed_name = "model.embed_tokens.weight";
        let embed = weights.embedding(embed_name, vocab)?;
        let tied = config.tie_word_embeddings;
        let lm_head = weights.lm_head("lm_head.weight", embed_name, tied, vocab)?;
        let final_norm = weights.vector("model.norm.weight", d)?;
        let resident = weights.resident_bytes();
        routed.provision(expert_tensors, &options.store, resident)?;
        Ok(GlmMoeDsa {
            shape: config.mla_shape(),
            rope: Rope::new(config.qk_rope_head_dim, config.rope_theta()),
            stop,
            embed,
            final_norm,
            lm_head,
            layers,
            mtp,
            routed: Mutex::new(routed),
            resident,
            dsa_force: options.dsa_force,
            draft,
            config,
        })
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

    fn drafting(&self) -> bool {
        self.mtp.is_some() && self.draft > 0
    }

    /// A layer's empty caches: the latents, and the index keys where it runs an indexer.
    fn empty_cache(&self, indexed: bool) -> LayerCache {
        LayerCache {
            latents: LatentCache::new(self.config.kv_lora_rank, self.config.qk_rope_head_dim),
            index_keys: indexed.then(|| IndexKeys::new(self.config.index_head_dim)),
        }
    }

    /// One MTP step over `n` rows of `state`'s MTP window: `hidden` (the main model's
    /// final-normalised states, or the head's own previous output) paired with the token
    /// that follows each; returns the layer's output rows.
    fn mtp_rows(
        &self,
        state: &mut GlmState,
        routed: &mut RoutedExperts,
        hidden: &[f32],
        next: &[u32],
    ) -> Result<Vec<f32>> {
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
        let rows = Rows::from_parts(&[(next, state.mtp_cache.latents.len(), Logits::Last)]);
        let mut pass = Pass {
            config: &self.config,
            shape: self.shape,
            rope: &self.rope,
            rows: &rows,
            keep_all: false,
            selected: vec![None],
            routed,
        };
        mtp.layer.forward(
            self.config.num_hidden_layers,
            &mut [&mut state.mtp_cache],
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

    fn new_state(&self) -> State {
        let layers = self
            .layers
            .iter()
            .map(|layer| self.empty_cache(matches!(layer.selection, Selection::Full(_))))
            .collect();
        State::new(
            NAME,
            GlmState {
                layers,
                tokens: Vec::new(),
                drafting: if self.drafting() {
                    self.config.hidden_size
                } else {
                    0
                },
                mtp_cache: self.empty_cache(false),
                mtp_done: 0,
                pending: Vec::new(),
            },
        )
    }

    fn forward(&self, batch: &mut [Step]) -> Result<Vec<Vec<f32>>> {
        let (rows, mut states) = states_of::<GlmState>(batch, NAME)?;
        let d = self.config.hidden_size;
        let mut x = self.embed_rows(&rows.tokens)?;
        let mut routed = self.routed();
        let mut pass = Pass {
            config: &self.config,
            shape: self.shape,
            rope: &self.rope,
            rows: &rows,
            keep_all: self.dsa_force,
            selected: vec![None; rows.segments.len()],
            routed: &mut routed,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            interrupt::checkpoint()?;
            let mut caches: Vec<_> = states.iter_mut().map(|s| &mut s.layers[l]).collect();
            layer.forward(l, &mut caches, &mut pass, &mut x)?;
        }
        for (state, segment) in states.iter_mut().zip(&rows.segments) {
            state
                .tokens
                .extend_from_slice(&rows.tokens[segment.rows.clone()]);
        }
        let eps = self.config.rms_norm_eps;
        let wanted = rows.output_rows();
        let normed = if self.drafting() {
            // The MTP reads every position's final hidden state.
            let every: Vec<usize> = (0..rows.len()).collect();
            let normed = final_norm(&x, &self.final_norm, eps, &every);
            for (state, segment) in states.iter_mut().zip(&rows.segments) {
                state.pending.extend_from_slice(segment.of(&normed, d));
            }
            Rows::gather(&normed, d, &wanted)
        } else {
            final_norm(&x, &self.final_norm, eps, &wanted)
        };
        let logits = lm_head(&self.lm_head, &normed)?;
        Ok(rows.split_logits(logits, self.config.vocab_size))
    }

    fn routed(&self) -> MutexGuard<'_, RoutedExperts> {
        lock(&self.routed)
    }

    fn resident_bytes(&self) -> usize {
        self.resident
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

    fn propose(&self, state: &mut State, next: u32, depth: usize) -> Result<Vec<u32>> {
        if !self.drafting() || depth == 0 {
            return Ok(Vec::new());
        }
        let state = state.downcast_mut::<GlmState>(NAME)?;
        let len = state.position();
        if len == state.mtp_done {
            bail!("{NAME}: a draft needs a forward since the last one");
        }
        // Pairs (hidden state at i, token at i + 1) for every position the MTP cache lacks;
        // the token after the last position is `next`. Rows that earlier chained drafts left
        // in the MTP cache go first.
        let next_tokens: Vec<u32> = (state.mtp_done..len)
            .map(|i| state.tokens.get(i + 1).copied().unwrap_or(next))
            .collect();
        state.mtp_cache.truncate(state.mtp_done);
        let hidden = std::mem::take(&mut state.pending);
        let mut routed = self.routed();
        let out = self.mtp_rows(state, &mut routed, &hidden, &next_tokens)?;
        state.mtp_done = len;
        let d = self.config.hidden_size;
        let mut row = out[out.len() - d..].to_vec();
        let mut drafts = vec![self.mtp_token(&row)?];
        while drafts.len() < depth {
            let last = drafts[drafts.len() - 1];
            row = self.mtp_rows(state, &mut routed, &row, &[last])?;
            drafts.push(self.mtp_token(&row)?);
        }
        Ok(drafts)
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
