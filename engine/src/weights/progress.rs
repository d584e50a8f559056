//! How far a checkpoint load is. Checking a checkpoint means decoding every element of every
//! tensor (the finiteness scan), which on a 160 GB checkpoint takes minutes; this module keeps
//! counters other threads can read while that runs ([`LoadProgress`], read as the wire
//! message a worker reports in `Worker.Info`), and the per-shard accounting behind them
//! ([`Tracker`]).
//!
//! Tensors are checked in schema order, which interleaves shards (a layer's tensors may sit in
//! several files, the globals in the first and last). So a shard is not timed from its first
//! tensor to its last; each tensor's bytes and the time spent checking it are credited to the
//! shard holding it, and a shard is reported once all of its tensors are done, with the time
//! actually spent on it.

use std::{
    collections::HashMap,
    fmt,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use proto::progress::{bytes, bytes_of, eta};

/// Called once per shard when its last tensor has been checked (on the loading thread: a slow
/// hook slows the load, which the `slow-load` test fault relies on).
pub type ShardHook = Box<dyn Fn(&ShardLoaded) + Send + Sync>;

/// A load's progress, shared between the loading thread and readers: the counters are atomics,
/// so reading never waits for the load.
#[derive(Default)]
pub struct LoadProgress {
    bytes_done: AtomicU64,
    bytes_total: AtomicU64,
    shards_done: AtomicU64,
    shards_total: AtomicU64,
    /// When the load started (set once by the loader).
    started: OnceLock<Instant>,
    /// Milliseconds the whole load took, once it finished (0 while running).
    finished_ms: AtomicU64,
    on_shard: Option<ShardHook>,
}

impl fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The counters as one reading, and whether a hook is set (a closure has no Debug).
        f.debug_struct("LoadProgress")
            .field("snapshot", &self.snapshot())
            .field("on_shard", &self.on_shard.is_some())
            .finish_non_exhaustive()
    }
}

impl LoadProgress {
    /// A progress value no load has started on.
    pub fn new() -> Self {
        Self::default()
    }

    /// Calls `hook` after each shard is done (besides logging it).
    #[must_use]
    pub fn with_shard_hook(mut self, hook: ShardHook) -> Self {
        self.on_shard = Some(hook);
        self
    }

    /// The counters now, as `Worker.Info` reports them.
    pub fn snapshot(&self) -> proto::v1::LoadProgress {
        let finished_ms = self.finished_ms.load(Ordering::Acquire);
        let elapsed_ms = if finished_ms > 0 {
            finished_ms
        } else {
            self.started.get().map_or(0, |s| millis(s.elapsed()))
        };
        proto::v1::LoadProgress {
            bytes_done: self.bytes_done.load(Ordering::Relaxed),
            bytes_total: self.bytes_total.load(Ordering::Relaxed),
            shards_done: self.shards_done.load(Ordering::Relaxed) as u32,
            shards_total: self.shards_total.load(Ordering::Relaxed) as u32,
            elapsed_ms,
            done: finished_ms > 0,
        }
    }

    fn begin(&self, bytes_total: u64, shards_total: u64) {
        let _ = self.started.set(Instant::now());
        self.bytes_total.store(bytes_total, Ordering::Relaxed);
        self.shards_total.store(shards_total, Ordering::Relaxed);
    }

    fn finish(&self) {
        // At least 1 ms: 0 means "still running".
        let ms = self.snapshot().elapsed_ms.max(1);
        self.finished_ms.store(ms, Ordering::Release);
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One shard finished: its own bytes and the time spent checking it, and the whole load then.
#[derive(Debug, Clone)]
pub struct ShardLoaded {
    /// The shard's file name.
    pub name: String,
    /// The shard's size on disk.
    pub bytes: u64,
    /// Time spent checking this shard's tensors.
    pub busy: Duration,
    pub overall: proto::v1::LoadProgress,
}

impl fmt::Display for ShardLoaded {
    /// `model-00003-of-00046.safetensors: 3.52 GB in 2.1 s (1676 MB/s); 10.6 of 160.0 GB,
    /// 3 of 46 shards, ETA 1m32s`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secs = self.busy.as_secs_f64();
        let mb_per_s = if secs > 0.0 {
            format!("{:.0}", self.bytes as f64 / 1e6 / secs)
        } else {
            "?".to_owned()
        };
        write!(
            f,
            "{}: {} in {secs:.1} s ({mb_per_s} MB/s); {}, {} of {} shards, ETA {}",
            self.name,
            bytes(self.bytes),
            bytes_of(self.overall.bytes_done, self.overall.bytes_total),
            self.overall.shards_done,
            self.overall.shards_total,
            self.overall.eta().map_or_else(|| "?".to_owned(), eta)
        )
    }
}

/// One shard's accounting.
#[derive(Debug)]
struct Shard {
    name: String,
    /// Size on disk (header and tensors the model does not use included).
    bytes: u64,
    /// Tensor bytes credited so far.
    credited: u64,
    /// Tensors still to check.
    left: usize,
    busy: Duration,
}

/// The loader's side: which shard each tensor is in, and what is left of each shard.
#[derive(Debug)]
pub struct Tracker {
    progress: Arc<LoadProgress>,
    shards: Vec<Shard>,
    /// File tensor name -> (shard index, bytes).
    tensors: HashMap<String, (usize, u64)>,
    /// When the previous tensor finished (or the load started): the time since then is the
    /// next tensor's.
    last: Instant,
}

impl Tracker {
    /// Starts the load on `progress`: `shards` are `(file name, size)`, `tensors` the file
    /// tensors the load will check, `(name, shard index, data bytes)`. The total is the sum of
    /// the shard sizes. Shards holding no tensor the load checks are done at once.
    pub fn start(
        progress: Arc<LoadProgress>,
        shards: Vec<(String, u64)>,
        tensors: impl IntoIterator<Item = (String, usize, u64)>,
    ) -> Self {
        let mut shards: Vec<Shard> = shards
            .into_iter()
            .map(|(name, bytes)| Shard {
                name,
                bytes,
                credited: 0,
                left: 0,
                busy: Duration::ZERO,
            })
            .collect();
        let mut map = HashMap::new();
        for (name, shard, bytes) in tensors {
            if shard < shards.len() && map.insert(name, (shard, bytes)).is_none() {
                shards[shard].left += 1;
            }
        }
        let total = shards.iter().map(|s| s.bytes).sum();
        tracing::info!(
            "checking the checkpoint: {} in {} shards",
            bytes(total),
            shards.len()
        );
        progress.begin(total, shards.len() as u64);
        let mut tracker = Self {
            progress,
            shards,
            tensors: map,
            last: Instant::now(),
        };
        for i in 0..tracker.shards.len() {
            if tracker.shards[i].left == 0 {
                tracker.shard_done(i);
            }
        }
        tracker
    }

    /// The file tensors in `names` (one logical tensor's parts) were checked: credits their
    /// bytes and the time since the previous call, and reports shards that are now complete.
    pub fn checked<'n>(&mut self, names: impl IntoIterator<Item = &'n str>) {
        let now = Instant::now();
        let spent = now - self.last;
        self.last = now;
        let mut parts = Vec::new();
        for name in names {
            if let Some((shard, bytes)) = self.tensors.remove(name) {
                parts.push((shard, bytes));
            }
        }
        let share = spent / u32::try_from(parts.len().max(1)).unwrap_or(u32::MAX);
        for (shard, bytes) in parts {
            let s = &mut self.shards[shard];
            s.credited += bytes;
            s.left -= 1;
            s.busy += share;
            self.progress.bytes_done.fetch_add(bytes, Ordering::Relaxed);
            if s.left == 0 {
                self.shard_done(shard);
            }
        }
    }

    /// Every tensor was checked: the load is complete.
    pub fn finish(&mut self) {
        // Shards whose tensors were not all listed (cannot happen after a successful load,
        // but the counters must still end at their totals).
        for i in 0..self.shards.len() {
            if self.shards[i].left > 0 {
                self.shards[i].left = 0;
                self.shard_done(i);
            }
        }
        self.progress.finish();
        let end = self.progress.snapshot();
        tracing::info!(
            "checkpoint checked: {} in {} shards in {:.1} s",
            bytes(end.bytes_total),
            end.shards_total,
            end.elapsed().as_secs_f64()
        );
    }

    fn shard_done(&mut self, i: usize) {
        let s = &self.shards[i];
        // The rest of the file (header, unused tensors) counts with the shard's last tensor.
        let rest = s.bytes.saturating_sub(s.credited);
        self.progress.bytes_done.fetch_add(rest, Ordering::Relaxed);
        self.progress.shards_done.fetch_add(1, Ordering::Relaxed);
        let loaded = ShardLoaded {
            name: s.name.clone(),
            bytes: s.bytes,
            busy: s.busy,
            overall: self.progress.snapshot(),
        };
        tracing::info!("loaded shard {loaded}");
        if let Some(hook) = &self.progress.on_shard {
            hook(&loaded);
        }
        // Time the hook took is not the next tensor's.
        self.last = Instant::now();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use std::sync::Mutex;

    use super::*;

    #[test]
    fn a_shard_line_reads_as_written() {
        let overall = proto::v1::LoadProgress {
            bytes_done: 40_000_000_000,
            bytes_total: 160_000_000_000,
            shards_done: 10,
            shards_total: 46,
            elapsed_ms: 20_000,
            done: false,
        };
        let shard = ShardLoaded {
            name: "model-00003-of-00046.safetensors".into(),
            bytes: 3_520_000_000,
            busy: Duration::from_millis(2100),
            overall,
        };
        assert_eq!(
            shard.to_string(),
            "model-00003-of-00046.safetensors: 3.52 GB in 2.1 s (1676 MB/s); 40.0 of 160.0 \
             GB, 10 of 46 shards, ETA 1m00s"
        );
    }

    /// Interleaved tensors: each shard completes with its last tensor, the file's untracked
    /// bytes count with it, and the totals end at the sum of the shard sizes.
    #[test]
    fn tracker_credits_shards_in_any_order() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let hook_seen = Arc::clone(&seen);
        let progress = Arc::new(LoadProgress::new().with_shard_hook(Box::new(move |s| {
            hook_seen.lock().unwrap().push((s.name.clone(), s.overall));
        })));
        let mut t = Tracker::start(
            Arc::clone(&progress),
            vec![("a".into(), 100), ("b".into(), 50), ("only-mtp".into(), 7)],
            [
                ("x".to_owned(), 0, 40),
                ("y".to_owned(), 1, 45),
                ("z".to_owned(), 0, 50),
            ],
        );
        // The shard with nothing to check is done at start.
        assert_eq!(progress.snapshot().shards_done, 1);
        assert_eq!(progress.snapshot().bytes_done, 7);
        assert_eq!(progress.snapshot().bytes_total, 157);
        t.checked(["x"]);
        assert_eq!(progress.snapshot().bytes_done, 47);
        t.checked(["y", "not-tracked"]);
        // b is complete: its 5 header bytes count too.
        assert_eq!(progress.snapshot().bytes_done, 7 + 40 + 50);
        assert_eq!(progress.snapshot().shards_done, 2);
        t.checked(["z"]);
        t.finish();
        let end = progress.snapshot();
        assert_eq!((end.bytes_done, end.bytes_total), (157, 157));
        assert_eq!((end.shards_done, end.shards_total), (3, 3));
        assert!(end.done);
        let names: Vec<String> = seen.lock().unwrap().iter().map(|s| s.0.clone()).collect();
        assert_eq!(names, ["only-mtp", "b", "a"]);
    }
}
