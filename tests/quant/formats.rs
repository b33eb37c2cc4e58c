//! Reading pre-quantised containers: the byte-count inference table, the int8-row vs
//! fp8-e4m3-b128 ambiguity and the other resolutions, the `colibri.fmt` stamp (agreeing,
//! disagreeing, unknown, malformed, conflicting across shards), the published FP8 and
//! compressed-tensors MXFP4 naming, colibri's merged OLMoE expert container, and bad
//! containers refused through the binary with exit code 2.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use coli::quant::{self, Format, Matrix, Width};
use coli::snapshot::Snapshot;
use common::{coli, copy_fixture, read_shard, rewrite_shard, stderr, stdout, write_shard, Tensor};
use safetensors::Dtype;

fn tensor(name: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>) -> Tensor {
    (name.to_string(), dtype, shape.to_vec(), bytes)
}

fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Write `tensors` as a shard `file` of `dir` (with an optional `colibri.fmt` stamp), and a
/// minimal config.json.
fn write_container(dir: &Path, file: &str, tensors: &[Tensor], stamp: Option<&str>) {
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    let metadata = stamp.map(|s| HashMap::from([("colibri.fmt".to_string(), s.to_string())]));
    write_shard(&dir.join(file), tensors, metadata);
}

/// The format `Matrix::load` gives `name` read as `shape`, or the error message.
fn load(dir: &Path, name: &str, shape: [usize; 2]) -> Result<Format, String> {
    let snapshot = Snapshot::open(dir).map_err(|e| format!("{e:#}"))?;
    let view =
        coli::quant::format::shaped(snapshot.tensor(name).map_err(|e| format!("{e:#}"))?, &shape)
            .map_err(|e| format!("{e:#}"))?;
    Matrix::load(&view, Width::F32)
        .map(|m| m.format())
        .map_err(|e| format!("{e:#}"))
}

/// A `.qs` container tensor pair with the given byte counts (contents irrelevant).
fn pair(name: &str, weight_bytes: usize, scales: usize) -> Vec<Tensor> {
    vec![
        tensor(name, Dtype::U8, &[weight_bytes], vec![0x88; weight_bytes]),
        tensor(
            &format!("{name}.qs"),
            Dtype::F32,
            &[scales],
            f32_bytes(&vec![0.5; scales]),
        ),
    ]
}

fn infer(
    shape: [usize; 2],
    weight_bytes: usize,
    scales: usize,
    stamp: Option<&str>,
) -> Result<Format, String> {
    let dir = tempfile::tempdir().unwrap();
    let stamp = stamp.map(|s| format!("{{\"w\": \"{s}\"}}"));
    write_container(
        dir.path(),
        "model.safetensors",
        &pair("w", weight_bytes, scales),
        stamp.as_deref(),
    );
    load(dir.path(), "w", shape)
}

#[test]
fn byte_counts_select_the_format() {
    // [O, I]                      weight bytes        scales         expected
    let table: &[([usize; 2], usize, usize, Format)] = &[
        ([16, 40], 16 * 40, 16, Format::Int8Row),
        ([16, 40], 16 * 20, 16, Format::Int4Row),
        ([16, 41], 16 * 21, 16, Format::Int4Row),
        (
            [16, 256],
            16 * 128,
            16 * 4,
            Format::Int4Grouped { group: 64 },
        ),
        (
            [16, 256],
            16 * 128,
            16 * 16,
            Format::Int4Grouped { group: 16 },
        ),
        (
            [16, 256],
            16 * 128,
            16 * 2,
            Format::Int4Grouped { group: 128 },
        ),
        // 200 columns: 4 groups of 64 (a 8-column tail group) and not 3 of 96 (too few).
        (
            [16, 200],
            16 * 100,
            16 * 4,
            Format::Int4Grouped { group: 64 },
        ),
        // 100 columns in two groups: 64 is the first size that gives two.
        (
            [16, 100],
            16 * 50,
            16 * 2,
            Format::Int4Grouped { group: 64 },
        ),
        ([256, 384], 256 * 384, 2 * 3, Format::Fp8E4m3B128),
        ([300, 130], 300 * 130, 3 * 2, Format::Fp8E4m3B128),
    ];
    for &(shape, nb, ns, want) in table {
        assert_eq!(infer(shape, nb, ns, None), Ok(want), "{shape:?} {nb} {ns}");
    }
}

#[test]
fn formats_without_kernels_and_unknown_counts_are_refused_by_name() {
    let refused = |shape: [usize; 2], nb: usize, ns: usize, needles: &[&str]| {
        let err = infer(shape, nb, ns, None).unwrap_err();
        for needle in needles {
            assert!(err.contains(needle), "{shape:?} {nb} {ns}: {err}");
        }
    };
    refused([16, 40], 16 * 10, 16, &["int2-row", "coli convert"]);
    refused([16, 128], 16 * 2 * 24, 16 * 2, &["int3-g64"]);
    // 96 columns as two int4 groups of 48 have int3-g64's counts, which take precedence
    // unless a stamp says otherwise.
    refused([16, 96], 16 * 48, 16 * 2, &["int3-g64"]);
    assert_eq!(
        infer([16, 96], 16 * 48, 16 * 2, Some("int4-grouped")),
        Ok(Format::Int4Grouped { group: 48 })
    );
    // A scale count that matches no format names the tensor and both byte counts.
    refused(
        [16, 40],
        16 * 40,
        17,
        &[
            "tensor w",
            "640 weight bytes",
            "68 scale bytes",
            "untrusted container",
        ],
    );
    refused(
        [16, 40],
        16 * 40 + 1,
        16,
        &["641 weight bytes", "match no known format"],
    );
}

#[test]
fn int8_row_and_fp8_blocks_resolve_as_colibri_resolves_them() {
    // GLM-5.2's o_proj [6144, 16384]: ceil(O/128) * ceil(I/128) == O. Same arithmetic at a
    // small size: [128, 16384] has 1 * 128 == 128 block scales and 128 row scales.
    let shape = [128, 16384];
    let (nb, ns) = (128 * 16384, 128);
    assert_eq!(
        infer(shape, nb, ns, None),
        Ok(Format::Int8Row),
        "unstamped -> int8-row"
    );
    assert_eq!(infer(shape, nb, ns, Some("int8-row")), Ok(Format::Int8Row));
    assert_eq!(
        infer(shape, nb, ns, Some("fp8-e4m3-b128")),
        Ok(Format::Fp8E4m3B128)
    );
    // e8-iq3-lattice vs fp8 at I = 98 is refused unless a stamp says which.
    let err = infer([100, 98], 100 * 98, 1, None).unwrap_err();
    assert!(
        err.contains("ambiguous") && err.contains("e8-iq3-lattice"),
        "{err}"
    );
    assert_eq!(
        infer([100, 98], 100 * 98, 1, Some("fp8-e4m3-b128")),
        Ok(Format::Fp8E4m3B128)
    );
    let err = infer([100, 98], 100 * 98, 1, Some("e8-iq3-lattice")).unwrap_err();
    assert!(err.contains("e8-iq3-lattice"), "{err}");
}

#[test]
fn stamps_are_verified() {
    assert_eq!(
        infer([16, 40], 16 * 40, 16, Some("int8-row")),
        Ok(Format::Int8Row)
    );
    let err = infer([16, 40], 16 * 40, 16, Some("int4-row")).unwrap_err();
    assert!(
        err.contains("stamp says int4-row") && err.contains("int8-row"),
        "{err}"
    );
    let err = infer([16, 40], 16 * 40, 16, Some("int9-magic")).unwrap_err();
    assert!(
        err.contains("unknown format") && err.contains("int9-magic"),
        "{err}"
    );
    let err = infer([16, 256], 16 * 128, 64, Some("int4-row")).unwrap_err();
    assert!(err.contains("int4-grouped (gs64)"), "{err}");
    assert_eq!(
        infer([16, 256], 16 * 128, 64, Some("int4-grouped")),
        Ok(Format::Int4Grouped { group: 64 })
    );

    // A float tensor stamped f32 agrees whatever its float dtype; stamped int8 it does not.
    let dir = tempfile::tempdir().unwrap();
    let half: Vec<u8> = vec![0; 4 * 8 * 2];
    write_container(
        dir.path(),
        "model.safetensors",
        &[
            tensor("a", Dtype::BF16, &[4, 8], half.clone()),
            tensor("b", Dtype::F32, &[4, 8], vec![0; 128]),
        ],
        Some(r#"{"a": "f32", "b": "int8-row"}"#),
    );
    assert_eq!(load(dir.path(), "a", [4, 8]), Ok(Format::Bf16));
    let err = load(dir.path(), "b", [4, 8]).unwrap_err();
    assert!(err.contains("stamp says int8-row"), "{err}");

    // Malformed stamps are refused when the snapshot opens, naming the shard.
    for malformed in ["not json", "[1, 2]", r#"{"w": 3}"#] {
        let dir = tempfile::tempdir().unwrap();
        write_container(
            dir.path(),
            "model.safetensors",
            &pair("w", 640, 16),
            Some(malformed),
        );
        let err = format!("{:#}", Snapshot::open(dir.path()).err().expect("refused"));
        assert!(
            err.contains("model.safetensors") && err.contains("stamp"),
            "{malformed}: {err}"
        );
    }

    // Two shards that claim different formats for one tensor are refused; agreeing
    // claims collapse.
    let dir = tempfile::tempdir().unwrap();
    write_container(
        dir.path(),
        "a.safetensors",
        &pair("w", 640, 16),
        Some(r#"{"w": "int8-row"}"#),
    );
    write_container(
        dir.path(),
        "b.safetensors",
        &pair("v", 640, 16),
        Some(r#"{"w": "int8-row", "v": "int8-row"}"#),
    );
    assert_eq!(load(dir.path(), "w", [16, 40]), Ok(Format::Int8Row));
    write_container(
        dir.path(),
        "b.safetensors",
        &pair("v", 640, 16),
        Some(r#"{"w": "int4-row"}"#),
    );
    let err = format!("{:#}", Snapshot::open(dir.path()).err().expect("refused"));
    assert!(
        err.contains("tensor w") && err.contains("int4-row") && err.contains("int8-row"),
        "{err}"
    );
}

/// A weight quantised with the public encoders, round-tripped through a real shard, must
/// compute exactly what the in-memory matrix computes.
fn same_product(stored: &Matrix, encoded: &Matrix) {
    let cols = encoded.cols();
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 7) % 11) as f32 * 0.25 - 1.0)
        .collect();
    let (mut a, mut b) = (vec![0f32; encoded.rows()], vec![0f32; encoded.rows()]);
    stored.matmul(&x, 1, &mut a);
    encoded.matmul(&x, 1, &mut b);
    assert_eq!(a, b);
}

#[test]
fn published_fp8_and_mxfp4_layouts_load() {
    let (rows, cols) = (200, 300);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    let dir = tempfile::tempdir().unwrap();

    // FP8: F8_E4M3 `x.weight` [O, I] with F32 `x.weight_scale_inv` [ceil(O/128), ceil(I/128)].
    let (codes, block_scales) = quant::quantize_fp8_blocks(&w, cols);
    // MXFP4 (compressed-tensors): U8 `y.weight_packed` [O, I/2] with U8 `y.weight_scale` [O, I/32].
    let (packed, exponents) = quant::quantize_mxfp4(&w, cols);
    write_container(
        dir.path(),
        "model.safetensors",
        &[
            tensor("x.weight", Dtype::F8_E4M3, &[rows, cols], codes),
            tensor(
                "x.weight_scale_inv",
                Dtype::F32,
                &[2, 3],
                f32_bytes(&block_scales),
            ),
            tensor("y.weight_packed", Dtype::U8, &[rows, cols / 2], packed),
            tensor(
                "y.weight_scale",
                Dtype::U8,
                &[rows, cols.div_ceil(32)],
                exponents,
            ),
        ],
        None,
    );
    let snapshot = Snapshot::open(dir.path()).unwrap();
    for (name, format) in [
        ("x.weight", Format::Fp8E4m3B128),
        ("y.weight_packed", Format::Mxfp4),
    ] {
        let view =
            coli::quant::format::shaped(snapshot.tensor(name).unwrap(), &[rows, cols]).unwrap();
        let stored = Matrix::load(&view, Width::Int8Row).unwrap();
        assert_eq!(
            stored.format(),
            format,
            "{name}: a pre-quantised weight ignores the width"
        );
        same_product(
            &stored,
            &Matrix::from_f32_as(rows, cols, &w, format).unwrap(),
        );
    }
}

/// The OLMoE fixture with every routed expert quantised to int8 rows as colibri stores
/// them: per matrix (`{name}` I8 + `{name}.qs`), or `merged` into one
/// `{expert}.merged_weight` + `{expert}.qs` pair per expert.
fn int8_expert_fixture(merged: bool) -> tempfile::TempDir {
    damaged_fixture(|tensors| {
        let experts: Vec<Tensor> = tensors
            .iter()
            .filter(|t| t.0.contains(".mlp.experts."))
            .cloned()
            .collect();
        tensors.retain(|t| !t.0.contains(".mlp.experts."));
        let mut prefixes: Vec<String> = experts
            .iter()
            .filter_map(|t| t.0.strip_suffix(".gate_proj.weight").map(str::to_string))
            .collect();
        prefixes.sort();
        for prefix in prefixes {
            let (mut weights, mut scales) = (Vec::new(), Vec::new());
            for part in ["gate_proj", "up_proj", "down_proj"] {
                let name = format!("{prefix}.{part}.weight");
                let (_, _, shape, bytes) = experts.iter().find(|t| t.0 == name).unwrap();
                let values: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                    .collect();
                let (q, s) = quant::quantize_int8_rows(&values, shape[1]);
                let q: Vec<u8> = q.iter().map(|&v| v as u8).collect();
                if merged {
                    weights.extend(q);
                    scales.extend(s);
                } else {
                    tensors.push(tensor(&name, Dtype::I8, &[q.len()], q));
                    tensors.push(tensor(
                        &format!("{name}.qs"),
                        Dtype::F32,
                        &[s.len()],
                        f32_bytes(&s),
                    ));
                }
            }
            if merged {
                let (w, s) = (weights.len(), scales.len());
                tensors.push(tensor(
                    &format!("{prefix}.merged_weight"),
                    Dtype::I8,
                    &[w],
                    weights,
                ));
                tensors.push(tensor(
                    &format!("{prefix}.qs"),
                    Dtype::F32,
                    &[s],
                    f32_bytes(&scales),
                ));
            }
        }
    })
}

#[test]
fn colibri_merged_olmoe_experts_run_as_int8_rows() {
    let run = |dir: &Path| {
        let out = coli(
            &[
                &format!("SNAP={}", dir.display()),
                "PPL=1",
                "CTX=32",
                "64",
                "16",
                "16",
            ],
            &[],
        );
        assert!(out.status.success(), "{}", stderr(&out));
        // The perplexity and mean NLL of the reference's tokens, to six digits: any difference in the
        // experts' products shows in it.
        let line = stdout(&out)
            .lines()
            .find(|line| line.starts_with("PPL:"))
            // Without the timing at its end.
            .map(|line| line.split(" | ").take(2).collect::<Vec<_>>().join(" | "));
        line.unwrap_or_else(|| panic!("no PPL line in {}", stdout(&out)))
    };
    let per_matrix = int8_expert_fixture(false);
    let merged = int8_expert_fixture(true);
    assert_eq!(run(merged.path()), run(per_matrix.path()));

    // A merged expert whose size does not fit the configuration is refused.
    let short = damaged_fixture(|tensors| {
        tensors.retain(|t| !t.0.starts_with("model.layers.1.mlp.experts.5."));
        let bytes = 3 * 32 * 64 - 64;
        tensors.push(tensor(
            "model.layers.1.mlp.experts.5.merged_weight",
            Dtype::I8,
            &[bytes],
            vec![1; bytes],
        ));
        tensors.push(tensor(
            "model.layers.1.mlp.experts.5.qs",
            Dtype::F32,
            &[2 * 32 + 64],
            f32_bytes(&[0.01; 2 * 32 + 64]),
        ));
    });
    refused_with_exit_2(
        short.path(),
        &[
            "model.layers.1.mlp.experts.5.merged_weight",
            "untrusted container",
        ],
    );
}

/// The OLMoE fixture with expert `model.layers.1.mlp.experts.5.up_proj.weight` replaced by
/// `edit`'s tensors.
fn damaged_fixture(edit: impl FnOnce(&mut Vec<Tensor>)) -> tempfile::TempDir {
    let dir = copy_fixture("olmoe_tiny");
    rewrite_shard(dir.path(), edit);
    dir
}

fn refused_with_exit_2(dir: &Path, needles: &[&str]) {
    let out = coli(&[&format!("SNAP={}", dir.display()), "64", "16", "16"], &[]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let err = stderr(&out);
    for needle in needles {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
}

#[test]
fn bad_containers_exit_2_with_a_clear_message() {
    let name = "model.layers.1.mlp.experts.5.up_proj.weight";
    // A scale count that matches no format ([32, 64] int8 needs 32 scales).
    let dir = damaged_fixture(|tensors| {
        tensors.retain(|t| t.0 != name);
        tensors.extend(pair(name, 32 * 64, 31));
    });
    refused_with_exit_2(
        dir.path(),
        &[name, "match no known format", "untrusted container"],
    );

    // A stamp naming an unknown format.
    let dir = damaged_fixture(|tensors| {
        tensors.retain(|t| t.0 != name);
        tensors.extend(pair(name, 32 * 64, 32));
    });
    let path = dir.path().join("model.safetensors");
    let stamp = HashMap::from([(
        "colibri.fmt".to_string(),
        format!(r#"{{"{name}": "int5-spiral"}}"#),
    )]);
    write_shard(&path, &read_shard(&path), Some(stamp));
    refused_with_exit_2(dir.path(), &[name, "unknown format", "int5-spiral"]);

    // A truncated shard of a converted container.
    let converted = tempfile::tempdir().unwrap();
    let dst = converted.path().join("int8");
    let out = coli(
        &[
            "convert",
            common::fixture("olmoe_tiny").to_str().unwrap(),
            dst.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let shard = dst.join("model-00001-of-00001.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    file.set_len(len - 100).unwrap();
    refused_with_exit_2(&dst, &["model-00001-of-00001.safetensors", "truncated"]);
}
