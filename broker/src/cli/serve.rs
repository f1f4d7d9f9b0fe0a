//! `proteus serve`: the broker service, built by [`crate::startup`].

use super::DatabaseArgs;
use crate::broker_lock::{BrokerLock, lock_postgres};
pub use crate::startup::ServeArgs;
use crate::startup::{CloudKind, start};
use anyhow::{Context, Result, bail};
use std::process::ExitCode;

pub async fn run(database: DatabaseArgs, args: ServeArgs) -> Result<ExitCode> {
    if args.ec2.dry_run {
        if args.cloud != CloudKind::Ec2 {
            bail!("--dry-run checks an EC2 account: use it with --cloud ec2");
        }
        return dry_run(&args).await;
    }
    // One broker per state directory and embedded database: locked before anything is
    // written (the store's migrations, recovery, the agents' files).
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(crate::startup::default_state_dir);
    let url = database.database_url();
    let mut lock = BrokerLock::acquire(&state_dir, crate::store::sqlite_file(&url).as_deref())?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    // Brokers on one Postgres share its jobs through leases, but the simulated cloud lives
    // inside one broker: with it, the database stays one broker's.
    let pg = match url.starts_with("postgres") && args.cloud == CloudKind::Sim {
        true => {
            let addr = listener.local_addr().context("the listener's address")?;
            Some(lock_postgres(&url, &addr.to_string()).await?)
        }
        false => None,
    };
    let store = database.open_store().await?;
    let server = start(store, args, listener).await?;
    let scheme = if server.tls.is_some() {
        "https"
    } else {
        "http"
    };
    lock.announce(&format!("{scheme}://{}", server.addr))
        .with_context(|| format!("recording this broker in {}", state_dir.display()))?;
    if server.tls.is_none() && !server.addr.ip().is_loopback() {
        tracing::warn!(
            "serving plain HTTP on {}: API and agent tokens cross the network in clear; \
             use --tls-cert and --tls-key (see docs/aws.md)",
            server.addr
        );
    }
    eprintln!(
        "proteus broker listening on {scheme}://{} ({} cloud)",
        server.addr,
        server.broker.cloud().kind()
    );
    // The Postgres lock is kept in the background; losing it to another broker (while
    // Postgres was away) stops this one.
    let (stop_keeping, kept) = tokio::sync::oneshot::channel::<()>();
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel();
    if let Some(pg) = pg {
        tokio::spawn(async move {
            if let Err(refused) = pg
                .keep(url, async {
                    let _ = kept.await;
                })
                .await
            {
                let _ = lost_tx.send(refused);
            }
        });
    }
    let lost = std::sync::Arc::new(std::sync::Mutex::new(None));
    let shutdown = {
        let lost = lost.clone();
        async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot listen for SIGTERM");
                        None
                    }
                };
            let terminated = async {
                match term.as_mut() {
                    Some(t) => {
                        t.recv().await;
                    }
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => tracing::info!("shutting down"),
                _ = terminated => tracing::info!("SIGTERM: releasing this broker's jobs and shutting down"),
                Ok(refused) = lost_rx => {
                    tracing::error!("another broker took the database while Postgres was away: stopping");
                    *lost.lock().unwrap_or_else(|e| e.into_inner()) = Some(refused);
                }
            }
        }
    };
    server.run_until(shutdown).await;
    let _ = stop_keeping.send(());
    drop(lock);
    if let Some(refused) = lost.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let holder = match refused {
            crate::store::Refused::Held(h) => h.unwrap_or_else(|| "another session".into()),
            crate::store::Refused::Store(e) => e.to_string(),
        };
        bail!("stopped: the database's broker lock is now held by {holder}");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(feature = "ec2")]
async fn dry_run(args: &ServeArgs) -> Result<ExitCode> {
    let region = crate::market::Region::parse(&args.region).context("--region")?;
    let cloud =
        crate::cloud::ec2::Ec2Cloud::new(crate::startup::ec2_config(args, &region, args.listen))
            .await;
    let report = cloud.dry_run().await;
    print!("{report}");
    if report.all_allowed() {
        println!("every EC2 action the broker uses is allowed in {region}");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("see docs/aws.md for the IAM policy the broker needs");
        Ok(ExitCode::FAILURE)
    }
}

#[cfg(not(feature = "ec2"))]
async fn dry_run(_: &ServeArgs) -> Result<ExitCode> {
    bail!("this build of proteus has no EC2 support (built without the `ec2` feature)")
}
