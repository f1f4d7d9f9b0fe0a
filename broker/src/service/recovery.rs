//! After a crash, or when this broker takes over jobs whose owner died: rebuild the in-memory
//! view of those jobs from the store and the cloud's tags.
//!
//! Every instance the broker ever meant to buy has a row written before the cloud was asked.
//! Matching rows with the cloud's tagged instances decides, for each: adopt what was launched,
//! launch what never was (under the same id, so real EC2 deduplicates by client token, and a
//! describe-first check covers LocalStack, which does not), finish terminations that were in
//! flight, record what vanished, and terminate anything tagged as Proteus's that no live row
//! claims. Nothing is launched twice for one decision.
//!
//! Recovery acts only on the jobs this broker holds the lease of (every write carries it), and
//! never ends an instance of a job another live broker owns.

use super::{Broker, ServiceError};
use crate::cloud::CloudInstance;
use crate::store::InstanceState;
use proteus_wire::JobId;
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// What recovery did, for the log and the tests.
#[derive(Debug, Default, Clone, Serialize, PartialEq)]
pub struct RecoveryReport {
    pub adopted: u32,
    pub relaunched: u32,
    pub ended: u32,
    pub terminated_leaks: u32,
    pub terminations_resumed: u32,
}

impl Broker {
    /// At start: joins the brokers on the database, takes back the jobs this broker (the same
    /// state directory) owned and claims those whose owner's lease expired, and recovers them.
    pub async fn recover(&self) -> Result<RecoveryReport, ServiceError> {
        self.join().await?;
        self.renew_leases().await?;
        self.claim_share().await?;
        let jobs = self.membership().jobs();
        self.recover_jobs(&jobs).await
    }

    /// Recovers `jobs` (whose leases this broker holds): their coordinators and runtimes, and
    /// their instances reconciled with the cloud by tag.
    pub async fn recover_jobs(
        &self,
        jobs: &HashSet<JobId>,
    ) -> Result<RecoveryReport, ServiceError> {
        let mut report = RecoveryReport::default();
        let now = self.clock.now();
        // Control planes first: agents that outlived the crash poll as soon as the API is up,
        // and must find their job's coordinator, not a "job over".
        for id in jobs {
            let Some(job) = self.store.job(*id).await? else {
                continue;
            };
            if job.state.is_over() {
                continue;
            }
            if let Err(e) = self.ensure_runtime(&job) {
                tracing::warn!(job = %job.id, error = %e, "cannot resume a job; the scheduler will fail it");
            }
        }
        let described = self.cloud.describe().await.map_err(|e| {
            ServiceError::Internal(format!("cannot list the cloud's instances: {e}"))
        })?;
        let by_tag: HashMap<&str, &CloudInstance> = described
            .iter()
            .filter_map(|c| c.instance_id.as_deref().map(|id| (id, c)))
            .collect();
        let all_rows = self.store.live_instances().await?;
        let rows: Vec<_> = all_rows
            .iter()
            .filter(|r| jobs.contains(&r.job_id))
            .cloned()
            .collect();
        for row in &rows {
            let lease = self.fence(row.job_id)?;
            let ci = by_tag.get(row.id.as_str()).copied();
            let job_over = match self.store.job(row.job_id).await? {
                Some(j) => j.state.is_over(),
                None => true,
            };
            match (row.state, ci) {
                (InstanceState::Requested, Some(ci)) if !ci.state.is_gone() => {
                    self.store
                        .mark_launched(
                            Some(&lease),
                            &row.id,
                            &ci.cloud_id,
                            ci.launched.unwrap_or(now),
                        )
                        .await?;
                    let row = self
                        .store
                        .instance(&row.id)
                        .await?
                        .unwrap_or_else(|| row.clone());
                    self.adopt(&row, &ci.cloud_id).await?;
                    report.adopted += 1;
                    if job_over {
                        self.terminate_instance(&row, "job over").await?;
                    }
                }
                (InstanceState::Requested, _) if job_over => {
                    self.store
                        .mark_ended(Some(&lease), &row.id, now, "never launched", false, None)
                        .await?;
                    report.ended += 1;
                }
                (InstanceState::Requested, _) => {
                    // The same ClientToken (the id) with the same parameters and user data (the
                    // token stored with the intent): if the first call did reach the cloud and
                    // its instance is not listed yet, EC2 answers with that instance.
                    let row = match &row.launch_token {
                        Some(token) => {
                            self.launch_recorded(row, token, now).await?;
                            row.clone()
                        }
                        // An intent stored before launch tokens were kept: a new bootstrap
                        // token (EC2 refuses it with IdempotentParameterMismatch if the first
                        // call landed; the instance is then ended as a leak).
                        None => {
                            let token = crate::api::auth::new_token(
                                proteus_wire::agent_api::BOOTSTRAP_TOKEN_PREFIX,
                            );
                            let hash = crate::api::auth::hash_token(&token);
                            self.store
                                .set_bootstrap(Some(&lease), &row.id, &token, &hash)
                                .await?;
                            let row = row.clone().carrying(token.clone(), hash);
                            self.launch_recorded(&row, &token, now).await?;
                            row
                        }
                    };
                    tracing::info!(instance = %row.id, "relaunched an intent the cloud does not list");
                    report.relaunched += 1;
                }
                (InstanceState::Terminating, ci) => {
                    match ci {
                        Some(ci) if !ci.state.is_gone() => {
                            self.fence(row.job_id)?;
                            if let Err(e) = self
                                .cloud
                                .terminate(std::slice::from_ref(&ci.cloud_id))
                                .await
                            {
                                tracing::warn!(instance = %row.id, error = %e, "terminate failed again");
                            }
                        }
                        _ => {
                            self.on_ended(row, now, false, now).await?;
                        }
                    }
                    report.terminations_resumed += 1;
                }
                (_, Some(ci)) if !ci.state.is_gone() => {
                    self.adopt(row, &ci.cloud_id).await?;
                    report.adopted += 1;
                    if job_over && row.stop_by.is_none() {
                        // The job ended (e.g. a cancel) before its instances were released.
                        // (One being stopped gracefully is ended by `finish_stops`.)
                        self.terminate_instance(row, "job over").await?;
                        report.terminations_resumed += 1;
                    }
                }
                (_, ci) => {
                    let by_provider = ci.is_some_and(|c| c.ended_by_provider);
                    self.on_ended(row, now, by_provider, now).await?;
                    report.ended += 1;
                }
            }
        }
        // Any live record, whoever owns its job, claims its instance.
        let claimed: HashSet<&str> = all_rows.iter().map(|r| r.id.as_str()).collect();
        for ci in described.iter().filter(|c| !c.state.is_gone()) {
            let ours = ci
                .instance_id
                .as_deref()
                .is_some_and(|id| claimed.contains(id));
            // A leak is ended only when its job is one of these, or nobody's: never an
            // instance another live broker may be about to record.
            let leaked = !ours
                && match ci.job_id {
                    Some(job) if jobs.contains(&job) => true,
                    Some(job) => match self.store.job(job).await? {
                        None => true,
                        Some(j) => j.state.is_over() && j.lease_owner.is_none(),
                    },
                    None => true,
                };
            if leaked {
                // One of these jobs' is ended under its lease; nobody's, as the deployment's.
                let lease = match ci.job_id {
                    Some(job) if jobs.contains(&job) => Some(self.fence(job)?),
                    _ => None,
                };
                tracing::warn!(cloud_id = %ci.cloud_id, tag = ?ci.instance_id, "terminating an instance no live record claims");
                if let Err(e) = self
                    .cloud
                    .terminate(std::slice::from_ref(&ci.cloud_id))
                    .await
                {
                    tracing::warn!(cloud_id = %ci.cloud_id, error = %e, "cannot terminate leaked instance");
                }
                self.store
                    .add_event(
                        lease.as_ref(),
                        ci.job_id,
                        ci.instance_id.as_deref(),
                        now,
                        "leak_terminated",
                        &format!("{} had no live record", ci.cloud_id),
                    )
                    .await?;
                report.terminated_leaks += 1;
            }
        }
        tracing::info!(?report, "recovered state from the store and the cloud");
        Ok(report)
    }

    /// Takes an instance that is running in the cloud back under management: its identity for
    /// the agent API and, when agents are local, its agent process (re-adopted if still alive,
    /// started again with a fresh token if not).
    async fn adopt(
        &self,
        row: &crate::store::InstanceRow,
        cloud_id: &str,
    ) -> Result<(), ServiceError> {
        let mut row = row.clone();
        if let Some(launcher) = &self.launcher
            && !launcher.has_live_process(&row.id, row.agent_pid)
        {
            let token = crate::api::auth::new_token("pa_");
            row.token_hash = crate::api::auth::hash_token(&token);
            self.store
                .set_token_hash(Some(&self.fence(row.job_id)?), &row.id, &row.token_hash)
                .await?;
            self.remember_agent_row(cloud_id, &row);
            self.start_local_agent(&row, cloud_id, &token).await?;
            return Ok(());
        }
        self.remember_agent_row(cloud_id, &row);
        self.start_local_agent(&row, cloud_id, "").await
    }
}
