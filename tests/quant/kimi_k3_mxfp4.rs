//! Kimi K3's routed experts as published: compressed-tensors MXFP4, a `*.weight_packed` U8
//! tensor (two e2m1 codes per byte, element 2i in the low nibble, element 2i+1 in the high
//! one; bit 3 of a code is the sign, bits 0..2 index {0, .5, 1, 1.5, 2, 3, 4, 6}) beside a
//! `*.weight_scale` U8 tensor (one E8M0 exponent per 32 values of a row, `2^(s - 127)`).
//! Hand-built bytes go through a real shard, the snapshot's sidecar lookup and
//! `Matrix::load`, and are checked value by value and through the matrix product.

use crate::common::write_shard;

use std::path::Path;

use coli::quant::{Format, Matrix, Width};
use coli::snapshot::Snapshot;
use safetensors::Dtype;

/// The e2m1 magnitudes and signs by code.
const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Pack codes (one per element, row-major `rows x cols`) two per byte, even element low.
fn pack(codes: &[u8], cols: usize) -> Vec<u8> {
    codes
        .chunks_exact(cols)
        .flat_map(|row| row.chunks_exact(2).map(|pair| pair[0] | (pair[1] << 4)))
        .collect()
}

/// A model directory holding `w.weight_packed` and `w.weight_scale` with the given bytes and
/// stored shapes.
fn shard(dir: &Path, packed: (&[u8], Vec<usize>), scales: (&[u8], Vec<usize>)) -> Snapshot {
    std::fs::write(dir.join("config.json"), "{}").unwrap();
    let tensors = [
        (
            "w.weight_packed".to_string(),
            Dtype::U8,
            packed.1,
            packed.0.to_vec(),
        ),
        (
            "w.weight_scale".to_string(),
            Dtype::U8,
            scales.1,
            scales.0.to_vec(),
        ),
    ];
    write_shard(&dir.join("model.safetensors"), &tensors, None);
    Snapshot::open(dir).unwrap()
}

/// Load `w` as a `[rows, cols]` matrix through the snapshot.
fn load(snapshot: &Snapshot, rows: usize, cols: usize, width: Width) -> anyhow::Result<Matrix> {
    let view = coli::quant::format::shaped(snapshot.tensor("w.weight_packed")?, &[rows, cols])?;
    Matrix::load(&view, width)
}

/// `2^(s - 127)` with colibri's edges: 0 is +0.
fn scale_of(s: u8) -> f32 {
    if s == 0 {
        0.0
    } else {
        2f32.powi(i32::from(s) - 127)
    }
}

#[test]
fn the_even_element_is_the_low_nibble() {
    let dir = tempfile::tempdir().unwrap();
    // One row of 32: codes 0..15 then 15..0. Byte 0 = 0x10 (elements 0, 1), byte 7 = 0xFE.
    let codes: Vec<u8> = (0..16).chain((0..16).rev()).collect();
    let packed = pack(&codes, 32);
    assert_eq!(packed[0], 0x10);
    assert_eq!(packed[7], 0xFE);
    let snapshot = shard(dir.path(), (&packed, vec![1, 16]), (&[127], vec![1, 1]));
    let matrix = load(&snapshot, 1, 32, Width::F32).unwrap();
    assert_eq!(matrix.format(), Format::Mxfp4);
    let values = matrix.to_f32();
    let want: Vec<f32> = codes.iter().map(|&c| E2M1[c as usize]).collect();
    assert_eq!(values, want);
    // Negative zero decodes as a zero of either sign.
    assert_eq!(values[8], 0.0);

    // The product with f32 activations: x_i = (i + 1) / 16 keeps every term and sum exact.
    let x: Vec<f32> = (0..32).map(|i| (i + 1) as f32 / 16.0).collect();
    let mut out = [0f32];
    matrix.matmul(&x, 1, &mut out);
    let exact: f64 = want
        .iter()
        .zip(&x)
        .map(|(&w, &x)| f64::from(w) * f64::from(x))
        .sum();
    assert_eq!(f64::from(out[0]), exact);

    // A swapped-nibble reading would see codes 1, 0 at elements 0, 1.
    assert_ne!(values[..2], [E2M1[1], E2M1[0]]);
}

#[test]
fn scales_apply_per_row_and_per_group_of_32() {
    let dir = tempfile::tempdir().unwrap();
    // Two rows of 64 columns: two groups per row, four different scales in [rows][groups].
    let (rows, cols) = (2, 64);
    let codes: Vec<u8> = (0..rows * cols).map(|i| ((i * 7 + 3) % 16) as u8).collect();
    let scales = [126u8, 130, 120, 127];
    let snapshot = shard(
        dir.path(),
        (&pack(&codes, cols), vec![rows, cols / 2]),
        (&scales, vec![rows, cols / 32]),
    );
    let matrix = load(&snapshot, rows, cols, Width::F32).unwrap();
    let values = matrix.to_f32();
    for (i, &v) in values.iter().enumerate() {
        let (r, c) = (i / cols, i % cols);
        let want = E2M1[codes[i] as usize] * scale_of(scales[r * 2 + c / 32]);
        assert_eq!(v, want, "element [{r}, {c}]");
    }
    let x: Vec<f32> = (0..cols).map(|i| (i % 5) as f32 - 2.0).collect();
    let mut out = [0f32; 2];
    matrix.matmul(&x, 1, &mut out);
    for (r, &y) in out.iter().enumerate() {
        let exact: f64 = (0..cols)
            .map(|c| f64::from(values[r * cols + c]) * f64::from(x[c]))
            .sum();
        assert!(
            (f64::from(y) - exact).abs() <= 1e-6 * exact.abs().max(1.0),
            "row {r}: {y} vs {exact}"
        );
    }
}

#[test]
fn scale_exponents_at_the_extremes() {
    let dir = tempfile::tempdir().unwrap();
    // Rows scaled by 2^127 (s = 254), 2^-126 (s = 1, the smallest normal) and s = 0, which
    // colibri decodes as +0 (published checkpoints never hold it).
    let cols = 32;
    let mut codes = vec![0u8; 3 * cols];
    codes[0] = 1; // 0.5 * 2^127 = 2^126
    codes[1] = 9; // -0.5 * 2^127
    codes[cols] = 1; // 0.5 * 2^-126 = 2^-127, a subnormal
    codes[cols + 1] = 7; // 6 * 2^-126
    codes[2 * cols] = 7;
    let scales = [254u8, 1, 0];
    let snapshot = shard(
        dir.path(),
        (&pack(&codes, cols), vec![3, cols / 2]),
        (&scales, vec![3, 1]),
    );
    let matrix = load(&snapshot, 3, cols, Width::F32).unwrap();
    let values = matrix.to_f32();
    assert_eq!(values[0], 2f32.powi(126));
    assert_eq!(values[1], -(2f32.powi(126)));
    assert_eq!(values[cols], f32::from_bits(1 << 22));
    assert_eq!(values[cols + 1], 6.0 * 2f32.powi(-126));
    assert!(values[2 * cols..].iter().all(|&v| v == 0.0));

    let mut x = vec![0f32; cols];
    x[0] = 2f32.powi(-100);
    x[1] = 2f32.powi(-101);
    let mut out = [0f32; 3];
    matrix.matmul(&x, 1, &mut out);
    // 2^26 - 2^25, and 2^-227 + 6 * 2^-227 underflows to zero in f32.
    assert_eq!(out[0], 2f32.powi(25));
    assert_eq!(out[1], 0.0);
    assert_eq!(out[2], 0.0);
    x[0] = 1.0;
    x[1] = 1.0;
    matrix.matmul(&x, 1, &mut out);
    assert_eq!(out[1], 2f32.powi(-127) + 6.0 * 2f32.powi(-126));
}

#[test]
fn a_pre_quantised_expert_keeps_its_format_at_every_width() {
    let dir = tempfile::tempdir().unwrap();
    let codes: Vec<u8> = (0..32).map(|i| (i % 16) as u8).collect();
    let snapshot = shard(
        dir.path(),
        (&pack(&codes, 32), vec![1, 16]),
        (&[125], vec![1, 1]),
    );
    for width in [Width::F32, Width::Int8Row, Width::Int4Group64] {
        let matrix = load(&snapshot, 1, 32, width).unwrap();
        assert_eq!(matrix.format(), Format::Mxfp4);
        assert_eq!(matrix.size_bytes(), 16 + 1);
    }
}

#[test]
fn byte_counts_that_do_not_fit_the_shape_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let codes = vec![3u8; 2 * 64];
    // 2 x 64 values need 64 packed bytes and 4 scale bytes; give 2 scale bytes.
    let snapshot = shard(
        dir.path(),
        (&pack(&codes, 64), vec![2, 32]),
        (&[127, 127], vec![2, 1]),
    );
    let message = format!("{:#}", load(&snapshot, 2, 64, Width::F32).err().unwrap());
    assert!(
        message.contains("w.weight_packed") && message.contains("w.weight_scale"),
        "{message}"
    );
    // The right counts for another shape are refused too: [4, 32] is not [2, 64].
    let message = format!("{:#}", load(&snapshot, 4, 32, Width::F32).err().unwrap());
    assert!(message.contains("w.weight_packed"), "{message}");
}
