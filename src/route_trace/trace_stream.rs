//! The `ROUTE_TRACE` stream: one line per (MoE call, batch row).
//!
//! ```text
//! <call> <row> <layer> <id>:<gate> <id>:<gate> ...
//! ```
//!
//! Owns the file, its buffering, the line bytes (gates as C `%.4f`) and the `call` number.
//! It is measurement only: nothing here may feed back into routing, and a write error stops
//! the trace instead of interrupting the run (it is reported by [`TraceStream::flush`],
//! with how many lines reached the file and how many were lost).
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
    /// Lines handed to the buffer (those after an error are not).
    lines: u64,
    /// Lines dropped after a write error.
    dropped: u64,
}

/// A trace that could not be written whole: the error, and where the file stops.
#[derive(Debug, thiserror::Error)]
#[error("{source} \u{2014} {written} trace lines reached the file, {lost} were lost")]
pub struct TraceLost {
    pub source: io::Error,
    /// Lines on disk (the last one may be cut short).
    pub written: u64,
    /// Lines that never reached it.
    pub lost: u64,
}

impl TraceStream {
    /// Creates the trace file, or truncates one that holds a trace (or nothing). A file
    /// holding anything else is refused with an `InvalidInput` error and left as it is: a
    /// trace never replaces a history, weights or a config. A FIFO or a character device
    /// (`/dev/stderr`) is written as a stream; a FIFO nobody reads is refused rather than
    /// waited on.
    pub fn create(path: &Path) -> io::Result<TraceStream> {
        let file = open_for_trace(path)?;
        Ok(TraceStream {
            path: path.to_path_buf(),
            out: BufWriter::with_capacity(1 << 16, file),
            call: 0,
            line: String::with_capacity(256),
            error: None,
            lines: 0,
            dropped: 0,
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
            self.dropped += 1;
            return;
        }
        self.line.clear();
        format_line(&mut self.line, self.call, row, layer, ids, gates);
        match self.out.write_all(self.line.as_bytes()) {
            Ok(()) => self.lines += 1,
            Err(e) => {
                self.error = Some(e);
                self.dropped += 1;
            }
        }
    }

    /// Ends one MoE-layer invocation: the next lines carry the next call number.
    pub fn end_call(&mut self) {
        self.call += 1;
    }

    /// Pushes buffered lines to the file; returns the first write error seen, if any, with
    /// how many lines reached the file and how many did not. After an error the trace
    /// stays stopped: every later line is counted as lost.
    pub fn flush(&mut self) -> Result<(), TraceLost> {
        let failed = match self.error.take() {
            Some(e) => Some(e),
            None => self.out.flush().err(),
        };
        let Some(e) = failed else {
            return Ok(());
        };
        // What the buffer still holds never reached the file.
        let buffered = self.out.buffer().iter().filter(|&&b| b == b'\n').count() as u64;
        let lost = buffered + self.dropped;
        let written = self.lines - buffered;
        // Stopped for good: later lines are dropped and counted, and the next flush says
        // the same again with the totals grown.
        self.error = Some(io::Error::new(e.kind(), e.to_string()));
        Err(TraceLost {
            source: io::Error::new(e.kind(), format!("{}: {e}", self.path.display())),
            written,
            lost,
        })
    }
}

/// Whether `head` (the start of a file) reads as a trace: every whole line is
/// `<call> <row> <layer>` followed by `<id>:<gate>` pairs, and at least one line has a
/// pair (a line of three numbers alone would also be a legacy history record).
fn is_trace(head: &[u8]) -> bool {
    let whole = match head.iter().rposition(|&b| b == b'\n') {
        Some(end) => &head[..end],
        None => head,
    };
    let Ok(text) = std::str::from_utf8(whole) else {
        return false;
    };
    let mut paired = false;
    let lines_ok = text.lines().all(|line| {
        let mut fields = line.split_ascii_whitespace();
        let numbers = fields
            .by_ref()
            .take(3)
            .filter(|f| f.parse::<u64>().is_ok())
            .count();
        let mut pairs = fields.peekable();
        paired |= pairs.peek().is_some();
        numbers == 3
            && pairs.all(|p| {
                p.split_once(':')
                    .is_some_and(|(id, _)| id.parse::<usize>().is_ok())
            })
    });
    lines_ok && paired
}

/// Opens `path` for a trace without blocking and without destroying what it holds (see
/// [`TraceStream::create`]).
fn open_for_trace(path: &Path) -> io::Result<File> {
    use std::io::{Read as _, Seek as _};
    use std::os::unix::fs::{FileTypeExt as _, OpenOptionsExt as _};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .or_else(|e| match e.raw_os_error() {
            // A FIFO opened for writing with nobody reading it.
            Some(libc::ENXIO) => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a FIFO with no reader",
            )),
            // A FIFO or device cannot be opened for reading as well: open it write-only.
            _ => std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
                .open(path)
                .map_err(|_| e),
        })?;
    let kind = file.metadata()?.file_type();
    if kind.is_fifo() || kind.is_char_device() {
        clear_nonblocking(&file)?;
        return Ok(file);
    }
    if !kind.is_file() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file, a FIFO or a character device",
        ));
    }
    let mut head = Vec::new();
    (&mut file).take(4096).read_to_end(&mut head)?;
    if !head.iter().all(u8::is_ascii_whitespace) && !is_trace(&head) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "it exists and does not hold a routing trace; refusing to replace it (choose another path)",
        ));
    }
    file.set_len(0)?;
    file.rewind()?;
    clear_nonblocking(&file)?;
    Ok(file)
}

fn clear_nonblocking(file: &File) -> io::Result<()> {
    use std::os::unix::io::AsRawFd as _;
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor this function's caller owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
    fn recognises_a_trace_and_nothing_else() {
        assert!(is_trace(b"0 0 1 5:0.2500 7:0.7500\n1 0 1 2:1.0000\n"));
        assert!(is_trace(b"0 0 1\n1 0 1 2:1.0000\n2 0"));
        assert!(!is_trace(b"-1 5 8\n-2 1 3815245270\n3 2 2\n"));
        assert!(!is_trace(b"3 2 2\n"));
        assert!(!is_trace(b"{\"model_type\": \"olmoe\"}"));
        assert!(!is_trace(b"\x10\0\0\0\0\0\0\0{\"__metadata__\""));
    }

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
