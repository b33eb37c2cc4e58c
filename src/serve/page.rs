//! `GET /`: the page, plain HTML, JavaScript and CSS compiled into the binary (no build
//! step, nothing fetched from elsewhere): a chat through `/v1/chat/completions` streamed,
//! beside a grid of the model's experts fed by `GET /routing`. The page and its two files
//! hold nothing of the model's, so they are served without the API key; everything they
//! ask for afterwards sends the key the user types (kept in the browser's `localStorage`).

use axum::http::header;
use axum::response::{IntoResponse, Response};

const INDEX: &str = include_str!("page/index.html");
const SCRIPT: &str = include_str!("page/app.js");
const STYLE: &str = include_str!("page/style.css");

/// The page's own files and this server are all it may load or call; no other site may
/// frame it.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

pub async fn index() -> Response {
    file("text/html; charset=utf-8", INDEX)
}

pub async fn script() -> Response {
    file("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    file("text/css; charset=utf-8", STYLE)
}
