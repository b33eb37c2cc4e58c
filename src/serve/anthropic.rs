//! Anthropic's Messages wire format (`POST /v1/messages`): request bodies parsed into the
//! same typed [`Request`] the OpenAI endpoints make, the message body, the stream's events
//! and Anthropic-shaped errors. No engine, tokenizer or HTTP machinery here.

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{self, ApiError, Finish, Input, Request, ToolChoice, Usage, MAX_STOP_BYTES};
use crate::sampling::Shaping;
use crate::text::{called_tool, ChatMessage, Conversation, ToolCall};

/// Fields clients send that mean nothing to this server: accepted and ignored.
const IGNORED_FIELDS: [&str; 2] = ["metadata", "service_tier"];

/// The most stop sequences a request may give (as the OpenAI endpoints take).
const MAX_STOP_SEQUENCES: usize = 4;

#[derive(Deserialize)]
struct Messages {
    model: Option<String>,
    max_tokens: Option<u64>,
    messages: Vec<Message>,
    system: Option<Value>,
    stop_sequences: Option<Vec<String>>,
    stream: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    thinking: Option<Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Value,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

/// A `/v1/messages/count_tokens` body: a Messages body without `max_tokens`.
pub fn count_request(body: &[u8]) -> Result<Request, ApiError> {
    let mut value: Value = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!(
            "the request body is not the JSON /v1/messages/count_tokens takes: {err}"
        ))
    })?;
    if let Some(fields) = value.as_object_mut() {
        fields.entry("max_tokens").or_insert(json!(1));
    }
    request(value.to_string().as_bytes())
}

/// A `/v1/messages` body.
pub fn request(body: &[u8]) -> Result<Request, ApiError> {
    let parsed: Messages = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!(
            "the request body is not the JSON /v1/messages takes: {err}"
        ))
    })?;
    for (key, value) in &parsed.rest {
        let says_nothing = value.is_null() || value.as_array().is_some_and(Vec::is_empty);
        if !says_nothing && !IGNORED_FIELDS.contains(&key.as_str()) {
            return Err(ApiError::invalid(format!(
                "{key}: this server does not implement this field; leave it out (docs/serve.md lists the fields coli serve takes)"
            )));
        }
    }
    let max_tokens = match parsed.max_tokens {
        None => return Err(ApiError::invalid("max_tokens: required")),
        // Anthropic's minimum.
        Some(0) => return Err(ApiError::invalid("max_tokens 0: expected at least 1")),
        Some(n) => n,
    };
    let thinking = thinking(parsed.thinking.as_ref(), max_tokens)?;
    if parsed.messages.is_empty() {
        return Err(ApiError::invalid("messages: give at least one message"));
    }
    let mut messages = Vec::new();
    if let Some(system) = parsed.system.filter(|s| !s.is_null()) {
        messages.push(ChatMessage::text("system", text_of(&system, "system")?));
    }
    for (i, message) in parsed.messages.iter().enumerate() {
        if let Some((key, _)) = message.rest.iter().find(|(_, v)| !v.is_null()) {
            return Err(ApiError::invalid(format!(
                "messages[{i}].{key}: this server does not implement this field"
            )));
        }
        let at = format!("messages[{i}].content");
        match message.role.as_str() {
            "assistant" => messages.push(assistant_turn(&message.content, &at)?),
            "user" => user_turn(&message.content, &at, &mut messages)?,
            other => {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].role {other:?}: expected \"user\" or \"assistant\" (the system prompt goes in `system`)"
                )))
            }
        }
    }
    // A last assistant turn is the start of the answer, which the answer continues.
    let mut prefill = String::new();
    if messages.last().is_some_and(|m| m.role == "assistant") {
        let last = messages.pop().unwrap_or_default();
        if !last.tool_calls.is_empty() {
            return Err(ApiError::invalid(
                "messages: the last message is the assistant's with a tool_use; send its tool_result in a user message",
            ));
        }
        if last.content.ends_with(char::is_whitespace) {
            return Err(ApiError::invalid(
                "messages: the final assistant content cannot end with whitespace",
            ));
        }
        prefill = last.content;
        if thinking.flatten().is_some() {
            return Err(ApiError::invalid(
                "messages: a prefilled answer (a last assistant message) with thinking enabled; the answer would start outside its thinking block",
            ));
        }
    }
    if let Some(t) = parsed.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::invalid(format!(
            "temperature {t}: expected a number in [0, 1]"
        )));
    }
    if let Some(p) = parsed.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(ApiError::invalid(format!(
            "top_p {p}: expected a number in (0, 1]"
        )));
    }
    let stop = parsed.stop_sequences.unwrap_or_default();
    if stop.len() > MAX_STOP_SEQUENCES
        || stop
            .iter()
            .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::invalid(format!(
            "stop_sequences: up to {MAX_STOP_SEQUENCES} sequences, none of them empty or over {MAX_STOP_BYTES} bytes"
        )));
    }
    let tools = parsed
        .tools
        .unwrap_or_default()
        .iter()
        .enumerate()
        .map(|(i, tool)| openai_tool(tool, i))
        .collect::<Result<Vec<_>, _>>()?;
    api::check_tools(&tools)?;
    let mut variables = serde_json::Map::new();
    if let Some(budget) = thinking {
        // The switches of the templates that think: GLM's, and Kimi K3's.
        let on = budget.is_some();
        variables.insert("enable_thinking".into(), on.into());
        variables.insert("thinking".into(), on.into());
    }
    let mut conversation = Conversation {
        messages,
        tools,
        variables,
        prefill,
    };
    let (choice, parallel) = tool_choice(parsed.tool_choice.as_ref())?;
    let tools = api::tools_for(&mut conversation, choice, parallel)?;
    Ok(Request {
        model: parsed.model,
        input: Input::Chat(conversation),
        max_tokens: Some(usize::try_from(max_tokens).unwrap_or(usize::MAX)),
        temperature: parsed.temperature,
        top_p: parsed.top_p,
        seed: None,
        stop,
        stream: parsed.stream.unwrap_or(false),
        stream_usage: false,
        routed_experts: false,
        // Clients send a large `max_tokens` with every request: it is cut to the context.
        clamp_tokens: true,
        choices: 1,
        shaping: Shaping {
            top_k: parsed
                .top_k
                .map_or(0, |k| usize::try_from(k).unwrap_or(usize::MAX)),
            ..Shaping::default()
        },
        logprobs: None,
        tools,
        grammar: None,
        thinking_budget: thinking.flatten(),
        echo: false,
    })
}

/// `thinking`: `None` when not given, `Some(None)` for `{"type": "disabled"}`,
/// `Some(Some(budget))` for `{"type": "enabled", "budget_tokens"}` (below `max_tokens`, as
/// Anthropic requires; Anthropic's minimum of 1,024 is not enforced, so a short answer may
/// think briefly).
fn thinking(thinking: Option<&Value>, max_tokens: u64) -> Result<Option<Option<usize>>, ApiError> {
    let Some(thinking) = thinking.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let expected = "thinking: expected {\"type\": \"enabled\", \"budget_tokens\": N} (0 < N < max_tokens) or {\"type\": \"disabled\"}";
    let fields = thinking
        .as_object()
        .ok_or_else(|| ApiError::invalid(expected))?;
    if let Some(key) = fields
        .keys()
        .find(|k| !["type", "budget_tokens"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid(format!("thinking.{key}: {expected}")));
    }
    match (fields.get("type").and_then(Value::as_str), fields.get("budget_tokens")) {
        (Some("disabled"), None) => Ok(Some(None)),
        (Some("enabled"), Some(budget)) => match budget.as_u64() {
            Some(budget) if (1..max_tokens).contains(&budget) => {
                Ok(Some(Some(budget as usize)))
            }
            _ => Err(ApiError::invalid(format!(
                "thinking.budget_tokens {budget}: expected a count of tokens below max_tokens ({max_tokens})"
            ))),
        },
        _ => Err(ApiError::invalid(expected)),
    }
}

/// An Anthropic tool, `{"name", "description"?, "input_schema"}`, in the OpenAI form the
/// templates read.
fn openai_tool(tool: &Value, i: usize) -> Result<Value, ApiError> {
    let Some(fields) = tool.as_object() else {
        return Err(ApiError::invalid(format!(
            "tools[{i}]: expected {{\"name\", \"description\", \"input_schema\"}}"
        )));
    };
    for (key, value) in fields {
        match key.as_str() {
            "name" | "description" | "input_schema" | "cache_control" => {}
            "type" if value == "custom" => {}
            _ => {
                return Err(ApiError::invalid(format!(
                    "tools[{i}].{key}: this server takes tools of name, description and input_schema (server tools such as web search are not implemented)"
                )))
            }
        }
    }
    if !tool.get("name").is_some_and(Value::is_string) {
        return Err(ApiError::invalid(format!(
            "tools[{i}].name: required, the tool's name"
        )));
    }
    if tool.get("input_schema").is_some_and(|s| !s.is_object()) {
        return Err(ApiError::invalid(format!(
            "tools[{i}].input_schema: expected a JSON Schema object"
        )));
    }
    let mut function = json!({ "name": tool.get("name").cloned().unwrap_or(Value::Null) });
    if let Some(description) = tool.get("description") {
        function["description"] = description.clone();
    }
    match tool.get("input_schema") {
        Some(schema) => function["parameters"] = schema.clone(),
        None => {
            return Err(ApiError::invalid(format!(
                "tools[{i}].input_schema: required (a JSON Schema object)"
            )))
        }
    }
    Ok(json!({ "type": "function", "function": function }))
}

/// `tool_choice` `{"type": "auto" | "any" | "tool" | "none", "name"?,
/// "disable_parallel_tool_use"?}`: the choice (`None` for `none`) and whether calls may
/// be parallel.
fn tool_choice(choice: Option<&Value>) -> Result<(Option<ToolChoice>, Option<bool>), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((Some(ToolChoice::Auto), None));
    };
    let bad = || {
        ApiError::invalid(format!(
            "tool_choice {choice}: expected {{\"type\": \"auto\" | \"any\" | \"none\"}} or {{\"type\": \"tool\", \"name\": ...}}, with \"disable_parallel_tool_use\" optional"
        ))
    };
    let fields = choice.as_object().ok_or_else(bad)?;
    if fields
        .keys()
        .any(|k| !["type", "name", "disable_parallel_tool_use"].contains(&k.as_str()))
    {
        return Err(bad());
    }
    let parallel = match fields.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(disable)) => Some(!disable),
        Some(_) => return Err(bad()),
    };
    let choice = match (
        fields.get("type").and_then(Value::as_str),
        fields.get("name"),
    ) {
        (Some("auto"), None) => Some(ToolChoice::Auto),
        (Some("any"), None) => Some(ToolChoice::Required),
        (Some("none"), None) => None,
        (Some("tool"), Some(Value::String(name))) => Some(ToolChoice::Named(name.clone())),
        _ => return Err(bad()),
    };
    Ok((choice, parallel))
}

/// The blocks of `content` (a string is one text block).
fn blocks(content: &Value, at: &str) -> Result<Vec<Value>, ApiError> {
    match content {
        Value::String(text) => Ok(vec![json!({ "type": "text", "text": text })]),
        Value::Array(blocks) => Ok(blocks.clone()),
        _ => Err(ApiError::invalid(format!(
            "{at}: expected a string or an array of blocks"
        ))),
    }
}

/// An assistant turn: its text blocks joined, its `tool_use` blocks its calls.
fn assistant_turn(content: &Value, at: &str) -> Result<ChatMessage, ApiError> {
    let mut text = Vec::new();
    let mut calls = Vec::new();
    for (j, block) in blocks(content, at)?.into_iter().enumerate() {
        // Past thinking, sent back as the answer came: the templates render none of it.
        if block
            .get("type")
            .is_some_and(|t| t == "thinking" || t == "redacted_thinking")
        {
            continue;
        }
        if block.get("type").is_some_and(|t| t == "tool_use") {
            let field = |key: &str| block.get(key);
            let (Some(Value::String(id)), Some(Value::String(name)), Some(Value::Object(input))) =
                (field("id"), field("name"), field("input"))
            else {
                return Err(ApiError::invalid(format!(
                    "{at}[{j}]: a tool_use block has an id, a name and an input object"
                )));
            };
            calls.push(ToolCall {
                id: id.clone(),
                name: name.clone(),
                arguments: input.clone(),
            });
        } else {
            text.push(block);
        }
    }
    let mut message = ChatMessage::text("assistant", text_of(&Value::Array(text), at)?);
    message.tool_calls = calls;
    Ok(message)
}

/// A user turn: a tool message for each `tool_result` block (the tool named by the call
/// it answers), then its text, if any.
fn user_turn(content: &Value, at: &str, messages: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    let mut text = Vec::new();
    for (j, block) in blocks(content, at)?.into_iter().enumerate() {
        if !block.get("type").is_some_and(|t| t == "tool_result") {
            text.push(block);
            continue;
        }
        let Some(id) = block.get("tool_use_id").and_then(Value::as_str) else {
            return Err(ApiError::invalid(format!(
                "{at}[{j}].tool_use_id: a tool_result names the tool_use it answers"
            )));
        };
        if let Some(key) = block.as_object().and_then(|b| {
            b.keys().find(|k| {
                ![
                    "type",
                    "tool_use_id",
                    "content",
                    "is_error",
                    "cache_control",
                ]
                .contains(&k.as_str())
            })
        }) {
            return Err(ApiError::invalid(format!(
                "{at}[{j}].{key}: this server does not implement this field"
            )));
        }
        let name = called_tool(messages, id).ok_or_else(|| {
                ApiError::invalid(format!(
                    "{at}[{j}].tool_use_id {id:?}: no earlier assistant turn has a tool_use with this id"
                ))
            })?;
        let result = match block.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(content) => text_of(content, &format!("{at}[{j}].content"))?,
        };
        let result = if block.get("is_error").is_some_and(|e| e == true) {
            format!("Error: {result}")
        } else {
            result
        };
        messages.push(ChatMessage {
            tool_call_id: Some(id.to_string()),
            name: Some(name),
            ..ChatMessage::text("tool", result)
        });
    }
    if !text.is_empty() || messages.last().is_none_or(|m| m.role != "tool") {
        messages.push(ChatMessage::text("user", text_of(&Value::Array(text), at)?));
    }
    Ok(())
}

/// The text of a content: a string, or text blocks (joined); `cache_control` on a block
/// means nothing here (every prompt's prefix is cached).
fn text_of(content: &Value, at: &str) -> Result<String, ApiError> {
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, block)| match (block.get("type"), block.get("text")) {
                (Some(kind), Some(Value::String(text))) if kind == "text" => {
                    if let Some(key) = block.as_object().and_then(|b| {
                        b.keys()
                            .find(|k| !["type", "text", "cache_control", "citations"].contains(&k.as_str()))
                    }) {
                        return Err(ApiError::invalid(format!(
                            "{at}[{j}].{key}: this server does not implement this field"
                        )));
                    }
                    Ok(text.as_str())
                }
                (kind, _) => Err(ApiError::invalid(format!(
                    "{at}[{j}].type {}: only text blocks ({{\"type\": \"text\", \"text\": ...}}) are supported",
                    kind.map_or("(none)".to_string(), Value::to_string)
                ))),
            })
            .collect(),
        _ => Err(ApiError::invalid(format!(
            "{at}: expected a string or an array of text blocks"
        ))),
    }
}

/// Why the message stopped, as Anthropic names it, and the stop sequence met.
fn stop_reason(finish: Finish, stops: &[String]) -> (&'static str, Value) {
    match finish {
        Finish::Stop => ("end_turn", Value::Null),
        Finish::StopString(index) => (
            "stop_sequence",
            stops.get(index).map_or(Value::Null, |s| json!(s)),
        ),
        Finish::Length => ("max_tokens", Value::Null),
        Finish::ToolCalls => ("tool_use", Value::Null),
    }
}

/// Anthropic's usage: `input_tokens` are those computed, the cached ones apart.
fn usage_body(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt - usage.cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached,
        "output_tokens": usage.completion,
    })
}

/// What a message says: its thinking, its text and its calls.
pub struct Content<'a> {
    pub thinking: &'a str,
    pub text: &'a str,
    pub calls: &'a [ToolCall],
}

/// The whole message, for a request without `stream`.
pub fn message(
    id: &str,
    model: &str,
    answer: Content,
    finish: Finish,
    stops: &[String],
    usage: Usage,
) -> Value {
    let (reason, sequence) = stop_reason(finish, stops);
    let mut content = Vec::new();
    if !answer.thinking.is_empty() {
        content.push(json!({ "type": "thinking", "thinking": answer.thinking, "signature": "" }));
    }
    if !answer.text.is_empty() || (answer.calls.is_empty() && answer.thinking.is_empty()) {
        content.push(json!({ "type": "text", "text": answer.text }));
    }
    content.extend(answer.calls.iter().map(tool_use));
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(usage),
    })
}

/// The stream's first event, `message_start`, with the prompt's token counts (`prompt`:
/// its tokens and those a kept state held; nothing generated yet).
pub fn stream_start(id: &str, model: &str, prompt: Usage) -> [(&'static str, Value); 1] {
    [(
        "message_start",
        json!({
            "type": "message_start",
            "message": {
                "id": id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": Value::Null,
                "stop_sequence": Value::Null,
                "usage": usage_body(prompt),
            },
        }),
    )]
}

/// A call as a `tool_use` block.
fn tool_use(call: &ToolCall) -> Value {
    json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments })
}

/// The content blocks of a streamed message, each opened when its first piece comes: the
/// thinking in a `thinking` block, text in a `text` block, each call a `tool_use` block of
/// its own (its input in one `input_json_delta`). A message with none has one empty text
/// block, as the whole message does.
#[derive(Default)]
pub struct Blocks {
    /// The index of the next block.
    next: usize,
    open: Option<Open>,
}

/// The kind of the block being written.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    Text,
    Thinking,
}

impl Blocks {
    /// A piece of text.
    pub fn text(&mut self, text: &str) -> Vec<(&'static str, Value)> {
        let mut events = self.open(Open::Text);
        events.push(self.delta(json!({ "type": "text_delta", "text": text })));
        events
    }

    /// A piece of the thinking.
    pub fn thinking(&mut self, text: &str) -> Vec<(&'static str, Value)> {
        let mut events = self.open(Open::Thinking);
        events.push(self.delta(json!({ "type": "thinking_delta", "thinking": text })));
        events
    }

    /// A call, whole.
    pub fn call(&mut self, call: &ToolCall) -> Vec<(&'static str, Value)> {
        let mut events = self.close();
        let start = json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": {} });
        events.push(block_start(self.next, start));
        events.push(self.delta(json!({
            "type": "input_json_delta",
            "partial_json": Value::Object(call.arguments.clone()).to_string(),
        })));
        events.push(block_stop(self.next));
        self.next += 1;
        events
    }

    /// A block of `kind` open, the one before closed.
    fn open(&mut self, kind: Open) -> Vec<(&'static str, Value)> {
        if self.open == Some(kind) {
            return Vec::new();
        }
        let mut events = self.close();
        let block = match kind {
            Open::Text => json!({ "type": "text", "text": "" }),
            Open::Thinking => json!({ "type": "thinking", "thinking": "", "signature": "" }),
        };
        events.push(block_start(self.next, block));
        self.open = Some(kind);
        events
    }

    /// A delta of the block at `next`.
    fn delta(&self, delta: Value) -> (&'static str, Value) {
        (
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": self.next, "delta": delta }),
        )
    }

    /// The open block's end, if one is open. A thinking block ends with its signature,
    /// which this server does not make (empty).
    fn close(&mut self) -> Vec<(&'static str, Value)> {
        let Some(kind) = self.open.take() else {
            return Vec::new();
        };
        let mut events = Vec::new();
        if kind == Open::Thinking {
            events.push(self.delta(json!({ "type": "signature_delta", "signature": "" })));
        }
        events.push(block_stop(self.next));
        self.next += 1;
        events
    }

    /// The stream's last events: the open block's end (an empty text block when there was
    /// none), the stop reason and usage, `message_stop`.
    pub fn end(
        &mut self,
        finish: Finish,
        stops: &[String],
        usage: Usage,
    ) -> Vec<(&'static str, Value)> {
        let (reason, sequence) = stop_reason(finish, stops);
        let mut events = if self.next == 0 && self.open.is_none() {
            self.open(Open::Text)
        } else {
            Vec::new()
        };
        events.extend(self.close());
        events.push((
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": { "stop_reason": reason, "stop_sequence": sequence },
                "usage": usage_body(usage),
            }),
        ));
        events.push(("message_stop", json!({ "type": "message_stop" })));
        events
    }
}

fn block_start(index: usize, block: Value) -> (&'static str, Value) {
    (
        "content_block_start",
        json!({ "type": "content_block_start", "index": index, "content_block": block }),
    )
}

fn block_stop(index: usize) -> (&'static str, Value) {
    (
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": index }),
    )
}

/// An error as Anthropic returns it: `{"type": "error", "error": {"type", "message"}}`,
/// the type from the HTTP status.
pub fn error_body(err: &ApiError) -> Value {
    let kind = match err.status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 | 503 => "overloaded_error",
        _ => "api_error",
    };
    json!({ "type": "error", "error": { "type": kind, "message": err.message } })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_map_to_a_chat_and_refuse_what_they_cannot_do() {
        let parsed = request(
            br#"{"model":"m","max_tokens":5,"system":[{"type":"text","text":"Be brief.","cache_control":{"type":"ephemeral"}}],
                "messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],
                "stop_sequences":["\n"],"top_k":3,"metadata":{"user_id":"u"}}"#,
        )
        .unwrap();
        assert_eq!(
            parsed.input,
            Input::Chat(Conversation::from(vec![
                ChatMessage::text("system", "Be brief."),
                ChatMessage::text("user", "Hi"),
            ]))
        );
        assert_eq!(parsed.shaping.top_k, 3);
        assert_eq!(parsed.stop, ["\n"]);
        let refused = |body: &[u8]| request(body).unwrap_err().message;
        let user = r#""messages":[{"role":"user","content":"Hi"}]"#;
        assert!(refused(format!("{{{user}}}").as_bytes()).starts_with("max_tokens"));
        assert!(refused(
            format!(r#"{{"max_tokens":1,{user},"tools":[{{"name":"f"}}]}}"#).as_bytes()
        )
        .starts_with("tools[0].input_schema: required"));
        assert!(refused(
            br#"{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image"}]}]}"#
        )
        .starts_with("messages[0].content[0].type"));
        assert!(refused(
            format!(
                r#"{{"max_tokens":9,{user},"thinking":{{"type":"enabled","budget_tokens":9}}}}"#
            )
            .as_bytes()
        )
        .starts_with("thinking"));
        assert!(
            refused(format!(r#"{{"max_tokens":1,{user},"temperature":1.5}}"#).as_bytes())
                .starts_with("temperature")
        );
    }

    #[test]
    fn tool_use_and_tool_result_blocks_become_calls_and_tool_messages() {
        let parsed = request(
            br#"{"max_tokens":9,"tools":[{"name":"ls","description":"List","input_schema":{"type":"object"}}],
                "tool_choice":{"type":"any","disable_parallel_tool_use":true},
                "messages":[{"role":"user","content":"Files?"},
                {"role":"assistant","content":[{"type":"text","text":"Looking."},{"type":"tool_use","id":"toolu_1","name":"ls","input":{"dir":"/"}}]},
                {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"a b"},{"type":"text","text":"And?"}]}]}"#,
        )
        .unwrap();
        let Input::Chat(conversation) = parsed.input else {
            panic!("a chat")
        };
        assert_eq!(
            conversation.tools,
            vec![
                json!({"type": "function", "function": {"name": "ls", "description": "List", "parameters": {"type": "object"}}})
            ]
        );
        let roles: Vec<_> = conversation
            .messages
            .iter()
            .map(|m| m.role.as_str())
            .collect();
        assert_eq!(roles, ["user", "assistant", "tool", "user"]);
        let call = &conversation.messages[1].tool_calls[0];
        assert_eq!((call.id.as_str(), call.name.as_str()), ("toolu_1", "ls"));
        assert_eq!(conversation.messages[1].content, "Looking.");
        let result = &conversation.messages[2];
        assert_eq!(result.name.as_deref(), Some("ls"));
        assert_eq!(result.content, "a b");
        let tools = parsed.tools.unwrap();
        assert_eq!(
            (tools.choice, tools.parallel),
            (ToolChoice::Required, false)
        );
        let refused = |body: &str| request(body.as_bytes()).unwrap_err().message;
        let result_for = |id: &str| {
            format!(
                r#"{{"max_tokens":1,"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"{id}"}}]}}]}}"#
            )
        };
        assert!(refused(&result_for("x")).contains("no earlier assistant turn"));
        let named = r#"{"max_tokens":1,"messages":[{"role":"user","content":"Hi"}],
            "tools":[{"name":"ls","input_schema":{}}],"tool_choice":{"type":"tool","name":"rm"}}"#;
        assert!(refused(named).contains("\"rm\", which is not in tools"));
        // A thinking answer sent back as it came: its thinking is not rendered.
        let back = r#"{"max_tokens":9,"tools":[{"name":"ls","input_schema":{}}],"messages":[
            {"role":"user","content":"Files?"},
            {"role":"assistant","content":[{"type":"thinking","thinking":"hm","signature":""},
                {"type":"tool_use","id":"t1","name":"ls","input":{}}]},
            {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"a"}]}]}"#;
        let Input::Chat(conversation) = request(back.as_bytes()).unwrap().input else {
            panic!("a chat")
        };
        assert_eq!(conversation.messages[1].content, "");
        assert_eq!(conversation.messages[1].tool_calls.len(), 1);
        let prefilled = r#"{"max_tokens":99,"thinking":{"type":"enabled","budget_tokens":9},
            "messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Well"}]}"#;
        assert!(refused(prefilled).starts_with("messages: a prefilled answer"));
        let unnamed = r#"{"max_tokens":9,"tools":[{"input_schema":{}}],"messages":[{"role":"user","content":"Hi"}]}"#;
        assert!(refused(unnamed).starts_with("tools[0].name"));
    }
}
