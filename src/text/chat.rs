//! Chat templates (`CHAT=1`): the model's own Jinja template, from `chat_template.jinja` or
//! `tokenizer_config.json`'s `chat_template`, else the engine's built-in one, rendered with
//! `minijinja` the way transformers renders them (`trim_blocks`, `lstrip_blocks`,
//! Python string methods) for the conversation's messages (one user message in text mode,
//! a request's in `coli serve`) and a generation prompt.
//!
//! A conversation reaches the template as transformers passes it: `messages` (with an
//! assistant turn's `tool_calls`, whose `function.arguments` is a mapping, and a tool
//! message's `tool_call_id` and `name`), `tools` when there are any, `add_generation_prompt`,
//! and the request's own variables (`chat_template_kwargs`: GLM's `enable_thinking`, Kimi
//! K3's `thinking`). `tojson` is transformers' (`json.dumps` with its separators, keys in
//! the order given, `ensure_ascii`, `indent`, `separators` and `sort_keys` taken), not
//! Jinja's HTML-safe one.
//!
//! Unlike transformers, a variable the template prints or iterates but coli does not provide
//! is an error rather than empty text, so a template that needs more than one user turn
//! says so instead of producing a silently wrong prompt.

use std::borrow::Cow;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};
use serde_json::{Map, Value as Json};

use super::tokenizer::TextTokenizer;

/// The file transformers writes a chat template to.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The variables a template is rendered with, for messages.
const PROVIDED: &str = "messages (role, content; tool_calls, tool_call_id, name where given), tools (when given), add_generation_prompt, bos_token, eos_token, raise_exception(), the request's chat_template_kwargs";

/// A render's fuel (minijinja's budget of instructions and of data created, one unit per 64
/// bytes) before what the conversation adds: far more than any published template spends
/// on a short conversation, and a fraction of a second of rendering.
const FUEL_BASE: u64 = 2_000_000;

/// Fuel per byte of the conversation as the template receives it (its JSON): room to read
/// every byte of it many times over.
const FUEL_PER_BYTE: u64 = 1;

/// Fuel per message and per tool: each is a few hundred instructions in a template's loops,
/// however short its text.
const FUEL_PER_ITEM: u64 = 2_000;

/// The most bytes a rendering may hold before what the conversation adds: a prompt longer
/// than any model's context is a template that never stops growing.
const OUTPUT_BASE: usize = 16 << 20;

/// Output bytes per byte of the conversation.
const OUTPUT_PER_BYTE: usize = 8;

/// Macro and block nesting a template may reach: below minijinja's own ceiling, so that a
/// template calling itself ends with an error on a thread's default 2 MiB stack too (the
/// server renders on its engine thread).
const RECURSION_LIMIT: usize = 200;

/// The variables coli sets itself, which a request's own variables may not replace.
const RESERVED: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// One message of a conversation, as templates read it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls of tools.
    pub tool_calls: Vec<ToolCall>,
    /// A tool message: the id of the call it answers.
    pub tool_call_id: Option<String>,
    /// A tool message: the tool that answered.
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message of text alone.
    pub fn text(role: &str, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.to_string(),
            content: content.into(),
            ..ChatMessage::default()
        }
    }

    /// The message as transformers hands it to a template: only the keys it has.
    fn template_value(&self) -> Json {
        let mut message = Map::new();
        message.insert("role".into(), self.role.clone().into());
        message.insert("content".into(), self.content.clone().into());
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.iter().map(|call| {
                serde_json::json!({
                    "id": call.id,
                    "type": "function",
                    "function": { "name": call.name, "arguments": call.arguments },
                })
            });
            message.insert("tool_calls".into(), calls.collect());
        }
        if let Some(id) = &self.tool_call_id {
            message.insert("tool_call_id".into(), id.clone().into());
        }
        if let Some(name) = &self.name {
            message.insert("name".into(), name.clone().into());
        }
        Json::Object(message)
    }
}

/// The name of the tool the last call with `id` among `messages` called.
pub fn called_tool(messages: &[ChatMessage], id: &str) -> Option<String> {
    messages
        .iter()
        .rev()
        .flat_map(|message| &message.tool_calls)
        .find(|call| call.id == id)
        .map(|call| call.name.clone())
}

/// A call of a tool: by a past assistant turn in a conversation, or parsed from an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments, a JSON object.
    pub arguments: Map<String, Json>,
}

/// What a chat template renders: the messages, the tools the model may call, and the
/// request's own template variables.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Conversation {
    pub messages: Vec<ChatMessage>,
    /// Each `{"type": "function", "function": {"name", "description", "parameters"}}`, as
    /// transformers passes `tools`.
    pub tools: Vec<Json>,
    /// `chat_template_kwargs`: more variables, by name.
    pub variables: Map<String, Json>,
    /// The start of the answer, given by the client (Anthropic's trailing assistant
    /// message): written after the generation prompt, and continued.
    pub prefill: String,
}

impl From<Vec<ChatMessage>> for Conversation {
    fn from(messages: Vec<ChatMessage>) -> Conversation {
        Conversation {
            messages,
            ..Conversation::default()
        }
    }
}

impl Conversation {
    /// A variable the request may not set: one coli sets itself.
    pub fn reserved_variable(&self) -> Option<&str> {
        self.variables
            .keys()
            .map(String::as_str)
            .find(|key| RESERVED.contains(key))
    }
}

/// A chat template and where it came from.
pub struct ChatTemplate {
    source: String,
    text: Cow<'static, str>,
}

impl ChatTemplate {
    /// The template for the model in `dir`: `chat_template.jinja`, else the tokenizer
    /// config's, else `built_in` (the engine's), else an error.
    pub fn find(
        dir: &Path,
        tokenizer: &TextTokenizer,
        built_in: Option<&'static str>,
        engine: &str,
    ) -> Result<ChatTemplate> {
        let file = dir.join(CHAT_TEMPLATE_FILE);
        if file.is_file() {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            return Ok(ChatTemplate {
                source: file.display().to_string(),
                text: Cow::Owned(text),
            });
        }
        if let Some(text) = &tokenizer.config().chat_template {
            return Ok(ChatTemplate {
                source: format!("{} chat_template", tokenizer.config_path().display()),
                text: Cow::Owned(text.clone()),
            });
        }
        match built_in {
            Some(text) => Ok(ChatTemplate {
                source: format!("{engine} built-in"),
                text: Cow::Borrowed(text),
            }),
            None => Err(anyhow!(
                "CHAT=1: {} has no chat template ({CHAT_TEMPLATE_FILE}, or chat_template in {}) and the {engine} engine has no built-in one",
                dir.display(),
                tokenizer.config_path().display()
            )),
        }
    }

    /// Where the template came from, for messages.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The text that starts the answer to the last of `messages`. An unset BOS or EOS token
    /// renders as empty text, as in transformers.
    pub fn render(
        &self,
        conversation: &Conversation,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<String> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|err| anyhow!("chat template syntax settings: {err}"))?;
        env.set_syntax(syntax);
        env.set_undefined_behavior(UndefinedBehavior::SemiStrict);
        // The failing line and the variables it saw, in every build (minijinja keeps them
        // only in debug builds unless asked), so a message names what is undefined.
        env.set_debug(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_filter("tojson", tojson);
        if let Some(key) = conversation.reserved_variable() {
            return Err(anyhow!(
                "chat_template_kwargs: {key} is set by coli itself and cannot be given"
            ));
        }
        let mut context = conversation.variables.clone();
        let messages = conversation
            .messages
            .iter()
            .map(ChatMessage::template_value);
        context.insert("messages".into(), messages.collect());
        if !conversation.tools.is_empty() {
            context.insert("tools".into(), conversation.tools.clone().into());
        }
        context.insert("add_generation_prompt".into(), true.into());
        context.insert("bos_token".into(), bos_token.unwrap_or("").into());
        context.insert("eos_token".into(), eos_token.unwrap_or("").into());
        // What the template may spend grows with what it is given; a template that loops
        // or builds text without end runs out of fuel (time and memory) or of room for its
        // output, and says so, instead of holding the thread forever.
        let given = serde_json::to_string(&context).map_or(0, |json| json.len());
        let items = (conversation.messages.len() + conversation.tools.len()) as u64;
        env.set_fuel(Some(
            FUEL_BASE + FUEL_PER_BYTE * given as u64 + FUEL_PER_ITEM * items,
        ));
        env.set_recursion_limit(RECURSION_LIMIT);
        let room = OUTPUT_BASE + OUTPUT_PER_BYTE * given;
        let context = Value::from(minijinja::value::Serde(&context));
        let prefill = &conversation.prefill;
        let failed = |err: Error| {
            let why = match err.kind() {
                ErrorKind::OutOfFuel => format!(
                    "it did more work than a prompt of {given} bytes of messages and tools can need (an endless loop, or text built without end); {err:#}"
                ),
                ErrorKind::WriteFailure => format!(
                    "it rendered more than {room} bytes from {given} bytes of messages and tools"
                ),
                _ => format!("{err:#}"),
            };
            anyhow!(
                "chat template ({}): {why}\n(coli renders chat templates with: {PROVIDED})",
                self.source
            )
        };
        let template = env
            .template_from_named_str("chat_template", &self.text)
            .map_err(failed)?;
        let mut out = Bounded {
            text: Vec::new(),
            room,
        };
        template
            .render_captured_to(context, &mut out)
            .map_err(failed)?;
        let text = String::from_utf8(out.text).map_err(|_| {
            anyhow!(
                "chat template ({}): it rendered text that is not UTF-8",
                self.source
            )
        })?;
        Ok(text + prefill)
    }
}

/// A template's output, refused past `room` bytes.
struct Bounded {
    text: Vec<u8>,
    room: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        if self.text.len() + bytes.len() > self.room {
            return Err(std::io::Error::other("the rendered prompt is too long"));
        }
        self.text.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each settable by keyword.
fn tojson(value: Value, options: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = options.get("ensure_ascii")?;
    let indent: Option<Value> = options.get("indent")?;
    let separators: Option<Vec<String>> = options.get("separators")?;
    let sort_keys: Option<bool> = options.get("sort_keys")?;
    options.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(match v.as_str() {
            Some(text) => text.to_string(),
            None => " ".repeat(usize::try_from(v.clone()).map_err(|_| {
                Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: indent {v} is not a count or a string"),
                )
            })?),
        }),
    };
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings, (item, key)",
            ))
        }
        // Python's defaults: no space after a comma when indenting.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|err| Error::new(ErrorKind::InvalidOperation, format!("tojson: {err}")))?;
    let style = PyJson {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// How Python's `json.dumps` lays a value out.
struct PyJson {
    ensure_ascii: bool,
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, value: &Json, depth: usize, out: &mut String) {
        match value {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.between(i, depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.close(']', depth, out);
            }
            Json::Object(fields) if !fields.is_empty() => {
                let mut entries: Vec<_> = fields.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (name, item)) in entries.into_iter().enumerate() {
                    self.between(i, depth + 1, out);
                    self.string(name, out);
                    out.push_str(&self.key);
                    self.write(item, depth + 1, out);
                }
                self.close('}', depth, out);
            }
            Json::String(text) => self.string(text, out),
            other => out.push_str(&other.to_string()),
        }
    }

    /// Before the `i`th entry at `depth`: the separator, then the newline and indent.
    fn between(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
    }

    fn close(&self, bracket: char, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth));
        }
        out.push(bracket);
    }

    fn string(&self, text: &str, out: &mut String) {
        let quoted = Json::String(text.to_string()).to_string();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}
