//! Anthropic's Messages wire format (`POST /v1/messages`): request bodies parsed into the
//! same typed [`Request`] the OpenAI endpoints make, the message body, the stream's events
//! and Anthropic-shaped errors. No engine, tokenizer or HTTP machinery here.

use serde::Deserialize;
use serde_json::{json, Value};

use super::api::{ApiError, Finish, Input, Request, Usage, MAX_STOP_BYTES};
use crate::sampling::Shaping;
use crate::text::ChatMessage;

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
        let says_nothing = value.is_null()
            || value.as_array().is_some_and(Vec::is_empty)
            || (key == "tool_choice"
                && value
                    .get("type")
                    .is_some_and(|t| t == "auto" || t == "none"));
        if !says_nothing && !IGNORED_FIELDS.contains(&key.as_str()) {
            return Err(ApiError::invalid(format!(
                "{key}: this server does not implement this field; leave it out (docs/serve.md lists the fields coli serve takes)"
            )));
        }
    }
    if let Some(thinking) = &parsed.thinking {
        if !thinking.is_null() && thinking.get("type").is_none_or(|t| t != "disabled") {
            return Err(ApiError::invalid(
                "thinking: this server does not implement thinking blocks; leave it out or give {\"type\": \"disabled\"}",
            ));
        }
    }
    let max_tokens = parsed
        .max_tokens
        .ok_or_else(|| ApiError::invalid("max_tokens: required"))?;
    if parsed.messages.is_empty() {
        return Err(ApiError::invalid("messages: give at least one message"));
    }
    let mut messages = Vec::new();
    if let Some(system) = parsed.system.filter(|s| !s.is_null()) {
        messages.push(ChatMessage {
            role: "system".to_string(),
            content: text_of(&system, "system")?,
        });
    }
    for (i, message) in parsed.messages.iter().enumerate() {
        if let Some((key, _)) = message.rest.iter().find(|(_, v)| !v.is_null()) {
            return Err(ApiError::invalid(format!(
                "messages[{i}].{key}: this server does not implement this field"
            )));
        }
        if message.role != "user" && message.role != "assistant" {
            return Err(ApiError::invalid(format!(
                "messages[{i}].role {:?}: expected \"user\" or \"assistant\" (the system prompt goes in `system`)",
                message.role
            )));
        }
        messages.push(ChatMessage {
            role: message.role.clone(),
            content: text_of(&message.content, &format!("messages[{i}].content"))?,
        });
    }
    if parsed
        .messages
        .last()
        .is_some_and(|m| m.role == "assistant")
    {
        return Err(ApiError::invalid(
            "messages: the last message is the assistant's (a prefill); this server answers a last user message",
        ));
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
    Ok(Request {
        model: parsed.model,
        input: Input::Chat(messages),
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
    })
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

/// The whole message, for a request without `stream`.
pub fn message(
    id: &str,
    model: &str,
    text: &str,
    finish: Finish,
    stops: &[String],
    usage: Usage,
) -> Value {
    let (reason, sequence) = stop_reason(finish, stops);
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{ "type": "text", "text": text }],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_body(usage),
    })
}

/// The stream's first events: `message_start`, then the text block's start.
pub fn stream_start(id: &str, model: &str) -> [(&'static str, Value); 2] {
    [
        (
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
                    "usage": usage_body(Usage::default()),
                },
            }),
        ),
        (
            "content_block_start",
            json!({
                "type": "content_block_start",
                "index": 0,
                "content_block": { "type": "text", "text": "" },
            }),
        ),
    ]
}

/// A piece of the text block.
pub fn text_delta(text: &str) -> (&'static str, Value) {
    (
        "content_block_delta",
        json!({
            "type": "content_block_delta",
            "index": 0,
            "delta": { "type": "text_delta", "text": text },
        }),
    )
}

/// The stream's last events: the block's end, the stop reason and usage, `message_stop`.
pub fn stream_end(finish: Finish, stops: &[String], usage: Usage) -> [(&'static str, Value); 3] {
    let (reason, sequence) = stop_reason(finish, stops);
    [
        (
            "content_block_stop",
            json!({ "type": "content_block_stop", "index": 0 }),
        ),
        (
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": { "stop_reason": reason, "stop_sequence": sequence },
                "usage": usage_body(usage),
            }),
        ),
        ("message_stop", json!({ "type": "message_stop" })),
    ]
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
            Input::Chat(vec![
                ChatMessage {
                    role: "system".into(),
                    content: "Be brief.".into()
                },
                ChatMessage {
                    role: "user".into(),
                    content: "Hi".into()
                },
            ])
        );
        assert_eq!(parsed.shaping.top_k, 3);
        assert_eq!(parsed.stop, ["\n"]);
        let refused = |body: &[u8]| request(body).unwrap_err().message;
        let user = r#""messages":[{"role":"user","content":"Hi"}]"#;
        assert!(refused(format!("{{{user}}}").as_bytes()).starts_with("max_tokens"));
        assert!(refused(
            format!(r#"{{"max_tokens":1,{user},"tools":[{{"name":"f"}}]}}"#).as_bytes()
        )
        .starts_with("tools:"));
        assert!(refused(
            br#"{"max_tokens":1,"messages":[{"role":"user","content":[{"type":"image"}]}]}"#
        )
        .starts_with("messages[0].content[0].type"));
        assert!(refused(
            format!(
                r#"{{"max_tokens":1,{user},"thinking":{{"type":"enabled","budget_tokens":9}}}}"#
            )
            .as_bytes()
        )
        .starts_with("thinking"));
        assert!(
            refused(format!(r#"{{"max_tokens":1,{user},"temperature":1.5}}"#).as_bytes())
                .starts_with("temperature")
        );
    }
}
