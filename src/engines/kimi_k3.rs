//! Kimi K3 (`kimi_k3`, whose text model is a `kimi_linear` config): Kimi Delta Attention
//! layers ([`super::kda`]) interleaved with gated NoPE MLA layers, a dense SiTU-GLU first
//! layer then stable LatentMoE layers, and block attention residuals
//! ([`super::attn_res`]) in place of the residual stream.
//!
//! - Layer `i` is KDA when `i + 1` is in `linear_attn_config.kda_layers` (1-indexed), else
//!   MLA with no rotation anywhere (the "rope" part of the key is the raw shared vector) and
//!   an elementwise output gate: `o_proj(context * sigmoid(g_proj x))`.
//! - LatentMoE: a sigmoid router with a score-correction bias chooses on the full hidden
//!   state; the routed experts (SiTU-GLU, `w1` gate, `w3` up, `w2` down) work in the latent
//!   `routed_expert_down_proj x`; their gated sum is RMS-normalised (`routed_expert_norm`) and
//!   projected back up, then the fused shared experts of `x` are added.
//! - Routed experts are read as published: compressed-tensors MXFP4
//!   (`experts.{E}.w{1,2,3}.weight_packed` + `.weight_scale`), through `quant`'s MXFP4
//!   format, with f32 activations in the oracle setting.
//!
//! A forward runs its tokens in chunks of [`PREFILL_CHUNK`]: each chunk's projections are
//! batched and its experts deduplicated, while the KDA recurrence and the MLA cache carry
//! across chunks, so any split of a sequence computes the same tokens.

use std::io::{self, Read, Write};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

use anyhow::{anyhow, bail, Context, Result};
use serde::Deserialize;

use super::attn_res::{ResMix, ResidualStream};
use super::kda::{Kda, KdaShape, KdaState};
use super::layers::{embed_tokens, final_norm, lm_head, rms_norm, rms_norm_in_place, GatedMlp};
use super::mla::{attend_absorbed, attend_plain, Keys, LatentCache, MlaProjections, MlaShape};
use super::moe::{Choice, ExpertInput, RoutedExperts, Router, SigmoidRouter};
use super::prompt::{PromptConvention, ToolSyntax};
use super::state::{per_sequence, Logits, Rows, SequenceState, State, Step};
use super::state_io::{self, expect};
use super::weights::Weights;
use super::{lock, Engine, LoadOptions};
use crate::activation::{Activation, Situ};
use crate::experts::ExpertTensors;
use crate::interrupt;
use crate::profile::{self, Phase};
use crate::quant::Matrix;
use crate::route_trace::RouteTrace;
use crate::snapshot::Snapshot;

pub const NAME: &str = "kimi_k3";

/// Name fragments of the tensors this engine reads only in f32, beyond what every engine
/// keeps (vectors, norms, routers, biases): the KDA convolution taps; the beta and
/// decay-gate projections, small, whose gate's exponent amplifies rounding; the
/// attention-residual pseudo-queries (`[1, hidden]`, read as vectors); the router's score
/// correction.
pub const KEPT_F32: &[&str] = &[
    "conv",
    ".b_proj.weight",
    ".f_a_proj.weight",
    ".f_b_proj.weight",
    "res_proj.weight",
    "e_score_correction",
];

/// XTML as the published template lays it out with `thinking` false: the tools declared
/// first (keys sorted, compact), each turn `<|open|>message role="R"<|sep|>TEXT<|close|>
/// message<|sep|>` then `<|end_of_msg|>`, an assistant turn's text in a `response` and its
/// calls in `tools`, a tool result naming its tool and place; `developer` speaks as
/// `system`; the answer opens a `response`.
const CHAT_TEMPLATE: &str = concat!(
    "{% macro attr(value) %}{{ value | string | replace('&', '&amp;') | replace('\"', '&quot;') }}{% endmacro %}",
    "{% if tools %}<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\n",
    "Here are the available tools, described in JSONSchema.\n\n```json\n",
    "{{ tools | tojson(separators=[',', ':'], sort_keys=true) }}\n```",
    "<|close|>message<|sep|><|end_of_msg|>{% endif %}",
    "{% set ns = namespace(tool_index=0) %}",
    "{% for message in messages %}",
    "{% if message['role'] == 'tool' %}",
    "{% set ns.tool_index = ns.tool_index + 1 %}",
    "<|open|>message role=\"tool\" tool=\"{{ attr(message['name']) }}\" index=\"{{ ns.tool_index }}\"<|sep|>",
    "{{ message['content'] }}<|close|>message<|sep|><|end_of_msg|>",
    "{% elif message['role'] == 'assistant' %}",
    "{% set ns.tool_index = 0 %}",
    "<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>{{ message['content'] }}",
    "<|close|>response<|sep|>",
    "{% if message['tool_calls'] %}<|open|>tools<|sep|>",
    "{% for call in message['tool_calls'] %}",
    "<|open|>call tool=\"{{ attr(call['function']['name']) }}\" index=\"{{ loop.index }}\"<|sep|>",
    "{% for key, value in call['function']['arguments'].items() %}",
    "<|open|>argument key=\"{{ attr(key) }}\" type=\"",
    "{% if value is boolean %}boolean{% elif value is none %}null{% elif value is number %}number",
    "{% elif value is string %}string{% elif value is mapping %}object{% else %}array{% endif %}\"<|sep|>",
    "{{ value if value is string else value | tojson }}<|close|>argument<|sep|>",
    "{% endfor %}<|close|>call<|sep|>{% endfor %}",
    "<|close|>tools<|sep|>{% endif %}",
    "<|close|>message<|sep|><|end_of_msg|>",
    "{% else %}",
    "{{ '<|open|>message role=\"' }}",
    "{{ 'system' if message['role'] == 'developer' else message['role'] }}",
    "{{ '\"<|sep|>' + message['content'] + '<|close|>message<|sep|><|end_of_msg|>' }}",
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}",
    "{{ '<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>' }}",
    "{% endif %}",
);

/// Tokens per chunk of a long forward (colibri's `K3_CHUNK` default).
pub const PREFILL_CHUNK: usize = 32;

/// transformers' `KimiLinearAttention` builds `q_a_layernorm` and `kv_a_layernorm` with its
/// RMSNorm default epsilon, not `rms_norm_eps`.
const LORA_NORM_EPS: f64 = 1e-6;

/// `linear_attn_config`.
#[derive(Debug, Clone, Deserialize)]
pub struct LinearAttnConfig {
    /// 1-indexed.
    pub kda_layers: Vec<usize>,
    /// 1-indexed; when present, exactly the layers that are not KDA.
    pub full_attn_layers: Option<Vec<usize>>,
    pub num_heads: usize,
    pub head_dim: usize,
    pub short_conv_kernel_size: usize,
    pub gate_lower_bound: Option<f32>,
    pub use_full_rank_gate: Option<bool>,
}

/// The text config (`text_config` of the release's `kimi_k3` config, or a bare
/// `kimi_linear` one). Keys K3 needs are required; keys whose release value the engine
/// implements are checked when present (see [`Config::validate`]).
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub first_k_dense_replace: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_token: usize,
    pub moe_intermediate_size: usize,
    pub routed_expert_hidden_size: Option<usize>,
    pub num_shared_experts: usize,
    pub attn_res_block_size: Option<usize>,
    pub activation_situ_beta: f32,
    pub activation_situ_linear_beta: Option<f32>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    pub linear_attn_config: LinearAttnConfig,
    pub hidden_act: Option<String>,
    pub moe_router_activation_func: Option<String>,
    pub topk_method: Option<String>,
    pub use_grouped_topk: Option<bool>,
    pub num_expert_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub moe_renormalize: Option<bool>,
    pub routed_scaling_factor: Option<f32>,
    pub latent_moe_use_norm: Option<bool>,
    pub mla_use_nope: Option<bool>,
    pub mla_use_output_gate: Option<bool>,
    pub moe_layer_freq: Option<usize>,
    pub tie_word_embeddings: Option<bool>,
    pub quantization_config: Option<serde_json::Value>,
}

fn default_eps() -> f64 {
    1e-5
}

impl Config {
    /// The config, its layer count checked against the checkpoint before the rest of it
    /// (whose checks walk the layers).
    pub fn read(snapshot: &Snapshot) -> Result<Config> {
        let path = snapshot.dir().join("config.json");
        let (config, what) = Config::parse(snapshot.config_json(), &path)?;
        super::check_config(
            snapshot,
            &format!("{}model.layers.", tensor_prefix(snapshot)?),
            config.num_hidden_layers,
            0,
            ("num_experts", config.num_experts),
            config.rms_norm_eps,
        )?;
        config
            .validate()
            .with_context(|| format!("{}: {what}", path.display()))?;
        Ok(config)
    }

    #[cfg(test)]
    fn from_json(root: &serde_json::Value, path: &Path) -> Result<Config> {
        let (config, what) = Config::parse(root, path)?;
        config
            .validate()
            .with_context(|| format!("{}: {what}", path.display()))?;
        Ok(config)
    }

    fn parse(root: &serde_json::Value, path: &Path) -> Result<(Config, &'static str)> {
        let (text, what) = match root.get("text_config") {
            Some(text) if text.is_object() => (text, "text_config"),
            Some(other) => bail!(
                "{}: text_config is {other}, expected an object",
                path.display()
            ),
            None => (root, "the config"),
        };
        let config: Config = serde_json::from_value(text.clone())
            .map_err(|err| anyhow!("{}: {what}: {err}", path.display()))?;
        Ok((config, what))
    }

    /// Per layer (0-based): whether it is a KDA layer.
    fn kda_layers(&self) -> Vec<bool> {
        let mut kda = vec![false; self.num_hidden_layers];
        for &l in &self.linear_attn_config.kda_layers {
            kda[l - 1] = true;
        }
        kda
    }

    fn latent(&self) -> usize {
        self.routed_expert_hidden_size.unwrap_or(0)
    }

    fn block_size(&self) -> usize {
        self.attn_res_block_size.unwrap_or(1)
    }

    fn lower_bound(&self) -> f32 {
        self.linear_attn_config.gate_lower_bound.unwrap_or(0.0)
    }

    fn situ(&self) -> Situ {
        Situ {
            beta: self.activation_situ_beta,
            linear_beta: self.activation_situ_linear_beta,
        }
    }

    /// `(groups, groups kept)` of the router: grouped top-k only with `use_grouped_topk`.
    fn groups(&self) -> (usize, usize) {
        if self.use_grouped_topk == Some(false) {
            return (1, 1);
        }
        let groups = self.num_expert_group.unwrap_or(1);
        (groups, self.topk_group.unwrap_or(1).min(groups))
    }

    fn mla_shape(&self) -> MlaShape {
        MlaShape::new(
            self.num_attention_heads,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
            self.kv_lora_rank,
        )
    }

    fn kda_shape(&self) -> KdaShape {
        let lac = &self.linear_attn_config;
        KdaShape {
            heads: lac.num_heads,
            head_dim: lac.head_dim,
            kernel: lac.short_conv_kernel_size,
            lower_bound: self.lower_bound(),
            eps: self.rms_norm_eps,
        }
    }

    fn validate(&self) -> Result<()> {
        let n = self.num_hidden_layers;
        if n == 0 || self.hidden_size == 0 || self.vocab_size == 0 || self.num_attention_heads == 0
        {
            bail!("hidden_size, num_hidden_layers, vocab_size and num_attention_heads must be positive");
        }
        let expect = |key: &str, found: Option<&str>, want: &str| -> Result<()> {
            match found {
                Some(value) if value != want => {
                    bail!("{key} is {value:?}; {NAME} implements {want:?} only (Kimi K3's value)")
                }
                _ => Ok(()),
            }
        };
        match self.hidden_act.as_deref() {
            Some("situ") => {}
            found => bail!(
                "hidden_act is {found:?}; {NAME} runs Kimi K3, whose MLPs use \"situ\" (a Kimi Linear checkpoint with \"silu\" is a different model)"
            ),
        }
        expect(
            "moe_router_activation_func",
            self.moe_router_activation_func.as_deref(),
            "sigmoid",
        )?;
        expect("topk_method", self.topk_method.as_deref(), "noaux_tc")?;
        let truth = |key: &str, found: Option<bool>, what: &str| -> Result<()> {
            match found {
                Some(false) => {
                    bail!("{key} is false; {NAME} implements {what} only (Kimi K3's value is true)")
                }
                _ => Ok(()),
            }
        };
        truth(
            "mla_use_nope",
            self.mla_use_nope,
            "MLA without rotary embeddings",
        )?;
        truth(
            "linear_attn_config.use_full_rank_gate",
            self.linear_attn_config.use_full_rank_gate,
            "the full-rank KDA output gate (g_proj)",
        )?;
        if let Some(freq) = self.moe_layer_freq.filter(|&f| f != 1) {
            bail!("moe_layer_freq is {freq}; {NAME} implements a MoE in every layer after the dense ones (1)");
        }
        if let Some(kv) = self
            .num_key_value_heads
            .filter(|&kv| kv != self.num_attention_heads)
        {
            bail!(
                "num_key_value_heads ({kv}) must equal num_attention_heads ({}): MLA decompresses one key and value per head",
                self.num_attention_heads
            );
        }
        match self.attn_res_block_size {
            Some(size) if size > 0 => {}
            found => bail!("attn_res_block_size is {found:?}; Kimi K3 replaces the residual stream by attention residuals every attn_res_block_size layers (a positive integer; a config without it is Kimi Linear, which {NAME} does not run)"),
        }
        match self.linear_attn_config.gate_lower_bound {
            Some(bound) if bound < 0.0 => {}
            found => bail!("linear_attn_config.gate_lower_bound is {found:?}; {NAME} implements Kimi K3's lower-bounded KDA gate, which needs a negative bound (K3: -5)"),
        }
        let latent = self.latent();
        if latent == 0 {
            bail!("routed_expert_hidden_size is {:?}; {NAME} implements Kimi K3's LatentMoE, whose routed experts work in a latent of that width", self.routed_expert_hidden_size);
        }
        if self.activation_situ_beta <= 0.0
            || self.activation_situ_linear_beta.is_some_and(|b| b <= 0.0)
        {
            bail!(
                "activation_situ_beta ({}) and activation_situ_linear_beta ({:?}) must be positive",
                self.activation_situ_beta,
                self.activation_situ_linear_beta
            );
        }
        if self.first_k_dense_replace >= n {
            bail!(
                "first_k_dense_replace ({}) leaves no MoE layer among num_hidden_layers ({n})",
                self.first_k_dense_replace
            );
        }
        let lac = &self.linear_attn_config;
        if lac.num_heads == 0 || lac.head_dim == 0 || lac.short_conv_kernel_size == 0 {
            bail!("linear_attn_config: num_heads, head_dim and short_conv_kernel_size must be positive");
        }
        let mut kda = vec![false; n];
        for &l in &lac.kda_layers {
            if l == 0 || l > n {
                bail!("linear_attn_config.kda_layers has {l}; the list is 1-indexed, so entries lie in 1..={n}");
            }
            if std::mem::replace(&mut kda[l - 1], true) {
                bail!("linear_attn_config.kda_layers lists layer {l} twice");
            }
        }
        if let Some(full) = &lac.full_attn_layers {
            let mut listed: Vec<usize> = full.clone();
            listed.sort_unstable();
            let complement: Vec<usize> = (1..=n).filter(|&l| !kda[l - 1]).collect();
            if listed != complement {
                bail!("linear_attn_config.full_attn_layers {full:?} must be exactly the layers not in kda_layers ({complement:?}, 1-indexed)");
            }
        }
        let (experts, k) = (self.num_experts, self.num_experts_per_token);
        let (groups, kept) = self.groups();
        if groups == 0 || experts == 0 || !experts.is_multiple_of(groups) || kept == 0 {
            bail!("num_experts ({experts}) must be a positive multiple of num_expert_group ({groups}), and topk_group positive");
        }
        if k == 0 || k > kept * (experts / groups) {
            bail!("num_experts_per_token ({k}) must be between 1 and the experts of topk_group groups ({})", kept * (experts / groups));
        }
        if let Some(quant) = &self.quantization_config {
            check_quantization(quant)?;
        }
        Ok(())
    }
}

/// The release's `quantization_config`: compressed-tensors MXFP4 in groups of 32.
fn check_quantization(quant: &serde_json::Value) -> Result<()> {
    let text = |key: &str| quant.get(key).and_then(|v| v.as_str());
    if text("quant_method") != Some("compressed-tensors")
        || text("format") != Some("mxfp4-pack-quantized")
    {
        bail!(
            "quantization_config is quant_method {:?}, format {:?}; {NAME} reads the release's compressed-tensors \"mxfp4-pack-quantized\" experts",
            text("quant_method"),
            text("format")
        );
    }
    fn group_sizes(value: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, v) in map {
                    if key == "group_size" {
                        out.push(v.clone());
                    } else {
                        group_sizes(v, out);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|v| group_sizes(v, out)),
            _ => {}
        }
    }
    let mut sizes = Vec::new();
    group_sizes(quant, &mut sizes);
    if let Some(bad) = sizes.iter().find(|v| v.as_u64() != Some(32)) {
        bail!("quantization_config has group_size {bad}; MXFP4 scales one group of 32 values");
    }
    Ok(())
}

/// Where the text model's tensors live: under `language_model.` (the release) or not.
fn tensor_prefix(snapshot: &Snapshot) -> Result<&'static str> {
    for prefix in ["language_model.", ""] {
        if snapshot.contains(&format!("{prefix}model.embed_tokens.weight")) {
            return Ok(prefix);
        }
    }
    bail!(
        "{}: neither language_model.model.embed_tokens.weight nor model.embed_tokens.weight is in any shard; not a Kimi K3 checkpoint",
        snapshot.dir().display()
    )
}

/// A gated NoPE MLA layer.
struct GatedMla {
    proj: MlaProjections,
    gate: Option<Matrix>,
    o: Matrix,
}

enum Mixer {
    Kda(Box<Kda>),
    Mla(Box<GatedMla>),
}

/// What a layer's attention remembers between forwards.
#[derive(Clone)]
enum MixerState {
    Kda(KdaState),
    Mla(LatentCache),
}

/// The stable LatentMoE block around the routed experts (whose router is in
/// [`RoutedExperts`]): into the latent, the experts there, its norm, and back.
struct LatentMoe {
    down: Matrix,
    norm: Option<Vec<f32>>,
    up: Matrix,
    shared: Option<GatedMlp>,
}

enum Ffn {
    Dense(Box<GatedMlp>),
    Moe(Box<LatentMoe>),
}

struct Layer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    attention_mix: ResMix,
    mlp_mix: ResMix,
    mixer: Mixer,
    ffn: Ffn,
}

/// A conversation's state: what each layer's attention remembers, and the positions held.
#[derive(Clone)]
struct KimiState {
    layers: Vec<MixerState>,
    position: usize,
}

impl SequenceState for KimiState {
    fn position(&self) -> usize {
        self.position
    }

    fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|state| match state {
                MixerState::Kda(state) => state.size_bytes(),
                MixerState::Mla(cache) => cache.size_bytes(),
            })
            .sum()
    }

    /// The KDA state is a running sum over every position, so only an empty state is exact
    /// short of the whole one.
    fn can_truncate(&self, len: usize) -> bool {
        len == 0
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > 0 {
            bail!("{NAME} cannot go back to position {len} of {}: its KDA layers keep a recurrent state, not the positions (start a new state, or fork one at the position wanted)", self.position);
        }
        for state in &mut self.layers {
            match state {
                MixerState::Kda(state) => state.clear(),
                MixerState::Mla(cache) => cache.clear(),
            }
        }
        self.position = 0;
        Ok(())
    }

    /// The position and the number of layers, then each layer's kind (0 KDA, 1 MLA) and
    /// its recurrent state or latent cache.
    fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.position)?;
        state_io::write_len(out, self.layers.len())?;
        for layer in &self.layers {
            match layer {
                MixerState::Kda(state) => {
                    state_io::write_len(out, 0)?;
                    state.save(out)?;
                }
                MixerState::Mla(cache) => {
                    state_io::write_len(out, 1)?;
                    cache.save(out)?;
                }
            }
        }
        Ok(())
    }

    fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        self.position = state_io::restore_layers(input, &mut self.layers, |layer, input, at| {
            layer.restore(input, at)
        })?;
        Ok(())
    }
}

impl MixerState {
    /// What [`KimiState::save`] wrote for one layer of a state at `position`.
    fn restore(&mut self, input: &mut dyn Read, position: usize) -> Result<()> {
        let kind = |tag: usize| match tag {
            0 => "a KDA layer".to_string(),
            1 => "an MLA layer".to_string(),
            _ => format!("a layer of unknown kind {tag}"),
        };
        let tag = state_io::read_len(input, "the layer's kind")?;
        match self {
            MixerState::Kda(state) => {
                expect("kind", kind(tag), kind(0))?;
                state.restore(input)
            }
            MixerState::Mla(cache) => {
                expect("kind", kind(tag), kind(1))?;
                cache.restore(input)?;
                expect("positions in the latent cache", cache.len(), position)
            }
        }
    }
}

/// What a forward's layers share.
struct Pass<'a> {
    config: &'a Config,
    situ: Situ,
    rows: &'a Rows,
    routed: &'a mut RoutedExperts,
}

impl Layer {
    /// Layer `w` (`model.layers.N`), the `l`-th, and, for a MoE layer, its router.
    fn load(w: &Weights, config: &Config, l: usize, kda: bool) -> Result<(Layer, Option<Router>)> {
        let d = config.hidden_size;
        let eps = config.rms_norm_eps;
        let a = w.at("self_attn");
        let mixer = if kda {
            Mixer::Kda(Box::new(Kda::load(&a, d, config.kda_shape())?))
        } else {
            let shape = config.mla_shape();
            let context = shape.heads * shape.v;
            Mixer::Mla(Box::new(GatedMla {
                proj: MlaProjections::load(&a, d, config.q_lora_rank, shape)?,
                gate: match config.mla_use_output_gate {
                    Some(false) => None,
                    _ => Some(a.matrix("g_proj.weight", [context, d])?),
                },
                o: a.matrix("o_proj.weight", [d, context])?,
            }))
        };
        let (ffn, router) = if l < config.first_k_dense_replace {
            let mlp = GatedMlp::load(
                &w.at("mlp"),
                (d, config.intermediate_size),
                Activation::Situ(config.situ()),
            )?;
            (Ffn::Dense(Box::new(mlp)), None)
        } else {
            let m = w.at("block_sparse_moe");
            let latent = config.latent();
            let (n_group, topk_group) = config.groups();
            let shared = config.moe_intermediate_size * config.num_shared_experts;
            let router = Router {
                weight: m.matrix_f32("gate.weight", [config.num_experts, d])?,
                choice: Choice::Sigmoid(SigmoidRouter {
                    bias: m.vector("gate.e_score_correction_bias", config.num_experts)?,
                    top_k: config.num_experts_per_token,
                    n_group,
                    topk_group,
                    normalise: config.moe_renormalize.unwrap_or(true),
                    scale: config.routed_scaling_factor.unwrap_or(1.0),
                }),
            };
            let moe = LatentMoe {
                down: m.matrix("routed_expert_down_proj.weight", [latent, d])?,
                norm: match config.latent_moe_use_norm {
                    Some(false) => None,
                    _ => Some(m.vector("routed_expert_norm.weight", latent)?),
                },
                up: m.matrix("routed_expert_up_proj.weight", [d, latent])?,
                shared: (shared > 0)
                    .then(|| {
                        GatedMlp::load(
                            &m.at("shared_experts"),
                            (d, shared),
                            Activation::Situ(config.situ()),
                        )
                    })
                    .transpose()?,
            };
            (Ffn::Moe(Box::new(moe)), Some(router))
        };
        let layer = Layer {
            input_norm: w.vector("input_layernorm.weight", d)?,
            post_attention_norm: w.vector("post_attention_layernorm.weight", d)?,
            attention_mix: ResMix::load(w, "self_attention_res", d, eps)?,
            mlp_mix: ResMix::load(w, "mlp_res", d, eps)?,
            mixer,
            ffn,
        };
        Ok((layer, router))
    }

    /// One layer over the block residual stream: attention over its mix of the blocks so
    /// far, then the FFN over its own; `id` is the layer's index.
    fn forward(
        &self,
        id: usize,
        states: &mut [&mut MixerState],
        pass: &mut Pass,
        stream: &mut ResidualStream,
    ) -> Result<()> {
        let eps = pass.config.rms_norm_eps;
        let input = stream.attention_input(id, &self.attention_mix);
        let mut h = vec![0f32; input.len()];
        rms_norm(&input, &self.input_norm, eps, &mut h);
        let attention = profile::time(Phase::Attention, || self.attention(states, pass, &h))?;
        let input = stream.after_attention(&attention, &self.mlp_mix);
        rms_norm(&input, &self.post_attention_norm, eps, &mut h);
        let ffn = self.ffn(id, pass, &h)?;
        stream.after_mlp(&ffn);
        Ok(())
    }

    fn attention(
        &self,
        states: &mut [&mut MixerState],
        pass: &Pass,
        h: &[f32],
    ) -> Result<Vec<f32>> {
        let (rows, n) = (pass.rows, pass.rows.len());
        match &self.mixer {
            Mixer::Kda(kda) => {
                let mut kda_states = of_kind(states, |state| match state {
                    MixerState::Kda(state) => Some(state),
                    MixerState::Mla(_) => None,
                })?;
                Ok(kda.forward(h, rows, &mut kda_states))
            }
            Mixer::Mla(mla) => {
                let shape = pass.config.mla_shape();
                let projected = mla.proj.project(h, n, LORA_NORM_EPS);
                let mut caches = of_kind(states, |state| match state {
                    MixerState::Mla(cache) => Some(cache),
                    MixerState::Kda(_) => None,
                })?;
                let width = shape.heads * shape.v;
                let mut context = vec![0f32; n * width];
                per_sequence(
                    rows,
                    &mut caches,
                    &mut context,
                    width,
                    |segment, cache, context| {
                        cache.push(
                            segment.of(&projected.latents, shape.kv_lora),
                            segment.of(&projected.rope_keys, shape.rope),
                        );
                        // Many queries share one expansion of the cache; a single one is
                        // cheaper against the latents directly.
                        let m = segment.len();
                        let attend = if m > 1 { attend_plain } else { attend_absorbed };
                        attend(
                            shape,
                            mla.proj.kv_b(),
                            segment.of(&projected.queries, shape.heads * shape.qk()),
                            m,
                            cache,
                            &Keys::Causal,
                            context,
                        );
                    },
                );
                if let Some(gate) = &mla.gate {
                    let mut g = vec![0f32; context.len()];
                    gate.matmul(h, n, &mut g);
                    for (c, &g) in context.iter_mut().zip(&g) {
                        *c *= 1.0 / (1.0 + (-g).exp());
                    }
                }
                let mut out = vec![0f32; n * pass.config.hidden_size];
                mla.o.matmul(&context, n, &mut out);
                Ok(out)
            }
        }
    }

    fn ffn(&self, id: usize, pass: &mut Pass, h: &[f32]) -> Result<Vec<f32>> {
        let (n, d, eps) = (
            pass.rows.len(),
            pass.config.hidden_size,
            pass.config.rms_norm_eps,
        );
        let moe = match &self.ffn {
            Ffn::Dense(mlp) => return Ok(mlp.forward_dense(h, n)),
            Ffn::Moe(moe) => moe,
        };
        let latent = moe.down.rows();
        let mut z = vec![0f32; n * latent];
        moe.down.matmul(h, n, &mut z);
        // Routed on the hidden rows; the experts run in the latent space.
        let input = ExpertInput {
            rows: &z,
            width: latent,
            activation: Activation::Situ(pass.situ),
        };
        let mut routed = pass.routed.forward_on(id, h, n, input)?.routed;
        if let Some(norm) = &moe.norm {
            rms_norm_in_place(&mut routed, norm, eps);
        }
        let mut out = vec![0f32; n * d];
        moe.up.matmul(&routed, n, &mut out);
        if let Some(shared) = &moe.shared {
            for (o, s) in out.iter_mut().zip(shared.forward_shared(h, n)) {
                *o += s;
            }
        }
        Ok(out)
    }
}

/// The routed experts of MoE layer `p` as published: `w1` (gate) and `w3` (up)
/// `[moe_intermediate, latent]`, `w2` (down) `[latent, moe_intermediate]`, MXFP4
/// (`weight_packed` + `weight_scale`) or float (`weight`). Looked up by name, so their order
/// in the shard does not matter.
fn layer_experts(w: &Weights, config: &Config) -> Result<Vec<ExpertTensors>> {
    let experts = w.at("block_sparse_moe.experts");
    let suffix = if experts.contains("0.w1.weight_packed") {
        "weight_packed"
    } else {
        "weight"
    };
    (0..config.num_experts)
        .map(|e| {
            let tensor = |part: &str| {
                w.snapshot()
                    .tensor(&experts.name(&format!("{e}.{part}.{suffix}")))
            };
            ExpertTensors {
                gate: tensor("w1")?,
                up: tensor("w3")?,
                down: tensor("w2")?,
            }
            .checked(config.latent(), config.moe_intermediate_size)
        })
        .collect()
}

pub struct KimiK3 {
    config: Config,
    situ: Situ,
    embed: Matrix,
    output_mix: ResMix,
    final_norm: Vec<f32>,
    lm_head: Matrix,
    layers: Vec<Layer>,
    routed: Mutex<RoutedExperts>,
    /// Bytes of the weights above.
    resident: usize,
    stop: Vec<u32>,
}

impl KimiK3 {
    pub fn load(snapshot: &Snapshot, options: LoadOptions) -> Result<KimiK3> {
        let config = Config::read(snapshot)?;
        let stop = snapshot.stop_ids(&[], config.vocab_size)?;
        let prefix = tensor_prefix(snapshot)?;
        let (d, n_layers) = (config.hidden_size, config.num_hidden_layers);
        let weights = Weights::new(snapshot, options.dense_width);
        let root = weights.at(prefix.trim_end_matches('.'));
        let model = root.at("model");
        // The dense layers do not route, and K3 has no MTP head in the row after the last.
        let mut telemetry = RouteTrace::new(NAME, n_layers, config.num_experts)?;
        for l in 0..config.first_k_dense_replace {
            telemetry.drop_row(l);
        }
        telemetry.drop_row(n_layers);
        let mut routed = RoutedExperts::unprovisioned(options.store.width, telemetry);
        let mut layers = Vec::with_capacity(n_layers);
        let mut expert_tensors = Vec::with_capacity(n_layers);
        for (l, &is_kda) in config.kda_layers().iter().enumerate() {
            let w = model.at(&format!("layers.{l}"));
            let (layer, router) = Layer::load(&w, &config, l, is_kda)?;
            layers.push(layer);
            expert_tensors.push(routed.add_layer(l, router, || layer_experts(&w, &config))?);
        }
        let vocab = [config.vocab_size, d];
        let embed_name = model.name("embed_tokens.weight");
        let embed = weights.embedding(&embed_name, vocab)?;
        let output_mix = ResMix::load(&model, "output_attn_res", d, config.rms_norm_eps)?;
        let final_norm = model.vector("norm.weight", d)?;
        let tied = config.tie_word_embeddings == Some(true);
        let lm_head = weights.lm_head(&root.name("lm_head.weight"), &embed_name, tied, vocab)?;
        let resident = weights.resident_bytes();
        routed.provision(expert_tensors, &options.store, resident)?;
        Ok(KimiK3 {
            situ: config.situ(),
            embed,
            output_mix,
            final_norm,
            lm_head,
            layers,
            routed: Mutex::new(routed),
            resident,
            stop,
            config,
        })
    }

    /// One chunk of each sequence of a batch through every layer: the final-normalised
    /// hidden states of the rows `picked`.
    fn chunk(
        &self,
        rows: &Rows,
        states: &mut [&mut KimiState],
        routed: &mut RoutedExperts,
        picked: &[usize],
    ) -> Result<Vec<f32>> {
        let (d, vocab) = (self.config.hidden_size, self.config.vocab_size);
        let x = embed_tokens(&self.embed, &rows.tokens, vocab)?;
        let eps = self.config.rms_norm_eps;
        let mut stream = ResidualStream::new(x, d, self.config.block_size());
        let mut pass = Pass {
            config: &self.config,
            situ: self.situ,
            rows,
            routed,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            interrupt::checkpoint()?;
            let mut layer_states: Vec<_> = states.iter_mut().map(|s| &mut s.layers[l]).collect();
            layer.forward(l, &mut layer_states, &mut pass, &mut stream)?;
        }
        for (state, segment) in states.iter_mut().zip(&rows.segments) {
            state.position += segment.len();
        }
        let out = stream.output(&self.output_mix);
        Ok(final_norm(&out, &self.final_norm, eps, picked))
    }
}

/// Each sequence's state of one layer as the layer's kind (`pick`), or an error when one is
/// of the other kind (a state built for another checkpoint of the same engine).
fn of_kind<'s, T>(
    states: &'s mut [&mut MixerState],
    pick: impl Fn(&'s mut MixerState) -> Option<&'s mut T>,
) -> Result<Vec<&'s mut T>> {
    states
        .iter_mut()
        .map(|state| {
            pick(state)
                .ok_or_else(|| anyhow!("{NAME}: a layer's attention state does not match its kind"))
        })
        .collect()
}

impl Engine for KimiK3 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    fn new_state(&self) -> State {
        let layers = self
            .layers
            .iter()
            .map(|layer| match &layer.mixer {
                Mixer::Kda(kda) => MixerState::Kda(kda.state()),
                Mixer::Mla(_) => MixerState::Mla(LatentCache::new(
                    self.config.kv_lora_rank,
                    self.config.qk_rope_head_dim,
                )),
            })
            .collect();
        State::new(
            NAME,
            KimiState {
                layers,
                position: 0,
            },
        )
    }

    /// Every sequence's tokens go through in chunks of [`PREFILL_CHUNK`]: round `r` runs
    /// chunk `r` of each sequence that has one, side by side.
    fn forward(&self, batch: &mut [Step]) -> Result<Vec<Vec<f32>>> {
        Rows::of(batch)?;
        let asks: Vec<(&[u32], Logits)> = batch.iter().map(|s| (s.tokens, s.logits)).collect();
        let mut states = batch
            .iter_mut()
            .map(|step| step.state.downcast_mut::<KimiState>(NAME))
            .collect::<Result<Vec<_>>>()?;
        let d = self.config.hidden_size;
        let rounds = asks
            .iter()
            .map(|(t, _)| t.len().div_ceil(PREFILL_CHUNK))
            .max()
            .unwrap_or(0);
        let mut hidden: Vec<Vec<f32>> = vec![Vec::new(); asks.len()];
        // Each sequence's first row in the batch, so that telemetry sees batch rows.
        let starts: Vec<usize> = asks
            .iter()
            .scan(0, |at, (t, _)| {
                let start = *at;
                *at += t.len();
                Some(start)
            })
            .collect();
        let mut routed = self.routed();
        for round in 0..rounds {
            let (from, to) = (round * PREFILL_CHUNK, (round + 1) * PREFILL_CHUNK);
            let members: Vec<usize> = (0..asks.len())
                .filter(|&i| asks[i].0.len() > from)
                .collect();
            let parts: Vec<(&[u32], usize, Logits)> = members
                .iter()
                .map(|&i| {
                    let (tokens, logits) = asks[i];
                    (
                        &tokens[from..tokens.len().min(to)],
                        states[i].position,
                        logits,
                    )
                })
                .collect();
            let rows = Rows::from_parts(&parts);
            // Rows the logits come from: every row of an `All` step, the last row of a
            // `Last` step's last chunk; none of a chunk only the state needs.
            let mut picked = Vec::new();
            let mut owners = Vec::new();
            for (segment, &i) in rows.segments.iter().zip(&members) {
                let wanted = match asks[i].1 {
                    Logits::All => segment.rows.clone(),
                    Logits::Last if asks[i].0.len() <= to => segment.rows.end - 1..segment.rows.end,
                    Logits::Last => segment.rows.end..segment.rows.end,
                };
                owners.push((i, wanted.len()));
                picked.extend(wanted);
            }
            let mut chunk_states: Vec<&mut KimiState> = states
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| members.contains(i))
                .map(|(_, state)| &mut **state)
                .collect();
            let batch_rows = rows
                .segments
                .iter()
                .zip(&members)
                .flat_map(|(segment, &i)| {
                    let start = starts[i] + from;
                    (start..start + segment.len()).collect::<Vec<_>>()
                })
                .collect();
            routed.telemetry.map_rows(Some(batch_rows));
            let normed = self.chunk(&rows, &mut chunk_states, &mut routed, &picked);
            routed.telemetry.map_rows(None);
            let normed = normed?;
            let mut rest = &normed[..];
            for (i, count) in owners {
                let (mine, after) = rest.split_at(count * d);
                hidden[i].extend_from_slice(mine);
                rest = after;
            }
        }
        drop(routed);
        let counts: Vec<usize> = hidden.iter().map(|h| h.len() / d).collect();
        let logits = lm_head(&self.lm_head, &hidden.concat())?;
        let vocab = self.config.vocab_size;
        let mut rest = &logits[..];
        Ok(counts
            .into_iter()
            .map(|count| {
                let (mine, after) = rest.split_at(count * vocab);
                rest = after;
                mine.to_vec()
            })
            .collect())
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

    fn prompt_convention(&self) -> PromptConvention {
        // K3 prompts start with BOS. `<|open|>`, `<|close|>` and `<|sep|>` are special yet
        // structure an answer, so only the EOS ids (`<|end_of_msg|>`) end one.
        PromptConvention {
            bos: true,
            prefix: &[],
            chat_template: Some(CHAT_TEMPLATE),
            stop_on_special: false,
            tools: Some(ToolSyntax::KimiXtml),
            thinking: None,
        }
    }

    fn notes(&self) -> Vec<String> {
        let kda = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, Mixer::Kda(_)))
            .count();
        vec![format!(
            "[{NAME}] {kda} KDA + {} gated MLA layers, attention residuals every {} layers, {} routed experts (top-{}) in a {}-wide latent, prefill chunks of {PREFILL_CHUNK}",
            self.layers.len() - kda,
            self.config.block_size(),
            self.config.num_experts,
            self.config.num_experts_per_token,
            self.config.latent()
        )]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text() -> serde_json::Value {
        serde_json::json!({
            "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 4,
            "first_k_dense_replace": 1, "intermediate_size": 32,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 8,
            "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4,
            "num_experts": 8, "num_experts_per_token": 2, "moe_intermediate_size": 32,
            "routed_expert_hidden_size": 32, "num_shared_experts": 2, "attn_res_block_size": 2,
            "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "hidden_act": "situ", "num_expert_group": 1, "topk_group": 1,
            "eos_token_id": 7,
            "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                "num_heads": 2, "head_dim": 4, "short_conv_kernel_size": 4,
                "gate_lower_bound": -5.0, "use_full_rank_gate": true}
        })
    }

    fn parse(root: serde_json::Value) -> Result<Config> {
        Config::from_json(&root, Path::new("config.json"))
    }

    fn error(root: serde_json::Value) -> String {
        format!("{:#}", parse(root).unwrap_err())
    }

    #[test]
    fn text_config_or_bare_and_one_indexed_layers() {
        let bare = parse(text()).unwrap();
        assert_eq!(bare.kda_layers(), vec![true, true, true, false]);
        let wrapped = parse(serde_json::json!({
            "model_type": "kimi_k3", "eos_token_id": [3, 5], "text_config": text()
        }))
        .unwrap();
        assert_eq!(wrapped.situ().linear_beta, Some(25.0));
        assert_eq!(wrapped.groups(), (1, 1));
    }

    #[test]
    fn unsupported_values_are_named() {
        let with = |key: &str, value: serde_json::Value| {
            let mut t = text();
            t[key] = value;
            error(t)
        };
        assert!(with("hidden_act", "silu".into()).contains("hidden_act"));
        assert!(with("moe_router_activation_func", "softmax".into())
            .contains("moe_router_activation_func"));
        assert!(with("mla_use_nope", false.into()).contains("mla_use_nope"));
        assert!(
            with("attn_res_block_size", serde_json::Value::Null).contains("attn_res_block_size")
        );
        assert!(with("routed_expert_hidden_size", serde_json::Value::Null)
            .contains("routed_expert_hidden_size"));
        assert!(with("num_key_value_heads", 1.into()).contains("num_key_value_heads"));
        assert!(with("num_expert_group", 3.into()).contains("num_expert_group"));
        let missing = {
            let mut t = text();
            t.as_object_mut().unwrap().remove("activation_situ_beta");
            error(t)
        };
        assert!(missing.contains("activation_situ_beta"), "{missing}");
        let mut t = text();
        t["linear_attn_config"]["kda_layers"] = serde_json::json!([0, 1, 2]);
        assert!(error(t).contains("1-indexed"));
        let mut t = text();
        t["linear_attn_config"]["full_attn_layers"] = serde_json::json!([3]);
        assert!(error(t).contains("full_attn_layers"));
        let mut t = text();
        t["linear_attn_config"]["gate_lower_bound"] = serde_json::Value::Null;
        assert!(error(t).contains("gate_lower_bound"));
        let mut t = text();
        t["linear_attn_config"]["use_full_rank_gate"] = false.into();
        assert!(error(t).contains("use_full_rank_gate"));
    }

    #[test]
    fn quantization_config_is_the_releases() {
        let mut t = text();
        t["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}}}
        });
        assert!(parse(t.clone()).is_ok());
        t["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 16.into();
        assert!(error(t.clone()).contains("group_size 16"));
        t["quantization_config"]["format"] = "nvfp4-pack-quantized".into();
        assert!(error(t).contains("nvfp4"));
    }

    #[test]
    fn grouped_top_k_follows_use_grouped_topk() {
        let mut t = text();
        t["num_expert_group"] = 4.into();
        t["topk_group"] = 2.into();
        assert_eq!(parse(t.clone()).unwrap().groups(), (4, 2));
        t["use_grouped_topk"] = false.into();
        assert_eq!(parse(t).unwrap().groups(), (1, 1));
    }
}
