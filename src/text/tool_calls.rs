//! Calls of tools in generated text: each model's own syntax ([`ToolSyntax`], which its
//! engine declares) found in the text as it streams, cut out of the answer's text and
//! parsed into a name and a JSON object of arguments.
//!
//! The text comes decoded with special tokens kept (Kimi K3's and Inkling's markers are
//! special tokens). Text that may still become a marker is held back until it is known.
//! A call that does not parse is handed on as text, as peers do, so nothing is lost.

use serde_json::{Map, Value as Json};

use crate::engines::ToolSyntax;

/// A call found in an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    /// A JSON object.
    pub arguments: Map<String, Json>,
}

/// A piece of an answer in tool mode.
#[derive(Debug, Clone, PartialEq)]
pub enum Scanned {
    Text(String),
    Call(ParsedCall),
}

/// The markers of one syntax.
struct Markers {
    open: &'static str,
    close: &'static str,
    /// Structural tags between blocks, which are not text of the answer.
    structure: &'static [&'static str],
}

fn markers(syntax: ToolSyntax) -> Markers {
    match syntax {
        ToolSyntax::GlmXml => Markers {
            open: "<tool_call>",
            close: "</tool_call>",
            structure: &[],
        },
        ToolSyntax::KimiXtml => Markers {
            open: "<|open|>call",
            close: "<|close|>call<|sep|>",
            structure: &[
                "<|open|>response<|sep|>",
                "<|close|>response<|sep|>",
                "<|open|>tools<|sep|>",
                "<|close|>tools<|sep|>",
                "<|close|>message<|sep|>",
            ],
        },
        ToolSyntax::InklingJson => Markers {
            open: "<|content_invoke_tool_json|>",
            close: "<|end_message|>",
            structure: &["<|end_message|>", "<|message_model|>", "<|content_text|>"],
        },
    }
}

/// Finds calls in an answer as its text arrives.
pub struct ToolScan {
    syntax: ToolSyntax,
    markers: Markers,
    /// The request's tools (OpenAI form), for the parameters' types.
    tools: Vec<Json>,
    pending: String,
    /// Inside a call: `pending` is its body so far.
    in_call: bool,
}

impl ToolScan {
    pub fn new(syntax: ToolSyntax, tools: Vec<Json>) -> ToolScan {
        ToolScan {
            syntax,
            markers: markers(syntax),
            tools,
            pending: String::new(),
            in_call: false,
        }
    }

    /// A scanner for another answer to the same request.
    pub fn fresh(&self) -> ToolScan {
        ToolScan::new(self.syntax, self.tools.clone())
    }

    /// Add `text`; the pieces now known.
    pub fn push(&mut self, text: &str) -> Vec<Scanned> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(at) = self.pending.find(self.markers.close) else {
                    break;
                };
                let body: String = self.pending.drain(..at).collect();
                self.pending.drain(..self.markers.close.len());
                self.in_call = false;
                out.push(self.parsed(&body));
            } else if let Some(at) = self.pending.find(self.markers.open) {
                let before: String = self.pending.drain(..at).collect();
                self.pending.drain(..self.markers.open.len());
                self.in_call = true;
                self.text(&before, &mut out);
            } else {
                let keep = self.undecided_tail();
                let ready: String = self.pending.drain(..self.pending.len() - keep).collect();
                self.text(&ready, &mut out);
                break;
            }
        }
        out
    }

    /// Whatever is held back, at the end of the answer. A call whose closing marker never
    /// came (it was the stop token, as Inkling's `<|end_message|>` may be) is parsed as it
    /// stands.
    pub fn finish(&mut self) -> Vec<Scanned> {
        let rest = std::mem::take(&mut self.pending);
        let mut out = Vec::new();
        if std::mem::replace(&mut self.in_call, false) {
            out.push(match self.parsed(&rest) {
                // Its text as generated: no closing marker was.
                Scanned::Text(_) => Scanned::Text(format!("{}{rest}", self.markers.open)),
                call => call,
            });
        } else {
            self.text(&rest, &mut out);
        }
        out
    }

    /// `text` between calls, without the syntax's structural tags.
    fn text(&self, text: &str, out: &mut Vec<Scanned>) {
        let mut text = text.to_string();
        for tag in self.markers.structure {
            text = text.replace(tag, "");
        }
        if !text.is_empty() {
            out.push(Scanned::Text(text));
        }
    }

    /// The bytes at the end of `pending` that could still begin the opening marker or a
    /// structural tag.
    fn undecided_tail(&self) -> usize {
        let pending = &self.pending;
        std::iter::once(self.markers.open)
            .chain(self.markers.structure.iter().copied())
            .flat_map(|marker| {
                (1..marker.len())
                    .rev()
                    .find(|&n| pending.ends_with(&marker[..n]))
            })
            .max()
            .unwrap_or(0)
    }

    /// The call `body` holds, or its text (with its markers) when it does not parse.
    fn parsed(&self, body: &str) -> Scanned {
        let call = match self.syntax {
            ToolSyntax::GlmXml => glm_call(body, &self.tools),
            ToolSyntax::KimiXtml => kimi_call(body),
            ToolSyntax::InklingJson => inkling_call(body),
        };
        match call {
            Some(call) => Scanned::Call(call),
            None => Scanned::Text(format!("{}{body}{}", self.markers.open, self.markers.close)),
        }
    }
}

/// The JSON Schema type the request's tool `name` declares for its parameter `key`.
fn declared_type<'t>(tools: &'t [Json], name: &str, key: &str) -> Option<&'t str> {
    tools
        .iter()
        .filter_map(|tool| tool.get("function"))
        .find(|function| function.get("name").and_then(Json::as_str) == Some(name))?
        .pointer(&format!(
            "/parameters/properties/{}",
            key.replace('~', "~0").replace('/', "~1")
        ))?
        .get("type")?
        .as_str()
}

/// GLM: `NAME<arg_key>K</arg_key><arg_value>V</arg_value>…` (GLM-4.5 puts newlines between
/// them). A value is raw text where the tool declares a string, else JSON, else raw text.
fn glm_call(body: &str, tools: &[Json]) -> Option<ParsedCall> {
    let (name, mut rest) = match body.find("<arg_key>") {
        Some(at) => (&body[..at], &body[at..]),
        None => (body, ""),
    };
    let name = name.trim();
    if name.is_empty() || name.contains('<') {
        return None;
    }
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix("<arg_key>")?;
        let (key, after) = after.split_once("</arg_key>")?;
        let after = after.trim_start().strip_prefix("<arg_value>")?;
        let (value, after) = after.split_once("</arg_value>")?;
        let value = match declared_type(tools, name, key) {
            Some("string") => Json::String(value.to_string()),
            _ => serde_json::from_str(value).unwrap_or_else(|_| Json::String(value.to_string())),
        };
        arguments.insert(key.trim().to_string(), value);
        rest = after;
    }
    Some(ParsedCall {
        name: name.to_string(),
        arguments,
    })
}

/// The value of attribute `name` in `attributes` (`k="v"` pairs, `&quot;` and `&amp;`
/// escaped).
fn attribute(attributes: &str, name: &str) -> Option<String> {
    let start = attributes.find(&format!(" {name}=\""))? + name.len() + 3;
    let end = start + attributes[start..].find('"')?;
    Some(
        attributes[start..end]
            .replace("&quot;", "\"")
            .replace("&amp;", "&"),
    )
}

/// Kimi K3: ` tool="NAME" index="I"<|sep|>` then `<|open|>argument key="K" type="T"<|sep|>V
/// <|close|>argument<|sep|>` per argument (strings raw, other types JSON), or one
/// `<|open|>json type="object"<|sep|>{…}<|close|>json<|sep|>`.
fn kimi_call(body: &str) -> Option<ParsedCall> {
    const SEP: &str = "<|sep|>";
    let (attributes, mut rest) = body.split_once(SEP)?;
    let name = attribute(attributes, "tool").filter(|n| !n.is_empty())?;
    let mut arguments = Map::new();
    if let Some(json) = rest.strip_prefix("<|open|>json") {
        let (_, json) = json.split_once(SEP)?;
        let json = json.strip_suffix("<|close|>json<|sep|>")?;
        arguments = serde_json::from_str(json).ok()?;
        rest = "";
    }
    while !rest.is_empty() {
        let after = rest.strip_prefix("<|open|>argument")?;
        let (attributes, after) = after.split_once(SEP)?;
        let key = attribute(attributes, "key")?;
        let (value, after) = after.split_once("<|close|>argument<|sep|>")?;
        let value = match attribute(attributes, "type").as_deref() {
            Some("string") | None => Json::String(value.to_string()),
            Some(_) => serde_json::from_str(value).ok()?,
        };
        arguments.insert(key, value);
        rest = after;
    }
    Some(ParsedCall { name, arguments })
}

/// Inkling: `{"name": NAME, "args": {…}}`.
fn inkling_call(body: &str) -> Option<ParsedCall> {
    let call: Json = serde_json::from_str(body.trim()).ok()?;
    let name = call.get("name")?.as_str()?.to_string();
    let arguments = match call.get("args").or_else(|| call.get("arguments")) {
        None => Map::new(),
        Some(Json::Object(arguments)) => arguments.clone(),
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

/// How the tokenizer holds a marker such as `<|open|>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Marker {
    /// As text (it is no token of its own, or not a special one).
    Text,
    /// As a special token, which a grammar names as a token.
    Special,
    /// As a special token that ends a generation.
    Stop,
}

/// The Lark grammar (llguidance's dialect) of an answer that is only calls, in the model's
/// own syntax, of `tools` (OpenAI form; with `only`, of that tool alone): one call, or with
/// `parallel` one or more (Inkling: one, where its `<|end_message|>` ends a generation).
/// Each call's arguments satisfy its tool's `parameters` schema (an object; JSON between
/// tokens bounded as [`bounded_whitespace`] bounds it). `marker` says how the tokenizer
/// holds each `<|...|>` marker of the syntax; the tools' own names, keys and values are
/// always text. Or why a tool's parameters cannot be held to in the syntax, naming it.
pub fn call_grammar(
    syntax: ToolSyntax,
    tools: &[Json],
    only: Option<&str>,
    parallel: bool,
    marker: impl Fn(&str) -> Marker,
) -> Result<String, String> {
    let lit = |text: &str| literal(text, &marker);
    let chosen: Vec<(usize, &str, Json)> = tools
        .iter()
        .enumerate()
        .filter_map(|(index, tool)| {
            let function = tool.get("function")?;
            let name = function.get("name")?.as_str()?;
            let mut parameters = function
                .get("parameters")
                .cloned()
                .unwrap_or_else(|| serde_json::json!({}));
            // Arguments are an object, whatever the schema leaves open.
            if let Some(fields) = parameters.as_object_mut() {
                fields.entry("type").or_insert_with(|| "object".into());
            }
            Some((index, name, parameters))
        })
        .filter(|(_, name, _)| only.is_none_or(|only| only == *name))
        .collect();
    let mut rules = Vec::new();
    let calls: Vec<String> = (0..chosen.len()).map(|i| format!("call_{i}")).collect();
    let repeat = if parallel { "+" } else { "" };
    match syntax {
        ToolSyntax::GlmXml => {
            rules.push(format!("start: ({}){repeat}", calls.join(" | ")));
            for (i, (index, name, parameters)) in chosen.iter().enumerate() {
                let mut parts = vec![lit("<tool_call>"), quoted(name)];
                let required: Vec<&str> = parameters
                    .get("required")
                    .and_then(Json::as_array)
                    .map(|r| r.iter().filter_map(Json::as_str).collect())
                    .unwrap_or_default();
                let properties = parameters.get("properties").and_then(Json::as_object);
                for (j, (key, schema)) in properties.into_iter().flatten().enumerate() {
                    let at = || format!("tools[{index}].function.parameters.properties.{key}");
                    let value = match schema.get("type").and_then(Json::as_str) {
                        Some("string") => raw_string(schema).map_err(|keyword| {
                            format!("{}: `{keyword}` cannot be held to in GLM's raw string values (a required or named call); leave it out", at())
                        })?,
                        _ => format!("%json {}", bounded_whitespace(with_definitions(schema, parameters))),
                    };
                    rules.push(format!(
                        "arg_{i}_{j}: {} {} {} {value} {}",
                        lit("<arg_key>"),
                        quoted(key),
                        lit("</arg_key><arg_value>"),
                        lit("</arg_value>")
                    ));
                    let optional = if required.contains(&key.as_str()) {
                        ""
                    } else {
                        "?"
                    };
                    parts.push(format!("arg_{i}_{j}{optional}"));
                }
                parts.push(lit("</tool_call>"));
                rules.push(format!("call_{i}: {}", parts.join(" ")));
            }
        }
        ToolSyntax::KimiXtml => {
            rules.push(format!(
                "start: {} ({}){repeat} {}",
                lit("<|close|>response<|sep|><|open|>tools<|sep|>"),
                calls.join(" | "),
                lit("<|close|>tools<|sep|><|close|>message<|sep|>")
            ));
            for (i, (_, name, parameters)) in chosen.iter().enumerate() {
                let name = name.replace('&', "&amp;").replace('"', "&quot;");
                rules.push(format!(
                    "call_{i}: {} {} {} /[1-9][0-9]{{0,3}}/ {} %json {} {}",
                    lit("<|open|>call tool=\""),
                    quoted(&name),
                    lit("\" index=\""),
                    lit("\"<|sep|><|open|>json type=\"object\"<|sep|>"),
                    bounded_whitespace(parameters.clone()),
                    lit("<|close|>json<|sep|><|close|>call<|sep|>")
                ));
            }
        }
        ToolSyntax::InklingJson => {
            // The answer opens its own block (with tools, the prompt stops at
            // `<|message_model|>`); where `<|end_message|>` ends a generation, after one call.
            let calls = calls.join(" | ");
            rules.push(if marker("<|end_message|>") == Marker::Stop {
                format!("start: {calls}")
            } else {
                let next = lit("<|end_message|><|message_model|>");
                let more = if parallel {
                    format!("({next} ({calls}))*")
                } else {
                    String::new()
                };
                format!("start: ({calls}) {more} {}", lit("<|end_message|>"))
            });
            for (i, (_, name, parameters)) in chosen.iter().enumerate() {
                let mut call = serde_json::json!({
                    "type": "object",
                    "properties": { "name": { "const": name }, "args": parameters },
                    "required": ["name", "args"],
                    "additionalProperties": false,
                });
                // The parameters' definitions where their `$ref`s look: at the root.
                for key in ["$defs", "definitions"] {
                    if let Some(definitions) = parameters.get(key) {
                        call[key] = definitions.clone();
                    }
                }
                rules.push(format!(
                    "call_{i}: {} %json {}",
                    lit("<|content_invoke_tool_json|>"),
                    bounded_whitespace(call)
                ));
            }
        }
    }
    Ok(rules.join("\n"))
}

/// `schema` (a property of `parameters`) with the parameters' `$defs` and `definitions`
/// beside it, where its `$ref`s look once it stands alone.
fn with_definitions(schema: &Json, parameters: &Json) -> Json {
    let mut schema = schema.clone();
    if let Some(fields) = schema.as_object_mut() {
        for key in ["$defs", "definitions"] {
            if let Some(definitions) = parameters.get(key) {
                fields.entry(key).or_insert_with(|| definitions.clone());
            }
        }
    }
    schema
}

/// The Lark items of a raw string value of GLM's syntax, which ends at the closing tag (so
/// it holds no `<`): its `enum`, or at most `maxLength` characters; or the keyword it
/// cannot hold to.
fn raw_string(schema: &Json) -> Result<String, String> {
    let annotations = [
        "type",
        "description",
        "title",
        "default",
        "examples",
        "enum",
        "maxLength",
    ];
    if let Some(keyword) = schema
        .as_object()
        .and_then(|fields| fields.keys().find(|k| !annotations.contains(&k.as_str())))
    {
        return Err(keyword.clone());
    }
    if let Some(options) = schema.get("enum").and_then(Json::as_array) {
        let options: Vec<String> = options
            .iter()
            .filter_map(Json::as_str)
            .map(quoted)
            .collect();
        return Ok(format!("({})", options.join(" | ")));
    }
    Ok(match schema.get("maxLength").and_then(Json::as_u64) {
        Some(most) => format!("/[^<]{{0,{most}}}/"),
        None => "/[^<]*/".to_string(),
    })
}

/// `schema` with the whitespace between JSON tokens bounded (at most 24 characters in a
/// gap: pretty-printed JSON nests a dozen levels), unless the schema sets llguidance's own
/// `x-guidance` options. Unbounded, a weak model can pad an answer with whitespace until
/// its token limit.
pub fn bounded_whitespace(mut schema: Json) -> Json {
    if let Some(fields) = schema.as_object_mut() {
        fields.entry("x-guidance").or_insert_with(
            || serde_json::json!({ "whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{1,24}" }),
        );
    }
    schema
}

/// `text` as one Lark string, every character text (DEL escaped too, which Lark's string
/// syntax does not take raw).
fn quoted(text: &str) -> String {
    Json::String(text.to_string())
        .to_string()
        .replace('\u{7f}', "\\u007f")
}

/// `text` as a sequence of Lark items: quoted strings, and the `<|...|>` markers the
/// tokenizer holds as special tokens named as tokens.
fn literal(text: &str, marker: &impl Fn(&str) -> Marker) -> String {
    let mut items = Vec::new();
    let mut plain = String::new();
    let mut rest = text;
    while let Some(start) = rest.find("<|") {
        let Some(len) = rest[start..].find("|>").map(|end| end + 2) else {
            break;
        };
        let tag = &rest[start..start + len];
        plain.push_str(&rest[..start]);
        if marker(tag) != Marker::Text {
            if !plain.is_empty() {
                items.push(Json::String(std::mem::take(&mut plain)).to_string());
            }
            items.push(tag.to_string());
        } else {
            plain.push_str(tag);
        }
        rest = &rest[start + len..];
    }
    plain.push_str(rest);
    if !plain.is_empty() {
        items.push(Json::String(plain).to_string());
    }
    items.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Every split of `text` into two pushes gives the same pieces, joined.
    fn scan_every_way(syntax: ToolSyntax, tools: &[Json], text: &str) -> Vec<Scanned> {
        let mut whole = ToolScan::new(syntax, tools.to_vec());
        let mut expected = whole.push(text);
        expected.extend(whole.finish());
        let expected = joined(expected);
        for cut in (1..text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut scan = ToolScan::new(syntax, tools.to_vec());
            let mut got = scan.push(&text[..cut]);
            got.extend(scan.push(&text[cut..]));
            got.extend(scan.finish());
            assert_eq!(joined(got), expected, "split at {cut}");
        }
        expected
    }

    /// Neighbouring texts merged.
    fn joined(pieces: Vec<Scanned>) -> Vec<Scanned> {
        let mut out: Vec<Scanned> = Vec::new();
        for piece in pieces {
            match (out.last_mut(), piece) {
                (Some(Scanned::Text(a)), Scanned::Text(b)) => a.push_str(&b),
                (_, piece) => out.push(piece),
            }
        }
        out
    }

    fn call(name: &str, arguments: Json) -> Scanned {
        Scanned::Call(ParsedCall {
            name: name.into(),
            arguments: arguments.as_object().unwrap().clone(),
        })
    }

    #[test]
    fn glm_calls_take_their_types_from_the_tools() {
        let tools = [json!({"type": "function", "function": {"name": "read",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}})];
        let text = "Let me look.<tool_call>read<arg_key>path</arg_key><arg_value>42</arg_value>\
            <arg_key>n</arg_key><arg_value>3</arg_value><arg_key>x</arg_key><arg_value>{\"a\": [1]}</arg_value></tool_call>\
            <tool_call>read\n<arg_key>path</arg_key>\n<arg_value>a b</arg_value>\n</tool_call>";
        assert_eq!(
            scan_every_way(ToolSyntax::GlmXml, &tools, text),
            vec![
                Scanned::Text("Let me look.".into()),
                call("read", json!({"path": "42", "n": 3, "x": {"a": [1]}})),
                call("read", json!({"path": "a b"})),
            ]
        );
        // Malformed: handed on as text, markers and all.
        let bad = "<tool_call><arg_key>k</arg_key></tool_call> after";
        assert_eq!(
            scan_every_way(ToolSyntax::GlmXml, &tools, bad),
            vec![Scanned::Text(bad.into())]
        );
        // A call cut off by the end of the answer stays its text, as generated.
        assert_eq!(
            scan_every_way(ToolSyntax::GlmXml, &tools, "<tool_call>read<arg_key>pa"),
            vec![Scanned::Text("<tool_call>read<arg_key>pa".into())]
        );
        // Text that only looks like the start of a marker is let through at the end.
        assert_eq!(
            scan_every_way(ToolSyntax::GlmXml, &tools, "a <tool"),
            vec![Scanned::Text("a <tool".into())]
        );
    }

    #[test]
    fn kimi_calls_read_typed_arguments_and_the_json_form() {
        let text = "Sure.<|close|>response<|sep|><|open|>tools<|sep|>\
            <|open|>call tool=\"get_weather\" index=\"1\"<|sep|>\
            <|open|>argument key=\"city\" type=\"string\"<|sep|>Paris &amp; \"Lyon\"<|close|>argument<|sep|>\
            <|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>\
            <|open|>call tool=\"a&quot;b\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>{\"q\": true}<|close|>json<|sep|><|close|>call<|sep|>\
            <|close|>tools<|sep|><|close|>message<|sep|>";
        assert_eq!(
            scan_every_way(ToolSyntax::KimiXtml, &[], text),
            vec![
                Scanned::Text("Sure.".into()),
                call(
                    "get_weather",
                    json!({"city": "Paris &amp; \"Lyon\"", "days": 3})
                ),
                call("a\"b", json!({"q": true})),
            ]
        );
    }

    #[test]
    fn inkling_calls_are_json_blocks_and_may_end_at_the_stop_token() {
        let text = "I'll check.<|end_message|><|message_model|><|content_invoke_tool_json|>{\"name\": \"ls\", \"args\": {\"dir\": \"/\"}}<|end_message|>\
            <|message_model|><|content_invoke_tool_json|>{\"name\": \"pwd\", \"args\": {}}";
        assert_eq!(
            scan_every_way(ToolSyntax::InklingJson, &[], text),
            vec![
                Scanned::Text("I'll check.".into()),
                call("ls", json!({"dir": "/"})),
                call("pwd", json!({})),
            ]
        );
    }

    #[test]
    fn call_grammars_quote_what_the_tools_say_and_refuse_what_they_cannot_hold() {
        let special = |m: &str| {
            if m == "<|user|>" {
                Marker::Special
            } else {
                Marker::Text
            }
        };
        let tools = [json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"k\"<|user|>\u{7f}": {"type": "string", "enum": ["<|user|>"]}}}}})];
        let lark = call_grammar(ToolSyntax::GlmXml, &tools, None, false, special).unwrap();
        // The tool's own text never becomes a token reference.
        assert!(!lark.contains(" <|user|> "), "{lark}");
        assert!(lark.contains(r#""k\"<|user|>\u007f""#), "{lark}");
        let pattern = [json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"p": {"type": "string", "pattern": "a+"}}}}})];
        let err = call_grammar(ToolSyntax::GlmXml, &pattern, None, false, special).unwrap_err();
        assert!(
            err.starts_with("tools[0].function.parameters.properties.p: `pattern`"),
            "{err}"
        );
        // JSON-typed syntaxes hold patterns themselves, and bound whitespace.
        let lark = call_grammar(ToolSyntax::KimiXtml, &pattern, None, false, special).unwrap();
        assert!(lark.contains("whitespace_pattern"), "{lark}");
    }
}
