//! `coli chat` as a person at a terminal uses it: the binary on a pseudo-terminal of its own
//! (its controlling terminal, so Ctrl-C is a signal while an answer streams and a key at the
//! prompt), keys typed as a terminal sends them, on the trained fixture with short answers.
//! What the model was sent is read back through `/save`.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{coli_command, fixture, read_json};

const ENTER: &str = "\r";
const LEFT: &str = "\x1b[D";
const UP: &str = "\x1b[A";
const CTRL_C: &str = "\x03";
const CTRL_D: &str = "\x04";
/// The prompt at the start of a line (the line editor goes back to the first column first).
const PROMPT: &str = "\n\r> ";

/// How long a test waits for what it expects before it fails.
const PATIENCE: Duration = Duration::from_secs(30);

/// A prompt the trained fixture answers greedily with text that does not end a line.
const OPEN_ENDED: &str = "The licence grants you";

/// `coli chat` on a pseudo-terminal: what it wrote (stdout and stderr alike, as a terminal
/// shows them) and the keys to type.
struct Terminal {
    child: Child,
    keys: File,
    screen: Arc<Mutex<Vec<u8>>>,
    /// How far [`Terminal::expect`] has read.
    seen: usize,
    /// Where the history and the files the test writes go (until [`Terminal::leave`]).
    dir: Option<tempfile::TempDir>,
}

impl Terminal {
    /// `coli chat` with `args` after the fixture and a history of its own, at the prompt.
    fn start(args: &[&str]) -> Terminal {
        let dir = tempfile::tempdir().unwrap();
        let snap = format!("SNAP={}", fixture("olmoe_trained").display());
        let history = format!("COLI_USAGE={}", dir.path().join("usage").display());
        let mut all = vec!["chat", snap.as_str(), history.as_str(), "TEMP=0"];
        all.extend_from_slice(args);
        let (mut master, mut slave) = (-1, -1);
        let size = libc::winsize {
            ws_row: 40,
            ws_col: 200,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: the two descriptors are written by openpty, which reads only `size`.
        let opened = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &size,
            )
        };
        assert_eq!(opened, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: openpty opened both and nothing else owns them.
        let (master, slave) = unsafe { (File::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let mut command = coli_command(&all, &[("TERM", "xterm")]);
        command
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: between fork and exec the child calls only async-signal-safe functions.
        unsafe {
            command.pre_exec(|| {
                // A session of its own whose controlling terminal is the pseudo-terminal.
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("coli chat starts");
        drop(command);
        let screen = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().unwrap();
        let into = screen.clone();
        std::thread::spawn(move || {
            let mut buffer = [0u8; 4096];
            // Ends when the child's side is closed (EIO).
            while let Ok(n @ 1..) = reader.read(&mut buffer) {
                into.lock().unwrap().extend_from_slice(&buffer[..n]);
            }
        });
        let mut terminal = Terminal {
            child,
            keys: master,
            screen,
            seen: 0,
            dir: Some(dir),
        };
        terminal.expect("/exit or Ctrl-D leaves");
        terminal.expect("> ");
        terminal
    }

    /// Everything the terminal was shown so far, less the control sequences that move the
    /// cursor and set modes.
    fn screen(&self) -> String {
        plain(&String::from_utf8_lossy(&self.screen.lock().unwrap()))
    }

    /// Wait until `text` is shown after what was expected before; what was shown up to its
    /// end.
    fn expect(&mut self, text: &str) -> String {
        let start = Instant::now();
        loop {
            let screen = self.screen();
            if let Some(at) = screen.get(self.seen..).and_then(|rest| rest.find(text)) {
                self.seen += at + text.len();
                return screen[..self.seen].to_string();
            }
            assert!(
                start.elapsed() < PATIENCE,
                "{text:?} not shown after {:?}:\n{screen}",
                &screen[self.seen.min(screen.len())..]
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn type_keys(&mut self, keys: &str) {
        self.keys.write_all(keys.as_bytes()).unwrap();
        self.keys.flush().unwrap();
    }

    /// Type `line` and Enter, and wait for `shows` to be shown, then the next prompt.
    fn enter(&mut self, line: &str, shows: &str) {
        self.type_keys(&format!("{line}{ENTER}"));
        self.expect(shows);
        self.expect(PROMPT);
    }

    /// Send `message` and wait for its turn's line and the next prompt.
    fn ask(&mut self, message: &str) {
        self.type_keys(&format!("{message}{ENTER}"));
        self.expect(" generated (");
        self.expect(PROMPT);
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.as_ref().expect("the chat is on").path().join(name)
    }

    /// The conversation as `/save` writes it.
    fn saved(&mut self) -> Value {
        let path = self.path("saved.json");
        self.enter(&format!("/save {}", path.display()), "saved to");
        read_json(&path)
    }

    /// Ctrl-D at the prompt; the exit status.
    fn leave(mut self) -> (Option<i32>, String, tempfile::TempDir) {
        self.type_keys(CTRL_D);
        let start = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if start.elapsed() > PATIENCE {
                let _ = self.child.kill();
                panic!("Ctrl-D did not end the chat:\n{}", self.screen());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let dir = self.dir.take().expect("the chat is on");
        (status.code(), self.screen(), dir)
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `shown` without its escape sequences (`ESC [ parameters final`, or `ESC` and one
/// character); one cut off at the end is left out whole.
fn plain(shown: &str) -> String {
    let mut out = String::with_capacity(shown.len());
    let mut chars = shown.chars();
    while let Some(c) = chars.next() {
        if c != '\x1b' {
            out.push(c);
            continue;
        }
        if chars.next() == Some('[') {
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) {
                    break;
                }
            }
        }
    }
    out
}

/// The text of each message of a saved conversation.
fn contents(saved: &Value) -> Vec<String> {
    saved["messages"]
        .as_array()
        .unwrap_or_else(|| panic!("{saved}"))
        .iter()
        .map(|m| m["content"].as_str().unwrap().to_string())
        .collect()
}

fn user_messages(saved: &Value) -> Vec<String> {
    contents(saved).into_iter().step_by(2).collect()
}

#[test]
fn left_arrow_and_a_key_edit_the_line_the_model_gets() {
    let mut chat = Terminal::start(&["NGEN=2"]);
    chat.ask(&format!("helo{LEFT}l"));
    assert_eq!(user_messages(&chat.saved()), ["hello"]);
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
}

#[test]
fn up_arrow_recalls_the_line_before() {
    let mut chat = Terminal::start(&["NGEN=2"]);
    chat.ask("first");
    chat.ask("second");
    chat.ask(UP);
    let saved = chat.saved();
    assert_eq!(user_messages(&saved), ["first", "second", "second"]);
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
}

#[test]
fn commands_are_answered_without_generating() {
    let mut chat = Terminal::start(&["NGEN=2"]);
    chat.enter("/help", "/load FILE");
    chat.enter("/stats", "no turn yet");
    chat.enter("/retry", "/retry: unknown command");
    let saved = chat.saved();
    assert_eq!(contents(&saved), Vec::<String>::new());
    let (status, screen, dir) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
    assert!(!screen.contains(" generated ("), "{screen}");
    // Nothing was routed, so no history was written.
    assert!(!dir.path().join("usage").exists(), "{screen}");
}

#[test]
fn the_system_prompt_from_the_flag_and_the_command_is_in_the_conversation() {
    let mut chat = Terminal::start(&["--system", "Be kind.", "NGEN=2"]);
    assert_eq!(chat.saved()["system"], "Be kind.");
    chat.enter("/system Be brief.", "system prompt set");
    chat.enter("/system", "system prompt: Be brief.");
    chat.ask("hi");
    chat.enter("/reset", "a new conversation");
    let saved = chat.saved();
    assert_eq!(saved["system"], "Be brief.", "{saved}");
    assert_eq!(contents(&saved), Vec::<String>::new());
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
}

#[test]
fn load_names_what_is_wrong_and_a_bad_file_changes_nothing() {
    let mut chat = Terminal::start(&["NGEN=2"]);
    chat.ask("hi");
    let before = chat.saved();
    let bad = chat.path("bad.json");
    std::fs::write(
        &bad,
        r#"{"system": null, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}"#,
    )
    .unwrap();
    chat.enter(
        &format!("/load {}", bad.display()),
        r#"messages[1].role: expected "assistant""#,
    );
    assert!(chat.screen().contains("the conversation is unchanged"));
    assert_eq!(chat.saved(), before);
    let good = chat.path("good.json");
    let conversation = serde_json::json!({
        "system": "Answer in French.",
        "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    });
    std::fs::write(&good, conversation.to_string()).unwrap();
    chat.enter(&format!("/load {}", good.display()), "loaded");
    assert_eq!(chat.saved(), conversation);
    chat.ask("c");
    assert_eq!(user_messages(&chat.saved()), ["a", "c"]);
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
}

#[test]
fn ctrl_c_at_the_prompt_says_how_to_leave_and_the_chat_goes_on() {
    let mut chat = Terminal::start(&["NGEN=2"]);
    chat.type_keys(CTRL_C);
    chat.expect("to leave: /exit, or Ctrl-D");
    chat.expect(PROMPT);
    chat.ask("hi");
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
    assert!(!screen.contains("stops after this token"), "{screen}");
}

#[test]
fn ctrl_d_leaves_with_status_0_and_the_history_saved() {
    let mut chat = Terminal::start(&["NGEN=2"]);
    chat.ask("hi");
    let (status, screen, dir) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
    let history = std::fs::read_to_string(dir.path().join("usage")).unwrap();
    assert!(!history.trim().is_empty(), "{screen}");
    assert!(!screen.contains("[serve]"), "{screen}");
}

#[test]
fn the_turn_line_begins_a_line_after_an_answer_that_does_not_end_one() {
    let mut chat = Terminal::start(&["NGEN=6"]);
    chat.type_keys(&format!("{OPEN_ENDED}{ENTER}"));
    let shown = chat.expect(" generated (");
    chat.expect(PROMPT);
    let answer = contents(&chat.saved())[1].clone();
    // What the test is about: an answer whose last line is open.
    assert!(!answer.is_empty() && !answer.ends_with('\n'), "{answer:?}");
    let line = shown.rfind("[chat] ").unwrap();
    let before = &shown[..line];
    // The terminal turns the answer's newline into CR LF.
    let last_words = answer.lines().last().unwrap();
    assert!(before.ends_with(&format!("{last_words}\r\n")), "{shown:?}");
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
}

#[test]
fn ctrl_c_while_an_answer_streams_stops_it_and_keeps_what_it_said() {
    let mut chat = Terminal::start(&["NGEN=4000"]);
    chat.type_keys(&format!("Tell me a story{ENTER}"));
    let asked = chat.expect("story").len();
    // Some of the answer, then Ctrl-C.
    let start = Instant::now();
    while chat.screen().len() < asked + 100 {
        assert!(start.elapsed() < PATIENCE, "{}", chat.screen());
        std::thread::sleep(Duration::from_millis(5));
    }
    chat.type_keys(CTRL_C);
    let shown = chat.expect("(interrupted)");
    chat.expect(PROMPT);
    let turn = &shown[shown.rfind("[chat] ").unwrap()..];
    let generated: usize = turn
        .split(" generated")
        .next()
        .and_then(|head| head.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{turn}"));
    assert!(generated > 0 && generated < 4000, "{turn}");
    let saved = chat.saved();
    assert_eq!(user_messages(&saved), ["Tell me a story"]);
    assert!(!contents(&saved)[1].is_empty(), "{saved}");
    let (status, screen, _) = chat.leave();
    assert_eq!(status, Some(0), "{screen}");
}

#[test]
fn without_a_terminal_lines_are_read_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("saved.json");
    let history = format!("COLI_USAGE={}", dir.path().join("usage").display());
    let snap = format!("SNAP={}", fixture("olmoe_trained").display());
    let mut child = coli_command(
        &["chat", "--system", "S", &snap, &history, "TEMP=0", "NGEN=2"],
        &[],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let script = format!("hi\n/help\n\nthere\n/save {}\n", saved.display());
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let conversation = read_json(Path::new(&saved));
    assert_eq!(conversation["system"], "S");
    assert_eq!(user_messages(&conversation), ["hi", "there"]);
    assert_eq!(err.matches(" generated (").count(), 2, "{err}");
    // stdout holds the answers alone, each ending a line.
    let answers = String::from_utf8_lossy(&out.stdout);
    assert!(
        !answers.contains("[chat]") && !answers.contains("> ") && answers.ends_with('\n'),
        "{answers:?}"
    );
}
