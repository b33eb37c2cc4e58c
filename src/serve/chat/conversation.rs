//! The conversation `coli chat` holds: its system prompt and its messages, what the model's
//! chat template is given each turn, and its file, which `/save` writes and `/load` reads:
//!
//! ```json
//! {"system": "Answer briefly.", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
//! ```
//!
//! `system` is a string or `null`; the messages alternate, the user's first, and end with an
//! answer, as a chat leaves them after every turn.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use crate::files;
use crate::text::ChatMessage;

const USER: &str = "user";
const ASSISTANT: &str = "assistant";

/// The system prompt and the messages of a conversation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conversation {
    pub system: Option<String>,
    /// The user's messages and the answers, alternating from the user's.
    messages: Vec<ChatMessage>,
}

impl Conversation {
    pub fn new(system: Option<String>) -> Conversation {
        Conversation {
            system,
            messages: Vec::new(),
        }
    }

    /// The messages so far.
    pub fn message_count(&self) -> usize {
        self.messages.len()
    }

    /// A new conversation with the same system prompt.
    pub fn reset(&mut self) {
        self.messages.clear();
    }

    /// The user's next message.
    pub fn ask(&mut self, text: &str) {
        self.messages.push(ChatMessage::text(USER, text));
    }

    /// The answer to the last message.
    pub fn answer(&mut self, text: String) {
        self.messages.push(ChatMessage::text(ASSISTANT, text));
    }

    /// Take back the user's last message (it got no answer).
    pub fn withdraw(&mut self) {
        if self.messages.last().is_some_and(|m| m.role == USER) {
            self.messages.pop();
        }
    }

    /// What the chat template is given: the system prompt, then the messages.
    pub fn prompt(&self) -> Vec<ChatMessage> {
        let system = self
            .system
            .iter()
            .map(|text| ChatMessage::text("system", text.as_str()));
        system.chain(self.messages.iter().cloned()).collect()
    }

    /// The conversation as its file holds it.
    pub fn to_json(&self) -> Value {
        let messages: Vec<Value> = self
            .messages
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        json!({"system": self.system, "messages": messages})
    }

    /// The conversation in `text`, or what in it is wrong, naming the field.
    pub fn from_json(text: &str) -> Result<Conversation, String> {
        let value: Value = serde_json::from_str(text).map_err(|err| format!("not JSON: {err}"))?;
        let Value::Object(fields) = value else {
            return Err(r#"expected a JSON object {"system", "messages"}"#.to_string());
        };
        if let Some(key) = fields
            .keys()
            .find(|key| !["system", "messages"].contains(&key.as_str()))
        {
            return Err(format!(
                r#""{key}": unknown field (a conversation has "system" and "messages")"#
            ));
        }
        let system = match fields.get("system") {
            None | Some(Value::Null) => None,
            Some(Value::String(text)) => Some(text.clone()),
            Some(_) => return Err(r#""system": expected a string or null"#.to_string()),
        };
        let Some(Value::Array(items)) = fields.get("messages") else {
            return Err(
                r#""messages": expected an array of {"role", "content"} objects"#.to_string(),
            );
        };
        let mut messages = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let Value::Object(message) = item else {
                return Err(format!(
                    r#"messages[{i}]: expected an object {{"role", "content"}}"#
                ));
            };
            if let Some(key) = message
                .keys()
                .find(|key| !["role", "content"].contains(&key.as_str()))
            {
                return Err(format!(
                    r#"messages[{i}].{key}: unknown field (a message has "role" and "content")"#
                ));
            }
            let expected = if i % 2 == 0 { USER } else { ASSISTANT };
            match message.get("role").and_then(Value::as_str) {
                Some(role) if role == expected => {}
                Some("system") => {
                    return Err(format!(
                        r#"messages[{i}].role: "system": the system prompt goes in "system""#
                    ))
                }
                _ => {
                    return Err(format!(
                        r#"messages[{i}].role: expected "{expected}" (the messages alternate "user" and "assistant", from "user")"#
                    ))
                }
            }
            let Some(Value::String(content)) = message.get("content") else {
                return Err(format!("messages[{i}].content: expected a string"));
            };
            messages.push(ChatMessage::text(expected, content.as_str()));
        }
        if messages.len() % 2 == 1 {
            return Err(format!(
                "messages[{}]: the user's message has no answer (a conversation ends with one)",
                messages.len() - 1
            ));
        }
        Ok(Conversation { system, messages })
    }

    /// Write the conversation to `path`, whole or not at all. A file there already is
    /// replaced only when it is a conversation (one an earlier `/save` wrote).
    pub fn save(&self, path: &Path) -> Result<()> {
        let target = files::resolve_link(path)
            .with_context(|| format!("cannot resolve {}", path.display()))?;
        if target.exists() {
            let held = files::read_input(&target)
                .map_err(anyhow::Error::from)
                .and_then(|bytes| Ok(String::from_utf8(bytes)?));
            if !held.is_ok_and(|text| Conversation::from_json(&text).is_ok()) {
                bail!(
                    "{} exists and is not a saved conversation: it is left as it is (choose another file)",
                    path.display()
                );
            }
        }
        let mut text = serde_json::to_string_pretty(&self.to_json())?;
        text.push('\n');
        files::replace_alone(&target, |out: &mut dyn Write| {
            out.write_all(text.as_bytes())
        })?;
        Ok(())
    }

    /// The conversation in the file at `path`, or why it cannot be one.
    pub fn load(path: &Path) -> Result<Conversation> {
        let bytes =
            files::read_input(path).with_context(|| format!("cannot read {}", path.display()))?;
        let text = String::from_utf8(bytes).map_err(|err| {
            anyhow::anyhow!(
                "{}: not UTF-8 text (byte {})",
                path.display(),
                err.utf8_error().valid_up_to()
            )
        })?;
        Conversation::from_json(&text)
            .map_err(|problem| anyhow::anyhow!("{}: {problem}", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(text: &str) -> String {
        Conversation::from_json(text).expect_err(text)
    }

    #[test]
    fn a_conversation_reads_back_as_it_was_written() {
        let mut conversation = Conversation::new(Some("Be brief.".to_string()));
        conversation.ask("Hi \"there\"");
        conversation.answer("Hello.\n".to_string());
        let text = conversation.to_json().to_string();
        assert_eq!(Conversation::from_json(&text), Ok(conversation.clone()));
        let prompt = conversation.prompt();
        let roles: Vec<&str> = prompt.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant"]);
        assert_eq!(prompt[0].content, "Be brief.");
        let none = Conversation::from_json(r#"{"system": null, "messages": []}"#).unwrap();
        assert_eq!(none, Conversation::new(None));
        assert_eq!(none.prompt(), Vec::new());
    }

    #[test]
    fn a_bad_conversation_is_refused_naming_the_field() {
        assert!(problem("[1").starts_with("not JSON"));
        assert!(problem("[]").contains("expected a JSON object"));
        assert!(problem(r#"{"messages": [], "model": "x"}"#).starts_with(r#""model": unknown"#));
        assert!(problem(r#"{"system": 3, "messages": []}"#).starts_with(r#""system":"#));
        assert!(problem(r#"{"system": "s"}"#).starts_with(r#""messages":"#));
        assert!(problem(r#"{"messages": [3]}"#).starts_with("messages[0]:"));
        let user = r#"{"role": "user", "content": "a"}"#;
        let bad = |second: &str| problem(&format!(r#"{{"messages": [{user}, {second}]}}"#));
        assert!(bad(r#"{"role": "assistant", "content": 5}"#).starts_with("messages[1].content:"));
        assert!(bad(r#"{"role": "user", "content": "b"}"#)
            .starts_with(r#"messages[1].role: expected "assistant""#));
        assert!(bad(r#"{"role": "system", "content": "b"}"#).contains(r#"goes in "system""#));
        assert!(bad(r#"{"role": "assistant", "content": "b", "name": "x"}"#)
            .starts_with("messages[1].name: unknown field"));
        assert!(problem(&format!(r#"{{"messages": [{user}]}}"#))
            .starts_with("messages[0]: the user's message has no answer"));
    }

    #[test]
    fn a_message_without_an_answer_is_withdrawn_and_only_it() {
        let mut conversation = Conversation::new(None);
        conversation.ask("a");
        conversation.answer("b".to_string());
        conversation.withdraw();
        assert_eq!(conversation.message_count(), 2);
        conversation.ask("c");
        conversation.withdraw();
        assert_eq!(conversation.message_count(), 2);
    }

    #[test]
    fn save_replaces_a_conversation_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("talk.json");
        let mut conversation = Conversation::new(None);
        conversation.save(&path).unwrap();
        conversation.ask("a");
        conversation.answer("b".to_string());
        conversation.save(&path).unwrap();
        assert_eq!(Conversation::load(&path).unwrap(), conversation);
        let other = dir.path().join("notes.txt");
        std::fs::write(&other, "mine").unwrap();
        let err = conversation.save(&other).unwrap_err().to_string();
        assert!(err.contains("is not a saved conversation"), "{err}");
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "mine");
        std::fs::write(&other, [0xff, b'{']).unwrap();
        let err = format!("{:#}", Conversation::load(&other).unwrap_err());
        assert!(err.contains("not UTF-8"), "{err}");
    }
}
