//! Which rule counters are free: the blocks in use, kept as a segment tree over the counter
//! positions, so that placing a new policy's block is O(log positions) however many policies
//! the kernel holds.
//!
//! Blocks may overlap (a kernel changed behind the agent's back, a plan stopped halfway): each
//! node counts the blocks that cover it whole, and a position is free when nothing covers it.
//! Each node also knows its free runs (from its start, to its end, the longest), so the
//! lowest fitting position is found in one descent. About 1.25 MiB for [`MAX_RULES`].

use std::collections::BTreeMap;

use wgfence_common::MAX_RULES;

/// The free runs of a node's range: from its start, to its end, and the longest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Runs {
    head: u32,
    tail: u32,
    best: u32,
}

impl Runs {
    const NONE: Self = Self {
        head: 0,
        tail: 0,
        best: 0,
    };

    fn free(width: u32) -> Self {
        Self {
            head: width,
            tail: width,
            best: width,
        }
    }

    /// The runs of two adjacent ranges of `width` positions each, `left` then `right`.
    fn join(left: Self, right: Self, width: u32) -> Self {
        Self {
            head: if left.head == width {
                width + right.head
            } else {
                left.head
            },
            tail: if right.tail == width {
                width + left.tail
            } else {
                right.tail
            },
            best: left.best.max(right.best).max(left.tail + right.head),
        }
    }
}

/// The rule counter positions `0..size` and the blocks that use them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RuleSpace {
    /// Positions; a power of two.
    size: u32,
    /// Per node (the root is 1, node `n`'s children `2n` and `2n + 1`, the leaves
    /// `size..2 * size`): the blocks that cover its range whole and none of its ancestors'.
    cover: Vec<u32>,
    /// Per inner node: its range's free runs, as its children have them (its own cover aside).
    runs: Vec<Runs>,
}

impl Default for RuleSpace {
    fn default() -> Self {
        Self::new(MAX_RULES)
    }
}

impl RuleSpace {
    /// Every position of `0..size` free; `size` is rounded up to a power of two, the positions
    /// beyond it taken.
    pub(super) fn new(size: u32) -> Self {
        let width = size.max(1).next_power_of_two();
        let len = usize::try_from(width).unwrap_or(usize::MAX);
        let mut space = Self {
            size: width,
            cover: vec![0; 2 * len],
            runs: vec![Runs::NONE; len],
        };
        for node in (1..len).rev() {
            space.runs[node] = Runs::free(width >> node.ilog2());
        }
        if size < width {
            space.add(size, width - size);
        }
        space
    }

    /// Notes a block of `len` positions from `base` (clipped to the positions).
    pub(super) fn add(&mut self, base: u32, len: u32) {
        self.change(base, len, true);
    }

    /// Forgets a block [`RuleSpace::add`] noted.
    pub(super) fn remove(&mut self, base: u32, len: u32) {
        self.change(base, len, false);
    }

    fn change(&mut self, base: u32, len: u32, up: bool) {
        let end = base.saturating_add(len).min(self.size);
        if base < end {
            self.update(1, 0, self.size, (base, end), up);
        }
    }

    fn update(&mut self, node: usize, lo: u32, hi: u32, (a, b): (u32, u32), up: bool) {
        if b <= lo || hi <= a {
            return;
        }
        if a <= lo && hi <= b {
            let cover = &mut self.cover[node];
            *cover = if up {
                cover.saturating_add(1)
            } else {
                cover.saturating_sub(1)
            };
            return;
        }
        let mid = lo + (hi - lo) / 2;
        self.update(2 * node, lo, mid, (a, b), up);
        self.update(2 * node + 1, mid, hi, (a, b), up);
        self.runs[node] = Runs::join(self.runs_of(2 * node), self.runs_of(2 * node + 1), mid - lo);
    }

    /// The free runs of `node`.
    fn runs_of(&self, node: usize) -> Runs {
        if self.cover[node] > 0 {
            Runs::NONE
        } else if node >= self.runs.len() {
            Runs::free(1)
        } else {
            self.runs[node]
        }
    }

    /// The lowest position from `from` on where `len` free positions start.
    pub(super) fn first_fit(&self, len: u32, from: u32) -> Option<u32> {
        if len == 0 {
            return (from <= self.size).then_some(from);
        }
        self.find(1, (0, self.size), from, len, 0).ok()
    }

    /// Within `node` (positions `lo..hi`), the lowest fit from `from` on, `run` free positions
    /// (from `from` on) right before `lo`; else the free run at the node's end, for the next.
    fn find(
        &self,
        node: usize,
        (lo, hi): (u32, u32),
        from: u32,
        len: u32,
        run: u32,
    ) -> Result<u32, u32> {
        if hi <= from {
            return Err(0);
        }
        let width = hi - lo;
        if lo >= from {
            let runs = self.runs_of(node);
            if run + runs.head >= len {
                return Ok(lo - run);
            }
            if runs.best < len {
                return Err(if runs.head == width {
                    run + width
                } else {
                    runs.tail
                });
            }
        } else if self.cover[node] > 0 {
            return Err(0);
        }
        // An inner node: a leaf is either before `from` or starts a fit or not.
        let mid = lo + width / 2;
        match self.find(2 * node, (lo, mid), from, len, run) {
            Ok(base) => Ok(base),
            Err(carry) => self.find(2 * node + 1, (mid, hi), from, len, carry),
        }
    }
}

/// The blocks one plan places, on top of the kernel's: a plan places a few (then its own
/// blocks are stepped over), or many (a cold load: then it works on its own copy).
pub(super) struct Placing<'a> {
    space: std::borrow::Cow<'a, RuleSpace>,
    /// This plan's blocks, by base, to their ends (disjoint), while `space` is borrowed.
    placed: BTreeMap<u32, u32>,
}

/// Blocks stepped over before a plan copies the space.
const STEP_OVER: usize = 8;

impl<'a> Placing<'a> {
    pub(super) fn new(space: &'a RuleSpace) -> Self {
        Self {
            space: std::borrow::Cow::Borrowed(space),
            placed: BTreeMap::new(),
        }
    }

    /// Places a block of `len` at the lowest position no block uses, if there is one.
    pub(super) fn place(&mut self, len: u32) -> Option<u32> {
        let mut from = 0;
        let base = loop {
            let base = self.space.first_fit(len, from)?;
            let end = base.saturating_add(len);
            match self.placed.range(..end).next_back() {
                Some((_, &placed_end)) if placed_end > base => from = placed_end,
                _ => break base,
            }
        };
        if self.placed.len() < STEP_OVER {
            self.placed.insert(base, base.saturating_add(len));
        } else {
            let space = self.space.to_mut();
            for (b, e) in std::mem::take(&mut self.placed) {
                space.add(b, e - b);
            }
            space.add(base, len);
        }
        Some(base)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The lowest `p >= from` where `len` positions of `0..size` are free of `blocks`.
    fn brute(size: u32, blocks: &[(u32, u32)], len: u32, from: u32) -> Option<u32> {
        let taken = |p: u32| {
            blocks
                .iter()
                .any(|&(b, l)| b <= p && p < b.saturating_add(l))
        };
        if len > size {
            return None;
        }
        (from..=size.saturating_sub(len)).find(|&p| (p..p + len).all(|q| !taken(q)))
    }

    #[test]
    fn an_empty_space_fits_from_its_start_and_nothing_longer_than_itself() {
        let space = RuleSpace::new(64);
        assert_eq!(space.first_fit(1, 0), Some(0));
        assert_eq!(space.first_fit(64, 0), Some(0));
        assert_eq!(space.first_fit(65, 0), None);
        assert_eq!(space.first_fit(3, 62), None);
        assert_eq!(space.first_fit(2, 62), Some(62));
    }

    #[test]
    fn a_size_not_a_power_of_two_keeps_its_end() {
        let space = RuleSpace::new(10);
        assert_eq!(space.first_fit(10, 0), Some(0));
        assert_eq!(space.first_fit(11, 0), None);
    }

    #[test]
    fn a_removed_block_frees_its_positions_unless_another_covers_them() {
        let mut space = RuleSpace::new(16);
        space.add(0, 8);
        space.add(4, 8);
        assert_eq!(space.first_fit(4, 0), Some(12));
        space.remove(0, 8);
        assert_eq!(space.first_fit(4, 0), Some(0));
        assert_eq!(space.first_fit(5, 0), None);
        space.remove(4, 8);
        assert_eq!(space.first_fit(16, 0), Some(0));
        assert_eq!(space, RuleSpace::new(16));
    }

    #[test]
    fn a_plan_steps_over_its_own_blocks_and_copies_the_space_past_a_few() {
        let mut kernel = RuleSpace::new(64);
        kernel.add(2, 2);
        let mut placing = Placing::new(&kernel);
        let bases: Vec<Option<u32>> = (0..20).map(|_| placing.place(3)).collect();
        let mut blocks = vec![(2, 2)];
        let mut want = Vec::new();
        for _ in 0..20 {
            let base = brute(64, &blocks, 3, 0);
            if let Some(b) = base {
                blocks.push((b, 3));
            }
            want.push(base);
        }
        assert_eq!(bases, want);
        assert_eq!(
            kernel.first_fit(2, 0),
            Some(0),
            "the kernel's space is not changed"
        );
    }

    proptest! {
        /// Whatever blocks come and go, a fit is the lowest one a scan of every position
        /// finds.
        #[test]
        fn fits_are_the_lowest_a_scan_finds(
            size in 1u32..80,
            ops in proptest::collection::vec((any::<bool>(), 0u32..90, 1u32..20), 0..40),
            queries in proptest::collection::vec((1u32..30, 0u32..90), 1..10),
        ) {
            let mut space = RuleSpace::new(size);
            let mut blocks: Vec<(u32, u32)> = Vec::new();
            for (add, base, len) in ops {
                if add || blocks.is_empty() {
                    space.add(base, len);
                    blocks.push((base, len));
                } else {
                    let (b, l) = blocks.remove(base as usize % blocks.len());
                    space.remove(b, l);
                }
            }
            for (len, from) in queries {
                prop_assert_eq!(space.first_fit(len, from), brute(size, &blocks, len, from));
            }
            let mut placing = Placing::new(&space);
            for (len, _) in [(3, 0), (1, 0), (5, 0), (2, 0)].iter().cycle().take(12) {
                let base = brute(size, &blocks, *len, 0);
                prop_assert_eq!(placing.place(*len), base);
                if let Some(b) = base {
                    blocks.push((b, *len));
                }
            }
        }
    }
}
