//! The policy ids nothing uses, kept as ranges: the ids step 4 hands to new policies.

use std::collections::BTreeMap;

use wgfence_common::UNRESTRICTED;

use super::EMPTY_POLICY;

/// The policy ids `1..EMPTY_POLICY` that nothing uses, as ranges, kept current as ids are
/// used and freed: the lowest free id costs O(log #ranges), not a copy of every used id.
#[derive(Debug, Clone, Default)]
pub(super) struct FreeIds {
    /// Free ranges below `high`, `start -> end` (exclusive), disjoint and not adjacent.
    below: BTreeMap<u32, u32>,
    /// One past the highest id ever used (at least 1): every id from here on is free.
    high: u32,
}

impl FreeIds {
    fn in_range(id: u32) -> bool {
        id != UNRESTRICTED && id != EMPTY_POLICY
    }

    /// `id` is used now.
    pub(super) fn take(&mut self, id: u32) {
        if !Self::in_range(id) {
            return;
        }
        let high = self.high.max(1);
        if id >= high {
            if id > high {
                // Joined to a free range that ends at the old high mark.
                let start = match self.below.range(..high).next_back() {
                    Some((&start, &end)) if end == high => start,
                    _ => high,
                };
                self.below.insert(start, id);
            }
            self.high = id + 1;
            return;
        }
        let Some((&start, &end)) = self.below.range(..=id).next_back() else {
            return;
        };
        if id >= end {
            return;
        }
        self.below.remove(&start);
        if start < id {
            self.below.insert(start, id);
        }
        if id + 1 < end {
            self.below.insert(id + 1, end);
        }
    }

    /// `id` is used no more.
    pub(super) fn give(&mut self, id: u32) {
        if !Self::in_range(id) || id >= self.high {
            return;
        }
        let mut start = id;
        let mut end = id + 1;
        if let Some((&s, &e)) = self.below.range(..=id).next_back() {
            if e > id {
                return;
            }
            if e == id {
                self.below.remove(&s);
                start = s;
            }
        }
        if let Some(e) = self.below.remove(&end) {
            end = e;
        }
        self.below.insert(start, end);
    }

    /// The free ids, lowest first (then every id from the high mark on).
    pub(super) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.below
            .iter()
            .flat_map(|(start, end)| *start..*end)
            .chain(self.high.max(1)..=u32::MAX)
    }

    /// The lowest free id that `taken` does not hold, up to `max`.
    #[cfg(test)]
    pub(super) fn lowest(&self, taken: &std::collections::BTreeSet<u32>, max: u32) -> Option<u32> {
        self.iter()
            .find(|id| !taken.contains(id))
            .filter(|id| *id <= max)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The free-id index, over any sequence of ids used and freed, gives what a scan of
        /// the used ids would: the lowest free id not taken by the plan, within the bound.
        #[test]
        fn free_ids_give_the_lowest_unused_id(
            steps in proptest::collection::vec((any::<bool>(), 0u32..40), 0..80),
            taken in proptest::collection::btree_set(1u32..45, 0..6),
            max in 1u32..50,
        ) {
            let mut free = FreeIds::default();
            let mut used = BTreeSet::new();
            for (take, id) in steps {
                if take {
                    free.take(id);
                    used.insert(id);
                } else {
                    free.give(id);
                    used.remove(&id);
                }
                let mut ranges = free.below.iter().peekable();
                while let Some((start, end)) = ranges.next() {
                    prop_assert!(start < end && *end <= free.high);
                    if let Some((next, _)) = ranges.peek() {
                        prop_assert!(end < *next, "ranges overlap or touch");
                    }
                }
            }
            let naive = (1..=max).find(|id| !used.contains(id) && !taken.contains(id));
            prop_assert_eq!(free.lowest(&taken, max), naive);
        }
    }
}
