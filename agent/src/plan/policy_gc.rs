//! Steps 3 and 8: deleting the trie entries of policies no peer entry references after the plan;
//! in the lead those nothing references once the revocations ran, last those the plan's policy
//! switches leave unreferenced.

use std::collections::{BTreeMap, BTreeSet};

use wgfence_common::UNRESTRICTED;

use super::{op::Op, planner::Planner, EMPTY_POLICY};

impl<'a> Planner<'a> {
    /// Steps 3 and 8: the trie entries of policies no peer entry references after the plan.
    /// Those nothing references once the lead ran (a revoked peer's, or a failed put's
    /// leftovers, which a full plan also collects) go in the lead: deleting them takes access
    /// from nobody, and at a full trie the puts need their room. Those the plan's switches
    /// unreference go last.
    /// `delta`: the change of each policy id's references over the plan (a full plan looks at
    /// every id, an incremental one only at those).
    pub(super) fn policy_gc(
        &self,
        delta: &BTreeMap<u32, i64>,
        lead_delta: &BTreeMap<u32, i64>,
    ) -> (Vec<Op>, Vec<Op>) {
        let (maps, index) = (&self.actual.maps, &self.actual.index);
        let candidates: BTreeSet<u32> = if self.full {
            maps.policies.keys().copied().collect()
        } else {
            delta.keys().copied().collect()
        };
        let (mut lead, mut last) = (Vec::new(), Vec::new());
        for id in candidates {
            let now = index.policy_refs.get(&id).copied().unwrap_or(0) as i64;
            let after_lead = now + lead_delta.get(&id).copied().unwrap_or(0);
            let after = now + delta.get(&id).copied().unwrap_or(0);
            // The empty policy and UNRESTRICTED never have entries: any there (drift) are
            // deleted at once.
            let never = id == EMPTY_POLICY || id == UNRESTRICTED;
            if !never && after > 0 {
                continue;
            }
            let to = if never || after_lead <= 0 {
                &mut lead
            } else {
                &mut last
            };
            if let Some(content) = maps.policies.get(&id) {
                for (prefix, _) in content.entries() {
                    to.push(Op::DeletePolicyEntry { policy: id, prefix });
                }
            }
        }
        (lead, last)
    }
}
