//! HTTPS for the API: rustls (with the aws-lc-rs provider the AWS SDK already compiles), and a
//! certificate that can be replaced while the broker runs. The accept loop that serves the
//! router over it, plain or TLS, is [`super::server`].
//!
//! The certificate lives behind a [`ResolvesServerCert`], so a reload swaps what the *next*
//! handshake presents without touching the listener or open connections. [`watch`] reloads on
//! SIGHUP and when the files change (checked every couple of seconds; renewals such as certbot
//! or cert-manager replace files, they do not signal processes). A file that does not parse is
//! reported and the certificate in service stays.

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

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
    #[error(
        "{}: its first certificate (the server's own) is a CA certificate (basicConstraints \
         CA:TRUE), which every client refuses as a server certificate (`CaUsedAsEndEntity`): \
         serve a leaf certificate signed by that CA as --tls-cert, and give the CA to agents and \
         clients with --tls-ca / PROTEUS_CA_FILE (the CA + leaf recipe is in docs/aws.md, \
         section 6 \"HTTPS for the API\")",
        path.display()
    )]
    CaAsLeaf { path: PathBuf },
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

/// Whether an X.509 certificate (DER) says it is a CA: its basicConstraints extension
/// (2.5.29.19) has `cA` TRUE. `None` when the DER is not a certificate this reads (the chain
/// then fails its other checks with their own reasons).
pub fn is_ca_certificate(der: &[u8]) -> Option<bool> {
    /// One DER element: its tag and contents, and what follows it.
    fn element(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
        let (&tag, rest) = input.split_first()?;
        let (&first, rest) = rest.split_first()?;
        let (len, rest) = if first < 0x80 {
            (usize::from(first), rest)
        } else {
            let n = usize::from(first & 0x7f);
            if n == 0 || n > 4 || rest.len() < n {
                return None;
            }
            let len = rest[..n]
                .iter()
                .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
            (len, &rest[n..])
        };
        if rest.len() < len {
            return None;
        }
        Some((tag, &rest[..len], &rest[len..]))
    }
    const SEQUENCE: u8 = 0x30;
    const BOOLEAN: u8 = 0x01;
    const OID: u8 = 0x06;
    const OCTET_STRING: u8 = 0x04;
    const EXTENSIONS: u8 = 0xa3; // [3] EXPLICIT, constructed
    const BASIC_CONSTRAINTS: &[u8] = &[0x55, 0x1d, 0x13]; // 2.5.29.19
    let (SEQUENCE, certificate, _) = element(der)? else {
        return None;
    };
    let (SEQUENCE, mut tbs, _) = element(certificate)? else {
        return None;
    };
    // The fields of TBSCertificate, up to the optional [3] extensions.
    while !tbs.is_empty() {
        let (tag, contents, rest) = element(tbs)?;
        tbs = rest;
        if tag != EXTENSIONS {
            continue;
        }
        let (SEQUENCE, mut extensions, _) = element(contents)? else {
            return None;
        };
        while !extensions.is_empty() {
            let (SEQUENCE, extension, rest) = element(extensions)? else {
                return None;
            };
            extensions = rest;
            let (OID, oid, mut fields) = element(extension)? else {
                return None;
            };
            if oid != BASIC_CONSTRAINTS {
                continue;
            }
            // `critical BOOLEAN DEFAULT FALSE`, then the value.
            let (mut tag, mut value, rest) = element(fields)?;
            if tag == BOOLEAN {
                fields = rest;
                (tag, value, _) = element(fields)?;
            }
            if tag != OCTET_STRING {
                return None;
            }
            // BasicConstraints ::= SEQUENCE { cA BOOLEAN DEFAULT FALSE, pathLen INTEGER OPTIONAL }
            let (SEQUENCE, constraints, _) = element(value)? else {
                return None;
            };
            return Some(match element(constraints) {
                Some((BOOLEAN, flag, _)) => flag.first().is_some_and(|b| *b != 0),
                _ => false,
            });
        }
        return Some(false);
    }
    Some(false)
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
        // Clients would refuse it at every handshake, with an error that points nowhere near
        // the file; say so here, at start or reload.
        if is_ca_certificate(&chain[0]) == Some(true) {
            return Err(TlsError::CaAsLeaf {
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

    /// A CA certificate (and its key) for `localhost` and 127.0.0.1, written under `dir`.
    fn ca_as_leaf(dir: &Path) -> TlsFiles {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params
            .subject_alt_names
            .push(rcgen::SanType::IpAddress([127, 0, 0, 1].into()));
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).unwrap();
        let files = TlsFiles {
            cert: dir.join("ca.pem"),
            key: dir.join("ca.key"),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }

    /// Issue 23 item 15: a CA certificate as the server's own is refused at start (and on
    /// reload) with the fix, instead of failing every client's handshake.
    #[test]
    fn a_ca_certificate_as_the_leaf_is_refused_with_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ca_as_leaf(dir.path());
        let e = ca.load().unwrap_err();
        assert!(matches!(e, TlsError::CaAsLeaf { .. }), "{e:?}");
        let text = e.to_string();
        for needle in [
            "ca.pem",
            "CA certificate",
            "CaUsedAsEndEntity",
            "leaf",
            "--tls-ca",
            "docs/aws.md",
        ] {
            assert!(text.contains(needle), "`{needle}` missing from: {text}");
        }
        assert!(
            ReloadingCert::load(ca.clone()).is_err(),
            "the broker does not start with it"
        );
        // A leaf signed by that CA is what to serve.
        let issuer_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let issuer = rcgen::Issuer::new(ca_params, issuer_key);
        let leaf_key = rcgen::KeyPair::generate().unwrap();
        let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        std::fs::write(&ca.cert, leaf.pem()).unwrap();
        std::fs::write(&ca.key, leaf_key.serialize_pem()).unwrap();
        let served = ReloadingCert::load(ca.clone()).expect("a leaf is served");
        // A reload to a CA certificate is refused too; the leaf stays in service.
        let other = tempfile::tempdir().unwrap();
        let bad = ca_as_leaf(other.path());
        std::fs::copy(&bad.cert, &ca.cert).unwrap();
        std::fs::copy(&bad.key, &ca.key).unwrap();
        assert!(matches!(served.reload(), Err(TlsError::CaAsLeaf { .. })));
    }

    #[test]
    fn basic_constraints_are_read_from_the_certificate() {
        let dir = tempfile::tempdir().unwrap();
        let ca = ca_as_leaf(dir.path());
        let der = |path: &Path| {
            CertificateDer::pem_slice_iter(&std::fs::read(path).unwrap())
                .next()
                .unwrap()
                .unwrap()
        };
        assert_eq!(is_ca_certificate(&der(&ca.cert)), Some(true));
        // A self-signed leaf without basicConstraints, and one that says CA:FALSE.
        let plain = self_signed(dir.path(), "plain.test");
        assert_eq!(is_ca_certificate(&der(&plain.cert)), Some(false));
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(vec!["x.test".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::ExplicitNoCa;
        let explicit = params.self_signed(&key).unwrap();
        assert_eq!(is_ca_certificate(explicit.der()), Some(false));
        // Not a certificate: no answer, and no panic on any prefix of one.
        assert_eq!(is_ca_certificate(b"hello"), None);
        let whole = der(&ca.cert);
        for end in 0..whole.len() {
            assert_ne!(
                is_ca_certificate(&whole[..end]),
                Some(true),
                "prefix of {end} bytes"
            );
        }
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
