//! The page at `/` and `GET /routing`: the events name experts of the shape the first one
//! gives, as a chat completion routes; the page is served (without the key, which
//! `/routing` needs); a stream open does not hold up the drain at SIGTERM; and
//! tests/serve/page_browser.py drives the page in headless Chromium (selenium), with and
//! without an API key: the answer streams in, the grid marks the last step's experts, Stop
//! stops the server's generation, Regenerate asks again. That test fails, not skips,
//! without selenium, chromium or chromedriver (.ci/run installs them).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::openai::{python, run_limited};
use super::server::{snapshot_copy, Server};

/// A `curl -N` reading server-sent events; its events arrive on `events` as
/// `(event, data)`.
struct EventStream {
    child: Child,
    events: mpsc::Receiver<(String, Value)>,
}

impl EventStream {
    fn open(server: &Server, path: &str, headers: &[&str]) -> EventStream {
        let mut command = Command::new("curl");
        command.args(["-sN", &server.url(path)]);
        for header in headers {
            command.args(["-H", header]);
        }
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("curl runs");
        let stdout = child.stdout.take().unwrap();
        let (send, events) = mpsc::channel();
        std::thread::spawn(move || {
            let mut event = String::new();
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(name) = line.strip_prefix("event: ") {
                    event = name.to_string();
                } else if let Some(data) = line.strip_prefix("data: ") {
                    let value = serde_json::from_str(data)
                        .unwrap_or_else(|e| panic!("event data {data:?}: {e}"));
                    if send.send((std::mem::take(&mut event), value)).is_err() {
                        return;
                    }
                }
            }
        });
        EventStream { child, events }
    }

    /// The next event, within `limit`.
    fn next(&self, limit: Duration) -> (String, Value) {
        self.events
            .recv_timeout(limit)
            .expect("an event arrives in time")
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A layer-by-expert table of numbers from the routing events.
fn counts(table: &Value) -> Vec<Vec<u64>> {
    table
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        })
        .collect()
}

#[test]
fn routing_events_name_the_experts_each_step_took_in_the_shape_given_first() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    // 8 slots a layer of 32 experts: some experts are resident, others not.
    let mut server = Server::start(&snap, &["8", "16", "16", "USAGE_SAVE=0"], &[]);

    // The page, and its files.
    let (status, html) = server.curl("/", None, &[]);
    assert_eq!(status, 200);
    assert!(html.starts_with("<!doctype html>") && html.contains("<canvas id=\"grid\""));
    for (path, needle) in [
        ("/page/app.js", "/v1/chat/completions"),
        ("/page/style.css", "#grid"),
    ] {
        let (status, text) = server.curl(path, None, &[]);
        assert_eq!(status, 200, "{path}");
        assert!(text.contains(needle), "{path}");
    }
    let head = Command::new("curl")
        .args(["-sI", &server.url("/")])
        .output()
        .unwrap();
    let head = String::from_utf8_lossy(&head.stdout).to_ascii_lowercase();
    assert!(
        head.contains("content-type: text/html; charset=utf-8"),
        "{head}"
    );
    assert!(
        head.contains("content-security-policy: default-src 'none'"),
        "{head}"
    );

    let stream = EventStream::open(&server, "/routing", &[]);
    let (event, shape) = stream.next(Duration::from_secs(10));
    assert_eq!(event, "shape", "{shape}");
    assert_eq!(shape["model"], "olmoe_trained");
    assert_eq!(shape["engine"], "olmoe");
    // OLMoE's four layers all route; the row after them (a draft head's) does not.
    assert_eq!(shape["layers"], 5);
    assert_eq!(shape["experts"], 32);
    assert_eq!(shape["moe_layers"], json!([0, 1, 2, 3]));
    assert_eq!(
        shape["residence_kinds"],
        json!(["none", "slot", "pin", "vram"])
    );
    let rows = shape["residence"].as_array().unwrap();
    assert_eq!(rows.len(), 5);
    assert!(rows.iter().all(|row| row.as_array().unwrap().len() == 32));
    assert_eq!(shape["heat"].as_array().unwrap().len(), 5);
    assert_eq!(shape["counters"]["tokens"], 0);

    let (status, answer) = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 12}),
    );
    assert_eq!(status, 200, "{answer}");
    let moe: Vec<u64> = (0..4).collect();
    let mut heat = counts(&shape["heat"]);
    let before: u64 = heat.iter().flatten().sum();
    let mut residence = counts(&shape["residence"]);
    let mut routed_cells = 0;
    let mut last_step = 0;
    let deadline = Instant::now() + Duration::from_secs(30);
    // Events until one counts the answer's 12 tokens: each names valid cells.
    loop {
        assert!(
            Instant::now() < deadline,
            "no event counted the answer's tokens"
        );
        let (event, step) = stream.next(Duration::from_secs(30));
        assert_eq!(event, "step", "{step}");
        let number = step["step"].as_u64().unwrap();
        assert!(number > last_step, "{step}");
        last_step = number;
        for entry in step["routed"].as_array().unwrap() {
            let layer = entry[0].as_u64().unwrap();
            assert!(moe.contains(&layer), "{step}");
            let experts = entry[1].as_array().unwrap();
            // OLMoE routes each token to 4 experts: a step took at least 4 in each layer.
            assert!(experts.len() >= 4, "{step}");
            for expert in experts {
                assert!(expert.as_u64().unwrap() < 32, "{step}");
                routed_cells += 1;
            }
        }
        for change in step["heat"].as_array().unwrap() {
            let (layer, expert, value) = (
                change[0].as_u64().unwrap() as usize,
                change[1].as_u64().unwrap() as usize,
                change[2].as_u64().unwrap(),
            );
            assert!(layer < 4 && expert < 32, "{step}");
            assert!(value > heat[layer][expert], "heat only grows: {step}");
            heat[layer][expert] = value;
        }
        for change in step["residence"].as_array().unwrap() {
            let (layer, expert, kind) = (
                change[0].as_u64().unwrap() as usize,
                change[1].as_u64().unwrap() as usize,
                change[2].as_u64().unwrap(),
            );
            assert!(layer < 4 && expert < 32 && kind < 4, "{step}");
            assert_ne!(residence[layer][expert], kind, "a change changes: {step}");
            residence[layer][expert] = kind;
        }
        let counters = &step["counters"];
        if counters["tokens"] == 12 {
            let lookups = ["vram", "pin", "lru"]
                .iter()
                .map(|k| counters["hits"][*k].as_u64().unwrap())
                .sum::<u64>()
                + counters["misses"].as_u64().unwrap();
            assert!(lookups > 0, "{step}");
            assert!(counters["rates"]["tokens_per_second"].as_f64().unwrap() > 0.0);
            break;
        }
    }
    assert!(routed_cells > 0);
    // Every selection of the turn is in the heat: 4 layers x 4 experts per computed position
    // (the prompt's and each generated token but the last).
    let prompt = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    let selections: u64 = heat.iter().flatten().sum::<u64>() - before;
    assert_eq!(selections, (prompt + 11) * 4 * 4);
    // With 8 slots for 32 experts, at most 8 of a layer are in memory.
    for row in &residence[..4] {
        assert!(
            row.iter().filter(|&&kind| kind == 1).count() <= 8,
            "{row:?}"
        );
    }

    // A stream open does not hold up the drain.
    let started = Instant::now();
    server.signal("TERM");
    assert_eq!(server.wait(), Some(0));
    assert!(started.elapsed() < Duration::from_secs(20));
}

#[test]
fn the_page_needs_no_key_and_routing_takes_the_guards_of_every_endpoint() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(
        &snap,
        &["64", "16", "16", "USAGE_SAVE=0", "API_KEY=s3cret"],
        &[],
    );
    assert_eq!(server.curl("/", None, &[]).0, 200);
    assert_eq!(server.curl("/page/app.js", None, &[]).0, 200);
    let (status, body) = server.curl("/routing", None, &[]);
    assert_eq!(status, 401, "{body}");
    let (status, body) = server.curl(
        "/routing",
        None,
        &[
            "Authorization: Bearer s3cret",
            "Origin: https://evil.example",
        ],
    );
    assert_eq!(status, 403, "{body}");
    let (status, body) = server.curl("/", None, &["Host: evil.example"]);
    assert_eq!(status, 403, "{body}");
    let stream = EventStream::open(&server, "/routing", &["Authorization: Bearer s3cret"]);
    assert_eq!(stream.next(Duration::from_secs(10)).0, "shape");
    let (status, body) = server.curl("/routing", Some("{}"), &["Authorization: Bearer s3cret"]);
    assert_eq!(status, 405, "{body}");
}

/// Runs tests/serve/page_browser.py against a server started with `extra` settings.
fn browse(extra: &[&str], script_args: &[&str]) {
    let python = python("selenium");
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    // The stopped answer asks for more tokens than the context holds.
    let mut args = vec!["64", "16", "16", "USAGE_SAVE=0", "LONG_CONTEXT=1"];
    args.extend_from_slice(extra);
    let server = Server::start(&snap, &args, &[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve/page_browser.py");
    let base = server.url("");
    let mut command = Command::new(&python);
    command.arg(&script).arg(&base).args(script_args);
    let out = run_limited(
        command,
        Duration::from_secs(240),
        "tests/serve/page_browser.py",
    );
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.lines().any(|line| line == "OK"),
        "`{python} tests/serve/page_browser.py {base}`: {}\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver stderr:\n{}",
        out.status,
        server.log.lock().unwrap()
    );
}

#[test]
fn the_page_chats_stops_and_shows_the_experts_in_a_browser() {
    browse(&[], &[]);
}

#[test]
fn the_page_asks_for_the_api_key_and_sends_it() {
    browse(&["API_KEY=s3cret"], &["--key", "s3cret"]);
}
