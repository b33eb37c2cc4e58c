//! The conversation states `coli serve --kv-dir DIR` keeps on disk, so that a long shared
//! prefix (an agent's preamble) survives a restart: one file per state, in the format
//! FORMATS.md describes ("Kept conversation states"), named by the model's identity and the
//! tokens the state holds, the directory kept within a byte limit by removing the least
//! recently used.
//!
//! This module owns that format, the identity a file must match to be used ([`KvIdentity`]),
//! the scan of the directory, the limit and the eviction ([`KvDir`]). It removes and replaces
//! only files of its own identity: a file of another model, width, build or format, or one
//! that is truncated or corrupt, is named in a note or an error and left as it is. It does
//! not decide which states are kept or which prompt reuses one (the server does), and it
//! knows no engine's state layout ([`State::save`] writes that).

use std::fmt;
use std::fs;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{anyhow, bail, Context, Result};

use crate::engines::state_io;
use crate::engines::{Engine, State};
use crate::files;
use crate::quant::Width;
use crate::snapshot::Snapshot;

/// The first bytes of every state file.
const MAGIC: &[u8; 6] = b"COLIKV";

/// The format version this build writes and the only one it reads. Any change to the file or
/// to an engine's state layout (`SequenceState::save`) takes a new one.
pub const FORMAT_VERSION: u16 = 1;

/// What a state file's name ends with; other files in the directory are not looked at.
const EXTENSION: &str = "colikv";

/// The longest engine name a header may hold: longer is a corrupt length, not a name.
const MAX_ENGINE_NAME: u64 = 64;

/// The FNV-1a 64 hash of `bytes`: the identity's hashes and the file names. Not the
/// checksum, which must catch damage, not tell inputs apart.
fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// How messages name a width by its bits.
fn width_name(bits: u32) -> String {
    match bits {
        32 => "f32".to_string(),
        8 => "int8".to_string(),
        4 => "int4".to_string(),
        bits => format!("{bits}-bit"),
    }
}

/// The model a state was computed by: the engine, the snapshot's `config.json` and weight
/// files, and the widths its weights were used at. A state is used only by a run whose
/// identity is the same in every field, since any of them changes the bits it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvIdentity {
    engine: String,
    /// FNV-1a 64 of `config.json`'s bytes.
    config: u64,
    /// FNV-1a 64 of each shard's file name, a zero byte and its size (u64 LE), in name order.
    weights: u64,
    dense_bits: u32,
    expert_bits: u32,
}

impl KvIdentity {
    /// The identity of `engine` run on `snapshot` with dense weights at `dense` and routed
    /// experts at `experts` (`LoadOptions::dense_width`, `StoreOptions::width`).
    pub fn of(
        snapshot: &Snapshot,
        engine: &str,
        dense: Width,
        experts: Width,
    ) -> Result<KvIdentity> {
        let config_path = snapshot.dir().join("config.json");
        let config = files::read_input(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?;
        let mut weights = Vec::new();
        for (path, size) in snapshot.shard_files() {
            let name = path
                .file_name()
                .map(|n| n.as_encoded_bytes())
                .unwrap_or_default();
            weights.extend_from_slice(name);
            weights.push(0);
            weights.extend_from_slice(&size.to_le_bytes());
        }
        Ok(KvIdentity {
            engine: engine.to_string(),
            config: fnv1a(config),
            weights: fnv1a(weights),
            dense_bits: dense.bits(),
            expert_bits: experts.bits(),
        })
    }

    /// One line: the engine, the hashes and the widths.
    pub fn describe(&self) -> String {
        self.to_string()
    }

    /// The hash that begins the names of this identity's files, so that models sharing a
    /// directory never write to one another's files.
    fn key(&self) -> u64 {
        let mut bytes = self.engine.as_bytes().to_vec();
        bytes.push(0);
        for part in [self.config, self.weights] {
            bytes.extend_from_slice(&part.to_le_bytes());
        }
        for bits in [self.dense_bits, self.expert_bits] {
            bytes.extend_from_slice(&bits.to_le_bytes());
        }
        fnv1a(bytes)
    }

    /// What differs between a file's identity (`self`) and this run's, as notes say it.
    fn differences(&self, run: &KvIdentity) -> Vec<String> {
        let mut found = Vec::new();
        if self.engine != run.engine {
            found.push(format!(
                "belongs to engine {}, not {}",
                self.engine, run.engine
            ));
        }
        if self.config != run.config {
            found.push("config.json differs".to_string());
        }
        if self.weights != run.weights {
            found.push("the weight files differ (names or sizes)".to_string());
        }
        for (what, file, this) in [
            ("dense", self.dense_bits, run.dense_bits),
            ("expert", self.expert_bits, run.expert_bits),
        ] {
            if file != this {
                found.push(format!(
                    "{what} width {}, this run {}",
                    width_name(file),
                    width_name(this)
                ));
            }
        }
        found
    }

    /// The header's identity fields.
    fn write(&self, out: &mut dyn Write) -> io::Result<()> {
        state_io::write_len(out, self.engine.len())?;
        out.write_all(self.engine.as_bytes())?;
        state_io::write_u64(out, self.config)?;
        state_io::write_u64(out, self.weights)?;
        out.write_all(&self.dense_bits.to_le_bytes())?;
        out.write_all(&self.expert_bits.to_le_bytes())
    }

    /// What [`KvIdentity::write`] wrote.
    fn read(input: &mut dyn Read) -> Result<KvIdentity> {
        let len = state_io::read_u64(input, "the engine's name")?;
        if len > MAX_ENGINE_NAME {
            bail!("an engine name of {len} bytes");
        }
        let mut name = vec![0u8; len as usize];
        input.read_exact(&mut name)?;
        let engine =
            String::from_utf8(name).map_err(|_| anyhow!("an engine name that is not UTF-8"))?;
        let config = state_io::read_u64(input, "the config.json hash")?;
        let weights = state_io::read_u64(input, "the weights hash")?;
        let mut bits = [0u8; 8];
        input.read_exact(&mut bits)?;
        Ok(KvIdentity {
            engine,
            config,
            weights,
            dense_bits: u32::from_le_bytes([bits[0], bits[1], bits[2], bits[3]]),
            expert_bits: u32::from_le_bytes([bits[4], bits[5], bits[6], bits[7]]),
        })
    }

    /// Bytes [`KvIdentity::write`] takes.
    fn header_bytes(&self) -> u64 {
        8 + self.engine.len() as u64 + 8 + 8 + 4 + 4
    }
}

impl fmt::Display for KvIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}, config.json {:016x}, weights {:016x}, experts {}, dense {}",
            self.engine,
            self.config,
            self.weights,
            width_name(self.expert_bits),
            width_name(self.dense_bits)
        )
    }
}

/// Bytes of a file holding `tokens` tokens and a state of `state` bytes for `identity`.
fn file_bytes(identity: &KvIdentity, tokens: usize, state: u64) -> u64 {
    8 + identity.header_bytes() + 8 + 4 * tokens as u64 + 8 + state + 4
}

/// What a state file says before its state.
struct Header {
    identity: KvIdentity,
    tokens: Vec<u32>,
    state_bytes: u64,
}

/// Reads a header from `input`, a file of `len` bytes: refused when it is not a state file,
/// another format version, or its sizes do not add up to `len` (truncated or corrupt).
fn read_header(input: &mut dyn Read, len: u64) -> Result<Header> {
    let mut start = [0u8; 8];
    input
        .read_exact(&mut start)
        .map_err(|_| anyhow!("not a coli state file (shorter than its first 8 bytes)"))?;
    if &start[..6] != MAGIC {
        bail!("not a coli state file (it does not begin with COLIKV)");
    }
    let version = u16::from_le_bytes([start[6], start[7]]);
    if version != FORMAT_VERSION {
        bail!("format version {version}, this build reads {FORMAT_VERSION}");
    }
    let corrupt = |e: anyhow::Error| anyhow!("truncated or corrupt ({e:#})");
    let identity = KvIdentity::read(input).map_err(corrupt)?;
    // A corrupt count reads to the end of the file and fails there: the list grows only as
    // its ids arrive.
    let tokens = state_io::read_u32s(input, "the tokens").map_err(corrupt)?;
    let state_bytes = state_io::read_u64(input, "the state's length").map_err(corrupt)?;
    let header_len = file_bytes(&identity, tokens.len(), 0);
    if header_len.checked_add(state_bytes) != Some(len) {
        bail!(
            "truncated or corrupt (its header and a state of {state_bytes} bytes make {} bytes, the file has {len})",
            header_len.saturating_add(state_bytes)
        );
    }
    Ok(Header {
        identity,
        tokens,
        state_bytes,
    })
}

/// A writer that keeps the CRC-32 of what goes through it.
struct Checksummed<W> {
    inner: W,
    crc: crc32fast::Hasher,
    bytes: u64,
}

impl<W> Checksummed<W> {
    fn new(inner: W) -> Checksummed<W> {
        Checksummed {
            inner,
            crc: crc32fast::Hasher::new(),
            bytes: 0,
        }
    }
}

impl<W: Write> Write for Checksummed<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Checksummed<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc.update(&buf[..n]);
        self.bytes += n as u64;
        Ok(n)
    }
}

/// A writer that only counts what it is given.
struct Counted(u64);

impl Write for Counted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0 += buf.len() as u64;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Bytes [`State::save`] writes for `state`, counted without keeping them, so that the
/// limit is checked and the length written before the state is.
fn state_bytes(state: &State) -> Result<u64> {
    let mut counter = Counted(0);
    state.save(&mut counter)?;
    Ok(counter.0)
}

/// Writes a whole state file: header, tokens, the state (`bytes` long), checksum.
fn write_file(
    out: &mut dyn Write,
    identity: &KvIdentity,
    tokens: &[u32],
    state: &State,
    bytes: u64,
) -> io::Result<()> {
    let mut body = Checksummed::new(&mut *out);
    body.write_all(MAGIC)?;
    body.write_all(&FORMAT_VERSION.to_le_bytes())?;
    identity.write(&mut body)?;
    state_io::write_u32s(&mut body, tokens)?;
    state_io::write_u64(&mut body, bytes)?;
    let before = body.bytes;
    state.save(&mut body)?;
    if body.bytes - before != bytes {
        return Err(io::Error::other(format!(
            "the state wrote {} bytes where it counted {bytes}",
            body.bytes - before
        )));
    }
    let crc = body.crc.finalize();
    out.write_all(&crc.to_le_bytes())
}

/// Reads the file at `path` back: header, identity (`run`'s), the state into a fresh one of
/// `engine`, checksum.
fn read_file(path: &Path, run: &KvIdentity, engine: &dyn Engine) -> Result<(Vec<u32>, State)> {
    let file = files::open_input(path)?;
    let len = file.metadata()?.len();
    let mut input = Checksummed::new(BufReader::new(file));
    let header = read_header(&mut input, len)?;
    let differences = header.identity.differences(run);
    if !differences.is_empty() {
        bail!("{}", differences.join("; "));
    }
    let mut state = engine.new_state();
    let mut body = (&mut input).take(header.state_bytes);
    let restored = state.restore(&mut body);
    // The rest of the state is read even after a refusal, so that a damaged file is called
    // damaged rather than a state of another shape.
    io::copy(&mut body, &mut io::sink())?;
    let unused = body.limit();
    let crc = input.crc.clone().finalize();
    let mut stored = [0u8; 4];
    input.inner.read_exact(&mut stored)?;
    if unused > 0 || crc != u32::from_le_bytes(stored) {
        bail!("truncated or corrupt (its checksum does not match its bytes)");
    }
    restored?;
    Ok((header.tokens, state))
}

/// One state file of this identity.
struct Entry {
    path: PathBuf,
    tokens: Vec<u32>,
    bytes: u64,
    /// When it was last saved or loaded, by [`KvDir`]'s clock: larger is more recent.
    used: u64,
}

/// What [`KvDir::save`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Saved {
    /// The state is in `path`, `bytes` long; `evicted` are the files removed to keep the
    /// directory's files of this identity within the limit.
    Written {
        path: PathBuf,
        bytes: u64,
        evicted: Vec<PathBuf>,
    },
    /// Nothing was written: the file would take `bytes`, more than the whole `limit`.
    TooLarge { bytes: u64, limit: u64 },
}

/// A directory of state files, of which this run uses those of its identity.
pub struct KvDir {
    dir: PathBuf,
    limit: u64,
    identity: KvIdentity,
    entries: Vec<Entry>,
    /// The next [`Entry::used`].
    clock: u64,
}

impl KvDir {
    /// Opens `dir` (created if missing) for states of `identity`, within `limit_bytes` for
    /// its files of that identity. Reads every state file's header and tokens, not its
    /// state; returns a note for each file it will not use, naming the file and why (another
    /// engine, `config.json`, weights or width, another format version, truncated or
    /// corrupt). Those files are left as they are.
    pub fn open(
        dir: &Path,
        limit_bytes: u64,
        identity: KvIdentity,
    ) -> Result<(KvDir, Vec<String>)> {
        fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the state directory {}", dir.display()))?;
        let mut paths: Vec<PathBuf> = fs::read_dir(dir)
            .with_context(|| format!("cannot list the state directory {}", dir.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|path| path.extension().is_some_and(|ext| ext == EXTENSION))
            .collect();
        paths.sort();
        let mut notes = Vec::new();
        let mut found = Vec::new();
        for path in paths {
            match scan(&path, &identity) {
                Ok((entry, modified)) => found.push((modified, entry)),
                Err(why) => notes.push(format!(
                    "{}: not used ({why:#}); left as it is",
                    path.display()
                )),
            }
        }
        // Least recently used first, as the files' modification times say (set by every
        // save and load); ties by name.
        found.sort_by_key(|(modified, _)| *modified);
        let entries: Vec<Entry> = found
            .into_iter()
            .enumerate()
            .map(|(used, (_, entry))| Entry {
                used: used as u64,
                ..entry
            })
            .collect();
        let clock = entries.len() as u64;
        let kv = KvDir {
            dir: dir.to_path_buf(),
            limit: limit_bytes,
            identity,
            entries,
            clock,
        };
        Ok((kv, notes))
    }

    /// Writes `state`, which holds `tokens`, to its file (replaced whole, never torn; the
    /// same tokens replace their own file), then removes the least recently used other
    /// files of this identity until they fit the limit. A state whose file alone exceeds
    /// the limit is not written ([`Saved::TooLarge`]). A file of another identity is never
    /// replaced.
    pub fn save(&mut self, tokens: &[u32], state: &State) -> Result<Saved> {
        if state.engine() != self.identity.engine {
            bail!(
                "a {} state cannot be kept among {} states",
                state.engine(),
                self.identity.engine
            );
        }
        if state.position() != tokens.len() {
            bail!(
                "a state of {} positions cannot be kept as holding {} tokens",
                state.position(),
                tokens.len()
            );
        }
        let state_len = state_bytes(state)?;
        let bytes = file_bytes(&self.identity, tokens.len(), state_len);
        if bytes > self.limit {
            return Ok(Saved::TooLarge {
                bytes,
                limit: self.limit,
            });
        }
        let path = self.path_for(tokens);
        let known = self.entries.iter().position(|e| e.path == path);
        if known.is_none() && fs::symlink_metadata(&path).is_ok() {
            bail!(
                "{}: not written: the file there was not one of this model's usable states at start; left as it is",
                path.display()
            );
        }
        files::replace_alone(&path, |out| {
            write_file(out, &self.identity, tokens, state, state_len)
        })?;
        let entry = Entry {
            path: path.clone(),
            tokens: tokens.to_vec(),
            bytes,
            used: self.tick(),
        };
        match known {
            Some(i) => self.entries[i] = entry,
            None => self.entries.push(entry),
        }
        let evicted = self.evict(&path)?;
        Ok(Saved::Written {
            path,
            bytes,
            evicted,
        })
    }

    /// The entry sharing the longest prefix with `prompt`, and that prefix's length; among
    /// equals, one the prompt continues whole (usable without going back), then the most
    /// recently used. `None` when no entry shares a token. Entries are numbered until the
    /// next [`KvDir::save`] or [`KvDir::load`].
    pub fn best(&self, prompt: &[u32]) -> Option<(usize, usize)> {
        self.entries
            .iter()
            .enumerate()
            .map(|(i, entry)| {
                let common = entry
                    .tokens
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (i, common, common == entry.tokens.len(), entry.used)
            })
            .filter(|&(_, common, _, _)| common > 0)
            .max_by_key(|&(_, common, whole, used)| (common, whole, used))
            .map(|(i, common, _, _)| (i, common))
    }

    /// Reads entry `entry` back: its tokens and its state restored into a fresh state of
    /// `engine`, after checking the identity, every length and the checksum again. Marks it
    /// the most recently used (its file's modification time too). A file that fails is
    /// named in the error, dropped from the entries and left on disk.
    pub fn load(&mut self, entry: usize, engine: &dyn Engine) -> Result<(Vec<u32>, State)> {
        let Some(found) = self.entries.get(entry) else {
            bail!("no kept state {entry}: {} are kept", self.entries.len());
        };
        if engine.name() != self.identity.engine {
            bail!(
                "{} states cannot be read by the {} engine",
                self.identity.engine,
                engine.name()
            );
        }
        let path = found.path.clone();
        match read_file(&path, &self.identity, engine) {
            Ok((tokens, state)) => {
                // Only the order of eviction after a restart depends on it, so a file
                // whose time cannot be set is still used.
                let _ = files::open_input(&path).and_then(|f| f.set_modified(SystemTime::now()));
                let used = self.tick();
                let found = &mut self.entries[entry];
                (found.tokens, found.used) = (tokens.clone(), used);
                Ok((tokens, state))
            }
            Err(why) => {
                self.entries.remove(entry);
                Err(anyhow!(
                    "{}: not loaded ({why:#}); left as it is",
                    path.display()
                ))
            }
        }
    }

    /// Files of this identity in the directory.
    pub fn entries(&self) -> usize {
        self.entries.len()
    }

    /// Bytes those files take.
    pub fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// `<identity key>-<tokens hash>.colikv`.
    fn path_for(&self, tokens: &[u32]) -> PathBuf {
        let tokens = fnv1a(tokens.iter().flat_map(|t| t.to_le_bytes()));
        self.dir.join(format!(
            "{:016x}-{tokens:016x}.{EXTENSION}",
            self.identity.key()
        ))
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Removes the least recently used files but `kept` until this identity's files fit
    /// the limit; the paths removed.
    fn evict(&mut self, kept: &Path) -> Result<Vec<PathBuf>> {
        let mut evicted = Vec::new();
        while self.bytes() > self.limit {
            let Some(oldest) = self
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.path != kept)
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let entry = self.entries.remove(oldest);
            match fs::remove_file(&entry.path) {
                Ok(()) => {}
                // Another server on the directory removed it first.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(anyhow!(
                        "{}: cannot remove it to keep {} within {} bytes: {e}",
                        entry.path.display(),
                        self.dir.display(),
                        self.limit
                    ))
                }
            }
            evicted.push(entry.path);
        }
        Ok(evicted)
    }
}

/// The entry for the file at `path` and its modification time, or why it is not used.
fn scan(path: &Path, identity: &KvIdentity) -> Result<(Entry, SystemTime)> {
    let file = files::open_input(path)?;
    let meta = file.metadata()?;
    let header = read_header(&mut BufReader::new(file), meta.len())?;
    let differences = header.identity.differences(identity);
    if !differences.is_empty() {
        bail!("{}", differences.join("; "));
    }
    let entry = Entry {
        path: path.to_path_buf(),
        tokens: header.tokens,
        bytes: meta.len(),
        used: 0,
    };
    Ok((entry, meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
}
