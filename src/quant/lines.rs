//! Float buffers that start on a cache line, for the kernels' 512-bit loads.
//!
//! A `Vec<f32>` is only as aligned as the allocator makes it (16 bytes), so a 512-bit load
//! at a multiple of sixteen floats from its start can straddle two cache lines, and two
//! lines cost a load twice over. Owns nothing else: the kernels decide what goes in.

use bytemuck::{Pod, Zeroable};

/// Sixteen floats on a cache line of their own.
#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Zeroed floats starting on a cache line.
pub struct Lines {
    lines: Vec<Line>,
    floats: usize,
}

impl Lines {
    /// `floats` zeros (held in whole lines, from memory the allocator hands over zeroed).
    pub fn zeroed(floats: usize) -> Lines {
        Lines {
            lines: bytemuck::allocation::zeroed_vec(floats.div_ceil(16)),
            floats,
        }
    }

    /// The buffer as floats.
    pub fn floats(&self) -> &[f32] {
        &bytemuck::cast_slice(&self.lines)[..self.floats]
    }

    /// The buffer as floats, to fill.
    pub fn floats_mut(&mut self) -> &mut [f32] {
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..self.floats]
    }
}

#[cfg(test)]
mod tests {
    use super::Lines;

    #[test]
    fn starts_on_a_cache_line_and_is_zeroed() {
        for floats in [0, 1, 15, 16, 17, 1000] {
            let mut lines = Lines::zeroed(floats);
            assert_eq!(lines.floats().as_ptr() as usize % 64, 0, "{floats} floats");
            assert_eq!(lines.floats().len(), floats);
            assert!(lines.floats().iter().all(|&x| x == 0.0));
            lines.floats_mut().iter_mut().for_each(|x| *x = 1.0);
            assert_eq!(
                lines.floats().iter().sum::<f32>(),
                lines.floats().len() as f32
            );
        }
    }
}
