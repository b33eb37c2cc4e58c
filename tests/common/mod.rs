//! Helpers shared by the integration tests: running the built binary and copying fixtures.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// Run `coli` with `args`, with none of the settings' variables inherited from the caller.
pub fn coli(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_coli"));
    command.args(args);
    for key in coli::settings::KEYS {
        command.env_remove(key.name);
    }
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("the coli binary runs")
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
    for entry in std::fs::read_dir(fixture(name)).expect("fixture exists") {
        let entry = entry.expect("fixture entry");
        // Histories a run left next to the committed fixture are not part of it.
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).expect("copy fixture file");
    }
    dir
}
