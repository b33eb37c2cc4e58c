//! How a model wants its text prompts: the convention each engine declares for its model
//! (BOS, a fixed prefix, a built-in chat template, which special tokens end an answer).
//! Declared beside the engines that state it; it holds data only: applying it to a tokenizer
//! is `text`'s job, and nothing here imports `text`.

/// How an engine's model turns a text prompt into ids and when its generation ends. Each
/// engine states its own through
/// [`Engine::prompt_convention`](super::Engine::prompt_convention).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptConvention {
    /// Prepend the BOS token (`bos_token_id` in `config.json`, else `tokenizer_config.json`'s
    /// `bos_token`). `add_bos_token: true` in `tokenizer_config.json` asks for it too.
    pub bos: bool,
    /// Tokens, by their text in `tokenizer.json`, that start every prompt after the BOS
    /// (GLM's `[gMASK]<sop>`).
    pub prefix: &'static [&'static str],
    /// The Jinja chat template `CHAT=1` uses when the model directory ships none.
    pub chat_template: Option<&'static str>,
    /// Every added token marked special ends a generation (colibri's stop set); otherwise
    /// only the EOS ids do, for models that emit special tokens inside an answer.
    pub stop_on_special: bool,
    /// How the model writes a call of a tool; `None`: it has no syntax for calls, and a
    /// request with tools is refused.
    pub tools: Option<ToolSyntax>,
    /// The tags around the model's thinking (`<think>`, `</think>`), when its template can
    /// open a thinking block for the answer.
    pub thinking: Option<(&'static str, &'static str)>,
}

/// A model's syntax for calls of tools (parsed by `text::tool_calls`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// GLM-4.5 to GLM-5.x: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…
    /// </tool_call>`, string values raw, others JSON.
    GlmXml,
    /// Kimi K3's XTML: `<|open|>call tool="NAME" index="I"<|sep|>` with an `argument` tag
    /// per argument (its `type` attribute says string or JSON), `<|close|>call<|sep|>`.
    KimiXtml,
    /// Inkling: a `<|content_invoke_tool_json|>` block `{"name": …, "args": {…}}` ended by
    /// `<|end_message|>`.
    InklingJson,
}

impl PromptConvention {
    /// The convention of an engine that states none: the tokenizer's own encoding, no
    /// built-in chat template, every special token stops.
    pub const PLAIN: PromptConvention = PromptConvention {
        bos: false,
        prefix: &[],
        chat_template: None,
        stop_on_special: true,
        tools: None,
        thinking: None,
    };
}
