//! Helpers shared by the benchmark programs.
#![allow(dead_code)]

pub mod cpu_limit;
pub mod plot;

use proteus_agent::testing::ImdsMock;
use std::process::{Child, Command, Stdio};

pub const DATA_DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../data/ml");

/// An agent process, killed on drop.
pub struct Proc(pub Child, pub ImdsMock);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub async fn spawn_agent(broker: &str, name: &str, imds_poll_ms: u64) -> Proc {
    spawn_agent_polling(broker, name, Some(imds_poll_ms)).await
}

/// An agent polling its metadata every `imds_poll_ms`, or at the agent's default when `None`
/// (no `--imds-poll-ms` is passed, so the figure is what a deployed agent does).
pub async fn spawn_agent_polling(broker: &str, name: &str, imds_poll_ms: Option<u64>) -> Proc {
    let imds = ImdsMock::start(name).await.expect("imds mock");
    let poll: Vec<String> = imds_poll_ms
        .map(|ms| vec!["--imds-poll-ms".to_string(), ms.to_string()])
        .unwrap_or_default();
    let child = Command::new(env!("CARGO_BIN_EXE_proteus-agent"))
        .args(["--broker", broker, "--token", &format!("tok-{name}")])
        .args(["--imds-endpoint", &imds.url()])
        .args(&poll)
        .env_remove("PROTEUS_AGENT_IMDS_POLL_MS")
        .args([
            "--data-dir",
            DATA_DIR,
            "--listen",
            "127.0.0.1:0",
            "--exit-margin-secs",
            "1",
        ])
        .args(["--log", "info"])
        .stdout(Stdio::null())
        .stderr(log_file(name))
        .spawn()
        .expect("agent binary");
    Proc(child, imds)
}

/// Agent logs go to `$TMPDIR/proteus-bench-<name>.log` for post-mortems.
fn log_file(name: &str) -> Stdio {
    let path = std::env::temp_dir().join(format!("proteus-bench-{name}.log"));
    std::fs::File::create(path).map_or(Stdio::null(), Stdio::from)
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// CPU seconds (user + system) this process has used, from /proc (0 where unavailable): lets a
/// benchmark on a shared machine report work per CPU-second, which other load does not distort.
pub fn cpu_seconds() -> f64 {
    proc_cpu_seconds("self")
}

/// CPU seconds of process `pid` ("self" for this one).
pub fn proc_cpu_seconds(pid: &str) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The 1-minute load average, printed with results: on a shared 2-core machine it says how
/// much of the machine the benchmark really had.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}
