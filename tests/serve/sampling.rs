//! What a request asks of the sampler and what it may send: log-probabilities that are the
//! model's (the `PPL=1` scores of the same ids), each sampling key changing what it should
//! and reproducible with a seed, and every field this server does not implement refused by
//! name.

use serde_json::{json, Value};

use crate::common::{coli, copy_fixture, edit_json, fixture, stderr, stdout};
use crate::server::{heldout_ids, usage, Server};

fn start() -> Server {
    Server::start(
        &fixture("olmoe_trained"),
        &["--cache-mb", "0", "USAGE_SAVE=0"],
        &[],
    )
}

/// The `mean NLL` and the token count of `PPL=1` over `ids`, in one window.
fn ppl_sum(ids: &[u32]) -> f64 {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    let output = coli(
        &[
            &format!("SNAP={}", fixture("olmoe_trained").display()),
            &format!("IDS={}", ids.join(" ")),
            "PPL=1",
            "CTX=128",
            "USAGE_SAVE=0",
        ],
        &[],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let out = stdout(&output);
    let line = out.lines().find(|l| l.starts_with("PPL:")).unwrap();
    let field = |after: &str, before: &str| -> f64 {
        let rest = &line[line.find(after).unwrap() + after.len()..];
        rest[..rest.find(before).unwrap()].trim().parse().unwrap()
    };
    field("mean NLL", "nats") * field("over", "tokens")
}

#[test]
fn logprobs_are_the_scores_ppl_gives_the_same_ids() {
    let server = start();
    let prompt = heldout_ids(15);
    let body = json!({
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3,
    });
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let logprobs = &reply["choices"][0]["logprobs"];
    let chosen: Vec<f64> = serde_json::from_value(logprobs["token_logprobs"].clone()).unwrap();
    assert_eq!(chosen.len() as u64, usage(&reply, "completion_tokens"));
    for (lp, top) in chosen
        .iter()
        .zip(logprobs["top_logprobs"].as_array().unwrap())
    {
        let top: Vec<f64> = top
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(top.len(), 3, "{logprobs}");
        // Greedy: the chosen token is the most likely one.
        let best = top.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(*lp, best, "{logprobs}");
    }
    let tokens: Vec<String> = serde_json::from_value(logprobs["tokens"].clone()).unwrap();
    assert_eq!(
        tokens.concat(),
        reply["choices"][0]["text"].as_str().unwrap(),
        "the tokens spell the text"
    );

    // The same greedy answer as ids, from a run with IDS=; PPL=1 over the prompt with and
    // without it scores exactly those positions.
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let output = coli(
        &[
            &format!("SNAP={}", fixture("olmoe_trained").display()),
            &format!("IDS={}", ids.join(" ")),
            "NGEN=6",
            "USAGE_SAVE=0",
        ],
        &[],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    let out = stdout(&output);
    let generated: Vec<u32> = out
        .lines()
        .find(|l| !l.is_empty() && l.split(' ').all(|w| w.parse::<u32>().is_ok()))
        .unwrap_or_else(|| panic!("no ids in {out}"))
        .split(' ')
        .map(|w| w.parse().unwrap())
        .collect();
    assert_eq!(generated.len(), chosen.len());
    let mut whole = prompt.clone();
    whole.extend(&generated);
    let scored = ppl_sum(&whole) - ppl_sum(&prompt);
    let served: f64 = -chosen.iter().sum::<f64>();
    assert!(
        (scored - served).abs() < 2e-3,
        "PPL=1 scores the answer {scored:.6} nats, its logprobs say {served:.6}"
    );

    // Chat, streamed and not: the same log-probabilities, one entry per generated token.
    let chat = json!({
        "messages": [{"role": "user", "content": "The history of"}],
        "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 2,
    });
    let (status, whole) = server.post("/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{whole}");
    let content = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(content.len() as u64, usage(&whole, "completion_tokens"));
    assert!(content
        .iter()
        .all(|t| t["top_logprobs"].as_array().unwrap().len() == 2));
    let mut streamed_body = chat.clone();
    streamed_body["stream"] = json!(true);
    let (status, text) = server.curl(
        "/v1/chat/completions",
        Some(&streamed_body.to_string()),
        &[],
    );
    assert_eq!(status, 200, "{text}");
    let streamed: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .flat_map(|d| {
            let chunk: Value = serde_json::from_str(d).unwrap();
            chunk["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed, content);
}

#[test]
fn each_sampling_key_changes_what_it_should_and_a_seed_repeats_it() {
    let server = start();
    let prompt = heldout_ids(12);
    let answer = |extra: Value| -> (String, Value) {
        let mut body = json!({ "prompt": prompt, "max_tokens": 8, "logprobs": 1 });
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        let (status, reply) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{reply}");
        (
            reply["choices"][0]["text"].as_str().unwrap().to_string(),
            reply["choices"][0]["logprobs"].clone(),
        )
    };
    let greedy = answer(json!({ "temperature": 0 })).0;
    // Cuts that leave one token are greedy at any temperature.
    for cut in [json!({ "top_k": 1 }), json!({ "min_p": 1.0 })] {
        let mut extra = cut.clone();
        extra["temperature"] = json!(5.0);
        extra["seed"] = json!(3);
        assert_eq!(answer(extra).0, greedy, "{cut}");
    }
    // Without a cut, that temperature wanders off the greedy answer.
    assert_ne!(answer(json!({ "temperature": 5.0, "seed": 3 })).0, greedy);
    // A bias of 100 makes one token every token.
    let forced = answer(json!({ "temperature": 0, "logit_bias": { "1500": 100 } })).1;
    let tokens: Vec<String> = serde_json::from_value(forced["tokens"].clone()).unwrap();
    assert_eq!(tokens.len(), 8);
    assert!(tokens.iter().all(|t| t == &tokens[0]), "{tokens:?}");
    // Penalties: greedy under a penalty takes the model's most likely token unless that
    // token was generated before (or, for the repetition penalty, is in the prompt); and
    // somewhere the penalty changes the choice.
    for (penalty, generated_only) in [
        (json!({ "presence_penalty": 2.0 }), true),
        (json!({ "frequency_penalty": 2.0 }), true),
        (json!({ "repetition_penalty": 20.0 }), false),
    ] {
        let mut extra = penalty.clone();
        extra["temperature"] = json!(0);
        extra["max_tokens"] = json!(32);
        let (_, logprobs) = answer(extra);
        let tokens: Vec<String> = serde_json::from_value(logprobs["tokens"].clone()).unwrap();
        let mut changed = 0;
        for (i, top) in logprobs["top_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let (best, _) = top
                .as_object()
                .unwrap()
                .iter()
                .max_by(|a, b| a.1.as_f64().unwrap().total_cmp(&b.1.as_f64().unwrap()))
                .unwrap();
            if &tokens[i] != best {
                changed += 1;
                if generated_only {
                    assert!(
                        tokens[..i].contains(best),
                        "{penalty}: token {i} is not the most likely {best:?}, which was never generated: {logprobs}"
                    );
                }
            }
        }
        assert!(changed > 0, "{penalty} changed no choice: {logprobs}");
    }
    // Every key, sampled with a seed, gives the same text twice.
    let all = json!({
        "temperature": 1.3, "seed": 9, "top_k": 40, "min_p": 0.02, "top_p": 0.95,
        "presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2,
        "logit_bias": { "14": -5 },
    });
    assert_eq!(answer(all.clone()).0, answer(all).0);
}

#[test]
fn fields_this_server_does_not_implement_are_refused_by_name() {
    let server = start();
    let chat = |extra: Value| {
        let mut body = json!({ "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2 });
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        server.post("/v1/chat/completions", &body)
    };
    for (extra, named) in [
        (
            json!({ "tools": [{"type": "function", "function": {"name": "f"}}] }),
            "tools:",
        ),
        (
            json!({ "response_format": {"type": "json_object", "schema": {}} }),
            "response_format.schema:",
        ),
        (
            json!({ "response_format": {"type": "xml"} }),
            "response_format.type:",
        ),
        (
            json!({ "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}} }),
            "response_format/grammar: invalid JSON schema",
        ),
        (
            json!({ "grammar": "start: (" }),
            "response_format/grammar: invalid Lark",
        ),
        (json!({ "tool_choice": "required" }), "tool_choice:"),
        (json!({ "frobnicate": 1 }), "frobnicate:"),
        (
            json!({ "messages": [{"role": "user", "content": "Hi", "tool_call_id": "c1"}] }),
            "messages[0].tool_call_id:",
        ),
        (json!({ "top_logprobs": 2 }), "top_logprobs:"),
        (
            json!({ "logprobs": true, "top_logprobs": 21 }),
            "top_logprobs 21",
        ),
        (json!({ "min_p": 2 }), "min_p 2"),
        (json!({ "presence_penalty": -3 }), "presence_penalty -3"),
        (json!({ "logit_bias": { "x": 1 } }), "logit_bias:"),
        (json!({ "logit_bias": { "4096": 1 } }), "logit_bias:"),
    ] {
        let (status, reply) = chat(extra.clone());
        assert_eq!(status, 400, "{extra}: {reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(named), "{extra}: {message}");
    }
    // What clients send that means nothing here, and values that ask for the default.
    for extra in [
        json!({ "user": "u1", "metadata": {"k": "v"}, "store": false, "service_tier": "auto" }),
        json!({ "tool_choice": "none", "parallel_tool_calls": true, "response_format": {"type": "text"} }),
        json!({ "tools": [], "seed": null, "logprobs": false }),
    ] {
        let (status, reply) = chat(extra.clone());
        assert_eq!(status, 200, "{extra}: {reply}");
    }
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({ "prompt": "x", "suffix": "y", "max_tokens": 1 }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(reply["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("suffix:"));
}

/// `echo`: the prompt's text before the answer's; with `logprobs`, the prompt's tokens
/// scored as `PPL=1` scores them (the first, which nothing predicts, `null`), streamed too.
#[test]
fn an_echoed_prompt_is_scored_as_ppl_scores_it() {
    let server = start();
    let prompt = heldout_ids(15);
    let body = json!({ "prompt": prompt, "max_tokens": 0, "echo": true, "logprobs": 2 });
    let (status, reply) = server.post("/v1/completions", &body);
    assert_eq!(status, 200, "{reply}");
    let logprobs = &reply["choices"][0]["logprobs"];
    let scores = logprobs["token_logprobs"].as_array().unwrap();
    assert_eq!(scores.len(), prompt.len(), "{logprobs}");
    assert!(
        scores[0].is_null() && logprobs["top_logprobs"][0].is_null(),
        "{logprobs}"
    );
    let sum: f64 = scores[1..].iter().map(|v| v.as_f64().unwrap()).sum();
    let scored = ppl_sum(&prompt);
    assert!(
        (sum + scored).abs() < 1e-3 * scored,
        "{sum} against PPL's -{scored}"
    );
    let tokens: Vec<String> = serde_json::from_value(logprobs["tokens"].clone()).unwrap();
    assert_eq!(
        tokens.concat(),
        reply["choices"][0]["text"].as_str().unwrap()
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, text) = server.curl("/v1/completions", Some(&streamed.to_string()), &[]);
    let streamed_scores: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(&streamed_scores[..], &scores[..]);
    // Without logprobs: the prompt's text, then the answer a request without echo gets.
    let ask = json!({ "prompt": "The history of", "max_tokens": 4, "temperature": 0 });
    let (_, plain) = server.post("/v1/completions", &ask);
    let mut echoed = ask.clone();
    echoed["echo"] = json!(true);
    let (_, echoed) = server.post("/v1/completions", &echoed);
    assert_eq!(
        echoed["choices"][0]["text"].as_str().unwrap(),
        format!(
            "The history of{}",
            plain["choices"][0]["text"].as_str().unwrap()
        )
    );
}

/// `grammar` and `response_format` constrain what is sampled (at a high temperature, so
/// the constraint, not the model, decides), on both endpoints, streamed too.
#[test]
fn a_grammar_or_a_json_format_bounds_every_answer() {
    let server = start();
    for seed in 0..4 {
        let (status, reply) = server.post(
            "/v1/chat/completions",
            &json!({ "messages": [{"role": "user", "content": "Yes?"}], "max_tokens": 8,
                     "temperature": 1.5, "seed": seed, "grammar": "start: \"yes\" | \"no\"" }),
        );
        assert_eq!(status, 200, "{reply}");
        let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(text == "yes" || text == "no", "seed {seed}: {text:?}");
        assert_eq!(reply["choices"][0]["finish_reason"], "stop", "{reply}");
        let (status, reply) = server.post(
            "/v1/completions",
            &json!({ "prompt": "Data:", "max_tokens": 120, "temperature": 1.5, "seed": seed,
                     "response_format": {"type": "json_object"} }),
        );
        assert_eq!(status, 200, "{reply}");
        let text = reply["choices"][0]["text"].as_str().unwrap();
        if reply["choices"][0]["finish_reason"] == "stop" {
            let value: Value = serde_json::from_str(text)
                .unwrap_or_else(|err| panic!("seed {seed}: {text:?} is not JSON: {err}"));
            assert!(value.is_object(), "seed {seed}: {text}");
        } else {
            assert!(text.trim_start().starts_with('{'), "seed {seed}: {text:?}");
        }
    }
}

/// GLM-5.2 thinks when asked (`chat_template_kwargs.enable_thinking`, Anthropic's
/// `thinking`): what it writes before `</think>` is `reasoning_content` (streamed as
/// `delta.reasoning_content`) and a `thinking` block; a budget closes the block where it
/// is spent. The random model never closes the block itself, so all it writes is thinking
/// until the budget forces the tag.
#[test]
fn thinking_is_reasoning_content_and_a_thinking_block_within_its_budget() {
    let server = Server::start(&fixture("glm_moe_dsa_tiny"), &["USAGE_SAVE=0"], &[]);
    let ask = json!({ "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 24,
                      "temperature": 0, "chat_template_kwargs": {"enable_thinking": true} });
    let (status, whole) = server.post("/v1/chat/completions", &ask);
    assert_eq!(status, 200, "{whole}");
    let message = &whole["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().unwrap_or_default();
    assert!(!reasoning.is_empty(), "{whole}");
    assert!(!reasoning.contains("</think>"), "{whole}");
    let usage = &whole["usage"];
    assert_eq!(
        usage["completion_tokens_details"]["reasoning_tokens"], usage["completion_tokens"],
        "{whole}"
    );
    // Streamed: the same reasoning, in deltas.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let (status, text) = server.curl("/v1/chat/completions", Some(&streamed.to_string()), &[]);
    assert_eq!(status, 200, "{text}");
    let deltas: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(deltas, reasoning);
    // Without the switch, no thinking.
    let (_, plain) = server.post(
        "/v1/chat/completions",
        &json!({ "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0 }),
    );
    assert!(
        plain["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{plain}"
    );

    // Anthropic, the same answer as a thinking block, whole and streamed.
    let messages = json!({ "max_tokens": 1040, "temperature": 0, "messages": [{"role": "user", "content": "Hi"}],
                           "thinking": {"type": "enabled", "budget_tokens": 1024} });
    let (status, message) = server.post("/v1/messages", &messages);
    assert_eq!(status, 200, "{message}");
    let mut same = ask.clone();
    same["max_tokens"] = json!(1040);
    let (_, same) = server.post("/v1/chat/completions", &same);
    assert_eq!(message["content"][0]["type"], "thinking", "{message}");
    assert_eq!(
        message["content"][0]["thinking"], same["choices"][0]["message"]["reasoning_content"],
        "{message}"
    );
    let mut streamed = messages.clone();
    streamed["stream"] = json!(true);
    let (_, text) = server.curl("/v1/messages", Some(&streamed.to_string()), &[]);
    let events: Vec<Value> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let thought: String = events
        .iter()
        .filter_map(|e| e["delta"]["thinking"].as_str())
        .collect();
    assert_eq!(thought, message["content"][0]["thinking"].as_str().unwrap());
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| {
            e["delta"]["type"]
                .as_str()
                .unwrap_or_else(|| e["type"].as_str().unwrap())
        })
        .filter(|k| *k != "thinking_delta")
        .collect();
    assert_eq!(
        kinds[..4],
        [
            "message_start",
            "content_block_start",
            "signature_delta",
            "content_block_stop"
        ],
        "{text}"
    );

    // The budget, on a copy whose special tokens do not stop it (its model writes its own
    // `</think>` after 163 tokens): 16 tokens of thinking, the closing tag it is made to
    // write, then text.
    let copy = copy_fixture("glm_moe_dsa_tiny");
    let unstoppable = |json: &mut Value| json["eos_token_id"] = json!(126);
    edit_json(&copy.path().join("config.json"), unstoppable);
    edit_json(&copy.path().join("generation_config.json"), unstoppable);
    edit_json(&copy.path().join("tokenizer_config.json"), |json| {
        json["eos_token"] = json!("<think>")
    });
    edit_json(&copy.path().join("tokenizer.json"), |json| {
        for token in json["added_tokens"].as_array_mut().unwrap() {
            token["special"] = json!(false);
        }
    });
    let budgeted = Server::start(copy.path(), &["USAGE_SAVE=0"], &[]);
    let mut messages = messages;
    messages["max_tokens"] = json!(40);
    messages["thinking"]["budget_tokens"] = json!(16);
    let (status, message) = budgeted.post("/v1/messages", &messages);
    assert_eq!(status, 200, "{message}");
    assert_eq!(message["usage"]["output_tokens"], 40, "{message}");
    let content = message["content"].as_array().unwrap();
    let thought = content[0]["thinking"].as_str().unwrap();
    let (_, counted) = budgeted.post(
        "/tokenize",
        &json!({ "content": thought, "add_special": false }),
    );
    let thought_tokens = counted["count"].as_u64().unwrap();
    // Token counts of decoded text may differ by one or two where pieces merge.
    assert!(
        (14..=18).contains(&thought_tokens),
        "{thought_tokens} tokens of thinking"
    );
    let after = content[1]["text"].as_str().unwrap();
    assert!(
        !after.is_empty() && !after.contains("</think>"),
        "{message}"
    );
    // Refused: thinking on a model whose prompt opens no thinking block, and thinking with a
    // required call.
    let (status, reply) = server.post(
        "/v1/messages",
        &json!({ "max_tokens": 2000, "messages": [{"role": "user", "content": "Hi"}],
                 "thinking": {"type": "enabled", "budget_tokens": 1024},
                 "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"} }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("thinking with"),
        "{reply}"
    );
    let olmoe = start();
    let (status, reply) = olmoe.post(
        "/v1/messages",
        &json!({ "max_tokens": 2000, "messages": [{"role": "user", "content": "Hi"}],
                 "thinking": {"type": "enabled", "budget_tokens": 1024} }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("olmoe"),
        "{reply}"
    );
}
