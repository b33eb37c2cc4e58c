//! Shards that change under a running process. The weights are views into the mapped
//! shards, and a mapped file that is truncated raises SIGBUS at the next read of a page
//! past its new end, which ends the process on the spot: no history saved, no trace
//! flushed, no message. A file rewritten in place raises nothing and is read as the new
//! bytes.
//!
//! Every shard mapping is watched for as long as it lives ([`watch`]). A SIGBUS whose
//! address lies in a watched mapping replaces that whole mapping with zeroed anonymous
//! pages (`mmap` with `MAP_FIXED`, which a signal handler may call) and marks it: the read
//! then completes, the forward under way ends with numbers that mean nothing, and
//! [`check`], which the LM head calls at the end of every forward (and `coli convert` after
//! every tensor), turns the mark into an error naming the shard before any of those numbers
//! is used. [`check`] also compares each shard's size and modification time with those it
//! had when mapped, which catches a file rewritten in place. A SIGBUS elsewhere goes to
//! the handler that was there before (Rust's own, then the default: the process ends as
//! it would have).
//!
//! Owns the signal handler and the list of watched mappings; it reads no weights.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::SystemTime;

use anyhow::{bail, Result};

/// One watched mapping. Nodes are never freed, since the signal handler may walk them at
/// any moment; the node of a mapping that is gone is taken by the next one.
struct Node {
    /// The mapping's first byte and its length in whole pages; a length of 0 matches no
    /// address.
    start: AtomicUsize,
    len: AtomicUsize,
    /// Set by the signal handler once it replaced the mapping.
    faulted: AtomicBool,
    /// Held by a live [`Watch`].
    taken: AtomicBool,
    /// What [`check`] compares. The signal handler never touches it.
    file: Mutex<Option<Watched>>,
    /// The next node of the list, set before the node is published.
    next: *mut Node,
}

// SAFETY: `next` is written once, before the node is published, and never again; every
// other field is an atomic or a mutex.
unsafe impl Sync for Node {}

/// A mapped shard as it was when mapped.
struct Watched {
    path: PathBuf,
    file: File,
    len: u64,
    modified: Option<SystemTime>,
}

/// The first node of the list.
static NODES: AtomicPtr<Node> = AtomicPtr::new(ptr::null_mut());

/// The SIGBUS action in place before ours, for the faults that are not ours.
static PREVIOUS: OnceLock<libc::sigaction> = OnceLock::new();

/// Shards that faulted and whose mapping has since been dropped: still reported.
static LOST: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// A mapping being watched; dropping it (before the mapping is unmapped) ends the watch.
pub struct Watch {
    node: &'static Node,
}

impl Drop for Watch {
    fn drop(&mut self) {
        let node = self.node;
        node.len.store(0, Ordering::Release);
        node.start.store(0, Ordering::Release);
        let watched = node
            .file
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if node.faulted.swap(false, Ordering::AcqRel) {
            if let Some(watched) = watched {
                LOST.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(watched.path);
            }
        }
        node.taken.store(false, Ordering::Release);
    }
}

/// Watch `bytes`, the whole mapping of `file` (the shard at `path`), until the returned
/// value is dropped. Installs the SIGBUS handler the first time.
pub fn watch(bytes: &[u8], file: File, path: &Path) -> Watch {
    install();
    let meta = file.metadata().ok();
    let node = take_node();
    *node.file.lock().unwrap_or_else(PoisonError::into_inner) = Some(Watched {
        path: path.to_path_buf(),
        len: meta.as_ref().map_or(0, |m| m.len()),
        modified: meta.and_then(|m| m.modified().ok()),
        file,
    });
    node.faulted.store(false, Ordering::Release);
    // The start is in place before a length makes the node match any address.
    node.start.store(bytes.as_ptr() as usize, Ordering::Release);
    node.len
        .store(bytes.len().next_multiple_of(page_size()), Ordering::Release);
    Watch { node }
}

/// An error naming every watched shard that changed since it was mapped: truncated (its
/// mapping met SIGBUS and now reads as zeros) or of another size or modification time.
pub fn check() -> Result<()> {
    let mut changed: Vec<String> = LOST
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .map(|path| format!("{} (truncated)", path.display()))
        .collect();
    let mut at = NODES.load(Ordering::Acquire);
    while !at.is_null() {
        // SAFETY: nodes are leaked when made and never freed.
        let node = unsafe { &*at };
        at = node.next;
        if !node.taken.load(Ordering::Acquire) {
            continue;
        }
        let guard = node.file.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(watched) = guard.as_ref() else {
            continue;
        };
        let path = watched.path.display();
        if node.faulted.load(Ordering::Acquire) {
            changed.push(format!("{path} (truncated)"));
            continue;
        }
        let Ok(now) = watched.file.metadata() else {
            continue;
        };
        if now.len() != watched.len {
            changed.push(format!(
                "{path} ({} bytes, {} when it was opened)",
                now.len(),
                watched.len
            ));
        } else if now.modified().ok() != watched.modified {
            changed.push(format!("{path} (rewritten in place)"));
        }
    }
    if changed.is_empty() {
        return Ok(());
    }
    let shards = if changed.len() == 1 {
        "shard"
    } else {
        "shards"
    };
    bail!(
        "the {shards} {} changed while the model ran: what was computed from it is not the model's, so the run stops here (restore the file, then run again)",
        changed.join(", ")
    )
}

/// A free node, or a new one put at the head of the list.
fn take_node() -> &'static Node {
    let mut at = NODES.load(Ordering::Acquire);
    while !at.is_null() {
        // SAFETY: nodes are leaked when made and never freed.
        let node = unsafe { &*at };
        if node
            .taken
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            return node;
        }
        at = node.next;
    }
    let node = Box::leak(Box::new(Node {
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        faulted: AtomicBool::new(false),
        taken: AtomicBool::new(true),
        file: Mutex::new(None),
        next: ptr::null_mut(),
    }));
    let mut head = NODES.load(Ordering::Acquire);
    loop {
        node.next = head;
        match NODES.compare_exchange(head, node, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return node,
            Err(now) => head = now,
        }
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096).max(1)
}

/// Put [`on_sigbus`] in place once, keeping the action it replaces.
fn install() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        // SAFETY: both structures are plain data, zeroed then filled; sigaction reads the
        // new action and writes the old one into memory this function owns.
        unsafe {
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, ptr::null(), &mut previous) != 0 {
                return;
            }
            let _ = PREVIOUS.set(previous);
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(libc::SIGBUS, &action, ptr::null_mut());
        }
    });
}

/// The SIGBUS handler. Only async-signal-safe work: atomic loads and stores, `mmap`,
/// `sigaction`.
extern "C" fn on_sigbus(_signal: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let address = unsafe { (*info).si_addr() } as usize;
    let mut at = NODES.load(Ordering::Acquire);
    while !at.is_null() {
        // SAFETY: nodes are leaked when made and never freed.
        let node = unsafe { &*at };
        at = node.next;
        let len = node.len.load(Ordering::Acquire);
        let start = node.start.load(Ordering::Acquire);
        if len == 0 || address < start || address - start >= len {
            continue;
        }
        // SAFETY: the range is a live mapping this process made of a watched shard (its
        // watch ends before it is unmapped); zeroed private pages take its place, so
        // every reader of it goes on reading valid memory.
        let replaced = unsafe {
            libc::mmap(
                start as *mut libc::c_void,
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if replaced != libc::MAP_FAILED {
            node.faulted.store(true, Ordering::Release);
            return;
        }
        break;
    }
    // Not a watched shard's: the action that was there before takes this fault, which
    // happens again as soon as this handler returns.
    if let Some(previous) = PREVIOUS.get() {
        // SAFETY: sigaction with a structure sigaction itself filled.
        unsafe { libc::sigaction(libc::SIGBUS, previous, ptr::null_mut()) };
    } else {
        // SAFETY: as above, with the default action.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_DFL) };
    }
}
