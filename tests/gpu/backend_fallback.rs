//! What happens when a device fails after startup, with a stand-in device that takes
//! uploads, declines dense products and fails every expert group: the failed layer's
//! resident experts are recomputed on the CPU, the device is switched off for the rest of
//! the process, and the tokens are those of a CPU-only run.
//!
//! The test runs in a process of its own ([`common::in_own_process`]): the installed device
//! is process-wide.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::anyhow;
use coli::backend::{self, Device, DeviceError, DeviceMemory, ExpertGroup, RawMatrix, WeightId};
use coli::engines::{self, LoadOptions};
use coli::experts::tier::ExpertTier;
use coli::generate::greedy;
use coli::snapshot::Snapshot;

#[derive(Default)]
struct FailingDevice {
    uploads: AtomicUsize,
    groups: AtomicUsize,
}

impl Device for FailingDevice {
    fn description(&self) -> String {
        "a device that fails".to_string()
    }

    fn memory(&self) -> DeviceMemory {
        DeviceMemory {
            free: 1 << 30,
            total: 1 << 30,
        }
    }

    fn upload(&self, _: &RawMatrix<'_>) -> Result<WeightId, DeviceError> {
        Ok(self.uploads.fetch_add(1, Ordering::Relaxed) as WeightId)
    }

    fn release(&self, _: WeightId) {}

    fn matmul(&self, _: WeightId, _: &[f32], _: usize, _: &mut [f32]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("dense products".into()))
    }

    fn rms_norm(&self, _: &[f32], _: &[f32], _: f32, _: &mut [f32]) -> Result<(), DeviceError> {
        Err(DeviceError::Unsupported("norms".into()))
    }

    fn expert_group(&self, _: &ExpertGroup<'_>, out: &mut [f32]) -> Result<(), DeviceError> {
        self.groups.fetch_add(1, Ordering::Relaxed);
        // A failed submission may leave anything behind.
        out.fill(f32::NAN);
        Err(DeviceError::Failed(anyhow!("device lost")))
    }
}

#[test]
fn a_failed_device_leaves_the_tokens_of_the_cpu() {
    if !common::in_own_process(
        module_path!(),
        "a_failed_device_leaves_the_tokens_of_the_cpu",
    ) {
        return;
    }
    let snapshot = Snapshot::open(&common::fixture("olmoe_tiny")).unwrap();
    let prompt = [3, 11, 29, 7];
    let engine = engines::load("olmoe", &snapshot, LoadOptions::exact(2)).unwrap();
    let on_cpu = greedy(engine.as_ref(), &prompt, 16).unwrap().tokens;

    let device = Arc::new(FailingDevice::default());
    backend::install(device.clone());
    let active = backend::active().expect("installed");
    let engine = engines::load("olmoe", &snapshot, LoadOptions::exact(2)).unwrap();
    let mut routed = engine.routed();
    let store = &routed.store;
    let every = (0..store.layers()).flat_map(|l| (0..store.experts_in(l)).map(move |e| (l, e)));
    let tier = ExpertTier::fill(active, store, every.collect::<Vec<_>>(), 1 << 30).unwrap();
    assert_eq!(
        tier.len(),
        3 * 8,
        "every expert of the three layers is resident"
    );
    routed.tier = tier;
    drop(routed);

    let after_failure = greedy(engine.as_ref(), &prompt, 16).unwrap().tokens;
    assert_eq!(after_failure, on_cpu);
    assert_eq!(
        device.groups.load(Ordering::Relaxed),
        1,
        "one failure, then the CPU"
    );
    assert!(
        backend::active().is_none(),
        "the device is off for the process"
    );
}
