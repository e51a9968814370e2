//! `wgfence explain`: why a packet from a peer passes or is dropped.

use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{bail, Context as _, Result};
use wgfence::{
    explain::{
        kernel::KernelProbe,
        report::{explain, StateFile},
        source::SourceMap,
        Probe,
    },
    state::{self, DesiredState},
};
use wgfence_common::{PROTO_ICMP, PROTO_TCP, PROTO_UDP};

use super::{print_json, read_state, state_path, StateArgs, Target};

#[derive(Debug, clap::Args)]
pub struct Explain {
    #[command(flatten)]
    pub target: Target,
    #[command(flatten)]
    request: Request,
    /// State file to compare with and name rules by (default: the running agent's).
    #[arg(long, short)]
    state: Option<PathBuf>,
    #[command(flatten)]
    read: StateArgs,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

/// What `explain` is asked about: one packet.
#[derive(Debug, clap::Args)]
struct Request {
    /// The sending peer, by name (its address of the destination's family).
    #[arg(long, required_unless_present = "from", conflicts_with = "from")]
    peer: Option<String>,
    /// The sending address (any: an unknown source is dropped).
    #[arg(long)]
    from: Option<IpAddr>,
    /// The destination address.
    #[arg(long)]
    to: IpAddr,
    /// tcp, udp, icmp (ICMPv6 toward an IPv6 destination) or an IP protocol number.
    #[arg(long, default_value = "tcp")]
    proto: String,
    /// Destination port (tcp and udp; required for them).
    #[arg(long)]
    port: Option<u16>,
    /// Source port (tcp and udp), e.g. to ask whether a reply on a flow passes.
    #[arg(long, value_name = "PORT")]
    from_port: Option<u16>,
    /// ICMP type (default: echo request).
    #[arg(long, value_name = "TYPE")]
    icmp_type: Option<u8>,
    /// ICMP echo identifier (to ask whether an echo reply answers a flow).
    #[arg(long, value_name = "ID")]
    icmp_id: Option<u16>,
    /// A non-first fragment of the packet (no transport header).
    #[arg(long)]
    fragment: bool,
}

impl Explain {
    pub fn execute(self) -> Result<ExitCode> {
        let Target { interface, bpffs } = &self.target;
        let path = state_path(interface, self.state.as_deref());
        let text = path
            .as_deref()
            .map(|p| read_state(p, self.read))
            .transpose()?;
        let desired = match (&path, &text) {
            (Some(path), Some(text)) => Some(parse_unchecked(path, text)?),
            _ => None,
        };
        let probe = self.request.probe(desired.as_ref())?;
        let mut kernel = KernelProbe::open(bpffs, interface)
            .with_context(|| format!("loading the datapath against the pins of {interface}"))?;
        let file = match (&path, &desired, &text) {
            (Some(path), Some(desired), Some(text)) => Some(StateFile {
                path: path.display().to_string(),
                state: desired,
                sources: SourceMap::new(text, desired),
            }),
            _ => None,
        };
        let report = explain(&mut kernel, file.as_ref(), &probe)?;
        if self.json {
            print_json(&report)?;
        } else {
            print!("{report}");
        }
        Ok(ExitCode::SUCCESS)
    }
}

/// The state file, unchecked: a state whose policy tests fail is exactly one to ask why of.
fn parse_unchecked(path: &Path, text: &str) -> Result<DesiredState> {
    state::parse_unchecked(text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

impl Request {
    /// The packet asked about; `desired` finds `--peer`'s address.
    fn probe(&self, desired: Option<&DesiredState>) -> Result<Probe> {
        let src = self.source(desired)?;
        if src.is_ipv4() != self.to.is_ipv4() {
            bail!(
                "--from {src} and --to {} are of different address families",
                self.to
            );
        }
        let protocol = protocol_number(&self.proto)?;
        let has_ports = protocol == PROTO_TCP || protocol == PROTO_UDP;
        let port = match self.port {
            Some(port) => port,
            None if has_ports => bail!("--port is required for --proto {}", self.proto),
            None => 0,
        };
        let mut probe = Probe::new(src, self.to, protocol, port);
        if let Some(p) = self.from_port {
            probe.src_port = p;
        }
        if let Some(t) = self.icmp_type {
            probe.icmp_type = t;
        }
        if let Some(id) = self.icmp_id {
            probe.icmp_id = id;
        }
        probe.later_fragment = self.fragment;
        Ok(probe)
    }

    /// `--from`, else `--peer`'s address of the destination's family.
    fn source(&self, desired: Option<&DesiredState>) -> Result<IpAddr> {
        let name = match (&self.peer, self.from) {
            (_, Some(from)) => return Ok(from),
            (Some(name), None) => name,
            (None, None) => bail!("--peer NAME or --from ADDR is required"),
        };
        let Some(desired) = desired else {
            bail!("--peer needs a state file to find {name:?} in (pass --state, or --from ADDR)");
        };
        let Some(peer) = desired.peers.iter().find(|p| p.name == name) else {
            bail!("no peer named {name:?} in the state file");
        };
        let Some(addr) = peer.addrs().find(|a| a.is_ipv4() == self.to.is_ipv4()) else {
            bail!(
                "peer {name:?} has no IPv{} address to send to {} from",
                if self.to.is_ipv4() { 4 } else { 6 },
                self.to
            );
        };
        Ok(addr)
    }
}

/// The protocol number of `--proto`.
fn protocol_number(proto: &str) -> Result<u8> {
    Ok(match proto {
        "tcp" => PROTO_TCP,
        "udp" => PROTO_UDP,
        "icmp" | "icmpv6" => PROTO_ICMP,
        n => n
            .parse()
            .with_context(|| format!("--proto {n:?}: tcp, udp, icmp or a protocol number"))?,
    })
}
