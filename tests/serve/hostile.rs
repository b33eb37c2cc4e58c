//! `coli serve` against clients that misbehave, written byte by byte on raw sockets: heads
//! and bodies that stall or break off, malformed chunks, more connections than allowed,
//! requests from other sites' pages (their `Host`, `Origin` and `Content-Type`); and requests
//! for nothing (`max_tokens` 0) or for far more than the context holds.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use serde_json::{json, Value};

use crate::server::{completion, snapshot_copy, Server};

/// What the server sends on `stream` until it closes the connection. Panics if it is still
/// open after a minute: the server holds a connection it should have closed.
fn read_to_close(stream: &mut TcpStream) -> String {
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut got = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buffer[..n]),
            Err(err) if err.kind() == ErrorKind::ConnectionReset => break,
            Err(err) => panic!(
                "the server kept the connection open ({err}) after {:?}",
                String::from_utf8_lossy(&got)
            ),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A new connection on which `bytes` are written, as is.
fn send(port: u16, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream.write_all(bytes).unwrap();
    stream
}

/// A whole request (`Connection: close`) with these extra header lines; the response.
fn exchange(port: u16, path: &str, headers: &[&str], body: &str) -> String {
    let mut request = format!("POST {path} HTTP/1.1\r\nConnection: close\r\n");
    for header in headers {
        request += header;
        request += "\r\n";
    }
    request += &format!("Content-Length: {}\r\n\r\n{body}", body.len());
    read_to_close(&mut send(port, request.as_bytes()))
}

fn status(response: &str) -> u16 {
    response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("a status line in {response:?}"))
}

/// The error message of a response in OpenAI's shape.
fn message(response: &str) -> String {
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default();
    let value: Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("{response:?} is not JSON: {e}"));
    value["error"]["message"].as_str().unwrap().to_string()
}

const JSON: &str = "Content-Type: application/json";

#[test]
fn a_head_or_body_that_stalls_is_cut_off_by_its_timeout() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(
        &snap,
        &[
            "--header-timeout",
            "1",
            "--body-timeout",
            "1",
            "64",
            "16",
            "16",
            "USAGE_SAVE=0",
        ],
        &[],
    );
    let port = server.port;
    // Nothing at all, one byte, a head without its end: each connection is closed.
    for stall in [
        &b""[..],
        b"P",
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
    ] {
        let mut stream = send(port, stall);
        let answer = read_to_close(&mut stream);
        assert!(!answer.contains("200 OK"), "{answer}");
    }
    // A body shorter than its Content-Length, then nothing: 408 naming the timeout.
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    );
    let answer = read_to_close(&mut send(port, head.as_bytes()));
    assert_eq!(status(&answer), 408, "{answer}");
    assert!(message(&answer).contains("--body-timeout"), "{answer}");
    // A kept-alive connection waiting for its next request is closed as well.
    let request = completion(&[1, 2, 3], 1).to_string();
    let whole = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\nContent-Length: {}\r\n\r\n{request}",
        request.len()
    );
    let answer = read_to_close(&mut send(port, whole.as_bytes()));
    assert_eq!(status(&answer), 200, "{answer}");
}

#[test]
fn a_body_cut_short_or_badly_chunked_is_a_400_saying_so() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let port = server.port;
    let short = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\nContent-Length: 100\r\n\r\n{{\"prompt\": \"x\"}}"
    );
    let mut stream = send(port, short.as_bytes());
    stream.shutdown(Shutdown::Write).unwrap();
    let answer = read_to_close(&mut stream);
    assert_eq!(status(&answer), 400, "{answer}");
    let said = message(&answer);
    assert!(said.contains("could not be read after 15 bytes"), "{said}");
    for chunks in [
        "zz\r\n{}\r\n0\r\n\r\n",
        "5\r\n{\"prompt\": \"x\"}\r\n0\r\n\r\n",
    ] {
        let chunked = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n{chunks}"
        );
        let answer = read_to_close(&mut send(port, chunked.as_bytes()));
        assert_eq!(status(&answer), 400, "{chunks:?}: {answer}");
        assert!(message(&answer).contains("could not be read"), "{answer}");
    }
}

#[test]
fn connections_beyond_the_cap_get_503_and_the_drain_closes_stalled_ones() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    // Timeouts far beyond the test's patience: the drain, not they, must close the stalls.
    let mut server = Server::start(
        &snap,
        &[
            "--max-connections",
            "2",
            "--header-timeout",
            "3600",
            "--body-timeout",
            "3600",
            "64",
            "16",
            "16",
            "USAGE_SAVE=0",
        ],
        &[],
    );
    let port = server.port;
    let mut head = send(
        port,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n",
    );
    let body_head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{JSON}\r\nContent-Length: 100\r\n\r\n{{\"prompt\""
    );
    let mut body = send(port, body_head.as_bytes());
    let refused = read_to_close(&mut send(
        port,
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    ));
    assert_eq!(status(&refused), 503, "{refused}");
    assert!(
        refused.to_lowercase().contains("retry-after: 1"),
        "{refused}"
    );
    assert!(message(&refused).contains("--max-connections"), "{refused}");
    // Time for the server to be reading the stalled body when the drain begins.
    std::thread::sleep(Duration::from_millis(300));
    server.signal("TERM");
    let answer = read_to_close(&mut body);
    assert_eq!(status(&answer), 503, "{answer}");
    assert!(message(&answer).contains("stopping"), "{answer}");
    read_to_close(&mut head);
    assert_eq!(server.wait(), Some(0), "{}", server.log.lock().unwrap());
}

#[test]
fn json_bodies_need_their_content_type_and_other_sites_are_refused() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let body = completion(&[1, 2, 3], 1).to_string();
    let local = "Host: 127.0.0.1";
    {
        let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
        let port = server.port;
        let own_origin = format!("Origin: http://127.0.0.1:{port}");
        let own_host = format!("Host: 127.0.0.1:{port}");
        let named = format!("Host: localhost:{port}");
        for (headers, code, named_in_message) in [
            (
                vec![local, "Content-Type: text/plain"],
                415,
                "Content-Type \"text/plain\"",
            ),
            (vec![local], 415, "Content-Type missing"),
            (
                vec!["Host: evil.example", JSON],
                403,
                "Host \"evil.example\"",
            ),
            (
                vec![local, JSON, "Origin: https://evil.example"],
                403,
                "Origin \"https://evil.example\"",
            ),
            (vec![named.as_str(), JSON], 200, ""),
            (vec!["Host: [::1]", JSON], 200, ""),
            (vec![own_host.as_str(), JSON, own_origin.as_str()], 200, ""),
        ] {
            let answer = exchange(port, "/v1/completions", &headers, &body);
            assert_eq!(status(&answer), code, "{headers:?}: {answer}");
            if code != 200 {
                let said = message(&answer);
                assert!(said.contains(named_in_message), "{headers:?}: {said}");
            }
        }
        // On Anthropic's endpoint, in Anthropic's shape.
        let answer = exchange(port, "/v1/messages", &["Host: evil.example", JSON], "{}");
        assert_eq!(status(&answer), 403, "{answer}");
        assert!(answer.contains("\"type\":\"error\""), "{answer}");
    }
    let server = Server::start(
        &snap,
        &[
            "--allowed-host",
            "my-box.lan",
            "--cors-origin",
            "https://chat.example",
            "64",
            "16",
            "16",
            "USAGE_SAVE=0",
        ],
        &[],
    );
    let port = server.port;
    let answer = exchange(
        port,
        "/v1/completions",
        &["Host: MY-BOX.lan:9000", JSON],
        &body,
    );
    assert_eq!(status(&answer), 200, "{answer}");
    let answer = exchange(
        port,
        "/v1/completions",
        &[local, JSON, "Origin: https://chat.example"],
        &body,
    );
    assert_eq!(status(&answer), 200, "{answer}");
    assert!(
        answer
            .to_lowercase()
            .contains("access-control-allow-origin: https://chat.example"),
        "{answer}"
    );
    let answer = exchange(
        port,
        "/v1/completions",
        &[local, JSON, "Origin: https://other.example"],
        &body,
    );
    assert_eq!(status(&answer), 403, "{answer}");
}

#[test]
fn max_tokens_0_is_refused_on_chat_and_answered_without_a_forward_on_completions() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    let hi = json!([{"role": "user", "content": "Hi"}]);
    for (path, body, field) in [
        (
            "/v1/chat/completions",
            json!({"messages": hi, "max_tokens": 0}),
            "max_tokens 0",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": hi, "max_completion_tokens": 0, "max_tokens": 5}),
            "max_completion_tokens 0",
        ),
        (
            "/v1/messages",
            json!({"messages": hi, "max_tokens": 0}),
            "max_tokens 0",
        ),
        (
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 0}),
            "max_output_tokens 0",
        ),
    ] {
        let (status, reply) = server.post(path, &body);
        assert_eq!(status, 400, "{path}: {reply}");
        let said = reply["error"]["message"].as_str().unwrap();
        assert!(said.starts_with(field), "{path}: {said}");
    }
    let text = "The history of the river";
    let (_, counted) = server.post("/tokenize", &json!({ "prompt": text }));
    for echo in [false, true] {
        let (status, reply) = server.post(
            "/v1/completions",
            &json!({"prompt": text, "max_tokens": 0, "echo": echo, "n": 2}),
        );
        assert_eq!(status, 200, "{reply}");
        for choice in reply["choices"].as_array().unwrap() {
            assert_eq!(choice["text"], if echo { text } else { "" }, "{reply}");
            assert_eq!(choice["finish_reason"], "length", "{reply}");
        }
        assert_eq!(reply["usage"]["prompt_tokens"], counted["count"], "{reply}");
        assert_eq!(reply["usage"]["completion_tokens"], 0, "{reply}");
    }
    // Nothing was computed.
    assert_eq!(server.metric("coli_steps_total"), 0.0);
    assert_eq!(server.metric("coli_prompt_tokens_total"), 0.0);
}

#[test]
fn a_prompt_far_beyond_the_context_is_refused_by_its_length_alone() {
    let temp = tempfile::tempdir().unwrap();
    let snap = snapshot_copy(temp.path());
    let server = Server::start(&snap, &["64", "16", "16", "USAGE_SAVE=0"], &[]);
    // 4096 positions; no token of the fixture's vocabulary stands for more than 66 bytes.
    let prompt = "word ".repeat(200_000);
    for body in [
        json!({"prompt": prompt, "max_tokens": 1}),
        json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}),
    ] {
        let path = if body.get("prompt").is_some() {
            "/v1/completions"
        } else {
            "/v1/chat/completions"
        };
        let (status, reply) = server.post(path, &body);
        assert_eq!(status, 400, "{path}");
        assert_eq!(reply["error"]["code"], "context_length_exceeded");
        let said = reply["error"]["message"].as_str().unwrap();
        assert!(said.contains("bytes are at least"), "{said}");
    }
    // One that fits its bound is tokenized, and refused by its count.
    let prompt = "word ".repeat(20_000);
    let (status, reply) = server.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    );
    assert_eq!(status, 400);
    let said = reply["error"]["message"].as_str().unwrap();
    assert!(said.starts_with("the prompt takes"), "{said}");
}

#[test]
fn a_prompt_the_tokenizer_cannot_represent_stays_out_of_the_log() {
    let temp = tempfile::tempdir().unwrap();
    let snap = temp.path().join("olmoe_tiny");
    crate::common::copy_fixture_to("olmoe_tiny", &snap);
    // Characters the tiny vocabulary lacks, after a mark the log must not repeat.
    let prompt = format!("MARK-{}{}", "中".repeat(2000), "x".repeat(2000));
    for verbose in [false, true] {
        let mut extra = vec!["64", "16", "16", "USAGE_SAVE=0"];
        if verbose {
            extra.insert(0, "-v");
        }
        let server = Server::start(&snap, &extra, &[]);
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let body = if path == "/v1/completions" {
                json!({"prompt": prompt, "max_tokens": 1})
            } else {
                json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
            };
            let (status, reply) = server.post(path, &body);
            assert_eq!(status, 200, "{reply}");
        }
        std::thread::sleep(Duration::from_millis(200));
        let log = server.log.lock().unwrap().clone();
        let misread: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("cannot represent"))
            .collect();
        if verbose {
            assert_eq!(misread.len(), 2, "{log}");
            for line in misread {
                assert!(line.contains("bytes)") && line.len() < 400, "{line}");
            }
        } else {
            assert!(misread.is_empty(), "{log}");
            assert!(!log.contains("MARK-"), "{log}");
        }
    }
}
