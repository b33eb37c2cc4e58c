//! Helpers shared by the integration tests: running the built binary (and the test binary
//! itself, for a test that needs a process of its own); copying fixtures and rewriting a
//! copy's JSON files and shards; the weight formats the kernel tests cover.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use coli::quant::Format;
use serde_json::Value;

/// One conversation with an engine: the engine and the state its forwards fill, for tests
/// that follow a single sequence.
pub struct Conversation {
    pub engine: Box<dyn coli::engines::Engine>,
    pub state: coli::engines::State,
}

impl Conversation {
    pub fn new(engine: Box<dyn coli::engines::Engine>) -> Conversation {
        let state = engine.new_state();
        Conversation { engine, state }
    }

    /// `tokens` after the positions held: every position's logits (`all`) or the last's.
    pub fn forward(&mut self, tokens: &[u32], all: bool) -> anyhow::Result<Vec<f32>> {
        let logits = if all {
            coli::engines::Logits::All
        } else {
            coli::engines::Logits::Last
        };
        self.engine.forward_one(&mut self.state, tokens, logits)
    }

    pub fn reset(&mut self) {
        self.state = self.engine.new_state();
    }

    pub fn position(&self) -> usize {
        self.state.position()
    }

    pub fn vocab_size(&self) -> usize {
        self.engine.vocab_size()
    }
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// A `coli` command with `args`, with none of the settings' variables inherited from the
/// caller.
pub fn coli_command(args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_coli"));
    command.args(args);
    for key in coli::settings::KEYS {
        command.env_remove(key.name);
    }
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// Run `coli` with `args`, with none of the settings' variables inherited from the caller.
pub fn coli(args: &[&str], env: &[(&str, &str)]) -> Output {
    coli_command(args, env)
        .output()
        .expect("the coli binary runs")
}

/// The harness's name for test `name` of the module at `module` (`module_path!()` there):
/// the path within the test binary, as `--exact` takes it.
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_, within)) => format!("{within}::{name}"),
        None => name.to_string(),
    }
}

/// Names the test a child of [`in_own_process`] runs.
const OWN_PROCESS: &str = "COLI_TEST_OWN_PROCESS";

/// Whether to run the body of test `name` of the module at `module` here. In the harness's
/// process this runs the test binary again for that test alone, asserts that it passed, and
/// returns `false`; in that child it returns `true`. For a test of process-wide state (an
/// installed device) that must not share its process with the other tests of its binary.
pub fn in_own_process(module: &str, name: &str) -> bool {
    let test = test_name(module, name);
    if std::env::var_os(OWN_PROCESS).is_some_and(|running| running == test.as_str()) {
        return true;
    }
    let out = Command::new(std::env::current_exe().expect("the test binary's path"))
        .args(["--exact", &test, "--test-threads=1"])
        .env(OWN_PROCESS, &test)
        .output()
        .expect("the test binary runs again");
    assert!(
        out.status.success() && stdout(&out).contains("1 passed"),
        "{test} in a process of its own: {}{}",
        stdout(&out),
        stderr(&out)
    );
    false
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A private copy of a fixture directory that a test may damage.
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temporary directory");
    copy_fixture_to(name, dir.path());
    dir
}

/// Copy fixture `name`'s files into directory `dst`, made if it is not there.
pub fn copy_fixture_to(name: &str, dst: &Path) {
    std::fs::create_dir_all(dst).expect("fixture copy's directory");
    for entry in std::fs::read_dir(fixture(name)).expect("fixture exists") {
        let entry = entry.expect("fixture entry");
        // Histories a run left next to the committed fixture are not part of it.
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        std::fs::copy(entry.path(), dst.join(entry.file_name())).expect("copy fixture file");
    }
}

/// The JSON file at `path`.
pub fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Rewrite the JSON file at `path` with `edit` applied to its value (a file not there yet
/// starts as `{}`).
pub fn edit_json(path: &Path, edit: impl FnOnce(&mut Value)) {
    let mut json = if path.exists() {
        read_json(path)
    } else {
        serde_json::json!({})
    };
    edit(&mut json);
    std::fs::write(path, json.to_string()).expect("write the JSON file");
}

/// A private copy of fixture `name` whose `config.json` `edit` changed.
pub fn fixture_with_config(name: &str, edit: impl FnOnce(&mut Value)) -> tempfile::TempDir {
    let dir = copy_fixture(name);
    edit_json(&dir.path().join("config.json"), edit);
    dir
}

/// The model's own part of a `config.json`: its `text_config` where it has one (a
/// checkpoint that wraps the language model), else the whole file.
pub fn text_config(config: &mut Value) -> &mut Value {
    if config.get("text_config").is_some() {
        &mut config["text_config"]
    } else {
        config
    }
}

/// One tensor of a shard as the tests build and edit them: name, dtype, shape and bytes.
pub type Tensor = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// The tensors of the shard at `path`.
pub fn read_shard(path: &Path) -> Vec<Tensor> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let parsed = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            )
        })
        .collect()
}

/// Write `tensors` as the shard at `path`, with `metadata` in its header (e.g. a
/// `colibri.fmt` stamp). A file already there is replaced, never written through.
pub fn write_shard(path: &Path, tensors: &[Tensor], metadata: Option<HashMap<String, String>>) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(name, dtype, shape, data)| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(*dtype, shape.clone(), data)
                    .expect("bytes that fit the dtype and shape"),
            )
        })
        .collect();
    if path.exists() {
        std::fs::remove_file(path).expect("remove the old shard");
    }
    safetensors::serialize_to_file(views, metadata, path).expect("write the shard");
}

/// Rewrite the shard `model.safetensors` of directory `dir` with `edit` applied to its
/// tensors.
pub fn rewrite_shard(dir: &Path, edit: impl FnOnce(&mut Vec<Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = read_shard(&path);
    edit(&mut tensors);
    write_shard(&path, &tensors, None);
}

/// Run the oracle on committed fixture `name` with `ORACLE_STRICT=1` at `cap` slots per layer
/// (teacher-forced or greedy), assert that it passed with every position matching its
/// `ref.json`, and return stdout and stderr for further checks.
pub fn oracle_exact(
    model: Option<&str>,
    name: &str,
    cap: usize,
    teacher_forced: bool,
) -> (String, String) {
    oracle_exact_with(model, name, cap, teacher_forced, &[])
}

/// [`oracle_exact`] with extra `KEY=VALUE` settings (a backend, a GPU tier).
pub fn oracle_exact_with(
    model: Option<&str>,
    name: &str,
    cap: usize,
    teacher_forced: bool,
    settings: &[&str],
) -> (String, String) {
    let reference = read_json(&fixture(name).join("ref.json"));
    let count = |key: &str| reference[key].as_array().map_or(0, Vec::len);
    let (full, prompt) = (count("full_ids"), count("prompt_ids"));
    let snap = format!("SNAP={}", fixture(name).display());
    let cap = cap.to_string();
    let mut args: Vec<&str> = Vec::new();
    if let Some(model) = model {
        args.extend(["--model", model]);
    }
    args.push(&snap);
    if teacher_forced {
        args.push("TF=1");
    }
    args.extend(settings);
    args.extend(["ORACLE_STRICT=1", &cap, "16", "16"]);
    let out = coli(&args, &[]);
    let (text, errors) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "{name} cap {cap}: {text}{errors}");
    let expected = if teacher_forced {
        format!("PREFILL (teacher-forcing) vs oracle: {full}/{full} positions")
    } else {
        format!("Matching tokens: {}/{}", full - prompt, full - prompt)
    };
    assert!(text.contains(&expected), "{name} cap {cap}: {text}");
    (text, errors)
}

/// Every weight format with kernels, int4-grouped once for each size in `groups` (the groups
/// a test's shapes make partial or whole), in one order: f32, bf16, f16, int8 rows, int4
/// rows, the groups, fp8 blocks, mxfp4.
pub fn kernel_formats(groups: &[usize]) -> Vec<Format> {
    let mut formats = vec![
        Format::F32,
        Format::Bf16,
        Format::F16,
        Format::Int8Row,
        Format::Int4Row,
    ];
    formats.extend(groups.iter().map(|&group| Format::Int4Grouped { group }));
    formats.extend([Format::Fp8E4m3B128, Format::Mxfp4]);
    formats
}

/// `len` values in [-1, 1) from a fixed xorshift sequence: random-looking test data that is
/// the same on every run.
pub fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// The eight experts of MoE layer `layer` of the `olmoe_tiny` fixture (hidden 64, width 32).
pub fn olmoe_tiny_experts(
    snapshot: &coli::snapshot::Snapshot,
    layer: usize,
) -> Vec<coli::experts::ExpertTensors> {
    (0..8)
        .map(|e| {
            let p = format!("model.layers.{layer}.mlp.experts.{e}");
            coli::experts::ExpertTensors {
                gate: snapshot.tensor(&format!("{p}.gate_proj.weight")).unwrap(),
                up: snapshot.tensor(&format!("{p}.up_proj.weight")).unwrap(),
                down: snapshot.tensor(&format!("{p}.down_proj.weight")).unwrap(),
            }
            .checked(64, 32)
            .unwrap()
        })
        .collect()
}
