//! An agent identity for tests that speak the agent protocol without a real agent: an instance
//! row of a job, launched as far as the store knows, with a per-instance token made here.
//! Prints `<cloud id> <token>`. Used by `bench/fuzz-api` to fuzz the agent endpoints past
//! authentication.

use anyhow::{Context, Result};
use proteus_broker::api::auth::{hash_token, new_token};
use proteus_broker::policy::Purchase;
use proteus_broker::store::{InstanceRow, MarketFilter, Store};
use proteus_wire::JobId;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The broker's database.
    #[arg(long, env = "PROTEUS_DATABASE_URL")]
    pub database_url: String,
    /// The job the instance belongs to.
    #[arg(long)]
    pub job: i64,
    /// The cloud's id of the instance.
    #[arg(long, default_value = "i-0f0220000000000001")]
    pub cloud_id: String,
}

pub async fn run(args: Args) -> Result<bool> {
    let store = Store::connect(&args.database_url).await?;
    let market = store
        .markets(&MarketFilter::default())
        .await?
        .into_iter()
        .next()
        .context("the database has no market")?
        .market;
    let token = new_token("pa_");
    // Market time, which on a simulated cloud is not today's: the job's own clock.
    let now = store
        .job(JobId(args.job))
        .await?
        .context("no such job")?
        .created;
    let id = format!("pi-{}-{}", args.job, args.cloud_id);
    store
        .insert_instance(
            None,
            &InstanceRow::intent(
                id.clone(),
                JobId(args.job),
                market,
                Purchase::OnDemand,
                hash_token(&token),
                now,
            ),
        )
        .await?;
    store.mark_launched(None, &id, &args.cloud_id, now).await?;
    store.close().await;
    println!("{} {token}", args.cloud_id);
    Ok(true)
}
