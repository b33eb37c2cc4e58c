//! The OpenAI wire format: request bodies parsed into typed requests (with messages that
//! name the field at fault), response and stream-chunk bodies, and OpenAI-style errors. No
//! engine, tokenizer or HTTP machinery here.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::guide::Grammar;
use crate::sampling::Shaping;
use crate::text::{called_tool, ChatMessage, Conversation, ToolCall};

/// The longest stop sequence: the text held back while it may still become one is at most
/// this long.
pub const MAX_STOP_BYTES: usize = 256;

/// The most choices (`n`) one request may ask for, as OpenAI allows; the server's
/// `--parallel` may allow fewer.
const MAX_CHOICES: u64 = 128;

/// An error as OpenAI returns it: an HTTP status and `{"error": {...}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub code: Option<&'static str>,
    pub message: String,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            kind: "invalid_request_error",
            code: None,
            message: message.into(),
        }
    }

    /// A failure on the server's side (HTTP `status`, 5xx).
    pub fn server(status: u16, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind: "server_error",
            code: None,
            message: message.into(),
        }
    }

    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": Value::Null,
                "code": self.code,
            }
        })
    }
}

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// `/v1/chat/completions`: rendered through the model's chat template.
    Chat(Conversation),
    /// `/v1/completions` with a string: encoded as text mode encodes a prompt.
    Text(String),
    /// `/v1/completions` with token ids.
    Ids(Vec<u32>),
}

/// One request, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub model: Option<String>,
    pub input: Input,
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    /// `stream_options.include_usage`: a last chunk carrying `usage`.
    pub stream_usage: bool,
    /// `return_routed_experts`: per generated token, the experts each MoE layer chose.
    pub routed_experts: bool,
    /// `n`: the choices to generate, each from the one prompt's state.
    pub choices: usize,
    /// Cut a `max_tokens` beyond the context to what fits instead of refusing it.
    pub clamp_tokens: bool,
    /// `top_k`, `min_p`, the penalties and `logit_bias`.
    pub shaping: Shaping,
    /// Log-probabilities of the chosen tokens, with this many most likely alternatives
    /// (`logprobs`/`top_logprobs`).
    pub logprobs: Option<usize>,
    /// How the answer may call the conversation's tools; `None`: it calls none (no tools,
    /// or `tool_choice` `none`).
    pub tools: Option<Tools>,
    /// What the answer must match (`response_format`, `grammar`).
    pub grammar: Option<Grammar>,
    /// Thinking asked for, with at most this many tokens of it (Anthropic's `thinking`).
    pub thinking_budget: Option<usize>,
    /// The prompt's text before the answer's (`/v1/completions`' `echo`).
    pub echo: bool,
}

/// How an answer calls tools.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub choice: ToolChoice,
    /// More than one call in an answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// `tool_choice` (Anthropic's `tool_choice.type`), less `none`, which leaves the tools out.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    /// The model decides (`auto`).
    Auto,
    /// At least one call (`required`; Anthropic's `any`).
    Required,
    /// A call of this tool (`{"type": "function", "function": {"name"}}`; Anthropic's
    /// `{"type": "tool", "name"}`).
    Named(String),
}

/// The most alternatives `top_logprobs` (chat) or `logprobs` (completions) may ask for.
const MAX_TOP_LOGPROBS: u64 = 20;

/// Fields clients send that mean nothing to this server: accepted and ignored (the list
/// docs/serve.md gives). Any other field this server does not implement is refused.
const IGNORED_FIELDS: [&str; 6] = [
    "user",
    "metadata",
    "service_tier",
    "store",
    "safety_identifier",
    "prompt_cache_key",
];

#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<u64>,
    stop: Option<Stop>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    n: Option<u64>,
    return_routed_experts: Option<bool>,
    top_k: Option<u64>,
    min_p: Option<f64>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    logit_bias: Option<std::collections::BTreeMap<String, f64>>,
    /// A bool for chat, a count of alternatives for completions.
    logprobs: Option<Value>,
    top_logprobs: Option<u64>,
    response_format: Option<Value>,
    /// A grammar in llguidance's Lark dialect the answer must match.
    grammar: Option<String>,
}

/// The chat-only fields about tools and the template.
#[derive(Deserialize)]
struct ChatExtras {
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct Chat {
    messages: Vec<Message>,
    #[serde(flatten)]
    common: Common,
    #[serde(flatten)]
    extras: ChatExtras,
    /// Every other field: refused unless ignorable ([`refuse_unknown`]).
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Value>,
    tool_calls: Option<Vec<Value>>,
    tool_call_id: Option<String>,
    name: Option<String>,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
struct Completion {
    prompt: Value,
    /// The prompt's text (and, with `logprobs`, its tokens' log-probabilities) before the
    /// answer's.
    echo: Option<bool>,
    #[serde(flatten)]
    common: Common,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

/// A 400 for the first field of `rest` (the fields no struct took) that carries a value
/// and is not one this server may ignore. `null`, `[]` and `{}` say nothing and pass.
pub fn refuse_unknown(rest: &serde_json::Map<String, Value>, at: &str) -> Result<(), ApiError> {
    for (key, value) in rest {
        let empty = match value {
            Value::Null => true,
            Value::Array(items) => items.is_empty(),
            Value::Object(fields) => fields.is_empty(),
            _ => false,
        };
        if empty || (at.is_empty() && IGNORED_FIELDS.contains(&key.as_str())) {
            continue;
        }
        return Err(ApiError::invalid(format!(
            "{at}{key}: this server does not implement this field; leave it out (docs/serve.md lists the fields coli serve takes)"
        )));
    }
    Ok(())
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!(
            "the request body is not the JSON this endpoint takes: {err}"
        ))
    })
}

/// A `/v1/chat/completions` body.
pub fn chat_request(body: &[u8]) -> Result<Request, ApiError> {
    let chat: Chat = parse(body)?;
    refuse_unknown(&chat.rest, "")?;
    if chat.messages.is_empty() {
        return Err(ApiError::invalid("messages: give at least one message"));
    }
    let logprobs = match &chat.common.logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(top_count(chat.common.top_logprobs, "top_logprobs")?),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "logprobs {other}: expected true or false (top_logprobs says how many alternatives)"
            )))
        }
    };
    if logprobs.is_none() && chat.common.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::invalid(
            "top_logprobs: give it with \"logprobs\": true",
        ));
    }
    // OpenAI's chat refuses a limit below 1 (`integer_below_min_value`); only
    // /v1/completions takes 0, to echo or score a prompt.
    let limit = match chat.common.max_completion_tokens {
        Some(n) => Some(("max_completion_tokens", n)),
        None => chat.common.max_tokens.map(|n| ("max_tokens", n)),
    };
    if let Some((field, 0)) = limit {
        return Err(ApiError::invalid(format!(
            "{field} 0: expected at least 1 (an answer has a token at least)"
        )));
    }
    let mut conversation = Conversation {
        messages: chat_messages(chat.messages)?,
        tools: chat.extras.tools.unwrap_or_default(),
        variables: chat.extras.chat_template_kwargs.unwrap_or_default(),
        prefill: String::new(),
    };
    check_tools(&conversation.tools)?;
    if let Some(key) = conversation.reserved_variable() {
        return Err(ApiError::invalid(format!(
            "chat_template_kwargs.{key}: set by the server itself; leave it out"
        )));
    }
    let choice = match chat.extras.tool_choice {
        None | Some(Value::Null) => Some(ToolChoice::Auto),
        Some(Value::String(word)) => match word.as_str() {
            "auto" => Some(ToolChoice::Auto),
            "none" => None,
            "required" => Some(ToolChoice::Required),
            other => {
                return Err(ApiError::invalid(format!(
                    "tool_choice {other:?}: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                )))
            }
        },
        Some(named) => match named.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if named.get("type").is_some_and(|t| t == "function") => {
                Some(ToolChoice::Named(name.to_string()))
            }
            _ => {
                return Err(ApiError::invalid(format!(
                    "tool_choice {named}: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                )))
            }
        },
    };
    let tools = tools_for(&mut conversation, choice, chat.extras.parallel_tool_calls)?;
    let mut request = request(chat.common, Input::Chat(conversation), logprobs)?;
    if request.grammar.is_some() && tools.is_some() {
        return Err(ApiError::invalid(
            "response_format or grammar with tools: an answer either calls tools or matches the format; give tool_choice \"none\" or leave the format out",
        ));
    }
    request.tools = tools;
    Ok(request)
}

/// Each tool is `{"type": "function", "function": {"name", "description"?, "parameters"?,
/// "strict"?}}` with a name, its parameters a JSON Schema object.
pub fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let bad = |what: &str| ApiError::invalid(format!("tools[{i}]{what}"));
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(".type: expected \"function\""));
        }
        let Some(function) = tool.get("function").and_then(Value::as_object) else {
            return Err(bad(".function: expected an object with a name"));
        };
        match function.get("name").and_then(Value::as_str) {
            Some(name) if !name.is_empty() && name.len() <= 256 => {}
            _ => {
                return Err(bad(
                    ".function.name: expected a name of 1 to 256 characters",
                ))
            }
        }
        if function.get("parameters").is_some_and(|p| !p.is_object()) {
            return Err(bad(".function.parameters: expected a JSON Schema object"));
        }
        for key in function.keys() {
            if !["name", "description", "parameters", "strict"].contains(&key.as_str()) {
                return Err(bad(&format!(
                    ".function.{key}: not a field of a function (name, description, parameters, strict)"
                )));
            }
        }
    }
    Ok(())
}

/// How the answer may call `conversation`'s tools under `choice` (`None`: `tool_choice`
/// `none`, whose tools are left out of the prompt); a named tool must be one of them.
pub fn tools_for(
    conversation: &mut Conversation,
    choice: Option<ToolChoice>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, ApiError> {
    let Some(choice) = choice else {
        conversation.tools.clear();
        return Ok(None);
    };
    if conversation.tools.is_empty() {
        return match choice {
            ToolChoice::Auto => Ok(None),
            _ => Err(ApiError::invalid(
                "tool_choice: asks for a call, but the request gives no tools",
            )),
        };
    }
    if let ToolChoice::Named(name) = &choice {
        let known = conversation
            .tools
            .iter()
            .any(|tool| tool.pointer("/function/name").and_then(Value::as_str) == Some(name));
        if !known {
            return Err(ApiError::invalid(format!(
                "tool_choice: names the tool {name:?}, which is not in tools"
            )));
        }
    }
    Ok(Some(Tools {
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

fn chat_messages(messages: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        refuse_unknown(&m.rest, &format!("messages[{i}]."))?;
        let mut message = ChatMessage::text(&m.role, message_text(i, m.content)?);
        if let Some(calls) = m.tool_calls.filter(|calls| !calls.is_empty()) {
            if m.role != "assistant" {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].tool_calls: only an assistant message makes calls"
                )));
            }
            message.tool_calls = calls
                .iter()
                .enumerate()
                .map(|(j, call)| past_call(call, &format!("messages[{i}].tool_calls[{j}]")))
                .collect::<Result<_, _>>()?;
        }
        if m.role == "tool" {
            let Some(id) = m.tool_call_id else {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].tool_call_id: a tool message names the call it answers"
                )));
            };
            // The tool's name, which templates print: the call's with that id.
            let called = called_tool(&out, &id);
            message.name = m.name.or(called);
            if message.name.is_none() {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].tool_call_id {id:?}: no earlier assistant message made a call with this id (give \"name\" to say which tool answered)"
                )));
            }
            message.tool_call_id = Some(id);
        } else if m.tool_call_id.is_some() {
            return Err(ApiError::invalid(format!(
                "messages[{i}].tool_call_id: only a tool message answers a call"
            )));
        } else {
            message.name = m.name;
        }
        out.push(message);
    }
    Ok(out)
}

/// A call an earlier assistant message made: `{"id", "type": "function", "function":
/// {"name", "arguments": "<a JSON object>"}}`; `at` names it in messages.
fn past_call(call: &Value, at: &str) -> Result<ToolCall, ApiError> {
    let bad = |what: &str| ApiError::invalid(format!("{at}{what}"));
    let id = call
        .get("id")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(".id: expected the call's id"))?;
    let name = call
        .pointer("/function/name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(".function.name: expected the tool's name"))?;
    let arguments = match call.pointer("/function/arguments") {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(arguments)) => arguments.clone(),
        Some(Value::String(text)) => match serde_json::from_str(text) {
            Ok(Value::Object(arguments)) => arguments,
            _ => {
                return Err(bad(
                    ".function.arguments: expected a JSON object, as a string",
                ))
            }
        },
        Some(_) => {
            return Err(bad(
                ".function.arguments: expected a JSON object, as a string",
            ))
        }
    };
    Ok(ToolCall {
        id: id.to_string(),
        name: name.to_string(),
        arguments,
    })
}

/// What `/tokenize` is asked to encode.
#[derive(Debug, Clone, PartialEq)]
pub enum Tokenize {
    /// Text; with `special`, as `/v1/completions` encodes a prompt (the model's BOS and
    /// prefix in front), else the tokenizer's ids of the text alone.
    Text { text: String, special: bool },
    /// Messages, as `/v1/chat/completions` renders and encodes them.
    Chat(Conversation),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizeBody {
    content: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    tools: Option<Vec<Value>>,
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    add_special: Option<bool>,
    add_special_tokens: Option<bool>,
    model: Option<String>,
}

/// A `/tokenize` body: `content` (llama-server's name) or `prompt` (vLLM's) with
/// `add_special`/`add_special_tokens` (default true), or `messages`; and its `model`.
pub fn tokenize_request(body: &[u8]) -> Result<(Tokenize, Option<String>), ApiError> {
    let parsed: TokenizeBody = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!(
            "the request body is not the JSON /tokenize takes ({{\"content\": text}} or {{\"messages\": [...]}}): {err}"
        ))
    })?;
    let special = parsed
        .add_special
        .or(parsed.add_special_tokens)
        .unwrap_or(true);
    let input = match (parsed.content.or(parsed.prompt), parsed.messages) {
        (Some(text), None) => Tokenize::Text { text, special },
        (None, Some(messages)) => {
            let conversation = Conversation {
                messages: chat_messages(messages)?,
                tools: parsed.tools.unwrap_or_default(),
                variables: parsed.chat_template_kwargs.unwrap_or_default(),
                prefill: String::new(),
            };
            check_tools(&conversation.tools)?;
            Tokenize::Chat(conversation)
        }
        _ => {
            return Err(ApiError::invalid(
                "give `content` (or `prompt`) text, or `messages`: one of them",
            ))
        }
    };
    Ok((input, parsed.model))
}

/// A `/detokenize` body: `{"tokens": [ids]}`.
pub fn detokenize_request(body: &[u8]) -> Result<Vec<u32>, ApiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        tokens: Vec<u32>,
        #[serde(rename = "model")]
        _model: Option<String>,
    }
    let parsed: Body = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!(
            "the request body is not the JSON /detokenize takes ({{\"tokens\": [ids]}}): {err}"
        ))
    })?;
    Ok(parsed.tokens)
}

/// A count of alternatives, 0 to [`MAX_TOP_LOGPROBS`], named `field` in a message.
fn top_count(count: Option<u64>, field: &str) -> Result<usize, ApiError> {
    match count {
        None => Ok(0),
        Some(n @ 0..=MAX_TOP_LOGPROBS) => Ok(n as usize),
        Some(n) => Err(ApiError::invalid(format!(
            "{field} {n}: expected 0 to {MAX_TOP_LOGPROBS} alternatives"
        ))),
    }
}

/// A message's content: a string, or an array of `{"type": "text", "text": ...}` parts.
fn message_text(index: usize, content: Option<Value>) -> Result<String, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(text)) => Ok(text),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|part| match (part.get("type"), part.get("text")) {
                (Some(Value::String(kind)), Some(Value::String(text))) if kind == "text" => {
                    Ok(text.as_str())
                }
                _ => Err(ApiError::invalid(format!(
                    "messages[{index}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported"
                ))),
            })
            .collect(),
        Some(_) => Err(ApiError::invalid(format!(
            "messages[{index}].content: expected a string or an array of text parts"
        ))),
    }
}

/// A `/v1/completions` body.
pub fn completion_request(body: &[u8]) -> Result<Request, ApiError> {
    let completion: Completion = parse(body)?;
    refuse_unknown(&completion.rest, "")?;
    if completion.common.top_logprobs.is_some() {
        return Err(ApiError::invalid(
            "top_logprobs: a chat field; completions take \"logprobs\": N alternatives",
        ));
    }
    let logprobs = match &completion.common.logprobs {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) if n.as_u64().is_some() => Some(top_count(n.as_u64(), "logprobs")?),
        Some(other) => {
            return Err(ApiError::invalid(format!(
                "logprobs {other}: expected a count of alternatives, 0 to {MAX_TOP_LOGPROBS}"
            )))
        }
    };
    let bad = || {
        ApiError::invalid(
            "prompt: expected a string, an array of one string, or an array of token ids",
        )
    };
    let input = match completion.prompt {
        Value::String(text) => Input::Text(text),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            Input::Text(items[0].as_str().unwrap_or_default().to_string())
        }
        Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_u64) => Input::Ids(
            items
                .iter()
                .map(|id| {
                    id.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?,
        ),
        _ => return Err(bad()),
    };
    let mut request = request(completion.common, input, logprobs)?;
    request.echo = completion.echo.unwrap_or(false);
    Ok(request)
}

fn request(common: Common, input: Input, logprobs: Option<usize>) -> Result<Request, ApiError> {
    let choices = match common.n {
        None => 1,
        Some(n @ 1..=MAX_CHOICES) => n as usize,
        Some(n) => {
            return Err(ApiError::invalid(format!(
                "n {n}: expected a count of choices from 1 to {MAX_CHOICES}"
            )))
        }
    };
    let stop = match common.stop {
        None => Vec::new(),
        Some(Stop::One(text)) => vec![text],
        Some(Stop::Many(list)) => list,
    };
    if let Some(t) = common.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        return Err(ApiError::invalid(format!(
            "temperature {t}: expected a number >= 0 (0 = greedy)"
        )));
    }
    if let Some(p) = common.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(ApiError::invalid(format!(
            "top_p {p}: expected a number in (0, 1]"
        )));
    }
    if stop
        .iter()
        .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
        || stop.len() > 4
    {
        return Err(ApiError::invalid(format!(
            "stop: up to 4 sequences, none of them empty or over {MAX_STOP_BYTES} bytes"
        )));
    }
    let logit_bias = common
        .logit_bias
        .unwrap_or_default()
        .into_iter()
        .map(|(id, bias)| {
            let id = id.parse::<u32>().map_err(|_| {
                ApiError::invalid(format!(
                    "logit_bias: key {id:?} is not a token id (a map of token ids, as strings, to biases)"
                ))
            })?;
            Ok((id, bias as f32))
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let shaping = Shaping {
        top_k: common
            .top_k
            .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
        min_p: common.min_p.unwrap_or(0.0),
        presence_penalty: common.presence_penalty.unwrap_or(0.0),
        frequency_penalty: common.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: common.repetition_penalty.unwrap_or(1.0),
        logit_bias,
    };
    shaping
        .check()
        .map_err(|err| ApiError::invalid(err.to_string()))?;
    let grammar = match (response_format(common.response_format)?, common.grammar) {
        (None, None) => None,
        (Some(format), None) => Some(format),
        (None, Some(lark)) => Some(Grammar::Lark(lark)),
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid(
                "grammar and response_format: give one of them",
            ))
        }
    };
    Ok(Request {
        model: common.model,
        input,
        max_tokens: common
            .max_completion_tokens
            .or(common.max_tokens)
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        temperature: common.temperature,
        top_p: common.top_p,
        seed: common.seed,
        stop,
        stream: common.stream.unwrap_or(false),
        stream_usage: common
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false),
        routed_experts: common.return_routed_experts.unwrap_or(false),
        choices,
        clamp_tokens: false,
        shaping,
        logprobs,
        tools: None,
        grammar,
        thinking_budget: None,
        echo: false,
    })
}

/// `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`.
fn response_format(format: Option<Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    let expected = "expected {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\"}}";
    let fields = format
        .as_object()
        .ok_or_else(|| ApiError::invalid(format!("response_format: {expected}")))?;
    match fields.get("type").and_then(Value::as_str) {
        Some("text") => only_fields(fields, &["type"], "response_format").map(|()| None),
        Some("json_object") => {
            only_fields(fields, &["type"], "response_format").map(|()| Some(Grammar::JsonObject))
        }
        Some("json_schema") => {
            only_fields(fields, &["type", "json_schema"], "response_format")?;
            let Some(wrapper) = fields.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(
                    "response_format.json_schema: expected {\"name\", \"schema\", \"strict\"?, \"description\"?}",
                ));
            };
            json_schema_grammar(
                wrapper,
                &["name", "schema", "strict", "description"],
                "response_format.json_schema",
            )
            .map(Some)
        }
        _ => Err(ApiError::invalid(format!(
            "response_format.type: {expected}"
        ))),
    }
}

/// A 400 naming `at.key` for the first key of `fields` that is not `allowed`.
pub fn only_fields(
    fields: &serde_json::Map<String, Value>,
    allowed: &[&str],
    at: &str,
) -> Result<(), ApiError> {
    match fields.keys().find(|k| !allowed.contains(&k.as_str())) {
        Some(key) => Err(ApiError::invalid(format!(
            "{at}.{key}: not a field this server takes ({})",
            allowed.join(", ")
        ))),
        None => Ok(()),
    }
}

/// The grammar of a JSON schema format, `fields` holding `schema` (a JSON Schema object)
/// and at most the other `allowed` keys (`name`, `strict`, `description`): chat's
/// `response_format.json_schema`, the Responses API's `text.format`.
pub fn json_schema_grammar(
    fields: &serde_json::Map<String, Value>,
    allowed: &[&str],
    at: &str,
) -> Result<Grammar, ApiError> {
    only_fields(fields, allowed, at)?;
    match fields.get("schema") {
        Some(schema) if schema.is_object() => Ok(Grammar::JsonSchema(schema.clone())),
        _ => Err(ApiError::invalid(format!(
            "{at}.schema: expected a JSON Schema object"
        ))),
    }
}

/// Why a generation ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token.
    Stop,
    /// The request's stop string of this index.
    StopString(usize),
    /// `max_tokens` reached.
    Length,
    /// The answer called tools and ended.
    ToolCalls,
}

impl Finish {
    pub fn name(self) -> &'static str {
        match self {
            Finish::Stop | Finish::StopString(_) => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
        }
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt: usize,
    pub completion: usize,
    /// Prompt tokens whose KV came from the previous turn.
    pub cached: usize,
    /// Completion tokens spent thinking.
    pub reasoning: usize,
}

impl Usage {
    /// The request's counts once `choice`, another choice of the same prompt, is done: its
    /// tokens added, the prompt counted once.
    pub fn and(self, choice: Usage) -> Usage {
        Usage {
            completion: self.completion + choice.completion,
            reasoning: self.reasoning + choice.reasoning,
            ..choice
        }
    }

    pub fn body(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": { "cached_tokens": self.cached },
            "completion_tokens_details": { "reasoning_tokens": self.reasoning },
        })
    }
}

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
        }
    }
}

/// The response identity every body and chunk of one request carries.
pub struct Identity<'a> {
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

/// Per generated token, the ids each MoE layer chose (`[tokens][layers][k]`).
pub type Routed = Vec<Vec<Vec<u32>>>;

/// One finished choice of a request without `stream`.
pub struct Choice {
    pub text: String,
    /// What it wrote in its thinking block.
    pub reasoning: String,
    /// The tools it called, in order.
    pub calls: Vec<ToolCall>,
    pub finish: Finish,
    pub routed: Option<Routed>,
    /// When asked: per generated token, its log-probability and the alternatives'.
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// A generated token's log-probability under the model (the logits before any sampling
/// setting), with the most likely tokens' at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    /// NaN for an echoed prompt's first token, which nothing predicts (`null` on the wire).
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// The `logprobs` of a choice: chat's `{"content": [...]}`, or the completions'
/// `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (offsets from `offset`,
/// the length of the text before these tokens).
pub fn logprobs_body(endpoint: Endpoint, tokens: &[TokenLogprob], offset: usize) -> Value {
    match endpoint {
        Endpoint::Chat => {
            let entry = |token: &str, logprob: f32| json!({ "token": token, "logprob": logprob, "bytes": token.as_bytes() });
            let content: Vec<Value> = tokens
                .iter()
                .map(|t| {
                    let mut body = entry(&t.token, t.logprob);
                    body["top_logprobs"] =
                        t.top.iter().map(|(token, lp)| entry(token, *lp)).collect();
                    body
                })
                .collect();
            json!({ "content": content, "refusal": Value::Null })
        }
        Endpoint::Completion => {
            let mut text_offset = Vec::with_capacity(tokens.len());
            let mut at = offset;
            for t in tokens {
                text_offset.push(at);
                at += t.token.len();
            }
            json!({
                "tokens": tokens.iter().map(|t| t.token.as_str()).collect::<Vec<_>>(),
                "token_logprobs": tokens
                    .iter()
                    .map(|t| if t.logprob.is_nan() { Value::Null } else { json!(t.logprob) })
                    .collect::<Vec<_>>(),
                "top_logprobs": tokens
                    .iter()
                    .map(|t| {
                        if t.logprob.is_nan() {
                            return Value::Null;
                        }
                        let top = t.top.iter().map(|(token, lp)| (token.clone(), json!(lp)));
                        Value::Object(top.collect())
                    })
                    .collect::<Vec<_>>(),
                "text_offset": text_offset,
            })
        }
    }
}

/// The whole answer, for a request without `stream`: its choices in order of `index`.
pub fn response(endpoint: Endpoint, who: &Identity, choices: &[Choice], usage: Usage) -> Value {
    let choices: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(index, choice)| {
            let logprobs = choice
                .logprobs
                .as_ref()
                .map_or(Value::Null, |l| logprobs_body(endpoint, l, 0));
            let mut body = match endpoint {
                Endpoint::Chat => {
                    let mut message = json!({ "role": "assistant", "content": choice.text });
                    if !choice.reasoning.is_empty() {
                        message["reasoning_content"] = choice.reasoning.clone().into();
                    }
                    if !choice.calls.is_empty() {
                        if choice.text.is_empty() {
                            message["content"] = Value::Null;
                        }
                        message["tool_calls"] = choice
                            .calls
                            .iter()
                            .map(|call| call_body(call, None))
                            .collect();
                    }
                    json!({
                        "index": index,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": choice.finish.name(),
                    })
                }
                Endpoint::Completion => json!({
                    "index": index,
                    "text": choice.text,
                    "logprobs": logprobs,
                    "finish_reason": choice.finish.name(),
                }),
            };
            if let Some(routed) = &choice.routed {
                body["routed_experts"] = json!(routed);
            }
            body
        })
        .collect();
    json!({
        "id": who.id,
        "object": match endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completion => "text_completion",
        },
        "created": who.created,
        "model": who.model,
        "choices": choices,
        "usage": usage.body(),
    })
}

/// One server-sent chunk of choice `index`: a piece of text (the chat's first chunk of a
/// choice also names the role), or the choice's last one with the finish reason (and the
/// routed experts, when asked).
#[allow(clippy::too_many_arguments)]
pub fn chunk(
    endpoint: Endpoint,
    who: &Identity,
    index: usize,
    text: Option<&str>,
    logprobs: Option<Value>,
    first: bool,
    finish: Option<(Finish, Option<&Routed>)>,
) -> Value {
    let finish_reason = finish.map_or(Value::Null, |(f, _)| f.name().into());
    let mut choice = match endpoint {
        Endpoint::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(text) = text {
                delta.insert("content".into(), text.into());
            }
            json!({
                "index": index,
                "delta": delta,
                "logprobs": logprobs.unwrap_or(Value::Null),
                "finish_reason": finish_reason,
            })
        }
        Endpoint::Completion => json!({
            "index": index,
            "text": text.unwrap_or(""),
            "logprobs": logprobs.unwrap_or(Value::Null),
            "finish_reason": finish_reason,
        }),
    };
    if let Some((_, Some(routed))) = finish {
        choice["routed_experts"] = json!(routed);
    }
    json!({
        "id": who.id,
        "object": match endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completion => "text_completion",
        },
        "created": who.created,
        "model": who.model,
        "choices": [choice],
    })
}

/// A call as OpenAI shows it, its arguments a JSON string; in a stream's delta, with its
/// `index` among the choice's calls.
fn call_body(call: &ToolCall, index: Option<usize>) -> Value {
    let mut body = json!({
        "id": call.id,
        "type": "function",
        "function": {
            "name": call.name,
            "arguments": Value::Object(call.arguments.clone()).to_string(),
        },
    });
    if let Some(index) = index {
        body["index"] = index.into();
    }
    body
}

/// The chunk of choice `index` that carries its `number`th call, whole (one delta per call,
/// as peers send a parsed call).
pub fn call_chunk(
    who: &Identity,
    index: usize,
    number: usize,
    call: &ToolCall,
    first: bool,
) -> Value {
    let mut body = chunk(Endpoint::Chat, who, index, None, None, first, None);
    body["choices"][0]["delta"]["tool_calls"] = json!([call_body(call, Some(number))]);
    body
}

/// The chunk of choice `index` that carries a piece of its reasoning
/// (`delta.reasoning_content`).
pub fn reasoning_chunk(who: &Identity, index: usize, text: &str, first: bool) -> Value {
    let mut body = chunk(Endpoint::Chat, who, index, None, None, first, None);
    body["choices"][0]["delta"]["reasoning_content"] = text.into();
    body
}

/// The chunk `stream_options.include_usage` asks for after the last choice.
pub fn usage_chunk(endpoint: Endpoint, who: &Identity, usage: Usage) -> Value {
    let mut body = chunk(endpoint, who, 0, None, None, false, None);
    body["choices"] = json!([]);
    body["usage"] = usage.body();
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_requests_take_strings_and_text_parts() {
        let request = chat_request(
            br#"{"model":"m","messages":[{"role":"system","content":"Be brief."},
                {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]}],
                "max_tokens":5,"stop":"\n","stream":true,"stream_options":{"include_usage":true},
                "presence_penalty":0}"#,
        )
        .unwrap();
        assert_eq!(
            request.input,
            Input::Chat(Conversation::from(vec![
                ChatMessage::text("system", "Be brief."),
                ChatMessage::text("user", "Hi there"),
            ]))
        );
        assert_eq!(request.max_tokens, Some(5));
        assert_eq!(request.stop, vec!["\n".to_string()]);
        assert!(request.stream && request.stream_usage);
    }

    #[test]
    fn bad_bodies_name_what_is_wrong() {
        let message = |body: &[u8]| chat_request(body).unwrap_err().message;
        assert!(message(b"{").contains("not the JSON"));
        assert!(message(br#"{"messages":[]}"#).contains("at least one message"));
        assert!(message(br#"{"messages":[{"role":"user","content":7}]}"#)
            .contains("messages[0].content"));
        assert!(
            message(br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#)
                .contains("only text parts")
        );
        assert!(
            message(br#"{"messages":[{"role":"user","content":"x"}],"n":0}"#).starts_with("n 0")
        );
        assert!(
            message(br#"{"messages":[{"role":"user","content":"x"}],"n":129}"#)
                .starts_with("n 129")
        );
        assert!(
            message(br#"{"messages":[{"role":"user","content":"x"}],"stop":[""]}"#)
                .contains("stop:")
        );
        let completion = |body: &[u8]| completion_request(body).unwrap_err().message;
        assert!(completion(br#"{"prompt":{"a":1}}"#).contains("prompt:"));
        assert!(completion(br#"{"prompt":"x","temperature":-1}"#).starts_with("temperature"));
        assert!(completion(br#"{"prompt":"x","top_p":0}"#).starts_with("top_p"));
        assert!(completion(br#"{"prompt":[1,-2]}"#).contains("prompt:"));
        assert_eq!(
            completion_request(br#"{"prompt":[1,2,3]}"#).unwrap().input,
            Input::Ids(vec![1, 2, 3])
        );
    }

    #[test]
    fn tool_calls_and_results_reach_the_conversation_checked() {
        let request = chat_request(
            br#"{"messages":[{"role":"user","content":"Weather?"},
                {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"weather","arguments":"{\"city\": \"Oslo\"}"}}]},
                {"role":"tool","tool_call_id":"c1","content":"-3 C"}],
                "tools":[{"type":"function","function":{"name":"weather","parameters":{"type":"object"}}}],
                "tool_choice":{"type":"function","function":{"name":"weather"}},"parallel_tool_calls":false,
                "chat_template_kwargs":{"enable_thinking":false}}"#,
        )
        .unwrap();
        let Input::Chat(conversation) = &request.input else {
            panic!("a chat")
        };
        let call = &conversation.messages[1].tool_calls[0];
        assert_eq!(call.arguments["city"], "Oslo");
        assert_eq!(conversation.messages[2].name.as_deref(), Some("weather"));
        assert_eq!(conversation.variables["enable_thinking"], false);
        let tools = request.tools.clone().unwrap();
        assert_eq!(tools.choice, ToolChoice::Named("weather".into()));
        assert!(!tools.parallel);
        // `none`: no tools in the prompt, no calls looked for.
        let none = chat_request(
            br#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"none",
                "tools":[{"type":"function","function":{"name":"f"}}]}"#,
        )
        .unwrap();
        assert!(none.tools.is_none());
        assert!(matches!(&none.input, Input::Chat(c) if c.tools.is_empty()));
        let message = |body: &str| chat_request(body.as_bytes()).unwrap_err().message;
        let user = r#"{"role":"user","content":"x"}"#;
        assert!(message(&format!(
            r#"{{"messages":[{user}],"tools":[{{"type":"function"}}]}}"#
        ))
        .starts_with("tools[0].function"));
        assert!(message(&format!(
            r#"{{"messages":[{user}],"tools":[{{"type":"function","function":{{"name":"f","strickt":true}}}}]}}"#
        ))
        .starts_with("tools[0].function.strickt"));
        assert!(message(&format!(
            r#"{{"messages":[{user}],"tool_choice":"required"}}"#
        ))
        .contains("gives no tools"));
        assert!(
            message(r#"{"messages":[{"role":"tool","tool_call_id":"zz","content":"1"}]}"#)
                .starts_with("messages[0].tool_call_id \"zz\"")
        );
        assert!(message(
            r#"{"messages":[{"role":"assistant","tool_calls":[{"id":"a","function":{"name":"f","arguments":"[1]"}}]}]}"#
        )
        .starts_with("messages[0].tool_calls[0].function.arguments"));
        assert!(message(&format!(
            r#"{{"messages":[{user}],"chat_template_kwargs":{{"messages":[]}}}}"#
        ))
        .starts_with("chat_template_kwargs.messages"));
    }
}
