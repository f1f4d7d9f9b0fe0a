//! HTTPS for the API: rustls (with the aws-lc-rs provider the AWS SDK already compiles), a
//! certificate that can be replaced while the broker runs, and the accept loop that serves the
//! axum router over TLS.
//!
//! The certificate lives behind a [`ResolvesServerCert`], so a reload swaps what the *next*
//! handshake presents without touching the listener or open connections. [`watch`] reloads on
//! SIGHUP and when the files change (checked every couple of seconds; renewals such as certbot
//! or cert-manager replace files, they do not signal processes). A file that does not parse is
//! reported and the certificate in service stays.

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};
use tokio::net::TcpListener;

/// A TLS client gets this long to finish its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the certificate or key cannot be used; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: no PEM certificate in it (expected `-----BEGIN CERTIFICATE-----`)", path.display())]
    NoCertificate { path: PathBuf },
    #[error("{}: not a PEM certificate chain: {problem}", path.display())]
    BadCertificate { path: PathBuf, problem: String },
    #[error("{}: no usable PEM private key in it (PKCS#8, PKCS#1 or SEC1): {problem}", path.display())]
    BadKey { path: PathBuf, problem: String },
    #[error("{} and {} do not go together: {problem}", cert.display(), key.display())]
    Mismatch {
        cert: PathBuf,
        key: PathBuf,
        problem: String,
    },
}

/// A CA certificate file for agents to trust, as PEM text: it must hold at least one
/// certificate (it is written onto VMs verbatim).
pub fn read_ca_pem(path: &Path) -> Result<String, TlsError> {
    let text = std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let certs = CertificateDer::pem_slice_iter(text.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadCertificate {
            path: path.to_path_buf(),
            problem: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(text)
}

/// The certificate chain and key files of `serve --tls-cert/--tls-key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

impl TlsFiles {
    /// Reads and checks both files: the chain parses, the key parses, and the key is the
    /// chain's.
    pub fn load(&self) -> Result<CertifiedKey, TlsError> {
        let read = |path: &Path| {
            std::fs::read(path).map_err(|source| TlsError::Read {
                path: path.to_path_buf(),
                source,
            })
        };
        let cert_pem = read(&self.cert)?;
        let chain = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::BadCertificate {
                path: self.cert.clone(),
                problem: e.to_string(),
            })?;
        if chain.is_empty() {
            return Err(TlsError::NoCertificate {
                path: self.cert.clone(),
            });
        }
        let key_pem = read(&self.key)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::BadKey {
            path: self.key.clone(),
            problem: e.to_string(),
        })?;
        CertifiedKey::from_der(chain, key, &provider()).map_err(|e| TlsError::Mismatch {
            cert: self.cert.clone(),
            key: self.key.clone(),
            problem: e.to_string(),
        })
    }

    /// What tells that the files were replaced: modification time and size of each.
    fn stamp(&self) -> Option<[(SystemTime, u64); 2]> {
        let one = |p: &Path| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok()?, m.len()))
        };
        Some([one(&self.cert)?, one(&self.key)?])
    }
}

/// The certificate in service, replaceable while connections come and go.
#[derive(Debug)]
pub struct ReloadingCert {
    files: TlsFiles,
    current: RwLock<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        )
    }
}

impl ReloadingCert {
    /// Loads the files once; an error here stops the broker from starting.
    pub fn load(files: TlsFiles) -> Result<Arc<ReloadingCert>, TlsError> {
        let key = files.load()?;
        Ok(Arc::new(ReloadingCert {
            files,
            current: RwLock::new(Arc::new(key)),
        }))
    }

    /// Reads the files again; on success new handshakes present the new certificate, on
    /// failure the old one stays in service.
    pub fn reload(&self) -> Result<(), TlsError> {
        let key = self.files.load()?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(key);
        Ok(())
    }

    /// The rustls server configuration that presents this certificate (HTTP/1.1 and h2).
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, rustls::Error> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// Reloads `cert` on SIGHUP and whenever its files change (polled every `poll`; `None`: on
/// SIGHUP only), until the task is dropped. Outcomes are logged; the files' contents never are.
pub async fn watch(cert: Arc<ReloadingCert>, poll: Option<Duration>) {
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "no SIGHUP handler: certificates reload on file change only");
            None
        }
    };
    let mut stamp = cert.files.stamp();
    // (Without polling the interval is never polled: the branch below is disabled.)
    let mut tick = tokio::time::interval(poll.unwrap_or(Duration::from_secs(3600)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let why = tokio::select! {
            Some(()) = async { match hup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => "SIGHUP",
            _ = tick.tick(), if poll.is_some() => {
                let now = cert.files.stamp();
                if now == stamp || now.is_none() {
                    continue;
                }
                stamp = now;
                "the files changed"
            }
        };
        match cert.reload() {
            Ok(()) => {
                tracing::info!(cert = %cert.files.cert.display(), reason = %why, "TLS certificate reloaded")
            }
            Err(e) => {
                tracing::error!(reason = %why, error = %e, "TLS certificate not reloaded; the previous one stays in service")
            }
        }
    }
}

/// Serves `app` over TLS on `listener` until `shutdown` resolves, then lets open requests
/// finish (the caller bounds how long it waits).
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    config: Arc<rustls::ServerConfig>,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let (conns_tx, mut conns_rx) = tokio::sync::mpsc::unbounded_channel();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let (tcp, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let (acceptor, tx) = (acceptor.clone(), conns_tx.clone());
                // The handshake runs off the accept loop: a slow or silent client holds only
                // its own task, and only for the handshake timeout.
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => { let _ = tx.send(tls); }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                    }
                });
            }
            Some(tls) = conns_rx.recv() => {
                // With the client's address, as `axum::serve` gives it (dashboard logins).
                let peer = tls.get_ref().0.peer_addr().ok().map(axum::extract::ConnectInfo);
                let app = tower::ServiceBuilder::new()
                    .option_layer(peer.map(axum::Extension))
                    .service(app.clone());
                let service = TowerToHyperService::new(app);
                let conn = auto::Builder::new(TokioExecutor::new())
                    .serve_connection_with_upgrades(TokioIo::new(tls), service)
                    .into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(error = %e, "HTTPS connection ended with an error");
                    }
                });
            }
        }
    }
    drop(listener);
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(dir: &Path, name: &str) -> TlsFiles {
        let c = rcgen::generate_simple_self_signed(vec![name.to_string()]).unwrap();
        let files = TlsFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
        };
        std::fs::write(&files.cert, c.cert.pem()).unwrap();
        std::fs::write(&files.key, c.signing_key.serialize_pem()).unwrap();
        files
    }

    #[test]
    fn unusable_files_are_refused_with_the_file_and_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        let a = self_signed(dir.path(), "a.test");
        let b = self_signed(dir.path(), "b.test");
        assert!(a.load().is_ok());
        let missing = TlsFiles {
            cert: dir.path().join("nope.crt"),
            key: a.key.clone(),
        };
        let e = missing.load().unwrap_err().to_string();
        assert!(e.contains("nope.crt"), "{e}");
        std::fs::write(dir.path().join("junk.crt"), "hello").unwrap();
        let junk = TlsFiles {
            cert: dir.path().join("junk.crt"),
            key: a.key.clone(),
        };
        let e = junk.load().unwrap_err().to_string();
        assert!(
            e.contains("junk.crt") && e.contains("no PEM certificate"),
            "{e}"
        );
        let swapped = TlsFiles {
            cert: a.cert.clone(),
            key: b.key.clone(),
        };
        let e = swapped.load().unwrap_err().to_string();
        assert!(e.contains("do not go together"), "{e}");
        // The key's contents never appear in an error.
        let key_pem = std::fs::read_to_string(&b.key).unwrap();
        let body = key_pem.lines().nth(1).unwrap();
        assert!(!e.contains(body));
        let key_as_cert = TlsFiles {
            cert: a.key.clone(),
            key: a.key.clone(),
        };
        let e = key_as_cert.load().unwrap_err().to_string();
        assert!(!e.contains(key_pem.lines().nth(1).unwrap()), "{e}");
    }

    #[test]
    fn a_failed_reload_keeps_the_certificate_in_service() {
        let dir = tempfile::tempdir().unwrap();
        let a = self_signed(dir.path(), "a.test");
        let cert = ReloadingCert::load(a.clone()).unwrap();
        let served = |c: &ReloadingCert| c.current.read().unwrap().cert[0].clone();
        let first = served(&cert);
        std::fs::write(
            &a.cert,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        assert!(cert.reload().is_err());
        assert_eq!(served(&cert), first);
        let b = self_signed(dir.path(), "b.test");
        std::fs::copy(&b.cert, &a.cert).unwrap();
        std::fs::copy(&b.key, &a.key).unwrap();
        cert.reload().unwrap();
        assert_ne!(served(&cert), first);
    }
}
