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

/// One numeric field as scanned: its sign, magnitude and place in the input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// A leading `-` was present (`-0` included).
    pub negative: bool,
    /// The decimal magnitude, or `None` when it exceeds `u64::MAX`.
    pub magnitude: Option<u64>,
    /// Byte range of the field's text (sign included) in the scanned input, so a message
    /// can quote a number of any size exactly as the file spells it.
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
    /// The loop stopped at this byte offset: a non-numeric byte, or a record cut short by
    /// the end of the input. Everything from here on is ignored, as the C loop ignores it.
    Stopped(usize),
}

/// Every triple the loop would read, and how it ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scan {
    /// Triples in file order.
    pub triples: Vec<Triple>,
    /// Where and why reading stopped.
    pub end: End,
}

/// C `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl Cursor<'_> {
    fn skip_space(&mut self) {
        while self.bytes.get(self.pos).copied().is_some_and(is_c_space) {
            self.pos += 1;
        }
    }

    /// One `%d`/`%u` directive: skip whitespace, optional sign, one or more digits.
    fn field(&mut self) -> Option<Field> {
        self.skip_space();
        let mut p = self.pos;
        let mut negative = false;
        if let Some(&s @ (b'+' | b'-')) = self.bytes.get(p) {
            negative = s == b'-';
            p += 1;
        }
        let digits_start = p;
        let mut magnitude = Some(0u64);
        while let Some(d) = self.bytes.get(p).filter(|b| b.is_ascii_digit()) {
            magnitude = magnitude
                .and_then(|m| m.checked_mul(10))
                .and_then(|m| m.checked_add(u64::from(d - b'0')));
            p += 1;
        }
        if p == digits_start {
            return None;
        }
        let start = self.pos;
        self.pos = p;
        Some(Field {
            negative,
            magnitude,
            span: (start, p),
        })
    }
}

/// Scans `bytes` as the C loop would.
pub fn scan(bytes: &[u8]) -> Scan {
    let mut cur = Cursor { bytes, pos: 0 };
    let mut triples = Vec::new();
    loop {
        cur.skip_space();
        let offset = cur.pos;
        if offset == bytes.len() {
            return Scan {
                triples,
                end: End::Clean,
            };
        }
        match (cur.field(), cur.field(), cur.field()) {
            (Some(a), Some(b), Some(c)) => triples.push(Triple {
                offset,
                fields: [a, b, c],
            }),
            _ => {
                return Scan {
                    triples,
                    end: End::Stopped(offset),
                }
            }
        }
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
