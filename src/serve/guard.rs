//! Who may call the server from where: the `Host` a request names (the bound address, the
//! loopback names when it listens on loopback, `--allowed-host`), the `Origin` a web page's
//! request carries (`--cors-origin`, or the server's own), and the CORS answers for those
//! origins. A page of another site can neither drive the server (a refused `Origin`), nor
//! read it through a name it rebinds to this address (a refused `Host`).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::Response;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

use super::api::ApiError;
use crate::text::excerpt;

/// The names and origins requests are checked against.
#[derive(Debug)]
pub struct Guard {
    /// The address the server listens on.
    bound: IpAddr,
    /// `--allowed-host`, lower-cased; `*` lets any name through.
    hosts: Vec<String>,
    /// `--cors-origin`, without a trailing `/`; `*` for any.
    origins: Vec<String>,
}

impl Guard {
    /// The guard for a server on `bound`; `origins` are `--cors-origin`'s, checked (an
    /// origin that is not `http(s)://host[:port]` is an error naming it).
    pub fn new(bound: IpAddr, hosts: &[String], origins: &[String]) -> Result<Guard> {
        for host in hosts {
            if host.is_empty() || host.contains(|c: char| c == '/' || c.is_whitespace()) {
                bail!("--allowed-host {host:?}: expected a host name such as my-box.lan (no scheme, port or path), or * for any");
            }
        }
        let origins = origins
            .iter()
            .map(|origin| {
                if origin != "*" && !is_origin(origin) {
                    bail!("--cors-origin {origin:?}: expected an origin such as https://chat.example (scheme, host and port, no path), or * for any");
                }
                Ok(origin.trim_end_matches('/').to_string())
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Guard {
            bound,
            hosts: hosts
                .iter()
                .map(|h| h.trim_end_matches('.').to_ascii_lowercase())
                .collect(),
            origins,
        })
    }

    /// The CORS layer for `--cors-origin`, if any was given.
    pub fn cors(&self) -> Result<Option<CorsLayer>> {
        if self.origins.is_empty() {
            return Ok(None);
        }
        let allow = if self.origins.iter().any(|o| o == "*") {
            AllowOrigin::any()
        } else {
            AllowOrigin::list(
                self.origins
                    .iter()
                    .map(|origin| {
                        HeaderValue::from_str(origin)
                            .with_context(|| format!("--cors-origin {origin:?}"))
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
        };
        Ok(Some(
            CorsLayer::new()
                .allow_origin(allow)
                .allow_methods([Method::GET, Method::POST])
                // Mirrored, not `*`: browsers do not let `*` cover `Authorization`.
                .allow_headers(AllowHeaders::mirror_request())
                .expose_headers([header::RETRY_AFTER]),
        ))
    }

    /// Whether a request naming `host` (its `Host`, port and all) is for this server.
    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        if self.hosts.iter().any(|h| h == "*" || h == name) {
            return true;
        }
        let loopback_bind = self.bound.is_loopback() || self.bound.is_unspecified();
        if name == "localhost" {
            return loopback_bind;
        }
        // An IPv6 address in brackets, as `Host` writes it; an IPv4 address bare.
        let ip = match name.strip_prefix('[') {
            Some(rest) => rest
                .strip_suffix(']')
                .and_then(|inner| inner.parse::<Ipv6Addr>().ok())
                .map(IpAddr::V6),
            None => name.parse::<Ipv4Addr>().ok().map(IpAddr::V4),
        };
        // An address is never a name a page's site could rebind; it must be this one's.
        ip.is_some_and(|ip| {
            ip == self.bound
                || self.bound.is_unspecified()
                || (ip.is_loopback() && self.bound.is_loopback())
        })
    }

    /// Whether a request from a page of `origin`, naming `host`, may be answered.
    fn origin_allowed(&self, origin: &str, host: &str) -> bool {
        let origin = origin.trim_end_matches('/');
        if self
            .origins
            .iter()
            .any(|o| o == "*" || o.eq_ignore_ascii_case(origin))
        {
            return true;
        }
        // The server's own pages: the origin names the host the request was sent to.
        origin
            .strip_prefix("http://")
            .is_some_and(|rest| rest.eq_ignore_ascii_case(host))
    }

    /// Why a request with these headers is refused, if it is.
    fn check(&self, request: &Request) -> Result<(), ApiError> {
        // An absolute request target names the host itself, and wins over `Host`.
        let host = match request.uri().authority() {
            Some(authority) => Some(authority.as_str().to_string()),
            None => request
                .headers()
                .get(header::HOST)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
        };
        let Some(host) = host else {
            return Err(ApiError::invalid(
                "Host: missing; a request names the host it is for (HTTP/1.1 requires it)",
            ));
        };
        if !self.host_allowed(&host) {
            return Err(refused(format!(
                "Host {}: not a name of this server, which answers {} (start it with --allowed-host NAME to answer another name)",
                excerpt(&host),
                self.names()
            )));
        }
        if let Some(origin) = request.headers().get(header::ORIGIN) {
            let origin = String::from_utf8_lossy(origin.as_bytes());
            if !self.origin_allowed(&origin, &host) {
                return Err(refused(format!(
                    "Origin {}: pages of this origin may not call this server (start it with --cors-origin ORIGIN to let them)",
                    excerpt(&origin)
                )));
            }
        }
        Ok(())
    }

    /// The names a request may give, for messages.
    fn names(&self) -> String {
        let mut names = Vec::new();
        if self.bound.is_unspecified() {
            names.push("any of its addresses".to_string());
        } else {
            names.push(match self.bound {
                IpAddr::V6(ip) => format!("[{ip}]"),
                IpAddr::V4(ip) => ip.to_string(),
            });
        }
        if self.bound.is_loopback() || self.bound.is_unspecified() {
            names.push("localhost".to_string());
        }
        names.extend(self.hosts.iter().cloned());
        names.join(", ")
    }
}

/// `scheme://host[:port]`, nothing more: what a browser sends as `Origin`.
fn is_origin(origin: &str) -> bool {
    let rest = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"));
    rest.is_some_and(|rest| {
        let host = rest.trim_end_matches('/');
        !host.is_empty() && !host.contains(|c: char| c == '/' || c.is_whitespace())
    })
}

/// `host` without its port: `[::1]:8080` -> `[::1]`, `localhost:8080` -> `localhost`.
fn host_name(host: &str) -> &str {
    if host.starts_with('[') {
        return host.find(']').map_or(host, |end| &host[..=end]);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

fn refused(message: String) -> ApiError {
    ApiError {
        status: 403,
        kind: "invalid_request_error",
        code: None,
        message,
    }
}

/// The middleware: a request whose `Host` or `Origin` is refused gets a 403 naming it (in
/// Anthropic's shape on `/v1/messages`), and a line in the request log.
pub async fn check(State(guard): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    match guard.check(&request) {
        Ok(()) => next.run(request).await,
        Err(err) => {
            tracing::info!(
                "{} {} {} | {}",
                request.method(),
                request.uri().path(),
                err.status,
                err.message
            );
            if request.uri().path().starts_with("/v1/messages") {
                super::anthropic_error_response(&err)
            } else {
                super::error_response(&err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(bound: &str, hosts: &[&str]) -> Guard {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        Guard::new(bound.parse().unwrap(), &hosts, &[]).unwrap()
    }

    #[test]
    fn hosts_are_the_bound_address_loopback_names_and_those_allowed() {
        let local = guard("127.0.0.1", &["My-Box.lan"]);
        for host in [
            "127.0.0.1:8080",
            "localhost:8080",
            "localhost",
            "LOCALHOST.",
            "[::1]:8080",
            "127.0.0.2",
            "my-box.lan:9000",
        ] {
            assert!(local.host_allowed(host), "{host}");
        }
        for host in ["evil.example:8080", "evil.example", "10.0.0.1:8080", "[::1"] {
            assert!(!local.host_allowed(host), "{host}");
        }
        let lan = guard("192.168.1.5", &[]);
        assert!(lan.host_allowed("192.168.1.5:8080"));
        assert!(!lan.host_allowed("localhost:8080"));
        assert!(!lan.host_allowed("192.168.1.6:8080"));
        let any = guard("0.0.0.0", &[]);
        assert!(any.host_allowed("10.1.2.3:8080") && any.host_allowed("localhost"));
        assert!(!any.host_allowed("box.lan"));
        assert!(guard("127.0.0.1", &["*"]).host_allowed("anything.example"));
    }

    #[test]
    fn origins_are_those_given_or_the_server_s_own() {
        let origins = ["https://chat.example/".to_string()];
        let guard = Guard::new("127.0.0.1".parse().unwrap(), &[], &origins).unwrap();
        assert!(guard.origin_allowed("https://chat.example", "127.0.0.1:8080"));
        assert!(guard.origin_allowed("http://127.0.0.1:8080", "127.0.0.1:8080"));
        assert!(!guard.origin_allowed("http://127.0.0.1:9999", "127.0.0.1:8080"));
        assert!(!guard.origin_allowed("https://evil.example", "127.0.0.1:8080"));
        assert!(!guard.origin_allowed("null", "127.0.0.1:8080"));
        let bad = ["https://chat.example/path".to_string()];
        assert!(Guard::new("127.0.0.1".parse().unwrap(), &[], &bad).is_err());
    }
}
