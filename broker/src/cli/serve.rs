//! `proteus serve`: the broker service, built by [`crate::startup`].

use super::GlobalArgs;
pub use crate::startup::ServeArgs;
use crate::startup::{CloudKind, start};
use anyhow::{Context, Result, bail};
use std::process::ExitCode;

pub async fn run(global: &GlobalArgs, args: ServeArgs) -> Result<ExitCode> {
    if args.ec2.dry_run {
        if args.cloud != CloudKind::Ec2 {
            bail!("--dry-run checks an EC2 account: use it with --cloud ec2");
        }
        return dry_run(&args).await;
    }
    let store = global.open_store().await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let server = start(store, args, listener).await?;
    let scheme = if server.tls.is_some() {
        "https"
    } else {
        "http"
    };
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
    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down");
    };
    server.run_until(shutdown).await;
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
