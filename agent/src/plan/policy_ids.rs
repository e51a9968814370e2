//! Step 4 and content addressing: a policy whose content the kernel already has under some id
//! keeps that id (so an unchanged state, in any order, plans nothing); new content gets the
//! lowest free id, and its trie entries are written before any peer entry points at them.

use std::collections::{BTreeMap, HashMap};

use wgfence_common::MAX_POLICIES;

use super::{op::Op, planner::Planner, unplanned::PlanError, EMPTY_POLICY};
use crate::policy::CompiledPolicy;

/// The policy id of each touched peer's policy. Peers with equal rules share one compiled
/// policy, so an id is found by the policy's address (a hash lookup per peer); its content is
/// compared only for an allocation not seen yet.
#[derive(Default)]
pub(super) struct PolicyIds<'a> {
    by_address: HashMap<*const CompiledPolicy, u32>,
    pub(super) by_content: BTreeMap<&'a CompiledPolicy, u32>,
}

impl<'a> PolicyIds<'a> {
    /// Whether `policy` has an id already (then it is known by its address too).
    fn known(&mut self, policy: &'a CompiledPolicy) -> bool {
        let address: *const CompiledPolicy = policy;
        if self.by_address.contains_key(&address) {
            return true;
        }
        match self.by_content.get(policy).copied() {
            Some(id) => {
                self.by_address.insert(address, id);
                true
            }
            None => false,
        }
    }

    pub(super) fn insert(&mut self, policy: &'a CompiledPolicy, id: u32) {
        self.by_address.insert(policy, id);
        self.by_content.insert(policy, id);
    }

    pub(super) fn get(&self, policy: &CompiledPolicy) -> Option<u32> {
        let address: *const CompiledPolicy = policy;
        self.by_address.get(&address).copied()
    }
}

impl<'a> Planner<'a> {
    /// The id a policy gets if the kernel has its content already: the empty policy's, or
    /// the lowest id with that content (never UNRESTRICTED, see [`content_of`]).
    pub(super) fn existing_id(&self, policy: &CompiledPolicy) -> Option<u32> {
        if policy.is_empty() {
            Some(EMPTY_POLICY)
        } else {
            self.actual.ids_of(policy).find(|id| *id != EMPTY_POLICY)
        }
    }

    /// Policy ids: keep the id of content the kernel already has; new content gets a new id,
    /// whose trie entries are written (step 4). `"egress": []` always has the one id
    /// [`EMPTY_POLICY`], without entries.
    pub(super) fn policy_ids(&self, ops: &mut Vec<Op>) -> Result<PolicyIds<'a>, PlanError> {
        let index = &self.actual.index;
        // The ids this plan hands out, lowest free first: a cursor, so that a plan writing P
        // new policies (a cold load) costs O(P).
        let mut free_ids = index.free_ids.iter();
        // Below MAX_POLICIES: an id indexes the datapath's array of policy tries.
        let mut new_id = || free_ids.next().filter(|id| *id < MAX_POLICIES);
        let mut ids = PolicyIds::default();
        for policy in self.touched.iter().filter_map(|p| p.policy.as_deref()) {
            if ids.known(policy) {
                continue;
            }
            let id = match self.existing_id(policy) {
                Some(id) => id,
                None => {
                    let id = new_id().ok_or(PlanError::PolicyIdsExhausted)?;
                    for (prefix, allows) in policy.entries() {
                        ops.push(Op::PutPolicyEntry {
                            policy: id,
                            prefix,
                            allows: allows.to_vec(),
                        });
                    }
                    id
                }
            };
            ids.insert(policy, id);
        }
        Ok(ids)
    }
}
