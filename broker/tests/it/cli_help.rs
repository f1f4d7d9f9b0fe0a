//! What the CLI's help and argument checks tell a user, through the real binary.

use std::process::{Command, Output};

fn proteus(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_proteus"))
        .args(args)
        .env("PROTEUS_LOG", "warn")
        .env_remove("PROTEUS_URL")
        .env_remove("PROTEUS_DATABASE_URL")
        .output()
        .expect("run proteus")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn only_the_commands_that_open_the_database_offer_database_url() {
    for client in ["submit", "status", "report", "cancel", "interrupt", "logs"] {
        let help = text(&proteus(&[client, "--help"]));
        assert!(help.contains("--url"), "{client}: {help}");
        assert!(!help.contains("--database-url"), "{client}: {help}");
    }
    for owner in [
        vec!["serve"],
        vec!["demo"],
        vec!["db", "migrate"],
        vec!["prices", "stats"],
        vec!["prices", "ingest"],
    ] {
        let mut args = owner.clone();
        args.push("--help");
        let help = text(&proteus(&args));
        assert!(help.contains("--database-url"), "{owner:?}: {help}");
    }
}

#[test]
fn a_broker_url_without_a_scheme_or_with_a_path_says_what_to_write() {
    let out = proteus(&["status", "--url", "127.0.0.1:8080"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("write http://127.0.0.1:8080"),
        "{}",
        text(&out)
    );
    let out = proteus(&["report", "3", "--url", "http://broker:8080/v1"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("without a path") && text(&out).contains("write http://broker:8080"),
        "{}",
        text(&out)
    );
}
