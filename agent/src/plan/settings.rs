//! The datapath's settings entry in a plan ([`plan_settings`]): the replies switch, the flow
//! timeouts and quota, written right after the lead ([`Plan::with_settings`]), with the
//! forgetting of every flow when replies are switched off.

use wgfence_common::Config;

use super::op::{Op, Plan};

impl Plan {
    /// Puts `ops` (the settings: [`plan_settings`]) right after the lead: a revocation waits
    /// for no settings write and no flow work.
    pub fn with_settings(mut self, ops: Vec<Op>) -> Self {
        let at = self.lead().len();
        self.ops.splice(at..at, ops);
        self
    }
}

/// The settings entry: written when `want` differs from the kernel's entry `have` (but for the
/// owner high-water mark, which is the planner's and stays the kernel's). Switching replies
/// off forgets every recorded flow.
pub fn plan_settings(want: &Config, have: Option<&Config>) -> Vec<Op> {
    let want = Config {
        owner_high: have.map_or(0, |c| c.owner_high),
        ..*want
    };
    if have == Some(&want) {
        return Vec::new();
    }
    let replies_before = have.map(Config::replies);
    let mut ops = vec![Op::PutSettings {
        config: want,
        replies_before,
    }];
    if replies_before == Some(true) && !want.replies() {
        ops.push(Op::ForgetAllFlows);
    }
    ops
}
