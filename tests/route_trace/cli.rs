//! Routing telemetry end to end through the binary on the OLMoE fixtures: the trace
//! stream, histories that accumulate across runs, placement from a history, refusal of a
//! foreign engine's history, and a save on Ctrl-C.

use crate::common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{coli, copy_fixture, stderr, stdout};

const PROMPT: &str = "IDS=3 11 29 7 41 19";

fn snap(dir: &Path) -> String {
    format!("SNAP={}", dir.display())
}

/// The total of the `[USAGE] expert history: N selections` line, if printed.
fn usage_total(text: &str) -> Option<u64> {
    let rest = text.split("[USAGE] expert history: ").nth(1)?;
    rest.split(' ').next()?.parse().ok()
}

fn stats_total(text: &str) -> Option<u64> {
    let rest = text.split("[STATS] ").nth(1)?;
    rest.split(' ').next()?.parse().ok()
}

fn generated_ids(text: &str) -> String {
    text.lines()
        .find(|line| !line.is_empty() && line.chars().all(|c| c.is_ascii_digit() || c == ' '))
        .unwrap_or_default()
        .to_string()
}

#[test]
fn trace_has_one_line_per_layer_and_row_with_the_applied_gates() {
    // olmoe_tiny_b renormalises its top-3 gates, so every line's gates sum to 1.
    let dir = copy_fixture("olmoe_tiny_b");
    let trace = dir.path().join("trace.txt");
    let out = coli(
        &[
            &snap(dir.path()),
            PROMPT,
            "NGEN=5",
            &format!("ROUTE_TRACE={}", trace.display()),
            "64",
            "16",
            "16",
        ],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains(&format!(
        "[ROUTE_TRACE] logging routing to {}",
        trace.display()
    )));
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    // Prefill: 6 rows in each of 4 layers; then 4 decode forwards of one row each.
    assert_eq!(lines.len(), 6 * 4 + 4 * 4);
    let mut calls = std::collections::BTreeSet::new();
    for line in &lines {
        let fields: Vec<&str> = line.split(' ').collect();
        assert_eq!(fields.len(), 3 + 3, "{line}");
        calls.insert(fields[0].parse::<u64>().unwrap());
        let layer: usize = fields[2].parse().unwrap();
        assert!(layer < 4);
        let gates: f64 = fields[3..]
            .iter()
            .map(|pair| {
                let (id, gate) = pair.split_once(':').unwrap();
                assert!(id.parse::<usize>().unwrap() < 12);
                assert_eq!(gate.split('.').nth(1).map(str::len), Some(4), "{pair}");
                gate.parse::<f64>().unwrap()
            })
            .sum();
        assert!((gates - 1.0).abs() <= 3.0 * 0.00005 + 1e-9, "{line}");
    }
    // One call number per MoE-layer invocation: 4 layers x (1 prefill + 4 decode).
    assert_eq!(calls.len(), 4 * 5);
}

#[test]
fn histories_accumulate_across_generating_runs_but_not_oracle_runs() {
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    let first = coli(
        &[&snap(dir.path()), PROMPT, "NGEN=4", "64", "16", "16"],
        &[],
    );
    assert!(first.status.success(), "{}", stderr(&first));
    assert_eq!(usage_total(&stderr(&first)), None, "no history yet");
    // 6 prompt rows + 3 decoded tokens, 3 layers, top-2.
    let saved = stats_total(&stderr(&first)).expect("the save reports [STATS]");
    assert_eq!(saved, 9 * 3 * 2);
    let text = std::fs::read_to_string(&history).unwrap();
    assert!(text.starts_with("-1 3 8\n-2 1 3841822045\n"), "{text}");

    let second = coli(
        &[&snap(dir.path()), PROMPT, "NGEN=4", "64", "16", "16"],
        &[],
    );
    assert_eq!(usage_total(&stderr(&second)), Some(saved));
    assert_eq!(stats_total(&stderr(&second)), Some(2 * saved));

    // An oracle run reads the history but never folds its reference tokens into it.
    let before = std::fs::read(&history).unwrap();
    let oracle = coli(&[&snap(dir.path()), "TF=1", "64", "16", "16"], &[]);
    assert!(oracle.status.success());
    assert_eq!(usage_total(&stderr(&oracle)), Some(2 * saved));
    assert_eq!(std::fs::read(&history).unwrap(), before);

    // USAGE_SAVE=0 reads but does not write.
    let readonly = coli(
        &[
            &snap(dir.path()),
            PROMPT,
            "NGEN=4",
            "USAGE_SAVE=0",
            "64",
            "16",
            "16",
        ],
        &[],
    );
    assert!(readonly.status.success());
    assert_eq!(std::fs::read(&history).unwrap(), before);

    // COLI_USAGE moves the history elsewhere.
    let elsewhere = dir.path().join("elsewhere.usage");
    let moved = coli(
        &[&snap(dir.path()), PROMPT, "NGEN=4", "64", "16", "16"],
        &[("COLI_USAGE", elsewhere.to_str().unwrap())],
    );
    assert!(moved.status.success());
    assert_eq!(usage_total(&stderr(&moved)), None);
    assert!(std::fs::metadata(&elsewhere).unwrap().len() > 0);
    assert_eq!(std::fs::read(&history).unwrap(), before);
}

/// `coli` as a user who cannot write the model directory: as root (where the suite usually
/// runs, and where permissions do not stop writes) a copy of the binary run as `nobody`,
/// since the build directory may not be open to other users; else this user.
fn coli_as_other_user(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    use std::os::unix::process::CommandExt as _;
    let root = unsafe { libc::geteuid() } == 0;
    let mut command = if root {
        let bin = dir.join("coli");
        if !bin.exists() {
            std::fs::copy(env!("CARGO_BIN_EXE_coli"), &bin).expect("copy the binary");
        }
        let mut c = Command::new(bin);
        for key in coli::settings::KEYS {
            c.env_remove(key.name);
        }
        c.args(args).envs(env.iter().copied()).uid(65534).gid(65534);
        c
    } else {
        common::coli_command(args, env)
    };
    command.output().expect("coli runs")
}

#[test]
fn a_model_directory_that_cannot_be_written_keeps_its_history_in_the_state_directory() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let model = dir.path().join("model");
    common::copy_fixture_to("olmoe_tiny", &model);
    let beside = model.join(".coli_usage");
    let args = |extra: &'static str| -> Vec<String> {
        [
            snap(&model),
            PROMPT.into(),
            extra.into(),
            "64".into(),
            "16".into(),
            "16".into(),
        ]
        .into()
    };
    let run_args = args("NGEN=4");
    let argv: Vec<&str> = run_args.iter().map(String::as_str).collect();

    // The owner's run leaves a history beside the weights.
    let owner = coli(&argv, &[]);
    assert!(owner.status.success(), "{}", stderr(&owner));
    let saved = stats_total(&stderr(&owner)).unwrap();
    let before = std::fs::read(&beside).unwrap();

    // Then the directory is made read-only, and another user runs the model.
    for entry in std::fs::read_dir(&model).unwrap() {
        let p = entry.unwrap().path();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o444)).unwrap();
    }
    std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o555)).unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    let env = [("XDG_STATE_HOME", state.to_str().unwrap())];

    let first = coli_as_other_user(dir.path(), &argv, &env);
    let err = stderr(&first);
    assert!(first.status.success(), "{err}");
    assert_eq!(usage_total(&err), Some(saved), "{err}");
    let moved_to = err
        .split("; saved to ")
        .nth(1)
        .and_then(|rest| rest.split(" (").next())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("the history line names the new home: {err}"));
    assert!(moved_to.starts_with(state.join("coli")), "{err}");
    let name = moved_to.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("olmoe-3x8-") && name.ends_with(".coli_usage"),
        "{name}"
    );
    assert!(
        err.contains(&format!("({} cannot be written", model.display())),
        "{err}"
    );
    assert!(
        err.contains(&format!(
            "[USAGE] carried {saved} selections from {}",
            beside.display()
        )),
        "{err}"
    );
    assert_eq!(stats_total(&err), Some(2 * saved), "{err}");
    assert_eq!(
        std::fs::read(&beside).unwrap(),
        before,
        "the file beside the weights is untouched"
    );

    // The next run reads the state file alone: the records it carried are not counted again.
    let second = coli_as_other_user(dir.path(), &argv, &env);
    let err = stderr(&second);
    assert!(second.status.success(), "{err}");
    assert_eq!(usage_total(&err), Some(2 * saved), "{err}");
    assert_eq!(err.matches("[USAGE] expert history").count(), 1, "{err}");
    assert!(err.contains("not read again"), "{err}");
    assert_eq!(stats_total(&err), Some(3 * saved), "{err}");
    let text = std::fs::read_to_string(&moved_to).unwrap();
    assert!(text.starts_with("-1 3 8\n-2 1 3841822045\n"), "{text}");

    // A history the user named stays where it was named, and a save that cannot write it
    // fails as before.
    let named = coli_as_other_user(
        dir.path(),
        &argv,
        &[env[0], ("COLI_USAGE", beside.to_str().unwrap())],
    );
    assert_eq!(named.status.code(), Some(1), "{}", stderr(&named));
    assert!(
        stderr(&named).contains("[USAGE] save failed"),
        "{}",
        stderr(&named)
    );
    assert_eq!(std::fs::read(&beside).unwrap(), before);
    std::fs::set_permissions(&model, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn pinning_from_the_history_keeps_the_tokens_and_hits_the_pins() {
    let dir = copy_fixture("olmoe_tiny");
    let warm = coli(
        &[&snap(dir.path()), PROMPT, "NGEN=12", "1", "16", "16"],
        &[],
    );
    assert!(warm.status.success());
    let baseline = generated_ids(&stdout(&warm));

    let pinned = coli(
        &[
            &snap(dir.path()),
            PROMPT,
            "NGEN=12",
            "PIN=auto",
            "USAGE_SAVE=0",
            "1",
            "16",
            "16",
        ],
        &[],
    );
    let err = stderr(&pinned);
    assert!(pinned.status.success(), "{err}");
    assert!(err.contains("[PIN] auto: seeding from"), "{err}");
    assert!(err.contains("[PIN] placement: 0 VRAM + "), "{err}");
    assert_eq!(generated_ids(&stdout(&pinned)), baseline);
    let hit_line = stdout(&pinned)
        .lines()
        .find(|l| l.starts_with("Expert cache hit rate"))
        .unwrap()
        .to_string();
    assert!(!hit_line.contains("(0 pin"), "{hit_line}");

    // PIN=off pins nothing even with a history.
    let off = coli(
        &[
            &snap(dir.path()),
            PROMPT,
            "NGEN=12",
            "PIN=off",
            "USAGE_SAVE=0",
            "1",
            "16",
            "16",
        ],
        &[],
    );
    assert!(!stderr(&off).contains("[PIN] placement"));
    assert!(stdout(&off).contains("(0 pin"));
    assert_eq!(generated_ids(&stdout(&off)), baseline);
}

#[test]
fn a_foreign_history_is_refused_by_name_and_honoured_when_named() {
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    let foreign = "-1 3 8\n-2 1 3815245270\n0 1 5\n2 7 9\n";
    std::fs::write(&history, foreign).unwrap();

    let out = coli(&[&snap(dir.path()), PROMPT, "NGEN=3", "2", "16", "16"], &[]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("written by glm_moe_dsa, this engine is olmoe — refusing"),
        "{err}"
    );
    // The refused file is untouched; this run's counts went next to it.
    assert_eq!(std::fs::read_to_string(&history).unwrap(), foreign);
    assert!(err.contains(".coli_usage.olmoe"), "{err}");

    let named = coli(
        &[
            &snap(dir.path()),
            PROMPT,
            "NGEN=3",
            &format!("PIN={}", history.display()),
            "USAGE_SAVE=0",
            "2",
            "16",
            "16",
        ],
        &[],
    );
    let err = stderr(&named);
    assert!(named.status.success(), "{err}");
    assert_eq!(
        err.matches("honouring it because you named it explicitly")
            .count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("[PIN] placement: 0 VRAM + 2 RAM expert"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&history).unwrap(), foreign);
}

#[test]
fn bad_telemetry_settings_exit_2() {
    let dir = copy_fixture("olmoe_tiny");
    for (arg, needle) in [
        ("PIN_GB=lots", "PIN_GB"),
        ("COLI_USAGE_DECAY=2", "COLI_USAGE_DECAY"),
        ("USAGE_SAVE=sometimes", "USAGE_SAVE"),
        ("REPIN=-3", "REPIN"),
    ] {
        let out = coli(&[&snap(dir.path()), PROMPT, arg, "64", "16", "16"], &[]);
        assert_eq!(out.status.code(), Some(2), "{arg}");
        assert!(stderr(&out).contains(needle), "{arg}: {}", stderr(&out));
    }
    assert!(!dir.path().join(".coli_usage").exists());
}

#[test]
fn a_signal_stops_generation_saves_and_exits_128_plus_its_number() {
    for (signal, code) in [("INT", 130), ("TERM", 143), ("HUP", 129)] {
        stopped_by(signal, code);
    }
}

/// `coli args` with its routing traced to `trace`, sent `SIG<signal>` once the trace has
/// its first bytes (and `settle` later): its output.
fn signalled_once_traced(
    args: &[&str],
    trace: &Path,
    signal: &str,
    settle: Duration,
) -> std::process::Output {
    let child = Command::new(env!("CARGO_BIN_EXE_coli"))
        .args(args)
        .arg(format!("ROUTE_TRACE={}", trace.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::fs::metadata(trace).map_or(0, |m| m.len()) == 0
        && started.elapsed() < Duration::from_secs(120)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(settle);
    let status = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    child.wait_with_output().unwrap()
}

fn stopped_by(signal: &str, code: i32) {
    let dir = copy_fixture("olmoe_tiny");
    let trace = dir.path().join("trace.txt");
    // Decoding is under way once the trace grows.
    let snap = snap(dir.path());
    let args = [&snap[..], PROMPT, "NGEN=1000000", "64", "16", "16"];
    let out = signalled_once_traced(&args, &trace, signal, Duration::from_millis(300));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(code), "SIG{signal}: {err}");
    assert!(
        err.contains(&format!("[coli] SIG{signal}: stopping")),
        "{err}"
    );
    let saved = stats_total(&err).expect("the history is saved on a signal");
    let history = std::fs::read_to_string(dir.path().join(".coli_usage")).unwrap();
    // Selections are the data records; the `-5` recent-heat records are not counts.
    let total: u64 = history
        .lines()
        .filter(|l| !l.starts_with('-'))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, saved);
    // Every traced routing decision is in the history: the trace was flushed too.
    let traced: u64 = std::fs::read_to_string(&trace)
        .unwrap()
        .lines()
        .map(|l| (l.split(' ').count() - 3) as u64)
        .sum();
    assert_eq!(traced, saved);
}

#[test]
fn a_signal_during_a_long_prefill_stops_it_between_layers() {
    // OLMoE runs the prompt in one forward; Kimi K3 in chunks of 32 tokens, each through
    // every layer (its routed layers: 5 of 6).
    for (fixture, routed_layers, whole_layers) in
        [("olmoe_tiny", 3, true), ("kimi_k3_tiny", 5, false)]
    {
        prefill_stopped(fixture, routed_layers, whole_layers);
    }
}

fn prefill_stopped(fixture: &str, routed_layers: usize, whole_layers: bool) {
    // 4000 tokens (the fixtures' whole context): the prefill takes seconds, and the trace's
    // first write comes early in it (in OLMoE's first layer), so a signal sent then lands
    // well before the forward could end.
    const TOKENS: usize = 4000;
    let dir = copy_fixture(fixture);
    let trace = dir.path().join("trace.txt");
    let ids: Vec<String> = (0..TOKENS)
        .map(|i| ((i * 7) % 120 + 3).to_string())
        .collect();
    let (snap, ids) = (snap(dir.path()), format!("IDS={}", ids.join(" ")));
    let args = [&snap[..], &ids, "NGEN=4", "64", "16", "16"];
    let out = signalled_once_traced(&args, &trace, "INT", Duration::ZERO);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{fixture}: {err}");
    assert!(
        err.contains(&format!(
            "stopped during the prefill of {TOKENS} tokens: nothing generated"
        )),
        "{fixture}: {err}"
    );
    assert_eq!(
        generated_ids(&stdout(&out)),
        "",
        "{fixture}: {}",
        stdout(&out)
    );
    // Part of the prompt went through the routed layers, not all of it; what was routed
    // is both traced and saved.
    let text = std::fs::read_to_string(&trace).unwrap();
    let lines = text.lines().count();
    assert!(
        lines > 0 && lines < routed_layers * TOKENS,
        "{fixture}: {lines} trace lines"
    );
    if whole_layers {
        assert_eq!(lines % TOKENS, 0, "{fixture}: {lines} trace lines");
    }
    let saved = stats_total(&err).expect("the history is saved on a signal");
    let traced: u64 = text
        .lines()
        .map(|l| (l.split(' ').count() - 3) as u64)
        .sum();
    assert_eq!(traced, saved, "{fixture}");
}

/// A history of `olmoe_tiny`'s shape (3 layers, 8 experts) holding 324,024 selections:
/// well past AUTOPIN's 5000, at full confidence.
fn hot_history() -> String {
    let mut text = String::from("-1 3 8\n-2 1 3841822045\n");
    for layer in 0..3 {
        for expert in 0..8 {
            text.push_str(&format!(
                "{layer} {expert} {}\n",
                (expert + 1) * 3000 + layer
            ));
        }
    }
    text
}

/// Any `[PIN]` line that says experts were placed or pinned.
fn pin_claims(err: &str) -> Vec<&str> {
    err.lines()
        .filter(|l| l.starts_with("[PIN]") && (l.contains("pinned") || l.contains("placement")))
        .collect()
}

#[test]
fn pin_n_zero_pins_nothing_from_autopin_auto_or_a_named_file() {
    let dir = copy_fixture("olmoe_tiny");
    let history = dir.path().join(".coli_usage");
    std::fs::write(&history, hot_history()).unwrap();
    let run = |extra: &[&str]| {
        let snap = snap(dir.path());
        let mut args = vec![snap.as_str(), PROMPT, "NGEN=4", "USAGE_SAVE=0"];
        args.extend_from_slice(extra);
        args.extend(["64", "16", "16"]);
        coli(&args, &[])
    };

    // Without PIN_N, AUTOPIN pins from this history: the PIN_N=0 runs below are a real test.
    let auto = run(&[]);
    let err = stderr(&auto);
    assert!(auto.status.success(), "{err}");
    assert!(
        err.contains("[PIN] 12 experts pinned from history (324024 selections, 100% confidence)"),
        "{err}"
    );
    let baseline = generated_ids(&stdout(&auto));

    let named = format!("PIN={}", history.display());
    for extra in [
        &["PIN_N=0"][..],
        &["PIN=auto", "PIN_N=0"],
        &[&named, "PIN_N=0"],
    ] {
        let out = run(extra);
        let (err, text) = (stderr(&out), stdout(&out));
        assert!(out.status.success(), "{extra:?}: {err}");
        assert!(pin_claims(&err).is_empty(), "{extra:?}: {err}");
        let hit_line = text
            .lines()
            .find(|l| l.starts_with("Expert cache hit rate"))
            .unwrap_or_default();
        assert!(hit_line.contains("(0 pin + "), "{extra:?}: {hit_line}");
        assert_eq!(generated_ids(&text), baseline, "{extra:?}");
    }
    // PIN=auto still seeds from the history, it just pins none of it.
    assert!(stderr(&run(&["PIN=auto", "PIN_N=0"])).contains("[PIN] auto: seeding from"));
    assert_eq!(std::fs::read_to_string(&history).unwrap(), hot_history());
}
