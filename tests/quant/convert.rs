//! `coli convert` on every committed fixture whose engine this build runs, then the engine
//! on the converted container: exact at 16 bits (every cache size), token-identical to
//! quantising the float checkpoint at load, greedy-equal to the float reference where the
//! fixture's margins allow; resumption, refusals, the on-disk layout; and FP8 and MXFP4
//! inputs end to end.

use crate::common;

use std::path::{Path, PathBuf};

use coli::quant::{self, Format, Matrix, Width};
use coli::snapshot::Snapshot;
use common::{coli, fixture, fixture_with_config, read_shard, stderr, stdout, write_shard, Tensor};
use safetensors::Dtype;

/// Fixture directories with a reference whose engine this build runs.
fn fixtures() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixture(""))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("ref.json").exists())
        .filter(|e| {
            Snapshot::open(&e.path())
                .ok()
                .is_some_and(|s| coli::engines::resolve(None, &s).is_ok())
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert!(names.iter().any(|n| n == "olmoe_tiny"), "{names:?}");
    names
}

fn convert(src: &Path, dst: &Path, args: &[&str]) {
    let mut argv = vec!["convert", src.to_str().unwrap(), dst.to_str().unwrap()];
    argv.extend_from_slice(args);
    let out = coli(&argv, &[]);
    assert!(
        out.status.success(),
        "convert {argv:?}: {}{}",
        stdout(&out),
        stderr(&out)
    );
    assert!(stdout(&out).contains("converted "), "{}", stdout(&out));
}

/// The oracle lines of a run (timings removed): teacher-forced and greedy.
fn oracle_lines(snap: &Path, args: &[&str]) -> (String, String) {
    let line = |extra: &[&str], key: &str| {
        let snap_arg = format!("SNAP={}", snap.display());
        let mut argv = vec![snap_arg.as_str()];
        argv.extend_from_slice(extra);
        argv.extend_from_slice(args);
        let out = coli(&argv, &[]);
        assert!(
            out.status.success(),
            "{argv:?}: {}{}",
            stdout(&out),
            stderr(&out)
        );
        let text = stdout(&out);
        let found = text
            .lines()
            .find(|l| l.contains(key))
            .unwrap_or_else(|| panic!("{key} in {text}"));
        found.split(" | ").next().unwrap().to_string()
    };
    (
        line(&["TF=1"], "PREFILL (teacher-forcing) vs oracle"),
        line(&[], "Matching tokens"),
    )
}

fn full(lines: &(String, String)) -> bool {
    let complete = |line: &str| {
        let counts = line
            .rsplit(": ")
            .next()
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap();
        let (a, b) = counts.split_once('/').unwrap();
        a == b
    };
    complete(&lines.0) && complete(&lines.1)
}

#[test]
fn a_16_bit_container_is_exact_at_every_cache_size() {
    let temp = tempfile::tempdir().unwrap();
    for name in fixtures() {
        let dst = temp.path().join(&name);
        convert(&fixture(&name), &dst, &["--bits", "16"]);
        for cap in ["1", "2", "64"] {
            let lines = oracle_lines(&dst, &["ORACLE_STRICT=1", cap, "16", "16"]);
            assert!(full(&lines), "{name} cap {cap}: {lines:?}");
        }
    }
}

#[test]
fn a_container_computes_what_quantising_at_load_computes() {
    let temp = tempfile::tempdir().unwrap();
    for name in fixtures() {
        let dst = temp.path().join(format!("{name}-8"));
        convert(&fixture(&name), &dst, &["--bits", "8", "--io-bits", "16"]);
        let at_load = oracle_lines(&fixture(&name), &["64", "8", "8"]);
        // The container's EBITS/DBITS do not matter: every matrix is pre-quantised.
        assert_eq!(
            oracle_lines(&dst, &["64", "16", "16"]),
            at_load,
            "{name} int8"
        );
        assert_eq!(
            oracle_lines(&dst, &["1", "8", "8"]),
            at_load,
            "{name} int8 cap 1"
        );
    }
    for name in ["olmoe_tiny", "olmoe_tiny_b"] {
        // Rows of at most 64 columns: int4 in groups of 64 is int4 per row either way.
        let dst = temp.path().join(format!("{name}-4"));
        convert(&fixture(name), &dst, &["--bits", "4", "--io-bits", "4"]);
        assert_eq!(
            oracle_lines(&dst, &["64", "16", "16"]),
            oracle_lines(&fixture(name), &["64", "4", "4"]),
            "{name} int4"
        );
    }
}

#[test]
fn int8_containers_keep_the_reference_tokens_where_margins_allow() {
    // These fixtures' margins hold under int8 weights (embedding and head included); the
    // MLA fixtures' do not, which the previous test covers by equality instead.
    let temp = tempfile::tempdir().unwrap();
    for name in fixtures()
        .iter()
        .filter(|n| n.starts_with("olmoe") || n.starts_with("inkling"))
    {
        let dst = temp.path().join(name);
        convert(&fixture(name), &dst, &[]);
        for cap in ["1", "64"] {
            let lines = oracle_lines(&dst, &[cap, "16", "16"]);
            assert!(full(&lines), "{name} cap {cap}: {lines:?}");
        }
    }
}

/// `(name, start, end)` of every tensor in a shard, in file order.
fn layout(shard: &Path) -> Vec<(String, usize, usize)> {
    let bytes = std::fs::read(shard).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let mut entries: Vec<(String, usize, usize)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let offsets = v["data_offsets"].as_array().unwrap();
            (
                k.clone(),
                offsets[0].as_u64().unwrap() as usize,
                offsets[1].as_u64().unwrap() as usize,
            )
        })
        .collect();
    entries.sort_by_key(|e| e.1);
    entries
}

#[test]
fn each_expert_is_one_contiguous_read_and_every_matrix_is_stamped() {
    let temp = tempfile::tempdir().unwrap();
    let dst = temp.path().join("c");
    convert(&fixture("olmoe_tiny"), &dst, &[]);
    let shard = dst.join("model-00001-of-00001.safetensors");
    let entries = layout(&shard);
    let p = "model.layers.1.mlp.experts.5";
    let expected: Vec<String> = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
        .iter()
        .map(|m| format!("{p}.{m}"))
        .chain(
            [
                "gate_proj.weight.qs",
                "up_proj.weight.qs",
                "down_proj.weight.qs",
            ]
            .iter()
            .map(|m| format!("{p}.{m}")),
        )
        .collect();
    let first = entries.iter().position(|e| e.0 == expected[0]).unwrap();
    let run: Vec<&(String, usize, usize)> = entries[first..first + 6].iter().collect();
    assert_eq!(
        run.iter().map(|e| e.0.clone()).collect::<Vec<_>>(),
        expected
    );
    assert!(
        run.windows(2).all(|w| w[0].2 == w[1].1),
        "contiguous: {run:?}"
    );
    // Float tensors come first and stay 4-byte aligned.
    let first_quantised = entries.iter().position(|e| e.0.ends_with(".qs")).unwrap();
    assert!(entries[..first_quantised.saturating_sub(1)]
        .iter()
        .all(|e| e.1.is_multiple_of(4)));

    let snapshot = Snapshot::open(&dst).unwrap();
    for (name, shape, format) in [
        (format!("{p}.down_proj.weight"), [64, 32], Format::Int8Row),
        (
            "model.layers.0.self_attn.q_proj.weight".to_string(),
            [64, 64],
            Format::Int8Row,
        ),
        ("lm_head.weight".to_string(), [128, 64], Format::Int8Row),
        (
            "model.layers.0.mlp.gate.weight".to_string(),
            [8, 64],
            Format::F32,
        ),
    ] {
        let view = coli::quant::format::shaped(snapshot.tensor(&name).unwrap(), &shape).unwrap();
        assert_eq!(
            Matrix::load(&view, Width::F32).unwrap().format(),
            format,
            "{name}"
        );
        let stamped = format != Format::F32;
        assert_eq!(
            view.stamp.as_deref(),
            stamped.then(|| format.name()),
            "{name}"
        );
    }
    for side in ["config.json", "generation_config.json", "ref.json"] {
        assert!(dst.join(side).exists(), "{side}");
    }
}

#[test]
fn an_interrupted_conversion_resumes_and_a_foreign_one_is_refused() {
    let temp = tempfile::tempdir().unwrap();
    let dst = temp.path().join("c");
    let small = ["--shard-gb", "0.00005"];
    convert(&fixture("olmoe_tiny"), &dst, &small);
    let mut shards: Vec<PathBuf> = std::fs::read_dir(&dst)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shards.sort();
    assert!(shards.len() >= 3, "{shards:?}");
    // As an interruption leaves it: one shard missing, another half-written under its
    // temporary name.
    std::fs::remove_file(&shards[1]).unwrap();
    let partial = dst.join(format!(
        ".{}.partial",
        shards[2].file_name().unwrap().to_string_lossy()
    ));
    std::fs::write(&partial, b"half a shard").unwrap();
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            dst.to_str().unwrap(),
            "--shard-gb",
            "0.00005",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("({} already complete)", shards.len() - 1)),
        "{}",
        stdout(&out)
    );
    assert!(!partial.exists());
    let lines = oracle_lines(&dst, &["64", "16", "16"]);
    assert!(full(&lines), "{lines:?}");

    // Other options into the same directory, or any non-empty directory, are refused.
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            dst.to_str().unwrap(),
            "--bits",
            "4",
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    // A finished conversion is said to be one, with what differs; nothing was stopped, so
    // there is nothing to resume.
    assert!(
        err.contains("holds a finished conversion made with --expert-bits 8 (this command: 4)"),
        "{err}"
    );
    assert!(!err.contains("rerun"), "{err}");
    // A record that cannot be read is said to be that, naming it.
    let record = dst.join(".coli-convert.json");
    let kept = std::fs::read(&record).unwrap();
    std::fs::write(&record, b"{\"source\": ").unwrap();
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            dst.to_str().unwrap(),
            "--shard-gb",
            "0.00005",
        ],
        &[],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(&format!("{}: it is not valid JSON", record.display()))
            && err.contains("remove the directory"),
        "{err}"
    );
    assert!(
        !err.contains("other options") && !err.contains("rerun"),
        "{err}"
    );
    std::fs::write(&record, kept).unwrap();
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            fixture("olmoe_tiny_b").to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not empty"), "{}", stderr(&out));
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            temp.path().join("d").to_str().unwrap(),
            "--bits",
            "3",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("--expert-bits 3"), "{}", stderr(&out));
}

/// The OLMoE fixture's tensors, with `edit` deciding each tensor's replacement(s).
fn rewrite_fixture(dst: &Path, edit: impl Fn(&str, &[usize], Vec<f32>) -> Vec<Tensor>) {
    let src = fixture("olmoe_tiny");
    std::fs::create_dir_all(dst).unwrap();
    for side in ["config.json", "generation_config.json", "ref.json"] {
        std::fs::copy(src.join(side), dst.join(side)).unwrap();
    }
    let mut tensors = Vec::new();
    for (name, _, shape, bytes) in read_shard(&src.join("model.safetensors")) {
        let values: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        tensors.extend(edit(&name, &shape, values));
    }
    write_shard(&dst.join("model.safetensors"), &tensors, None);
}

fn f32_tensor(name: &str, shape: &[usize], values: &[f32]) -> Tensor {
    (
        name.to_string(),
        Dtype::F32,
        shape.to_vec(),
        values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    )
}

fn quantised_matrix(name: &str, rank: usize) -> bool {
    rank == 2 && !name.contains("norm") && !name.ends_with("mlp.gate.weight")
}

#[test]
fn fp8_and_mxfp4_checkpoints_run_and_convert() {
    let temp = tempfile::tempdir().unwrap();
    // FP8 as published: every matrix F8_E4M3 with 128x128 f32 block scales.
    let fp8 = temp.path().join("fp8");
    rewrite_fixture(&fp8, |name, shape, values| {
        if !quantised_matrix(name, shape.len()) {
            return vec![f32_tensor(name, shape, &values)];
        }
        let (codes, scales) = quant::quantize_fp8_blocks(&values, shape[1]);
        vec![
            (name.to_string(), Dtype::F8_E4M3, shape.to_vec(), codes),
            f32_tensor(
                &format!("{name}_scale_inv"),
                &[shape[0].div_ceil(128), shape[1].div_ceil(128)],
                &scales,
            ),
        ]
    });
    // The same checkpoint dequantised to f32 by the converter is e4m3 · scale exactly.
    let widened = temp.path().join("fp8-16");
    convert(&fp8, &widened, &["--bits", "16"]);
    let name = "model.layers.2.self_attn.o_proj.weight";
    let stored = Snapshot::open(&fp8).unwrap();
    let fp8_matrix = Matrix::load(
        &coli::quant::format::shaped(stored.tensor(name).unwrap(), &[64, 64]).unwrap(),
        Width::F32,
    )
    .unwrap();
    assert_eq!(fp8_matrix.format(), Format::Fp8E4m3B128);
    let out = Snapshot::open(&widened).unwrap();
    let f32_matrix = Matrix::load(
        &coli::quant::format::shaped(out.tensor(name).unwrap(), &[64, 64]).unwrap(),
        Width::F32,
    )
    .unwrap();
    assert_eq!(f32_matrix.format(), Format::F32);
    assert_eq!(fp8_matrix.to_f32(), f32_matrix.to_f32());
    // The FP8 checkpoint runs directly, computing what its f32 dequantisation computes.
    assert_eq!(
        oracle_lines(&fp8, &["64", "16", "16"]),
        oracle_lines(&widened, &["64", "16", "16"])
    );
    // And converts to int8.
    let int8 = temp.path().join("fp8-8");
    convert(&fp8, &int8, &[]);
    oracle_lines(&int8, &["2", "16", "16"]);

    // MXFP4 experts in a container: U8 codes with E8M0 `.qs` exponents.
    let mxfp4 = temp.path().join("mxfp4");
    let dequantised = temp.path().join("mxfp4-f32");
    for (dir, keep_codes) in [(&mxfp4, true), (&dequantised, false)] {
        rewrite_fixture(dir, |name, shape, values| {
            if !name.contains(".experts.") {
                return vec![f32_tensor(name, shape, &values)];
            }
            let (packed, exponents) = quant::quantize_mxfp4(&values, shape[1]);
            if !keep_codes {
                let matrix =
                    Matrix::from_f32_as(shape[0], shape[1], &values, Format::Mxfp4).unwrap();
                return vec![f32_tensor(name, shape, &matrix.to_f32())];
            }
            vec![
                (name.to_string(), Dtype::U8, vec![packed.len()], packed),
                (
                    format!("{name}.qs"),
                    Dtype::U8,
                    vec![exponents.len()],
                    exponents,
                ),
            ]
        });
    }
    assert_eq!(
        oracle_lines(&mxfp4, &["64", "16", "16"]),
        oracle_lines(&dequantised, &["64", "16", "16"])
    );
    // The converter copies pre-quantised experts byte for byte.
    let copied = temp.path().join("mxfp4-copy");
    convert(&mxfp4, &copied, &["--bits", "16"]);
    assert_eq!(
        oracle_lines(&copied, &["1", "16", "16"]),
        oracle_lines(&mxfp4, &["1", "16", "16"])
    );
}

#[test]
fn fp8_and_mxfp4_containers_compute_what_their_encoding_of_the_source_computes() {
    let temp = tempfile::tempdir().unwrap();
    let container = temp.path().join("minifloat");
    convert(
        &fixture("olmoe_tiny"),
        &container,
        &[
            "--expert-bits",
            "mxfp4",
            "--dense-bits",
            "fp8",
            "--io-bits",
            "fp8",
        ],
    );
    // The same formats applied to the f32 checkpoint in memory, written back as f32.
    let encoded = temp.path().join("encoded-f32");
    rewrite_fixture(&encoded, |name, shape, values| {
        if !quantised_matrix(name, shape.len()) {
            return vec![f32_tensor(name, shape, &values)];
        }
        let format = if name.contains(".experts.") {
            Format::Mxfp4
        } else {
            Format::Fp8E4m3B128
        };
        let matrix = Matrix::from_f32_as(shape[0], shape[1], &values, format).unwrap();
        vec![f32_tensor(name, shape, &matrix.to_f32())]
    });
    let stored = Snapshot::open(&container).unwrap();
    for (name, shape, format) in [
        (
            "model.layers.0.mlp.experts.3.down_proj.weight",
            [64, 32],
            Format::Mxfp4,
        ),
        (
            "model.layers.1.self_attn.q_proj.weight",
            [64, 64],
            Format::Fp8E4m3B128,
        ),
        ("lm_head.weight", [128, 64], Format::Fp8E4m3B128),
    ] {
        let view = coli::quant::format::shaped(stored.tensor(name).unwrap(), &shape).unwrap();
        assert_eq!(view.stamp.as_deref(), Some(format.name()), "{name}");
        assert_eq!(Matrix::load(&view, Width::F32).unwrap().format(), format);
    }
    for cap in ["1", "64"] {
        assert_eq!(
            oracle_lines(&container, &[cap, "16", "16"]),
            oracle_lines(&encoded, &[cap, "16", "16"]),
            "cap {cap}"
        );
    }
    // A name that is neither a width nor a format is refused, naming what is accepted.
    let out = coli(
        &[
            "convert",
            fixture("olmoe_tiny").to_str().unwrap(),
            temp.path().join("d").to_str().unwrap(),
            "--expert-bits",
            "nf4",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("fp8 or mxfp4"), "{}", stderr(&out));
}

#[test]
fn the_engine_declares_what_stays_f32_and_convert_asks_it() {
    let src = fixture_with_config("glm_moe_dsa_tiny", |config| {
        config.as_object_mut().unwrap().remove("model_type");
    });
    let out_dir = tempfile::tempdir().unwrap();
    let dst = out_dir.path().join("int4");
    let argv = |extra: &[&'static str]| {
        let mut argv = vec![
            "convert".to_string(),
            src.path().display().to_string(),
            dst.display().to_string(),
            "--bits".to_string(),
            "4".to_string(),
        ];
        argv.extend(extra.iter().map(|s| s.to_string()));
        argv
    };
    let run = |extra: &[&'static str]| {
        let args = argv(extra);
        coli(&args.iter().map(String::as_str).collect::<Vec<_>>(), &[])
    };

    // Without model_type nobody says what stays f32: refused before anything is written.
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("has no model_type; pass --model ENGINE"),
        "{}",
        stderr(&out)
    );
    assert!(!dst.exists());
    let out = run(&["--model", "glm5"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("invalid value 'glm5' for '--model <ENGINE>'"),
        "{}",
        stderr(&out)
    );
    assert!(!dst.exists());

    // Named, the engine's declaration keeps the indexer's head weights f32 at 4 bits.
    let out = run(&["--model", "glm_moe_dsa"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let snapshot = Snapshot::open(&dst).unwrap();
    let indexer = snapshot
        .tensor("model.layers.0.self_attn.indexer.weights_proj.weight")
        .unwrap();
    assert_eq!(indexer.dtype, Dtype::F32);
    let query = snapshot
        .tensor("model.layers.0.self_attn.indexer.wq_b.weight")
        .unwrap();
    assert_ne!(
        query.dtype,
        Dtype::F32,
        "the indexer's other matrices are quantised"
    );

    // Asked for as another engine's checkpoint, nothing keeps them f32: the declaration,
    // not a rule of names, decided.
    let other = out_dir.path().join("as-olmoe");
    let args = [
        "convert",
        src.path().to_str().unwrap(),
        other.to_str().unwrap(),
        "--bits",
        "4",
        "--model",
        "olmoe",
    ];
    let out = coli(&args, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let snapshot = Snapshot::open(&other).unwrap();
    let indexer = snapshot
        .tensor("model.layers.0.self_attn.indexer.weights_proj.weight")
        .unwrap();
    assert_ne!(indexer.dtype, Dtype::F32);
}
