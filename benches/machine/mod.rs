//! The machine's limits the benchmarks measure their figures against, in the same run: the
//! memory read bandwidth, the register-only FMA peak, and the load average (the machine is
//! shared). Also [`touch`], so that no timed step pays a page fault.
// Each benchmark uses a different subset of these.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use coli::snapshot::Snapshot;
use rayon::prelude::*;

/// Read bandwidth in bytes per second: a sum over 1 GiB on every thread, best of five.
pub fn bandwidth() -> f64 {
    let buffer: Vec<u64> = (0..(1usize << 30) / 8).map(|i| i as u64).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let started = Instant::now();
        std::hint::black_box(sum(&buffer));
        best = best.max((buffer.len() * 8) as f64 / started.elapsed().as_secs_f64());
    }
    best
}

/// The wrapping sum of `buffer` on every thread.
pub fn sum(buffer: &[u64]) -> u64 {
    buffer
        .par_chunks(1 << 16)
        .map(|chunk| {
            // Four independent sums so the adds keep up with the loads.
            let mut acc = [0u64; 4];
            for quad in chunk.chunks_exact(4) {
                for lane in 0..4 {
                    acc[lane] = acc[lane].wrapping_add(quad[lane]);
                }
            }
            acc.iter().fold(0u64, |a, &v| a.wrapping_add(v))
        })
        .reduce(|| 0, u64::wrapping_add)
}

/// Multiply-adds one call of an [`FmaKernel`] makes per lane and chain.
pub const FMA_STEPS: usize = 1 << 22;
/// Independent chains per call: enough to hide the FMA latency.
pub const FMA_CHAINS: usize = 12;

/// A register-only FMA loop at one vector width.
pub struct FmaKernel {
    pub name: &'static str,
    pub lanes: usize,
    /// `FMA_STEPS` x `FMA_CHAINS` x `lanes` multiply-adds; `unsafe` because it needs the
    /// instruction set [`fma_kernels`] detected.
    pub run: unsafe fn(f32) -> f32,
}

impl FmaKernel {
    /// Multiply-adds one call on every thread makes.
    pub fn multiply_adds(&self, threads: usize) -> usize {
        threads * FMA_STEPS * FMA_CHAINS * self.lanes
    }

    /// One call on each of `threads` threads of their own, started together once all of
    /// them exist, and the time from that start to the last call's end (the threads'
    /// creation left out: on a many-core host it takes milliseconds). Not on the thread
    /// pool: there a worker that is still asleep when the first one starts leaves both
    /// calls to the first, and the probe reads half the machine (seen here in about half
    /// of the runs).
    pub fn run_on(&self, threads: usize) -> (f32, Duration) {
        let go = AtomicBool::new(false);
        std::thread::scope(|scope| {
            // Also released if a thread cannot be created, so the others finish and the
            // failure surfaces instead of a hang.
            let release = Release(&go);
            let calls: Vec<_> = (0..threads)
                .map(|t| {
                    let go = &go;
                    scope.spawn(move || {
                        while !go.load(Ordering::Acquire) {
                            std::hint::spin_loop();
                        }
                        // SAFETY: `fma_kernels` only returns kernels whose instruction set
                        // it detected.
                        unsafe { (self.run)(t as f32 * 1e-3) }
                    })
                })
                .collect();
            let started = Instant::now();
            drop(release);
            let sum = calls
                .into_iter()
                .map(|call| call.join().expect("FMA probe thread"))
                .sum();
            (sum, started.elapsed())
        })
    }
}

/// Sets its flag when dropped: [`FmaKernel::run_on`]'s start.
struct Release<'a>(&'a AtomicBool);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// The FMA kernels this CPU runs: AVX2 (256 bits) and, where present, AVX-512.
pub fn fma_kernels() -> Vec<FmaKernel> {
    let mut kernels = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx2,fma")]
        unsafe fn chains256(seed: f32) -> f32 {
            let mut acc = [_mm256_set1_ps(seed); FMA_CHAINS];
            let (a, b) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-4));
            for _ in 0..FMA_STEPS {
                for v in acc.iter_mut() {
                    *v = _mm256_fmadd_ps(*v, a, b);
                }
            }
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(
                lanes.as_mut_ptr(),
                acc.iter()
                    .fold(_mm256_setzero_ps(), |s, &v| _mm256_add_ps(s, v)),
            );
            lanes.iter().sum()
        }
        #[target_feature(enable = "avx512f")]
        unsafe fn chains512(seed: f32) -> f32 {
            let mut acc = [_mm512_set1_ps(seed); FMA_CHAINS];
            let (a, b) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-4));
            for _ in 0..FMA_STEPS {
                for v in acc.iter_mut() {
                    *v = _mm512_fmadd_ps(*v, a, b);
                }
            }
            let mut total = _mm512_setzero_ps();
            for v in acc {
                total = _mm512_add_ps(total, v);
            }
            _mm512_reduce_add_ps(total)
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            kernels.push(FmaKernel {
                name: "avx2 fma peak",
                lanes: 8,
                run: chains256,
            });
            if is_x86_feature_detected!("avx512f") {
                kernels.push(FmaKernel {
                    name: "avx512 fma peak",
                    lanes: 16,
                    run: chains512,
                });
            }
        }
    }
    kernels
}

/// The f32 FMA peak in multiply-adds per second on every thread: the widest kernel's best
/// of five; `None` where the CPU has no FMA kernel here.
pub fn fma_peak() -> Option<f64> {
    let kernel = fma_kernels().pop()?;
    let threads = rayon::current_num_threads();
    let mut best = 0f64;
    for _ in 0..5 {
        let (sum, took) = kernel.run_on(threads);
        std::hint::black_box(sum);
        best = best.max(kernel.multiply_adds(threads) as f64 / took.as_secs_f64());
    }
    Some(best)
}

/// Touch every page of every tensor through the snapshot's mappings, so no timed step pays
/// a page fault.
pub fn touch(snapshot: &Snapshot) {
    let names: Vec<&str> = snapshot.names().collect();
    let sum: u64 = names
        .par_iter()
        .map(|name| {
            let view = snapshot.tensor(name).expect("tensor");
            view.bytes
                .as_slice()
                .iter()
                .step_by(4096)
                .map(|&b| u64::from(b))
                .sum::<u64>()
        })
        .sum();
    std::hint::black_box(sum);
}

/// The 1-, 5- and 15-minute load averages.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".to_string())
}
