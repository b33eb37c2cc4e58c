//! Starting Vulkan: loading the loader library, the instance, choosing the physical device
//! and creating the logical one, building pipelines from embedded SPIR-V, and choosing
//! memory types. Everything here runs once, from [`VulkanDevice::open`](super::VulkanDevice::open).

use std::ffi::CStr;
use std::io::Cursor;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use ash::vk;

pub(super) unsafe fn pipeline_of(
    device: &ash::Device,
    layout: vk::PipelineLayout,
    cache: vk::PipelineCache,
    name: &str,
    spirv: &[u8],
) -> Result<vk::Pipeline> {
    let code = ash::util::read_spv(&mut Cursor::new(spirv))
        .with_context(|| format!("reading the embedded {name} SPIR-V"))?;
    let module = device
        .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&code), None)
        .with_context(|| format!("creating the {name} shader module"))?;
    let stage = vk::PipelineShaderStageCreateInfo::default()
        .stage(vk::ShaderStageFlags::COMPUTE)
        .module(module)
        .name(c"main");
    let info = vk::ComputePipelineCreateInfo::default()
        .stage(stage)
        .layout(layout);
    let created = device.create_compute_pipelines(cache, &[info], None);
    device.destroy_shader_module(module, None);
    match created {
        Ok(pipelines) => Ok(pipelines[0]),
        Err((_, error)) => Err(anyhow!("creating the {name} pipeline: {error}")),
    }
}

/// The Vulkan loader: `loader` (`COLI_VK_LOADER`) when given, else the system's.
pub(super) fn load_entry(loader: Option<&Path>) -> Result<ash::Entry> {
    // SAFETY: loading the Vulkan loader runs its initialisers, which is what it is for.
    match loader {
        Some(path) => unsafe { ash::Entry::load_from(path) }.map_err(|error| {
            anyhow!(
                "no Vulkan loader at COLI_VK_LOADER={} ({error}): point it at libvulkan.so.1, or unset it",
                path.display()
            )
        }),
        None => unsafe { ash::Entry::load() }.map_err(|error| {
            anyhow!(
                "no Vulkan loader (libvulkan.so.1) found ({error}): install your GPU driver's Vulkan ICD, or mesa-vulkan-drivers for the CPU driver"
            )
        }),
    }
}

pub(super) const PORTABILITY_ENUMERATION: &CStr = c"VK_KHR_portability_enumeration";
pub(super) const PORTABILITY_SUBSET: &CStr = c"VK_KHR_portability_subset";
pub(super) const MEMORY_BUDGET: &CStr = c"VK_EXT_memory_budget";

pub(super) unsafe fn create_instance(entry: &ash::Entry) -> Result<ash::Instance> {
    let version = entry
        .try_enumerate_instance_version()
        .context("asking the Vulkan loader for its version")?
        .unwrap_or(vk::API_VERSION_1_0);
    if version < vk::API_VERSION_1_2 {
        bail!(
            "the Vulkan loader offers Vulkan {}; coli needs 1.2: update the Vulkan loader and driver",
            version_text(version)
        );
    }
    let app = vk::ApplicationInfo::default()
        .application_name(c"coli")
        .engine_name(c"coli")
        .api_version(vk::API_VERSION_1_2);
    // Portability drivers (MoltenVK) are listed only when asked for.
    let portability = entry
        .enumerate_instance_extension_properties(None)
        .context("listing Vulkan instance extensions")?
        .iter()
        .any(|e| e.extension_name_as_c_str() == Ok(PORTABILITY_ENUMERATION));
    let extensions = [PORTABILITY_ENUMERATION.as_ptr()];
    let mut info = vk::InstanceCreateInfo::default().application_info(&app);
    if portability {
        info = info
            .enabled_extension_names(&extensions)
            .flags(vk::InstanceCreateFlags::ENUMERATE_PORTABILITY_KHR);
    }
    entry
        .create_instance(&info, None)
        .context("creating a Vulkan instance")
}

/// The physical device `open` settles on, and what it learnt about it.
pub(super) struct Chosen {
    pub(super) handle: vk::PhysicalDevice,
    pub(super) queue_family: u32,
    pub(super) description: String,
    /// A driver that computes on the host CPU (Mesa's lavapipe, SwiftShader).
    pub(super) software: bool,
    pub(super) max_storage_buffer_range: u32,
    pub(super) memory_budget: bool,
    pub(super) portability_subset: bool,
}

/// Why a physical device cannot serve, or what it offers.
pub(super) unsafe fn inspect(
    instance: &ash::Instance,
    handle: vk::PhysicalDevice,
) -> Result<Chosen, String> {
    let mut driver = vk::PhysicalDeviceDriverProperties::default();
    let mut properties = vk::PhysicalDeviceProperties2::default().push_next(&mut driver);
    instance.get_physical_device_properties2(handle, &mut properties);
    let properties = properties.properties;
    let name = properties
        .device_name_as_c_str()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unnamed device".into());
    if properties.api_version < vk::API_VERSION_1_2 {
        return Err(format!(
            "{name} offers Vulkan {}, coli needs 1.2",
            version_text(properties.api_version)
        ));
    }
    let Some(queue_family) = instance
        .get_physical_device_queue_family_properties(handle)
        .iter()
        .position(|family| family.queue_flags.contains(vk::QueueFlags::COMPUTE))
    else {
        return Err(format!("{name} has no compute queue"));
    };
    let extensions = instance
        .enumerate_device_extension_properties(handle)
        .map_err(|e| format!("{name}: listing its extensions failed: {e}"))?;
    let has = |wanted: &CStr| {
        extensions
            .iter()
            .any(|e| e.extension_name_as_c_str() == Ok(wanted))
    };
    let driver_info = driver
        .driver_info_as_c_str()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let driver_name = driver
        .driver_name_as_c_str()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let driver_text = if driver_info.is_empty() {
        driver_name
    } else {
        driver_info
    };
    Ok(Chosen {
        handle,
        queue_family: queue_family as u32,
        // lavapipe's name already carries parentheses: "llvmpipe (LLVM 15.0.6, 256 bits)".
        description: format!("Vulkan: {name}, {driver_text}"),
        software: properties.device_type == vk::PhysicalDeviceType::CPU,
        max_storage_buffer_range: properties.limits.max_storage_buffer_range,
        memory_budget: has(MEMORY_BUDGET),
        portability_subset: has(PORTABILITY_SUBSET),
    })
}

/// Discrete first, then integrated, virtual, other and CPU devices; `wanted`
/// (`COLI_VK_DEVICE`) picks one by its index in the loader's list.
pub(super) unsafe fn choose_physical_device(
    instance: &ash::Instance,
    wanted: Option<usize>,
) -> Result<Chosen> {
    let handles = instance
        .enumerate_physical_devices()
        .context("listing Vulkan devices")?;
    if handles.is_empty() {
        bail!("the Vulkan loader found no device: install your GPU driver's Vulkan ICD, or mesa-vulkan-drivers for the CPU driver");
    }
    if let Some(index) = wanted {
        let Some(&handle) = handles.get(index) else {
            bail!(
                "COLI_VK_DEVICE={index}: there are only {} Vulkan devices (indices 0 to {})",
                handles.len(),
                handles.len() - 1
            );
        };
        return inspect(instance, handle).map_err(|why| anyhow!("COLI_VK_DEVICE={index}: {why}"));
    }
    let rank = |handle| {
        let kind = instance.get_physical_device_properties(handle).device_type;
        match kind {
            vk::PhysicalDeviceType::DISCRETE_GPU => 0,
            vk::PhysicalDeviceType::INTEGRATED_GPU => 1,
            vk::PhysicalDeviceType::VIRTUAL_GPU => 2,
            vk::PhysicalDeviceType::CPU => 4,
            _ => 3,
        }
    };
    let mut ranked = handles;
    ranked.sort_by_key(|&handle| rank(handle));
    let mut refusals = Vec::new();
    for handle in ranked {
        match inspect(instance, handle) {
            Ok(chosen) => return Ok(chosen),
            Err(why) => refusals.push(why),
        }
    }
    bail!("no usable Vulkan device: {}", refusals.join("; "))
}

pub(super) unsafe fn create_logical_device(
    instance: &ash::Instance,
    chosen: &Chosen,
) -> Result<ash::Device> {
    let priorities = [1.0];
    let queues = [vk::DeviceQueueCreateInfo::default()
        .queue_family_index(chosen.queue_family)
        .queue_priorities(&priorities)];
    let mut extensions = Vec::new();
    if chosen.memory_budget {
        extensions.push(MEMORY_BUDGET.as_ptr());
    }
    if chosen.portability_subset {
        extensions.push(PORTABILITY_SUBSET.as_ptr());
    }
    let info = vk::DeviceCreateInfo::default()
        .queue_create_infos(&queues)
        .enabled_extension_names(&extensions);
    instance
        .create_device(chosen.handle, &info, None)
        .with_context(|| format!("creating the {} device", chosen.description))
}

pub(super) fn version_text(version: u32) -> String {
    format!(
        "{}.{}",
        vk::api_version_major(version),
        vk::api_version_minor(version)
    )
}

/// The first memory type allowed by `bits` with `required` and `preferred`, else with
/// `required` only.
pub(super) fn find_memory_type(
    types: &vk::PhysicalDeviceMemoryProperties,
    bits: u32,
    required: vk::MemoryPropertyFlags,
    preferred: vk::MemoryPropertyFlags,
) -> Option<u32> {
    let allowed = |i: u32, flags: vk::MemoryPropertyFlags| {
        bits & (1 << i) != 0
            && types.memory_types[i as usize]
                .property_flags
                .contains(flags)
    };
    let count = types.memory_type_count;
    (0..count)
        .find(|&i| allowed(i, required | preferred))
        .or_else(|| (0..count).find(|&i| allowed(i, required)))
}

/// The index of the largest device-local heap, if any.
pub(super) fn largest_device_local_heap(
    types: &vk::PhysicalDeviceMemoryProperties,
) -> Option<usize> {
    types.memory_heaps[..types.memory_heap_count as usize]
        .iter()
        .enumerate()
        .filter(|(_, heap)| heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
        .max_by_key(|(_, heap)| heap.size)
        .map(|(index, _)| index)
}

/// Whether weights can be written in place: a memory type that is device-local, mappable
/// and coherent, on a heap at least a quarter of the largest device-local heap (a discrete
/// card without resizable BAR maps only a 256 MiB window, too small to hold weights).
pub(super) fn has_large_mappable_device_memory(types: &vk::PhysicalDeviceMemoryProperties) -> bool {
    let heaps = &types.memory_heaps[..types.memory_heap_count as usize];
    let largest = heaps
        .iter()
        .filter(|heap| heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
        .map(|heap| heap.size)
        .max()
        .unwrap_or(0);
    let mappable = vk::MemoryPropertyFlags::DEVICE_LOCAL
        | vk::MemoryPropertyFlags::HOST_VISIBLE
        | vk::MemoryPropertyFlags::HOST_COHERENT;
    types.memory_types[..types.memory_type_count as usize]
        .iter()
        .any(|t| {
            t.property_flags.contains(mappable) && heaps[t.heap_index as usize].size >= largest / 4
        })
}
