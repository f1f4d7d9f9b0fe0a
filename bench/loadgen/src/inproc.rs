//! A broker built in this process with the library (`startup::start`, simulated cloud, no
//! local agents), on a tokio runtime of its own, so that the load generator's threads and the
//! broker's are separate as they would be in two processes.

use anyhow::{Context, Result};
use clap::Parser;
use proteus_broker::startup::{Application, ServeArgs, start};
use proteus_broker::store::Store;

#[derive(Parser)]
struct Wrapper {
    #[command(flatten)]
    serve: ServeArgs,
}

/// `proteus serve` flags (without the command name), e.g. `["--cloud", "sim"]`.
pub fn serve_args(flags: &[&str]) -> Result<ServeArgs> {
    let argv = std::iter::once("serve").chain(flags.iter().copied());
    Ok(Wrapper::try_parse_from(argv).context("serve flags")?.serve)
}

/// A runtime for the broker, with `threads` workers.
pub fn runtime(threads: usize, name: &str) -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(name)
        .enable_all()
        .build()
        .context("a tokio runtime")
}

/// Opens the store (migrating it) and builds a broker on 127.0.0.1:0 with `flags`.
pub async fn build(database_url: &str, flags: &[&str]) -> Result<Application> {
    let store = Store::open(database_url)
        .await
        .with_context(|| format!("opening {database_url}"))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    start(store, serve_args(flags)?, listener).await
}
