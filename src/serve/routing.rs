//! `GET /routing`: the model's experts at work, as server-sent events. The engine thread
//! keeps a [`Feed`]: after each batched forward it adds the step's selections to the heat
//! (the history's counts at start plus every selection since) and, at most
//! [`PUBLISH_EVERY`] apart and only while someone watches, publishes a [`Frame`] (the last
//! step's routing, where every expert lives, the heat, the store's counters and recent
//! rates) on a `watch` channel, which never blocks it: a frame replaces the one before,
//! read or not. When the engine runs out of work it publishes what it holds, so a stream
//! always ends on the state the last step left. Each connection ([`events`]) gets the shape
//! and a full snapshot first, then per frame what changed since the last event it sent, at
//! most one event per [`PUBLISH_EVERY`].

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::engines::Engine;
use crate::experts::{CacheStats, Residence};

/// The least time between two frames the engine publishes, and between two events of one
/// connection: at most 20 a second.
pub const PUBLISH_EVERY: Duration = Duration::from_millis(50);

/// The recent steps the rates are measured over.
const RATE_WINDOW: Duration = Duration::from_secs(2);

/// The residence kinds, by the index the events give them.
const KINDS: [Residence; 4] = [
    Residence::Absent,
    Residence::Slot,
    Residence::Pinned,
    Residence::Vram,
];

fn kind_index(residence: Residence) -> u8 {
    KINDS.iter().position(|&k| k == residence).unwrap_or(0) as u8
}

/// The grid: rows of the routing table (the model's layers, and a multi-token-prediction
/// head's row after them), experts per row, and the rows that route.
#[derive(Debug)]
pub struct Shape {
    pub layers: usize,
    pub experts: usize,
    pub moe_layers: Vec<usize>,
}

/// Rates over the steps of the last [`RATE_WINDOW`]; `None` without a step in it.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rates {
    /// Generated tokens a second, from the start of the window's first step to the end of
    /// its last.
    pub tokens_per_second: Option<f64>,
    /// Percent of the window's expert lookups answered from memory.
    pub hit_rate: Option<f64>,
    /// Megabytes read from the shards per generated token.
    pub disk_mb_per_token: Option<f64>,
}

/// What the engine publishes after a step.
#[derive(Debug, Default)]
pub struct Frame {
    /// Batched forwards so far.
    pub steps: u64,
    /// Tokens generated so far (all requests).
    pub tokens: u64,
    /// The last step: for each routing layer, the experts it took (ascending; none when
    /// the layer routed nothing).
    pub routed: Vec<(usize, Vec<u32>)>,
    /// Row-major `layers x experts`: the history's counts at start plus every selection
    /// since.
    pub heat: Vec<u64>,
    /// Row-major `layers x experts`: where each expert lives, as an index into [`KINDS`].
    pub residence: Vec<u8>,
    pub stats: CacheStats,
    pub rates: Rates,
}

/// The HTTP side's handle: the shape, and the channel to subscribe to.
#[derive(Clone)]
pub struct Routing {
    pub shape: Arc<Shape>,
    frames: Arc<watch::Sender<Arc<Frame>>>,
}

impl std::fmt::Debug for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Routing({} layers x {} experts)",
            self.shape.layers, self.shape.experts
        )
    }
}

/// One step, for the rates.
struct Sample {
    started: Instant,
    ended: Instant,
    tokens: u64,
    lookups: u64,
    hits: u64,
    bytes_read: u64,
}

/// The engine thread's side.
pub struct Feed {
    shape: Arc<Shape>,
    frames: Arc<watch::Sender<Arc<Frame>>>,
    heat: Vec<u64>,
    /// The selections of the last step, as the telemetry hands them over.
    counts: Vec<u32>,
    routed: Vec<(usize, Vec<u32>)>,
    steps: u64,
    tokens: u64,
    samples: VecDeque<Sample>,
    published: Instant,
    /// Steps since the last frame published.
    unpublished: bool,
}

impl Feed {
    /// The feed of `engine` (its telemetry counting steps from now on) and the handle the
    /// HTTP side subscribes through, holding a first frame: the history's heat and where
    /// every expert lives before any step.
    pub fn new(engine: &dyn Engine) -> (Feed, Routing) {
        let (shape, heat) = {
            let mut routed = engine.routed();
            routed.telemetry.count_steps();
            let counts = routed.telemetry.counts();
            let (layers, experts) = (counts.n_layers() + 1, counts.n_experts());
            let moe_layers = (0..layers).filter(|&l| counts.routes(l)).collect();
            let mut heat = vec![0u64; layers * experts];
            for (layer, row) in heat.chunks_mut(experts).enumerate() {
                for (expert, cell) in row.iter_mut().enumerate() {
                    *cell = u64::from(counts.get(layer, expert));
                }
            }
            let shape = Shape {
                layers,
                experts,
                moe_layers,
            };
            (Arc::new(shape), heat)
        };
        let mut feed = Feed {
            shape: shape.clone(),
            // Replaced by the first frame below, before anyone can subscribe.
            frames: Arc::new(watch::channel(Arc::new(Frame::default())).0),
            heat,
            counts: Vec::new(),
            routed: Vec::new(),
            steps: 0,
            tokens: 0,
            samples: VecDeque::new(),
            published: Instant::now(),
            unpublished: false,
        };
        feed.publish(engine);
        let routing = Routing {
            shape,
            frames: feed.frames.clone(),
        };
        (feed, routing)
    }

    /// A batched forward that began at `started` ended, the store's counters going from
    /// `before` to `after`, and `tokens` generated from it: its selections join the heat,
    /// and a frame is published when someone watches and the last is old enough.
    pub fn step(
        &mut self,
        engine: &dyn Engine,
        started: Instant,
        before: &CacheStats,
        after: &CacheStats,
        tokens: u64,
    ) {
        engine.routed().telemetry.take_steps(&mut self.counts);
        let experts = self.shape.experts;
        self.routed.clear();
        for &layer in &self.shape.moe_layers {
            let row = layer * experts..(layer + 1) * experts;
            let (Some(counts), Some(heat)) = (self.counts.get(row.clone()), self.heat.get_mut(row))
            else {
                continue;
            };
            let mut took = Vec::new();
            for (expert, (&count, cell)) in counts.iter().zip(heat.iter_mut()).enumerate() {
                if count > 0 {
                    *cell += u64::from(count);
                    took.push(expert as u32);
                }
            }
            self.routed.push((layer, took));
        }
        self.steps += 1;
        self.tokens += tokens;
        let lookups = |s: &CacheStats| s.vram_hits + s.pin_hits + s.lru_hits + s.misses;
        let now = Instant::now();
        self.samples.push_back(Sample {
            started,
            ended: now,
            tokens,
            lookups: lookups(after).saturating_sub(lookups(before)),
            hits: lookups(after)
                .saturating_sub(lookups(before))
                .saturating_sub(after.misses.saturating_sub(before.misses)),
            bytes_read: after.bytes_read.saturating_sub(before.bytes_read),
        });
        while self
            .samples
            .front()
            .is_some_and(|s| now.duration_since(s.ended) > RATE_WINDOW)
        {
            self.samples.pop_front();
        }
        self.unpublished = true;
        if self.frames.receiver_count() > 0 && self.published.elapsed() >= PUBLISH_EVERY {
            self.publish(engine);
        }
    }

    /// The engine has nothing to do: publish the state the last step left, if it is not
    /// published yet.
    pub fn idle(&mut self, engine: &dyn Engine) {
        if self.unpublished {
            self.publish(engine);
        }
    }

    fn rates(&self) -> Rates {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else {
            return Rates::default();
        };
        let sum = |f: fn(&Sample) -> u64| self.samples.iter().map(f).sum::<u64>();
        let (tokens, lookups, hits, bytes) = (
            sum(|s| s.tokens),
            sum(|s| s.lookups),
            sum(|s| s.hits),
            sum(|s| s.bytes_read),
        );
        let seconds = last.ended.duration_since(first.started).as_secs_f64();
        Rates {
            tokens_per_second: (seconds > 0.0).then(|| tokens as f64 / seconds),
            hit_rate: (lookups > 0).then(|| 100.0 * hits as f64 / lookups as f64),
            disk_mb_per_token: (tokens > 0).then(|| bytes as f64 / 1e6 / tokens as f64),
        }
    }

    fn publish(&mut self, engine: &dyn Engine) {
        let (residence, stats) = {
            let routed = engine.routed();
            (routed.residence(), routed.stats())
        };
        let experts = self.shape.experts;
        let mut cells = vec![0u8; self.shape.layers * experts];
        for (row, layer) in cells.chunks_mut(experts).zip(&residence) {
            for (cell, &place) in row.iter_mut().zip(layer) {
                *cell = kind_index(place);
            }
        }
        let frame = Frame {
            steps: self.steps,
            tokens: self.tokens,
            routed: self.routed.clone(),
            heat: self.heat.clone(),
            residence: cells,
            stats,
            rates: self.rates(),
        };
        self.frames.send_replace(Arc::new(frame));
        self.published = Instant::now();
        self.unpublished = false;
    }
}

/// The counters and rates of `frame`, as events give them.
fn counters(frame: &Frame) -> Value {
    let stats = &frame.stats;
    json!({
        "steps": frame.steps,
        "tokens": frame.tokens,
        "hits": { "vram": stats.vram_hits, "pin": stats.pin_hits, "lru": stats.lru_hits },
        "misses": stats.misses,
        "hit_rate": stats.hit_rate(),
        "bytes_read": stats.bytes_read,
        "rates": {
            "tokens_per_second": frame.rates.tokens_per_second,
            "hit_rate": frame.rates.hit_rate,
            "disk_mb_per_token": frame.rates.disk_mb_per_token,
        },
    })
}

/// The first event of a connection: the shape, the model, and the whole state.
fn shape_event(model: &str, engine: &str, shape: &Shape, frame: &Frame) -> Value {
    let rows = |cells: Vec<Value>| -> Vec<Value> {
        cells
            .chunks(shape.experts.max(1))
            .map(|row| Value::from(row.to_vec()))
            .collect()
    };
    let heat = frame.heat.iter().map(|&h| Value::from(h)).collect();
    let residence = frame.residence.iter().map(|&r| Value::from(r)).collect();
    json!({
        "model": model,
        "engine": engine,
        "layers": shape.layers,
        "experts": shape.experts,
        "moe_layers": shape.moe_layers,
        "residence_kinds": KINDS.iter().map(|k| k.name()).collect::<Vec<_>>(),
        "residence": rows(residence),
        "heat": rows(heat),
        "counters": counters(frame),
    })
}

/// What changed from `sent` (the heat and residence a connection last sent) to `frame`,
/// with the last step's routing and the counters; `sent` becomes `frame`'s.
fn step_event(sent: &mut (Vec<u64>, Vec<u8>), frame: &Frame, experts: usize) -> Value {
    let experts = experts.max(1);
    let cell = |i: usize| (i / experts, i % experts);
    let mut heat = Vec::new();
    for (i, (&now, was)) in frame.heat.iter().zip(sent.0.iter_mut()).enumerate() {
        if now != *was {
            let (layer, expert) = cell(i);
            heat.push(json!([layer, expert, now]));
            *was = now;
        }
    }
    let mut residence = Vec::new();
    for (i, (&now, was)) in frame.residence.iter().zip(sent.1.iter_mut()).enumerate() {
        if now != *was {
            let (layer, expert) = cell(i);
            residence.push(json!([layer, expert, now]));
            *was = now;
        }
    }
    json!({
        "step": frame.steps,
        "routed": frame.routed.iter().map(|(layer, experts)| json!([layer, experts])).collect::<Vec<_>>(),
        "heat": heat,
        "residence": residence,
        "counters": counters(frame),
    })
}

/// The event stream of one connection: `shape` with the whole state, then a `step` per
/// frame published (at most one per [`PUBLISH_EVERY`], the latest frame when several came
/// between), until the client leaves or the server begins to stop.
pub fn events(
    routing: &Routing,
    model: &str,
    engine: &str,
    stopping: watch::Receiver<bool>,
) -> Response {
    let mut frames = routing.frames.subscribe();
    let first = frames.borrow_and_update().clone();
    let shape = routing.shape.clone();
    let opening = SseEvent::default()
        .event("shape")
        .data(shape_event(model, engine, &shape, &first).to_string());
    let sent = (first.heat.clone(), first.residence.clone());
    let steps = futures_util::stream::unfold(
        (frames, sent, None::<Instant>),
        move |(mut frames, mut sent, last)| {
            let experts = shape.experts;
            let mut stopping = stopping.clone();
            async move {
                if let Some(last) = last {
                    tokio::time::sleep_until((last + PUBLISH_EVERY).into()).await;
                }
                tokio::select! {
                    biased;
                    _ = stopping.wait_for(|stopping| *stopping) => return None,
                    changed = frames.changed() => changed.ok()?,
                }
                let frame = frames.borrow_and_update().clone();
                let data = step_event(&mut sent, &frame, experts).to_string();
                let event = SseEvent::default().event("step").data(data);
                Some((
                    Ok::<_, Infallible>(event),
                    (frames, sent, Some(Instant::now())),
                ))
            }
        },
    );
    let opening = futures_util::stream::once(async move { Ok::<_, Infallible>(opening) });
    Sse::new(futures_util::StreamExt::chain(opening, steps))
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(heat: Vec<u64>, residence: Vec<u8>) -> Frame {
        Frame {
            steps: 3,
            tokens: 2,
            routed: vec![(0, vec![1]), (1, vec![])],
            heat,
            residence,
            stats: CacheStats::default(),
            rates: Rates::default(),
        }
    }

    #[test]
    fn a_step_event_names_only_the_cells_that_changed() {
        let mut sent = (vec![0, 5, 0, 0], vec![0, 1, 0, 0]);
        let event = step_event(&mut sent, &frame(vec![0, 6, 0, 2], vec![0, 1, 3, 0]), 2);
        assert_eq!(event["heat"], json!([[0, 1, 6], [1, 1, 2]]));
        assert_eq!(event["residence"], json!([[1, 0, 3]]));
        assert_eq!(event["routed"], json!([[0, [1]], [1, []]]));
        assert_eq!(event["step"], 3);
        assert_eq!(sent, (vec![0, 6, 0, 2], vec![0, 1, 3, 0]));
        let again = step_event(&mut sent, &frame(vec![0, 6, 0, 2], vec![0, 1, 3, 0]), 2);
        assert_eq!(again["heat"], json!([]));
        assert_eq!(again["residence"], json!([]));
    }

    #[test]
    fn the_shape_event_holds_every_row() {
        let shape = Shape {
            layers: 2,
            experts: 2,
            moe_layers: vec![0],
        };
        let event = shape_event(
            "m",
            "olmoe",
            &shape,
            &frame(vec![4, 0, 0, 0], vec![2, 0, 0, 0]),
        );
        assert_eq!(event["heat"], json!([[4, 0], [0, 0]]));
        assert_eq!(event["residence"], json!([[2, 0], [0, 0]]));
        assert_eq!(
            event["residence_kinds"],
            json!(["none", "slot", "pin", "vram"])
        );
        assert_eq!(event["moe_layers"], json!([0]));
    }
}
