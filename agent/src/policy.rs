//! The policy compiler: a peer's egress rules become the canonical trie entries the datapath
//! looks up.
//!
//! The datapath does one longest-prefix-match lookup of the destination, so each entry must
//! already hold everything any rule allows for destinations under that prefix:
//!
//! 1. every rule becomes (prefix, allows) with the prefix's host bits cleared;
//! 2. each prefix's allows are folded into every more specific prefix it contains;
//! 3. per prefix, overlapping and adjacent port ranges of a protocol merge, and `any` subsumes
//!    everything; the result is sorted, so equal rule sets give equal output in any order;
//! 4. a prefix whose folded allows equal those of the prefix that contains it adds nothing
//!    (the lookup would find the same allows one level up) and is left out.
//!
//! A [`CompiledPolicy`] is its own content identity: peers whose rules compile to the same
//! entries can share one set of trie entries.

use std::collections::BTreeMap;

use ipnet::IpNet;
use wgfence_common::{
    Allow, PolicyValue, MAX_ALLOWS, PROTO_ANY, PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP,
};

/// The protocol of a rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Any,
    Tcp,
    Udp,
    /// ICMP for IPv4 destinations, ICMPv6 for IPv6 destinations.
    Icmp,
}

/// An inclusive destination port range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortRange {
    pub lo: u16,
    pub hi: u16,
}

impl PortRange {
    pub const ALL: PortRange = PortRange {
        lo: 0,
        hi: u16::MAX,
    };

    pub const fn new(lo: u16, hi: u16) -> Self {
        Self { lo, hi }
    }

    pub const fn single(port: u16) -> Self {
        Self { lo: port, hi: port }
    }
}

/// One egress rule: destinations in `cidr` but in none of `except`, of `protocol`, to `ports`
/// (empty: every port). For an `icmp` rule `ports` holds ICMP type ranges (`types` in the
/// state file; empty: every type): the datapath matches an ICMP packet's type where it
/// matches a TCP/UDP packet's destination port.
///
/// Rules are the bulk of an agent's memory when every peer has a policy of its own
/// (docs/operations.md, "Agent memory"), so a rule is held in 40 bytes: up to two port ranges
/// inline, as most rules have, and anything more (more ranges, `except`) in one heap block
/// that most rules do not have. Two vectors took 72 bytes and a heap block. Equality, order
/// and hash are those of (cidr, protocol, ports, except): the canonical order of a rule set,
/// which the rule counters are indexed by.
#[derive(Clone)]
pub struct Rule {
    pub cidr: IpNet,
    pub protocol: Protocol,
    /// How many of `inline` are the rule's ports, when `more` holds none.
    inline_len: u8,
    inline: [PortRange; 2],
    more: Option<Box<More>>,
}

/// What few rules have: more than two port ranges, or an `except`.
#[derive(Clone)]
struct More {
    /// Empty when the ports are inline.
    ports: Box<[PortRange]>,
    /// Sorted, each strictly inside the rule's cidr.
    except: Box<[IpNet]>,
}

impl Rule {
    /// The port (or ICMP type) ranges; empty: every port.
    pub fn ports(&self) -> &[PortRange] {
        match &self.more {
            Some(more) if !more.ports.is_empty() => &more.ports,
            _ => &self.inline[..usize::from(self.inline_len)],
        }
    }

    /// Prefixes carved out of `cidr` (sorted, each strictly inside it).
    pub fn except(&self) -> &[IpNet] {
        self.more.as_ref().map_or(&[], |more| &more.except)
    }

    fn key(&self) -> (IpNet, Protocol, &[PortRange], &[IpNet]) {
        (self.cidr, self.protocol, self.ports(), self.except())
    }
}

impl PartialEq for Rule {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for Rule {}

impl PartialOrd for Rule {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Rule {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl std::hash::Hash for Rule {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.key().hash(state);
    }
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("cidr", &self.cidr)
            .field("protocol", &self.protocol)
            .field("ports", &self.ports())
            .field("except", &self.except())
            .finish()
    }
}

/// Prefixes one rule may carve out of its `cidr`.
pub const MAX_EXCEPT: usize = 64;

/// ICMP type names a rule's `types` may use, per family: (name, ICMPv4 type, ICMPv6 type).
pub const ICMP_TYPE_NAMES: [(&str, u16, u16); 4] = [
    ("echo-reply", 0, 129),
    ("destination-unreachable", 3, 1),
    ("echo-request", 8, 128),
    ("time-exceeded", 11, 3),
];

impl Rule {
    pub fn new(cidr: IpNet, protocol: Protocol, ports: Vec<PortRange>) -> Self {
        let mut rule = Self {
            cidr,
            protocol,
            inline_len: 0,
            inline: [PortRange::new(0, 0); 2],
            more: None,
        };
        match ports.as_slice() {
            [] => {}
            [a] => (rule.inline_len, rule.inline[0]) = (1, *a),
            [a, b] => (rule.inline_len, rule.inline) = (2, [*a, *b]),
            _ => {
                rule.more = Some(Box::new(More {
                    ports: ports.into_boxed_slice(),
                    except: Box::default(),
                }))
            }
        }
        rule
    }

    /// The same rule with `except` carved out.
    pub fn with_except(mut self, mut except: Vec<IpNet>) -> Self {
        except.sort_unstable();
        except.dedup();
        let except = except.into_boxed_slice();
        match &mut self.more {
            Some(more) => more.except = except,
            None if except.is_empty() => {}
            None => {
                self.more = Some(Box::new(More {
                    ports: Box::default(),
                    except,
                }))
            }
        }
        self
    }

    /// Whether `dst` is one of the rule's destinations.
    pub fn covers(&self, dst: &std::net::IpAddr) -> bool {
        self.cidr.contains(dst) && !self.except().iter().any(|e| e.contains(dst))
    }

    /// The destinations as disjoint prefixes: `cidr` without the `except` prefixes (each
    /// removed by halving the prefix that holds it down to its length: at most one prefix
    /// per bit of difference).
    pub fn pieces(&self) -> Vec<IpNet> {
        let mut pieces = vec![self.cidr.trunc()];
        for hole in self.except() {
            pieces = pieces
                .into_iter()
                .flat_map(|piece| carve(piece, *hole))
                .collect();
        }
        pieces.sort_unstable();
        pieces
    }

    /// The datapath entries this rule allows, before folding and merging.
    pub fn allows(&self) -> Vec<Allow> {
        let all = |protocol| vec![Allow::new(protocol, 0, u16::MAX)];
        let ranges = |protocol| {
            if self.ports().is_empty() {
                all(protocol)
            } else {
                self.ports()
                    .iter()
                    .map(|r| Allow::new(protocol, r.lo, r.hi))
                    .collect()
            }
        };
        match self.protocol {
            Protocol::Any => all(PROTO_ANY),
            Protocol::Tcp => ranges(PROTO_TCP),
            Protocol::Udp => ranges(PROTO_UDP),
            Protocol::Icmp => match self.cidr {
                IpNet::V4(_) => ranges(PROTO_ICMP),
                IpNet::V6(_) => ranges(PROTO_ICMPV6),
            },
        }
    }
}

/// `net` without `hole`: `net` itself if they do not overlap, nothing if `hole` covers it,
/// else the halves of `net` that do not hold `hole`, down to `hole`'s length.
fn carve(net: IpNet, hole: IpNet) -> Vec<IpNet> {
    if hole.contains(&net) {
        return Vec::new();
    }
    if !net.contains(&hole) {
        return vec![net];
    }
    let mut out = Vec::new();
    let mut current = net;
    while current.prefix_len() < hole.prefix_len() {
        let Ok(halves) = current.subnets(current.prefix_len() + 1) else {
            break;
        };
        let mut next = None;
        for half in halves {
            if half.contains(&hole) {
                next = Some(half);
            } else {
                out.push(half);
            }
        }
        match next {
            Some(n) => current = n,
            None => break,
        }
    }
    out
}

/// Checks a rule's `except` list against its `cidr`: same family, no host bits, strictly
/// inside the cidr, at most [`MAX_EXCEPT`]. The message names the offending prefix.
pub fn check_except(cidr: IpNet, except: &[IpNet]) -> Result<(), String> {
    if except.is_empty() {
        return Err("empty: leave except out to keep the whole cidr".into());
    }
    if except.len() > MAX_EXCEPT {
        return Err(format!("{} prefixes, at most {MAX_EXCEPT}", except.len()));
    }
    for e in except {
        if e.trunc() != *e {
            return Err(format!(
                "{e} has host bits set (did you mean {}?)",
                e.trunc()
            ));
        }
        if !cidr.contains(e) || e.prefix_len() <= cidr.prefix_len() {
            return Err(format!(
                "{e} is not a prefix strictly inside the rule's cidr {cidr}"
            ));
        }
    }
    Ok(())
}

/// One entry of an `icmp` rule's `types`: a type number (0-255), a `"lo-hi"` range or a name
/// of [`ICMP_TYPE_NAMES`] (its number for the rule's family).
pub fn icmp_types(text: Option<&str>, number: Option<u64>, v6: bool) -> Result<PortRange, String> {
    let ty = |v: u64| {
        u16::try_from(v)
            .ok()
            .filter(|v| *v <= 255)
            .ok_or_else(|| format!("{v} is not an ICMP type (0-255)"))
    };
    if let Some(v) = number {
        return ty(v).map(PortRange::single);
    }
    let s = text.unwrap_or_default().trim();
    if let Some((_, v4, v6_type)) = ICMP_TYPE_NAMES.iter().find(|(name, ..)| *name == s) {
        return Ok(PortRange::single(if v6 { *v6_type } else { *v4 }));
    }
    let parse = |t: &str| {
        t.trim()
            .parse::<u64>()
            .map_err(|_| format!("{s:?} is not an ICMP type, a \"lo-hi\" range or a type name"))
            .and_then(ty)
    };
    match s.split_once('-') {
        Some((lo, hi)) => {
            let (lo, hi) = (parse(lo)?, parse(hi)?);
            if lo > hi {
                Err(format!("range {s:?} is reversed"))
            } else {
                Ok(PortRange::new(lo, hi))
            }
        }
        None => parse(s).map(PortRange::single),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    #[error(
        "destination {prefix} needs {count} (protocol, port range) entries after folding in \
         the rules of the prefixes that contain it; the datapath holds at most {max}"
    )]
    TooManyAllows {
        prefix: IpNet,
        count: usize,
        max: usize,
    },
}

/// A compiled, canonical policy: trie entries by destination prefix. No entries means every
/// packet is denied (`"egress": []`, [`NOTHING`]); a peer without `egress` is unrestricted and
/// has no compiled policy at all.
///
/// Held flat, as two exactly sized arrays: the prefixes in order, each with the end of its
/// allows in the second. A policy is written once and read often; an agent with a policy per
/// peer holds tens of thousands (the accepted state's, which the view of the kernel refers
/// to), where a map of prefixes to vectors cost twice the bytes and a heap block an entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CompiledPolicy {
    /// Sorted by prefix, without repeats: each prefix and the end of its allows in `allows`
    /// (the start is the previous entry's end).
    prefixes: Vec<(IpNet, u32)>,
    allows: Vec<Allow>,
}

/// The rules one trie entry counts for: its highest rule index, plus one (0 for no allow).
pub fn counted_rules(allows: &[Allow]) -> u32 {
    allows
        .iter()
        .map(|a| u32::from(a.rule) + 1)
        .max()
        .unwrap_or(0)
}

/// The policy of `"egress": []`: no entry, so every packet is denied. As the kernel holds it:
/// a restricted policy id that peer entries point at and the tries have no entry for.
pub static NOTHING: CompiledPolicy = CompiledPolicy {
    prefixes: Vec::new(),
    allows: Vec::new(),
};

/// In the order of the entries, as a map of prefixes to allows would sort (the order the
/// compiler's canonical ids were always given in).
impl Ord for CompiledPolicy {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.entries().cmp(other.entries())
    }
}

impl PartialOrd for CompiledPolicy {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl CompiledPolicy {
    /// The trie entries, sorted by prefix.
    pub fn entries(&self) -> impl ExactSizeIterator<Item = (IpNet, &[Allow])> + '_ {
        self.prefixes
            .iter()
            .enumerate()
            .map(|(i, (prefix, _))| (*prefix, self.allows_at(i)))
    }

    /// The allows of entry `i`.
    fn allows_at(&self, i: usize) -> &[Allow] {
        &self.allows[self.start_of(i)..self.prefixes[i].1 as usize]
    }

    pub fn len(&self) -> usize {
        self.prefixes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// The map value of one entry.
    pub fn value(allows: &[Allow]) -> PolicyValue {
        let mut value = PolicyValue::default();
        let n = allows.len().min(MAX_ALLOWS);
        value.allows[..n].copy_from_slice(&allows[..n]);
        value.count = n as u32;
        value
    }

    /// Sets one entry (the kernel's view of a policy while it is being written); the entry it
    /// replaced, if any. O(entries) moves, as is the content hash the planner's index takes
    /// of the policy after each of its writes; no heap block but the arrays' own.
    pub fn insert_entry(&mut self, prefix: IpNet, allows: Vec<Allow>) -> Option<Vec<Allow>> {
        let (at, replaced) = match self.prefixes.binary_search_by_key(&prefix, |(p, _)| *p) {
            Ok(at) => (at, Some(self.allows_at(at).to_vec())),
            Err(at) => (at, None),
        };
        let start = self.start_of(at);
        let old_len = replaced.as_ref().map_or(0, Vec::len);
        self.allows
            .splice(start..start + old_len, allows.iter().copied());
        let end = Self::offset(start + allows.len());
        if replaced.is_some() {
            self.prefixes[at].1 = end;
        } else {
            self.prefixes.insert(at, (prefix, end));
        }
        self.shift_ends(at + 1, allows.len(), old_len);
        self.prefixes.shrink_to_fit();
        self.allows.shrink_to_fit();
        replaced
    }

    /// Removes one entry; the entry, if there was one.
    pub fn remove_entry(&mut self, prefix: &IpNet) -> Option<Vec<Allow>> {
        let at = self.entry_index(prefix)?;
        let start = self.start_of(at);
        let removed: Vec<Allow> = self
            .allows
            .drain(start..self.prefixes[at].1 as usize)
            .collect();
        self.prefixes.remove(at);
        self.shift_ends(at, 0, removed.len());
        self.prefixes.shrink_to_fit();
        self.allows.shrink_to_fit();
        Some(removed)
    }

    /// Whether the policy has an entry for exactly `prefix`.
    pub fn has_entry(&self, prefix: &IpNet) -> bool {
        self.entry_index(prefix).is_some()
    }

    fn entry_index(&self, prefix: &IpNet) -> Option<usize> {
        self.prefixes.binary_search_by_key(prefix, |(p, _)| *p).ok()
    }

    /// Where entry `at`'s allows start: the previous entry's end.
    fn start_of(&self, at: usize) -> usize {
        at.checked_sub(1).map_or(0, |p| self.prefixes[p].1 as usize)
    }

    /// The ends of the entries from `from` on, after their allows moved by `added - removed`.
    fn shift_ends(&mut self, from: usize, added: usize, removed: usize) {
        for (_, end) in &mut self.prefixes[from..] {
            *end = Self::offset(*end as usize + added - removed);
        }
    }

    /// An offset into `allows`: at most MAX_ALLOWS an entry and a trie's worth of entries, far
    /// below u32::MAX.
    fn offset(at: usize) -> u32 {
        u32::try_from(at).unwrap_or(u32::MAX)
    }

    /// How many of the policy's rules (in canonical order) have a counter: the highest rule
    /// index its entries carry, plus one. A later rule compiles to no entry (everything it
    /// allows, earlier rules allow or `except` took away), so no packet can count for it, and
    /// the policy's rule-counter block ([`crate::plan`]) ends before it.
    pub fn counted_rules(&self) -> u32 {
        counted_rules(&self.allows)
    }

    /// Rebuilds a policy from trie entries read back from the kernel (a prefix given twice
    /// keeps its last allows, as a map's insert would).
    pub fn from_entries(entries: impl IntoIterator<Item = (IpNet, Vec<Allow>)>) -> Self {
        let sorted: BTreeMap<IpNet, Vec<Allow>> = entries.into_iter().collect();
        Self::from_sorted_entries(sorted)
    }

    /// A policy from its trie entries sorted by prefix, without repeats (as the compiler makes
    /// them, or as read back from one trie and sorted).
    pub fn from_sorted_entries<A: AsRef<[Allow]>>(
        entries: impl IntoIterator<Item = (IpNet, A)>,
    ) -> Self {
        let mut prefixes = Vec::new();
        let mut allows = Vec::new();
        for (prefix, entry) in entries {
            allows.extend_from_slice(entry.as_ref());
            prefixes.push((prefix, Self::offset(allows.len())));
        }
        prefixes.shrink_to_fit();
        allows.shrink_to_fit();
        Self { prefixes, allows }
    }

    /// What the datapath decides for a packet: the longest matching prefix's allows must
    /// contain a match. A reference model for tests of the compiler and of the datapath.
    #[cfg(any(test, feature = "testing"))]
    pub fn permits(&self, dst: std::net::IpAddr, protocol: u8, port: Option<u16>) -> bool {
        self.entries()
            .filter(|(prefix, _)| prefix.contains(&dst))
            .max_by_key(|(prefix, _)| prefix.prefix_len())
            .is_some_and(|(_, allows)| allows.iter().any(|a| a.matches(protocol, port)))
    }
}

/// Compiles a peer's rules. The result does not depend on the order of `rules`.
///
/// Each allow entry carries the index of its rule in canonical order (the rules sorted and
/// deduplicated, as the state holds them), and entries of different rules are never merged:
/// the datapath credits a packet to the first entry that matches, so to the first rule in
/// canonical order that allows it ([`Allow::rule`], the per-rule hit counters).
pub fn compile(rules: &[Rule]) -> Result<CompiledPolicy, PolicyError> {
    let mut canonical: Vec<&Rule> = rules.iter().collect();
    canonical.sort();
    canonical.dedup();
    let mut by_prefix: BTreeMap<IpNet, Vec<Allow>> = BTreeMap::new();
    for (index, rule) in canonical.into_iter().enumerate() {
        let index = u16::try_from(index).unwrap_or(u16::MAX);
        let allows: Vec<Allow> = rule
            .allows()
            .into_iter()
            .map(|a| Allow { rule: index, ..a })
            .collect();
        for piece in rule.pieces() {
            by_prefix
                .entry(piece)
                .or_default()
                .extend(allows.iter().copied());
        }
    }

    // Fold: each prefix gets the allows of every prefix that contains it (itself included).
    let mut folded: BTreeMap<IpNet, Vec<Allow>> = BTreeMap::new();
    for prefix in by_prefix.keys() {
        let allows: Vec<Allow> = by_prefix
            .iter()
            .filter(|(outer, _)| outer.contains(prefix))
            .flat_map(|(_, allows)| allows.iter().copied())
            .collect();
        folded.insert(*prefix, merge(allows));
    }

    // Drop entries that repeat their nearest enclosing entry.
    let redundant: Vec<IpNet> = folded
        .iter()
        .filter(|(prefix, allows)| {
            folded
                .iter()
                .filter(|(outer, _)| *outer != *prefix && outer.contains(*prefix))
                .max_by_key(|(outer, _)| outer.prefix_len())
                .is_some_and(|(_, outer_allows)| outer_allows == *allows)
        })
        .map(|(prefix, _)| *prefix)
        .collect();
    for prefix in redundant {
        folded.remove(&prefix);
    }

    if let Some((prefix, allows)) = folded.iter().find(|(_, a)| a.len() > MAX_ALLOWS) {
        return Err(PolicyError::TooManyAllows {
            prefix: *prefix,
            count: allows.len(),
            max: MAX_ALLOWS,
        });
    }
    Ok(CompiledPolicy::from_sorted_entries(folded))
}

/// Provenance of a compiled allow entry: the indexes (into `rules`) of the rules it came from
/// for a destination `dst` that the trie entry holding `allow` covers. Allows of different rules
/// are never merged, so an entry compiled from `rules` names its one rule ([`Allow::rule`], in
/// canonical order): that rule, if it contains `dst` and has an entry of the same protocol inside
/// `allow`'s range (with its duplicates in `rules`, if any). An entry whose rule index does not
/// fit (one a layout-2 datapath carried over, credited to rule 0, until the first apply) falls
/// back to every rule that could have produced it: the rules containing `dst` with an entry of
/// the same protocol inside `allow`'s range. Empty when no rule produces `allow` (an entry the
/// state does not compile to).
pub fn sources(rules: &[Rule], dst: std::net::IpAddr, allow: &Allow) -> Vec<usize> {
    let produces = |rule: &Rule| {
        rule.covers(&dst)
            && rule.allows().iter().any(|a| {
                a.protocol == allow.protocol
                    && allow.port_lo <= a.port_lo
                    && a.port_hi <= allow.port_hi
            })
    };
    let mut canonical: Vec<&Rule> = rules.iter().collect();
    canonical.sort();
    canonical.dedup();
    if let Some(own) = canonical
        .get(usize::from(allow.rule))
        .filter(|rule| produces(rule))
    {
        return rules
            .iter()
            .enumerate()
            .filter(|(_, rule)| rule == own)
            .map(|(i, _)| i)
            .collect();
    }
    rules
        .iter()
        .enumerate()
        .filter(|(_, rule)| produces(rule))
        .map(|(i, _)| i)
        .collect()
}

/// Canonical form of a set of allows, rule by rule in rule order: per rule, `any` alone if
/// present, else per protocol the union of its port ranges as disjoint, non-adjacent ranges,
/// sorted by (protocol, port).
fn merge(mut allows: Vec<Allow>) -> Vec<Allow> {
    let any: std::collections::BTreeSet<u16> = allows
        .iter()
        .filter(|a| a.protocol == PROTO_ANY)
        .map(|a| a.rule)
        .collect();
    allows.retain(|a| !any.contains(&a.rule) || a.protocol == PROTO_ANY);
    allows.sort_unstable_by_key(|a| (a.rule, a.protocol, a.port_lo, a.port_hi));
    let mut merged: Vec<Allow> = Vec::with_capacity(allows.len());
    for allow in allows {
        match merged.last_mut() {
            Some(last)
                if last.rule == allow.rule
                    && last.protocol == allow.protocol
                    && u32::from(allow.port_lo) <= u32::from(last.port_hi) + 1 =>
            {
                last.port_hi = last.port_hi.max(allow.port_hi);
            }
            _ => merged.push(allow),
        }
    }
    // An entry an earlier rule's entry covers whole is never the first match: it credits no
    // packet and decides none, so it goes.
    let mut kept: Vec<Allow> = Vec::with_capacity(merged.len());
    for allow in merged {
        let covered = kept.iter().any(|k| {
            k.rule < allow.rule
                && (k.protocol == PROTO_ANY || k.protocol == allow.protocol)
                && k.port_lo <= allow.port_lo
                && allow.port_hi <= k.port_hi
        });
        if !covered {
            kept.push(allow);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    /// What the doc of [`Rule`] says a rule takes: the bulk of memory with a policy per peer.
    #[test]
    fn a_rule_takes_40_bytes() {
        assert_eq!(std::mem::size_of::<Rule>(), 40);
    }

    /// Inline or in the heap block, a rule gives back the ranges and `except` it was made with.
    #[test]
    fn a_rule_gives_back_its_ports_and_except() {
        let cidr: IpNet = "10.0.0.0/8".parse().unwrap();
        let holes: Vec<IpNet> = vec!["10.1.0.0/16".parse().unwrap()];
        for n in 0..5u16 {
            let ports: Vec<PortRange> =
                (0..n).map(|i| PortRange::new(i * 10, i * 10 + 5)).collect();
            for except in [vec![], holes.clone()] {
                let rule =
                    Rule::new(cidr, Protocol::Tcp, ports.clone()).with_except(except.clone());
                assert_eq!(
                    rule.ports(),
                    ports.as_slice(),
                    "{n} ranges, except {except:?}"
                );
                assert_eq!(rule.except(), except.as_slice(), "{n} ranges");
            }
        }
    }

    fn net(s: &str) -> IpNet {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    /// The datapath judges a later IPv6 fragment with `PROTO_UNKNOWN`, which only `any`
    /// matches: no rule may compile to an entry with that protocol.
    #[test]
    fn no_rule_compiles_to_the_unknown_protocol() {
        for cidr in ["10.0.0.0/8", "fd00::/8"] {
            for protocol in [Protocol::Any, Protocol::Tcp, Protocol::Udp, Protocol::Icmp] {
                for ports in [vec![], vec![PortRange::single(443)]] {
                    let allows = Rule::new(net(cidr), protocol, ports).allows();
                    assert!(allows
                        .iter()
                        .all(|a| a.protocol != wgfence_common::PROTO_UNKNOWN));
                }
            }
        }
    }

    /// An allow names its own rule (allows of different rules are never merged); one whose
    /// rule index does not fit (a layout-2 entry an upgrade credited to rule 0) names every
    /// rule that could have produced it.
    #[test]
    fn sources_name_the_rule_an_allow_is_credited_to() {
        // Canonical order: 10.0.0.0/8 first, then 10.1.0.0/16.
        let rules = vec![
            tcp("10.0.0.0/8", &[(400, 450)]),
            tcp("10.1.0.0/16", &[(443, 443), (500, 500)]),
        ];
        let compiled = compile(&rules).unwrap();
        let dst = ip("10.1.2.3");
        let (_, allows) = compiled
            .entries()
            .filter(|(prefix, _)| prefix.contains(&dst))
            .max_by_key(|(prefix, _)| prefix.prefix_len())
            .unwrap_or_else(|| panic!("no entry for {dst}"));
        for allow in allows {
            let want = if allow.port_lo == 500 { 1 } else { 0 };
            assert_eq!(sources(&rules, dst, allow), vec![want], "{allow:?}");
        }
        let carried = Allow::new(wgfence_common::PROTO_TCP, 443, 443);
        assert_eq!(carried.rule, 0);
        assert_eq!(sources(&rules, dst, &carried), vec![1]);
    }

    fn tcp(cidr: &str, ports: &[(u16, u16)]) -> Rule {
        let ports = ports
            .iter()
            .map(|&(lo, hi)| PortRange::new(lo, hi))
            .collect();
        Rule::new(net(cidr), Protocol::Tcp, ports)
    }

    #[test]
    fn allows_are_credited_to_the_first_rule_in_canonical_order() {
        // Canonical order: 443 (rule 0), 8000-8100 (1), 8050-8200 (2), 8060-8070 (3). 1 and 2
        // overlap: kept apart, the earlier first; 3, which 1 covers whole, goes.
        let p = compile(&[
            tcp("10.0.0.0/8", &[(8050, 8200)]),
            tcp("10.0.0.0/8", &[(443, 443)]),
            tcp("10.0.0.0/8", &[(8000, 8100)]),
            tcp("10.0.0.0/8", &[(8060, 8070)]),
        ])
        .unwrap();
        let entries: Vec<_> = p.entries().map(|(_, a)| a.to_vec()).collect();
        assert_eq!(
            entries,
            vec![vec![
                Allow::of_rule(0, PROTO_TCP, 443, 443),
                Allow::of_rule(1, PROTO_TCP, 8000, 8100),
                Allow::of_rule(2, PROTO_TCP, 8050, 8200),
            ]]
        );
        // The same in any order.
        let q = compile(&[
            tcp("10.0.0.0/8", &[(8060, 8070)]),
            tcp("10.0.0.0/8", &[(8000, 8100)]),
            tcp("10.0.0.0/8", &[(443, 443)]),
            tcp("10.0.0.0/8", &[(8050, 8200)]),
        ])
        .unwrap();
        assert_eq!(p, q);
    }

    #[test]
    fn overlapping_and_adjacent_port_ranges_merge() {
        let p = compile(&[tcp(
            "10.0.0.0/8",
            &[(443, 443), (8000, 8100), (8050, 8200), (444, 500)],
        )])
        .unwrap();
        let entries: Vec<_> = p.entries().collect();
        assert_eq!(
            entries,
            vec![(
                net("10.0.0.0/8"),
                &[
                    Allow::new(PROTO_TCP, 443, 500),
                    Allow::new(PROTO_TCP, 8000, 8200)
                ][..]
            )]
        );
    }

    #[test]
    fn any_protocol_subsumes_the_rest() {
        let rules = [
            tcp("10.0.0.0/8", &[(22, 22)]),
            Rule::new(net("10.0.0.0/8"), Protocol::Any, vec![]),
        ];
        let p = compile(&rules).unwrap();
        let entries: Vec<_> = p.entries().collect();
        assert_eq!(
            entries,
            vec![(net("10.0.0.0/8"), &[Allow::new(PROTO_ANY, 0, u16::MAX)][..])]
        );
    }

    #[test]
    fn less_specific_prefixes_fold_into_more_specific_ones() {
        let rules = [
            Rule::new(net("0.0.0.0/0"), Protocol::Icmp, vec![]),
            tcp("10.0.0.0/8", &[(443, 443)]),
            Rule::new(
                net("10.1.0.0/16"),
                Protocol::Udp,
                vec![PortRange::single(53)],
            ),
        ];
        let p = compile(&rules).unwrap();
        // 10.1.2.3 matches /16 longest: it keeps ICMP from /0 and TCP 443 from /8.
        assert!(p.permits(ip("10.1.2.3"), PROTO_UDP, Some(53)));
        assert!(p.permits(ip("10.1.2.3"), PROTO_TCP, Some(443)));
        assert!(p.permits(ip("10.1.2.3"), PROTO_ICMP, None));
        assert!(!p.permits(ip("10.1.2.3"), PROTO_TCP, Some(80)));
        // 10.2.0.1 only matches /8 and /0.
        assert!(!p.permits(ip("10.2.0.1"), PROTO_UDP, Some(53)));
        assert!(p.permits(ip("10.2.0.1"), PROTO_TCP, Some(443)));
        // Outside 10/8 only ICMP.
        assert!(p.permits(ip("192.0.2.1"), PROTO_ICMP, None));
        assert!(!p.permits(ip("192.0.2.1"), PROTO_TCP, Some(443)));
        // ICMP rules are per family: no ICMPv6 from an IPv4 rule.
        assert!(!p.permits(ip("fd00::1"), PROTO_ICMPV6, None));
        let v16: Vec<_> = p
            .entries()
            .filter(|(prefix, _)| *prefix == net("10.1.0.0/16"))
            .map(|(_, a)| a.to_vec())
            .collect();
        // Each entry credited to its own rule, in canonical order (/0, /8, /16).
        assert_eq!(
            v16,
            vec![vec![
                Allow::of_rule(0, PROTO_ICMP, 0, u16::MAX),
                Allow::of_rule(1, PROTO_TCP, 443, 443),
                Allow::of_rule(2, PROTO_UDP, 53, 53),
            ]]
        );
    }

    #[test]
    fn a_nested_prefix_that_adds_nothing_is_left_out() {
        let rules = [
            tcp("10.0.0.0/8", &[(1, 1000)]),
            tcp("10.1.0.0/16", &[(80, 80)]),
        ];
        let p = compile(&rules).unwrap();
        assert_eq!(p.len(), 1);
        assert!(p.permits(ip("10.1.0.1"), PROTO_TCP, Some(80)));
    }

    #[test]
    fn except_carves_prefixes_out_as_trie_entries() {
        let rule = tcp("0.0.0.0/0", &[(443, 443)]).with_except(vec![net("10.96.0.0/12")]);
        // One prefix per bit from /0 to /12: the halves that do not hold the hole.
        assert_eq!(rule.pieces().len(), 12);
        let p = compile(&[rule, Rule::new(net("0.0.0.0/0"), Protocol::Icmp, vec![])]).unwrap();
        assert!(p.permits(ip("10.95.255.255"), PROTO_TCP, Some(443)));
        assert!(!p.permits(ip("10.96.0.1"), PROTO_TCP, Some(443)));
        assert!(!p.permits(ip("10.111.255.255"), PROTO_TCP, Some(443)));
        assert!(p.permits(ip("10.112.0.0"), PROTO_TCP, Some(443)));
        // The other rule still covers the hole.
        assert!(p.permits(ip("10.96.0.1"), PROTO_ICMP, Some(8)));
    }

    #[test]
    fn icmp_types_compile_to_ranges_that_only_a_known_type_matches() {
        let rule = Rule::new(
            net("192.0.2.0/24"),
            Protocol::Icmp,
            vec![PortRange::single(8)],
        );
        let p = compile(&[rule]).unwrap();
        assert!(p.permits(ip("192.0.2.1"), PROTO_ICMP, Some(8)));
        assert!(!p.permits(ip("192.0.2.1"), PROTO_ICMP, Some(0)));
        // A type the datapath did not read (a later fragment, an old datapath): dropped.
        assert!(!p.permits(ip("192.0.2.1"), PROTO_ICMP, None));
        // Not a port range for TCP.
        assert!(!p.permits(ip("192.0.2.1"), PROTO_TCP, Some(8)));
    }

    #[test]
    fn host_bits_are_cleared() {
        let p = compile(&[tcp("10.1.2.3/8", &[])]).unwrap();
        assert_eq!(
            p.entries().map(|(n, _)| n).collect::<Vec<_>>(),
            vec![net("10.0.0.0/8")]
        );
    }

    #[test]
    fn only_port_less_entries_match_unknown_ports() {
        let p = compile(&[tcp("10.0.0.0/8", &[(443, 443)]), tcp("10.9.0.0/16", &[])]).unwrap();
        assert!(!p.permits(ip("10.1.0.1"), PROTO_TCP, None));
        assert!(p.permits(ip("10.9.0.1"), PROTO_TCP, None));
    }

    #[test]
    fn too_many_allows_for_one_prefix_is_an_error() {
        let ports: Vec<(u16, u16)> = (0..=MAX_ALLOWS as u16)
            .map(|i| (i * 10 + 1, i * 10 + 1))
            .collect();
        let err = compile(&[tcp("10.0.0.0/8", &ports)]);
        assert_eq!(
            err,
            Err(PolicyError::TooManyAllows {
                prefix: net("10.0.0.0/8"),
                count: MAX_ALLOWS + 1,
                max: MAX_ALLOWS
            })
        );
    }

    #[test]
    fn order_of_rules_does_not_matter() {
        let mut rules = vec![
            Rule::new(net("0.0.0.0/0"), Protocol::Icmp, vec![]),
            tcp("10.0.0.0/8", &[(443, 443), (8000, 8100)]),
            Rule::new(net("fd00::/8"), Protocol::Any, vec![]),
            Rule::new(
                net("10.1.0.0/16"),
                Protocol::Udp,
                vec![PortRange::single(53)],
            ),
        ];
        let a = compile(&rules);
        rules.reverse();
        assert_eq!(a, compile(&rules));
        rules.swap(0, 2);
        assert_eq!(a, compile(&rules));
    }

    #[test]
    fn value_holds_the_allows_in_order() {
        let allows = [Allow::new(PROTO_TCP, 1, 2), Allow::new(PROTO_UDP, 3, 4)];
        let v = CompiledPolicy::value(&allows);
        assert_eq!(v.count, 2);
        assert_eq!(v.allows(), &allows);
    }
}

#[cfg(test)]
mod properties {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    use ipnet::{Ipv4Net, Ipv6Net};
    use proptest::prelude::*;

    use super::*;

    /// The meaning of a rule set, straight from the schema: a packet passes if any rule matches.
    fn reference(rules: &[Rule], dst: IpAddr, protocol: u8, port: Option<u16>) -> bool {
        rules.iter().any(|r| {
            let proto_ok = match r.protocol {
                Protocol::Any => true,
                Protocol::Tcp => protocol == PROTO_TCP,
                Protocol::Udp => protocol == PROTO_UDP,
                Protocol::Icmp => {
                    protocol
                        == if dst.is_ipv4() {
                            PROTO_ICMP
                        } else {
                            PROTO_ICMPV6
                        }
                }
            };
            // Ports of TCP/UDP, types of ICMP: unknown (None) matches only a rule without.
            let port_ok = match (r.protocol, port) {
                (Protocol::Tcp | Protocol::Udp | Protocol::Icmp, Some(p)) => {
                    r.ports().is_empty() || r.ports().iter().any(|x| x.lo <= p && p <= x.hi)
                }
                (Protocol::Tcp | Protocol::Udp | Protocol::Icmp, None) => r.ports().is_empty(),
                _ => true,
            };
            r.cidr.contains(&dst)
                && !r.except().iter().any(|e| e.contains(&dst))
                && proto_ok
                && port_ok
        })
    }

    // Small address spaces so that prefixes nest and destinations hit them often.
    fn v4_net() -> impl Strategy<Value = IpNet> {
        (0u8..4, 0u8..4, 0u8..=32).prop_map(|(a, b, len)| {
            let addr = Ipv4Addr::new(10, a, b, a ^ b);
            IpNet::V4(Ipv4Net::new(addr, len).unwrap().trunc())
        })
    }

    fn v6_net() -> impl Strategy<Value = IpNet> {
        (0u16..4, 0u16..4, 0u8..=128).prop_map(|(a, b, len)| {
            let addr = Ipv6Addr::new(0xfd00, a, b, 0, 0, 0, 0, a ^ b);
            IpNet::V6(Ipv6Net::new(addr, len).unwrap().trunc())
        })
    }

    fn rule() -> impl Strategy<Value = Rule> {
        let protocol = prop_oneof![
            Just(Protocol::Any),
            Just(Protocol::Tcp),
            Just(Protocol::Udp),
            Just(Protocol::Icmp)
        ];
        let range = (1u16..40, 0u16..10).prop_map(|(lo, len)| PortRange::new(lo, lo + len));
        (
            prop_oneof![v4_net(), v6_net()],
            protocol,
            // Up to three ranges: two are held inline, a third moves them all to the heap.
            prop::collection::vec(range, 0..4),
            prop::collection::vec((any::<u128>(), 0u8..=16), 0..3),
        )
            .prop_map(|(cidr, protocol, ports, holes)| {
                // Ports for TCP/UDP, types (the same small numbers) for ICMP.
                let ports = match protocol {
                    Protocol::Tcp | Protocol::Udp | Protocol::Icmp => ports,
                    Protocol::Any => vec![],
                };
                // Holes strictly inside the cidr: its bits, then random ones, a few bits longer.
                let except: Vec<IpNet> = holes
                    .into_iter()
                    .filter_map(|(bits, extra)| hole(cidr, bits, extra))
                    .collect();
                Rule::new(cidr, protocol, ports).with_except(except)
            })
    }

    /// A prefix `1 + extra` bits longer than `cidr` inside it, if `cidr` has room.
    fn hole(cidr: IpNet, bits: u128, extra: u8) -> Option<IpNet> {
        match cidr {
            IpNet::V4(n) => {
                let len = n.prefix_len().checked_add(1 + extra % 8)?.min(32);
                if len <= n.prefix_len() {
                    return None;
                }
                let host =
                    (bits as u32) & (u32::MAX.checked_shr(u32::from(n.prefix_len())).unwrap_or(0));
                let addr = Ipv4Addr::from(u32::from(n.network()) | host);
                Some(IpNet::V4(Ipv4Net::new(addr, len).ok()?.trunc()))
            }
            IpNet::V6(n) => {
                let len = n.prefix_len().checked_add(1 + extra)?.min(128);
                if len <= n.prefix_len() {
                    return None;
                }
                let host = bits
                    & (u128::MAX
                        .checked_shr(u32::from(n.prefix_len()))
                        .unwrap_or(0));
                let addr = Ipv6Addr::from(u128::from(n.network()) | host);
                Some(IpNet::V6(Ipv6Net::new(addr, len).ok()?.trunc()))
            }
        }
    }

    fn packet() -> impl Strategy<Value = (IpAddr, u8, Option<u16>)> {
        let dst = prop_oneof![
            (0u8..4, 0u8..4, any::<u8>())
                .prop_map(|(a, b, c)| IpAddr::V4(Ipv4Addr::new(10, a, b, c))),
            any::<u32>().prop_map(|x| IpAddr::V4(Ipv4Addr::from(x))),
            (0u16..4, 0u16..4, any::<u16>())
                .prop_map(|(a, b, c)| IpAddr::V6(Ipv6Addr::new(0xfd00, a, b, 0, 0, 0, 0, c))),
        ];
        let protocol = prop_oneof![
            Just(PROTO_TCP),
            Just(PROTO_UDP),
            Just(PROTO_ICMP),
            Just(PROTO_ICMPV6),
            Just(47u8)
        ];
        let port = prop_oneof![Just(None), (0u16..60).prop_map(Some)];
        (dst, protocol, port).prop_map(|(dst, protocol, port)| {
            // TCP and UDP carry a port the datapath reads, ICMP a type (the same small
            // numbers here); nothing else does.
            let carries = matches!(protocol, PROTO_TCP | PROTO_UDP | PROTO_ICMP | PROTO_ICMPV6);
            (dst, protocol, if carries { port } else { None })
        })
    }

    proptest! {
        #[test]
        fn compiled_policy_decides_like_the_rules(
            rules in prop::collection::vec(rule(), 1..8),
            packets in prop::collection::vec(packet(), 64),
        ) {
            let Ok(compiled) = compile(&rules) else { return Ok(()) };
            for (dst, protocol, port) in packets {
                prop_assert_eq!(
                    compiled.permits(dst, protocol, port),
                    reference(&rules, dst, protocol, port),
                    "dst {} protocol {} port {:?}", dst, protocol, port
                );
            }
        }

        /// An entry allows at least what every broader entry of its policy allows. The
        /// datapath's trie per policy relies on it: while a trie misses some of its entries
        /// (drift being repaired), a packet's longest match among the rest allows no more than
        /// its longest match among all would.
        #[test]
        fn an_entry_allows_what_every_broader_one_allows(
            rules in prop::collection::vec(rule(), 1..8),
        ) {
            let Ok(compiled) = compile(&rules) else { return Ok(()) };
            let entries: Vec<_> = compiled.entries().collect();
            for (broad, broad_allows) in &entries {
                for (narrow, narrow_allows) in &entries {
                    if broad == narrow || !broad.contains(narrow) {
                        continue;
                    }
                    for a in broad_allows.iter() {
                        for protocol in [a.protocol, PROTO_TCP, PROTO_UDP, PROTO_ICMP, 47] {
                            for port in [None, Some(a.port_lo), Some(a.port_hi)] {
                                if a.matches(protocol, port) {
                                    prop_assert!(
                                        narrow_allows.iter().any(|n| n.matches(protocol, port)),
                                        "{} allows protocol {} port {:?}, {} within it not",
                                        broad, protocol, port, narrow
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }

        #[test]
        fn compiled_policy_does_not_depend_on_rule_order(
            rules in prop::collection::vec(rule(), 1..8),
            seed in any::<u64>(),
        ) {
            let mut shuffled = rules.clone();
            // A deterministic shuffle from the seed.
            let n = shuffled.len();
            for i in (1..n).rev() {
                let j = (seed.rotate_left(i as u32) % (i as u64 + 1)) as usize;
                shuffled.swap(i, j);
            }
            prop_assert_eq!(compile(&rules), compile(&shuffled));
        }

        /// However a rule is held (ports inline or not, with or without `except`), it is the
        /// rule its fields say: equal, ordered and hashed as (cidr, protocol, ports, except),
        /// the canonical order the rule counters are indexed by. Compared with rules that
        /// differ from it in one field only, as two random rules seldom do.
        #[test]
        fn a_rule_is_its_fields(a in rule(), b in rule()) {
            let fields = |r: &Rule| (r.cidr, r.protocol, r.ports().to_vec(), r.except().to_vec());
            let hash = |r: &Rule| {
                use std::hash::{BuildHasher, BuildHasherDefault};
                BuildHasherDefault::<std::hash::DefaultHasher>::default().hash_one(r)
            };
            let (ports, except) = (a.ports().to_vec(), a.except().to_vec());
            let near = [
                Rule::new(a.cidr, a.protocol, ports.clone()).with_except(except.clone()),
                Rule::new(a.cidr, a.protocol, ports.clone()),
                Rule::new(a.cidr, a.protocol, b.ports().to_vec()).with_except(except.clone()),
                Rule::new(a.cidr, b.protocol, ports).with_except(except),
                b.clone(),
            ];
            for other in &near {
                prop_assert_eq!(a.cmp(other), fields(&a).cmp(&fields(other)));
                prop_assert_eq!(a == *other, fields(&a) == fields(other));
                if a == *other {
                    prop_assert_eq!(hash(&a), hash(other));
                }
            }
        }

        /// Entry by entry, as the view of the kernel is written, the flat policy holds what a
        /// map of prefixes to allows holds, and answers each write as the map would.
        #[test]
        fn entry_writes_match_a_map_of_prefixes(
            writes in prop::collection::vec((0u8..6, 0usize..4, any::<bool>()), 0..40),
        ) {
            let prefix = |i: u8| IpNet::from(Ipv4Net::new(Ipv4Addr::new(10, i, 0, 0), 16).unwrap());
            let mut policy = CompiledPolicy::default();
            let mut model: BTreeMap<IpNet, Vec<Allow>> = BTreeMap::new();
            for (step, (i, n, remove)) in writes.into_iter().enumerate() {
                if remove {
                    prop_assert_eq!(policy.remove_entry(&prefix(i)), model.remove(&prefix(i)));
                } else {
                    let allows: Vec<Allow> = (0..n)
                        .map(|k| Allow::of_rule(step as u16, PROTO_TCP, k as u16, k as u16))
                        .collect();
                    prop_assert_eq!(
                        policy.insert_entry(prefix(i), allows.clone()),
                        model.insert(prefix(i), allows)
                    );
                }
                prop_assert_eq!(&policy, &CompiledPolicy::from_entries(model.clone()));
                prop_assert_eq!(policy.has_entry(&prefix(i)), model.contains_key(&prefix(i)));
            }
        }
    }
}
