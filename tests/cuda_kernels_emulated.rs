//! The CUDA matmul kernels on the CPU: `kernels/cuda/coli.cu` compiled by the system C++
//! compiler against CPU stand-ins for the CUDA built-ins (`tests/cuda_emulation/harness.cpp`),
//! and run on every format at odd shapes and batch sizes against the CPU reference. This
//! checks the kernels' decoding, indexing and padding on machines without a GPU; the same
//! products on a GPU are `tests/cuda_kernels.rs`.

mod common;

use std::path::Path;
use std::process::Command;

use coli::backend::cuda::format_code;
use coli::backend::RawScales;
use coli::quant::{Format, Isa, Matrix};
use common::random;

/// Scales per row as the kernel's `Job::per_row` counts them.
fn per_row(format: Format, cols: usize) -> usize {
    match format {
        Format::Int4Grouped { group } => cols.div_ceil(group),
        Format::Fp8E4m3B128 => cols.div_ceil(128),
        Format::Mxfp4 => cols.div_ceil(32),
        _ => 0,
    }
}

/// One case in the harness's format: the matrix, the input, the CPU's output and the error
/// each output may have. Two f32 dot products of `cols` terms in different orders differ by
/// at most about `2 (cols + 8) u` times the sum of the terms' magnitudes (u = 2^-24), over
/// the exactly decoded weights.
fn write_case(out: &mut Vec<u8>, matrix: &Matrix, input: &[f32], n: usize) {
    let raw = matrix.raw();
    let (rows, cols) = (raw.rows, raw.cols);
    let mut want = vec![0f32; n * rows];
    matrix.matmul_with(Isa::Scalar, input, n, &mut want);
    let weights = matrix.to_f32();
    let unit = f64::from(f32::EPSILON) / 2.0;
    let allowed: Vec<f32> = (0..n * rows)
        .map(|i| {
            let (t, r) = (i / rows, i % rows);
            let magnitude: f64 = (0..cols)
                .map(|c| f64::from(weights[r * cols + c] * input[t * cols + c]).abs())
                .sum();
            (2.0 * (cols + 8) as f64 * unit * magnitude + 1e-30) as f32
        })
        .collect();
    let scales: &[u8] = match raw.scales {
        RawScales::None => &[],
        RawScales::F32(scales) => bytemuck::cast_slice(scales),
        RawScales::E8m0(scales) => scales,
    };
    let group = match raw.format {
        Format::Int4Grouped { group } => group,
        _ => 0,
    };
    out.extend(
        format_code(raw.format)
            .expect("a CUDA format")
            .to_le_bytes(),
    );
    for value in [rows, cols, group, per_row(raw.format, cols), n] {
        out.extend((value as u32).to_le_bytes());
    }
    out.extend((raw.data.len() as u64).to_le_bytes());
    out.extend((scales.len() as u64).to_le_bytes());
    out.extend(raw.data);
    out.extend(scales);
    for values in [input, &want, &allowed] {
        out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
    }
}

#[test]
fn every_format_matches_the_cpu_reference() {
    let formats = [
        Format::F32,
        Format::Bf16,
        Format::F16,
        Format::Int8Row,
        Format::Int4Row,
        Format::Int4Grouped { group: 32 },
        Format::Int4Grouped { group: 64 },
        Format::Fp8E4m3B128,
        Format::Mxfp4,
    ];
    let shapes = [(37, 70), (9, 300), (130, 257), (3, 7)];
    let mut cases = Vec::new();
    let mut count = 0u32;
    for (f, &format) in formats.iter().enumerate() {
        for (s, &(rows, cols)) in shapes.iter().enumerate() {
            let seed = (f * 16 + s) as u64;
            let matrix = Matrix::from_f32_as(rows, cols, &random(rows * cols, seed), format)
                .expect("an encodable shape");
            for n in [1, 3, 9] {
                write_case(&mut cases, &matrix, &random(n * cols, seed + 1000), n);
                count += 1;
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let case_file = dir.path().join("cases.bin");
    let mut file = count.to_le_bytes().to_vec();
    file.extend(cases);
    std::fs::write(&case_file, file).unwrap();

    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let harness = dir.path().join("harness");
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let built = Command::new(&compiler)
        .args(["-std=c++20", "-O1", "-pthread", "-I"])
        .arg(root.join("kernels/cuda"))
        .arg(root.join("tests/cuda_emulation/harness.cpp"))
        .arg("-o")
        .arg(&harness)
        .output()
        .unwrap_or_else(|e| panic!("a C++20 compiler ({compiler}) is needed: {e}"));
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&harness).arg(&case_file).output().unwrap();
    let report = String::from_utf8_lossy(&ran.stdout);
    assert!(
        ran.status.success(),
        "{report}{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    assert!(
        report.contains(&format!("0 of {count} cases off")),
        "{report}"
    );
}
