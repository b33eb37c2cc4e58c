//! Every weight format's kernels: quantise -> dequantise round trips within the format's
//! bound, every SIMD path bit-identical to the scalar reference, batches identical to single
//! rows, and odd and tail shapes (columns not a multiple of 8 or of the group, odd columns
//! for the nibble formats, rows not a multiple of the 4-row blocks).

use crate::common;

use coli::quant::{Format, Isa, Matrix, Width};

/// Every format with kernels, int4-grouped at four group sizes.
fn formats() -> Vec<Format> {
    common::kernel_formats(&[16, 64, 96, 256])
}

/// `[rows, cols]` covering single elements, partial 8-lane chunks, partial groups, odd
/// nibble rows, 4-row blocks with remainders, several FP8 128-row blocks, and rows long
/// enough that a batch walks them in several column steps.
/// Every tail: rows past a block of eight or four, a lone last chunk column, and with
/// (21, 1100) eight-row blocks over three column blocks (64, 64 and 10 chunks).
const SHAPES: [(usize, usize); 13] = [
    (1, 1),
    (3, 7),
    (5, 8),
    (9, 17),
    (13, 64),
    (17, 100),
    (33, 129),
    (7, 255),
    (130, 257),
    (260, 96),
    (6, 600),
    (5, 1024),
    (21, 1100),
];

/// A deterministic spread of magnitudes (with some exact zeros and a few large values) so
/// every code of every format gets used.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            match i % 37 {
                0 => 0.0,
                5 => unit * 40.0,
                _ => unit * (1.0 + (i % 5) as f32),
            }
        })
        .collect()
}

fn label(format: Format) -> String {
    format.to_string()
}

#[test]
fn round_trips_stay_within_each_formats_bound() {
    for format in formats() {
        for (rows, cols) in SHAPES {
            let w = values(rows * cols, (rows * 1000 + cols) as u64);
            let matrix = Matrix::from_f32_as(rows, cols, &w, format).unwrap();
            let back = matrix.to_f32();
            for r in 0..rows {
                let row = &w[r * cols..(r + 1) * cols];
                let row_max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (i, (&a, &b)) in row.iter().zip(&back[r * cols..(r + 1) * cols]).enumerate() {
                    let bound = match format {
                        Format::F32 => 0.0,
                        Format::Bf16 => a.abs() * 2f32.powi(-8),
                        Format::F16 => a.abs() * 2f32.powi(-11) + 2f32.powi(-25),
                        // Half a step of the row's (or group's) scale.
                        Format::Int8Row => row_max / 127.0 * 0.5,
                        Format::Int4Row => row_max / 7.0 * 0.5,
                        Format::Int4Grouped { group } => {
                            let g = &row[i / group * group..((i / group + 1) * group).min(cols)];
                            g.iter().fold(0f32, |m, v| m.max(v.abs())) / 7.0 * 0.5
                        }
                        // 3 mantissa bits: half an ulp relative, plus the subnormal step
                        // of the block scale (block max / 448 * 2^-9 / 2).
                        Format::Fp8E4m3B128 => {
                            let block_max = (r / 128 * 128..((r / 128 + 1) * 128).min(rows))
                                .flat_map(|rr| {
                                    w[rr * cols + i / 128 * 128
                                        ..rr * cols + ((i / 128 + 1) * 128).min(cols)]
                                        .iter()
                                })
                                .fold(0f32, |m, v| m.max(v.abs()));
                            a.abs() * 2f32.powi(-4) + block_max / 448.0 * 2f32.powi(-10)
                        }
                        // e2m1 steps are at most 2 (x the group scale 2^e) near the top,
                        // and values in [6, 8)·2^e saturate to 6: at most 2·2^e off.
                        Format::Mxfp4 => {
                            let g = &row[i / 32 * 32..((i / 32 + 1) * 32).min(cols)];
                            let max = g.iter().fold(0f32, |m, v| m.max(v.abs()));
                            if max == 0.0 {
                                0.0
                            } else {
                                2.0 * 2f32.powi(max.log2().floor() as i32 - 2)
                            }
                        }
                        other => panic!("no bound for {other}"),
                    };
                    assert!(
                        (a - b).abs() <= bound * 1.0001,
                        "{} {rows}x{cols} [{r},{i}]: {a} -> {b}, bound {bound}",
                        label(format)
                    );
                }
            }
        }
    }
}

#[test]
fn every_simd_path_matches_the_scalar_reference_bit_for_bit() {
    let isas = Isa::available();
    for format in formats() {
        for (rows, cols) in SHAPES {
            let matrix =
                Matrix::from_f32_as(rows, cols, &values(rows * cols, cols as u64), format).unwrap();
            // A few inputs (tiled in registers; five as 3 + 2), and more than the few-input
            // kernels take with group scales (10) and without (17). The reference is each
            // input alone on the scalar row kernel.
            for n in [1, 2, 5, 10, 17] {
                let x = values(n * cols, 7 + n as u64);
                let mut reference = vec![0f32; n * rows];
                for (input, out) in x.chunks_exact(cols).zip(reference.chunks_exact_mut(rows)) {
                    matrix.matmul_with(Isa::Scalar, input, 1, out);
                }
                for &isa in &isas {
                    let mut out = vec![0f32; n * rows];
                    matrix.matmul_with(isa, &x, n, &mut out);
                    for (k, (a, b)) in reference.iter().zip(&out).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{} {rows}x{cols} n={n} {isa:?} element {k}: {a} vs {b}",
                            label(format)
                        );
                    }
                }
            }
            // Each row dequantised (an embedding lookup, MLA's absorbed query).
            for row in 0..rows {
                let mut reference = vec![0f32; cols];
                matrix.row_into_with(Isa::Scalar, row, &mut reference);
                for &isa in &isas {
                    let mut out = vec![0f32; cols];
                    matrix.row_into_with(isa, row, &mut out);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&out),
                        bits(&reference),
                        "{} {rows}x{cols} row {row} {isa:?}",
                        label(format)
                    );
                }
            }
        }
    }
}

/// The product of `n` inputs `x` as one batch, and each input's product alone.
fn batch_and_rows(matrix: &Matrix, x: &[f32], n: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (rows, cols) = (matrix.rows(), matrix.cols());
    let mut batch = vec![0f32; n * rows];
    matrix.matmul(x, n, &mut batch);
    let singles = x
        .chunks_exact(cols)
        .map(|input| {
            let mut single = vec![0f32; rows];
            matrix.matmul(input, 1, &mut single);
            single
        })
        .collect();
    (batch, singles)
}

#[test]
fn a_batch_computes_what_single_rows_compute() {
    for format in formats() {
        for (rows, cols) in SHAPES {
            let matrix = Matrix::from_f32_as(rows, cols, &values(rows * cols, 3), format).unwrap();
            // A few inputs, tiled in registers (3 and 4; 7, 10 and 16 without group scales
            // or, with them, 7; every count without them on the 8-lane kernels), and more
            // than that (10 with group scales; 18, 20 and 22 without them on AVX-512; FP8 on
            // AVX-512 from 7 on) against rows decoded to memory, which AVX-512
            // runs in tiles of three input pairs and fewer (20 and 22 inputs end in one pair
            // and in two).
            for n in [3, 4, 7, 16, 10, 18, 20, 22] {
                let x = values(n * cols, 11);
                let (batch, singles) = batch_and_rows(&matrix, &x, n);
                for (t, single) in singles.iter().enumerate() {
                    assert_eq!(
                        single[..],
                        batch[t * rows..(t + 1) * rows],
                        "{} {rows}x{cols} row {t}",
                        label(format)
                    );
                    // Some rows on their own: one row, and every row but the first.
                    let input = &x[t * cols..(t + 1) * cols];
                    for r in [0, rows - 1] {
                        let mut one = [0f32];
                        matrix.rows_product(r, input, 1, &mut one);
                        assert_eq!(one[0].to_bits(), single[r].to_bits());
                    }
                    let mut later = vec![0f32; rows - 1];
                    matrix.rows_product(1, input, 1, &mut later);
                    assert_eq!(later[..], single[1..]);
                }
                // Every row but the first against the whole batch.
                let mut later = vec![0f32; n * (rows - 1)];
                matrix.rows_product(1, &x, n, &mut later);
                for (t, single) in singles.iter().enumerate() {
                    let got = &later[t * (rows - 1)..][..rows - 1];
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(got), bits(&single[1..]), "{} row {t}", label(format));
                }
            }
        }
    }
}

#[test]
fn a_long_batch_in_groups_of_inputs_computes_what_single_rows_compute() {
    // 4000 columns make an input pair 32 KB, so the AVX-512 kernels run 18 pairs at a
    // time: 45 inputs are groups of 18 and 5 pairs, 39 inputs 18 and 2 (the last group,
    // for f32 and int8-row, too small for eight-row blocks). 16,000 columns make a pair
    // 128 KB, and a group its least, nine pairs: 21 inputs are 9 and 2 pairs, 23 inputs 9
    // and 3.
    let rows = 20;
    let formats = [
        Format::F32,
        Format::Int8Row,
        Format::Int4Grouped { group: 64 },
    ];
    for format in formats {
        for (cols, batches) in [(4000, [45, 39]), (16000, [21, 23])] {
            let matrix = Matrix::from_f32_as(rows, cols, &values(rows * cols, 5), format).unwrap();
            for n in batches {
                let (batch, singles) = batch_and_rows(&matrix, &values(n * cols, 13), n);
                for (t, single) in singles.iter().enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|y| y.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(single),
                        bits(&batch[t * rows..(t + 1) * rows]),
                        "{} {cols} columns, n {n} row {t}",
                        label(format)
                    );
                }
            }
        }
    }
}

#[test]
fn kernels_compute_the_dequantised_matrix_product() {
    for format in formats() {
        for (rows, cols) in SHAPES {
            let matrix = Matrix::from_f32_as(rows, cols, &values(rows * cols, 5), format).unwrap();
            let dequantised = matrix.to_f32();
            let x = values(cols, 9);
            let mut y = vec![0f32; rows];
            matrix.matmul(&x, 1, &mut y);
            for r in 0..rows {
                let row = &dequantised[r * cols..(r + 1) * cols];
                let exact: f64 = row.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let magnitude: f64 = row
                    .iter()
                    .zip(&x)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                assert!(
                    (y[r] as f64 - exact).abs() <= 1e-5 * magnitude + 1e-30,
                    "{} {rows}x{cols} row {r}: {} vs {exact}",
                    label(format),
                    y[r]
                );
            }
        }
    }
}

#[test]
fn widths_map_bits_like_colibri() {
    assert_eq!(Width::from_bits(16).unwrap(), Width::F32);
    assert_eq!(Width::from_bits(32).unwrap(), Width::F32);
    assert_eq!(Width::from_bits(8).unwrap(), Width::Int8Row);
    assert_eq!(Width::from_bits(5).unwrap(), Width::Int8Row);
    assert_eq!(Width::from_bits(4).unwrap(), Width::Int4Group64);
    assert!(Width::from_bits(3).is_err());
    let w = values(8 * 200, 1);
    let m = Matrix::from_f32(8, 200, w.clone(), Width::Int4Group64);
    assert_eq!(m.format(), Format::Int4Grouped { group: 64 });
    assert_eq!(m.size_bytes(), 8 * 100 + 8 * 4 * 4);
    assert_eq!(
        Matrix::from_f32(8, 200, w.clone(), Width::Int8Row).size_bytes(),
        8 * 200 + 8 * 4
    );
    assert_eq!(
        Matrix::from_f32(8, 200, w, Width::F32).size_bytes(),
        8 * 200 * 4
    );
}

#[test]
fn unsupported_encodings_are_refused() {
    assert!(Matrix::from_f32_as(2, 8, &[0.0; 16], Format::Int2Row).is_err());
    assert!(Matrix::from_f32_as(2, 8, &[0.0; 16], Format::Int4Grouped { group: 12 }).is_err());
    assert!(Matrix::from_f32_as(2, 8, &[0.0; 15], Format::Int8Row).is_err());
}
