//! The gated activations an FFN combines its gate and up projections with: SiLU and SwiGLU,
//! and Kimi K3's bounded SiTU-GLU. A leaf: the engines (which build FFNs) and the backends
//! (which run them on a device) both import it, and it imports neither.
//!
//! `situ(g, u) = b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2)`: SwiGLU to first order near the
//! origin, with each factor bounded (`|.| < b1` and `< b2`). Without a linear beta the up
//! branch passes through unchanged, as the vendor code does when
//! `activation_situ_linear_beta` is null.

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate = silu(gate) * up`, element-wise, leaving the product in `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// The two betas of SiTU-GLU (`activation_situ_beta`, `activation_situ_linear_beta`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Situ {
    pub beta: f32,
    pub linear_beta: Option<f32>,
}

impl Situ {
    /// `gate = situ(gate, up)`, element-wise, leaving the product in `gate`.
    pub fn apply(&self, gate: &mut [f32], up: &[f32]) {
        let b1 = self.beta;
        for (g, &u) in gate.iter_mut().zip(up) {
            let x = *g;
            let bounded = b1 * (x / b1).tanh() * (1.0 / (1.0 + (-x).exp()));
            let linear = match self.linear_beta {
                Some(b2) => b2 * (u / b2).tanh(),
                None => u,
            };
            *g = bounded * linear;
        }
    }
}

/// The element-wise combination of the gate and up projections in a gated FFN.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// `silu(gate) * up`.
    SwiGlu,
    /// Kimi K3's bounded SiTU-GLU.
    Situ(Situ),
}

impl Activation {
    /// `gate = act(gate, up)` on the CPU.
    pub fn apply(&self, gate: &mut [f32], up: &[f32]) {
        match self {
            Activation::SwiGlu => swiglu(gate, up),
            Activation::Situ(situ) => situ.apply(gate, up),
        }
    }
}
