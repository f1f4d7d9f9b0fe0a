//! A client command whose reader went away (`proteus openapi | true`) ends quietly, as Unix
//! tools do: killed by SIGPIPE or exit 0, never a panic or a "Broken pipe" error.

use crate::support::{ON_DEMAND_2015, TRACE_2015, data};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

/// Runs `proteus args` with its stdout a pipe whose read end is already closed.
fn into_a_closed_pipe(args: &[&str]) -> (std::process::ExitStatus, String) {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(args)
        .env("PROTEUS_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(writer)
        .stderr(Stdio::piped())
        .output()
        .expect("run proteus");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn client_commands_end_quietly_when_their_reader_is_gone() {
    let trace = data(TRACE_2015).display().to_string();
    let on_demand = data(ON_DEMAND_2015).display().to_string();
    let job = format!("{}/../examples/jobs/demo.toml", env!("CARGO_MANIFEST_DIR"));
    let cases: Vec<Vec<&str>> = vec![
        vec!["openapi"],
        vec![
            "simulate",
            "--trace",
            &trace,
            "--on-demand",
            &on_demand,
            "--job",
            &job,
            "--policy",
            "bidbrain",
            "--output",
            "json",
        ],
    ];
    for args in cases {
        let (status, err) = into_a_closed_pipe(&args);
        assert!(
            status.signal() == Some(libc::SIGPIPE) || status.code() == Some(0),
            "{args:?}: {status:?}\n{err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
    }
}
