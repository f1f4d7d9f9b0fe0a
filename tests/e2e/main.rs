//! End-to-end tests: real `proteus serve` and `proteus-agent` processes, real Postgres, real
//! LocalStack. Run through `scripts/test`, which starts the services and exports their URLs.

mod api_contract;
mod bootstrap;
mod command;
mod crash;
mod dashboard;
mod demo;
mod eviction;
mod failover;
mod flexrr;
mod follow;
mod localstack;
mod parity;
mod pg_restart;
mod pipeline;
mod sim;
mod single_broker;
mod tls;
mod torchrun;
mod work;
