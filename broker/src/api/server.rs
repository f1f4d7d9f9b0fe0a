//! Serving the router on a listener, over plain HTTP or HTTPS, with the limits that keep slow,
//! silent or too many clients from holding the broker:
//!
//! - **a connection cap**: a semaphore taken before each accept, so that beyond
//!   [`ConnLimits::max_connections`] new connections wait in the listen backlog until one ends;
//! - **a header-read timeout** (hyper's, on its tokio timer): a request's head must arrive
//!   within it, counted from when the connection is ready for a request — so an HTTP/1.1
//!   connection kept alive without a next request is closed after it too;
//! - **an idle timeout**: a connection with no request in flight and no byte moving either way
//!   for that long is closed (HTTP/2 connections without streams, and clients that connect and
//!   send nothing);
//! - **a request-body timeout**: a request whose body stops arriving for that long fails (the
//!   handler sees the body end in an error), so a half-sent upload does not hold its handler;
//! - the TLS handshake, when there is one, must finish within its own timeout.
//!
//! A request in flight is never cut by the idle timeout: an agent's command long poll sends
//! nothing until it is answered.

use axum::Router;
use axum::body::{Body, HttpBody};
use axum::http::Request;
use axum::response::Response;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tower::ServiceExt;

/// A TLS client gets this long to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the API lets a connection take over what, and how many it holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// A request's head (request line and headers) must arrive within this, counted from when
    /// the connection is ready for a request.
    pub header_read_timeout: Duration,
    /// A connection with no request in flight and no traffic for this long is closed.
    pub idle_timeout: Duration,
    /// A request body that sends nothing for this long fails.
    pub body_read_timeout: Duration,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    /// The defaults of `proteus serve` (see its `--header-read-timeout-secs` and friends).
    fn default() -> Self {
        ConnLimits {
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// Serves `app` on `listener` — over TLS with `tls`, plain HTTP without — within `limits`,
/// until `shutdown` resolves; then stops accepting and lets open requests finish (the caller
/// bounds how long it waits).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<rustls::ServerConfig>>,
    limits: ConnLimits,
    shutdown: impl Future<Output = ()> + Send,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // The cap: a connection is accepted only once a permit is free.
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break, // never closed
            },
        };
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors, mostly: give connections time to end.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let (app, builder, acceptor) = (app.clone(), builder.clone(), acceptor.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let activity = Arc::new(Activity::new());
            let io = Tracked {
                inner: tcp,
                activity: activity.clone(),
            };
            let service = TowerToHyperService::new(ConnService {
                app,
                activity: activity.clone(),
                body_read_timeout: limits.body_read_timeout,
                peer,
            });
            let served = async {
                match acceptor {
                    None => {
                        let conn =
                            builder.serve_connection_with_upgrades(TokioIo::new(io), service);
                        watcher.watch(conn.into_owned()).await
                    }
                    Some(acceptor) => {
                        // The handshake runs in this connection's own task: a slow or silent
                        // client holds only that, and only for the handshake timeout.
                        let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(io))
                            .await
                        {
                            Ok(Ok(tls)) => tls,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return Ok(());
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return Ok(());
                            }
                        };
                        let conn =
                            builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
                        watcher.watch(conn.into_owned()).await
                    }
                }
            };
            tokio::select! {
                outcome = served => {
                    if let Err(e) = outcome {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                }
                () = activity.idle_for(limits.idle_timeout) => {
                    tracing::debug!(%peer, "closing an idle connection");
                }
            }
            drop(permit);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// When a connection last moved a byte or finished a request, and how many requests it has
/// in flight.
struct Activity {
    start: Instant,
    /// Milliseconds after `start`.
    last: AtomicU64,
    in_flight: AtomicUsize,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        }
    }

    fn touch(&self) {
        let now = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.fetch_max(now, Ordering::Relaxed);
    }

    fn quiet(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.start.elapsed().saturating_sub(last)
    }

    /// Marks a request in flight until the guard is dropped.
    fn request(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        self.touch();
        InFlight(self.clone())
    }

    /// Resolves once the connection has had no request in flight and no traffic for `limit`.
    async fn idle_for(&self, limit: Duration) {
        loop {
            let quiet = self.quiet();
            if self.in_flight.load(Ordering::SeqCst) == 0 && quiet >= limit {
                return;
            }
            // Look again when it could first be idle long enough.
            let wait = if quiet >= limit { limit } else { limit - quiet };
            tokio::time::sleep(wait.max(Duration::from_millis(10))).await;
        }
    }
}

struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The connection's stream, noting every byte read or written.
struct Tracked<T> {
    inner: T,
    activity: Arc<Activity>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The router as one connection serves it: each request counted in flight while its handler
/// runs, its body under the body-read timeout.
#[derive(Clone)]
struct ConnService {
    app: Router,
    activity: Arc<Activity>,
    body_read_timeout: Duration,
    /// The client's address, given to handlers as `ConnectInfo` (as `axum::serve` does):
    /// dashboard logins are limited by it.
    peer: std::net::SocketAddr,
}

impl<B> tower::Service<Request<B>> for ConnService
where
    B: HttpBody<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let in_flight = self.activity.request();
        let timeout = self.body_read_timeout;
        let mut req =
            req.map(|body| Body::new(tower_http::timeout::TimeoutBody::new(timeout, body)));
        req.extensions_mut()
            .insert(axum::extract::ConnectInfo(self.peer));
        let answer = self.app.clone().oneshot(req);
        Box::pin(async move {
            let response = answer.await;
            drop(in_flight);
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A bound on every wait of these tests: what should happen within a fraction of it.
    const BOUND: Duration = Duration::from_secs(10);

    fn app() -> Router {
        Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_millis(1500)).await;
                    "slow"
                }),
            )
            .route("/echo", post(|body: String| async move { body }))
    }

    fn limits(header_ms: u64, idle_ms: u64, body_ms: u64, max: usize) -> ConnLimits {
        ConnLimits {
            header_read_timeout: Duration::from_millis(header_ms),
            idle_timeout: Duration::from_millis(idle_ms),
            body_read_timeout: Duration::from_millis(body_ms),
            max_connections: max,
        }
    }

    async fn start(
        limits: ConnLimits,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(serve(listener, app(), tls, limits, std::future::pending()));
        (addr, task)
    }

    /// Reads until the server closes the connection (or resets it); what it sent.
    async fn read_to_close<S: AsyncRead + Unpin>(stream: &mut S) -> Result<Vec<u8>, String> {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(BOUND, stream.read(&mut buf)).await {
                Err(_) => {
                    return Err(format!(
                        "still open after {BOUND:?}; received {:?}",
                        String::from_utf8_lossy(&got)
                    ));
                }
                Ok(Ok(0)) | Ok(Err(_)) => return Ok(got),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            }
        }
    }

    /// Reads one whole `Connection: close` answer; its text.
    async fn answer_of<S: AsyncRead + AsyncWrite + Unpin>(stream: &mut S, path: &str) -> String {
        let request = format!("GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        String::from_utf8_lossy(&read_to_close(stream).await.unwrap()).into_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_half_sent_request_is_disconnected_after_the_header_read_timeout() {
        let (addr, _server) = start(limits(300, 60_000, 60_000, 16), None).await;
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Half: ")
            .await
            .unwrap();
        let started = Instant::now();
        let got = read_to_close(&mut tcp).await.expect("disconnected");
        assert!(
            started.elapsed() < BOUND,
            "closed after {:?}",
            started.elapsed()
        );
        // hyper answers a header timeout by closing, possibly after a 408.
        let text = String::from_utf8_lossy(&got);
        assert!(
            text.is_empty() || text.starts_with("HTTP/1.1 408"),
            "{text}"
        );
        // A whole request on a new connection is still served.
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let text = answer_of(&mut tcp, "/healthz").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_connection_is_closed_after_the_idle_timeout_but_a_slow_answer_is_not_cut() {
        let (addr, _server) = start(limits(60_000, 300, 60_000, 16), None).await;
        // Connects and says nothing (hyper has not even seen which protocol it speaks).
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert_eq!(read_to_close(&mut silent).await.expect("closed"), b"");
        // A handler that takes five times the idle timeout is still answered.
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let text = answer_of(&mut tcp, "/slow").await;
        assert!(
            text.starts_with("HTTP/1.1 200") && text.ends_with("slow"),
            "{text}"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_body_that_stops_arriving_fails_the_request() {
        let (addr, _server) = start(limits(60_000, 60_000, 300, 16), None).await;
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(
            b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\nContent-Type: text/plain\r\n\r\nonly ten b",
        )
        .await
        .unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match tokio::time::timeout(BOUND, tcp.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
                other => panic!(
                    "no answer: {other:?} after {:?}",
                    String::from_utf8_lossy(&got)
                ),
            }
        }
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 4"), "{text}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_beyond_the_cap_wait_until_one_ends() {
        let (addr, _server) = start(limits(60_000, 60_000, 60_000, 2), None).await;
        // Two connections hold the two places (silent, but well within their timeouts)...
        let first = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _second = tokio::net::TcpStream::connect(addr).await.unwrap();
        // ... so a third is not served: its request waits in the listen backlog.
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        third
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut buf)).await;
        assert!(early.is_err(), "served beyond the cap: {early:?}");
        // Once one of the two ends, the third is served.
        drop(first);
        let text = String::from_utf8_lossy(&read_to_close(&mut third).await.unwrap()).into_owned();
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }

    /// The same limits on the HTTPS listener.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn over_tls_a_half_sent_request_is_disconnected_and_the_cap_holds() {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let config = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(cert.signing_key.serialize_der().into()),
            )
            .unwrap();
        let (addr, _server) = start(limits(300, 60_000, 60_000, 1), Some(Arc::new(config))).await;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.cert.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = connector.connect(name.clone(), tcp).await.unwrap();
        tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Half: ")
            .await
            .unwrap();
        tls.flush().await.unwrap();
        read_to_close(&mut tls).await.expect("disconnected");
        // The one place is free again: a whole request is served.
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = connector.connect(name.clone(), tcp).await.unwrap();
        let text = answer_of(&mut tls, "/healthz").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
        // With the place taken, a second client does not even get its handshake answered.
        let holder = tokio::net::TcpStream::connect(addr).await.unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let early = tokio::time::timeout(
            Duration::from_millis(500),
            connector.connect(name.clone(), tcp),
        )
        .await;
        assert!(early.is_err(), "a handshake beyond the cap was answered");
        drop(holder);
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = tokio::time::timeout(BOUND, connector.connect(name, tcp))
            .await
            .expect("served once the place is free")
            .unwrap();
        let text = answer_of(&mut tls, "/healthz").await;
        assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    }
}
