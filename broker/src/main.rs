//! `proteus`: the broker's command line. All logic lives in the library.

use clap::Parser;
use proteus_broker::cli::{Cli, init_tracing, run};
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.global);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
