//! The rules for every file coli reads as input or replaces as output: how an input is
//! opened, how a symlinked output is followed to its target, how writers of one file take
//! turns, and how a file is replaced so that a crash, a planted symlink or a failed write
//! never damages what was there.
//!
//! Owns opening inputs (refusing anything but a regular file, without ever blocking on a
//! FIFO or device), resolving symlinks, the `<target>.lock` side file and its advisory lock,
//! and the `<target>.tmp` write–sync–rename that keeps the target's mode and owner. It knows
//! nothing about what the files hold: history, trace and container formats belong to their
//! writers, which hand this module bytes through a closure. Unix only.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, BufWriter, Read as _};
use std::os::unix::fs::{
    FileTypeExt as _, MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _,
};
use std::os::unix::io::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// How many symlinks [`resolve_link`] follows before giving up; the kernel's own limit.
const MAX_LINK_HOPS: usize = 40;

/// Why a replace or a lock did not happen. The target is unchanged in every case.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The lock side file could not be created or locked.
    #[error("cannot lock {}: {source}", path.display())]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Inspecting the target, or writing, syncing or renaming the new file, failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        /// The file that failed: the temporary file while it is written, else the target.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// The target exists and is a FIFO, directory, device or socket.
    #[error("{} is {kind}, not a regular file: refusing to replace it", path.display())]
    NotRegular {
        /// The target.
        path: PathBuf,
        /// What it is instead ("a FIFO", "a directory", ...).
        kind: &'static str,
    },
    /// The new file could not be given the target's owner.
    #[error(
        "{} is owned by uid {uid}, gid {gid}, and replacing it would change its owner: {source}",
        path.display()
    )]
    Owner {
        /// The target.
        path: PathBuf,
        /// The target's owner.
        uid: u32,
        /// The target's group.
        gid: u32,
        /// Why the temporary file could not be given that owner.
        source: io::Error,
    },
}

/// Opens `path` for reading. Anything but a regular file is refused with
/// `InvalidInput` ("not a regular file (a FIFO)"); a missing file stays `NotFound`.
pub fn open_input(path: &Path) -> io::Result<File> {
    // O_NONBLOCK makes the open itself return at once on a FIFO with no writer (a plain
    // open would wait for one forever), so the fstat below can refuse it.
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    if let Some(kind) = file_kind(&file.metadata()?) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("not a regular file ({kind})"),
        ));
    }
    // Regular files ignore O_NONBLOCK, but the caller gets an ordinary descriptor, not one
    // whose flags would surprise whatever it is handed to.
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the whole call (owned by `file`); F_GETFL/F_SETFL take and
    // return plain integers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags == -1 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

/// The whole content of `path`, opened with [`open_input`].
pub fn read_input(path: &Path) -> io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    open_input(path)?.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Follows symlinks of the final component of `path` to the file they name, so that a
/// replace goes through a symlinked output to its target instead of replacing the link.
/// A relative link target is taken relative to the link's directory. A dangling link
/// resolves to its missing target; a path that is not a link comes back unchanged.
pub fn resolve_link(path: &Path) -> io::Result<PathBuf> {
    let mut current = path.to_path_buf();
    for _ in 0..=MAX_LINK_HOPS {
        let meta = match fs::symlink_metadata(&current) {
            Ok(m) => m,
            // Nothing there (the end of a dangling chain, or a file not yet created): that
            // is the path a write creates.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(current),
            Err(e) => return Err(e),
        };
        if !meta.file_type().is_symlink() {
            return Ok(current);
        }
        let target = fs::read_link(&current)?;
        // Joined without normalising `..`: the kernel resolves `dir/../x` through the
        // directory as it really is (which may itself be a link), and so must we.
        current = match current.parent() {
            Some(dir) if target.is_relative() => dir.join(target),
            _ => target,
        };
    }
    // Like the other errors here it does not name the path: the caller does.
    Err(io::Error::other("too many levels of symbolic links"))
}

/// Whether `a` and `b` both exist and are the same file (links followed).
pub fn same_file(a: &Path, b: &Path) -> bool {
    match (fs::metadata(a), fs::metadata(b)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// `<target>.lock`: the side file whose advisory lock writers of `target` take turns on.
pub fn lock_path(target: &Path) -> PathBuf {
    with_suffix(target, ".lock")
}

/// `<target>.tmp`: where [`replace`] writes the new content before renaming it.
pub fn temp_path(target: &Path) -> PathBuf {
    with_suffix(target, ".tmp")
}

/// Appends to the full file name (`a.b` -> `a.b.lock`), unlike `with_extension`.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = OsString::from(path.as_os_str());
    name.push(suffix);
    PathBuf::from(name)
}

/// Holds the exclusive advisory lock on a `<target>.lock` for the life of the value
/// (closing the file releases it). The lock is on a side file rather than the target
/// because every replace gives the target a new inode: a process waiting on the old
/// inode's lock would wake holding a lock nobody else can see.
pub struct FileLock {
    /// `None` where the filesystem has no advisory locks.
    _file: Option<File>,
}

/// Set once the "no advisory locks" notice has been printed: every save of the process
/// would hit it again, and one line says all there is to say.
static LOCKS_UNSUPPORTED_TOLD: AtomicBool = AtomicBool::new(false);

/// Creates or opens `<target>.lock` and waits for its exclusive lock. `target` should be
/// the resolved path (see [`resolve_link`]), so that every writer of one file, whichever
/// link it came through, locks the same side file.
pub fn lock_for(target: &Path) -> Result<FileLock, WriteError> {
    let path = lock_path(target);
    // O_NOFOLLOW: a symlink planted at the lock name must not make us create or open the
    // file it points at.
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|source| WriteError::Lock {
            path: path.clone(),
            source,
        })?;
    match file.lock() {
        Ok(()) => Ok(FileLock { _file: Some(file) }),
        // A filesystem without advisory locks still gets the atomic replace; only the
        // protection against a concurrent writer is lost, and refusing to save would lose
        // this run's output instead.
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {
            if !LOCKS_UNSUPPORTED_TOLD.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "[files] {}: advisory locks are not supported here ({e}) \u{2014} saving without one",
                    path.display()
                );
            }
            Ok(FileLock { _file: None })
        }
        Err(source) => Err(WriteError::Lock { path, source }),
    }
}

/// Replaces `target` with what `write` writes, so that a crash at any point leaves the old
/// file or the new one, never a mix: the bytes go to `<target>.tmp`, which gets the
/// target's mode and owner (or `0o666` less the umask for a new file), is fsynced, and is
/// renamed over `target`; then the directory is fsynced so the rename survives a power cut.
///
/// `target` must be the resolved path ([`resolve_link`]) and `_lock` its lock
/// ([`lock_for`]), taken before the caller read whatever it merges into the new content.
/// On any error the target is untouched and no temporary file is left behind.
pub fn replace(
    target: &Path,
    _lock: &FileLock,
    write: impl FnOnce(&mut dyn io::Write) -> io::Result<()>,
) -> Result<(), WriteError> {
    let existing = existing_regular(target)?;
    replace_through(target, &temp_path(target), existing, write)
}

/// [`replace`] for an output nothing merges into (a picture, a table a tool derives): no
/// lock is taken, so no `.lock` file is left beside it, and the temporary file is
/// `<target>.tmp.<pid>`, which no other process uses, so concurrent writers of one output
/// cannot write into each other's temporary file; the last rename wins, whole.
pub fn replace_alone(
    target: &Path,
    write: impl FnOnce(&mut dyn io::Write) -> io::Result<()>,
) -> Result<(), WriteError> {
    let existing = existing_regular(target)?;
    let mut tmp = temp_path(target).into_os_string();
    tmp.push(format!(".{}", std::process::id()));
    replace_through(target, Path::new(&tmp), existing, write)
}

/// The target's metadata when it exists; an error when it is not a regular file.
fn existing_regular(target: &Path) -> Result<Option<fs::Metadata>, WriteError> {
    // `metadata` only stats: it never opens, so a FIFO target cannot block us.
    match fs::metadata(target) {
        Ok(meta) => match file_kind(&meta) {
            Some(kind) => Err(WriteError::NotRegular {
                path: target.to_path_buf(),
                kind,
            }),
            None => Ok(Some(meta)),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(WriteError::Write {
            path: target.to_path_buf(),
            source,
        }),
    }
}

/// The write-sync-rename through the temporary file `tmp`, which only this writer uses.
fn replace_through(
    target: &Path,
    tmp: &Path,
    existing: Option<fs::Metadata>,
    write: impl FnOnce(&mut dyn io::Write) -> io::Result<()>,
) -> Result<(), WriteError> {
    let write_error = |path: &Path| {
        let path = path.to_path_buf();
        move |source| WriteError::Write { path, source }
    };
    // A leftover from a crashed save. `remove_file` on a symlink removes the link itself,
    // never the file it points at.
    match fs::remove_file(tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(write_error(tmp)(e)),
    }
    // create_new (O_EXCL) fails rather than open whatever appeared at the name since the
    // removal, so the bytes can only land in a file this call created. A new target gets
    // the mode a plain create would give it (0o666 less the umask, applied by the kernel,
    // so there is no process-wide umask to read and race on); a temp that will take an
    // existing target's mode starts private until it does.
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(if existing.is_some() { 0o600 } else { 0o666 })
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(tmp)
        .map_err(write_error(tmp))?;

    let result = fill_temp(file, tmp, existing.as_ref(), target, write)
        .and_then(|()| fs::rename(tmp, target).map_err(write_error(target)));
    if let Err(e) = result {
        let _ = fs::remove_file(tmp);
        return Err(e);
    }
    sync_parent(target);
    Ok(())
}

/// Writes, dresses and syncs the freshly created temporary file (everything before the
/// rename), closing it on return.
fn fill_temp(
    file: File,
    tmp: &Path,
    existing: Option<&fs::Metadata>,
    target: &Path,
    write: impl FnOnce(&mut dyn io::Write) -> io::Result<()>,
) -> Result<(), WriteError> {
    let write_error = |source| WriteError::Write {
        path: tmp.to_path_buf(),
        source,
    };
    let mut out = BufWriter::new(file);
    write(&mut out).map_err(write_error)?;
    let file = out.into_inner().map_err(|e| write_error(e.into_error()))?;
    if let Some(old) = existing {
        let own = file.metadata().map_err(write_error)?;
        // Owner before mode: a chown clears the setuid and setgid bits (even for root), so
        // the mode set first would not survive it.
        if (own.uid(), own.gid()) != (old.uid(), old.gid()) {
            std::os::unix::fs::fchown(&file, Some(old.uid()), Some(old.gid())).map_err(
                |source| WriteError::Owner {
                    path: target.to_path_buf(),
                    uid: old.uid(),
                    gid: old.gid(),
                    source,
                },
            )?;
        }
        file.set_permissions(Permissions::from_mode(old.mode() & 0o7777))
            .map_err(write_error)?;
    }
    file.sync_all().map_err(write_error)
}

/// Makes a rename durable. Failure is ignored: some filesystems cannot fsync a directory,
/// and the rename has already happened.
fn sync_parent(path: &Path) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// What a non-regular file is, as a phrase for messages; `None` for a regular file.
pub fn file_kind(meta: &fs::Metadata) -> Option<&'static str> {
    let t = meta.file_type();
    if t.is_file() {
        return None;
    }
    Some(if t.is_fifo() {
        "a FIFO"
    } else if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        // Only a symlink is left: metadata from `fs::symlink_metadata`, never from an
        // fstat or `fs::metadata`, which follow links.
        "a symbolic link"
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::fs::TryLockError;
    use std::os::unix::ffi::OsStrExt as _;
    use std::os::unix::fs::symlink;
    use std::sync::mpsc;
    use std::thread;
    use std::time::Duration;

    /// Runs `f` in a thread and fails the test if it takes over 5 s, so a regression that
    /// blocks (on a FIFO, on a lock) fails instead of hanging the suite.
    fn within_5s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(5))
            .expect("blocked for over 5 s")
    }

    fn mkfifo(path: &Path) {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(
            unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
            0,
            "mkfifo failed"
        );
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().mode() & 0o7777
    }

    fn replace_with(target: &Path, bytes: &'static [u8]) -> Result<(), WriteError> {
        let lock = lock_for(target)?;
        replace(target, &lock, |w| w.write_all(bytes))
    }

    #[test]
    fn open_input_refuses_a_fifo_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let err = within_5s(move || open_input(&fifo).unwrap_err());
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("FIFO"), "{err}");
    }

    #[test]
    fn open_input_refuses_a_directory_and_keeps_not_found() {
        let dir = tempfile::tempdir().unwrap();
        let err = open_input(dir.path()).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert!(err.to_string().contains("a directory"), "{err}");
        let err = read_input(&dir.path().join("missing")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn open_input_hands_back_a_blocking_descriptor() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        fs::write(&path, b"abc").unwrap();
        let file = open_input(&path).unwrap();
        // SAFETY: the descriptor is owned by `file`, open for the call.
        let flags = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GETFL) };
        assert_ne!(flags, -1);
        assert_eq!(flags & libc::O_NONBLOCK, 0);
        assert_eq!(read_input(&path).unwrap(), b"abc");
    }

    #[test]
    fn resolve_link_follows_a_relative_chain() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::create_dir(d.join("sub")).unwrap();
        fs::write(d.join("real"), b"x").unwrap();
        // a -> sub/b -> ../real: each relative target is read from the link's own directory.
        symlink("sub/b", d.join("a")).unwrap();
        symlink("../real", d.join("sub/b")).unwrap();
        let got = resolve_link(&d.join("a")).unwrap();
        assert!(!fs::symlink_metadata(&got).unwrap().is_symlink());
        assert!(same_file(&got, &d.join("real")));
        assert_eq!(resolve_link(&d.join("real")).unwrap(), d.join("real"));
    }

    #[test]
    fn resolve_link_gives_a_dangling_links_target_and_stops_on_a_loop() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        symlink("missing", d.join("dangling")).unwrap();
        assert_eq!(
            resolve_link(&d.join("dangling")).unwrap(),
            d.join("missing")
        );
        symlink("y", d.join("x")).unwrap();
        symlink("x", d.join("y")).unwrap();
        let err = within_5s({
            let x = d.join("x");
            move || resolve_link(&x).unwrap_err()
        });
        assert!(
            err.to_string()
                .contains("too many levels of symbolic links"),
            "{err}"
        );
    }

    #[test]
    fn same_file_compares_inodes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        fs::write(d.join("f"), b"1").unwrap();
        fs::write(d.join("g"), b"1").unwrap();
        symlink("f", d.join("l")).unwrap();
        assert!(same_file(&d.join("f"), &d.join("l")));
        assert!(!same_file(&d.join("f"), &d.join("g")));
        assert!(!same_file(&d.join("f"), &d.join("missing")));
    }

    #[test]
    fn replace_keeps_the_mode_of_an_existing_target() {
        let dir = tempfile::tempdir().unwrap();
        for m in [0o600, 0o640] {
            let target = dir.path().join(format!("t{m:o}"));
            fs::write(&target, b"old").unwrap();
            fs::set_permissions(&target, Permissions::from_mode(m)).unwrap();
            replace_with(&target, b"new").unwrap();
            assert_eq!(fs::read(&target).unwrap(), b"new");
            assert_eq!(mode(&target), m);
        }
    }

    #[test]
    fn replace_gives_a_new_target_the_umask_mode() {
        let dir = tempfile::tempdir().unwrap();
        // What a plain create gets: 0o666 less this process's umask.
        let plain = dir.path().join("plain");
        File::create(&plain).unwrap();
        let target = dir.path().join("new");
        replace_with(&target, b"new").unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert_eq!(mode(&target), mode(&plain));
    }

    #[test]
    fn replace_keeps_a_foreign_owner() {
        // Giving a file to another user needs root; the suite runs as root in CI, and the
        // owner half of `replace` cannot be exercised otherwise.
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        fs::write(&target, b"old").unwrap();
        std::os::unix::fs::chown(&target, Some(1234), Some(1234)).unwrap();
        // Setuid too: it only survives if the owner is set before the mode.
        fs::set_permissions(&target, Permissions::from_mode(0o4640)).unwrap();
        replace_with(&target, b"new").unwrap();
        let meta = fs::metadata(&target).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (1234, 1234));
        assert_eq!(meta.mode() & 0o7777, 0o4640);
        assert_eq!(fs::read(&target).unwrap(), b"new");
    }

    #[test]
    fn replace_does_not_write_through_a_planted_temp_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        let victim = dir.path().join("victim");
        fs::write(&target, b"old").unwrap();
        fs::write(&victim, b"precious").unwrap();
        symlink(&victim, temp_path(&target)).unwrap();
        replace_with(&target, b"new").unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert!(fs::symlink_metadata(temp_path(&target)).is_err());
    }

    #[test]
    fn replace_refuses_a_fifo_target_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let err = within_5s({
            let fifo = fifo.clone();
            move || replace_with(&fifo, b"new").unwrap_err()
        });
        assert!(
            matches!(err, WriteError::NotRegular { kind: "a FIFO", .. }),
            "{err}"
        );
        assert!(fs::metadata(&fifo).unwrap().file_type().is_fifo());
    }

    #[test]
    fn a_failed_write_leaves_the_target_and_no_temp() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        fs::write(&target, b"old").unwrap();
        let lock = lock_for(&target).unwrap();
        let err = replace(&target, &lock, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("boom"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
        assert_eq!(fs::read(&target).unwrap(), b"old");
        assert!(fs::symlink_metadata(temp_path(&target)).is_err());
    }

    #[test]
    fn replace_alone_leaves_no_lock_and_keeps_the_mode() {
        let d = tempfile::tempdir().unwrap();
        let target = d.path().join("heat.png");
        fs::write(&target, b"old").unwrap();
        fs::set_permissions(&target, Permissions::from_mode(0o640)).unwrap();
        replace_alone(&target, |w| w.write_all(b"new")).unwrap();
        assert_eq!(fs::read(&target).unwrap(), b"new");
        assert_eq!(mode(&target), 0o640);
        let left: Vec<_> = fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![OsString::from("heat.png")]);
    }

    #[test]
    fn lock_for_excludes_a_second_writer_until_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        let first = lock_for(&target).unwrap();
        let probe = File::open(lock_path(&target)).unwrap();
        assert!(matches!(probe.try_lock(), Err(TryLockError::WouldBlock)));

        let (tx, rx) = mpsc::channel();
        let second = thread::spawn({
            let target = target.clone();
            move || {
                let lock = lock_for(&target).unwrap();
                tx.send(()).unwrap();
                lock
            }
        });
        assert!(
            rx.recv_timeout(Duration::from_millis(300)).is_err(),
            "second lock taken while the first is held"
        );
        drop(first);
        rx.recv_timeout(Duration::from_secs(5))
            .expect("second lock not taken after the first was dropped");
        let held = second.join().unwrap();
        assert!(matches!(probe.try_lock(), Err(TryLockError::WouldBlock)));
        drop(held);
        probe.try_lock().unwrap();
    }

    #[test]
    fn lock_for_does_not_follow_a_planted_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("t");
        let victim = dir.path().join("victim");
        symlink(&victim, lock_path(&target)).unwrap();
        let err = lock_for(&target).err().expect("lock through a symlink");
        assert!(matches!(err, WriteError::Lock { .. }), "{err}");
        assert!(!victim.exists());
    }
}
