//! The BTF of the policy tries, so that `bpftool map dump` prints their keys and values by
//! field, as it does for the maps the object declares.
//!
//! The loader gives the object's maps the object's BTF, but the agent creates each policy's
//! trie itself, and aya 0.14 does not hand out the object's BTF descriptor. So the agent loads
//! a BTF of its own, once, with the few types a trie needs: the LPM key (`prefix_len`, then
//! the destination) of each address family and [`PolicyValue`] with its [`Allow`] entries.
//! Its layout is checked against the Rust types in the tests below. A kernel that refuses it
//! gets tries without BTF: bpftool then prints their bytes, and nothing else changes.
//!
//! [`PolicyValue`]: wgfence_common::PolicyValue
//! [`Allow`]: wgfence_common::Allow

use std::mem::size_of;

use wgfence_common::{Allow, PolicyKeyV4, PolicyKeyV6, PolicyValue, MAX_ALLOWS};

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;

/// The type ids of the trie key of each family and of the value, in [`build`]'s blob.
pub(crate) const KEY_V4: u32 = 6;
pub(crate) const KEY_V6: u32 = 9;
pub(crate) const VALUE: u32 = 12;

/// Types and strings, written in BTF's encoding (native endian, as the kernel reads it).
struct Blob {
    types: Vec<u8>,
    strings: Vec<u8>,
    next_id: u32,
}

impl Blob {
    fn new() -> Self {
        Self {
            types: Vec::new(),
            // Offset 0 is the empty name.
            strings: vec![0],
            next_id: 1,
        }
    }

    fn name(&mut self, name: &str) -> u32 {
        let offset = self.strings.len() as u32;
        self.strings.extend_from_slice(name.as_bytes());
        self.strings.push(0);
        offset
    }

    fn words(&mut self, words: &[u32]) {
        for w in words {
            self.types.extend_from_slice(&w.to_ne_bytes());
        }
    }

    /// `struct btf_type`: name, info (kind, vlen), size or type. Returns the new type's id.
    fn head(&mut self, name: &str, kind: u32, vlen: u32, size: u32) -> u32 {
        let name = if name.is_empty() { 0 } else { self.name(name) };
        self.words(&[name, kind << 24 | vlen, size]);
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// An unsigned integer of `bytes` bytes.
    fn int(&mut self, name: &str, bytes: u32) -> u32 {
        let id = self.head(name, KIND_INT, 0, bytes);
        // Encoding 0 (unsigned), offset 0, `bytes * 8` bits.
        self.words(&[bytes * 8]);
        id
    }

    fn array(&mut self, element: u32, index: u32, len: u32) -> u32 {
        let id = self.head("", KIND_ARRAY, 0, 0);
        self.words(&[element, index, len]);
        id
    }

    /// A struct of `size` bytes; members as (name, type, offset in bytes).
    fn structure(&mut self, name: &str, size: usize, members: &[(&str, u32, usize)]) -> u32 {
        let id = self.head(name, KIND_STRUCT, members.len() as u32, size as u32);
        for (member, ty, offset) in members {
            let member = self.name(member);
            self.words(&[member, *ty, (*offset * 8) as u32]);
        }
        id
    }

    fn finish(self) -> Vec<u8> {
        let hdr_len = 24u32;
        let type_len = self.types.len() as u32;
        let mut out = Vec::with_capacity(24 + self.types.len() + self.strings.len());
        out.extend_from_slice(&BTF_MAGIC.to_ne_bytes());
        out.push(1); // version
        out.push(0); // flags
        for w in [hdr_len, 0, type_len, type_len, self.strings.len() as u32] {
            out.extend_from_slice(&w.to_ne_bytes());
        }
        out.extend_from_slice(&self.types);
        out.extend_from_slice(&self.strings);
        out
    }
}

/// The BTF blob: ids [`KEY_V4`], [`KEY_V6`] and [`VALUE`] are the tries' key and value types.
pub(crate) fn build() -> Vec<u8> {
    let mut b = Blob::new();
    let u8_ = b.int("u8", 1); // 1
    let u16_ = b.int("u16", 2); // 2
    let u32_ = b.int("u32", 4); // 3
    let addr4 = b.array(u8_, u32_, 4); // 4
    let data4 = b.structure(
        "PolicyKeyV4",
        size_of::<PolicyKeyV4>(),
        &[("addr", addr4, 0)],
    ); // 5
    let key4 = b.structure(
        "PolicyTrieKeyV4",
        4 + size_of::<PolicyKeyV4>(),
        &[("prefix_len", u32_, 0), ("data", data4, 4)],
    ); // 6
    let addr6 = b.array(u8_, u32_, 16); // 7
    let data6 = b.structure(
        "PolicyKeyV6",
        size_of::<PolicyKeyV6>(),
        &[("addr", addr6, 0)],
    ); // 8
    let key6 = b.structure(
        "PolicyTrieKeyV6",
        4 + size_of::<PolicyKeyV6>(),
        &[("prefix_len", u32_, 0), ("data", data6, 4)],
    ); // 9
    let allow = b.structure(
        "Allow",
        size_of::<Allow>(),
        &[
            ("protocol", u8_, 0),
            ("_pad", u8_, 1),
            ("port_lo", u16_, 2),
            ("port_hi", u16_, 4),
            ("rule", u16_, 6),
        ],
    ); // 10
    let allows = b.array(allow, u32_, MAX_ALLOWS as u32); // 11
    let value = b.structure(
        "PolicyValue",
        size_of::<PolicyValue>(),
        &[("count", u32_, 0), ("allows", allows, 4)],
    ); // 12
    debug_assert_eq!((key4, key6, value), (KEY_V4, KEY_V6, VALUE));
    b.finish()
}

#[cfg(test)]
mod tests {
    use core::mem::offset_of;

    use super::*;

    /// The offsets written above are the Rust types' own.
    #[test]
    fn the_btf_matches_the_rust_types() {
        assert_eq!(offset_of!(Allow, protocol), 0);
        assert_eq!(offset_of!(Allow, _pad), 1);
        assert_eq!(offset_of!(Allow, port_lo), 2);
        assert_eq!(offset_of!(Allow, port_hi), 4);
        assert_eq!(offset_of!(Allow, rule), 6);
        assert_eq!(size_of::<Allow>(), 8);
        assert_eq!(offset_of!(PolicyValue, count), 0);
        assert_eq!(offset_of!(PolicyValue, allows), 4);
        assert_eq!(offset_of!(PolicyKeyV4, addr), 0);
        assert_eq!(offset_of!(PolicyKeyV6, addr), 0);
        let blob = build();
        assert_eq!(&blob[..2], &BTF_MAGIC.to_ne_bytes());
        // 12 types of three words: 3 ints with one word more, 3 arrays with three, 6 structs
        // with three a member.
        let type_len = u32::from_ne_bytes([blob[12], blob[13], blob[14], blob[15]]) as usize;
        let members = 1 + 2 + 1 + 2 + 5 + 2;
        assert_eq!(type_len, 12 * 12 + 3 * 4 + 3 * 12 + members * 12);
    }
}
