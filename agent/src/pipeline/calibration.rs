//! The cost model calibrated from warm-up runs: what the workers measured as they ran, in
//! place of the profile's timings of each layer alone.
//!
//! A profile times each layer on its own (several at once when emulated workers share this
//! machine); a running stage is also slowed by what else shares its cores and spends processor
//! time on its messages. A short warm-up run of a plan measures both, and two things are fitted
//! from one or more warm-ups:
//!
//! - **each layer's compute scale**: its stages' measured computing time over the profile's
//!   (forward, backward and optimizer step of their layers), pooled over the warm-ups whose plan
//!   had the layer in a stage (weighted by the profiled time);
//! - **`h`, seconds per byte of the activations and gradients a stage sends and receives**
//!   ([`Profile::message_secs_per_byte`]): the one number that makes the model's prediction of
//!   each warm-up's plan closest to its measured time per minibatch (least squares on the log,
//!   over a grid of 0.05 ns steps up to 100 ns per byte).
//!
//! The calibrated profile is what [`super::partition::Partitioner`] then plans with and predicts
//! from; a plan it chooses that no warm-up ran is a prediction of the model, not a measurement.

use super::StagePlan;
use super::partition::{Link, predicted_1f1b_secs};
use super::profile::Profile;

/// One warm-up run of a plan, as measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Warmup {
    pub link: Link,
    pub stages: Vec<StagePlan>,
    /// Per stage: its replicas' computing seconds per minibatch of the pipeline, summed.
    pub stage_compute_secs: Vec<f64>,
    /// The pipeline's time per minibatch in steady state.
    pub secs_per_minibatch: f64,
}

/// A profile calibrated from warm-ups, and how well it fits them.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibration {
    pub profile: Profile,
    /// Per layer: measured over profiled computing time (1 for a layer no warm-up measured).
    pub compute_scale: Vec<f64>,
    /// Per warm-up: the calibrated model's prediction of its plan, and the measured time.
    pub fitted: Vec<(f64, f64)>,
}

/// Why warm-ups cannot calibrate a profile.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrationError {
    #[error("no warm-up to calibrate from")]
    NoWarmups,
    #[error("warm-up {0}: {1}")]
    Warmup(usize, String),
}

/// Largest `h` tried, and the grid's step.
const MAX_SECS_PER_BYTE: f64 = 100e-9;
const STEP_SECS_PER_BYTE: f64 = 0.05e-9;

/// `p` calibrated from `warmups` (see the module's note).
pub fn calibrate(p: &Profile, warmups: &[Warmup]) -> Result<Calibration, CalibrationError> {
    if warmups.is_empty() {
        return Err(CalibrationError::NoWarmups);
    }
    let n = p.layers.len();
    let mut measured = vec![0.0; n];
    let mut profiled = vec![0.0; n];
    for (i, w) in warmups.iter().enumerate() {
        let bad = |what: String| CalibrationError::Warmup(i, what);
        if w.stages.len() != w.stage_compute_secs.len() {
            return Err(bad(format!(
                "{} stages but {} measured",
                w.stages.len(),
                w.stage_compute_secs.len()
            )));
        }
        if !(w.secs_per_minibatch.is_finite() && w.secs_per_minibatch > 0.0) {
            return Err(bad(format!(
                "a time per minibatch of {} s",
                w.secs_per_minibatch
            )));
        }
        for (s, (st, &secs)) in w.stages.iter().zip(&w.stage_compute_secs).enumerate() {
            if st.layers.end > n || st.layers.is_empty() {
                return Err(bad(format!(
                    "stage {s} has layers {:?} of a model of {n}",
                    st.layers
                )));
            }
            if !(secs.is_finite() && secs >= 0.0) {
                return Err(bad(format!("stage {s} computed for {secs} s")));
            }
            let prof: f64 = p.layers[st.layers.clone()]
                .iter()
                .map(|l| l.forward_secs + l.backward_secs + l.update_secs)
                .sum();
            for l in st.layers.clone() {
                measured[l] += secs;
                profiled[l] += prof;
            }
        }
    }
    let compute_scale: Vec<f64> = measured
        .iter()
        .zip(&profiled)
        .map(|(&m, &q)| if q > 0.0 && m > 0.0 { m / q } else { 1.0 })
        .collect();
    let scaled = |h: f64| Profile {
        batch: p.batch,
        layers: p
            .layers
            .iter()
            .zip(&compute_scale)
            .map(|(l, &k)| super::profile::LayerProfile {
                forward_secs: l.forward_secs * k,
                backward_secs: l.backward_secs * k,
                update_secs: l.update_secs * k,
                ..*l
            })
            .collect(),
        message_secs_per_byte: h,
    };
    let misfit = |q: &Profile| -> f64 {
        warmups
            .iter()
            .map(|w| {
                let e = (predicted_1f1b_secs(q, w.link, &w.stages) / w.secs_per_minibatch).ln();
                e * e
            })
            .sum()
    };
    let steps = (MAX_SECS_PER_BYTE / STEP_SECS_PER_BYTE).round() as usize;
    let mut best = (f64::INFINITY, 0.0);
    for i in 0..=steps {
        let h = i as f64 * STEP_SECS_PER_BYTE;
        let m = misfit(&scaled(h));
        if m < best.0 {
            best = (m, h);
        }
    }
    let profile = scaled(best.1);
    let fitted = warmups
        .iter()
        .map(|w| {
            (
                predicted_1f1b_secs(&profile, w.link, &w.stages),
                w.secs_per_minibatch,
            )
        })
        .collect();
    Ok(Calibration {
        profile,
        compute_scale,
        fitted,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::partition::Partitioner;
    use crate::pipeline::profile::LayerProfile;

    fn layer(ms: f64, act: u64) -> LayerProfile {
        LayerProfile {
            forward_secs: ms / 3e3,
            backward_secs: 2.0 * ms / 3e3 * 0.75,
            update_secs: 2.0 * ms / 3e3 * 0.25,
            activation_bytes: act,
            param_bytes: 200_000,
        }
    }

    fn static_profile() -> Profile {
        Profile {
            batch: 64,
            layers: vec![
                layer(4.0, 130_000),
                layer(2.0, 130_000),
                layer(1.0, 65_000),
                layer(0.5, 65_000),
                layer(1.0, 130_000),
                layer(0.5, 32_000),
                layer(0.1, 32_000),
                layer(0.05, 2_500),
            ],
            message_secs_per_byte: 0.0,
        }
    }

    /// What the machine really does: every layer 1.3 × slower than profiled, the first two
    /// 1.6 ×, and 6 ns of handling per byte of a message.
    fn truth() -> Profile {
        let mut t = static_profile();
        for (i, l) in t.layers.iter_mut().enumerate() {
            let k = if i < 2 { 1.6 } else { 1.3 };
            l.forward_secs *= k;
            l.backward_secs *= k;
            l.update_secs *= k;
        }
        t.message_secs_per_byte = 6e-9;
        t
    }

    fn warmup(link: Link) -> Warmup {
        let plan = Partitioner::solve(&static_profile(), link, 4)
            .exact(4)
            .cloned()
            .expect("a plan");
        let t = truth();
        Warmup {
            link,
            stages: plan.stages().to_vec(),
            stage_compute_secs: plan
                .stages()
                .iter()
                .map(|s| {
                    t.layers[s.layers.clone()]
                        .iter()
                        .map(|l| l.forward_secs + l.backward_secs + l.update_secs)
                        .sum()
                })
                .collect(),
            secs_per_minibatch: predicted_1f1b_secs(&t, link, plan.stages()),
        }
    }

    #[test]
    fn warmups_recover_the_machines_compute_and_message_costs() {
        let links: Vec<Link> = [50.0, 200.0, 1000.0]
            .iter()
            .map(|mbit| Link::new(mbit * 1e6 / 8.0, 0.002))
            .collect();
        let warmups: Vec<Warmup> = links.iter().map(|&l| warmup(l)).collect();
        let c = calibrate(&static_profile(), &warmups).expect("calibrates");
        assert!(
            (c.profile.message_secs_per_byte - 6e-9).abs() < 0.3e-9,
            "{}",
            c.profile.message_secs_per_byte
        );
        for (pred, meas) in &c.fitted {
            assert!((pred / meas - 1.0).abs() < 0.02, "{pred} vs {meas}");
        }
        // The uncalibrated model is off on the fast link, where handling is most of the gap.
        let fast = warmups.last().expect("a warm-up");
        let raw = predicted_1f1b_secs(&static_profile(), fast.link, &fast.stages);
        assert!(raw < 0.85 * fast.secs_per_minibatch);
        // A plan chosen on the calibrated profile is predicted as the machine runs it.
        for &l in &links {
            let plan = Partitioner::solve(&c.profile, l, 4)
                .exact(4)
                .cloned()
                .expect("a plan");
            let real = predicted_1f1b_secs(&truth(), l, plan.stages());
            assert!((plan.predicted_secs / real - 1.0).abs() < 0.03);
        }
    }

    #[test]
    fn warmups_that_do_not_fit_the_model_are_refused() {
        assert_eq!(
            calibrate(&static_profile(), &[]),
            Err(CalibrationError::NoWarmups)
        );
        let mut w = warmup(Link::new(1e8, 0.0));
        w.stage_compute_secs.pop();
        let e = calibrate(&static_profile(), &[w]).expect_err("a stage unmeasured");
        assert!(e.to_string().starts_with("warm-up 0:"), "{e}");
        let mut w = warmup(Link::new(1e8, 0.0));
        w.secs_per_minibatch = 0.0;
        assert!(calibrate(&static_profile(), &[w]).is_err());
    }
}
