//! How an uploaded weight sits in device memory for `kernels/vulkan/matmul.wgsl`: each row
//! of the format's bytes padded to whole u32 words, the scales after the rows, and the
//! matrix cut into row parts small enough for one storage-buffer binding. This module only
//! computes and fills byte layouts; it knows nothing of Vulkan objects.

use crate::backend::{DeviceError, RawMatrix, RawScales};
use crate::layout::Format;

/// Format codes of the matmul shader.
const F32: u32 = 0;
const BF16: u32 = 1;
const F16: u32 = 2;
const INT8: u32 = 3;
const INT4: u32 = 4;
const MXFP4: u32 = 5;
const FP8: u32 = 6;

/// Columns per E8M0 scale byte in MXFP4; rows and columns per FP8 scale block.
const MXFP4_GROUP: usize = 32;
const FP8_BLOCK: usize = 128;

/// The shader's view of one format at one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packing {
    pub code: u32,
    pub rows: usize,
    pub cols: usize,
    /// Bytes of one row in the [`RawMatrix`].
    row_bytes: usize,
    pub row_words: usize,
    /// Scale words per scale row (MXFP4: words of scale bytes).
    pub scale_stride: usize,
    /// Columns sharing one scale.
    pub group: usize,
    /// Rows sharing one scale row (a whole FP8 block, else 1).
    pub scale_row_div: usize,
}

/// A run of consecutive rows stored in one buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub first_row: usize,
    pub rows: usize,
}

impl Packing {
    /// The layout of `matrix`, checking that its bytes and scales are what the format says;
    /// formats and shapes the shader does not take are [`DeviceError::Unsupported`].
    pub fn of(matrix: &RawMatrix<'_>) -> Result<Packing, DeviceError> {
        let (rows, cols) = (matrix.rows, matrix.cols);
        if rows == 0 || cols == 0 {
            return Err(DeviceError::Unsupported(format!(
                "an empty {rows}x{cols} matrix"
            )));
        }
        let format = matrix.format;
        // 0 only for the formats without kernels, which the match below refuses.
        let row_bytes = format.row_bytes(cols).unwrap_or(0);
        let per_row = format.scales_per_row(cols);
        let (code, scale_stride, group, scale_row_div) = match format {
            Format::F32 => (F32, 0, 1, 1),
            Format::Bf16 => (BF16, 0, 1, 1),
            Format::F16 => (F16, 0, 1, 1),
            Format::Int8Row => (INT8, 1, cols.max(1), 1),
            Format::Int4Row => (INT4, 1, cols.max(1), 1),
            Format::Int4Grouped { group } if group > 0 && group.is_multiple_of(8) => {
                (INT4, per_row, group, 1)
            }
            // E8M0 bytes, four to a 32-bit word.
            Format::Mxfp4 => (MXFP4, per_row.div_ceil(4), MXFP4_GROUP, 1),
            Format::Fp8E4m3B128 => (FP8, per_row, FP8_BLOCK, FP8_BLOCK),
            other => {
                return Err(DeviceError::Unsupported(format!(
                    "{other} weights on the Vulkan device"
                )))
            }
        };
        let packing = Packing {
            code,
            rows,
            cols,
            row_bytes,
            row_words: row_bytes.div_ceil(4),
            scale_stride,
            group,
            scale_row_div,
        };
        packing.check(matrix)?;
        Ok(packing)
    }

    fn check(&self, matrix: &RawMatrix<'_>) -> Result<(), DeviceError> {
        let mismatch = |what: String| {
            Err(DeviceError::Unsupported(format!(
                "a {}x{} {} matrix with {what}",
                self.rows, self.cols, matrix.format
            )))
        };
        if matrix.data.len() != self.rows * self.row_bytes {
            return mismatch(format!(
                "{} data bytes (expected {})",
                matrix.data.len(),
                self.rows * self.row_bytes
            ));
        }
        let expected = matrix.format.scale_count(self.rows, self.cols);
        match (self.code, matrix.scales) {
            (F32 | BF16 | F16, RawScales::None) => Ok(()),
            (INT8 | INT4 | FP8, RawScales::F32(scales)) if scales.len() == expected => Ok(()),
            (MXFP4, RawScales::E8m0(scales)) if scales.len() == expected => Ok(()),
            (_, scales) => mismatch(format!("scales {scales:?} (expected {expected} values)")),
        }
    }

    /// Scales of one scale row in the [`RawMatrix`] (MXFP4: bytes).
    fn scales_per_row(&self) -> usize {
        match self.code {
            F32 | BF16 | F16 => 0,
            MXFP4 => Format::Mxfp4.scales_per_row(self.cols),
            _ => self.scale_stride,
        }
    }

    /// The scale rows that rows `first..first + rows` use.
    fn scale_rows(&self, first: usize, rows: usize) -> usize {
        (first + rows).div_ceil(self.scale_row_div) - first / self.scale_row_div
    }

    /// Bytes of a part of `rows` rows starting at `first`.
    pub fn part_bytes(&self, part: Part) -> usize {
        (part.rows * self.row_words
            + self.scale_rows(part.first_row, part.rows) * self.scale_stride)
            * 4
    }

    /// The word offset of a part's scales in its buffer.
    pub fn scale_offset(&self, part: Part) -> usize {
        part.rows * self.row_words
    }

    /// The matrix cut into parts of at most `max_bytes` each (whole FP8 blocks per part);
    /// `None` when not even one row (block) fits.
    pub fn parts(&self, max_bytes: usize) -> Option<Vec<Part>> {
        let unit = self.scale_row_div;
        let unit_bytes = self.part_bytes(Part {
            first_row: 0,
            rows: unit,
        });
        let rows_per_part = max_bytes / unit_bytes * unit;
        if rows_per_part == 0 {
            return None;
        }
        Some(
            (0..self.rows)
                .step_by(rows_per_part)
                .map(|first_row| Part {
                    first_row,
                    rows: rows_per_part.min(self.rows - first_row),
                })
                .collect(),
        )
    }

    /// Write a part of `matrix` into `out` (`part_bytes(part)` long): each row padded with
    /// zero bytes to whole words, then the part's scale rows.
    pub fn fill(&self, matrix: &RawMatrix<'_>, part: Part, out: &mut [u8]) {
        out.fill(0);
        let row_stride = self.row_words * 4;
        let rows = &matrix.data[part.first_row * self.row_bytes..][..part.rows * self.row_bytes];
        for (source, target) in rows
            .chunks_exact(self.row_bytes)
            .zip(out.chunks_exact_mut(row_stride))
        {
            target[..self.row_bytes].copy_from_slice(source);
        }
        let scales_out = &mut out[self.scale_offset(part) * 4..];
        let first = part.first_row / self.scale_row_div;
        let count = self.scale_rows(part.first_row, part.rows);
        match matrix.scales {
            RawScales::None => {}
            RawScales::F32(scales) => {
                let slice = &scales[first * self.scale_stride..][..count * self.scale_stride];
                scales_out[..slice.len() * 4].copy_from_slice(bytemuck::cast_slice(slice));
            }
            RawScales::E8m0(bytes) => {
                let per_row = self.scales_per_row();
                for (source, target) in bytes[first * per_row..][..count * per_row]
                    .chunks_exact(per_row)
                    .zip(scales_out.chunks_exact_mut(self.scale_stride * 4))
                {
                    target[..per_row].copy_from_slice(source);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::Matrix;

    fn packing(rows: usize, cols: usize, format: Format) -> (Matrix, Packing) {
        let values: Vec<f32> = (0..rows * cols).map(|i| (i % 13) as f32 - 6.0).collect();
        let matrix = Matrix::from_f32_as(rows, cols, &values, format).expect("encodable");
        let packing = Packing::of(&matrix.raw()).expect("packable");
        (matrix, packing)
    }

    #[test]
    fn rows_are_padded_to_words_and_scales_follow() {
        let (matrix, packing) = packing(3, 5, Format::Int8Row);
        assert_eq!((packing.row_words, packing.scale_stride), (2, 1));
        let part = Part {
            first_row: 0,
            rows: 3,
        };
        let mut out = vec![0xAAu8; packing.part_bytes(part)];
        packing.fill(&matrix.raw(), part, &mut out);
        assert_eq!(out.len(), 3 * 8 + 3 * 4);
        assert_eq!(&out[..5], &matrix.raw().data[..5]);
        assert_eq!(&out[5..8], &[0, 0, 0]);
        let RawScales::F32(scales) = matrix.raw().scales else {
            panic!("int8 rows have f32 scales")
        };
        assert_eq!(&out[24..28], &scales[0].to_le_bytes());
    }

    #[test]
    fn mxfp4_scale_bytes_are_padded_per_row() {
        let (matrix, packing) = packing(2, 40, Format::Mxfp4);
        assert_eq!((packing.row_words, packing.scale_stride), (5, 1));
        let part = Part {
            first_row: 1,
            rows: 1,
        };
        let mut out = vec![0u8; packing.part_bytes(part)];
        packing.fill(&matrix.raw(), part, &mut out);
        let RawScales::E8m0(scales) = matrix.raw().scales else {
            panic!("mxfp4 has e8m0 scales")
        };
        assert_eq!(&out[20..24], &[scales[2], scales[3], 0, 0]);
    }

    #[test]
    fn parts_keep_fp8_blocks_whole() {
        let (_, packing) = packing(300, 16, Format::Fp8E4m3B128);
        let block = packing.part_bytes(Part {
            first_row: 0,
            rows: 128,
        });
        let parts = packing.parts(block * 2 - 1).expect("one block fits");
        assert_eq!(
            parts,
            vec![
                Part {
                    first_row: 0,
                    rows: 128
                },
                Part {
                    first_row: 128,
                    rows: 128
                },
                Part {
                    first_row: 256,
                    rows: 44
                },
            ]
        );
        assert_eq!(packing.parts(block - 1), None);
    }
}
