//! Today's market: how a spot pool's capacity comes and goes.
//!
//! Since late 2017 a spot launch into a pool without capacity is refused and a running instance
//! is interrupted when the pool needs its capacity back; the price says nothing about either.
//! This model describes one pool (availability zone × instance type) as alternating *runs*: up
//! (a spot launch would succeed) and down (it would be refused). It is semi-Markov on a grid of
//! `step_minutes`: the chance that the current run ends in the next step depends on how long
//! it has lasted, counted in age buckets. That dependence is what the real traces show and what
//! a memoryless rate misses: half the outages of a V100 pool end within half an hour, but one
//! that has lasted two hours will probably last hours more; a pool that has just come back is
//! likely to go again soon, one that has stayed up for a day is not.
//!
//! [`AvailabilityModel::fit`] estimates the end probabilities from availability series (the
//! policy's default is fitted on the 2022 traces, `policies/bidbrain.toml` `[today]`); a policy
//! keeps a [`Belief`] of where its pool is — which run, how old — from what it sees (its own
//! spot instances running, a launch refused or granted, an interruption), and lets it drift by
//! the model in between, when it does not look.

use serde::{Deserialize, Serialize};

/// A semi-Markov model of one pool's spot availability (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AvailabilityModel {
    /// The grid, minutes.
    pub step_minutes: f64,
    /// The age buckets' upper ends, in steps of the grid: bucket `k` holds runs aged from the
    /// previous end + 1 to `bucket_steps[k]` steps, and one more bucket holds every run older
    /// than the last end. Increasing, starting at 1.
    pub bucket_steps: Vec<u32>,
    /// Per bucket (one more than `bucket_steps`), the probability that an up run of that age
    /// ends within the next step.
    pub up_end: Vec<f64>,
    /// Per bucket, the probability that a down run of that age ends within the next step.
    pub down_end: Vec<f64>,
}

/// Why a model cannot be used, with the key at fault.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelProblem {
    pub key: &'static str,
    pub problem: String,
}

impl AvailabilityModel {
    /// The buckets' ends the default model uses, in 10-minute steps: each of the first 40
    /// minutes, then up to 1, 1½, 2⅓, 4 and 8 hours, and beyond.
    pub const DEFAULT_BUCKETS: [u32; 9] = [1, 2, 3, 4, 6, 9, 14, 24, 48];

    pub fn check(&self) -> Result<(), ModelProblem> {
        let bad = |key, problem: String| Err(ModelProblem { key, problem });
        if !(self.step_minutes.is_finite() && (1.0..=120.0).contains(&self.step_minutes)) {
            return bad(
                "step_minutes",
                format!("{} is not between 1 and 120 minutes", self.step_minutes),
            );
        }
        let b = &self.bucket_steps;
        if b.is_empty() || b[0] != 1 || b.windows(2).any(|w| w[0] >= w[1]) {
            return bad(
                "bucket_steps",
                format!("{b:?} must be increasing whole numbers of steps starting at 1"),
            );
        }
        for (key, p) in [("up_end", &self.up_end), ("down_end", &self.down_end)] {
            if p.len() != b.len() + 1 {
                return bad(
                    key,
                    format!(
                        "has {} probabilities for {} buckets (one per bucket: one more than \
                         bucket_steps)",
                        p.len(),
                        b.len() + 1
                    ),
                );
            }
            if p.iter().any(|x| !(x.is_finite() && *x > 0.0 && *x < 1.0)) {
                return bad(
                    key,
                    format!("{p:?}: every probability must be above 0 and below 1"),
                );
            }
        }
        Ok(())
    }

    pub fn step_secs(&self) -> f64 {
        self.step_minutes * 60.0
    }

    pub fn buckets(&self) -> usize {
        self.bucket_steps.len() + 1
    }

    /// States of the chain: down buckets first, then up buckets.
    pub fn states(&self) -> usize {
        2 * self.buckets()
    }

    /// The bucket of a run `age_steps` old (1 = in its first step).
    pub fn bucket_of(&self, age_steps: u32) -> usize {
        let age = age_steps.max(1);
        self.bucket_steps
            .iter()
            .position(|&edge| age <= edge)
            .unwrap_or(self.buckets() - 1)
    }

    /// The state of a run `age_steps` old.
    pub fn state(&self, up: bool, age_steps: u32) -> usize {
        usize::from(up) * self.buckets() + self.bucket_of(age_steps)
    }

    /// Whether a state is up.
    pub fn is_up(&self, state: usize) -> bool {
        state >= self.buckets()
    }

    /// One step of the chain, as a row-major `states × states` matrix: a run ends with its
    /// bucket's probability (and the next run starts in its first bucket), or goes on and
    /// moves to the next bucket as often as the bucket's width says (a geometric stay with the
    /// bucket's mean).
    pub fn transition(&self) -> Vec<f64> {
        let nb = self.buckets();
        let n = 2 * nb;
        let mut p = vec![0.0; n * n];
        for up in [false, true] {
            let ends = if up { &self.up_end } else { &self.down_end };
            for (b, &end) in ends.iter().enumerate() {
                let from = usize::from(up) * nb + b;
                let lo = if b == 0 {
                    1
                } else {
                    self.bucket_steps[b - 1] + 1
                };
                let advance = if b + 1 < nb {
                    // Widths are whole steps: a bucket of width w is left after w steps on
                    // average.
                    1.0 / f64::from(self.bucket_steps[b] - lo + 1)
                } else {
                    0.0
                };
                let stay = 1.0 - end;
                let next = usize::from(up) * nb + (b + 1).min(nb - 1);
                p[from * n + next] += stay * advance;
                p[from * n + from] += stay * (1.0 - advance);
                p[from * n + usize::from(!up) * nb] += end;
            }
        }
        p
    }

    /// Fits the end probabilities to availability series sampled on the model's grid (one
    /// `bool` per step: spot could be had). Each bucket's estimate is the runs that ended in it
    /// over the steps spent in it, with `prior_steps` steps of pseudo-observation at the
    /// state's overall rate, so that a bucket few runs reach borrows from the rest. A run cut
    /// by the end of a series counts its steps but not an end.
    pub fn fit(series: &[Vec<bool>], step_minutes: f64, buckets: &[u32], prior_steps: f64) -> Self {
        let mut model = AvailabilityModel {
            step_minutes,
            bucket_steps: buckets.to_vec(),
            up_end: vec![0.5; buckets.len() + 1],
            down_end: vec![0.5; buckets.len() + 1],
        };
        let nb = model.buckets();
        // [state][bucket]: (ends, steps)
        let mut counts = [vec![(0.0f64, 0.0f64); nb], vec![(0.0, 0.0); nb]];
        for s in series {
            let mut i = 0;
            while i < s.len() {
                let up = s[i];
                let mut j = i;
                while j + 1 < s.len() && s[j + 1] == up {
                    j += 1;
                }
                let len = (j - i + 1) as u32;
                let complete = j + 1 < s.len();
                let c = &mut counts[usize::from(up)];
                for age in 1..=len {
                    let b = model.bucket_of(age);
                    c[b].1 += 1.0;
                    if age == len && complete {
                        c[b].0 += 1.0;
                    }
                }
                i = j + 1;
            }
        }
        for up in [false, true] {
            let c = &counts[usize::from(up)];
            let (ends, steps) = c.iter().fold((0.0, 0.0), |(e, s), x| (e + x.0, s + x.1));
            let overall = if steps > 0.0 { ends / steps } else { 0.5 };
            let fitted: Vec<f64> = c
                .iter()
                .map(|&(e, s)| {
                    ((e + prior_steps * overall) / (s + prior_steps).max(1e-9)).clamp(1e-4, 0.9999)
                })
                .collect();
            if up {
                model.up_end = fitted;
            } else {
                model.down_end = fitted;
            }
        }
        model
    }

    /// The share of time the chain spends up in the long run (for reports).
    pub fn up_share(&self) -> f64 {
        let n = self.states();
        let p = self.transition();
        let mut pi = vec![1.0 / n as f64; n];
        for _ in 0..2000 {
            let mut next = vec![0.0; n];
            for (i, &w) in pi.iter().enumerate() {
                for (j, x) in next.iter_mut().enumerate() {
                    *x += w * p[i * n + j];
                }
            }
            pi = next;
        }
        pi[self.buckets()..].iter().sum()
    }
}

/// Samples an availability series at `step_secs`: step `k` is up when the series' value at the
/// step's start is.
pub fn resample(values: &[bool], gap_secs: f64, step_secs: f64) -> Vec<bool> {
    if values.is_empty() || gap_secs <= 0.0 || step_secs <= 0.0 {
        return Vec::new();
    }
    let steps = (values.len() as f64 * gap_secs / step_secs).floor() as usize;
    (0..steps)
        .map(|k| values[((k as f64 * step_secs / gap_secs) as usize).min(values.len() - 1)])
        .collect()
}

/// Where a policy believes its pool is: a distribution over the model's states, sharpened by
/// what it sees and drifting by the model in between.
#[derive(Debug, Clone, PartialEq)]
pub struct Belief {
    probs: Vec<f64>,
}

impl Belief {
    /// Nothing seen yet: the chain's long-run mix.
    pub fn unknown(model: &AvailabilityModel) -> Self {
        let n = model.states();
        let p = model.transition();
        let mut pi = vec![1.0 / n as f64; n];
        for _ in 0..500 {
            pi = step(&pi, &p, n);
        }
        Belief { probs: pi }
    }

    pub fn probs(&self) -> &[f64] {
        &self.probs
    }

    /// The chance that the pool is up.
    pub fn up(&self, model: &AvailabilityModel) -> f64 {
        self.probs[model.buckets()..].iter().sum()
    }

    /// `steps` of the grid pass unobserved (a fraction of a step is interpolated).
    pub fn drift(&mut self, model: &AvailabilityModel, transition: &[f64], steps: f64) {
        let n = model.states();
        if !(steps.is_finite() && steps > 0.0) {
            return;
        }
        let whole = steps.floor().min(10_000.0) as usize;
        for _ in 0..whole {
            self.probs = step(&self.probs, transition, n);
        }
        let frac = steps - steps.floor();
        if frac > 1e-9 {
            let next = step(&self.probs, transition, n);
            for (p, q) in self.probs.iter_mut().zip(next) {
                *p = (1.0 - frac) * *p + frac * q;
            }
        }
    }

    /// The pool was seen up (`true`) or down. `changed`: the run began now (seen to change),
    /// so its age is known; otherwise only its state is learned, its age stays as believed.
    pub fn see(&mut self, model: &AvailabilityModel, up: bool, changed: bool) {
        let nb = model.buckets();
        if !changed {
            let mut total = 0.0;
            for (s, p) in self.probs.iter_mut().enumerate() {
                if model.is_up(s) != up {
                    *p = 0.0;
                }
                total += *p;
            }
            if total > 1e-12 {
                for p in &mut self.probs {
                    *p /= total;
                }
                return;
            }
        }
        self.probs.iter_mut().for_each(|p| *p = 0.0);
        self.probs[usize::from(up) * nb] = 1.0;
    }

    /// If the pool is up now, what its up run does over the next `steps`: the chance that it
    /// ends within them, and the expected steps it stays up (at most `steps`). From the belief
    /// conditioned on up (a pool seen down a little while ago that is up now has only just come
    /// back); `None` if the belief rules up out.
    pub fn up_run_within(
        &self,
        model: &AvailabilityModel,
        transition: &[f64],
        steps: usize,
    ) -> Option<(f64, f64)> {
        let n = model.states();
        let nb = model.buckets();
        let up: f64 = self.probs[nb..].iter().sum();
        if up <= 1e-12 {
            return None;
        }
        let mut alive: Vec<f64> = self
            .probs
            .iter()
            .enumerate()
            .map(|(s, p)| if model.is_up(s) { p / up } else { 0.0 })
            .collect();
        let mut expected = 0.0;
        for _ in 0..steps {
            let next = step(&alive, transition, n);
            // Mass that went down has ended; it never comes back within this run.
            alive = next
                .into_iter()
                .enumerate()
                .map(|(s, p)| if model.is_up(s) { p } else { 0.0 })
                .collect();
            expected += alive.iter().sum::<f64>();
        }
        let survived: f64 = alive.iter().sum();
        Some((1.0 - survived, expected))
    }
}

fn step(pi: &[f64], p: &[f64], n: usize) -> Vec<f64> {
    let mut next = vec![0.0; n];
    for (i, &w) in pi.iter().enumerate() {
        if w == 0.0 {
            continue;
        }
        let row = &p[i * n..(i + 1) * n];
        for (x, &t) in next.iter_mut().zip(row) {
            *x += w * t;
        }
    }
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> AvailabilityModel {
        AvailabilityModel {
            step_minutes: 10.0,
            bucket_steps: vec![1, 2, 4],
            up_end: vec![0.3, 0.2, 0.1, 0.02],
            down_end: vec![0.5, 0.3, 0.2, 0.1],
        }
    }

    #[test]
    fn rows_of_the_chain_sum_to_one_and_runs_age_through_their_buckets() {
        let m = model();
        m.check().unwrap();
        let p = m.transition();
        let n = m.states();
        for i in 0..n {
            let row: f64 = p[i * n..(i + 1) * n].iter().sum();
            assert!((row - 1.0).abs() < 1e-12, "row {i} sums to {row}");
        }
        // An up run in its first step ends (to down, first bucket) with 0.3, else moves on to
        // the bucket of age 2 (width 1).
        let up0 = m.state(true, 1);
        assert_eq!(up0, 4);
        assert!((p[up0 * n + m.state(false, 1)] - 0.3).abs() < 1e-12);
        assert!((p[up0 * n + m.state(true, 2)] - 0.7).abs() < 1e-12);
        // Bucket 3..4 is two steps wide: half the survivors move on each step.
        let up2 = m.state(true, 3);
        assert!((p[up2 * n + m.state(true, 5)] - 0.9 * 0.5).abs() < 1e-12);
        assert!((p[up2 * n + up2] - 0.9 * 0.5).abs() < 1e-12);
        assert_eq!(m.bucket_of(0), 0);
        assert_eq!(m.bucket_of(1000), 3);
    }

    #[test]
    fn fitting_counts_ends_over_steps_per_bucket() {
        // Runs (10-minute steps): up 1, down 2, up 3, down 1 (cut by the end: no end counted).
        let s = vec![true, false, false, true, true, true, false];
        let m = AvailabilityModel::fit(&[s], 10.0, &[1, 2], 0.0);
        // Up runs of lengths 1 and 3: bucket 0 saw 2 steps, 1 end; bucket 1 one step, no end;
        // bucket 2 one step, one end.
        assert!((m.up_end[0] - 0.5).abs() < 1e-12, "{:?}", m.up_end);
        assert!((m.up_end[1] - 1e-4).abs() < 1e-12);
        assert!((m.up_end[2] - 0.9999).abs() < 1e-12);
        // Down runs: 2 (complete) and 1 (cut): bucket 0 saw 2 steps, no end; bucket 1 one step,
        // one end.
        assert!((m.down_end[0] - 1e-4).abs() < 1e-12, "{:?}", m.down_end);
        assert!((m.down_end[1] - 0.9999).abs() < 1e-12);
        // A prior pulls empty buckets to the overall rate.
        let m = AvailabilityModel::fit(&[vec![true, true, false, true]], 10.0, &[1, 2], 1.0);
        assert!(m.up_end[2] > 0.0 && m.up_end[2] < 1.0);
        m.check().unwrap();
    }

    #[test]
    fn a_belief_drifts_by_the_chain_and_sharpens_on_what_is_seen() {
        let m = model();
        let p = m.transition();
        let mut b = Belief::unknown(&m);
        let total: f64 = b.probs().iter().sum();
        assert!((total - 1.0).abs() < 1e-9);
        let share = m.up_share();
        assert!((b.up(&m) - share).abs() < 1e-6);
        // Seen to come up: a fresh up run. One unobserved step later it is still up with 0.7.
        b.see(&m, true, true);
        assert_eq!(b.up(&m), 1.0);
        b.drift(&m, &p, 1.0);
        assert!((b.up(&m) - 0.7).abs() < 1e-12);
        // Seen up again, without seeing a change: the down share goes, the ages stay.
        b.see(&m, true, false);
        assert!((b.up(&m) - 1.0).abs() < 1e-12);
        assert!((b.probs()[m.state(true, 2)] - 1.0).abs() < 1e-12);
        // Seen down: a fresh down run.
        b.see(&m, false, true);
        assert_eq!(b.probs()[m.state(false, 1)], 1.0);
        // Half a step: halfway between.
        b.drift(&m, &p, 0.5);
        assert!((b.up(&m) - 0.25).abs() < 1e-12);
    }

    #[test]
    fn an_up_run_seen_to_begin_is_likelier_to_end_within_the_hour_than_an_old_one() {
        let m = model();
        let p = m.transition();
        let mut fresh = Belief::unknown(&m);
        fresh.see(&m, true, true);
        let (end_fresh, up_fresh) = fresh.up_run_within(&m, &p, 6).unwrap();
        // One step: it ends with its first bucket's 0.3.
        let (end_one, up_one) = fresh.up_run_within(&m, &p, 1).unwrap();
        assert!((end_one - 0.3).abs() < 1e-12 && (up_one - 0.7).abs() < 1e-12);
        let mut old = Belief::unknown(&m);
        old.see(&m, true, true);
        old.drift(&m, &p, 12.0);
        old.see(&m, true, false);
        let (end_old, up_old) = old.up_run_within(&m, &p, 6).unwrap();
        assert!(end_fresh > end_old + 0.2, "{end_fresh} vs {end_old}");
        assert!(up_fresh < up_old && up_old <= 6.0, "{up_fresh} vs {up_old}");
        let mut down = Belief::unknown(&m);
        down.see(&m, false, true);
        assert_eq!(down.up_run_within(&m, &p, 6), None);
    }

    #[test]
    fn bad_models_are_explained() {
        let mut m = model();
        m.up_end.pop();
        let e = m.check().unwrap_err();
        assert_eq!(e.key, "up_end");
        let mut m = model();
        m.bucket_steps = vec![2, 3, 4];
        assert_eq!(m.check().unwrap_err().key, "bucket_steps");
        let mut m = model();
        m.down_end[0] = 1.0;
        assert_eq!(m.check().unwrap_err().key, "down_end");
    }

    #[test]
    fn resampling_takes_the_value_at_each_steps_start() {
        // 195 s ticks onto 600 s steps.
        let v: Vec<bool> = (0..20).map(|i| i % 7 < 4).collect();
        let r = resample(&v, 195.0, 600.0);
        assert_eq!(r.len(), 6);
        assert_eq!(r[1], v[3]);
        assert_eq!(r[5], v[15]);
    }
}
