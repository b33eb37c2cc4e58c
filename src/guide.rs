//! Constrained decoding: the tokens a JSON schema, "any JSON object" or a Lark grammar allows
//! at the next position, through the `llguidance` crate.
//!
//! [`Guides`] is built once per model from its tokenizer: the byte string of every token id
//! (llguidance's trie) and the ids that end a generation. [`Guides::start`] compiles one
//! [`Grammar`] into a [`Guide`], which follows one sequence: [`Guide::mask`] says which ids
//! may come next, [`Guide::accept`] advances by the id chosen, [`Guide::is_finished`] says
//! when the grammar is complete.
//!
//! A mask depends only on the ids accepted so far, not on the logits, so it can be computed
//! while the forward that produces those logits runs: a `Guide` is `Send`, and
//! `std::thread::scope(|s| { let mask = s.spawn(|| guide.mask()); /* forward */ })` is the
//! intended use. [`Guides`] is `Send + Sync` and cheap to clone (one `Arc`).

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::{ParserLimits, StopReason, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use thiserror::Error;

use crate::text::tool_calls::bounded_whitespace;
use crate::text::TextTokenizer;

/// What a sequence's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value the JSON schema accepts (OpenAI's `json_schema`); whitespace between tokens of
    /// the JSON is the model's choice, up to 24 characters in a gap.
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect (`docs/syntax.md` of llguidance).
    Lark(String),
}

impl Grammar {
    fn top_level(&self) -> TopLevelGrammar {
        match self {
            // vLLM's reading of json_object, so that both servers accept the same outputs.
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(bounded_whitespace(
                serde_json::json!({"type": "object"}),
            )),
            Grammar::JsonSchema(schema) => {
                TopLevelGrammar::from_json_schema(bounded_whitespace(schema.clone()))
            }
            Grammar::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Grammar::JsonObject | Grammar::JsonSchema(_) => "JSON schema",
            Grammar::Lark(_) => "Lark grammar",
        }
    }
}

/// Why a grammar could not be started or followed. `Invalid` is the caller's input (an
/// HTTP 400); the others are misuse or a limit reached while decoding.
#[derive(Debug, Error, PartialEq)]
pub enum GuideError {
    /// The schema or grammar does not compile; the text says what is wrong.
    #[error("invalid {kind}: {reason}")]
    Invalid { kind: &'static str, reason: String },
    /// `accept` was given an id the last mask did not allow.
    #[error("token {token} is not allowed by the grammar at this position")]
    Rejected { token: u32 },
    /// `accept` was given an id beyond the model's vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab_size} ids")]
    OutOfVocabulary { token: u32, vocab_size: usize },
    /// The grammar is complete (or failed earlier); nothing more may be accepted.
    #[error("the grammar is finished ({0}); no further token may be accepted")]
    Stopped(String),
    /// The matcher failed while computing a mask or consuming a token (a grammar too
    /// complex for llguidance's limits, say); the guide cannot continue.
    #[error("constrained decoding failed: {0}")]
    Failed(String),
}

/// The grammar compiler of one model: its token trie, stop ids and vocabulary width.
#[derive(Clone)]
pub struct Guides {
    factory: Arc<ParserFactory>,
    vocab_size: usize,
    eos_ids: Arc<[u32]>,
}

impl Guides {
    /// The token trie of `tokenizer` widened to `vocab_size` ids (the width of the model's
    /// logits, which may exceed the tokenizer's vocabulary: ids it does not know are never
    /// allowed), with `eos_ids` as the ids that end a generation (allowed where the grammar
    /// is complete).
    pub fn new(tokenizer: &TextTokenizer, vocab_size: usize, eos_ids: &[u32]) -> Result<Guides> {
        let path = tokenizer.path();
        let text = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let json: Value = serde_json::from_slice(&text)
            .with_context(|| format!("{}: not valid JSON", path.display()))?;
        // llguidance asserts on vocabularies it does not expect (a byte-fallback token named
        // like `<0x..>` but longer, a token over 1024 bytes): a message, not a crash.
        let trie = llguidance::panic_utils::catch_unwind(|| build_trie(&json, vocab_size, eos_ids))
            .with_context(|| {
                format!(
                    "{}: cannot build the token trie for constrained decoding",
                    path.display()
                )
            })?;
        let env: TokEnv = Arc::new(Env {
            tokenizer: tokenizer.clone(),
            trie,
        });
        let mut factory = ParserFactory::new_simple(&env)
            .with_context(|| format!("{}: constrained decoding setup", path.display()))?;
        // Warnings go to the caller through errors, never straight to stderr; and an error
        // becomes an HTTP 400, which should say what is wrong with the grammar, not echo it
        // with the parser's state.
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Guides {
            factory: Arc::new(factory),
            vocab_size,
            eos_ids: eos_ids.into(),
        })
    }

    /// The width of every mask: the model's logits row.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// A guide at the start of `grammar`, or why the grammar does not compile.
    pub fn start(&self, grammar: &Grammar) -> Result<Guide, GuideError> {
        let invalid = |reason: String| GuideError::Invalid {
            kind: grammar.kind(),
            reason,
        };
        let parser = self
            .factory
            .create_parser(grammar.top_level())
            .map_err(|err| invalid(err.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(err) = matcher.get_error() {
            return Err(invalid(err));
        }
        Ok(Guide {
            matcher,
            vocab_size: self.vocab_size,
            eos_ids: self.eos_ids.clone(),
        })
    }
}

/// The bytes of every id, padded with empty ones to `vocab_size`, in a trie that knows the
/// stop ids.
fn build_trie(json: &Value, vocab_size: usize, eos_ids: &[u32]) -> Result<TokTrie> {
    let mut words = llguidance::token_bytes_from_tokenizer_json(json)?;
    if words.len() > vocab_size {
        bail!(
            "the tokenizer has {} ids, more than the model's vocabulary of {vocab_size}",
            words.len()
        );
    }
    words.resize(vocab_size, Vec::new());
    let Some(&first_eos) = eos_ids.first() else {
        bail!("no end-of-sequence id: a grammar could never end");
    };
    if let Some(&eos) = eos_ids.iter().find(|&&id| id as usize >= vocab_size) {
        bail!("end-of-sequence id {eos} is outside the vocabulary of {vocab_size} ids");
    }
    let vocab = u32::try_from(vocab_size)
        .map_err(|_| anyhow!("a vocabulary of {vocab_size} ids does not fit 32-bit ids"))?;
    let trie = TokTrie::from(&TokRxInfo::new(vocab, first_eos), &words);
    Ok(trie.with_eos_tokens(eos_ids))
}

/// llguidance's view of the tokenizer: the trie, and our tokenizer for the canonical ids of
/// bytes the grammar forces.
struct Env {
    tokenizer: TextTokenizer,
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        // Bytes that are not UTF-8 (part of a character) go token by token through the trie,
        // as llguidance's own Hugging Face binding does.
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            self.tokenizer
                .encode(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(text.as_bytes()))
        })
    }
}

/// One sequence's position in its grammar.
pub struct Guide {
    matcher: Matcher,
    vocab_size: usize,
    eos_ids: Arc<[u32]>,
}

impl Guide {
    /// The ids allowed at the next position: where the grammar is complete, the stop ids;
    /// once it is finished, only those. May take a millisecond or more on a large
    /// vocabulary: run it beside the forward (see the module's documentation).
    pub fn mask(&mut self) -> Result<Mask, GuideError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|err| GuideError::Failed(err.to_string()))?;
        Ok(Mask(allowed))
    }

    /// Advance by `token`, which the last mask must have allowed (a stop id, once the
    /// grammar is finished). A refused token leaves the guide where it was.
    pub fn accept(&mut self, token: u32) -> Result<(), GuideError> {
        if token as usize >= self.vocab_size {
            return Err(GuideError::OutOfVocabulary {
                token,
                vocab_size: self.vocab_size,
            });
        }
        if self.matcher.is_stopped() {
            // A finished grammar's masks allow the stop ids, which end the generation.
            if self.is_finished() && self.eos_ids.contains(&token) {
                return Ok(());
            }
            return Err(GuideError::Stopped(self.matcher.stop_reason().to_string()));
        }
        // Checked before it is consumed: a matcher that consumes a bad token is dead.
        match self.matcher.try_consume_tokens(&[token]) {
            Ok(1) => Ok(()),
            Ok(_) => Err(GuideError::Rejected { token }),
            Err(err) => Err(GuideError::Failed(err.to_string())),
        }
    }

    /// The grammar is complete and nothing may follow (its last byte was generated, or a
    /// stop id was accepted where it was complete): the next mask allows the stop ids only.
    pub fn is_finished(&self) -> bool {
        matches!(
            self.matcher.stop_reason(),
            StopReason::NoExtension | StopReason::NoExtensionBias | StopReason::EndOfSentence
        )
    }

    /// An independent copy at the same position, for another choice of the same request
    /// (`n > 1`). The copy owns its lexer caches too, so the two can compute masks on
    /// different threads at once; a plain clone of llguidance's matcher would share them
    /// behind one lock.
    pub fn fork(&self) -> Guide {
        Guide {
            matcher: self.matcher.deep_clone(),
            vocab_size: self.vocab_size,
            eos_ids: self.eos_ids.clone(),
        }
    }
}

/// The ids allowed at one position.
#[derive(Debug, Clone, PartialEq)]
pub struct Mask(SimpleVob);

impl Mask {
    pub fn allows(&self, token: u32) -> bool {
        (token as usize) < self.0.len() && self.0.is_allowed(token)
    }

    /// Every logit of an id the mask does not allow set to minus infinity (a row longer
    /// than the mask loses the excess too).
    pub fn apply(&self, logits: &mut [f32]) {
        let words = self.0.as_slice();
        for (chunk, &word) in logits.chunks_mut(32).zip(words) {
            if word == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        let covered = (words.len() * 32).min(logits.len());
        logits[covered..].fill(f32::NEG_INFINITY);
    }
}
