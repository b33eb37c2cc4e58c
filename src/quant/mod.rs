//! Weight formats and their CPU kernels.
//!
//! A [`Matrix`] is a 2-D weight `[rows, cols]` (the `nn.Linear` layout: `y = W x`) in one of
//! the compute formats: f32, bf16, f16, int8-row, int4-row, int4-grouped, fp8-e4m3-b128 and
//! MXFP4 ([`Format`]). A tensor stored in float is kept in its float dtype at the oracle
//! width (`>= 16` bits: widening bf16/f16 to f32 is exact, so keeping the narrow dtype
//! computes the same values from half the bytes) or quantised at load to the width
//! `EBITS`/`DBITS` ask for ([`Width`]). A pre-quantised tensor (`name` + a scale tensor,
//! see [`format`]) keeps its own format whatever the width, as colibri's containers do.
//! Weights stay views into the mapped shard whenever their bytes are suitably aligned; only
//! scales and converted tensors are owned.
//!
//! Every kernel accumulates in f32 over f32 activations, with one summation order shared
//! by the scalar reference and every SIMD path ([`kernels`]), so the oracle setting computes
//! what a float reference computes up to summation order, and `COLI_SIMD` never changes a
//! result.
//!
//! This module does not know about models, experts or caching.

pub mod act8;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod codec;
pub mod format;
mod kernels;
mod lines;
#[cfg(target_arch = "aarch64")]
mod neon;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::marker::PhantomData;

use anyhow::{bail, Result};
use bytemuck::Pod;
use half::{bf16, f16};
use rayon::prelude::*;

pub use codec::{
    e4m3_to_f32, f32_to_e4m3, quantize_fp8_blocks, quantize_int4_groups, quantize_int8_rows,
    quantize_mxfp4,
};
pub use format::{Format, DEFAULT_INT4_GROUP};
pub use kernels::{
    add_weighted, dots, fused_add_weighted, fused_add_weighted_tile, fused_dots,
    loads_shared_across_vectors, select as select_simd, selected as selected_simd,
    tile_pays_for_skipped_rows, Isa, Queries,
};
pub use lines::Lines;

use crate::backend::{self, Residency};
use crate::layout::{RawMatrix, RawScales};
use crate::snapshot::{Dtype, MappedBytes, TensorView};
use kernels::{
    Bf16Codes, Decode, E2m1Codes, E4m3Codes, F16Codes, F32Codes, I8Codes, Int4Codes, Scaling,
    SimdDecode, View,
};

/// The storage width a bit-count selects for float tensors, as colibri maps its
/// `EBITS`/`DBITS` positionals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Width {
    /// `>= 16`: float as stored (f32, or bf16/f16 used exactly), the oracle setting.
    F32,
    /// `5..=15`: int8 with one f32 scale per row.
    Int8Row,
    /// `4`: int4 with one f32 scale per group of 64 columns.
    Int4Group64,
}

impl Width {
    pub fn from_bits(bits: u32) -> Result<Width> {
        match bits {
            16.. => Ok(Width::F32),
            5..=15 => Ok(Width::Int8Row),
            4 => Ok(Width::Int4Group64),
            _ => bail!(
                "{bits}-bit weights are not supported: use 16 or more for f32 (exact), 5..15 for int8 per row or 4 for int4 in groups of 64"
            ),
        }
    }

    /// The width of embeddings and the LM head when dense weights use `self`: f32 unless
    /// dense weights go below 8 bits, as colibri sizes them.
    pub fn for_embeddings(self) -> Width {
        if self.bits() >= 8 {
            Width::F32
        } else {
            self
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            Width::F32 => 32,
            Width::Int8Row => 8,
            Width::Int4Group64 => 4,
        }
    }

    /// The format a float tensor is stored in at this width.
    pub fn format(self) -> Format {
        match self {
            Width::F32 => Format::F32,
            Width::Int8Row => Format::Int8Row,
            Width::Int4Group64 => Format::Int4Grouped {
                group: DEFAULT_INT4_GROUP,
            },
        }
    }
}

/// Elements of type `T`: a window into the mapped shard when its bytes are aligned for
/// `T`, else an owned copy.
enum Data<T> {
    Mapped(MappedBytes, PhantomData<T>),
    Owned(Vec<T>),
}

impl<T: Pod> Data<T> {
    fn from_mapped(bytes: &MappedBytes) -> Data<T> {
        match bytemuck::try_cast_slice::<u8, T>(bytes.as_slice()) {
            Ok(_) => Data::Mapped(bytes.clone(), PhantomData),
            Err(_) => Data::Owned(
                bytes
                    .as_slice()
                    .chunks_exact(std::mem::size_of::<T>())
                    .map(bytemuck::pod_read_unaligned)
                    .collect(),
            ),
        }
    }

    fn as_slice(&self) -> &[T] {
        match self {
            Data::Mapped(bytes, _) => bytemuck::cast_slice(bytes.as_slice()),
            Data::Owned(values) => values,
        }
    }

    fn size_bytes(&self) -> usize {
        std::mem::size_of_val(self.as_slice())
    }
}

enum Storage {
    F32(Data<f32>),
    Bf16(Data<u16>),
    F16(Data<u16>),
    Int8Row {
        values: Data<i8>,
        scales: Vec<f32>,
    },
    /// int4-row (`group == cols`, one scale per row) and int4-grouped.
    Int4 {
        packed: Data<u8>,
        scales: Vec<f32>,
        group: usize,
    },
    Fp8 {
        codes: Data<u8>,
        scales: Vec<f32>,
    },
    Mxfp4 {
        packed: Data<u8>,
        scales: Data<u8>,
    },
}

/// A 2-D weight matrix in a compute format.
pub struct Matrix {
    rows: usize,
    cols: usize,
    format: Format,
    storage: Storage,
    residency: Residency,
}

/// A format's kernel view and codec, for one generic call.
macro_rules! with_view {
    ($matrix:expr, |$view:ident, $codes:ident| $body:expr) => {{
        let m = $matrix;
        let (rows, cols) = (m.rows, m.cols);
        fn view<'a, T>(
            data: &'a [T],
            rows: usize,
            cols: usize,
            scaling: Scaling<'a>,
        ) -> View<'a, T> {
            View {
                data,
                rows,
                cols,
                scaling,
            }
        }
        match &m.storage {
            Storage::F32(data) => {
                type $codes = F32Codes;
                let $view = view(data.as_slice(), rows, cols, Scaling::None);
                $body
            }
            Storage::Bf16(data) => {
                type $codes = Bf16Codes;
                let $view = view(data.as_slice(), rows, cols, Scaling::None);
                $body
            }
            Storage::F16(data) => {
                type $codes = F16Codes;
                let $view = view(data.as_slice(), rows, cols, Scaling::None);
                $body
            }
            Storage::Int8Row { values, scales } => {
                type $codes = I8Codes;
                let $view = view(values.as_slice(), rows, cols, Scaling::Row(scales));
                $body
            }
            Storage::Int4 {
                packed,
                scales,
                group,
            } => {
                type $codes = Int4Codes;
                let scaling = if *group >= cols {
                    Scaling::Row(scales)
                } else {
                    Scaling::Groups {
                        size: *group,
                        scales,
                        per_row: cols.div_ceil(*group),
                        row_div: 1,
                    }
                };
                let $view = view(packed.as_slice(), rows, cols, scaling);
                $body
            }
            Storage::Fp8 { codes, scales } => {
                type $codes = E4m3Codes;
                let scaling = Scaling::Groups {
                    size: 128,
                    scales,
                    per_row: Format::Fp8E4m3B128.scales_per_row(cols),
                    row_div: 128,
                };
                let $view = view(codes.as_slice(), rows, cols, scaling);
                $body
            }
            Storage::Mxfp4 { packed, scales } => {
                type $codes = E2m1Codes;
                let scaling = Scaling::E8m0 {
                    scales: scales.as_slice(),
                    per_row: Format::Mxfp4.scales_per_row(cols),
                };
                let $view = view(packed.as_slice(), rows, cols, scaling);
                $body
            }
        }
    }};
}

impl Matrix {
    /// Build from a 2-D tensor: a float tensor at `width`, a pre-quantised one (it carries
    /// `scales`) in its own format. The format is checked against the byte counts and the
    /// container stamp ([`format::infer`]).
    pub fn load(view: &TensorView, width: Width) -> Result<Matrix> {
        let [rows, cols] = view.shape[..] else {
            bail!(
                "{}: tensor {} has shape {:?}, expected a 2-D matrix",
                view.file.display(),
                view.name,
                view.shape
            );
        };
        let format = format::infer(view, rows, cols)?;
        let storage = match format {
            Format::F32 | Format::Bf16 | Format::F16 if width != Width::F32 => {
                return Ok(Matrix::encode(rows, cols, &read_f32(view)?, width.format()));
            }
            Format::F32 => Storage::F32(Data::from_mapped(&view.bytes)),
            Format::Bf16 => Storage::Bf16(Data::from_mapped(&view.bytes)),
            Format::F16 => Storage::F16(Data::from_mapped(&view.bytes)),
            _ => {
                let Some(scales) = view.scales.as_deref() else {
                    bail!(
                        "{}: tensor {} has no scales",
                        view.file.display(),
                        view.name
                    );
                };
                let bytes = &view.bytes;
                match format {
                    Format::Int8Row => Storage::Int8Row {
                        values: Data::from_mapped(bytes),
                        scales: read_f32(scales)?,
                    },
                    Format::Int4Row => Storage::Int4 {
                        packed: Data::from_mapped(bytes),
                        scales: read_f32(scales)?,
                        group: cols,
                    },
                    Format::Int4Grouped { group } => Storage::Int4 {
                        packed: Data::from_mapped(bytes),
                        scales: read_f32(scales)?,
                        group,
                    },
                    Format::Fp8E4m3B128 => Storage::Fp8 {
                        codes: Data::from_mapped(bytes),
                        scales: read_f32(scales)?,
                    },
                    Format::Mxfp4 => Storage::Mxfp4 {
                        packed: Data::from_mapped(bytes),
                        scales: Data::from_mapped(&scales.bytes),
                    },
                    other => bail!(
                        "{}: tensor {} is {other}, which coli cannot compute with",
                        view.file.display(),
                        view.name
                    ),
                }
            }
        };
        Ok(Matrix {
            rows,
            cols,
            format,
            storage,
            residency: Residency::default(),
        })
    }

    /// Build from row-major f32 values already in memory (tests, benchmarks, converted
    /// weights).
    pub fn from_f32(rows: usize, cols: usize, values: Vec<f32>, width: Width) -> Matrix {
        assert_eq!(values.len(), rows * cols, "matrix shape");
        match width {
            Width::F32 => Matrix {
                rows,
                cols,
                format: Format::F32,
                storage: Storage::F32(Data::Owned(values)),
                residency: Residency::default(),
            },
            other => Matrix::encode(rows, cols, &values, other.format()),
        }
    }

    /// Encode row-major f32 values in any supported format (an int4-grouped group size
    /// must be a multiple of 8).
    pub fn from_f32_as(rows: usize, cols: usize, values: &[f32], format: Format) -> Result<Matrix> {
        if values.len() != rows * cols {
            bail!("{} values for a {rows}x{cols} matrix", values.len());
        }
        match format {
            Format::Int4Grouped { group } if group == 0 || !group.is_multiple_of(8) => {
                bail!(
                    "int4-grouped needs a group size that is a positive multiple of 8, not {group}"
                )
            }
            other if !other.supported() => bail!("{other} has no kernel"),
            other => Ok(Matrix::encode(rows, cols, values, other)),
        }
    }

    fn encode(rows: usize, cols: usize, values: &[f32], format: Format) -> Matrix {
        let storage = match format {
            Format::Bf16 => Storage::Bf16(Data::Owned(
                values
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits())
                    .collect(),
            )),
            Format::F16 => Storage::F16(Data::Owned(
                values.iter().map(|&v| f16::from_f32(v).to_bits()).collect(),
            )),
            Format::Int8Row => {
                let (values, scales) = quantize_int8_rows(values, cols);
                Storage::Int8Row {
                    values: Data::Owned(values),
                    scales,
                }
            }
            Format::Int4Row | Format::Int4Grouped { .. } => {
                let group = match format {
                    Format::Int4Grouped { group } => group,
                    _ => cols,
                };
                let (packed, scales) = quantize_int4_groups(values, cols, group);
                Storage::Int4 {
                    packed: Data::Owned(packed),
                    scales,
                    group: group.min(cols),
                }
            }
            Format::Fp8E4m3B128 => {
                let (codes, scales) = quantize_fp8_blocks(values, cols);
                Storage::Fp8 {
                    codes: Data::Owned(codes),
                    scales,
                }
            }
            Format::Mxfp4 => {
                let (packed, scales) = quantize_mxfp4(values, cols);
                Storage::Mxfp4 {
                    packed: Data::Owned(packed),
                    scales: Data::Owned(scales),
                }
            }
            _ => Storage::F32(Data::Owned(values.to_vec())),
        };
        let format = match (format, &storage) {
            (Format::Int4Grouped { .. }, Storage::Int4 { group, .. }) if *group >= cols => {
                Format::Int4Row
            }
            (format, Storage::F32(_)) if !format.is_float() => Format::F32,
            (format, _) => format,
        };
        Matrix {
            rows,
            cols,
            format,
            storage,
            residency: Residency::default(),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The format the matrix computes in.
    pub fn format(&self) -> Format {
        self.format
    }

    /// Bytes this matrix occupies in its compute format, scales included: what one pass
    /// over it reads.
    pub fn size_bytes(&self) -> usize {
        match &self.storage {
            Storage::F32(data) => data.size_bytes(),
            Storage::Bf16(data) | Storage::F16(data) => data.size_bytes(),
            Storage::Int8Row { values, scales } => values.size_bytes() + scales.len() * 4,
            Storage::Int4 { packed, scales, .. } => packed.size_bytes() + scales.len() * 4,
            Storage::Fp8 { codes, scales } => codes.size_bytes() + scales.len() * 4,
            Storage::Mxfp4 { packed, scales } => packed.size_bytes() + scales.size_bytes(),
        }
    }

    /// `out[t] = W · input[t]` for `n` rows of input (`input` is `n x cols`, `out` is
    /// `n x rows`), with the instruction set `COLI_SIMD` selects. Each output element is
    /// one dot product in a fixed order, so the result does not depend on how the work is
    /// split across threads, nor on `n`: a batch computes what `n` single rows compute,
    /// reading each weight row once for the whole batch.
    ///
    /// With a GPU backend installed the product runs there (see [`backend`]) unless the
    /// matrix is [host-only](Matrix::host_only).
    pub fn matmul(&self, input: &[f32], n: usize, out: &mut [f32]) {
        if backend::matmul(&self.residency, || self.raw(), input, n, out) {
            return;
        }
        if act8::enabled() {
            if let Some(weights) = self.integer_weights() {
                let isa = kernels::selected();
                return act8::matmul(isa, weights, self.rows, self.cols, input, n, out);
            }
        }
        self.matmul_with(kernels::selected(), input, n, out)
    }

    /// The weights of an int8, int4 or MXFP4 matrix, for the int8-activation path.
    fn integer_weights(&self) -> Option<act8::Weights<'_>> {
        match &self.storage {
            Storage::Int8Row { values, scales } => Some(act8::Weights::Int8Row {
                values: values.as_slice(),
                scales,
            }),
            Storage::Int4 {
                packed,
                scales,
                group,
            } => Some(act8::Weights::Int4 {
                packed: packed.as_slice(),
                scales,
                group: *group,
            }),
            Storage::Mxfp4 { packed, scales } => Some(act8::Weights::Mxfp4 {
                packed: packed.as_slice(),
                scales: scales.as_slice(),
            }),
            _ => None,
        }
    }

    /// Keep this matrix off the GPU backend's automatic uploads (routed experts, which a
    /// GPU holds only through its expert tier).
    pub fn host_only(mut self) -> Matrix {
        self.residency = Residency::HostOnly;
        self
    }

    /// The matrix's bytes and scales as a device uploads them.
    pub fn raw(&self) -> RawMatrix<'_> {
        let (data, scales): (&[u8], RawScales<'_>) = match &self.storage {
            Storage::F32(data) => (bytemuck::cast_slice(data.as_slice()), RawScales::None),
            Storage::Bf16(data) | Storage::F16(data) => {
                (bytemuck::cast_slice(data.as_slice()), RawScales::None)
            }
            Storage::Int8Row { values, scales } => (
                bytemuck::cast_slice(values.as_slice()),
                RawScales::F32(scales),
            ),
            Storage::Int4 { packed, scales, .. } => (packed.as_slice(), RawScales::F32(scales)),
            Storage::Fp8 { codes, scales } => (codes.as_slice(), RawScales::F32(scales)),
            Storage::Mxfp4 { packed, scales } => {
                (packed.as_slice(), RawScales::E8m0(scales.as_slice()))
            }
        };
        RawMatrix {
            rows: self.rows,
            cols: self.cols,
            format: self.format,
            data,
            scales,
        }
    }

    /// [`Matrix::matmul`] with an explicit instruction set (an unsupported one falls back
    /// to the scalar reference).
    pub fn matmul_with(&self, isa: Isa, input: &[f32], n: usize, out: &mut [f32]) {
        fn run<D: Decode<kernels::Scalar> + SimdDecode>(
            isa: Isa,
            view: View<'_, D::Elem>,
            input: &[f32],
            n: usize,
            out: &mut [f32],
        ) {
            kernels::matmul::<D>(isa, view, input, n, out)
        }
        with_view!(self, |view, C| run::<C>(isa, view, input, n, out))
    }

    /// Row `row` as f32, scale applied (an embedding lookup).
    pub fn row_into(&self, row: usize, out: &mut [f32]) {
        self.row_into_with(kernels::selected(), row, out)
    }

    /// [`Matrix::row_into`] with the kernels of `isa` (the same bits with every one).
    pub fn row_into_with(&self, isa: Isa, row: usize, out: &mut [f32]) {
        fn run<D: Decode<kernels::Scalar> + SimdDecode>(
            isa: Isa,
            view: View<'_, D::Elem>,
            row: usize,
            out: &mut [f32],
        ) {
            kernels::dequantize_row::<D>(isa, view, row, out)
        }
        with_view!(self, |view, C| run::<C>(isa, view, row, out))
    }

    /// Rows `first..first + count` of the matrix against each of the `n` rows of `input`,
    /// as `out[t * count + row - first]` (`count = out.len() / n`): those output elements
    /// of [`Matrix::matmul`] with f32 activations, for callers that need only some rows
    /// (e.g. one head's slice).
    pub fn rows_product(&self, first: usize, input: &[f32], n: usize, out: &mut [f32]) {
        fn run<D: Decode<kernels::Scalar> + SimdDecode>(
            view: View<'_, D::Elem>,
            first: usize,
            input: &[f32],
            n: usize,
            out: &mut [f32],
        ) {
            kernels::rows_product::<D>(kernels::selected(), view, first, input, n, out)
        }
        with_view!(self, |view, C| run::<C>(view, first, input, n, out))
    }

    /// Every element as f32 (scales applied), row-major.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut values = vec![0f32; self.rows * self.cols];
        for (row, out) in values.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.row_into(row, out);
        }
        values
    }
}

/// `out = matrix . input` for several matrices that read the same `n` input rows (q, k and
/// v of one attention; gate and up of one FFN), side by side on the thread pool: one wait
/// for the set instead of one per product, and each product computes what
/// [`Matrix::matmul`] computes.
pub fn matmul_shared_input(products: Vec<(&Matrix, &mut [f32])>, input: &[f32], n: usize) {
    products
        .into_par_iter()
        .for_each(|(matrix, out)| matrix.matmul(input, n, out));
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
pub fn read_f32(view: &TensorView) -> Result<Vec<f32>> {
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
