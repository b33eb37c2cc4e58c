//! Chat templates (`CHAT=1`): the model's own Jinja template, from `chat_template.jinja` or
//! `tokenizer_config.json`'s `chat_template`, else the engine's built-in one, rendered with
//! `minijinja` the way transformers renders them (`trim_blocks`, `lstrip_blocks`,
//! Python string methods) for the conversation's messages (one user message in text mode,
//! a request's in `coli serve`) and a generation prompt.
//!
//! Unlike transformers, a variable the template prints or iterates but coli does not provide
//! is an error rather than empty text, so a template that needs more than one user turn
//! says so instead of producing a silently wrong prompt.

use std::borrow::Cow;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, Error, ErrorKind, UndefinedBehavior, Value};

use super::tokenizer::TextTokenizer;

/// The file transformers writes a chat template to.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The variables a template is rendered with, for messages.
const PROVIDED: &str =
    "messages (role and content), add_generation_prompt, bos_token, eos_token, raise_exception()";

/// One message of a conversation, as templates read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
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
        messages: &[ChatMessage],
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
        let context = minijinja::context! {
            messages => messages.iter().map(|m| minijinja::context! { role => &m.role, content => &m.content }).collect::<Vec<_>>(),
            add_generation_prompt => true,
            bos_token => bos_token.unwrap_or(""),
            eos_token => eos_token.unwrap_or(""),
        };
        let failed = |err: Error| {
            anyhow!(
                "chat template ({}): {err:#}\n(coli renders chat templates with: {PROVIDED})",
                self.source
            )
        };
        let template = env
            .template_from_named_str("chat_template", &self.text)
            .map_err(failed)?;
        template.render(context).map_err(failed)
    }
}
