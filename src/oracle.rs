//! Oracle checks against a `ref.json` written by a transformers reference: greedy
//! generation compared token by token, or one teacher-forced forward compared at every
//! position.
//!
//! `ref.json` holds `prompt_ids`, `full_ids` (the prompt followed by the reference's greedy
//! continuation) and `tf_pred` (the reference's argmax at every position of `full_ids`).

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::engines::{Engine, Logits};
use crate::generate::greedy;
use crate::sampling::argmax;

/// A parsed, validated `ref.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub full_ids: Vec<u32>,
    pub tf_pred: Option<Vec<u32>>,
}

impl Reference {
    /// Read `path`, checking every id against `vocab_size`.
    pub fn load(path: &Path, vocab_size: usize) -> Result<Reference> {
        let text = std::fs::read_to_string(path).with_context(|| {
            format!(
                "cannot read the oracle reference {} (set REF=<path> or use IDS= to generate)",
                path.display()
            )
        })?;
        Reference::parse(&text, vocab_size)
            .with_context(|| format!("malformed oracle reference {}", path.display()))
    }

    pub fn parse(text: &str, vocab_size: usize) -> Result<Reference> {
        let json: serde_json::Value = serde_json::from_str(text).context("not valid JSON")?;
        if !json.is_object() {
            bail!("expected a JSON object with prompt_ids and full_ids");
        }
        let ids = |key: &str| -> Result<Option<Vec<u32>>> {
            let Some(value) = json.get(key) else {
                return Ok(None);
            };
            let Some(items) = value.as_array() else {
                bail!("{key} must be an array of token ids");
            };
            items
                .iter()
                .enumerate()
                .map(|(i, item)| match item.as_u64() {
                    Some(id) if (id as usize) < vocab_size => Ok(id as u32),
                    Some(id) => bail!(
                        "{key}[{i}] = {id} is outside the vocabulary (vocab_size {vocab_size})"
                    ),
                    None => bail!("{key}[{i}] = {item} is not a non-negative integer token id"),
                })
                .collect::<Result<Vec<u32>>>()
                .map(Some)
        };
        let prompt_ids = ids("prompt_ids")?.context("missing key prompt_ids")?;
        let full_ids = ids("full_ids")?.context("missing key full_ids")?;
        let tf_pred = ids("tf_pred")?;
        if prompt_ids.is_empty() {
            bail!("prompt_ids is empty");
        }
        if full_ids.len() <= prompt_ids.len() || !full_ids.starts_with(&prompt_ids) {
            bail!(
                "full_ids ({} ids) must be prompt_ids ({} ids) followed by at least one generated id",
                full_ids.len(),
                prompt_ids.len()
            );
        }
        if let Some(tf) = &tf_pred {
            if tf.len() != full_ids.len() {
                bail!(
                    "tf_pred has {} ids, expected one per position of full_ids ({})",
                    tf.len(),
                    full_ids.len()
                );
            }
        }
        Ok(Reference {
            prompt_ids,
            full_ids,
            tf_pred,
        })
    }

    pub fn generated(&self) -> &[u32] {
        &self.full_ids[self.prompt_ids.len()..]
    }
}

/// The result of one comparison.
pub struct Outcome {
    pub matching: usize,
    pub compared: usize,
    pub non_finite: bool,
    /// Generated (greedy) or scored (teacher-forced) positions per second.
    pub rate: f64,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.matching == self.compared && !self.non_finite
    }
}

/// Greedy generation from `prompt_ids`, compared position by position with the reference
/// continuation.
pub fn compare_greedy(engine: &dyn Engine, reference: &Reference) -> Result<Outcome> {
    let expected = reference.generated();
    let generation = greedy(engine, &reference.prompt_ids, expected.len())?;
    let matching = expected
        .iter()
        .zip(&generation.tokens)
        .filter(|(a, b)| a == b)
        .count();
    println!("\nReference (oracle): {}", join(&reference.full_ids));
    let produced: Vec<u32> = reference
        .prompt_ids
        .iter()
        .chain(&generation.tokens)
        .copied()
        .collect();
    println!("\ncoli ({:<6})     : {}", engine.name(), join(&produced));
    println!("\nMatching tokens: {matching}/{}", expected.len());
    if let Some(speculation) = &generation.speculation {
        println!("{speculation}");
    }
    if generation.non_finite {
        eprintln!("[ORACLE] non-finite logits during greedy generation");
    }
    Ok(Outcome {
        matching,
        compared: expected.len(),
        non_finite: generation.non_finite,
        rate: generation.decode_tokens_per_second(),
    })
}

/// One forward over `full_ids`; the argmax at every position against `tf_pred`.
pub fn compare_teacher_forced(engine: &dyn Engine, reference: &Reference) -> Result<Outcome> {
    let Some(expected) = &reference.tf_pred else {
        bail!("TF=1 needs tf_pred in the reference (the reference model's argmax at every position of full_ids)");
    };
    let mut state = engine.new_state();
    let started = Instant::now();
    let logits = engine.forward_one(&mut state, &reference.full_ids, Logits::All)?;
    let seconds = started.elapsed().as_secs_f64();
    let vocab = engine.vocab_size();
    let mut matching = 0;
    let mut non_finite = false;
    for (pos, (row, &want)) in logits.chunks_exact(vocab).zip(expected).enumerate() {
        if row.iter().any(|v| !v.is_finite()) {
            if !non_finite {
                eprintln!("[ORACLE] non-finite logits at teacher-forcing position {pos}");
            }
            non_finite = true;
        }
        let got = argmax(row);
        if got == want {
            matching += 1;
        } else {
            eprintln!("[ORACLE] mismatch pos={pos} expected={want} got={got}");
        }
    }
    let compared = expected.len();
    let rate = if seconds > 0.0 {
        compared as f64 / seconds
    } else {
        0.0
    };
    println!(
        "PREFILL (teacher-forcing) vs oracle: {matching}/{compared} positions | {rate:.1} pos/s"
    );
    if matching < compared {
        eprintln!("[ORACLE] {}/{compared} mismatches", compared - matching);
    }
    Ok(Outcome {
        matching,
        compared,
        non_finite,
        rate,
    })
}

pub fn join(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_errors_name_the_problem() {
        let err = |text: &str| format!("{:#}", Reference::parse(text, 100).unwrap_err());
        assert!(err("{}").contains("missing key prompt_ids"));
        assert!(
            err(r#"{"prompt_ids":[1],"full_ids":[1,2.5]}"#).contains("full_ids[1] = 2.5 is not")
        );
        assert!(err(r#"{"prompt_ids":[1],"full_ids":[1,200]}"#).contains("outside the vocabulary"));
        assert!(err(r#"{"prompt_ids":[1],"full_ids":[2,3]}"#).contains("must be prompt_ids"));
        assert!(
            err(r#"{"prompt_ids":[1],"full_ids":[1,3],"tf_pred":[3]}"#).contains("tf_pred has 1")
        );
        assert!(err("[1]").contains("JSON object"));
        let ok = Reference::parse(
            r#"{"prompt_ids":[1],"full_ids":[1,3],"tf_pred":[3,4]}"#,
            100,
        )
        .unwrap();
        assert_eq!(ok.generated(), &[3]);
    }
}
