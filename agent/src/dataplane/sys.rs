//! The few `bpf(2)` calls the agent makes itself, because aya offers them only in a form that
//! needs CAP_SYS_ADMIN (which the DaemonSet does not grant) or consumes what it is given.
//!
//! A tcx link held open by its own descriptor, pinned without giving the descriptor up.
//!
//! aya's `FdLink::pin` consumes the link and closes its descriptor when pinning fails; with its
//! pin removed, that would release the link and take the program off the interface. The agent
//! repairs pins while it enforces, so it keeps a descriptor of each link that nothing consumes
//! (`BPF_OBJ_GET` on the pin, right after it is made) and pins that one again when needed
//! (`BPF_OBJ_PIN`, which only borrows it). Neither needs more than the agent's CAP_BPF (the
//! `*_GET_FD_BY_ID` commands would need CAP_SYS_ADMIN).
//!
//! Which programs run on a tcx hook: `BPF_PROG_QUERY` gives their ids, which is all the check
//! needs (aya's `query_tcx` opens each by id, CAP_SYS_ADMIN again).
//!
//! A policy trie with BTF (aya creates a standalone map only without), and the BTF itself.
//!
//! Which map a map of maps holds under a key: its id, read with `BPF_MAP_LOOKUP_ELEM` (aya's
//! lookup opens the map by that id, CAP_SYS_ADMIN again).
//!
//! Reading a whole map: `BPF_MAP_LOOKUP_BATCH` (aya 0.14 has no batch API) copies thousands of
//! entries per call where aya's iterator makes two calls per entry. Hash and array maps have it
//! from Linux 5.6; a map type without it (the LPM tries) says so, and the caller iterates.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

use super::{DataplaneError, Result};

/// `bpf(2)` commands of the stable UAPI (include/uapi/linux/bpf.h).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_BTF_LOAD: libc::c_long = 18;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_LINK_GET_FD_BY_ID: libc::c_long = 30;
/// `enum bpf_attach_type`.
pub(crate) const BPF_TCX_INGRESS: u32 = 46;
pub(crate) const BPF_TCX_EGRESS: u32 = 47;

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

/// The `BPF_MAP_CREATE` member of `union bpf_attr`, up to the BTF type ids.
#[repr(C)]
struct MapCreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
    map_ifindex: u32,
    btf_fd: u32,
    btf_key_type_id: u32,
    btf_value_type_id: u32,
    btf_vmlinux_value_type_id: u32,
}

/// A new map of `layout` named `name` (cut to the kernel's 15 characters), its keys and values
/// described by the BTF type ids `key` and `value` of `btf` when given. aya 0.14 creates a
/// standalone map only without BTF.
pub(crate) fn create_map(
    layout: &super::layout::Layout,
    name: &str,
    btf: Option<(BorrowedFd<'_>, u32, u32)>,
) -> io::Result<OwnedFd> {
    let mut map_name = [0u8; 16];
    for (to, from) in map_name.iter_mut().zip(name.bytes().take(15)) {
        *to = from;
    }
    let (btf_fd, btf_key_type_id, btf_value_type_id) = btf.map_or((0, 0, 0), |(fd, key, value)| {
        (fd.as_raw_fd() as u32, key, value)
    });
    let mut attr = MapCreateAttr {
        map_type: layout.map_type as u32,
        key_size: layout.key_size as u32,
        value_size: layout.value_size as u32,
        max_entries: layout.max_entries,
        map_flags: layout.flags,
        inner_map_fd: 0,
        numa_node: 0,
        map_name,
        map_ifindex: 0,
        btf_fd,
        btf_key_type_id,
        btf_value_type_id,
        btf_vmlinux_value_type_id: 0,
    };
    // SAFETY: `attr` is the BPF_MAP_CREATE member (no pointers); the BTF descriptor, if any,
    // is the caller's and open.
    let fd = unsafe { bpf(BPF_MAP_CREATE, &mut attr) }?;
    // SAFETY: on success the syscall returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The `BPF_BTF_LOAD` member of `union bpf_attr`.
#[repr(C)]
struct BtfLoadAttr {
    btf: u64,
    btf_log_buf: u64,
    btf_size: u32,
    btf_log_size: u32,
    btf_log_level: u32,
    pad: u32,
}

/// Loads a BTF blob into the kernel; its descriptor.
pub(crate) fn load_btf(blob: &[u8]) -> io::Result<OwnedFd> {
    let mut attr = BtfLoadAttr {
        btf: blob.as_ptr() as u64,
        btf_log_buf: 0,
        btf_size: u32::try_from(blob.len())
            .map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
        btf_log_size: 0,
        btf_log_level: 0,
        pad: 0,
    };
    // SAFETY: `attr` is the BPF_BTF_LOAD member; `blob` outlives the call.
    let fd = unsafe { bpf(BPF_BTF_LOAD, &mut attr) }?;
    // SAFETY: on success the syscall returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The `BPF_MAP_*_ELEM` member of `union bpf_attr`.
#[repr(C)]
struct ElemAttr {
    map_fd: u32,
    pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// The id of the inner map that a map of maps (behind `fd`, keyed by u32) holds at `key`;
/// `None` if it holds none (or `key` is past its end). aya's lookup opens the inner map by that id, which needs
/// CAP_SYS_ADMIN; the id alone does not.
pub(crate) fn inner_map_id(fd: BorrowedFd<'_>, key: u32) -> io::Result<Option<u32>> {
    let mut id = 0u32;
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        pad: 0,
        key: &key as *const u32 as u64,
        value: &mut id as *mut u32 as u64,
        flags: 0,
    };
    // SAFETY: `attr` is the BPF_MAP_LOOKUP_ELEM member; `key` and `id` have the map's key and
    // (for a map of maps, as user space sees it) value sizes and outlive the call.
    match unsafe { bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) } {
        Ok(_) => Ok(Some(id)),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}

/// The `BPF_PROG_QUERY` member of `union bpf_attr`.
#[repr(C)]
struct QueryAttr {
    target_ifindex: u32,
    attach_type: u32,
    query_flags: u32,
    attach_flags: u32,
    prog_ids: u64,
    prog_cnt: u32,
    pad: u32,
    prog_attach_flags: u64,
    link_ids: u64,
    link_attach_flags: u64,
    revision: u64,
}

/// The ids of the programs attached to a tcx hook of the interface, in chain order. Needs
/// CAP_NET_ADMIN (or CAP_SYS_ADMIN).
pub(crate) fn tcx_program_ids(ifindex: u32, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = vec![0u32; 16];
    loop {
        let mut attr = QueryAttr {
            target_ifindex: ifindex,
            attach_type,
            query_flags: 0,
            attach_flags: 0,
            prog_ids: ids.as_mut_ptr() as u64,
            prog_cnt: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            pad: 0,
            prog_attach_flags: 0,
            link_ids: 0,
            link_attach_flags: 0,
            revision: 0,
        };
        // SAFETY: `attr` is the BPF_PROG_QUERY member; `prog_ids` points to `prog_cnt` u32s
        // that outlive the call.
        match unsafe { bpf(BPF_PROG_QUERY, &mut attr) } {
            Ok(_) => {
                ids.truncate(attr.prog_cnt as usize);
                return Ok(ids);
            }
            // More programs than room: the kernel said how many.
            Err(e)
                if e.raw_os_error() == Some(libc::ENOSPC) && attr.prog_cnt as usize > ids.len() =>
            {
                ids = vec![0u32; attr.prog_cnt as usize];
            }
            Err(e) => return Err(e),
        }
    }
}

/// The `BPF_MAP_*_BATCH` member of `union bpf_attr`.
#[repr(C)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// `ENOTSUPP`: what the kernel returns (its own code, not in libc) for a map type without
/// batch operations.
const ENOTSUPP: i32 = 524;

/// What [`update_batch`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Updated {
    /// The keys set, from the first: all of them unless one by one was cut short.
    pub(crate) count: usize,
    /// In one `BPF_MAP_UPDATE_BATCH`; else one update each.
    pub(crate) batched: bool,
}

/// Sets `keys[i]` to `values[i]` in the map behind `fd` (u32 keys and values: an array of maps
/// takes inner map descriptors), in one `BPF_MAP_UPDATE_BATCH` where the kernel has it for the
/// map, else one update each, the first `one_by_one` keys at most (on a map of maps each update
/// waits for an RCU grace period, about 10 ms).
pub(crate) fn update_batch(
    fd: BorrowedFd<'_>,
    keys: &[u32],
    values: &[u32],
    one_by_one: usize,
) -> io::Result<Updated> {
    let count = keys.len().min(values.len());
    if count == 0 {
        return Ok(Updated {
            count,
            batched: true,
        });
    }
    let mut attr = BatchAttr {
        in_batch: 0,
        out_batch: 0,
        keys: keys.as_ptr() as u64,
        values: values.as_ptr() as u64,
        count: u32::try_from(count).map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?,
        map_fd: fd.as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    };
    // SAFETY: `attr` is the BPF_MAP_*_BATCH member; `keys` and `values` hold `count` u32s (the
    // map's key and value sizes) and outlive the call.
    match unsafe { bpf(BPF_MAP_UPDATE_BATCH, &mut attr) } {
        Ok(_) => {
            return Ok(Updated {
                count,
                batched: true,
            })
        }
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
            ) => {}
        Err(e) => return Err(e),
    }
    let count = count.min(one_by_one);
    for (key, value) in keys.iter().zip(values).take(count) {
        let mut attr = ElemAttr {
            map_fd: fd.as_raw_fd() as u32,
            pad: 0,
            key: key as *const u32 as u64,
            value: value as *const u32 as u64,
            flags: 0,
        };
        // SAFETY: `attr` is the BPF_MAP_UPDATE_ELEM member; `key` and `value` are u32s that
        // outlive the call.
        unsafe { bpf(BPF_MAP_UPDATE_ELEM, &mut attr) }?;
    }
    Ok(Updated {
        count,
        batched: false,
    })
}

/// Entries asked for per batch call: 4096 peer entries are 80 KiB of keys and values.
const BATCH: usize = 4096;

/// Every (key, value) of the map behind `fd`, read with `BPF_MAP_LOOKUP_BATCH`; `Ok(None)` if
/// the kernel has no batch lookup for this map (type or kernel too old): iterate instead.
/// `K` and `V` must have the map's key and value sizes (not for per-CPU maps). Like an
/// iteration, it sees each entry that stays in the map throughout exactly once.
pub(crate) fn lookup_batch<K: aya::Pod, V: aya::Pod>(
    fd: BorrowedFd<'_>,
) -> io::Result<Option<Vec<(K, V)>>> {
    let mut keys: Vec<K> = Vec::with_capacity(BATCH);
    let mut values: Vec<V> = Vec::with_capacity(BATCH);
    let mut out = Vec::new();
    // The position between calls: a bucket index (hash maps) or a key (arrays), at most the
    // key's size; u64s keep it aligned.
    let words = std::mem::size_of::<K>().div_ceil(8).max(1);
    let mut token = vec![0u64; words];
    let mut next = vec![0u64; words];
    let mut first = true;
    let mut room = BATCH;
    loop {
        keys.reserve(room);
        values.reserve(room);
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { token.as_mut_ptr() as u64 },
            out_batch: next.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: u32::try_from(room).unwrap_or(u32::MAX),
            map_fd: fd.as_raw_fd() as u32,
            elem_flags: 0,
            flags: 0,
        };
        // SAFETY: `attr` is the BPF_MAP_*_BATCH member; `keys` and `values` have room for
        // `count` elements of the map's key and value sizes (the caller's contract), the
        // tokens for a key, and all outlive the call.
        let result = unsafe { bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let done = match result {
            Ok(_) => false,
            // The end of the map: `count` says how many this last call filled.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e)
                if first
                    && matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
                    ) =>
            {
                return Ok(None);
            }
            // One hash bucket holds more entries than `room`: ask again with more.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && attr.count == 0 => {
                room *= 2;
                continue;
            }
            Err(e) => return Err(e),
        };
        let filled = (attr.count as usize).min(room);
        // SAFETY: the kernel wrote `filled` keys and values (Pod: any bytes are valid).
        unsafe {
            keys.set_len(filled);
            values.set_len(filled);
        }
        out.extend(keys.drain(..).zip(values.drain(..)));
        if done {
            return Ok(Some(out));
        }
        std::mem::swap(&mut token, &mut next);
        first = false;
    }
}

/// One tcx link, kept alive by this descriptor for as long as the value lives.
#[derive(Debug)]
pub(crate) struct HeldLink {
    fd: OwnedFd,
}

impl HeldLink {
    /// A descriptor of its own for the link pinned at `path`.
    pub(crate) fn open(path: &Path) -> Result<Self> {
        let fd = obj(BPF_OBJ_GET, path, 0)?;
        // SAFETY: on success BPF_OBJ_GET returned a new descriptor that nothing else owns.
        Ok(Self {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// Pins the link at `path`; the descriptor stays open whatever happens.
    pub(crate) fn pin(&self, path: &Path) -> Result<()> {
        obj(BPF_OBJ_PIN, path, self.fd.as_raw_fd() as u32)?;
        Ok(())
    }
}

/// `BPF_OBJ_GET` or `BPF_OBJ_PIN` of `fd` at `path`.
fn obj(cmd: libc::c_long, path: &Path, fd: u32) -> Result<i32> {
    let io_err = |source| DataplaneError::Io {
        path: path.to_owned(),
        source,
    };
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io_err(io::Error::from_raw_os_error(libc::EINVAL)))?;
    let mut attr = ObjAttr {
        pathname: c_path.as_ptr() as u64,
        bpf_fd: fd,
        file_flags: 0,
        path_fd: 0,
        pad: 0,
    };
    // SAFETY: `attr` is the BPF_OBJ_* member; the path it points to outlives the call, and
    // `fd` (for a pin) is the caller's open descriptor.
    unsafe { bpf(cmd, &mut attr) }.map_err(io_err)
}

/// Whether a link with this id still exists (anything still holds it: a pin, a descriptor).
/// Needs CAP_SYS_ADMIN: `EPERM` without it.
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
