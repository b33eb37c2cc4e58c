//! Which format a stored weight is in: the names colibri's containers use, the inference
//! from byte counts (a pre-quantised weight `name` carries no format field, only its byte
//! count and the count of its scales), and the check against the `colibri.fmt` container
//! stamp (which `snapshot` parses and merges) that may confirm it.
//!
//! A quantised weight `W[O, I]` is `name` (raw U8/I8 bytes, usually a flat 1-D array) plus
//! a scale tensor: `name.qs` (F32) in colibri's containers, `name_scale_inv` (F32 per
//! 128x128 block) beside an F8_E4M3 weight in published FP8 checkpoints, or
//! `*.weight_scale` (E8M0 bytes) beside a compressed-tensors `*.weight_packed` MXFP4 weight.
//! The snapshot attaches that tensor to the view as `scales`; this module decides what the
//! pair means for the shape the engine expects.

use anyhow::{bail, Result};

pub use crate::layout::Format;
use crate::snapshot::{Dtype, TensorView};

/// Group sizes an int4-grouped weight may use, tried from the smallest; not stored in the
/// container, found from the scale count.
pub const INT4_GROUP_SIZES: [usize; 8] = [16, 32, 48, 64, 96, 128, 192, 256];

/// The group size `coli convert` and `EBITS`/`DBITS = 4` use.
pub const DEFAULT_INT4_GROUP: usize = 64;

/// Whether a stamp naming `name` describes `format`. A float tensor stamped `f32` agrees
/// whatever its float dtype: colibri reads every float tensor as f32.
fn answers_to(format: Format, name: &str) -> bool {
    name == format.name() || (format.is_float() && name == "f32")
}

/// Every name a stamp may use.
const KNOWN_NAMES: &[&str] = &[
    "f32",
    "bf16",
    "f16",
    "int8-row",
    "int4-row",
    "int2-row",
    "int4-grouped",
    "int3-g64",
    "e8-iq3-lattice",
    "mxfp4",
    "fp8-e4m3-b128",
    "int4-rans256-g0",
];

/// The stored byte counts of a view, for inference and messages.
struct Counts {
    weight_bytes: usize,
    scale_dtype: Dtype,
    scale_bytes: usize,
}

/// The format of `view` read as a `[rows, cols]` matrix: the float dtype when it has no
/// scale tensor, else the byte-count inference, checked against the container stamp.
pub fn infer(view: &TensorView, rows: usize, cols: usize) -> Result<Format> {
    let format = match &view.scales {
        None => float_format(view, rows, cols)?,
        Some(scales) => {
            let counts = Counts {
                weight_bytes: view.bytes.len(),
                scale_dtype: scales.dtype,
                scale_bytes: scales.bytes.len(),
            };
            quantised_format(view, &counts, rows, cols)?
        }
    };
    if let Some(stamp) = &view.stamp {
        if !answers_to(format, stamp) {
            bail!(
                "{}: tensor {}: the container stamp says {stamp}, its byte counts say {format} for shape [{rows}, {cols}]; refusing a container that disagrees with itself",
                view.file.display(),
                view.name
            );
        }
    }
    if !format.supported() {
        bail!(
            "{}: tensor {} is {format} (colibri's format of that name); coli computes with f32, bf16, f16, int8-row, int4-row, int4-grouped, fp8-e4m3-b128 and mxfp4 only; re-convert it with `coli convert`",
            view.file.display(),
            view.name
        );
    }
    Ok(format)
}

fn float_format(view: &TensorView, rows: usize, cols: usize) -> Result<Format> {
    let (format, size) = match view.dtype {
        Dtype::F32 => (Format::F32, 4),
        Dtype::BF16 => (Format::Bf16, 2),
        Dtype::F16 => (Format::F16, 2),
        Dtype::U8 | Dtype::I8 => bail!(
            "{}: tensor {} holds {} raw {:?} bytes but has no {}.qs scale tensor; a quantised weight needs its scales",
            view.file.display(),
            view.name,
            view.bytes.len(),
            view.dtype,
            view.name
        ),
        Dtype::F8_E4M3 => bail!(
            "{}: tensor {} is F8_E4M3 but has no {}_scale_inv block-scale tensor",
            view.file.display(),
            view.name,
            view.name
        ),
        other => bail!(
            "{}: tensor {} has dtype {other:?}; expected F32, BF16 or F16, or quantised bytes with a scale tensor",
            view.file.display(),
            view.name
        ),
    };
    if view.bytes.len() != rows * cols * size {
        bail!(
            "{}: tensor {} has {} bytes of {:?}, expected {rows}x{cols}x{size} = {} for shape [{rows}, {cols}]",
            view.file.display(),
            view.name,
            view.bytes.len(),
            view.dtype,
            rows * cols * size
        );
    }
    Ok(format)
}

/// The formats whose byte arithmetic matches, in colibri's order of precedence: the row
/// formats (int8, int4, int2, int3), then the grouped and block formats.
fn candidates(counts: &Counts, rows: usize, cols: usize) -> Vec<Format> {
    let (nb, o, i) = (counts.weight_bytes, rows, cols);
    let mut found = Vec::new();
    match counts.scale_dtype {
        Dtype::F32 if counts.scale_bytes.is_multiple_of(4) => {
            let ns = counts.scale_bytes / 4;
            let nibbles = o * i.div_ceil(2);
            if nb == o * i && ns == o {
                found.push(Format::Int8Row);
            }
            if nb == nibbles && ns == o {
                found.push(Format::Int4Row);
            }
            if nb == o * i.div_ceil(4) && ns == o {
                found.push(Format::Int2Row);
            }
            if nb == o * i.div_ceil(64) * 24 && ns == o * i.div_ceil(64) {
                found.push(Format::Int3G64);
            }
            if nb == nibbles && ns != o {
                if let Some(&group) = INT4_GROUP_SIZES
                    .iter()
                    .find(|&&gs| ns == o * i.div_ceil(gs))
                {
                    found.push(Format::Int4Grouped { group });
                }
            }
            if nb == o * i && ns == o.div_ceil(128) * i.div_ceil(128) {
                found.push(Format::Fp8E4m3B128);
            }
            if nb == o * i.div_ceil(256) * 98 && ns == 1 {
                found.push(Format::E8Iq3Lattice);
            }
        }
        Dtype::U8 | Dtype::F8_E8M0
            if nb == o * i.div_ceil(2) && counts.scale_bytes == o * i.div_ceil(32) =>
        {
            found.push(Format::Mxfp4);
        }
        _ => {}
    }
    found
}

fn quantised_format(
    view: &TensorView,
    counts: &Counts,
    rows: usize,
    cols: usize,
) -> Result<Format> {
    let scales_name = view.scales.as_ref().map_or("", |s| s.name.as_str());
    let mut found = candidates(counts, rows, cols);
    if found.is_empty()
        && counts.scale_dtype == Dtype::F8_E8M0
        && counts.weight_bytes == rows * cols
        && counts.scale_bytes == rows.div_ceil(128) * cols.div_ceil(128)
    {
        bail!(
            "{}: tensor {} has UE8M0 block scales ({scales_name}); recognised but not supported: coli reads FP8 with f32 block scales",
            view.file.display(),
            view.name
        );
    }
    match view.dtype {
        // The dtype itself says FP8; only the block layout can match.
        Dtype::F8_E4M3 => found.retain(|f| *f == Format::Fp8E4m3B128),
        Dtype::U8 | Dtype::I8 => {}
        other => bail!(
            "{}: tensor {} has dtype {other:?} beside the scale tensor {scales_name}; a quantised weight is U8, I8 or F8_E4M3",
            view.file.display(),
            view.name
        ),
    }
    if found.is_empty() {
        bail!(
            "{}: tensor {}: {} weight bytes ({:?}) and {} scale bytes ({:?}, {scales_name}) match no known format for shape [{rows}, {cols}] (int8-row: {} + {}; int4-row: {} + {}; int4-grouped gs64: {} + {}; fp8-e4m3-b128: {} + {}; mxfp4: {} + {} E8M0); untrusted container",
            view.file.display(),
            view.name,
            counts.weight_bytes,
            view.dtype,
            counts.scale_bytes,
            counts.scale_dtype,
            rows * cols,
            rows * 4,
            rows * cols.div_ceil(2),
            rows * 4,
            rows * cols.div_ceil(2),
            rows * cols.div_ceil(64) * 4,
            rows * cols,
            rows.div_ceil(128) * cols.div_ceil(128) * 4,
            rows * cols.div_ceil(2),
            rows * cols.div_ceil(32),
        );
    }
    if let Some(stamp) = &view.stamp {
        if !KNOWN_NAMES.contains(&stamp.as_str()) {
            bail!(
                "{}: tensor {}: the container stamp names an unknown format {stamp:?}; its byte counts say {}",
                view.file.display(),
                view.name,
                found[0]
            );
        }
        // The stamp picks among the formats the bytes allow; a disagreement is refused by
        // the caller.
        return Ok(found
            .iter()
            .copied()
            .find(|f| answers_to(*f, stamp))
            .unwrap_or(found[0]));
    }
    if found.contains(&Format::E8Iq3Lattice) && found.contains(&Format::Fp8E4m3B128) {
        bail!(
            "{}: tensor {} is ambiguous: {} weight bytes and {} scales fit both e8-iq3-lattice and fp8-e4m3-b128 for shape [{rows}, {cols}], and no colibri.fmt stamp says which",
            view.file.display(),
            view.name,
            counts.weight_bytes,
            counts.scale_bytes / 4
        );
    }
    // Unstamped int8-row vs fp8-e4m3-b128 (ceil(O/128)·ceil(I/128) == O) resolves to
    // int8-row, the first candidate, as colibri resolves it.
    Ok(found[0])
}

/// `view` checked to hold a `shape` weight: a float tensor must have exactly that shape; a
/// quantised one (any stored shape, colibri writes flat arrays) must have byte counts that
/// fit a format for `[product of leading dims, last dim]`. The returned view carries
/// `shape` as its shape.
pub fn shaped(view: TensorView, shape: &[usize]) -> Result<TensorView> {
    if view.scales.is_none() {
        if view.shape != shape {
            bail!(
                "{}: tensor {} has shape {:?}, expected {:?} from config.json",
                view.file.display(),
                view.name,
                view.shape,
                shape
            );
        }
        // The dtype and byte count now, not when the tensor is first used (a routed
        // expert may be read for the first time hours into a run).
        let (cols, leading) = shape.split_last().map_or((1, &[][..]), |(c, l)| (*c, l));
        float_format(&view, leading.iter().product(), cols)?;
        return Ok(view);
    }
    let Some((&cols, leading)) = shape.split_last() else {
        bail!(
            "{}: tensor {} is quantised but a scalar was expected",
            view.file.display(),
            view.name
        );
    };
    infer(&view, leading.iter().product(), cols)?;
    Ok(TensorView {
        shape: shape.to_vec(),
        ..view
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_row_and_scale_counts_follow_the_layouts() {
        // (format, rows, cols, row bytes, scales per row, scales)
        let cases = [
            (Format::F32, 3, 5, 20, 0, 0),
            (Format::Bf16, 3, 5, 10, 0, 0),
            (Format::Int8Row, 3, 5, 5, 1, 3),
            (Format::Int4Row, 3, 5, 3, 1, 3),
            (Format::Int4Grouped { group: 64 }, 3, 100, 50, 2, 6),
            (Format::Fp8E4m3B128, 130, 257, 257, 3, 6),
            (Format::Mxfp4, 2, 33, 17, 2, 4),
        ];
        for (format, rows, cols, row_bytes, per_row, count) in cases {
            assert_eq!(format.row_bytes(cols), Some(row_bytes), "{format}");
            assert_eq!(format.scales_per_row(cols), per_row, "{format}");
            assert_eq!(format.scale_count(rows, cols), count, "{format}");
        }
        assert_eq!(Format::Int3G64.row_bytes(64), None);
    }
}
