//! `coli serve` end to end, driven with `curl` against the trained fixture: KV reuse across
//! turns gives a fresh run's tokens (and, in the library, on every engine, drafting
//! included); concurrent clients all get complete answers; the history holds exactly the
//! turns served when the server is killed; SIGTERM drains and saves; a client that leaves
//! mid-stream stops its generation; bad requests get OpenAI-style errors; API_KEY.

use crate::common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use coli::engines::{self, LoadOptions};
use coli::generate::{generate_after, generate_with, Flow, Policy};
use coli::sampling::Sampler;
use coli::snapshot::Snapshot;
use common::{coli, coli_command, copy_fixture_to, fixture, stderr};
use serde_json::{json, Value};

/// A running `coli serve`, killed when dropped.
pub(crate) struct Server {
    child: Child,
    pub(crate) port: u16,
    pub(crate) log: Arc<Mutex<String>>,
}

impl Server {
    pub(crate) fn start(snap: &Path, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let snap_arg = format!("SNAP={}", snap.display());
        let mut args = vec!["serve", "--port", "0", snap_arg.as_str(), "TEMP=0"];
        args.extend_from_slice(extra);
        let mut child = coli_command(&args, env)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("coli serve starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (port_tx, port_rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(rest) = line.split("on http://127.0.0.1:").nth(1) {
                    let port: u16 = rest.split('/').next().unwrap().parse().unwrap();
                    let _ = port_tx.send(port);
                }
                let mut log = sink.lock().unwrap();
                log.push_str(&line);
                log.push('\n');
            }
        });
        let port = match port_rx.recv_timeout(Duration::from_secs(60)) {
            Ok(port) => port,
            Err(_) => {
                let _ = child.kill();
                panic!("coli serve did not start: {}", log.lock().unwrap());
            }
        };
        Server { child, port, log }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `(HTTP status, body)` of a request through curl.
    pub(crate) fn curl(&self, path: &str, body: Option<&str>, headers: &[&str]) -> (u16, String) {
        let mut command = Command::new("curl");
        command.args(["-s", "-N", "-w", "\n%{http_code}", &self.url(path)]);
        for header in headers {
            command.args(["-H", header]);
        }
        if body.is_some() {
            command.args([
                "-H",
                "Content-Type: application/json",
                "--data-binary",
                "@-",
            ]);
            command.stdin(Stdio::piped());
        }
        command.stdout(Stdio::piped());
        let mut child = command
            .spawn()
            .expect("curl runs (install it: apt-get install curl)");
        if let Some(body) = body {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(body.as_bytes())
                .unwrap();
        }
        let out = child.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').unwrap();
        (status.trim().parse().unwrap(), body.to_string())
    }

    pub(crate) fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.curl(path, Some(&body.to_string()), &[]);
        let value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path} answered {status} {text:?}: {e}"));
        (status, value)
    }

    pub(crate) fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.curl("/metrics", None, &[]);
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} in {text}"))
            .parse()
            .unwrap()
    }

    pub(crate) fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success());
    }

    /// Wait for the server to exit; its exit code.
    pub(crate) fn wait(&mut self) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("coli serve did not exit: {}", self.log.lock().unwrap());
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The trained fixture copied where the server may write its history.
pub(crate) fn snapshot_copy(dir: &Path) -> PathBuf {
    let snap = dir.join("olmoe_trained");
    copy_fixture_to("olmoe_trained", &snap);
    snap
}

pub(crate) fn heldout_ids(count: usize) -> Vec<u32> {
    std::fs::read_to_string(fixture("olmoe_trained").join("heldout_prose.ids"))
        .unwrap()
        .split(|c: char| c.is_whitespace() || c == ',')
        .filter(|s| !s.is_empty())
        .take(count)
        .map(|s| s.parse().unwrap())
        .collect()
}

pub(crate) fn completion(prompt: &[u32], max_tokens: usize) -> Value {
    json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0 })
}

pub(crate) fn usage(body: &Value, key: &str) -> u64 {
    body["usage"][key]
        .as_u64()
        .unwrap_or_else(|| panic!("usage.{key} in {body}"))
}

/// Selections the history holds, from `coli usage show`.
pub(crate) fn history_selections(path: &Path) -> u64 {
    let out = coli(&["usage", "show", path.to_str().unwrap()], &[]);
    let text = common::stdout(&out);
    text.lines()
        .find_map(|l| l.strip_prefix("selections"))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("selections in {text}{}", stderr(&out)))
        .parse()
        .unwrap()
}

#[test]
fn prompts_start_from_the_longest_kept_prefix_and_answer_as_a_fresh_run() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let fresh = Server::start(
        &snap,
        &["--cache-mb", "0", "64", "16", "16", "USAGE_SAVE=0"],
        &[],
    );
    let first = heldout_ids(24);
    // The next turn: the first prompt, the first six of its answer's eight ids (the same
    // greedy run in this process) and new ids. The kept state holds the prompt and seven
    // answer tokens (the eighth was never fed), six of them shared.
    let snapshot = Snapshot::open(&snap).unwrap();
    let engine = engines::load("olmoe", &snapshot, LoadOptions::exact(64)).unwrap();
    let answer = coli::generate::greedy(engine.as_ref(), &first, 6)
        .unwrap()
        .tokens;
    let mut second = first.clone();
    second.extend_from_slice(&answer);
    second.extend(heldout_ids(40)[24..].iter());
    let mut edited = second[..40].to_vec();
    edited.extend(heldout_ids(60)[50..].iter());
    let cases: [(&str, &[u32], u64); 6] = [
        ("a first turn", &first, 0),
        ("the next turn", &second, 30),
        // Everything but the last token, whose logits are computed again.
        ("the same request again", &second, 45),
        ("an edited last message", &edited, 40),
        ("an unrelated prompt", &heldout_ids(3)[1..], 0),
        ("the first prompt after all that", &first, 23),
    ];
    let mut reused_total = 0;
    for (what, prompt, cached) in cases {
        let (status, reused) = server.post("/v1/completions", &completion(prompt, 8));
        assert_eq!(status, 200, "{what}: {reused}");
        assert_eq!(
            reused["usage"]["prompt_tokens_details"]["cached_tokens"], cached,
            "{what}: {reused}"
        );
        assert_eq!(usage(&reused, "prompt_tokens"), prompt.len() as u64);
        let (_, alone) = fresh.post("/v1/completions", &completion(prompt, 8));
        assert_eq!(alone["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(
            reused["choices"][0]["text"], alone["choices"][0]["text"],
            "{what}: reused {reused} fresh {alone}"
        );
        reused_total += cached;
    }
    assert_eq!(
        server.metric("coli_prompt_tokens_cached_total"),
        reused_total as f64
    );
    assert!(server.metric("coli_kept_states") >= 3.0);
    assert_eq!(fresh.metric("coli_kept_states"), 0.0);
}

#[test]
fn every_engine_continues_a_cached_prefix_as_a_fresh_prefill_would() {
    let cases = [
        ("olmoe_tiny", None),
        ("olmoe_trained", None),
        ("inkling_tiny", None),
        ("kimi_k3_tiny", None),
        ("glm_moe_dsa_tiny", None),
        ("glm_moe_dsa_tiny_mtp", Some(2)),
    ];
    for (name, draft) in cases {
        let snapshot = Snapshot::open(&fixture(name)).unwrap();
        let engine_name = engines::resolve(None, &snapshot).unwrap();
        let options = LoadOptions {
            draft,
            ..LoadOptions::exact(64)
        };
        let engine = engines::load(engine_name, &snapshot, options).unwrap();
        let vocab = engine.vocab_size() as u32;
        let prompt: Vec<u32> = (0..7).map(|i| (i * 37 + 5) % vocab).collect();
        let run = |state: &mut coli::engines::State, ids: &[u32]| {
            let policy = Policy {
                count: 6,
                sampler: &mut Sampler::greedy(),
                stops: &[],
            };
            let done = |_: u32| Ok(Flow::Continue);
            generate_after(
                engine.as_ref(),
                state,
                ids,
                policy,
                &mut |_, _| Ok(()),
                &mut { done },
            )
            .unwrap()
            .tokens
        };
        let mut state = engine.new_state();
        let answer = run(&mut state, &prompt);
        let mut conversation = prompt.clone();
        conversation.extend_from_slice(&answer);
        let held = state.position();
        assert!(held >= prompt.len() && held <= conversation.len(), "{name}");
        conversation.truncate(held);
        conversation.extend((0..5).map(|i| (i * 11 + 3) % vocab));
        let continued = run(&mut state, &conversation);
        let policy = Policy {
            count: 6,
            sampler: &mut Sampler::greedy(),
            stops: &[],
        };
        let fresh = generate_with(
            engine.as_ref(),
            &mut engine.new_state(),
            &conversation,
            policy,
            &mut |_, _| Ok(()),
            &mut |_| Ok(Flow::Continue),
        )
        .unwrap()
        .tokens;
        assert_eq!(continued, fresh, "{name} (draft {draft:?})");
    }
}

#[test]
fn concurrent_clients_all_get_whole_answers_and_the_history_holds_every_turn() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let history = temp.path().join("usage.coli_usage");
    let history_arg = format!("COLI_USAGE={}", history.display());
    let server = Arc::new(Server::start(&snap, &["64", "16", "16", &history_arg], &[]));
    let prompt_of =
        |client: usize, turn: usize| heldout_ids(8 + client * 5 + turn)[client..].to_vec();
    let clients: Vec<_> = (0..4)
        .map(|client| {
            let server = server.clone();
            std::thread::spawn(move || {
                (0..2)
                    .map(|turn| {
                        let (status, body) = server
                            .post("/v1/completions", &completion(&prompt_of(client, turn), 5));
                        assert_eq!(status, 200, "{body}");
                        body
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<Value> = clients
        .into_iter()
        .flat_map(|c| c.join().unwrap())
        .collect();
    assert_eq!(answers.len(), 8);
    // Each turn routes every token it feeds through 4 layers x top-4: the fresh prompt
    // positions and every generated token but one that `max_tokens` left unfed.
    let mut fed = 0;
    for body in &answers {
        assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
        assert_eq!(usage(body, "completion_tokens"), 5);
        fed += usage(body, "prompt_tokens")
            - body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap()
            + 5
            - 1;
    }
    // A turn's answer goes out before its save; the metrics count it after.
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("coli_completion_tokens_total") < 40.0 {
        assert!(Instant::now() < deadline, "8 turns were not all counted");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Killed without a chance to save: the history holds the turns saved after each one.
    let mut server = Arc::try_unwrap(server).ok().unwrap();
    server.signal("KILL");
    server.wait();
    assert_eq!(history_selections(&history), fed * 16);
}

#[test]
fn sigterm_finishes_the_running_generation_then_saves() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let history = temp.path().join("usage.coli_usage");
    let history_arg = format!("COLI_USAGE={}", history.display());
    let mut server = Server::start(&snap, &["64", "16", "16", &history_arg], &[]);
    let port = server.port;
    let prompt = heldout_ids(10);
    let body = json!({ "prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": true })
        .to_string();
    let (chunks_tx, chunks_rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            stream,
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut reader = BufReader::new(stream);
        let mut all = String::new();
        let mut line = String::new();
        while reader.read_line(&mut line).unwrap() > 0 {
            if line.starts_with("data: ") {
                let _ = chunks_tx.send(());
            }
            all.push_str(&line);
            line.clear();
        }
        all
    });
    chunks_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    server.signal("TERM");
    let streamed = reader.join().unwrap();
    assert!(streamed.contains("data: [DONE]"), "{streamed}");
    assert!(
        streamed.contains("\"finish_reason\":\"length\""),
        "{streamed}"
    );
    assert_eq!(server.wait(), Some(0), "{}", server.log.lock().unwrap());
    // 10 prompt positions and 399 generated tokens fed, 16 selections each.
    assert_eq!(history_selections(&history), (10 + 399) * 16);
}

#[test]
fn a_second_sigterm_ends_a_long_drain_at_once() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let mut server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let port = server.port;
    let body =
        json!({ "prompt": heldout_ids(6), "max_tokens": 4000, "temperature": 0, "stream": true })
            .to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    assert!(stream.read(&mut first).unwrap() > 0);
    server.signal("TERM");
    std::thread::sleep(Duration::from_millis(200));
    server.signal("TERM");
    let started = Instant::now();
    assert_eq!(server.wait(), Some(143));
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_client_that_leaves_mid_stream_stops_its_generation() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let body =
        json!({ "prompt": heldout_ids(6), "max_tokens": 4000, "temperature": 0, "stream": true })
            .to_string();
    {
        let mut stream = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        write!(
            stream,
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut first = [0u8; 512];
        let read = stream.read(&mut first).unwrap();
        assert!(String::from_utf8_lossy(&first[..read]).contains("200 OK"));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while server.metric("coli_generations_abandoned_total") < 1.0 {
        assert!(Instant::now() < deadline, "the generation went on");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(server.metric("coli_completion_tokens_total") < 4000.0);
    // The server goes on serving.
    let (status, _) = server.post("/v1/completions", &completion(&heldout_ids(4), 2));
    assert_eq!(status, 200);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_goes_on() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let error_of = |status: u16, text: &str| -> (u16, String) {
        let body: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        (
            status,
            body["error"]["message"].as_str().unwrap().to_string(),
        )
    };
    let (status, text) = server.curl("/v1/chat/completions", Some("{\"messages\": ["), &[]);
    let (status, message) = error_of(status, &text);
    assert_eq!(status, 400);
    assert!(message.contains("not the JSON"), "{message}");
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({ "model": "gpt-4", "messages": [{ "role": "user", "content": "hi" }] }),
    );
    assert_eq!(status, 404);
    assert_eq!(body["error"]["code"], "model_not_found");
    let (status, body) = server.post("/v1/completions", &completion(&heldout_ids(5), 5000));
    assert_eq!(status, 400);
    assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
    let (status, body) = server.post("/v1/completions", &json!({ "prompt": [1, 2, 999999] }));
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("vocabulary"));
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(5 << 20));
    let (status, text) = server.curl("/v1/completions", Some(&big), &[]);
    assert_eq!(error_of(status, &text).0, 413);
    let (status, text) = server.curl("/v2/nothing", None, &[]);
    assert_eq!(error_of(status, &text).0, 404);
    let (status, text) = server.curl("/v1/chat/completions", None, &[]);
    assert_eq!(error_of(status, &text).0, 405);
    let (status, text) = server.curl("/v1/models/olmoe_trained", None, &[]);
    assert_eq!(status, 200, "{text}");
    let (status, text) = server.curl("/v1/models/gpt-4", None, &[]);
    assert_eq!(error_of(status, &text).0, 404);
    let (status, body) = server.post(
        "/v1/completions",
        &json!({ "prompt": "x", "temperature": -1 }),
    );
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("temperature"));
    let (status, body) = server.post(
        "/v1/chat/completions",
        &json!({ "messages": [{ "role": "user", "content": "hi" }], "max_tokens": 3 }),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["choices"][0]["message"]["content"].is_string());
}

/// A model whose `max_position_embeddings` is in config.json's `text_config` alone (Inkling's
/// multimodal release, Kimi K3): the server holds requests to that limit, naming it, and
/// `LONG_CONTEXT=1` lifts it, as for a run.
#[test]
fn a_limit_in_text_config_holds_requests_unless_long_context() {
    let ids = |count: u32| -> Vec<u32> { (3..3 + count).collect() };
    for name in ["inkling_tiny_b", "kimi_k3_tiny"] {
        let dir = common::copy_fixture(name);
        let path = dir.path().join("config.json");
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert!(
            config.get("max_position_embeddings").is_none(),
            "{name}: the limit is meant to be in text_config alone"
        );
        config["text_config"]["max_position_embeddings"] = json!(8);
        std::fs::write(&path, config.to_string()).unwrap();

        let server = Server::start(dir.path(), &["64", "16", "16", "USAGE_SAVE=0"], &[]);
        // max_tokens beyond what the prompt leaves, then a prompt that fills the context.
        for (prompt, max_tokens) in [(4, 6), (8, 1)] {
            let (status, body) =
                server.post("/v1/completions", &completion(&ids(prompt), max_tokens));
            assert_eq!(status, 400, "{name}: {body}");
            assert_eq!(body["error"]["code"], "context_length_exceeded", "{body}");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains("max_position_embeddings"), "{message}");
        }
        let (status, body) = server.post("/v1/completions", &completion(&ids(4), 4));
        assert_eq!(status, 200, "{name}: {body}");
        drop(server);

        let server = Server::start(
            dir.path(),
            &["64", "16", "16", "USAGE_SAVE=0", "LONG_CONTEXT=1"],
            &[],
        );
        let (status, body) = server.post("/v1/completions", &completion(&ids(8), 6));
        assert_eq!(status, 200, "{name} with LONG_CONTEXT=1: {body}");
    }
}

#[test]
fn api_key_is_required_beyond_loopback_and_checked_when_set() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let out = coli(
        &[
            "serve",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            &format!("SNAP={}", snap.display()),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("API_KEY"), "{}", stderr(&out));
    let out = coli(
        &["serve", "--port", "0", &format!("SNAP={}", snap.display())],
        &[("TEMP", "/tmp")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("TEMP=\"/tmp\""), "{}", stderr(&out));
    let server = Server::start(
        &snap,
        &["64", "16", "16", "USAGE_SAVE=0", "API_KEY=s3cret"],
        &[],
    );
    let (status, _) = server.curl("/v1/models", None, &[]);
    assert_eq!(status, 401);
    let (status, _) = server.curl("/v1/models", None, &["Authorization: Bearer wrong"]);
    assert_eq!(status, 401);
    let head = response_head(&server, "GET", "/v1/models", &[]);
    assert!(head.contains("www-authenticate: bearer"), "{head}");
    let (status, text) = server.curl("/v1/models", None, &["Authorization: Bearer s3cret"]);
    assert_eq!(status, 200, "{text}");
    // Anthropic's clients send the key as `x-api-key`; a refusal comes in Anthropic's shape.
    let ask = r#"{"max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}"#;
    let (status, text) = server.curl("/v1/messages", Some(ask), &["x-api-key: s3cret"]);
    assert_eq!(status, 200, "{text}");
    let (status, text) = server.curl("/v1/messages", Some(ask), &["x-api-key: wrong"]);
    assert_eq!(status, 401, "{text}");
    let refusal: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(refusal["type"], "error");
    assert_eq!(refusal["error"]["type"], "authentication_error", "{text}");
    let (status, _) = server.curl("/health", None, &[]);
    assert_eq!(status, 200);
}

#[test]
fn routed_experts_are_the_routing_that_computed_each_token_and_the_trace_numbers_on() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let trace = temp.path().join("routes.trace");
    let trace_arg = format!("ROUTE_TRACE={}", trace.display());
    let mut server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0", &trace_arg], &[]);
    let ask = |prompt: &[u32]| {
        let mut body = completion(prompt, 5);
        body["return_routed_experts"] = json!(true);
        let (status, answer) = server.post("/v1/completions", &body);
        assert_eq!(status, 200, "{answer}");
        let routed: Vec<Vec<Vec<u32>>> =
            serde_json::from_value(answer["choices"][0]["routed_experts"].clone()).unwrap();
        routed
    };
    // 20 prompt rows: beyond the rows the capture keeps, but the last is kept.
    let first = ask(&heldout_ids(20));
    let second = ask(&heldout_ids(12)[5..]);
    server.signal("TERM");
    assert_eq!(server.wait(), Some(0));
    // `<call> <row> <layer> <id>:<gate> ...`: 4 MoE calls per forward, numbered on across
    // both requests.
    let mut calls: Vec<Vec<Vec<u32>>> = Vec::new();
    for line in std::fs::read_to_string(&trace).unwrap().lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let (call, row): (usize, usize) = (fields[0].parse().unwrap(), fields[1].parse().unwrap());
        if calls.len() <= call {
            calls.resize(call + 1, Vec::new());
        }
        if calls[call].len() <= row {
            calls[call].resize(row + 1, Vec::new());
        }
        calls[call][row] = fields[3..]
            .iter()
            .map(|pair| pair.split(':').next().unwrap().parse().unwrap())
            .collect();
    }
    // Five forwards per request: the prefill (its last row chose the first token), then
    // one per fed token; the fifth token is never fed.
    assert_eq!(calls.len(), 2 * 5 * 4);
    let expected = |forward_base: usize, prompt_rows: usize| -> Vec<Vec<Vec<u32>>> {
        (0..5)
            .map(|f| {
                let row = if f == 0 { prompt_rows - 1 } else { 0 };
                (0..4)
                    .map(|layer| calls[(forward_base + f) * 4 + layer][row].clone())
                    .collect()
            })
            .collect()
    };
    assert_eq!(first, expected(0, 20));
    assert_eq!(second, expected(5, 7));
    assert!(first.iter().flatten().all(|ids| ids.len() == 4));
}

#[test]
fn coli_chat_holds_a_conversation_reusing_the_cache_and_saving_every_turn() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let history = temp.path().join("usage.coli_usage");
    let mut child = coli_command(
        &[
            "chat",
            &format!("SNAP={}", snap.display()),
            &format!("COLI_USAGE={}", history.display()),
            "TEMP=0",
            "NGEN=12",
            "64",
            "16",
            "16",
        ],
        &[],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"The licence grants you\n\nWhat about the source code?\n/exit\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // `[chat] P prompt tokens (C cached) | G generated (...) | R tok/s`, one per turn.
    let turns: Vec<(u64, u64, u64, bool)> = err
        .lines()
        .filter_map(|l| l.split("[chat] ").nth(1))
        .filter(|l| l.contains(" generated ("))
        .map(|l| {
            let n: Vec<u64> = l
                .split(|c: char| !c.is_ascii_digit())
                .filter(|s| !s.is_empty())
                .map(|s| s.parse().unwrap())
                .collect();
            (n[0], n[1], n[2], l.contains("(NGEN reached)"))
        })
        .collect();
    assert_eq!(turns.len(), 2, "{err}");
    // The second turn's prompt holds the first turn and its answer, whose KV is reused.
    assert!(turns[1].0 > turns[0].0 + turns[0].2, "{err}");
    assert!(turns[1].1 > turns[0].0, "{err}");
    // stdout is the answers alone.
    let answers = common::stdout(&out);
    assert!(
        !answers.trim().is_empty() && !answers.contains("[chat]"),
        "{answers}"
    );
    let fed: u64 = turns
        .iter()
        .map(|&(prompt, cached, generated, limit)| prompt - cached + generated - u64::from(limit))
        .sum();
    assert_eq!(history_selections(&history), fed * 16, "{err}");
}

/// The response head (status line and headers, lower-cased) of `method path` through curl.
fn response_head(server: &Server, method: &str, path: &str, headers: &[&str]) -> String {
    let mut command = Command::new("curl");
    command.args([
        "-s",
        "-o",
        "/dev/null",
        "-D",
        "-",
        "-X",
        method,
        &server.url(path),
    ]);
    for header in headers {
        command.args(["-H", header]);
    }
    let out = command.output().expect("curl runs");
    String::from_utf8_lossy(&out.stdout).to_lowercase()
}

#[test]
fn cors_answers_the_origins_given_and_only_those_and_ids_differ_across_restarts() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let preflight = [
        "Origin: https://chat.example",
        "Access-Control-Request-Method: POST",
        "Access-Control-Request-Headers: authorization, content-type",
    ];
    let mut ids = Vec::new();
    {
        let server = Server::start(
            &snap,
            &[
                "--cors-origin",
                "https://chat.example",
                "64",
                "16",
                "16",
                "USAGE_SAVE=0",
            ],
            &[],
        );
        let head = response_head(&server, "OPTIONS", "/v1/chat/completions", &preflight);
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(
            head.contains("access-control-allow-origin: https://chat.example"),
            "{head}"
        );
        assert!(
            head.contains("authorization"),
            "the preflight must allow Authorization: {head}"
        );
        let other = response_head(
            &server,
            "GET",
            "/v1/models",
            &["Origin: https://evil.example"],
        );
        assert!(!other.contains("access-control-allow-origin"), "{other}");
        ids.push(server.post("/v1/completions", &completion(&[1, 2, 3], 1)).1["id"].clone());
    }
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let head = response_head(&server, "OPTIONS", "/v1/chat/completions", &preflight);
    assert!(
        !head.contains("access-control-allow-origin"),
        "no --cors-origin, no CORS: {head}"
    );
    ids.push(server.post("/v1/completions", &completion(&[1, 2, 3], 1)).1["id"].clone());
    assert_ne!(ids[0], ids[1], "the first response of two runs");
}

#[test]
fn tokenize_and_count_tokens_give_the_ids_a_request_computes() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(
        &snap,
        &["--cache-mb", "0", "64", "16", "16", "USAGE_SAVE=0"],
        &[],
    );
    let messages = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The history of"}
    ]);
    let (status, counted) = server.post("/tokenize", &json!({ "messages": messages }));
    assert_eq!(status, 200, "{counted}");
    let chat = json!({ "messages": messages, "max_tokens": 1 });
    let (_, answer) = server.post("/v1/chat/completions", &chat);
    assert_eq!(
        counted["count"].as_u64().unwrap(),
        usage(&answer, "prompt_tokens")
    );
    let (_, counted) = server.post(
        "/v1/messages/count_tokens",
        &json!({ "system": "Be brief.", "messages": [{"role": "user", "content": "The history of"}] }),
    );
    assert_eq!(
        counted["input_tokens"].as_u64().unwrap(),
        usage(&answer, "prompt_tokens")
    );
    // A text's ids read back as the text; a completion's prompt is the same ids.
    let text = "The history of the river";
    let (_, ids) = server.post(
        "/tokenize",
        &json!({ "content": text, "add_special": false }),
    );
    let (_, back) = server.post("/detokenize", &json!({ "tokens": ids["tokens"] }));
    assert_eq!(back["content"], text);
    let (_, prompt) = server.post("/tokenize", &json!({ "prompt": text }));
    let (_, answer) = server.post(
        "/v1/completions",
        &json!({ "prompt": text, "max_tokens": 1 }),
    );
    assert_eq!(
        prompt["count"].as_u64().unwrap(),
        usage(&answer, "prompt_tokens")
    );
    for (path, body, named) in [
        ("/tokenize", json!({ "text": "x" }), "text"),
        ("/tokenize", json!({}), "content"),
        ("/detokenize", json!({ "tokens": [1_000_000] }), "tokens"),
    ] {
        let (status, reply) = server.post(path, &body);
        assert_eq!(status, 400, "{reply}");
        assert!(
            reply["error"]["message"].as_str().unwrap().contains(named),
            "{reply}"
        );
    }
}

#[test]
fn each_request_logs_one_line_and_quiet_keeps_only_server_errors() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let lines = |server: &Server| -> Vec<String> {
        // A stream's line comes when it ends, which curl has seen by now; give the log
        // reader a moment.
        std::thread::sleep(Duration::from_millis(200));
        server
            .log
            .lock()
            .unwrap()
            .lines()
            .filter(|l| l.contains(" POST /v1/"))
            .map(str::to_string)
            .collect()
    };
    for quiet in [false, true] {
        let mut extra = vec!["64", "16", "16", "USAGE_SAVE=0"];
        if quiet {
            extra.insert(0, "-q");
        }
        let server = Server::start(&snap, &extra, &[]);
        let (status, _) = server.post("/v1/completions", &completion(&[1, 2, 3], 4));
        assert_eq!(status, 200);
        let mut streamed = completion(&[1, 2, 3, 4], 4);
        streamed["stream"] = json!(true);
        let (status, _) = server.curl("/v1/completions", Some(&streamed.to_string()), &[]);
        assert_eq!(status, 200);
        let (status, _) = server.post("/v1/completions", &json!({ "prompt": "x", "best_of": 2 }));
        assert_eq!(status, 400);
        let logged = lines(&server);
        if quiet {
            assert!(logged.is_empty(), "-q logged {logged:?}");
            continue;
        }
        assert_eq!(logged.len(), 3, "{logged:?}");
        assert!(
            logged[0].contains("POST /v1/completions 200")
                && logged[0].contains("prompt 3 (0 cached) | completion 4"),
            "{logged:?}"
        );
        assert!(
            logged[1].contains("POST /v1/completions 200")
                && logged[1].contains("completion 4")
                && logged[1].contains("tok/s"),
            "{logged:?}"
        );
        assert!(
            logged[2].contains("POST /v1/completions 400") && logged[2].contains("best_of"),
            "{logged:?}"
        );
    }
}

#[test]
fn anthropic_max_tokens_beyond_the_context_is_cut_to_it_and_openai_s_is_refused() {
    let dir = crate::common::fixture_with_config("olmoe_trained", |config| {
        config["max_position_embeddings"] = json!(24);
    });
    let server = Server::start(dir.path(), &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let (status, reply) = server.post(
        "/v1/messages",
        &json!({ "max_tokens": 64000, "messages": [{"role": "user", "content": "Hi"}] }),
    );
    assert_eq!(status, 200, "{reply}");
    let prompt = reply["usage"]["input_tokens"].as_u64().unwrap();
    let output = reply["usage"]["output_tokens"].as_u64().unwrap();
    assert!(prompt + output <= 24, "{reply}");
    let (status, reply) = server.post(
        "/v1/chat/completions",
        &json!({ "max_tokens": 64000, "messages": [{"role": "user", "content": "Hi"}] }),
    );
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["code"], "context_length_exceeded");
}
