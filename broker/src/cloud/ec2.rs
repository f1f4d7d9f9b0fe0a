//! The EC2 driver (aws-sdk-ec2): real AWS through the default credential chain, or LocalStack
//! through `AWS_ENDPOINT_URL`.
//!
//! - On-demand: RunInstances. Spot: RunInstances with spot market options (max price = bid,
//!   one-time, terminate on interruption), or RequestSpotInstances (`--spot-requests`).
//! - Every instance is tagged at launch ([`super::tags`]) and the broker's instance id is the
//!   ClientToken, so a retried launch is deduplicated on EC2. (LocalStack ignores ClientToken;
//!   recovery therefore matches by tag before it relaunches.)
//! - Warnings reach only the instance (its metadata endpoint), so they arrive through the
//!   agent; [`Cloud::events`] reports terminations seen by DescribeInstances, marking those whose
//!   state reason is a spot interruption as ended by the provider.

use super::{Cloud, CloudError, CloudEvent, CloudInstance, CloudState, LaunchSpec, tags};
use crate::market::{Region, Timestamp};
use async_trait::async_trait;
use aws_sdk_ec2::Client;
use aws_sdk_ec2::error::ProvideErrorMetadata;
use aws_sdk_ec2::types::{
    Filter, IamInstanceProfileSpecification, InstanceInterruptionBehavior,
    InstanceMarketOptionsRequest, InstanceStateName, InstanceType, MarketType, Placement,
    RequestSpotLaunchSpecification, ResourceType, SpotInstanceType, SpotMarketOptions,
    SpotPlacement, Tag, TagSpecification,
};
use base64::Engine;
use proteus_wire::{JobId, Tier};
use std::collections::HashMap;
use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The agent's launch script: fetches `proteus-agent` from the broker and runs it as a systemd
/// service with its per-instance token. `{{BROKER_URL}}` and `{{TOKEN}}` are filled in.
pub const USER_DATA_TEMPLATE: &str = include_str!("user_data.sh");

/// How the driver launches.
#[derive(Debug, Clone)]
pub struct Ec2Config {
    pub region: Region,
    pub ami: String,
    pub subnet: Option<String>,
    pub security_groups: Vec<String>,
    pub instance_profile: Option<String>,
    pub key_name: Option<String>,
    pub spot_requests: bool,
    /// What the launched agents call.
    pub broker_url: String,
    /// A private CA's PEM certificate for the agents to trust the broker's HTTPS by (written to
    /// `/etc/proteus/broker-ca.pem` by the user data); `None`: the VM's system roots.
    pub ca_pem: Option<String>,
    /// Tags every instance and scopes every listing, so that several brokers (or a test's
    /// brokers) can share an account without taking each other's instances for leaks.
    pub deployment: String,
}

/// The EC2 cloud.
pub struct Ec2Cloud {
    client: Client,
    config: Ec2Config,
    /// Instances seen alive, so a later sighting as terminated becomes one [`CloudEvent::Ended`].
    alive: Mutex<HashMap<String, ()>>,
    /// DescribeInstances at most this often from `events`: it is rate-limited on real accounts.
    describe_every: Duration,
    last_describe: Mutex<Option<Instant>>,
}

impl fmt::Debug for Ec2Cloud {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ec2Cloud")
            .field("region", &self.config.region)
            .finish()
    }
}

impl Ec2Cloud {
    pub async fn new(config: Ec2Config) -> Self {
        let client = crate::prices::ec2::client(&config.region).await;
        Ec2Cloud {
            client,
            config,
            alive: Mutex::new(HashMap::new()),
            describe_every: Duration::from_secs(2),
            last_describe: Mutex::new(None),
        }
    }

    fn user_data(&self, token: &str) -> String {
        let script = USER_DATA_TEMPLATE
            .replace("{{BROKER_URL}}", &self.config.broker_url)
            .replace("{{CA_PEM}}", self.config.ca_pem.as_deref().unwrap_or(""))
            .replace("{{TOKEN}}", token);
        base64::engine::general_purpose::STANDARD.encode(script)
    }

    fn tag_spec(&self, resource: ResourceType, spec: &LaunchSpec) -> TagSpecification {
        let tag = |k: &str, v: String| Tag::builder().key(k).value(v).build();
        TagSpecification::builder()
            .resource_type(resource)
            .tags(tag(tags::MANAGED, self.config.deployment.clone()))
            .tags(tag(tags::INSTANCE_ID, spec.instance_id.clone()))
            .tags(tag(tags::JOB_ID, spec.job_id.to_string()))
            .tags(tag(tags::TIER, spec.tier.to_string()))
            .tags(tag("Name", format!("proteus-{}", spec.instance_id)))
            .build()
    }

    async fn run_instances(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        let mut req = self
            .client
            .run_instances()
            .image_id(&self.config.ami)
            .instance_type(InstanceType::from(spec.market.instance_type.as_str()))
            .min_count(1)
            .max_count(1)
            .client_token(&spec.instance_id)
            .placement(
                Placement::builder()
                    .availability_zone(spec.market.zone.as_str())
                    .build(),
            )
            .tag_specifications(self.tag_spec(ResourceType::Instance, spec))
            .user_data(self.user_data(&spec.bootstrap_token))
            .set_subnet_id(self.config.subnet.clone())
            .set_key_name(self.config.key_name.clone());
        for sg in &self.config.security_groups {
            req = req.security_group_ids(sg);
        }
        if let Some(profile) = &self.config.instance_profile {
            req = req.iam_instance_profile(
                IamInstanceProfileSpecification::builder()
                    .name(profile)
                    .build(),
            );
        }
        if let (Tier::Transient, Some(bid)) = (spec.tier, spec.bid) {
            req = req.instance_market_options(
                InstanceMarketOptionsRequest::builder()
                    .market_type(MarketType::Spot)
                    .spot_options(
                        SpotMarketOptions::builder()
                            .max_price(format!("{:.6}", bid.get()))
                            .spot_instance_type(SpotInstanceType::OneTime)
                            .instance_interruption_behavior(InstanceInterruptionBehavior::Terminate)
                            .build(),
                    )
                    .build(),
            );
        }
        let out = req.send().await.map_err(|e| launch_error(&e, spec))?;
        let instance = out.instances().first().ok_or_else(|| CloudError::Call {
            operation: "RunInstances",
            message: "the answer holds no instance".into(),
        })?;
        let cloud_id = instance.instance_id().unwrap_or_default().to_string();
        self.alive
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(cloud_id.clone(), ());
        Ok(CloudInstance {
            cloud_id,
            instance_id: Some(spec.instance_id.clone()),
            job_id: Some(spec.job_id),
            state: CloudState::Pending,
            launched: instance.launch_time().and_then(to_timestamp),
            ended_by_provider: false,
        })
    }

    async fn request_spot(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        let bid = spec.bid.ok_or_else(|| CloudError::Call {
            operation: "RequestSpotInstances",
            message: "a spot request needs a bid".into(),
        })?;
        let mut launch = RequestSpotLaunchSpecification::builder()
            .image_id(&self.config.ami)
            .instance_type(InstanceType::from(spec.market.instance_type.as_str()))
            .placement(
                SpotPlacement::builder()
                    .availability_zone(spec.market.zone.as_str())
                    .build(),
            )
            .user_data(self.user_data(&spec.bootstrap_token))
            .set_subnet_id(self.config.subnet.clone())
            .set_key_name(self.config.key_name.clone());
        for sg in &self.config.security_groups {
            launch = launch.security_group_ids(sg);
        }
        let out = self
            .client
            .request_spot_instances()
            .spot_price(format!("{:.6}", bid.get()))
            .instance_count(1)
            .r#type(SpotInstanceType::OneTime)
            .client_token(&spec.instance_id)
            .launch_specification(launch.build())
            .tag_specifications(self.tag_spec(ResourceType::SpotInstancesRequest, spec))
            .send()
            .await
            .map_err(|e| launch_error(&e, spec))?;
        let request_id = out
            .spot_instance_requests()
            .first()
            .and_then(|r| r.spot_instance_request_id())
            .unwrap_or_default()
            .to_string();
        // Wait (bounded) for the request to be fulfilled, then tag the instance itself.
        for _ in 0..30 {
            let described = self
                .client
                .describe_spot_instance_requests()
                .spot_instance_request_ids(&request_id)
                .send()
                .await
                .map_err(|e| call_error("DescribeSpotInstanceRequests", &e))?;
            if let Some(cloud_id) = described
                .spot_instance_requests()
                .first()
                .and_then(|r| r.instance_id())
            {
                let tagging = self.tag_spec(ResourceType::Instance, spec);
                self.client
                    .create_tags()
                    .resources(cloud_id)
                    .set_tags(Some(tagging.tags().to_vec()))
                    .send()
                    .await
                    .map_err(|e| call_error("CreateTags", &e))?;
                self.alive
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(cloud_id.to_string(), ());
                return Ok(CloudInstance {
                    cloud_id: cloud_id.to_string(),
                    instance_id: Some(spec.instance_id.clone()),
                    job_id: Some(spec.job_id),
                    state: CloudState::Pending,
                    launched: None,
                    ended_by_provider: false,
                });
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let _ = self
            .client
            .cancel_spot_instance_requests()
            .spot_instance_request_ids(&request_id)
            .send()
            .await;
        Err(CloudError::InsufficientCapacity {
            market: spec.market.to_string(),
            message: format!("spot request {request_id} not fulfilled within 60 s; cancelled"),
        })
    }

    async fn describe_all(&self) -> Result<Vec<CloudInstance>, CloudError> {
        let mut pages = self
            .client
            .describe_instances()
            .filters(
                Filter::builder()
                    .name(format!("tag:{}", tags::MANAGED))
                    .values(&self.config.deployment)
                    .build(),
            )
            .into_paginator()
            .send();
        let mut out = Vec::new();
        while let Some(page) = pages.next().await {
            let page = page.map_err(|e| call_error("DescribeInstances", &e))?;
            for reservation in page.reservations() {
                for i in reservation.instances() {
                    let tag = |k: &str| {
                        i.tags()
                            .iter()
                            .find(|t| t.key() == Some(k))
                            .and_then(|t| t.value())
                            .map(str::to_string)
                    };
                    let state = match i.state().and_then(|s| s.name()) {
                        Some(InstanceStateName::Pending) => CloudState::Pending,
                        Some(InstanceStateName::Running) => CloudState::Running,
                        Some(InstanceStateName::ShuttingDown) => CloudState::ShuttingDown,
                        Some(InstanceStateName::Terminated) => CloudState::Terminated,
                        // Stopping/stopped instances do no work: for the broker they are gone.
                        _ => CloudState::ShuttingDown,
                    };
                    let reason = i.state_reason().and_then(|r| r.code()).unwrap_or_default();
                    out.push(CloudInstance {
                        cloud_id: i.instance_id().unwrap_or_default().to_string(),
                        instance_id: tag(tags::INSTANCE_ID),
                        job_id: tag(tags::JOB_ID).and_then(|j| j.parse().ok()).map(JobId),
                        state,
                        launched: i.launch_time().and_then(to_timestamp),
                        ended_by_provider: reason.starts_with("Server.SpotInstance"),
                    });
                }
            }
        }
        Ok(out)
    }

    /// Checks each EC2 action the broker uses with `DryRun`, as the account is set up.
    pub async fn dry_run(&self) -> DryRunReport {
        let mut checks = Vec::new();
        let verdict = |r: Result<(), String>| r;
        macro_rules! check {
            ($action:literal, $call:expr) => {{
                let result = match $call.await {
                    Ok(_) => Ok(()),
                    Err(e) => match e.code() {
                        Some("DryRunOperation") => Ok(()),
                        Some(code) => Err(format!("{code}: {}", e.message().unwrap_or(""))),
                        None => Err(aws_sdk_ec2::error::DisplayErrorContext(&e).to_string()),
                    },
                };
                checks.push(($action, verdict(result)));
            }};
        }
        let ty = InstanceType::from("t3.micro");
        check!(
            "ec2:DescribeInstances",
            self.client.describe_instances().dry_run(true).send()
        );
        check!(
            "ec2:DescribeSpotPriceHistory",
            self.client
                .describe_spot_price_history()
                .dry_run(true)
                .max_results(5)
                .send()
        );
        check!(
            "ec2:RunInstances",
            self.client
                .run_instances()
                .dry_run(true)
                .image_id(&self.config.ami)
                .instance_type(ty.clone())
                .min_count(1)
                .max_count(1)
                .set_subnet_id(self.config.subnet.clone())
                .send()
        );
        check!(
            "ec2:CreateTags",
            self.client
                .create_tags()
                .dry_run(true)
                .resources("i-00000000000000000")
                .tags(
                    Tag::builder()
                        .key(tags::MANAGED)
                        .value(&self.config.deployment)
                        .build()
                )
                .send()
        );
        check!(
            "ec2:TerminateInstances",
            self.client
                .terminate_instances()
                .dry_run(true)
                .instance_ids("i-00000000000000000")
                .send()
        );
        check!(
            "ec2:DescribeSpotInstanceRequests",
            self.client
                .describe_spot_instance_requests()
                .dry_run(true)
                .send()
        );
        DryRunReport { checks }
    }
}

/// The outcome of `serve --cloud ec2 --dry-run`.
#[derive(Debug)]
pub struct DryRunReport {
    pub checks: Vec<(&'static str, Result<(), String>)>,
}

impl DryRunReport {
    /// Whether every action was allowed. An error other than a permission error (e.g. an AMI
    /// that does not exist) also counts as a failure: the launch would fail the same way.
    pub fn all_allowed(&self) -> bool {
        self.checks.iter().all(|(_, r)| r.is_ok())
    }
}

impl fmt::Display for DryRunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (action, result) in &self.checks {
            match result {
                Ok(()) => writeln!(f, "ok       {action}")?,
                Err(e) if e.starts_with("UnauthorizedOperation") => {
                    writeln!(f, "MISSING  {action}: {e}")?
                }
                Err(e) => writeln!(f, "FAILED   {action}: {e}")?,
            }
        }
        Ok(())
    }
}

fn to_timestamp(t: &aws_sdk_ec2::primitives::DateTime) -> Option<Timestamp> {
    t.to_millis().ok().map(Timestamp::from_millis)
}

fn call_error<E: ProvideErrorMetadata + std::error::Error + 'static>(
    operation: &'static str,
    e: &E,
) -> CloudError {
    CloudError::Call {
        operation,
        message: match (e.code(), e.message()) {
            (Some(c), Some(m)) => format!("{c}: {m}"),
            _ => aws_sdk_ec2::error::DisplayErrorContext(e).to_string(),
        },
    }
}

/// Maps EC2's capacity and price errors to the kinds the scheduler cools markets down for.
fn launch_error<E: ProvideErrorMetadata + std::error::Error + 'static>(
    e: &E,
    spec: &LaunchSpec,
) -> CloudError {
    let message = e.message().unwrap_or("").to_string();
    let market = spec.market.to_string();
    match e.code() {
        Some("InsufficientInstanceCapacity")
        | Some("InsufficientCapacity")
        | Some("Unsupported") => CloudError::InsufficientCapacity { market, message },
        Some("MaxSpotInstanceCountExceeded")
        | Some("InstanceLimitExceeded")
        | Some("VcpuLimitExceeded") => CloudError::SpotQuotaExceeded { message },
        Some("SpotMaxPriceTooLow") => CloudError::PriceTooLow { market, message },
        Some("IdempotentParameterMismatch") => CloudError::IdempotentParameterMismatch { message },
        _ => call_error("RunInstances", e),
    }
}

#[async_trait]
impl Cloud for Ec2Cloud {
    fn kind(&self) -> &'static str {
        "ec2"
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        if spec.tier == Tier::Transient && self.config.spot_requests {
            self.request_spot(spec).await
        } else {
            self.run_instances(spec).await
        }
    }

    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError> {
        if cloud_ids.is_empty() {
            return Ok(());
        }
        match self
            .client
            .terminate_instances()
            .set_instance_ids(Some(cloud_ids.to_vec()))
            .send()
            .await
        {
            Ok(_) => Ok(()),
            // Already gone is what we wanted. A call naming several instances fails whole when
            // one of them is unknown: end the others one by one.
            Err(e) if e.code() == Some("InvalidInstanceID.NotFound") => {
                if cloud_ids.len() > 1 {
                    for id in cloud_ids {
                        self.terminate(std::slice::from_ref(id)).await?;
                    }
                }
                Ok(())
            }
            Err(e) => Err(call_error("TerminateInstances", &e)),
        }
    }

    async fn describe(&self) -> Result<Vec<CloudInstance>, CloudError> {
        let all = self.describe_all().await?;
        let mut alive = self.alive.lock().unwrap_or_else(|e| e.into_inner());
        for i in all.iter().filter(|i| !i.state.is_gone()) {
            alive.insert(i.cloud_id.clone(), ());
        }
        Ok(all)
    }

    async fn events(&self) -> Result<Vec<CloudEvent>, CloudError> {
        {
            let mut last = self.last_describe.lock().unwrap_or_else(|e| e.into_inner());
            if last.is_some_and(|t| t.elapsed() < self.describe_every) {
                return Ok(Vec::new());
            }
            *last = Some(Instant::now());
        }
        let all = self.describe_all().await?;
        tracing::debug!(listed = all.len(), states = ?all.iter().map(|i| (&i.cloud_id, i.state)).collect::<Vec<_>>(), "DescribeInstances");
        let now = Timestamp::now();
        let mut alive = self.alive.lock().unwrap_or_else(|e| e.into_inner());
        let mut events = Vec::new();
        for i in &all {
            if i.state.is_gone() {
                if alive.remove(&i.cloud_id).is_some() {
                    events.push(CloudEvent::Ended {
                        cloud_id: i.cloud_id.clone(),
                        at: now,
                        by_provider: i.ended_by_provider,
                    });
                }
            } else {
                alive.insert(i.cloud_id.clone(), ());
            }
        }
        // Instances that vanished from the listing altogether are gone too.
        let listed: std::collections::HashSet<&str> =
            all.iter().map(|i| i.cloud_id.as_str()).collect();
        let vanished: Vec<String> = alive
            .keys()
            .filter(|k| !listed.contains(k.as_str()))
            .cloned()
            .collect();
        for cloud_id in vanished {
            alive.remove(&cloud_id);
            events.push(CloudEvent::Ended {
                cloud_id,
                at: now,
                by_provider: false,
            });
        }
        Ok(events)
    }
}
