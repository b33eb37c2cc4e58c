//! Tools in the built-in chat templates: declared, called by a past assistant turn and
//! answered, as each model's published template lays them out; and calls constrained to each
//! model's syntax.

use coli::guide::{Grammar, Guides};
use coli::sampling::argmax;
use coli::text::tool_calls::{call_grammar, Marker, Scanned, ToolScan};
use coli::text::{ChatMessage, ChatTemplate, Conversation, TextModel, ToolCall};
use serde_json::json;

use crate::common;
use crate::support::{load_engine, text_fixture, tokenizer};

/// A conversation with a tool, a past call of it with arguments of every JSON type, its
/// result and a later turn.
fn conversation() -> Conversation {
    let arguments = json!({"city": "Oslo", "days": 3, "units": {"t": "C"}, "flag": true, "at": null, "list": [1]});
    let call = ToolCall {
        id: "c1".into(),
        name: "weather".into(),
        arguments: arguments.as_object().unwrap().clone(),
    };
    Conversation {
        messages: vec![
            ChatMessage::text("system", "Be brief."),
            ChatMessage::text("user", "Weather in Oslo & \"Bergen\"?"),
            ChatMessage {
                tool_calls: vec![call],
                ..ChatMessage::text("assistant", "")
            },
            ChatMessage {
                tool_call_id: Some("c1".into()),
                name: Some("weather".into()),
                ..ChatMessage::text("tool", "-3 C")
            },
            ChatMessage::text("assistant", "It is cold."),
            ChatMessage::text("user", "Thanks"),
        ],
        tools: vec![
            json!({"type": "function", "function": {"name": "weather", "description": "Get weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}),
        ],
        variables: serde_json::Map::new(),
        prefill: String::new(),
    }
}

fn rendered(fixture: &str, tokenizer_name: &str) -> String {
    let dir = text_fixture(fixture, tokenizer_name);
    let (_, engine) = load_engine(dir.path());
    let tokenizer = tokenizer(dir.path());
    let convention = engine.prompt_convention();
    let template = ChatTemplate::find(
        dir.path(),
        &tokenizer,
        convention.chat_template,
        engine.name(),
    )
    .unwrap();
    template.render(&conversation(), None, None).unwrap()
}

/// Byte for byte what the published Kimi K3 template renders for this conversation with
/// `thinking` false (checked with Python's Jinja2 and transformers' `tojson`).
const KIMI_K3: &str = "<|open|>message role=\"system\" type=\"tool-declare\"<|sep|># Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n[{\"function\":{\"description\":\"Get weather\",\"name\":\"weather\",\"parameters\":{\"properties\":{\"city\":{\"type\":\"string\"},\"days\":{\"type\":\"integer\"}},\"required\":[\"city\"],\"type\":\"object\"}},\"type\":\"function\"}]\n```<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"system\"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"user\"<|sep|>Weather in Oslo & \"Bergen\"?<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Oslo<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|open|>argument key=\"units\" type=\"object\"<|sep|>{\"t\": \"C\"}<|close|>argument<|sep|><|open|>argument key=\"flag\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|><|open|>argument key=\"at\" type=\"null\"<|sep|>null<|close|>argument<|sep|><|open|>argument key=\"list\" type=\"array\"<|sep|>[1]<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role=\"tool\" tool=\"weather\" index=\"1\"<|sep|>-3 C<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>It is cold.<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|><|open|>message role=\"user\"<|sep|>Thanks<|close|>message<|sep|><|end_of_msg|><|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>";

/// GLM-4.7/GLM-5's layout, without newlines between the tags.
const GLM: &str = "[gMASK]<sop><|system|># Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"weather\", \"description\": \"Get weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}}, \"required\": [\"city\"]}}}\n</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call><|system|>Be brief.<|user|>Weather in Oslo & \"Bergen\"?<|assistant|><think></think><tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>3</arg_value><arg_key>units</arg_key><arg_value>{\"t\": \"C\"}</arg_value><arg_key>flag</arg_key><arg_value>true</arg_value><arg_key>at</arg_key><arg_value>null</arg_value><arg_key>list</arg_key><arg_value>[1]</arg_value></tool_call><|observation|><tool_response>-3 C</tool_response><|assistant|><think></think>It is cold.<|user|>Thanks<|assistant|><think></think>";

/// With tools, the model's turn is opened without a block: it chooses text or a call.
const INKLING: &str = "<|message_system|><|content_text|># Tools\n[{\"type\": \"function\", \"function\": {\"name\": \"weather\", \"description\": \"Get weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}, \"days\": {\"type\": \"integer\"}}, \"required\": [\"city\"]}}}]<|end_message|><|message_system|><|content_text|>Be brief.<|end_message|><|message_system|><|content_text|>Thinking effort level: 0<|end_message|><|message_user|><|content_text|>Weather in Oslo & \"Bergen\"?<|end_message|><|message_model|><|content_invoke_tool_json|>{\"name\": \"weather\", \"args\": {\"city\": \"Oslo\", \"days\": 3, \"units\": {\"t\": \"C\"}, \"flag\": true, \"at\": null, \"list\": [1]}}<|end_message|><|message_tool|><|content_text|>-3 C<|end_message|><|message_model|><|content_text|>It is cold.<|end_message|><|message_user|><|content_text|>Thanks<|end_message|><|message_model|>";

#[test]
fn the_built_in_templates_declare_tools_and_render_calls_and_results() {
    assert_eq!(rendered("kimi_k3_tiny", "kimi_k3_192"), KIMI_K3);
    assert_eq!(rendered("glm_moe_dsa_tiny", "glm_moe_dsa_128"), GLM);
    assert_eq!(rendered("inkling_tiny", "inkling_250"), INKLING);
}

/// The tools of the constrained-call test: one with a string and an integer, both
/// required, one with an optional string.
fn weather_and_ls() -> Vec<serde_json::Value> {
    vec![
        json!({"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["city", "days"], "additionalProperties": false}}}),
        json!({"type": "function", "function": {"name": "ls", "parameters": {"type": "object",
            "properties": {"dir": {"type": "string"}, "opts": {"$ref": "#/$defs/Opts"}},
            "additionalProperties": false,
            "$defs": {"Opts": {"type": "object", "properties": {"all": {"type": "boolean"}},
                "required": ["all"], "additionalProperties": false}}}}}),
        json!({"type": "function", "function": {"name": "now"}}),
    ]
}

/// With a call required, greedy choices from random logits under the grammar's masks give
/// an answer that is calls alone, in the engine's syntax, whose arguments fit the schema;
/// one call when parallel calls are off, calls of the named tool alone when one is named.
#[test]
fn a_required_call_is_well_formed_in_every_engines_syntax() {
    let cases = [
        ("kimi_k3_tiny", "kimi_k3_192"),
        ("glm_moe_dsa_tiny", "glm_moe_dsa_128"),
        ("inkling_tiny", "inkling_250"),
    ];
    for (fixture, tokenizer_name) in cases {
        let dir = text_fixture(fixture, tokenizer_name);
        let (snapshot, engine) = load_engine(dir.path());
        let tokenizer = tokenizer(dir.path());
        let stops = TextModel::new(&tokenizer, &snapshot, engine.as_ref())
            .stop_ids(engine.stop_tokens())
            .unwrap();
        let syntax = engine.prompt_convention().tools.expect("a tool syntax");
        let guides = Guides::new(&tokenizer, engine.vocab_size(), &stops).unwrap();
        let specials = tokenizer.special_ids();
        let marker = |m: &str| match tokenizer.token_id(m) {
            Some(id) if stops.contains(&id) => Marker::Stop,
            Some(id) if specials.contains(&id) => Marker::Special,
            _ => Marker::Text,
        };
        let tools = weather_and_ls();
        for (only, parallel) in [(None, true), (None, false), (Some("weather"), true)] {
            for seed in 0..6u64 {
                let lark = call_grammar(syntax, &tools, only, parallel, marker).unwrap();
                let mut guide = guides.start(&Grammar::Lark(lark.clone())).unwrap();
                let mut stream = tokenizer.stream_keeping(true);
                let mut scan = ToolScan::new(syntax, tools.clone());
                let mut pieces = Vec::new();
                let mut ended = false;
                for step in 0..4000u64 {
                    let mut logits = common::random(engine.vocab_size(), seed * 7919 + step);
                    guide.mask().unwrap().apply(&mut logits);
                    let token = argmax(&logits);
                    if let Err(err) = guide.accept(token) {
                        panic!("{fixture} {only:?} {parallel} seed {seed} step {step}: {err}");
                    }
                    if stops.contains(&token) {
                        ended = true;
                        break;
                    }
                    if let Some(text) = stream.step(token).unwrap() {
                        pieces.extend(scan.push(&text));
                    }
                }
                pieces.extend(scan.push(&stream.finish().unwrap()));
                pieces.extend(scan.finish());
                let context = format!("{fixture}, only {only:?}, parallel {parallel}, seed {seed}");
                assert!(ended, "{context}: no stop within 4000 tokens\n{lark}");
                let calls: Vec<_> = pieces
                    .iter()
                    .map(|piece| match piece {
                        Scanned::Call(call) => call,
                        Scanned::Text(text) => panic!("{context}: text {text:?} in {pieces:?}"),
                    })
                    .collect();
                assert!(!calls.is_empty(), "{context}");
                if !parallel {
                    assert_eq!(calls.len(), 1, "{context}: {calls:?}");
                }
                for call in calls {
                    let arguments = &call.arguments;
                    match call.name.as_str() {
                        "weather" => {
                            assert!(arguments["city"].is_string(), "{context}: {call:?}");
                            let days = arguments["days"].as_i64();
                            assert!(
                                days.is_some_and(|d| (1..=9).contains(&d)),
                                "{context}: {call:?}"
                            );
                            assert_eq!(arguments.len(), 2, "{context}: {call:?}");
                        }
                        "ls" if only.is_none() => {
                            let dir = arguments.get("dir");
                            assert!(dir.is_none_or(|v| v.is_string()), "{context}: {call:?}");
                            let opts = arguments.get("opts");
                            let all = |v: &serde_json::Value| v["all"].is_boolean();
                            assert!(opts.is_none_or(all), "{context}: {call:?}");
                        }
                        "now" if only.is_none() => {}
                        other => panic!("{context}: a call of {other}"),
                    }
                }
            }
        }
    }
}
