//! The profiler: per layer, forward and backward time for the job's minibatch size, output
//! activation bytes and parameter bytes, measured on this machine.
//!
//! `concurrency` runs that many profiling threads at once, each timing every layer: when several
//! emulated workers share this machine's cores (a benchmark on one host), a layer takes as long as
//! it takes with the others computing beside it, and that is the time the partitioner must use.

use crate::apps::mlp::{self, Dense, MlpShape};
use ndarray::Array2;
use proteus_wire::agent_api::LayerTiming;
use std::time::Instant;

/// What the partitioner knows of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerProfile {
    pub forward_secs: f64,
    pub backward_secs: f64,
    /// One optimizer step of the layer as a stage takes it: its gradient flattened and back,
    /// the weights copied (stashed versions keep theirs), momentum SGD.
    pub update_secs: f64,
    /// Bytes of the layer's output for one minibatch (what crosses a stage boundary after it,
    /// forward; its gradient crosses back).
    pub activation_bytes: u64,
    pub param_bytes: u64,
}

impl LayerProfile {
    /// Forward, backward and an optimizer step.
    pub fn compute_secs(&self) -> f64 {
        self.forward_secs + self.backward_secs + self.update_secs
    }
}

/// Per-layer profile for one minibatch size.
#[derive(Debug, Clone, PartialEq)]
pub struct Profile {
    pub batch: usize,
    pub layers: Vec<LayerProfile>,
    /// A stage's processor time per byte of the activations and gradients it sends and
    /// receives across its boundaries (encoding, decoding, copying: on the cores its compute
    /// uses). 0 in a profile of the layers alone; [`super::calibration`] measures it.
    pub message_secs_per_byte: f64,
}

impl Profile {
    pub fn compute_secs(&self) -> f64 {
        self.layers.iter().map(LayerProfile::compute_secs).sum()
    }
    pub fn param_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.param_bytes).sum()
    }
}

impl Profile {
    /// The times of this profile as a job spec pins them (`training.pipeline.profile`).
    pub fn timings(&self) -> Vec<LayerTiming> {
        self.layers
            .iter()
            .map(|l| LayerTiming {
                forward_ms: l.forward_secs * 1e3,
                backward_ms: l.backward_secs * 1e3,
                update_ms: l.update_secs * 1e3,
            })
            .collect()
    }
}

/// A pinned profile that does not fit the model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a pinned profile of {got} layers for a model of {want}")]
pub struct PinnedMismatch {
    pub got: usize,
    pub want: usize,
}

/// The profile a job pinned (`training.pipeline.profile`): its times, and the bytes `shape`
/// and `batch` give, as [`profile`] counts them.
pub fn pinned(
    shape: &MlpShape,
    batch: usize,
    timings: &[LayerTiming],
) -> Result<Profile, PinnedMismatch> {
    if timings.len() != shape.layers() {
        return Err(PinnedMismatch {
            got: timings.len(),
            want: shape.layers(),
        });
    }
    let layers = timings
        .iter()
        .enumerate()
        .map(|(l, t)| {
            let (activation_bytes, param_bytes) = layer_bytes(shape, batch, l);
            LayerProfile {
                forward_secs: t.forward_ms / 1e3,
                backward_secs: t.backward_ms / 1e3,
                update_secs: t.update_ms / 1e3,
                activation_bytes,
                param_bytes,
            }
        })
        .collect();
    Ok(Profile {
        batch,
        layers,
        message_secs_per_byte: 0.0,
    })
}

/// Layer `l`'s output bytes for one minibatch and its parameter bytes (f32).
fn layer_bytes(shape: &MlpShape, batch: usize, l: usize) -> (u64, u64) {
    (
        (batch * shape.widths()[l + 1] * 4) as u64,
        (shape.layer_params(l) * 4) as u64,
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Time one layer's forward pass, backward pass and optimizer step `reps` times each (after
/// one warm-up run).
fn time_layer(layer: &Dense, batch: usize, last: bool, reps: usize) -> [Vec<f64>; 3] {
    let inputs = layer.w.nrows();
    let x = Array2::from_shape_fn((batch, inputs), |(i, j)| {
        ((i * 31 + j * 17) % 97) as f32 / 97.0
    });
    let layers = std::slice::from_ref(layer);
    let mut opt = mlp::Sgd::new(layers, mlp::LrSchedule::constant(0.01), 0.9);
    let mut weights = std::sync::Arc::new(layers.to_vec());
    let (mut f, mut b, mut u) = (Vec::new(), Vec::new(), Vec::new());
    for rep in 0..=reps {
        let t = Instant::now();
        let trace = mlp::forward(layers, x.clone(), last);
        let tf = t.elapsed().as_secs_f64();
        let g = Array2::from_elem(trace.output.raw_dim(), 0.01f32);
        let t = Instant::now();
        let (grads, gin) = mlp::backward(layers, &trace, g, last, true);
        let tb = t.elapsed().as_secs_f64();
        std::hint::black_box(gin);
        // As `StageCore::apply` steps: a flat gradient back into layers, the weights copied
        // on write while a stashed version shares them.
        let t = Instant::now();
        let flat = mlp::flatten(&grads);
        let stashed = weights.clone();
        if let Some(grads) = mlp::unflatten(&weights, &flat) {
            let w = std::sync::Arc::make_mut(&mut weights);
            opt.step(w, &grads, batch as f32, 0);
        }
        let tu = t.elapsed().as_secs_f64();
        std::hint::black_box(stashed);
        if rep > 0 {
            f.push(tf);
            b.push(tb);
            u.push(tu);
        }
    }
    [f, b, u]
}

/// Profile every layer of `shape` at minibatch size `batch`, `reps` timed runs per layer, on
/// `concurrency` threads at once (at least one).
pub fn profile(shape: &MlpShape, batch: usize, reps: usize, concurrency: usize) -> Profile {
    let layers = shape.init(0);
    let n = layers.len();
    let runs: Vec<Vec<[Vec<f64>; 3]>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..concurrency.max(1))
            .map(|_| {
                let layers = &layers;
                s.spawn(move || {
                    (0..n)
                        .map(|l| time_layer(&layers[l], batch, l + 1 == n, reps.max(1)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let layers = (0..n)
        .map(|l| {
            let of = |i: usize| -> Vec<f64> {
                runs.iter().flat_map(|r| r[l][i].iter().copied()).collect()
            };
            let (activation_bytes, param_bytes) = layer_bytes(shape, batch, l);
            LayerProfile {
                forward_secs: median(of(0)),
                backward_secs: median(of(1)),
                update_secs: median(of(2)),
                activation_bytes,
                param_bytes,
            }
        })
        .collect();
    Profile {
        batch,
        layers,
        message_secs_per_byte: 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profile_counts_bytes_and_measures_time() {
        let shape = MlpShape::new(vec![64, 32, 10]).unwrap();
        let p = profile(&shape, 16, 3, 1);
        assert_eq!(p.layers.len(), 2);
        assert_eq!(p.layers[0].activation_bytes, 16 * 32 * 4);
        assert_eq!(p.layers[0].param_bytes, (64 * 32 + 32) * 4);
        assert_eq!(p.layers[1].activation_bytes, 16 * 10 * 4);
        assert!(
            p.layers
                .iter()
                .all(|l| l.forward_secs > 0.0 && l.backward_secs > 0.0 && l.update_secs > 0.0)
        );
        // Pinned as a spec writes it, the same profile comes back, bytes and all.
        let again = pinned(&shape, 16, &p.timings()).unwrap();
        assert_eq!(again.layers.len(), p.layers.len());
        for (a, b) in again.layers.iter().zip(&p.layers) {
            assert_eq!(
                (a.activation_bytes, a.param_bytes),
                (b.activation_bytes, b.param_bytes)
            );
            assert!((a.compute_secs() - b.compute_secs()).abs() < 1e-12);
        }
        assert_eq!(
            pinned(&shape, 16, &p.timings()[..1]),
            Err(PinnedMismatch { got: 1, want: 2 })
        );
    }
}
