//! The legacy TC hook, for kernels without tcx (before 6.6): the datapath's programs run as
//! direct-action `cls_bpf` filters on a `clsact` qdisc.
//!
//! Which filters are the agent's: exactly one per direction, at priority [`TC_PRIORITY`] and
//! handle [`TC_HANDLE`] (fixed, so every agent version finds them again without any record),
//! of kind `bpf`, running a program named like the datapath's. Priority 1 is the lowest number
//! there is, so the agent's filter runs before any other: a filter before it could pass what it
//! must drop. Anything else on the qdisc is foreign and never touched; a foreign filter at the
//! agent's priority and handle is an error, and the agent changes nothing.
//!
//! A restart replaces the program of the existing filter in place (`RTM_NEWTFILTER` for the
//! same priority and handle without `NLM_F_CREATE`: `cls_bpf` swaps the program under RCU, so
//! every packet meets the old or the new one). aya sends that message when
//! `SchedClassifier::attach_to_link` gets a netlink link; a first attach sends it with
//! `NLM_F_CREATE | NLM_F_EXCL`, which never replaces anything.
//!
//! The qdisc: the agent adds `clsact` when the interface has none, and marks that in its pin
//! directory (an empty directory named [`QDISC_MARKER`]). `detach` removes the qdisc only if that
//! mark is there and no filter is left on it, so an administrator's qdisc, or one that holds
//! foreign filters, stays.
//!
//! The netlink dump and the qdisc removal are a few messages of the stable rtnetlink UAPI
//! (include/uapi/linux/{rtnetlink,pkt_sched,pkt_cls}.h); aya keeps its own helpers private.

use std::{
    io,
    mem::size_of,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
};

use aya::programs::{
    tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    Link as _, SchedClassifier, TcAttachType,
};

use super::{program_err, DataplaneError, Result};

/// The priority of the agent's filters: the first there is.
pub const TC_PRIORITY: u16 = 1;
/// The handle of the agent's filters (`0x7767` is "wg").
pub const TC_HANDLE: u32 = 0x7767_0001;
/// An empty directory in the pin directory: the agent added the clsact qdisc.
pub const QDISC_MARKER: &str = "clsact_added";
/// An empty directory in the pin directory: the programs run on the tc hook (for `detach`,
/// which must then find the interface to delete the filters).
pub const HOOK_MARKER: &str = "hook_tc";
/// The marks the pin directory may hold besides pins.
pub const MARKERS: [&str; 2] = [QDISC_MARKER, HOOK_MARKER];

const RTM_DELQDISC: u16 = 37;
const RTM_GETTFILTER: u16 = 46;
const RTM_NEWTFILTER: u16 = 44;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const TC_H_CLSACT: u32 = 0xFFFF_FFF1;
const TC_H_INGRESS_PARENT: u32 = 0xFFFF_FFF2;
const TC_H_EGRESS_PARENT: u32 = 0xFFFF_FFF3;
const CLSACT_HANDLE: u32 = 0xFFFF_0000;
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_NAME: u16 = 7;
const TCA_BPF_FLAGS: u16 = 8;
const TCA_BPF_ID: u16 = 11;
const TCA_BPF_FLAG_ACT_DIRECT: u32 = 1;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// One filter on a clsact hook, as the kernel lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub priority: u16,
    pub handle: u32,
    pub kind: String,
    /// For `bpf` filters: the program's name and id, and whether it is direct-action.
    pub bpf_name: Option<String>,
    pub bpf_id: Option<u32>,
    pub direct_action: bool,
}

impl Filter {
    fn at_our_place(&self) -> bool {
        self.priority == TC_PRIORITY && self.handle == TC_HANDLE
    }

    /// Whether this is the agent's filter for `program`.
    fn is_ours(&self, program: &str) -> bool {
        self.at_our_place()
            && self.kind == "bpf"
            && self.direct_action
            && self.bpf_name.as_deref() == Some(program)
    }
}

/// What sits at the agent's place on one hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    Empty,
    /// The agent's filter, running this program id.
    Ours {
        program_id: Option<u32>,
    },
    /// Something else: never touched.
    Foreign(Filter),
}

fn parent(attach_type: TcAttachType) -> u32 {
    match attach_type {
        TcAttachType::Egress => TC_H_EGRESS_PARENT,
        _ => TC_H_INGRESS_PARENT,
    }
}

fn direction(attach_type: TcAttachType) -> &'static str {
    match attach_type {
        TcAttachType::Egress => "egress",
        _ => "ingress",
    }
}

/// Every filter on the interface's clsact hook, in the kernel's order; empty without a clsact
/// qdisc. Needs CAP_NET_ADMIN only to change filters, not to list them.
pub fn filters(ifindex: u32, attach_type: TcAttachType) -> io::Result<Vec<Filter>> {
    let socket = Socket::open()?;
    let msg = tcmsg(ifindex, 0, parent(attach_type), 0);
    let replies = match socket.request(
        RTM_GETTFILTER,
        (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16,
        &msg,
    ) {
        Ok(replies) => replies,
        // No clsact qdisc: no block to list.
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(replies
        .iter()
        .filter(|(kind, _)| *kind == RTM_NEWTFILTER)
        .filter_map(|(_, body)| parse_filter(body))
        .collect())
}

/// What sits at the agent's place on the hook, for `program`.
pub fn place(ifindex: u32, attach_type: TcAttachType, program: &str) -> io::Result<Place> {
    Ok(filters(ifindex, attach_type)?
        .into_iter()
        .find(Filter::at_our_place)
        .map_or(Place::Empty, |f| {
            if f.is_ours(program) {
                Place::Ours {
                    program_id: f.bpf_id,
                }
            } else {
                Place::Foreign(f)
            }
        }))
}

/// Adds the clsact qdisc if the interface has none: whether this call added it.
pub fn ensure_clsact(interface: &str) -> Result<bool> {
    match aya::programs::tc::qdisc_add_clsact(interface) {
        Ok(()) => Ok(true),
        Err(aya::programs::tc::TcError::NetlinkError(e))
            if e.raw_os_error() == Some(libc::EEXIST) =>
        {
            Ok(false)
        }
        Err(e) => Err(DataplaneError::Qdisc {
            interface: interface.to_owned(),
            source: io::Error::other(e),
        }),
    }
}

/// Puts the loaded program at the agent's place on the hook: replaces the program of the
/// agent's filter in place if there is one, else adds the filter (never replacing anything).
/// Whether a filter of the agent's was there. A foreign filter at the place is an error.
pub fn attach_or_replace(
    program: &mut SchedClassifier,
    name: &'static str,
    interface: &str,
    ifindex: u32,
    attach_type: TcAttachType,
) -> Result<bool> {
    let found = place(ifindex, attach_type, name).map_err(|source| DataplaneError::Qdisc {
        interface: interface.to_owned(),
        source,
    })?;
    let existed = match found {
        Place::Foreign(filter) => {
            return Err(DataplaneError::ForeignFilter {
                interface: interface.to_owned(),
                direction: direction(attach_type),
                priority: TC_PRIORITY,
                handle: TC_HANDLE,
                found: format!("{filter:?}"),
            })
        }
        Place::Ours { .. } => {
            let link =
                our_link(interface, attach_type).map_err(|source| DataplaneError::Interface {
                    interface: interface.to_owned(),
                    source,
                })?;
            let id = program.attach_to_link(link).map_err(program_err(name))?;
            keep(program.take_link(id).map_err(program_err(name))?);
            true
        }
        Place::Empty => {
            let id = program
                .attach_with_options(
                    interface,
                    attach_type,
                    TcAttachOptions::Netlink(NlOptions {
                        priority: TC_PRIORITY,
                        handle: TcHandle::from(TC_HANDLE),
                        classid: None,
                    }),
                )
                .map_err(program_err(name))?;
            keep(program.take_link(id).map_err(program_err(name))?);
            false
        }
    };
    Ok(existed)
}

/// The agent's filter on the hook, as aya addresses it (no kernel call).
fn our_link(interface: &str, attach_type: TcAttachType) -> io::Result<SchedClassifierLink> {
    SchedClassifierLink::attached(
        interface,
        attach_type,
        TC_PRIORITY,
        TcHandle::from(TC_HANDLE),
        None,
    )
}

/// A netlink "link" is only the filter's address; dropping it would delete the filter. The
/// filter outlives the agent, like a pinned tcx link.
fn keep(link: SchedClassifierLink) {
    std::mem::forget(link);
}

/// Deletes the agent's filter for `program` from the hook, if it is there and the agent's.
/// Whether one was deleted.
pub fn remove_ours(
    interface: &str,
    ifindex: u32,
    attach_type: TcAttachType,
    program: &str,
) -> Result<bool> {
    let err = |source| DataplaneError::Qdisc {
        interface: interface.to_owned(),
        source,
    };
    if !matches!(
        place(ifindex, attach_type, program).map_err(err)?,
        Place::Ours { .. }
    ) {
        return Ok(false);
    }
    let link = our_link(interface, attach_type).map_err(err)?;
    match link.detach() {
        Ok(()) => Ok(true),
        Err(aya::programs::ProgramError::NetlinkError(e))
            if e.raw_os_error() == Some(libc::ENOENT) =>
        {
            Ok(false)
        }
        Err(e) => Err(err(io::Error::other(crate::error_chain(&e)))),
    }
}

/// Deletes the clsact qdisc if no filter is left on either of its hooks. Whether it did.
pub fn remove_clsact_if_empty(interface: &str, ifindex: u32) -> Result<bool> {
    let err = |source| DataplaneError::Qdisc {
        interface: interface.to_owned(),
        source,
    };
    for attach_type in [TcAttachType::Ingress, TcAttachType::Egress] {
        if !filters(ifindex, attach_type).map_err(err)?.is_empty() {
            return Ok(false);
        }
    }
    let socket = Socket::open().map_err(err)?;
    let mut msg = tcmsg(ifindex, CLSACT_HANDLE, TC_H_CLSACT, 0);
    push_attr(&mut msg, TCA_KIND, b"clsact\0");
    match socket.request(
        RTM_DELQDISC,
        (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16,
        &msg,
    ) {
        Ok(_) => Ok(true),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EINVAL)) => Ok(false),
        Err(e) => Err(err(e)),
    }
}

/// `struct tcmsg`: family, padding, ifindex, handle, parent, info.
fn tcmsg(ifindex: u32, handle: u32, parent: u32, info: u32) -> Vec<u8> {
    let mut msg = vec![0u8; 4];
    msg.extend_from_slice(&ifindex.to_ne_bytes());
    msg.extend_from_slice(&handle.to_ne_bytes());
    msg.extend_from_slice(&parent.to_ne_bytes());
    msg.extend_from_slice(&info.to_ne_bytes());
    msg
}

fn push_attr(msg: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    msg.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(payload);
    msg.resize(align4(msg.len()), 0);
}

const fn align4(n: usize) -> usize {
    (n + 3) & !3
}

fn read_u16(buf: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(buf.get(at..at + 2)?.try_into().ok()?))
}

fn read_u32(buf: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(buf.get(at..at + 4)?.try_into().ok()?))
}

/// The attributes in `buf`: (type, payload).
fn attrs(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while let (Some(len), Some(kind)) = (read_u16(buf, 0), read_u16(buf, 2)) {
        let len = usize::from(len);
        if len < 4 || len > buf.len() {
            break;
        }
        if let Some(payload) = buf.get(4..len) {
            out.push((kind & NLA_TYPE_MASK, payload));
        }
        buf = buf.get(align4(len).min(buf.len())..).unwrap_or_default();
    }
    out
}

fn c_string(payload: &[u8]) -> String {
    let end = payload
        .iter()
        .position(|b| *b == 0)
        .unwrap_or(payload.len());
    String::from_utf8_lossy(payload.get(..end).unwrap_or_default()).into_owned()
}

/// A `RTM_NEWTFILTER` body: a tcmsg and its attributes. `None` for a chain's head (handle 0).
fn parse_filter(body: &[u8]) -> Option<Filter> {
    let handle = read_u32(body, 8)?;
    let info = read_u32(body, 16)?;
    if handle == 0 {
        return None;
    }
    let mut filter = Filter {
        priority: (info >> 16) as u16,
        handle,
        kind: String::new(),
        bpf_name: None,
        bpf_id: None,
        direct_action: false,
    };
    for (kind, payload) in attrs(body.get(20..)?) {
        match kind {
            TCA_KIND => filter.kind = c_string(payload),
            TCA_OPTIONS => {
                for (opt, value) in attrs(payload) {
                    match opt {
                        TCA_BPF_NAME => filter.bpf_name = Some(c_string(value)),
                        TCA_BPF_ID => filter.bpf_id = read_u32(value, 0),
                        TCA_BPF_FLAGS => {
                            filter.direct_action =
                                read_u32(value, 0).is_some_and(|f| f & TCA_BPF_FLAG_ACT_DIRECT != 0)
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some(filter)
}

/// A NETLINK_ROUTE socket of the calling thread's network namespace.
struct Socket {
    fd: OwnedFd,
}

impl Socket {
    fn open() -> io::Result<Self> {
        // SAFETY: plain socket(2); the descriptor is owned below.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                libc::NETLINK_ROUTE,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd was just created and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let one: libc::c_int = 1;
        // SAFETY: setsockopt reads one c_int. Extended acks are a nicety: failures ignored.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_NETLINK,
                libc::NETLINK_EXT_ACK,
                (&one as *const libc::c_int).cast(),
                size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        Ok(Self { fd })
    }

    /// Sends one request and collects the replies (type, body) until its ack or the end of
    /// the dump; a netlink error is returned as the errno it carries.
    fn request(&self, kind: u16, flags: u16, body: &[u8]) -> io::Result<Vec<(u16, Vec<u8>)>> {
        let len = 16 + body.len();
        let mut msg = Vec::with_capacity(len);
        msg.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&flags.to_ne_bytes());
        msg.extend_from_slice(&1u32.to_ne_bytes()); // seq
        msg.extend_from_slice(&0u32.to_ne_bytes()); // pid: the kernel
        msg.extend_from_slice(body);
        // SAFETY: send(2) reads `msg.len()` bytes of `msg`.
        let sent = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let dump = flags & (libc::NLM_F_DUMP as u16) != 0;
        let mut out = Vec::new();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: recv(2) writes at most `buf.len()` bytes into `buf`.
            let n =
                unsafe { libc::recv(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut rest = buf.get(..n as usize).unwrap_or_default();
            while let (Some(len), Some(kind)) = (read_u32(rest, 0), read_u16(rest, 4)) {
                let len = len as usize;
                if len < 16 || len > rest.len() {
                    break;
                }
                let payload = rest.get(16..len).unwrap_or_default();
                match kind {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let errno = read_u32(payload, 0).map_or(0, |e| e as i32);
                        if errno != 0 {
                            return Err(io::Error::from_raw_os_error(-errno));
                        }
                        if !dump {
                            return Ok(out);
                        }
                    }
                    _ => out.push((kind, payload.to_vec())),
                }
                rest = rest.get(align4(len).min(rest.len())..).unwrap_or_default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filter_dump_message_parses_to_its_place_kind_and_program() {
        let mut body = tcmsg(7, TC_HANDLE, TC_H_INGRESS_PARENT, (1 << 16) | 0x0300);
        push_attr(&mut body, TCA_KIND, b"bpf\0");
        let mut opts = Vec::new();
        push_attr(&mut opts, TCA_BPF_NAME, b"wgfence_ingress\0");
        push_attr(&mut opts, TCA_BPF_ID, &42u32.to_ne_bytes());
        push_attr(&mut opts, TCA_BPF_FLAGS, &1u32.to_ne_bytes());
        push_attr(&mut body, TCA_OPTIONS | 0x8000, &opts);
        let filter = parse_filter(&body).expect("not parsed");
        assert_eq!(filter.priority, TC_PRIORITY);
        assert_eq!(filter.handle, TC_HANDLE);
        assert_eq!(filter.kind, "bpf");
        assert_eq!(filter.bpf_id, Some(42));
        assert!(filter.is_ours("wgfence_ingress"));
        assert!(!filter.is_ours("wgfence_egress"));
        // A chain head (handle 0) is not a filter.
        assert_eq!(
            parse_filter(&tcmsg(7, 0, TC_H_INGRESS_PARENT, 1 << 16)),
            None
        );
    }
}
