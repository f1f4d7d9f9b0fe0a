//! The broker's integration tests: one binary (it links once), one module per area.
//! They need a real Postgres (`PROTEUS_TEST_PG_URL`) and LocalStack (`PROTEUS_TEST_LOCALSTACK_URL`);
//! `scripts/test` starts both.

mod support;

mod api;
mod api_access;
mod cancel_during_launch;
mod cli_help;
mod cli_pipes;
mod cli_prices;
mod dos;
#[cfg(feature = "ec2")]
mod ec2_prices;
mod engine_restart;
mod graceful_stop;
mod job_spec_doc;
mod launch_idempotency;
mod pipeline_plans;
mod pool_book;
mod read_freshness;
mod sim_cli;
mod sim_policies;
mod sim_today;
mod store_jobs;
mod store_leases;
mod store_outputs;
mod store_prices;
mod takeover;
mod terminate_retry;
