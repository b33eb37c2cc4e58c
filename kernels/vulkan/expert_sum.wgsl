// out[r] = sum over the experts that row r was routed to, in routing order, of
// weight * down[entry]: the rows of an expert group's down products joined into its output.
// Row r's entries are index[entries + 2i] (a row of `down`) and index[entries + 2i + 1]
// (the gate weight's f32 bits) for i from index[starts + r] to index[starts + r + 1].

const THREADS: u32 = 64u;

struct Params {
    rows: u32,
    width: u32,
    starts: u32,
    entries: u32,
    down_offset: u32,
    out_offset: u32,
}

@group(0) @binding(1) var<storage, read> down: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read> index: array<u32>;
var<immediate> p: Params;

@compute @workgroup_size(64)
fn main(
    @builtin(workgroup_id) workgroup: vec3<u32>,
    @builtin(num_workgroups) workgroups: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    for (var r = workgroup.x; r < p.rows; r += workgroups.x) {
        let first = index[p.starts + r];
        let end = index[p.starts + r + 1u];
        for (var c = lane; c < p.width; c += THREADS) {
            var sum = 0.0;
            for (var i = first; i < end; i++) {
                let source = index[p.entries + 2u * i];
                let weight = bitcast<f32>(index[p.entries + 2u * i + 1u]);
                sum += weight * down[p.down_offset + source * p.width + c];
            }
            out[p.out_offset + r * p.width + c] = sum;
        }
    }
}
