//! The agent side of the API: authentication by per-instance token, then registration,
//! heartbeats, command long-polls and events, all applied to the job's coordinator.
//!
//! A token is valid only for the instance it was issued to (and so only for that instance's
//! job), and only while that instance lives: 401 without a token or with an unknown one, 403
//! with another instance's token or the token of an instance that has ended.

use super::control::wall_ms;
use super::{Broker, ServiceError, metrics::Metrics};
use crate::api::auth::{hash_token, hashes_match};
use crate::market::Timestamp;
use crate::store::InstanceRow;
use proteus_wire::agent_api::{
    AgentEvent, BOOTSTRAP_TOKEN_PREFIX, BootstrapRequest, BootstrapResponse, CommandEnvelope,
    ExitReason, Heartbeat, MAX_FAILURE_MESSAGE, RegisterRequest, RegisterResponse,
};
use proteus_wire::coordinator::CoordinatorError;
use proteus_wire::{InstanceId, JobId, Tier};
use std::time::Duration;

/// What the broker knows about the agent behind a cloud instance id.
#[derive(Debug, Clone)]
pub struct AgentIdentity {
    /// The broker's instance id.
    pub instance_id: String,
    pub job_id: JobId,
    pub tier: Tier,
    pub token_hash: String,
}

impl From<&InstanceRow> for AgentIdentity {
    fn from(row: &InstanceRow) -> Self {
        AgentIdentity {
            instance_id: row.id.clone(),
            job_id: row.job_id,
            tier: row.tier,
            token_hash: row.token_hash.clone(),
        }
    }
}

impl Broker {
    /// Checks an agent's token against the instance it claims to be.
    pub async fn authenticate_agent(
        &self,
        token: Option<&str>,
        cloud_id: &str,
    ) -> Result<AgentIdentity, ServiceError> {
        let token = token.ok_or_else(|| {
            ServiceError::Unauthenticated("missing `Authorization: Bearer <instance token>`".into())
        })?;
        let hash = hash_token(token);
        let cached = self
            .agent_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(cloud_id)
            .cloned();
        let identity = match cached {
            Some(i) if hashes_match(&hash, &i.token_hash) => Some(i),
            // A cached identity whose token has changed since (the bootstrap token traded on
            // another broker, a token rotated at adoption): read the instance again.
            Some(_) => {
                self.forget_agent(cloud_id);
                self.load_identity(cloud_id, &hash).await?
            }
            None => self.load_identity(cloud_id, &hash).await?,
        };
        if let Some(identity) = identity
            && hashes_match(&hash, &identity.token_hash)
        {
            // Only the job's owner controls its agents; another broker sends them on (421),
            // and they try the next broker URL they were given.
            self.fence(identity.job_id)?;
            return Ok(identity);
        }
        // Wrong token for this instance: is it somebody else's?
        match self.store.instance_by_token_hash(&hash).await? {
            Some(_) => Err(ServiceError::Forbidden(format!(
                "this token does not belong to instance {cloud_id}"
            ))),
            None => Err(ServiceError::Unauthenticated(
                "invalid instance token".into(),
            )),
        }
    }

    /// The identity of the live instance the cloud calls `cloud_id`, from the store (and then
    /// cached); None when there is none. Err(ended) when it has ended and `hash` is its token.
    async fn load_identity(
        &self,
        cloud_id: &str,
        hash: &str,
    ) -> Result<Option<AgentIdentity>, ServiceError> {
        // Not a name any cloud gives an instance (and Postgres could not even look up one with
        // a NUL in it): no such instance.
        if !plausible_cloud_id(cloud_id) {
            return Ok(None);
        }
        Ok(match self.store.instance_by_cloud_id(cloud_id).await? {
            // An ended instance's token dies with it: its row is never cached, whoever
            // asks with whatever token (live instances are cached, and leave the cache
            // when they end).
            Some(r) if r.state.is_final() => {
                if hashes_match(hash, &r.token_hash) {
                    return Err(ended(cloud_id));
                }
                None
            }
            Some(r) => {
                let identity = AgentIdentity::from(&r);
                self.agent_cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(cloud_id.to_string(), identity.clone());
                // The instance may have ended between the read and the insert, after its
                // end took it out of the cache: look again, so that no ended instance
                // stays cached.
                if self
                    .store
                    .instance_by_cloud_id(cloud_id)
                    .await?
                    .is_none_or(|now| now.state.is_final())
                {
                    self.forget_agent(cloud_id);
                    if hashes_match(hash, &identity.token_hash) {
                        return Err(ended(cloud_id));
                    }
                    None
                } else {
                    Some(identity)
                }
            }
            None => None,
        })
    }

    /// Checks that `token` is the token of some live instance, before the request says which
    /// (registration names its instance in the body, read only after this check).
    pub async fn authenticate_agent_token(&self, token: Option<&str>) -> Result<(), ServiceError> {
        let token = token.ok_or_else(|| {
            ServiceError::Unauthenticated("missing `Authorization: Bearer <instance token>`".into())
        })?;
        match self
            .store
            .instance_by_token_hash(&hash_token(token))
            .await?
        {
            Some(row) if row.state.is_final() => Err(ServiceError::Forbidden(
                "this instance has ended; its token is no longer valid".into(),
            )),
            Some(_) => Ok(()),
            None => Err(ServiceError::Unauthenticated(
                "invalid instance token".into(),
            )),
        }
    }

    /// What a booting instance may fetch (the agent binary, data sets): with its agent token,
    /// or with its bootstrap token until that is traded.
    pub async fn authenticate_download(&self, token: Option<&str>) -> Result<(), ServiceError> {
        if let Some(t) = token
            && t.starts_with(BOOTSTRAP_TOKEN_PREFIX)
        {
            return match self
                .store
                .instance_by_bootstrap_hash(&hash_token(t))
                .await?
            {
                Some(row) if row.state.is_final() || row.bootstrap_used.is_some() => {
                    Err(ServiceError::Forbidden(
                        "this bootstrap token has been exchanged (or its instance has ended); \
                         use the agent token"
                            .into(),
                    ))
                }
                Some(_) => Ok(()),
                None => Err(ServiceError::Unauthenticated(
                    "invalid bootstrap token".into(),
                )),
            };
        }
        self.authenticate_agent_token(token).await
    }

    /// Checks that `token` is a bootstrap token some instance was issued, before the exchange's
    /// body is read.
    pub async fn authenticate_bootstrap(&self, token: Option<&str>) -> Result<(), ServiceError> {
        match token.filter(|t| t.starts_with(BOOTSTRAP_TOKEN_PREFIX)) {
            Some(t)
                if self
                    .store
                    .instance_by_bootstrap_hash(&hash_token(t))
                    .await?
                    .is_some() =>
            {
                Ok(())
            }
            _ => Err(ServiceError::Unauthenticated(
                "missing or invalid `Authorization: Bearer <bootstrap token>` (the pb_… token in \
                 the instance's user data)"
                    .into(),
            )),
        }
    }

    /// An agent's first contact: its instance's one-time bootstrap token (from the user data,
    /// which stays readable for the instance's life) for a new agent token. Only for the
    /// instance the token was issued to, and only once: a second exchange is refused (403)
    /// and recorded in the job's events, since it means the user data was read by someone
    /// else (or the agent lost the answer and must be replaced).
    pub async fn agent_bootstrap(
        &self,
        token: Option<&str>,
        req: BootstrapRequest,
    ) -> Result<BootstrapResponse, ServiceError> {
        self.authenticate_bootstrap(token).await?;
        let hash = hash_token(token.unwrap_or_default());
        let row = self
            .store
            .instance_by_bootstrap_hash(&hash)
            .await?
            .ok_or_else(|| ServiceError::Unauthenticated("invalid bootstrap token".into()))?;
        let cloud_id = req.instance_id.0.as_str();
        if !plausible_cloud_id(cloud_id) {
            return Err(ServiceError::invalid(
                "instance_id",
                "the instance id from instance metadata (1–256 characters, no control character)",
            ));
        }
        let refuse = |why: String| ServiceError::Forbidden(why);
        if row.state.is_final() {
            return Err(refuse(format!(
                "instance {} has ended; its bootstrap token is dead",
                row.id
            )));
        }
        // Only the job's owner changes its instances; another broker sends the agent on (421).
        let lease = self.fence(row.job_id)?;
        // Launched, but the answer not recorded yet (the broker crashed in between; recovery
        // adopts the instance by its tag): the agent asks again.
        if row.cloud_id.is_none() {
            return Err(ServiceError::Unavailable(format!(
                "the launch of instance {} is not recorded yet; ask again shortly",
                row.id
            )));
        }
        if row.cloud_id.as_deref() != Some(cloud_id) {
            let why = format!(
                "a bootstrap token of instance {} ({}) was presented for instance {cloud_id}: refused",
                row.id,
                row.cloud_id.as_deref().unwrap_or_default()
            );
            self.record_refused_bootstrap(&lease, &row, &why).await?;
            return Err(refuse(why));
        }
        let agent_token = crate::api::auth::new_token("pa_");
        let now = self.clock.now();
        let exchanged = self
            .store
            .exchange_bootstrap(
                Some(&lease),
                &row.id,
                cloud_id,
                &hash_token(&agent_token),
                now,
            )
            .await?;
        if !exchanged {
            let first = self
                .store
                .instance(&row.id)
                .await?
                .and_then(|r| r.bootstrap_used)
                .map_or_else(|| "before".to_string(), |t| format!("at {t}"));
            let why = format!(
                "a second exchange of instance {cloud_id}'s bootstrap token (first exchanged \
                 {first}) was refused: its user data may have been read by someone else"
            );
            self.record_refused_bootstrap(&lease, &row, &why).await?;
            return Err(refuse(why));
        }
        // The identity cached for this instance (if any) carries the old, unheld token hash.
        self.forget_agent(cloud_id);
        self.store
            .add_event(
                Some(&lease),
                Some(row.job_id),
                Some(&row.id),
                now,
                "agent_bootstrapped",
                &format!("instance {cloud_id} traded its bootstrap token for its agent token"),
            )
            .await?;
        Ok(BootstrapResponse { token: agent_token })
    }

    async fn record_refused_bootstrap(
        &self,
        lease: &crate::store::Lease,
        row: &InstanceRow,
        why: &str,
    ) -> Result<(), ServiceError> {
        tracing::warn!(instance = %row.id, job = %row.job_id, "{why}");
        super::metrics::Metrics::inc(&self.metrics.bootstrap_refused);
        self.store
            .add_event(
                Some(lease),
                Some(row.job_id),
                Some(&row.id),
                self.clock.now(),
                "bootstrap_refused",
                why,
            )
            .await?;
        Ok(())
    }

    fn forget_agent(&self, cloud_id: &str) {
        self.agent_cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(cloud_id);
    }

    pub async fn agent_register(
        &self,
        token: Option<&str>,
        req: RegisterRequest,
    ) -> Result<RegisterResponse, ServiceError> {
        let identity = self.authenticate_agent(token, &req.instance_id.0).await?;
        if req.data_addr.is_empty()
            || req.data_addr.len() > 256
            || req
                .data_addr
                .chars()
                .any(|c| c.is_control() || c.is_whitespace())
        {
            return Err(ServiceError::invalid(
                "data_addr",
                "the `host:port` on which the agent's peers reach it",
            ));
        }
        let row = self
            .store
            .instance(&identity.instance_id)
            .await?
            .ok_or_else(|| ServiceError::NotFound("unknown instance".into()))?;
        if row.state.is_final() {
            return Err(ServiceError::Refused(format!(
                "instance {} has ended",
                req.instance_id
            )));
        }
        let job = self
            .store
            .job(identity.job_id)
            .await?
            .ok_or_else(|| ServiceError::NotFound("unknown job".into()))?;
        if job.state.is_over() {
            return Err(CoordinatorError::JobOver(job.id).into());
        }
        self.ensure_runtime(&job)
            .map_err(|e| ServiceError::Internal(e.to_string()))?;
        let control = self
            .control
            .get(job.id)
            .ok_or(CoordinatorError::JobOver(job.id))?;
        let data_addr = req.data_addr.clone();
        let vcpus = req.vcpus;
        let response = control
            .update(|c| c.register(req.clone(), identity.tier, wall_ms()))
            .inspect_err(|e| {
                if let CoordinatorError::ProtocolMismatch { agent, broker } = e {
                    tracing::warn!(instance = %req.instance_id, agent, broker,
                        agent_version = %req.agent_version,
                        "refused an agent of another protocol version");
                }
            })?;
        self.save_control(job.id).await?;
        let now = self.clock.now();
        self.store
            .upsert_agent(&identity.instance_id, job.id, &data_addr, vcpus, now)
            .await?;
        // A registration is never refused for the job's event count, but is not logged past it.
        match self.check_event_room(job.id).await {
            Ok(()) => {
                self.store
                    .add_event(
                        Some(&self.fence(job.id)?),
                        Some(job.id),
                        Some(&identity.instance_id),
                        now,
                        "agent_registered",
                        &format!("data plane at {data_addr}"),
                    )
                    .await?
            }
            Err(ServiceError::TooMany(why)) => {
                tracing::warn!(instance = %identity.instance_id, "registration not logged: {why}")
            }
            Err(other) => return Err(other),
        }
        Ok(response)
    }

    pub async fn agent_heartbeat(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        hb: Heartbeat,
    ) -> Result<(), ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let control = self.control_of(identity.job_id)?;
        control
            .update_quietly(|c| c.heartbeat(&InstanceId(cloud_id.to_string()), hb, wall_ms()))?;
        Ok(())
    }

    pub async fn agent_commands(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        after: u64,
        wait_ms: u64,
    ) -> Result<Vec<CommandEnvelope>, ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        let control = self.control_of(identity.job_id)?;
        let wait =
            Duration::from_millis(wait_ms.min(proteus_wire::agent_api::default_command_wait_ms()));
        control
            .wait_commands(&InstanceId(cloud_id.to_string()), after, wait)
            .await
            .map_err(ServiceError::from)
    }

    pub async fn agent_event(
        &self,
        token: Option<&str>,
        cloud_id: &str,
        event: AgentEvent,
    ) -> Result<(), ServiceError> {
        let identity = self.authenticate_agent(token, cloud_id).await?;
        check_event_text(&event)?;
        // `program_idle` is bookkeeping between agent and coordinator (an idle agent says so at
        // every layout), not history: it is neither kept nor counted against the job's events.
        if let AgentEvent::ProgramIdle { .. } = event {
            let control = self.control_of(identity.job_id)?;
            control.update(|c| c.event(&InstanceId(cloud_id.to_string()), event, wall_ms()))?;
            return self.save_control(identity.job_id).await;
        }
        self.check_event_room(identity.job_id).await?;
        let now = self.clock.now();
        let (kind, mut detail) = describe(&in_market_time(&event, now, self.clock.speed()));
        // A command job's agent has no model: its readiness says what it is ready for.
        if let AgentEvent::Ready { .. } = event
            && self.control.get(identity.job_id).is_some_and(|c| {
                c.read(|c| {
                    matches!(
                        c.training().app,
                        proteus_wire::agent_api::AppConfig::Command(_)
                    )
                })
            })
        {
            detail = "ready to run the program".into();
        }
        // Each of these may end something now (the job; a graceful stop waits for its agent
        // to leave): the scheduler runs at once, not at its next tick.
        let wake = matches!(
            event,
            AgentEvent::TrainingComplete { .. }
                | AgentEvent::InterruptionWarning { .. }
                | AgentEvent::ProgramExited { .. }
                | AgentEvent::Exit { .. }
        );
        let warning = matches!(event, AgentEvent::InterruptionWarning { .. });
        // The coordinator first: it refuses an instance that is not a member of the job (and
        // events it cannot take), and nothing is logged for a refused event.
        if let Some(control) = self.control.get(identity.job_id) {
            control.update(|c| c.event(&InstanceId(cloud_id.to_string()), event, wall_ms()))?;
        }
        let lease = self.fence(identity.job_id)?;
        self.store
            .add_event(
                Some(&lease),
                Some(identity.job_id),
                Some(&identity.instance_id),
                now,
                kind,
                &detail,
            )
            .await?;
        if warning
            && self
                .store
                .mark_warned(Some(&lease), &identity.instance_id, now, None)
                .await?
        {
            self.status_cache.invalidate();
            Metrics::inc(&self.metrics.warnings);
        }
        self.save_control(identity.job_id).await?;
        if wake {
            self.nudge.notify_one();
        }
        Ok(())
    }

    /// 429 once a job has as many events as the broker keeps per job: an agent cannot fill
    /// the database.
    async fn check_event_room(&self, job: JobId) -> Result<(), ServiceError> {
        let max = self.settings.max_job_events;
        if self.store.event_count_of_job(job).await? >= i64::from(max) {
            return Err(ServiceError::TooMany(format!(
                "job {job} has {max} events, the most this broker keeps per job \
                 (`proteus serve --max-job-events`); this event was not recorded"
            )));
        }
        Ok(())
    }

    fn control_of(
        &self,
        job: JobId,
    ) -> Result<std::sync::Arc<super::control::JobControl>, ServiceError> {
        self.control
            .get(job)
            .ok_or(ServiceError::Coordinator(CoordinatorError::JobOver(job)))
    }
}

fn ended(cloud_id: &str) -> ServiceError {
    ServiceError::Forbidden(format!(
        "instance {cloud_id} has ended; its token is no longer valid"
    ))
}

/// Whether `id` could be a cloud's instance id (`i-0abc…`, `sim-…`): short, printable.
fn plausible_cloud_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= 256 && !id.chars().any(char::is_control)
}

/// The texts of an event go into the event log as they are: no control characters (a NUL
/// cannot even be stored in Postgres).
/// Every text of every kind of event is checked (the match has no catch-all, so a new kind
/// must say which of its fields are texts): at most 256 characters, or
/// [`MAX_FAILURE_MESSAGE`] for an exit's failure message, which may also span lines.
fn check_event_text(event: &AgentEvent) -> Result<(), ServiceError> {
    let short = |field: &'static str, text: &str| {
        let fine = text.chars().count() <= 256 && !text.chars().any(char::is_control);
        (!fine).then(|| {
            ServiceError::invalid(
                field,
                "at most 256 characters, none of them a control character",
            )
        })
    };
    let problem = match event {
        AgentEvent::InterruptionWarning {
            action,
            action_time,
        } => short("action", action).or_else(|| short("action_time", action_time)),
        AgentEvent::RebalanceRecommendation { notice_time } => {
            notice_time.as_deref().and_then(|t| short("notice_time", t))
        }
        AgentEvent::HandoverComplete { to, .. } => short("to", &to.0),
        AgentEvent::Exit {
            reason: ExitReason::Failed { message },
        } => {
            let fine = message.chars().count() <= MAX_FAILURE_MESSAGE
                && !message
                    .chars()
                    .any(|c| c.is_control() && c != '\n' && c != '\t');
            (!fine).then(|| {
                ServiceError::invalid(
                    "reason.message",
                    format!(
                        "at most {MAX_FAILURE_MESSAGE} characters, no control characters but \
                         line breaks and tabs"
                    ),
                )
            })
        }
        AgentEvent::Exit {
            reason: ExitReason::Stopped | ExitReason::Interrupted,
        }
        | AgentEvent::Ready { .. }
        | AgentEvent::TrainingComplete { .. }
        | AgentEvent::PipelineResumed { .. }
        | AgentEvent::PipelineProfile { .. }
        | AgentEvent::ProgramIdle { .. }
        | AgentEvent::ProgramExited { .. } => None,
    };
    problem.map_or(Ok(()), Err)
}

/// `event` with the times an agent read from its instance's metadata (its wall clock) moved to
/// the broker's market clock, so a job's history reads in one clock: on the simulated cloud a
/// notice for two wall seconds from now is two market minutes from `now` at 60×. A time that
/// does not parse is left as the agent sent it.
fn in_market_time(event: &AgentEvent, now: Timestamp, speed: f64) -> AgentEvent {
    let market = |wall: &str| -> String {
        match chrono::DateTime::parse_from_rfc3339(wall) {
            Ok(t) if speed != 1.0 => {
                let ahead = (t.to_utc() - chrono::Utc::now()).num_milliseconds() as f64 / 1000.0;
                now.plus_secs(ahead * speed).to_string()
            }
            _ => wall.to_string(),
        }
    };
    match event {
        AgentEvent::InterruptionWarning {
            action,
            action_time,
        } => AgentEvent::InterruptionWarning {
            action: action.clone(),
            action_time: market(action_time),
        },
        AgentEvent::RebalanceRecommendation {
            notice_time: Some(t),
        } => AgentEvent::RebalanceRecommendation {
            notice_time: Some(market(t)),
        },
        other => other.clone(),
    }
}

fn describe(event: &AgentEvent) -> (&'static str, String) {
    match event {
        AgentEvent::InterruptionWarning {
            action,
            action_time,
        } => (
            "agent_interruption_notice",
            format!("{action} at {action_time}"),
        ),
        AgentEvent::RebalanceRecommendation { notice_time } => (
            "rebalance_recommendation",
            notice_time.clone().unwrap_or_else(|| "now".into()),
        ),
        AgentEvent::HandoverComplete { shard, to, seq } => (
            "handover_complete",
            format!("shard {shard} now served by {to} (up to update {seq})"),
        ),
        AgentEvent::Ready { model_len } => (
            "agent_ready",
            format!("model of {model_len} parameters loaded"),
        ),
        AgentEvent::TrainingComplete { metric } => (
            "training_complete",
            format!("{} {:.4}", metric.kind, metric.value),
        ),
        AgentEvent::PipelineResumed {
            segment,
            from,
            workers,
            pause_ms,
        } => (
            "pipeline_resumed",
            format!(
                "training again on plan {segment} (for {workers} workers) from minibatch {from}, \
                 {pause_ms} ms after the drain"
            ),
        ),
        AgentEvent::PipelineProfile { layers } => (
            "pipeline_profile",
            format!(
                "profile of {} layers: {:.2} ms a minibatch (forward, backward and update)",
                layers.len(),
                layers
                    .iter()
                    .map(|t| t.forward_ms + t.backward_ms + t.update_ms)
                    .sum::<f64>()
            ),
        ),
        AgentEvent::Exit { reason } => ("agent_exit", format!("{reason:?}")),
        AgentEvent::ProgramIdle { epoch } => (
            "program_idle",
            format!("no rank in layout {epoch} and no program running"),
        ),
        AgentEvent::ProgramExited {
            code,
            signal,
            after_notice,
            completes,
        } => (
            "program_exited",
            format!(
                "{}{}{}",
                match (code, signal) {
                    (Some(c), _) => format!("exit code {c}"),
                    (None, Some(s)) => format!("killed by signal {s}"),
                    _ => "unknown status".into(),
                },
                if *after_notice {
                    ", after a notice"
                } else {
                    ""
                },
                if *completes {
                    ", completing the job"
                } else {
                    ""
                },
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_no_cloud_gives_are_not_looked_up() {
        assert!(plausible_cloud_id("i-0123456789abcdef0"));
        assert!(plausible_cloud_id("sim-0000002a"));
        assert!(!plausible_cloud_id(""));
        assert!(!plausible_cloud_id("i-0\u{0}1"));
        assert!(plausible_cloud_id(&"i".repeat(256)));
        assert!(!plausible_cloud_id(&"i".repeat(257)));
    }

    #[test]
    fn an_agents_notice_time_is_shown_in_the_brokers_market_time() {
        let now = Timestamp::parse("2015-05-01T00:00:00Z").unwrap();
        let in_two_s = (chrono::Utc::now() + chrono::Duration::seconds(2))
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let warning = AgentEvent::InterruptionWarning {
            action: "terminate".into(),
            action_time: in_two_s.clone(),
        };
        // At 60×, two wall seconds ahead are two market minutes ahead (give or take the time
        // this test takes to get here).
        let AgentEvent::InterruptionWarning { action_time, .. } =
            in_market_time(&warning, now, 60.0)
        else {
            panic!("still a warning");
        };
        let at = Timestamp::parse(&action_time).unwrap();
        let ahead = at.secs_since(now);
        assert!(
            (100.0..=120.0).contains(&ahead),
            "{action_time}: {ahead} s ahead"
        );
        // On a real cloud both clocks are the wall's: nothing changes.
        assert_eq!(in_market_time(&warning, now, 1.0), warning);
        let garbled = AgentEvent::RebalanceRecommendation {
            notice_time: Some("soon".into()),
        };
        assert_eq!(in_market_time(&garbled, now, 60.0), garbled);
    }

    #[test]
    fn events_are_logged_under_their_kind_with_what_they_say() {
        use proteus_wire::agent_api::{ExitReason, Metric, MetricKind};
        let cases = [
            (
                AgentEvent::InterruptionWarning {
                    action: "terminate".into(),
                    action_time: "2015-05-01T00:02:00Z".into(),
                },
                "agent_interruption_notice",
                "terminate at 2015-05-01T00:02:00Z",
            ),
            (
                AgentEvent::RebalanceRecommendation { notice_time: None },
                "rebalance_recommendation",
                "now",
            ),
            (
                AgentEvent::RebalanceRecommendation {
                    notice_time: Some("2015-05-01T00:01:00Z".into()),
                },
                "rebalance_recommendation",
                "2015-05-01T00:01:00Z",
            ),
            (
                AgentEvent::HandoverComplete {
                    shard: 3,
                    to: InstanceId("sim-2".into()),
                    seq: 17,
                },
                "handover_complete",
                "shard 3 now served by sim-2 (up to update 17)",
            ),
            (
                AgentEvent::Ready { model_len: 785 },
                "agent_ready",
                "model of 785 parameters loaded",
            ),
            (
                AgentEvent::TrainingComplete {
                    metric: Metric {
                        kind: MetricKind::Accuracy,
                        value: 0.91234,
                        baseline: None,
                        clock: 9,
                    },
                },
                "training_complete",
                "accuracy 0.9123",
            ),
            (
                AgentEvent::PipelineResumed {
                    segment: 2,
                    from: 640,
                    workers: 3,
                    pause_ms: 40,
                },
                "pipeline_resumed",
                "training again on plan 2 (for 3 workers) from minibatch 640, 40 ms after the drain",
            ),
            (
                AgentEvent::Exit {
                    reason: ExitReason::Interrupted,
                },
                "agent_exit",
                "Interrupted",
            ),
            (
                AgentEvent::ProgramExited {
                    code: Some(0),
                    signal: None,
                    after_notice: false,
                    completes: true,
                },
                "program_exited",
                "exit code 0, completing the job",
            ),
            (
                AgentEvent::ProgramExited {
                    code: None,
                    signal: Some(15),
                    after_notice: true,
                    completes: false,
                },
                "program_exited",
                "killed by signal 15, after a notice",
            ),
            (
                AgentEvent::ProgramExited {
                    code: None,
                    signal: None,
                    after_notice: false,
                    completes: false,
                },
                "program_exited",
                "unknown status",
            ),
        ];
        for (event, kind, detail) in cases {
            assert_eq!(describe(&event), (kind, detail.to_string()), "{event:?}");
        }
    }

    #[test]
    fn event_texts_with_control_characters_are_refused() {
        let warning = |action: &str| AgentEvent::InterruptionWarning {
            action: action.into(),
            action_time: "2026-01-01T00:00:00Z".into(),
        };
        assert!(check_event_text(&warning("terminate")).is_ok());
        // An invalid field: the API answers 422 naming it.
        let field_of = |e: ServiceError| match e {
            ServiceError::Invalid { field, .. } => field,
            other => panic!("not an invalid field: {other:?}"),
        };
        let err = check_event_text(&warning("term\u{0}inate")).unwrap_err();
        assert_eq!(field_of(err), "action");
        let handover = AgentEvent::HandoverComplete {
            shard: 0,
            to: InstanceId("i-1\u{0}".into()),
            seq: 1,
        };
        assert_eq!(field_of(check_event_text(&handover).unwrap_err()), "to");
        assert!(check_event_text(&AgentEvent::Ready { model_len: 1 }).is_ok());
        assert!(check_event_text(&warning(&"t".repeat(256))).is_ok());
        assert_eq!(
            field_of(check_event_text(&warning(&"t".repeat(257))).unwrap_err()),
            "action"
        );
        let rebalance = AgentEvent::RebalanceRecommendation {
            notice_time: Some("2015\n".into()),
        };
        assert_eq!(
            field_of(check_event_text(&rebalance).unwrap_err()),
            "notice_time"
        );
        // An exit's failure message is checked too: longer, and it may span lines.
        let failed = |message: String| AgentEvent::Exit {
            reason: ExitReason::Failed { message },
        };
        assert!(check_event_text(&failed("no data\n\tat load".into())).is_ok());
        assert!(check_event_text(&failed("x".repeat(MAX_FAILURE_MESSAGE))).is_ok());
        for bad in [
            "x".repeat(MAX_FAILURE_MESSAGE + 1),
            "nul\u{0}".into(),
            "bell\u{7}".into(),
        ] {
            assert_eq!(
                field_of(check_event_text(&failed(bad.clone())).unwrap_err()),
                "reason.message",
                "{bad:?}"
            );
        }
        let stopped = AgentEvent::Exit {
            reason: ExitReason::Stopped,
        };
        assert!(check_event_text(&stopped).is_ok());
    }
}
