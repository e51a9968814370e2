//! The clock of peer windows. The datapath compares `bpf_ktime_get_boot_ns` (CLOCK_BOOTTIME:
//! monotonic, counts suspend, not moved by setting the wall clock) with each windowed peer's
//! bounds; the state file gives them in wall-clock time. The agent converts with one offset,
//! wall clock minus boot clock, sampled once per process and rounded to the millisecond, so
//! an unchanged state plans the same entries at every reconcile, a bound is right to a
//! millisecond, and setting the wall clock while the agent runs moves no bound the kernel
//! holds.

use std::sync::OnceLock;

/// Wall clock minus boot clock, in nanoseconds rounded to the millisecond, as first sampled
/// by this process.
pub fn wall_minus_boot_ns() -> i128 {
    static OFFSET: OnceLock<i128> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let boot = now_ns(libc::CLOCK_BOOTTIME);
        let wall = now_ns(libc::CLOCK_REALTIME);
        let diff = i128::from(wall) - i128::from(boot);
        diff.div_euclid(1_000_000) * 1_000_000
    })
}

/// A clock's time in nanoseconds.
pub fn now_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes into the timespec it is given.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    u64::try_from(ts.tv_sec)
        .unwrap_or_default()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or_default())
}

/// A wall-clock time (seconds since the epoch) on the boot clock, in nanoseconds, given the
/// offset `wall - boot` in nanoseconds; times before boot are 0.
pub fn to_boot_ns(wall_secs: u64, wall_minus_boot_ns: i128) -> u64 {
    let boot = i128::from(wall_secs) * 1_000_000_000 - wall_minus_boot_ns;
    u64::try_from(boot.max(0)).unwrap_or(u64::MAX)
}

/// The inverse of [`to_boot_ns`], rounded down to the second.
pub fn to_wall_secs(boot_ns: u64, wall_minus_boot_ns: i128) -> i128 {
    (i128::from(boot_ns) + wall_minus_boot_ns).div_euclid(1_000_000_000)
}

/// Seconds since the Unix epoch (the wall clock), as peer windows are given.
pub fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wall_times_map_onto_the_boot_clock_and_back() {
        let offset = 1_700_000_000_000_000_000;
        assert_eq!(to_boot_ns(1_700_000_005, offset), 5_000_000_000);
        assert_eq!(to_boot_ns(1_600_000_000, offset), 0);
        assert_eq!(to_wall_secs(5_000_000_000, offset), 1_700_000_005);
        assert_eq!(wall_minus_boot_ns(), wall_minus_boot_ns());
        let now_wall = now_ns(libc::CLOCK_REALTIME);
        let now_boot = now_ns(libc::CLOCK_BOOTTIME);
        let converted = to_boot_ns(now_wall / 1_000_000_000, wall_minus_boot_ns());
        let expected = now_boot - now_wall % 1_000_000_000;
        assert!(
            converted.abs_diff(expected) < 5_000_000,
            "{converted} vs {expected}"
        );
    }
}
