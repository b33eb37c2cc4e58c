//! The tokenizer side of text mode on the committed fixture tokenizers: encodings equal to
//! the Python `tokenizers` library's, round trips, streaming decode across split UTF-8
//! characters, chat templates, each engine's prompt convention and the stop set.

use crate::common;
use crate::support;

use std::path::Path;

use coli::text::{ChatMessage, ChatTemplate, Conversation, TextModel, TextTokenizer};
use proptest::prelude::*;
use serde::Deserialize;

use common::{copy_fixture, edit_json, read_json};
use support::{load_engine, text_fixture, tokenizer, tokenizer_dir, FIXTURES};

const TOKENIZERS: &[&str] = &["olmoe_128", "glm_moe_dsa_128", "inkling_250", "inkling_197"];

#[derive(Deserialize)]
struct Probe {
    text: String,
    ids: Vec<u32>,
}

fn probes(name: &str) -> Vec<Probe> {
    serde_json::from_value(read_json(&tokenizer_dir(name).join("encodings.json"))).unwrap()
}

/// The concatenated output of a stream over `ids`, and whether any chunk before the final
/// flush carried a replacement character.
fn stream(tokenizer: &TextTokenizer, ids: &[u32]) -> (String, bool) {
    let mut stream = tokenizer.stream();
    let mut text = String::new();
    let mut broken = false;
    for &id in ids {
        if let Some(chunk) = stream.step(id).unwrap() {
            broken |= chunk.ends_with(char::REPLACEMENT_CHARACTER);
            text.push_str(&chunk);
        }
    }
    text.push_str(&stream.finish().unwrap());
    (text, broken)
}

#[test]
fn encodings_equal_the_python_library_and_round_trip() {
    for name in TOKENIZERS {
        let tokenizer = tokenizer(&tokenizer_dir(name));
        for probe in probes(name) {
            let ids = tokenizer.encode(&probe.text, true).unwrap();
            assert_eq!(ids, probe.ids, "{name}: {:?}", probe.text);
            assert_eq!(tokenizer.decode_all(&ids).unwrap(), probe.text, "{name}");
        }
    }
}

#[test]
fn multi_byte_characters_split_across_tokens_stream_whole() {
    // é (2 bytes), 日 (3) and 🙂 (4): the 128-token GLM tokenizer holds their bytes only.
    let text = "Caf\u{e9} \u{1F642} \u{65E5}\u{65E5}!";
    for name in TOKENIZERS {
        let tokenizer = tokenizer(&tokenizer_dir(name));
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(tokenizer.decode(&ids).unwrap(), text, "{name}");
        let (streamed, broken) = stream(&tokenizer, &ids);
        assert_eq!(streamed, text, "{name}");
        assert!(!broken, "{name}: a chunk ended inside a character");
        if *name == "glm_moe_dsa_128" {
            let split = ids
                .iter()
                .filter(|&&id| {
                    tokenizer
                        .decode(&[id])
                        .unwrap()
                        .contains(char::REPLACEMENT_CHARACTER)
                })
                .count();
            assert!(
                split >= 7,
                "the emoji and 日 should arrive byte by byte: {ids:?}"
            );
        }
    }
}

#[test]
fn an_unfinished_character_is_flushed_as_the_full_decode_shows_it() {
    let tokenizer = tokenizer(&tokenizer_dir("glm_moe_dsa_128"));
    let ids = tokenizer.encode("ok \u{1F642}", false).unwrap();
    // Drop the emoji's last byte.
    let cut = &ids[..ids.len() - 1];
    let (streamed, _) = stream(&tokenizer, cut);
    assert_eq!(streamed, tokenizer.decode(cut).unwrap());
    assert!(streamed.starts_with("ok ") && streamed.ends_with(char::REPLACEMENT_CHARACTER));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn streaming_equals_the_full_decode(ids in prop::collection::vec(0u32..128, 0..40)) {
        for name in ["glm_moe_dsa_128", "inkling_250"] {
            let tokenizer = tokenizer(&tokenizer_dir(name));
            let (streamed, _) = stream(&tokenizer, &ids);
            prop_assert_eq!(streamed, tokenizer.decode(&ids).unwrap(), "{}", name);
        }
    }
}

#[test]
fn special_tokens_come_from_the_added_tokens() {
    let tokenizer = tokenizer(&tokenizer_dir("glm_moe_dsa_128"));
    // [gMASK] <sop> <|endoftext|> <|system|> <|assistant|> <|user|>; <think> is not special.
    assert_eq!(tokenizer.special_ids(), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(tokenizer.token_id("<think>"), Some(126));
    assert_eq!(
        tokenizer.config().eos_token.as_deref(),
        Some("<|endoftext|>")
    );
    // Special tokens are not printed.
    assert_eq!(tokenizer.decode(&[0, 1, 93]).unwrap(), "x");
}

#[test]
fn missing_and_corrupt_tokenizers_are_named() {
    let dir = copy_fixture("olmoe_tiny");
    std::fs::remove_file(dir.path().join("tokenizer.json")).ok();
    let err = TextTokenizer::load(dir.path()).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json not found"), "{err}");
    assert!(err.contains("oracle mode") && err.contains("IDS="), "{err}");
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = TextTokenizer::load(dir.path()).err().unwrap().to_string();
    assert!(err.contains("tokenizer.json: not a tokenizer"), "{err}");
    std::fs::copy(
        tokenizer_dir("olmoe_128").join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        "{\"eos_token\": 5}",
    )
    .unwrap();
    let err = format!("{:#}", TextTokenizer::load(dir.path()).err().unwrap());
    assert!(
        err.contains("tokenizer_config.json: eos_token must be"),
        "{err}"
    );
}

/// The prompt ids and rendered text for `prompt` on `fixture` with its tokenizer.
fn prompt(dir: &Path, text: &str, chat: bool) -> coli::text::Prompt {
    let tokenizer = tokenizer(dir);
    let (snapshot, engine) = load_engine(dir);
    TextModel::new(&tokenizer, &snapshot, engine.as_ref())
        .prompt(text, chat)
        .unwrap()
}

#[test]
fn each_engine_renders_its_built_in_chat_template() {
    let cases = [
        ("olmoe_tiny", "olmoe_128", "<|user|>\nHello\n<|assistant|>\n"),
        (
            "glm_moe_dsa_tiny",
            "glm_moe_dsa_128",
            "[gMASK]<sop><|user|>Hello<|assistant|><think></think>",
        ),
        (
            "inkling_tiny",
            "inkling_250",
            "<|message_system|><|content_text|>Thinking effort level: 0<|end_message|><|message_user|><|content_text|>Hello<|end_message|><|message_model|><|content_text|>",
        ),
    ];
    for (fixture, tokenizer_name, expected) in cases {
        let dir = text_fixture(fixture, tokenizer_name);
        let prompt = prompt(dir.path(), "Hello", true);
        assert_eq!(prompt.text, expected, "{fixture}");
        assert_eq!(
            prompt.template.as_deref(),
            Some(format!("{} built-in", load_engine(dir.path()).1.name()).as_str())
        );
        let tokenizer = tokenizer(dir.path());
        assert_eq!(
            prompt.ids,
            tokenizer.encode(expected, false).unwrap(),
            "{fixture}"
        );
    }
}

#[test]
fn glm_prompts_start_with_the_prefix_once() {
    let dir = text_fixture("glm_moe_dsa_tiny", "glm_moe_dsa_128");
    let tokenizer = tokenizer(dir.path());
    let gmask = tokenizer.token_id("[gMASK]").unwrap();
    let sop = tokenizer.token_id("<sop>").unwrap();
    let plain = prompt(dir.path(), "Hello there", false);
    let body = tokenizer.encode("Hello there", true).unwrap();
    assert_eq!(plain.ids, [vec![gmask, sop], body].concat());
    // The chat template writes the prefix itself: it is not repeated.
    let chat = prompt(dir.path(), "Hello there", true);
    assert_eq!(
        &chat.ids[..3],
        &[gmask, sop, tokenizer.token_id("<|user|>").unwrap()]
    );
    // Nor when the prompt text already starts with it.
    let written = prompt(dir.path(), "[gMASK]<sop>Hello there", false);
    assert_eq!(written.ids, plain.ids);
}

#[test]
fn olmoe_and_inkling_prompts_are_the_plain_encoding_unless_bos_is_asked_for() {
    for (fixture, tokenizer_name) in [("olmoe_tiny", "olmoe_128"), ("inkling_tiny", "inkling_250")]
    {
        let dir = text_fixture(fixture, tokenizer_name);
        let tokenizer = tokenizer(dir.path());
        let expected = tokenizer.encode("Hello there", true).unwrap();
        assert_eq!(
            prompt(dir.path(), "Hello there", false).ids,
            expected,
            "{fixture}"
        );
        // add_bos_token in tokenizer_config.json asks for the BOS token.
        edit_json(&dir.path().join("tokenizer_config.json"), |json| {
            json["add_bos_token"] = true.into();
            json["bos_token"] = "<|endoftext|>".into();
        });
        let bos = tokenizer.token_id("<|endoftext|>").unwrap();
        assert_eq!(
            prompt(dir.path(), "Hello there", false).ids,
            [vec![bos], expected].concat(),
            "{fixture}"
        );
    }
}

#[test]
fn the_model_directory_template_wins_and_python_methods_work() {
    let dir = text_fixture("olmoe_tiny", "olmoe_128");
    edit_json(&dir.path().join("tokenizer_config.json"), |json| {
        json["chat_template"] = "{% for m in messages %}[{{ m['role'].upper() }}] {{ m['content'].strip() }}{% endfor %}{% if add_generation_prompt %}{{ eos_token }}>{% endif %}".into();
    });
    let rendered = prompt(dir.path(), "  Hello  ", true);
    assert_eq!(rendered.text, "[USER] Hello<|endoftext|>>");
    assert!(rendered
        .template
        .unwrap()
        .ends_with("tokenizer_config.json chat_template"));
    // chat_template.jinja (transformers' own file) comes first.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "Q: {{ messages[0]['content'] }}\nA:",
    )
    .unwrap();
    let rendered = prompt(dir.path(), "Hi", true);
    assert_eq!(rendered.text, "Q: Hi\nA:");
}

#[test]
fn an_unknown_template_variable_is_an_error_naming_the_template() {
    let dir = text_fixture("olmoe_tiny", "olmoe_128");
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ messages[0]['content'] }} {{ system_prompt }}",
    )
    .unwrap();
    let tokenizer = tokenizer(dir.path());
    let template = ChatTemplate::find(dir.path(), &tokenizer, None, "olmoe").unwrap();
    let err = template
        .render(
            &Conversation::from(vec![ChatMessage::text("user", "Hi")]),
            None,
            None,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("undefined"),
        "{err}"
    );
    assert!(err.contains("coli renders chat templates with"), "{err}");
    // Checking an unknown variable for truth is fine, as templates do with `tools`.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% if tools %}T{% endif %}{{ messages[0]['content'] }}",
    )
    .unwrap();
    let template = ChatTemplate::find(dir.path(), &tokenizer, None, "olmoe").unwrap();
    assert_eq!(
        template
            .render(
                &Conversation::from(vec![ChatMessage::text("user", "Hi")]),
                None,
                None
            )
            .unwrap(),
        "Hi"
    );
}

/// A template that loops without end, builds text without end, prints without end or calls
/// itself without end is stopped with an error naming its file, on a thread with the
/// default 2 MiB stack (as the server's engine thread renders); a short conversation's
/// template still renders.
#[test]
fn a_template_without_end_is_stopped_naming_its_file() {
    let dir = text_fixture("olmoe_tiny", "olmoe_128");
    let file = dir.path().join("chat_template.jinja");
    let cases = [
        (
            "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
            "did more work than",
        ),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
            "did more work than",
        ),
        (
            "{% for i in range(20000) %}{{ 'x' * 1000 }}{% endfor %}",
            "rendered more than",
        ),
        (
            "{% macro deeper(n) %}{{ deeper(n + 1) }}{% endmacro %}{{ deeper(0) }}",
            "recursion",
        ),
        ("Q: {{ messages[0]['content'] }}\nA:", ""),
    ];
    for (template, why) in cases {
        std::fs::write(&file, template).unwrap();
        let path = dir.path().to_path_buf();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || {
                let tokenizer = tokenizer(&path);
                let template = ChatTemplate::find(&path, &tokenizer, None, "olmoe").unwrap();
                let rendered = template
                    .render(
                        &Conversation::from(vec![ChatMessage::text("user", "Hi")]),
                        None,
                        None,
                    )
                    .map(|text| text.len())
                    .map_err(|err| format!("{err:#}"));
                let _ = tx.send(rendered);
            })
            .unwrap();
        // A guard against a render that never returns, far beyond what any of these takes.
        let rendered = rx
            .recv_timeout(std::time::Duration::from_secs(300))
            .unwrap_or_else(|_| panic!("{template}: the render did not return"));
        match (rendered, why) {
            (Ok(_), "") => {}
            (Ok(len), _) => panic!("{template}: rendered {len} bytes, expected an error"),
            (Err(err), why) => assert!(
                !why.is_empty() && err.contains(&file.display().to_string()) && err.contains(why),
                "{template}: {err}"
            ),
        }
    }
}

#[test]
fn the_stop_set_joins_every_source() {
    let dir = text_fixture("inkling_tiny", "inkling_250");
    let end_message = tokenizer(dir.path()).token_id("<|end_message|>").unwrap();
    let stops = |dir: &Path| {
        let tokenizer = tokenizer(dir);
        let (snapshot, engine) = load_engine(dir);
        TextModel::new(&tokenizer, &snapshot, engine.as_ref())
            .stop_ids(engine.stop_tokens())
            .unwrap()
    };
    // Inkling stops on EOS ids only: the tokenizer's eos_token here.
    assert_eq!(stops(dir.path()), vec![end_message]);
    edit_json(&dir.path().join("config.json"), |config| {
        config["eos_token_id"] = 40.into()
    });
    std::fs::write(
        dir.path().join("generation_config.json"),
        "{\"eos_token_id\": [41, 40]}",
    )
    .unwrap();
    assert_eq!(stops(dir.path()), vec![end_message, 40, 41]);
    // OLMoE and GLM stop on every special token too.
    let dir = text_fixture("glm_moe_dsa_tiny", "glm_moe_dsa_128");
    assert_eq!(stops(dir.path()), vec![0, 1, 2, 3, 4, 5]);
    let dir = text_fixture("olmoe_tiny", "olmoe_128");
    assert_eq!(stops(dir.path()), vec![0, 1]);
}

#[test]
fn every_fixture_has_a_tokenizer_that_fits_its_model() {
    for (fixture, tokenizer_name) in FIXTURES {
        let dir = text_fixture(fixture, tokenizer_name);
        let (_, engine) = load_engine(dir.path());
        let tokenizer = tokenizer(dir.path());
        let probes = probes(tokenizer_name);
        for probe in probes {
            assert!(
                probe
                    .ids
                    .iter()
                    .all(|&id| (id as usize) < engine.vocab_size()),
                "{fixture}"
            );
            assert_eq!(tokenizer.encode(&probe.text, true).unwrap(), probe.ids);
        }
    }
}

/// The text whose every token is as long as the vocabulary allows: its longest entry, read
/// back as text, over and over.
fn longest_entries(dir: &Path, times: usize) -> String {
    let tokenizer = tokenizer(dir);
    let vocab = read_json(&dir.join("tokenizer.json"))["model"]["vocab"]
        .as_object()
        .unwrap()
        .len() as u32;
    let longest = (0..vocab)
        .map(|id| tokenizer.decode_all(&[id]).unwrap())
        .max_by_key(String::len)
        .unwrap();
    longest.repeat(times)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// The server refuses a prompt by its bytes alone where the tokenizer bounds its tokens
    /// by them; no text may encode to fewer tokens than that bound says.
    #[test]
    fn no_text_encodes_to_fewer_tokens_than_its_bytes_bound(
        pieces in prop::collection::vec(
            prop::sample::select(vec![
                "a", "word", " ", "   ", "\n", "\n\n", "\t", "é", "中", "🙂", "<|endoftext|>",
                "0123456789", "!!", "'s", "\u{7f}", "\u{0}",
            ]),
            0..200,
        )
    ) {
        let dir = common::fixture("olmoe_trained");
        let tokenizer = tokenizer(&dir);
        let longest = tokenizer.bytes_per_token().unwrap();
        let text: String = pieces.concat();
        let ids = tokenizer.encode(&text, false).unwrap();
        prop_assert!(ids.len() >= text.len().div_ceil(longest), "{} ids for {:?}", ids.len(), text);
    }
}

#[test]
fn a_bound_of_tokens_by_bytes_only_where_every_byte_is_a_token_s() {
    let trained = common::fixture("olmoe_trained");
    let longest = tokenizer(&trained).bytes_per_token();
    assert_eq!(
        longest,
        Some(66),
        "the vocabulary's longest entry, in UTF-8"
    );
    // Its longest entries back to back: as few tokens a byte as any text can have.
    let text = longest_entries(&trained, 100);
    let ids = tokenizer(&trained).encode(&text, false).unwrap();
    assert!(ids.len() >= text.len().div_ceil(66), "{}", ids.len());
    // Vocabularies without every byte drop what they cannot hold: no bound.
    for name in TOKENIZERS {
        assert_eq!(
            tokenizer(&tokenizer_dir(name)).bytes_per_token(),
            None,
            "{name}"
        );
    }
}

#[test]
fn a_prompt_is_encoded_once_with_what_it_reads_back_as() {
    for dir in [common::fixture("olmoe_trained"), tokenizer_dir("olmoe_128")] {
        let tokenizer = tokenizer(&dir);
        for text in ["The history of the river", "中文 and é", ""] {
            for special in [false, true] {
                let (ids, misread) = tokenizer.encode_checked(text, special).unwrap();
                assert_eq!(ids, tokenizer.encode(text, special).unwrap(), "{text:?}");
                let back = tokenizer
                    .decode_all(&tokenizer.encode(text, false).unwrap())
                    .unwrap();
                assert_eq!(misread, (back != text).then_some(back), "{text:?}");
            }
        }
    }
    let tiny = tokenizer(&tokenizer_dir("olmoe_128"));
    assert!(tiny.encode_checked("中", false).unwrap().1.is_some());
}
