//! Serving a router to clients that may be slow, idle or hostile: every HTTP server of the
//! product (the console, the order service, the ops endpoints) goes through [`serve`].
//!
//! `axum::serve` sets no timer, so a connection that sends half a header, or nothing, stays open
//! for as long as its client likes, and it takes every connection offered. Here hyper's HTTP/1
//! header-read timeout closes a connection that has not sent a whole request head within
//! [`ServerLimits::header_read_timeout`] (a connection idle between requests included), a request
//! (its body read included) that takes longer than [`ServerLimits::request_timeout`] is answered
//! 408 (tower-http's timeout layer), requests beyond [`ServerLimits::max_requests_in_flight`] are
//! answered 503 at once (tower's concurrency limit and load shedding), and connections beyond
//! [`ServerLimits::max_connections`] (or [`ServerLimits::max_connections_per_client`] from one
//! address) get a 503 and are closed before any of their bytes is read. A connection that sends
//! nothing within the header-read timeout of opening is closed too. An HTTP/1 answer of 408 or
//! 413 (its request's body left unread) says `connection: close`, so a client does not send its
//! next request on a connection the server is about to close.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::ConnectInfo;
use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode, Version};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::{BoxError, Extension, Router};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::ServiceBuilder;

/// The bounds [`serve`] holds every client to. With the `cli` feature, also a command line's
/// settings (`--http-max-connections` and the rest, each with its `HTTP_…` environment
/// variable), whose defaults are [`ServerLimits::default`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
pub struct ServerLimits {
    /// Longest a connection may take to send a request's head (line and headers), counted from
    /// when the server is ready to read one: a connection idle that long between requests is
    /// closed too.
    #[cfg_attr(
        feature = "cli",
        arg(long = "http-header-read-timeout", env = "HTTP_HEADER_READ_TIMEOUT", default_value = "10s",
            value_parser = humantime::parse_duration)
    )]
    pub header_read_timeout: Duration,
    /// Longest a request may take from its head to its response, its body included: 408 after.
    #[cfg_attr(
        feature = "cli",
        arg(long = "http-request-timeout", env = "HTTP_REQUEST_TIMEOUT", default_value = "30s",
            value_parser = humantime::parse_duration)
    )]
    pub request_timeout: Duration,
    /// Connections open at once; one more gets a 503 and is closed.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "http-max-connections",
            env = "HTTP_MAX_CONNECTIONS",
            default_value_t = 1_024
        )
    )]
    pub max_connections: usize,
    /// Connections open at once from one client address (so one client cannot take them all);
    /// one more from it gets a 503 and is closed.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "http-max-connections-per-client",
            env = "HTTP_MAX_CONNECTIONS_PER_CLIENT",
            default_value_t = 64
        )
    )]
    pub max_connections_per_client: usize,
    /// Requests handled at once; one more gets a 503.
    #[cfg_attr(
        feature = "cli",
        arg(
            long = "http-max-requests-in-flight",
            env = "HTTP_MAX_REQUESTS_IN_FLIGHT",
            default_value_t = 256
        )
    )]
    pub max_requests_in_flight: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 1_024,
            max_connections_per_client: 64,
            max_requests_in_flight: 256,
        }
    }
}

/// What a connection beyond [`ServerLimits::max_connections`] is sent before it is closed.
const TOO_MANY_CONNECTIONS: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: text/plain; charset=utf-8\r\ncontent-length: 44\r\nconnection: close\r\n\
retry-after: 1\r\n\r\ntoo many connections; try again in a moment\n";

/// Serves `app` on `listener` within `limits` until `shutdown`, then lets the requests under way
/// finish (the caller bounds how long it waits). Handlers can read the client's address as
/// `ConnectInfo<SocketAddr>` (an extension).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: &ServerLimits,
    shutdown: CancellationToken,
) {
    let app = bounded(app, limits);
    let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let clients = Clients::default();
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    let _ = builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let _ = builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.header_read_timeout)
        .keep_alive_timeout(limits.header_read_timeout);
    loop {
        let (stream, peer) = tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: the connections open close in time.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(client) = clients.admit(peer.ip(), limits.max_connections_per_client) else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tokio::spawn(refuse(stream));
            continue;
        };
        let service = TowerToHyperService::new(app.clone().layer(Extension(ConnectInfo(peer))));
        let (builder, watcher) = (builder.clone(), graceful.watcher());
        let wait = limits.header_read_timeout;
        tokio::spawn(async move {
            // hyper's header timer starts with a request's first byte: a connection that sends
            // nothing is closed here.
            let mut first = [0u8; 1];
            if !matches!(
                tokio::time::timeout(wait, stream.peek(&mut first)).await,
                Ok(Ok(1))
            ) {
                return;
            }
            let connection = builder
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            let _ = watcher.watch(connection).await;
            drop((permit, client));
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Connections open per client address.
#[derive(Clone, Default)]
struct Clients(Arc<Mutex<HashMap<IpAddr, usize>>>);

/// One open connection of a client address, counted until dropped.
struct ClientConnection {
    clients: Clients,
    address: IpAddr,
}

impl Clients {
    /// Counts a connection from `address`, unless it has `max` open already.
    fn admit(&self, address: IpAddr, max: usize) -> Option<ClientConnection> {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(address).or_insert(0);
        if *count >= max.max(1) {
            return None;
        }
        *count += 1;
        Some(ClientConnection {
            clients: self.clone(),
            address,
        })
    }
}

impl Drop for ClientConnection {
    fn drop(&mut self) {
        let mut open = self.clients.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                let _ = open.remove(&self.address);
            }
        }
    }
}

/// `app` with the per-request bounds of `limits`.
fn bounded(app: Router, limits: &ServerLimits) -> Router {
    app.layer(
        ServiceBuilder::new()
            .layer(middleware::from_fn(close_after_unread_body))
            .layer(HandleErrorLayer::new(overloaded))
            .load_shed()
            // Global: one count across every route (a plain limit layer counts per route).
            .layer(GlobalConcurrencyLimitLayer::new(
                limits.max_requests_in_flight.max(1),
            ))
            .layer(tower_http::timeout::TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                limits.request_timeout,
            )),
    )
}

/// The answer to a request the concurrency limit shed.
async fn overloaded(_: BoxError) -> Result<Response, Infallible> {
    Ok((
        StatusCode::SERVICE_UNAVAILABLE,
        [("retry-after", "1")],
        "too many requests at once; try again in a moment\n",
    )
        .into_response())
}

/// Adds `connection: close` to an HTTP/1 answer whose request body may be left unread (408, 413):
/// hyper closes such a connection after the answer, and a client told so opens a new one for its
/// next request instead of losing it on this one.
async fn close_after_unread_body(request: Request, next: Next) -> Response {
    let http1 = matches!(request.version(), Version::HTTP_10 | Version::HTTP_11);
    let mut response = next.run(request).await;
    if http1
        && matches!(
            response.status(),
            StatusCode::REQUEST_TIMEOUT | StatusCode::PAYLOAD_TOO_LARGE
        )
    {
        let _ = response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

/// Tells a connection beyond the cap why it is closed, without reading it.
async fn refuse(mut stream: TcpStream) {
    let _ = tokio::time::timeout(Duration::from_secs(1), async {
        let _ = stream.write_all(TOO_MANY_CONNECTIONS).await;
        let _ = stream.shutdown().await;
    })
    .await;
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::extract::DefaultBodyLimit;
    use axum::routing::{get, post};
    use tokio::io::AsyncReadExt;
    use tokio::sync::Notify;

    use super::*;

    /// Serves `app` within `limits` on a free port until the token is cancelled.
    async fn start(app: Router, limits: ServerLimits) -> (SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address");
        let stop = CancellationToken::new();
        tokio::spawn({
            let stop = stop.clone();
            async move { serve(listener, app, &limits, stop).await }
        });
        (address, stop)
    }

    /// Writes `bytes` on a new connection, then reads until the server closes it (or `within`
    /// passes: `None`).
    async fn exchange(address: SocketAddr, bytes: &[u8], within: Duration) -> Option<String> {
        let mut stream = TcpStream::connect(address).await.expect("connect");
        stream.write_all(bytes).await.expect("write");
        let mut answer = Vec::new();
        tokio::time::timeout(within, stream.read_to_end(&mut answer))
            .await
            .ok()
            .map(|_| String::from_utf8_lossy(&answer).into_owned())
    }

    fn limits() -> ServerLimits {
        ServerLimits {
            header_read_timeout: Duration::from_millis(300),
            request_timeout: Duration::from_millis(500),
            max_connections: 4,
            max_connections_per_client: 4,
            max_requests_in_flight: 1,
        }
    }

    fn app() -> Router {
        Router::new()
            .route("/", get(|| async { "ok" }))
            .route("/echo", post(|body: String| async move { body }))
            .route(
                "/small",
                post(|body: String| async move { body }).layer(DefaultBodyLimit::max(16)),
            )
            .route(
                "/client",
                get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() }),
            )
    }

    const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n";

    #[tokio::test]
    async fn slow_and_idle_clients_are_cut_off_and_others_still_served() {
        let (address, stop) = start(app(), limits()).await;
        let within = Duration::from_secs(3);
        // Half a head, never finished; nothing at all.
        let half = exchange(address, b"GET / HTTP/1.1\r\nhost: x\r\n", within).await;
        assert!(
            half.is_some(),
            "a half-sent head is closed within {within:?}"
        );
        assert!(
            exchange(address, b"", within).await.is_some(),
            "an idle connection is closed"
        );
        // A body announced and never sent: 408.
        let slow = exchange(
            address,
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nfirst bytes",
            within,
        )
        .await
        .expect("answered");
        assert!(slow.starts_with("HTTP/1.1 408"), "{slow}");
        assert!(slow.contains("connection: close\r\n"), "{slow}");
        let ok = exchange(address, GET, within).await.expect("answered");
        assert!(ok.starts_with("HTTP/1.1 200") && ok.ends_with("ok"), "{ok}");
        let client = exchange(
            address,
            b"GET /client HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            within,
        )
        .await
        .expect("answered");
        assert!(client.contains("127.0.0.1:"), "{client}");
        stop.cancel();
    }

    #[tokio::test]
    async fn a_connection_whose_body_is_refused_unread_is_closed_and_the_client_told() {
        let (address, stop) = start(app(), limits()).await;
        let within = Duration::from_secs(3);
        // Two requests on one connection, the first's body too large: the second is not read.
        let refused = exchange(
            address,
            b"POST /small HTTP/1.1\r\nhost: x\r\ncontent-length: 64\r\n\r\n\
              0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef\
              GET / HTTP/1.1\r\nhost: x\r\n\r\n",
            within,
        )
        .await
        .expect("closed");
        assert!(refused.starts_with("HTTP/1.1 413"), "{refused}");
        assert!(refused.contains("connection: close\r\n"), "{refused}");
        assert_eq!(refused.matches("HTTP/1.1 ").count(), 1, "{refused}");
        // A body within the limit keeps the connection open for the next request.
        let kept = exchange(
            address,
            b"POST /small HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi\
              GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
            within,
        )
        .await
        .expect("closed");
        assert_eq!(kept.matches("HTTP/1.1 200").count(), 2, "{kept}");
        let first = kept.split("hiHTTP/1.1").next().unwrap_or_default();
        assert!(!first.contains("connection: close"), "{kept}");
        stop.cancel();
    }

    #[tokio::test]
    async fn connections_and_requests_beyond_the_caps_get_503_at_once() {
        let release = Arc::new(Notify::new());
        let app = app().route(
            "/wait",
            get({
                let release = release.clone();
                move || async move {
                    release.notified().await;
                    "released"
                }
            }),
        );
        let limits = ServerLimits {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            ..limits()
        };
        let (address, stop) = start(app, limits.clone()).await;
        // One request in flight: the next one is shed.
        let mut waiting = TcpStream::connect(address).await.expect("connect");
        waiting
            .write_all(b"GET /wait HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .expect("write");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let shed = exchange(address, GET, Duration::from_secs(2))
            .await
            .expect("answered");
        assert!(shed.starts_with("HTTP/1.1 503"), "{shed}");
        release.notify_one();
        let mut answer = String::new();
        let _ = waiting.read_to_string(&mut answer).await;
        assert!(answer.ends_with("released"), "{answer}");
        // Connections up to the cap stay open; the next is told why it is closed.
        let mut open = Vec::new();
        for _ in 0..limits.max_connections {
            open.push(TcpStream::connect(address).await.expect("connect"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let refused = exchange(address, b"", Duration::from_secs(2))
            .await
            .expect("closed");
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        assert!(refused.ends_with("too many connections; try again in a moment\n"));
        drop(open);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ok = exchange(address, GET, Duration::from_secs(2))
            .await
            .expect("answered");
        assert!(ok.starts_with("HTTP/1.1 200"), "{ok}");
        stop.cancel();
    }

    /// The flags' defaults are [`ServerLimits::default`]: a server a program starts with the
    /// default and one a binary starts without flags hold clients to the same bounds.
    #[cfg(feature = "cli")]
    #[test]
    fn the_flags_defaults_are_the_default_limits() {
        use clap::Parser;

        #[derive(Parser)]
        struct Command {
            #[command(flatten)]
            limits: ServerLimits,
        }
        let parsed = Command::try_parse_from(["server"]).expect("the defaults parse");
        assert_eq!(parsed.limits, ServerLimits::default());
    }

    #[tokio::test]
    async fn one_client_address_cannot_take_every_connection() {
        let limits = ServerLimits {
            header_read_timeout: Duration::from_secs(10),
            max_connections: 8,
            max_connections_per_client: 2,
            ..limits()
        };
        let (address, stop) = start(app(), limits).await;
        let mut open = Vec::new();
        for _ in 0..2 {
            open.push(TcpStream::connect(address).await.expect("connect"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let refused = exchange(address, b"", Duration::from_secs(2))
            .await
            .expect("closed");
        assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
        // Another address of the machine (all of 127.0.0.0/8 is loopback) is still served.
        let other = tokio::net::TcpSocket::new_v4().expect("socket");
        other
            .bind("127.0.0.2:0".parse().expect("address"))
            .expect("bind 127.0.0.2");
        let mut stream = other.connect(address).await.expect("connect");
        stream.write_all(GET).await.expect("write");
        let mut answer = String::new();
        let _ = stream.read_to_string(&mut answer).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        stop.cancel();
    }
}
