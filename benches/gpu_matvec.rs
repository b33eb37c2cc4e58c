//! Matrix-vector products on the Vulkan device (`cargo bench --bench gpu_matvec`): one f32
//! input row against a resident 2048x2048 matrix per format, the time per product and the
//! weight bytes read per second. On Mesa's CPU driver (lavapipe) this is a record of what
//! the software path costs, not a target; on a GPU it is the kernel's streaming rate. The
//! device is the one the `COLI_VK_*` settings name.

use std::time::Instant;

use coli::backend::vulkan::VulkanDevice;
use coli::backend::Device;
use coli::quant::{Format, Matrix};
use coli::settings::Settings;

fn main() {
    // The device the settings name (`COLI_VK_DEVICE`, `COLI_VK_LOADER`, `COLI_VK_STAGED` from
    // the environment), as for a run.
    let options = match Settings::from_process(&[]) {
        Ok(settings) => settings.vulkan,
        Err(error) => {
            eprintln!("{error:#}");
            std::process::exit(2);
        }
    };
    let device = match VulkanDevice::open(&options) {
        Ok(device) => device,
        Err(error) => {
            eprintln!("no Vulkan device: {error:#}");
            std::process::exit(2);
        }
    };
    println!("{}", device.description());
    let (rows, cols) = (2048, 2048);
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 2003) as f32 / 1001.0) - 1.0)
        .collect();
    let input: Vec<f32> = (0..cols).map(|i| (i % 17) as f32 / 17.0).collect();
    for format in [
        Format::F32,
        Format::Bf16,
        Format::Int8Row,
        Format::Int4Grouped { group: 64 },
        Format::Mxfp4,
    ] {
        let matrix = Matrix::from_f32_as(rows, cols, &values, format).expect("encodable shape");
        let id = device.upload(&matrix.raw()).expect("upload");
        let mut out = vec![0f32; rows];
        device
            .matmul(id, &input, 1, &mut out)
            .expect("warm-up product");
        let calls = 20;
        let started = Instant::now();
        for _ in 0..calls {
            device.matmul(id, &input, 1, &mut out).expect("product");
        }
        let seconds = started.elapsed().as_secs_f64() / calls as f64;
        let name = format.to_string();
        println!(
            "{name:>20} {rows}x{cols}: {:8.3} ms per product, {:6.2} GB/s of weights",
            seconds * 1e3,
            matrix.size_bytes() as f64 / seconds / 1e9
        );
        device.release(id);
    }
}
