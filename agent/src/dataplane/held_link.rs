//! A tcx link held open by its own descriptor, pinned without giving the descriptor up.
//!
//! aya's `FdLink::pin` consumes the link and closes its descriptor when pinning fails; with its
//! pin removed, that would release the link and take the program off the interface. The agent
//! repairs pins while it enforces, so it keeps a descriptor of each link that nothing consumes
//! (`BPF_LINK_GET_FD_BY_ID`) and pins that one (`BPF_OBJ_PIN`, which only borrows it).

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use aya::programs::links::FdLink;

use super::{DataplaneError, Result};

/// `bpf(2)` commands of the stable UAPI (include/uapi/linux/bpf.h).
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;

/// The `BPF_OBJ_*` member of `union bpf_attr`.
#[repr(C)]
struct ObjAttr {
    pathname: u64,
    bpf_fd: u32,
    file_flags: u32,
    path_fd: i32,
    /// Explicit, so no uninitialised padding reaches the kernel (which wants zeros there).
    pad: u32,
}

/// The `*_GET_FD_BY_ID` member of `union bpf_attr`.
#[repr(C)]
struct GetFdByIdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// One tcx link, kept alive by this descriptor for as long as the value lives.
#[derive(Debug)]
pub(crate) struct HeldLink {
    fd: OwnedFd,
}

impl HeldLink {
    /// A descriptor of its own for `link` (which the caller may then drop).
    pub(crate) fn hold(link: &FdLink, path: &Path) -> Result<Self> {
        let id = link
            .info()
            .map_err(|source| DataplaneError::Link {
                path: path.to_owned(),
                source,
            })?
            .id();
        let fd = link_fd(id)
            .map_err(|source| DataplaneError::Io {
                path: path.to_owned(),
                source,
            })?
            .ok_or_else(|| DataplaneError::Io {
                path: path.to_owned(),
                source: io::Error::from_raw_os_error(libc::ENOENT),
            })?;
        Ok(Self { fd })
    }

    /// Pins the link at `path`; the descriptor stays open whatever happens.
    pub(crate) fn pin(&self, path: &Path) -> Result<()> {
        let io_err = |source| DataplaneError::Io {
            path: path.to_owned(),
            source,
        };
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| io_err(io::Error::from_raw_os_error(libc::EINVAL)))?;
        let mut attr = ObjAttr {
            pathname: c_path.as_ptr() as u64,
            bpf_fd: self.fd.as_raw_fd() as u32,
            file_flags: 0,
            path_fd: 0,
            pad: 0,
        };
        // SAFETY: `attr` is the BPF_OBJ_PIN member; the path it points to and the descriptor
        // outlive the call.
        unsafe { bpf(BPF_OBJ_PIN, &mut attr) }.map_err(io_err)?;
        Ok(())
    }
}

/// Whether a link with this id still exists (anything still holds it: a pin, a descriptor).
pub(crate) fn link_exists(id: u32) -> io::Result<bool> {
    Ok(link_fd(id)?.is_some())
}

/// A new descriptor of the link with this id; `None` once the link is gone.
fn link_fd(id: u32) -> io::Result<Option<OwnedFd>> {
    let mut attr = GetFdByIdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    // SAFETY: `attr` is the BPF_LINK_GET_FD_BY_ID member (no pointers).
    match unsafe { bpf(BPF_LINK_GET_FD_BY_ID, &mut attr) } {
        // SAFETY: on success the syscall returned a new descriptor that nothing else owns.
        Ok(fd) => Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `bpf(cmd, attr, sizeof attr)`: the syscall's non-negative result.
///
/// # Safety
/// `attr` must be the `union bpf_attr` member that `cmd` reads, with every pointer in it valid.
unsafe fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i32> {
    // SAFETY: the caller's contract; the kernel reads at most size_of::<T>() bytes.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T,
            std::mem::size_of::<T>() as libc::c_ulong,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    i32::try_from(ret).map_err(|_| io::Error::from_raw_os_error(libc::EOVERFLOW))
}
