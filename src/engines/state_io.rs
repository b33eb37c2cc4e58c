//! The byte form of a conversation's state ([`SequenceState::save`] and
//! [`SequenceState::restore`]): counts and sizes as little-endian `u64`, token ids as `u32`,
//! values as the little-endian bits of each `f32` (so a state read back is the state
//! written, bit for bit), every list behind its length.
//!
//! This module owns those primitives and the wording of what a stream did not hold; each
//! state type decides the order of its own fields and checks what it reads against its own
//! shape. It knows no file: where states are kept on disk is `serve::kv_dir`'s.
//!
//! [`SequenceState::save`]: super::state::SequenceState::save
//! [`SequenceState::restore`]: super::state::SequenceState::restore

use std::fmt::Display;
use std::io::{self, Read, Write};

use anyhow::{anyhow, bail, Result};

/// Values converted per write or read. It bounds the staging buffer, and how far a corrupt
/// length can make a read allocate ahead of the bytes that are really there: a list grows
/// only as its values arrive.
const CHUNK: usize = 16 * 1024;

/// A four-byte value of a saved list.
trait Word: Copy {
    fn to_le(self) -> [u8; 4];
    fn from_le(bytes: [u8; 4]) -> Self;
}

impl Word for f32 {
    fn to_le(self) -> [u8; 4] {
        self.to_bits().to_le_bytes()
    }
    fn from_le(bytes: [u8; 4]) -> f32 {
        f32::from_bits(u32::from_le_bytes(bytes))
    }
}

impl Word for u32 {
    fn to_le(self) -> [u8; 4] {
        self.to_le_bytes()
    }
    fn from_le(bytes: [u8; 4]) -> u32 {
        u32::from_le_bytes(bytes)
    }
}

pub fn write_u64(out: &mut dyn Write, value: u64) -> io::Result<()> {
    out.write_all(&value.to_le_bytes())
}

/// A count, a size or a position.
pub fn write_len(out: &mut dyn Write, len: usize) -> io::Result<()> {
    write_u64(out, len as u64)
}

/// `values`' length, then their bits.
pub fn write_f32s(out: &mut dyn Write, values: &[f32]) -> io::Result<()> {
    write_words(out, values)
}

/// `ids`' length, then the ids.
pub fn write_u32s(out: &mut dyn Write, ids: &[u32]) -> io::Result<()> {
    write_words(out, ids)
}

fn write_words<W: Word>(out: &mut dyn Write, values: &[W]) -> io::Result<()> {
    write_len(out, values.len())?;
    let mut bytes = Vec::with_capacity(4 * values.len().min(CHUNK));
    for chunk in values.chunks(CHUNK) {
        bytes.clear();
        bytes.extend(chunk.iter().flat_map(|v| v.to_le()));
        out.write_all(&bytes)?;
    }
    Ok(())
}

/// Fills `buf`, or says which field the stream ended in.
fn read_exact(input: &mut dyn Read, buf: &mut [u8], what: &str) -> Result<()> {
    input.read_exact(buf).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            anyhow!("the saved state ends inside {what}")
        } else {
            anyhow!("cannot read {what} of the saved state: {e}")
        }
    })
}

pub fn read_u64(input: &mut dyn Read, what: &str) -> Result<u64> {
    let mut bytes = [0u8; 8];
    read_exact(input, &mut bytes, what)?;
    Ok(u64::from_le_bytes(bytes))
}

/// What [`write_len`] wrote.
pub fn read_len(input: &mut dyn Read, what: &str) -> Result<usize> {
    let value = read_u64(input, what)?;
    usize::try_from(value).map_err(|_| anyhow!("{what}: {value} is more than this machine holds"))
}

/// Positions a saved state may claim: far beyond any context a model is trained for, and far
/// enough below `usize::MAX` that a forward after it cannot overflow a position.
pub const MAX_POSITION: usize = u32::MAX as usize;

/// What [`write_len`] wrote for a position (or a count of positions), refused beyond
/// [`MAX_POSITION`]: a state that holds no list as long as its position (a recurrent state,
/// a window) has only this to bound it.
pub fn read_position(input: &mut dyn Read, what: &str) -> Result<usize> {
    let position = read_len(input, what)?;
    if position > MAX_POSITION {
        bail!("{what}: {position} is beyond any context (at most {MAX_POSITION})");
    }
    Ok(position)
}

/// What [`write_f32s`] wrote, of any length.
pub fn read_f32s(input: &mut dyn Read, what: &str) -> Result<Vec<f32>> {
    let len = read_len(input, what)?;
    read_words(input, len, what)
}

/// What [`write_f32s`] wrote, refused unless it holds exactly `len` values.
pub fn read_f32s_exact(input: &mut dyn Read, len: usize, what: &str) -> Result<Vec<f32>> {
    let saved = read_len(input, what)?;
    expect(&format!("{what} (values)"), saved, len)?;
    read_words(input, len, what)
}

/// What [`write_u32s`] wrote, of any length.
pub fn read_u32s(input: &mut dyn Read, what: &str) -> Result<Vec<u32>> {
    let len = read_len(input, what)?;
    read_words(input, len, what)
}

fn read_words<W: Word>(input: &mut dyn Read, len: usize, what: &str) -> Result<Vec<W>> {
    let mut values = Vec::with_capacity(len.min(CHUNK));
    let mut bytes = vec![0u8; 4 * len.min(CHUNK)];
    while values.len() < len {
        let n = (len - values.len()).min(CHUNK);
        read_exact(input, &mut bytes[..4 * n], what)?;
        values.extend(
            bytes[..4 * n]
                .chunks_exact(4)
                .map(|b| W::from_le([b[0], b[1], b[2], b[3]])),
        );
    }
    Ok(values)
}

/// Refuses a saved `what` that differs from this state's.
pub fn expect<T: PartialEq + Display>(what: &str, saved: T, this: T) -> Result<()> {
    if saved != this {
        bail!("{what}: the saved state has {saved}, this model's has {this}");
    }
    Ok(())
}

/// `len` values as whole rows of `width`: the number of rows, or why not.
pub fn rows(what: &str, len: usize, width: usize) -> Result<usize> {
    if width == 0 || !len.is_multiple_of(width) {
        bail!("{what}: {len} saved values are not whole rows of {width}");
    }
    Ok(len / width)
}

/// A state of per-layer parts behind its position (what `write_len(position)`,
/// `write_len(layers)` and each layer's bytes wrote): each of `layers` read by `restore`
/// with the position; returns the position. The layer count must be this model's.
pub fn restore_layers<L>(
    input: &mut dyn Read,
    layers: &mut [L],
    mut restore: impl FnMut(&mut L, &mut dyn Read, usize) -> Result<()>,
) -> Result<usize> {
    let position = read_position(input, "the position")?;
    let count = read_len(input, "the number of layers")?;
    expect("layers", count, layers.len())?;
    for (l, layer) in layers.iter_mut().enumerate() {
        part(format_args!("layer {l}"), restore(layer, input, position))?;
    }
    Ok(position)
}

/// `result`, its error (with every cause) prefixed by the part of the state it is about.
pub fn part<T>(name: impl Display, result: Result<T>) -> Result<T> {
    result.map_err(|e| anyhow!("{name}: {e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_come_back_bit_for_bit_across_chunks() {
        let values: Vec<f32> = (0..CHUNK + 7)
            .map(|i| f32::from_bits(0x7fc0_0001 ^ (i as u32).wrapping_mul(2_654_435_761)))
            .collect();
        let mut bytes = Vec::new();
        write_f32s(&mut bytes, &values).unwrap();
        write_u32s(&mut bytes, &[3, u32::MAX]).unwrap();
        write_len(&mut bytes, 42).unwrap();
        assert_eq!(bytes.len(), 8 + 4 * values.len() + 8 + 8 + 8);
        let mut input = &bytes[..];
        let back = read_f32s(&mut input, "values").unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back), bits(&values));
        assert_eq!(read_u32s(&mut input, "ids").unwrap(), vec![3, u32::MAX]);
        assert_eq!(read_len(&mut input, "position").unwrap(), 42);
        assert!(input.is_empty());
    }

    #[test]
    fn a_huge_length_fails_at_the_end_of_the_bytes_without_allocating_it() {
        let mut bytes = Vec::new();
        write_u64(&mut bytes, u64::MAX / 8).unwrap();
        bytes.extend_from_slice(&[0; 12]);
        let err = read_f32s(&mut &bytes[..], "layer 0 keys").unwrap_err();
        assert_eq!(err.to_string(), "the saved state ends inside layer 0 keys");
        let err = read_f32s_exact(&mut &bytes[..], 3, "history").unwrap_err();
        assert!(
            err.to_string().starts_with(
                "history (values): the saved state has 2305843009213693951, this model's has 3"
            ),
            "{err}"
        );
    }

    #[test]
    fn rows_refuses_a_ragged_list() {
        assert_eq!(rows("keys", 12, 4).unwrap(), 3);
        assert!(rows("keys", 13, 4)
            .unwrap_err()
            .to_string()
            .contains("not whole rows of 4"));
        assert!(rows("keys", 0, 0).is_err());
    }
}
