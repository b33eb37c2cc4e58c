//! The `ROUTE_TRACE` stream: one line per (MoE call, batch row).
//!
//! ```text
//! <call> <row> <layer> <id>:<gate> <id>:<gate> ...
//! ```
//!
//! Owns the file, its buffering, the line bytes (gates as C `%.4f`) and the `call` number.
//! It is measurement only: nothing here may feed back into routing, and a write error stops
//! the trace instead of interrupting the run (it is reported by [`TraceStream::flush`]).
//! The stream is fully buffered like colibri's stdio stream; lines reach the disk when the
//! buffer fills, on [`TraceStream::flush`], and when the stream is dropped.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use super::cfmt::push_fixed_f32;

/// An open trace file.
#[derive(Debug)]
pub struct TraceStream {
    path: PathBuf,
    out: BufWriter<File>,
    call: u64,
    line: String,
    error: Option<io::Error>,
}

impl TraceStream {
    /// Creates (truncating) the trace file.
    pub fn create(path: &Path) -> io::Result<TraceStream> {
        let file = File::create(path)?;
        Ok(TraceStream {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 16, file),
            call: 0,
            line: String::with_capacity(256),
            error: None,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The current MoE-call number (0 for the first call).
    pub fn call(&self) -> u64 {
        self.call
    }

    /// Writes one routing decision under the current call number. `ids` and `gates` are
    /// paired in order; `k = 0` writes just the three leading fields.
    pub fn write(&mut self, row: usize, layer: usize, ids: &[usize], gates: &[f32]) {
        if self.error.is_some() {
            return;
        }
        self.line.clear();
        format_line(&mut self.line, self.call, row, layer, ids, gates);
        if let Err(e) = self.out.write_all(self.line.as_bytes()) {
            self.error = Some(e);
        }
    }

    /// Ends one MoE-layer invocation: the next lines carry the next call number.
    pub fn end_call(&mut self) {
        self.call += 1;
    }

    /// Pushes buffered lines to the file; returns the first write error seen, if any.
    pub fn flush(&mut self) -> io::Result<()> {
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.out.flush()
    }
}

/// Appends one trace line, newline included.
pub fn format_line(
    out: &mut String,
    call: u64,
    row: usize,
    layer: usize,
    ids: &[usize],
    gates: &[f32],
) {
    use std::fmt::Write as _;
    let _ = write!(out, "{call} {row} {layer}");
    for (&id, &g) in ids.iter().zip(gates) {
        let _ = write!(out, " {id}:");
        push_fixed_f32(out, g, 4);
    }
    out.push('\n');
}

/// `[ROUTE_TRACE] logging routing to <path>`.
pub fn opened_line(path: &Path) -> String {
    format!("[ROUTE_TRACE] logging routing to {}", path.display())
}

/// `[ROUTE_TRACE] cannot open <path>`.
pub fn failed_line(path: &Path) -> String {
    format!("[ROUTE_TRACE] cannot open {}", path.display())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_bytes() {
        let mut s = String::new();
        format_line(&mut s, 17, 0, 42, &[131, 7], &[0.312, 0.2211]);
        assert_eq!(s, "17 0 42 131:0.3120 7:0.2211\n");
        s.clear();
        format_line(&mut s, 0, 3, 1, &[], &[]);
        assert_eq!(s, "0 3 1\n");
        s.clear();
        format_line(&mut s, 1, 0, 0, &[5], &[f32::NAN]);
        assert_eq!(s, "1 0 0 5:nan\n");
    }
}
