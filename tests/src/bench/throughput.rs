//! Throughput through a veth pair: 64-byte UDP from the first and the last peer of 10k, with
//! wgfence, with the iptables baseline and with no filter.

use std::net::IpAddr;

use serde_json::json;
use wgfence::{
    dataplane::{AttachOptions, Dataplane},
    plan::{plan, Actual, Op},
    testing::apply_map_op,
};

use super::{
    baseline::{self, Backend},
    gen::{self},
    parse_value, progress,
    report::{f, verdict, Report},
    sandbox::Veth,
    Config,
};

pub fn run(report: &mut Report, config: &Config) {
    let n = 10_000;
    let secs = 3;
    // Rounds; the median is reported.
    let runs = if config.quick { 1 } else { 5 };
    progress("throughput");
    // The first and last peers may reach the iperf3 server; a few more rules make their
    // lookup realistic.
    let mut state = gen::state(n, 4);
    let allow = json!([
        { "cidr": "198.19.0.0/24", "protocol": "udp", "ports": [5201] },
        { "cidr": "198.19.0.0/24", "protocol": "tcp", "ports": [5201] },
        { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] },
        { "cidr": "0.0.0.0/0", "protocol": "icmp" },
    ]);
    for i in [0, n - 1] {
        state["peers"][i]["egress"] = allow.clone();
    }
    let (_, desired) = parse_value(&state);
    let first = IpAddr::V4(gen::peer_v4(0));
    let last = IpAddr::V4(gen::peer_v4(n - 1));
    let veth = Veth::new(&[first, last]);
    let med = |x: &[f64]| {
        let mut x = x.to_vec();
        x.sort_by(f64::total_cmp);
        x.get(x.len() / 2).copied().unwrap_or(f64::NAN)
    };
    // [no filter, wgfence, iptables] x [first, last]: every round measures each filter in
    // turn, so drift on this shared machine hits all three alike.
    let mut samples = [
        [Vec::new(), Vec::new()],
        [Vec::new(), Vec::new()],
        [Vec::new(), Vec::new()],
    ];
    let mut sample = |i: usize| {
        samples[i][0].push(veth.udp_pps(first, secs));
        samples[i][1].push(veth.udp_pps(last, secs));
    };
    let options = AttachOptions::new("vd");
    let ruleset = baseline::render(&desired, "vd");
    for _ in 0..runs {
        sample(0);
        let mut dp = veth.dst.enter(|| Dataplane::attach(&options)).unwrap();
        for op in plan(&desired, &Actual::default())
            .unwrap()
            .ops
            .iter()
            .filter(|op| !matches!(op, Op::WgPeer(_) | Op::RemoveWgPeer { .. }))
        {
            apply_map_op(dp.maps_mut(), op).unwrap();
        }
        sample(1);
        drop(dp);
        let _ = Dataplane::detach(
            std::path::Path::new(wgfence::dataplane::DEFAULT_BPFFS),
            "vd",
        );
        baseline::restore(&veth.dst, Backend::Nft, &ruleset);
        sample(2);
        baseline::flush(&veth.dst, Backend::Nft);
    }
    let mut rows = Vec::new();
    let mut record = Vec::new();
    let mut medians = Vec::new();
    for (mode, s) in ["no filter", "wgfence", "iptables-nft chain"]
        .iter()
        .zip(&samples)
    {
        let (a, b) = (med(&s[0]), med(&s[1]));
        rows.push(vec![(*mode).to_owned(), f(a / 1e3, 1), f(b / 1e3, 1)]);
        record.push(json!({ "mode": mode, "first_pps": s[0], "last_pps": s[1] }));
        medians.push((a, b));
    }
    let (none, wgfence, ipt) = (medians[0], medians[1], medians[2]);
    let unfiltered = samples[0].iter().flatten().copied();
    let spread = unfiltered.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    drop(veth);

    report.section(
        "Throughput through a veth pair",
        &format!(
            "64-byte UDP (`iperf3 -u -l 64 -b 0`, {secs} s) from the first and the last of {n} \
             peers (both restricted, allowed by their policy) across a veth pair between two \
             namespaces; received kpps, the median of {runs} rounds, each measuring the three \
             in turn. wgfence's programs (the Ethernet variant) are attached with tcx to the \
             receiving veth; the baseline's chain is hooked at INPUT. Command: `{}`.",
            config.command
        ),
    );
    report.table(&["filter", "first peer (kpps)", "last peer (kpps)"], &rows);
    let ratio = |x: (f64, f64)| (x.0 / none.0, x.1 / none.1);
    let w = ratio(wgfence);
    let i = ratio(ipt);
    report.paragraph(&format!(
        "wgfence / no filter: first {:.0}%, last {:.0}% — goal ≥ 95% for both: {}. \
         iptables chain / no filter: first {:.0}%, last {:.0}% (last / first {:.0}%). wgfence \
         costs the same for the first and the last peer (one hash lookup). The unfiltered \
         path itself ranged from {:.1} to {:.1} kpps over the runs: differences inside that \
         spread are the machine's noise, not the filter's cost.",
        w.0 * 100.0,
        w.1 * 100.0,
        verdict(w.0 >= 0.95 && w.1 >= 0.95),
        i.0 * 100.0,
        i.1 * 100.0,
        ipt.1 / ipt.0 * 100.0,
        spread.0 / 1e3,
        spread.1 / 1e3,
    ));
    report.record("throughput", json!(record));
}
