//! The benchmark harness behind `cargo xtask bench`: generated states, the iptables baseline
//! and the report. Timings are measured side by side in one run and reported as ratios; the
//! machines are shared and noisy, so no figure here is a test assertion.

pub mod baseline;
pub mod floor;
pub mod gen;
pub mod replies;
pub mod report;

use std::time::Duration;

/// The `q`-quantile (0..=1) of `samples`, nearest rank.
pub fn quantile(samples: &[Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

pub fn median(samples: &[Duration]) -> Duration {
    quantile(samples, 0.5)
}

/// Milliseconds, for reports.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Microseconds, for reports.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_the_nearest_rank() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(median(&s), Duration::from_millis(50));
        assert_eq!(quantile(&s, 0.99), Duration::from_millis(99));
        assert_eq!(quantile(&s, 1.0), Duration::from_millis(100));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
