//! Crafted frames for `BPF_PROG_TEST_RUN`: an Ethernet header, then IPv4 or IPv6 with options,
//! extension headers and fragments as asked, then a transport header. Checksums are left zero:
//! the datapath does not read them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;

/// An IPv6 extension header to put before the transport header.
#[derive(Debug, Clone, Copy)]
pub enum Ext {
    HopByHop,
    Routing,
    DestinationOptions,
    /// Authentication header (its length counts 4-byte units).
    Authentication,
    /// Fragment header with this fragment offset (in 8-byte units) and more-fragments flag.
    Fragment {
        offset: u16,
        more: bool,
    },
}

impl Ext {
    fn number(self) -> u8 {
        match self {
            Ext::HopByHop => 0,
            Ext::Routing => 43,
            Ext::Fragment { .. } => 44,
            Ext::Authentication => 51,
            Ext::DestinationOptions => 60,
        }
    }
}

/// A packet to build.
#[derive(Debug, Clone)]
pub struct Packet {
    pub src: IpAddr,
    pub dst: IpAddr,
    pub protocol: u8,
    pub dst_port: u16,
    /// IPv4 options, in 4-byte words (IHL = 5 + this).
    pub ipv4_option_words: u8,
    /// IPv4 fragment offset (8-byte units) and more-fragments flag.
    pub ipv4_fragment: Option<(u16, bool)>,
    pub ipv6_ext: Vec<Ext>,
    /// Bytes of transport header to include (None: the whole header).
    pub transport_len: Option<usize>,
    /// TCP/UDP source port.
    pub src_port: u16,
    /// TCP flags (default SYN).
    pub tcp_flags: u8,
    /// ICMP/ICMPv6 type (default echo request) and echo identifier.
    pub icmp: Option<(u8, u16)>,
    /// Bytes after the transport header (an ICMP error's quoted packet).
    pub payload: Vec<u8>,
}

pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

impl Packet {
    pub fn new(src: &str, dst: &str, protocol: u8, dst_port: u16) -> Self {
        Self {
            src: parse(src),
            dst: parse(dst),
            protocol,
            dst_port,
            ipv4_option_words: 0,
            ipv4_fragment: None,
            ipv6_ext: Vec::new(),
            transport_len: None,
            src_port: 40000,
            tcp_flags: TCP_SYN,
            icmp: None,
            payload: Vec::new(),
        }
    }

    /// An ICMP error quoting `packet` (its IP header and the first 8 bytes after it).
    pub fn quoting(mut self, packet: &Packet) -> Self {
        let ip = packet.frame().split_off(14);
        let header_len = match packet.src {
            IpAddr::V4(_) => usize::from(ip[0] & 0x0f) * 4,
            IpAddr::V6(_) => 40,
        };
        self.payload = ip[..(header_len + 8).min(ip.len())].to_vec();
        self
    }

    pub fn src_port(mut self, port: u16) -> Self {
        self.src_port = port;
        self
    }

    pub fn tcp_flags(mut self, flags: u8) -> Self {
        self.tcp_flags = flags;
        self
    }

    /// ICMP (or ICMPv6) message type and echo identifier.
    pub fn icmp(mut self, kind: u8, id: u16) -> Self {
        self.icmp = Some((kind, id));
        self
    }

    pub fn options(mut self, words: u8) -> Self {
        self.ipv4_option_words = words;
        self
    }

    pub fn fragment(mut self, offset: u16, more: bool) -> Self {
        self.ipv4_fragment = Some((offset, more));
        self
    }

    pub fn ext(mut self, ext: Ext) -> Self {
        self.ipv6_ext.push(ext);
        self
    }

    pub fn transport_len(mut self, len: usize) -> Self {
        self.transport_len = Some(len);
        self
    }

    fn transport(&self) -> Vec<u8> {
        let mut t = match self.protocol {
            TCP => {
                let mut h = vec![0u8; 20];
                h[0..2].copy_from_slice(&self.src_port.to_be_bytes());
                h[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
                h[12] = 5 << 4;
                h[13] = self.tcp_flags;
                h
            }
            UDP => {
                let mut h = vec![0u8; 8];
                h[0..2].copy_from_slice(&self.src_port.to_be_bytes());
                h[2..4].copy_from_slice(&self.dst_port.to_be_bytes());
                h[4..6].copy_from_slice(&8u16.to_be_bytes());
                h
            }
            ICMP | ICMPV6 => {
                let echo_request = if self.protocol == ICMP { 8 } else { 128 };
                let (kind, id) = self.icmp.unwrap_or((echo_request, 1));
                let mut h = vec![kind, 0, 0, 0, 0, 0, 0, 1];
                h[4..6].copy_from_slice(&id.to_be_bytes());
                h
            }
            _ => vec![0u8; 8],
        };
        if let Some(len) = self.transport_len {
            t.truncate(len);
        }
        t.extend(&self.payload);
        t
    }

    /// The frame, Ethernet header included.
    pub fn frame(&self) -> Vec<u8> {
        match (self.src, self.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => self.frame_v4(s, d),
            (IpAddr::V6(s), IpAddr::V6(d)) => self.frame_v6(s, d),
            _ => panic!("mixed address families"),
        }
    }

    fn frame_v4(&self, src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
        let transport = self.transport();
        let ihl = 5 + self.ipv4_option_words;
        let header_len = usize::from(ihl) * 4;
        let total = header_len + transport.len();
        let mut f = ethernet(0x0800);
        let mut ip = vec![0u8; header_len];
        ip[0] = 0x40 | ihl;
        ip[2..4].copy_from_slice(&(total as u16).to_be_bytes());
        if let Some((offset, more)) = self.ipv4_fragment {
            let flags = if more { 0x2000 } else { 0 };
            ip[6..8].copy_from_slice(&(flags | (offset & 0x1fff)).to_be_bytes());
        }
        ip[8] = 64;
        ip[9] = self.protocol;
        ip[12..16].copy_from_slice(&src.octets());
        ip[16..20].copy_from_slice(&dst.octets());
        for b in ip.iter_mut().skip(20) {
            *b = 1; // NOP options
        }
        f.extend(ip);
        f.extend(transport);
        f
    }

    fn frame_v6(&self, src: Ipv6Addr, dst: Ipv6Addr) -> Vec<u8> {
        let transport = self.transport();
        let mut chain = Vec::new();
        let numbers: Vec<u8> = self
            .ipv6_ext
            .iter()
            .map(|e| e.number())
            .chain(std::iter::once(self.protocol))
            .collect();
        for (i, ext) in self.ipv6_ext.iter().enumerate() {
            let next = numbers[i + 1];
            match ext {
                Ext::Fragment { offset, more } => {
                    let field = (offset << 3) | u16::from(*more);
                    chain.extend([next, 0]);
                    chain.extend(field.to_be_bytes());
                    chain.extend([0, 0, 0, 1]);
                }
                Ext::Authentication => {
                    // 12 bytes: length field 1 means (1 + 2) * 4.
                    chain.extend([next, 1, 0, 0]);
                    chain.extend([0u8; 8]);
                }
                _ => {
                    // 16 bytes: length field 1 means (1 + 1) * 8, padded with PadN.
                    chain.extend([next, 1, 1, 12]);
                    chain.extend([0u8; 12]);
                }
            }
        }
        let payload = chain.len() + transport.len();
        let mut f = ethernet(0x86dd);
        let mut ip = vec![0u8; 40];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(payload as u16).to_be_bytes());
        ip[6] = numbers[0];
        ip[7] = 64;
        ip[8..24].copy_from_slice(&src.octets());
        ip[24..40].copy_from_slice(&dst.octets());
        f.extend(ip);
        f.extend(chain);
        f.extend(transport);
        f
    }
}

fn ethernet(ethertype: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2];
    f.extend(ethertype.to_be_bytes());
    f
}

fn parse(s: &str) -> IpAddr {
    s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
}

/// Sends whole frames (Ethernet header included) out of `interface` with an `AF_PACKET`
/// socket, from the calling thread's network namespace.
pub fn inject(interface: &str, frames: &[Vec<u8>]) {
    send_frames(interface, frames, None);
}

/// Like [`inject`], but each frame leaves as an skb whose linear part is its Ethernet header
/// alone: the IP header and everything after it are in page fragments. The socket carries a
/// virtio-net header whose `hdr_len` (14) is how much the kernel puts in the linear part,
/// which it honours for frames of a page or more: `frames` must be that long, and the link's
/// MTU must let them through.
pub fn inject_paged(interface: &str, frames: &[Vec<u8>]) {
    for frame in frames {
        assert!(frame.len() >= 4096, "a paged frame must be a page or more");
    }
    send_frames(interface, frames, Some(14));
}

/// `struct virtio_net_hdr` (no checksum offload, no GSO), as the kernel reads it on a
/// little-endian host.
fn virtio_net_hdr(hdr_len: u16) -> [u8; 10] {
    let mut h = [0u8; 10];
    h[2..4].copy_from_slice(&hdr_len.to_le_bytes());
    h
}

fn send_frames(interface: &str, frames: &[Vec<u8>], linear: Option<u16>) {
    let name = std::ffi::CString::new(interface).unwrap_or_else(|e| panic!("{interface}: {e}"));
    // SAFETY: plain syscalls on a socket this function owns; the address and buffers outlive
    // each call.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr());
        assert_ne!(ifindex, 0, "no interface {interface}");
        // Protocol 0: the socket only sends.
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, 0);
        assert!(
            fd >= 0,
            "AF_PACKET socket: {}",
            std::io::Error::last_os_error()
        );
        if linear.is_some() {
            let on: libc::c_int = 1;
            let set = libc::setsockopt(
                fd,
                libc::SOL_PACKET,
                libc::PACKET_VNET_HDR,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
            if set != 0 {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                panic!("PACKET_VNET_HDR: {e}");
            }
        }
        let mut addr: libc::sockaddr_ll = std::mem::zeroed();
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = ifindex as i32;
        addr.sll_halen = 6;
        for frame in frames {
            let mut buf = linear
                .map(|l| virtio_net_hdr(l).to_vec())
                .unwrap_or_default();
            buf.extend_from_slice(frame);
            let sent = libc::sendto(
                fd,
                buf.as_ptr().cast(),
                buf.len(),
                0,
                (&addr as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            );
            if sent < 0 {
                let e = std::io::Error::last_os_error();
                libc::close(fd);
                panic!("sending a frame on {interface}: {e}");
            }
        }
        libc::close(fd);
    }
}

impl Packet {
    /// The IP packet alone (no Ethernet header), for a raw socket.
    pub fn ip(&self) -> Vec<u8> {
        self.frame().split_off(14)
    }
}

/// An IPv4 UDP datagram of `payload` split into fragments of `chunk` bytes (a multiple of 8)
/// of the IP payload (UDP header included), all with identification `id`; checksums zero (UDP
/// over IPv4 may omit its own; the kernel fills in the IP header's for a raw socket).
pub fn udp4_fragments(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    dst_port: u16,
    id: u16,
    payload: &[u8],
    chunk: usize,
) -> Vec<Vec<u8>> {
    let mut udp = Vec::with_capacity(8 + payload.len());
    udp.extend(40000u16.to_be_bytes());
    udp.extend(dst_port.to_be_bytes());
    udp.extend(((8 + payload.len()) as u16).to_be_bytes());
    udp.extend([0, 0]);
    udp.extend(payload);
    let chunks: Vec<&[u8]> = udp.chunks(chunk).collect();
    let n = chunks.len();
    chunks
        .into_iter()
        .enumerate()
        .map(|(i, part)| {
            let mut ip = vec![0u8; 20];
            ip[0] = 0x45;
            ip[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&id.to_be_bytes());
            let more = if i + 1 < n { 0x2000u16 } else { 0 };
            let offset = ((i * chunk) / 8) as u16;
            ip[6..8].copy_from_slice(&(more | offset).to_be_bytes());
            ip[8] = 64;
            ip[9] = UDP;
            ip[12..16].copy_from_slice(&src.octets());
            ip[16..20].copy_from_slice(&dst.octets());
            ip.extend(part);
            ip
        })
        .collect()
}

/// Sends one complete IP packet (header included, any source address) through a raw socket
/// of the calling thread's network namespace: it leaves by whatever route its destination
/// takes (in a peer's namespace, the WireGuard tunnel).
pub fn send_raw(packet: &[u8]) -> std::io::Result<()> {
    use std::{io, mem, os::fd::FromRawFd as _};
    let v6 = packet.first().is_some_and(|b| b >> 4 == 6);
    let family = if v6 { libc::AF_INET6 } else { libc::AF_INET };
    // SAFETY: plain socket(2); the fd is owned by `socket` below. IPPROTO_RAW implies
    // IP_HDRINCL (and IPV6_HDRINCL): the packet is sent as it is.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::IPPROTO_RAW,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd was just created and is owned by nothing else.
    let socket = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&socket);
    let rc = if v6 {
        let dst: [u8; 16] = packet
            .get(24..40)
            .and_then(|d| d.try_into().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "short IPv6 packet"))?;
        // SAFETY: sockaddr_in6 is plain old data; all-zero is valid.
        let mut addr: libc::sockaddr_in6 = unsafe { mem::zeroed() };
        addr.sin6_family = libc::AF_INET6 as libc::sa_family_t;
        addr.sin6_addr.s6_addr = dst;
        // SAFETY: buffer and address are valid for the lengths given.
        unsafe {
            libc::sendto(
                raw,
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&addr as *const libc::sockaddr_in6).cast(),
                mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    } else {
        let dst: [u8; 4] = packet
            .get(16..20)
            .and_then(|d| d.try_into().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "short IPv4 packet"))?;
        // SAFETY: sockaddr_in is plain old data; all-zero is valid.
        let mut addr: libc::sockaddr_in = unsafe { mem::zeroed() };
        addr.sin_family = libc::AF_INET as libc::sa_family_t;
        addr.sin_addr.s_addr = u32::from_ne_bytes(dst);
        // SAFETY: buffer and address are valid for the lengths given.
        unsafe {
            libc::sendto(
                raw,
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&addr as *const libc::sockaddr_in).cast(),
                mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
