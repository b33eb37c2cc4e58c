//! Inkling's IKU1 binary history, read-only.
//!
//! Layout (little-endian u32 words): magic `0x31554B49` (the bytes `IKU1`), `n_layers`,
//! `n_experts`, then the dense `n_layers x n_experts` count table, row-major. Owns the
//! sniff and the decoding; nothing writes this layout any more (inkling itself now writes
//! the text format), so there is no writer.

use std::io::{self, BufRead, Read};

use super::counters::Counters;
use super::history::{Keep, Layout, Pending, Refusal, Trust};

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

/// Decodes an IKU1 file, streaming. The owner check comes before the dimensions, as in
/// colibri, and trust relaxes only the owner check. A truncated table is accepted up to
/// the last whole row (the rest is reported through `stopped_at`). Counts on rows this
/// engine cannot hold are kept as text records.
pub(super) fn parse<'k>(
    mut src: impl BufRead,
    engine: &str,
    trust: Trust,
    table: &Counters,
    keep: Option<&'k mut Keep>,
) -> io::Result<Result<Pending<'k>, Refusal>> {
    let mut p = Pending::new(Layout::Iku1, table, keep);
    if engine != OWNER {
        match trust {
            Trust::Found => {
                return Ok(Err(Refusal::Iku1Foreign {
                    engine: engine.to_string(),
                }))
            }
            Trust::Named => p.report.overridden = Some(OWNER),
        }
    }
    let mut header = [0u8; HEADER];
    let got = read_up_to(&mut src, &mut header)?;
    if got < HEADER {
        p.stop(MAGIC.len());
        return Ok(Ok(p));
    }
    let (Some(dim0), Some(dim1)) = (word(&header, 4), word(&header, 8)) else {
        unreachable!("a whole header holds both words")
    };
    if dim0 as usize != table.n_layers() || dim1 as usize != table.n_experts() {
        return Ok(Err(Refusal::Dimensions {
            file_layers: dim0.to_string(),
            file_experts: dim1.to_string(),
            n_layers: table.n_layers(),
            n_experts: table.n_experts(),
        }));
    }
    // Rows are read in bounded chunks, and a row's counts are offered only once it is
    // whole, so a header declaring a huge table costs what the file holds, not what it
    // declares.
    let row_bytes = u64::from(dim1) * 4;
    let mut chunk = vec![0u8; 1 << 16];
    let mut row: Vec<(usize, u32)> = Vec::new();
    let mut at = HEADER;
    for l in 0..dim0 {
        row.clear();
        let mut left = row_bytes;
        let mut e = 0usize;
        while left > 0 {
            let want = chunk.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            if read_up_to(&mut src, &mut chunk[..want])? < want {
                p.stop(at);
                return Ok(Ok(p));
            }
            for w in chunk[..want].chunks_exact(4) {
                let count = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
                if count != 0 {
                    row.push((e, count));
                }
                e += 1;
            }
            left -= want as u64;
        }
        for &(e, count) in &row {
            p.offer(i64::from(l), e as i64, count, || format!("{l} {e} {count}"));
        }
        at += row_bytes as usize;
    }
    if !src.fill_buf()?.is_empty() {
        p.stop(at);
    }
    Ok(Ok(p))
}

/// Fills `buf` as far as the input goes; returns how many bytes were read.
fn read_up_to(src: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match src.read(&mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}
