//! The `colibri.fmt` container stamp of a shard's `__metadata__`: which format each
//! quantised tensor's bytes are. Parsed and merged across shards here; checked against what
//! the byte counts say by `quant::format::infer`, which knows the formats.

use std::collections::HashMap;

use anyhow::{bail, Context, Result};

/// The stamp of one shard: `__metadata__["colibri.fmt"]`, a JSON-encoded object of tensor
/// name to format name. Refused when it is not that.
pub fn parse_stamp(text: &str) -> Result<HashMap<String, String>> {
    let value: serde_json::Value = serde_json::from_str(text)
        .context("colibri.fmt is not JSON; expected an object of tensor name to format name")?;
    let Some(object) = value.as_object() else {
        bail!("colibri.fmt is not a JSON object; expected an object of tensor name to format name");
    };
    object
        .iter()
        .map(|(tensor, format)| match format.as_str() {
            Some(format) => Ok((tensor.clone(), format.to_string())),
            None => bail!("colibri.fmt entry {tensor:?} is {format}, not a format name string"),
        })
        .collect()
}

/// Merge one shard's stamp into the snapshot's: agreeing duplicates collapse, conflicting
/// claims for one tensor are refused.
pub fn merge_stamp(
    into: &mut HashMap<String, String>,
    shard: &std::path::Path,
    text: &str,
) -> Result<()> {
    let stamp = parse_stamp(text)
        .with_context(|| format!("{}: malformed container stamp", shard.display()))?;
    for (tensor, format) in stamp {
        match into.get(&tensor) {
            Some(previous) if *previous != format => bail!(
                "{}: container stamp says tensor {tensor} is {format}, another shard's stamp says {previous}",
                shard.display()
            ),
            Some(_) => {}
            None => {
                into.insert(tensor, format);
            }
        }
    }
    Ok(())
}
