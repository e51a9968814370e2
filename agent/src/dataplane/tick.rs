//! The running kernel's tick rate (`CONFIG_HZ`). The drop-event limiter refills its per-CPU
//! buckets from `jiffies`, which costs a dropped packet no clock read, and is given the length
//! of a jiffy as a load-time constant ([`JIFFY_NS_GLOBAL`]). The agent learns it from the
//! kernel itself: a tiny program (`ebpf/src/tick.rs`) that returns `jiffies` is run twice,
//! [`SAMPLE`] apart, with `BPF_PROG_TEST_RUN`, and the rate is rounded to the nearest rate
//! Linux is built with. That needs nothing the agent does not already have; `/proc/timer_list`
//! needs root and is masked in containers, `/proc/schedstat` is absent without
//! `CONFIG_SCHEDSTATS`, and the kernel's config is not always shipped.

use std::{
    os::fd::AsFd as _,
    sync::OnceLock,
    thread,
    time::{Duration, Instant},
};

use aya::EbpfLoader;

use super::{
    classifier,
    error::{DataplaneError, Result},
    program_err,
    test_run::test_run,
};

/// The tick counter, built from `ebpf/` by `build.rs`.
static TICK_OBJECT: &[u8] = aya::include_bytes_aligned!(env!("WGFENCE_TICK_OBJECT"));
const PROGRAM: &str = "wgfence_tick";

/// The datapath's global that holds the nanoseconds of one jiffy.
pub(crate) const JIFFY_NS_GLOBAL: &str = "WGFENCE_JIFFY_NS";

/// The tick rates of the kernel's `kernel/Kconfig.hz`.
const KNOWN_HZ: [u32; 4] = [100, 250, 300, 1000];
/// The rate assumed when it cannot be measured: the fastest, so that a jiffy is never taken
/// for longer than it is and the limiter grants at most the configured event rate.
pub const FALLBACK_HZ: u32 = 1000;
/// How far apart the two readings are: 25 ticks at 250 Hz, 30 at 300 Hz, so one tick of
/// jitter cannot make one rate look like another.
const SAMPLE: Duration = Duration::from_millis(100);
/// How far a measured rate may be from the nearest known one.
const TOLERANCE: f64 = 0.15;
/// What `BPF_PROG_TEST_RUN` takes as a tc program's input, at the least.
const FRAME: [u8; 14] = [0; 14];

/// Nanoseconds in one jiffy of the running kernel, measured once per process (the first call
/// takes [`SAMPLE`]); [`FALLBACK_HZ`]'s, with a warning, when the measurement fails. A
/// reference that lives as long as the process, as aya's loader wants a global's value.
pub(crate) fn jiffy_ns() -> &'static u64 {
    static JIFFY_NS: OnceLock<u64> = OnceLock::new();
    JIFFY_NS.get_or_init(|| {
        let hz = measure_hz().unwrap_or_else(|err| {
            tracing::warn!(
                error = %err,
                "cannot measure the kernel's tick rate; the drop-event limiter assumes \
                 {FALLBACK_HZ} Hz, which grants at most the configured event rate"
            );
            FALLBACK_HZ
        });
        1_000_000_000 / u64::from(hz)
    })
}

/// Measures the running kernel's tick rate (needs CAP_BPF).
pub fn measure_hz() -> Result<u32> {
    let mut ebpf = EbpfLoader::new().load(TICK_OBJECT)?;
    let program = classifier(&mut ebpf, PROGRAM)?;
    program.load().map_err(program_err(PROGRAM))?;
    let fd = program.fd().map_err(program_err(PROGRAM))?;
    // The low 32 bits of `jiffies`, as the run's return value.
    let jiffies = || test_run(fd.as_fd(), &FRAME, 1, None).map(|run| run.retval as u32);
    let (start, first) = (Instant::now(), jiffies()?);
    thread::sleep(SAMPLE);
    let (second, end) = (jiffies()?, Instant::now());
    nearest(second.wrapping_sub(first), end - start)
}

/// The known tick rate `ticks` in `elapsed` stands for, if it is close enough to one.
fn nearest(ticks: u32, elapsed: Duration) -> Result<u32> {
    let measured = f64::from(ticks) / elapsed.as_secs_f64().max(f64::MIN_POSITIVE);
    let distance = |hz: u32| (measured / f64::from(hz) - 1.0).abs();
    KNOWN_HZ
        .into_iter()
        .min_by(|a, b| distance(*a).total_cmp(&distance(*b)))
        .filter(|hz| distance(*hz) <= TOLERANCE)
        .ok_or(DataplaneError::TickRate { ticks, elapsed })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readings_round_to_the_nearest_known_rate() {
        let ms = Duration::from_millis;
        assert_eq!(nearest(25, ms(100)).ok(), Some(250));
        assert_eq!(nearest(26, ms(104)).ok(), Some(250));
        assert_eq!(nearest(30, ms(101)).ok(), Some(300));
        assert_eq!(nearest(10, ms(100)).ok(), Some(100));
        assert_eq!(nearest(101, ms(100)).ok(), Some(1000));
        // A late wake-up is measured, not assumed.
        assert_eq!(nearest(50, ms(200)).ok(), Some(250));
    }

    #[test]
    fn a_reading_far_from_every_rate_is_an_error() {
        let ms = Duration::from_millis;
        assert!(nearest(60, ms(100)).is_err());
        assert!(nearest(0, ms(100)).is_err());
        // jiffies stood still: no rate at all.
        assert!(nearest(0, Duration::ZERO).is_err());
    }
}
