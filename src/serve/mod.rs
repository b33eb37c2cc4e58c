//! `coli serve`: an OpenAI-compatible HTTP server (axum on tokio) in front of one engine;
//! and `coli chat` ([`chat`]), the same engine thread behind a terminal.
//! This module owns the HTTP side: binding, authentication, reading bodies (their type,
//! size limit and idle timeout), the routes, the bounded queue (429 when full), and
//! server-sent events; connections and their limits are [`connections`]', the checks of
//! `Host` and `Origin` and the CORS answers [`guard`]'s. The engine runs on a thread of
//! its own ([`worker`]), whose [`scheduler`] batches up to `--parallel` generations a step;
//! the handlers only queue jobs and relay their events; nothing here touches the engine or
//! the telemetry.

mod anthropic;
mod api;
pub mod chat;
mod connections;
mod guard;
pub mod kv_dir;
mod metrics;
mod page;
mod pool;
mod responses;
mod routing;
mod scheduler;
mod worker;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::settings::Settings;
use crate::startup::Positionals;
use crate::text::tool_calls::ParsedCall;
use crate::text::{excerpt, ToolCall};
use api::{ApiError, Endpoint, Identity, Request, Usage};
pub use connections::Limits;
use metrics::Metrics;
use worker::{Event, Job, ModelInfo};
pub use worker::{Front, Serving, DEFAULT_PREFILL_CHUNK};

/// The largest request body accepted.
const BODY_LIMIT: usize = 4 << 20;

/// The characters of an error message the request log keeps.
const LOGGED_ERROR_CHARS: usize = 400;

struct App {
    jobs: mpsc::Sender<Job>,
    model: ModelInfo,
    api_key: Option<String>,
    metrics: Arc<Metrics>,
    next_id: AtomicU64,
    settings: Settings,
    /// `TEMP`, for requests that give no temperature (checked at start).
    temperature: f64,
    /// Requests that may wait for a free sequence before new ones get 429.
    queue: usize,
    /// Starts every response id, so that ids stay unique across restarts.
    id_prefix: String,
    /// `--body-timeout`: the most time a request body may go without a byte arriving.
    body_timeout: Duration,
    /// Set when the drain begins: a body still arriving then is not waited for.
    stopping: watch::Receiver<bool>,
    /// `/tokenize` and `count_tokens` encode one request at a time.
    encoding: tokio::sync::Semaphore,
}

/// Where and how the server listens: `--host`, `--port`, `--queue`, `--cors-origin`,
/// `--allowed-host`, the connections' limits.
#[derive(Debug, Clone)]
pub struct Listen {
    pub host: String,
    pub port: u16,
    pub queue: usize,
    /// Origins whose pages may call the server; `*` for any; none: no CORS headers.
    pub cors_origins: Vec<String>,
    /// Names a request's `Host` may give besides the bound address (and, on loopback,
    /// `localhost`); `*` for any.
    pub allowed_hosts: Vec<String>,
    pub limits: Limits,
    /// The request log's level: `-q` WARN, `-v` DEBUG, else INFO.
    pub log: tracing::Level,
}

/// Serve the model the settings name on `host:port` until SIGINT or SIGTERM; then the
/// queued and running generations finish, and the run ends as a run does (history saved,
/// `STATS`, trace).
pub fn run(
    model: Option<&str>,
    settings: Settings,
    positionals: Positionals,
    listen: Listen,
    serving: Serving,
) -> Result<ExitCode> {
    let Listen {
        host,
        port,
        queue,
        cors_origins,
        allowed_hosts,
        limits,
        log,
    } = listen;
    // The request log, on stderr with the server's other lines.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(log)
        .with_target(false)
        .with_ansi(false)
        .try_init();
    let host = host.as_str();
    if serving.parallel == 0 || serving.prefill_chunk == 0 || queue == 0 {
        bail!("--parallel, --prefill-chunk and --queue take a count of at least 1");
    }
    if limits.max_connections == 0 {
        bail!("--max-connections takes a count of at least 1");
    }
    let ip: IpAddr = match host {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        _ => host.parse().with_context(|| {
            format!("--host {host:?}: expected an IP address such as 127.0.0.1 or 0.0.0.0")
        })?,
    };
    let guard = Arc::new(guard::Guard::new(ip, &allowed_hosts, &cors_origins)?);
    let cors = guard.cors()?;
    let api_key = settings.api_key.clone();
    if !ip.is_loopback() && api_key.is_none() {
        bail!("--host {host}: listening beyond this machine needs API_KEY=<token> (clients then send `Authorization: Bearer <token>`); or keep the default --host 127.0.0.1");
    }
    // What requests without `temperature` take, checked before anything loads.
    let temperature = settings
        .temperature()
        .context("requests that give no temperature take TEMP")?;
    let top_p = settings.top_p;
    if !(top_p > 0.0 && top_p <= 1.0) {
        bail!("TOP_P={top_p}: requests that give no top_p take it, so it must be in (0, 1]");
    }
    let address = SocketAddr::new(ip, port);
    // Bound before loading, so a port in use is said before minutes of loading.
    let listener = std::net::TcpListener::bind(address).with_context(|| {
        format!("cannot listen on {address} (is another server there? choose --port)")
    })?;
    listener.set_nonblocking(true)?;
    let address = listener.local_addr()?;

    let metrics = Arc::new(Metrics::default());
    let (jobs, waiting) = mpsc::channel(queue);
    let parallel = serving.parallel;
    let (engine_thread, info) = worker::spawn(
        model.map(str::to_string),
        settings.clone(),
        positionals,
        serving,
        waiting,
        metrics.clone(),
    )?;
    let info_id = info.id.clone();
    let (stopping, stopping_seen) = watch::channel(false);
    let app = Arc::new(App {
        jobs,
        model: info,
        api_key,
        metrics,
        next_id: AtomicU64::new(1),
        settings,
        temperature,
        queue,
        id_prefix: id_prefix(),
        body_timeout: limits.body_timeout,
        stopping: stopping_seen,
        encoding: tokio::sync::Semaphore::new(1),
    });
    let router = Router::new()
        .route("/", get(page::index))
        .route("/page/app.js", get(page::script))
        .route("/page/style.css", get(page::style))
        .route("/routing", get(routing_events))
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model_by_id))
        .route("/metrics", get(metrics_text))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/responses", post(responses))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::disable())
        .with_state(app);
    let router = match cors {
        Some(layer) => router.layer(layer),
        None => router,
    };
    // Outermost: a refused Host or Origin reaches neither CORS nor a handler.
    let router = router.layer(axum::middleware::from_fn_with_state(guard, guard::check));
    let id = info_id.clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the server's runtime")?;
    let served = runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        // The line clients and scripts wait for.
        eprintln!(
            "[serve] {id} on http://{address}/v1 (up to {parallel} generations at once; SIGINT/SIGTERM drain and save)"
        );
        connections::serve(listener, router, limits, shutdown(), stopping).await;
        Ok::<_, std::io::Error>(())
    });
    // Dropping the runtime drops the router and with it the queue's last sender.
    drop(runtime);
    served.context("the server stopped")?;
    // Every sender is gone now: the engine thread finishes its queue and the run's end.
    engine_thread
        .join()
        .map_err(|_| anyhow::anyhow!("the engine thread panicked"))
}

async fn shutdown() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(signal) => signal,
                Err(_) => return interrupt.await.unwrap_or(()),
            };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
    eprintln!("[serve] stopping: finishing queued generations, then saving (a second Ctrl-C or SIGTERM quits at once)");
    // The drain can be long; a second signal ends it. Every finished turn is saved.
    tokio::spawn(async {
        let _ = tokio::signal::ctrl_c().await;
        eprintln!("[serve] quitting now; the turns that finished are in the history");
        std::process::exit(130);
    });
    #[cfg(unix)]
    if let Ok(mut terminate) =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        tokio::spawn(async move {
            terminate.recv().await;
            eprintln!("[serve] quitting now; the turns that finished are in the history");
            std::process::exit(143);
        });
    }
}

/// A prefix for response ids that no earlier run of this server gave: the start time.
fn id_prefix() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}{:x}", nanos as u64, std::process::id())
}

/// `WWW-Authenticate` on a 401, `Retry-After` on a 429.
fn with_error_headers(mut response: Response) -> Response {
    match response.status() {
        StatusCode::UNAUTHORIZED => {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
        }
        StatusCode::TOO_MANY_REQUESTS => {
            // Clients (the OpenAI and Anthropic SDKs among them) wait this long and retry.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        _ => {}
    }
    response
}

fn error_response(err: &ApiError) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::BAD_REQUEST);
    with_error_headers((status, Json(err.body())).into_response())
}

/// `Err` when the request lacks the bearer token `API_KEY` asks for.
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else {
        return Ok(());
    };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    // Anthropic's clients send `x-api-key`.
    let x_api_key = headers.get("x-api-key").map(|v| v.as_bytes());
    let matches = |given: Option<&[u8]>| given.is_some_and(|given| same_key(given, key.as_bytes()));
    if matches(bearer) | matches(x_api_key) {
        Ok(())
    } else {
        Err(ApiError {
            status: 401,
            kind: "invalid_request_error",
            code: Some("invalid_api_key"),
            message:
                "this server needs `Authorization: Bearer <API_KEY>` (or `x-api-key: <API_KEY>`)"
                    .to_string(),
        })
    }
}

/// Whether `given` is `key`, in a time that depends on their lengths alone (not on where
/// they first differ, which a client timing its attempts could otherwise learn byte by byte).
fn same_key(given: &[u8], key: &[u8]) -> bool {
    let mut differ = u8::from(given.len() != key.len());
    for (i, &k) in key.iter().enumerate() {
        differ |= k ^ given.get(i).copied().unwrap_or(!k);
    }
    differ == 0
}

async fn not_found() -> Response {
    error_response(&ApiError {
        status: 404,
        kind: "invalid_request_error",
        code: None,
        message: "no such endpoint: coli serves /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages, /v1/messages/count_tokens, /tokenize, /detokenize, /v1/models, /routing, /health, /metrics and its page at /".to_string(),
    })
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let (running, waiting) = app.metrics.load();
    Json(json!({
        "status": "ok",
        "model": app.model.id,
        "engine": app.model.engine,
        "generations": { "running": running, "waiting": waiting },
        "queue": app.queue,
    }))
    .into_response()
}

async fn method_not_allowed() -> Response {
    error_response(&ApiError {
        status: 405,
        kind: "invalid_request_error",
        code: None,
        message: "method not allowed: completions are POST; /v1/models, /routing, /health, /metrics and the page at / GET"
            .to_string(),
    })
}

fn model_card(app: &App) -> Value {
    json!({
        "id": app.model.id,
        "object": "model",
        "created": 0,
        "owned_by": "coli",
    })
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(err) = authorize(&app, &headers) {
        return error_response(&err);
    }
    Json(json!({ "object": "list", "data": [model_card(&app)] })).into_response()
}

async fn model_by_id(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(err) = authorize(&app, &headers) {
        return error_response(&err);
    }
    if id != app.model.id {
        return error_response(&unknown_model(&app, &id));
    }
    Json(model_card(&app)).into_response()
}

fn unknown_model(app: &App, name: &str) -> ApiError {
    ApiError {
        status: 404,
        kind: "invalid_request_error",
        code: Some("model_not_found"),
        message: format!(
            "model {}: this server runs {:?} (GET /v1/models)",
            excerpt(name),
            app.model.id
        ),
    }
}

/// `GET /routing`: the experts at work, as server-sent events ([`routing`]).
async fn routing_events(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(err) = authorize(&app, &headers) {
        return error_response(&err);
    }
    routing::events(
        &app.model.routing,
        &app.model.id,
        app.model.engine,
        app.stopping.clone(),
    )
}

async fn metrics_text(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(err) = authorize(&app, &headers) {
        return error_response(&err);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
        .into_response()
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    complete(app, headers, body, Endpoint::Chat).await
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    complete(app, headers, body, Endpoint::Completion).await
}

async fn complete(app: Arc<App>, headers: HeaderMap, body: Body, endpoint: Endpoint) -> Response {
    let label = match endpoint {
        Endpoint::Chat => "chat",
        Endpoint::Completion => "completions",
    };
    let path = endpoint.path();
    let started = Instant::now();
    tracing::debug!("POST {path} received");
    let answer = answer(&app, &headers, body, endpoint, started).await;
    finish(&app, (path, label), started, answer, error_response)
}

/// A generating endpoint's answer (`path`, its metrics `label`) logged, an error in the
/// endpoint's shape (`error`), and counted. A stream logs its line when it ends.
fn finish(
    app: &App,
    (path, label): (&str, &'static str),
    started: Instant,
    answer: Result<Response, ApiError>,
    error: fn(&ApiError) -> Response,
) -> Response {
    let response = match answer {
        Ok(response) => {
            if let Some(figures) = response.extensions().get::<Figures>() {
                log_request(path, 200, started, Some(figures), None);
            }
            response
        }
        Err(err) => {
            log_request(path, err.status, started, None, Some(&err.message));
            error(&err)
        }
    };
    app.metrics.request(label, response.status().as_u16());
    response
}

/// What a request's log line says of its generation.
#[derive(Debug, Clone, Copy, Default)]
struct Figures {
    usage: Usage,
    /// Seconds to the first token of the first choice to have one.
    first_token: Option<f64>,
    /// Tokens a second after the first, of the last choice to finish.
    decode_rate: Option<f64>,
}

impl Figures {
    fn of(usage: Usage, first_token: Option<f64>, decode_rate: Option<f64>) -> Figures {
        let mut figures = Figures::default();
        figures.add(usage, first_token, decode_rate);
        figures
    }

    fn add(&mut self, usage: Usage, first_token: Option<f64>, decode_rate: Option<f64>) {
        self.usage = self.usage.and(usage);
        self.first_token = match (self.first_token, first_token) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.decode_rate = decode_rate.or(self.decode_rate);
    }
}

/// One line per request (at info; a server error at warn): method, path, status, time,
/// and for a generation its tokens, time to first token and rate; `-q` leaves only the
/// server errors, `-v` adds each request's arrival.
fn log_request(
    path: &str,
    status: u16,
    started: Instant,
    figures: Option<&Figures>,
    error: Option<&str>,
) {
    let mut line = format!(
        "POST {path} {status} in {:.3} s",
        started.elapsed().as_secs_f64()
    );
    if let Some(f) = figures {
        line += &format!(
            " | prompt {} ({} cached) | completion {}",
            f.usage.prompt, f.usage.cached, f.usage.completion
        );
        if let Some(t) = f.first_token {
            line += &format!(" | first token {t:.3} s");
        }
        if let Some(rate) = f.decode_rate {
            line += &format!(" | {rate:.1} tok/s");
        }
    }
    if let Some(error) = error {
        // The messages name what they refuse and quote little of it; this bounds any that
        // would quote more, so that no request's text reaches the log at length.
        line += " | ";
        match error.char_indices().nth(LOGGED_ERROR_CHARS) {
            Some((cut, _)) => {
                line += &error[..cut];
                line += &format!("… ({} bytes)", error.len());
            }
            None => line += error,
        }
    }
    if status >= 500 {
        tracing::warn!("{line}");
    } else {
        tracing::info!("{line}");
    }
}

/// The ids the engine would compute for `input`, or why it cannot be encoded: off the
/// runtime's threads (a long text takes seconds), one request at a time (and hundreds of MB).
async fn encode(app: &App, input: api::Tokenize) -> Result<Vec<u32>, ApiError> {
    let failed = || ApiError::server(500, "encoding stopped before it finished");
    let _turn = app.encoding.acquire().await.map_err(|_| failed())?;
    let texts = app.model.texts.clone();
    tokio::task::spawn_blocking(move || encode_now(&texts, &input))
        .await
        .map_err(|_| failed())?
}

fn encode_now(texts: &worker::Texts, input: &api::Tokenize) -> Result<Vec<u32>, ApiError> {
    let model = texts.model();
    let ids = match input {
        api::Tokenize::Text {
            text,
            special: true,
        } => model.prompt(text, false).map(|p| p.ids),
        api::Tokenize::Text {
            text,
            special: false,
        } => model.tokenizer.encode(text, false),
        api::Tokenize::Chat(messages) => model.chat_prompt(messages).map(|p| p.ids),
    };
    ids.map_err(|err| ApiError::invalid(format!("{err:#}")))
}

fn check_model(app: &App, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(name) if name != app.model.id && name != app.model.engine => {
            Err(unknown_model(app, name))
        }
        _ => Ok(()),
    }
}

/// `/tokenize`: `{"tokens", "count", "max_model_len"}`.
async fn tokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        authorize(&app, &headers)?;
        let bytes = read_body(&app, &headers, body).await?;
        let (input, model) = api::tokenize_request(&bytes)?;
        check_model(&app, model.as_deref())?;
        let tokens = encode(&app, input).await?;
        Ok::<_, ApiError>(Json(json!({
            "tokens": tokens,
            "count": tokens.len(),
            "max_model_len": app.model.context,
        })))
    };
    let answer = answer.await.map(IntoResponse::into_response);
    respond(&app, "tokenize", answer, error_response)
}

/// A handler's answer, or its error in the shape `refusal` makes; counted under `label`.
fn respond(
    app: &App,
    label: &'static str,
    answer: Result<Response, ApiError>,
    refusal: fn(&ApiError) -> Response,
) -> Response {
    let response = answer.unwrap_or_else(|err| refusal(&err));
    app.metrics.request(label, response.status().as_u16());
    response
}

/// An error in Anthropic's shape, with the headers its status asks for.
fn anthropic_error_response(err: &ApiError) -> Response {
    let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::BAD_REQUEST);
    with_error_headers((status, Json(anthropic::error_body(err))).into_response())
}

/// `/detokenize`: `{"content"}`, the text of the ids, special tokens written out.
async fn detokenize(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        authorize(&app, &headers)?;
        let bytes = read_body(&app, &headers, body).await?;
        let tokens = api::detokenize_request(&bytes)?;
        let vocab = app.model.texts.vocab;
        if let Some(bad) = tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(ApiError::invalid(format!(
                "tokens: id {bad} is outside the model's vocabulary (vocab_size {vocab})"
            )));
        }
        let content = app
            .model
            .texts
            .tokenizer
            .decode_all(&tokens)
            .map_err(|err| ApiError::invalid(format!("{err:#}")))?;
        Ok(Json(json!({ "content": content })))
    };
    let answer = answer.await.map(IntoResponse::into_response);
    respond(&app, "detokenize", answer, error_response)
}

/// `/v1/messages/count_tokens`: `{"input_tokens"}`, the prompt `/v1/messages` would
/// compute for the same body.
async fn count_tokens(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        authorize(&app, &headers)?;
        let bytes = read_body(&app, &headers, body).await?;
        let request = anthropic::count_request(&bytes)?;
        check_model(&app, request.model.as_deref())?;
        let api::Input::Chat(messages) = request.input else {
            unreachable!("a Messages body is a chat")
        };
        let tokens = encode(&app, api::Tokenize::Chat(messages)).await?;
        Ok::<_, ApiError>(Json(json!({ "input_tokens": tokens.len() })))
    };
    let answer = answer.await.map(IntoResponse::into_response);
    respond(&app, "count_tokens", answer, anthropic_error_response)
}

async fn messages(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    tracing::debug!("POST /v1/messages received");
    let answer = answer_messages(&app, &headers, body, started).await;
    let path = ("/v1/messages", "messages");
    finish(&app, path, started, answer, anthropic_error_response)
}

/// `/v1/messages`: the whole message, or its stream of events.
async fn answer_messages(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
    started: Instant,
) -> Result<Response, ApiError> {
    authorize(app, headers)?;
    let received = Instant::now();
    let bytes = read_body(app, headers, body).await?;
    let request = anthropic::request(&bytes)?;
    let (mut events, prompt) = submit(app, &request, received).await?;
    let id = format!(
        "msg_{}-{}",
        app.id_prefix,
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let model = app.model.id.clone();
    let stops = request.stop.clone();
    if request.stream {
        return Ok(stream_messages((id, model), stops, events, prompt, started));
    }
    let mut text = String::new();
    let mut thinking = String::new();
    let mut calls = Vec::new();
    loop {
        match events.recv().await {
            Some(Event::Text { text: piece, .. }) => text.push_str(&piece),
            Some(Event::Reasoning { text: piece, .. }) => thinking.push_str(&piece),
            Some(Event::Call { call, .. }) => {
                let id = call_id("toolu", &id, 0, calls.len());
                calls.push(with_id(call, id));
            }
            Some(Event::Done {
                finish,
                usage,
                first_token,
                decode_rate,
                ..
            }) => {
                let content = anthropic::Content {
                    thinking: &thinking,
                    text: &text,
                    calls: &calls,
                };
                let body = anthropic::message(&id, &model, content, finish, &stops, usage);
                let mut response = Json(body).into_response();
                let figures = Figures::of(usage, first_token, decode_rate);
                response.extensions_mut().insert(figures);
                return Ok(response);
            }
            Some(Event::Failed(err)) => return Err(err),
            Some(Event::Started(_)) | None => return Err(engine_gone()),
        }
    }
}

/// The Messages stream: `message_start`, the text block's start, a delta per piece of
/// text, the block's stop, `message_delta` and `message_stop`; `ping` every few seconds
/// while nothing else is sent (a long prompt being filled). A failure after the start is
/// an `error` event.
fn stream_messages(
    (id, model): (String, String),
    stops: Vec<String>,
    events: mpsc::UnboundedReceiver<Event>,
    prompt: Usage,
    started: Instant,
) -> Response {
    let event = |(name, body): (&'static str, Value)| {
        Ok::<_, Infallible>(SseEvent::default().event(name).data(body.to_string()))
    };
    let start = anthropic::stream_start(&id, &model, prompt).map(event);
    let blocks = (events, anthropic::Blocks::default(), 0);
    let rest = futures_util::stream::unfold(Some(blocks), move |state| {
        let stops = stops.clone();
        let id = id.clone();
        async move {
            let (mut events, mut blocks, mut calls) = state?;
            let batch: Vec<_> = match events.recv().await {
                Some(Event::Text { text, .. }) => blocks.text(&text),
                Some(Event::Reasoning { text, .. }) => blocks.thinking(&text),
                Some(Event::Call { call, .. }) => {
                    let call = with_id(call, call_id("toolu", &id, 0, calls));
                    calls += 1;
                    blocks.call(&call)
                }
                Some(Event::Done {
                    finish,
                    usage,
                    first_token,
                    decode_rate,
                    ..
                }) => {
                    let figures = Figures::of(usage, first_token, decode_rate);
                    log_request("/v1/messages", 200, started, Some(&figures), None);
                    let end = blocks.end(finish, &stops, usage);
                    return Some((end.into_iter().map(event).collect::<Vec<_>>(), None));
                }
                failed => {
                    let err = match failed {
                        Some(Event::Failed(err)) => err,
                        _ => engine_gone(),
                    };
                    let message = Some(err.message.as_str());
                    log_request("/v1/messages", err.status, started, None, message);
                    return Some((vec![event(("error", anthropic::error_body(&err)))], None));
                }
            };
            Some((
                batch.into_iter().map(event).collect(),
                Some((events, blocks, calls)),
            ))
        }
    })
    .flat_map(futures_util::stream::iter);
    let ping = SseEvent::default()
        .event("ping")
        .data(r#"{"type": "ping"}"#);
    Sse::new(futures_util::stream::iter(start).chain(rest))
        .keep_alive(
            axum::response::sse::KeepAlive::new()
                .interval(std::time::Duration::from_secs(5))
                .event(ping),
        )
        .into_response()
}

async fn responses(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    tracing::debug!("POST /v1/responses received");
    let answer = answer_responses(&app, &headers, body, started).await;
    let path = ("/v1/responses", "responses");
    finish(&app, path, started, answer, error_response)
}

/// `/v1/responses`: the whole response object, or its stream of events.
async fn answer_responses(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
    started: Instant,
) -> Result<Response, ApiError> {
    authorize(app, headers)?;
    let received = Instant::now();
    let bytes = read_body(app, headers, body).await?;
    let (request, mut echo) = responses::request(&bytes)?;
    let (mut events, _) = submit(app, &request, received)
        .await
        .map_err(responses::in_own_words)?;
    // The response repeats the sampling it was generated with, the server's where the
    // request gives none.
    echo.temperature = Some(request.temperature.unwrap_or(app.temperature));
    echo.top_p = Some(request.top_p.unwrap_or(app.settings.top_p));
    let stem = format!(
        "{}-{}",
        app.id_prefix,
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut output = responses::Output::new(stem, created, app.model.id.clone(), echo);
    if request.stream {
        return Ok(stream_responses(output, events, started));
    }
    // The stream's builder, its events unsent: the whole response has the streamed output.
    loop {
        match events.recv().await {
            Some(Event::Text { text, .. }) => {
                output.text(&text);
            }
            Some(Event::Reasoning { text, .. }) => {
                output.reasoning(&text);
            }
            Some(Event::Call { call, .. }) => {
                let call = with_id(call, output.next_call_id());
                output.call(&call);
            }
            Some(Event::Done {
                finish,
                usage,
                first_token,
                decode_rate,
                ..
            }) => {
                output.end(finish, usage);
                let mut response = Json(output.response()).into_response();
                let figures = Figures::of(usage, first_token, decode_rate);
                response.extensions_mut().insert(figures);
                return Ok(response);
            }
            Some(Event::Failed(err)) => return Err(err),
            Some(Event::Started(_)) | None => return Err(engine_gone()),
        }
    }
}

/// The Responses stream: `response.created` and `response.in_progress`, then the output
/// items' events as text and calls come ([`responses::Output`]), then
/// `response.completed` (or `response.incomplete`); a failure after the start is an
/// `error` event. Dropping the stream (the client left) drops the receiver, and the
/// engine thread stops at its next token.
fn stream_responses(
    mut output: responses::Output,
    events: mpsc::UnboundedReceiver<Event>,
    started: Instant,
) -> Response {
    let event = |(name, body): responses::Sent| {
        Ok::<_, Infallible>(SseEvent::default().event(name).data(body.to_string()))
    };
    let start = output.start().into_iter().map(event);
    let rest = futures_util::stream::unfold(Some((events, output)), move |state| async move {
        let (mut events, mut output) = state?;
        let batch = match events.recv().await {
            Some(Event::Text { text, .. }) => output.text(&text),
            Some(Event::Reasoning { text, .. }) => output.reasoning(&text),
            Some(Event::Call { call, .. }) => {
                let call = with_id(call, output.next_call_id());
                output.call(&call)
            }
            Some(Event::Done {
                finish,
                usage,
                first_token,
                decode_rate,
                ..
            }) => {
                let figures = Figures::of(usage, first_token, decode_rate);
                log_request("/v1/responses", 200, started, Some(&figures), None);
                let end = output.end(finish, usage);
                return Some((end.into_iter().map(event).collect::<Vec<_>>(), None));
            }
            failed => {
                let err = match failed {
                    Some(Event::Failed(err)) => err,
                    _ => engine_gone(),
                };
                log_request(
                    "/v1/responses",
                    err.status,
                    started,
                    None,
                    Some(&err.message),
                );
                return Some((vec![event(output.error(&err))], None));
            }
        };
        Some((
            batch.into_iter().map(event).collect(),
            Some((events, output)),
        ))
    })
    .flat_map(futures_util::stream::iter);
    Sse::new(futures_util::stream::iter(start).chain(rest)).into_response()
}

/// A JSON request body: `Content-Type: application/json` (415 otherwise: a web page can send
/// other types to any server without asking, JSON only to those that allow its origin), at
/// most [`BODY_LIMIT`] bytes (413), no pause of `--body-timeout` (408) and none once the
/// drain began (503); a body that breaks off or whose chunks are malformed is a 400 saying so.
async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let refusal = |status: u16, message: String| ApiError {
        status,
        kind: "invalid_request_error",
        code: None,
        message,
    };
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let json = content_type.as_deref().is_some_and(|value| {
        let media = value.split(';').next().unwrap_or_default().trim();
        media.eq_ignore_ascii_case("application/json")
    });
    if !json {
        let found = content_type
            .as_deref()
            .map_or("missing".to_string(), excerpt);
        return Err(refusal(
            415,
            format!("Content-Type {found}: this endpoint takes a JSON body; send Content-Type: application/json"),
        ));
    }
    let too_large = || refusal(413, format!("the request body is over {BODY_LIMIT} bytes"));
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > BODY_LIMIT) {
        return Err(too_large());
    }
    let mut stream = body.into_data_stream();
    // Grown as bytes arrive, not from Content-Length: a declared size costs nothing until sent.
    let mut bytes = Vec::new();
    let mut stopping = app.stopping.clone();
    loop {
        let next = tokio::select! {
            // Bytes already here are taken before the drain is looked at: only a body that
            // is still arriving is refused for it.
            biased;
            next = tokio::time::timeout(app.body_timeout, stream.next()) => next,
            _ = stopping.wait_for(|stopping| *stopping) => {
                return Err(ApiError::server(
                    503,
                    "the server is stopping: it finishes the requests it has and takes no more",
                ));
            }
        };
        match next {
            Ok(None) => return Ok(Bytes::from(bytes)),
            Ok(Some(Ok(chunk))) => {
                if bytes.len() + chunk.len() > BODY_LIMIT {
                    return Err(too_large());
                }
                bytes.extend_from_slice(&chunk);
            }
            Ok(Some(Err(err))) => {
                return Err(refusal(
                    400,
                    format!(
                        "the request body could not be read after {} bytes ({}): send the whole body its Content-Length or chunked encoding declares",
                        bytes.len(),
                        causes(&err)
                    ),
                ))
            }
            Err(_) => {
                return Err(refusal(
                    408,
                    format!(
                        "the request body: nothing arrived for {} s (--body-timeout) after {} bytes",
                        app.body_timeout.as_secs_f64(),
                        bytes.len()
                    ),
                ))
            }
        }
    }
}

/// An error and its sources, `: `-separated.
fn causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let more = cause.to_string();
        if !text.contains(&more) {
            text += ": ";
            text += &more;
        }
        source = cause.source();
    }
    text
}

async fn answer(
    app: &Arc<App>,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
    started: Instant,
) -> Result<Response, ApiError> {
    authorize(app, headers)?;
    let received = Instant::now();
    let bytes = read_body(app, headers, body).await?;
    let request = match endpoint {
        Endpoint::Chat => api::chat_request(&bytes)?,
        Endpoint::Completion => api::completion_request(&bytes)?,
    };
    let (mut events, _) = submit(app, &request, received).await?;
    let sequence = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match endpoint {
        Endpoint::Chat => format!("chatcmpl-{}-{sequence}", app.id_prefix),
        Endpoint::Completion => format!("cmpl-{}-{sequence}", app.id_prefix),
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let reply = Reply {
        endpoint,
        id,
        created,
        model: app.model.id.clone(),
    };
    if request.stream {
        return Ok(stream(
            reply,
            events,
            request.choices,
            request.stream_usage,
            started,
        ));
    }
    let mut texts = vec![String::new(); request.choices];
    let mut reasoning = vec![String::new(); request.choices];
    let mut calls = vec![Vec::new(); request.choices];
    let mut logprobs = vec![Vec::new(); request.choices];
    let mut done: Vec<Option<api::Choice>> = (0..request.choices).map(|_| None).collect();
    let mut figures = Figures::default();
    while done.iter().any(Option::is_none) {
        match events.recv().await {
            Some(Event::Text {
                choice,
                text,
                logprobs: more,
            }) => {
                texts[choice].push_str(&text);
                logprobs[choice].extend(more);
            }
            Some(Event::Call { choice, call }) => {
                let id = call_id("call", &reply.id, choice, calls[choice].len());
                calls[choice].push(with_id(call, id));
            }
            Some(Event::Reasoning { choice, text }) => reasoning[choice].push_str(&text),
            Some(Event::Done {
                choice,
                finish,
                usage,
                routed,
                logprobs: more,
                first_token,
                decode_rate,
            }) => {
                figures.add(usage, first_token, decode_rate);
                logprobs[choice].extend(more);
                done[choice] = Some(api::Choice {
                    text: std::mem::take(&mut texts[choice]),
                    reasoning: std::mem::take(&mut reasoning[choice]),
                    calls: std::mem::take(&mut calls[choice]),
                    finish,
                    routed,
                    logprobs: request
                        .logprobs
                        .is_some()
                        .then(|| std::mem::take(&mut logprobs[choice])),
                });
            }
            Some(Event::Failed(err)) => return Err(err),
            Some(Event::Started(_)) | None => return Err(engine_gone()),
        }
    }
    let choices: Vec<api::Choice> = done.into_iter().flatten().collect();
    let body = api::response(endpoint, &reply.identity(), &choices, figures.usage);
    let mut response = Json(body).into_response();
    response.extensions_mut().insert(figures);
    Ok(response)
}

/// Queue `request` for the engine thread and wait until it starts: its events from then
/// on and its prompt's token counts, or why it was not started (an unknown model, a full
/// queue: 429, a request the engine refused).
async fn submit(
    app: &App,
    request: &Request,
    received: Instant,
) -> Result<(mpsc::UnboundedReceiver<Event>, Usage), ApiError> {
    if let Some(name) = &request.model {
        if name != &app.model.id && name != app.model.engine {
            return Err(unknown_model(app, name));
        }
    }
    let (job, mut events) = job(app, request, received)?;
    app.metrics.queue(1, 0);
    match app.jobs.try_send(job) {
        Ok(()) => {}
        Err(mpsc::error::TrySendError::Full(_)) => {
            app.metrics.queue(-1, 0);
            return Err(ApiError {
                status: 429,
                kind: "rate_limit_error",
                code: Some("queue_full"),
                message: format!(
                    "{} requests are already waiting for a free sequence (--queue); retry after a second",
                    app.queue
                ),
            });
        }
        Err(mpsc::error::TrySendError::Closed(_)) => {
            app.metrics.queue(-1, 0);
            return Err(engine_gone());
        }
    }
    match events.recv().await {
        Some(Event::Started(usage)) => Ok((events, usage)),
        Some(Event::Failed(err)) => Err(err),
        _ => Err(engine_gone()),
    }
}

/// The id of a request's call: `kind` (`call`, `toolu`), the request's id without its own
/// kind (`chatcmpl-`, `msg_`), the choice and the call's place among the choice's calls.
fn call_id(kind: &str, request: &str, choice: usize, number: usize) -> String {
    let request = ["chatcmpl-", "msg_"]
        .iter()
        .find_map(|kind| request.strip_prefix(kind))
        .unwrap_or(request);
    format!("{kind}_{request}-{choice}-{number}")
}

fn with_id(call: ParsedCall, id: String) -> ToolCall {
    ToolCall {
        id,
        name: call.name,
        arguments: call.arguments,
    }
}

fn engine_gone() -> ApiError {
    ApiError::server(500, "the engine stopped before answering")
}

/// The job for `request`, with the server's settings filling what the request leaves out.
fn job(
    app: &App,
    request: &Request,
    received: Instant,
) -> Result<(Job, mpsc::UnboundedReceiver<Event>), ApiError> {
    let temperature = request.temperature.unwrap_or(app.temperature);
    let (events, receiver) = mpsc::unbounded_channel();
    Ok((
        Job {
            input: request.input.clone(),
            max_tokens: request.max_tokens,
            temperature,
            top_p: request.top_p.unwrap_or(app.settings.top_p),
            seed: request.seed.unwrap_or_else(|| app.settings.seed_or_clock()),
            stop: request.stop.clone(),
            routed_experts: request.routed_experts,
            clamp_tokens: request.clamp_tokens,
            choices: request.choices,
            shaping: request.shaping.clone(),
            logprobs: request.logprobs,
            tools: request.tools.clone(),
            grammar: request.grammar.clone(),
            thinking_budget: request.thinking_budget,
            echo: request.echo,
            events,
            received,
        },
        receiver,
    ))
}

struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Reply {
    fn identity(&self) -> Identity<'_> {
        Identity {
            id: &self.id,
            created: self.created,
            model: &self.model,
        }
    }
}

/// Server-sent events: a chunk per piece of text of each choice, each choice's finishing
/// chunk, the usage chunk if asked, then `[DONE]`. Dropping the stream (the client left)
/// drops the receiver, and the engine thread stops at its next token.
fn stream(
    reply: Reply,
    events: mpsc::UnboundedReceiver<Event>,
    choices: usize,
    with_usage: bool,
    started: Instant,
) -> Response {
    struct State {
        reply: Reply,
        events: mpsc::UnboundedReceiver<Event>,
        /// Per choice: nothing sent yet.
        first: Vec<bool>,
        /// Per choice: the text sent so far, in bytes (completions' `text_offset`).
        sent: Vec<usize>,
        /// Per choice: the calls sent so far.
        calls: Vec<usize>,
        /// Choices not finished yet.
        open: usize,
        figures: Figures,
        pending: std::collections::VecDeque<String>,
        done: bool,
    }
    let state = State {
        reply,
        events,
        first: vec![true; choices],
        sent: vec![0; choices],
        calls: vec![0; choices],
        open: choices,
        figures: Figures::default(),
        pending: std::collections::VecDeque::new(),
        done: false,
    };
    let data = |value: Value| value.to_string();
    let chunks = futures_util::stream::unfold(state, move |mut state| async move {
        loop {
            if let Some(next) = state.pending.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(next)), state));
            }
            if state.done {
                return None;
            }
            let who = state.reply.identity();
            let endpoint = state.reply.endpoint;
            match state.events.recv().await {
                Some(Event::Text {
                    choice,
                    text,
                    logprobs,
                }) => {
                    let first = std::mem::replace(&mut state.first[choice], false);
                    let logprobs = (!logprobs.is_empty())
                        .then(|| api::logprobs_body(endpoint, &logprobs, state.sent[choice]));
                    state.sent[choice] += text.len();
                    let chunk =
                        api::chunk(endpoint, &who, choice, Some(&text), logprobs, first, None);
                    state.pending.push_back(data(chunk));
                }
                Some(Event::Reasoning { choice, text }) => {
                    let first = std::mem::replace(&mut state.first[choice], false);
                    let chunk = api::reasoning_chunk(&who, choice, &text, first);
                    state.pending.push_back(data(chunk));
                }
                Some(Event::Call { choice, call }) => {
                    let first = std::mem::replace(&mut state.first[choice], false);
                    let number = state.calls[choice];
                    state.calls[choice] += 1;
                    let call = with_id(call, call_id("call", who.id, choice, number));
                    let chunk = api::call_chunk(&who, choice, number, &call, first);
                    state.pending.push_back(data(chunk));
                }
                Some(Event::Done {
                    choice,
                    finish,
                    usage,
                    routed,
                    logprobs,
                    first_token,
                    decode_rate,
                }) => {
                    let first = std::mem::replace(&mut state.first[choice], false);
                    let logprobs = (!logprobs.is_empty())
                        .then(|| api::logprobs_body(endpoint, &logprobs, state.sent[choice]));
                    let last = api::chunk(
                        endpoint,
                        &who,
                        choice,
                        None,
                        logprobs,
                        first,
                        Some((finish, routed.as_ref())),
                    );
                    state.pending.push_back(data(last));
                    state.figures.add(usage, first_token, decode_rate);
                    state.open -= 1;
                    if state.open == 0 {
                        log_request(endpoint.path(), 200, started, Some(&state.figures), None);
                        if with_usage {
                            let usage = api::usage_chunk(endpoint, &who, state.figures.usage);
                            state.pending.push_back(data(usage));
                        }
                        state.pending.push_back("[DONE]".to_string());
                        state.done = true;
                    }
                }
                Some(Event::Failed(err)) => {
                    log_request(endpoint.path(), 500, started, None, Some(&err.message));
                    state.pending.push_back(data(err.body()));
                    state.done = true;
                }
                Some(Event::Started(_)) | None => {
                    state.pending.push_back(data(engine_gone().body()));
                    state.done = true;
                }
            }
        }
    });
    Sse::new(chunks).into_response()
}

#[cfg(test)]
mod tests {
    use super::same_key;

    #[test]
    fn keys_match_only_whole() {
        assert!(same_key(b"s3cret", b"s3cret"));
        for given in [&b"s3cres"[..], b"s3cre", b"s3crett", b"", b"S3cret"] {
            assert!(!same_key(given, b"s3cret"), "{given:?}");
        }
    }
}
