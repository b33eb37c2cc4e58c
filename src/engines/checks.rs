//! The checks of a model's `config.json` against its checkpoint that come before an engine
//! allocates anything; each message names the key and what was expected. They read, and
//! decide nothing about what a model computes.

use anyhow::{bail, Result};

use crate::snapshot::Snapshot;

/// The largest integer a config may hold: beyond every model dimension, layer and token
/// count, and small enough that the shape arithmetic of two such numbers cannot overflow.
const MAX_CONFIG_INTEGER: u64 = 1 << 31;

/// Every integer in `config.json`, at any depth, is at most [`MAX_CONFIG_INTEGER`]; checked
/// before an engine reads a dimension, so a hostile number is refused by name instead of
/// overflowing a shape or sizing an allocation.
pub(super) fn check_config_integers(value: &serde_json::Value, path: &str) -> Result<()> {
    match value {
        serde_json::Value::Number(n) => match n.as_u64() {
            Some(v) if v > MAX_CONFIG_INTEGER => bail!(
                "config.json: {path} is {v}, larger than any model's dimension or count (at most {MAX_CONFIG_INTEGER})"
            ),
            _ => Ok(()),
        },
        serde_json::Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_config_integers(item, &format!("{path}[{i}]"))),
        serde_json::Value::Object(map) => map.iter().try_for_each(|(key, item)| {
            let path = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            check_config_integers(item, &path)
        }),
        _ => Ok(()),
    }
}

/// Checks of a config against its checkpoint that every engine makes before it allocates
/// anything: `num_hidden_layers` is the number of decoder layers the checkpoint holds under
/// `prefix` (`model.layers.`): every index below it is present and none at or above it
/// beyond `extra` (an MTP head's layers); no routed expert (`.experts.N.`) is numbered at
/// or beyond the config's count (`experts`: its key and value); and the RMSNorm epsilon is
/// a positive number.
pub(crate) fn check_config(
    snapshot: &Snapshot,
    prefix: &str,
    layers: usize,
    extra: usize,
    experts: (&str, usize),
    rms_norm_eps: f64,
) -> Result<()> {
    if !(rms_norm_eps.is_finite() && rms_norm_eps > 0.0) {
        bail!("config.json: rms_norm_eps is {rms_norm_eps}; it must be a positive number");
    }
    let (key, count) = experts;
    let beyond = snapshot.names().find(|name| {
        name.split(".experts.")
            .nth(1)
            .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .is_some_and(|e| e >= count)
    });
    if let Some(name) = beyond {
        bail!("config.json: {key} is {count}, but the checkpoint holds tensor {name}: the config does not describe these weights");
    }
    let present: std::collections::BTreeSet<usize> = snapshot
        .names()
        .filter_map(|name| name.strip_prefix(prefix))
        .filter_map(|rest| rest.split('.').next()?.parse().ok())
        .collect();
    let highest = present.iter().next_back().copied();
    let found = match highest {
        Some(h) => format!("layers 0..={h}"),
        None => "no layers".to_string(),
    };
    if layers == 0 {
        bail!("config.json: num_hidden_layers is 0; the checkpoint holds {found} under {prefix}N");
    }
    if let Some(missing) = (0..layers).find(|l| !present.contains(l)) {
        bail!(
            "config.json: num_hidden_layers is {layers}, but the checkpoint has no layer {missing} ({prefix}{missing}.*; it holds {found}): the config does not belong to these weights"
        );
    }
    if let Some(h) = highest.filter(|&h| h >= layers + extra) {
        bail!(
            "config.json: num_hidden_layers is {layers}, but the checkpoint holds layers up to {h} ({prefix}{h}.*): the config does not describe every layer of these weights"
        );
    }
    Ok(())
}

/// `value` of `key` in config.json is a positive number.
pub(crate) fn check_positive(key: &str, value: f64) -> Result<()> {
    if !(value.is_finite() && value > 0.0) {
        bail!("config.json: {key} is {value}; it must be a positive number");
    }
    Ok(())
}
