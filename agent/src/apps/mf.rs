//! Matrix factorisation with biases: `r̂ = μ + b_u + b_i + p_u · q_i`, trained by SGD.
//!
//! Model layout: `users × (rank + 1)` then `items × (rank + 1)`; the last entry of each row is
//! the bias. The global mean `μ` comes from the training ratings, which every agent has, so it is
//! not a parameter. Within a clock every rating's step is computed against the clock's
//! parameters and the steps are summed: with thousands of users and items per clock, few rows are
//! hit twice, so this is SGD in all but name, and independent of who computes what.

use super::{Partitioner, Update};
use crate::data::Rating;
use ndarray::ArrayView1;
use proteus_wire::agent_api::{Metric, MetricKind};

/// Hyperparameters.
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub rank: usize,
    pub learning_rate: f32,
    pub l2: f32,
    pub seed: u64,
}

#[derive(Debug)]
pub struct Mf {
    num_users: usize,
    num_items: usize,
    train: Vec<Rating>,
    test: Vec<Rating>,
    parts: Partitioner,
    hyper: Hyper,
    mean: f32,
}

impl Mf {
    pub fn new(
        num_users: usize,
        num_items: usize,
        train: Vec<Rating>,
        test: Vec<Rating>,
        parts: Partitioner,
        hyper: Hyper,
    ) -> Self {
        let mean = (train.iter().map(|r| f64::from(r.value)).sum::<f64>()
            / train.len().max(1) as f64) as f32;
        Mf {
            num_users,
            num_items,
            train,
            test,
            parts,
            hyper,
            mean,
        }
    }

    fn row_len(&self) -> usize {
        self.hyper.rank + 1
    }

    pub fn model_len(&self) -> usize {
        (self.num_users + self.num_items) * self.row_len()
    }

    fn user_row(&self, u: u32) -> usize {
        u as usize * self.row_len()
    }

    fn item_row(&self, i: u32) -> usize {
        (self.num_users + i as usize) * self.row_len()
    }

    /// Small deterministic pseudo-random factors (a hash of seed and key), zero biases.
    pub fn init_value(&self, key: usize) -> f32 {
        if key % self.row_len() == self.hyper.rank {
            return 0.0;
        }
        let mut z =
            (key as u64 ^ self.hyper.seed.rotate_left(17)).wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let unit = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
        (unit - 0.5) * 0.1
    }

    fn predict(&self, params: &[f32], r: &Rating) -> f32 {
        let k = self.hyper.rank;
        let (u, i) = (self.user_row(r.user), self.item_row(r.item));
        let p = ArrayView1::from(&params[u..u + k]);
        let q = ArrayView1::from(&params[i..i + k]);
        self.mean + params[u + k] + params[i + k] + p.dot(&q)
    }

    pub fn compute(&self, params: &[f32], partitions: &[u32], clock: u64) -> Update {
        let (k, lr, l2) = (self.hyper.rank, self.hyper.learning_rate, self.hyper.l2);
        let mut delta = vec![0.0f32; self.model_len()];
        let mut samples = 0;
        let mut loss_sum = 0.0f64;
        for &part in partitions {
            for idx in self.parts.batch(part, clock) {
                let r = &self.train[idx as usize];
                let e = r.value - self.predict(params, r);
                loss_sum += f64::from(e * e);
                samples += 1;
                let (u, i) = (self.user_row(r.user), self.item_row(r.item));
                for f in 0..k {
                    let (pu, qi) = (params[u + f], params[i + f]);
                    delta[u + f] += lr * (e * qi - l2 * pu);
                    delta[i + f] += lr * (e * pu - l2 * qi);
                }
                delta[u + k] += lr * (e - l2 * params[u + k]);
                delta[i + k] += lr * (e - l2 * params[i + k]);
            }
        }
        Update {
            delta,
            samples,
            loss_sum,
        }
    }

    /// Held-out RMSE (predictions clipped to the 0–10 scale); baseline: the global mean.
    pub fn evaluate(&self, params: &[f32], clock: u64) -> Metric {
        let n = self.test.len().max(1) as f64;
        let sq = |f: &dyn Fn(&Rating) -> f32| {
            (self
                .test
                .iter()
                .map(|r| f64::from((r.value - f(r)).powi(2)))
                .sum::<f64>()
                / n)
                .sqrt()
        };
        let rmse = sq(&|r| self.predict(params, r).clamp(0.0, 10.0));
        let baseline = sq(&|_| self.mean);
        Metric {
            kind: MetricKind::Rmse,
            value: rmse,
            baseline: Some(baseline),
            clock,
        }
    }
}
