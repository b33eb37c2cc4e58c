//! The CUDA device against the CPU reference (`Matrix::matmul_with(Isa::Scalar, ..)`,
//! `layers::rms_norm`, the activations' `apply`): every format's product at real and odd
//! shapes for n = 1, 3 and 17, RMSNorm, expert groups with SwiGLU and SiTU-GLU, uploads
//! and releases. Device tests are ignored where no GPU is (cargo reports them as skipped);
//! `scripts/gpu-check.sh` runs them with `--include-ignored`.
//!
//! Tolerance. Both sides decode weights exactly and sum exact products `w·x` in f32, only
//! in different orders, so each is within `γ_d · Σ|w·x|` of the exact sum, where `d` is the
//! most roundings any one product goes through and `γ_d = d·u / (1 − d·u)`, `u = 2⁻²⁴`
//! (Higham, recursive summation; a fused multiply-add rounds once). The CPU adds each
//! product into one of 8 lanes in column order, then sums the lanes in a tree, with one
//! more rounding for a scale: `d ≤ cols/8 + 8`. A GPU thread adds its units in order
//! (at most `cols/32` products of its own for f32, fewer for the packed formats, plus the
//! at most 32 products of one unit's partial sum), then 5 shuffle levels and a scale:
//! `d ≤ cols/32 + 40`. So `|gpu − cpu| ≤ (γ_cpu + γ_gpu) · Σ|w·x|`, which for 4096 columns
//! is about 4e-5 of `Σ|w·x|`: tight enough that one wrongly decoded element of a
//! 4096-wide row (about 2.4e-4 of it) fails. Where the arithmetic is exact (small integer
//! weights and inputs, power-of-two scales) the results must be equal, whatever the order.

use crate::common;
use crate::cuda_reference;

use std::sync::OnceLock;

use coli::activation::Activation;
use coli::activation::Situ;
use coli::backend::cuda::{compile_kernels, CudaDevice};
use coli::backend::{Device, DeviceError, ExpertGroup, GroupExpert, RawMatrix};
use coli::engines::layers;
use coli::quant::{Format, Isa, Matrix};
use cuda_reference::{cpu_group, expert_matrices, magnitudes, routes_batched, routes_single};

/// Every format with kernels, int4-grouped at three group sizes.
fn formats() -> Vec<Format> {
    common::kernel_formats(&[16, 48, 64])
}

/// `[rows, cols]`: OLMoE's expert shapes, a 4096-wide row, and odd shapes (one column,
/// partial 16-byte units, odd nibble rows, partial groups, several FP8 row blocks, rows not
/// a multiple of the 8 rows of a block).
const SHAPES: [(usize, usize); 9] = [
    (1024, 2048),
    (2048, 1024),
    (64, 4096),
    (1, 1),
    (3, 7),
    (9, 33),
    (37, 70),
    (130, 257),
    (260, 300),
];

fn device() -> &'static CudaDevice {
    static DEVICE: OnceLock<CudaDevice> = OnceLock::new();
    DEVICE.get_or_init(|| match CudaDevice::open() {
        Ok(device) => device,
        Err(error) => panic!("{error:#}"),
    })
}

/// A deterministic spread of values in about [-2, 2], with some exact zeros.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if i % 29 == 0 {
                0.0
            } else {
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            }
        })
        .collect()
}

/// Small integers in [-limit, limit].
fn integers(n: usize, limit: i64, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 33) as i64 % (2 * limit + 1) - limit) as f32
        })
        .collect()
}

fn gamma(d: usize) -> f64 {
    let du = d as f64 * f64::powi(2.0, -24);
    du / (1.0 - du)
}

/// The bound of the module documentation for a row of `cols` products.
fn relative_bound(cols: usize) -> f64 {
    gamma(cols / 8 + 8) + gamma(cols.div_ceil(32) + 40)
}

fn upload(matrix: &Matrix) -> u64 {
    device().upload(&matrix.raw()).unwrap_or_else(|e| {
        panic!(
            "upload of {} {}x{}: {e}",
            matrix.format(),
            matrix.rows(),
            matrix.cols()
        )
    })
}

fn gpu_matmul(matrix: &Matrix, id: u64, input: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n * matrix.rows()];
    device()
        .matmul(id, input, n, &mut out)
        .unwrap_or_else(|e| panic!("matmul: {e}"));
    out
}

fn cpu_matmul(matrix: &Matrix, input: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * matrix.rows()];
    matrix.matmul_with(Isa::Scalar, input, n, &mut out);
    out
}

#[test]
fn open_names_what_is_missing() {
    // SAFETY: opens and closes the library only to see whether it exists.
    let driver_present = unsafe { cudarc::driver::sys::is_culib_present() };
    match CudaDevice::open() {
        Ok(device) => {
            assert!(driver_present);
            assert!(
                device.description().starts_with("CUDA: "),
                "{}",
                device.description()
            );
        }
        Err(error) => {
            let message = format!("{error:#}");
            assert!(
                !message.is_empty() && !message.contains("panicked"),
                "{message}"
            );
            if !driver_present {
                assert!(message.contains("libcuda.so"), "{message}");
            }
        }
    }
}

#[test]
#[ignore = "needs libnvrtc (the CUDA toolkit or the nvidia-cuda-nvrtc package) on LD_LIBRARY_PATH; run scripts/gpu-check.sh"]
fn the_kernels_compile_for_every_architecture() {
    // Turing, Ampere, Hopper: every NVRTC from CUDA 12 on knows them (CUDA 13 dropped 70).
    for arch in [75, 80, 90] {
        let ptx = compile_kernels(arch).unwrap_or_else(|e| panic!("{e:#}"));
        for name in coli::backend::cuda::KERNEL_NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{name} missing for compute_{arch}"
            );
        }
        // Registers only: a local-memory spill would mean the decoders' arrays did not unroll.
        assert!(
            !ptx.contains(".local"),
            "local memory in the compute_{arch} kernels"
        );
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn every_format_matches_the_cpu_within_the_summation_bound() {
    for (f, format) in formats().into_iter().enumerate() {
        for (s, &(rows, cols)) in SHAPES.iter().enumerate() {
            let seed = (f * 100 + s) as u64;
            let matrix = Matrix::from_f32_as(rows, cols, &values(rows * cols, seed), format)
                .expect("encodable");
            let id = upload(&matrix);
            for n in [1, 3, 17] {
                let input = values(n * cols, seed + 7 * n as u64);
                let gpu = gpu_matmul(&matrix, id, &input, n);
                let cpu = cpu_matmul(&matrix, &input, n);
                let scale = magnitudes(&matrix, &input, n);
                let bound = relative_bound(cols);
                for (i, ((&g, &c), &m)) in gpu.iter().zip(&cpu).zip(&scale).enumerate() {
                    let allowed = bound * m * 1.01 + 1e-30;
                    assert!(
                        (f64::from(g) - f64::from(c)).abs() <= allowed,
                        "{format} {rows}x{cols} n={n}: output {i} (row {}, input {}) gpu {g} cpu {c}, allowed {allowed:e}",
                        i % rows,
                        i / rows
                    );
                }
            }
            device().release(id);
        }
    }
}

/// Weights that each format holds exactly with power-of-two scales, and inputs, whose
/// products and sums are all exact in f32.
fn exact_weights(format: Format, rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let (limit, peak) = match format {
        // Row/group maximum 127 (int8) or 7 (int4): scale exactly 1.
        Format::Int8Row => (127, 127.0),
        Format::Int4Row | Format::Int4Grouped { .. } => (7, 7.0),
        // Block maximum 448: scale exactly 1; integers up to 16 are E4M3 values.
        Format::Fp8E4m3B128 => (16, 448.0),
        // Group maximum 6: shared exponent 0; e2m1 holds 0..4 and 6 as integers.
        Format::Mxfp4 => (4, 6.0),
        _ => (100, 100.0),
    };
    let mut weights = integers(rows * cols, limit, seed);
    // Put the peak in the first column of every row, group and 128-column block, so that
    // every scale comes out exactly 1.
    let every = match format {
        Format::Int4Grouped { group } => group,
        Format::Mxfp4 => 32,
        Format::Fp8E4m3B128 => 128,
        _ => cols,
    };
    for r in 0..rows {
        for c in (0..cols).step_by(every) {
            weights[r * cols + c] = peak;
        }
    }
    weights
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn exact_arithmetic_gives_equal_results() {
    for (f, format) in formats().into_iter().enumerate() {
        for &(rows, cols) in &[(130, 300), (64, 4096), (3, 7)] {
            let seed = 1000 + f as u64;
            let weights = exact_weights(format, rows, cols, seed);
            let matrix = Matrix::from_f32_as(rows, cols, &weights, format).expect("encodable");
            assert_eq!(
                matrix.to_f32(),
                weights,
                "{format}: the weights are not exact"
            );
            let id = upload(&matrix);
            for n in [1, 3, 17] {
                let input = integers(n * cols, 3, seed + n as u64);
                assert_eq!(
                    gpu_matmul(&matrix, id, &input, n),
                    cpu_matmul(&matrix, &input, n),
                    "{format} {rows}x{cols} n={n}"
                );
            }
            device().release(id);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn special_values_decode_as_on_the_cpu() {
    // bf16/f16 infinities and subnormals, and a NaN input, propagate as on the CPU; f16
    // subnormals are exact.
    let cols = 40;
    let mut weights = values(2 * cols, 5);
    weights[3] = f32::INFINITY;
    weights[cols + 5] = 3e-6;
    weights[cols + 6] = -6e-8;
    for format in [Format::Bf16, Format::F16] {
        let matrix = Matrix::from_f32_as(2, cols, &weights, format).expect("encodable");
        let id = upload(&matrix);
        let input = vec![1.0f32; cols];
        let gpu = gpu_matmul(&matrix, id, &input, 1);
        let cpu = cpu_matmul(&matrix, &input, 1);
        assert_eq!(gpu[0], cpu[0], "{format}: infinity");
        assert!(
            (gpu[1] - cpu[1]).abs() <= 1e-5 * cpu[1].abs().max(1.0),
            "{format}"
        );
        device().release(id);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn rms_norm_matches_the_cpu() {
    for (rows, width) in [(1, 2048), (5, 7), (17, 4096), (3, 1)] {
        let x = values(rows * width, 40 + width as u64);
        let weight = values(width, 41);
        let mut gpu = vec![f32::NAN; rows * width];
        device()
            .rms_norm(&x, &weight, 1e-5, &mut gpu)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut cpu = vec![0f32; rows * width];
        layers::rms_norm(&x, &weight, f64::from(1e-5f32), &mut cpu);
        for (i, (&g, &c)) in gpu.iter().zip(&cpu).enumerate() {
            // The mean square is summed in f64 on both sides; only the order differs.
            assert!(
                (g - c).abs() <= 2.0 * f32::EPSILON * c.abs(),
                "{rows}x{width} element {i}: gpu {g} cpu {c}"
            );
        }
    }
}

fn check_group(activation: Activation, routes: &[Vec<(usize, f32)>], formats: [Format; 3]) {
    let (width, inter, rows) = (256, 96, 6);
    let input = values(rows * width, 77);
    let matrices = expert_matrices(routes.len(), (width, inter), formats, values);
    let ids: Vec<[u64; 3]> = matrices
        .iter()
        .map(|m| [0, 1, 2].map(|k| upload(&m[k])))
        .collect();
    let experts: Vec<GroupExpert<'_>> = ids
        .iter()
        .zip(routes)
        .map(|(id, routed)| GroupExpert {
            gate: id[0],
            up: id[1],
            down: id[2],
            rows: routed,
        })
        .collect();
    let group = ExpertGroup {
        experts: &experts,
        input: &input,
        rows,
        width,
        activation,
    };
    let mut gpu = vec![f32::NAN; rows * width];
    device()
        .expert_group(&group, &mut gpu)
        .unwrap_or_else(|e| panic!("{e}"));
    let (cpu, scale) = cpu_group(&matrices, routes, &input, width, activation);
    for (i, ((&g, &c), &s)) in gpu.iter().zip(&cpu).zip(&scale).enumerate() {
        // The gate and up products differ within the summation bound, the activation's
        // exp and tanh by a few ulp; SiLU and SiTU change slowly (derivative about 1 at
        // most), so the down product's inputs differ by about 1e-5 relative, well inside
        // 1e-4 of the down product's Σ|w·h|. Unrouted rows must be exactly zero.
        let allowed = 1e-4 * s + 1e-30;
        assert!(
            (f64::from(g) - f64::from(c)).abs() <= allowed,
            "{activation:?} {formats:?}: output {i} (row {}) gpu {g} cpu {c}, allowed {allowed:e}",
            i / width
        );
    }
    for id in ids.iter().flatten() {
        device().release(*id);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn expert_groups_match_the_cpu_with_swiglu() {
    let int4 = Format::Int4Grouped { group: 32 };
    for formats in [
        [Format::F32; 3],
        [Format::Int8Row; 3],
        [int4, int4, Format::Int8Row],
        [Format::Mxfp4, Format::Bf16, Format::Fp8E4m3B128],
    ] {
        check_group(Activation::SwiGlu, &routes_batched(), formats);
        check_group(Activation::SwiGlu, &routes_single(), formats);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn expert_groups_match_the_cpu_with_situ() {
    for linear_beta in [Some(3.0), None] {
        let situ = Activation::Situ(Situ {
            beta: 2.0,
            linear_beta,
        });
        for formats in [[Format::F32; 3], [Format::Mxfp4; 3]] {
            check_group(situ, &routes_batched(), formats);
            check_group(situ, &routes_single(), formats);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn an_empty_group_zeroes_the_output() {
    let input = values(2 * 8, 3);
    let group = ExpertGroup {
        experts: &[],
        input: &input,
        rows: 2,
        width: 8,
        activation: Activation::SwiGlu,
    };
    let mut out = vec![f32::NAN; 16];
    device().expert_group(&group, &mut out).unwrap();
    assert_eq!(out, vec![0.0; 16]);
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn uploads_and_releases() {
    let device = device();
    let before = device.memory();
    assert!(
        before.total > 0 && before.free <= before.total,
        "{before:?}"
    );
    // 256 MiB of f32, more than one pinned half of the upload, so the halves alternate.
    let (rows, cols) = (16384, 4096);
    let matrix = Matrix::from_f32_as(rows, cols, &values(rows * cols, 9), Format::F32).unwrap();
    let id = upload(&matrix);
    let input = values(cols, 10);
    let gpu = gpu_matmul(&matrix, id, &input, 1);
    assert_eq!(gpu.len(), rows);
    device.release(id);
    let mut out = vec![0f32; rows];
    assert!(matches!(
        device.matmul(id, &input, 1, &mut out),
        Err(DeviceError::Unsupported(_))
    ));
    device.release(id);
    device.release(u64::MAX);

    let data = vec![0u8; 10];
    let wrong = RawMatrix {
        rows: 2,
        cols: 8,
        format: Format::Int8Row,
        data: &data,
        scales: coli::backend::RawScales::F32(&[1.0, 1.0]),
    };
    assert!(matches!(
        device.upload(&wrong),
        Err(DeviceError::Unsupported(_))
    ));
    let two_bit = RawMatrix {
        format: Format::Int2Row,
        ..wrong
    };
    assert!(matches!(
        device.upload(&two_bit),
        Err(DeviceError::Unsupported(_))
    ));
}

#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn concurrent_callers_get_their_own_results() {
    let matrices: Vec<Matrix> = (0..4)
        .map(|k| {
            Matrix::from_f32_as(300, 500, &values(300 * 500, 60 + k), Format::Int8Row).unwrap()
        })
        .collect();
    let ids: Vec<u64> = matrices.iter().map(upload).collect();
    std::thread::scope(|scope| {
        for (matrix, &id) in matrices.iter().zip(&ids) {
            scope.spawn(move || {
                for n in [1, 3, 17, 1, 3] {
                    let input = values(n * 500, id + n as u64);
                    let gpu = gpu_matmul(matrix, id, &input, n);
                    let cpu = cpu_matmul(matrix, &input, n);
                    let scale = magnitudes(matrix, &input, n);
                    for ((&g, &c), &m) in gpu.iter().zip(&cpu).zip(&scale) {
                        assert!(
                            (f64::from(g) - f64::from(c)).abs()
                                <= relative_bound(500) * m * 1.01 + 1e-30
                        );
                    }
                }
            });
        }
    });
    for id in ids {
        device().release(id);
    }
}

/// Device-side kernel time only (no host copies): the matvec's achieved bandwidth against
/// the measured device-to-device copy bandwidth. Prints one line per probe.
#[test]
#[ignore = "needs an NVIDIA GPU with a CUDA driver; run scripts/gpu-check.sh"]
fn matvec_bandwidth() {
    let device = device();
    let copy = device
        .measure_copy(1 << 30, 10)
        .unwrap_or_else(|e| panic!("{e}"));
    println!("device: {}", device.description());
    println!(
        "copy 1 GiB device-to-device: {:.1} GB/s (read + write)",
        copy / 1e9
    );
    let (rows, cols) = (4096, 4096);
    let base = values(rows * cols, 11);
    for format in [
        Format::Int8Row,
        Format::Bf16,
        Format::Int4Grouped { group: 64 },
        Format::Mxfp4,
    ] {
        let matrix = Matrix::from_f32_as(rows, cols, &base, format).unwrap();
        // Copies filling 512 MiB, cycled, so that the weights stream from memory rather
        // than the L2 cache.
        let copies = ((512usize << 20) / matrix.size_bytes()).max(2);
        let ids: Vec<u64> = (0..copies).map(|_| upload(&matrix)).collect();
        let seconds = device
            .measure_matmul(&ids, 200)
            .unwrap_or_else(|e| panic!("{e}"));
        let rate = matrix.size_bytes() as f64 / seconds;
        println!(
            "matvec {format} {rows}x{cols}: {:.1} us, {:.1} GB/s, {:.0}% of the copy rate",
            seconds * 1e6,
            rate / 1e9,
            100.0 * rate / copy
        );
        assert!(rate > 0.0);
        for id in ids {
            device.release(id);
        }
    }
}
