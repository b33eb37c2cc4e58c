//! Text mode (`PROMPT=`): from a prompt to streamed text. The tokenizer and its special
//! tokens ([`tokenizer`]), chat templates ([`chat`]), prompts through each engine's
//! [`PromptConvention`], the stop set, and the run itself: sampled (or greedy) tokens
//! decoded and printed as they come.
//!
//! Oracle and `IDS=` modes never come here and need no tokenizer.

pub mod chat;
pub mod reasoning;
pub mod tokenizer;
pub mod tool_calls;

use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Result};
use serde_json::Value;

use crate::engines::{Engine, PromptConvention};
use crate::generate::{generate_with, Ending, Flow, Generation, OnTokens, Policy};
use crate::sampling::{Sampler, Shaping};
use crate::settings::Settings;
use crate::snapshot::{token_ids, Snapshot};

pub use chat::{called_tool, ChatMessage, ChatTemplate, Conversation, ToolCall};
pub use tokenizer::{TextStream, TextTokenizer};

/// `text` quoted for a message: whole when short, else its first [`EXCERPT_CHARS`]
/// characters, an ellipsis and its length, so that no message repeats a request's text at
/// length.
pub fn excerpt(text: &str) -> String {
    match text.char_indices().nth(EXCERPT_CHARS) {
        None => format!("{text:?}"),
        Some((cut, _)) => format!("{:?} ({} bytes)", format!("{}…", &text[..cut]), text.len()),
    }
}

/// The characters of a text [`excerpt`] quotes.
pub const EXCERPT_CHARS: usize = 80;

/// A prompt ready for the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompt {
    pub ids: Vec<u32>,
    /// The text that was encoded (the rendered template with `CHAT=1`).
    pub text: String,
    /// Where the chat template came from, with `CHAT=1`.
    pub template: Option<String>,
    /// What the model reads instead of `text` where the tokenizer cannot represent all of it
    /// (characters its vocabulary lacks).
    pub misread: Option<String>,
}

/// A prompt's text before it is encoded: as given, or a rendered chat template.
#[derive(Debug, Clone)]
pub struct PromptText {
    pub text: String,
    /// Add what the tokenizer's post-processor adds (text as given; a rendered template
    /// carries its own special tokens).
    post_process: bool,
    /// Where the chat template came from.
    template: Option<String>,
}

impl PromptText {
    /// Text as given, encoded as text mode and `/v1/completions` encode a prompt.
    pub fn plain(text: String) -> PromptText {
        PromptText {
            text,
            post_process: true,
            template: None,
        }
    }
}

/// A model directory's tokenizer and config seen through an engine's convention.
pub struct TextModel<'a> {
    pub tokenizer: &'a TextTokenizer,
    pub dir: &'a Path,
    pub config: &'a Value,
    pub engine: &'a str,
    pub convention: PromptConvention,
}

impl<'a> TextModel<'a> {
    pub fn new(
        tokenizer: &'a TextTokenizer,
        snapshot: &'a Snapshot,
        engine: &dyn Engine,
    ) -> TextModel<'a> {
        TextModel {
            tokenizer,
            dir: snapshot.dir(),
            config: snapshot.config_json(),
            engine: engine.name(),
            convention: engine.prompt_convention(),
        }
    }

    /// The ids for `text`: encoded as given (the tokenizer's post-processor applied), or
    /// rendered through the chat template with `chat`; then the BOS and the convention's
    /// prefix in front, each unless already there.
    pub fn prompt(&self, text: &str, chat: bool) -> Result<Prompt> {
        if chat {
            let conversation = Conversation::from(vec![ChatMessage::text("user", text)]);
            return self.chat_prompt(&conversation);
        }
        self.encode(PromptText::plain(text.to_string()))
    }

    /// The ids that start the answer to the last of the conversation's messages, rendered
    /// through the chat template; then the BOS and the convention's prefix, as
    /// [`TextModel::prompt`].
    pub fn chat_prompt(&self, conversation: &Conversation) -> Result<Prompt> {
        self.encode(self.render(conversation)?)
    }

    /// The conversation rendered through the chat template, not encoded yet.
    pub fn render(&self, conversation: &Conversation) -> Result<PromptText> {
        let tokenizer = self.tokenizer;
        let template = ChatTemplate::find(
            self.dir,
            tokenizer,
            self.convention.chat_template,
            self.engine,
        )?;
        let config = tokenizer.config();
        let rendered = template.render(
            conversation,
            config.bos_token.as_deref(),
            config.eos_token.as_deref(),
        )?;
        Ok(PromptText {
            text: rendered,
            // A rendered template carries its own special tokens, as transformers encodes it.
            post_process: false,
            template: Some(template.source().to_string()),
        })
    }

    /// `text` encoded (once), behind the BOS and the convention's prefix.
    pub fn encode(&self, text: PromptText) -> Result<Prompt> {
        let tokenizer = self.tokenizer;
        let PromptText {
            text,
            post_process,
            template,
        } = text;
        let (body, misread) = tokenizer.encode_checked(&text, post_process)?;
        let mut start = Vec::new();
        if self.convention.bos || tokenizer.config().add_bos_token {
            match self.bos_id()? {
                Some(bos) => start.push(bos),
                None => eprintln!(
                    "[prompt] {} asks for a BOS token but neither config.json nor {} names one; none added",
                    self.engine,
                    tokenizer.config_path().display()
                ),
            }
        }
        for token in self.convention.prefix {
            match tokenizer.token_id(token) {
                Some(id) => start.push(id),
                None => bail!(
                    "{} has no token {token:?}, which every {} prompt starts with",
                    tokenizer.path().display(),
                    self.engine
                ),
            }
        }
        let mut ids = without_repeat(&start, &body);
        ids.extend_from_slice(&body);
        Ok(Prompt {
            ids,
            text,
            template,
            misread,
        })
    }

    /// Every id that ends a generation: the engine's own (`eos_token_id` of `config.json`,
    /// or its `text_config`, and of `generation_config.json`, read once when it loaded),
    /// `tokenizer_config.json`'s `eos_token`, and with [`PromptConvention::stop_on_special`]
    /// every special token.
    pub fn stop_ids(&self, engine_stops: &[u32]) -> Result<Vec<u32>> {
        let mut ids = engine_stops.to_vec();
        if let Some(eos) = &self.tokenizer.config().eos_token {
            ids.push(self.tokenizer.config_token_id("eos_token", eos)?);
        }
        if self.convention.stop_on_special {
            ids.extend(self.tokenizer.special_ids());
        }
        ids.sort_unstable();
        ids.dedup();
        Ok(ids)
    }

    fn bos_id(&self) -> Result<Option<u32>> {
        let key = "bos_token_id";
        let value = self
            .config
            .get(key)
            .or_else(|| self.config.get("text_config").and_then(|t| t.get(key)));
        let from_config = token_ids(value, key, &self.dir.join("config.json"))?;
        if let Some(&id) = from_config.first() {
            return Ok(Some(id));
        }
        match &self.tokenizer.config().bos_token {
            Some(bos) => Ok(Some(self.tokenizer.config_token_id("bos_token", bos)?)),
            None => Ok(None),
        }
    }
}

/// What goes before `body`: `start`, less its longest tail that `body` already begins with
/// (a template or post-processor that writes the BOS or prefix itself).
fn without_repeat(start: &[u32], body: &[u32]) -> Vec<u32> {
    let keep = (0..=start.len())
        .find(|&k| body.starts_with(&start[k..]))
        .unwrap_or(start.len());
    start[..keep].to_vec()
}

/// Text mode's settings and tokenizer, checked before the model loads.
pub struct TextMode {
    tokenizer: TextTokenizer,
    prompt: String,
    chat: bool,
    temperature: f64,
    top_p: f64,
    /// `TOP_K`, `MIN_P` and the penalties.
    shaping: Shaping,
    seed: u64,
}

impl TextMode {
    /// `None` without `PROMPT`; otherwise the checked sampling settings and the tokenizer of
    /// the model in `dir`.
    pub fn from_settings(settings: &Settings, dir: &Path) -> Result<Option<TextMode>> {
        let Some(prompt) = &settings.prompt else {
            return Ok(None);
        };
        if settings.ids.is_some() {
            bail!("PROMPT and IDS are two modes: give the prompt as text (PROMPT=) or as token ids (IDS=), not both");
        }
        let temperature = settings.temperature()?;
        let top_p = settings.top_p;
        // The sampler is built per run; this checks the values before anything loads.
        Sampler::new(temperature, top_p, 0)?;
        let shaping = settings.shaping()?;
        let seed = settings.seed_or_clock();
        Ok(Some(TextMode {
            tokenizer: TextTokenizer::load(dir)?,
            prompt: prompt.clone(),
            chat: settings.chat,
            temperature,
            top_p,
            shaping,
            seed,
        }))
    }

    /// The prompt's ids and the stop set for the loaded engine; reports both on stderr.
    pub fn prepare(&self, snapshot: &Snapshot, engine: &dyn Engine) -> Result<TextJob<'_>> {
        let model = TextModel::new(&self.tokenizer, snapshot, engine);
        let prompt = model.prompt(&self.prompt, self.chat)?;
        if let Some(read) = &prompt.misread {
            eprintln!(
                "[prompt] {} cannot represent all of the prompt; the model reads {}",
                self.tokenizer.path().display(),
                excerpt(read)
            );
        }
        let vocab = engine.vocab_size();
        if let Some(bad) = prompt.ids.iter().find(|&&id| id as usize >= vocab) {
            bail!(
                "{} gives the prompt token id {bad}, outside the model's vocabulary (vocab_size {vocab}): the tokenizer does not belong to this model",
                self.tokenizer.path().display()
            );
        }
        if prompt.ids.is_empty() {
            bail!("PROMPT: the prompt encodes to no tokens; give some text");
        }
        let stops = model.stop_ids(engine.stop_tokens())?;
        let sampler = Sampler::new(self.temperature, self.top_p, self.seed)?
            .shaped(self.shaping.clone(), &prompt.ids)?;
        let mut line = format!("[prompt] {} tokens", prompt.ids.len());
        if let Some(template) = &prompt.template {
            let _ = write!(line, " (chat template: {template})");
        }
        let _ = write!(line, " | {} stop ids", stops.len());
        crate::note!("{line}");
        if crate::verbosity::verbose() {
            eprintln!("[prompt] ids: {}", crate::oracle::join(&prompt.ids));
        }
        if sampler.is_greedy() {
            crate::note!("[sample] greedy (TEMP=0)");
        } else {
            crate::note!(
                "[sample] TEMP={} TOP_P={} SEED={}",
                self.temperature,
                self.top_p,
                self.seed
            );
        }
        if self.shaping != Shaping::default() {
            let s = &self.shaping;
            crate::note!(
                "[sample] TOP_K={} MIN_P={} PRESENCE_PENALTY={} FREQUENCY_PENALTY={} REPETITION_PENALTY={}",
                s.top_k, s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty
            );
        }
        Ok(TextJob {
            tokenizer: &self.tokenizer,
            prompt,
            stops,
            sampler,
        })
    }
}

/// One prepared text generation.
pub struct TextJob<'a> {
    tokenizer: &'a TextTokenizer,
    prompt: Prompt,
    stops: Vec<u32>,
    sampler: Sampler,
}

impl TextJob<'_> {
    /// Generate up to `count` tokens, writing the text to `out` as it is decoded and a
    /// newline at the end.
    pub fn run(
        &mut self,
        engine: &dyn Engine,
        count: usize,
        on_tokens: OnTokens,
        out: &mut dyn Write,
    ) -> Result<Generation> {
        let mut stream = self.tokenizer.stream();
        let generation = {
            let mut print = |token: u32| -> Result<Flow> {
                if let Some(text) = stream.step(token)? {
                    out.write_all(text.as_bytes())?;
                    out.flush()?;
                }
                Ok(Flow::Continue)
            };
            let policy = Policy {
                count,
                sampler: &mut self.sampler,
                stops: &self.stops,
            };
            let mut state = engine.new_state();
            generate_with(
                engine,
                &mut state,
                &self.prompt.ids,
                policy,
                on_tokens,
                &mut print,
            )?
        };
        let rest = stream.finish()?;
        out.write_all(rest.as_bytes())?;
        out.write_all(b"\n")?;
        out.flush()?;
        Ok(generation)
    }

    /// The prompt's length in tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt.ids.len()
    }

    /// `[text] P prompt tokens | G generated (why it ended) | prefill X tok/s | decode Y tok/s`
    pub fn summary(&self, generation: &Generation) -> String {
        let ending = match generation.ending {
            Ending::Limit => "NGEN reached".to_string(),
            Ending::Stop(id) => format!("stop token {id}"),
            Ending::Interrupted if generation.stopped_in_prefill() => {
                "interrupted during the prefill".to_string()
            }
            Ending::Interrupted => "interrupted".to_string(),
            Ending::Halted => "halted".to_string(),
        };
        // A prefill a signal stopped did not run the whole prompt: no rate.
        let prefill = if generation.prefill_seconds > 0.0 && !generation.stopped_in_prefill() {
            self.prompt.ids.len() as f64 / generation.prefill_seconds
        } else {
            0.0
        };
        format!(
            "[text] {} prompt tokens | {} generated ({ending}) | prefill {prefill:.1} tok/s | decode {:.1} tok/s",
            self.prompt.ids.len(),
            generation.tokens.len(),
            generation.decode_tokens_per_second()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_tokens_are_not_repeated() {
        assert_eq!(without_repeat(&[1, 2], &[5, 6]), vec![1, 2]);
        assert_eq!(without_repeat(&[1, 2], &[1, 2, 5]), Vec::<u32>::new());
        assert_eq!(without_repeat(&[1, 2], &[1, 5]), vec![1, 2]);
        assert_eq!(without_repeat(&[0, 1, 2], &[1, 2, 5]), vec![0]);
        assert_eq!(without_repeat(&[], &[1]), Vec::<u32>::new());
    }
}
