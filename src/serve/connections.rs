//! The server's connections: accepted up to `--max-connections` (beyond them a 503 and the
//! connection closed), each served by hyper's HTTP/1 with `--header-timeout` on every request
//! head (a kept-alive connection waiting for its next request included), and the drain that
//! SIGINT or SIGTERM starts: no new connections, idle ones closed at once, a connection that
//! has no request in progress (a head still arriving) closed after [`DRAIN_GRACE`], the
//! others served to the end of their response. Reading a body, and its own timeout, is the
//! handlers' ([`super::read_body`]).

use std::convert::Infallible;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes, HttpBody};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};

/// How long a connection without a request in progress may stay once the drain began: time
/// for a response just finished to be flushed.
const DRAIN_GRACE: Duration = Duration::from_secs(1);

/// `--header-timeout`, `--body-timeout`, `--max-connections`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// The most time a request's head (request line and headers) may take to arrive, from
    /// the moment the connection waits for it.
    pub header_timeout: Duration,
    /// The most time a request body may go without a byte arriving.
    pub body_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

/// Serve `router` on `listener` until `stop` completes, then drain: `stopping` is set (the
/// handlers reading a body see it), and this returns when every connection is closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
    stopping: watch::Sender<bool>,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    // Each connection holds a receiver; the drain waits until none is left.
    let (open, all_closed) = watch::channel(());
    let mut stop = pin!(stop);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(err) => {
                    // Out of file descriptors, or a connection reset before it was taken:
                    // the listener itself is fine; try again shortly.
                    tracing::debug!("accepting a connection failed: {err}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream, limits.max_connections));
            continue;
        };
        let router = router.clone();
        let stopping = stopping.subscribe();
        let all_closed = all_closed.clone();
        tokio::spawn(async move {
            connection(stream, router, limits, stopping).await;
            drop(permit);
            drop(all_closed);
        });
    }
    drop(listener);
    drop(all_closed);
    let _ = stopping.send(true);
    open.closed().await;
}

/// One connection, to its end or, in the drain, until it has no request in progress.
async fn connection(
    stream: TcpStream,
    router: Router,
    limits: Limits,
    mut stopping: watch::Receiver<bool>,
) {
    let _ = stream.set_nodelay(true);
    let busy = Arc::new(AtomicUsize::new(0));
    let inner = TowerToHyperService::new(router);
    let counted = busy.clone();
    let service = hyper::service::service_fn(move |request| {
        let busy = Busy::enter(&counted);
        let answer = hyper::service::Service::call(&inner, request);
        async move {
            let response: axum::response::Response = answer.await?;
            Ok::<_, Infallible>(response.map(|body| Tracked { body, _busy: busy }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let mut conn = pin!(builder.serve_connection(TokioIo::new(stream), service));
    let mut draining = *stopping.borrow();
    if draining {
        conn.as_mut().graceful_shutdown();
    }
    loop {
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(err) = served {
                    tracing::debug!("connection ended: {err}");
                }
                return;
            }
            _ = stopping.changed(), if !draining => {
                // Hyper closes an idle connection here, and any other after its response.
                conn.as_mut().graceful_shutdown();
                draining = true;
            }
            () = tokio::time::sleep(DRAIN_GRACE), if draining => {
                // A head still arriving (or none at all) holds no one's answer.
                if busy.load(Ordering::SeqCst) == 0 {
                    return;
                }
            }
        }
    }
}

/// A connection beyond `--max-connections`: a 503 with `Retry-After`, then closed. What the
/// client sent is read (and dropped) for a moment first, so that closing does not reset the
/// connection before the client has read the answer.
async fn refuse(stream: TcpStream, max: usize) {
    let body = serde_json::json!({"error": {
        "message": format!("this server has {max} connections open (--max-connections); retry after a second"),
        "type": "server_error",
        "param": null,
        "code": "too_many_connections",
    }})
    .to_string();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let mut left = response.as_bytes();
        while !left.is_empty() {
            stream.writable().await?;
            match stream.try_write(left) {
                Ok(written) => left = &left[written..],
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(err) => return Err(err),
            }
        }
        let mut sink = [0u8; 4096];
        loop {
            stream.readable().await?;
            match stream.try_read(&mut sink) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(err) if err.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(err) => return Err(err),
            }
        }
    })
    .await;
}

/// A request in progress on a connection, from its head to the end of its response body.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn enter(count: &Arc<AtomicUsize>) -> Busy {
        count.fetch_add(1, Ordering::SeqCst);
        Busy(count.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its request counted as in progress until it is dropped.
struct Tracked {
    body: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
