//! Engine identity: the FNV-1a-32 hash of an engine name, as stored in the third field of a
//! history's `-2` record.
//!
//! Owns the hash, the table of known engine names (used only to *name* a writer in
//! messages) and the history format version. It must not decide whether a mismatch is
//! acceptable: that is the reader's trust rule.

use std::fmt;

/// The history format version this build writes and the highest it reads.
pub const FORMAT_VERSION: i32 = 1;

/// The first field of a recent-heat record: `-5 <layer * n_experts + expert> <heat>`.
pub const RECENT_RECORD: i32 = -5;

/// How messages name a writer whose id is not in [`KNOWN_ENGINES`].
pub const UNKNOWN_ENGINE: &str = "an unknown engine";

/// Engine names whose histories we can name in a refusal. The order follows colibri's
/// table so that a (theoretical) hash collision resolves to the same name.
pub const KNOWN_ENGINES: [&str; 7] = [
    "glm_moe_dsa",
    "inkling",
    "olmoe",
    "kimi_k3",
    "deepseek_v4",
    "qwen38",
    "glm53",
];

/// The FNV-1a-32 hash of an engine name. The id is numeric (not the name) because every
/// pre-header reader stops at the first non-numeric token; it is the third field because
/// old readers scan that field with `%u`, and many ids exceed `i32::MAX`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct EngineId(pub u32);

impl EngineId {
    /// FNV-1a over the name's bytes; the empty name hashes to the offset basis.
    pub fn of(name: &str) -> EngineId {
        let mut h: u32 = 0x811C_9DC5;
        for &b in name.as_bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
        EngineId(h)
    }

    /// The first known engine name with this id, if any.
    pub fn name(self) -> Option<&'static str> {
        KNOWN_ENGINES
            .iter()
            .copied()
            .find(|n| EngineId::of(n) == self)
    }

    /// The writer as refusal messages name it: its name, or "an unknown engine".
    pub fn describe(self) -> &'static str {
        self.name().unwrap_or(UNKNOWN_ENGINE)
    }
}

impl fmt::Display for EngineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ids() {
        assert_eq!(EngineId::of("glm_moe_dsa").0, 3_815_245_270);
        assert_eq!(EngineId::of("inkling").0, 2_050_583_463);
        assert_eq!(EngineId::of("olmoe").0, 3_841_822_045);
        assert_eq!(EngineId::of("kimi_k3").0, 1_820_578_806);
        assert_eq!(EngineId::of("deepseek_v4").0, 1_277_378_958);
        assert_eq!(EngineId::of("qwen38").0, 2_546_085_765);
        assert_eq!(EngineId::of("glm53").0, 2_402_853_253);
        assert_eq!(EngineId::of("").0, 2_166_136_261);
    }

    #[test]
    fn names_resolve() {
        for n in KNOWN_ENGINES {
            assert_eq!(EngineId::of(n).name(), Some(n));
        }
        assert_eq!(EngineId(12345).name(), None);
        assert_eq!(EngineId(12345).describe(), "an unknown engine");
        assert_eq!(EngineId::of("kimi_k3").describe(), "kimi_k3");
    }
}
