//! `launcher = "torchrun"`: the program runs under torchrun's elastic agent, one worker per
//! instance, all instances of the job in one c10d rendezvous (see docs/command-jobs.md).
//!
//! - The rendezvous (torch's TCPStore) is hosted by the torchrun of the member the view names
//!   ([`ClusterView::rendezvous_host`]: a reliable-tier worker), at that member's `data_addr`;
//!   its torchrun gets `is_host=1`, every other `is_host=0` (so on one machine, where every
//!   address is loopback, only the host binds the port). Spot nodes come and go; the store stays.
//! - torchrun is started through [`SHIM`], which makes a warned node *leave* the rendezvous on
//!   SIGTERM instead of closing it for everyone, and ties workers to torchrun's life.
//! - `--nnodes=MIN:MAX` is the job's `min_workers` to its `limits.max_instances`; a new round
//!   completes once MAX nodes joined or [`LAST_CALL_SECS`] after MIN did.

use proteus_wire::InstanceId;
use proteus_wire::agent_api::{ClusterView, CommandConfig};

/// The launcher script (`python3 SHIM <torchrun args>`), written beside the checkpoint directory.
pub const SHIM: &str = include_str!("torchrun_shim.py");

/// How long a new round waits for more nodes once it has `MIN` (torch's default: 30 s). This is
/// most of the time survivors spend re-forming after a node left.
pub const LAST_CALL_SECS: u32 = 2;

/// torchrun's restarts of its workers. Every membership change that kills a collective costs
/// one (a survivor's worker fails when its peer leaves), so this is large; failures of the
/// program itself count against the job's `max_restarts` only when torchrun gives up.
pub const TORCHRUN_MAX_RESTARTS: u32 = 1000;

/// Set for torchrun unless the job's `env` says otherwise. torch 2.4+ lets the workers'
/// process group reuse the rendezvous store under the prefix `attempt_<restart count>`; the
/// count is each node's own, so after nodes restarted different numbers of times (failures
/// count, membership changes do not) the workers of one round wait forever under different
/// prefixes (seen here: `wait timeout ... keys: //worker/attempt_2/...`). Unshared, rank 0
/// opens a fresh store for every round.
pub const UNSHARED_STORE: (&str, &str) = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1");

/// Where this instance's torchrun meets the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// `host:port` of the TCPStore.
    pub endpoint: String,
    /// This instance hosts it.
    pub is_host: bool,
}

/// The rendezvous of `view` as `me` sees it; `None` while nobody works.
pub fn rendezvous(view: &ClusterView, me: &InstanceId) -> Option<Rendezvous> {
    let host = view.rendezvous_host()?;
    Some(Rendezvous {
        endpoint: host.data_addr.clone(),
        is_host: &host.instance_id == me,
    })
}

/// The full argv: `python3 SHIM torchrun-args --no-python run...`. `python3` is looked up on
/// the program's `PATH` (a virtualenv's `bin` first in `command.env.PATH` selects it).
pub fn argv(
    cfg: &CommandConfig,
    shim: &str,
    rdzv: &Rendezvous,
    job_id: i64,
    min_nodes: u32,
) -> Vec<String> {
    let min = min_nodes.clamp(1, cfg.max_nodes.max(1));
    let mut argv = vec![
        "python3".to_string(),
        shim.to_string(),
        format!("--nnodes={min}:{}", cfg.max_nodes.max(min)),
        "--nproc-per-node=1".into(),
        "--rdzv-backend=c10d".into(),
        format!("--rdzv-endpoint={}", rdzv.endpoint),
        format!("--rdzv-id=proteus-job-{job_id}"),
        format!(
            "--rdzv-conf=is_host={},last_call_timeout={LAST_CALL_SECS}",
            u8::from(rdzv.is_host)
        ),
        format!("--max-restarts={TORCHRUN_MAX_RESTARTS}"),
        "--monitor-interval=0.5".into(),
        "--no-python".into(),
    ];
    argv.extend(cfg.run.iter().cloned());
    argv
}

#[cfg(test)]
mod tests {
    use super::*;
    use proteus_wire::Tier;
    use proteus_wire::agent_api::{MemberInfo, PartitionRange, Stage, WorkerAssignment};

    fn view(members: &[(&str, Tier)]) -> ClusterView {
        ClusterView {
            epoch: 1,
            stage: Stage::Stage2,
            founders: Vec::new(),
            pipeline: None,
            profiler: None,
            members: members
                .iter()
                .enumerate()
                .map(|(i, (id, tier))| MemberInfo {
                    instance_id: InstanceId(id.to_string()),
                    tier: *tier,
                    data_addr: format!("10.0.0.{i}:7000"),
                    draining: false,
                })
                .collect(),
            shards: vec![],
            workers: members
                .iter()
                .enumerate()
                .map(|(r, (id, _))| WorkerAssignment {
                    instance_id: InstanceId(id.to_string()),
                    rank: r as u32,
                    partitions: PartitionRange { start: 0, end: 1 },
                })
                .collect(),
            num_partitions: 1,
            model_len: 1,
        }
    }

    #[test]
    fn the_reliable_worker_hosts_the_rendezvous_and_everyone_agrees() {
        let v = view(&[
            ("i-a", Tier::Transient),
            ("i-b", Tier::Reliable),
            ("i-c", Tier::Transient),
        ]);
        let seen: Vec<Rendezvous> = ["i-a", "i-b", "i-c"]
            .iter()
            .map(|me| rendezvous(&v, &InstanceId(me.to_string())).unwrap())
            .collect();
        assert!(seen.iter().all(|r| r.endpoint == "10.0.0.1:7000"));
        assert_eq!(
            seen.iter().map(|r| r.is_host).collect::<Vec<_>>(),
            [false, true, false]
        );
        // No reliable member: the first worker hosts it.
        let spot = view(&[("i-a", Tier::Transient), ("i-c", Tier::Transient)]);
        assert_eq!(
            rendezvous(&spot, &InstanceId("i-a".into())).unwrap(),
            Rendezvous {
                endpoint: "10.0.0.0:7000".into(),
                is_host: true
            }
        );
    }

    #[test]
    fn torchrun_gets_the_elastic_range_the_endpoint_and_the_program() {
        let cfg: CommandConfig = serde_json::from_value(serde_json::json!({
            "run": ["python3", "train.py", "--lr", "0.1"],
            "launcher": "torchrun",
            "max_nodes": 3,
        }))
        .unwrap();
        let rdzv = Rendezvous {
            endpoint: "10.0.0.1:7000".into(),
            is_host: false,
        };
        let a = argv(&cfg, "/s/shim.py", &rdzv, 42, 1);
        assert_eq!(&a[..2], ["python3", "/s/shim.py"]);
        for want in [
            "--nnodes=1:3",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=10.0.0.1:7000",
            "--rdzv-id=proteus-job-42",
            "--rdzv-conf=is_host=0,last_call_timeout=2",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} missing from {a:?}");
        }
        let np = a.iter().position(|x| x == "--no-python").unwrap();
        assert_eq!(&a[np + 1..], ["python3", "train.py", "--lr", "0.1"]);
    }
}
