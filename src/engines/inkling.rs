//! Inkling (`InklingForCausalLM`; config `inkling_text`, or the text part of the release's
//! multimodal `inkling_mm_model`): hybrid sliding-window / global attention with their own
//! head counts and dims, no RoPE but a learned relative position bias mixed per token and
//! head from a bank of distance profiles, log-length logit scaling on the global layers,
//! four short causal convolutions per layer (keys, values, attention output, MLP output,
//! each with the residual inside), dense or sparse MLP per layer, and a sigmoid + bias
//! router whose shared experts are scored alongside the routed ones and normalised jointly
//! with them (the "shared-expert sink"). The final hidden state is divided by the muP width
//! multiplier before the head, whose logits are cut to the unpadded vocabulary.

use std::io::{self, Read, Write};
use std::sync::{Mutex, MutexGuard};

use anyhow::{anyhow, bail, Result};
use serde::Deserialize;

use super::layers::{
    add_in_place, embed_tokens, final_norm, lm_head, pre_norm_residual, rms_norm_in_place,
    AttentionShape, GatedMlp, Sublayer,
};
use super::moe::{Choice, RoutedExperts, Router};
use super::prompt::{PromptConvention, ToolSyntax};
use super::short_conv::{ConvState, ShortConv};
use super::state::{per_sequence, states_of, Rows, SequenceState, State, Step};
use super::state_io::{self, expect, part};
use super::weights::Weights;
use super::window_attention::{windowed_attention, DistanceBias, WindowKvCache};
use super::{lock, Engine, LoadOptions};
use crate::activation::Activation;
use crate::experts::ExpertTensors;
use crate::interrupt;
use crate::quant::Matrix;
use crate::route_trace::RouteTrace;
use crate::snapshot::Snapshot;

pub const NAME: &str = "inkling";

/// Name fragments of the tensors this engine reads only in f32, beyond what every engine
/// keeps (vectors, norms, routers, biases): the short-convolution taps and the relative
/// position bias bank (`rel_logits_proj.proj`), both read as vectors.
pub const KEPT_F32: &[&str] = &["conv", "rel_logits_proj"];

/// Inkling prompts have no BOS; answers contain content-part markers, so only the EOS ids
/// end them.
const PROMPT: PromptConvention = PromptConvention {
    bos: false,
    prefix: &[],
    chat_template: Some(CHAT_TEMPLATE),
    stop_on_special: false,
    tools: Some(ToolSyntax::InklingJson),
    thinking: None,
};

/// Inkling's chat prompt as colibri's gateway renders it: the thinking-effort hint (0: off)
/// before the first non-system message, each message as
/// `<|message_ROLE|><|content_text|>TEXT<|end_message|>`, then the model's turn opened in
/// content mode (with tools, the model's turn alone: it chooses a text block or a call).
/// A past call is the model's own block, `<|content_invoke_tool_json|>{"name",
/// "args"}`; the tools are declared in a first system message (`# Tools` and their JSON), a
/// layout no published source confirms.
const CHAT_TEMPLATE: &str = concat!(
    "{% set roles = {'user': 'user', 'system': 'system', 'assistant': 'model', 'tool': 'tool'} %}",
    "{% set ns = namespace(hinted=false) %}",
    "{% if tools %}<|message_system|><|content_text|># Tools\n{{ tools | tojson }}<|end_message|>{% endif %}",
    "{% for message in messages %}",
    "{% if message['role'] != 'system' and not ns.hinted %}",
    "<|message_system|><|content_text|>Thinking effort level: 0<|end_message|>",
    "{% set ns.hinted = true %}",
    "{% endif %}",
    "{% if message['content'] or not message['tool_calls'] %}",
    "<|message_{{ roles[message['role']] }}|><|content_text|>{{ message['content'] }}<|end_message|>",
    "{% endif %}",
    "{% for call in message['tool_calls'] or [] %}",
    "<|message_model|><|content_invoke_tool_json|>",
    "{{ {'name': call['function']['name'], 'args': call['function']['arguments']} | tojson }}<|end_message|>",
    "{% endfor %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}<|message_model|>{% if not tools %}<|content_text|>{% endif %}{% endif %}",
);

/// The keys of the text config this engine reads. Missing keys take `InklingTextConfig`'s
/// defaults (the 975B model's values).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Config {
    pub vocab_size: usize,
    pub unpadded_vocab_size: Option<usize>,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub swa_num_attention_heads: usize,
    pub swa_num_key_value_heads: usize,
    pub swa_head_dim: usize,
    #[serde(alias = "sliding_window")]
    pub sliding_window_size: usize,
    pub d_rel: usize,
    pub rel_extent: usize,
    pub log_scaling_n_floor: Option<f64>,
    pub log_scaling_alpha: f64,
    pub layer_types: Option<Vec<String>>,
    pub local_layer_ids: Option<Vec<usize>>,
    pub mlp_layer_types: Option<Vec<String>>,
    pub dense_mlp_idx: Option<usize>,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub dense_intermediate_size: Option<usize>,
    pub conv_kernel_size: Option<usize>,
    pub sconv_kernel_size: Option<usize>,
    pub rms_norm_eps: f64,
    pub hidden_act: Option<String>,
    #[serde(alias = "num_local_experts")]
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub route_scale: f64,
    #[serde(alias = "embedding_multiplier")]
    pub logits_mup_width_multiplier: f64,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            vocab_size: 201_024,
            unpadded_vocab_size: None,
            hidden_size: 6144,
            num_hidden_layers: 66,
            num_attention_heads: 64,
            num_key_value_heads: 8,
            head_dim: 128,
            swa_num_attention_heads: 64,
            swa_num_key_value_heads: 16,
            swa_head_dim: 128,
            sliding_window_size: 512,
            d_rel: 16,
            rel_extent: 1024,
            log_scaling_n_floor: None,
            log_scaling_alpha: 0.1,
            layer_types: None,
            local_layer_ids: None,
            mlp_layer_types: None,
            dense_mlp_idx: None,
            intermediate_size: 24_576,
            moe_intermediate_size: 3072,
            dense_intermediate_size: None,
            conv_kernel_size: None,
            sconv_kernel_size: None,
            rms_norm_eps: 1e-6,
            hidden_act: None,
            n_routed_experts: 256,
            num_experts_per_tok: 6,
            n_shared_experts: 2,
            route_scale: 8.0,
            logits_mup_width_multiplier: 24.0,
        }
    }
}

/// What the config says about one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LayerKind {
    sliding: bool,
    sparse: bool,
}

impl Config {
    /// The text config of `snapshot`: `text_config` when the file has one (the multimodal
    /// release schema), else the file itself.
    pub fn read(snapshot: &Snapshot) -> Result<Config> {
        let path = snapshot.dir().join("config.json");
        let config = match snapshot.config_json().get("text_config") {
            Some(text) if !text.is_null() => serde_json::from_value(text.clone())
                .map_err(|err| anyhow!("{}: text_config: {err}", path.display()))?,
            _ => snapshot.config()?,
        };
        Ok(config)
    }

    /// The rows of the usage history that never route: the dense layers, and the row after
    /// the last layer (Inkling has no MTP head; transformers ignores `model.mtp.*`).
    pub fn non_routing_rows(&self) -> Result<Vec<usize>> {
        let kinds = self.layer_kinds()?;
        let dense = kinds.iter().enumerate().filter(|(_, k)| !k.sparse);
        Ok(dense
            .map(|(l, _)| l)
            .chain([self.num_hidden_layers])
            .collect())
    }

    /// Per layer: sliding-window or global attention, sparse or dense MLP, as
    /// `InklingTextConfig` derives them (`layer_types`, else `local_layer_ids`, else every
    /// sixth layer global; `mlp_layer_types`, else the first `dense_mlp_idx` layers dense).
    fn layer_kinds(&self) -> Result<Vec<LayerKind>> {
        let n = self.num_hidden_layers;
        let listed = |key: &str, len: usize| -> Result<()> {
            if len != n {
                bail!("config.json: {key} has {len} entries for {n} layers");
            }
            Ok(())
        };
        let sliding: Vec<bool> = match (&self.layer_types, &self.local_layer_ids) {
            (Some(types), _) => {
                listed("layer_types", types.len())?;
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "hybrid_sliding" => Ok(true),
                        "hybrid" => Ok(false),
                        other => bail!(
                            "config.json: layer_types entry {other:?} is not \"hybrid\" or \"hybrid_sliding\""
                        ),
                    })
                    .collect::<Result<_>>()?
            }
            (None, Some(local)) => {
                if let Some(bad) = local.iter().find(|&&i| i >= n) {
                    bail!(
                        "config.json: local_layer_ids names layer {bad}, but there are {n} layers"
                    );
                }
                (0..n).map(|i| local.contains(&i)).collect()
            }
            (None, None) => (0..n).map(|i| (i + 1) % 6 != 0).collect(),
        };
        let sparse: Vec<bool> = match &self.mlp_layer_types {
            Some(types) => {
                listed("mlp_layer_types", types.len())?;
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sparse" => Ok(true),
                        "dense" => Ok(false),
                        other => bail!(
                            "config.json: mlp_layer_types entry {other:?} is not \"dense\" or \"sparse\""
                        ),
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                let dense = self.dense_mlp_idx.unwrap_or(0);
                (0..n).map(|i| i >= dense).collect()
            }
        };
        Ok(sliding
            .into_iter()
            .zip(sparse)
            .map(|(sliding, sparse)| LayerKind { sliding, sparse })
            .collect())
    }

    /// `(dense, moe)` intermediate widths. Release configs carry `dense_intermediate_size`
    /// and then `intermediate_size` is the experts' width; configs saved by transformers
    /// carry `intermediate_size` (dense) and `moe_intermediate_size`.
    fn intermediate_sizes(&self) -> (usize, usize) {
        match self.dense_intermediate_size {
            Some(dense) => (dense, self.intermediate_size),
            None => (self.intermediate_size, self.moe_intermediate_size),
        }
    }

    /// `conv_kernel_size`, or the checkpoints' `sconv_kernel_size`, or 4.
    fn conv_kernel(&self) -> Result<usize> {
        match (self.conv_kernel_size, self.sconv_kernel_size) {
            (Some(a), Some(b)) if a != b => {
                bail!("config.json: conv_kernel_size ({a}) and sconv_kernel_size ({b}) disagree")
            }
            (Some(k), _) | (None, Some(k)) => Ok(k),
            (None, None) => Ok(4),
        }
    }

    /// Logits kept: the head's rows up to `unpadded_vocab_size`.
    fn logit_count(&self) -> usize {
        self.unpadded_vocab_size
            .map_or(self.vocab_size, |u| u.min(self.vocab_size))
    }

    /// `log_scaling_n_floor` when the scaling is on. A floor of zero or below is read as
    /// "off", as colibri reads it: transformers would divide by it.
    fn log_floor(&self) -> Option<f64> {
        self.log_scaling_n_floor.filter(|&f| f > 0.0)
    }

    fn validate(&self) -> Result<()> {
        for (heads, kv, key) in [
            (
                self.num_attention_heads,
                self.num_key_value_heads,
                "num_attention_heads / num_key_value_heads",
            ),
            (
                self.swa_num_attention_heads,
                self.swa_num_key_value_heads,
                "swa_num_attention_heads / swa_num_key_value_heads",
            ),
        ] {
            if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
                bail!("config.json: {key} ({heads} / {kv}): query heads must be a positive multiple of key/value heads");
            }
        }
        if self.head_dim == 0 || self.swa_head_dim == 0 {
            bail!("config.json: head_dim and swa_head_dim must be positive");
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts {
            bail!(
                "config.json: num_experts_per_tok ({}) must be between 1 and n_routed_experts ({})",
                self.num_experts_per_tok,
                self.n_routed_experts
            );
        }
        if self.n_shared_experts == 0 {
            bail!("config.json: n_shared_experts must be at least 1 (the router scores the shared experts alongside the routed ones)");
        }
        if self.sliding_window_size == 0 || self.rel_extent == 0 {
            bail!("config.json: sliding_window_size and rel_extent must be positive");
        }
        if self.conv_kernel()? == 0 {
            bail!("config.json: conv_kernel_size must be positive");
        }
        if self.logits_mup_width_multiplier <= 0.0 {
            bail!("config.json: logits_mup_width_multiplier must be positive");
        }
        if let Some(act) = self.hidden_act.as_deref() {
            if act != "silu" {
                bail!(
                    "config.json: hidden_act {act:?} is not supported by inkling (only \"silu\")"
                );
            }
        }
        Ok(())
    }
}

/// Where the text model's tensors live: `model.` (`InklingForCausalLM`) or
/// `model.language_model.` (`InklingForConditionalGeneration`), and the embedding norm,
/// which transformers >= 5.18 keeps inside the embedding module.
#[derive(Debug, PartialEq, Eq)]
struct Names {
    prefix: &'static str,
    embed_norm: String,
}

impl Names {
    fn find(contains: impl Fn(&str) -> bool) -> Result<Names> {
        let prefix = if contains("model.language_model.embed_tokens.weight") {
            "model.language_model."
        } else {
            "model."
        };
        let candidates = [
            format!("{prefix}embed_tokens.embed_norm.weight"),
            format!("{prefix}embed_norm.weight"),
        ];
        match candidates.iter().find(|name| contains(name)) {
            Some(name) => Ok(Names {
                prefix,
                embed_norm: name.clone(),
            }),
            None => bail!(
                "no embedding norm: expected tensor {} or {}",
                candidates[0],
                candidates[1]
            ),
        }
    }
}

struct Attention {
    shape: AttentionShape,
    /// The window for sliding layers; `None` for global ones.
    window: Option<usize>,
    q_proj: Matrix,
    k_proj: Matrix,
    v_proj: Matrix,
    r_proj: Matrix,
    o_proj: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    /// `rel_logits_proj.proj`, `[d_rel, extent]`: bias profiles over backward distance.
    rel_bank: Vec<f32>,
    extent: usize,
    k_conv: ShortConv,
    v_conv: ShortConv,
}

enum Mlp {
    Dense {
        mlp: Box<GatedMlp>,
        global_scale: f32,
    },
    /// The shared experts of a sparse layer; its router (which weighs them too) and its
    /// routed experts are in [`RoutedExperts`].
    Sparse { shared: Vec<GatedMlp> },
}

struct Layer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    attention: Attention,
    attn_conv: ShortConv,
    mlp: Mlp,
    mlp_conv: ShortConv,
}

/// What a layer carries from one forward to the next.
#[derive(Clone)]
struct LayerState {
    kv: WindowKvCache,
    k_conv: ConvState,
    v_conv: ConvState,
    attn_conv: ConvState,
    mlp_conv: ConvState,
}

pub struct Inkling {
    config: Config,
    embed: Matrix,
    embed_norm: Vec<f32>,
    final_norm: Vec<f32>,
    lm_head: Matrix,
    layers: Vec<Layer>,
    routed: Mutex<RoutedExperts>,
    /// Bytes of the weights above.
    resident: usize,
    /// The ids that end a generation (`eos_token_id`).
    stop: Vec<u32>,
}

/// transformers' `InklingConfig` default `eos_token_id`, for a `config.json` without one.
const DEFAULT_EOS: &[u32] = &[2];

impl Inkling {
    pub fn load(snapshot: &Snapshot, options: LoadOptions) -> Result<Inkling> {
        let config = Config::read(snapshot)?;
        config.validate()?;
        let stop = snapshot.stop_ids(DEFAULT_EOS, config.logit_count())?;
        let names = Names::find(|name| snapshot.contains(name))
            .map_err(|err| anyhow!("{}: {err}", snapshot.dir().display()))?;
        super::check_config(
            snapshot,
            &format!("{}layers.", names.prefix),
            config.num_hidden_layers,
            0,
            ("n_routed_experts", config.n_routed_experts),
            config.rms_norm_eps,
        )?;
        let kinds = config.layer_kinds()?;
        let d = config.hidden_size;
        let (dense_inter, moe_inter) = config.intermediate_sizes();
        let kernel = config.conv_kernel()?;
        let (n_experts, n_shared) = (config.n_routed_experts, config.n_shared_experts);
        let weights = Weights::new(snapshot, options.dense_width);
        let model = weights.at(names.prefix.trim_end_matches('.'));
        let conv = |w: &Weights, name: &str, channels: usize| {
            ShortConv::load(w, &format!("{name}.conv1d.weight"), channels, kernel)
        };
        let mut telemetry = RouteTrace::new(NAME, config.num_hidden_layers, n_experts)?;
        for l in config.non_routing_rows()? {
            telemetry.drop_row(l);
        }
        let mut routed = RoutedExperts::unprovisioned(options.store.width, telemetry);

        let mut layers = Vec::with_capacity(kinds.len());
        let mut expert_tensors = Vec::with_capacity(kinds.len());
        for (l, kind) in kinds.iter().enumerate() {
            let w = model.at(&format!("layers.{l}"));
            let (heads, kv_heads, hd) = if kind.sliding {
                (
                    config.swa_num_attention_heads,
                    config.swa_num_key_value_heads,
                    config.swa_head_dim,
                )
            } else {
                (
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                )
            };
            let extent = if kind.sliding {
                config.sliding_window_size
            } else {
                config.rel_extent
            };
            let a = w.at("self_attn");
            let attention = Attention {
                shape: AttentionShape {
                    heads,
                    kv_heads,
                    head_dim: hd,
                    // q and k are RMS-normalised per head, so the reference scales by 1/d.
                    scale: 1.0 / hd as f32,
                },
                window: kind.sliding.then_some(config.sliding_window_size),
                q_proj: a.matrix("q_proj.weight", [heads * hd, d])?,
                k_proj: a.matrix("k_proj.weight", [kv_heads * hd, d])?,
                v_proj: a.matrix("v_proj.weight", [kv_heads * hd, d])?,
                r_proj: a.matrix("r_proj.weight", [heads * config.d_rel, d])?,
                o_proj: a.matrix("o_proj.weight", [d, heads * hd])?,
                q_norm: a.vector("q_norm.weight", hd)?,
                k_norm: a.vector("k_norm.weight", hd)?,
                rel_bank: a.flat("rel_logits_proj.proj", &[config.d_rel, extent])?,
                extent,
                k_conv: conv(&a, "k_sconv", kv_heads * hd)?,
                v_conv: conv(&a, "v_sconv", kv_heads * hd)?,
            };
            let m = w.at("mlp");
            let (mlp, experts) = if kind.sparse {
                let gate_up = m.view("experts.gate_up_proj", &[n_experts, 2 * moe_inter, d])?;
                let down = m.view("experts.down_proj", &[n_experts, d, moe_inter])?;
                let experts = (0..n_experts)
                    .map(|e| ExpertTensors::from_fused(&gate_up, &down, e)?.checked(d, moe_inter))
                    .collect::<Result<Vec<_>>>()?;
                let shared = |part: &str, shape: [usize; 3]| {
                    m.view(&format!("shared_experts.{part}"), &shape)
                };
                let gate = shared("gate_proj", [n_shared, moe_inter, d])?;
                let up = shared("up_proj", [n_shared, moe_inter, d])?;
                let down_shared = shared("down_proj", [n_shared, d, moe_inter])?;
                let shared = (0..n_shared)
                    .map(|j| {
                        Ok(GatedMlp::from_matrices(
                            Activation::SwiGlu,
                            m.dense_from(&gate.select(j)?)?,
                            m.dense_from(&up.select(j)?)?,
                            m.dense_from(&down_shared.select(j)?)?,
                        ))
                    })
                    .collect::<Result<_>>()?;
                let scale = (config.route_scale as f32) * learned_scale(&m, "gate.global_scale")?;
                routed.set_router(
                    l,
                    Router {
                        weight: m.matrix_f32("gate.weight", [n_experts + n_shared, d])?,
                        choice: Choice::Sink {
                            routed: n_experts,
                            bias: m.vector("gate.e_score_correction_bias", n_experts)?,
                            top_k: config.num_experts_per_tok,
                            scale,
                        },
                    },
                );
                (Mlp::Sparse { shared }, experts)
            } else {
                let mlp = Mlp::Dense {
                    mlp: Box::new(GatedMlp::load(&m, (d, dense_inter), Activation::SwiGlu)?),
                    global_scale: learned_scale(&m, "global_scale")?,
                };
                (mlp, Vec::new())
            };
            layers.push(Layer {
                input_norm: w.vector("input_layernorm.weight", d)?,
                post_attention_norm: w.vector("post_attention_layernorm.weight", d)?,
                attention,
                attn_conv: conv(&w, "attn_sconv", d)?,
                mlp,
                mlp_conv: conv(&w, "mlp_sconv", d)?,
            });
            expert_tensors.push(experts);
        }

        let vocab = [config.vocab_size, d];
        let embed = model.embedding("embed_tokens.weight", vocab)?;
        let embed_norm = weights.vector(&names.embed_norm, d)?;
        let final_norm = model.vector("norm.weight", d)?;
        let lm_head = weights.embedding("lm_head.weight", vocab)?;
        let resident = weights.resident_bytes();
        routed.provision(expert_tensors, &options.store, resident)?;
        Ok(Inkling {
            stop,
            embed,
            embed_norm,
            final_norm,
            lm_head,
            layers,
            routed: Mutex::new(routed),
            resident,
            config,
        })
    }
}

/// A conversation's state: what each layer carries, and the positions held.
#[derive(Clone)]
struct InklingState {
    layers: Vec<LayerState>,
    position: usize,
}

impl SequenceState for InklingState {
    fn position(&self) -> usize {
        self.position
    }

    fn size_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                l.kv.size_bytes()
                    + [&l.k_conv, &l.v_conv, &l.attn_conv, &l.mlp_conv]
                        .iter()
                        .map(|c| c.size_bytes())
                        .sum::<usize>()
            })
            .sum()
    }

    /// The short convolutions carry only their last inputs, so only an empty state is
    /// exact short of the whole one.
    fn can_truncate(&self, len: usize) -> bool {
        len == 0
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        if len > 0 {
            bail!("{NAME} cannot go back to position {len} of {}: its short convolutions keep only their last inputs (start a new state, or fork one at the position wanted)", self.position);
        }
        for state in &mut self.layers {
            state.kv.clear();
            state.k_conv.clear();
            state.v_conv.clear();
            state.attn_conv.clear();
            state.mlp_conv.clear();
        }
        self.position = 0;
        Ok(())
    }

    /// The position and the number of layers, then each layer's KV cache and its k, v,
    /// attention and MLP convolutions' inputs.
    fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.position)?;
        state_io::write_len(out, self.layers.len())?;
        for layer in &self.layers {
            layer.kv.save(out)?;
            for conv in [
                &layer.k_conv,
                &layer.v_conv,
                &layer.attn_conv,
                &layer.mlp_conv,
            ] {
                conv.save(out)?;
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

impl LayerState {
    /// What [`InklingState::save`] wrote for one layer of a state at `position`.
    fn restore(&mut self, input: &mut dyn Read, position: usize) -> Result<()> {
        part("KV cache", self.kv.restore(input))?;
        expect("positions in the KV cache", self.kv.positions(), position)?;
        part("k convolution", self.k_conv.restore(input))?;
        part("v convolution", self.v_conv.restore(input))?;
        part("attention convolution", self.attn_conv.restore(input))?;
        part("MLP convolution", self.mlp_conv.restore(input))
    }
}

/// What every layer of one forward shares: the configuration, the batch's rows, and the
/// routed experts.
struct Pass<'a> {
    config: &'a Config,
    rows: &'a Rows,
    routed: &'a mut RoutedExperts,
}

impl Layer {
    /// `x += conv(attention(norm(x))); x += conv(ffn(norm(x)))` for the rows of `x`, each
    /// short convolution with its residual inside, over each sequence's rows with its own
    /// `states`; `id` is the layer's index.
    fn forward(
        &self,
        id: usize,
        states: &mut [&mut LayerState],
        pass: &mut Pass,
        x: &mut [f32],
    ) -> Result<()> {
        let norms = [&self.input_norm[..], &self.post_attention_norm];
        let d = pass.config.hidden_size;
        pre_norm_residual(x, norms, pass.config.rms_norm_eps, |step, h| {
            let (out, conv, pick): (_, _, fn(&mut LayerState) -> &mut ConvState) = match step {
                Sublayer::Attention => (self.attention(states, pass, h), &self.attn_conv, |s| {
                    &mut s.attn_conv
                }),
                Sublayer::Ffn => (self.ffn(id, pass, h)?, &self.mlp_conv, |s| &mut s.mlp_conv),
            };
            let mut convolved = vec![0f32; out.len()];
            per_sequence(
                pass.rows,
                states,
                &mut convolved,
                d,
                |segment, state, part| {
                    part.copy_from_slice(&conv.forward(
                        segment.of(&out, d),
                        segment.len(),
                        pick(state),
                    ));
                },
            );
            Ok(with_residual(convolved, &out))
        })
    }

    /// Self-attention over the normalised rows `h`, before the output convolution.
    fn attention(&self, states: &mut [&mut LayerState], pass: &Pass, h: &[f32]) -> Vec<f32> {
        let (config, n) = (pass.config, pass.rows.len());
        let d = config.hidden_size;
        let attn = &self.attention;
        let AttentionShape {
            heads,
            kv_heads,
            head_dim: hd,
            ..
        } = attn.shape;
        let d_rel = config.d_rel;
        let mut q = vec![0f32; n * heads * hd];
        let mut k = vec![0f32; n * kv_heads * hd];
        let mut v = vec![0f32; n * kv_heads * hd];
        let mut r = vec![0f32; n * heads * d_rel];
        attn.q_proj.matmul(h, n, &mut q);
        attn.k_proj.matmul(h, n, &mut k);
        attn.v_proj.matmul(h, n, &mut v);
        attn.r_proj.matmul(h, n, &mut r);
        let (q_width, kv_width) = (heads * hd, kv_heads * hd);
        let mut context = vec![0f32; n * q_width];
        per_sequence(
            pass.rows,
            states,
            &mut context,
            q_width,
            |segment, state, context| {
                let rows = segment.len();
                let (k, v) = (segment.of(&k, kv_width), segment.of(&v, kv_width));
                let mut k = with_residual(attn.k_conv.forward(k, rows, &mut state.k_conv), k);
                let v = with_residual(attn.v_conv.forward(v, rows, &mut state.v_conv), v);
                let mut q = segment.of(&q, q_width).to_vec();
                // The norm weights are one head wide, so each head is normalised on its own.
                rms_norm_in_place(&mut q, &attn.q_norm, config.rms_norm_eps);
                rms_norm_in_place(&mut k, &attn.k_norm, config.rms_norm_eps);
                let tau: Vec<f32> = (segment.start..segment.start + rows)
                    .map(|position| match (attn.window, config.log_floor()) {
                        (None, Some(floor)) => {
                            log_length_scale(position, floor, config.log_scaling_alpha)
                        }
                        _ => 1.0,
                    })
                    .collect();
                for (row, &scale) in q.chunks_exact_mut(q_width).zip(&tau) {
                    if scale != 1.0 {
                        row.iter_mut().for_each(|x| *x *= scale);
                    }
                }
                state.kv.push(&k, &v);
                let bias = RelativeBias {
                    states: segment.of(&r, heads * d_rel),
                    bank: &attn.rel_bank,
                    extent: attn.extent,
                    d_rel,
                    heads,
                    tau: &tau,
                };
                windowed_attention(
                    attn.shape,
                    attn.window,
                    &q,
                    rows,
                    &state.kv,
                    Some(&bias),
                    context,
                );
            },
        );
        let mut out = vec![0f32; n * d];
        attn.o_proj.matmul(&context, n, &mut out);
        out
    }

    /// The MLP of layer `id` (dense or sparse) over the normalised rows `h`, before the
    /// output convolution.
    fn ffn(&self, id: usize, pass: &mut Pass, h: &[f32]) -> Result<Vec<f32>> {
        let (config, n) = (pass.config, pass.rows.len());
        let d = config.hidden_size;
        let shared = match &self.mlp {
            Mlp::Dense { mlp, global_scale } => {
                let mut out = mlp.forward_dense(h, n);
                out.iter_mut().for_each(|x| *x *= global_scale);
                return Ok(out);
            }
            Mlp::Sparse { shared } => shared,
        };
        let moe = pass.routed.forward(id, h, n)?;
        let mut out = moe.routed;
        // The router weighs the shared experts together with the routed ones.
        let mut shared_sum = vec![0f32; n * d];
        for (j, expert) in shared.iter().enumerate() {
            let y = expert.forward_shared(h, n);
            for ((sum, y), weights) in shared_sum
                .chunks_exact_mut(d)
                .zip(y.chunks_exact(d))
                .zip(&moe.shared_weights)
            {
                for (s, &v) in sum.iter_mut().zip(y) {
                    *s += v * weights[j];
                }
            }
        }
        add_in_place(&mut out, &shared_sum);
        Ok(out)
    }
}

/// `tau = 1 + alpha * ln(max((position + 1) / floor, 1))`, in f32 as the reference computes it.
fn log_length_scale(position: usize, floor: f64, alpha: f64) -> f32 {
    let ratio = ((position + 1) as f32 / floor as f32).max(1.0);
    1.0 + alpha as f32 * ratio.ln()
}

/// The learned relative position bias of one attention call: row `t`, head `h` mixes the
/// bank's distance profiles with its relative state `r[t, h, :]`; zero at or beyond the
/// extent; scaled by the row's log-length factor like the query.
struct RelativeBias<'a> {
    states: &'a [f32],
    bank: &'a [f32],
    extent: usize,
    d_rel: usize,
    heads: usize,
    tau: &'a [f32],
}

impl DistanceBias for RelativeBias<'_> {
    fn fill(&self, token: usize, head: usize, out: &mut [f32]) {
        let state = &self.states[(token * self.heads + head) * self.d_rel..][..self.d_rel];
        let tau = self.tau[token];
        for (distance, b) in out.iter_mut().enumerate() {
            *b = if distance < self.extent {
                let mix: f32 = state
                    .iter()
                    .enumerate()
                    .map(|(j, &s)| s * self.bank[j * self.extent + distance])
                    .sum();
                mix * tau
            } else {
                0.0
            };
        }
    }
}

/// A scalar parameter (`global_scale`, stored as `[1]`); 1 when the checkpoint has none,
/// as transformers initialises it.
fn learned_scale(w: &Weights, name: &str) -> Result<f32> {
    if w.contains(name) {
        w.scalar(name)
    } else {
        Ok(1.0)
    }
}

/// The short convolutions keep the residual inside: `conv(x) + x`.
fn with_residual(mut conv: Vec<f32>, input: &[f32]) -> Vec<f32> {
    add_in_place(&mut conv, input);
    conv
}

impl Engine for Inkling {
    fn name(&self) -> &'static str {
        NAME
    }

    fn prompt_convention(&self) -> PromptConvention {
        PROMPT
    }

    fn vocab_size(&self) -> usize {
        self.config.logit_count()
    }

    fn new_state(&self) -> State {
        let layers = self
            .layers
            .iter()
            .map(|layer| {
                let a = &layer.attention;
                LayerState {
                    kv: WindowKvCache::new(a.shape.kv_heads, a.shape.head_dim, a.window),
                    k_conv: a.k_conv.state(),
                    v_conv: a.v_conv.state(),
                    attn_conv: layer.attn_conv.state(),
                    mlp_conv: layer.mlp_conv.state(),
                }
            })
            .collect();
        State::new(
            NAME,
            InklingState {
                layers,
                position: 0,
            },
        )
    }

    fn forward(&self, batch: &mut [Step]) -> Result<Vec<Vec<f32>>> {
        let (rows, mut states) = states_of::<InklingState>(batch, NAME)?;
        let vocab = self.config.vocab_size;
        let eps = self.config.rms_norm_eps;
        let mut x = embed_tokens(&self.embed, &rows.tokens, vocab)?;
        rms_norm_in_place(&mut x, &self.embed_norm, eps);
        let mut routed = self.routed();
        let mut pass = Pass {
            config: &self.config,
            rows: &rows,
            routed: &mut routed,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            interrupt::checkpoint()?;
            let mut layer_states: Vec<_> = states.iter_mut().map(|s| &mut s.layers[l]).collect();
            layer.forward(l, &mut layer_states, &mut pass, &mut x)?;
        }
        for (state, segment) in states.iter_mut().zip(&rows.segments) {
            state.position += segment.len();
        }
        let mut normed = final_norm(&x, &self.final_norm, eps, &rows.output_rows());
        let multiplier = self.config.logits_mup_width_multiplier as f32;
        normed.iter_mut().for_each(|v| *v /= multiplier);
        let logits = lm_head(&self.lm_head, &normed)?;
        let kept = self.config.logit_count();
        let logits = if kept == vocab {
            logits
        } else {
            logits
                .chunks_exact(vocab)
                .flat_map(|row| &row[..kept])
                .copied()
                .collect()
        };
        Ok(rows.split_logits(logits, kept))
    }

    fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    fn routed(&self) -> MutexGuard<'_, RoutedExperts> {
        lock(&self.routed)
    }

    fn resident_bytes(&self) -> usize {
        self.resident
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: serde_json::Value) -> Config {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn layer_kinds_follow_the_reference_rules() {
        let defaults = config(serde_json::json!({"num_hidden_layers": 12, "dense_mlp_idx": 2}));
        let kinds = defaults.layer_kinds().unwrap();
        let global: Vec<usize> = (0..12).filter(|&i| !kinds[i].sliding).collect();
        assert_eq!(global, vec![5, 11]);
        assert!(!kinds[0].sparse && !kinds[1].sparse && kinds[2].sparse);

        let listed = config(serde_json::json!({
            "num_hidden_layers": 3,
            "local_layer_ids": [0, 2],
            "layer_types": ["hybrid", "hybrid_sliding", "hybrid"],
            "mlp_layer_types": ["sparse", "dense", "sparse"],
            "dense_mlp_idx": 3
        }));
        let kinds = listed.layer_kinds().unwrap();
        assert_eq!(
            kinds
                .iter()
                .map(|k| (k.sliding, k.sparse))
                .collect::<Vec<_>>(),
            vec![(false, true), (true, false), (false, true)]
        );

        let local = config(serde_json::json!({"num_hidden_layers": 3, "local_layer_ids": [1]}));
        let kinds = local.layer_kinds().unwrap();
        assert_eq!(
            kinds.iter().map(|k| k.sliding).collect::<Vec<_>>(),
            vec![false, true, false]
        );
        assert!(kinds.iter().all(|k| k.sparse));

        let wrong = config(
            serde_json::json!({"num_hidden_layers": 2, "layer_types": ["hybrid", "full_attention"]}),
        );
        assert!(wrong
            .layer_kinds()
            .unwrap_err()
            .to_string()
            .contains("full_attention"));
    }

    #[test]
    fn intermediate_sizes_follow_the_schema() {
        let release = config(
            serde_json::json!({"intermediate_size": 3072, "dense_intermediate_size": 24576}),
        );
        assert_eq!(release.intermediate_sizes(), (24576, 3072));
        let saved =
            config(serde_json::json!({"intermediate_size": 96, "moe_intermediate_size": 16}));
        assert_eq!(saved.intermediate_sizes(), (96, 16));
        assert_eq!(
            config(serde_json::json!({})).intermediate_sizes(),
            (24576, 3072)
        );
    }

    #[test]
    fn aliases_kernel_and_vocabulary() {
        let c = config(serde_json::json!({
            "sconv_kernel_size": 3,
            "sliding_window": 7,
            "num_local_experts": 9,
            "vocab_size": 256,
            "unpadded_vocab_size": 250,
            "log_scaling_n_floor": 0
        }));
        assert_eq!(c.conv_kernel().unwrap(), 3);
        assert_eq!((c.sliding_window_size, c.n_routed_experts), (7, 9));
        assert_eq!(c.logit_count(), 250);
        assert_eq!(c.log_floor(), None);
        assert_eq!(config(serde_json::json!({})).conv_kernel().unwrap(), 4);
        let clash = config(serde_json::json!({"conv_kernel_size": 4, "sconv_kernel_size": 3}));
        assert!(clash.conv_kernel().is_err());
        let null = config(serde_json::json!({"unpadded_vocab_size": null, "vocab_size": 64}));
        assert_eq!(null.logit_count(), 64);
    }

    #[test]
    fn tensor_name_variants() {
        let find = |present: &[&str]| {
            let present: Vec<String> = present.iter().map(|s| s.to_string()).collect();
            Names::find(move |name| present.iter().any(|p| p == name))
        };
        let v5 = find(&[
            "model.embed_tokens.weight",
            "model.embed_tokens.embed_norm.weight",
        ])
        .unwrap();
        assert_eq!(
            (v5.prefix, v5.embed_norm.as_str()),
            ("model.", "model.embed_tokens.embed_norm.weight")
        );
        let legacy = find(&["model.embed_tokens.weight", "model.embed_norm.weight"]).unwrap();
        assert_eq!(legacy.embed_norm, "model.embed_norm.weight");
        let mm = find(&[
            "model.language_model.embed_tokens.weight",
            "model.language_model.embed_norm.weight",
        ])
        .unwrap();
        assert_eq!(mm.prefix, "model.language_model.");
        assert_eq!(mm.embed_norm, "model.language_model.embed_norm.weight");
        let missing = find(&["model.embed_tokens.weight"])
            .unwrap_err()
            .to_string();
        assert!(
            missing.contains("model.embed_tokens.embed_norm.weight")
                && missing.contains("model.embed_norm.weight")
        );
    }

    #[test]
    fn log_length_scale_starts_at_the_floor() {
        assert_eq!(log_length_scale(0, 8.0, 0.1), 1.0);
        assert_eq!(log_length_scale(7, 8.0, 0.1), 1.0);
        assert!((log_length_scale(15, 8.0, 0.1) - (1.0 + 0.1 * 2f32.ln())).abs() < 1e-6);
    }
}
