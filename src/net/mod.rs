//! Listeners: what a port accepts before gRPC sees a connection.
//!
//! Every accepted connection must open with the HTTP/2 client preface within
//! [`ListenerLimits::handshake_timeout`]; it is checked with `peek`, so the bytes stay for
//! the gRPC server. A connection that sends something else (a Kafka client, HTTP/1, TLS)
//! is closed and logged, one line per peer address at most every
//! [`FOREIGN_LOG_INTERVAL`]; one that sends nothing or half a preface is closed when the
//! timeout runs out, so slow or idle handshakes cannot pile up. At most
//! [`ListenerLimits::connections_max`] connections are open at once (handshakes
//! included); past that new ones are closed at once and counted in a rate-limited
//! warning.
//!
//! Established connections whose peer stops answering HTTP/2 keepalive pings (dead,
//! frozen or cut off) are closed by the gRPC server (`roles::server_builder`). A live
//! connection that carries nothing but keepalive traffic for
//! [`ListenerLimits::idle_timeout`] (Kafka's `connections.max.idle.ms`, 10 minutes) is
//! closed here, so connections that hold a slot without using it do not add up; gRPC
//! clients reconnect on their next call.
//!
//! An internal listener (node-to-node RPCs) first runs the node handshake of
//! [`node_auth`] on every connection, then the same checks.

pub mod grpc_pieces;
pub mod node_auth;

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// The bytes every HTTP/2 client sends first.
const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Shortest pause between two log lines about the same peer (or about refusals).
pub const FOREIGN_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// Connections that passed the handshake and wait for the server to take them.
const ACCEPTED_QUEUE: usize = 128;

/// HTTP/2 flow-control window per stream. The protocol's 64 KiB default lets a 1 MiB
/// produce or fetch cross loopback only in 16 window updates; a window larger than the
/// biggest message lets it go in one burst.
pub const HTTP2_STREAM_WINDOW_BYTES: u32 = 8 * 1024 * 1024;
/// HTTP/2 flow-control window per connection (shared by its streams).
pub const HTTP2_CONNECTION_WINDOW_BYTES: u32 = 32 * 1024 * 1024;
/// Largest HTTP/2 frame a client may send a server (the default is 16 KiB: 64 frames per
/// MiB). A produce request's record batches, sent as one piece (`grpc_pieces`), cross in
/// one frame up to this size. Not larger: a server holds a frame whole before it can
/// refuse it, and a hostile peer claiming the protocol's 16 MiB maximum would make every
/// connection slot cost that much, and keep its connection until keepalive gives up.
pub const HTTP2_FRAME_BYTES_MAX: u32 = 1024 * 1024;

/// Largest HTTP/2 frame a client lets a server send it: the protocol's maximum. A fetch
/// answer's record batches (up to the fetch's `max_bytes`, 8 MiB in the Rust consumer)
/// then cross in one frame and are decoded in place rather than joined from several.
/// Flow control still bounds what a server may send unasked.
pub const HTTP2_RESPONSE_FRAME_BYTES_MAX: u32 = (1 << 24) - 1;

/// A client endpoint with the HTTP/2 settings every tidelog connection uses.
pub fn tune_endpoint(endpoint: tonic::transport::Endpoint) -> tonic::transport::Endpoint {
    endpoint
        .initial_stream_window_size(HTTP2_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(HTTP2_CONNECTION_WINDOW_BYTES)
        .max_frame_size(HTTP2_RESPONSE_FRAME_BYTES_MAX)
        .tcp_nodelay(true)
}

/// Limits of one listener.
#[derive(Debug, Clone, Copy)]
pub struct ListenerLimits {
    /// Most connections open at once.
    pub connections_max: usize,
    /// Longest a new connection may take to send the HTTP/2 preface.
    pub handshake_timeout: Duration,
    /// Longest an established connection may carry only keepalive-sized frames.
    pub idle_timeout: Duration,
}

impl Default for ListenerLimits {
    fn default() -> Self {
        Self {
            connections_max: 10_000,
            handshake_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// Reads and writes of at most this many bytes do not count as use: an HTTP/2 PING or
/// its acknowledgement is 17 bytes (9 of header, 8 of payload), a WINDOW_UPDATE 13, a
/// SETTINGS acknowledgement 9. Anything carrying a request or a response is larger.
const KEEPALIVE_FRAME_BYTES_MAX: usize = 17;

/// What the first bytes of a connection say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preface {
    /// The HTTP/2 preface (gRPC).
    Http2,
    /// A prefix of it: wait for more.
    Partial,
    /// Something else, with a guess of what.
    Foreign(&'static str),
}

/// Classifies the first bytes of a connection (pure).
pub fn classify(first: &[u8]) -> Preface {
    let n = first.len().min(HTTP2_PREFACE.len());
    if first[..n] == HTTP2_PREFACE[..n] {
        return if n == HTTP2_PREFACE.len() {
            Preface::Http2
        } else {
            Preface::Partial
        };
    }
    let guess = match first {
        [b'T', b'L', b'N', b'O', b'D', b'E', ..] => {
            "the node handshake (a tidelog node on a client port? --peers and --controllers name internal addresses)"
        }
        [0x16, 0x03, ..] => "TLS (a client expecting TLS?)",
        [b'G' | b'P' | b'H' | b'D' | b'O', ..] if first.contains(&b' ') => "HTTP/1",
        // Kafka: a big-endian i32 size, then api_key i16 (< 100) and api_version i16.
        [0, _, _, _, 0, key, 0, _, ..] if *key < 100 => {
            "the Kafka protocol (a Kafka client on the gRPC port?)"
        }
        _ => "an unknown protocol",
    };
    Preface::Foreign(guess)
}

/// Counts a connection in `tidelog_connections_active` while it lives.
#[derive(Debug)]
struct OpenGauge(&'static str);

impl OpenGauge {
    fn new(listener: &'static str) -> Self {
        metrics::gauge!("tidelog_connections_active", "listener" => listener).increment(1.0);
        Self(listener)
    }
}

impl Drop for OpenGauge {
    fn drop(&mut self) {
        metrics::gauge!("tidelog_connections_active", "listener" => self.0).decrement(1.0);
    }
}

/// One accepted connection; holds its place under the connection limit until dropped.
/// Reads end (EOF) once it has been idle for the listener's idle timeout, which makes
/// the gRPC server close it.
#[derive(Debug)]
pub struct Conn {
    stream: TcpStream,
    _permit: OwnedSemaphorePermit,
    _open: OpenGauge,
    idle_timeout: Duration,
    idle: Pin<Box<tokio::time::Sleep>>,
    /// Whether reads count as use (else only writes: answers).
    reads_count: bool,
}

impl Conn {
    /// Wraps an accepted `stream` holding `permit` (its place under the listener's
    /// connection limit), closed after `idle_timeout` without use; counted in the
    /// `listener`'s open-connections gauge.
    pub fn new(
        stream: TcpStream,
        permit: OwnedSemaphorePermit,
        idle_timeout: Duration,
        listener: &'static str,
    ) -> Self {
        Self {
            stream,
            _permit: permit,
            _open: OpenGauge::new(listener),
            idle_timeout,
            idle: Box::pin(tokio::time::sleep(idle_timeout)),
            reads_count: true,
        }
    }

    /// Counts only what the server writes as use: a connection is idle until it is
    /// answered, however the client trickles bytes (HTTP/1.1, where every request gets
    /// an answer).
    pub fn idle_until_answered(mut self) -> Self {
        self.reads_count = false;
        self
    }

    /// Counts a read or write of `bytes` as use unless it is keepalive-sized.
    fn used(&mut self, bytes: usize) {
        if bytes > KEEPALIVE_FRAME_BYTES_MAX {
            let at = tokio::time::Instant::now() + self.idle_timeout;
            self.idle.as_mut().reset(at);
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                if self.reads_count {
                    self.used(n);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => match self.idle.as_mut().poll(cx) {
                // Idle for the whole timeout: end of stream, and the server closes it.
                Poll::Ready(()) => Poll::Ready(Ok(())),
                Poll::Pending => Poll::Pending,
            },
            other => other,
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.used(n);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = r {
            self.used(n);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Rate-limited log lines, one key at a time.
#[derive(Debug, Default)]
pub struct LogLimiter {
    last: Mutex<HashMap<String, Instant>>,
}

impl LogLimiter {
    /// Whether a line about `key` may be logged now.
    pub fn allow(&self, key: &str) -> bool {
        let mut last = self.last.lock();
        let now = Instant::now();
        if last.len() > 1024 {
            last.retain(|_, t| now.duration_since(*t) < FOREIGN_LOG_INTERVAL);
        }
        match last.get(key) {
            Some(t) if now.duration_since(*t) < FOREIGN_LOG_INTERVAL => false,
            _ => {
                last.insert(key.to_owned(), now);
                true
            }
        }
    }
}

/// Accepts on `listener` until `cancel`, checking each connection as the module doc
/// says (with the node handshake first when `nodes` is given: an internal listener); the
/// stream yields the connections for the gRPC server.
pub fn serve_incoming(
    listener: TcpListener,
    limits: ListenerLimits,
    what: &'static str,
    nodes: Option<Arc<node_auth::ClusterSecret>>,
    cancel: CancellationToken,
) -> impl futures_util::Stream<Item = Result<Conn, std::io::Error>> {
    let (tx, rx) = mpsc::channel(ACCEPTED_QUEUE);
    let slots = Arc::new(Semaphore::new(limits.connections_max.max(1)));
    let logs = Arc::new(LogLimiter::default());
    tokio::spawn(async move {
        let mut refused = 0u64;
        loop {
            let accepted = tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // E.g. out of file descriptors: back off instead of spinning.
                    if logs.allow("accept-error") {
                        tracing::warn!(listener = what, error = %e, "accept failed");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                refused += 1;
                if logs.allow("limit") {
                    tracing::warn!(
                        listener = what,
                        limit = limits.connections_max,
                        refused_total = refused,
                        "connection limit reached; closing new connections"
                    );
                }
                drop(stream);
                continue;
            };
            let _ = stream.set_nodelay(true);
            let (tx, logs, nodes) = (tx.clone(), logs.clone(), nodes.clone());
            tokio::spawn(async move {
                let mut stream = stream;
                match handshake(&mut stream, nodes.as_deref(), limits.handshake_timeout).await {
                    Ok(()) => {
                        let _ = tx
                            .send(Ok(Conn::new(stream, permit, limits.idle_timeout, what)))
                            .await;
                    }
                    Err(why) => {
                        if logs.allow(&peer.ip().to_string()) {
                            if nodes.is_some() {
                                tracing::warn!(listener = what, %peer, "closing a connection that is not an authenticated tidelog node: {why}");
                            } else {
                                tracing::warn!(listener = what, %peer, "closing a connection that does not speak gRPC: {why}");
                            }
                        }
                    }
                }
            });
        }
    });
    futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
}

/// Runs the node handshake when `nodes` is given, then waits until `stream` has sent the
/// HTTP/2 preface (peeking, so nothing of it is consumed); all within `timeout`.
async fn handshake(
    stream: &mut TcpStream,
    nodes: Option<&node_auth::ClusterSecret>,
    timeout: Duration,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    if let Some(secret) = nodes {
        match tokio::time::timeout_at(deadline, node_auth::server_handshake(stream, secret)).await {
            Err(_) => {
                return Err(format!(
                    "no node handshake within {} ms",
                    timeout.as_millis()
                ))
            }
            Ok(result) => result?,
        }
    }
    let mut buf = [0u8; HTTP2_PREFACE.len()];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Err(_) => {
                return Err(format!(
                    "no HTTP/2 preface within {} ms",
                    timeout.as_millis()
                ))
            }
            Ok(Err(e)) => return Err(format!("read failed: {e}")),
            Ok(Ok(0)) => return Err("closed before the HTTP/2 preface".to_owned()),
            Ok(Ok(n)) => n,
        };
        match classify(&buf[..n]) {
            Preface::Http2 => return Ok(()),
            Preface::Foreign(guess) => return Err(format!("it speaks {guess}")),
            Preface::Partial => {
                // peek returns what is buffered at once; wait a little for the rest.
                if tokio::time::Instant::now() >= deadline {
                    return Err(format!(
                        "only {n} bytes of the HTTP/2 preface within {} ms",
                        timeout.as_millis()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefaces_are_classified() {
        assert_eq!(classify(HTTP2_PREFACE), Preface::Http2);
        assert_eq!(classify(&HTTP2_PREFACE[..10]), Preface::Partial);
        assert_eq!(classify(b""), Preface::Partial);
        assert!(matches!(classify(b"GET / HTTP/1.1\r\n"), Preface::Foreign(g) if g == "HTTP/1"));
        assert!(
            matches!(classify(&[0x16, 0x03, 0x01, 0, 0]), Preface::Foreign(g) if g.starts_with("TLS"))
        );
        // A Kafka ApiVersions request: size, api_key 18, api_version 3, ...
        let kafka = [0, 0, 0, 30, 0, 18, 0, 3, 0, 0, 0, 1];
        assert!(matches!(classify(&kafka), Preface::Foreign(g) if g.contains("Kafka")));
        assert!(matches!(classify(b"\x00\x01garbage"), Preface::Foreign(_)));
    }

    #[tokio::test]
    async fn silent_and_foreign_connections_are_closed_and_grpc_passes() {
        use futures_util::StreamExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let limits = ListenerLimits {
            connections_max: 2,
            handshake_timeout: Duration::from_millis(200),
            idle_timeout: Duration::from_secs(60),
        };
        let incoming = serve_incoming(listener, limits, "test", None, cancel.clone());
        tokio::pin!(incoming);
        // Half a preface, then silence: closed after the timeout.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        silent.write_all(&HTTP2_PREFACE[..5]).await.unwrap();
        let mut byte = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte))
            .await
            .expect("closed by the handshake timeout")
            .unwrap_or(0);
        assert_eq!(n, 0);
        // A Kafka client: closed at once.
        let mut kafka = TcpStream::connect(addr).await.unwrap();
        kafka
            .write_all(&[0, 0, 0, 30, 0, 18, 0, 3, 0, 0])
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), kafka.read(&mut byte))
            .await
            .expect("closed")
            .unwrap_or(0);
        assert_eq!(n, 0);
        // gRPC: handed on, bytes intact.
        let mut good = TcpStream::connect(addr).await.unwrap();
        good.write_all(HTTP2_PREFACE).await.unwrap();
        let mut conn = tokio::time::timeout(Duration::from_secs(5), incoming.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let mut got = [0u8; 24];
        conn.read_exact(&mut got).await.unwrap();
        assert_eq!(&got[..], HTTP2_PREFACE);
        cancel.cancel();
    }

    #[tokio::test]
    async fn a_connection_carrying_only_keepalives_is_closed_when_idle() {
        use futures_util::StreamExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cancel = CancellationToken::new();
        let limits = ListenerLimits {
            connections_max: 4,
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_millis(300),
        };
        let incoming = serve_incoming(listener, limits, "test", None, cancel.clone());
        tokio::pin!(incoming);
        let mut busy = TcpStream::connect(addr).await.unwrap();
        busy.write_all(HTTP2_PREFACE).await.unwrap();
        let mut busy_conn = incoming.next().await.unwrap().unwrap();
        let mut quiet = TcpStream::connect(addr).await.unwrap();
        quiet.write_all(HTTP2_PREFACE).await.unwrap();
        let mut quiet_conn = incoming.next().await.unwrap().unwrap();
        let mut buf = [0u8; 64];
        busy_conn.read_exact(&mut buf[..24]).await.unwrap();
        quiet_conn.read_exact(&mut buf[..24]).await.unwrap();
        let started = tokio::time::Instant::now();
        // The quiet peer sends only ping-sized frames; the busy one real traffic.
        let quiet_reader = tokio::spawn(async move {
            let mut buf = [0u8; 64];
            loop {
                match quiet_conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return tokio::time::Instant::now(),
                    Ok(_) => {}
                }
            }
        });
        for _ in 0..8 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let _ = quiet.write_all(&[0u8; 17]).await;
            busy.write_all(&[1u8; 40]).await.unwrap();
            let n = busy_conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "a connection in use was closed");
        }
        let closed_at = tokio::time::timeout(Duration::from_secs(5), quiet_reader)
            .await
            .expect("the idle connection was never closed")
            .unwrap();
        let idle_for = closed_at - started;
        assert!(
            idle_for >= Duration::from_millis(300) && idle_for < Duration::from_millis(800),
            "closed after {idle_for:?}"
        );
        cancel.cancel();
    }
}
