// gate = act(gate, up), element-wise over `count` values: SwiGLU (silu(g) * u) or SiTU-GLU
// (b1 tanh(g / b1) sigmoid(g) * b2 tanh(u / b2), or * u without a linear beta).

const SWIGLU: u32 = 0u;

struct Params {
    count: u32,
    gate_offset: u32,
    up_offset: u32,
    activation: u32,
    beta: f32,
    linear_beta: f32,
    // 0 when SiTU passes the up branch through unchanged.
    has_linear_beta: u32,
}

@group(0) @binding(2) var<storage, read_write> values: array<f32>;
var<immediate> p: Params;

// tanh from one exponential of a non-positive argument, so that it cannot overflow.
fn bounded_tanh(v: f32) -> f32 {
    let e = exp(-2.0 * abs(v));
    return sign(v) * (1.0 - e) / (1.0 + e);
}

fn sigmoid(v: f32) -> f32 {
    return 1.0 / (1.0 + exp(-v));
}

@compute @workgroup_size(64)
fn main(
    @builtin(global_invocation_id) id: vec3<u32>,
    @builtin(num_workgroups) workgroups: vec3<u32>,
) {
    for (var i = id.x; i < p.count; i += workgroups.x * 64u) {
        let g = values[p.gate_offset + i];
        let u = values[p.up_offset + i];
        var result: f32;
        if p.activation == SWIGLU {
            result = g / (1.0 + exp(-g)) * u;
        } else {
            var linear = u;
            if p.has_linear_beta != 0u {
                linear = p.linear_beta * bounded_tanh(u / p.linear_beta);
            }
            result = p.beta * bounded_tanh(g / p.beta) * sigmoid(g) * linear;
        }
        values[p.gate_offset + i] = result;
    }
}
