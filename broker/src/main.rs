//! `proteus`: the broker's command line. All logic lives in the library.

use clap::Parser;
use proteus_broker::cli::{Cli, init_tracing_for, run};
use std::process::ExitCode;

fn main() -> ExitCode {
    // `proteus agent …` is the agent itself (what `proteus-agent` runs), so that one binary is
    // enough where instances are local processes (the demo, the simulated cloud).
    let mut args = std::env::args_os();
    if std::env::args_os().nth(1).is_some_and(|a| a == "agent") {
        let _ = args.next();
        let _ = args.next();
        return proteus_agent::cli::main_from(
            std::iter::once(std::ffi::OsString::from("proteus agent")).chain(args),
        );
    }
    let cli = Cli::parse();
    if cli.command.prints_for_a_reader() {
        // Like any Unix tool, a command whose reader went away (`proteus logs 7 | head -1`)
        // ends quietly by SIGPIPE instead of failing on a broken pipe. Not `serve` or `demo`:
        // a server must survive a client or agent that hung up.
        // SAFETY: restoring the default action of a signal, before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    init_tracing_for(&cli.global, &cli.command);
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
