//! An MLP job's plans, computed where the job is coordinated: from the job's configuration
//! and a profile (pinned in the spec, or measured by the member the view names), one plan per
//! worker count up to the founders', in the wire's form. The broker runs [`plan_if_due`] after
//! every change of a job's coordinator (so does the agents' test coordinator); the members
//! train what the view then carries, so two jobs of the same spec and profile train the same
//! plans whatever their machines measured, and the plans survive any member.

use super::partition::{Link, Partitioner};
use super::{Plan, PlanError, StagePlan, profile};
use crate::apps::mlp::MlpShape;
use proteus_wire::agent_api::{
    AppConfig, PipelinePlan, PipelinePlans, PipelineStagePlan, PlanSource, TrainingConfig,
};
use proteus_wire::coordinator::{Coordinator, PlanningInput};
use std::collections::BTreeMap;

/// Why plans could not be computed or read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanningError {
    #[error("not an MLP job")]
    NotMlp,
    #[error("the model's shape: {0}")]
    Shape(String),
    #[error("{0}")]
    Profile(#[from] profile::PinnedMismatch),
    #[error("a plan for {0} workers: {1}")]
    Plan(u32, PlanError),
    #[error("no plan for {0} workers")]
    Missing(u32),
    #[error("the job's pipeline profile is missing")]
    NoProfile,
}

/// The plans for `input.workers` founders of the MLP job `training` trains.
pub fn plans_for(
    training: &TrainingConfig,
    input: &PlanningInput,
) -> Result<PipelinePlans, PlanningError> {
    let AppConfig::Mlp {
        dataset,
        layers,
        batch,
        link_mbit_per_sec,
        link_latency_ms,
        pipeline,
        ..
    } = &training.app
    else {
        return Err(PlanningError::NotMlp);
    };
    let mut widths = vec![dataset.input_width() as usize];
    widths.extend(layers.iter().map(|&w| w as usize));
    let shape = MlpShape::new(widths).map_err(|e| PlanningError::Shape(e.to_string()))?;
    let n = input.workers;
    let timings = match &input.source {
        PlanSource::DataParallel => {
            let plans = (1..=n)
                .map(|w| to_wire(&Plan::data_parallel(shape.layers(), w, 0.0)))
                .collect();
            return Ok(PipelinePlans {
                source: PlanSource::DataParallel,
                plans,
            });
        }
        PlanSource::Pinned => pipeline
            .profile
            .as_deref()
            .ok_or(PlanningError::NoProfile)?,
        PlanSource::Measured { profile, .. } => profile.as_slice(),
    };
    let prof = profile::pinned(&shape, *batch as usize, timings)?;
    let link = Link::new(
        link_mbit_per_sec.map_or(f64::INFINITY, |b| b * 1e6 / 8.0),
        link_latency_ms.map_or(0.0, |ms| ms.max(0.0) / 1e3),
    );
    let part = Partitioner::solve(&prof, link, n as usize);
    let plans = (1..=n)
        .map(|w| {
            part.exact(w as usize)
                .map(to_wire)
                .ok_or(PlanningError::Missing(w))
        })
        .collect::<Result<_, _>>()?;
    Ok(PipelinePlans {
        source: input.source.clone(),
        plans,
    })
}

/// Computes and publishes a job's plans when its coordinator has what they need and lacks
/// them; `Some` with what happened when it did (an error leaves the job without plans: its
/// members wait for them until they give up, and the log says why).
pub fn plan_if_due(c: &mut Coordinator) -> Option<Result<(), String>> {
    let input = c.planning_due()?;
    let result = plans_for(c.training(), &input)
        .map_err(|e| e.to_string())
        .and_then(|plans| c.set_pipeline_plans(plans).map_err(|e| e.to_string()));
    Some(result)
}

/// A plan in the wire's form.
pub fn to_wire(plan: &Plan) -> PipelinePlan {
    PipelinePlan {
        stages: plan
            .stages()
            .iter()
            .map(|s| PipelineStagePlan {
                first_layer: s.layers.start as u32,
                end_layer: s.layers.end as u32,
                replicas: s.replicas,
            })
            .collect(),
        predicted_secs: plan.predicted_secs,
    }
}

/// The view's plans by worker count, checked against a model of `layers` layers.
pub fn from_wire(
    plans: &PipelinePlans,
    layers: usize,
) -> Result<BTreeMap<u32, Plan>, PlanningError> {
    plans
        .plans
        .iter()
        .map(|p| {
            let stages = p
                .stages
                .iter()
                .map(|s| StagePlan {
                    layers: s.first_layer as usize..s.end_layer as usize,
                    replicas: s.replicas,
                })
                .collect();
            let plan = Plan::new(stages, layers, p.predicted_secs)
                .map_err(|e| PlanningError::Plan(p.workers(), e))?;
            Ok((plan.workers(), plan))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proteus_wire::agent_api::{
        ImageDataset, LayerTiming, Parallelism, PipelineOptions, StopCondition,
    };
    use proteus_wire::{InstanceId, JobId};

    fn mlp(parallelism: Parallelism, profile: Option<Vec<LayerTiming>>) -> TrainingConfig {
        let mut t = TrainingConfig::new(AppConfig::Mlp {
            dataset: ImageDataset::Digits,
            layers: vec![48, 32, 24, 10],
            batch: 16,
            learning_rate: 0.05,
            momentum: 0.9,
            parallelism,
            link_mbit_per_sec: Some(200.0),
            link_latency_ms: None,
            pipeline: PipelineOptions {
                profile,
                ..Default::default()
            },
        });
        t.stop = StopCondition::Epochs { epochs: 1 };
        t.min_workers = 3;
        t
    }

    fn timing(ms: f64) -> LayerTiming {
        LayerTiming {
            forward_ms: ms,
            backward_ms: 2.0 * ms,
            update_ms: ms / 10.0,
        }
    }

    #[test]
    fn the_same_profile_gives_the_same_plans_for_every_count_and_they_read_back() {
        let profile = vec![timing(4.0), timing(1.0), timing(1.0), timing(0.5)];
        let t = mlp(Parallelism::Pipeline, Some(profile.clone()));
        let input = PlanningInput {
            workers: 3,
            source: PlanSource::Pinned,
        };
        let a = plans_for(&t, &input).unwrap();
        let b = plans_for(&t, &input).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.plans.len(), 3);
        let read = from_wire(&a, 4).unwrap();
        assert_eq!(read.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
        for (n, p) in &read {
            assert_eq!(to_wire(p), a.plans[*n as usize - 1]);
        }
        // A measured profile with the same times plans the same.
        let measured = PlanningInput {
            workers: 3,
            source: PlanSource::Measured {
                by: InstanceId("i-1".into()),
                profile,
            },
        };
        assert_eq!(plans_for(&t, &measured).unwrap().plans, a.plans);
        // A plan table for another model is refused.
        assert!(from_wire(&a, 5).is_err());
    }

    #[test]
    fn a_coordinator_is_planned_once_its_founders_and_profile_are_in() {
        use proteus_wire::agent_api::{AgentEvent, RegisterRequest};
        use proteus_wire::ids::Tier;
        let t = mlp(Parallelism::Pipeline, None);
        let mut c = Coordinator::new(JobId(1), t).unwrap();
        let params = MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap().params() as u64;
        for (i, tier) in [
            ("a", Tier::Transient),
            ("b", Tier::Reliable),
            ("c", Tier::Transient),
        ] {
            let id = InstanceId(i.into());
            let req = RegisterRequest {
                instance_id: id.clone(),
                data_addr: format!("127.0.0.1:{}", 9000 + i.len()),
                vcpus: 2,
                agent_version: String::new(),
                protocol_version: proteus_wire::agent_api::PROTOCOL_VERSION,
            };
            c.register(req, tier, 0).unwrap();
            c.event(&id, AgentEvent::Ready { model_len: params }, 0)
                .unwrap();
            assert!(plan_if_due(&mut c).is_none(), "nothing to plan from yet");
        }
        let view = c.view().cloned().unwrap();
        assert_eq!(view.founders.len(), 3);
        assert!(view.pipeline.is_none());
        // The reliable founder profiles, not the first.
        assert_eq!(view.profiler, Some(InstanceId("b".into())));
        let profile = vec![timing(4.0), timing(1.0), timing(1.0), timing(0.5)];
        let wrong = c.event(
            &InstanceId("a".into()),
            AgentEvent::PipelineProfile {
                layers: profile.clone(),
            },
            1,
        );
        assert!(wrong.is_err(), "only the profiler's profile is taken");
        let short = c.event(
            &InstanceId("b".into()),
            AgentEvent::PipelineProfile {
                layers: profile[..3].to_vec(),
            },
            1,
        );
        assert!(short.is_err(), "a profile of three layers for four");
        assert!(plan_if_due(&mut c).is_none());
        c.event(
            &InstanceId("b".into()),
            AgentEvent::PipelineProfile {
                layers: profile.clone(),
            },
            1,
        )
        .unwrap();
        assert_eq!(plan_if_due(&mut c), Some(Ok(())));
        let planned = c.view().cloned().unwrap();
        assert!(planned.epoch > view.epoch, "a new view carries the plans");
        assert_eq!(planned.profiler, None);
        let plans = planned.pipeline.clone().unwrap();
        assert_eq!(plans.plans.len(), 3);
        assert!(plan_if_due(&mut c).is_none(), "planned once");
        // A duplicate of the profile is no error and changes nothing.
        c.event(
            &InstanceId("b".into()),
            AgentEvent::PipelineProfile { layers: profile },
            2,
        )
        .unwrap();
        assert_eq!(c.view().unwrap().pipeline.as_ref(), Some(&plans));
        assert_eq!(c.pipeline_plan(), plans.plans.last());
        // Saved and restored (a broker restart), the plans stay.
        let back: Coordinator = serde_json::from_str(&serde_json::to_string(&c).unwrap()).unwrap();
        assert_eq!(back.view().unwrap().pipeline.as_ref(), Some(&plans));
        // A re-plan for two is recorded as the plan trained now.
        c.event(
            &InstanceId("b".into()),
            AgentEvent::PipelineResumed {
                segment: 1,
                from: 10,
                workers: 2,
                pause_ms: 5,
            },
            3,
        )
        .unwrap();
        assert_eq!(c.pipeline_plan(), plans.plans.get(1));
    }

    #[test]
    fn a_profiler_warned_before_it_sent_its_profile_is_replaced_and_its_profile_refused() {
        use proteus_wire::agent_api::{AgentEvent, RegisterRequest};
        use proteus_wire::ids::Tier;
        let mut c = Coordinator::new(JobId(2), mlp(Parallelism::Pipeline, None)).unwrap();
        let params = MlpShape::new(vec![64, 48, 32, 24, 10]).unwrap().params() as u64;
        for (i, tier) in [
            ("a", Tier::Transient),
            ("b", Tier::Reliable),
            ("c", Tier::Transient),
        ] {
            let id = InstanceId(i.into());
            let req = RegisterRequest {
                instance_id: id.clone(),
                data_addr: format!("127.0.0.1:{}", 9100 + i.len()),
                vcpus: 2,
                agent_version: String::new(),
                protocol_version: proteus_wire::agent_api::PROTOCOL_VERSION,
            };
            c.register(req, tier, 0).unwrap();
            c.event(&id, AgentEvent::Ready { model_len: params }, 0)
                .unwrap();
        }
        assert_eq!(c.view().unwrap().profiler, Some(InstanceId("b".into())));
        let warning = AgentEvent::InterruptionWarning {
            action: "terminate".into(),
            action_time: "2026-12-07T00:02:00Z".into(),
        };
        c.event(&InstanceId("b".into()), warning, 1).unwrap();
        // No reliable founder left: the first active founder profiles.
        assert_eq!(c.view().unwrap().profiler, Some(InstanceId("a".into())));
        let profile = vec![timing(4.0), timing(1.0), timing(1.0), timing(0.5)];
        let late = c.event(
            &InstanceId("b".into()),
            AgentEvent::PipelineProfile {
                layers: profile.clone(),
            },
            2,
        );
        assert!(
            late.is_err(),
            "the warned member's late profile is not taken"
        );
        c.event(
            &InstanceId("a".into()),
            AgentEvent::PipelineProfile { layers: profile },
            3,
        )
        .unwrap();
        assert_eq!(plan_if_due(&mut c), Some(Ok(())));
        assert!(c.view().unwrap().pipeline.is_some());
    }

    #[test]
    fn data_parallel_jobs_are_planned_without_a_profile() {
        let t = mlp(Parallelism::Data, None);
        let input = PlanningInput {
            workers: 2,
            source: PlanSource::DataParallel,
        };
        let p = plans_for(&t, &input).unwrap();
        assert_eq!(p.plans.len(), 2);
        assert!(p.plans.iter().all(|p| p.stages.len() == 1));
    }
}
