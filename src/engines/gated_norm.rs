//! The sigmoid-gated RMSNorm that closes a linear-attention head (fla's `FusedRMSNormGated`
//! with a sigmoid activation; transformers' `KimiLinearRMSNormGated`): each head's output is
//! RMS-normalised over the head dimension, scaled by the norm weight, then multiplied by
//! `sigmoid(gate)` of the same element.

use super::layers::rms_norm;

/// `out = rms_norm(x, weight, eps) * sigmoid(gate)` for each `weight.len()`-wide row of `x`
/// (one head of one token); `gate` and `out` have the layout of `x`.
pub fn rms_norm_sigmoid_gated(x: &[f32], weight: &[f32], gate: &[f32], eps: f64, out: &mut [f32]) {
    rms_norm(x, weight, eps, out);
    for (y, &g) in out.iter_mut().zip(gate) {
        *y *= 1.0 / (1.0 + (-g).exp());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_is_normalised_then_gated() {
        // Rows [3, 4] (mean square 12.5) and [1, 1] (1); gates 0 (half) and a large one.
        let mut out = [0f32; 4];
        rms_norm_sigmoid_gated(
            &[3.0, 4.0, 1.0, 1.0],
            &[1.0, 2.0],
            &[0.0, 0.0, 40.0, 40.0],
            0.0,
            &mut out,
        );
        let inv = 1.0 / 12.5f32.sqrt();
        let want = [0.5 * 3.0 * inv, 0.5 * 8.0 * inv, 1.0, 2.0];
        for (a, b) in out.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{out:?}");
        }
    }
}
