//! Inkling's IKU1 binary history, read-only.
//!
//! Layout (little-endian u32 words): magic `0x31554B49` (the bytes `IKU1`), `n_layers`,
//! `n_experts`, then the dense `n_layers x n_experts` count table, row-major. Owns the
//! sniff and the decoding; nothing writes this layout any more (inkling itself now writes
//! the text format), so there is no writer.

use super::counters::Counters;
use super::history::{Layout, Pending, Refusal, Trust};

const MAGIC: [u8; 4] = *b"IKU1";
const HEADER: usize = 12;

/// The only engine whose IKU1 files are its own.
const OWNER: &str = "inkling";

/// Whether `bytes` start with the IKU1 magic. Text histories begin with `-` or a digit
/// (or whitespace), so this cannot misfire on our own files.
pub fn sniff(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

/// The little-endian u32 at byte `at`, if the file is that long.
pub fn word(bytes: &[u8], at: usize) -> Option<u32> {
    let w = bytes.get(at..at + 4)?;
    Some(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

/// Decodes an IKU1 file. The owner check comes before the dimensions, as in colibri, and
/// trust relaxes only the owner check. A truncated table is accepted up to the last whole
/// row (the rest is reported through `stopped_at`).
pub(super) fn parse(
    bytes: &[u8],
    engine: &str,
    trust: Trust,
    table: &Counters,
) -> Result<Pending, Refusal> {
    let mut p = Pending::new(Layout::Iku1);
    if engine != OWNER {
        match trust {
            Trust::Found => {
                return Err(Refusal::Iku1Foreign {
                    engine: engine.to_string(),
                })
            }
            Trust::Named => p.report.overridden = Some(OWNER),
        }
    }
    let (Some(dim0), Some(dim1)) = (word(bytes, 4), word(bytes, 8)) else {
        p.report.stopped_at = Some(MAGIC.len());
        return Ok(p);
    };
    if dim0 as usize != table.n_layers() || dim1 as usize != table.n_experts() {
        return Err(Refusal::Dimensions {
            file_layers: dim0.to_string(),
            file_experts: dim1.to_string(),
            n_layers: table.n_layers(),
            n_experts: table.n_experts(),
        });
    }
    let row_bytes = dim1 as usize * 4;
    let mut at = HEADER;
    for l in 0..dim0 {
        let Some(row) = bytes.get(at..at + row_bytes) else {
            p.report.stopped_at = Some(at);
            return Ok(p);
        };
        for (e, w) in row.chunks_exact(4).enumerate() {
            let count = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            if count != 0 {
                p.offer(table, i64::from(l), e as i64, count);
            }
        }
        at += row_bytes;
    }
    if bytes.len() > at {
        p.report.stopped_at = Some(at);
    }
    Ok(p)
}
