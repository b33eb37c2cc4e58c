// out = x / sqrt(mean(x^2) + eps) * weight for each `width`-wide row of x: one workgroup per
// row, the mean square accumulated in f32 and added across threads in shared memory.

const THREADS: u32 = 64u;

struct Params {
    rows: u32,
    width: u32,
    eps: f32,
    x_offset: u32,
    weight_offset: u32,
    out_offset: u32,
}

@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
var<immediate> p: Params;

var<workgroup> partial: array<f32, 64>;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(num_workgroups) workgroups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    for (var r = workgroup.x; r < p.rows; r += workgroups.x) {
        let row = p.x_offset + r * p.width;
        var sum = 0.0;
        for (var c = lane; c < p.width; c += THREADS) {
            let v = x[row + c];
            sum += v * v;
        }
        partial[lane] = sum;
        workgroupBarrier();
        for (var half = THREADS / 2u; half > 0u; half >>= 1u) {
            if lane < half {
                partial[lane] += partial[lane + half];
            }
            workgroupBarrier();
        }
        let inv = 1.0 / sqrt(partial[0] / f32(p.width) + p.eps);
        for (var c = lane; c < p.width; c += THREADS) {
            out[p.out_offset + r * p.width + c] = x[p.weight_offset + c] * (x[row + c] * inv);
        }
        workgroupBarrier();
    }
}
