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
        if !c.workdir.as_deref().is_some_and(|w| w.starts_with("s3://")) {
            return Ok(());
        }
        if self.programs.get().is_some_and(|p| p.checkpoints.is_s3()) {
            return Ok(());
        }
        Err(ServiceError::invalid(
            "command.workdir",
            "an s3:// working directory needs a broker started with `--checkpoint-store \
             s3://…` (its credentials sign the agents' download); give an absolute local path",
        ))
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
        self.programs()?
            .write_output(identity.job_id, &identity.instance_id, text)
            .await
            .map_err(storage_error)
    }

    /// Every instance's output tail of a job (empty for jobs that are not command jobs).
    pub async fn job_outputs(&self, id: JobId) -> Result<Vec<OutputView>, ServiceError> {
        if self.store.job(id).await?.is_none() {
            return Err(ServiceError::NoSuchJob(id));
        }
        let Some(storage) = self.programs.get() else {
            return Ok(Vec::new());
        };
        let outputs = storage
            .outputs(id)
            .await
            .map_err(|e| ServiceError::Internal(e.to_string()))?;
        Ok(outputs
            .into_iter()
            .map(|(instance_id, output)| OutputView {
                instance_id,
                output,
            })
            .collect())
    }
}
