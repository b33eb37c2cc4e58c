//! `coli serve` with several clients at once: every engine's greedy answers are the same
//! batched as alone, prompts filled a chunk a step between others' tokens; a full queue
//! answers 429 with Retry-After and a client that leaves frees its sequence; a killed
//! server's history holds exactly the turns that finished, none of a turn in flight.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::fixture;
use crate::server::{completion, heldout_ids, history_selections, snapshot_copy, usage, Server};

/// A completion streamed through curl: its text, put together from the chunks.
fn streamed_text(server: &Server, body: &Value) -> String {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = server.curl("/v1/completions", Some(&body.to_string()), &[]);
    assert_eq!(status, 200, "{text}");
    let mut out = String::new();
    let mut done = false;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        out.push_str(chunk["choices"][0]["text"].as_str().unwrap_or(""));
    }
    assert!(done, "the stream ended without [DONE]: {text}");
    out
}

fn answer_text(server: &Server, body: &Value, streamed: bool) -> String {
    if streamed {
        return streamed_text(server, body);
    }
    let (status, reply) = server.post("/v1/completions", body);
    assert_eq!(status, 200, "{reply}");
    reply["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn every_engine_answers_each_of_eight_clients_as_it_answers_one_alone() {
    let fixtures = [
        ("olmoe_tiny", 128),
        ("olmoe_trained", 4096),
        ("inkling_tiny", 250),
        ("kimi_k3_tiny", 192),
        ("glm_moe_dsa_tiny", 128),
        ("glm_moe_dsa_tiny_mtp", 128),
    ];
    for (name, vocab) in fixtures {
        // Prompts of 3 to 38 tokens, one of them far longer than a chunk: it is filled four
        // tokens a step while the others decode.
        let prompts: Vec<Vec<u32>> = (0..8u32)
            .map(|client| {
                let len = if client == 5 { 38 } else { 3 + client };
                (0..len)
                    .map(|i| (i * 37 + 5 + client * 13) % vocab)
                    .collect()
            })
            .collect();
        let body = |prompt: &Vec<u32>| completion(prompt, 7);
        let server = Arc::new(Server::start(
            &fixture(name),
            &[
                "--parallel",
                "8",
                "--prefill-chunk",
                "4",
                "--cache-mb",
                "0",
                "64",
                "16",
                "16",
                "USAGE_SAVE=0",
            ],
            &[],
        ));
        let alone: Vec<String> = prompts
            .iter()
            .map(|p| answer_text(&server, &body(p), false))
            .collect();
        let clients: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(client, prompt)| {
                let server = server.clone();
                let body = body(prompt);
                std::thread::spawn(move || answer_text(&server, &body, client % 2 == 1))
            })
            .collect();
        let together: Vec<String> = clients.into_iter().map(|c| c.join().unwrap()).collect();
        assert_eq!(together, alone, "{name}");
        // The clients were batched: some step ran more than one sequence.
        let steps = server.metric("coli_steps_total");
        let rows = server.metric("coli_step_rows_total");
        let sequences_alone = server.metric("coli_step_sequences_bucket{le=\"1\"}");
        assert!(
            sequences_alone < steps,
            "{name}: {steps} steps, none batched"
        );
        assert!(rows > steps, "{name}");
    }
}

/// Send a streamed request on a raw connection and read its response head.
fn open_stream(port: u16, prompt: &[u32], max_tokens: usize) -> TcpStream {
    let body =
        json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": true })
            .to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 512];
    let read = stream.read(&mut head).unwrap();
    assert!(String::from_utf8_lossy(&head[..read]).contains("200 OK"));
    stream
}

fn wait_for(server: &Server, metric: &str, value: f64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric(metric) < value {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_full_queue_answers_429_and_a_client_that_leaves_frees_its_sequence() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Arc::new(Server::start(
        &snap,
        &[
            "--parallel",
            "1",
            "--queue",
            "1",
            "64",
            "16",
            "16",
            "USAGE_SAVE=0",
        ],
        &[],
    ));
    // The one sequence, busy for a long time.
    let long = open_stream(server.port, &heldout_ids(6), 4000);
    // One request waits for it.
    let waiting = {
        let server = server.clone();
        std::thread::spawn(move || server.post("/v1/completions", &completion(&heldout_ids(5), 3)))
    };
    wait_for(
        &server,
        "coli_requests_waiting",
        1.0,
        "the second request never queued",
    );
    // The next one finds the queue full.
    let out = Command::new("curl")
        .args([
            "-s",
            "-i",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            "@-",
        ])
        .arg(server.url("/v1/completions"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(completion(&heldout_ids(4), 2).to_string().as_bytes())?;
            child.wait_with_output()
        })
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(text.starts_with("http/1.1 429"), "{text}");
    assert!(text.contains("retry-after: 1"), "{text}");
    assert!(text.contains("queue_full"), "{text}");
    // The long stream's client leaves: its sequence is freed and the waiting one runs.
    drop(long);
    let (status, body) = waiting.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(usage(&body, "completion_tokens"), 3);
    assert_eq!(server.metric("coli_generations_abandoned_total"), 1.0);
}

#[test]
fn a_killed_server_s_history_holds_the_finished_turns_and_nothing_of_one_in_flight() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let history = temp.path().join("usage.coli_usage");
    let history_arg = format!("COLI_USAGE={}", history.display());
    let server = Arc::new(Server::start(
        &snap,
        &["--cache-mb", "0", "64", "16", "16", &history_arg],
        &[],
    ));
    // A turn that runs beside all the others and never finishes.
    let mut long = open_stream(server.port, &heldout_ids(7), 4000);
    let clients: Vec<_> = (0..3)
        .map(|client| {
            let server = server.clone();
            std::thread::spawn(move || {
                let prompt = heldout_ids(9 + client)[client..].to_vec();
                let (status, body) = server.post("/v1/completions", &completion(&prompt, 5));
                assert_eq!(status, 200, "{body}");
                body
            })
        })
        .collect();
    let answers: Vec<Value> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    // Each finished turn fed its prompt and all but its last token, through 4 layers x
    // top-4 routing.
    let fed: u64 = answers
        .iter()
        .map(|body| usage(body, "prompt_tokens") + usage(body, "completion_tokens") - 1)
        .sum();
    // Their answers go out before their saves; the metrics count them after.
    wait_for(
        &server,
        "coli_completion_tokens_total",
        15.0,
        "3 turns were not all counted",
    );
    // The long turn is still streaming.
    let mut more = [0u8; 256];
    assert!(long.read(&mut more).unwrap() > 0);
    let mut server = Arc::try_unwrap(server).ok().unwrap();
    server.signal("KILL");
    server.wait();
    assert_eq!(history_selections(&history), fed * 16);
}

#[test]
fn kept_states_survive_a_restart_in_the_kv_dir_and_another_model_s_are_refused_by_name() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let kv = temp.path().join("kv");
    let kv_arg = kv.to_str().unwrap();
    let args = ["--kv-dir", kv_arg, "64", "16", "16", "USAGE_SAVE=0"];
    let preamble = heldout_ids(30);
    {
        let mut server = Server::start(&snap, &args, &[]);
        let (status, body) = server.post("/v1/completions", &completion(&preamble, 4));
        assert_eq!(status, 200, "{body}");
        // SIGTERM drains, then writes the kept states.
        server.signal("TERM");
        assert_eq!(server.wait(), Some(0));
    }
    let files = std::fs::read_dir(&kv).unwrap().count();
    assert!(files >= 1, "nothing written to {}", kv.display());
    let mut next = preamble.clone();
    next.extend(heldout_ids(45)[35..].iter());
    let server = Server::start(&snap, &args, &[]);
    let (_, restarted) = server.post("/v1/completions", &completion(&next, 6));
    assert_eq!(
        restarted["usage"]["prompt_tokens_details"]["cached_tokens"], 30,
        "{restarted}"
    );
    let fresh = Server::start(
        &snap,
        &["--cache-mb", "0", "64", "16", "16", "USAGE_SAVE=0"],
        &[],
    );
    let (_, alone) = fresh.post("/v1/completions", &completion(&next, 6));
    assert_eq!(alone["choices"][0]["text"], restarted["choices"][0]["text"]);
    // Another model (the untrained fixture: another config.json) refuses them by name and
    // leaves them alone.
    let other = Server::start(
        &fixture("olmoe_tiny"),
        &["--kv-dir", kv_arg, "64", "16", "16", "USAGE_SAVE=0"],
        &[],
    );
    let (_, body) = other.post("/v1/completions", &completion(&[1, 2, 3], 2));
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let log = other.log.lock().unwrap().clone();
    assert!(
        log.contains("config.json") && log.contains(".colikv"),
        "{log}"
    );
    assert_eq!(std::fs::read_dir(&kv).unwrap().count(), files);
}

/// `routed_experts` of a completion: per generated token, per MoE layer, the ids.
fn routes_of(body: &Value) -> Vec<Vec<Vec<u64>>> {
    serde_json::from_value(body["choices"][0]["routed_experts"].clone())
        .unwrap_or_else(|e| panic!("routed_experts in {body}: {e}"))
}

#[test]
fn routed_experts_name_each_token_s_own_row_in_a_batch_and_across_prefill_rounds() {
    // Kimi K3 runs a long prompt in rounds of 32 rows: the routing of the prompt's last row
    // and of another client's decode rows in the same step must still be theirs.
    let server = Arc::new(Server::start(
        &fixture("kimi_k3_tiny"),
        &[
            "--parallel",
            "2",
            "--cache-mb",
            "0",
            "64",
            "16",
            "16",
            "USAGE_SAVE=0",
        ],
        &[],
    ));
    let long: Vec<u32> = (0..45).map(|i| (i * 29 + 7) % 192).collect();
    let short: Vec<u32> = vec![5, 9, 14];
    let body = |prompt: &[u32]| {
        let mut body = completion(prompt, 5);
        body["return_routed_experts"] = json!(true);
        body
    };
    let alone: Vec<Value> = [&long, &short]
        .iter()
        .map(|p| server.post("/v1/completions", &body(p)).1)
        .collect();
    for answer in &alone {
        let routes = routes_of(answer);
        assert_eq!(routes.len(), 5, "{answer}");
        assert!(
            routes
                .iter()
                .all(|token| token.iter().any(|layer| !layer.is_empty())),
            "a token without routing: {answer}"
        );
    }
    let clients: Vec<_> = [long.clone(), short.clone()]
        .into_iter()
        .map(|prompt| {
            let server = server.clone();
            let body = body(&prompt);
            std::thread::spawn(move || server.post("/v1/completions", &body).1)
        })
        .collect();
    let together: Vec<Value> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    for (alone, together) in alone.iter().zip(&together) {
        assert_eq!(routes_of(alone), routes_of(together), "{together}");
        assert_eq!(alone["choices"][0]["text"], together["choices"][0]["text"]);
    }
}

/// Each choice's text of a streamed completion, by `index`.
fn streamed_choices(server: &Server, body: &Value, choices: usize) -> Vec<String> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let (status, text) = server.curl("/v1/completions", Some(&body.to_string()), &[]);
    assert_eq!(status, 200, "{text}");
    let mut out = vec![String::new(); choices];
    let mut finished = vec![false; choices];
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        for choice in chunk["choices"].as_array().unwrap() {
            let index = choice["index"].as_u64().unwrap() as usize;
            assert!(
                !finished[index],
                "text after choice {index} finished: {text}"
            );
            out[index].push_str(choice["text"].as_str().unwrap_or(""));
            finished[index] = !choice["finish_reason"].is_null();
        }
    }
    assert!(
        finished.iter().all(|&f| f),
        "a choice never finished: {text}"
    );
    out
}

#[test]
fn n_choices_fork_one_prompt_and_each_is_the_answer_its_seed_gives_alone() {
    // A recurrent engine (Kimi K3) forks from a kept checkpoint's logits the second time;
    // GLM-5.2 with MTP forks its draft window.
    for (name, vocab) in [
        ("olmoe_tiny", 128),
        ("kimi_k3_tiny", 192),
        ("glm_moe_dsa_tiny_mtp", 128),
    ] {
        let server = Server::start(
            &fixture(name),
            &["--parallel", "3", "64", "16", "16", "USAGE_SAVE=0"],
            &[],
        );
        let prompt: Vec<u32> = (0..9).map(|i| (i * 41 + 3) % vocab).collect();
        let body = |seed: u64, n: usize| {
            let mut body = completion(&prompt, 6);
            body["temperature"] = json!(1.0);
            body["seed"] = json!(seed);
            body["n"] = json!(n);
            body
        };
        let replies: Vec<Value> = (0..3)
            .map(|j| server.post("/v1/completions", &body(40 + j, 1)).1)
            .collect();
        let alone: Vec<&str> = replies
            .iter()
            .map(|r| r["choices"][0]["text"].as_str().unwrap())
            .collect();
        let tokens: u64 = replies.iter().map(|r| usage(r, "completion_tokens")).sum();
        assert!(
            alone.iter().any(|t| t != &alone[0]),
            "{name}: three seeds gave one answer, the test would not see a mix-up: {alone:?}"
        );
        for _ in 0..2 {
            let (status, reply) = server.post("/v1/completions", &body(40, 3));
            assert_eq!(status, 200, "{reply}");
            let choices = reply["choices"].as_array().unwrap();
            let texts: Vec<&str> = choices
                .iter()
                .map(|c| c["text"].as_str().unwrap())
                .collect();
            assert_eq!(texts, alone, "{name}");
            let indices: Vec<u64> = choices
                .iter()
                .map(|c| c["index"].as_u64().unwrap())
                .collect();
            assert_eq!(indices, [0, 1, 2]);
            assert_eq!(
                usage(&reply, "prompt_tokens"),
                prompt.len() as u64,
                "{reply}"
            );
            assert_eq!(usage(&reply, "completion_tokens"), tokens, "{reply}");
        }
        assert_eq!(streamed_choices(&server, &body(40, 3), 3), alone, "{name}");
        let (status, reply) = server.post("/v1/completions", &body(40, 4));
        assert_eq!(status, 400, "{reply}");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--parallel"),
            "{reply}"
        );
    }
}
