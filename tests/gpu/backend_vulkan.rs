//! The Vulkan backend end to end, on whatever Vulkan device the machine has (Mesa's CPU
//! driver, lavapipe, in CI): every committed fixture gives the reference's tokens with
//! `BACKEND=vulkan`, teacher-forced and greedy, at one slot and every expert per layer, with
//! the VRAM expert tier empty and holding every expert; free generation gives the CPU's
//! tokens; and a backend that cannot start stops the run with the reason.

use crate::common;

use common::{coli, copy_fixture, fixture, stderr, stdout};

/// (engine, fixture, experts per layer)
const FIXTURES: &[(&str, &str, usize)] = &[
    ("olmoe", "olmoe_tiny", 8),
    ("olmoe", "olmoe_tiny_b", 12),
    ("glm_moe_dsa", "glm_moe_dsa_tiny", 8),
    ("glm_moe_dsa", "glm_moe_dsa_tiny_b", 12),
    ("glm_moe_dsa", "glm_moe_dsa_tiny_mtp", 8),
    ("inkling", "inkling_tiny", 8),
    ("inkling", "inkling_tiny_b", 8),
    ("kimi_k3", "kimi_k3_tiny", 8),
    ("kimi_k3", "kimi_k3_tiny_b", 8),
];

/// Far more than any fixture's experts: the tier takes all of them.
const WHOLE_MODEL: &str = "GPU_EXPERT_GB=0.5";

fn each_setting(teacher_forced: bool) {
    for &(model, name, experts) in FIXTURES {
        for cap in [1, experts] {
            for tier in ["GPU_EXPERT_GB=0", WHOLE_MODEL] {
                let (text, errors) = common::oracle_exact_with(
                    Some(model),
                    name,
                    cap,
                    teacher_forced,
                    &["BACKEND=vulkan", tier],
                );
                assert!(errors.contains("[BACKEND] Vulkan: "), "{name}: {errors}");
                if tier == WHOLE_MODEL {
                    assert!(errors.contains("[GPU] expert tier: "), "{name}: {errors}");
                    // Every expert is resident: the CPU cache is never asked.
                    assert!(
                        text.contains(" vram + 0 pin + 0 lru / 0 miss)"),
                        "{name} cap {cap}: {text}"
                    );
                }
            }
        }
    }
}

#[test]
fn teacher_forced_matches_the_reference_on_every_fixture() {
    each_setting(true);
}

#[test]
fn greedy_matches_the_reference_on_every_fixture() {
    each_setting(false);
}

/// The generated ids line of a free run of up to `NGEN` tokens after `IDS` (fewer when the
/// model chooses a stop id).
fn generate(name: &str, settings: &[&str]) -> String {
    let snap = format!("SNAP={}", fixture(name).display());
    let mut args = vec![snap.as_str(), "IDS=3 11 29 7", "NGEN=24", "USAGE_SAVE=0"];
    args.extend(settings);
    let out = coli(&args, &[]);
    assert!(out.status.success(), "{name}: {}", stderr(&out));
    generated_ids(&out, name)
}

/// The line of up to 24 generated ids in a run's stdout.
fn generated_ids(out: &std::process::Output, what: &str) -> String {
    stdout(out)
        .lines()
        .find(|line| {
            let ids: Vec<&str> = line.split_whitespace().collect();
            (1..=24).contains(&ids.len()) && ids.iter().all(|id| id.parse::<u32>().is_ok())
        })
        .unwrap_or_else(|| panic!("{what}: no generated ids in {}", stdout(out)))
        .to_string()
}

#[test]
fn free_generation_gives_the_cpu_tokens() {
    for &(_, name, _) in FIXTURES {
        let cpu = generate(name, &["2", "16", "16"]);
        for tier in ["GPU_EXPERT_GB=0", WHOLE_MODEL] {
            let gpu = generate(name, &["BACKEND=vulkan", tier, "2", "16", "16"]);
            assert_eq!(gpu, cpu, "{name} with {tier}");
        }
    }
}

#[test]
fn int8_experts_on_the_tier_give_the_cpu_tokens() {
    for name in ["olmoe_tiny", "glm_moe_dsa_tiny"] {
        let cpu = generate(name, &["2", "8", "16"]);
        let gpu = generate(name, &["BACKEND=vulkan", WHOLE_MODEL, "2", "8", "16"]);
        assert_eq!(gpu, cpu, "{name}");
    }
}

/// A copy of `olmoe_tiny` with a usage history from one prompt (IDS "3 11 29 7") to plan
/// pins from, and its `SNAP=` setting.
fn olmoe_with_history() -> (tempfile::TempDir, String) {
    let dir = copy_fixture("olmoe_tiny");
    let snap = format!("SNAP={}", dir.path().display());
    let out = coli(&[&snap, "IDS=3 11 29 7", "NGEN=8", "2", "16", "16"], &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    (dir, snap)
}

#[test]
fn the_tier_is_filled_from_the_pin_plan_first() {
    let (_dir, snap) = olmoe_with_history();
    // The plan pins eight experts (PIN_GB) of 24,576 bytes each; the tier has room for two
    // of them, the hottest, and the other six are pinned in RAM.
    let out = coli(
        &[
            &snap,
            "IDS=3 11 29 7",
            "NGEN=8",
            "PIN=auto",
            "PIN_GB=0.0002",
            "BACKEND=vulkan",
            "GPU_EXPERT_GB=0.00005",
            "USAGE_SAVE=0",
            "2",
            "16",
            "16",
        ],
        &[],
    );
    let errors = stderr(&out);
    assert!(out.status.success(), "{errors}");
    assert!(errors.contains("[GPU] expert tier: 2 experts"), "{errors}");
    assert!(
        errors.contains("[PIN] placement: 2 VRAM + 6 RAM expert"),
        "{errors}"
    );
}

#[test]
fn a_repin_pass_trades_a_cold_vram_expert_for_a_hot_ram_pin() {
    // The run below routes another prompt than the history's, so its session heat
    // disagrees with the history the tier was filled from.
    let (_dir, snap) = olmoe_with_history();
    let run = |backend: &str| {
        let out = coli(
            &[
                &snap,
                "IDS=5 40 2 17 9",
                "NGEN=24",
                "PIN=auto",
                "PIN_GB=0.0002",
                backend,
                "GPU_EXPERT_GB=0.00005",
                "REPIN=1",
                "USAGE_SAVE=0",
                "2",
                "16",
                "16",
            ],
            &[],
        );
        assert!(out.status.success(), "{backend}: {}", stderr(&out));
        (generated_ids(&out, backend), stderr(&out))
    };
    let (cpu, _) = run("BACKEND=cpu");
    let (gpu, errors) = run("BACKEND=vulkan");
    assert!(
        errors.contains("[PIN] placement: 2 VRAM + 6 RAM expert"),
        "{errors}"
    );
    let trade = errors
        .lines()
        .find(|line| line.starts_with("[REPIN] VRAM layer "))
        .unwrap_or_else(|| panic!("no VRAM trade in {errors}"));
    assert!(
        trade.contains(": evict ") && trade.contains(" <- admit "),
        "{trade}"
    );
    // The experts that moved between the device and the CPU compute the same tokens.
    assert_eq!(gpu, cpu);
}

#[test]
fn a_backend_that_cannot_start_is_an_error() {
    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    // COLI_VK_LOADER is a setting: from the environment or as an argument.
    let loader = "COLI_VK_LOADER=/nonexistent/libvulkan.so.1";
    for (argument, env) in [
        (
            None,
            vec![("COLI_VK_LOADER", "/nonexistent/libvulkan.so.1")],
        ),
        (Some(loader), Vec::new()),
    ] {
        let mut args = vec![snap.as_str(), "BACKEND=vulkan", "2", "16", "16"];
        args.extend(argument);
        let out = coli(&args, &env);
        assert_eq!(out.status.code(), Some(2));
        let errors = stderr(&out);
        assert!(
            errors.contains("BACKEND=vulkan cannot start")
                && errors.contains("/nonexistent/libvulkan.so.1"),
            "{errors}"
        );
        assert!(!errors.contains("panicked"), "{errors}");
    }

    let out = coli(
        &[
            &snap,
            "BACKEND=vulkan",
            "GPU_EXPERT_GB=100000",
            "2",
            "16",
            "16",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(2));
    let errors = stderr(&out);
    assert!(
        errors.contains("GPU_EXPERT_GB asks for 100000.00 GB")
            && errors.contains("lower GPU_EXPERT_GB"),
        "{errors}"
    );
}

#[test]
fn auto_says_which_backend_computes() {
    let snap = format!("SNAP={}", fixture("olmoe_tiny").display());
    let out = coli(&[&snap, "BACKEND=auto", "2", "16", "16"], &[]);
    let errors = stderr(&out);
    assert!(out.status.success(), "{errors}");
    assert!(errors.contains("[BACKEND] "), "{errors}");
    // A software driver is never auto's choice: the CPU backend is faster than it.
    assert!(
        !errors
            .lines()
            .any(|line| line.starts_with("[BACKEND] Vulkan: llvmpipe")),
        "{errors}"
    );
}

#[test]
fn the_tier_alone_can_use_the_gpu() {
    for &(model, name, experts) in &FIXTURES[..3] {
        let (text, errors) = common::oracle_exact_with(
            Some(model),
            name,
            experts,
            false,
            &["BACKEND=vulkan", "GPU_DENSE=0", WHOLE_MODEL],
        );
        assert!(
            errors.contains("(expert tier only: GPU_DENSE=0)"),
            "{errors}"
        );
        assert!(text.contains(" vram + 0 pin + 0 lru / 0 miss)"), "{text}");
    }
}
