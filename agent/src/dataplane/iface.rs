//! What the loader needs to know about the interface: its index and which program variant
//! fits it (where the IP header starts).

use std::{ffi::CString, io, mem, os::fd::FromRawFd as _};

use wgfence_common::{Variant, VARIANT_ETHERNET, VARIANT_L3};

use super::error::{DataplaneError, Result};

const ARPHRD_ETHER: u16 = 1;
const ARPHRD_LOOPBACK: u16 = 772;
const ARPHRD_NONE: u16 = 0xfffe;

/// The program variant for `interface` (where the IP header starts in a tc program's packet
/// data), looked up in the calling thread's network namespace (ioctl on a socket of that
/// namespace, not /sys, which shows the namespace of whoever mounted it).
pub(crate) fn variant(interface: &str) -> Result<Variant> {
    match link_type(interface)? {
        // WireGuard (kernel) and TUN (wireguard-go) devices: packets start at the IP header.
        ARPHRD_NONE => Ok(VARIANT_L3),
        ARPHRD_ETHER | ARPHRD_LOOPBACK => Ok(VARIANT_ETHERNET),
        link_type => Err(DataplaneError::UnsupportedLinkType {
            interface: interface.to_owned(),
            link_type,
        }),
    }
}

/// The interface's index in the calling thread's network namespace; `ENODEV` if it does not
/// exist.
pub(crate) fn index(interface: &str) -> Result<u32> {
    let err = |source: io::Error| DataplaneError::Interface {
        interface: interface.to_owned(),
        source,
    };
    let name = CString::new(interface).map_err(|_| {
        err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "name contains NUL",
        ))
    })?;
    // SAFETY: if_nametoindex reads a NUL-terminated string.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(err(io::Error::last_os_error())),
        index => Ok(index),
    }
}

fn link_type(interface: &str) -> Result<u16> {
    let err = |source: io::Error| DataplaneError::Interface {
        interface: interface.to_owned(),
        source,
    };
    let name = CString::new(interface).map_err(|_| {
        err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "name contains NUL",
        ))
    })?;
    let bytes = name.as_bytes_with_nul();
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { mem::zeroed() };
    if bytes.len() > req.ifr_name.len() {
        return Err(err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "name longer than 15 characters",
        )));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain socket(2); the fd is owned (and closed) by `socket` below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(err(io::Error::last_os_error()));
    }
    // SAFETY: fd was just created and is not owned elsewhere.
    let socket = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // SAFETY: SIOCGIFHWADDR reads ifr_name and writes ifr_hwaddr inside `req`.
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            libc::SIOCGIFHWADDR,
            &mut req,
        )
    };
    if rc < 0 {
        return Err(err(io::Error::last_os_error()));
    }
    // SAFETY: the kernel filled ifr_hwaddr (the union's sockaddr member) on success.
    Ok(unsafe { req.ifr_ifru.ifru_hwaddr.sa_family })
}
