//! The history text as the classic C loop sees it: `while (fscanf(f, "%d %d %u", ...) == 3)`.
//!
//! Owns tokenisation only: where each numeric field starts and ends, where the loop stops,
//! and the field's exact value. It reproduces glibc's scanning character by character
//! (whitespace is C `isspace`, so `\v` and `\r` count; a number is an optional sign and at
//! least one decimal digit and ends at the first non-digit, so `3 2 5abc` yields one triple
//! and then stops), so that a history means the same records to us as to every C binary
//! that reads it. It does not interpret records; the reader does.
//!
//! What it deliberately does not copy is glibc's *conversion*: `%d` and `%u` silently wrap
//! out-of-range values (and `%u` accepts `-5` as 4294967291). Fields keep their exact
//! sign and magnitude instead, and the reader rejects a record that does not fit rather
//! than admit a wrapped number. The triple alignment, which is what the format's safety
//! rests on, is unchanged by that choice.
//!
//! The scan streams: [`Scanner`] reads one triple at a time from a buffered reader and
//! keeps only the current triple's text, so reading a history takes memory for the table
//! it fills, not for the file. A field longer than [`MAX_FIELD_CHARS`] ends the scan at
//! its record, as if the byte were not a number (C would read on, wrapping it): such a
//! file is damaged, and stopping keeps the memory bounded; what follows is the file's
//! unread tail, which a rewrite keeps byte for byte.

use std::io::{self, Read};

/// The longest field (sign included) the scan reads as a number.
pub const MAX_FIELD_CHARS: usize = 4096;

/// One numeric field as scanned: its sign, magnitude and place in the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// A leading `-` was present (`-0` included).
    pub negative: bool,
    /// The decimal magnitude, or `None` when it exceeds `u64::MAX`.
    pub magnitude: Option<u64>,
    /// Byte range of the field's text (sign included) in the scanned input.
    pub span: (usize, usize),
}

impl Field {
    /// The value if it fits an i64 exactly.
    pub fn exact(self) -> Option<i64> {
        let m = i128::from(self.magnitude?);
        i64::try_from(if self.negative { -m } else { m }).ok()
    }

    /// The value if it fits a C `int` exactly (what `%d` can hold without wrapping).
    pub fn as_int(self) -> Option<i32> {
        self.exact().and_then(|v| i32::try_from(v).ok())
    }

    /// The value if it is a count `%u` can hold without wrapping: not negative (`-0` is
    /// zero) and at most `u32::MAX`.
    pub fn as_count(self) -> Option<u32> {
        self.exact().and_then(|v| u32::try_from(v).ok())
    }
}

/// Three fields the loop consumed together, and where the first one began.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Triple {
    /// Byte offset of the first field (after leading whitespace).
    pub offset: usize,
    /// `%d`, `%d`, `%u` in order.
    pub fields: [Field; 3],
}

/// How the scan ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// Only whitespace followed the last complete triple.
    Clean,
    /// The loop stopped at this byte offset: a non-numeric byte, a record cut short by
    /// the end of the input, or a field too long to read. Everything from here on is
    /// ignored, as the C loop ignores it.
    Stopped(usize),
}

/// C `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// The streaming scan of one input.
pub struct Scanner<R> {
    src: R,
    /// Bytes read from `src` and not yet consumed: `buf[at..len]`.
    buf: Box<[u8]>,
    at: usize,
    len: usize,
    /// Offset in the input of `buf[at]`.
    pos: usize,
    text: [String; 3],
    end: Option<End>,
}

impl<R: Read> Scanner<R> {
    /// A scan of `src` from its current position, which counts as offset 0.
    pub fn new(src: R) -> Scanner<R> {
        Scanner {
            src,
            buf: vec![0; 1 << 16].into_boxed_slice(),
            at: 0,
            len: 0,
            pos: 0,
            text: Default::default(),
            end: None,
        }
    }

    /// The next byte without consuming it; the buffer is refilled only when it is empty,
    /// so the common case is one bounds check.
    fn peek(&mut self) -> io::Result<Option<u8>> {
        if self.at == self.len {
            self.at = 0;
            self.len = loop {
                match self.src.read(&mut self.buf) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                }
            };
        }
        Ok((self.at < self.len).then(|| self.buf[self.at]))
    }

    fn bump(&mut self) {
        self.at += 1;
        self.pos += 1;
    }

    fn skip_space(&mut self) -> io::Result<()> {
        while self.peek()?.is_some_and(is_c_space) {
            self.bump();
        }
        Ok(())
    }

    /// One `%d`/`%u` directive into text slot `slot`: skip whitespace, optional sign, one
    /// or more digits.
    fn field(&mut self, slot: usize) -> io::Result<Option<Field>> {
        self.skip_space()?;
        let start = self.pos;
        self.text[slot].clear();
        let mut negative = false;
        if let Some(s @ (b'+' | b'-')) = self.peek()? {
            negative = s == b'-';
            self.text[slot].push(char::from(s));
            self.bump();
        }
        let mut digits = 0usize;
        let mut magnitude = Some(0u64);
        while let Some(d) = self.peek()?.filter(u8::is_ascii_digit) {
            if self.text[slot].len() == MAX_FIELD_CHARS {
                return Ok(None);
            }
            magnitude = magnitude
                .and_then(|m| m.checked_mul(10))
                .and_then(|m| m.checked_add(u64::from(d - b'0')));
            self.text[slot].push(char::from(d));
            self.bump();
            digits += 1;
        }
        Ok((digits > 0).then_some(Field {
            negative,
            magnitude,
            span: (start, self.pos),
        }))
    }

    /// The next triple, or `None` at the end of the scan (see [`Scanner::end`]). After the
    /// end every call returns `None`.
    pub fn next_triple(&mut self) -> io::Result<Option<Triple>> {
        if self.end.is_some() {
            return Ok(None);
        }
        self.skip_space()?;
        let offset = self.pos;
        if self.peek()?.is_none() {
            self.end = Some(End::Clean);
            return Ok(None);
        }
        let mut fields = [None; 3];
        for (slot, f) in fields.iter_mut().enumerate() {
            *f = self.field(slot)?;
            if f.is_none() {
                self.end = Some(End::Stopped(offset));
                return Ok(None);
            }
        }
        let [Some(a), Some(b), Some(c)] = fields else {
            unreachable!("every field was checked above")
        };
        Ok(Some(Triple {
            offset,
            fields: [a, b, c],
        }))
    }

    /// How the scan ended; `None` while triples remain.
    pub fn end(&self) -> Option<End> {
        self.end
    }

    /// Field `i` (0, 1 or 2) of the last triple, exactly as the input spells it.
    pub fn spelled(&self, i: usize) -> &str {
        &self.text[i]
    }

    /// The last triple as one record line: its three fields as spelled, one space apart.
    pub fn record_text(&self) -> String {
        format!("{} {} {}", self.text[0], self.text[1], self.text[2])
    }
}

/// Every triple the loop would read, and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scan {
    /// Triples in file order.
    pub triples: Vec<Triple>,
    /// Where and why reading stopped.
    pub end: End,
}

/// Scans a whole input held in memory.
pub fn scan(bytes: &[u8]) -> Scan {
    let mut sc = Scanner::new(bytes);
    let mut triples = Vec::new();
    // Reading from a byte slice cannot fail.
    while let Ok(Some(t)) = sc.next_triple() {
        triples.push(t);
    }
    Scan {
        triples,
        end: sc.end().unwrap_or(End::Clean),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(s: &str) -> (Vec<[i64; 3]>, End) {
        let sc = scan(s.as_bytes());
        let v = sc
            .triples
            .iter()
            .map(|t| t.fields.map(|f| f.exact().expect("in range")))
            .collect();
        (v, sc.end)
    }

    #[test]
    fn crlf_tabs_vt() {
        let (v, end) = vals("-1 5 8\r\n-2\t1 7\x0b\x0c3 2 2\r\n");
        assert_eq!(v, vec![[-1, 5, 8], [-2, 1, 7], [3, 2, 2]]);
        assert_eq!(end, End::Clean);
    }

    #[test]
    fn numbers_need_no_separator() {
        let (v, end) = vals("1-2-3 4 5 6x");
        assert_eq!(v, vec![[1, -2, -3], [4, 5, 6]]);
        assert_eq!(end, End::Stopped(11));
    }

    #[test]
    fn short_final_record_stops() {
        let (v, end) = vals("3 2 5\n4 1");
        assert_eq!(v, vec![[3, 2, 5]]);
        assert_eq!(end, End::Stopped(6));
    }

    #[test]
    fn sign_without_digits_stops() {
        assert_eq!(vals("3 - 5"), (vec![], End::Stopped(0)));
        assert_eq!(vals("+3 +2 +5"), (vec![[3, 2, 5]], End::Clean));
    }

    #[test]
    fn four_field_record_desynchronises() {
        let (v, end) = vals("3 2 5\n-3 7 12 99\n4 1 8\n");
        assert_eq!(v, vec![[3, 2, 5], [-3, 7, 12], [99, 4, 1]]);
        assert_eq!(end, End::Stopped(21));
    }

    #[test]
    fn a_field_too_long_ends_the_scan() {
        let long = format!("3 2 5\n4 {} 1\n5 1 1\n", "7".repeat(MAX_FIELD_CHARS + 1));
        let sc = scan(long.as_bytes());
        assert_eq!(sc.triples.len(), 1);
        assert_eq!(sc.end, End::Stopped(6));
        let ok = format!("4 {} 1\n", "7".repeat(MAX_FIELD_CHARS));
        assert_eq!(scan(ok.as_bytes()).end, End::Clean);
    }

    #[test]
    fn spelled_fields_and_record_text() {
        let mut sc = Scanner::new(&b"  +3\n-0 99999999999999999999999x"[..]);
        let t = sc.next_triple().expect("slice").expect("a triple");
        assert_eq!(t.offset, 2);
        assert_eq!(sc.spelled(0), "+3");
        assert_eq!(sc.record_text(), "+3 -0 99999999999999999999999");
        assert_eq!(sc.next_triple().expect("slice"), None);
        assert_eq!(sc.end(), Some(End::Stopped(31)));
    }

    #[test]
    fn exact_conversions() {
        let big = scan(b"99999999999999999999999 -5 4294967296");
        let f = big.triples[0].fields;
        assert_eq!(f[0].magnitude, None);
        assert_eq!(f[0].as_int(), None);
        assert_eq!(f[1].as_int(), Some(-5));
        assert_eq!(f[1].as_count(), None);
        assert_eq!(f[2].as_count(), None);
        let z = scan(b"-0 0 -0").triples[0].fields;
        assert_eq!(z[2].as_count(), Some(0));
    }
}
