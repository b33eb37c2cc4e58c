//! The Vulkan device against the CPU reference, on the machine's Vulkan driver (Mesa's
//! lavapipe in CI). A device that does not open fails every test with the reason.
//!
//! Tolerance: the device decodes every format exactly and accumulates in f32 in another
//! order than the CPU. Recursive f32 summation of `k` products carries an error of at most
//! `(k + 1) u Σ|w x|` (`u = 2^-24`), the scales add a few roundings more, so for a row of
//! `cols` columns two such results differ by at most `2 (cols + 4) u Σ|w x|`, with
//! `Σ|w x|` taken over the decoded weights in f64. The expert group carries that bound
//! through the activation and the down product (see [`ExpertBound`]).

use crate::common;

use std::sync::OnceLock;

use coli::activation::Activation;
use coli::activation::Situ;
use coli::backend::vulkan::{VulkanDevice, VulkanOptions};
use coli::backend::{Device, DeviceError, ExpertGroup, GroupExpert};
use coli::engines::layers::{rms_norm, swiglu_ffn};
use coli::quant::{Format, Isa, Matrix};
use common::{kernel_formats, random};

const UNIT: f64 = 1.0 / (1u64 << 24) as f64;

/// Square, odd columns (a partial last word and partial groups), and several FP8 blocks.
const SHAPES: [(usize, usize); 3] = [(64, 64), (100, 37), (257, 130)];

fn device() -> &'static VulkanDevice {
    static DEVICE: OnceLock<VulkanDevice> = OnceLock::new();
    DEVICE.get_or_init(|| {
        VulkanDevice::open(&VulkanOptions::default())
            .unwrap_or_else(|error| panic!("the Vulkan device did not open: {error:#}"))
    })
}

/// `Σ_c |W[r][c] x[t][c]|` for every output, in f64 over the decoded weights.
fn magnitudes(matrix: &Matrix, input: &[f32], n: usize) -> Vec<f64> {
    let (rows, cols) = (matrix.rows(), matrix.cols());
    let weights = matrix.to_f32();
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            out[t * rows + r] = (0..cols)
                .map(|c| (f64::from(weights[r * cols + c]) * f64::from(input[t * cols + c])).abs())
                .sum();
        }
    }
    out
}

fn assert_matmul_matches(matrix: &Matrix, id: u64, n: usize, seed: u64) {
    assert_matmul_matches_on(device(), matrix, id, n, seed);
}

fn assert_matmul_matches_on(device: &VulkanDevice, matrix: &Matrix, id: u64, n: usize, seed: u64) {
    let (rows, cols) = (matrix.rows(), matrix.cols());
    let input = random(n * cols, seed);
    let mut want = vec![0f32; n * rows];
    matrix.matmul_with(Isa::Scalar, &input, n, &mut want);
    let mut got = vec![f32::NAN; n * rows];
    device
        .matmul(id, &input, n, &mut got)
        .unwrap_or_else(|e| panic!("{} {rows}x{cols} n={n}: {e}", matrix.format()));
    let bound = 2.0 * (cols + 4) as f64 * UNIT;
    for (i, ((g, w), m)) in got
        .iter()
        .zip(&want)
        .zip(magnitudes(matrix, &input, n))
        .enumerate()
    {
        let error = (f64::from(*g) - f64::from(*w)).abs();
        assert!(
            error <= bound * m + 1e-30,
            "{} {rows}x{cols} n={n} output {i}: device {g}, CPU {w}, allowed {}",
            matrix.format(),
            bound * m
        );
    }
}

#[test]
fn matmul_matches_the_cpu_for_every_format_and_shape() {
    matmul_matches_on(device());
}

fn matmul_matches_on(device: &VulkanDevice) {
    for (f, format) in kernel_formats(&[32, 64]).into_iter().enumerate() {
        for (s, &(rows, cols)) in SHAPES.iter().enumerate() {
            let seed = (f * 10 + s) as u64;
            let matrix = Matrix::from_f32_as(rows, cols, &random(rows * cols, seed), format)
                .expect("encodable");
            let id = device.upload(&matrix.raw()).expect("upload");
            for n in [1, 3, 17] {
                assert_matmul_matches_on(device, &matrix, id, n, seed + n as u64);
            }
            device.release(id);
        }
    }
}

#[test]
fn a_matrix_larger_than_one_buffer_is_split_into_row_parts() {
    // 4100 x 4096 f32 is 64 MiB and a row more: two parts.
    let (rows, cols) = (4100, 4096);
    let matrix =
        Matrix::from_f32_as(rows, cols, &random(rows * cols, 7), Format::F32).expect("f32");
    let id = device().upload(&matrix.raw()).expect("upload");
    assert_matmul_matches(&matrix, id, 2, 8);
    device().release(id);
}

#[test]
fn uploads_through_a_staging_copy_match_too() {
    let staged = VulkanOptions {
        staged: true,
        ..VulkanOptions::default()
    };
    matmul_matches_on(&open(&staged));
    thousands_of_small_weights_on(&open(&staged));
}

fn open(options: &VulkanOptions) -> VulkanDevice {
    VulkanDevice::open(options).unwrap_or_else(|e| panic!("the Vulkan device did not open: {e:#}"))
}

/// More weights than the 4096 memory allocations many drivers allow: they share a few
/// memory blocks, each computes with its own values (an overlap would show in the first
/// ones, checked after the last is written), and released room serves the next uploads.
#[test]
fn thousands_of_small_weights_share_a_few_memory_blocks() {
    // A device of its own, so that other tests' weights do not change its block count.
    thousands_of_small_weights_on(&open(&VulkanOptions::default()));
}

fn thousands_of_small_weights_on(own: &VulkanDevice) {
    const COUNT: usize = 5000;
    let wave = |seed: u64| -> Vec<(Matrix, u64)> {
        (0..COUNT)
            .map(|i| {
                let values = random(16 * 16, seed + i as u64);
                let matrix = Matrix::from_f32_as(16, 16, &values, Format::F32).expect("f32");
                let id = own
                    .upload(&matrix.raw())
                    .unwrap_or_else(|e| panic!("upload {i} of {COUNT}: {e}"));
                (matrix, id)
            })
            .collect()
    };
    let check = |weights: &[(Matrix, u64)]| {
        for i in (0..COUNT).step_by(499).chain([1, COUNT - 1]) {
            let (matrix, id) = &weights[i];
            assert_matmul_matches_on(own, matrix, *id, 2, 50_000 + i as u64);
        }
    };
    let first = wave(10_000);
    check(&first);
    let blocks = own.memory_blocks();
    assert!(
        (1..=8).contains(&blocks),
        "{COUNT} weights of 1 KiB took {blocks} memory blocks"
    );
    for (_, id) in &first {
        own.release(*id);
    }
    assert!(own.memory_blocks() <= blocks);
    let second = wave(20_000);
    check(&second);
    assert_eq!(
        own.memory_blocks(),
        blocks,
        "a second wave of the same size needed other blocks"
    );
    let memory = own.memory();
    assert!(memory.free <= memory.total, "{memory:?}");
}

#[test]
fn concurrent_callers_get_their_own_results() {
    let matrix = Matrix::from_f32_as(96, 80, &random(96 * 80, 21), Format::Int8Row).expect("int8");
    let id = device().upload(&matrix.raw()).expect("upload");
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let matrix = &matrix;
            scope.spawn(move || {
                for round in 0..5 {
                    assert_matmul_matches(
                        matrix,
                        id,
                        1 + (thread as usize + round) % 5,
                        100 * thread + round as u64,
                    );
                }
            });
        }
    });
    device().release(id);
}

#[test]
fn rms_norm_matches_the_cpu() {
    for (width, rows) in [(64, 1), (37, 5), (2048, 3)] {
        let x: Vec<f32> = random(rows * width, width as u64)
            .iter()
            .map(|v| v * 3.0)
            .collect();
        let weight = random(width, 99);
        let eps = 1e-6f32;
        let mut want = vec![0f32; x.len()];
        rms_norm(&x, &weight, f64::from(eps), &mut want);
        let mut got = vec![f32::NAN; x.len()];
        device()
            .rms_norm(&x, &weight, eps, &mut got)
            .expect("rms_norm");
        // The mean square in f32 (the CPU's is f64) is off by at most `width u` relatively,
        // its inverse square root by half that and a few roundings.
        let bound = (width + 16) as f64 * UNIT;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let error = (f64::from(*g) - f64::from(*w)).abs();
            assert!(
                error <= bound * f64::from(w.abs()) + 1e-30,
                "width {width} element {i}: device {g}, CPU {w}"
            );
        }
    }
}

/// One expert of a test group: its matrices and the `(row, weight)` pairs routed to it.
struct TestExpert {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    rows: Vec<(usize, f32)>,
}

/// The error allowed for each output of an expert group, from the f64 products:
/// gate and up are off by at most `eg = 2 (width + 4) u Σ|w x|`; the activation moves by
/// at most `1.1 eg_gate |u| + |g| eu + (32 + 4|g|) u |h|` (its slopes are below 1.1 in the
/// gate and 1 in the up branch; the last term is the GPU's exp and tanh error); the down
/// product adds `Σ|d| |Δh| + 2 (inter + 4) u Σ|d h|`, and the weighted sum over experts
/// `experts u Σ|weight · down|`. The CPU result is within the same bound of the exact one,
/// so the device and the CPU may differ by twice it. `|h|` is SwiGLU's, which bounds
/// SiTU-GLU's (each of its bounded branches is no larger than the unbounded one).
struct ExpertBound;

impl ExpertBound {
    fn per_output(experts: &[TestExpert], input: &[f32], rows: usize, width: usize) -> Vec<f64> {
        let mut bound = vec![0f64; rows * width];
        for expert in experts {
            let inter = expert.gate.rows();
            let [gate, up, down] = [&expert.gate, &expert.up, &expert.down].map(|m| m.to_f32());
            for &(row, weight) in &expert.rows {
                let x = &input[row * width..][..width];
                let product = |w: &[f32], k: usize| -> (f64, f64) {
                    (0..width).fold((0.0, 0.0), |(sum, mag), c| {
                        let term = f64::from(w[k * width + c]) * f64::from(x[c]);
                        (sum + term, mag + term.abs())
                    })
                };
                let mut hidden_error = vec![0f64; inter];
                let mut hidden = vec![0f64; inter];
                for k in 0..inter {
                    let (g, g_mag) = product(&gate, k);
                    let (u, u_mag) = product(&up, k);
                    let (eg, eu) = (
                        2.0 * (width + 4) as f64 * UNIT * g_mag,
                        2.0 * (width + 4) as f64 * UNIT * u_mag,
                    );
                    let h = g / (1.0 + (-g).exp()) * u;
                    hidden[k] = h;
                    hidden_error[k] = 1.1 * eg * (u.abs() + eu)
                        + (g.abs() + eg) * eu
                        + (32.0 + 4.0 * g.abs()) * UNIT * h.abs();
                }
                for c in 0..width {
                    let (mut spread, mut mag) = (0.0, 0.0);
                    for k in 0..inter {
                        let d = f64::from(down[c * inter + k]).abs();
                        spread += d * hidden_error[k];
                        mag += d * (hidden[k].abs() + hidden_error[k]);
                    }
                    let down_error = spread + 2.0 * (inter + 4) as f64 * UNIT * mag;
                    bound[row * width + c] += f64::from(weight.abs())
                        * (down_error + (experts.len() + 1) as f64 * UNIT * mag);
                }
            }
        }
        bound.iter().map(|b| 2.0 * b).collect()
    }
}

fn test_experts(width: usize, inter: usize, rows: usize) -> Vec<TestExpert> {
    let formats = [
        (
            Format::Int4Grouped { group: 32 },
            Format::Int8Row,
            Format::Bf16,
        ),
        (Format::Mxfp4, Format::F32, Format::Int4Row),
        (
            Format::Fp8E4m3B128,
            Format::F16,
            Format::Int4Grouped { group: 32 },
        ),
        (Format::Int8Row, Format::Int8Row, Format::Int8Row),
    ];
    // Expert 3 gets no rows; the last row goes to no expert; row 0 goes to every routed one.
    let routes: [Vec<(usize, f32)>; 4] = [
        vec![(0, 0.5), (2, 0.25), (3, 1.5)],
        vec![(1, 0.75), (0, -0.3), (5, 0.2), (2, 0.9)],
        vec![(4, 1.0), (0, 0.125)],
        vec![],
    ];
    assert!(routes.iter().flatten().all(|&(row, _)| row + 1 < rows));
    formats
        .iter()
        .zip(routes)
        .enumerate()
        .map(|(e, (&(g, u, d), rows))| {
            let seed = 1000 + 10 * e as u64;
            let make = |r, c, format, seed| {
                let values: Vec<f32> = random(r * c, seed).iter().map(|v| v * 0.5).collect();
                Matrix::from_f32_as(r, c, &values, format).expect("encodable")
            };
            TestExpert {
                gate: make(inter, width, g, seed),
                up: make(inter, width, u, seed + 1),
                down: make(width, inter, d, seed + 2),
                rows,
            }
        })
        .collect()
}

fn assert_expert_group_matches(activation: Activation) {
    let (width, inter, rows) = (48, 40, 7);
    let experts = test_experts(width, inter, rows);
    let input: Vec<f32> = random(rows * width, 5).iter().map(|v| v * 2.0).collect();

    let mut want = vec![0f32; rows * width];
    for expert in &experts {
        let gathered: Vec<f32> = expert
            .rows
            .iter()
            .flat_map(|&(row, _)| input[row * width..][..width].iter().copied())
            .collect();
        let n = expert.rows.len();
        let outputs = match activation {
            Activation::SwiGlu => swiglu_ffn(&expert.gate, &expert.up, &expert.down, &gathered, n),
            Activation::Situ(situ) => {
                situ.ffn(&expert.gate, &expert.up, &expert.down, &gathered, n)
            }
        };
        for (j, &(row, weight)) in expert.rows.iter().enumerate() {
            for (o, v) in want[row * width..][..width]
                .iter_mut()
                .zip(&outputs[j * width..])
            {
                *o += weight * v;
            }
        }
    }

    let ids: Vec<[u64; 3]> = experts
        .iter()
        .map(|e| [&e.gate, &e.up, &e.down].map(|m| device().upload(&m.raw()).expect("upload")))
        .collect();
    let group_experts: Vec<GroupExpert<'_>> = experts
        .iter()
        .zip(&ids)
        .map(|(e, &[gate, up, down])| GroupExpert {
            gate,
            up,
            down,
            rows: &e.rows,
        })
        .collect();
    let group = ExpertGroup {
        experts: &group_experts,
        input: &input,
        rows,
        width,
        activation,
    };
    let mut got = vec![f32::NAN; rows * width];
    device()
        .expert_group(&group, &mut got)
        .expect("expert group");

    let bound = ExpertBound::per_output(&experts, &input, rows, width);
    for (i, ((g, w), b)) in got.iter().zip(&want).zip(&bound).enumerate() {
        let error = (f64::from(*g) - f64::from(*w)).abs();
        assert!(
            error <= b + 1e-30,
            "{activation:?} output {i}: device {g}, CPU {w}, allowed {b}"
        );
    }
    assert!(
        got[(rows - 1) * width..].iter().all(|&v| v == 0.0),
        "an unrouted row is zero"
    );
    assert!(want.iter().any(|&v| v != 0.0));
    for id in ids.into_iter().flatten() {
        device().release(id);
    }
}

#[test]
fn expert_group_matches_the_cpu_with_swiglu() {
    assert_expert_group_matches(Activation::SwiGlu);
}

#[test]
fn expert_group_matches_the_cpu_with_situ() {
    // Small betas so that both bounded branches bend.
    assert_expert_group_matches(Activation::Situ(Situ {
        beta: 0.5,
        linear_beta: Some(0.75),
    }));
    assert_expert_group_matches(Activation::Situ(Situ {
        beta: 0.5,
        linear_beta: None,
    }));
}

#[test]
fn released_weights_are_gone_and_uploads_go_on() {
    let memory = device().memory();
    assert!(
        memory.total > 0 && memory.free <= memory.total,
        "{memory:?}"
    );
    assert!(
        device().description().starts_with("Vulkan: "),
        "{}",
        device().description()
    );
    let matrix = Matrix::from_f32_as(32, 40, &random(32 * 40, 3), Format::Int4Row).expect("int4");
    let first = device().upload(&matrix.raw()).expect("upload");
    device().release(first);
    device().release(first);
    let mut out = vec![0f32; 32];
    let refused = device().matmul(first, &random(40, 4), 1, &mut out);
    assert!(
        matches!(refused, Err(DeviceError::Unsupported(_))),
        "{refused:?}"
    );
    let second = device()
        .upload(&matrix.raw())
        .expect("upload after a release");
    assert_ne!(first, second);
    assert_matmul_matches(&matrix, second, 3, 5);
    device().release(second);
}

#[test]
fn a_device_of_its_own_opens_computes_and_drops() {
    let own = open(&VulkanOptions::default());
    let matrix = Matrix::from_f32_as(8, 8, &random(64, 11), Format::F32).expect("f32");
    let id = own.upload(&matrix.raw()).expect("upload");
    let mut out = vec![0f32; 8];
    own.matmul(id, &random(8, 12), 1, &mut out).expect("matmul");
    assert!(out.iter().any(|&v| v != 0.0));
    drop(own);
}

#[test]
fn open_names_a_missing_loader() {
    let options = VulkanOptions {
        loader: Some("/nonexistent/libvulkan.so.1".into()),
        ..VulkanOptions::default()
    };
    let error = match VulkanDevice::open(&options) {
        Ok(_) => panic!("opened a device without a loader"),
        Err(error) => format!("{error:#}"),
    };
    assert!(
        error.contains("COLI_VK_LOADER=/nonexistent/libvulkan.so.1"),
        "{error}"
    );
    assert!(error.contains("no Vulkan loader"), "{error}");
}

#[test]
fn a_device_index_beyond_the_list_is_refused_by_name() {
    let options = VulkanOptions {
        device: Some(1000),
        ..VulkanOptions::default()
    };
    let error = match VulkanDevice::open(&options) {
        Ok(_) => panic!("opened device 1000"),
        Err(error) => format!("{error:#}"),
    };
    assert!(
        error.contains("COLI_VK_DEVICE=1000: there are only"),
        "{error}"
    );
}
