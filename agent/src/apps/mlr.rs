//! Multinomial (softmax) logistic regression, minibatch SGD.
//!
//! Model layout: `classes × (dim + 1)` row-major; the last column of each class row is its bias.

use super::{Partitioner, Update};
use crate::data::ImageSet;
use ndarray::{Array2, ArrayView2, Axis, s};
use proteus_wire::agent_api::{Metric, MetricKind};

const CLASSES: usize = 10;

#[derive(Debug)]
pub struct Mlr {
    train: ImageSet,
    test: ImageSet,
    parts: Partitioner,
    learning_rate: f32,
    l2: f32,
}

impl Mlr {
    pub fn new(
        train: ImageSet,
        test: ImageSet,
        parts: Partitioner,
        learning_rate: f32,
        l2: f32,
    ) -> Self {
        Mlr {
            train,
            test,
            parts,
            learning_rate,
            l2,
        }
    }

    pub fn model_len(&self) -> usize {
        CLASSES * (self.train.dim + 1)
    }

    fn weights<'a>(&self, params: &'a [f32]) -> ArrayView2<'a, f32> {
        // The length is checked by the caller's shard assembly; a mismatch is a programming error.
        ArrayView2::from_shape((CLASSES, self.train.dim + 1), params)
            .expect("model length matches classes × (dim + 1)")
    }

    fn features(set: &ImageSet, rows: impl ExactSizeIterator<Item = usize>) -> Array2<f32> {
        let n = rows.len();
        let mut x = Array2::<f32>::zeros((n, set.dim));
        let inv = 1.0 / set.scale;
        for (r, i) in rows.enumerate() {
            let src = set.row(i);
            for (dst, &v) in x.row_mut(r).iter_mut().zip(src) {
                *dst = f32::from(v) * inv;
            }
        }
        x
    }

    /// Softmax probabilities of `x` under `w`.
    fn probabilities(&self, w: ArrayView2<f32>, x: &Array2<f32>) -> Array2<f32> {
        let dim = self.train.dim;
        let mut logits = x.dot(&w.slice(s![.., ..dim]).t());
        let bias = w.column(dim);
        for mut row in logits.rows_mut() {
            row += &bias;
            let max = row.fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            row.mapv_inplace(|v| (v - max).exp());
            let sum = row.sum();
            row /= sum;
        }
        logits
    }

    pub fn compute(&self, params: &[f32], partitions: &[u32], clock: u64) -> Update {
        let rows: Vec<usize> = partitions
            .iter()
            .flat_map(|&p| self.parts.batch(p, clock))
            .map(|i| i as usize)
            .collect();
        let global = self.parts.global_batch(clock).max(1) as f32;
        let w = self.weights(params);
        let dim = self.train.dim;
        let mut delta = vec![0.0f32; self.model_len()];
        if rows.is_empty() {
            return Update {
                delta,
                samples: 0,
                loss_sum: 0.0,
            };
        }
        let x = Self::features(&self.train, rows.iter().copied());
        let mut g = self.probabilities(w, &x);
        let mut loss_sum = 0.0f64;
        for (r, &i) in rows.iter().enumerate() {
            let y = self.train.labels[i] as usize;
            loss_sum -= f64::from(g[[r, y]].max(1e-12).ln());
            g[[r, y]] -= 1.0;
        }
        let grad_w = g.t().dot(&x); // classes × dim
        let grad_b = g.sum_axis(Axis(0));
        let step = -self.learning_rate / global;
        let decay = -self.learning_rate * self.l2 * rows.len() as f32 / global;
        for c in 0..CLASSES {
            let out = &mut delta[c * (dim + 1)..(c + 1) * (dim + 1)];
            for d in 0..dim {
                out[d] = step * grad_w[[c, d]] + decay * w[[c, d]];
            }
            out[dim] = step * grad_b[c];
        }
        Update {
            delta,
            samples: rows.len(),
            loss_sum,
        }
    }

    /// Test accuracy, with the accuracy of always predicting the most frequent training class as
    /// the baseline.
    pub fn evaluate(&self, params: &[f32], clock: u64) -> Metric {
        let w = self.weights(params);
        let mut correct = 0usize;
        let n = self.test.len();
        for start in (0..n).step_by(2000) {
            let end = (start + 2000).min(n);
            let x = Self::features(&self.test, start..end);
            let p = self.probabilities(w, &x);
            for (r, row) in p.rows().into_iter().enumerate() {
                let guess = row
                    .iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |best, (c, &v)| {
                        if v > best.1 { (c, v) } else { best }
                    })
                    .0;
                if guess == self.test.labels[start + r] as usize {
                    correct += 1;
                }
            }
        }
        let mut counts = [0usize; CLASSES];
        for &l in &self.train.labels {
            counts[(l as usize).min(CLASSES - 1)] += 1;
        }
        let majority = (0..CLASSES).max_by_key(|&c| counts[c]).unwrap_or(0);
        let base = self
            .test
            .labels
            .iter()
            .filter(|&&l| l as usize == majority)
            .count();
        let denom = n.max(1) as f64;
        Metric {
            kind: MetricKind::Accuracy,
            value: correct as f64 / denom,
            baseline: Some(base as f64 / denom),
            clock,
        }
    }
}
