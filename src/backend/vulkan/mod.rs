//! The Vulkan [`Device`], on ash: loads the Vulkan loader at run time (nothing links
//! libvulkan), opens one physical device with a compute queue, and runs the WGSL compute
//! shaders of `kernels/vulkan` that `build.rs` compiles to SPIR-V.
//!
//! What it owns: the instance, the logical device and every object made from it; the
//! uploaded weights (one buffer per row part, see `packing`, bound inside large shared
//! memory blocks, see `blocks`); one device-local scratch buffer that every operation's
//! inputs, intermediates and outputs live in, and one host-visible staging buffer that
//! carries them to and from the host. Each operation is one command buffer, one submit and
//! one fence wait (at most `FENCE_TIMEOUT`), under one lock: calls from several threads
//! are serialised. What it must not do: decide what runs on the CPU (that is
//! [`crate::backend`]'s policy) or keep results on the device between calls.
//!
//! Reductions use workgroup shared memory only; no subgroup operation is needed, so no
//! subgroup feature is required or probed. Weights are read as u32 words, so no 8- or 16-bit
//! storage feature is needed either. The device needs Vulkan 1.2 and a compute queue.
//!
//! Weights go straight into memory that is both device-local and host-visible when such a
//! heap is large enough (integrated GPUs, resizable BAR, the CPU driver), else through the
//! staging buffer with a copy; [`VulkanOptions`] (the settings `COLI_VK_STAGED`,
//! `COLI_VK_LOADER` and `COLI_VK_DEVICE`) force the copy, name the loader library and pick
//! the physical device. This module reads no environment: the settings registry does.

mod blocks;
mod packing;
mod setup;

use std::collections::HashMap;
use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use ash::vk;

use self::blocks::{block_size, Block, Blocks, Placement};
use self::packing::{Packing, Part};
use self::setup::{
    choose_physical_device, create_instance, create_logical_device, find_memory_type,
    has_large_mappable_device_memory, largest_device_local_heap, load_entry, pipeline_of,
};
use super::group::GroupRouting;
use super::{Device, DeviceError, DeviceMemory, ExpertGroup, RawMatrix, WeightId};
use crate::activation::Activation;

/// How long one submission may run before the device is declared failed.
const FENCE_TIMEOUT: Duration = Duration::from_secs(10);

/// The largest buffer one weight part or one staged upload uses; a bigger matrix is cut
/// into row parts.
const MAX_PART_BYTES: u64 = 64 << 20;

/// Bytes of push constants every pipeline layout offers (the largest shader uses 60).
const PUSH_BYTES: u32 = 64;

/// The most workgroups one dispatch asks for; the shaders loop over the rest.
const MAX_WORKGROUPS: usize = 65535;

/// Weight rows one matmul workgroup loops over: fewer, longer workgroups cost less to start
/// on a CPU driver, and a matrix of thousands of rows still fills a GPU.
const ROWS_PER_WORKGROUP: usize = 8;

/// Threads per workgroup of the element-wise activation shader.
const GLU_THREADS: usize = 64;

/// The matmul shader specialised for each format code of [`packing`].
const MATMUL_SPV: [&[u8]; 7] = [
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_0.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_1.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_2.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_3.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_4.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_5.spv")),
    include_bytes!(concat!(env!("OUT_DIR"), "/matmul_6.spv")),
];
const RMS_NORM_SPV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/rms_norm.spv"));
const GLU_SPV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/glu.spv"));
const EXPERT_SUM_SPV: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/expert_sum.spv"));

/// How to open the Vulkan device; the default takes the system's loader and the best device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VulkanOptions {
    /// `COLI_VK_LOADER`: the loader library to open instead of the system's `libvulkan.so.1`.
    pub loader: Option<PathBuf>,
    /// `COLI_VK_DEVICE`: the physical device, by its index in the loader's list.
    pub device: Option<usize>,
    /// `COLI_VK_STAGED`: upload weights through the staging buffer even where device memory
    /// is host-visible.
    pub staged: bool,
}

/// A GPU (or the CPU driver) through Vulkan.
pub struct VulkanDevice {
    description: String,
    software: bool,
    /// The largest range one storage-buffer descriptor may bind.
    max_binding: u64,
    /// Whether weights are written through a mapping instead of a staged copy.
    direct_upload: bool,
    memory_budget: bool,
    memory_types: vk::PhysicalDeviceMemoryProperties,
    /// The largest device-local heap, the one [`Device::memory`] reports.
    heap: Option<usize>,
    /// Bytes of device memory this device holds on `heap`.
    allocated: AtomicU64,
    failed: AtomicBool,
    state: Mutex<State>,
    pipelines: Pipelines,
    set_layout: vk::DescriptorSetLayout,
    pipeline_layout: vk::PipelineLayout,
    pipeline_cache: vk::PipelineCache,
    queue: vk::Queue,
    device: ash::Device,
    physical: vk::PhysicalDevice,
    instance: ash::Instance,
    /// Keeps the loader library mapped while the instance lives.
    _entry: ash::Entry,
}

#[derive(Default)]
struct Pipelines {
    /// By format code.
    matmul: [vk::Pipeline; 7],
    rms_norm: vk::Pipeline,
    glu: vk::Pipeline,
    expert_sum: vk::Pipeline,
}

/// What one submission uses; only touched under the lock.
#[derive(Default)]
struct State {
    command_pool: vk::CommandPool,
    command: vk::CommandBuffer,
    fence: vk::Fence,
    descriptor_pool: vk::DescriptorPool,
    descriptor_capacity: u32,
    scratch: Option<Buffer>,
    staging: Option<Buffer>,
    blocks: Blocks,
    weights: HashMap<WeightId, Weight>,
    next_id: WeightId,
}

struct Weight {
    packing: Packing,
    parts: Vec<(Part, WeightBuffer)>,
}

/// A buffer with a device-memory allocation of its own.
struct Buffer {
    buffer: vk::Buffer,
    memory: vk::DeviceMemory,
    type_index: u32,
    /// Bytes the buffer holds.
    size: u64,
    /// Bytes of device memory it took.
    allocated: u64,
    mapped: Option<Mapped>,
}

/// One weight part's buffer, bound inside a block of [`State::blocks`].
struct WeightBuffer {
    buffer: vk::Buffer,
    placement: Placement,
}

/// A host mapping of device memory.
struct Mapped(NonNull<u8>);

// SAFETY: the mapping belongs to memory inside `State`, which is only reached through the
// device's mutex, so one thread at a time writes or reads it.
unsafe impl Send for Mapped {}

impl VulkanDevice {
    /// Load the Vulkan loader, pick a device and build the pipelines. The error names what
    /// is missing: the loader library, any device, Vulkan 1.2 or a compute queue.
    pub fn open(options: &VulkanOptions) -> Result<VulkanDevice> {
        let entry = load_entry(options.loader.as_deref())?;
        // SAFETY: the entry points come from a loaded Vulkan loader; the instance is destroyed
        // by `Drop` or below.
        let instance = unsafe { create_instance(&entry)? };
        let chosen = match unsafe { choose_physical_device(&instance, options.device) } {
            Ok(chosen) => chosen,
            Err(error) => {
                unsafe { instance.destroy_instance(None) };
                return Err(error);
            }
        };
        let device = match unsafe { create_logical_device(&instance, &chosen) } {
            Ok(device) => device,
            Err(error) => {
                unsafe { instance.destroy_instance(None) };
                return Err(error);
            }
        };
        let memory_types = unsafe { instance.get_physical_device_memory_properties(chosen.handle) };
        let mut vulkan = VulkanDevice {
            description: chosen.description.clone(),
            software: chosen.software,
            max_binding: u64::from(chosen.max_storage_buffer_range),
            direct_upload: !options.staged && has_large_mappable_device_memory(&memory_types),
            memory_budget: chosen.memory_budget,
            heap: largest_device_local_heap(&memory_types),
            memory_types,
            allocated: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            state: Mutex::new(State::default()),
            pipelines: Pipelines::default(),
            set_layout: vk::DescriptorSetLayout::null(),
            pipeline_layout: vk::PipelineLayout::null(),
            pipeline_cache: vk::PipelineCache::null(),
            queue: unsafe { device.get_device_queue(chosen.queue_family, 0) },
            device,
            physical: chosen.handle,
            instance,
            _entry: entry,
        };
        // On an error from here on, `Drop` destroys what was made (null handles are skipped
        // by Vulkan's destroy calls).
        unsafe { vulkan.build(chosen.queue_family)? };
        Ok(vulkan)
    }

    unsafe fn build(&mut self, queue_family: u32) -> Result<()> {
        let device = &self.device;
        let bindings: Vec<_> = (0..4)
            .map(|binding| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(binding)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        self.set_layout = device
            .create_descriptor_set_layout(
                &vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings),
                None,
            )
            .context("creating the descriptor set layout")?;
        let push = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .size(PUSH_BYTES)];
        let set_layouts = [self.set_layout];
        self.pipeline_layout = device
            .create_pipeline_layout(
                &vk::PipelineLayoutCreateInfo::default()
                    .set_layouts(&set_layouts)
                    .push_constant_ranges(&push),
                None,
            )
            .context("creating the pipeline layout")?;
        self.pipeline_cache = device
            .create_pipeline_cache(&vk::PipelineCacheCreateInfo::default(), None)
            .context("creating the pipeline cache")?;
        for (pipeline, spirv) in self.pipelines.matmul.iter_mut().zip(MATMUL_SPV) {
            *pipeline = pipeline_of(
                device,
                self.pipeline_layout,
                self.pipeline_cache,
                "matmul",
                spirv,
            )?;
        }
        let made = |name, spirv| {
            pipeline_of(
                device,
                self.pipeline_layout,
                self.pipeline_cache,
                name,
                spirv,
            )
        };
        self.pipelines.rms_norm = made("rms_norm", RMS_NORM_SPV)?;
        self.pipelines.glu = made("glu", GLU_SPV)?;
        self.pipelines.expert_sum = made("expert_sum", EXPERT_SUM_SPV)?;

        let state = self
            .state
            .get_mut()
            .map_err(|_| anyhow!("state lock poisoned"))?;
        state.command_pool = device
            .create_command_pool(
                &vk::CommandPoolCreateInfo::default()
                    .queue_family_index(queue_family)
                    .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER),
                None,
            )
            .context("creating the command pool")?;
        state.command = device
            .allocate_command_buffers(
                &vk::CommandBufferAllocateInfo::default()
                    .command_pool(state.command_pool)
                    .level(vk::CommandBufferLevel::PRIMARY)
                    .command_buffer_count(1),
            )
            .context("allocating the command buffer")?[0];
        state.fence = device
            .create_fence(&vk::FenceCreateInfo::default(), None)
            .context("creating the fence")?;
        Ok(())
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>, DeviceError> {
        if self.failed.load(Ordering::Relaxed) {
            return Err(DeviceError::Failed(anyhow!(
                "the Vulkan device failed earlier in this process"
            )));
        }
        self.state
            .lock()
            .map_err(|_| DeviceError::Failed(anyhow!("a thread panicked inside the Vulkan device")))
    }

    /// Mark the device failed when `result` says it failed.
    fn watch<T>(&self, result: Result<T, DeviceError>) -> Result<T, DeviceError> {
        if let Err(DeviceError::Failed(_)) = &result {
            self.failed.store(true, Ordering::Relaxed);
        }
        result
    }

    /// Whether the device is a driver computing on the host CPU (lavapipe): correct, and
    /// slower than the CPU backend, so `BACKEND=auto` passes it over.
    pub fn is_software(&self) -> bool {
        self.software
    }

    /// How many device-memory blocks hold the uploaded weights.
    pub fn memory_blocks(&self) -> usize {
        match self.state.lock() {
            Ok(state) => state.blocks.len(),
            Err(poisoned) => poisoned.into_inner().blocks.len(),
        }
    }

    /// Whether memory of type `type_index` lies on the heap [`Device::memory`] reports.
    fn on_reported_heap(&self, type_index: u32) -> bool {
        let heap = self.memory_types.memory_types[type_index as usize].heap_index as usize;
        self.heap == Some(heap)
    }

    fn memory_type(
        &self,
        needs: &vk::MemoryRequirements,
        required: vk::MemoryPropertyFlags,
        preferred: vk::MemoryPropertyFlags,
    ) -> Result<u32, DeviceError> {
        find_memory_type(
            &self.memory_types,
            needs.memory_type_bits,
            required,
            preferred,
        )
        .ok_or_else(|| {
            DeviceError::Failed(anyhow!(
                "no Vulkan memory type with property flags {:#x} for a {}-byte buffer",
                required.as_raw(),
                needs.size
            ))
        })
    }

    /// `size` bytes of memory type `type_index`, mapped whole when `map` asks for it.
    fn allocate_memory(
        &self,
        type_index: u32,
        size: u64,
        map: bool,
    ) -> Result<(vk::DeviceMemory, Option<Mapped>), DeviceError> {
        let info = vk::MemoryAllocateInfo::default()
            .allocation_size(size)
            .memory_type_index(type_index);
        // SAFETY: the memory is freed on the error path below or by `free_memory`.
        let memory = unsafe { self.device.allocate_memory(&info, None) }.map_err(|error| {
            DeviceError::Failed(anyhow!(
                "allocating {} of Vulkan memory: {error}",
                mib(size)
            ))
        })?;
        let mut mapped = None;
        if map {
            // SAFETY: the memory is host-visible (the caller chose its type for that) and
            // not mapped yet.
            match unsafe {
                self.device
                    .map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
            } {
                Ok(pointer) => mapped = NonNull::new(pointer.cast()).map(Mapped),
                Err(error) => {
                    unsafe { self.device.free_memory(memory, None) };
                    return Err(DeviceError::Failed(anyhow!(
                        "mapping Vulkan memory: {error}"
                    )));
                }
            }
        }
        if self.on_reported_heap(type_index) {
            self.allocated.fetch_add(size, Ordering::Relaxed);
        }
        Ok((memory, mapped))
    }

    /// Free memory from [`VulkanDevice::allocate_memory`] (its mapping goes with it).
    fn free_memory(&self, memory: vk::DeviceMemory, type_index: u32, size: u64) {
        // SAFETY: no submission is in flight while the lock is held, nothing bound to the
        // memory is used again, and the handle came from this device.
        unsafe { self.device.free_memory(memory, None) };
        if self.on_reported_heap(type_index) {
            self.allocated.fetch_sub(size, Ordering::Relaxed);
        }
    }

    fn new_buffer(
        &self,
        size: u64,
        usage: vk::BufferUsageFlags,
    ) -> Result<vk::Buffer, DeviceError> {
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(usage)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        // SAFETY: the caller destroys the buffer.
        unsafe { self.device.create_buffer(&info, None) }
            .map_err(|e| DeviceError::Failed(anyhow!("creating a {size}-byte buffer: {e}")))
    }

    /// A buffer with memory of its own, mapped when `required` is host-visible.
    fn create_buffer(
        &self,
        size: u64,
        usage: vk::BufferUsageFlags,
        required: vk::MemoryPropertyFlags,
        preferred: vk::MemoryPropertyFlags,
    ) -> Result<Buffer, DeviceError> {
        let buffer = self.new_buffer(size, usage)?;
        // SAFETY: the buffer came from this device; it is destroyed on the error paths or
        // by `destroy`.
        let needs = unsafe { self.device.get_buffer_memory_requirements(buffer) };
        let map = required.contains(vk::MemoryPropertyFlags::HOST_VISIBLE);
        let allocated = self
            .memory_type(&needs, required, preferred)
            .and_then(|type_index| {
                let (memory, mapped) = self.allocate_memory(type_index, needs.size, map)?;
                Ok(Buffer {
                    buffer,
                    memory,
                    type_index,
                    size,
                    allocated: needs.size,
                    mapped,
                })
            });
        let made = match allocated {
            Ok(made) => made,
            Err(error) => {
                unsafe { self.device.destroy_buffer(buffer, None) };
                return Err(error);
            }
        };
        if let Err(error) = unsafe { self.device.bind_buffer_memory(buffer, made.memory, 0) } {
            self.destroy(made);
            return Err(DeviceError::Failed(anyhow!(
                "binding buffer memory: {error}"
            )));
        }
        Ok(made)
    }

    fn destroy(&self, buffer: Buffer) {
        // SAFETY: no submission is in flight while the lock is held, and the buffer came
        // from this device.
        unsafe { self.device.destroy_buffer(buffer.buffer, None) };
        self.free_memory(buffer.memory, buffer.type_index, buffer.allocated);
    }

    /// A buffer of `bytes` for one weight part, bound at a suitable offset inside a block.
    fn create_weight_buffer(
        &self,
        blocks: &mut Blocks,
        bytes: u64,
    ) -> Result<WeightBuffer, DeviceError> {
        let buffer = self.new_buffer(
            bytes,
            vk::BufferUsageFlags::STORAGE_BUFFER | vk::BufferUsageFlags::TRANSFER_DST,
        )?;
        // SAFETY: the buffer came from this device; it is destroyed on the error paths or
        // by `destroy_weight_buffer`.
        let needs = unsafe { self.device.get_buffer_memory_requirements(buffer) };
        let placement = match self.place(blocks, &needs) {
            Ok(placement) => placement,
            Err(error) => {
                unsafe { self.device.destroy_buffer(buffer, None) };
                return Err(error);
            }
        };
        let made = WeightBuffer { buffer, placement };
        // SAFETY: the placement is free room of the block, aligned as `needs` asks.
        let bound = unsafe {
            self.device
                .bind_buffer_memory(buffer, placement.memory, placement.offset)
        };
        if let Err(error) = bound {
            self.destroy_weight_buffer(blocks, made);
            return Err(DeviceError::Failed(anyhow!(
                "binding a weight buffer inside its memory block: {error}"
            )));
        }
        Ok(made)
    }

    /// Room for a weight part: in a block that has it, else in a new block.
    fn place(
        &self,
        blocks: &mut Blocks,
        needs: &vk::MemoryRequirements,
    ) -> Result<Placement, DeviceError> {
        let required = if self.direct_upload {
            vk::MemoryPropertyFlags::DEVICE_LOCAL
                | vk::MemoryPropertyFlags::HOST_VISIBLE
                | vk::MemoryPropertyFlags::HOST_COHERENT
        } else {
            vk::MemoryPropertyFlags::DEVICE_LOCAL
        };
        let type_index = self.memory_type(needs, required, vk::MemoryPropertyFlags::empty())?;
        if let Some(placement) = blocks.place(type_index, needs.size, needs.alignment) {
            return Ok(placement);
        }
        let heap_index = self.memory_types.memory_types[type_index as usize].heap_index;
        let heap = self.memory_types.memory_heaps[heap_index as usize].size;
        let size = block_size(needs.size, heap);
        // A nearly full heap may still hold the part when it no longer holds a whole block.
        let allocated = self
            .allocate_memory(type_index, size, self.direct_upload)
            .map(|(memory, mapped)| (memory, mapped, size))
            .or_else(|error| {
                if size == needs.size {
                    return Err(error);
                }
                self.allocate_memory(type_index, needs.size, self.direct_upload)
                    .map(|(memory, mapped)| (memory, mapped, needs.size))
            });
        let (memory, mapped, size) = allocated.map_err(|error| {
            DeviceError::Failed(anyhow!(
                "no Vulkan memory left for a {} weight part ({error}); the device holds {} \
                 weight blocks and {} of the {} device-local heap: lower GPU_EXPERT_GB",
                mib(needs.size),
                blocks.len(),
                mib(self.allocated.load(Ordering::Relaxed)),
                mib(heap)
            ))
        })?;
        blocks.add(Block::new(memory, type_index, size, mapped));
        blocks
            .place(type_index, needs.size, needs.alignment)
            .ok_or_else(|| {
                DeviceError::Failed(anyhow!(
                    "a new {} memory block does not hold a {} weight part aligned to {}",
                    mib(size),
                    mib(needs.size),
                    needs.alignment
                ))
            })
    }

    /// Destroy a weight part's buffer and give its room back to the block.
    fn destroy_weight_buffer(&self, blocks: &mut Blocks, weight: WeightBuffer) {
        // SAFETY: no submission is in flight while the lock is held, and the buffer came
        // from this device.
        unsafe { self.device.destroy_buffer(weight.buffer, None) };
        if let Some(block) = blocks.release(&weight.placement) {
            self.free_memory(block.memory, block.type_index, block.size);
        }
    }

    /// Make the scratch buffer hold `scratch` bytes and the staging buffer `staging` bytes.
    fn reserve(&self, state: &mut State, scratch: u64, staging: u64) -> Result<(), DeviceError> {
        if state.scratch.as_ref().is_none_or(|b| b.size < scratch) {
            if let Some(old) = state.scratch.take() {
                self.destroy(old);
            }
            // `run` keeps `scratch` within one binding, so the rounded size is at least it.
            let size = scratch
                .next_power_of_two()
                .max(1 << 20)
                .min(self.max_binding);
            state.scratch = Some(self.create_buffer(
                size,
                vk::BufferUsageFlags::STORAGE_BUFFER
                    | vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST,
                vk::MemoryPropertyFlags::DEVICE_LOCAL,
                vk::MemoryPropertyFlags::empty(),
            )?);
        }
        if state.staging.as_ref().is_none_or(|b| b.size < staging) {
            if let Some(old) = state.staging.take() {
                self.destroy(old);
            }
            state.staging = Some(self.create_buffer(
                staging.next_power_of_two().max(1 << 20),
                vk::BufferUsageFlags::TRANSFER_SRC | vk::BufferUsageFlags::TRANSFER_DST,
                vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT,
                vk::MemoryPropertyFlags::HOST_CACHED,
            )?);
        }
        Ok(())
    }

    /// Make the descriptor pool hold `sets` sets, and empty it.
    fn reserve_descriptors(&self, state: &mut State, sets: u32) -> Result<(), DeviceError> {
        // SAFETY: no set of the pool is in use: the last submission has completed.
        unsafe {
            if state.descriptor_capacity < sets {
                self.device
                    .destroy_descriptor_pool(state.descriptor_pool, None);
                state.descriptor_pool = vk::DescriptorPool::null();
                state.descriptor_capacity = 0;
                let capacity = sets.next_power_of_two().max(64);
                let sizes = [vk::DescriptorPoolSize::default()
                    .ty(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(capacity * 4)];
                state.descriptor_pool = self
                    .device
                    .create_descriptor_pool(
                        &vk::DescriptorPoolCreateInfo::default()
                            .max_sets(capacity)
                            .pool_sizes(&sizes),
                        None,
                    )
                    .map_err(|e| anyhow!("creating a descriptor pool: {e}"))?;
                state.descriptor_capacity = capacity;
            }
            self.device
                .reset_descriptor_pool(state.descriptor_pool, vk::DescriptorPoolResetFlags::empty())
                .map_err(|e| anyhow!("resetting the descriptor pool: {e}"))?;
        }
        Ok(())
    }

    /// Submit the recorded command buffer and wait for it.
    fn submit_and_wait(&self, state: &State) -> Result<(), DeviceError> {
        let commands = [state.command];
        let submit = vk::SubmitInfo::default().command_buffers(&commands);
        // SAFETY: the command buffer is fully recorded and every object it names is alive
        // until the fence signals (or the device is declared failed and nothing is freed).
        unsafe {
            self.device
                .queue_submit(self.queue, &[submit], state.fence)
                .map_err(|e| anyhow!("submitting to the Vulkan queue: {e}"))?;
            let waited =
                self.device
                    .wait_for_fences(&[state.fence], true, FENCE_TIMEOUT.as_nanos() as u64);
            match waited {
                Ok(()) => {}
                Err(vk::Result::TIMEOUT) => {
                    return Err(DeviceError::Failed(anyhow!(
                        "a Vulkan submission did not finish within {} s",
                        FENCE_TIMEOUT.as_secs()
                    )))
                }
                Err(error) => {
                    return Err(DeviceError::Failed(anyhow!(
                        "waiting for the Vulkan fence: {error}"
                    )))
                }
            }
            self.device
                .reset_fences(&[state.fence])
                .map_err(|e| anyhow!("resetting the fence: {e}"))?;
        }
        Ok(())
    }

    /// Upload one part of a weight.
    fn upload_part(
        &self,
        state: &mut State,
        matrix: &RawMatrix<'_>,
        packing: &Packing,
        part: Part,
    ) -> Result<WeightBuffer, DeviceError> {
        let bytes = packing.part_bytes(part);
        let buffer = self.create_weight_buffer(&mut state.blocks, bytes as u64)?;
        if self.direct_upload {
            let Some(mapped) = state.blocks.mapping(&buffer.placement) else {
                self.destroy_weight_buffer(&mut state.blocks, buffer);
                return Err(DeviceError::Failed(anyhow!(
                    "a host-visible weight block has no mapping"
                )));
            };
            // SAFETY: the block is mapped whole and the placement holds at least `bytes`.
            let target = unsafe { std::slice::from_raw_parts_mut(mapped.as_ptr(), bytes) };
            packing.fill(matrix, part, target);
            return Ok(buffer);
        }
        let copied = self.reserve(state, 0, bytes as u64).and_then(|()| {
            let staging = state.staging.as_ref().expect("reserved");
            let mapped = staging.mapped.as_ref().expect("staging is mapped");
            // SAFETY: the staging mapping is at least `bytes` long (reserved above).
            let target = unsafe { std::slice::from_raw_parts_mut(mapped.0.as_ptr(), bytes) };
            packing.fill(matrix, part, target);
            let region = [vk::BufferCopy::default().size(bytes as u64)];
            // SAFETY: recording into the one command buffer, which is idle under the lock.
            unsafe {
                self.begin(state)?;
                self.device
                    .cmd_copy_buffer(state.command, staging.buffer, buffer.buffer, &region);
                self.end(state)?;
            }
            self.submit_and_wait(state)
        });
        match copied {
            Ok(()) => Ok(buffer),
            Err(error) => {
                self.destroy_weight_buffer(&mut state.blocks, buffer);
                Err(error)
            }
        }
    }

    unsafe fn begin(&self, state: &State) -> Result<(), DeviceError> {
        self.device
            .reset_command_buffer(state.command, vk::CommandBufferResetFlags::empty())
            .map_err(|e| anyhow!("resetting the command buffer: {e}"))?;
        self.device
            .begin_command_buffer(
                state.command,
                &vk::CommandBufferBeginInfo::default()
                    .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT),
            )
            .map_err(|e| anyhow!("beginning the command buffer: {e}"))?;
        Ok(())
    }

    unsafe fn end(&self, state: &State) -> Result<(), DeviceError> {
        self.device
            .end_command_buffer(state.command)
            .map_err(|e| anyhow!("recording the command buffer: {e}"))?;
        Ok(())
    }

    /// One submission: the inputs copied to the start of scratch, `record` adding the
    /// dispatches, then scratch words `output..output + out.len()` copied back into `out`.
    fn run(
        &self,
        state: &mut State,
        plan: Submission<'_>,
        out: &mut [f32],
        record: impl FnOnce(&mut Recorder<'_>) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let Submission {
            inputs,
            scratch_words,
            output,
            dispatches,
        } = plan;
        let in_words: usize = inputs.iter().map(|input| input.len()).sum();
        let scratch_bytes = (scratch_words.max(1) * 4) as u64;
        if scratch_bytes > self.max_binding {
            return Err(DeviceError::Unsupported(format!(
                "{} MiB of working memory in one submission (the device binds at most {} MiB)",
                scratch_bytes >> 20,
                self.max_binding >> 20
            )));
        }
        self.reserve(
            state,
            scratch_bytes,
            ((in_words + out.len()).max(1) * 4) as u64,
        )?;
        self.reserve_descriptors(state, u32::try_from(dispatches).unwrap_or(u32::MAX))?;
        let scratch = state.scratch.as_ref().expect("reserved").buffer;
        let staging = state.staging.as_ref().expect("reserved");
        let mapped = staging
            .mapped
            .as_ref()
            .expect("staging is mapped")
            .0
            .as_ptr();
        // SAFETY: the staging mapping holds `in_words + out.len()` words (reserved above)
        // and the device does not touch it until the submit.
        let words =
            unsafe { std::slice::from_raw_parts_mut(mapped.cast::<u32>(), in_words + out.len()) };
        let mut at = 0;
        for input in inputs {
            words[at..at + input.len()].copy_from_slice(input);
            at += input.len();
        }
        // SAFETY: recording into the idle command buffer; every buffer named is alive.
        unsafe {
            self.begin(state)?;
            let command = state.command;
            if in_words > 0 {
                let region = [vk::BufferCopy::default().size((in_words * 4) as u64)];
                self.device
                    .cmd_copy_buffer(command, staging.buffer, scratch, &region);
            }
            self.barrier(
                command,
                vk::PipelineStageFlags::TRANSFER,
                vk::AccessFlags::TRANSFER_WRITE,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE,
            );
            let mut recorder = Recorder {
                vulkan: self,
                command,
                pool: state.descriptor_pool,
                scratch,
            };
            record(&mut recorder)?;
            self.barrier(
                command,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::AccessFlags::SHADER_WRITE,
                vk::PipelineStageFlags::TRANSFER,
                vk::AccessFlags::TRANSFER_READ,
            );
            if !out.is_empty() {
                let region = [vk::BufferCopy::default()
                    .src_offset((output * 4) as u64)
                    .dst_offset((in_words * 4) as u64)
                    .size((out.len() * 4) as u64)];
                self.device
                    .cmd_copy_buffer(command, scratch, staging.buffer, &region);
            }
            self.barrier(
                command,
                vk::PipelineStageFlags::TRANSFER,
                vk::AccessFlags::TRANSFER_WRITE,
                vk::PipelineStageFlags::HOST,
                vk::AccessFlags::HOST_READ,
            );
            self.end(state)?;
        }
        self.submit_and_wait(state)?;
        for (value, &bits) in out.iter_mut().zip(&words[in_words..]) {
            *value = f32::from_bits(bits);
        }
        Ok(())
    }

    unsafe fn barrier(
        &self,
        command: vk::CommandBuffer,
        from_stage: vk::PipelineStageFlags,
        from: vk::AccessFlags,
        to_stage: vk::PipelineStageFlags,
        to: vk::AccessFlags,
    ) {
        let barrier = [vk::MemoryBarrier::default()
            .src_access_mask(from)
            .dst_access_mask(to)];
        self.device.cmd_pipeline_barrier(
            command,
            from_stage,
            to_stage,
            vk::DependencyFlags::empty(),
            &barrier,
            &[],
            &[],
        );
    }

    fn weight(state: &State, id: WeightId) -> Result<&Weight, DeviceError> {
        state.weights.get(&id).ok_or_else(|| {
            DeviceError::Unsupported(format!("weight {id} is not on the Vulkan device"))
        })
    }

    fn matmul_locked(
        &self,
        state: &mut State,
        id: WeightId,
        input: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let packing = Self::weight(state, id)?.packing;
        let (rows, cols) = (packing.rows, packing.cols);
        if input.len() != n * cols || out.len() != n * rows {
            return Err(DeviceError::Unsupported(format!(
                "a product of a {rows}x{cols} weight with {} inputs into {} outputs for {n} rows",
                input.len(),
                out.len()
            )));
        }
        // The tokens of one submission must fit the scratch binding.
        let per_token = (cols + rows) * 4;
        let tokens = (self.max_binding as usize / per_token).min(n.max(1));
        if tokens == 0 {
            return Err(DeviceError::Unsupported(format!(
                "a {rows}x{cols} product does not fit one storage binding"
            )));
        }
        for (x, y) in input
            .chunks(tokens * cols)
            .zip(out.chunks_mut(tokens * rows))
        {
            let m = x.len() / cols;
            let weight = Self::weight(state, id)?;
            let buffers: Vec<(Part, vk::Buffer)> = weight
                .parts
                .iter()
                .map(|(part, buffer)| (*part, buffer.buffer))
                .collect();
            let output = m * cols;
            let plan = Submission {
                inputs: &[bytemuck::cast_slice(x)],
                scratch_words: output + m * rows,
                output,
                dispatches: buffers.len(),
            };
            self.run(state, plan, y, |recorder| {
                for &(part, buffer) in &buffers {
                    let params = MatmulParams::new(&packing, part, m)
                        .reading(0, cols)
                        .writing(output + part.first_row, rows);
                    recorder.dispatch(
                        self.pipelines.matmul[packing.code as usize],
                        Some(buffer),
                        &params.words(),
                        part.rows.div_ceil(ROWS_PER_WORKGROUP),
                    )?;
                }
                Ok(())
            })?;
        }
        Ok(())
    }
}

/// The scratch one [`VulkanDevice::run`] uses.
struct Submission<'a> {
    /// Copied, one after the other, to the start of scratch.
    inputs: &'a [&'a [u32]],
    /// Words of scratch the dispatches use, inputs included.
    scratch_words: usize,
    /// Where the output starts in scratch.
    output: usize,
    /// How many dispatches `record` adds.
    dispatches: usize,
}

/// The matmul shader's push constants, in the order of its `Params` struct.
#[derive(Debug, Clone, Copy)]
struct MatmulParams {
    rows: u32,
    cols: u32,
    n: u32,
    row_words: u32,
    scale_offset: u32,
    scale_stride: u32,
    group: u32,
    scale_row_div: u32,
    x_offset: u32,
    x_stride: u32,
    out_offset: u32,
    out_stride: u32,
    gather: u32,
    index_offset: u32,
}

impl MatmulParams {
    /// `n` input rows through one part of a weight; the caller sets where they are read
    /// and written. Every size was checked against the storage binding, so it fits a u32.
    fn new(packing: &Packing, part: Part, n: usize) -> MatmulParams {
        MatmulParams {
            rows: part.rows as u32,
            cols: packing.cols as u32,
            n: n as u32,
            row_words: packing.row_words as u32,
            scale_offset: packing.scale_offset(part) as u32,
            scale_stride: packing.scale_stride as u32,
            group: packing.group as u32,
            scale_row_div: packing.scale_row_div as u32,
            x_offset: 0,
            x_stride: packing.cols as u32,
            out_offset: 0,
            out_stride: part.rows as u32,
            gather: 0,
            index_offset: 0,
        }
    }

    fn reading(self, offset: usize, stride: usize) -> MatmulParams {
        MatmulParams {
            x_offset: offset as u32,
            x_stride: stride as u32,
            ..self
        }
    }

    fn writing(self, offset: usize, stride: usize) -> MatmulParams {
        MatmulParams {
            out_offset: offset as u32,
            out_stride: stride as u32,
            ..self
        }
    }

    /// Input row `t` is scratch row `index[offset + t]`.
    fn gathering(self, offset: usize) -> MatmulParams {
        MatmulParams {
            gather: 1,
            index_offset: offset as u32,
            ..self
        }
    }

    fn words(&self) -> [u32; 14] {
        [
            self.rows,
            self.cols,
            self.n,
            self.row_words,
            self.scale_offset,
            self.scale_stride,
            self.group,
            self.scale_row_div,
            self.x_offset,
            self.x_stride,
            self.out_offset,
            self.out_stride,
            self.gather,
            self.index_offset,
        ]
    }
}

/// Records dispatches into the command buffer of one [`VulkanDevice::run`]: binding 0 is
/// the weight (or scratch), bindings 1 to 3 are the scratch buffer.
struct Recorder<'a> {
    vulkan: &'a VulkanDevice,
    command: vk::CommandBuffer,
    pool: vk::DescriptorPool,
    scratch: vk::Buffer,
}

impl Recorder<'_> {
    fn dispatch(
        &mut self,
        pipeline: vk::Pipeline,
        weight: Option<vk::Buffer>,
        params: &[u32],
        items: usize,
    ) -> Result<(), DeviceError> {
        let device = &self.vulkan.device;
        let layouts = [self.vulkan.set_layout];
        // SAFETY: the pool was sized for every dispatch of this submission and reset; the
        // buffers are alive until the submission completes.
        unsafe {
            let set = device
                .allocate_descriptor_sets(
                    &vk::DescriptorSetAllocateInfo::default()
                        .descriptor_pool(self.pool)
                        .set_layouts(&layouts),
                )
                .map_err(|e| anyhow!("allocating a descriptor set: {e}"))?[0];
            let infos: Vec<[vk::DescriptorBufferInfo; 1]> = [
                weight.unwrap_or(self.scratch),
                self.scratch,
                self.scratch,
                self.scratch,
            ]
            .iter()
            .map(|&buffer| {
                [vk::DescriptorBufferInfo::default()
                    .buffer(buffer)
                    .range(vk::WHOLE_SIZE)]
            })
            .collect();
            let writes: Vec<_> = infos
                .iter()
                .enumerate()
                .map(|(binding, info)| {
                    vk::WriteDescriptorSet::default()
                        .dst_set(set)
                        .dst_binding(binding as u32)
                        .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                        .buffer_info(info)
                })
                .collect();
            device.update_descriptor_sets(&writes, &[]);
            device.cmd_bind_pipeline(self.command, vk::PipelineBindPoint::COMPUTE, pipeline);
            device.cmd_bind_descriptor_sets(
                self.command,
                vk::PipelineBindPoint::COMPUTE,
                self.vulkan.pipeline_layout,
                0,
                &[set],
                &[],
            );
            device.cmd_push_constants(
                self.command,
                self.vulkan.pipeline_layout,
                vk::ShaderStageFlags::COMPUTE,
                0,
                bytemuck::cast_slice(params),
            );
            device.cmd_dispatch(self.command, items.clamp(1, MAX_WORKGROUPS) as u32, 1, 1);
        }
        Ok(())
    }

    /// Make the writes of the dispatches so far visible to the ones after.
    fn barrier(&self) {
        // SAFETY: recording into the command buffer this recorder was made for.
        unsafe {
            self.vulkan.barrier(
                self.command,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::AccessFlags::SHADER_WRITE,
                vk::PipelineStageFlags::COMPUTE_SHADER,
                vk::AccessFlags::SHADER_READ | vk::AccessFlags::SHADER_WRITE,
            );
        }
    }
}

impl Device for VulkanDevice {
    fn description(&self) -> String {
        self.description.clone()
    }

    /// The reported heap's free memory (the driver's budget less its usage with
    /// `VK_EXT_memory_budget`, else the heap less what this device allocated), plus the room
    /// still free inside this device's weight blocks on that heap.
    fn memory(&self) -> DeviceMemory {
        let Some(heap) = self.heap else {
            return DeviceMemory { free: 0, total: 0 };
        };
        let total = self.memory_types.memory_heaps[heap].size;
        let outside = if self.memory_budget {
            let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
            let mut properties =
                vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
            // SAFETY: the extension was found on this physical device and enabled.
            unsafe {
                self.instance
                    .get_physical_device_memory_properties2(self.physical, &mut properties)
            };
            budget.heap_budget[heap].saturating_sub(budget.heap_usage[heap])
        } else {
            total.saturating_sub(self.allocated.load(Ordering::Relaxed))
        };
        let inside = match self.state.lock() {
            Ok(state) => state.blocks.free_bytes(|t| self.on_reported_heap(t)),
            Err(poisoned) => poisoned
                .into_inner()
                .blocks
                .free_bytes(|t| self.on_reported_heap(t)),
        };
        DeviceMemory {
            free: outside.saturating_add(inside).min(total),
            total,
        }
    }

    fn upload(&self, matrix: &RawMatrix<'_>) -> Result<WeightId, DeviceError> {
        let packing = Packing::of(matrix)?;
        let limit = self.max_binding.min(MAX_PART_BYTES) as usize;
        let parts = packing.parts(limit).ok_or_else(|| {
            DeviceError::Unsupported(format!(
                "a {}x{} {} matrix: one row is larger than a storage binding",
                matrix.rows, matrix.cols, matrix.format
            ))
        })?;
        let mut state = self.lock()?;
        let mut buffers = Vec::with_capacity(parts.len());
        for part in parts {
            match self.upload_part(&mut state, matrix, &packing, part) {
                Ok(buffer) => buffers.push((part, buffer)),
                Err(error) => {
                    for (_, buffer) in buffers {
                        self.destroy_weight_buffer(&mut state.blocks, buffer);
                    }
                    return self.watch(Err(error));
                }
            }
        }
        state.next_id += 1;
        let id = state.next_id;
        state.weights.insert(
            id,
            Weight {
                packing,
                parts: buffers,
            },
        );
        Ok(id)
    }

    fn release(&self, weight: WeightId) {
        let Ok(mut state) = self.lock() else {
            return;
        };
        if let Some(weight) = state.weights.remove(&weight) {
            for (_, buffer) in weight.parts {
                self.destroy_weight_buffer(&mut state.blocks, buffer);
            }
        }
    }

    fn matmul(
        &self,
        weight: WeightId,
        input: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let mut state = self.lock()?;
        self.watch(self.matmul_locked(&mut state, weight, input, n, out))
    }

    fn rms_norm(
        &self,
        x: &[f32],
        weight: &[f32],
        eps: f32,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let width = weight.len();
        let rows = super::rms_norm_rows(x, weight, out)?;
        let output = x.len() + width;
        let params = [
            rows as u32,
            width as u32,
            eps.to_bits(),
            0,
            x.len() as u32,
            output as u32,
        ];
        let mut state = self.lock()?;
        let plan = Submission {
            inputs: &[bytemuck::cast_slice(x), bytemuck::cast_slice(weight)],
            scratch_words: output + x.len(),
            output,
            dispatches: 1,
        };
        let result = self.run(&mut state, plan, out, |recorder| {
            recorder.dispatch(self.pipelines.rms_norm, None, &params, rows)
        });
        self.watch(result)
    }

    fn expert_group(&self, group: &ExpertGroup<'_>, out: &mut [f32]) -> Result<(), DeviceError> {
        let mut state = self.lock()?;
        let result = self.expert_group_locked(&mut state, group, out);
        self.watch(result)
    }
}

/// Where an expert's rows sit in the scratch of one expert group.
struct ExpertSlot {
    gate: (Packing, Vec<(Part, vk::Buffer)>),
    up: (Packing, Vec<(Part, vk::Buffer)>),
    down: (Packing, Vec<(Part, vk::Buffer)>),
    rows: usize,
    /// Offset of the expert's routed-row indices in the index region.
    index: usize,
    /// Offset of its gate (and, one region on, up) products.
    hidden: usize,
    /// First row of its down products in the down region.
    down_row: usize,
}

impl VulkanDevice {
    fn expert_group_locked(
        &self,
        state: &mut State,
        group: &ExpertGroup<'_>,
        out: &mut [f32],
    ) -> Result<(), DeviceError> {
        let (rows, width) = (group.rows, group.width);
        let Some(routing) = GroupRouting::new(group, out.len())? else {
            out.fill(0.0);
            return Ok(());
        };
        let shape = |id, want_rows: Option<usize>, want_cols: Option<usize>| {
            let weight = Self::weight(state, id)?;
            let packing = weight.packing;
            let buffers = weight.parts.iter().map(|(p, b)| (*p, b.buffer)).collect();
            let fits = want_rows.is_none_or(|r| r == packing.rows)
                && want_cols.is_none_or(|c| c == packing.cols);
            if !fits {
                return Err(DeviceError::Unsupported(format!(
                    "an expert weight of {}x{} in a group of width {width}",
                    packing.rows, packing.cols
                )));
            }
            Ok((packing, buffers))
        };
        // A slot's down row is the slot: the routing's order.
        let mut slots = Vec::new();
        let mut hidden = 0;
        for &(expert, first) in &routing.experts {
            let gate = shape(expert.gate, None, Some(width))?;
            let inter = gate.0.rows;
            let up = shape(expert.up, Some(inter), Some(width))?;
            let down = shape(expert.down, Some(width), Some(inter))?;
            let m = expert.rows.len();
            slots.push(ExpertSlot {
                gate,
                up,
                down,
                rows: m,
                index: first,
                hidden,
                down_row: first,
            });
            hidden += m * inter;
        }
        let down_row = routing.slots();
        let routed: Vec<u32> = routing.slot_rows.iter().map(|&r| r as u32).collect();
        let starts: Vec<u32> = routing.row_start.iter().map(|&s| s as u32).collect();
        // Each output row's (down row, gate weight) entries, in expert order.
        let flat: Vec<u32> = routing
            .entry_slot
            .iter()
            .zip(&routing.entry_weight)
            .flat_map(|(&slot, weight)| [slot as u32, weight.to_bits()])
            .collect();
        // Scratch: input, routed-row indices, entry starts, entries | gate, up, down, out.
        let index_at = rows * width;
        let starts_at = index_at + routed.len();
        let entries_at = starts_at + starts.len();
        let gate_at = entries_at + flat.len();
        let up_at = gate_at + hidden;
        let down_at = up_at + hidden;
        let output = down_at + down_row * width;
        let scratch_words = output + rows * width;
        let dispatches: usize = slots
            .iter()
            .map(|s| s.gate.1.len() + s.up.1.len() + s.down.1.len())
            .sum::<usize>()
            + 2;
        let (kind, beta, linear_beta, has_linear) = match group.activation {
            Activation::SwiGlu => (0, 0.0, 0.0, 0),
            Activation::Situ(situ) => (
                1,
                situ.beta,
                situ.linear_beta.unwrap_or(0.0),
                u32::from(situ.linear_beta.is_some()),
            ),
        };
        let plan = Submission {
            inputs: &[bytemuck::cast_slice(group.input), &routed, &starts, &flat],
            scratch_words,
            output,
            dispatches,
        };
        self.run(state, plan, out, |recorder| {
            for slot in &slots {
                let inter = slot.gate.0.rows;
                for (weight, at) in [(&slot.gate, gate_at), (&slot.up, up_at)] {
                    for &(part, buffer) in &weight.1 {
                        let params = MatmulParams::new(&weight.0, part, slot.rows)
                            .reading(0, width)
                            .gathering(index_at + slot.index)
                            .writing(at + slot.hidden + part.first_row, inter);
                        let matmul = self.pipelines.matmul[weight.0.code as usize];
                        recorder.dispatch(
                            matmul,
                            Some(buffer),
                            &params.words(),
                            part.rows.div_ceil(ROWS_PER_WORKGROUP),
                        )?;
                    }
                }
            }
            recorder.barrier();
            let glu = [
                hidden as u32,
                gate_at as u32,
                up_at as u32,
                kind,
                beta.to_bits(),
                linear_beta.to_bits(),
                has_linear,
            ];
            recorder.dispatch(self.pipelines.glu, None, &glu, hidden.div_ceil(GLU_THREADS))?;
            recorder.barrier();
            for slot in &slots {
                let inter = slot.gate.0.rows;
                for &(part, buffer) in &slot.down.1 {
                    let params = MatmulParams::new(&slot.down.0, part, slot.rows)
                        .reading(gate_at + slot.hidden, inter)
                        .writing(down_at + slot.down_row * width + part.first_row, width);
                    let matmul = self.pipelines.matmul[slot.down.0.code as usize];
                    recorder.dispatch(
                        matmul,
                        Some(buffer),
                        &params.words(),
                        part.rows.div_ceil(ROWS_PER_WORKGROUP),
                    )?;
                }
            }
            recorder.barrier();
            let sum = [
                rows as u32,
                width as u32,
                starts_at as u32,
                entries_at as u32,
                down_at as u32,
                output as u32,
            ];
            recorder.dispatch(self.pipelines.expert_sum, None, &sum, rows)
        })
    }
}

/// `bytes` in MiB, for messages.
fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

impl Drop for VulkanDevice {
    fn drop(&mut self) {
        // A failed device may still be running a submission that timed out: destroying the
        // objects it uses could crash the driver, so they are left to the process exit.
        if self.failed.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: after the wait nothing is in flight; every handle came from this device
        // (or is null, which the destroy calls ignore).
        unsafe {
            let _ = self.device.device_wait_idle();
            let mut state = match self.state.get_mut() {
                Ok(state) => std::mem::take(state),
                Err(poisoned) => std::mem::take(poisoned.into_inner()),
            };
            for (_, weight) in state.weights {
                for (_, buffer) in weight.parts {
                    self.device.destroy_buffer(buffer.buffer, None);
                }
            }
            for block in state.blocks.take_all() {
                self.free_memory(block.memory, block.type_index, block.size);
            }
            for buffer in [state.scratch, state.staging].into_iter().flatten() {
                self.destroy(buffer);
            }
            self.device
                .destroy_descriptor_pool(state.descriptor_pool, None);
            self.device.destroy_fence(state.fence, None);
            self.device.destroy_command_pool(state.command_pool, None);
            let pipelines = std::mem::take(&mut self.pipelines);
            let others = [pipelines.rms_norm, pipelines.glu, pipelines.expert_sum];
            for pipeline in pipelines.matmul.into_iter().chain(others) {
                self.device.destroy_pipeline(pipeline, None);
            }
            self.device
                .destroy_pipeline_cache(self.pipeline_cache, None);
            self.device
                .destroy_pipeline_layout(self.pipeline_layout, None);
            self.device
                .destroy_descriptor_set_layout(self.set_layout, None);
            self.device.destroy_device(None);
            self.instance.destroy_instance(None);
        }
    }
}
