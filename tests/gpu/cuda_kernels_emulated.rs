//! The CUDA kernels on the CPU: `kernels/cuda/coli.cu` compiled by the system C++ compiler
//! against CPU stand-ins for the CUDA built-ins (`tests/gpu/cuda_harness.cpp`), and
//! fed what the device code stages and queues: the bytes and steps of
//! [`MatmulPlan`] and [`GroupPlan`], at "device addresses" that are offsets into the
//! harness's memory. Every kernel is checked against the CPU reference: the products of
//! every format at odd shapes, RMSNorm, the activations, the combination of expert outputs,
//! and whole expert groups. The same operations on a GPU are `cuda_kernels`.

use crate::common;
use crate::cuda_reference;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use coli::activation::Activation;
use coli::activation::Situ;
use coli::backend::cuda::{Arg, GroupBuffers, GroupPlan, Layout, MatmulPlan, Placed, Step};
use coli::backend::{ExpertGroup, GroupExpert, RawMatrix, RawScales};
use coli::engines::layers;
use coli::quant::{Format, Isa, Matrix};
use common::{kernel_formats, random};
use cuda_reference::{cpu_group, expert_matrices, magnitudes, routes_batched, routes_single};

/// Device allocations start on this boundary, as `cuMemAlloc`'s do.
const ALIGN: usize = 256;

/// The compiled harness, built once for all the tests of this file.
fn harness() -> &'static Path {
    static HARNESS: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let (_, path) = HARNESS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let harness = dir.path().join("harness");
        let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let built = Command::new(&compiler)
            .args(["-std=c++20", "-O1", "-pthread", "-I"])
            .arg(root.join("kernels/cuda"))
            .arg(root.join("tests/gpu/cuda_harness.cpp"))
            .arg("-o")
            .arg(&harness)
            .output()
            .unwrap_or_else(|e| panic!("a C++20 compiler ({compiler}) is needed: {e}"));
        assert!(
            built.status.success(),
            "{}",
            String::from_utf8_lossy(&built.stderr)
        );
        (dir, harness)
    });
    path
}

/// The harness's memory and the commands it runs, in its input format.
struct Emulation {
    arena: Vec<u8>,
    commands: Vec<u8>,
    count: u32,
    checks: usize,
}

impl Emulation {
    fn new() -> Emulation {
        Emulation {
            // Address 0 is the null pointer.
            arena: vec![0; ALIGN],
            commands: Vec::new(),
            count: 0,
            checks: 0,
        }
    }

    /// A new allocation of `bytes`, filled with NaN bytes so that a kernel reading what
    /// nothing wrote shows in its results.
    fn reserve(&mut self, bytes: usize) -> u64 {
        let address = self.arena.len();
        self.arena
            .resize((address + bytes).div_ceil(ALIGN) * ALIGN, 0xff);
        address as u64
    }

    fn bytes(&mut self, address: u64, len: usize) -> &mut [u8] {
        &mut self.arena[address as usize..][..len]
    }

    fn place(&mut self, bytes: &[u8]) -> u64 {
        let address = self.reserve(bytes.len());
        self.bytes(address, bytes.len()).copy_from_slice(bytes);
        address
    }

    fn place_floats(&mut self, values: &[f32]) -> u64 {
        self.place(bytemuck::cast_slice(values))
    }

    /// `raw` as `CudaDevice::upload` leaves it: rows padded to the layout's stride.
    fn upload(&mut self, raw: &RawMatrix<'_>) -> Placed {
        let layout = Layout::of(raw).expect("a layout the kernels take");
        let data = self.reserve(layout.rows * layout.stride);
        layout.pad_rows(raw.data, self.bytes(data, layout.rows * layout.stride));
        let scales = match raw.scales {
            RawScales::None => 0,
            RawScales::F32(scales) => self.place(bytemuck::cast_slice(scales)),
            RawScales::E8m0(scales) => self.place(scales),
        };
        Placed {
            layout,
            data,
            scales,
        }
    }

    fn command(&mut self, code: u32) {
        self.commands.extend(code.to_le_bytes());
        self.count += 1;
    }

    fn text(&mut self, text: &str) {
        self.commands.extend((text.len() as u32).to_le_bytes());
        self.commands.extend(text.as_bytes());
    }

    fn queue(&mut self, steps: &[Step]) {
        for step in steps {
            match step {
                Step::Clear { address, bytes } => {
                    self.command(0);
                    self.commands.extend(address.to_le_bytes());
                    self.commands.extend((*bytes as u64).to_le_bytes());
                }
                Step::Launch {
                    name,
                    grid,
                    threads,
                    args,
                } => {
                    self.command(1);
                    self.text(name);
                    for value in [grid.0 as u32, grid.1 as u32, *threads, args.len() as u32] {
                        self.commands.extend(value.to_le_bytes());
                    }
                    for arg in args {
                        let (kind, bits) = match *arg {
                            Arg::Address(address) => (0u32, address),
                            Arg::Int(value) => (1, u64::from(value as u32)),
                            Arg::Float(value) => (2, u64::from(value.to_bits())),
                        };
                        self.commands.extend(kind.to_le_bytes());
                        self.commands.extend(bits.to_le_bytes());
                    }
                }
            }
        }
    }

    /// After the steps queued so far, the floats at `address` must be within `allowed` of
    /// `want` (NaN where `want` is NaN).
    fn check(&mut self, label: &str, address: u64, want: &[f32], allowed: &[f32]) {
        assert_eq!(want.len(), allowed.len());
        self.command(2);
        self.text(label);
        self.commands.extend(address.to_le_bytes());
        self.commands.extend((want.len() as u64).to_le_bytes());
        for values in [want, allowed] {
            self.commands
                .extend(values.iter().flat_map(|v| v.to_le_bytes()));
        }
        self.checks += 1;
    }

    /// Run everything queued; panics with the harness's report unless every check passed.
    fn run(self) {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("commands.bin");
        let mut file = (self.arena.len() as u64).to_le_bytes().to_vec();
        file.extend(&self.arena);
        file.extend(self.count.to_le_bytes());
        file.extend(&self.commands);
        std::fs::write(&input, file).unwrap();
        let ran = Command::new(harness()).arg(&input).output().unwrap();
        let report = String::from_utf8_lossy(&ran.stdout);
        assert!(
            ran.status.success() && report.contains(&format!("0 of {} checks off", self.checks)),
            "{report}{}",
            String::from_utf8_lossy(&ran.stderr)
        );
    }
}

#[test]
fn every_format_matches_the_cpu_reference() {
    let formats = kernel_formats(&[32, 64]);
    // Partial 16-byte units, odd nibble rows, partial groups, two FP8 row blocks, rows not
    // a multiple of a block's 8; n = 9 is a whole and a partial tile of matmul_8.
    let shapes = [(37, 70), (9, 300), (130, 257), (3, 7)];
    let mut emulation = Emulation::new();
    for (f, &format) in formats.iter().enumerate() {
        for (s, &(rows, cols)) in shapes.iter().enumerate() {
            let seed = (f * 16 + s) as u64;
            let matrix = Matrix::from_f32_as(rows, cols, &random(rows * cols, seed), format)
                .expect("an encodable shape");
            let placed = emulation.upload(&matrix.raw());
            for n in [1, 9] {
                let input = random(n * cols, seed + 1000);
                let plan = MatmulPlan::new(placed, n).unwrap();
                let staged = emulation.reserve(plan.staged_bytes());
                let output = emulation.reserve(plan.output_bytes());
                plan.write(
                    &input,
                    staged,
                    output,
                    emulation.bytes(staged, plan.staged_bytes()),
                );
                emulation.queue(&plan.steps(staged));
                let (want, allowed) = expected_product(&matrix, &input, n);
                let label = format!("{format} {rows}x{cols} n={n}");
                emulation.check(&label, output, &want, &allowed);
            }
        }
    }
    emulation.run();
}

/// The CPU's product and the error each output may have. Two f32 dot products of `cols`
/// terms in different orders differ by at most about `2 (cols + 8) u` times the sum of the
/// terms' magnitudes (u = 2^-24), over the exactly decoded weights.
fn expected_product(matrix: &Matrix, input: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut want = vec![0f32; n * matrix.rows()];
    matrix.matmul_with(Isa::Scalar, input, n, &mut want);
    let unit = f64::from(f32::EPSILON) / 2.0;
    let bound = 2.0 * (matrix.cols() + 8) as f64 * unit;
    let allowed = magnitudes(matrix, input, n)
        .iter()
        .map(|m| (bound * m + 1e-30) as f32)
        .collect();
    (want, allowed)
}

#[test]
fn rms_norm_matches_the_cpu() {
    let mut emulation = Emulation::new();
    for (rows, width) in [(1, 2048), (5, 7), (3, 1), (2, 300)] {
        let x = random(rows * width, 40 + width as u64);
        let weight = random(width, 41);
        let eps = 1e-5f32;
        let (x_at, weight_at) = (emulation.place_floats(&x), emulation.place_floats(&weight));
        let out = emulation.reserve(rows * width * 4);
        emulation.queue(&[Step::rms_norm(x_at, weight_at, out, rows, width, eps)]);
        let mut want = vec![0f32; rows * width];
        layers::rms_norm(&x, &weight, f64::from(eps), &mut want);
        // Both sides sum the squares in f64, in different orders: the scale may differ in
        // its last bit, and each output by about that much.
        let allowed: Vec<f32> = want.iter().map(|c| 2.0 * f32::EPSILON * c.abs()).collect();
        emulation.check(&format!("rms_norm {rows}x{width}"), out, &want, &allowed);
    }
    emulation.run();
}

fn activations() -> [Activation; 3] {
    [
        Activation::SwiGlu,
        Activation::Situ(Situ {
            beta: 2.0,
            linear_beta: Some(3.0),
        }),
        Activation::Situ(Situ {
            beta: 1.5,
            linear_beta: None,
        }),
    ]
}

#[test]
fn glu_matches_the_cpu_activations() {
    let mut emulation = Emulation::new();
    // Not a multiple of the 256 threads of a block; large magnitudes saturate tanh and the
    // sigmoid; zeros must stay zero (the padding of an expert group relies on it).
    let count = 1000;
    let mut gate: Vec<f32> = random(count, 7).iter().map(|v| v * 12.0).collect();
    let up: Vec<f32> = random(count, 8).iter().map(|v| v * 12.0).collect();
    gate[..16].fill(0.0);
    for activation in activations() {
        let gate_at = emulation.place_floats(&gate);
        let up_at = emulation.place_floats(&up);
        emulation.queue(&[Step::glu(gate_at, up_at, count, activation)]);
        let mut want = gate.clone();
        activation.apply(&mut want, &up);
        // The same operations in the same order; exp and tanh may come from different
        // math libraries, each within an ulp or two.
        let allowed: Vec<f32> = want.iter().map(|c| 4.0 * f32::EPSILON * c.abs()).collect();
        emulation.check(&format!("glu {activation:?}"), gate_at, &want, &allowed);
    }
    emulation.run();
}

/// `count` experts with `formats` for gate, up and down, uploaded to `emulation`.
fn experts(
    emulation: &mut Emulation,
    count: usize,
    (width, inter): (usize, usize),
    formats: [Format; 3],
) -> (Vec<[Matrix; 3]>, Vec<[Placed; 3]>) {
    let matrices = expert_matrices(count, (width, inter), formats, random);
    let placed = matrices
        .iter()
        .map(|m| [0, 1, 2].map(|k| emulation.upload(&m[k].raw())))
        .collect();
    (matrices, placed)
}

/// The group's weights by id: expert `e`'s gate, up and down are ids `3e`, `3e + 1`, `3e + 2`.
fn group_experts<'a>(routes: &'a [Vec<(usize, f32)>]) -> Vec<GroupExpert<'a>> {
    routes
        .iter()
        .enumerate()
        .map(|(e, rows)| {
            let id = 3 * e as u64;
            GroupExpert {
                gate: id,
                up: id + 1,
                down: id + 2,
                rows,
            }
        })
        .collect()
}

/// Lay out `group` as the device does, in new buffers of `emulation`.
fn stage<'a>(
    emulation: &mut Emulation,
    group: &'a ExpertGroup<'a>,
    placed: &[[Placed; 3]],
) -> (GroupPlan<'a>, GroupBuffers) {
    let out_len = group.rows * group.width;
    let plan = GroupPlan::new(group, out_len, |id| {
        Ok(placed[id as usize / 3][id as usize % 3])
    })
    .unwrap()
    .expect("a group with routed rows");
    let at = GroupBuffers {
        staged: emulation.reserve(plan.staged_bytes()),
        gate: emulation.reserve(plan.hidden_bytes()),
        up: emulation.reserve(plan.hidden_bytes()),
        down: emulation.reserve(plan.down_bytes()),
        output: emulation.reserve(plan.output_bytes()),
    };
    plan.write(&at, emulation.bytes(at.staged, plan.staged_bytes()));
    (plan, at)
}

#[test]
fn combine_sums_each_row_in_expert_order() {
    let mut emulation = Emulation::new();
    let (width, inter, rows) = (300, 8, 6);
    for routes in [routes_batched(), routes_single()] {
        let (_, placed) = experts(
            &mut emulation,
            routes.len(),
            (width, inter),
            [Format::F32; 3],
        );
        let input = random(rows * width, 3);
        let experts = group_experts(&routes);
        let group = ExpertGroup {
            experts: &experts,
            input: &input,
            rows,
            width,
            activation: Activation::SwiGlu,
        };
        let (plan, at) = stage(&mut emulation, &group, &placed);
        // Down products the test chooses, one row per slot: the routed rows, expert by
        // expert.
        let slots: usize = routes.iter().map(Vec::len).sum();
        let down = random(slots * width, 4);
        emulation
            .bytes(at.down, plan.down_bytes())
            .copy_from_slice(bytemuck::cast_slice(&down));
        let steps = plan.steps(&at);
        emulation.queue(&steps[steps.len() - 1..]);
        let mut want = vec![0f32; rows * width];
        let entries = routes.iter().flatten();
        for (slot, &(row, weight)) in entries.enumerate() {
            for c in 0..width {
                want[row * width + c] += down[slot * width + c] * weight;
            }
        }
        let exact = vec![0f32; rows * width];
        emulation.check(
            &format!("combine of {} experts", routes.len()),
            at.output,
            &want,
            &exact,
        );
    }
    emulation.run();
}

#[test]
fn expert_groups_match_the_cpu() {
    let int4 = Format::Int4Grouped { group: 32 };
    let mut cases: Vec<(Activation, [Format; 3])> = [
        [Format::F32; 3],
        [int4, int4, Format::Int8Row],
        [Format::Mxfp4, Format::Bf16, Format::Fp8E4m3B128],
    ]
    .into_iter()
    .map(|formats| (Activation::SwiGlu, formats))
    .collect();
    cases.extend(activations()[1..].iter().map(|&a| (a, [Format::F16; 3])));
    // Experts 40 wide: the gate and up rows are padded to 64 floats, which the down
    // product reads as whole units.
    let (width, inter, rows) = (96, 40, 6);
    let input = random(rows * width, 77);
    let mut emulation = Emulation::new();
    for (activation, formats) in cases {
        for routes in [routes_batched(), routes_single()] {
            let (matrices, placed) = experts(&mut emulation, routes.len(), (width, inter), formats);
            let experts = group_experts(&routes);
            let group = ExpertGroup {
                experts: &experts,
                input: &input,
                rows,
                width,
                activation,
            };
            let (plan, at) = stage(&mut emulation, &group, &placed);
            emulation.queue(&plan.steps(&at));
            let (want, scale) = cpu_group(&matrices, &routes, &input, width, activation);
            // The gate and up products differ within the summation bound, the activation
            // by an ulp or two; SiLU and SiTU change slowly (derivative about 1 at most),
            // so the down product's inputs differ by about 1e-5 relative, well inside 1e-4
            // of the down product's Σ|w·h|. Unrouted rows must be exactly zero.
            let allowed: Vec<f32> = scale.iter().map(|s| (1e-4 * s) as f32).collect();
            let label = format!(
                "group {activation:?} {formats:?} of {} experts",
                routes.len()
            );
            emulation.check(&label, at.output, &want, &allowed);
        }
    }
    emulation.run();
}
