//! The VRAM expert tier.
