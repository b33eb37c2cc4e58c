//! Weight formats and their CPU kernels.
//!
//! A [`Matrix`] is a 2-D weight `[rows, cols]` (the `nn.Linear` layout: `y = W x`) in one of
//! the compute formats, built from a tensor of the snapshot at the width the command line
//! asked for (`EBITS`/`DBITS`). An f32 tensor that is suitably aligned stays a view into the
//! mapped shard; any conversion (bf16/f16 widening, int8 quantisation) produces an owned copy
//! at load. Every kernel accumulates in f32 over f32 activations, so the oracle setting
//! (`>= 16` bits) computes exactly what a float reference computes, up to summation order.
//!
//! This module does not know about models, experts or caching.

mod kernels;

use anyhow::{bail, Result};
use half::{bf16, f16};
use rayon::prelude::*;

use crate::snapshot::{Dtype, MappedBytes, TensorView};

/// The storage width a bit-count selects for float tensors, as colibri maps its
/// `EBITS`/`DBITS` positionals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    /// `>= 16`: f32, the exact oracle setting.
    F32,
    /// `5..=15`: int8 with one f32 scale per row.
    Int8Row,
}

impl Width {
    pub fn from_bits(bits: u32) -> Result<Width> {
        match bits {
            16.. => Ok(Width::F32),
            5..=15 => Ok(Width::Int8Row),
            _ => bail!(
                "{bits}-bit weights are not supported: use 16 or more for f32 (exact) or 5..8 for int8 per-row"
            ),
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            Width::F32 => 32,
            Width::Int8Row => 8,
        }
    }
}

enum Storage {
    /// f32 little-endian bytes in the mapped shard, 4-byte aligned.
    MappedF32(MappedBytes),
    F32(Vec<f32>),
    Int8Row {
        values: Vec<i8>,
        scales: Vec<f32>,
    },
}

/// A 2-D weight matrix in a compute format.
pub struct Matrix {
    rows: usize,
    cols: usize,
    storage: Storage,
}

impl Matrix {
    /// Build from a 2-D float tensor at `width`.
    pub fn load(view: &TensorView, width: Width) -> Result<Matrix> {
        let [rows, cols] = view.shape[..] else {
            bail!(
                "{}: tensor {} has shape {:?}, expected a 2-D matrix",
                view.file.display(),
                view.name,
                view.shape
            );
        };
        let storage = match width {
            Width::F32 if view.dtype == Dtype::F32 && aligned_f32(&view.bytes).is_some() => {
                Storage::MappedF32(view.bytes.clone())
            }
            Width::F32 => Storage::F32(read_f32(view)?),
            Width::Int8Row => {
                let (values, scales) = kernels::quantize_int8_rows(&read_f32(view)?, cols);
                Storage::Int8Row { values, scales }
            }
        };
        Ok(Matrix {
            rows,
            cols,
            storage,
        })
    }

    /// Build from row-major f32 values already in memory (tests, benchmarks, converted
    /// weights).
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>, width: Width) -> Matrix {
        assert_eq!(values.len(), rows * cols, "matrix shape");
        let storage = match width {
            Width::F32 => Storage::F32(values),
            Width::Int8Row => {
                let (values, scales) = kernels::quantize_int8_rows(&values, cols);
                Storage::Int8Row { values, scales }
            }
        };
        Matrix {
            rows,
            cols,
            storage,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes this matrix occupies in its compute format.
    pub fn size_bytes(&self) -> usize {
        match &self.storage {
            Storage::MappedF32(bytes) => bytes.len(),
            Storage::F32(values) => values.len() * 4,
            Storage::Int8Row { values, scales } => values.len() + scales.len() * 4,
        }
    }

    /// `out[t] = W · input[t]` for `n` rows of input (`input` is `n x cols`, `out` is
    /// `n x rows`). Each output element is one independent dot product, so the result does
    /// not depend on how the work is split across threads.
    pub fn matmul(&self, input: &[f32], n: usize, out: &mut [f32]) {
        assert_eq!(input.len(), n * self.cols, "matmul input shape");
        assert_eq!(out.len(), n * self.rows, "matmul output shape");
        let parallel = n * self.rows * self.cols >= 1 << 16;
        if n == 1 {
            let chunk = self.rows.div_ceil(rayon::current_num_threads() * 4).max(16);
            let run = |(block, out): (usize, &mut [f32])| {
                for (offset, y) in out.iter_mut().enumerate() {
                    *y = self.dot_row(block * chunk + offset, input);
                }
            };
            if parallel {
                out.par_chunks_mut(chunk).enumerate().for_each(run);
            } else {
                out.chunks_mut(chunk).enumerate().for_each(run);
            }
        } else {
            let run = |(x, out): (&[f32], &mut [f32])| {
                for (row, y) in out.iter_mut().enumerate() {
                    *y = self.dot_row(row, x);
                }
            };
            if parallel {
                input
                    .par_chunks(self.cols)
                    .zip(out.par_chunks_mut(self.rows))
                    .for_each(run);
            } else {
                input
                    .chunks(self.cols)
                    .zip(out.chunks_mut(self.rows))
                    .for_each(run);
            }
        }
    }

    /// Row `row` as f32 (an embedding lookup).
    pub fn row_into(&self, row: usize, out: &mut [f32]) {
        let range = row * self.cols..(row + 1) * self.cols;
        match &self.storage {
            Storage::MappedF32(bytes) => out.copy_from_slice(&as_f32(bytes)[range]),
            Storage::F32(values) => out.copy_from_slice(&values[range]),
            Storage::Int8Row { values, scales } => {
                for (y, &q) in out.iter_mut().zip(&values[range]) {
                    *y = f32::from(q) * scales[row];
                }
            }
        }
    }

    fn dot_row(&self, row: usize, x: &[f32]) -> f32 {
        let range = row * self.cols..(row + 1) * self.cols;
        match &self.storage {
            Storage::MappedF32(bytes) => kernels::dot_f32(&as_f32(bytes)[range], x),
            Storage::F32(values) => kernels::dot_f32(&values[range], x),
            Storage::Int8Row { values, scales } => kernels::dot_i8(&values[range], x) * scales[row],
        }
    }
}

/// A 1-D float tensor (a norm weight, a bias) as owned f32.
pub fn load_vector(view: &TensorView, len: usize) -> Result<Vec<f32>> {
    if view.shape != [len] {
        bail!(
            "{}: tensor {} has shape {:?}, expected [{len}]",
            view.file.display(),
            view.name,
            view.shape
        );
    }
    read_f32(view)
}

/// The elements of a float tensor widened to f32.
fn read_f32(view: &TensorView) -> Result<Vec<f32>> {
    let bytes = view.bytes.as_slice();
    let values = match view.dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => bail!(
            "{}: tensor {} has dtype {other:?}; expected F32, BF16 or F16",
            view.file.display(),
            view.name
        ),
    };
    Ok(values)
}

fn aligned_f32(bytes: &MappedBytes) -> Option<&[f32]> {
    bytemuck::try_cast_slice(bytes.as_slice()).ok()
}

fn as_f32(bytes: &MappedBytes) -> &[f32] {
    aligned_f32(bytes).expect("mapped f32 storage is checked for alignment at load")
}
