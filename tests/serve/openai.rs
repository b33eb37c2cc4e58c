//! `coli serve` as the official `openai` and `anthropic` Python clients see it:
//! tests/serve/openai_client.py lists the model, asks for chat and text completions whole
//! and streamed (greedy, so both give the same text and token counts) and checks that errors
//! arrive as the client's exception types; tests/serve/anthropic_client.py does the same
//! with Messages; tests/serve/tools_client.py has both call tools and ask for structured
//! output on the fixtures whose models have a syntax for calls; tests/serve/responses_client.py
//! drives `/v1/responses` with the `openai` client (text on OLMoE, calls and their results on
//! Kimi K3). The interpreter is `COLI_TEST_PYTHON`, else `python3`; it must have both
//! packages (.ci/run installs them), and the tests fail, not skip, when it has not.

use crate::common;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use common::{coli_command, copy_fixture};

/// How long the server may take to say it is listening.
const START_LIMIT: Duration = Duration::from_secs(60);
/// How long the client script may run.
const SCRIPT_LIMIT: Duration = Duration::from_secs(180);

/// A child process killed (and reaped) however the test ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A running `coli serve`: its base URL and everything it has written on stderr so far.
struct Server {
    _child: Killed,
    url: String,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    fn start(snap: &Path) -> Server {
        let snap = format!("SNAP={}", snap.display());
        let args = [
            "serve",
            &snap,
            "--port",
            "0",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ];
        let mut child = coli_command(&args, &[])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the coli binary starts");
        let pipe = child.stderr.take().expect("stderr is piped");
        let child = Killed(child);
        let stderr = Arc::new(Mutex::new(String::new()));
        let (lines, listening) = mpsc::channel();
        let seen = stderr.clone();
        // Reads stderr to its end, so that the server never blocks on a full pipe.
        thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                seen.lock().unwrap().push_str(&format!("{line}\n"));
                let _ = lines.send(line);
            }
        });
        let started = Instant::now();
        let url = loop {
            let left = START_LIMIT.saturating_sub(started.elapsed());
            match listening.recv_timeout(left) {
                Ok(line) if line.starts_with("[serve] ") => {
                    if let Some(url) = line
                        .split_once(" on ")
                        .and_then(|(_, rest)| rest.split_whitespace().next())
                        .filter(|url| url.starts_with("http://"))
                    {
                        break url.to_string();
                    }
                }
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "coli serve did not say it was listening within {START_LIMIT:?}; stderr:\n{}",
                    stderr.lock().unwrap()
                ),
                Err(mpsc::RecvTimeoutError::Disconnected) => panic!(
                    "coli serve ended before listening; stderr:\n{}",
                    stderr.lock().unwrap()
                ),
            }
        };
        Server {
            _child: child,
            url,
            stderr,
        }
    }
}

/// The interpreter to run the client with, checked to have `package`.
pub(crate) fn python(package: &str) -> String {
    let python = std::env::var("COLI_TEST_PYTHON").unwrap_or_else(|_| "python3".to_string());
    let fix = format!(
        "install it with `python3 -m pip install {package}`, or point COLI_TEST_PYTHON at a \
         Python that has it (.ci/run does this)"
    );
    let probe = Command::new(&python)
        .args(["-c", &format!("import {package}")])
        .stdin(Stdio::null())
        .output();
    match probe {
        Ok(out) if out.status.success() => python,
        Ok(out) => panic!(
            "{python} cannot import the `{package}` package: {fix}\n{}",
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(err) => panic!("cannot run {python:?} ({err}): {fix}"),
    }
}

/// Runs `command` to its end, or kills it after `limit` and fails the test.
pub(crate) fn run_limited(mut command: Command, limit: Duration, what: &str) -> Output {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|err| panic!("{what} does not start: {err}"));
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                let _ = pipe.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let out = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let err = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let mut child = Killed(child);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.0.try_wait().expect("wait for the child") {
            break status;
        }
        assert!(
            started.elapsed() < limit,
            "{what}: still running after {limit:?}, killed"
        );
        thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

#[test]
fn the_openai_python_client_talks_to_coli_serve() {
    run_client("openai", "openai_client.py", "olmoe_trained", |url| {
        url.to_string()
    });
}

#[test]
fn tool_calls_and_structured_output_reach_both_clients() {
    for fixture in ["kimi_k3_tiny", "glm_moe_dsa_tiny"] {
        run_client("anthropic", "tools_client.py", fixture, |url| {
            url.trim_end_matches("/v1").to_string()
        });
    }
}

#[test]
fn responses_text_whole_and_streamed_through_the_openai_client() {
    run_client("openai", "responses_client.py", "olmoe_trained", |url| {
        url.to_string()
    });
}

#[test]
fn responses_function_calls_and_their_results_through_the_openai_client() {
    run_client("openai", "responses_client.py", "kimi_k3_tiny", |url| {
        url.to_string()
    });
}

#[test]
fn the_anthropic_python_client_talks_to_coli_serve() {
    // Anthropic's clients take the server's root, without `/v1`.
    run_client("anthropic", "anthropic_client.py", "olmoe_trained", |url| {
        url.trim_end_matches("/v1").to_string()
    });
}

/// Run tests/serve/`script` with the interpreter that has `package`, against a server on
/// `fixture` at the URL `base` makes of its `/v1` URL.
fn run_client(package: &str, script: &str, fixture: &str, base: impl Fn(&str) -> String) {
    let python = python(package);
    let dir = copy_fixture(fixture);
    let server = Server::start(dir.path());
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("serve")
        .join(script);
    let url = base(&server.url);
    let mut command = Command::new(&python);
    command.arg(&path).arg(&url);
    let what = format!("tests/serve/{script}");
    let out = run_limited(command, SCRIPT_LIMIT, &what);
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success() && stdout.lines().any(|line| line == "OK"),
        "`{python} {what} {url}`: {}\nstdout:\n{stdout}\nstderr:\n{stderr}\nserver stderr:\n{}",
        out.status,
        server.stderr.lock().unwrap()
    );
}
