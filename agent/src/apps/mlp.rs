//! A multilayer perceptron on ndarray: dense layers, ReLU between them, softmax cross-entropy at
//! the end, SGD with momentum. Used by the pipeline mode, where consecutive layers form stages:
//! every function here works on a contiguous slice of layers, so a stage and a single process run
//! the very same code.
//!
//! Gradients are *sums* over the samples of a minibatch; the optimizer divides by the number of
//! samples that went into a step. So a stage can accumulate several minibatches (flushing
//! schedule) or replicas can add theirs (all-reduce) and still take the mean-gradient step that
//! single-process SGD takes.

use crate::data::ImageSet;
use ndarray::{Array1, Array2, Axis};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// An MLP job as an agent loads it: the model's shape, the data and the hyperparameters. It is
/// trained by the pipeline runtime ([`crate::pipeline`]), not through the parameter server.
#[derive(Debug)]
pub struct MlpJob {
    pub shape: MlpShape,
    pub train: std::sync::Arc<ImageSet>,
    pub test: ImageSet,
    pub batch: usize,
    pub lr: LrSchedule,
    pub momentum: f32,
    pub parallelism: proteus_wire::agent_api::Parallelism,
    pub pipeline: proteus_wire::agent_api::PipelineOptions,
    /// Bytes per second per connection, when links are emulated.
    pub link_bytes_per_sec: Option<f64>,
    /// One-way latency per message, when links are emulated.
    pub link_latency: Option<std::time::Duration>,
}

/// The most workers a pipeline's plan table is sized for in the frame bound.
pub const PLAN_WORKERS: usize = 4096;

/// Number of classes of the image data sets.
pub const CLASSES: usize = 10;

/// Layer widths, input first and classes last: `[784, 512, 10]` is one hidden layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MlpShape(Vec<usize>);

/// Why a shape was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShapeError {
    #[error("an MLP needs at least an input and an output width, got {0}")]
    TooFew(usize),
    #[error("layer widths must be at least 1")]
    Zero,
}

impl MlpShape {
    pub fn new(widths: Vec<usize>) -> Result<Self, ShapeError> {
        if widths.len() < 2 {
            return Err(ShapeError::TooFew(widths.len()));
        }
        if widths.contains(&0) {
            return Err(ShapeError::Zero);
        }
        Ok(MlpShape(widths))
    }

    pub fn widths(&self) -> &[usize] {
        &self.0
    }

    /// Number of dense layers.
    pub fn layers(&self) -> usize {
        self.0.len() - 1
    }

    /// Parameters of layer `l` (weights and biases).
    pub fn layer_params(&self, l: usize) -> usize {
        self.0[l] * self.0[l + 1] + self.0[l + 1]
    }

    /// The most f32s one pipeline message of this model carries with minibatches of about
    /// `batch` samples: a stage's weights for the all-reduce, a layer's weights and velocity, an
    /// activation or gradient (a minibatch holds fewer than `2 × batch` rows, see
    /// `pipeline::stage::Batches`), or the table of plans for up to [`PLAN_WORKERS`] workers.
    pub fn max_message_floats(&self, batch: usize) -> usize {
        let widest = self.0.iter().copied().max().unwrap_or(0);
        let layer = (0..self.layers())
            .map(|l| self.layer_params(l))
            .max()
            .unwrap_or(0);
        let plans = PLAN_WORKERS * (2 + 3 * self.layers());
        self.params()
            .max(batch.saturating_mul(2).saturating_mul(widest))
            .max(2 * layer)
            .max(plans)
    }

    pub fn params(&self) -> usize {
        (0..self.layers()).map(|l| self.layer_params(l)).sum()
    }

    /// He-uniform initial weights, zero biases; the same for a given seed on every agent.
    pub fn init(&self, seed: u64) -> Vec<Dense> {
        (0..self.layers())
            .map(|l| {
                let (i, o) = (self.0[l], self.0[l + 1]);
                let mut rng = ChaCha8Rng::seed_from_u64(seed ^ (0xA5A5_0000 + l as u64));
                let bound = (6.0 / i as f32).sqrt();
                let w = Array2::from_shape_fn((i, o), |_| rng.random_range(-bound..bound));
                Dense {
                    w,
                    b: Array1::zeros(o),
                }
            })
            .collect()
    }
}

/// One dense layer: `y = x · w + b` (`w` is `in × out`).
#[derive(Debug, Clone, PartialEq)]
pub struct Dense {
    pub w: Array2<f32>,
    pub b: Array1<f32>,
}

impl Dense {
    pub fn zeros_like(&self) -> Dense {
        Dense {
            w: Array2::zeros(self.w.raw_dim()),
            b: Array1::zeros(self.b.raw_dim()),
        }
    }

    pub fn len(&self) -> usize {
        self.w.len() + self.b.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What a forward pass keeps for its backward pass: every layer's input and the last output.
#[derive(Debug, Clone)]
pub struct Trace {
    pub inputs: Vec<Array2<f32>>,
    pub output: Array2<f32>,
}

/// Forward through `layers`; ReLU after each layer except, when `ends_model`, the last one
/// (whose output are the logits).
pub fn forward(layers: &[Dense], x: Array2<f32>, ends_model: bool) -> Trace {
    let mut inputs = Vec::with_capacity(layers.len());
    let mut cur = x;
    for (i, layer) in layers.iter().enumerate() {
        let mut z = cur.dot(&layer.w);
        z += &layer.b;
        if !(ends_model && i + 1 == layers.len()) {
            z.mapv_inplace(|v| v.max(0.0));
        }
        inputs.push(cur);
        cur = z;
    }
    Trace {
        inputs,
        output: cur,
    }
}

/// Backward through `layers` given the gradient of the loss with respect to their output.
/// Returns the parameter gradients (sums over the rows) and, when `input_grad`, the gradient
/// with respect to the input.
pub fn backward(
    layers: &[Dense],
    trace: &Trace,
    grad_out: Array2<f32>,
    ends_model: bool,
    input_grad: bool,
) -> (Vec<Dense>, Option<Array2<f32>>) {
    let mut grads: Vec<Option<Dense>> = vec![None; layers.len()];
    let gin = backward_each(layers, trace, grad_out, ends_model, input_grad, |i, d| {
        grads[i] = Some(d)
    });
    (grads.into_iter().flatten().collect(), gin)
}

/// [`backward`], handing each layer's parameter gradient to `on_layer` as soon as it is
/// computed (the last layer first), so that it can be sent while earlier layers are computed.
pub fn backward_each(
    layers: &[Dense],
    trace: &Trace,
    grad_out: Array2<f32>,
    ends_model: bool,
    input_grad: bool,
    mut on_layer: impl FnMut(usize, Dense),
) -> Option<Array2<f32>> {
    let n = layers.len();
    let mut g = grad_out;
    for i in (0..n).rev() {
        let out = if i + 1 == n {
            &trace.output
        } else {
            &trace.inputs[i + 1]
        };
        if !(ends_model && i + 1 == n) {
            // ReLU: the output is positive exactly where the pre-activation was.
            ndarray::Zip::from(&mut g)
                .and(out)
                .for_each(|d, &y| *d = if y > 0.0 { *d } else { 0.0 });
        }
        let x = &trace.inputs[i];
        let gw = x.t().dot(&g);
        let gb = g.sum_axis(Axis(0));
        on_layer(i, Dense { w: gw, b: gb });
        if i > 0 || input_grad {
            g = g.dot(&layers[i].w.t());
        }
    }
    input_grad.then_some(g)
}

/// Softmax cross-entropy of `logits` against `labels`: (loss sum, correct count, gradient of the
/// loss sum with respect to the logits).
pub fn softmax_xent(logits: &Array2<f32>, labels: &[u8]) -> (f64, usize, Array2<f32>) {
    let mut p = logits.clone();
    let mut loss = 0.0f64;
    let mut correct = 0usize;
    for (mut row, &y) in p.rows_mut().into_iter().zip(labels) {
        let (arg, max) =
            row.iter().enumerate().fold(
                (0, f32::NEG_INFINITY),
                |b, (c, &v)| {
                    if v > b.1 { (c, v) } else { b }
                },
            );
        if arg == y as usize {
            correct += 1;
        }
        row.mapv_inplace(|v| (v - max).exp());
        let sum = row.sum();
        row /= sum;
        let y = (y as usize).min(row.len() - 1);
        loss -= f64::from(row[y].max(1e-12).ln());
        row[y] -= 1.0;
    }
    (loss, correct, p)
}

/// Rows of `set` as f32 features scaled to [0, 1].
pub fn features(set: &ImageSet, rows: &[u32]) -> Array2<f32> {
    let mut x = Array2::<f32>::zeros((rows.len(), set.dim));
    let inv = 1.0 / set.scale;
    for (r, &i) in rows.iter().enumerate() {
        for (dst, &v) in x.row_mut(r).iter_mut().zip(set.row(i as usize)) {
            *dst = f32::from(v) * inv;
        }
    }
    x
}

pub fn labels(set: &ImageSet, rows: &[u32]) -> Vec<u8> {
    rows.iter().map(|&i| set.labels[i as usize]).collect()
}

/// Test accuracy of the whole model `layers` on `set`.
pub fn accuracy(layers: &[Dense], set: &ImageSet) -> f64 {
    let n = set.len();
    let mut correct = 0;
    for start in (0..n).step_by(1000) {
        let rows: Vec<u32> = (start as u32..(start + 1000).min(n) as u32).collect();
        let t = forward(layers, features(set, &rows), true);
        let (_, c, _) = softmax_xent(&t.output, &labels(set, &rows));
        correct += c;
    }
    correct as f64 / n.max(1) as f64
}

/// Step size, optionally decayed by `factor` every `every_epochs` epochs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LrSchedule {
    pub base: f32,
    pub every_epochs: u32,
    pub factor: f32,
}

impl LrSchedule {
    pub fn constant(base: f32) -> Self {
        LrSchedule {
            base,
            every_epochs: 0,
            factor: 1.0,
        }
    }

    pub fn at(&self, epoch: u64) -> f32 {
        if self.every_epochs == 0 {
            return self.base;
        }
        let k = (epoch / u64::from(self.every_epochs)).min(i32::MAX as u64) as i32;
        self.base * self.factor.powi(k)
    }
}

/// SGD with momentum over a slice of layers: `v ← μ v + mean gradient; w ← w − lr v`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sgd {
    pub lr: LrSchedule,
    pub momentum: f32,
    pub velocity: Vec<Dense>,
}

impl Sgd {
    pub fn new(layers: &[Dense], lr: LrSchedule, momentum: f32) -> Self {
        Sgd {
            lr,
            momentum,
            velocity: layers.iter().map(Dense::zeros_like).collect(),
        }
    }

    /// One step with gradient sums `grads` divided by `divisor` (the samples they sum over, for
    /// the mean gradient), in `epoch`.
    pub fn step(&mut self, layers: &mut [Dense], grads: &[Dense], divisor: f32, epoch: u64) {
        self.step_as(layers, grads, divisor, epoch, 1);
    }

    /// [`Self::step`] standing in for `steps` consecutive steps whose mean gradients average
    /// `grads / (divisor · steps)`: the weights and the velocity end where those steps would take
    /// them if their gradients were equal (first order otherwise). With `ḡ` that average and
    /// `μ` the momentum: `w ← w − lr (a v + b ḡ)`, `v ← μ^steps v + c ḡ`, where
    /// `a = μ + … + μ^steps`, `c = 1 + … + μ^(steps−1)` and `b = Σ_{j=1..steps} (1 + … + μ^(j−1))`.
    /// One step is plain momentum SGD: `v ← μ v + g; w ← w − lr v`.
    pub fn step_as(
        &mut self,
        layers: &mut [Dense],
        grads: &[Dense],
        divisor: f32,
        epoch: u64,
        steps: u32,
    ) {
        if divisor <= 0.0 || !divisor.is_finite() {
            return;
        }
        let n = steps.max(1) as i32;
        let m = self.momentum;
        let partial = |j: i32| -> f32 { (0..j).map(|i| m.powi(i)).sum() };
        let a: f32 = (1..=n).map(|i| m.powi(i)).sum();
        let b: f32 = (1..=n).map(partial).sum();
        let c = partial(n);
        let mu = m.powi(n);
        let inv = 1.0 / (divisor * n as f32);
        let lr = self.lr.at(epoch);
        let update = |w: &mut f32, v: &mut f32, g: f32| {
            let g = g * inv;
            *w -= lr * (a * *v + b * g);
            *v = mu * *v + c * g;
        };
        for ((layer, v), g) in layers.iter_mut().zip(&mut self.velocity).zip(grads) {
            ndarray::Zip::from(&mut layer.w)
                .and(&mut v.w)
                .and(&g.w)
                .for_each(|w, v, &g| update(w, v, g));
            ndarray::Zip::from(&mut layer.b)
                .and(&mut v.b)
                .and(&g.b)
                .for_each(|w, v, &g| update(w, v, g));
        }
    }
}

/// Layers as one flat vector (weights row-major, then biases, layer by layer).
pub fn flatten(layers: &[Dense]) -> Vec<f32> {
    let mut out = Vec::with_capacity(layers.iter().map(Dense::len).sum());
    for l in layers {
        out.extend(l.w.iter());
        out.extend(l.b.iter());
    }
    out
}

/// Inverse of [`flatten`] into layers shaped like `like`; `None` if the length differs.
pub fn unflatten(like: &[Dense], flat: &[f32]) -> Option<Vec<Dense>> {
    if flat.len() != like.iter().map(Dense::len).sum::<usize>() {
        return None;
    }
    let mut at = 0;
    let mut out = Vec::with_capacity(like.len());
    for l in like {
        let nw = l.w.len();
        let w = Array2::from_shape_vec(l.w.raw_dim(), flat[at..at + nw].to_vec()).ok()?;
        at += nw;
        let b = Array1::from_vec(flat[at..at + l.b.len()].to_vec());
        at += l.b.len();
        out.push(Dense { w, b });
    }
    Some(out)
}

/// Add `b` into `a` (gradient accumulation).
pub fn add_into(a: &mut [Dense], b: &[Dense]) {
    for (x, y) in a.iter_mut().zip(b) {
        x.w += &y.w;
        x.b += &y.b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Loss sum of a whole model on one batch.
    fn loss(layers: &[Dense], x: &Array2<f32>, y: &[u8]) -> f64 {
        softmax_xent(&forward(layers, x.clone(), true).output, y).0
    }

    #[test]
    fn gradients_match_finite_differences() {
        let shape = MlpShape::new(vec![5, 7, 6, 3]).unwrap();
        let mut layers = shape.init(3);
        for l in &mut layers {
            l.b.mapv_inplace(|_| 0.1);
        }
        let x = Array2::from_shape_fn((4, 5), |(i, j)| ((i * 5 + j) as f32 * 0.37).sin());
        let y = [0u8, 2, 1, 2];
        let t = forward(&layers, x.clone(), true);
        let (_, _, g) = softmax_xent(&t.output, &y);
        let (grads, gin) = backward(&layers, &t, g, true, true);
        let eps = 1e-2f32;
        for l in 0..layers.len() {
            for idx in [(0usize, 0usize), (1, 2), (3, 1)] {
                if idx.0 >= layers[l].w.nrows() || idx.1 >= layers[l].w.ncols() {
                    continue;
                }
                let mut p = layers.clone();
                p[l].w[idx] += eps;
                let mut m = layers.clone();
                m[l].w[idx] -= eps;
                let num = (loss(&p, &x, &y) - loss(&m, &x, &y)) / (2.0 * f64::from(eps));
                let ana = f64::from(grads[l].w[idx]);
                assert!(
                    (num - ana).abs() < 2e-2 * (1.0 + num.abs()),
                    "layer {l} {idx:?}: {num} vs {ana}"
                );
            }
        }
        let gin = gin.unwrap();
        let mut xp = x.clone();
        xp[[1, 3]] += eps;
        let mut xm = x.clone();
        xm[[1, 3]] -= eps;
        let num = (loss(&layers, &xp, &y) - loss(&layers, &xm, &y)) / (2.0 * f64::from(eps));
        assert!((num - f64::from(gin[[1, 3]])).abs() < 2e-2 * (1.0 + num.abs()));
    }

    #[test]
    fn split_layers_compute_what_the_whole_model_computes() {
        let shape = MlpShape::new(vec![6, 8, 8, 4]).unwrap();
        let layers = shape.init(9);
        let x = Array2::from_shape_fn((3, 6), |(i, j)| (i + 2 * j) as f32 / 10.0);
        let y = [1u8, 3, 0];
        let whole = forward(&layers, x.clone(), true);
        let (_, _, g) = softmax_xent(&whole.output, &y);
        let (gw, _) = backward(&layers, &whole, g.clone(), true, false);
        let a = forward(&layers[..1], x, false);
        let b = forward(&layers[1..], a.output.clone(), true);
        assert_eq!(b.output, whole.output);
        let (gb, gin) = backward(&layers[1..], &b, g, true, true);
        let (ga, _) = backward(&layers[..1], &a, gin.unwrap(), false, false);
        assert_eq!(ga[0], gw[0]);
        assert_eq!(gb, gw[1..].to_vec());
    }

    #[test]
    fn a_combined_step_equals_sequential_steps_with_equal_gradients() {
        let shape = MlpShape::new(vec![3, 2]).unwrap();
        let start = shape.init(4);
        let mut g = start.clone();
        for l in &mut g {
            l.w.mapv_inplace(|x| x * 0.5 + 0.1);
            l.b.fill(0.3);
        }
        let lr = LrSchedule::constant(0.1);
        let (mut seq, mut one) = (start.clone(), start.clone());
        let (mut s1, mut s2) = (Sgd::new(&start, lr, 0.9), Sgd::new(&start, lr, 0.9));
        // Some velocity first, the same in both.
        s1.step(&mut seq, &g, 2.0, 0);
        s2.step(&mut one, &g, 2.0, 0);
        for _ in 0..3 {
            s1.step(&mut seq, &g, 1.0, 0);
        }
        let mut sum = g.clone();
        for l in &mut sum {
            l.w *= 3.0;
            l.b *= 3.0;
        }
        s2.step_as(&mut one, &sum, 1.0, 0, 3);
        let close = |x: &[Dense], y: &[Dense]| {
            flatten(x)
                .iter()
                .zip(flatten(y))
                .all(|(a, b)| (a - b).abs() < 1e-5)
        };
        assert!(close(&seq, &one), "{seq:?} vs {one:?}");
        assert!(close(&s1.velocity, &s2.velocity));
    }

    #[test]
    fn flatten_roundtrips_and_shapes_are_validated() {
        let shape = MlpShape::new(vec![3, 4, 2]).unwrap();
        let l = shape.init(1);
        assert_eq!(flatten(&l).len(), shape.params());
        assert_eq!(unflatten(&l, &flatten(&l)).unwrap(), l);
        assert!(unflatten(&l, &[0.0; 3]).is_none());
        assert_eq!(MlpShape::new(vec![3]), Err(ShapeError::TooFew(1)));
        assert_eq!(MlpShape::new(vec![3, 0, 2]), Err(ShapeError::Zero));
    }
}
