//! Node-to-node authentication on the internal listener: a challenge-response handshake
//! over a shared cluster secret, run on every new connection before HTTP/2 starts.
//!
//! Both sides prove they hold the secret without sending it:
//! 1. client → server: [`MAGIC`], a fresh 32-byte client nonce `nc`;
//! 2. server → client: [`MAGIC`], a fresh server nonce `ns`, `HMAC(key, "S" ‖ nc ‖ ns)`;
//! 3. client → server: `HMAC(key, "C" ‖ ns ‖ nc)` (only after checking the server's proof);
//! 4. server → client: one byte, [`ACCEPTED`] or [`REFUSED`].
//!
//! Every call on an authenticated connection is the authenticated node's. The different
//! prefixes keep one side's proof from being replayed as the other's; fresh nonces keep a
//! recorded handshake from being replayed. The secret does not encrypt the traffic: on an
//! untrusted network, run the internal listener on a private network or a tunnel.
//!
//! The client speaks first, so a client that reaches the wrong port fails fast: a gRPC
//! port closes a connection that does not open with the HTTP/2 preface (and logs that a
//! tidelog node knocked), and the internal port closes one that does not open with
//! [`MAGIC`] (and logs that a gRPC client knocked).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint, Uri};

/// The first bytes of a node handshake.
pub const MAGIC: &[u8; 8] = b"TLNODE\x00\x01";
/// The server accepted the client's proof.
const ACCEPTED: u8 = 0;
/// The server refused it.
const REFUSED: u8 = 1;
const NONCE: usize = 32;
const PROOF: usize = 32;
/// Shortest secret accepted from a file (bytes).
pub const SECRET_BYTES_MIN: usize = 16;
/// Longest a client waits for the handshake to finish.
pub const CLIENT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

type HmacSha256 = Hmac<Sha256>;

/// The shared secret of a cluster's nodes.
#[derive(Clone)]
pub struct ClusterSecret {
    key: Vec<u8>,
    authenticated: bool,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterSecret")
            .field("authenticated", &self.authenticated)
            .finish_non_exhaustive()
    }
}

impl ClusterSecret {
    /// Reads the secret from `path` (trailing whitespace ignored); at least
    /// [`SECRET_BYTES_MIN`] bytes.
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let bytes = std::fs::read(path)
            .map_err(|e| format!("cluster_secret_file {}: {e}", path.display()))?;
        Self::from_bytes(&bytes).map_err(|e| format!("cluster_secret_file {}: {e}", path.display()))
    }

    /// The secret `bytes` (trailing whitespace ignored); at least [`SECRET_BYTES_MIN`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        let end = bytes
            .iter()
            .rposition(|b| !b.is_ascii_whitespace())
            .map_or(0, |i| i + 1);
        if end < SECRET_BYTES_MIN {
            return Err(format!(
                "the secret holds {end} bytes; at least {SECRET_BYTES_MIN} are needed (e.g. `head -c 32 /dev/urandom | base64 > FILE`)"
            ));
        }
        Ok(Self {
            key: bytes[..end].to_vec(),
            authenticated: true,
        })
    }

    /// A fresh random secret (for `standalone`, whose internal port only it uses).
    pub fn random() -> Self {
        let mut key = vec![0u8; 32];
        fill_random(&mut key);
        Self {
            key,
            authenticated: true,
        }
    }

    /// The well-known key of a cluster without a secret: the handshake still runs (so
    /// ports cannot be mixed up), but any process that can connect passes it. Allowed only
    /// on loopback.
    pub fn unauthenticated() -> Self {
        Self {
            key: b"tidelog: no cluster secret".to_vec(),
            authenticated: false,
        }
    }

    /// Whether this is a real secret.
    pub fn is_authenticated(&self) -> bool {
        self.authenticated
    }

    fn proof(&self, side: &[u8], first: &[u8], second: &[u8]) -> HmacSha256 {
        let mut mac = HmacSha256::new_from_slice(&self.key).expect("HMAC takes keys of any size");
        mac.update(side);
        mac.update(first);
        mac.update(second);
        mac
    }
}

/// Fills `buf` with OS randomness (SHA-256 of time and addresses where there is none).
pub fn fill_random(buf: &mut [u8]) {
    if getrandom::fill(buf).is_err() {
        // No OS randomness (never seen on Linux): fall back to time and address entropy
        // mixed through SHA-256 rather than refusing to start.
        use sha2::Digest;
        let seed = format!(
            "{:?} {:p} {}",
            std::time::SystemTime::now(),
            buf,
            std::process::id()
        );
        let digest = Sha256::digest(seed.as_bytes());
        for (b, d) in buf.iter_mut().zip(digest.iter().cycle()) {
            *b = *d;
        }
    }
}

/// Why a node handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The peer does not speak the node handshake (a client port, or not tidelog).
    #[error("it is not a tidelog internal listener (--peers and --controllers name internal addresses: by default the client port + 100)")]
    NotInternal,
    /// The peer does not hold our secret.
    #[error(
        "it does not hold this node's cluster secret (check cluster_secret_file on both nodes)"
    )]
    WrongSecret,
    /// The peer refused our proof.
    #[error("it refused this node's cluster secret (check cluster_secret_file on both nodes)")]
    Refused,
    /// Reading or writing failed, or the peer was too slow.
    #[error("{0}")]
    Io(String),
}

/// What a server learned from a handshake that failed, for its log.
pub fn describe_foreign(first: &[u8]) -> &'static str {
    match super::classify(first) {
        super::Preface::Http2 | super::Preface::Partial => {
            "a gRPC client (clients use the client port, not the internal one)"
        }
        super::Preface::Foreign(guess) => guess,
    }
}

/// The client side of the handshake on a fresh connection.
pub async fn client_handshake(
    stream: &mut TcpStream,
    secret: &ClusterSecret,
) -> Result<(), HandshakeError> {
    let io = |e: std::io::Error| HandshakeError::Io(e.to_string());
    let mut nc = [0u8; NONCE];
    fill_random(&mut nc);
    let mut hello = Vec::with_capacity(MAGIC.len() + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&nc);
    stream.write_all(&hello).await.map_err(io)?;
    let mut answer = [0u8; 8 + NONCE + PROOF];
    if let Err(e) = stream.read_exact(&mut answer).await {
        // An internal listener always answers the hello; a port that closes on it (EOF,
        // or a reset because it did not read our bytes) is some other listener.
        use std::io::ErrorKind::{ConnectionReset, UnexpectedEof};
        return Err(if matches!(e.kind(), UnexpectedEof | ConnectionReset) {
            HandshakeError::NotInternal
        } else {
            io(e)
        });
    }
    if &answer[..8] != MAGIC {
        return Err(HandshakeError::NotInternal);
    }
    let ns = &answer[8..8 + NONCE];
    secret
        .proof(b"S", &nc, ns)
        .verify_slice(&answer[8 + NONCE..])
        .map_err(|_| HandshakeError::WrongSecret)?;
    let proof = secret.proof(b"C", ns, &nc).finalize().into_bytes();
    stream.write_all(&proof).await.map_err(io)?;
    let mut verdict = [0u8; 1];
    stream.read_exact(&mut verdict).await.map_err(io)?;
    match verdict[0] {
        ACCEPTED => Ok(()),
        _ => Err(HandshakeError::Refused),
    }
}

/// The server side of the handshake; on error the caller closes the connection.
pub async fn server_handshake(
    stream: &mut TcpStream,
    secret: &ClusterSecret,
) -> Result<(), String> {
    let mut hello = [0u8; 8 + NONCE];
    let mut got = 0;
    while got < hello.len() {
        let n = stream
            .read(&mut hello[got..])
            .await
            .map_err(|e| format!("read failed: {e}"))?;
        if n == 0 {
            return Err("closed during the node handshake".to_owned());
        }
        got += n;
        let known = got.min(MAGIC.len());
        if hello[..known] != MAGIC[..known] {
            return Err(format!("it speaks {}", describe_foreign(&hello[..got])));
        }
    }
    let nc = &hello[8..];
    let mut ns = [0u8; NONCE];
    fill_random(&mut ns);
    let mut answer = Vec::with_capacity(8 + NONCE + PROOF);
    answer.extend_from_slice(MAGIC);
    answer.extend_from_slice(&ns);
    answer.extend_from_slice(&secret.proof(b"S", nc, &ns).finalize().into_bytes());
    stream
        .write_all(&answer)
        .await
        .map_err(|e| format!("write failed: {e}"))?;
    let mut proof = [0u8; PROOF];
    stream
        .read_exact(&mut proof)
        .await
        .map_err(|e| format!("read failed: {e}"))?;
    let ok = secret.proof(b"C", &ns, nc).verify_slice(&proof).is_ok();
    stream
        .write_all(&[if ok { ACCEPTED } else { REFUSED }])
        .await
        .map_err(|e| format!("write failed: {e}"))?;
    if ok {
        Ok(())
    } else {
        Err("it does not hold the cluster secret".to_owned())
    }
}

/// Connects to `address` and authenticates as a node.
async fn connect(address: String, secret: Arc<ClusterSecret>) -> std::io::Result<TcpStream> {
    let mut stream = TcpStream::connect(&address).await?;
    stream.set_nodelay(true)?;
    match tokio::time::timeout(
        CLIENT_HANDSHAKE_TIMEOUT,
        client_handshake(&mut stream, &secret),
    )
    .await
    {
        Ok(Ok(())) => Ok(stream),
        Ok(Err(e)) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!("node handshake with {address}: {e}"),
        )),
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!(
                "node handshake with {address}: no answer within {} ms",
                CLIENT_HANDSHAKE_TIMEOUT.as_millis()
            ),
        )),
    }
}

/// A lazily connected channel to another node's internal listener at `address`
/// (`host:port`); every connection it opens runs the node handshake first.
pub fn internal_channel(
    address: &str,
    secret: Arc<ClusterSecret>,
    connect_timeout: Duration,
) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(format!("http://{address}"))
        .map_err(|e| format!("'{address}' is not a host:port address: {e}"))?
        .connect_timeout(connect_timeout);
    let endpoint = super::tune_endpoint(endpoint);
    let connector = tower::service_fn(move |uri: Uri| {
        let secret = secret.clone();
        async move {
            let host = uri.host().unwrap_or_default();
            let port = uri.port_u16().unwrap_or(80);
            let target = if host.contains(':') && !host.starts_with('[') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            };
            connect(target, secret)
                .await
                .map(hyper_util::rt::TokioIo::new)
        }
    });
    Ok(endpoint.connect_with_connector_lazy(connector))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, server) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (client.unwrap(), server.unwrap().0)
    }

    fn secret(text: &[u8]) -> ClusterSecret {
        ClusterSecret {
            key: text.to_vec(),
            authenticated: true,
        }
    }

    #[tokio::test]
    async fn the_same_secret_passes_and_another_fails_on_both_sides() {
        let (mut c, mut s) = pair().await;
        let (a, b) = (secret(b"0123456789abcdef"), secret(b"0123456789abcdef"));
        let (client, server) =
            tokio::join!(client_handshake(&mut c, &a), server_handshake(&mut s, &b));
        assert_eq!(client, Ok(()));
        assert_eq!(server, Ok(()));

        let (mut c, mut s) = pair().await;
        let other = secret(b"fedcba9876543210");
        let client = async move {
            // A failed client drops its connection, as `connect` does.
            let result = client_handshake(&mut c, &a).await;
            drop(c);
            result
        };
        let (client, server) = tokio::join!(client, server_handshake(&mut s, &other));
        // The client checks the server's proof first and stops there.
        assert_eq!(client, Err(HandshakeError::WrongSecret));
        assert!(server.is_err());
    }

    #[tokio::test]
    async fn a_grpc_client_on_the_internal_port_is_named() {
        let (mut c, mut s) = pair().await;
        c.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let err = server_handshake(&mut s, &secret(b"0123456789abcdef"))
            .await
            .unwrap_err();
        assert!(err.contains("gRPC client"), "{err}");
    }

    #[tokio::test]
    async fn a_client_port_is_not_taken_for_an_internal_one() {
        let (mut c, s) = pair().await;
        drop(s); // what a gRPC port does with a connection that is not HTTP/2
        let err = client_handshake(&mut c, &secret(b"0123456789abcdef"))
            .await
            .unwrap_err();
        assert!(
            matches!(err, HandshakeError::NotInternal | HandshakeError::Io(_)),
            "{err:?}"
        );
    }

    #[test]
    fn secret_files_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let short = dir.path().join("short");
        std::fs::write(&short, "tooshort\n").unwrap();
        assert!(ClusterSecret::from_file(&short)
            .unwrap_err()
            .contains("holds 8 bytes"));
        let good = dir.path().join("good");
        std::fs::write(&good, "0123456789abcdef0123\n").unwrap();
        let s = ClusterSecret::from_file(&good).unwrap();
        assert_eq!(s.key, b"0123456789abcdef0123");
        assert!(!format!("{s:?}").contains("0123"));
        assert!(ClusterSecret::from_file(&dir.path().join("missing")).is_err());
    }
}
