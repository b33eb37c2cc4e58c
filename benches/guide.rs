//! What a constrained-decoding mask (`coli::guide`) costs per token: JSON schemas and
//! `json_object` on the fixture tokenizers (128 to 4096 ids) and on a synthetic byte-level BPE
//! vocabulary of about 150k tokens (the size of GLM's and Kimi's), which the benchmark
//! writes itself: pseudo-words, numbers, punctuation and whitespace runs, UTF-8 letters and
//! CJK, every prefix of a token a token too, so that each has a merge.
//!
//! Each case runs greedy generations from random logits (seeded) under the mask, up to
//! `STEPS` tokens or the grammar's end, and times every `Guide::mask` call alone; it prints
//! the one-time costs (`Guides::new`, `Guides::start`) and mean, p50, p99 and max per mask.
//! Random logits stay inside JSON strings for long stretches, where almost every id is
//! allowed: a pessimistic mix next to a model's output.
//!
//! `cargo bench --bench guide`

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use coli::guide::{Grammar, Guides};
use coli::sampling::argmax;
use coli::text::TextTokenizer;
use serde_json::json;

/// Tokens per generation at most.
const STEPS: usize = 256;
/// Generations per case.
const SEEDS: u64 = 12;
/// The synthetic vocabulary's size, specials included.
const LARGE_VOCAB: usize = 150_000;

fn main() {
    let tool = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["read", "write", "search"]},
            "path": {"type": "string", "maxLength": 80},
            "lines": {"type": "array", "items": {"type": "integer", "minimum": 0}, "maxItems": 8},
            "recursive": {"type": "boolean"}
        },
        "required": ["name", "path", "lines", "recursive"],
        "additionalProperties": false
    });
    let grammars = [
        (
            "schema {a: integer}",
            Grammar::JsonSchema(json!({
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "required": ["a"],
                "additionalProperties": false
            })),
        ),
        ("schema tool call", Grammar::JsonSchema(tool)),
        ("json_object", Grammar::JsonObject),
    ];
    let synthetic = tempfile::tempdir().expect("temporary directory");
    let started = Instant::now();
    write_large_tokenizer(synthetic.path());
    println!(
        "synthetic tokenizer written in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let tokenizers = [
        (
            "olmoe_tiny",
            Path::new("fixtures/olmoe_tiny"),
            "<|endoftext|>",
        ),
        (
            "kimi_k3_tiny",
            Path::new("fixtures/kimi_k3_tiny"),
            "<|end_of_msg|>",
        ),
        (
            "olmoe_trained",
            Path::new("fixtures/olmoe_trained"),
            "<|endoftext|>",
        ),
        ("synthetic", synthetic.path(), "<|endoftext|>"),
    ];
    println!(
        "{:<14} {:>7} {:<20} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "tokenizer",
        "vocab",
        "grammar",
        "new ms",
        "start ms",
        "masks",
        "mean µs",
        "p50 µs",
        "p99 µs",
        "max µs"
    );
    for (name, dir, eos_token) in tokenizers {
        let tokenizer = TextTokenizer::load(dir).expect("tokenizer");
        let eos = tokenizer.token_id(eos_token).expect("EOS token");
        let vocab = vocab_of(dir);
        let started = Instant::now();
        let guides = Guides::new(&tokenizer, vocab, &[eos]).expect("guides");
        let new_ms = started.elapsed().as_secs_f64() * 1e3;
        for (label, grammar) in &grammars {
            let started = Instant::now();
            let mut guide = guides.start(grammar).expect("grammar");
            let start_ms = started.elapsed().as_secs_f64() * 1e3;
            let mut times = Vec::new();
            for seed in 0..SEEDS {
                if seed > 0 {
                    guide = guides.start(grammar).expect("grammar");
                }
                for step in 0..STEPS {
                    let started = Instant::now();
                    let mask = guide.mask().expect("mask");
                    times.push(started.elapsed());
                    let mut logits = random(vocab, seed * 100_003 + step as u64);
                    mask.apply(&mut logits);
                    let token = argmax(&logits);
                    guide.accept(token).expect("a token the mask allowed");
                    if token == eos || guide.is_finished() {
                        break;
                    }
                }
            }
            let (mean, p50, p99, max) = summary(&mut times);
            println!(
                "{name:<14} {vocab:>7} {label:<20} {new_ms:>9.1} {start_ms:>9.2} {:>6} {mean:>9.1} {p50:>9.1} {p99:>9.1} {max:>9.1}",
                times.len()
            );
        }
    }
}

/// The logits width: `vocab_size` of the fixture's `config.json` (its `text_config`'s for
/// Kimi K3); the synthetic tokenizer has no model, so its own size.
fn vocab_of(dir: &Path) -> usize {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else {
        return LARGE_VOCAB;
    };
    let config: serde_json::Value = serde_json::from_str(&text).expect("config.json");
    let size = config
        .get("vocab_size")
        .or_else(|| config["text_config"].get("vocab_size"))
        .and_then(|v| v.as_u64())
        .expect("vocab_size in config.json");
    size as usize
}

/// Mean, p50, p99 and max in microseconds.
fn summary(times: &mut [Duration]) -> (f64, f64, f64, f64) {
    times.sort_unstable();
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let at = |q: f64| micros(times[((times.len() - 1) as f64 * q).round() as usize]);
    let mean = times.iter().map(|&d| micros(d)).sum::<f64>() / times.len() as f64;
    (mean, at(0.5), at(0.99), micros(times[times.len() - 1]))
}

/// `len` values in [-1, 1) from a fixed xorshift sequence.
fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// GPT-2's byte-to-character table of byte-level BPE: printable bytes stand for
/// themselves, the others for U+0100 onwards.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    let mut next = 0x100;
    (0..=255u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

/// `dir/tokenizer.json`: a byte-level BPE of `LARGE_VOCAB` ids, `<|endoftext|>` last.
fn write_large_tokenizer(dir: &Path) {
    const SYLLABLES: &[&str] = &[
        "a", "al", "an", "ar", "as", "at", "ba", "be", "bi", "bo", "ca", "ce", "ch", "co", "con",
        "da", "de", "di", "do", "e", "ed", "el", "en", "er", "es", "ex", "fa", "fi", "fo", "ga",
        "ge", "go", "ha", "he", "hi", "ho", "i", "ic", "id", "il", "in", "io", "is", "it", "ja",
        "ka", "ke", "la", "le", "li", "lo", "ly", "ma", "me", "mi", "mo", "na", "ne", "ni", "no",
        "o", "ol", "on", "or", "ou", "pa", "pe", "per", "pi", "po", "pro", "qu", "ra", "re", "ri",
        "ro", "sa", "se", "si", "so", "st", "ta", "te", "th", "ti", "tion", "to", "tr", "u", "um",
        "un", "ur", "us", "va", "ve", "vi", "wa", "we", "wh", "ya", "za", "ze",
    ];
    const PUNCT: &[&str] = &[
        "\"", ",", ":", "{", "}", "[", "]", "(", ")", ";", ".", "_", "-", "/", "\\", "=", "'", "<",
        ">", "*", "#", "!", "?", "`", "&", "|", "+", "%", "@", "$", "^", "~",
    ];
    const UNICODE: &[&str] = &[
        "é", "ü", "ß", "ñ", "ç", "ø", "å", "ж", "я", "λ", "—", "“", "”",
    ];
    let chars = byte_chars();
    let spell = |bytes: &[u8]| -> String { bytes.iter().map(|&b| chars[b as usize]).collect() };
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |n: usize| -> usize {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    let mut seen: HashSet<Vec<u8>> = words.iter().cloned().collect();
    while seen.len() < LARGE_VOCAB - 1 {
        let mut word = Vec::new();
        match next(10) {
            0..=5 => {
                if next(2) == 0 {
                    word.push(b' ');
                }
                for i in 0..1 + next(4) {
                    let syllable = SYLLABLES[next(SYLLABLES.len())];
                    if i == 0 && next(6) == 0 {
                        word.extend(syllable.to_uppercase().bytes().take(1));
                        word.extend(syllable.bytes().skip(1));
                    } else {
                        word.extend(syllable.bytes());
                    }
                }
            }
            6 => word.extend(format!("{}", next(10_000)).bytes()),
            7 => {
                for _ in 0..1 + next(3) {
                    word.extend(PUNCT[next(PUNCT.len())].bytes());
                }
            }
            8 => {
                let run = [" ", "\n", "\t", "  "][next(4)];
                for _ in 0..1 + next(16) {
                    word.extend(run.bytes());
                }
            }
            _ => {
                if next(2) == 0 {
                    for _ in 0..1 + next(3) {
                        word.extend(UNICODE[next(UNICODE.len())].bytes());
                    }
                } else {
                    // A CJK ideograph, three UTF-8 bytes.
                    let c = char::from_u32(0x4E00 + next(0x5000) as u32).unwrap();
                    word.extend(c.to_string().bytes());
                }
            }
        }
        // Every prefix too, so that each token is the merge of a shorter one and a byte.
        for end in 2..=word.len() {
            if seen.len() >= LARGE_VOCAB - 1 {
                break;
            }
            if seen.insert(word[..end].to_vec()) {
                words.push(word[..end].to_vec());
            }
        }
    }
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(id, word)| (spell(word), json!(id)))
        .collect();
    let merges: Vec<[String; 2]> = words[256..]
        .iter()
        .map(|word| {
            let (head, last) = word.split_at(word.len() - 1);
            [spell(head), spell(last)]
        })
        .collect();
    let eos = words.len();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [{
            "id": eos, "content": "<|endoftext|>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true
        }],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges
        }
    });
    std::fs::write(
        dir.join("tokenizer.json"),
        serde_json::to_vec(&tokenizer).expect("tokenizer JSON"),
    )
    .expect("writing the synthetic tokenizer");
}
