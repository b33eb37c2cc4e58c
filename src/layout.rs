//! The byte layout of a stored weight, which the kernels, the converter and both GPU
//! backends share: its [`Format`], the arithmetic of its rows and scales, and the
//! [`RawMatrix`] view a device receives. This is a leaf: it imports nothing of the crate,
//! so that `backend` and `quant` both build on it without depending on each other.

use std::fmt;

/// A weight format, named as colibri's `FORMATS.md` and `colibri.fmt` stamps name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    F32,
    Bf16,
    F16,
    /// `name` O·I int8 bytes, `name.qs` O f32 scales.
    Int8Row,
    /// `name` O·⌈I/2⌉ nibble bytes, `name.qs` O f32 scales.
    Int4Row,
    /// `name` O·⌈I/2⌉ nibble bytes, `name.qs` O·⌈I/group⌉ f32 scales.
    Int4Grouped {
        group: usize,
    },
    /// `name` O·I E4M3 bytes, scales ⌈O/128⌉·⌈I/128⌉ f32, one per 128x128 block.
    Fp8E4m3B128,
    /// `name` O·⌈I/2⌉ e2m1 nibble bytes, scales O·⌈I/32⌉ E8M0 bytes.
    Mxfp4,
    /// Recognised so that a refusal can name it; no kernel.
    Int2Row,
    /// Recognised so that a refusal can name it; no kernel.
    Int3G64,
    /// Recognised so that a refusal can name it; no kernel.
    E8Iq3Lattice,
}

impl Format {
    /// The name in `colibri.fmt` stamps and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::Bf16 => "bf16",
            Format::F16 => "f16",
            Format::Int8Row => "int8-row",
            Format::Int4Row => "int4-row",
            Format::Int4Grouped { .. } => "int4-grouped",
            Format::Fp8E4m3B128 => "fp8-e4m3-b128",
            Format::Mxfp4 => "mxfp4",
            Format::Int2Row => "int2-row",
            Format::Int3G64 => "int3-g64",
            Format::E8Iq3Lattice => "e8-iq3-lattice",
        }
    }

    /// Whether coli computes with this format.
    pub fn supported(self) -> bool {
        !matches!(
            self,
            Format::Int2Row | Format::Int3G64 | Format::E8Iq3Lattice
        )
    }

    pub fn is_float(self) -> bool {
        matches!(self, Format::F32 | Format::Bf16 | Format::F16)
    }

    /// Bytes of one stored row of `cols` weights, each row starting on a byte boundary
    /// (the nibble formats pack two weights a byte, low nibble first); `None` for a format
    /// coli has no kernels for. The kernels' scaling and both GPU backends' upload checks
    /// ask it.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        Some(match self {
            Format::F32 => cols * 4,
            Format::Bf16 | Format::F16 => cols * 2,
            Format::Int8Row | Format::Fp8E4m3B128 => cols,
            Format::Int4Row | Format::Int4Grouped { .. } | Format::Mxfp4 => cols.div_ceil(2),
            Format::Int2Row | Format::Int3G64 | Format::E8Iq3Lattice => return None,
        })
    }

    /// Scales along one row of `cols` weights: one for the row formats, one per group of
    /// columns for int4-grouped and MXFP4 (32), one per 128-column block for FP8 (shared by
    /// 128 rows); none for the float formats.
    pub fn scales_per_row(self, cols: usize) -> usize {
        match self {
            Format::Int8Row | Format::Int4Row => 1,
            Format::Int4Grouped { group } => cols.div_ceil(group.max(1)),
            Format::Fp8E4m3B128 => cols.div_ceil(128),
            Format::Mxfp4 => cols.div_ceil(32),
            _ => 0,
        }
    }

    /// Scales a `rows x cols` matrix stores (FP8: one per 128x128 block).
    pub fn scale_count(self, rows: usize, cols: usize) -> usize {
        let per_row = self.scales_per_row(cols);
        match self {
            Format::Fp8E4m3B128 => rows.div_ceil(128) * per_row,
            _ => rows * per_row,
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Format::Int4Grouped { group } => write!(f, "int4-grouped (gs{group})"),
            other => f.write_str(other.name()),
        }
    }
}

/// A weight matrix as a device receives it: the compute format's bytes, row-major, each
/// row starting on a byte boundary (`rows x row_bytes`), and its scales.
#[derive(Debug, Clone, Copy)]
pub struct RawMatrix<'a> {
    pub rows: usize,
    pub cols: usize,
    pub format: Format,
    /// f32/bf16/f16 little-endian values; int8 values; int4 offset-binary nibbles or MXFP4
    /// e2m1 nibbles, low nibble first, `ceil(cols / 2)` bytes per row; e4m3 bytes.
    pub data: &'a [u8],
    pub scales: RawScales<'a>,
}

/// The scales of a [`RawMatrix`], in the layout its [`Format`] documents.
#[derive(Debug, Clone, Copy)]
pub enum RawScales<'a> {
    /// Float formats.
    None,
    /// f32 scales: one per row (int8-row, int4-row), one per row and group of columns
    /// (int4-grouped, `ceil(cols / group)` per row), or one per 128x128 block (fp8).
    F32(&'a [f32]),
    /// E8M0 exponent bytes, one per row and 32 columns (MXFP4).
    E8m0(&'a [u8]),
}
