//! `proteus-agent`: runs on every VM of a Proteus job. See [`proteus_agent::cli`].

fn main() -> std::process::ExitCode {
    proteus_agent::cli::main_from(std::env::args_os())
}
