//! `coli usage show | merge | migrate` through the binary and the library: reports,
//! sums that keep every count, refusals named by file, and atomic output.

use crate::common;

use std::path::{Path, PathBuf};

use coli::route_trace::{history, save, Counters, EngineId, Trust};
use coli::tools::usage;
use common::{coli, stderr, stdout};
use proptest::prelude::*;

fn table(n_layers: usize, n_experts: usize, recs: &[(usize, usize, u32)]) -> Counters {
    let mut t = Counters::new(n_layers, n_experts).unwrap();
    for &(l, e, c) in recs {
        assert!(t.admit(l as i64, e as i64, c));
    }
    t
}

fn write_history(dir: &Path, name: &str, engine: &str, t: &Counters) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, save::render(t, EngineId::of(engine))).unwrap();
    p
}

fn iku1(n_layers: u32, n_experts: u32, cells: &[(u32, u32, u32)]) -> Vec<u8> {
    let mut words = vec![0x3155_4B49u32, n_layers, n_experts];
    let mut body = vec![0u32; (n_layers * n_experts) as usize];
    for &(l, e, c) in cells {
        body[(l * n_experts + e) as usize] = c;
    }
    words.extend(body);
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// Reads a history back as `engine` would.
fn read_back(path: &Path, engine: &str, n_layers: usize, n_experts: usize) -> Counters {
    let mut t = Counters::new(n_layers, n_experts).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let report = history::parse(&bytes, engine, Trust::Found, &mut t).expect("accepted");
    assert!(report.is_complete(), "{report:?}");
    t
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

#[test]
fn show_reports_header_totals_layers_and_verdict() {
    let dir = tempfile::tempdir().unwrap();
    let t = table(5, 8, &[(3, 2, 2), (3, 5, 1), (3, 7, 1), (1, 0, 6)]);
    let h = write_history(dir.path(), "u", "glm_moe_dsa", &t);
    let out = coli(&["usage", "show", p(&h)], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("engine      glm_moe_dsa (id 3815245270)"),
        "{text}"
    );
    assert!(text.contains("shape       5 layers x 8 experts"), "{text}");
    assert!(
        text.contains("selections  10 across 4 distinct experts"),
        "{text}"
    );
    assert!(
        text.contains("glm_moe_dsa with 5 layers x 8 experts loads it"),
        "{text}"
    );
    assert!(
        text.contains("    3           4        3  2:2 50.0%"),
        "{text}"
    );

    let out = coli(&["usage", "show", p(&h), "--json", "--top", "1"], &[]);
    assert!(out.status.success());
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["layout"], "text");
    assert_eq!(j["engine"], "glm_moe_dsa");
    assert_eq!(j["engine_id"], 3_815_245_270u64);
    assert_eq!(j["n_layers"], 5);
    assert_eq!(j["selections"], 10);
    assert_eq!(j["complete"], true);
    assert_eq!(j["layers"][0]["layer"], 1);
    assert_eq!(j["layers"][1]["top"][0]["expert"], 2);
    assert_eq!(j["layers"][1]["top"].as_array().unwrap().len(), 1);
}

#[test]
fn show_says_what_an_engine_would_do() {
    let dir = tempfile::tempdir().unwrap();
    let cases: [(&str, &[u8], &str); 6] = [
        (
            "future",
            b"-1 5 8\n-2 2 3815245270\n3 2 9\n",
            "every engine refuses it",
        ),
        ("legacy", b"3 2 2\n3 5 1\n", "no header"),
        ("empty", b"", "an empty history"),
        (
            "stopped",
            b"-1 5 8\n-2 1 3815245270\n3 2 2\nbad 1 1\n",
            "Not read completely",
        ),
        (
            "unknown",
            b"-1 5 8\n-2 1 12345\n3 2 2\n",
            "written by an unknown engine (id 12345)",
        ),
        (
            "conflict",
            b"-1 5 8\n-1 6 8\n3 2 2\n",
            "history is 6 layers x 8 experts",
        ),
    ];
    for (name, bytes, want) in cases {
        let f = dir.path().join(name);
        std::fs::write(&f, bytes).unwrap();
        let out = coli(&["usage", "show", p(&f)], &[]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert!(stdout(&out).contains(want), "{name}: {}", stdout(&out));
    }
    let f = dir.path().join("ink");
    std::fs::write(&f, iku1(2, 4, &[(1, 3, 7)])).unwrap();
    let out = coli(&["usage", "show", p(&f), "--json"], &[]);
    let j: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(j["layout"], "iku1");
    assert_eq!(j["engine"], "inkling");
    assert_eq!(j["selections"], 7);
    assert!(j["verdict"].as_str().unwrap().contains("migrate"));
}

#[test]
fn missing_file_is_exit_2_naming_it() {
    let out = coli(&["usage", "show", "/nonexistent/dir/u"], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("/nonexistent/dir/u"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn merge_sums_and_writes_what_an_engine_writes() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_history(
        dir.path(),
        "a",
        "olmoe",
        &table(3, 8, &[(0, 1, 5), (2, 7, 1)]),
    );
    let b = write_history(
        dir.path(),
        "b",
        "olmoe",
        &table(3, 8, &[(0, 1, 2), (1, 0, 4)]),
    );
    let o = dir.path().join("out");
    let out = coli(&["usage", "merge", p(&a), p(&b), "-o", p(&o)], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("12 selections across 3 distinct experts"));
    let want = table(3, 8, &[(0, 1, 7), (1, 0, 4), (2, 7, 1)]);
    assert_eq!(
        std::fs::read_to_string(&o).unwrap(),
        save::render(&want, EngineId::of("olmoe"))
    );
    assert_eq!(read_back(&o, "olmoe", 3, 8), want);
    // An existing output is replaced only with --force; then it may be an input.
    let before = std::fs::read(&a).unwrap();
    let out = coli(&["usage", "merge", p(&a), p(&o), "-o", p(&a)], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("exists: --force replaces it"),
        "{}",
        stderr(&out)
    );
    assert_eq!(std::fs::read(&a).unwrap(), before);
    let out = coli(
        &["usage", "merge", p(&a), p(&o), "-o", p(&a), "--force"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(read_back(&a, "olmoe", 3, 8).get(0, 1), 12);
    // The same file twice would count it twice, whatever the spelling of its path.
    let again = dir.path().join(".").join("a");
    let out = coli(
        &["usage", "merge", p(&a), p(&again), "-o", p(&o), "--force"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("are the same file"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn merge_refuses_mismatches_by_name_and_leaves_the_output_alone() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_history(dir.path(), "a", "olmoe", &table(3, 8, &[(0, 1, 5)]));
    let ink = write_history(dir.path(), "ink", "inkling", &table(3, 8, &[(0, 2, 1)]));
    let wide = write_history(dir.path(), "wide", "olmoe", &table(3, 16, &[(0, 12, 3)]));
    let o = dir.path().join("out");
    let precious = "-1 3 8\n-2 1 3841822045\n0 0 9\n";
    std::fs::write(&o, precious).unwrap();

    let out = coli(&["usage", "merge", p(&a), p(&ink), "-o", p(&o)], &[]);
    assert_eq!(out.status.code(), Some(2));
    let e = stderr(&out);
    assert!(
        e.contains(&format!(
            "{} is olmoe's history, {} is inkling's",
            p(&a),
            p(&ink)
        )),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&o).unwrap(), precious);

    let out = coli(&["usage", "merge", p(&a), p(&wide), "-o", p(&o)], &[]);
    assert_eq!(out.status.code(), Some(2));
    let e = stderr(&out);
    assert!(
        e.contains("3 layers x 8 experts") && e.contains("3 layers x 16 experts"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&o).unwrap(), precious);

    let bad = dir.path().join("bad");
    std::fs::write(&bad, "-1 3 8\n-2 1 3841822045\n0 1 5\n0 x 1\n").unwrap();
    let out = coli(&["usage", "merge", p(&a), p(&bad), "-o", p(&o)], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("was not read completely"),
        "{}",
        stderr(&out)
    );

    // --force says what it did.
    let out = coli(
        &[
            "usage",
            "merge",
            p(&a),
            p(&ink),
            p(&wide),
            "-o",
            p(&o),
            "--force",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let e = stderr(&out);
    assert!(
        e.contains("--force: ") && e.contains("under olmoe's identity"),
        "{e}"
    );
    assert!(e.contains("wrote 3 layers x 16 experts"), "{e}");
    let merged = read_back(&o, "olmoe", 3, 16);
    assert_eq!(
        (merged.get(0, 1), merged.get(0, 2), merged.get(0, 12)),
        (5, 1, 3)
    );
}

#[test]
fn merge_refuses_a_file_no_engine_reads() {
    let dir = tempfile::tempdir().unwrap();
    let a = write_history(dir.path(), "a", "olmoe", &table(3, 8, &[(0, 1, 5)]));
    let future = dir.path().join("future");
    std::fs::write(&future, "-1 3 8\n-2 2 3841822045\n0 1 1\n").unwrap();
    let o = dir.path().join("out");
    let out = coli(
        &["usage", "merge", p(&a), p(&future), "-o", p(&o), "--force"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("format version 2"),
        "{}",
        stderr(&out)
    );
    assert!(!o.exists());
}

#[test]
fn merge_of_empty_histories_says_there_is_nothing_to_merge() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    std::fs::write(&a, "").unwrap();
    std::fs::write(&b, "").unwrap();
    let o = dir.path().join("out");
    let out = coli(&["usage", "merge", p(&a), p(&b), "-o", p(&o)], &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("nothing to merge"),
        "{}",
        stderr(&out)
    );
    assert!(!o.exists());
}

/// The selections a classic C reader totals: the third field of every record whose first
/// is not negative.
fn c_loop_total(text: &str) -> u64 {
    let fields: Vec<i64> = text
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    fields
        .chunks(3)
        .filter(|r| r[0] >= 0)
        .map(|r| r[2] as u64)
        .sum()
}

#[test]
fn migrate_rewrites_iku1_count_for_count_on_the_rows_that_route() {
    // The Inkling fixture: 7 layers of 8 experts, layer 0 dense.
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::copy_fixture_to("inkling_tiny", &model);
    let src = model.join(".coli_usage");
    std::fs::write(&src, iku1(7, 8, &[(3, 2, 7), (1, 5, 4), (0, 0, 1)])).unwrap();
    let o = dir.path().join("usage.txt");
    let out = coli(&["usage", "migrate", p(&src), "-o", p(&o)], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("migrated 11 selections"),
        "{}",
        stdout(&out)
    );
    assert!(
        stderr(&out).contains("left out 1 selections on row 0 (dense layers"),
        "{}",
        stderr(&out)
    );
    let text = std::fs::read_to_string(&o).unwrap();
    assert_eq!(text, "-1 7 8\n-2 1 2050583463\n1 5 4\n3 2 7\n");
    assert_eq!(c_loop_total(&text), 11);

    // Inkling's own load of the migrated file counts what the migration said.
    let mut loaded = Counters::new(7, 8).unwrap();
    loaded.drop_row(0);
    loaded.drop_row(7);
    history::parse(text.as_bytes(), "inkling", Trust::Found, &mut loaded).unwrap();
    assert_eq!(loaded.total(), 11);

    // Away from its model, the history needs --snap; another model's shape is refused.
    let alone = dir.path().join("usage.iku1");
    std::fs::copy(&src, &alone).unwrap();
    let out = coli(
        &["usage", "migrate", p(&alone), "-o", p(&o), "--force"],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--snap DIR"), "{}", stderr(&out));
    let fixture = common::fixture("inkling_tiny");
    let out = coli(
        &[
            "usage",
            "migrate",
            p(&alone),
            "-o",
            p(&o),
            "--force",
            "--snap",
            p(&fixture),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    std::fs::write(&alone, iku1(4, 8, &[(3, 2, 7)])).unwrap();
    let out = coli(
        &[
            "usage",
            "migrate",
            p(&alone),
            "-o",
            p(&o),
            "--force",
            "--snap",
            p(&fixture),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("it is another model's history"),
        "{}",
        stderr(&out)
    );
    let olmoe = common::fixture("olmoe_tiny");
    let out = coli(
        &[
            "usage",
            "migrate",
            p(&alone),
            "-o",
            p(&o),
            "--force",
            "--snap",
            p(&olmoe),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("holds a olmoe model"),
        "{}",
        stderr(&out)
    );
    let src = alone;
    let snap_args = ["--snap", p(&fixture)];

    let not = dir.path().join("text");
    std::fs::copy(&o, &not).unwrap();
    let out = coli(
        &[
            &["usage", "migrate", p(&not), "-o", p(&o), "--force"][..],
            &snap_args,
        ]
        .concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("is not an IKU1 history"),
        "{}",
        stderr(&out)
    );

    let mut cut = iku1(7, 8, &[(1, 1, 3), (3, 2, 7)]);
    cut.truncate(12 + 8 * 2 * 4 + 5);
    std::fs::write(&src, &cut).unwrap();
    let out = coli(
        &[&["usage", "migrate", p(&src), "-o", p(&o)][..], &snap_args].concat(),
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("not read completely"),
        "{}",
        stderr(&out)
    );
    let out = coli(
        &[
            &["usage", "migrate", p(&src), "-o", p(&o), "--force"][..],
            &snap_args,
        ]
        .concat(),
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(&o).unwrap(),
        "-1 7 8\n-2 1 2050583463\n1 1 3\n"
    );
}

fn arb_table() -> impl Strategy<Value = Vec<(usize, usize, u32)>> {
    prop::collection::vec((0usize..4, 0usize..6, 1u32..1_000_000), 0..30)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn merge_preserves_every_count(a in arb_table(), b in arb_table(), c in arb_table()) {
        let dir = tempfile::tempdir().unwrap();
        let mut want = Counters::new(3, 6).unwrap();
        let mut paths = Vec::new();
        for (i, recs) in [a, b, c].iter().enumerate() {
            let mut t = Counters::new(3, 6).unwrap();
            for &(l, e, n) in recs {
                t.admit(l as i64, e as i64, n);
                want.admit(l as i64, e as i64, n);
            }
            paths.push(write_history(dir.path(), &format!("h{i}"), "kimi_k3", &t));
        }
        let o = dir.path().join("merged");
        // Records at layer 3 fall outside the 3-layer table, so every input may be empty.
        if want.distinct() == 0 {
            let err = usage::merge(&paths, &o, false).unwrap_err().to_string();
            prop_assert!(err.contains("nothing to merge"), "{}", err);
            prop_assert!(!o.exists());
        } else {
            usage::merge(&paths, &o, false).unwrap();
            prop_assert_eq!(read_back(&o, "kimi_k3", 3, 6), want);
        }
    }

    #[test]
    fn migrate_preserves_every_count_on_the_rows_that_route(cells in prop::collection::vec((0u32..7, 0u32..8, 0u32..u32::MAX), 0..35)) {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("in");
        std::fs::write(&src, iku1(7, 8, &cells)).unwrap();
        let o = dir.path().join("out");
        usage::migrate(&src, &o, Some(&common::fixture("inkling_tiny")), false).unwrap();
        let mut want = Counters::new(7, 8).unwrap();
        want.drop_row(0);
        want.drop_row(7);
        history::parse(&std::fs::read(&src).unwrap(), "inkling", Trust::Found, &mut want).unwrap();
        let mut plain = Counters::new(7, 8).unwrap();
        for (l, e, c) in want.nonzero() {
            plain.admit(l as i64, e as i64, c);
        }
        prop_assert_eq!(read_back(&o, "inkling", 7, 8), plain);
    }
}

#[test]
fn merge_adds_expert_transitions_edge_by_edge_and_keeps_them_grouped() {
    let dir = tempfile::tempdir().unwrap();
    let id = EngineId::of("olmoe").0;
    // 3 layers of 4 experts; source 0:1 (cell 1) -> layer 1, source 1:2 (cell 6) -> layer 2.
    let a = dir.path().join("a");
    std::fs::write(
        &a,
        format!("-1 3 4\n-2 1 {id}\n0 1 9\n1 2 9\n-3 1 1\n-4 2 6\n-4 3 3\n-3 6 2\n-4 0 5\n"),
    )
    .unwrap();
    let b = dir.path().join("b");
    std::fs::write(
        &b,
        format!("-1 3 4\n-2 1 {id}\n0 1 3\n1 2 3\n-3 1 1\n-4 3 4\n-4 0 1\n"),
    )
    .unwrap();
    let o = dir.path().join("merged");
    let out = coli(&["usage", "merge", p(&a), p(&b), "-o", p(&o)], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = std::fs::read_to_string(&o).unwrap();
    assert!(
        text.ends_with("-3 1 1\n-4 3 7\n-4 2 6\n-4 0 1\n-3 6 2\n-4 0 5\n"),
        "{text}"
    );
    assert_eq!(c_loop_total(&text), 24);
}
