//! Test support that is not an item of its own elsewhere: what the integration tests, the
//! benchmarks and the fuzz targets reach that the agent keeps to itself. Like every other
//! piece of test support ([`crate::plan::invariants`], the canonical state writer, the
//! datapath's test-run loaders), it exists only with the `testing` feature, which the agent
//! binary is built without.

use crate::{
    dataplane::{DataplaneError, Maps},
    plan::Op,
};

/// Applies one map operation of a plan as the reconciler does ([`crate::reconcile`]):
/// WireGuard operations are skipped, flows deleted here and now. For tools that fill maps
/// without a WireGuard device: the benchmarks, the differential test.
pub fn apply_map_op(maps: &mut Maps, op: &Op) -> Result<(), DataplaneError> {
    crate::reconcile::apply_map_op(maps, op)
}
