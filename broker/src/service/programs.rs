//! Command jobs on the broker's side: where agents put and fetch checkpoints, the output tails
//! they send, and what users read back (`GET /v1/jobs/{id}/logs`, `proteus logs JOB`).

use super::{Broker, ServiceError};
use crate::checkpoint::{CheckpointError, ProgramStorage};
use proteus_wire::JobId;
use proteus_wire::agent_api::{CheckpointOp, CheckpointTransfer};
use std::path::PathBuf;

/// Ranks a checkpoint can belong to (a job has at most 1000 instances).
const MAX_RANK: u32 = 1000;

/// One instance's output tail.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct OutputView {
    pub instance_id: String,
    pub output: String,
}

/// Which `s3://` working directories this broker signs a download of with its own S3
/// credentials: objects in its checkpoint store's bucket outside the checkpoint prefix, and in
/// the buckets named by `--workdir-buckets`; never anything in the checkpoint store itself
/// (other jobs' checkpoints).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkdirPolicy {
    /// The checkpoint store's bucket and key prefix (no slashes around it), when it is S3.
    checkpoints: Option<(String, String)>,
    /// Further buckets the operator allows.
    buckets: Vec<String>,
}

impl WorkdirPolicy {
    /// From `--checkpoint-store` (`s3://bucket/prefix` or a directory) and `--workdir-buckets`.
    /// The error names the bucket that is not one.
    pub fn new(checkpoint_store: Option<&str>, buckets: &[String]) -> Result<Self, String> {
        let checkpoints = match checkpoint_store.filter(|s| s.starts_with("s3://")) {
            Some(spec) => {
                let (bucket, prefix) = crate::checkpoint::parse_s3_url(spec)?;
                Some((bucket.to_string(), prefix.trim_matches('/').to_string()))
            }
            None => None,
        };
        let mut names = Vec::new();
        for b in buckets.iter().map(|b| b.trim()).filter(|b| !b.is_empty()) {
            match crate::checkpoint::parse_s3_url(&format!("s3://{b}")) {
                Ok((name, "")) => names.push(name.to_string()),
                _ => {
                    return Err(format!(
                        "`{b}` is not an S3 bucket name (3–63 of a-z, 0-9, `-`, `.`)"
                    ));
                }
            }
        }
        Ok(WorkdirPolicy {
            checkpoints,
            buckets: names,
        })
    }

    /// Whether the broker may sign `url` (an `s3://bucket/key` the job spec named); the error
    /// says why not, naming only what the job sent.
    pub fn check(&self, url: &str) -> Result<(), String> {
        let (bucket, key) = crate::checkpoint::parse_s3_url(url)?;
        if let Some((own, prefix)) = &self.checkpoints
            && bucket == own
            && (prefix.is_empty() || key == prefix || key.starts_with(&format!("{prefix}/")))
        {
            return Err(format!(
                "`{url}` is inside this broker's checkpoint store, which holds the jobs' \
                 checkpoints; put the working directory somewhere else"
            ));
        }
        let allowed = self.checkpoints.iter().map(|(b, _)| b).chain(&self.buckets);
        if !allowed.into_iter().any(|b| b == bucket) {
            return Err(format!(
                "bucket `{bucket}` is not one this broker signs working directories from \
                 (its checkpoint bucket, and those of `proteus serve --workdir-buckets`)"
            ));
        }
        Ok(())
    }
}

fn storage_error(e: CheckpointError) -> ServiceError {
    match e {
        CheckpointError::TooLarge(_) => ServiceError::TooLarge(e.to_string()),
        CheckpointError::QuotaExceeded { .. } => ServiceError::InsufficientStorage(e.to_string()),
        other => ServiceError::Internal(other.to_string()),
    }
}

impl Broker {
    /// The command jobs' storage; set once when the broker starts (`--checkpoint-store`).
    pub fn set_program_storage(&self, storage: ProgramStorage) {
        let _ = self.programs.set(storage);
    }

    fn programs(&self) -> Result<&ProgramStorage, ServiceError> {
        self.programs.get().ok_or_else(|| {
            ServiceError::Unavailable("this broker has no checkpoint store configured".into())
        })
    }

    fn checked_rank(rank: u32) -> Result<u32, ServiceError> {
        if rank >= MAX_RANK {
            return Err(ServiceError::invalid(
                "rank",
                format!("must be below {MAX_RANK}"),
            ));
        }
        Ok(rank)
    }

    /// Only the instance holding `rank` (working, or leaving and saving) may replace its
    /// checkpoint, so a rank's checkpoint is only ever replaced by a newer one of the same
    /// lineage: a former holder, or an instance that never held it, is refused (409).
    fn check_rank_holder(&self, job: JobId, cloud_id: &str, rank: u32) -> Result<(), ServiceError> {
        let id = proteus_wire::InstanceId(cloud_id.to_string());
        let holds = self
            .control
            .get(job)
            .is_some_and(|c| c.read(|c| c.holds_rank(&id, rank)));
        if holds {
            return Ok(());
        }
        Err(ServiceError::Refused(format!(
            "instance {cloud_id} does not hold rank {rank}: only the rank's holder replaces its \
             checkpoint"
        )))
    }

    /// Where the agent behind `cloud_id` puts or fetches `rank`'s checkpoint of its own job.
    pub async fn agent_checkpoint_transfer(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        rank: u32,
        op: CheckpointOp,
    ) -> Result<CheckpointTransfer, ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let rank = Self::checked_rank(rank)?;
        if op == CheckpointOp::Upload {
            self.check_rank_holder(identity.job_id, cloud_id, rank)?;
        }
        self.programs()?
            .checkpoints
            .transfer(
                &proteus_wire::InstanceId(cloud_id.to_string()),
                identity.job_id,
                rank,
                op,
            )
            .await
            .map_err(storage_error)
    }

    /// Where the agent behind `cloud_id` fetches its command job's `s3://` working directory
    /// (a presigned `GET`; see [`crate::checkpoint::CheckpointStore::workdir_transfer`]).
    pub async fn agent_workdir_transfer(
        &self,
        token: Option<&str>,
        cloud_id: &str,
    ) -> Result<CheckpointTransfer, ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let job = self
            .store
            .job(identity.job_id)
            .await?
            .ok_or_else(|| ServiceError::NotFound("unknown job".into()))?;
        let runtime = self.ensure_runtime(&job)?;
        let workdir = match &runtime
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .valid
            .training
            .app
        {
            proteus_wire::agent_api::AppConfig::Command(c) => c.workdir.clone(),
            _ => None,
        };
        let url = workdir.filter(|w| w.starts_with("s3://")).ok_or_else(|| {
            ServiceError::NotFound(format!("job {} has no s3:// working directory", job.id))
        })?;
        // Checked again here: the job may have been accepted under another configuration.
        self.settings
            .workdir
            .check(&url)
            .map_err(|e| ServiceError::Forbidden(format!("job {}: {e}", job.id)))?;
        self.programs()?
            .checkpoints
            .workdir_transfer(&url)
            .await
            .map_err(|e| match e {
                // A broker restarted without S3 since the job was accepted.
                CheckpointError::Config(..) => ServiceError::Unavailable(e.to_string()),
                other => storage_error(other),
            })
    }

    /// Refuses a command job whose `s3://` working directory this broker cannot sign for
    /// (its checkpoint store is a directory), at submission rather than on every instance.
    pub(crate) fn check_workdir_signable(
        &self,
        app: &proteus_wire::agent_api::AppConfig,
    ) -> Result<(), ServiceError> {
        let proteus_wire::agent_api::AppConfig::Command(c) = app else {
            return Ok(());
        };
        let Some(url) = c.workdir.as_deref().filter(|w| w.starts_with("s3://")) else {
            return Ok(());
        };
        const NO_S3: &str = "an s3:// working directory needs a broker started with \
             `--checkpoint-store s3://…` (its credentials sign the agents' download); give an \
             absolute local path";
        let allowed = self.settings.workdir.check(url);
        let signable = self.programs.get().is_some_and(|p| p.checkpoints.is_s3());
        // Without S3 credentials nothing can be signed: that comes first, it is the fix.
        let message = match (signable, allowed) {
            (true, Ok(())) => return Ok(()),
            (true, Err(e)) => e,
            (false, Ok(())) => NO_S3.to_string(),
            (false, Err(e)) => format!("{NO_S3}; and {e}"),
        };
        Err(ServiceError::invalid("command.workdir", message))
    }

    /// The directory store's upload: the archive replaces `rank`'s checkpoint atomically. An
    /// upload that `declared` its length is refused before its body is read when that is over
    /// the per-upload limit or the job's quota.
    pub async fn agent_checkpoint_put<S, E>(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        rank: u32,
        declared: Option<u64>,
        body: S,
    ) -> Result<u64, ServiceError>
    where
        S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let rank = Self::checked_rank(rank)?;
        self.check_rank_holder(identity.job_id, cloud_id, rank)?;
        let dir = self.programs()?.checkpoints.dir().ok_or_else(|| {
            ServiceError::BadRequest("checkpoints go to S3 here: ask /checkpoint for a URL".into())
        })?;
        if let Some(declared) = declared {
            dir.check_declared(identity.job_id, rank, declared)
                .await
                .map_err(storage_error)?;
        }
        dir.write(identity.job_id, rank, body)
            .await
            .map_err(storage_error)
    }

    /// The directory store's download: the file of `rank`'s newest checkpoint, if any.
    pub async fn agent_checkpoint_file(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        rank: u32,
    ) -> Result<Option<PathBuf>, ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let rank = Self::checked_rank(rank)?;
        let dir = self.programs()?.checkpoints.dir().ok_or_else(|| {
            ServiceError::BadRequest(
                "checkpoints come from S3 here: ask /checkpoint for a URL".into(),
            )
        })?;
        let path = dir.path(identity.job_id, rank);
        Ok(path.is_file().then_some(path))
    }

    /// An agent's newest output tail.
    pub async fn agent_output(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        text: &str,
    ) -> Result<(), ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let lease = self.fence(identity.job_id)?;
        self.store
            .put_output(
                Some(&lease),
                identity.job_id,
                &identity.instance_id,
                crate::checkpoint::tail(text),
            )
            .await?;
        Ok(())
    }

    /// Every instance's output tail of a job (empty for jobs that are not command jobs).
    pub async fn job_outputs(&self, id: JobId) -> Result<Vec<OutputView>, ServiceError> {
        if self.store.job(id).await?.is_none() {
            return Err(ServiceError::NoSuchJob(id));
        }
        let outputs = self.store.outputs_of_job(id).await?;
        Ok(outputs
            .into_iter()
            .map(|(instance_id, output)| OutputView {
                instance_id,
                output,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workdirs_come_from_allowed_buckets_and_never_from_the_checkpoint_store() {
        let policy =
            WorkdirPolicy::new(Some("s3://ck-bucket/proteus/"), &["team-code".into()]).unwrap();
        // The checkpoint bucket outside its prefix, and the listed buckets.
        for ok in [
            "s3://ck-bucket/programs/train.tar.gz",
            "s3://ck-bucket/proteus-other/train.tar.gz",
            "s3://team-code/a/b.tgz",
        ] {
            assert_eq!(policy.check(ok), Ok(()), "{ok}");
        }
        // Other jobs' checkpoints (and anything else under the checkpoint prefix).
        for inside in [
            "s3://ck-bucket/proteus/job-1/rank-0.tar.gz",
            "s3://ck-bucket/proteus/x.tgz",
        ] {
            let e = policy.check(inside).unwrap_err();
            assert!(e.contains("inside this broker's checkpoint store"), "{e}");
            assert!(!e.contains("proteus/ "), "{e}");
        }
        // Any other bucket the broker's credentials might read.
        let e = policy
            .check("s3://someone-elses/secret.tar.gz")
            .unwrap_err();
        assert!(
            e.contains("bucket `someone-elses`") && e.contains("--workdir-buckets"),
            "{e}"
        );
        assert!(policy.check("https://x/y.tar.gz").is_err());

        // A checkpoint store at a bucket's root: the whole bucket is checkpoints.
        let root = WorkdirPolicy::new(Some("s3://ck-bucket"), &[]).unwrap();
        assert!(root.check("s3://ck-bucket/programs/train.tar.gz").is_err());
        // No S3 checkpoint store and no list: no bucket at all.
        let none = WorkdirPolicy::new(Some("/var/lib/proteus/checkpoints"), &[]).unwrap();
        assert!(none.check("s3://ck-bucket/programs/train.tar.gz").is_err());
        assert_eq!(none, WorkdirPolicy::default());
        // The flag's values are bucket names, checked at start.
        let e = WorkdirPolicy::new(None, &["ok-bucket".into(), "Bad_Bucket".into()]).unwrap_err();
        assert!(e.contains("`Bad_Bucket`"), "{e}");
        assert!(WorkdirPolicy::new(None, &["b/with/key".into()]).is_err());
        let listed = WorkdirPolicy::new(None, &[" team-code ".into(), String::new()]).unwrap();
        assert_eq!(listed.check("s3://team-code/t.tar.gz"), Ok(()));
    }
}
