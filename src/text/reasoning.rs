//! The model's thinking in generated text: an answer that starts inside a thinking block
//! (the prompt opened it) is reasoning until the block's closing tag, then the answer's
//! text. The tag itself is neither.

/// Splits an answer's text into its reasoning and the rest as the text arrives.
pub struct ThinkScan {
    close: &'static str,
    /// The closing tag's ids, where a budget may force it (set by the caller).
    pub close_ids: Vec<u32>,
    /// Reasoning held back while it may be the start of the closing tag.
    pending: String,
    closed: bool,
}

/// What a piece of text turned out to be.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub text: String,
}

impl ThinkScan {
    /// A scan of an answer that starts inside a block closed by `close`.
    pub fn new(close: &'static str) -> ThinkScan {
        ThinkScan {
            close,
            close_ids: Vec::new(),
            pending: String::new(),
            closed: false,
        }
    }

    /// A scan for another answer to the same prompt.
    pub fn fresh(&self) -> ThinkScan {
        ThinkScan {
            close_ids: self.close_ids.clone(),
            ..ThinkScan::new(self.close)
        }
    }

    /// The closing tag.
    pub fn close(&self) -> &'static str {
        self.close
    }

    /// Whether the answer is still thinking.
    pub fn thinking(&self) -> bool {
        !self.closed
    }

    /// Add `piece`.
    pub fn push(&mut self, piece: &str) -> Split {
        if self.closed {
            return Split {
                reasoning: String::new(),
                text: piece.to_string(),
            };
        }
        self.pending.push_str(piece);
        if let Some(at) = self.pending.find(self.close) {
            self.closed = true;
            let text = self.pending[at + self.close.len()..].to_string();
            self.pending.truncate(at);
            return Split {
                reasoning: std::mem::take(&mut self.pending),
                text,
            };
        }
        let keep = (1..self.close.len())
            .rev()
            .find(|&n| self.pending.ends_with(&self.close[..n]))
            .unwrap_or(0);
        let ready = self.pending.len() - keep;
        Split {
            reasoning: self.pending.drain(..ready).collect(),
            text: String::new(),
        }
    }

    /// What is held back, at the end of the answer: reasoning that never closed.
    pub fn finish(&mut self) -> Split {
        Split {
            reasoning: std::mem::take(&mut self.pending),
            text: String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasoning_ends_at_the_closing_tag_wherever_the_pieces_split() {
        let answer = "Let me think </ a bit.</think>The answer is 4.";
        for cut in 1..answer.len() {
            let mut scan = ThinkScan::new("</think>");
            let mut all = Split::default();
            for piece in [&answer[..cut], &answer[cut..]] {
                let split = scan.push(piece);
                all.reasoning += &split.reasoning;
                all.text += &split.text;
            }
            all.reasoning += &scan.finish().reasoning;
            assert_eq!(all.reasoning, "Let me think </ a bit.", "cut {cut}");
            assert_eq!(all.text, "The answer is 4.", "cut {cut}");
            assert!(!scan.thinking());
        }
        let mut scan = ThinkScan::new("</think>");
        assert_eq!(scan.push("still </thi").reasoning, "still ");
        assert!(scan.thinking());
        assert_eq!(scan.finish().reasoning, "</thi");
    }
}
