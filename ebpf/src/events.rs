//! Drop events for `wgfence monitor`: a per-CPU token bucket decides, then the event goes to
//! the ring buffer.
//!
//! The bucket is refilled from `jiffies` ([`bpf_jiffies64`], which the verifier turns into one
//! load of a kernel variable on 64-bit JITs): no clock is read for a packet the bucket refuses.
//! Credit is counted in nanoseconds, as the agent's [`Config`] gives it, at
//! [`WGFENCE_JIFFY_NS`] nanoseconds per elapsed jiffy, so no division runs here; a refused
//! packet within the same jiffy writes nothing at all, and the bucket is this CPU's own, so
//! nothing is shared between CPUs. Only an admitted event reads the monotonic clock, for its
//! timestamp. With nobody reading, the ring fills and each admitted event costs one failed
//! write: a flood of dropped packets costs at most the configured event rate.

use aya_ebpf::{helpers::bpf_jiffies64, programs::TcContext};
use wgfence_common::{Config, Counter, DropEvent, EventBucket};

use crate::{config, count, now_ns, v4, v6, EVENTS, EVENT_BUCKET, HEAD_LEN};

/// Nanoseconds in one jiffy of the running kernel (10^9 / `CONFIG_HZ`). A load-time constant:
/// the agent measures the kernel's tick rate and sets it when it loads the object. The
/// default is that of the fastest common tick (1000 Hz), so an object loaded without it
/// grants at most the configured event rate.
#[unsafe(no_mangle)]
static WGFENCE_JIFFY_NS: u64 = 1_000_000;

/// The most jiffies of credit one refill counts: far more than any burst needs, and small
/// enough that the product with [`WGFENCE_JIFFY_NS`] cannot overflow.
const MAX_ELAPSED_JIFFIES: u64 = 1 << 24;

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
    if !admit(config) {
        count(Counter::EventRateLimited);
        return;
    }
    let mut event = DropEvent {
        timestamp_ns: now_ns(),
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
fn admit(config: &Config) -> bool {
    let Some(bucket) = EVENT_BUCKET.get_ptr_mut(0) else {
        return false;
    };
    // SAFETY: a helper without arguments or side effects.
    let now = unsafe { bpf_jiffies64() };
    // SAFETY: a per-CPU array element; tc programs run with migration disabled, so only this
    // CPU touches it. The read of the global is volatile so that the loader's value is used,
    // not the default the compiler sees.
    unsafe {
        let EventBucket {
            credit_ns,
            last_jiffies,
        } = *bucket;
        let credit = if now == last_jiffies {
            // Within the jiffy of the last refill: nothing to add.
            credit_ns
        } else {
            let elapsed = now.wrapping_sub(last_jiffies).min(MAX_ELAPSED_JIFFIES);
            let jiffy_ns = core::ptr::read_volatile(&WGFENCE_JIFFY_NS);
            (*bucket).last_jiffies = now;
            credit_ns
                .saturating_add(elapsed * jiffy_ns)
                .min(config.event_burst_ns)
        };
        if credit >= config.event_interval_ns {
            (*bucket).credit_ns = credit - config.event_interval_ns;
            true
        } else {
            if credit != credit_ns {
                (*bucket).credit_ns = credit;
            }
            false
        }
    }
}
