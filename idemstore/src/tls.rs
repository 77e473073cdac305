//! idemstore's own listener over TLS (`--tls-cert-file`, `--tls-key-file`), optionally
//! requiring client certificates signed by `--tls-client-ca-file`, so that only Envoys holding
//! one can call it, on every route (the protocol, the store stream, the admin routes,
//! `/healthz` and `/metrics`). The files are read again when they change: a rotated
//! certificate serves new connections within a [`RELOAD_PERIOD`], open ones keep theirs; a
//! file that does not load (half written, a key that does not match) keeps the previous one
//! and says why.
//!
//! Handshakes run in their own tasks, bounded by [`HANDSHAKE_TIMEOUT`], so a client that stalls
//! mid-handshake holds nothing but itself; [`TlsListener`] hands axum finished connections.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// How often the files are checked for a change.
pub const RELOAD_PERIOD: Duration = Duration::from_secs(1);
/// A handshake not done by then is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Finished handshakes waiting for the server to take them.
const ACCEPTED_QUEUE: usize = 1024;

/// The listener's certificate, key and (for client certificates) CA files.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// The files as they are now (modification time and size of each): a change means reload.
    fn stamp(&self) -> Vec<Option<(SystemTime, u64)>> {
        let files = [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()];
        files
            .into_iter()
            .flatten()
            .map(|p| std::fs::metadata(p).ok().and_then(|m| Some((m.modified().ok()?, m.len()))))
            .collect()
    }

    /// A server configuration from the files, or what is wrong with them.
    pub fn load(&self) -> Result<Arc<ServerConfig>, String> {
        let certs = certificates(&self.cert, "--tls-cert-file")?;
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| format!("--tls-key-file {}: {e}", self.key.display()))?;
        let builder = ServerConfig::builder();
        let builder = match &self.client_ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in certificates(ca, "--tls-client-ca-file")? {
                    roots.add(cert).map_err(|e| format!("--tls-client-ca-file {}: {e}", ca.display()))?;
                }
                let verifier = WebPkiClientVerifier::builder(Arc::new(roots))
                    .build()
                    .map_err(|e| format!("--tls-client-ca-file {}: {e}", ca.display()))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| format!("--tls-cert-file and --tls-key-file: {e}"))?;
        // Envoy speaks HTTP/2 to the store; HTTP/1.1 stays for curl and the tools.
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The certificates of a PEM file, at least one; errors name `flag`. Also the tools' (an
/// https:// `--url`).
pub fn certificates(path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{flag} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{flag} {}: no certificate in it", path.display()));
    }
    Ok(certs)
}

/// Connections that finished their TLS handshake, for `axum::serve`.
pub struct TlsListener {
    accepted: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    /// Serves TLS on `tcp` with `files`, already loaded as `config`; reloads them as they
    /// change. Needs a tokio runtime.
    pub fn new(tcp: TcpListener, files: TlsFiles, config: Arc<ServerConfig>) -> std::io::Result<Self> {
        let local = tcp.local_addr()?;
        let current = Arc::new(RwLock::new(config));
        tokio::spawn(reload(files, Arc::clone(&current)));
        let (tx, accepted) = mpsc::channel(ACCEPTED_QUEUE);
        tokio::spawn(accept(tcp, current, tx));
        Ok(Self { accepted, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.accepted.recv().await {
            Some(accepted) => accepted,
            // The accepting task never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

async fn accept(
    tcp: TcpListener,
    config: Arc<RwLock<Arc<ServerConfig>>>,
    accepted: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    loop {
        let (stream, peer) = match tcp.accept().await {
            Ok(conn) => conn,
            Err(e) => {
                // Out of file descriptors and the like: what axum's own listener does.
                tracing::warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        // As on the plain listener: answers must not wait for Envoy's delayed ACK.
        if let Err(e) = stream.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY");
        }
        let Ok(current) = config.read().map(|c| Arc::clone(&c)) else { return };
        let acceptor = TlsAcceptor::from(current);
        let accepted = accepted.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => {
                    // Sending fails only when the server is gone.
                    let _ = accepted.send((tls, peer)).await;
                }
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake refused"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

async fn reload(files: TlsFiles, config: Arc<RwLock<Arc<ServerConfig>>>) {
    let mut stamp = files.stamp();
    loop {
        tokio::time::sleep(RELOAD_PERIOD).await;
        let now = files.stamp();
        if now == stamp {
            continue;
        }
        stamp = now;
        match files.load() {
            Ok(fresh) => match config.write() {
                Ok(mut current) => {
                    *current = fresh;
                    tracing::info!("reloaded the listener's TLS files: new connections use them");
                }
                Err(_) => return,
            },
            Err(e) => {
                tracing::error!("cannot reload the listener's TLS files, keeping the previous ones: {e}")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(dir: &Path) -> TlsFiles {
        TlsFiles { cert: dir.join("cert.pem"), key: dir.join("key.pem"), client_ca: Some(dir.join("ca.pem")) }
    }

    #[test]
    fn bad_files_are_named_by_their_flag() {
        let dir = std::env::temp_dir().join(format!("idem-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = files(&dir);
        let e = f.load().unwrap_err();
        assert!(e.starts_with("--tls-cert-file"), "{e}");
        std::fs::write(&f.cert, "not a certificate\n").unwrap();
        let e = f.load().unwrap_err();
        assert!(e.contains("--tls-cert-file") && e.contains("no certificate"), "{e}");
        // A change of size or time is what the reload looks for.
        let before = f.stamp();
        std::fs::write(&f.cert, "still not a certificate\n").unwrap();
        assert_ne!(before, f.stamp());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
