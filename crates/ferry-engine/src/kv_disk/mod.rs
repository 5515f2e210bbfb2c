//! The KV disk tier: full prefix-cache blocks kept in files under a directory, below the KV
//! pool, so a prefix evicted from the pool (or held by a worker that restarted) is read back
//! instead of computed again (issue 38; Dynamo's KVBM, LMCache and SGLang's HiCache keep the same
//! kind of tier).
//!
//! - **Written through, in the background.** When the engine seals a block (full, immutable; see
//!   [`ferry_core::prefix_cache`]) it copies the block's KV out (a memcpy, or a device-to-host
//!   copy) and offers it here ([`DiskTier::offer`]); a writer thread writes the file. Writing at
//!   seal time rather than at eviction: an evicted block is reused by the same allocation that
//!   evicted it, inside a step, with no moment to copy it out; and a block written early is on
//!   disk when the worker is killed. A block already on disk is not copied again. The queue is
//!   bounded; when the disk falls behind, blocks are dropped (counted), never waited for.
//! - **Read on a prefix hit.** A prompt's chain is walked through the pool first, then through
//!   [`DiskTier::chain`]; the blocks found are read, checked ([`format::decode`]: checksum, name,
//!   chain, size) and imported into fresh pool blocks. A file that fails any check is deleted and
//!   counts as a miss: never served.
//! - **Read ahead.** A prompt that has to wait for its turn (a prefill worker's queue) has its
//!   disk blocks read by a reader thread meanwhile ([`DiskTier::prefetch`]), while the engine
//!   steps the prompts ahead of it; when it starts, its blocks are taken from memory
//!   ([`DiskTier::load`]; a read still under way is waited for, not repeated). A prompt that starts
//!   at once reads on the engine thread: there is nothing to overlap with.
//! - **Least recently used leaves first**, a parent never before its children ([`index`]).
//! - **Kept across restarts.** A tier opened on a directory finds its blocks again; the directory
//!   names what made them (`manifest.json`: model fingerprint, KV dtype and layout), and a tier
//!   for another model or layout refuses it rather than mixing. One process at a time: the tier
//!   holds an exclusive lock on `DIR/lock` for its life, and a second worker given the same
//!   directory fails to start, naming it.
//!
//! Pure parts: the file format ([`format`]) and the index ([`index`]); the threads and files
//! are here.

pub mod format;
pub mod index;

use ferry_core::{BlockHash, DiskEvent, KvLayout};
use index::Index;
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{self, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;
use thiserror::Error;

/// Where the tier keeps its blocks and how many bytes of files it may hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskConfig {
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// Why a tier could not be opened.
#[derive(Debug, Error)]
pub enum DiskError {
    #[error("--kv-disk {dir}: {op}: {source}")]
    Io { dir: String, op: &'static str, source: std::io::Error },
    #[error("--kv-disk {dir} is in use by another worker process (it holds {dir}/lock); give each worker its own directory")]
    InUse { dir: String },
    #[error("--kv-disk {dir} holds KV blocks of another model or cache layout ({what}); give this worker another directory, or empty that one")]
    Foreign { dir: String, what: String },
}

/// What made a directory's blocks: a tier only serves blocks of the same model and layout.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    pub format: u32,
    pub fingerprint: String,
    pub kv_dtype: String,
    pub block_size: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl Identity {
    pub fn new(fingerprint: &str, layout: &KvLayout) -> Identity {
        Identity {
            format: 1,
            fingerprint: fingerprint.to_string(),
            // The stored layout's name (int8: "int8-hadamard"), so a directory of an earlier int8
            // layout is refused by name rather than kept full of blocks no chain reaches.
            kv_dtype: layout.dtype.layout_name().to_string(),
            block_size: layout.block_size,
            n_layers: layout.n_layers,
            n_kv_heads: layout.n_kv_heads,
            head_dim: layout.head_dim,
        }
    }

    /// The first field that differs from `other`, named with both values.
    fn differs(&self, other: &Identity) -> Option<String> {
        let pairs = [
            ("format", self.format.to_string(), other.format.to_string()),
            ("model fingerprint", self.fingerprint.clone(), other.fingerprint.clone()),
            ("KV dtype", self.kv_dtype.clone(), other.kv_dtype.clone()),
            ("block size", self.block_size.to_string(), other.block_size.to_string()),
            ("layers", self.n_layers.to_string(), other.n_layers.to_string()),
            ("KV heads", self.n_kv_heads.to_string(), other.n_kv_heads.to_string()),
            ("head dim", self.head_dim.to_string(), other.head_dim.to_string()),
        ];
        pairs.into_iter().find(|(_, a, b)| a != b).map(|(what, a, b)| format!("{what} {a}, this worker's {b}"))
    }
}

/// Counters since the tier was opened, and its state now.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DiskStats {
    /// Blocks and bytes of files on disk now, and the most it may hold.
    pub blocks: u64,
    pub bytes: u64,
    pub capacity_bytes: u64,
    /// Blocks found on disk when the tier was opened (a warm restart).
    pub found_at_open: u64,
    pub written_blocks: u64,
    pub written_bytes: u64,
    pub write_seconds: f64,
    /// Seconds the engine thread spent copying sealed blocks' KV out for the writer.
    pub copy_seconds: f64,
    /// Blocks waiting for the writer now.
    pub write_queue: u64,
    /// Blocks not written because the writer's queue was full or the write failed.
    pub write_dropped: u64,
    pub read_blocks: u64,
    pub read_bytes: u64,
    /// Seconds spent reading and checking blocks (the measured read cost).
    pub read_seconds: f64,
    /// Blocks evicted from disk to make room.
    pub evicted: u64,
    /// Files that failed their checks (deleted, treated as misses).
    pub corrupt: u64,
}

impl DiskStats {
    /// Tokens of KV read per second, as measured; None before the first read.
    pub fn read_tokens_per_s(&self, block_size: usize) -> Option<f64> {
        (self.read_seconds > 0.0).then(|| (self.read_blocks as usize * block_size) as f64 / self.read_seconds)
    }
}

#[derive(Default)]
struct Counters {
    found_at_open: AtomicU64,
    written_blocks: AtomicU64,
    written_bytes: AtomicU64,
    write_nanos: AtomicU64,
    copy_nanos: AtomicU64,
    write_queue: AtomicU64,
    write_dropped: AtomicU64,
    read_blocks: AtomicU64,
    read_bytes: AtomicU64,
    read_nanos: AtomicU64,
    evicted: AtomicU64,
    corrupt: AtomicU64,
}

/// What the engine thread and the writer thread share.
struct Shared {
    dir: PathBuf,
    blocks: PathBuf,
    block_size: usize,
    payload_bytes: usize,
    index: Mutex<Index>,
    events: Mutex<Vec<DiskEvent>>,
    counters: Counters,
    /// Blocks read ahead ([`DiskTier::prefetch`]) and reads under way.
    staging: Mutex<Staging>,
    staged: Condvar,
    /// Held for the tier's life: the exclusive lock on `DIR/lock`.
    _lock: File,
}

/// Most bytes of read-ahead blocks kept waiting for their prompts (the oldest are dropped).
const STAGING_BYTES: usize = 256 << 20;

/// Blocks read ahead for prompts not started yet.
#[derive(Default)]
struct Staging {
    /// Read (None: the read failed, a miss), oldest first in `order`.
    ready: HashMap<BlockHash, Option<Vec<u8>>>,
    order: VecDeque<BlockHash>,
    bytes: usize,
    /// Queued for the reader or being read.
    pending: HashSet<BlockHash>,
}

impl Staging {
    fn put(&mut self, hash: BlockHash, got: Option<Vec<u8>>) {
        self.pending.remove(&hash);
        self.bytes += got.as_ref().map_or(0, Vec::len);
        if self.ready.insert(hash, got).is_none() {
            self.order.push_back(hash);
        }
        while self.bytes > STAGING_BYTES {
            let Some(old) = self.order.pop_front() else { break };
            if let Some(Some(p)) = self.ready.remove(&old) {
                self.bytes -= p.len();
            }
        }
    }

    fn take(&mut self, hash: BlockHash) -> Option<Option<Vec<u8>>> {
        let got = self.ready.remove(&hash)?;
        self.order.retain(|h| *h != hash);
        self.bytes -= got.as_ref().map_or(0, Vec::len);
        Some(got)
    }
}

/// A block to read ahead: its hash and the chain it continues.
struct Want {
    hash: BlockHash,
    parent: BlockHash,
    tokens: Vec<u32>,
}

impl Shared {
    fn index(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn staging(&self) -> MutexGuard<'_, Staging> {
        self.staging.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Read and check block `hash`: its payload, or None when the file is gone or fails a check
    /// (then it is deleted and forgotten: a miss).
    fn read(&self, hash: BlockHash, parent: BlockHash, tokens: &[u32]) -> Option<Vec<u8>> {
        let t0 = Instant::now();
        let got = fs::read(self.path(hash)).map_err(|e| e.to_string()).and_then(|file| {
            format::decode(&file, hash, parent, tokens, self.payload_bytes).map(<[u8]>::to_vec).map_err(|e| e.to_string())
        });
        self.counters.read_nanos.fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
        match got {
            Ok(payload) => {
                self.counters.read_blocks.fetch_add(1, Relaxed);
                self.counters.read_bytes.fetch_add(payload.len() as u64, Relaxed);
                Some(payload)
            }
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), "kv disk: block {:016x} not served: {e}", hash.0);
                self.counters.corrupt.fetch_add(1, Relaxed);
                if self.index().remove(hash).is_some() {
                    self.log(false, [hash]);
                }
                self.delete(&[hash]);
                None
            }
        }
    }

    fn log(&self, stored: bool, hashes: impl IntoIterator<Item = BlockHash>) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        ev.extend(hashes.into_iter().map(|hash| DiskEvent { stored, hash }));
    }

    fn path(&self, hash: BlockHash) -> PathBuf {
        self.blocks.join(format!("{:016x}.kvb", hash.0))
    }

    /// Delete evicted or corrupt blocks' files (a file already gone is fine).
    fn delete(&self, hashes: &[BlockHash]) {
        for &h in hashes {
            if let Err(e) = fs::remove_file(self.path(h))
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(dir = %self.dir.display(), "kv disk: deleting block {:016x}: {e}", h.0);
            }
        }
    }

    fn write(&self, job: &Write) -> std::io::Result<u64> {
        let bytes = format::encode(job.hash, job.parent, &job.tokens, &job.payload);
        let path = self.path(job.hash);
        let tmp = path.with_extension("tmp");
        let mut f = File::create(&tmp)?;
        f.write_all(&bytes)?;
        drop(f);
        fs::rename(&tmp, &path)?;
        Ok(bytes.len() as u64)
    }
}

/// A block on its way to disk.
pub struct Write {
    pub hash: BlockHash,
    pub parent: BlockHash,
    pub tokens: Vec<u32>,
    pub payload: Vec<u8>,
}

/// A worker's disk tier: owned by its engine. Dropping it lets the writer finish the queued
/// blocks and waits for it.
pub struct DiskTier {
    shared: Arc<Shared>,
    writer: Option<SyncSender<Write>>,
    reader: Option<Sender<Vec<Want>>>,
    threads: Vec<JoinHandle<()>>,
}

impl DiskTier {
    /// Open (or create) the tier at `cfg.dir` for blocks of `identity`'s model and layout, finding
    /// the blocks a previous process left there. `payload_bytes`: one block's KV.
    pub fn open(cfg: &DiskConfig, identity: &Identity, payload_bytes: usize) -> Result<DiskTier, DiskError> {
        let dir_s = cfg.dir.display().to_string();
        let io = |op: &'static str| {
            let dir = dir_s.clone();
            move |source| DiskError::Io { dir, op, source }
        };
        fs::create_dir_all(&cfg.dir).map_err(io("creating the directory"))?;
        let lock = OpenOptions::new().create(true).truncate(false).write(true).open(cfg.dir.join("lock")).map_err(io("opening its lock file"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => return Err(DiskError::InUse { dir: dir_s }),
            Err(fs::TryLockError::Error(e)) => return Err(io("locking it")(e)),
        }
        let manifest = cfg.dir.join("manifest.json");
        match fs::read(&manifest) {
            Ok(bytes) => {
                let found: Identity = serde_json::from_slice(&bytes)
                    .map_err(|e| DiskError::Foreign { dir: dir_s.clone(), what: format!("an unreadable manifest.json: {e}") })?;
                if let Some(what) = found.differs(identity) {
                    return Err(DiskError::Foreign { dir: dir_s, what });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let tmp = cfg.dir.join("manifest.json.tmp");
                let text = serde_json::to_vec_pretty(identity).unwrap_or_default();
                fs::write(&tmp, text).and_then(|()| fs::rename(&tmp, &manifest)).map_err(io("writing manifest.json"))?;
            }
            Err(e) => return Err(io("reading manifest.json")(e)),
        }
        let blocks = cfg.dir.join("blocks");
        fs::create_dir_all(&blocks).map_err(io("creating blocks/"))?;
        let shared = Arc::new(Shared {
            dir: cfg.dir.clone(),
            blocks,
            block_size: identity.block_size,
            payload_bytes,
            index: Mutex::new(Index::new(cfg.max_bytes)),
            events: Mutex::new(Vec::new()),
            counters: Counters::default(),
            staging: Mutex::new(Staging::default()),
            staged: Condvar::new(),
            _lock: lock,
        });
        scan(&shared).map_err(io("reading blocks/"))?;
        let depth = ((64usize << 20) / payload_bytes.max(1)).max(4);
        let (tx, rx) = mpsc::sync_channel::<Write>(depth);
        let s = shared.clone();
        let writer = std::thread::Builder::new()
            .name("ferry-kv-disk-write".into())
            .spawn(move || {
                for job in rx {
                    write_one(&s, &job);
                    s.counters.write_queue.fetch_sub(1, Relaxed);
                }
            })
            .map_err(io("starting its writer thread"))?;
        let (read_tx, read_rx) = mpsc::channel::<Vec<Want>>();
        let s = shared.clone();
        let reader = std::thread::Builder::new()
            .name("ferry-kv-disk-read".into())
            .spawn(move || {
                for wants in read_rx {
                    for w in wants {
                        let got = s.read(w.hash, w.parent, &w.tokens);
                        s.staging().put(w.hash, got);
                        s.staged.notify_all();
                    }
                }
            })
            .map_err(io("starting its reader thread"))?;
        Ok(DiskTier { shared, writer: Some(tx), reader: Some(read_tx), threads: vec![writer, reader] })
    }

    pub fn dir(&self) -> &Path {
        &self.shared.dir
    }

    /// One block's KV, in bytes.
    pub fn payload_bytes(&self) -> usize {
        self.shared.payload_bytes
    }

    /// Claim `hash` for writing: false when it is on disk or on its way (nothing to copy out).
    pub fn reserve(&self, hash: BlockHash) -> bool {
        self.shared.index().reserve(hash)
    }

    /// A claimed block's copy failed: release the claim.
    pub fn unreserve(&self, hash: BlockHash) {
        self.shared.index().unreserve(hash);
    }

    /// Queue a claimed block for writing; dropped (and counted) when the writer is behind.
    pub fn offer(&self, job: Write) {
        let Some(tx) = &self.writer else { return };
        let hash = job.hash;
        self.shared.counters.write_queue.fetch_add(1, Relaxed);
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = tx.try_send(job) {
            self.shared.counters.write_queue.fetch_sub(1, Relaxed);
            self.shared.counters.write_dropped.fetch_add(1, Relaxed);
            self.unreserve(hash);
        }
    }

    /// The engine thread spent `d` copying a block out for [`DiskTier::offer`] (counted in
    /// [`DiskStats::copy_seconds`]).
    pub fn copied(&self, d: std::time::Duration) {
        self.shared.counters.copy_nanos.fetch_add(d.as_nanos() as u64, Relaxed);
    }

    /// The blocks on disk continuing the chain at `parent` with the full blocks of `tokens`.
    pub fn chain(&self, parent: BlockHash, tokens: &[u32], max_blocks: usize) -> Vec<BlockHash> {
        self.shared.index().chain(parent, tokens, self.shared.block_size, max_blocks)
    }

    /// Read and check block `hash` (continuing `parent` with `tokens`) now: its KV payload, or
    /// None when the file is gone or fails a check (then it is deleted and forgotten: a miss).
    pub fn read(&self, hash: BlockHash, parent: BlockHash, tokens: &[u32]) -> Option<Vec<u8>> {
        self.shared.read(hash, parent, tokens)
    }

    /// Read the blocks of a chain ahead, on the reader thread: `chain[i]` continues `chain[i-1]`
    /// (`parent` for the first) with the `i`-th full block of `tokens`. Blocks read already or
    /// under way are not read again.
    pub fn prefetch(&self, parent: BlockHash, tokens: &[u32], chain: &[BlockHash]) {
        let Some(tx) = &self.reader else { return };
        let bs = self.shared.block_size;
        let mut wants = Vec::new();
        {
            let mut st = self.shared.staging();
            let mut p = parent;
            for (&hash, chunk) in chain.iter().zip(tokens.chunks_exact(bs)) {
                if !st.ready.contains_key(&hash) && st.pending.insert(hash) {
                    wants.push(Want { hash, parent: p, tokens: chunk.to_vec() });
                }
                p = hash;
            }
        }
        if !wants.is_empty() {
            let _ = tx.send(wants);
        }
    }

    /// Whether any block of `chain` is still queued for the reader or being read (false once
    /// each is in memory, found missing, or was never asked for), after waiting at most `wait`
    /// for the reads to end.
    pub fn reading(&self, chain: &[BlockHash], wait: std::time::Duration) -> bool {
        let deadline = Instant::now() + wait;
        let mut st = self.shared.staging();
        loop {
            if !chain.iter().any(|h| st.pending.contains(h)) {
                return false;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            st = self.shared.staged.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Block `hash` for a prompt starting now: taken from what was read ahead, waiting for a read
    /// under way, else read here. None: a miss.
    pub fn load(&self, hash: BlockHash, parent: BlockHash, tokens: &[u32]) -> Option<Vec<u8>> {
        let mut st = self.shared.staging();
        loop {
            if let Some(got) = st.take(hash) {
                return got;
            }
            if !st.pending.contains(&hash) {
                break;
            }
            st = self.shared.staged.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        drop(st);
        self.read(hash, parent, tokens)
    }

    /// The blocks of a chain were used: they become the most recently used.
    pub fn touch(&self, chain: &[BlockHash]) {
        self.shared.index().touch_chain(chain);
    }

    /// Blocks written to and deleted from disk since the last drain, oldest first (the blocks
    /// found at open come first, as written).
    pub fn drain_events(&self) -> Vec<DiskEvent> {
        std::mem::take(&mut *self.shared.events.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Every block on disk now.
    pub fn hashes(&self) -> Vec<BlockHash> {
        self.shared.index().hashes().collect()
    }

    pub fn stats(&self) -> DiskStats {
        let c = &self.shared.counters;
        let (blocks, bytes, capacity_bytes) = {
            let ix = self.shared.index();
            (ix.len() as u64, ix.bytes(), ix.capacity())
        };
        DiskStats {
            blocks,
            bytes,
            capacity_bytes,
            found_at_open: c.found_at_open.load(Relaxed),
            written_blocks: c.written_blocks.load(Relaxed),
            written_bytes: c.written_bytes.load(Relaxed),
            write_seconds: c.write_nanos.load(Relaxed) as f64 * 1e-9,
            copy_seconds: c.copy_nanos.load(Relaxed) as f64 * 1e-9,
            write_queue: c.write_queue.load(Relaxed),
            write_dropped: c.write_dropped.load(Relaxed),
            read_blocks: c.read_blocks.load(Relaxed),
            read_bytes: c.read_bytes.load(Relaxed),
            read_seconds: c.read_nanos.load(Relaxed) as f64 * 1e-9,
            evicted: c.evicted.load(Relaxed),
            corrupt: c.corrupt.load(Relaxed),
        }
    }

    /// Wait until every block queued so far is written (tests, and a clean shutdown).
    pub fn flush(&self) {
        while self.shared.counters.write_queue.load(Relaxed) > 0 {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        self.writer.take();
        self.reader.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The measured cost of a disk hit, for `ferry profile`: seconds to read and check one prompt
/// token's KV from a tier at `dir` (a fresh folder, removed after), from `blocks` blocks of
/// `identity`'s layout written there, the tier closed and opened again (as a restarted worker
/// reads), each block read once. Reads come from the page cache when it holds the files, as they
/// do for blocks written recently; the copy into the pool (a memcpy) is not included.
pub fn measure_read_cost(dir: &Path, identity: &Identity, payload_bytes: usize, blocks: usize) -> Result<f64, DiskError> {
    let cfg = DiskConfig { dir: dir.to_path_buf(), max_bytes: u64::MAX };
    let root = BlockHash::root(b"ferry-profile-disk-probe", b"");
    let bs = identity.block_size;
    let tokens: Vec<u32> = (0..(blocks * bs) as u32).collect();
    let chain = ferry_core::prefix_cache::block_hashes(root, &tokens, bs);
    {
        let t = DiskTier::open(&cfg, identity, payload_bytes)?;
        let mut parent = root;
        for (i, (&h, c)) in chain.iter().zip(tokens.chunks(bs)).enumerate() {
            // Not all zeros, so no layer of the storage stack can shortcut it.
            let payload: Vec<u8> = (0..payload_bytes).map(|j| (j as u32).wrapping_mul(2_654_435_761).wrapping_add(i as u32).to_le_bytes()[3]).collect();
            if t.reserve(h) {
                t.offer(Write { hash: h, parent, tokens: c.to_vec(), payload });
            }
            t.flush();
            parent = h;
        }
    }
    let t = DiskTier::open(&cfg, identity, payload_bytes)?;
    let mut parent = root;
    for (&h, c) in chain.iter().zip(tokens.chunks(bs)) {
        t.read(h, parent, c);
        parent = h;
    }
    let s = t.stats();
    drop(t);
    let _ = fs::remove_dir_all(dir);
    Ok(s.read_seconds / (s.read_blocks.max(1) as usize * bs) as f64)
}

/// The writer thread's work for one block: its file, then the index (evicting what no longer
/// fits), then the events.
fn write_one(s: &Shared, job: &Write) {
    let t0 = Instant::now();
    match s.write(job) {
        Ok(bytes) => {
            let evicted = s.index().insert(job.hash, job.parent, &job.tokens, bytes);
            let kept = !evicted.contains(&job.hash);
            s.delete(&evicted);
            let c = &s.counters;
            c.write_nanos.fetch_add(t0.elapsed().as_nanos() as u64, Relaxed);
            c.written_blocks.fetch_add(1, Relaxed);
            c.written_bytes.fetch_add(bytes, Relaxed);
            c.evicted.fetch_add(evicted.len() as u64, Relaxed);
            // Stored before the evictions it caused: a router applies them in this order.
            if kept {
                s.log(true, [job.hash]);
            }
            s.log(false, evicted.into_iter().filter(|&h| h != job.hash));
        }
        Err(e) => {
            tracing::warn!(dir = %s.dir.display(), "kv disk: writing block {:016x}: {e}", job.hash.0);
            s.index().unreserve(job.hash);
            s.counters.write_dropped.fetch_add(1, Relaxed);
            let _ = fs::remove_file(s.path(job.hash).with_extension("tmp"));
        }
    }
}

/// Find the blocks a previous process left: each file's header is checked (name, size, layout;
/// the payload's checksum is checked when it is read), the oldest files first into the index,
/// so the least recently written go first. Leftover temporary files and files that fail are
/// deleted.
fn scan(s: &Shared) -> std::io::Result<()> {
    let mut found = Vec::new();
    let mut bad = Vec::new();
    for entry in fs::read_dir(&s.blocks)? {
        let entry = entry?;
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("kvb") {
            bad.push(path);
            continue;
        }
        match check_header(s, &path) {
            Some(found_one) => found.push(found_one),
            None => bad.push(path),
        }
    }
    for p in &bad {
        let _ = fs::remove_file(p);
    }
    s.counters.corrupt.fetch_add(bad.iter().filter(|p| p.extension().and_then(|e| e.to_str()) == Some("kvb")).count() as u64, Relaxed);
    found.sort_by_key(|f| f.0);
    let mut ix = s.index();
    let mut evicted = Vec::new();
    for (_, header, bytes) in &found {
        evicted.extend(ix.insert(header.hash, header.parent, &header.tokens, *bytes));
    }
    ix.recount_children();
    let kept: Vec<BlockHash> = ix.hashes().collect();
    drop(ix);
    s.delete(&evicted);
    s.counters.found_at_open.store(kept.len() as u64, Relaxed);
    s.log(true, kept);
    Ok(())
}

/// A block file's modification time, header and size, if its header is whole and fits this tier.
fn check_header(s: &Shared, path: &Path) -> Option<(std::time::SystemTime, format::Header, u64)> {
    let meta = fs::metadata(path).ok()?;
    let mut head = vec![0u8; 8 + 4 + 8 + 8 + 4 + 4 * s.block_size + 8];
    File::open(path).ok()?.read_exact(&mut head).ok()?;
    let h = format::decode_header(&head, s.block_size).ok()?;
    let named = path.file_stem().and_then(|n| n.to_str()).and_then(|n| u64::from_str_radix(n, 16).ok());
    let fits = named == Some(h.hash.0) && h.tokens.len() == s.block_size && h.payload_bytes == s.payload_bytes;
    (fits && meta.len() == h.file_bytes() as u64).then(|| (meta.modified().unwrap_or(std::time::UNIX_EPOCH), h, meta.len()))
}

#[cfg(test)]
mod tests;
