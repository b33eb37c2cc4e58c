//! PIN, PIN=auto, PIN_N, PIN_GB and AUTOPIN: which experts to pin at startup.
//!
//! Owns the ranking, the three ways of choosing a pinned set (a byte budget, a per-layer
//! count, the AUTOPIN confidence quota), the resolution of `PIN=auto`, and the `[PIN]` line
//! texts. The result is a [`PinPlan`]: a list of (layer, expert) for the expert cache to
//! load and never evict. Nothing here loads an expert or changes what the model computes:
//! pins choose which bytes are resident, never which experts are routed.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::cfmt::fixed;
use super::counters::Counters;
use super::history::{self, ReadOutcome, Trust};

/// The `PIN` setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PinSetting {
    /// Not set: AUTOPIN may pin from the history.
    Unset,
    /// `off`, `0` or empty: no pins, and no AUTOPIN.
    Off,
    /// `auto`: seed from this model's history, or `stats.txt` when the history is empty.
    Auto,
    /// A path typed by the user: trusted (another engine's history is honoured).
    Path(PathBuf),
}

impl PinSetting {
    /// Reads the setting's text.
    pub fn from_setting(value: Option<&str>) -> PinSetting {
        match value {
            None => PinSetting::Unset,
            Some("" | "off" | "0") => PinSetting::Off,
            Some("auto") => PinSetting::Auto,
            Some(p) => PinSetting::Path(PathBuf::from(p)),
        }
    }
}

/// `PIN_RANK`: which counts placement ranks experts by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PinRank {
    /// Every selection the history holds.
    #[default]
    Lifetime,
    /// The recent heat of the `-5` records: a moving average over saves, so a workload
    /// that switched ranks by what it does now.
    Recent,
    /// Each expert's share of the lifetime selections plus its share of the recent heat.
    Blend,
}

impl PinRank {
    /// Reads the setting; unset is `lifetime`.
    pub fn from_setting(value: Option<&str>) -> Result<PinRank, String> {
        match value.map(str::trim) {
            None | Some("lifetime") => Ok(PinRank::Lifetime),
            Some("recent") => Ok(PinRank::Recent),
            Some("blend") => Ok(PinRank::Blend),
            Some(other) => Err(format!(
                "setting PIN_RANK={other}: expected lifetime, recent or blend"
            )),
        }
    }

    /// The table to rank by: the lifetime counts, the recent heat, or their blend (both
    /// normalised to their totals, in millionths). A history without recent heat ranks by
    /// its lifetime counts whatever the setting.
    pub fn table(self, t: &Counters) -> Counters {
        let Some(recent) = t.recent().filter(|r| r.total() > 0) else {
            return t.clone();
        };
        match self {
            PinRank::Lifetime => t.clone(),
            PinRank::Recent => recent.clone(),
            PinRank::Blend => {
                let (lt, rt) = (t.total().max(1) as f64, recent.total() as f64);
                let mut out = t.zeroed_like();
                let share = |c: u32, of: f64| (1e6 * f64::from(c) / of).round();
                for (l, e, c) in t.nonzero() {
                    out.admit(l as i64, e as i64, share(c, lt) as u32);
                }
                for (l, e, h) in recent.nonzero() {
                    out.admit(l as i64, e as i64, share(h, rt) as u32);
                }
                out
            }
        }
    }
}

/// The `PIN_GB` setting.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PinGb {
    /// A budget in gigabytes (10^9 bytes).
    Gb(f64),
    /// `all`: as much as the RAM budget the caller computed allows.
    All,
}

/// A `PIN_GB` value that is neither `all` nor a number.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("PIN_GB={0:?}: expected a number of gigabytes or `all`")]
pub struct PinGbError(pub String);

impl PinGb {
    /// The default budget when `PIN_GB` is unset.
    pub const DEFAULT: PinGb = PinGb::Gb(10.0);

    /// Reads the setting; unset is 10 GB, and a negative number means `all` as in colibri.
    pub fn from_setting(value: Option<&str>) -> Result<PinGb, PinGbError> {
        match value.map(str::trim) {
            None => Ok(PinGb::DEFAULT),
            Some("all") => Ok(PinGb::All),
            Some(v) => match v.parse::<f64>() {
                Ok(gb) if gb.is_finite() && gb < 0.0 => Ok(PinGb::All),
                Ok(gb) if gb.is_finite() => Ok(PinGb::Gb(gb)),
                _ => Err(PinGbError(v.to_string())),
            },
        }
    }

    /// The budget in bytes; `all` is `ram_avail_bytes`.
    pub fn bytes(self, ram_avail_bytes: u64) -> u64 {
        match self {
            PinGb::Gb(gb) => (gb * 1e9) as u64,
            PinGb::All => ram_avail_bytes,
        }
    }
}

/// One candidate or pinned expert.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pin {
    /// Layer (counter row).
    pub layer: usize,
    /// Expert within the layer.
    pub expert: usize,
    /// Its recorded selections.
    pub count: u32,
}

/// The placement order: count descending, then layer, then expert ascending, so equal
/// counts always rank the same way (colibri's `qsort` leaves ties unspecified).
fn by_rank(a: &Pin, b: &Pin) -> std::cmp::Ordering {
    b.count
        .cmp(&a.count)
        .then(a.layer.cmp(&b.layer))
        .then(a.expert.cmp(&b.expert))
}

/// Every expert with a non-zero count, hottest first. Duplicate records were already
/// summed when the history was read.
pub fn rank(table: &Counters) -> Vec<Pin> {
    let mut v: Vec<Pin> = table
        .nonzero()
        .map(|(layer, expert, count)| Pin {
            layer,
            expert,
            count,
        })
        .collect();
    v.sort_by(by_rank);
    v
}

/// The longest prefix of `ranked` whose expert bytes fit `budget`, and its size. Stops at
/// the first expert that does not fit rather than skipping it for a colder, narrower one:
/// the pinned set is always a popularity-ranked prefix.
pub fn select_by_bytes(
    ranked: &[Pin],
    budget: u64,
    expert_bytes: &dyn Fn(usize) -> u64,
) -> (Vec<Pin>, u64) {
    let mut used = 0u64;
    let mut out = Vec::new();
    for p in ranked {
        match used.checked_add(expert_bytes(p.layer)) {
            Some(next) if next <= budget => {
                used = next;
                out.push(*p);
            }
            _ => break,
        }
    }
    (out, used)
}

/// The `per_layer` hottest experts of every layer (count > 0; ties to the lower id), in
/// rank order.
pub fn select_per_layer(table: &Counters, per_layer: usize) -> Vec<Pin> {
    // The global ranking orders each layer's experts by count, then id, so the first
    // `per_layer` of a layer met in it are that layer's hottest.
    let mut taken: HashMap<usize, usize> = HashMap::new();
    let mut out = rank(table);
    out.retain(|p| {
        let n = taken.entry(p.layer).or_insert(0);
        *n += 1;
        *n <= per_layer
    });
    out
}

/// `PIN_N` clamped so that eight slots per layer stay adaptive, or half of them when the
/// layer has fewer than sixteen (colibri's `CAP - 8` alone would leave no pin at all in
/// the small caches a model several times larger than memory runs with).
pub fn clamp_pin_n(pin_n: usize, cap: usize) -> usize {
    pin_n.min(cap - cap.div_ceil(2).min(8))
}

/// AUTOPIN engages only from this many recorded selections.
pub const AUTOPIN_MIN_SELECTIONS: i64 = 5000;
/// Selections at which AUTOPIN trusts the history fully.
pub const AUTOPIN_FULL_CONFIDENCE: f64 = 200_000.0;

/// `min(1, selections / 200000)`.
pub fn autopin_confidence(selections: i64) -> f64 {
    (selections as f64 / AUTOPIN_FULL_CONFIDENCE).min(1.0)
}

/// Pins per layer under AUTOPIN: `floor(cap * 0.5 * confidence)`, at most `cap / 2`, so
/// automatic pinning never takes more than half of a layer's slots.
pub fn autopin_quota(cap: usize, confidence: f64) -> usize {
    ((cap as f64 * 0.5 * confidence) as usize).min(cap / 2)
}

/// Where a plan's pins came from.
#[derive(Clone, Debug, PartialEq)]
pub enum PinSource {
    /// `PIN=<path>`.
    Named(PathBuf),
    /// `PIN=auto`, seeded from this file.
    Auto(PathBuf),
    /// AUTOPIN from the loaded history.
    Autopin {
        /// Selections in the history.
        selections: i64,
        /// `autopin_confidence(selections)`.
        confidence: f64,
    },
}

/// The experts to pin and where they came from.
#[derive(Clone, Debug, PartialEq)]
pub struct PinPlan {
    /// `None` when nothing was consulted (PIN=off, or no history to pin from).
    pub source: Option<PinSource>,
    /// Experts to pin, hottest first.
    pub pins: Vec<Pin>,
    /// Their total size, from the caller's per-expert byte sizes.
    pub bytes: u64,
    /// The experts ranked next, hottest first, up to `PIN_N` per layer and one slot short
    /// of the layer's: not pinned at start (the clamp keeps slots adaptive), but the
    /// abstain rule may pin them where its shadows show they pay ([`super::guard`]).
    pub reserve: Vec<Pin>,
}

impl PinPlan {
    fn empty() -> PinPlan {
        PinPlan {
            source: None,
            pins: Vec::new(),
            bytes: 0,
            reserve: Vec::new(),
        }
    }

    /// The `[PIN]` line reporting what was pinned from where, once the cache has loaded
    /// the plan (`vram`: how many of the pins went to a GPU tier; `secs`: load time).
    /// `None` when nothing was pinned.
    pub fn line(&self, vram: usize, secs: f64) -> Option<String> {
        if self.pins.is_empty() {
            return None;
        }
        let n = self.pins.len();
        Some(match self.source.as_ref()? {
            PinSource::Named(p) | PinSource::Auto(p) => format!(
                "[PIN] placement: {vram} VRAM + {} RAM expert ({} GB warm) in {}s da {}",
                n.saturating_sub(vram),
                fixed(self.bytes as f64 / 1e9, 1),
                fixed(secs, 0),
                p.display()
            ),
            PinSource::Autopin {
                selections,
                confidence,
            } => format!(
                "[PIN] {n} experts pinned from history ({selections} selections, {}% confidence)",
                fixed(confidence * 100.0, 0)
            ),
        })
    }
}

/// Everything the placement decision depends on besides the history.
#[derive(Clone, Debug)]
pub struct PinRequest<'a> {
    /// `PIN`.
    pub pin: &'a PinSetting,
    /// `PIN_N`: pins per layer instead of a byte budget.
    pub pin_n: Option<usize>,
    /// `PIN_GB`.
    pub pin_gb: PinGb,
    /// What `PIN_GB=all` means: the bytes the RAM budget leaves for experts.
    pub ram_avail_bytes: u64,
    /// `AUTOPIN` (default on).
    pub autopin: bool,
    /// Expert-cache slots per MoE layer.
    pub cap: usize,
    /// The model directory (`PIN=auto` falls back to `<snap>/stats.txt`).
    pub snap: &'a Path,
    /// The history this run loads and saves, if it keeps one.
    pub history: Option<&'a Path>,
    /// `PIN_RANK`.
    pub rank: PinRank,
}

/// `[PIN] auto: seeding from <path>`.
pub fn auto_seed_line(path: &Path) -> String {
    format!("[PIN] auto: seeding from {}", path.display())
}

/// `[PIN] auto: no .coli_usage or stats.txt in <snap> yet (no pin this run)`.
pub fn auto_none_line(snap: &Path) -> String {
    format!(
        "[PIN] auto: no .coli_usage or stats.txt in {} yet (no pin this run)",
        snap.display()
    )
}

/// A non-empty file, the test `PIN=auto` uses for "is there a usable history?".
fn has_bytes(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() > 0)
}

/// `PIN=auto`'s file: the history when it is non-empty, else `<snap>/stats.txt` when that
/// is non-empty.
pub fn resolve_auto(history: Option<&Path>, snap: &Path) -> Option<PathBuf> {
    let stats = snap.join("stats.txt");
    history
        .filter(|h| has_bytes(h))
        .map(Path::to_path_buf)
        .or_else(|| has_bytes(&stats).then_some(stats))
}

/// Chooses from a table, ranked as `PIN_RANK` says, by `PIN_N` when set, else by the
/// `PIN_GB` byte budget.
/// `PIN_N=0` chooses nothing: the file still seeds the ranking, but no expert is pinned.
/// Returns the pins, their bytes and the reserve (see [`PinPlan::reserve`]).
fn choose(
    table: &Counters,
    req: &PinRequest<'_>,
    expert_bytes: &dyn Fn(usize) -> u64,
) -> (Vec<Pin>, u64, Vec<Pin>) {
    let table = &req.rank.table(table);
    match req.pin_n {
        Some(0) => (Vec::new(), 0, Vec::new()),
        Some(n) => {
            let start = clamp_pin_n(n, req.cap);
            let mut pins = select_per_layer(table, n.min(req.cap.saturating_sub(1)));
            let mut held: HashMap<usize, usize> = HashMap::new();
            let (pins_now, reserve): (Vec<Pin>, Vec<Pin>) = pins.drain(..).partition(|p| {
                let k = held.entry(p.layer).or_insert(0);
                *k += 1;
                *k <= start
            });
            let bytes = pins_now.iter().map(|p| expert_bytes(p.layer)).sum();
            (pins_now, bytes, reserve)
        }
        None => {
            let (pins, bytes) = select_by_bytes(
                &rank(table),
                req.pin_gb.bytes(req.ram_avail_bytes),
                expert_bytes,
            );
            (pins, bytes, Vec::new())
        }
    }
}

/// Decides the startup pins. `loaded` is the table holding the history this run loaded
/// (the AUTOPIN source; call before routing starts so it holds only the history);
/// `engine` names this engine for the trust check of a pin file; `expert_bytes(layer)` is
/// one expert's size in that layer. Prints the `PIN=auto` lines and any refusal of a pin
/// file.
pub fn plan_pins(
    loaded: &Counters,
    engine: &str,
    req: &PinRequest<'_>,
    expert_bytes: &dyn Fn(usize) -> u64,
) -> PinPlan {
    let (path, trust) = match req.pin {
        PinSetting::Off => return PinPlan::empty(),
        PinSetting::Unset => return autopin(loaded, req, expert_bytes),
        PinSetting::Path(p) => (p.clone(), Trust::Named),
        PinSetting::Auto => match resolve_auto(req.history, req.snap) {
            Some(p) => {
                eprintln!("{}", auto_seed_line(&p));
                (p, Trust::Found)
            }
            None => {
                eprintln!("{}", auto_none_line(req.snap));
                return PinPlan::empty();
            }
        },
    };
    let mut table = loaded.zeroed_like();
    let outcome = history::read(&path, engine, trust, &mut table);
    history::announce(&path, engine, &outcome);
    match &outcome {
        ReadOutcome::Missing => {
            eprintln!("[PIN] {}: no such file (no pin this run)", path.display());
        }
        ReadOutcome::Read(_) if outcome.total() == 0 => eprintln!(
            "[PIN] {}: no expert-usage records for this engine in it (is it a .coli_usage history?); nothing pinned",
            path.display()
        ),
        _ => {}
    }
    let (pins, bytes, reserve) = choose(&table, req, expert_bytes);
    let source = match req.pin {
        PinSetting::Auto => PinSource::Auto(path),
        _ => PinSource::Named(path),
    };
    PinPlan {
        source: Some(source),
        pins,
        bytes,
        reserve,
    }
}

/// AUTOPIN: with `PIN` unset and at least 5000 selections in the history, pin the
/// `autopin_quota` hottest experts of each layer. An explicit `PIN_N=0` pins nothing here
/// too; any other `PIN_N` leaves the quota as it is.
fn autopin(
    loaded: &Counters,
    req: &PinRequest<'_>,
    expert_bytes: &dyn Fn(usize) -> u64,
) -> PinPlan {
    let selections = loaded.total();
    if !req.autopin || req.pin_n == Some(0) || selections < AUTOPIN_MIN_SELECTIONS {
        return PinPlan::empty();
    }
    let confidence = autopin_confidence(selections);
    let pins = select_per_layer(&req.rank.table(loaded), autopin_quota(req.cap, confidence));
    let bytes = pins.iter().map(|p| expert_bytes(p.layer)).sum();
    PinPlan {
        source: Some(PinSource::Autopin {
            selections,
            confidence,
        }),
        pins,
        bytes,
        reserve: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(recs: &[(i64, i64, u32)]) -> Counters {
        let mut t = Counters::new(3, 4).expect("shape");
        for &(l, e, c) in recs {
            t.admit(l, e, c);
        }
        t
    }

    #[test]
    fn ranking_ties_are_deterministic() {
        let t = table(&[(2, 1, 5), (0, 3, 5), (0, 2, 5), (1, 0, 9)]);
        let r: Vec<_> = rank(&t).iter().map(|p| (p.layer, p.expert)).collect();
        assert_eq!(r, vec![(1, 0), (0, 2), (0, 3), (2, 1)]);
    }

    #[test]
    fn byte_budget_is_a_prefix() {
        let t = table(&[(0, 0, 9), (1, 0, 8), (0, 1, 7)]);
        // Layer 1 experts are wide: the budget stops there, it does not skip to (0, 1).
        let bytes = |l: usize| if l == 1 { 100 } else { 10 };
        let (p, used) = select_by_bytes(&rank(&t), 50, &bytes);
        assert_eq!(p.len(), 1);
        assert_eq!(used, 10);
        let (p, used) = select_by_bytes(&rank(&t), 120, &bytes);
        assert_eq!(p.len(), 3);
        assert_eq!(used, 120);
    }

    #[test]
    fn per_layer_quota() {
        let t = table(&[(0, 0, 1), (0, 1, 3), (0, 2, 3), (1, 3, 2)]);
        let p: Vec<_> = select_per_layer(&t, 1)
            .iter()
            .map(|p| (p.layer, p.expert))
            .collect();
        assert_eq!(p, vec![(0, 1), (1, 3)]);
        assert_eq!(clamp_pin_n(40, 64), 40);
        assert_eq!(clamp_pin_n(40, 20), 12);
        assert_eq!(clamp_pin_n(3, 4), 2);
        assert_eq!(clamp_pin_n(16, 16), 8);
        assert_eq!(clamp_pin_n(9, 9), 4);
        assert_eq!(clamp_pin_n(5, 1), 0);
        assert_eq!(clamp_pin_n(5, 0), 0);
    }

    #[test]
    fn autopin_formula() {
        assert_eq!(autopin_confidence(100_000), 0.5);
        assert_eq!(autopin_confidence(1_000_000), 1.0);
        assert_eq!(autopin_quota(64, 0.5), 16);
        assert_eq!(autopin_quota(64, 1.0), 32);
        assert_eq!(autopin_quota(3, 1.0), 1);
        assert_eq!(autopin_quota(8, 0.1), 0);
    }

    #[test]
    fn settings() {
        assert_eq!(PinSetting::from_setting(None), PinSetting::Unset);
        assert_eq!(PinSetting::from_setting(Some("off")), PinSetting::Off);
        assert_eq!(PinSetting::from_setting(Some("0")), PinSetting::Off);
        assert_eq!(PinSetting::from_setting(Some("auto")), PinSetting::Auto);
        assert_eq!(
            PinSetting::from_setting(Some("/h/u")),
            PinSetting::Path(PathBuf::from("/h/u"))
        );
        assert_eq!(PinGb::from_setting(None), Ok(PinGb::Gb(10.0)));
        assert_eq!(PinGb::from_setting(Some("all")), Ok(PinGb::All));
        assert_eq!(PinGb::from_setting(Some("-1")), Ok(PinGb::All));
        assert_eq!(PinGb::from_setting(Some("2.5")), Ok(PinGb::Gb(2.5)));
        assert!(PinGb::from_setting(Some("lots")).is_err());
        assert_eq!(PinGb::Gb(2.5).bytes(0), 2_500_000_000);
        assert_eq!(PinGb::All.bytes(77), 77);
    }

    #[test]
    fn lines() {
        let pins = vec![Pin {
            layer: 0,
            expert: 1,
            count: 3,
        }];
        let plan = PinPlan {
            source: Some(PinSource::Named(PathBuf::from("/m/.coli_usage"))),
            pins: pins.clone(),
            bytes: 1_250_000_000,
            reserve: Vec::new(),
        };
        assert_eq!(
            plan.line(0, 2.4).as_deref(),
            Some("[PIN] placement: 0 VRAM + 1 RAM expert (1.2 GB warm) in 2s da /m/.coli_usage")
        );
        let plan = PinPlan {
            source: Some(PinSource::Autopin {
                selections: 12_000,
                confidence: 0.06,
            }),
            pins,
            bytes: 0,
            reserve: Vec::new(),
        };
        assert_eq!(
            plan.line(0, 0.0).as_deref(),
            Some("[PIN] 1 experts pinned from history (12000 selections, 6% confidence)")
        );
        assert_eq!(PinPlan::empty().line(0, 0.0), None);
        // A plan that consulted a file but chose nothing (PIN_N=0) claims no placement.
        let plan = PinPlan {
            source: Some(PinSource::Auto(PathBuf::from("/m/.coli_usage"))),
            pins: Vec::new(),
            bytes: 0,
            reserve: Vec::new(),
        };
        assert_eq!(plan.line(0, 0.0), None);
    }

    /// 3 layers x 4 experts holding over 200,000 selections: full AUTOPIN confidence.
    fn hot_table() -> Counters {
        let mut recs = Vec::new();
        for l in 0..3 {
            for e in 0..4 {
                recs.push((l, e, 20_000 + 1000 * e as u32 + l as u32));
            }
        }
        let t = table(&recs);
        assert!(t.total() >= AUTOPIN_MIN_SELECTIONS);
        assert!(autopin_confidence(t.total()) >= 1.0);
        t
    }

    fn request<'a>(
        pin: &'a PinSetting,
        pin_n: Option<usize>,
        snap: &'a Path,
        history: Option<&'a Path>,
    ) -> PinRequest<'a> {
        PinRequest {
            pin,
            pin_n,
            pin_gb: PinGb::DEFAULT,
            ram_avail_bytes: 0,
            autopin: true,
            cap: 16,
            snap,
            history,
            rank: PinRank::Lifetime,
        }
    }

    const ONE_MB: &dyn Fn(usize) -> u64 = &|_| 1_000_000;

    #[test]
    fn autopin_pins_nothing_with_pin_n_zero() {
        let t = hot_table();
        let snap = Path::new("/nonexistent-snap");
        let unset = PinSetting::Unset;
        // Today's AUTOPIN: cap 16 at full confidence pins 8 per layer (only 4 are hot),
        // whatever a non-zero PIN_N says.
        let plan = plan_pins(&t, "olmoe", &request(&unset, None, snap, None), ONE_MB);
        assert_eq!(plan.pins.len(), 12);
        assert_eq!(
            plan_pins(&t, "olmoe", &request(&unset, Some(2), snap, None), ONE_MB),
            plan
        );
        // PIN_N=0: nothing, and no startup line.
        let plan = plan_pins(&t, "olmoe", &request(&unset, Some(0), snap, None), ONE_MB);
        assert!(plan.pins.is_empty(), "{plan:?}");
        assert_eq!(plan.bytes, 0);
        assert_eq!(plan.line(0, 0.0), None);
    }

    #[test]
    fn pin_files_pin_nothing_with_pin_n_zero() {
        let t = hot_table();
        let dir = tempfile::tempdir().expect("tempdir");
        let history = dir.path().join(".coli_usage");
        let mut text = format!(
            "-1 {} {}\n-2 {} {}\n",
            t.n_layers(),
            t.n_experts(),
            super::super::FORMAT_VERSION,
            super::super::EngineId::of("olmoe").0
        );
        for (l, e, c) in t.nonzero() {
            text.push_str(&format!("{l} {e} {c}\n"));
        }
        std::fs::write(&history, text).expect("write history");
        let auto = PinSetting::Auto;
        let named = PinSetting::Path(history.clone());
        for pin in [&auto, &named] {
            let req = request(pin, Some(1), dir.path(), Some(&history));
            let plan = plan_pins(&t.zeroed_like(), "olmoe", &req, ONE_MB);
            assert_eq!(plan.pins.len(), 3, "{pin:?}: one per layer");
            let req = request(pin, Some(0), dir.path(), Some(&history));
            let plan = plan_pins(&t.zeroed_like(), "olmoe", &req, ONE_MB);
            assert!(plan.pins.is_empty(), "{pin:?}: {plan:?}");
            assert_eq!(plan.bytes, 0);
            assert_eq!(plan.line(0, 0.0), None);
        }
    }
}
