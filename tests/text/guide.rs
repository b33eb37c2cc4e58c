//! Constrained decoding (`coli::guide`) on the committed fixture tokenizers: greedy choices
//! from random logits under the mask always give text the grammar accepts, and end; bad
//! schemas, grammars and tokens are errors that say what is wrong.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use coli::guide::{Grammar, Guide, GuideError, Guides};
use coli::sampling::argmax;
use coli::text::TextTokenizer;
use serde::de::IgnoredAny;
use serde_json::json;

/// The logits row is wider than the tokenizer (128 ids), as a padded embedding makes it:
/// the ids past the tokenizer draw random logits too, and must never be chosen.
const OLMOE_VOCAB: usize = 160;
const OLMOE_EOS: u32 = 0;
const KIMI_VOCAB: usize = 192;
const KIMI_EOS: u32 = 1;

fn olmoe() -> (TextTokenizer, Guides) {
    let tokenizer = TextTokenizer::load(Path::new("fixtures/olmoe_tiny")).unwrap();
    assert_eq!(tokenizer.token_id("<|endoftext|>"), Some(OLMOE_EOS));
    let guides = Guides::new(&tokenizer, OLMOE_VOCAB, &[OLMOE_EOS]).unwrap();
    (tokenizer, guides)
}

fn kimi() -> (TextTokenizer, Guides) {
    let tokenizer = TextTokenizer::load(Path::new("fixtures/kimi_k3_tiny")).unwrap();
    assert_eq!(tokenizer.token_id("<|end_of_msg|>"), Some(KIMI_EOS));
    let guides = Guides::new(&tokenizer, KIMI_VOCAB, &[KIMI_EOS]).unwrap();
    (tokenizer, guides)
}

/// How a guided generation ended.
struct Generated {
    text: String,
    /// Ended by the grammar (finished, or the stop id chosen where it was complete).
    ended: bool,
}

/// Greedy choices under the mask from logits drawn from `seed`, at most `limit` tokens.
/// Every choice is checked against the mask; after the grammar finishes, the mask must
/// allow the stop id alone.
fn generate(
    tokenizer: &TextTokenizer,
    guide: &mut Guide,
    vocab: usize,
    eos: u32,
    seed: u64,
    limit: usize,
) -> Generated {
    let mut ids = Vec::new();
    let mut ended = false;
    for step in 0..limit {
        let mask = guide.mask().unwrap();
        let mut logits = common::random(vocab, seed * 100_003 + step as u64);
        mask.apply(&mut logits);
        let token = argmax(&logits);
        assert!(
            logits[token as usize].is_finite(),
            "seed {seed} step {step}: the mask allows nothing"
        );
        assert!(mask.allows(token));
        guide.accept(token).unwrap();
        if token == eos {
            ended = true;
            break;
        }
        ids.push(token);
        if guide.is_finished() {
            let mask = guide.mask().unwrap();
            let allowed: Vec<u32> = (0..vocab as u32).filter(|&id| mask.allows(id)).collect();
            assert_eq!(
                allowed,
                [eos],
                "seed {seed}: a finished grammar allows only EOS"
            );
            ended = true;
            break;
        }
    }
    assert!(guide.is_finished() || !ended);
    Generated {
        text: tokenizer.decode(&ids).unwrap(),
        ended,
    }
}

#[test]
fn a_schema_is_always_satisfied_and_ends() {
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": false
    });
    for (name, (tokenizer, guides), vocab, eos) in [
        ("olmoe", olmoe(), OLMOE_VOCAB, OLMOE_EOS),
        ("kimi", kimi(), KIMI_VOCAB, KIMI_EOS),
    ] {
        for seed in 1..=12 {
            let mut guide = guides.start(&Grammar::JsonSchema(schema.clone())).unwrap();
            let out = generate(&tokenizer, &mut guide, vocab, eos, seed, 200);
            assert!(
                out.ended,
                "{name} seed {seed}: no end in 200 tokens: {:?}",
                out.text
            );
            let fields: BTreeMap<String, IgnoredAny> = serde_json::from_str(&out.text)
                .unwrap_or_else(|err| panic!("{name} seed {seed}: {:?}: {err}", out.text));
            assert_eq!(
                fields.keys().collect::<Vec<_>>(),
                ["a"],
                "{name} seed {seed}: {}",
                out.text
            );
            // The only value is the number between the colon and the closing brace; JSON
            // Schema's integers have no bound, so it is checked as text.
            let number = out.text[out.text.rfind(':').unwrap() + 1..out.text.rfind('}').unwrap()]
                .trim()
                .trim_start_matches('-');
            assert!(
                number == "0"
                    || (!number.starts_with('0') && number.bytes().all(|b| b.is_ascii_digit())),
                "{name} seed {seed}: not an integer: {}",
                out.text
            );
        }
    }
}

#[test]
fn json_object_is_always_an_object_and_ends() {
    let (tokenizer, guides) = kimi();
    // Random logits wander: these seeds take from 2 to about 1800 tokens (long strings end
    // only when the quote wins among ~190 ids).
    for seed in 1..=8 {
        let mut guide = guides.start(&Grammar::JsonObject).unwrap();
        let out = generate(&tokenizer, &mut guide, KIMI_VOCAB, KIMI_EOS, seed, 3000);
        assert!(
            out.ended,
            "seed {seed}: no end in 3000 tokens: {:?}",
            out.text
        );
        // Syntax only: numbers such as 6862e+7698 are JSON but beyond an f64.
        let _: BTreeMap<String, IgnoredAny> = serde_json::from_str(&out.text)
            .unwrap_or_else(|err| panic!("seed {seed}: {:?}: {err}", out.text));
    }
}

#[test]
fn a_lark_grammar_gives_one_of_its_words() {
    let grammar = Grammar::Lark(r#"start: "yes" | "no""#.to_string());
    let (tokenizer, guides) = olmoe();
    let mut seen = Vec::new();
    for seed in 1..=16 {
        let mut guide = guides.start(&grammar).unwrap();
        let out = generate(&tokenizer, &mut guide, OLMOE_VOCAB, OLMOE_EOS, seed, 10);
        assert!(
            out.ended && guide.is_finished(),
            "seed {seed}: {:?}",
            out.text
        );
        assert!(
            out.text == "yes" || out.text == "no",
            "seed {seed}: {:?}",
            out.text
        );
        seen.push(out.text);
    }
    assert!(seen.iter().any(|t| t == "yes") && seen.iter().any(|t| t == "no"));
}

#[test]
fn bad_schemas_and_grammars_say_what_is_wrong() {
    let (_, guides) = olmoe();
    let cases = [
        (
            Grammar::JsonSchema(json!({"type": "strnig"})),
            "invalid JSON schema",
            "strnig",
        ),
        (
            Grammar::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
            "invalid JSON schema",
            "minimum (5) is greater than maximum (1)",
        ),
        (
            Grammar::Lark("start: greeting".to_string()),
            "invalid Lark grammar",
            "greeting",
        ),
        (
            Grammar::Lark(r#"start: ("yes" | "no""#.to_string()),
            "invalid Lark grammar",
            "Expected token ')'",
        ),
    ];
    for (grammar, kind, detail) in cases {
        let err = match guides.start(&grammar) {
            Ok(_) => panic!("{grammar:?} was accepted"),
            Err(err) => err,
        };
        assert!(matches!(err, GuideError::Invalid { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.starts_with(kind), "{text}");
        assert!(text.contains(detail), "{text} does not name {detail:?}");
        assert!(!text.contains("panic"), "{text}");
    }
}

#[test]
fn a_token_outside_the_mask_is_refused_and_changes_nothing() {
    let (tokenizer, guides) = olmoe();
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let mut guide = guides.start(&Grammar::JsonSchema(schema)).unwrap();
    let letter = tokenizer.token_id("a").unwrap();
    let brace = tokenizer.token_id("{").unwrap();
    let mask = guide.mask().unwrap();
    assert!(!mask.allows(letter) && mask.allows(brace));
    assert_eq!(
        guide.accept(letter),
        Err(GuideError::Rejected { token: letter })
    );
    assert_eq!(
        guide.accept(OLMOE_VOCAB as u32),
        Err(GuideError::OutOfVocabulary {
            token: OLMOE_VOCAB as u32,
            vocab_size: OLMOE_VOCAB
        })
    );
    // A padded id (known to the model, not to the tokenizer) is never allowed.
    assert_eq!(guide.accept(150), Err(GuideError::Rejected { token: 150 }));
    assert_eq!(guide.mask().unwrap(), mask);
    guide.accept(brace).unwrap();
    assert!(!guide.mask().unwrap().allows(brace));

    let mut done = guides
        .start(&Grammar::Lark(r#"start: "no""#.to_string()))
        .unwrap();
    for id in tokenizer.encode("no", false).unwrap() {
        done.accept(id).unwrap();
    }
    assert!(done.is_finished());
    assert!(matches!(done.accept(brace), Err(GuideError::Stopped(_))));
}

#[test]
fn a_mask_is_computed_beside_other_work_and_a_fork_goes_its_own_way() {
    let (tokenizer, guides) = kimi();
    let mut guide = guides.start(&Grammar::JsonObject).unwrap();
    for id in tokenizer.encode("{\"key\": \"", false).unwrap() {
        guide.accept(id).unwrap();
    }
    let mut fork = guide.fork();
    // The mask on a thread of its own while this one does the "forward".
    let (mask, forward) = std::thread::scope(|scope| {
        let mask = scope.spawn(|| guide.mask().unwrap());
        let forward: f32 = common::random(KIMI_VOCAB, 7).iter().sum();
        (mask.join().unwrap(), forward)
    });
    assert!(forward.is_finite());
    assert_eq!(fork.mask().unwrap(), mask);
    // Inside a string: letters may come, a raw newline may not.
    let letter = tokenizer.token_id("x").unwrap();
    let newline = tokenizer.token_id("Ċ").unwrap();
    assert!(mask.allows(letter) && !mask.allows(newline));

    // The original closes its string; the fork stays inside its own.
    for id in tokenizer.encode("v\"", false).unwrap() {
        guide.accept(id).unwrap();
    }
    fork.accept(letter).unwrap();
    assert!(!guide.mask().unwrap().allows(letter));
    assert!(fork.mask().unwrap().allows(letter));
    let brace = tokenizer.token_id("}").unwrap();
    guide.accept(brace).unwrap();
    assert!(guide.is_finished() && !fork.is_finished());
}

#[test]
fn apply_blocks_every_disallowed_logit() {
    let (tokenizer, guides) = olmoe();
    let mut guide = guides
        .start(&Grammar::Lark(r#"start: "{" | "[""#.to_string()))
        .unwrap();
    let mask = guide.mask().unwrap();
    // A row longer than the mask loses its tail too.
    let mut logits = vec![1.0f32; OLMOE_VOCAB + 40];
    mask.apply(&mut logits);
    let kept: Vec<usize> = (0..logits.len())
        .filter(|&id| logits[id].is_finite())
        .collect();
    let expected: Vec<usize> = ["{", "["]
        .iter()
        .map(|t| tokenizer.token_id(t).unwrap() as usize)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(kept, expected);
    assert!(logits.iter().all(|&l| l == 1.0 || l == f32::NEG_INFINITY));
}

#[test]
fn a_vocabulary_that_does_not_fit_is_refused_by_name() {
    let tokenizer = TextTokenizer::load(Path::new("fixtures/olmoe_tiny")).unwrap();
    for (vocab, eos, expected) in [
        (
            100,
            &[OLMOE_EOS][..],
            "the tokenizer has 128 ids, more than the model's vocabulary of 100",
        ),
        (
            OLMOE_VOCAB,
            &[OLMOE_VOCAB as u32][..],
            "end-of-sequence id 160 is outside",
        ),
        (OLMOE_VOCAB, &[][..], "no end-of-sequence id"),
    ] {
        let err = match Guides::new(&tokenizer, vocab, eos) {
            Ok(_) => panic!("vocabulary {vocab}, EOS {eos:?} accepted"),
            Err(err) => format!("{err:#}"),
        };
        assert!(err.contains("fixtures/olmoe_tiny/tokenizer.json"), "{err}");
        assert!(err.contains(expected), "{err}");
    }
}
