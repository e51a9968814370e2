//! Drop events for `wgfence monitor`: a per-CPU token bucket (counted in nanoseconds of credit,
//! so no division runs here) decides, then the event goes to the ring buffer. One read of the
//! monotonic clock (`bpf_ktime_get_ns`, which every supported kernel has; the coarse clock
//! helper would save a few ns but needs Linux 5.11) serves the bucket and the event's
//! timestamp. With nobody reading, the ring fills and each admitted event costs one failed
//! write: a flood of dropped packets costs at most the configured event rate.

use aya_ebpf::programs::TcContext;
use wgfence_common::{Config, Counter, DropEvent};

use crate::{config, count, now_ns, v4, v6, EVENTS, EVENT_BUCKET, HEAD_LEN};

/// Reports one dropped packet, if the agent enabled events and the rate limit allows.
#[inline(always)]
pub(crate) fn report(
    ctx: &TcContext,
    l3: usize,
    head: Option<&[u8; HEAD_LEN]>,
    why: Counter,
    slot: u32,
) {
    let Some(config) = config() else {
        return;
    };
    if config.event_interval_ns == 0 {
        return;
    }
    let now = now_ns();
    if !admit(config, now) {
        count(Counter::EventRateLimited);
        return;
    }
    let mut event = DropEvent {
        timestamp_ns: now,
        reason: why as u32,
        slot,
        len: ctx.len(),
        ..DropEvent::default()
    };
    if let Some(head) = head {
        match head[0] >> 4 {
            4 => v4::describe(ctx, l3, head, &mut event),
            6 => v6::describe(ctx, l3, head, &mut event),
            _ => {}
        }
    }
    match EVENTS.output(&event, 0) {
        Ok(()) => count(Counter::EventSent),
        Err(_) => count(Counter::EventRingFull),
    }
}

/// Takes one event's credit from this CPU's bucket, if it has it.
#[inline(always)]
fn admit(config: &Config, now: u64) -> bool {
    let Some(bucket) = EVENT_BUCKET.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: a per-CPU array element; tc programs run with migration disabled, so only this
    // CPU touches it.
    unsafe {
        let elapsed = now.saturating_sub((*bucket).last_ns);
        let credit = (*bucket)
            .credit_ns
            .saturating_add(elapsed)
            .min(config.event_burst_ns);
        (*bucket).last_ns = now;
        if credit >= config.event_interval_ns {
            (*bucket).credit_ns = credit - config.event_interval_ns;
            true
        } else {
            (*bucket).credit_ns = credit;
            false
        }
    }
}
