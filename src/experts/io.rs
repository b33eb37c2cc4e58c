//! Reading experts from the shards into memory the store owns.
//!
//! An expert's bytes (its three matrices and their scales) are planned once as the fewest
//! file ranges that cover them: windows of one file that touch, or lie within
//! [`MERGE_GAP`] of each other, are one read, so a `coli convert` container (each expert
//! adjacent) is one read per expert. Each range is rounded out to [`ALIGN`] so that it
//! can be read with `O_DIRECT`, into a page-aligned anonymous buffer that becomes the
//! expert's slot; the tensor views are then re-pointed into that buffer and the usual
//! `quant` loader builds the matrices from it (zero-copy where the format is kept).
//!
//! Reads run on a pool of loader threads with two queues, demand first and read-ahead
//! second. Buffers of evicted experts are recycled, so a steady state allocates nothing
//! and touches no new pages. Buffered reads drop the pages they read from the page cache
//! (`POSIX_FADV_DONTNEED`), so in neither mode does the kernel keep a second copy.
//!
//! This module owns file descriptors, buffers and threads; it does not decide which
//! expert to read or where it goes (that is the store).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::{MmapMut, MmapOptions};

use super::{Expert, ExpertTensors};
use crate::quant::Width;
use crate::snapshot::{MappedBytes, Mapping, TensorView};

/// File offsets, lengths and buffer positions are multiples of this, as `O_DIRECT` needs
/// on every common file system and device.
pub const ALIGN: usize = 4096;

/// A range longer than this is read as several parts at once.
pub const READ_CHUNK: usize = 2 << 20;

/// The most parts one range is read as.
pub const READ_FANOUT: usize = 4;

/// Windows of one file at most this far apart are read as one range: reading a small gap
/// costs less than a second request.
pub const MERGE_GAP: usize = 64 << 10;

/// How experts are read when they stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoMode {
    /// `O_DIRECT`: straight from the device into the slot, no page-cache copy.
    Direct,
    /// `pread` through the page cache, whose pages are dropped after each read.
    Buffered,
}

impl IoMode {
    pub fn describe(self) -> &'static str {
        match self {
            IoMode::Direct => "direct I/O",
            IoMode::Buffered => "buffered reads, pages dropped after each",
        }
    }
}

/// One range of one file, read into the expert's buffer at `at`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Range {
    file: usize,
    offset: u64,
    len: usize,
    /// Bytes of the range that must exist (its last window's end): the rest is rounding.
    needed: usize,
    at: usize,
}

/// Where one expert's bytes are in the shards and where each lands in its buffer.
#[derive(Debug, Clone)]
pub struct ReadPlan {
    ranges: Vec<Range>,
    buffer_len: usize,
    /// Bytes of tensor data the expert has (what a read must deliver).
    data_bytes: usize,
}

impl ReadPlan {
    /// How many reads load the expert.
    pub fn reads(&self) -> usize {
        self.ranges.len()
    }

    /// Bytes of the buffer the expert is read into.
    pub fn buffer_len(&self) -> usize {
        self.buffer_len
    }

    /// Bytes read from the files (the ranges, rounded to [`ALIGN`]).
    pub fn read_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.len as u64).sum()
    }

    pub fn data_bytes(&self) -> usize {
        self.data_bytes
    }
}

/// The shard files experts are read from, each opened once.
pub struct Files {
    paths: Vec<PathBuf>,
    handles: Vec<File>,
    /// The length of each file when opened.
    lengths: Vec<u64>,
    mode: IoMode,
}

impl Files {
    /// Open every file the experts are in. `direct`: `Some(true)` asks for `O_DIRECT`,
    /// `Some(false)` for buffered reads, `None` takes direct I/O where the file system
    /// accepts it. The note says what was chosen when it differs from what was asked.
    pub fn open(paths: Vec<PathBuf>, direct: Option<bool>) -> Result<(Files, Option<String>)> {
        let mut note = None;
        let mode = match direct {
            Some(false) => IoMode::Buffered,
            _ => match paths.first().map(|p| probe_direct(p)).transpose() {
                Ok(_) => IoMode::Direct,
                Err(err) => {
                    if direct == Some(true) {
                        note = Some(format!(
                            "[experts] DIRECT=1: the file system refuses O_DIRECT ({err:#}); reading buffered"
                        ));
                    }
                    IoMode::Buffered
                }
            },
        };
        let mut handles = Vec::with_capacity(paths.len());
        let mut lengths = Vec::with_capacity(paths.len());
        for path in &paths {
            let file = open_file(path, mode)?;
            lengths.push(
                file.metadata()
                    .with_context(|| format!("cannot stat {}", path.display()))?
                    .len(),
            );
            handles.push(file);
        }
        Ok((
            Files {
                paths,
                handles,
                lengths,
                mode,
            },
            note,
        ))
    }

    pub fn mode(&self) -> IoMode {
        self.mode
    }

    fn index(&self, path: &Path) -> Option<usize> {
        self.paths.iter().position(|p| p == path)
    }

    /// The read plan of one expert, checked against the files' lengths so that a shard
    /// shorter than its header says is an error here, not at the token that first needs it.
    pub fn plan(&self, tensors: &ExpertTensors) -> Result<ReadPlan> {
        let mut windows: Vec<(usize, usize, usize)> = Vec::new();
        let mut data_bytes = 0;
        for view in tensors.views() {
            let Some(file) = self.index(&view.file) else {
                bail!(
                    "{}: tensor {} is in a file the expert store did not open",
                    view.file.display(),
                    view.name
                );
            };
            let (start, end) = view.bytes.range();
            if end as u64 > self.lengths[file] {
                bail!(
                    "{}: tensor {} ends at byte {end}, but the file has {} bytes; the shard is truncated: re-download or re-convert it",
                    view.file.display(),
                    view.name,
                    self.lengths[file]
                );
            }
            data_bytes += end - start;
            windows.push((file, start, end));
        }
        windows.sort_unstable();
        let mut ranges: Vec<Range> = Vec::new();
        let mut at = 0;
        for (file, start, end) in windows {
            if let Some(last) = ranges.last_mut() {
                let last_end = last.offset as usize + last.len;
                if last.file == file && start <= last_end + MERGE_GAP {
                    let new_end = end.max(last.offset as usize + last.needed);
                    let grown = new_end.next_multiple_of(ALIGN) - last.offset as usize;
                    at += grown - last.len;
                    last.len = grown;
                    last.needed = new_end - last.offset as usize;
                    continue;
                }
            }
            let offset = start / ALIGN * ALIGN;
            let len = end.next_multiple_of(ALIGN) - offset;
            ranges.push(Range {
                file,
                offset: offset as u64,
                len,
                needed: end - offset,
                at,
            });
            at += len;
        }
        Ok(ReadPlan {
            ranges,
            buffer_len: at.max(ALIGN),
            data_bytes,
        })
    }

    /// Read the plan's ranges into `buffer`. A range longer than [`READ_CHUNK`] is read as
    /// up to [`READ_FANOUT`] aligned parts at once: one expert's read then keeps several
    /// requests in flight, which a device needs to reach its bandwidth.
    fn read(&self, plan: &ReadPlan, buffer: &mut [u8]) -> Result<()> {
        for range in &plan.ranges {
            let file = &self.handles[range.file];
            let window = &mut buffer[range.at..][..range.len];
            let done = if range.len > READ_CHUNK {
                let part = range
                    .len
                    .div_ceil(READ_FANOUT)
                    .next_multiple_of(ALIGN)
                    .max(READ_CHUNK / 2);
                std::thread::scope(|scope| {
                    let reads: Vec<_> = window
                        .chunks_mut(part)
                        .enumerate()
                        .map(|(i, chunk)| {
                            let offset = range.offset + (i * part) as u64;
                            std::thread::Builder::new()
                                .spawn_scoped(scope, move || read_fully(file, chunk, offset))
                        })
                        .collect();
                    reads.into_iter().try_fold(0, |sum, read| {
                        read?
                            .join()
                            .unwrap_or_else(|_| {
                                Err(std::io::Error::other("a read thread panicked"))
                            })
                            .map(|n| sum + n)
                    })
                })
            } else {
                read_fully(file, window, range.offset)
            }
            .with_context(|| {
                format!(
                    "cannot read {} bytes at offset {} of {}",
                    range.len,
                    range.offset,
                    self.paths[range.file].display()
                )
            })?;
            if done < range.needed {
                bail!(
                    "{}: read {done} of {} bytes at offset {}: the file ended early (truncated while running?)",
                    self.paths[range.file].display(),
                    range.needed,
                    range.offset
                );
            }
            if self.mode == IoMode::Buffered {
                drop_cached(file, range.offset, range.len);
            }
        }
        Ok(())
    }

    /// The expert's tensors re-pointed into `buffer`, read with `plan`.
    fn rebase(
        &self,
        tensors: &ExpertTensors,
        plan: &ReadPlan,
        buffer: &Arc<Mapping>,
    ) -> ExpertTensors {
        let moved = |view: &TensorView| -> TensorView {
            let file = self.index(&view.file).unwrap_or(usize::MAX);
            let (start, end) = view.bytes.range();
            let range = plan
                .ranges
                .iter()
                .find(|r| {
                    r.file == file && r.offset as usize <= start && end <= r.offset as usize + r.len
                })
                .expect("every window of the expert is inside one of its planned ranges");
            let at = range.at + (start - range.offset as usize);
            TensorView {
                bytes: MappedBytes::new(Arc::clone(buffer), at, at + (end - start)),
                ..view.clone()
            }
        };
        let with_scales = |view: &TensorView| -> TensorView {
            TensorView {
                scales: view.scales.as_deref().map(|s| Box::new(moved(s))),
                ..moved(view)
            }
        };
        ExpertTensors {
            gate: with_scales(&tensors.gate),
            up: with_scales(&tensors.up),
            down: with_scales(&tensors.down),
        }
    }
}

/// Read into `buffer` from `offset` until it is full or the file ends; the bytes read. A
/// short read of a regular file is its end (another read there, at an offset no longer
/// aligned, would be refused under `O_DIRECT` by some kernels).
fn read_fully(file: &File, buffer: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buffer.len() {
        match file.read_at(&mut buffer[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) if n < buffer.len() - done => return Ok(done + n),
            Ok(n) => done += n,
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(done)
}

fn open_file(path: &Path, mode: IoMode) -> Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    if mode == IoMode::Direct {
        options.custom_flags(libc::O_DIRECT);
    }
    options
        .open(path)
        .with_context(|| format!("cannot open {} for expert reads", path.display()))
}

/// Whether `path`'s file system takes an aligned `O_DIRECT` read.
fn probe_direct(path: &Path) -> Result<()> {
    let file = open_file(path, IoMode::Direct)?;
    let mut buffer = MmapOptions::new().len(ALIGN).map_anon()?;
    file.read_at(&mut buffer, 0)
        .map(|_| ())
        .map_err(|err| anyhow!("{}: {err}", path.display()))
}

/// Drop the page-cache pages of a range just read (advice: nothing to do if refused).
fn drop_cached(file: &File, offset: u64, len: usize) {
    use std::os::fd::AsRawFd;
    // SAFETY: posix_fadvise only reads its integer arguments; the descriptor is open.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

/// An expert in memory, with the buffer its matrices point into (none when every matrix
/// was converted into owned storage, or when it is a view into the shard mapping).
pub struct Loaded {
    /// Boxed: a slot's state is this or nothing (being read), so keep the two small alike.
    pub weights: Box<Expert>,
    pub buffer: Option<Arc<Mapping>>,
}

/// A read the store asked for.
struct Job {
    layer: usize,
    expert: usize,
    tensors: ExpertTensors,
    plan: Arc<ReadPlan>,
}

/// A finished read: the expert, or why it could not be read.
pub struct Done {
    pub layer: usize,
    pub expert: usize,
    pub ahead: bool,
    pub result: Result<Loaded>,
    /// Time the loader spent reading and building the expert.
    pub service: Duration,
}

#[derive(Default)]
struct Queues {
    demand: VecDeque<Job>,
    ahead: VecDeque<Job>,
    closed: bool,
}

/// What the loader threads share with the store.
struct Shared {
    files: Files,
    width: Width,
    queues: Mutex<Queues>,
    ready: Condvar,
    /// Buffers of evicted experts, reused by later reads.
    spare: Mutex<Vec<MmapMut>>,
    spare_limit: usize,
}

impl Shared {
    fn buffer(&self, len: usize) -> Result<MmapMut> {
        let reused = {
            let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
            spare
                .iter()
                .position(|b| b.len() >= len && b.len() <= 2 * len)
                .map(|i| spare.swap_remove(i))
        };
        match reused {
            Some(buffer) => Ok(buffer),
            None => MmapOptions::new()
                .len(len)
                .map_anon()
                .with_context(|| format!("cannot allocate {len} bytes for an expert slot")),
        }
    }

    fn recycle(&self, buffer: Arc<Mapping>) {
        let Ok(mapping) = Arc::try_unwrap(buffer) else {
            return;
        };
        let Ok(writable) = mapping.into_buffer().make_mut() else {
            return;
        };
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.len() < self.spare_limit {
            spare.push(writable);
        }
    }

    fn load(&self, tensors: &ExpertTensors, plan: &ReadPlan) -> Result<Loaded> {
        let mut buffer = self.buffer(plan.buffer_len)?;
        self.files.read(plan, &mut buffer)?;
        let buffer = Arc::new(Mapping::buffer(
            buffer
                .make_read_only()
                .context("cannot protect an expert slot")?,
        ));
        let weights = Box::new(Expert::load(
            &self.files.rebase(tensors, plan, &buffer),
            self.width,
        )?);
        if Arc::strong_count(&buffer) > 1 {
            Ok(Loaded {
                weights,
                buffer: Some(buffer),
            })
        } else {
            // Every matrix was converted into owned storage: the buffer is free again.
            self.recycle(buffer);
            Ok(Loaded {
                weights,
                buffer: None,
            })
        }
    }

    fn next_job(&self) -> Option<(Job, bool)> {
        let mut queues = self.queues.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(job) = queues.demand.pop_front() {
                return Some((job, false));
            }
            if let Some(job) = queues.ahead.pop_front() {
                return Some((job, true));
            }
            if queues.closed {
                return None;
            }
            queues = self.ready.wait(queues).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The loader pool: `threads` threads reading experts, demand reads before read-ahead.
pub struct Loader {
    shared: Arc<Shared>,
    done: Receiver<Done>,
    workers: Vec<JoinHandle<()>>,
}

impl Loader {
    pub fn start(files: Files, width: Width, threads: usize) -> Result<Loader> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            files,
            width,
            queues: Mutex::new(Queues::default()),
            ready: Condvar::new(),
            spare: Mutex::new(Vec::new()),
            spare_limit: threads,
        });
        let (sender, done) = mpsc::channel();
        let workers = (0..threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                let sender: Sender<Done> = sender.clone();
                std::thread::Builder::new()
                    .name(format!("coli-loader-{i}"))
                    .spawn(move || {
                        while let Some((job, ahead)) = shared.next_job() {
                            let started = Instant::now();
                            // A panic must still answer: the store waits for this read.
                            let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                                shared.load(&job.tensors, &job.plan)
                            }))
                            .unwrap_or_else(|_| {
                                Err(anyhow!(
                                    "reading expert {} of MoE layer {} failed unexpectedly",
                                    job.expert,
                                    job.layer
                                ))
                            });
                            let done = Done {
                                layer: job.layer,
                                expert: job.expert,
                                ahead,
                                result,
                                service: started.elapsed(),
                            };
                            if sender.send(done).is_err() {
                                return;
                            }
                        }
                    })
                    .context("cannot start an expert loader thread")
            })
            .collect::<Result<_>>()?;
        Ok(Loader {
            shared,
            done,
            workers,
        })
    }

    pub fn mode(&self) -> IoMode {
        self.shared.files.mode()
    }

    pub fn threads(&self) -> usize {
        self.workers.len()
    }

    pub fn files(&self) -> &Files {
        &self.shared.files
    }

    /// Queue a read; its [`Done`] arrives through [`Loader::wait`] or [`Loader::poll`].
    pub fn submit(
        &self,
        layer: usize,
        expert: usize,
        tensors: &ExpertTensors,
        plan: &Arc<ReadPlan>,
        ahead: bool,
    ) {
        let job = Job {
            layer,
            expert,
            tensors: tensors.clone(),
            plan: Arc::clone(plan),
        };
        let mut queues = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
        if ahead {
            queues.ahead.push_back(job);
        } else {
            queues.demand.push_back(job);
        }
        drop(queues);
        self.shared.ready.notify_one();
    }

    /// Take a read-ahead of `(layer, expert)` out of the queue if no thread has begun it;
    /// whether it was still queued (then no [`Done`] will come for it).
    pub fn cancel(&self, layer: usize, expert: usize) -> bool {
        let mut queues = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
        let queued = queues
            .ahead
            .iter()
            .position(|job| job.layer == layer && job.expert == expert);
        queued.and_then(|i| queues.ahead.remove(i)).is_some()
    }

    /// Move a queued read-ahead of `(layer, expert)` to the demand queue: its layer needs it
    /// now.
    pub fn promote(&self, layer: usize, expert: usize) {
        let mut queues = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
        let queued = queues
            .ahead
            .iter()
            .position(|job| job.layer == layer && job.expert == expert);
        if let Some(job) = queued.and_then(|i| queues.ahead.remove(i)) {
            queues.demand.push_back(job);
        }
    }

    /// Read an expert on the calling thread (pins, the GPU tier).
    pub fn load_now(&self, tensors: &ExpertTensors, plan: &ReadPlan) -> Result<Loaded> {
        self.shared.load(tensors, plan)
    }

    /// The next finished read, waiting for it.
    pub fn wait(&self) -> Result<Done> {
        self.done
            .recv()
            .map_err(|_| anyhow!("the expert loader threads stopped"))
    }

    /// A finished read, if one is ready.
    pub fn poll(&self) -> Option<Done> {
        self.done.try_recv().ok()
    }

    /// Give an evicted expert's buffer back for reuse.
    pub fn recycle(&self, loaded: Loaded) {
        let Loaded { weights, buffer } = loaded;
        drop(weights);
        if let Some(buffer) = buffer {
            self.shared.recycle(buffer);
        }
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        {
            let mut queues = self.shared.queues.lock().unwrap_or_else(|e| e.into_inner());
            queues.closed = true;
            queues.demand.clear();
            queues.ahead.clear();
        }
        self.shared.ready.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pages of `path` in the page cache.
    fn cached_pages(path: &Path) -> usize {
        let file = File::open(path).unwrap();
        // SAFETY: a read-only mapping of a file no one else writes during the test.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        let pages = map.len().div_ceil(ALIGN);
        let mut resident = vec![0u8; pages];
        // SAFETY: `resident` has one byte per page of the mapping, as mincore needs.
        let rc = unsafe {
            libc::mincore(
                map.as_ptr() as *mut libc::c_void,
                map.len(),
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        resident.iter().filter(|&&r| r & 1 == 1).count()
    }

    fn written(dir: &Path, name: &str, len: usize) -> (PathBuf, Vec<u8>) {
        let path = dir.join(name);
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        File::open(&path).unwrap().sync_all().unwrap();
        (path, data)
    }

    fn whole_file(len: usize) -> ReadPlan {
        ReadPlan {
            ranges: vec![Range {
                file: 0,
                offset: 0,
                len,
                needed: len,
                at: 0,
            }],
            buffer_len: len,
            data_bytes: len,
        }
    }

    #[test]
    fn reads_leave_no_copy_in_the_page_cache() {
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        // Long enough to be read as parts at once, not a whole number of parts.
        let len = (5 << 20) + 3 * ALIGN;
        // Whether this file system drops clean pages on advice at all.
        let (probe, _) = written(dir.path(), "probe", len);
        drop_cached(&File::open(&probe).unwrap(), 0, len);
        if cached_pages(&probe) != 0 {
            eprintln!("the file system keeps pages despite POSIX_FADV_DONTNEED: not checked");
            return;
        }
        for direct in [false, true] {
            let (path, data) = written(dir.path(), &format!("f{direct}"), len);
            let (files, _) = Files::open(vec![path.clone()], Some(direct)).unwrap();
            if direct && files.mode() != IoMode::Direct {
                eprintln!("O_DIRECT is refused here: direct reads not checked");
                continue;
            }
            drop_cached(&File::open(&path).unwrap(), 0, len);
            let mut buffer = MmapOptions::new().len(len).map_anon().unwrap();
            files.read(&whole_file(len), &mut buffer).unwrap();
            assert!(buffer[..] == data[..], "direct={direct}");
            assert_eq!(cached_pages(&path), 0, "direct={direct}");
        }
    }

    #[test]
    fn a_file_that_ends_early_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let (path, _) = written(dir.path(), "short", 10_000);
        let (files, _) = Files::open(vec![path], Some(false)).unwrap();
        let mut buffer = vec![0u8; 3 * ALIGN];
        let mut plan = whole_file(3 * ALIGN);
        plan.ranges[0].needed = 12_000;
        let err = files.read(&plan, &mut buffer).unwrap_err().to_string();
        assert!(
            err.contains("short") && err.contains("ended early"),
            "{err}"
        );
    }
}
