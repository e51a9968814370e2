//! The datapath's settings, the single entry of `wgf4_config`: whether replies pass (from the
//! state's `"replies"`), the reply flows' idle timeouts, each peer's flow quota and the drop
//! event rate (from the command line). The reconciler writes the entry only when it differs
//! from the kernel's. The entry also keeps the owner high-water mark, which is the planner's.

use std::time::Duration;

use wgfence_common::{Config, CONFIG_REPLIES, DEFAULT_FLOWS_PER_PEER};

/// Settings the agent's command line controls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DatapathSettings {
    /// Idle timeout of an open TCP flow.
    pub tcp_timeout: Duration,
    /// Idle timeout of a TCP flow after a FIN or an RST.
    pub tcp_closing_timeout: Duration,
    pub udp_timeout: Duration,
    /// Idle timeout of ICMP echo flows.
    pub icmp_timeout: Duration,
    /// Idle timeout of a flow the peer has not answered yet, when shorter than its protocol's.
    pub unanswered_timeout: Duration,
    /// Drop events per second, node-wide; 0 switches drop events off.
    pub events_per_second: u32,
    /// Live reply flows one peer may hold (both address families together).
    pub flows_per_peer: u32,
}

impl DatapathSettings {
    /// The timeouts of Cilium's connection tracking (TCP 6 h, closing 10 s, UDP 60 s, a TCP
    /// flow not answered yet 60 s) and of Linux conntrack for ICMP (30 s); 1,000 drop events
    /// per second; 1,024 flows per peer.
    pub const DEFAULT: Self = Self {
        tcp_timeout: Duration::from_secs(6 * 3600),
        tcp_closing_timeout: Duration::from_secs(10),
        udp_timeout: Duration::from_secs(60),
        icmp_timeout: Duration::from_secs(30),
        unanswered_timeout: Duration::from_secs(60),
        events_per_second: 1000,
        flows_per_peer: DEFAULT_FLOWS_PER_PEER,
    };
}

impl Default for DatapathSettings {
    fn default() -> Self {
        Self::DEFAULT
    }
}

const NANOS_PER_SECOND: u64 = 1_000_000_000;

impl DatapathSettings {
    /// The map entry for a state with `replies`, on a machine with `cpus` online CPUs (with an
    /// owner high-water mark of 0: the reconciler keeps the kernel's).
    ///
    /// The rate limiter keeps one bucket per CPU, so each CPU gets an equal share of the rate:
    /// the node never exceeds `events_per_second` (plus one burst), however the flood spreads.
    /// A CPU saves up at most one second of its share.
    pub fn config(&self, replies: bool, cpus: u32) -> Config {
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let (event_interval_ns, event_burst_ns) = match self.events_per_second {
            0 => (0, 0),
            rate => {
                let interval =
                    NANOS_PER_SECOND.saturating_mul(u64::from(cpus.max(1))) / u64::from(rate);
                let interval = interval.max(1);
                (interval, interval.max(NANOS_PER_SECOND))
            }
        };
        Config {
            flags: if replies { CONFIG_REPLIES } else { 0 },
            flows_per_peer: self.flows_per_peer,
            tcp_timeout_ns: nanos(self.tcp_timeout),
            tcp_closing_timeout_ns: nanos(self.tcp_closing_timeout),
            udp_timeout_ns: nanos(self.udp_timeout),
            icmp_timeout_ns: nanos(self.icmp_timeout),
            unanswered_timeout_ns: nanos(self.unanswered_timeout),
            event_interval_ns,
            event_burst_ns,
            owner_high: 0,
        }
    }
}

/// CPUs the rate limiter's per-CPU buckets are spread over.
pub fn online_cpus() -> u32 {
    aya::util::online_cpus()
        .map(|cpus| u32::try_from(cpus.len()).unwrap_or(u32::MAX))
        .unwrap_or(1)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_and_timeouts_reach_the_entry() {
        let s = DatapathSettings::default();
        let on = s.config(true, 2);
        assert!(on.replies());
        assert!(!s.config(false, 2).replies());
        assert_eq!(on.tcp_timeout_ns, 6 * 3600 * NANOS_PER_SECOND);
        assert_eq!(on.tcp_closing_timeout_ns, 10 * NANOS_PER_SECOND);
        assert_eq!(on.udp_timeout_ns, 60 * NANOS_PER_SECOND);
        assert_eq!(on.icmp_timeout_ns, 30 * NANOS_PER_SECOND);
        assert_eq!(on.unanswered_timeout_ns, 60 * NANOS_PER_SECOND);
        assert_eq!(on.flows_per_peer, 1024);
    }

    #[test]
    fn the_event_rate_is_shared_between_cpus() {
        let s = DatapathSettings {
            events_per_second: 100,
            ..DatapathSettings::default()
        };
        // 100/s on 4 CPUs: 25/s each, one every 40 ms, at most one second saved up.
        let c = s.config(true, 4);
        assert_eq!(c.event_interval_ns, 40_000_000);
        assert_eq!(c.event_burst_ns, NANOS_PER_SECOND);
        // Fewer events than CPUs: each CPU may save up one event.
        let c = DatapathSettings {
            events_per_second: 1,
            ..s
        }
        .config(true, 4);
        assert_eq!(c.event_interval_ns, 4 * NANOS_PER_SECOND);
        assert_eq!(c.event_burst_ns, 4 * NANOS_PER_SECOND);
        let off = DatapathSettings {
            events_per_second: 0,
            ..s
        }
        .config(true, 4);
        assert_eq!((off.event_interval_ns, off.event_burst_ns), (0, 0));
    }
}
