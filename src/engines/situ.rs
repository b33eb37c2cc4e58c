//! The dense MLP on SiTU-GLU, Kimi K3's bounded gated activation ([`Situ`], in
//! [`crate::activation`]): K3's first layer and its fused shared experts; its routed
//! experts run [`Situ::ffn`] too.

use anyhow::Result;

use super::layers::glu_ffn;
use crate::activation::Situ;
use crate::quant::{Matrix, Width};
use crate::snapshot::Snapshot;

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

/// A dense SiTU-GLU MLP (`{prefix}.{gate,up,down}_proj.weight`).
pub struct SituMlp {
    act: Situ,
    gate: Matrix,
    up: Matrix,
    down: Matrix,
}

impl SituMlp {
    pub fn load(
        snapshot: &Snapshot,
        prefix: &str,
        hidden: usize,
        inter: usize,
        act: Situ,
        width: Width,
    ) -> Result<SituMlp> {
        let [gate, up, down] = [
            ("gate_proj", [inter, hidden]),
            ("up_proj", [inter, hidden]),
            ("down_proj", [hidden, inter]),
        ]
        .map(|(name, shape)| {
            snapshot
                .tensor_shaped(&format!("{prefix}.{name}.weight"), &shape)
                .and_then(|view| Matrix::load(&view, width))
        });
        Ok(SituMlp {
            act,
            gate: gate?,
            up: up?,
            down: down?,
        })
    }

    pub fn forward(&self, input: &[f32], n: usize) -> Vec<f32> {
        self.act.ffn(&self.gate, &self.up, &self.down, input, n)
    }

    pub fn size_bytes(&self) -> usize {
        self.gate.size_bytes() + self.up.size_bytes() + self.down.size_bytes()
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
