//! `GET /metrics`: the server's counters and histograms, and the expert cache's figures as
//! of the last turn, in the Prometheus text format (version 0.0.4). The HTTP side counts
//! requests; the engine thread records turns, steps, kept states and the cache.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

use crate::experts::CacheStats;

/// Upper bounds of the time-to-first-token histogram, in seconds.
const TTFT_BUCKETS: [f64; 10] = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds of the decode-rate histogram, in tokens per second.
const RATE_BUCKETS: [f64; 10] = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];
/// Upper bounds of the queue-wait histogram, in seconds.
const WAIT_BUCKETS: [f64; 10] = [0.001, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0];
/// Upper bounds of the step-time histogram, in seconds.
const STEP_BUCKETS: [f64; 10] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0];
/// Upper bounds of the sequences-per-step histogram.
const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0];

#[derive(Default)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], value: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; bounds.len()];
        }
        for (count, bound) in self.counts.iter_mut().zip(bounds) {
            if value <= *bound {
                *count += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, bounds: &[f64]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, bound) in bounds.iter().enumerate() {
            let count = self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", self.sum, self.count);
    }
}

#[derive(Default)]
struct Inner {
    /// (endpoint, HTTP status) -> requests.
    requests: BTreeMap<(&'static str, u16), u64>,
    prompt_tokens: u64,
    cached_prompt_tokens: u64,
    completion_tokens: u64,
    /// Generations stopped because their client went away.
    abandoned: u64,
    ttft: Histogram,
    decode_rate: Histogram,
    cache: CacheStats,
    pinned: usize,
    running: usize,
    waiting: usize,
    queue_wait: Histogram,
    batch: Histogram,
    step_time: Histogram,
    steps: u64,
    step_rows: u64,
    step_experts_taken: u64,
    step_experts_read: u64,
    kept_states: usize,
    kept_bytes: u64,
}

/// One step of the scheduler: one batched forward.
pub struct StepFigures {
    /// Sequences in the forward.
    pub sequences: usize,
    /// Token rows in the forward.
    pub rows: usize,
    /// Distinct experts its MoE layers took, from memory or read.
    pub experts_taken: u64,
    /// Of those, read from the shards (the store's misses).
    pub experts_read: u64,
    pub seconds: f64,
}

/// Shared between the HTTP handlers and the engine thread.
#[derive(Default)]
pub struct Metrics {
    inner: Mutex<Inner>,
}

/// One finished turn, as the engine thread reports it.
pub struct Turn {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// From the request's arrival to its first token; `None` when no token came.
    pub first_token_seconds: Option<f64>,
    /// Decode rate after the first token; `None` with fewer than two tokens.
    pub decode_rate: Option<f64>,
    pub abandoned: bool,
}

impl Metrics {
    fn with<T>(&self, f: impl FnOnce(&mut Inner) -> T) -> T {
        // A poisoned lock still holds counts worth reporting.
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut inner)
    }

    pub fn request(&self, endpoint: &'static str, status: u16) {
        self.with(|m| *m.requests.entry((endpoint, status)).or_default() += 1);
    }

    /// A request entered the queue (`+1`) or left it for the engine (`-1`).
    pub fn queue(&self, waiting: isize, running: isize) {
        self.with(|m| {
            m.waiting = m.waiting.saturating_add_signed(waiting);
            m.running = m.running.saturating_add_signed(running);
        });
    }

    /// (running, waiting) generations.
    pub fn load(&self) -> (usize, usize) {
        self.with(|m| (m.running, m.waiting))
    }

    /// A request left the queue for the engine after `seconds` in it.
    pub fn waited(&self, seconds: f64) {
        self.with(|m| m.queue_wait.observe(&WAIT_BUCKETS, seconds));
    }

    pub fn step(&self, step: StepFigures) {
        self.with(|m| {
            m.batch.observe(&BATCH_BUCKETS, step.sequences as f64);
            m.step_time.observe(&STEP_BUCKETS, step.seconds);
            m.steps += 1;
            m.step_rows += step.rows as u64;
            m.step_experts_taken += step.experts_taken;
            m.step_experts_read += step.experts_read;
        });
    }

    /// The kept conversation states now: how many, and their bytes.
    pub fn kept(&self, (states, bytes): (usize, u64)) {
        self.with(|m| {
            m.kept_states = states;
            m.kept_bytes = bytes;
        });
    }

    pub fn turn(&self, turn: &Turn, cache: CacheStats, pinned: usize) {
        self.with(|m| {
            m.prompt_tokens += turn.prompt_tokens as u64;
            m.cached_prompt_tokens += turn.cached_tokens as u64;
            m.completion_tokens += turn.completion_tokens as u64;
            m.abandoned += u64::from(turn.abandoned);
            if let Some(seconds) = turn.first_token_seconds {
                m.ttft.observe(&TTFT_BUCKETS, seconds);
            }
            if let Some(rate) = turn.decode_rate {
                m.decode_rate.observe(&RATE_BUCKETS, rate);
            }
            m.cache = cache;
            m.pinned = pinned;
        });
    }

    /// The generated tokens of the turns so far and the expert cache as of the last
    /// (`coli chat`'s `/stats`).
    pub fn totals(&self) -> (u64, CacheStats) {
        self.with(|m| (m.completion_tokens, m.cache))
    }

    pub fn render(&self) -> String {
        self.with(|m| {
            let mut out = String::new();
            let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
                for (labels, value) in samples {
                    let _ = writeln!(out, "{name}{labels} {value}");
                }
            };
            let requests: Vec<(String, f64)> = m
                .requests
                .iter()
                .map(|((endpoint, status), n)| {
                    (
                        format!("{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
                        *n as f64,
                    )
                })
                .collect();
            let one = |v: f64| vec![(String::new(), v)];
            metric(
                "coli_requests_total",
                "counter",
                "HTTP requests answered, by endpoint and status.",
                &requests,
            );
            // The metrics with one sample each: name, type, help, value.
            let single = [
                (
                    "coli_requests_running",
                    "gauge",
                    "Generations running (up to --parallel, batched in each step).",
                    m.running as f64,
                ),
                (
                    "coli_requests_waiting",
                    "gauge",
                    "Generations waiting for a free sequence, served first come first served.",
                    m.waiting as f64,
                ),
                (
                    "coli_prompt_tokens_total",
                    "counter",
                    "Prompt tokens of finished turns.",
                    m.prompt_tokens as f64,
                ),
                (
                    "coli_prompt_tokens_cached_total",
                    "counter",
                    "Prompt tokens a kept conversation state held (not computed).",
                    m.cached_prompt_tokens as f64,
                ),
                (
                    "coli_completion_tokens_total",
                    "counter",
                    "Generated tokens.",
                    m.completion_tokens as f64,
                ),
                (
                    "coli_generations_abandoned_total",
                    "counter",
                    "Generations stopped because the client disconnected.",
                    m.abandoned as f64,
                ),
                (
                    "coli_steps_total",
                    "counter",
                    "Batched forwards the scheduler ran.",
                    m.steps as f64,
                ),
                (
                    "coli_step_rows_total",
                    "counter",
                    "Token rows those forwards computed (decoded tokens, drafts and prompt chunks).",
                    m.step_rows as f64,
                ),
                (
                    "coli_step_experts_taken_total",
                    "counter",
                    "Distinct routed experts the steps' MoE layers took: one take serves every row routed to the expert in its step.",
                    m.step_experts_taken as f64,
                ),
                (
                    "coli_step_experts_read_total",
                    "counter",
                    "Of those, experts read from the shards.",
                    m.step_experts_read as f64,
                ),
                (
                    "coli_kept_states",
                    "gauge",
                    "Conversation states kept for prefix reuse.",
                    m.kept_states as f64,
                ),
                (
                    "coli_kept_state_bytes",
                    "gauge",
                    "Bytes of the kept conversation states (bounded by --cache-mb).",
                    m.kept_bytes as f64,
                ),
            ];
            for (name, kind, help, value) in single {
                metric(name, kind, help, &one(value));
            }
            let cache = &m.cache;
            metric(
                "coli_expert_cache_hits_total",
                "counter",
                "Routed-expert lookups answered from memory, by where.",
                &[
                    ("{where=\"pin\"}".to_string(), cache.pin_hits as f64),
                    ("{where=\"lru\"}".to_string(), cache.lru_hits as f64),
                    ("{where=\"vram\"}".to_string(), cache.vram_hits as f64),
                ],
            );
            let cache_single = [
                (
                    "coli_expert_cache_misses_total",
                    "counter",
                    "Routed-expert lookups that had to load the expert.",
                    cache.misses as f64,
                ),
                (
                    "coli_expert_pins",
                    "gauge",
                    "Experts pinned in the expert cache.",
                    m.pinned as f64,
                ),
                (
                    "coli_expert_bytes_read_total",
                    "counter",
                    "Bytes the expert store read from the shard files (0 when experts are mapped).",
                    cache.bytes_read as f64,
                ),
            ];
            for (name, kind, help, value) in cache_single {
                metric(name, kind, help, &one(value));
            }
            m.ttft.render(
                &mut out,
                "coli_time_to_first_token_seconds",
                "From a request's arrival (queueing included) to its first generated token.",
                &TTFT_BUCKETS,
            );
            m.decode_rate.render(
                &mut out,
                "coli_decode_tokens_per_second",
                "Decode rate of each turn after its first token.",
                &RATE_BUCKETS,
            );
            m.queue_wait.render(
                &mut out,
                "coli_queue_wait_seconds",
                "From a request's arrival to its start on the engine.",
                &WAIT_BUCKETS,
            );
            m.batch.render(
                &mut out,
                "coli_step_sequences",
                "Sequences in each batched forward.",
                &BATCH_BUCKETS,
            );
            m.step_time.render(
                &mut out,
                "coli_step_seconds",
                "Time of each batched forward.",
                &STEP_BUCKETS,
            );
            out
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_cumulative_buckets() {
        let metrics = Metrics::default();
        metrics.request("chat", 200);
        metrics.request("chat", 200);
        metrics.request("completions", 400);
        let turn = Turn {
            prompt_tokens: 10,
            cached_tokens: 4,
            completion_tokens: 3,
            first_token_seconds: Some(0.3),
            decode_rate: Some(42.0),
            abandoned: false,
        };
        let cache = CacheStats {
            misses: 7,
            lru_hits: 5,
            ..CacheStats::default()
        };
        metrics.turn(&turn, cache, 2);
        for sequences in [1, 3] {
            metrics.step(StepFigures {
                sequences,
                rows: 2 * sequences,
                experts_taken: 5,
                experts_read: 1,
                seconds: 0.1,
            });
        }
        metrics.waited(0.02);
        metrics.kept((2, 4096));
        let text = metrics.render();
        assert!(text.contains("coli_step_sequences_bucket{le=\"2\"} 1\n"));
        assert!(text.contains("coli_step_sequences_bucket{le=\"3\"} 2\n"));
        assert!(text.contains("coli_step_rows_total 8\n"));
        assert!(text.contains("coli_step_experts_taken_total 10\n"));
        assert!(text.contains("coli_queue_wait_seconds_bucket{le=\"0.05\"} 1\n"));
        assert!(text.contains("coli_kept_state_bytes 4096\n"));
        assert!(text.contains("coli_requests_total{endpoint=\"chat\",status=\"200\"} 2\n"));
        assert!(text.contains("coli_requests_total{endpoint=\"completions\",status=\"400\"} 1\n"));
        assert!(text.contains("coli_prompt_tokens_cached_total 4\n"));
        assert!(text.contains("coli_expert_cache_misses_total 7\n"));
        assert!(text.contains("coli_expert_cache_hits_total{where=\"lru\"} 5\n"));
        assert!(text.contains("coli_time_to_first_token_seconds_bucket{le=\"0.25\"} 0\n"));
        assert!(text.contains("coli_time_to_first_token_seconds_bucket{le=\"0.5\"} 1\n"));
        assert!(text.contains("coli_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1\n"));
        assert!(text.contains("coli_decode_tokens_per_second_bucket{le=\"50\"} 1\n"));
        assert!(text.contains("coli_expert_pins 2\n"));
    }
}
