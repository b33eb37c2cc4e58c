//! SiTU-GLU's FFN ([`Situ`], Kimi K3's bounded gated activation, is in
//! [`crate::activation`]): what K3's routed experts run; its dense layers and shared experts
//! are [`GatedMlp`](super::layers::GatedMlp)s of the same activation.

use super::layers::glu_ffn;
use crate::activation::Situ;
use crate::quant::Matrix;

impl Situ {
    /// `down(situ(gate x, up x))` for `n` rows of `input`.
    pub fn ffn(
        &self,
        gate: &Matrix,
        up: &Matrix,
        down: &Matrix,
        input: &[f32],
        n: usize,
    ) -> Vec<f32> {
        glu_ffn(gate, up, down, input, n, |g, u| self.apply(g, u))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn situ_by_hand() {
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        let act = Situ {
            beta: 2.0,
            linear_beta: Some(3.0),
        };
        let mut gate = [1.5f32, -4.0, 0.0];
        act.apply(&mut gate, &[2.0, 10.0, 5.0]);
        let want = [
            2.0 * (0.75f32).tanh() * sigmoid(1.5) * 3.0 * (2.0f32 / 3.0).tanh(),
            2.0 * (-2.0f32).tanh() * sigmoid(-4.0) * 3.0 * (10.0f32 / 3.0).tanh(),
            0.0,
        ];
        for (g, w) in gate.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{gate:?} vs {want:?}");
        }
        // Bounded: |situ| < b1 * b2 however large the inputs.
        let mut big = [1e4f32];
        act.apply(&mut big, &[1e4]);
        assert!(big[0] <= 6.0 && big[0] > 5.99);
    }

    #[test]
    fn without_a_linear_beta_the_up_branch_passes_through() {
        let act = Situ {
            beta: 1.0,
            linear_beta: None,
        };
        let mut gate = [0.5f32];
        act.apply(&mut gate, &[40.0]);
        let want = (0.5f32).tanh() / (1.0 + (-0.5f32).exp()) * 40.0;
        assert!((gate[0] - want).abs() < 1e-5);
    }
}
