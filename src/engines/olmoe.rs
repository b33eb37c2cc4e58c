//! OLMoE (`OlmoeForCausalLM`): every layer is grouped-query attention with RMSNorm over the
//! whole q and k projections and rotate-half RoPE, then a softmax-routed top-k MoE of
//! SwiGLU experts. No dense layers, no shared experts, no router bias.

use std::io::{self, Read, Write};
use std::sync::{Mutex, MutexGuard};

use anyhow::{bail, Result};
use serde::Deserialize;

use super::layers::{
    embed_tokens, final_norm, lm_head, pre_norm_residual, rms_norm_in_place, AttentionShape, Rope,
    Sublayer,
};
use super::moe::{Choice, RoutedExperts, Router};
use super::prompt::PromptConvention;
use super::state::{per_sequence, states_of, Rows, SequenceState, State, Step};
use super::state_io::{self, expect, part};
use super::weights::Weights;
use super::window_attention::{windowed_attention, WindowKvCache};
use super::{lock, Engine, LoadOptions};
use crate::experts::ExpertTensors;
use crate::interrupt;
use crate::quant::{matmul_shared_input, Matrix};
use crate::route_trace::RouteTrace;
use crate::snapshot::{Dtype, Snapshot, TensorView};

pub const NAME: &str = "olmoe";

/// Matrices this engine reads only in f32, beyond what every engine keeps (vectors, norms,
/// routers, biases): none.
pub const KEPT_F32: &[&str] = &[];

/// OLMoE prompts: the tokenizer's own encoding (no BOS), the Tulu chat format of
/// OLMoE-Instruct, and every special token ends an answer.
const PROMPT: PromptConvention = PromptConvention {
    bos: false,
    prefix: &[],
    chat_template: Some(CHAT_TEMPLATE),
    stop_on_special: true,
    tools: None,
    thinking: None,
};

/// OLMoE-Instruct's chat template: `<|user|>` and `<|assistant|>` are plain text, each turn
/// ends with a newline and an answer with the EOS token.
const CHAT_TEMPLATE: &str = concat!(
    "{{ bos_token }}",
    "{% for message in messages %}",
    "{% if message['role'] == 'system' %}{{ '<|system|>\\n' + message['content'] + '\\n' }}",
    "{% elif message['role'] == 'user' %}{{ '<|user|>\\n' + message['content'] + '\\n' }}",
    "{% elif message['role'] == 'assistant' %}",
    "{{ '<|assistant|>\\n' + message['content'] + eos_token + '\\n' }}",
    "{% endif %}",
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    "{% endfor %}",
);

/// The keys of `config.json` this engine reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    pub rope_theta: Option<f64>,
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default)]
    pub norm_topk_prob: bool,
    pub clip_qkv: Option<f32>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    pub hidden_act: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    pub rope_type: Option<String>,
    pub rope_theta: Option<f64>,
}

fn default_eps() -> f64 {
    1e-5
}

impl Config {
    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// `rope_parameters.rope_theta` (transformers 5) or the top-level `rope_theta`.
    fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10000.0)
    }

    fn validate(&self) -> Result<()> {
        let heads = self.num_attention_heads;
        let kv_heads = self.kv_heads();
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            bail!("config.json: num_attention_heads ({heads}) must be a positive multiple of num_key_value_heads ({kv_heads})");
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            bail!(
                "config.json: num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                self.num_experts_per_tok,
                self.num_experts
            );
        }
        if let Some(kind) = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_type.as_deref())
        {
            if kind != "default" {
                bail!(
                    "config.json: rope_type {kind:?} is not supported by olmoe (only \"default\")"
                );
            }
        }
        if let Some(act) = self.hidden_act.as_deref() {
            if act != "silu" {
                bail!("config.json: hidden_act {act:?} is not supported by olmoe (only \"silu\")");
            }
        }
        if !self.head_dim().is_multiple_of(2) {
            bail!(
                "config.json: head dimension {} must be even for RoPE",
                self.head_dim()
            );
        }
        Ok(())
    }
}

struct Attention {
    q_proj: Matrix,
    k_proj: Matrix,
    v_proj: Matrix,
    o_proj: Matrix,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
}

struct Layer {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    attention: Attention,
}

pub struct Olmoe {
    config: Config,
    embed: Matrix,
    final_norm: Vec<f32>,
    lm_head: Matrix,
    layers: Vec<Layer>,
    rope: Rope,
    shape: AttentionShape,
    routed: Mutex<RoutedExperts>,
    /// Bytes of the weights above.
    resident: usize,
    /// The ids that end a generation (`eos_token_id`).
    stop: Vec<u32>,
}

/// transformers' `OlmoeConfig` default `eos_token_id`, for a `config.json` without one.
const DEFAULT_EOS: &[u32] = &[50279];

impl Olmoe {
    pub fn load(snapshot: &Snapshot, options: LoadOptions) -> Result<Olmoe> {
        let config: Config = snapshot.config()?;
        config.validate()?;
        let stop = snapshot.stop_ids(DEFAULT_EOS, config.vocab_size)?;
        super::check_config(
            snapshot,
            "model.layers.",
            config.num_hidden_layers,
            0,
            ("num_experts", config.num_experts),
            config.rms_norm_eps,
        )?;
        super::check_positive("rope_theta", config.rope_theta())?;
        let (d, hd) = (config.hidden_size, config.head_dim());
        let (heads, kv_heads) = (config.num_attention_heads, config.kv_heads());
        let weights = Weights::new(snapshot, options.dense_width);
        let mut telemetry = RouteTrace::new(NAME, config.num_hidden_layers, config.num_experts)?;
        // Every layer routes; the row after the last layer (an MTP head in other models)
        // does not exist here.
        telemetry.drop_row(config.num_hidden_layers);
        let mut routed = RoutedExperts::unprovisioned(options.store.width, telemetry);

        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        let mut expert_tensors = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let w = weights.at(&format!("model.layers.{l}"));
            let a = w.at("self_attn");
            layers.push(Layer {
                input_norm: w.vector("input_layernorm.weight", d)?,
                post_attention_norm: w.vector("post_attention_layernorm.weight", d)?,
                attention: Attention {
                    q_proj: a.matrix("q_proj.weight", [heads * hd, d])?,
                    k_proj: a.matrix("k_proj.weight", [kv_heads * hd, d])?,
                    v_proj: a.matrix("v_proj.weight", [kv_heads * hd, d])?,
                    o_proj: a.matrix("o_proj.weight", [d, heads * hd])?,
                    q_norm: a.vector("q_norm.weight", heads * hd)?,
                    k_norm: a.vector("k_norm.weight", kv_heads * hd)?,
                },
            });
            routed.set_router(
                l,
                Router {
                    weight: w.matrix_f32("mlp.gate.weight", [config.num_experts, d])?,
                    choice: Choice::Softmax {
                        top_k: config.num_experts_per_tok,
                        normalise: config.norm_topk_prob,
                    },
                },
            );
            expert_tensors.push(layer_experts(&w.at("mlp.experts"), &config)?);
        }
        let vocab = [config.vocab_size, d];
        let embed = weights.embedding("model.embed_tokens.weight", vocab)?;
        let tied = config.tie_word_embeddings;
        let lm_head =
            weights.lm_head("lm_head.weight", "model.embed_tokens.weight", tied, vocab)?;
        let final_norm = weights.vector("model.norm.weight", d)?;
        let resident = weights.resident_bytes();
        routed.provision(expert_tensors, &options.store, resident)?;
        Ok(Olmoe {
            stop,
            rope: Rope::new(hd, config.rope_theta()),
            shape: AttentionShape {
                heads,
                kv_heads,
                head_dim: hd,
                scale: (hd as f32).powf(-0.5),
            },
            routed: Mutex::new(routed),
            resident,
            embed,
            final_norm,
            lm_head,
            layers,
            config,
        })
    }
}

/// A conversation's state: each layer's KV cache.
#[derive(Clone)]
struct OlmoeState {
    caches: Vec<WindowKvCache>,
}

impl SequenceState for OlmoeState {
    fn position(&self) -> usize {
        self.caches.first().map_or(0, WindowKvCache::positions)
    }

    fn size_bytes(&self) -> usize {
        self.caches.iter().map(WindowKvCache::size_bytes).sum()
    }

    fn can_truncate(&self, len: usize) -> bool {
        self.caches.iter().all(|c| c.can_truncate(len))
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.caches.iter_mut().try_for_each(|c| c.truncate(len))
    }

    /// The number of layers, then each layer's cache.
    fn save(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.caches.len())?;
        self.caches.iter().try_for_each(|c| c.save(out))
    }

    fn restore(&mut self, input: &mut dyn Read) -> Result<()> {
        let layers = state_io::read_len(input, "the number of layers")?;
        expect("layers", layers, self.caches.len())?;
        for (l, cache) in self.caches.iter_mut().enumerate() {
            part(format_args!("layer {l}"), cache.restore(input))?;
        }
        let position = self.position();
        if let Some(l) = self.caches.iter().position(|c| c.positions() != position) {
            bail!(
                "layer {l} holds {} positions, layer 0 holds {position}",
                self.caches[l].positions()
            );
        }
        Ok(())
    }
}

/// What every layer of one forward shares: the configuration, the attention shape and
/// rotary table, the batch's rows, and the routed experts.
struct Pass<'a> {
    config: &'a Config,
    shape: AttentionShape,
    rope: &'a Rope,
    rows: &'a Rows,
    routed: &'a mut RoutedExperts,
}

impl Layer {
    /// `x += attention(norm(x)); x += ffn(norm(x))` for the rows of `x`, with `caches`
    /// this layer's cache of each sequence; `id` is the layer's index.
    fn forward(
        &self,
        id: usize,
        caches: &mut [&mut WindowKvCache],
        pass: &mut Pass,
        x: &mut [f32],
    ) -> Result<()> {
        let norms = [&self.input_norm[..], &self.post_attention_norm];
        pre_norm_residual(x, norms, pass.config.rms_norm_eps, |step, h| match step {
            Sublayer::Attention => Ok(self.attention(caches, pass, h)),
            Sublayer::Ffn => self.ffn(id, pass, h),
        })
    }

    fn attention(&self, caches: &mut [&mut WindowKvCache], pass: &Pass, h: &[f32]) -> Vec<f32> {
        let (config, shape, n) = (pass.config, pass.shape, pass.rows.len());
        let (d, hd) = (config.hidden_size, shape.head_dim);
        let attn = &self.attention;
        let q_width = shape.heads * hd;
        let kv_width = shape.kv_heads * hd;
        let mut q = vec![0f32; n * q_width];
        let mut k = vec![0f32; n * kv_width];
        let mut v = vec![0f32; n * kv_width];
        matmul_shared_input(
            vec![
                (&attn.q_proj, &mut q),
                (&attn.k_proj, &mut k),
                (&attn.v_proj, &mut v),
            ],
            h,
            n,
        );
        rms_norm_in_place(&mut q, &attn.q_norm, config.rms_norm_eps);
        rms_norm_in_place(&mut k, &attn.k_norm, config.rms_norm_eps);
        if let Some(clip) = config.clip_qkv {
            for value in q.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
                *value = value.clamp(-clip, clip);
            }
        }
        for segment in &pass.rows.segments {
            for (i, t) in segment.rows.clone().enumerate() {
                let position = segment.start + i;
                pass.rope
                    .apply(&mut q[t * q_width..][..q_width], hd, position);
                pass.rope
                    .apply(&mut k[t * kv_width..][..kv_width], hd, position);
            }
        }
        let mut context = vec![0f32; n * q_width];
        per_sequence(
            pass.rows,
            caches,
            &mut context,
            q_width,
            |segment, cache, context| {
                cache.push(segment.of(&k, kv_width), segment.of(&v, kv_width));
                windowed_attention(
                    shape,
                    None,
                    segment.of(&q, q_width),
                    segment.len(),
                    cache,
                    None,
                    context,
                );
            },
        );
        let mut out = vec![0f32; n * d];
        attn.o_proj.matmul(&context, n, &mut out);
        out
    }

    /// The routed experts of layer `id` for the normed rows `h`.
    fn ffn(&self, id: usize, pass: &mut Pass, h: &[f32]) -> Result<Vec<f32>> {
        Ok(pass.routed.forward(id, h, pass.rows.len())?.routed)
    }
}

/// The expert tensors under `w` (a layer's `mlp.experts`): per-expert matrices as
/// published, the fused `gate_up_proj [E, 2I, D]` / `down_proj [E, D, I]` of transformers 5,
/// or colibri's merged int8 container.
fn layer_experts(w: &Weights, config: &Config) -> Result<Vec<ExpertTensors>> {
    let (d, inter, n) = (
        config.hidden_size,
        config.intermediate_size,
        config.num_experts,
    );
    if !w.contains("0.gate_proj.weight") && w.contains("gate_up_proj") {
        let gate_up = w.view("gate_up_proj", &[n, 2 * inter, d])?;
        let down = w.view("down_proj", &[n, d, inter])?;
        return (0..n)
            .map(|e| ExpertTensors::from_fused(&gate_up, &down, e)?.checked(d, inter))
            .collect();
    }
    (0..n)
        .map(|e| {
            let tensors = if w.contains(&format!("{e}.merged_weight")) {
                merged_expert(w.snapshot(), &w.name(&e.to_string()), d, inter)?
            } else {
                ExpertTensors::published(w.snapshot(), &w.name(""), e)?
            };
            tensors.checked(d, inter)
        })
        .collect()
}

/// colibri's merged OLMoE container stores the expert at `prefix` as
/// `{prefix}.merged_weight` (int8, the gate, up and down rows one after another, `3·I·D`
/// bytes) with `{prefix}.qs` (`2I + D` f32 row scales). Its three matrices are windows into
/// those two tensors, read as int8-row experts.
fn merged_expert(
    snapshot: &Snapshot,
    prefix: &str,
    d: usize,
    inter: usize,
) -> Result<ExpertTensors> {
    let weights = snapshot.tensor(&format!("{prefix}.merged_weight"))?;
    let file = weights.file.display().to_string();
    for part in ["gate_proj", "up_proj", "down_proj"] {
        let name = format!("{prefix}.{part}.weight");
        if snapshot.contains(&name) {
            bail!("{file}: {name} is stored both on its own and inside {prefix}.merged_weight");
        }
    }
    let scales_name = format!("{prefix}.qs");
    if !snapshot.contains(&scales_name) {
        bail!(
            "{file}: {prefix}.merged_weight has no {scales_name} row scales; untrusted container"
        );
    }
    let scales = snapshot.tensor(&scales_name)?;
    let (nb, ns) = (weights.bytes.len(), scales.bytes.len());
    if weights.dtype != Dtype::I8
        || scales.dtype != Dtype::F32
        || nb != 3 * inter * d
        || ns != (2 * inter + d) * 4
    {
        bail!(
            "{file}: {prefix}.merged_weight has {nb} bytes ({:?}) and {scales_name} {ns} bytes ({:?}); an int8 expert with hidden_size {d} and intermediate_size {inter} needs {} (I8) and {} (F32); untrusted container",
            weights.dtype,
            scales.dtype,
            3 * inter * d,
            (2 * inter + d) * 4
        );
    }
    // Each matrix: its shape, its first weight and its first row scale.
    let part = |shape: [usize; 2], first: usize, first_scale: usize| -> Result<TensorView> {
        let mut view = weights.span(first, &shape)?;
        view.scales = Some(Box::new(scales.span(first_scale, &[shape[0]])?));
        Ok(view)
    };
    Ok(ExpertTensors {
        gate: part([inter, d], 0, 0)?,
        up: part([inter, d], inter * d, inter)?,
        down: part([d, inter], 2 * inter * d, 2 * inter)?,
    })
}

impl Engine for Olmoe {
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
        let shape = self.shape;
        State::new(
            NAME,
            OlmoeState {
                caches: (0..self.layers.len())
                    .map(|_| WindowKvCache::new(shape.kv_heads, shape.head_dim, None))
                    .collect(),
            },
        )
    }

    fn forward(&self, batch: &mut [Step]) -> Result<Vec<Vec<f32>>> {
        let (rows, mut states) = states_of::<OlmoeState>(batch, NAME)?;
        let vocab = self.config.vocab_size;
        let mut x = embed_tokens(&self.embed, &rows.tokens, vocab)?;
        let mut routed = self.routed();
        let mut pass = Pass {
            config: &self.config,
            shape: self.shape,
            rope: &self.rope,
            rows: &rows,
            routed: &mut routed,
        };
        for (l, layer) in self.layers.iter().enumerate() {
            interrupt::checkpoint()?;
            let mut caches: Vec<_> = states.iter_mut().map(|s| &mut s.caches[l]).collect();
            layer.forward(l, &mut caches, &mut pass, &mut x)?;
        }
        let eps = self.config.rms_norm_eps;
        let normed = final_norm(&x, &self.final_norm, eps, &rows.output_rows());
        Ok(rows.split_logits(lm_head(&self.lm_head, &normed)?, vocab))
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
