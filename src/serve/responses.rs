//! OpenAI's Responses wire format (`POST /v1/responses`), stateless: request bodies parsed
//! into the same typed [`Request`] the chat endpoint makes (`input` items become a
//! [`Conversation`], tools and `text.format` the chat's), and the response object and its
//! stream of events built from the engine's text and calls. The server keeps nothing
//! between requests, so what would refer to a stored response or conversation is refused.
//! No engine, tokenizer or HTTP machinery here.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::api::{self, ApiError, Finish, Input, Request, ToolChoice, Usage};
use crate::guide::Grammar;
use crate::sampling::Shaping;
use crate::text::{called_tool, ChatMessage, Conversation, ToolCall};

/// What a request that needs a stored response or conversation is told.
const STATELESS: &str =
    "this server is stateless (it stores no responses): send the whole conversation in input";

#[derive(Deserialize)]
struct Body {
    model: Option<String>,
    input: Option<Value>,
    instructions: Option<Value>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    max_output_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    stream: Option<bool>,
    text: Option<Value>,
    store: Option<bool>,
    background: Option<bool>,
    truncation: Option<String>,
    /// Every other field: refused unless ignorable ([`api::refuse_unknown`]).
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// What the response object repeats of its request, as OpenAI's does.
#[derive(Debug, Clone, PartialEq)]
pub struct Echo {
    pub instructions: Option<String>,
    /// In the Responses form, as given.
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    pub max_output_tokens: Option<u64>,
    /// The server's default where the request gives none (the caller fills it in).
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// `{"format": ...}`.
    pub text: Value,
}

/// `null`, `[]`, `{}` and `false` ask for nothing.
fn asks_nothing(value: &Value) -> bool {
    match value {
        Value::Null | Value::Bool(false) => true,
        Value::Array(items) => items.is_empty(),
        Value::Object(fields) => fields.is_empty(),
        _ => false,
    }
}

/// A `/v1/responses` body, and what its response repeats of it.
pub fn request(body: &[u8]) -> Result<(Request, Echo), ApiError> {
    let mut parsed: Body = serde_json::from_slice(body).map_err(|err| {
        ApiError::invalid(format!(
            "the request body is not the JSON /v1/responses takes: {err}"
        ))
    })?;
    for key in ["previous_response_id", "conversation", "prompt"] {
        if parsed.rest.get(key).is_some_and(|v| !asks_nothing(v)) {
            return Err(ApiError::invalid(format!("{key}: {STATELESS}")));
        }
    }
    if parsed.store == Some(true) {
        return Err(ApiError::invalid(format!(
            "store true: {STATELESS}; give \"store\": false or leave it out"
        )));
    }
    if parsed.background == Some(true) {
        return Err(ApiError::invalid(format!(
            "background true: {STATELESS}; a response is answered to the request that asks for it (stream it to see it grow)"
        )));
    }
    if parsed
        .rest
        .get("reasoning")
        .is_some_and(|v| !asks_nothing(v))
    {
        return Err(ApiError::invalid(
            "reasoning: this server does not implement reasoning options (effort, summary); leave it out",
        ));
    }
    if parsed.rest.get("include").is_some_and(|v| !asks_nothing(v)) {
        return Err(ApiError::invalid(
            "include: this server adds no optional data to a response (no reasoning, logprobs or tool outputs); leave it out",
        ));
    }
    parsed.rest.remove("reasoning");
    parsed.rest.remove("include");
    api::refuse_unknown(&parsed.rest, "")?;
    // OpenAI's floor is 16; below 1 there is no answer to give.
    if parsed.max_output_tokens == Some(0) {
        return Err(ApiError::invalid(
            "max_output_tokens 0: expected at least 1",
        ));
    }
    if let Some(other) = parsed.truncation.as_deref().filter(|t| *t != "disabled") {
        return Err(ApiError::invalid(format!(
            "truncation {}: this server does not drop input; give \"disabled\" (a prompt beyond the context is a 400) or leave it out",
            crate::text::excerpt(other)
        )));
    }
    let instructions = match parsed.instructions {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text),
        Some(_) => return Err(ApiError::invalid("instructions: expected a string")),
    };
    let mut messages = Vec::new();
    if let Some(text) = &instructions {
        messages.push(ChatMessage::text("system", text.as_str()));
    }
    match parsed.input {
        Some(Value::String(text)) => messages.push(ChatMessage::text("user", text)),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                add_item(item, &format!("input[{i}]"), &mut messages)?;
            }
        }
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                "input: required (a string, or a list of message, function_call and function_call_output items)",
            ))
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "input: expected a string, or a non-empty list of message, function_call and function_call_output items",
            ))
        }
    }
    if let Some(t) = parsed.temperature.filter(|t| !(t.is_finite() && *t >= 0.0)) {
        return Err(ApiError::invalid(format!(
            "temperature {t}: expected a number >= 0 (0 = greedy)"
        )));
    }
    if let Some(p) = parsed.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return Err(ApiError::invalid(format!(
            "top_p {p}: expected a number in (0, 1]"
        )));
    }
    let given_tools = parsed.tools.unwrap_or_default();
    let tools = given_tools
        .iter()
        .enumerate()
        .map(|(i, tool)| chat_tool(tool, i))
        .collect::<Result<Vec<_>, _>>()?;
    api::check_tools(&tools)?;
    let mut conversation = Conversation {
        messages,
        tools,
        variables: Map::new(),
        prefill: String::new(),
    };
    let (choice, tool_choice) = tool_choice(parsed.tool_choice)?;
    let tools = api::tools_for(&mut conversation, choice, parsed.parallel_tool_calls)?;
    let (grammar, text) = text_format(parsed.text)?;
    if grammar.is_some() && tools.is_some() {
        return Err(ApiError::invalid(
            "text.format with tools: an answer either calls tools or matches the format; give tool_choice \"none\" or leave the format out",
        ));
    }
    let echo = Echo {
        instructions,
        tools: given_tools,
        tool_choice,
        parallel_tool_calls: parsed.parallel_tool_calls.unwrap_or(true),
        max_output_tokens: parsed.max_output_tokens,
        temperature: parsed.temperature,
        top_p: parsed.top_p,
        text,
    };
    let request = Request {
        model: parsed.model,
        input: Input::Chat(conversation),
        max_tokens: parsed
            .max_output_tokens
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        temperature: parsed.temperature,
        top_p: parsed.top_p,
        seed: None,
        stop: Vec::new(),
        stream: parsed.stream.unwrap_or(false),
        stream_usage: false,
        routed_experts: false,
        choices: 1,
        clamp_tokens: false,
        shaping: Shaping::default(),
        logprobs: None,
        tools,
        grammar,
        thinking_budget: None,
        echo: false,
    };
    Ok((request, echo))
}

/// The fields of `item` (at `at`) beyond `known`, refused when they ask for something.
fn refuse_other_fields(
    item: &Map<String, Value>,
    known: &[&str],
    at: &str,
) -> Result<(), ApiError> {
    let mut rest = item.clone();
    rest.retain(|key, _| !known.contains(&key.as_str()));
    api::refuse_unknown(&rest, &format!("{at}."))
}

/// `item`'s string field `key`, required.
fn string_field<'a>(
    item: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::invalid(format!("{at}.{key}: required, a string")))
}

/// One `input` item onto `messages`: a message; a `function_call` (joining the assistant
/// message before it, so that consecutive calls are one turn's); a `function_call_output`
/// (a tool message, the tool named by the call it answers).
fn add_item(item: &Value, at: &str, messages: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    let Some(fields) = item.as_object() else {
        return Err(ApiError::invalid(format!(
            "{at}: expected an item object (a message, function_call or function_call_output)"
        )));
    };
    // The SDKs send a message without `type`.
    let kind = match fields.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        None | Some(Value::Null) if fields.contains_key("role") => "message",
        _ => {
            return Err(ApiError::invalid(format!(
                "{at}.type: expected \"message\", \"function_call\" or \"function_call_output\""
            )))
        }
    };
    match kind {
        "message" => {
            // `id` and `status` come with a past response's output items sent back.
            refuse_other_fields(fields, &["type", "role", "content", "id", "status"], at)?;
            let role = match string_field(fields, "role", at)? {
                // Templates know no `developer`; OpenAI ranks it as the system's.
                "developer" | "system" => "system",
                role @ ("user" | "assistant") => role,
                other => {
                    return Err(ApiError::invalid(format!(
                        "{at}.role {other:?}: expected \"user\", \"assistant\", \"system\" or \"developer\""
                    )))
                }
            };
            let text = text_of(fields.get("content"), &format!("{at}.content"))?;
            messages.push(ChatMessage::text(role, text));
        }
        "function_call" => {
            refuse_other_fields(
                fields,
                &["type", "call_id", "name", "arguments", "id", "status"],
                at,
            )?;
            let bad_arguments = || {
                ApiError::invalid(format!(
                    "{at}.arguments: expected a JSON object, as a string"
                ))
            };
            let arguments = match serde_json::from_str(string_field(fields, "arguments", at)?) {
                Ok(Value::Object(arguments)) => arguments,
                _ => return Err(bad_arguments()),
            };
            let call = ToolCall {
                id: string_field(fields, "call_id", at)?.to_string(),
                name: string_field(fields, "name", at)?.to_string(),
                arguments,
            };
            match messages.last_mut() {
                Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                _ => messages.push(ChatMessage {
                    tool_calls: vec![call],
                    ..ChatMessage::text("assistant", "")
                }),
            }
        }
        "function_call_output" => {
            refuse_other_fields(fields, &["type", "call_id", "output", "id", "status"], at)?;
            let id = string_field(fields, "call_id", at)?;
            let name = called_tool(messages, id)
                .ok_or_else(|| {
                    ApiError::invalid(format!(
                        "{at}.call_id {id:?}: no earlier function_call item has this call_id"
                    ))
                })?;
            let output = text_of(fields.get("output"), &format!("{at}.output"))?;
            messages.push(ChatMessage {
                tool_call_id: Some(id.to_string()),
                name: Some(name),
                ..ChatMessage::text("tool", output)
            });
        }
        "item_reference" => {
            return Err(ApiError::invalid(format!(
                "{at}.type \"item_reference\": {STATELESS}"
            )))
        }
        other => {
            return Err(ApiError::invalid(format!(
                "{at}.type {other:?}: this server takes message, function_call and function_call_output items"
            )))
        }
    }
    Ok(())
}

/// The text of a content (or a call's output): a string, or text parts (`input_text`,
/// `output_text`), joined.
fn text_of(content: Option<&Value>, at: &str) -> Result<String, ApiError> {
    match content {
        Some(Value::String(text)) => Ok(text.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .enumerate()
            .map(|(j, part)| {
                let at = format!("{at}[{j}]");
                let kind = part.get("type").and_then(Value::as_str);
                match (kind, part.as_object()) {
                    (Some("input_text" | "output_text"), Some(fields)) => {
                        // A past answer's parts sent back carry these, empty.
                        refuse_other_fields(
                            fields,
                            &["type", "text", "annotations", "logprobs"],
                            &at,
                        )?;
                        string_field(fields, "text", &at).map(str::to_string)
                    }
                    _ => Err(ApiError::invalid(format!(
                        "{at}.type: only text parts ({{\"type\": \"input_text\" or \"output_text\", \"text\": ...}}) are supported"
                    ))),
                }
            })
            .collect(),
        _ => Err(ApiError::invalid(format!(
            "{at}: expected a string or an array of text parts"
        ))),
    }
}

/// A Responses tool, `{"type": "function", "name", "description"?, "parameters"?,
/// "strict"?}`, in the chat form the templates read.
fn chat_tool(tool: &Value, i: usize) -> Result<Value, ApiError> {
    let at = format!("tools[{i}]");
    let Some(fields) = tool.as_object() else {
        return Err(ApiError::invalid(format!(
            "{at}: expected {{\"type\": \"function\", \"name\", \"description\", \"parameters\"}}"
        )));
    };
    match fields.get("type").and_then(Value::as_str) {
        Some("function") => {}
        other => {
            return Err(ApiError::invalid(format!(
                "{at}.type {}: this server calls only functions ({{\"type\": \"function\", \"name\", \"parameters\"}}); hosted tools such as web search are not implemented",
                other.map_or("(none)".to_string(), |t| format!("{t:?}"))
            )))
        }
    }
    refuse_other_fields(
        fields,
        &["type", "name", "description", "parameters", "strict"],
        &at,
    )?;
    match fields.get("name").and_then(Value::as_str) {
        Some(name) if !name.is_empty() && name.len() <= 256 => {}
        _ => {
            return Err(ApiError::invalid(format!(
                "{at}.name: expected a name of 1 to 256 characters"
            )))
        }
    }
    if fields
        .get("parameters")
        .is_some_and(|p| !p.is_null() && !p.is_object())
    {
        return Err(ApiError::invalid(format!(
            "{at}.parameters: expected a JSON Schema object"
        )));
    }
    let function: Map<String, Value> = fields
        .iter()
        .filter(|(key, value)| *key != "type" && !value.is_null())
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    Ok(json!({ "type": "function", "function": function }))
}

/// `tool_choice`: `"auto"` (the default), `"none"`, `"required"` or `{"type": "function",
/// "name"}`; the choice (`None` for `none`) and its form for the response.
fn tool_choice(choice: Option<Value>) -> Result<(Option<ToolChoice>, Value), ApiError> {
    let Some(choice) = choice.filter(|c| !c.is_null()) else {
        return Ok((Some(ToolChoice::Auto), json!("auto")));
    };
    let parsed = match &choice {
        Value::String(word) => match word.as_str() {
            "auto" => Some(Some(ToolChoice::Auto)),
            "none" => Some(None),
            "required" => Some(Some(ToolChoice::Required)),
            _ => None,
        },
        Value::Object(fields) => match (fields.get("type"), fields.get("name")) {
            (Some(kind), Some(Value::String(name))) if kind == "function" && fields.len() == 2 => {
                Some(Some(ToolChoice::Named(name.clone())))
            }
            _ => None,
        },
        _ => None,
    };
    match parsed {
        Some(parsed) => Ok((parsed, choice)),
        None => Err(ApiError::invalid(format!(
            "tool_choice {choice}: expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"name\": ...}}"
        ))),
    }
}

/// `text`: `{"format": {"type": "text"}}` (no constraint, the default), `{"type":
/// "json_object"}` or `{"type": "json_schema", "name", "schema", "strict"?,
/// "description"?}`; the grammar and the `text` the response repeats.
fn text_format(text: Option<Value>) -> Result<(Option<Grammar>, Value), ApiError> {
    let plain = json!({ "format": { "type": "text" } });
    let Some(text) = text.filter(|t| !t.is_null()) else {
        return Ok((None, plain));
    };
    let Some(fields) = text.as_object() else {
        return Err(ApiError::invalid("text: expected {\"format\": {...}}"));
    };
    api::only_fields(fields, &["format"], "text")?;
    let Some(format) = fields.get("format").filter(|f| !f.is_null()) else {
        return Ok((None, plain));
    };
    let expected = "expected {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", \"name\", \"schema\"}";
    let Some(format_fields) = format.as_object() else {
        return Err(ApiError::invalid(format!("text.format: {expected}")));
    };
    let grammar = match format_fields.get("type").and_then(Value::as_str) {
        Some("text") => api::only_fields(format_fields, &["type"], "text.format").map(|()| None),
        Some("json_object") => api::only_fields(format_fields, &["type"], "text.format")
            .map(|()| Some(Grammar::JsonObject)),
        Some("json_schema") => api::json_schema_grammar(
            format_fields,
            &["type", "name", "schema", "strict", "description"],
            "text.format",
        )
        .map(Some),
        _ => Err(ApiError::invalid(format!("text.format.type: {expected}"))),
    }?;
    Ok((grammar, text))
}

/// A refusal of the engine thread in this API's words: it names the chat fields
/// (`max_tokens`, `response_format`), whose Responses names differ.
pub fn in_own_words(err: ApiError) -> ApiError {
    let renamed = [
        ("max_tokens ", "max_output_tokens "),
        ("response_format/grammar: ", "text.format: "),
    ];
    for (chat, own) in renamed {
        if let Some(rest) = err.message.strip_prefix(chat) {
            return ApiError {
                message: format!("{own}{rest}"),
                ..err
            };
        }
    }
    err
}

/// A server-sent event: its name, which is also its body's `type`, and the body.
pub type Sent = (&'static str, Value);

/// One response's output items, built from the engine's text and calls as they come: the
/// stream's events on the way, the whole response at the end. Text goes to an open
/// message item (a new one after a call); each call is a `function_call` item of its own,
/// its arguments in one delta. A request without `stream` builds the same items and sends
/// none of the events, so that both give the same output.
pub struct Output {
    /// What the ids of the response and its items are made of: unique to the response.
    stem: String,
    created_at: u64,
    model: String,
    echo: Echo,
    sequence: u64,
    /// The finished items.
    items: Vec<Value>,
    /// The text of the open message item, which would be `items.len()`.
    open: Option<String>,
    /// Reasoning not yet made an item (a model's own template may open its thinking).
    thinking: String,
    messages: usize,
    calls: usize,
    /// How the response ended and its token counts, once it has.
    end: Option<(Finish, Usage)>,
}

impl Output {
    pub fn new(stem: String, created_at: u64, model: String, echo: Echo) -> Output {
        Output {
            stem,
            created_at,
            model,
            echo,
            sequence: 0,
            items: Vec::new(),
            open: None,
            thinking: String::new(),
            messages: 0,
            calls: 0,
            end: None,
        }
    }

    /// The response's id.
    pub fn id(&self) -> String {
        format!("resp_{}", self.stem)
    }

    /// The `call_id` the next call gets.
    pub fn next_call_id(&self) -> String {
        format!("call_{}-{}", self.stem, self.calls)
    }

    /// An event named `kind`: its body with `type` and the next sequence number.
    fn event(&mut self, kind: &'static str, mut body: Value) -> Sent {
        body["type"] = kind.into();
        body["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        (kind, body)
    }

    /// The stream's first events: `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Sent> {
        let response = self.response();
        vec![
            self.event("response.created", json!({ "response": response })),
            self.event("response.in_progress", json!({ "response": response })),
        ]
    }

    fn message_id(&self) -> String {
        format!("msg_{}-{}", self.stem, self.messages)
    }

    fn text_part(text: &str) -> Value {
        json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
    }

    fn message_item(&self, text: &str, status: &str) -> Value {
        let content = if status == "in_progress" {
            json!([])
        } else {
            json!([Output::text_part(text)])
        };
        json!({
            "type": "message",
            "id": self.message_id(),
            "status": status,
            "role": "assistant",
            "content": content,
        })
    }

    /// The position of the item being built, in `output`.
    fn index(&self) -> usize {
        self.items.len()
    }

    /// A piece of reasoning: kept until the next text, call or end makes it a `reasoning`
    /// item, added and done at once.
    pub fn reasoning(&mut self, text: &str) -> Vec<Sent> {
        self.thinking.push_str(text);
        Vec::new()
    }

    /// The reasoning kept, as an item of its own.
    fn reasoning_item(&mut self) -> Vec<Sent> {
        if self.thinking.is_empty() {
            return Vec::new();
        }
        let index = self.index();
        let item = json!({
            "type": "reasoning",
            "id": format!("rs_{}-{index}", self.stem),
            "summary": [],
            "content": [{ "type": "reasoning_text", "text": std::mem::take(&mut self.thinking) }],
            "status": "completed",
        });
        let events = vec![
            self.event(
                "response.output_item.added",
                json!({ "output_index": index, "item": item }),
            ),
            self.event(
                "response.output_item.done",
                json!({ "output_index": index, "item": item }),
            ),
        ];
        self.items.push(item);
        events
    }

    /// A piece of text.
    pub fn text(&mut self, text: &str) -> Vec<Sent> {
        let mut events = self.reasoning_item();
        if self.open.is_none() {
            events.extend(self.open_message());
        }
        if let Some(open) = &mut self.open {
            open.push_str(text);
        }
        let delta = json!({
            "item_id": self.message_id(),
            "output_index": self.index(),
            "content_index": 0,
            "delta": text,
            "logprobs": [],
        });
        events.push(self.event("response.output_text.delta", delta));
        events
    }

    fn open_message(&mut self) -> Vec<Sent> {
        self.open = Some(String::new());
        let item = self.message_item("", "in_progress");
        let part = json!({
            "item_id": self.message_id(),
            "output_index": self.index(),
            "content_index": 0,
            "part": Output::text_part(""),
        });
        let index = self.index();
        vec![
            self.event(
                "response.output_item.added",
                json!({ "output_index": index, "item": item }),
            ),
            self.event("response.content_part.added", part),
        ]
    }

    /// The open message item's end, if one is open: `status` it is left with.
    fn close_message(&mut self, status: &str) -> Vec<Sent> {
        let Some(text) = self.open.take() else {
            return Vec::new();
        };
        let (id, index) = (self.message_id(), self.index());
        let at = json!({ "item_id": id, "output_index": index, "content_index": 0 });
        let mut text_done = at.clone();
        text_done["text"] = text.as_str().into();
        text_done["logprobs"] = json!([]);
        let mut part_done = at;
        part_done["part"] = Output::text_part(&text);
        let item = self.message_item(&text, status);
        let events = vec![
            self.event("response.output_text.done", text_done),
            self.event("response.content_part.done", part_done),
            self.event(
                "response.output_item.done",
                json!({ "output_index": index, "item": item }),
            ),
        ];
        self.items.push(item);
        self.messages += 1;
        events
    }

    /// A call, whole, its `id` from [`Output::next_call_id`].
    pub fn call(&mut self, call: &ToolCall) -> Vec<Sent> {
        let mut events = self.reasoning_item();
        events.extend(self.close_message("completed"));
        let arguments = Value::Object(call.arguments.clone()).to_string();
        let id = format!("fc_{}-{}", self.stem, self.calls);
        self.calls += 1;
        let index = self.index();
        let item = |arguments: &str, status: &str| {
            json!({
                "type": "function_call",
                "id": id,
                "call_id": call.id,
                "name": call.name,
                "arguments": arguments,
                "status": status,
            })
        };
        let at = json!({ "item_id": id, "output_index": index });
        let mut delta = at.clone();
        delta["delta"] = arguments.as_str().into();
        let mut done = at;
        done["arguments"] = arguments.as_str().into();
        let added = item("", "in_progress");
        let finished = item(&arguments, "completed");
        events.extend([
            self.event(
                "response.output_item.added",
                json!({ "output_index": index, "item": added }),
            ),
            self.event("response.function_call_arguments.delta", delta),
            self.event("response.function_call_arguments.done", done),
            self.event(
                "response.output_item.done",
                json!({ "output_index": index, "item": finished }),
            ),
        ]);
        self.items.push(finished);
        events
    }

    /// The stream's last events: the open message's end (an empty message when the
    /// answer has neither text nor calls), then `response.completed`, or
    /// `response.incomplete` at `max_output_tokens`.
    pub fn end(&mut self, finish: Finish, usage: Usage) -> Vec<Sent> {
        let status = match finish {
            Finish::Length => "incomplete",
            _ => "completed",
        };
        let mut events = self.reasoning_item();
        if self.items.iter().all(|item| item["type"] == "reasoning") && self.open.is_none() {
            events.extend(self.open_message());
        }
        events.extend(self.close_message(status));
        self.end = Some((finish, usage));
        let kind = match finish {
            Finish::Length => "response.incomplete",
            _ => "response.completed",
        };
        let response = self.response();
        events.push(self.event(kind, json!({ "response": response })));
        events
    }

    /// A failure after the stream started: an `error` event.
    pub fn error(&mut self, err: &ApiError) -> Sent {
        let body = json!({ "code": err.code, "message": err.message, "param": Value::Null });
        self.event("error", body)
    }

    /// The response object: in progress, or as it ended.
    pub fn response(&self) -> Value {
        let (status, incomplete, usage) = match self.end {
            None => ("in_progress", Value::Null, Value::Null),
            Some((Finish::Length, usage)) => (
                "incomplete",
                json!({ "reason": "max_output_tokens" }),
                usage_body(usage),
            ),
            Some((_, usage)) => ("completed", Value::Null, usage_body(usage)),
        };
        let echo = &self.echo;
        json!({
            "id": self.id(),
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": Value::Null,
            "incomplete_details": incomplete,
            "instructions": echo.instructions,
            "max_output_tokens": echo.max_output_tokens,
            "model": self.model,
            "output": self.items,
            "parallel_tool_calls": echo.parallel_tool_calls,
            "temperature": echo.temperature,
            "text": echo.text,
            "tool_choice": echo.tool_choice,
            "tools": echo.tools,
            "top_p": echo.top_p,
            "truncation": "disabled",
            "usage": usage,
        })
    }
}

/// The Responses API's usage: the prompt tokens with those a kept state held, and the
/// generated ones (no reasoning tokens: this server tells no reasoning from the text).
fn usage_body(usage: Usage) -> Value {
    json!({
        "input_tokens": usage.prompt,
        "input_tokens_details": { "cached_tokens": usage.cached, "cache_write_tokens": 0 },
        "output_tokens": usage.completion,
        "output_tokens_details": { "reasoning_tokens": usage.reasoning },
        "total_tokens": usage.prompt + usage.completion,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conversation(request: &Request) -> &Conversation {
        match &request.input {
            Input::Chat(conversation) => conversation,
            other => panic!("a chat, not {other:?}"),
        }
    }

    fn refused(body: &str) -> String {
        request(body.as_bytes()).unwrap_err().message
    }

    #[test]
    fn a_string_input_is_a_user_message_after_the_instructions() {
        let (parsed, echo) = request(
            br#"{"model":"m","input":"Hi","instructions":"Be brief.","max_output_tokens":7,
                "temperature":0,"stream":true,"store":false,"metadata":{"a":"b"},"user":"u"}"#,
        )
        .unwrap();
        assert_eq!(
            conversation(&parsed).messages,
            [
                ChatMessage::text("system", "Be brief."),
                ChatMessage::text("user", "Hi")
            ]
        );
        assert_eq!(parsed.max_tokens, Some(7));
        assert_eq!(parsed.temperature, Some(0.0));
        assert!(parsed.stream && parsed.tools.is_none() && parsed.grammar.is_none());
        assert_eq!(echo.tool_choice, "auto");
        assert_eq!(echo.text, json!({"format": {"type": "text"}}));
    }

    #[test]
    fn items_become_messages_calls_and_tool_results() {
        let (parsed, echo) = request(
            br#"{"input":[
                {"role":"developer","content":"Rules."},
                {"type":"message","role":"user","content":[{"type":"input_text","text":"Weather "},{"type":"input_text","text":"and time?"}]},
                {"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Looking.","annotations":[],"logprobs":[]}]},
                {"type":"function_call","call_id":"c1","name":"weather","arguments":"{\"city\":\"Oslo\"}","id":"fc_1","status":"completed"},
                {"type":"function_call","call_id":"c2","name":"time","arguments":"{}","phase":null},
                {"type":"function_call_output","call_id":"c2","output":"noon"},
                {"type":"function_call_output","call_id":"c1","output":[{"type":"input_text","text":"-3 C"}]},
                {"type":"function_call","call_id":"c3","name":"time","arguments":"{}"}
              ],
              "tools":[{"type":"function","name":"weather","description":"Forecast.","parameters":{"type":"object"},"strict":true},
                       {"type":"function","name":"time"}],
              "tool_choice":{"type":"function","name":"weather"},"parallel_tool_calls":false}"#,
        )
        .unwrap();
        let messages = &conversation(&parsed).messages;
        let roles: Vec<_> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "tool", "assistant"]
        );
        assert_eq!(messages[1].content, "Weather and time?");
        // The assistant's text and its two calls are one turn.
        assert_eq!(messages[2].content, "Looking.");
        let calls: Vec<_> = messages[2]
            .tool_calls
            .iter()
            .map(|c| c.id.as_str())
            .collect();
        assert_eq!(calls, ["c1", "c2"]);
        assert_eq!(messages[2].tool_calls[0].arguments["city"], "Oslo");
        assert_eq!(
            (messages[3].name.as_deref(), messages[3].content.as_str()),
            (Some("time"), "noon")
        );
        assert_eq!(messages[4].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(messages[4].name.as_deref(), Some("weather"));
        // A call after the results starts a turn of its own.
        assert_eq!(messages[5].tool_calls[0].id, "c3");
        assert_eq!(
            conversation(&parsed).tools[0],
            json!({"type": "function", "function": {"name": "weather", "description": "Forecast.", "parameters": {"type": "object"}, "strict": true}})
        );
        let tools = parsed.tools.unwrap();
        assert_eq!(
            (tools.choice, tools.parallel),
            (ToolChoice::Named("weather".into()), false)
        );
        assert_eq!(echo.tools.len(), 2);
        assert_eq!(
            echo.tool_choice,
            json!({"type": "function", "name": "weather"})
        );
    }

    #[test]
    fn what_needs_a_stored_response_is_refused_by_name() {
        for (body, start) in [
            (
                r#"{"input":"x","previous_response_id":"resp_1"}"#,
                "previous_response_id: this server is stateless",
            ),
            (
                r#"{"input":"x","conversation":"conv_1"}"#,
                "conversation: this server is stateless",
            ),
            (
                r#"{"input":"x","store":true}"#,
                "store true: this server is stateless",
            ),
            (
                r#"{"input":"x","background":true}"#,
                "background true: this server is stateless",
            ),
            (
                r#"{"input":[{"type":"item_reference","id":"msg_1"}]}"#,
                "input[0].type \"item_reference\": this server is stateless",
            ),
            (
                r#"{"input":"x","reasoning":{"effort":"high"}}"#,
                "reasoning:",
            ),
            (
                r#"{"input":"x","include":["reasoning.encrypted_content"]}"#,
                "include:",
            ),
            (
                r#"{"input":"x","top_logprobs":3}"#,
                "top_logprobs: this server does not implement",
            ),
            (
                r#"{"input":"x","truncation":"auto"}"#,
                "truncation \"auto\"",
            ),
        ] {
            let message = refused(body);
            assert!(message.starts_with(start), "{body}: {message}");
        }
        // Fields that ask for nothing pass.
        request(br#"{"input":"x","previous_response_id":null,"reasoning":null,"include":[],"background":false,"truncation":"disabled"}"#)
            .unwrap();
    }

    #[test]
    fn bad_items_tools_and_formats_name_the_field() {
        for (body, start) in [
            (r#"{}"#, "input: required"),
            (r#"{"input":[]}"#, "input: expected"),
            (
                r#"{"input":[{"type":"reasoning","summary":[]}]}"#,
                "input[0].type \"reasoning\"",
            ),
            (
                r#"{"input":[{"role":"tool","content":"x"}]}"#,
                "input[0].role \"tool\"",
            ),
            (
                r#"{"input":[{"role":"user","content":[{"type":"input_image","image_url":"u"}]}]}"#,
                "input[0].content[0].type: only text parts",
            ),
            (
                r#"{"input":[{"role":"user","content":"x","name":"n"}]}"#,
                "input[0].name: this server does not implement",
            ),
            (
                r#"{"input":[{"type":"function_call","call_id":"c","name":"f","arguments":"[1]"}]}"#,
                "input[0].arguments: expected a JSON object",
            ),
            (
                r#"{"input":[{"type":"function_call","name":"f","arguments":"{}"}]}"#,
                "input[0].call_id: required",
            ),
            (
                r#"{"input":[{"type":"function_call_output","call_id":"zz","output":"1"}]}"#,
                "input[0].call_id \"zz\": no earlier function_call",
            ),
            (
                r#"{"input":"x","tools":[{"type":"web_search"}]}"#,
                "tools[0].type \"web_search\"",
            ),
            (
                r#"{"input":"x","tools":[{"type":"function","function":{"name":"f"}}]}"#,
                "tools[0].function: this server does not implement",
            ),
            (
                r#"{"input":"x","tools":[{"type":"function","name":""}]}"#,
                "tools[0].name",
            ),
            (
                r#"{"input":"x","tools":[{"type":"function","name":"f","parameters":3}]}"#,
                "tools[0].parameters",
            ),
            (
                r#"{"input":"x","tool_choice":"required"}"#,
                "tool_choice: asks for a call",
            ),
            (
                r#"{"input":"x","tools":[{"type":"function","name":"f"}],"tool_choice":{"type":"function","name":"g"}}"#,
                "tool_choice: names the tool \"g\"",
            ),
            (
                r#"{"input":"x","tool_choice":{"type":"file_search"}}"#,
                "tool_choice {\"type\":\"file_search\"}",
            ),
            (
                r#"{"input":"x","text":{"format":{"type":"json_schema","name":"a"}}}"#,
                "text.format.schema: expected a JSON Schema object",
            ),
            (
                r#"{"input":"x","text":{"format":{"type":"grammar"}}}"#,
                "text.format.type",
            ),
            (
                r#"{"input":"x","text":{"verbosity":"low"}}"#,
                "text.verbosity",
            ),
            (
                r#"{"input":"x","text":{"format":{"type":"json_object"}},"tools":[{"type":"function","name":"f"}]}"#,
                "text.format with tools",
            ),
            (r#"{"input":"x","temperature":-1}"#, "temperature -1"),
            (
                r#"{"input":"x","whatever":1}"#,
                "whatever: this server does not implement",
            ),
        ] {
            let message = refused(body);
            assert!(message.starts_with(start), "{body}: {message}");
        }
        let (schema, echo) = request(
            br#"{"input":"x","text":{"format":{"type":"json_schema","name":"f","schema":{"type":"object"},"strict":true}}}"#,
        )
        .unwrap();
        assert_eq!(
            schema.grammar,
            Some(Grammar::JsonSchema(json!({"type": "object"})))
        );
        assert_eq!(echo.text["format"]["name"], "f");
    }

    #[test]
    fn engine_refusals_name_this_api_s_fields() {
        let renamed = in_own_words(ApiError::invalid("max_tokens 9000: too many"));
        assert_eq!(renamed.message, "max_output_tokens 9000: too many");
        let renamed = in_own_words(ApiError::invalid("response_format/grammar: bad schema"));
        assert_eq!(renamed.message, "text.format: bad schema");
        let kept = ApiError::invalid("tools: the olmoe engine's model has no syntax");
        assert_eq!(in_own_words(kept.clone()), kept);
    }

    fn echo() -> Echo {
        request(br#"{"input":"x"}"#).unwrap().1
    }

    fn usage() -> Usage {
        Usage {
            prompt: 10,
            completion: 4,
            cached: 3,
            reasoning: 0,
        }
    }

    /// The events' names.
    fn names(events: &[Sent]) -> Vec<&'static str> {
        events.iter().map(|(name, _)| *name).collect()
    }

    #[test]
    fn streamed_events_build_the_items_the_response_holds() {
        let mut output = Output::new("s-1".into(), 5, "model".into(), echo());
        let mut events = output.start();
        events.extend(output.text("Let me "));
        events.extend(output.text("look."));
        let call = ToolCall {
            id: output.next_call_id(),
            name: "weather".into(),
            arguments: json!({"city": "Oslo"}).as_object().unwrap().clone(),
        };
        events.extend(output.call(&call));
        events.extend(output.end(Finish::ToolCalls, usage()));
        assert_eq!(
            names(&events),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (n, (name, body)) in events.iter().enumerate() {
            assert_eq!(
                (body["type"].as_str(), body["sequence_number"].as_u64()),
                (Some(*name), Some(n as u64))
            );
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        assert_eq!(events[6].1["text"], "Let me look.");
        assert_eq!(events[10].1["item_id"], "fc_s-1-0");
        assert_eq!(events[10].1["output_index"], 1);
        let response = output.response();
        assert_eq!(events[13].1["response"], response);
        assert_eq!(response["id"], "resp_s-1");
        assert_eq!(response["status"], "completed");
        assert_eq!(response["incomplete_details"], Value::Null);
        let output_items = response["output"].as_array().unwrap();
        assert_eq!(output_items[0]["id"], "msg_s-1-0");
        assert_eq!(output_items[0]["content"][0]["text"], "Let me look.");
        assert_eq!(
            output_items[1],
            json!({"type": "function_call", "id": "fc_s-1-0", "call_id": "call_s-1-0", "name": "weather",
                   "arguments": "{\"city\":\"Oslo\"}", "status": "completed"})
        );
        assert_eq!(
            response["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
                   "output_tokens": 4, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 14})
        );
    }

    #[test]
    fn an_answer_cut_at_max_output_tokens_is_incomplete_and_an_empty_one_is_one_message() {
        let mut output = Output::new("s-2".into(), 5, "model".into(), echo());
        output.text("The sea");
        let events = output.end(Finish::Length, usage());
        assert_eq!(events.last().unwrap().0, "response.incomplete");
        let response = output.response();
        assert_eq!(response["status"], "incomplete");
        assert_eq!(
            response["incomplete_details"]["reason"],
            "max_output_tokens"
        );
        assert_eq!(response["output"][0]["status"], "incomplete");

        let mut empty = Output::new("s-3".into(), 5, "model".into(), echo());
        let events = empty.end(Finish::Stop, usage());
        assert_eq!(names(&events)[0], "response.output_item.added");
        assert_eq!(empty.response()["output"][0]["content"][0]["text"], "");
        let error = empty.error(&ApiError::server(500, "gone"));
        assert_eq!(error.0, "error");
        assert_eq!(error.1["message"], "gone");
    }

    #[test]
    fn reasoning_before_the_text_is_an_item_of_its_own() {
        let mut output = Output::new("s-4".into(), 5, "model".into(), echo());
        assert!(output.reasoning("Hmm, ").is_empty());
        assert!(output.reasoning("the sea.").is_empty());
        let events = output.text("Blue.");
        assert_eq!(
            names(&events)[..2],
            ["response.output_item.added", "response.output_item.done"]
        );
        output.end(Finish::Stop, usage());
        let response = output.response();
        assert_eq!(response["output"][0]["type"], "reasoning");
        assert_eq!(response["output"][0]["content"][0]["text"], "Hmm, the sea.");
        assert_eq!(response["output"][1]["content"][0]["text"], "Blue.");
        // Reasoning alone still ends with an (empty) message.
        let mut thought = Output::new("s-5".into(), 5, "model".into(), echo());
        thought.reasoning("only this");
        thought.end(Finish::Length, usage());
        let kinds: Vec<_> = thought.response()["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|item| item["type"].clone())
            .collect();
        assert_eq!(kinds, ["reasoning", "message"]);
    }
}
