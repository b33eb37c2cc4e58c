//! The memory the process may use: the lowest of `RAM_GB`, `MemAvailable` and the memory
//! cgroup's limit (v2 `memory.max`, v1 `memory.limit_in_bytes`, the own group's and every
//! ancestor's), since inside a container `MemAvailable` reports the host.

use std::path::{Path, PathBuf};

/// A memory budget and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    pub bytes: u64,
    /// What set it, e.g. `cgroup v1 memory.limit_in_bytes`, with the other candidates.
    pub source: String,
}

impl Budget {
    /// A fixed budget (tests, library users).
    pub fn fixed(bytes: u64) -> Budget {
        Budget {
            bytes,
            source: "given".to_string(),
        }
    }

    /// The budget of this process: `ram_gb` when positive, `MemAvailable` and the cgroup
    /// limit, whichever is lowest.
    pub fn detect(ram_gb: f64) -> Budget {
        let mut candidates: Vec<(u64, String)> = Vec::new();
        if ram_gb > 0.0 {
            candidates.push(((ram_gb * 1e9) as u64, "RAM_GB".to_string()));
        }
        if let Some(kib) = proc_field("/proc/meminfo", "MemAvailable:") {
            candidates.push((kib * 1024, "MemAvailable".to_string()));
        }
        if let Some((bytes, what)) = cgroup_limit() {
            candidates.push((bytes, what));
        }
        candidates.sort_by_key(|(bytes, _)| *bytes);
        let Some((bytes, first)) = candidates.first().cloned() else {
            return Budget {
                bytes: 8 << 30,
                source: "no RAM_GB, /proc/meminfo or cgroup limit: assumed 8 GiB".to_string(),
            };
        };
        let others: Vec<String> = candidates[1..]
            .iter()
            .map(|(b, what)| format!("{what} {:.2} GB", *b as f64 / 1e9))
            .collect();
        let source = if others.is_empty() {
            first
        } else {
            format!("{first}; {}", others.join(", "))
        };
        Budget { bytes, source }
    }
}

/// Memory kept free of expert slots for everything else the run allocates (activations,
/// KV cache, logits, thread stacks, the binary): 64 MiB plus 5% of the budget, at most 2 GiB.
pub fn reserve(budget: u64) -> u64 {
    ((64u64 << 20) + budget / 20).min(2 << 30)
}

/// The first number after `field` in the `/proc` file `path` (e.g. `MemAvailable:` in
/// `/proc/meminfo`, in kB; `read_bytes:` in `/proc/self/io`).
pub fn proc_field(path: &str, field: &str) -> Option<u64> {
    field_value(&std::fs::read_to_string(path).ok()?, field)
}

fn field_value(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// The lowest memory limit of this process's cgroup and its ancestors, and which file set it.
fn cgroup_limit() -> Option<(u64, String)> {
    let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut limits = Vec::new();
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        let path = path.trim_start_matches('/');
        if controllers.is_empty() {
            for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
                limits.extend(lowest_in(Path::new(root), path, "memory.max", "cgroup v2"));
            }
        } else if controllers.split(',').any(|c| c == "memory") {
            limits.extend(lowest_in(
                Path::new("/sys/fs/cgroup/memory"),
                path,
                "memory.limit_in_bytes",
                "cgroup v1",
            ));
        }
    }
    limits.into_iter().min_by_key(|(bytes, _)| *bytes)
}

/// The lowest `file` limit from `root/path` up to `root`.
fn lowest_in(root: &Path, path: &str, file: &str, version: &str) -> Option<(u64, String)> {
    let mut dir: PathBuf = root.join(path);
    let mut best: Option<(u64, String)> = None;
    loop {
        if let Some(bytes) = read_limit(&dir.join(file)) {
            if best.as_ref().is_none_or(|(b, _)| bytes < *b) {
                best = Some((bytes, format!("{version} {file}")));
            }
        }
        if dir == root || !dir.pop() || !dir.starts_with(root) {
            return best;
        }
    }
}

/// A limit file's value; `None` for "max" or the v1 "unlimited" value (near 2^63).
fn read_limit(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let value: u64 = text.trim().parse().ok()?;
    (value < 1 << 60).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_candidate_wins() {
        let budget = Budget::detect(0.001);
        assert_eq!(budget.bytes, 1_000_000);
        assert!(budget.source.starts_with("RAM_GB"), "{}", budget.source);
    }

    #[test]
    fn limits_read_as_bytes_or_unlimited() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("memory.max");
        std::fs::write(&file, "max\n").unwrap();
        assert_eq!(read_limit(&file), None);
        std::fs::write(&file, "9223372036854771712\n").unwrap();
        assert_eq!(read_limit(&file), None);
        std::fs::write(&file, "838860800\n").unwrap();
        assert_eq!(read_limit(&file), Some(838_860_800));
        let child = dir.path().join("a/b");
        std::fs::create_dir_all(&child).unwrap();
        std::fs::write(child.join("memory.max"), "900000000\n").unwrap();
        let (bytes, what) = lowest_in(dir.path(), "a/b", "memory.max", "cgroup v2").unwrap();
        assert_eq!(
            (bytes, what.as_str()),
            (838_860_800, "cgroup v2 memory.max")
        );
    }

    #[test]
    fn proc_fields_parse() {
        assert_eq!(
            field_value("VmPeak:  10 kB\nVmRSS:\t  2048 kB\n", "VmRSS:"),
            Some(2048)
        );
        assert_eq!(
            field_value("rchar: 5\nread_bytes: 4096\n", "read_bytes:"),
            Some(4096)
        );
        assert_eq!(field_value("VmRSS: x kB\n", "VmRSS:"), None);
    }

    #[test]
    fn reserve_grows_with_the_budget_and_stops_at_two_gib() {
        assert_eq!(reserve(0), 64 << 20);
        assert_eq!(reserve(1_000_000_000), (64 << 20) + 50_000_000);
        assert_eq!(reserve(1 << 40), 2 << 30);
    }
}
