//! The GPU backends, one test binary: the CUDA and Vulkan kernels against the CPU reference
//! (CUDA's also on the CPU, its device code compiled against stand-ins for the built-ins), the
//! Vulkan backend end to end, and what a device that fails mid-run leaves.

#[path = "../common/mod.rs"]
mod common;
mod cuda_reference;

mod backend_fallback;
mod backend_vulkan;
mod cuda_kernels;
mod cuda_kernels_emulated;
mod vulkan_kernels;
