//! Helpers shared by the text mode's test modules: committed fixtures paired with their
//! tokenizers (from `fixtures/tokenizers/`, copied into a private directory), the engines
//! loaded from them, and the parts of a text run's output.
#![allow(dead_code)] // each test module uses a different subset

use std::path::{Path, PathBuf};

use coli::engines::{self, Engine, LoadOptions};
use coli::snapshot::Snapshot;
use coli::text::TextTokenizer;

use crate::common::{copy_fixture, fixture};

/// Every committed fixture with the tokenizer made for its vocabulary.
pub const FIXTURES: &[(&str, &str)] = &[
    ("olmoe_tiny", "olmoe_128"),
    ("olmoe_tiny_b", "olmoe_128"),
    ("glm_moe_dsa_tiny", "glm_moe_dsa_128"),
    ("glm_moe_dsa_tiny_b", "glm_moe_dsa_128"),
    ("glm_moe_dsa_tiny_mtp", "glm_moe_dsa_128"),
    ("inkling_tiny", "inkling_250"),
    ("inkling_tiny_b", "inkling_197"),
];

/// The tokenizer files every fixture directory gets.
pub const TOKENIZER_FILES: &[&str] = &["tokenizer.json", "tokenizer_config.json"];

pub fn tokenizer_dir(name: &str) -> PathBuf {
    fixture("tokenizers").join(name)
}

/// A private copy of `fixture` with the tokenizer `tokenizer` in it.
pub fn text_fixture(fixture: &str, tokenizer: &str) -> tempfile::TempDir {
    let dir = copy_fixture(fixture);
    for file in TOKENIZER_FILES {
        std::fs::copy(tokenizer_dir(tokenizer).join(file), dir.path().join(file))
            .expect("copy tokenizer file");
    }
    dir
}

pub fn load_engine(dir: &Path) -> (Snapshot, Box<dyn Engine>) {
    let snapshot = Snapshot::open(dir).expect("fixture opens");
    let name = engines::resolve(None, &snapshot).expect("fixture names its engine");
    let engine = engines::load(name, &snapshot, LoadOptions::exact(64)).expect("fixture loads");
    (snapshot, engine)
}

pub fn tokenizer(dir: &Path) -> TextTokenizer {
    TextTokenizer::load(dir).expect("tokenizer loads")
}

/// A run's two streams: in text mode stdout is the generated text alone (and a final
/// newline); the banner, summary and cache lines are on stderr.
pub struct Run {
    pub stdout: String,
    pub stderr: String,
}

/// The streamed text of a text run: its stdout without the final newline.
pub fn streamed_text(run: &Run) -> &str {
    run.stdout
        .strip_suffix('\n')
        .expect("a text run ends its text with a newline")
}

/// `(generated, ending)` from the `[text]` summary line on stderr.
pub fn summary(run: &Run) -> (usize, String) {
    let line = run
        .stderr
        .lines()
        .rev()
        .find(|line| line.starts_with("[text] "))
        .expect("summary line");
    let part = line.split(" | ").nth(1).expect("generated part");
    let (count, rest) = part.split_once(" generated (").expect("generated count");
    (
        count.parse().expect("a count"),
        rest.trim_end_matches(')').to_string(),
    )
}

/// The ids an `IDS=` run printed.
pub fn generated_ids(stdout: &str) -> Vec<u32> {
    stdout
        .lines()
        .find(|line| !line.is_empty() && line.chars().all(|c| c.is_ascii_digit() || c == ' '))
        .unwrap_or_default()
        .split_whitespace()
        .map(|id| id.parse().expect("an id"))
        .collect()
}

pub fn snap(dir: &Path) -> String {
    format!("SNAP={}", dir.display())
}
