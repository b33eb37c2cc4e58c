//! A model's tokenizer: `tokenizer.json` (read by the `tokenizers` crate, pure-Rust regex
//! backend) with the special tokens `tokenizer_config.json` names, and [`TextStream`], which
//! turns generated ids into text as they come without ever splitting a UTF-8 character.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// What `tokenizer_config.json` says beyond the vocabulary.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// `add_bos_token: true`: every prompt starts with the BOS token.
    pub add_bos_token: bool,
    /// The `chat_template` entry (the one named `default` when it is a list).
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// Parse `tokenizer_config.json`; `path` is for messages.
    pub fn parse(json: &Value, path: &Path) -> Result<TokenizerConfig> {
        let token = |key: &str| -> Result<Option<String>> {
            match json.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(text)) => Ok(Some(text.clone())),
                // The serialised `AddedToken` form.
                Some(Value::Object(fields)) => match fields.get("content") {
                    Some(Value::String(text)) => Ok(Some(text.clone())),
                    _ => bail!("{}: {key} has no string \"content\"", path.display()),
                },
                Some(other) => bail!(
                    "{}: {key} must be a token string or null, found {other}",
                    path.display()
                ),
            }
        };
        let add_bos_token = match json.get("add_bos_token") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(flag)) => *flag,
            Some(other) => bail!(
                "{}: add_bos_token must be true or false, found {other}",
                path.display()
            ),
        };
        let chat_template = match json.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(template)) => Some(template.clone()),
            Some(Value::Array(named)) => named
                .iter()
                .find(|entry| entry.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|entry| entry.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            Some(other) => bail!(
                "{}: chat_template must be a string or a list of {{name, template}}, found {other}",
                path.display()
            ),
        };
        Ok(TokenizerConfig {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            add_bos_token,
            chat_template,
        })
    }
}

/// `tokenizer.json` plus `tokenizer_config.json` of one model directory.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    config: TokenizerConfig,
    config_path: PathBuf,
    /// See [`TextTokenizer::bytes_per_token`].
    bytes_per_token: Option<usize>,
}

impl TextTokenizer {
    /// Load `dir/tokenizer.json` and, when present, `dir/tokenizer_config.json`.
    pub fn load(dir: &Path) -> Result<TextTokenizer> {
        let path = dir.join(TOKENIZER_FILE);
        if !path.is_file() {
            bail!(
                "{} not found: text mode (PROMPT=) needs the model's tokenizer; oracle mode (ref.json) and IDS= mode run without one",
                path.display()
            );
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|err| {
            anyhow!(
                "{}: not a tokenizer the tokenizers library can read: {err}",
                path.display()
            )
        })?;
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {}", config_path.display()))?;
            let json: Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: not valid JSON", config_path.display()))?;
            TokenizerConfig::parse(&json, &config_path)?
        } else {
            TokenizerConfig::default()
        };
        Ok(TextTokenizer {
            bytes_per_token: longest_token(&inner),
            inner,
            path,
            config,
            config_path,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Token ids of `text`; added tokens written in the text are matched as such, and
    /// `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS it adds).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|err| anyhow!("{}: encoding failed: {err}", self.path.display()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The ids of `text`, encoded once, and what they read back as where that is not `text`
    /// (characters the vocabulary cannot hold are dropped); with `add_special_tokens`, what
    /// the post-processor adds (not part of the text, so not read back).
    pub fn encode_checked(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Option<String>)> {
        let failed = |err| anyhow!("{}: encoding failed: {err}", self.path.display());
        let encoding = self.inner.encode(text, false).map_err(failed)?;
        let read_back = self.decode_all(encoding.get_ids())?;
        let misread = (read_back != text).then_some(read_back);
        let encoding = if add_special_tokens {
            self.inner
                .post_process(encoding, None, true)
                .map_err(failed)?
        } else {
            encoding
        };
        Ok((encoding.get_ids().to_vec(), misread))
    }

    /// The most bytes of text one token stands for, where that bounds every text's count
    /// of tokens from below (a text of B bytes is at least B / this many tokens, known
    /// without encoding it); `None` where this tokenizer allows no such bound
    /// ([`longest_token`]).
    pub fn bytes_per_token(&self) -> Option<usize> {
        self.bytes_per_token
    }

    /// The text of `ids` as printed: special tokens left out, bytes that do not form UTF-8
    /// shown as U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, true)
    }

    /// The text of `ids`, special tokens included (what encoding read).
    pub fn decode_all(&self, ids: &[u32]) -> Result<String> {
        self.decode_with(ids, false)
    }

    fn decode_with(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|err| anyhow!("{}: decoding failed: {err}", self.path.display()))
    }

    /// The id of a token given by its text (an added token or a vocabulary entry).
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Every added token flagged `"special": true`, ascending.
    pub fn special_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        ids.sort_unstable();
        ids
    }

    /// The id of a token `tokenizer_config.json` names under `key`, or an error naming both
    /// files when `tokenizer.json` lacks it.
    pub fn config_token_id(&self, key: &str, token: &str) -> Result<u32> {
        self.token_id(token).ok_or_else(|| {
            anyhow!(
                "{} names {key} {token:?}, which {} does not contain",
                self.config_path.display(),
                self.path.display()
            )
        })
    }

    /// An incremental decoder for generated ids, special tokens left out.
    pub fn stream(&self) -> TextStream<'_> {
        self.stream_keeping(false)
    }

    /// An incremental decoder for generated ids; with `special`, special tokens decoded
    /// too (the markers of a model's calls of tools).
    pub fn stream_keeping(&self, special: bool) -> TextStream<'_> {
        TextStream {
            tokenizer: self,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
            skip_special: !special,
        }
    }
}

/// Decodes ids one at a time and hands out only finished text: while the decoded window
/// ends in U+FFFD (a character whose bytes are still arriving) it waits for the next token.
/// The concatenation of every [`step`](Self::step) and the final [`finish`](Self::finish) is
/// exactly [`TextTokenizer::decode`] of all the ids.
///
/// Only a short window is decoded each step: the ids of the last chunk handed out (context
/// for decoders that look at neighbours) and those not handed out yet.
pub struct TextStream<'a> {
    tokenizer: &'a TextTokenizer,
    ids: Vec<u32>,
    /// The decoded text of `ids[..prefix_index]`, already handed out.
    prefix: String,
    prefix_index: usize,
    skip_special: bool,
}

impl TextStream<'_> {
    /// Add one id; the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.decode()?;
        if text.len() <= self.prefix.len() || text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let fresh = self.fresh(&text)?;
        let kept = self.ids.len() - self.prefix_index;
        self.ids.drain(..self.prefix_index);
        self.prefix = self.decode()?;
        self.prefix_index = kept;
        Ok(Some(fresh))
    }

    /// The text still held back at the end of a generation (an unfinished character shows as
    /// U+FFFD, as in the full decode).
    pub fn finish(self) -> Result<String> {
        if self.ids.len() == self.prefix_index {
            return Ok(String::new());
        }
        let text = self.decode()?;
        self.fresh(&text)
    }

    fn decode(&self) -> Result<String> {
        self.tokenizer.decode_with(&self.ids, self.skip_special)
    }

    /// `text` past the part already handed out.
    fn fresh(&self, text: &str) -> Result<String> {
        match text.strip_prefix(self.prefix.as_str()) {
            Some(rest) => Ok(rest.to_string()),
            None => bail!(
                "{}: decoding ids {:?} gave {text:?}, which does not continue the text already printed ({:?})",
                self.tokenizer.path.display(),
                self.ids,
                self.prefix
            ),
        }
    }
}

/// The most bytes of text one token of `tokenizer` can stand for, where that bounds a text's
/// tokens from below: nothing drops or shrinks text on its way to the model (no normalizer,
/// no truncation, no pre-tokenizer that removes what it splits on, no added token that strips
/// the spaces beside it) and every byte ends up in a token (a byte-level BPE whose vocabulary
/// holds all 256 bytes, byte fallback with its 256 byte tokens, or an unknown token for each
/// character not in the vocabulary). Then every token stands for at most the bytes of its
/// longest vocabulary entry or added token (a byte-level entry's UTF-8 is at least the bytes
/// it stands for), so a text of B bytes is at least B / that many tokens.
fn longest_token(tokenizer: &tokenizers::Tokenizer) -> Option<usize> {
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::PreTokenizerWrapper as Pre;
    use tokenizers::ModelWrapper;
    use tokenizers::SplitDelimiterBehavior::Removed;

    if tokenizer.get_normalizer().is_some() || tokenizer.get_truncation().is_some() {
        return None;
    }
    /// Whether `pre` keeps every byte, and whether it maps them to byte-level characters.
    fn keeps(pre: &Pre) -> Option<bool> {
        match pre {
            Pre::ByteLevel(_) => Some(true),
            Pre::Split(split) if split.behavior != Removed => Some(false),
            Pre::Punctuation(punctuation) if punctuation.behavior != Removed => Some(false),
            Pre::Digits(_) | Pre::Metaspace(_) => Some(false),
            Pre::Sequence(sequence) => sequence
                .as_ref()
                .iter()
                .try_fold(false, |byte_level, pre| Some(byte_level | keeps(pre)?)),
            _ => None,
        }
    }
    let byte_level = match tokenizer.get_pre_tokenizer() {
        None => false,
        Some(pre) => keeps(pre)?,
    };
    let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
        return None;
    };
    let vocab = bpe.get_vocab();
    let every_byte = (byte_level
        && ByteLevel::alphabet()
            .iter()
            .all(|c| vocab.contains_key(&c.to_string())))
        || (bpe.byte_fallback && (0..=255u8).all(|b| vocab.contains_key(&format!("<0x{b:02X}>"))));
    let unknown_each = bpe.unk_token.is_some() && !bpe.fuse_unk;
    if !(every_byte || unknown_each) {
        return None;
    }
    let added = tokenizer.get_added_tokens_decoder();
    if added.values().any(|token| token.lstrip || token.rstrip) {
        return None;
    }
    let longest = vocab
        .keys()
        .map(String::len)
        .chain(added.values().map(|token| token.content.len()))
        .max()?;
    // An unknown token stands for one character, up to 4 bytes.
    Some(if unknown_each {
        longest.max(4)
    } else {
        longest
    })
}
