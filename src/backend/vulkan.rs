//! Placeholder until the Vulkan device lands.

use anyhow::{bail, Result};

use super::{Device, DeviceError, DeviceMemory, ExpertGroup, RawMatrix, WeightId};

pub struct VulkanDevice;

impl VulkanDevice {
    pub fn open() -> Result<VulkanDevice> {
        bail!("BACKEND=vulkan is not built yet")
    }
}

impl Device for VulkanDevice {
    fn description(&self) -> String {
        String::new()
    }
    fn memory(&self) -> DeviceMemory {
        DeviceMemory { free: 0, total: 0 }
    }
    fn upload(&self, _: &RawMatrix<'_>) -> Result<WeightId, DeviceError> {
        Err(DeviceError::Unsupported(String::new()))
    }
    fn release(&self, _: WeightId) {}
    fn matmul(&self, _: WeightId, _: &[f32], _: usize, _: &mut [f32]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported(String::new()))
    }
    fn rms_norm(&self, _: &[f32], _: &[f32], _: f32, _: &mut [f32]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported(String::new()))
    }
    fn expert_group(&self, _: &ExpertGroup<'_>, _: &mut [f32]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported(String::new()))
    }
}
