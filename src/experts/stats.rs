//! The store's counters: hits by tier, misses, bytes loaded and read, read-ahead and its
//! predictions, time reading and waiting; and their arithmetic (a window of a run, the
//! words an expert rank sends the trunk, the sum over ranks).
//!
//! The store moves them; this module decides nothing.

/// Counters of the whole store. Hits and misses count each distinct expert a layer needs in
/// one forward once, however many rows of the batch route to it. A lookup answered by an
/// expert read ahead is a hit (and a useful read-ahead); a miss is a read on demand.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Lookups answered by the GPU's expert tier (counted by the MoE pass, not the store).
    pub vram_hits: u64,
    pub pin_hits: u64,
    pub lru_hits: u64,
    pub misses: u64,
    /// Bytes of expert tensors loaded (on demand, ahead and for pins).
    pub bytes_loaded: u64,
    /// Bytes the store read from the shard files (ranges rounded for direct I/O); 0 when
    /// experts are mapped and the kernel reads them.
    pub bytes_read: u64,
    /// Experts read ahead by the lookahead; of those, later used and evicted unused.
    pub ahead_reads: u64,
    pub ahead_useful: u64,
    pub ahead_wasted: u64,
    /// Time the loader threads spent reading experts, and the compute thread waiting.
    pub read_nanos: u64,
    pub wait_nanos: u64,
    /// Experts the lookahead predicted that were not resident (read ahead or not), and of
    /// those, taken by their layer.
    pub predicted: u64,
    pub predicted_right: u64,
    /// Recall: the experts layers with a prediction took (resident or not), and of those,
    /// the ones predicted.
    pub foreseeable: u64,
    pub foreseen: u64,
}

impl CacheStats {
    /// Hit rate in percent; 0 before any lookup.
    pub fn hit_rate(&self) -> f64 {
        let hits = self.vram_hits + self.pin_hits + self.lru_hits;
        let total = hits + self.misses;
        if total == 0 {
            0.0
        } else {
            100.0 * hits as f64 / total as f64
        }
    }

    /// `self - earlier`, counter by counter (a window of a run, e.g. REPLAY's timed pass).
    pub fn since(&self, earlier: &CacheStats) -> CacheStats {
        CacheStats {
            vram_hits: self.vram_hits - earlier.vram_hits,
            pin_hits: self.pin_hits - earlier.pin_hits,
            lru_hits: self.lru_hits - earlier.lru_hits,
            misses: self.misses - earlier.misses,
            bytes_loaded: self.bytes_loaded - earlier.bytes_loaded,
            bytes_read: self.bytes_read - earlier.bytes_read,
            ahead_reads: self.ahead_reads - earlier.ahead_reads,
            ahead_useful: self.ahead_useful - earlier.ahead_useful,
            ahead_wasted: self.ahead_wasted - earlier.ahead_wasted,
            read_nanos: self.read_nanos - earlier.read_nanos,
            wait_nanos: self.wait_nanos - earlier.wait_nanos,
            predicted: self.predicted - earlier.predicted,
            predicted_right: self.predicted_right - earlier.predicted_right,
            foreseeable: self.foreseeable - earlier.foreseeable,
            foreseen: self.foreseen - earlier.foreseen,
        }
    }

    /// Every counter, in declaration order (what an expert rank sends the trunk).
    pub fn to_words(&self) -> [u64; 15] {
        [
            self.vram_hits,
            self.pin_hits,
            self.lru_hits,
            self.misses,
            self.bytes_loaded,
            self.bytes_read,
            self.ahead_reads,
            self.ahead_useful,
            self.ahead_wasted,
            self.read_nanos,
            self.wait_nanos,
            self.predicted,
            self.predicted_right,
            self.foreseeable,
            self.foreseen,
        ]
    }

    /// The counters [`CacheStats::to_words`] gave.
    pub fn from_words(w: [u64; 15]) -> CacheStats {
        CacheStats {
            vram_hits: w[0],
            pin_hits: w[1],
            lru_hits: w[2],
            misses: w[3],
            bytes_loaded: w[4],
            bytes_read: w[5],
            ahead_reads: w[6],
            ahead_useful: w[7],
            ahead_wasted: w[8],
            read_nanos: w[9],
            wait_nanos: w[10],
            predicted: w[11],
            predicted_right: w[12],
            foreseeable: w[13],
            foreseen: w[14],
        }
    }

    /// Add `other`'s counters to these (the stores of several processes).
    pub fn add(&mut self, other: &CacheStats) {
        let mut sum = self.to_words();
        for (s, o) in sum.iter_mut().zip(other.to_words()) {
            *s += o;
        }
        *self = CacheStats::from_words(sum);
    }
}
