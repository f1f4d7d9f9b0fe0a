//! The broker over HTTPS with a test CA: the CLI and the agents it starts verify it with
//! `--ca-file`, a client that does not trust the CA is refused, a replaced certificate reaches
//! new connections, and a whole job run at `trace` log level leaks no token and no secret.

use proteus_e2e::{BrokerProcess, TOKEN, fresh_pg_database, proteus};
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A test certificate authority and the files of one server certificate it signed.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

/// A fresh CA named `name` and a certificate for 127.0.0.1 and localhost, written under `dir`.
fn pki(dir: &Path, name: &str) -> Pki {
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(rcgen::DnType::CommonName, format!("proteus test CA {name}"));
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let out = Pki {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-cert.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    std::fs::write(&out.ca, ca_cert.pem()).unwrap();
    std::fs::write(&out.cert, cert.pem()).unwrap();
    std::fs::write(&out.key, key.serialize_pem()).unwrap();
    out
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A client that trusts only `ca`. A fresh one per probe: a client keeps connections and TLS
/// sessions, and a resumed session skips the certificate altogether.
fn client_trusting(ca: &Path) -> reqwest::Client {
    let pem = std::fs::read(ca).unwrap();
    reqwest::Client::builder()
        .tls_certs_only(reqwest::Certificate::from_pem_bundle(&pem).unwrap())
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

async fn healthy(client: &reqwest::Client, url: &str) -> Result<u16, String> {
    match client.get(format!("{url}/healthz")).send().await {
        Ok(r) => Ok(r.status().as_u16()),
        Err(e) => {
            let mut m = e.to_string();
            let mut s = std::error::Error::source(&e);
            while let Some(c) = s {
                m.push_str(&format!(": {c}"));
                s = c.source();
            }
            Err(m)
        }
    }
}

/// The job's data-plane secret (hex), from the coordinator state the broker saved.
async fn job_secret(db: &str, id: i64) -> Option<String> {
    let pool = sqlx::PgPool::connect(db).await.ok()?;
    let state: Option<String> = sqlx::query_scalar("SELECT control_state FROM jobs WHERE id = $1")
        .bind(id)
        .fetch_one(&pool)
        .await
        .ok()?;
    pool.close().await;
    let v: serde_json::Value = serde_json::from_str(&state?).ok()?;
    v["data_secret"].as_str().map(str::to_string)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_and_agents_use_tls_and_a_trace_level_run_logs_no_secret() {
    let dir = tempfile::tempdir().unwrap();
    let p = pki(dir.path(), "one");
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "300",
        &[
            "--tls-cert",
            path(&p.cert),
            "--tls-key",
            path(&p.key),
            "--tls-ca",
            path(&p.ca),
            "--log",
            "trace",
            "--agent-log",
            "trace",
        ],
    )
    .await;
    assert!(broker.url.starts_with("https://"));

    // The CLI with the CA: submits; the agents it launches get the CA and register over TLS.
    let id = broker.submit_file(
        dir.path(),
        "name = \"e2e-tls\"\napp = \"mlr\"\ndataset = \"digits\"\npolicy = \"bidbrain\"\n\
         [stop]\nepochs = 8\n[limits]\nmax_instances = 2\nmax_reliable_instances = 1\n\
         [work]\ntotal_work = 1.0\n[training]\nseed = 5\n",
    );
    // The secrets to look for, collected while the job runs (agent tokens live in the agents'
    // environments; the job secret is dropped when the job ends).
    let (mut tokens, mut secret) = (Vec::new(), None);
    let deadline = Instant::now() + Duration::from_secs(120);
    while (tokens.is_empty() || secret.is_none()) && Instant::now() < deadline {
        tokens.extend(broker.agent_tokens());
        tokens.sort();
        tokens.dedup();
        if secret.is_none() {
            secret = job_secret(&db, id).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let secret = secret.expect("the running job has a data-plane secret");
    assert_eq!(secret.len(), 64);
    assert!(!tokens.is_empty(), "no agent was started");
    broker
        .wait_succeeded(
            &format!("/v1/jobs/{id}"),
            Duration::from_secs(240),
            "the TLS job",
        )
        .await;
    assert_eq!(
        job_secret(&db, id).await,
        None,
        "the secret outlived the job"
    );

    // A client that does not trust the CA is refused: the CLI without --ca-file, and plain HTTP.
    let env = [
        ("PROTEUS_URL", broker.url.as_str()),
        ("PROTEUS_TOKEN", TOKEN),
    ];
    let (code, _, err) = proteus(None, &["status"], &env);
    assert_ne!(code, 0, "the CLI trusted an unknown CA");
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    let other = pki(dir.path(), "other");
    let (code, _, err) = proteus(None, &["status", "--ca-file", path(&other.ca)], &env);
    assert_ne!(code, 0);
    assert!(err.to_lowercase().contains("certificate"), "{err}");
    let plain = broker.url.replace("https://", "http://");
    assert!(healthy(&reqwest::Client::new(), &plain).await.is_err());
    let (code, out, err) = proteus(None, &["status", "--ca-file", path(&p.ca)], &env);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("e2e-tls") && out.contains("succeeded"),
        "{out}"
    );

    // The dashboard's session cookie, set over HTTPS, is marked Secure so a browser never sends
    // it back over plain HTTP.
    let login = reqwest::Client::builder()
        .tls_certs_only(
            reqwest::Certificate::from_pem_bundle(&std::fs::read(&p.ca).unwrap()).unwrap(),
        )
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{}/login", broker.url))
        .header(
            reqwest::header::CONTENT_TYPE,
            "application/x-www-form-urlencoded",
        )
        .body(format!("token={TOKEN}"))
        .send()
        .await
        .unwrap();
    let cookie = login
        .headers()
        .get(reqwest::header::SET_COOKIE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    assert!(
        cookie.starts_with("proteus_session="),
        "no session cookie: {cookie:?}"
    );
    assert!(
        cookie.ends_with("; Secure"),
        "the session cookie over HTTPS is not Secure: {cookie}"
    );

    // No token or secret in any log, at trace level.
    let logs = format!("{}{}", broker.log_text(), broker.agent_logs());
    assert!(logs.contains("TRACE"), "the logs are not at trace level");
    assert!(
        logs.contains("registered") && logs.contains("data plane bound"),
        "the agents' logs are missing"
    );
    assert!(!logs.contains(TOKEN), "the user token was logged");
    for t in &tokens {
        assert!(!logs.contains(t.as_str()), "an agent token was logged");
    }
    assert!(
        !proteus_e2e::contains_agent_token(&logs),
        "an agent token was logged"
    );
    assert!(
        !logs.to_lowercase().contains(&secret),
        "the job's data-plane secret was logged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_connections_get_a_replaced_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let first = pki(dir.path(), "first");
    let second = pki(dir.path(), "second");
    // The broker's files, replaced below the way renewals do (write aside, rename over).
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::copy(&first.cert, &cert).unwrap();
    std::fs::copy(&first.key, &key).unwrap();
    let db = fresh_pg_database().await;
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &[
            "--tls-cert",
            path(&cert),
            "--tls-key",
            path(&key),
            "--tls-ca",
            path(&first.ca),
        ],
    )
    .await;
    let old = || client_trusting(&first.ca);
    let new = || client_trusting(&second.ca);
    assert_eq!(healthy(&old(), &broker.url).await, Ok(200));
    assert!(healthy(&new(), &broker.url).await.is_err());

    let replace = |from: &Pki| {
        std::fs::copy(&from.key, dir.path().join("tls.key.new")).unwrap();
        std::fs::copy(&from.cert, dir.path().join("tls.crt.new")).unwrap();
        std::fs::rename(dir.path().join("tls.key.new"), &key).unwrap();
        std::fs::rename(dir.path().join("tls.crt.new"), &cert).unwrap();
    };
    replace(&second);
    let deadline = Instant::now() + Duration::from_secs(30);
    while healthy(&new(), &broker.url).await != Ok(200) {
        assert!(
            Instant::now() < deadline,
            "the new certificate was never served:\n{}",
            broker.log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = healthy(&old(), &broker.url).await;
    assert!(refused.is_err(), "the old certificate is still served");
    assert!(broker.log_text().contains("TLS certificate reloaded"));

    // A broken replacement is reported and the working certificate stays in service.
    std::fs::write(&cert, "not a certificate\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !broker.log_text().contains("TLS certificate not reloaded") {
        assert!(Instant::now() < deadline, "{}", broker.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(healthy(&new(), &broker.url).await, Ok(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let first = pki(dir.path(), "first");
    let second = pki(dir.path(), "second");
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::copy(&first.cert, &cert).unwrap();
    std::fs::copy(&first.key, &key).unwrap();
    let db = fresh_pg_database().await;
    // No file polling: only the signal can make the broker read the files again.
    let broker = BrokerProcess::start_sim(
        dir.path(),
        &db,
        "60",
        &[
            "--tls-cert",
            path(&cert),
            "--tls-key",
            path(&key),
            "--tls-ca",
            path(&first.ca),
            "--tls-reload-poll-secs",
            "0",
        ],
    )
    .await;
    std::fs::copy(&second.key, &key).unwrap();
    std::fs::copy(&second.cert, &cert).unwrap();
    assert_eq!(
        healthy(&client_trusting(&first.ca), &broker.url).await,
        Ok(200),
        "replaced files alone changed nothing"
    );
    let pid = broker.child.as_ref().expect("running").id();
    // SAFETY: signalling the broker process this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while healthy(&client_trusting(&second.ca), &broker.url).await != Ok(200) {
        assert!(
            Instant::now() < deadline,
            "SIGHUP did not reload:\n{}",
            broker.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        healthy(&client_trusting(&first.ca), &broker.url)
            .await
            .is_err()
    );
    let log = broker.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("TLS certificate reloaded") && l.contains("SIGHUP")),
        "{log}"
    );
}
