//! The CPU side of the CUDA kernel tests (`cuda_kernels` on a GPU, `cuda_kernels_emulated` on
//! the CPU): the reference results and the magnitudes their tolerances scale with.

#![allow(dead_code)]

use coli::activation::Activation;
use coli::quant::{Format, Isa, Matrix};

/// `count` experts of `width` inputs and `inter` hidden units: gate, up and down in
/// `formats`, their weights drawn from `values(len, seed)`.
pub fn expert_matrices(
    count: usize,
    (width, inter): (usize, usize),
    formats: [Format; 3],
    values: impl Fn(usize, u64) -> Vec<f32>,
) -> Vec<[Matrix; 3]> {
    (0..count)
        .map(|e| {
            let seed = 500 + 10 * e as u64;
            [
                Matrix::from_f32_as(inter, width, &values(inter * width, seed), formats[0]),
                Matrix::from_f32_as(inter, width, &values(inter * width, seed + 1), formats[1]),
                Matrix::from_f32_as(width, inter, &values(width * inter, seed + 2), formats[2]),
            ]
            .map(|m| m.expect("encodable"))
        })
        .collect()
}

/// `Σ|w·x|` per output of `matrix · input` (`n` rows), from the decoded weights, in f64.
pub fn magnitudes(matrix: &Matrix, input: &[f32], n: usize) -> Vec<f64> {
    let (rows, cols) = (matrix.rows(), matrix.cols());
    let weights = matrix.to_f32();
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        let x = &input[t * cols..][..cols];
        for r in 0..rows {
            out[t * rows + r] = weights[r * cols..][..cols]
                .iter()
                .zip(x)
                .map(|(&w, &v)| (f64::from(w) * f64::from(v)).abs())
                .sum();
        }
    }
    out
}

/// The CPU's computation of an expert group: each expert in order, its rows gathered,
/// `down(act(gate x, up x))`, added into the rows with their gate weights; and the scale
/// of each output (`Σ over experts of |weight| · Σ|down · h|`) for the tolerance.
pub fn cpu_group(
    matrices: &[[Matrix; 3]],
    routes: &[Vec<(usize, f32)>],
    input: &[f32],
    width: usize,
    activation: Activation,
) -> (Vec<f32>, Vec<f64>) {
    let rows = input.len() / width;
    let mut out = vec![0f32; rows * width];
    let mut scale = vec![0f64; rows * width];
    for ([gate, up, down], routed) in matrices.iter().zip(routes) {
        let n = routed.len();
        let batch: Vec<f32> = routed
            .iter()
            .flat_map(|&(row, _)| input[row * width..][..width].to_vec())
            .collect();
        let inter = gate.rows();
        let mut g = vec![0f32; n * inter];
        let mut u = vec![0f32; n * inter];
        gate.matmul_with(Isa::Scalar, &batch, n, &mut g);
        up.matmul_with(Isa::Scalar, &batch, n, &mut u);
        activation.apply(&mut g, &u);
        let mut y = vec![0f32; n * width];
        down.matmul_with(Isa::Scalar, &g, n, &mut y);
        let magnitude = magnitudes(down, &g, n);
        for (k, &(row, weight)) in routed.iter().enumerate() {
            for c in 0..width {
                out[row * width + c] += y[k * width + c] * weight;
                scale[row * width + c] += f64::from(weight.abs()) * magnitude[k * width + c];
            }
        }
    }
    (out, scale)
}

/// Routes of a group of 6 rows over 3 experts (the prefill path): row 1 goes to all three,
/// row 5 to none.
pub fn routes_batched() -> Vec<Vec<(usize, f32)>> {
    vec![
        vec![(0, 0.5), (1, 0.25), (3, 0.125)],
        vec![(1, 0.3), (2, 0.7)],
        vec![(1, -0.2), (4, 1.5), (0, 0.1), (2, 0.05)],
    ]
}

/// One row per expert (the decode path), and an expert with no rows.
pub fn routes_single() -> Vec<Vec<(usize, f32)>> {
    vec![vec![(2, 0.6)], vec![(2, 0.3)], vec![], vec![(0, 1.0)]]
}
