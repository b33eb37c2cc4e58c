//! Helpers shared by the routing telemetry's test modules: the C programs in `tests/c`,
//! compiled with the system C compiler at test time, and small file utilities.
#![allow(dead_code)] // each test module uses a different subset

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Compiles `tests/c/<name>.c` once per test process with `$CC` (default `cc`). Panics
/// when the compiler cannot be run: these tests check real C and must never pass without
/// it.
pub fn c_program(name: &'static str) -> PathBuf {
    static OLD_READER: OnceLock<PathBuf> = OnceLock::new();
    static PRINTF: OnceLock<PathBuf> = OnceLock::new();
    let cell = match name {
        "old_reader" => &OLD_READER,
        "printf_fixed" => &PRINTF,
        other => panic!("no C program {other}"),
    };
    cell.get_or_init(|| compile(name)).clone()
}

fn compile(name: &str) -> PathBuf {
    let (cc, origin) = match std::env::var("CC") {
        Ok(cc) => (cc, "$CC"),
        Err(_) => ("cc".to_string(), "the default, CC is unset"),
    };
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/c")
        .join(format!("{name}.c"));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    match Command::new(&cc)
        .args(["-O1", "-std=c99", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
    {
        Ok(s) if s.success() => out,
        Ok(s) => panic!(
            "C compiler {cc:?} ({origin}) failed to compile {}: {s}",
            src.display()
        ),
        Err(e) => panic!(
            "cannot run the C compiler {cc:?} ({origin}): {e}. These tests compare coli with \
             real C and do not pass without a compiler: install one (`apt-get install gcc`) \
             or point CC at a working C compiler (e.g. CC=gcc or CC=clang)."
        ),
    }
}

/// What the classic C loop made of a file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct OldRead {
    /// Every triple scanned, as the C variables held them.
    pub triples: Vec<(i32, i32, u32)>,
    /// Parallel to `triples`: admitted by `0 <= l <= n_layers && 0 <= e < n_experts`.
    pub admitted: Vec<bool>,
    /// Sum of admitted counts.
    pub total: i64,
}

impl OldRead {
    /// The admitted records in file order.
    pub fn records(&self) -> Vec<(i32, i32, u32)> {
        self.triples
            .iter()
            .zip(&self.admitted)
            .filter(|(_, &a)| a)
            .map(|(t, _)| *t)
            .collect()
    }
}

/// Runs `tests/c/old_reader.c` on `bytes`.
pub fn old_read(
    bin: &Path,
    dir: &Path,
    bytes: &[u8],
    n_layers: usize,
    n_experts: usize,
) -> OldRead {
    let file = dir.join("old_reader_input");
    std::fs::write(&file, bytes).expect("write input");
    let out = Command::new(bin)
        .arg(&file)
        .arg(n_layers.to_string())
        .arg(n_experts.to_string())
        .output()
        .expect("run old_reader");
    assert!(out.status.success(), "old_reader failed: {:?}", out);
    let text = String::from_utf8(out.stdout).expect("utf8");
    let mut r = OldRead::default();
    for line in text.lines() {
        let mut it = line.split(' ');
        let tag = it.next().expect("tag");
        let v: Vec<&str> = it.collect();
        let triple = || {
            (
                v[0].parse::<i32>().expect("l"),
                v[1].parse::<i32>().expect("e"),
                v[2].parse::<u32>().expect("c"),
            )
        };
        match tag {
            "T" => {
                r.triples.push(triple());
                r.admitted.push(false);
            }
            "A" => {
                assert_eq!(r.triples.last(), Some(&triple()), "A follows its T line");
                if let Some(a) = r.admitted.last_mut() {
                    *a = true;
                }
            }
            "TOTAL" => r.total = v[0].parse().expect("total"),
            other => panic!("unexpected old_reader line {other}"),
        }
    }
    r
}

/// Every line of a history has exactly three whitespace-separated fields (the C test's
/// tokeniser: separators space and tab, lines end at `\n`, `\r` or NUL).
pub fn every_record_has_three_fields(bytes: &[u8]) -> bool {
    bytes
        .split(|&b| b == b'\n' || b == b'\r' || b == 0)
        .filter(|l| !l.is_empty())
        .all(|l| {
            l.split(|&b| b == b' ' || b == b'\t')
                .filter(|f| !f.is_empty())
                .count()
                == 3
        })
}
