//! Where weight parts live in device memory: large blocks of [`BLOCK_BYTES`] (less on a small
//! heap, more for a part that needs it), each holding many parts, so a model of tens of
//! thousands of matrices takes tens of allocations where drivers may allow only 4096
//! (`maxMemoryAllocationCount`). Each block keeps its free space in a first-fit
//! [`FreeList`] that merges neighbours on release. Of the blocks that fall empty, one per
//! memory type is kept for the next uploads and the others are handed back to be freed.
//!
//! This module is bookkeeping only: it makes no Vulkan call. The device allocates, maps and
//! frees the memory it names, and creates and binds the buffers placed in it.

use std::ptr::NonNull;

use ash::vk;

use super::Mapped;

/// The size of a new block when the heap is large enough.
pub const BLOCK_BYTES: u64 = 256 << 20;

/// How large a new block is for a part of `needed` bytes on a heap of `heap` bytes: at most
/// a quarter of a small heap, so that blocks do not strand most of it, and at least the part.
pub fn block_size(needed: u64, heap: u64) -> u64 {
    BLOCK_BYTES.min(heap / 4).max(needed)
}

/// The free ranges of one block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FreeList {
    size: u64,
    /// `(offset, length)` of each free range, sorted by offset; none is empty and no two
    /// touch (touching ranges are merged).
    free: Vec<(u64, u64)>,
}

impl FreeList {
    pub fn new(size: u64) -> FreeList {
        let free = if size > 0 { vec![(0, size)] } else { vec![] };
        FreeList { size, free }
    }

    /// Take `size` bytes at a multiple of `align` from the first free range that holds them,
    /// returning their offset. The bytes skipped to reach the alignment stay free.
    pub fn allocate(&mut self, size: u64, align: u64) -> Option<u64> {
        let align = align.max(1);
        for i in 0..self.free.len() {
            let (start, length) = self.free[i];
            let end = start + length;
            let at = start.next_multiple_of(align);
            let Some(after) = at.checked_add(size) else {
                continue;
            };
            if after > end {
                continue;
            }
            match (at > start, after < end) {
                (false, false) => {
                    self.free.remove(i);
                }
                (true, false) => self.free[i] = (start, at - start),
                (false, true) => self.free[i] = (after, end - after),
                (true, true) => {
                    self.free[i] = (start, at - start);
                    self.free.insert(i + 1, (after, end - after));
                }
            }
            return Some(at);
        }
        None
    }

    /// Give back `size` bytes at `offset` that [`FreeList::allocate`] handed out, merging
    /// them with the free ranges they touch.
    pub fn release(&mut self, offset: u64, size: u64) {
        if size == 0 {
            return;
        }
        let i = self.free.partition_point(|&(start, _)| start < offset);
        debug_assert!(
            i == 0 || self.free[i - 1].0 + self.free[i - 1].1 <= offset,
            "released range overlaps a free one"
        );
        debug_assert!(
            i == self.free.len() || offset + size <= self.free[i].0,
            "released range overlaps a free one"
        );
        let joins_previous = i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == offset;
        let joins_next = i < self.free.len() && self.free[i].0 == offset + size;
        match (joins_previous, joins_next) {
            (true, true) => {
                let (_, next) = self.free.remove(i);
                self.free[i - 1].1 += size + next;
            }
            (true, false) => self.free[i - 1].1 += size,
            (false, true) => self.free[i] = (offset, size + self.free[i].1),
            (false, false) => self.free.insert(i, (offset, size)),
        }
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.iter().map(|&(_, length)| length).sum()
    }

    /// Whether nothing is allocated.
    pub fn is_unused(&self) -> bool {
        self.free_bytes() == self.size
    }
}

/// One device-memory allocation that weight parts are placed in.
pub struct Block {
    pub memory: vk::DeviceMemory,
    pub type_index: u32,
    pub size: u64,
    /// The whole block mapped, when weights are written in place.
    pub mapped: Option<Mapped>,
    space: FreeList,
}

impl Block {
    pub fn new(
        memory: vk::DeviceMemory,
        type_index: u32,
        size: u64,
        mapped: Option<Mapped>,
    ) -> Block {
        Block {
            memory,
            type_index,
            size,
            mapped,
            space: FreeList::new(size),
        }
    }
}

/// Where one weight part's buffer is bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub memory: vk::DeviceMemory,
    pub offset: u64,
    pub size: u64,
}

/// Every block that holds weights.
#[derive(Default)]
pub struct Blocks {
    blocks: Vec<Block>,
}

impl Blocks {
    /// Room for `size` bytes at a multiple of `align` in the first block of memory type
    /// `type_index` that has it.
    pub fn place(&mut self, type_index: u32, size: u64, align: u64) -> Option<Placement> {
        self.blocks
            .iter_mut()
            .filter(|block| block.type_index == type_index)
            .find_map(|block| {
                let offset = block.space.allocate(size, align)?;
                Some(Placement {
                    memory: block.memory,
                    offset,
                    size,
                })
            })
    }

    pub fn add(&mut self, block: Block) {
        self.blocks.push(block);
    }

    /// Where the host sees the start of `placement`, when its block is mapped.
    pub fn mapping(&self, placement: &Placement) -> Option<NonNull<u8>> {
        let block = self.blocks.iter().find(|b| b.memory == placement.memory)?;
        let base = block.mapped.as_ref()?.0;
        // SAFETY: the placement lies inside the block, which is mapped whole.
        Some(unsafe { base.add(placement.offset as usize) })
    }

    /// Give back a placement's room. A block that falls empty while another empty block of
    /// its memory type is kept is removed and returned, for the caller to free.
    pub fn release(&mut self, placement: &Placement) -> Option<Block> {
        let index = self
            .blocks
            .iter()
            .position(|b| b.memory == placement.memory)?;
        let block = &mut self.blocks[index];
        block.space.release(placement.offset, placement.size);
        if !block.space.is_unused() {
            return None;
        }
        let type_index = block.type_index;
        let another_empty = self
            .blocks
            .iter()
            .enumerate()
            .any(|(i, b)| i != index && b.type_index == type_index && b.space.is_unused());
        another_empty.then(|| self.blocks.swap_remove(index))
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes not yet placed in the blocks of the memory types `counted` accepts.
    pub fn free_bytes(&self, counted: impl Fn(u32) -> bool) -> u64 {
        self.blocks
            .iter()
            .filter(|block| counted(block.type_index))
            .map(|block| block.space.free_bytes())
            .sum()
    }

    /// Every block, for the caller to free; none is left.
    pub fn take_all(&mut self) -> Vec<Block> {
        std::mem::take(&mut self.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_ranges(list: &FreeList) -> Vec<(u64, u64)> {
        list.free.clone()
    }

    #[test]
    fn allocations_follow_each_other_until_the_block_is_full() {
        let mut list = FreeList::new(100);
        assert_eq!(list.allocate(40, 1), Some(0));
        assert_eq!(list.allocate(40, 1), Some(40));
        assert_eq!(list.allocate(30, 1), None);
        assert_eq!(list.allocate(20, 1), Some(80));
        assert_eq!(free_ranges(&list), vec![]);
        assert_eq!(list.allocate(1, 1), None);
    }

    #[test]
    fn alignment_skips_bytes_that_stay_free() {
        let mut list = FreeList::new(256);
        assert_eq!(list.allocate(10, 1), Some(0));
        assert_eq!(list.allocate(16, 64), Some(64));
        assert_eq!(free_ranges(&list), vec![(10, 54), (80, 176)]);
        // The gap before the aligned part still serves a small unaligned request.
        assert_eq!(list.allocate(50, 2), Some(10));
        assert_eq!(list.allocate(8, 16), Some(80));
        assert_eq!(free_ranges(&list), vec![(60, 4), (88, 168)]);
        assert_eq!(list.allocate(4, 4), Some(60));
        assert_eq!(free_ranges(&list), vec![(88, 168)]);
    }

    #[test]
    fn a_request_larger_than_any_range_after_alignment_is_refused() {
        let mut list = FreeList::new(128);
        assert_eq!(list.allocate(1, 1), Some(0));
        // 127 bytes are free, but aligned to 64 only 64 of them are.
        assert_eq!(list.allocate(100, 64), None);
        assert_eq!(list.allocate(64, 64), Some(64));
        assert_eq!(list.allocate(u64::MAX, 1), None);
    }

    #[test]
    fn released_ranges_merge_with_both_neighbours() {
        let mut list = FreeList::new(300);
        let offsets: Vec<u64> = (0..3).map(|_| list.allocate(100, 1).unwrap()).collect();
        assert_eq!(offsets, [0, 100, 200]);
        list.release(0, 100);
        list.release(200, 100);
        assert_eq!(free_ranges(&list), vec![(0, 100), (200, 100)]);
        assert!(!list.is_unused());
        list.release(100, 100);
        assert_eq!(free_ranges(&list), vec![(0, 300)]);
        assert!(list.is_unused());
        assert_eq!(list.free_bytes(), 300);
    }

    #[test]
    fn released_ranges_merge_with_one_neighbour_or_none() {
        let mut list = FreeList::new(400);
        for _ in 0..4 {
            list.allocate(100, 1).unwrap();
        }
        list.release(100, 100);
        assert_eq!(free_ranges(&list), vec![(100, 100)]);
        list.release(0, 100);
        assert_eq!(free_ranges(&list), vec![(0, 200)]);
        list.release(300, 100);
        assert_eq!(free_ranges(&list), vec![(0, 200), (300, 100)]);
        list.release(200, 100);
        assert!(list.is_unused());
        // Released space serves the next requests first fit.
        assert_eq!(list.allocate(400, 1), Some(0));
    }

    #[test]
    fn aligned_allocations_released_leave_the_block_whole() {
        let mut list = FreeList::new(1 << 12);
        let mut taken = Vec::new();
        for (size, align) in [(3, 1), (100, 256), (7, 4), (500, 512), (1, 1024)] {
            let offset = list.allocate(size, align).unwrap();
            assert_eq!(offset % align, 0);
            taken.push((offset, size));
        }
        let mut sorted = taken.clone();
        sorted.sort();
        for pair in sorted.windows(2) {
            assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlap: {pair:?}");
        }
        for index in [3, 0, 4, 1, 2] {
            let (offset, size) = taken[index];
            list.release(offset, size);
        }
        assert_eq!(free_ranges(&list), vec![(0, 1 << 12)]);
    }

    #[test]
    fn block_size_is_capped_by_small_heaps_and_grows_for_large_parts() {
        assert_eq!(block_size(1 << 10, 64 << 30), BLOCK_BYTES);
        assert_eq!(block_size(1 << 10, 512 << 20), 128 << 20);
        assert_eq!(block_size(300 << 20, 64 << 30), 300 << 20);
    }

    fn memory(raw: u64) -> vk::DeviceMemory {
        ash::vk::Handle::from_raw(raw)
    }

    #[test]
    fn blocks_place_first_fit_by_memory_type_and_keep_one_empty_block() {
        let mut blocks = Blocks::default();
        blocks.add(Block::new(memory(1), 0, 100, None));
        blocks.add(Block::new(memory(2), 1, 100, None));
        let a = blocks.place(1, 60, 1).unwrap();
        assert_eq!((a.memory, a.offset), (memory(2), 0));
        assert_eq!(blocks.place(1, 60, 1), None);
        blocks.add(Block::new(memory(3), 1, 100, None));
        let b = blocks.place(1, 60, 1).unwrap();
        assert_eq!((b.memory, b.offset), (memory(3), 0));
        let c = blocks.place(1, 40, 1).unwrap();
        assert_eq!((c.memory, c.offset), (memory(2), 60));
        assert_eq!(blocks.free_bytes(|t| t == 1), 40);
        assert_eq!(blocks.free_bytes(|_| true), 140);
        // Block 2 still holds `c`; block 3 falls empty and is the only empty one of type 1.
        assert!(blocks.release(&a).is_none());
        assert!(blocks.release(&b).is_none());
        assert_eq!(blocks.len(), 3);
        // Block 2 falls empty too: one empty block of type 1 is enough.
        let freed = blocks
            .release(&c)
            .expect("a second empty block is given back");
        assert_eq!(freed.memory, memory(2));
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks.take_all().len(), 2);
        assert_eq!(blocks.len(), 0);
    }
}
