//! Compiles the Vulkan compute shaders (`kernels/vulkan/*.wgsl`) to SPIR-V 1.3 with naga, into
//! `OUT_DIR/<name>.spv` (or one `<name>_<value>.spv` per value of a [`SPECIALISED`] shader's
//! `override` constant), which `src/backend/vulkan` embeds. A shader that does not parse or
//! validate fails the build with naga's message.

use std::path::{Path, PathBuf};
use std::{env, fs};

use naga::back::{pipeline_constants, spv, PipelineConstants};
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// Shaders compiled once per value of one `override` constant: (shader, constant, values).
const SPECIALISED: &[(&str, &str, &[u32])] = &[("matmul", "FORMAT", &[0, 1, 2, 3, 4, 5, 6])];

fn main() {
    let dir = Path::new("kernels/vulkan");
    println!("cargo:rerun-if-changed={}", dir.display());
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut shaders: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("listing kernels/vulkan").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "wgsl"))
        .collect();
    shaders.sort();
    for path in shaders {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path
            .file_stem()
            .and_then(|stem| stem.to_str())
            .expect("a .wgsl file has a UTF-8 stem");
        let variants: Vec<(String, Option<(&str, u32)>)> =
            match SPECIALISED.iter().find(|(shader, _, _)| *shader == name) {
                Some((_, constant, values)) => values
                    .iter()
                    .map(|&value| (format!("{name}_{value}"), Some((*constant, value))))
                    .collect(),
                None => vec![(name.to_string(), None)],
            };
        for (target, constant) in variants {
            let words = compile(&path, constant).unwrap_or_else(|message| {
                eprintln!("{message}");
                std::process::exit(1)
            });
            let target = out.join(target).with_extension("spv");
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            fs::write(&target, bytes)
                .unwrap_or_else(|e| panic!("writing {}: {e}", target.display()));
        }
    }
}

fn compile(path: &Path, constant: Option<(&str, u32)>) -> Result<Vec<u32>, String> {
    let shown = path.display().to_string();
    let source = fs::read_to_string(path).map_err(|e| format!("reading {shown}: {e}"))?;
    let module = naga::front::wgsl::parse_str(&source)
        .map_err(|e| e.emit_to_string_with_path(&source, &shown))?;
    let info = Validator::new(
        ValidationFlags::all(),
        Capabilities::IMMEDIATES | Capabilities::SHADER_FLOAT16_IN_FLOAT32,
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string_with_path(&source, &shown))?;
    let mut values = PipelineConstants::default();
    if let Some((name, value)) = constant {
        values.insert(name.to_string(), f64::from(value));
    }
    let (module, info) = pipeline_constants::process_overrides(&module, &info, None, &values)
        .map_err(|e| format!("{shown}: setting {constant:?}: {e}"))?;
    let options = spv::Options {
        lang_version: (1, 3),
        flags: spv::WriterFlags::empty(),
        // Every workgroup variable is written before it is read; the host never passes a
        // zero divisor.
        zero_initialize_workgroup_memory: spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: false,
        emit_int_div_checks: false,
        ..spv::Options::default()
    };
    spv::write_vec(&module, &info, &options, None).map_err(|e| format!("{shown}: {e}"))
}
