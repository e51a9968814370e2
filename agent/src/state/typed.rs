//! The typed pass over a state file: deserialize into structs that borrow from the text, then
//! validate, without a JSON value tree. It only ever answers "this is the state" or "ask the
//! value-tree walk": every check is the walk's own (the helpers in the parent module), and any
//! doubt (a type, an unknown or repeated field, a failed check) is handed over to it, so the
//! walk stays the one place that decides what is an error and says so.

use std::{
    borrow::Cow,
    collections::{BTreeSet, HashMap, HashSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;
use serde::{
    de::{self, Visitor},
    Deserialize, Deserializer,
};
use serde_json::value::RawValue;
use wgfence_common::{MAX_PEERS, MAX_POLICY_ENTRIES};

use super::{
    keepalive, parse_endpoint, parse_start_time, parse_time, port_number, port_text,
    protocol_named, scan, share, trie_entries, unique_keys, usable_tunnel_addr, valid_name,
    window_error, Compiled, DesiredState, Mode, PeerSpec, Shared, WgKey, Window,
    MAX_RULES_PER_PEER, SCHEMA_VERSION,
};
use crate::policy::{PortRange, Protocol, Rule};

/// A JSON string, borrowed from the text unless it has escapes.
pub(super) struct Str<'a>(pub Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StrVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for StrVisitor<'a> {
            type Value = Str<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(StrVisitor(std::marker::PhantomData))
    }
}

/// An entry of `ports`: a number or a string (`"443"`, `"8000-8100"`).
enum Port<'a> {
    Number(u64),
    Text(Str<'a>),
}

impl<'de: 'a, 'a> Deserialize<'de> for Port<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct PortVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for PortVisitor<'a> {
            type Value = Port<'a>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a port number or a \"lo-hi\" string")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Port::Number(v))
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Port::Text(Str(Cow::Borrowed(v))))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Port::Text(Str(Cow::Owned(v.to_owned()))))
            }
        }
        deserializer.deserialize_any(PortVisitor(std::marker::PhantomData))
    }
}

/// `T`, deserialized only from a JSON object. serde's derived structs also accept a positional
/// array (`[1, null, []]` would be a state with no field names to check), which the schema and
/// the walk do not.
pub(super) struct Obj<T>(pub T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Obj<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjVisitor<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjVisitor<T> {
            type Value = Obj<T>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Obj)
            }
        }
        deserializer.deserialize_map(ObjVisitor(std::marker::PhantomData))
    }
}

/// An optional field: absent is `None`, and `null` is not a value (serde's `Option` would take
/// it as absent), so it fails here and the walk names it.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawState<'a> {
    version: u64,
    #[serde(default, deserialize_with = "present")]
    pub replies: Option<bool>,
    #[serde(borrow)]
    pub peers: Vec<Obj<RawPeer<'a>>>,
    /// Policy tests: parsed by the walk's own parser (they are few).
    #[serde(borrow, default, deserialize_with = "present")]
    pub tests: Option<&'a RawValue>,
}

/// A peer's rules as their texts, in the file's order.
pub(super) type RuleTexts<'a> = smallvec::SmallVec<[&'a str; 4]>;

/// An `egress` array: each rule's text, as serde_json reads a raw value (the value's bytes,
/// without the whitespace around it).
fn rule_texts<'de: 'a, 'a, D: Deserializer<'de>>(d: D) -> Result<Option<RuleTexts<'a>>, D::Error> {
    let raw = smallvec::SmallVec::<[&'de RawValue; 4]>::deserialize(d)?;
    let text = |rule: &'de RawValue| -> &'a str { rule.get() };
    Ok(Some(raw.into_iter().map(text).collect()))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawPeer<'a> {
    #[serde(borrow)]
    pub(super) name: Str<'a>,
    #[serde(borrow)]
    pub(super) public_key: Str<'a>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) address: Option<Str<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) address_v6: Option<Str<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) endpoint: Option<Str<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) preshared_key: Option<Str<'a>>,
    #[serde(default, deserialize_with = "present")]
    pub(super) persistent_keepalive: Option<u64>,
    /// Each rule kept as its text: peers that share a policy usually carry the same rules
    /// (in some order), which are then parsed, validated and compiled once. Inline for a few
    /// rules: a heap allocation per peer, freed by the next push, left glibc's allocator a
    /// fastbin of 131,072 chunks to consolidate inside the next plan (milliseconds).
    #[serde(borrow, default, deserialize_with = "rule_texts")]
    pub(super) egress: Option<RuleTexts<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) mode: Option<Str<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) not_before: Option<Str<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    pub(super) expires: Option<Str<'a>>,
}

impl RawPeer<'_> {
    /// Feeds what decides the peer's spec to `feed` (each piece tagged, lengths first, so that
    /// different peers feed different sequences): its fields, and the sum of its rules' hashes,
    /// since rules are a set (`rule_hash` hashes a rule's text).
    pub(super) fn feed(&self, feed: &mut impl FnMut(&[u8]), rule_hash: impl Fn(&str) -> u128) {
        let mut text = |tag: u8, value: Option<&Str<'_>>| match value {
            Some(v) => {
                feed(&[tag]);
                feed(&v.0.len().to_le_bytes());
                feed(v.0.as_bytes());
            }
            None => feed(&[tag | 0x80]),
        };
        text(1, Some(&self.name));
        text(2, Some(&self.public_key));
        text(3, self.address.as_ref());
        text(4, self.address_v6.as_ref());
        text(5, self.endpoint.as_ref());
        text(6, self.preshared_key.as_ref());
        text(9, self.mode.as_ref());
        text(10, self.not_before.as_ref());
        text(11, self.expires.as_ref());
        match self.persistent_keepalive {
            Some(secs) => {
                feed(&[7]);
                feed(&secs.to_le_bytes());
            }
            None => feed(&[7 | 0x80]),
        }
        match &self.egress {
            Some(rules) => {
                // A multiset hash: the sum of the rules' hashes, whatever their order.
                let sum = rules
                    .iter()
                    .fold(0u128, |sum, r| sum.wrapping_add(rule_hash(r)));
                feed(&[8]);
                feed(&rules.len().to_le_bytes());
                feed(&sum.to_le_bytes());
            }
            None => feed(&[8 | 0x80]),
        }
    }

    pub(super) fn name(&self) -> &str {
        &self.name.0
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule<'a> {
    #[serde(borrow)]
    cidr: Str<'a>,
    #[serde(borrow, default, deserialize_with = "present")]
    protocol: Option<Str<'a>>,
    #[serde(borrow, default, deserialize_with = "present")]
    ports: Option<Vec<Port<'a>>>,
    #[serde(borrow, default, deserialize_with = "present")]
    types: Option<Vec<Port<'a>>>,
    #[serde(borrow, default, deserialize_with = "present")]
    except: Option<Vec<Str<'a>>>,
}

/// The top level of a state file, with where each peer's text starts and what the caller
/// made of its fields (borrowed, not validated).
pub(super) struct Top<T> {
    pub replies: Option<bool>,
    /// Each peer's offset in the text, and what `read` made of it, in file order.
    pub peers: Vec<(usize, T)>,
    /// The offset of the `]` that closes `peers`.
    pub end: usize,
}

/// The top level of `text`; `None` if it is not what a valid state file has there, or if it
/// has policy tests (the full parse runs them). One pass: each value is read where it starts,
/// so that each peer's offset is known, and each peer's fields are handed to `read` as they
/// are read (only what it keeps of them is held for the whole file).
pub(super) fn top<'a, T>(text: &'a str, mut read: impl FnMut(RawPeer<'a>) -> T) -> Option<Top<T>> {
    let mut at = Cursor { text, at: 0 };
    at.ws();
    at.expect(b'{')?;
    let (mut version, mut replies, mut peers) = (None, None, None);
    loop {
        at.ws();
        let Str(key) = at.value::<Str<'_>>()?;
        at.ws();
        at.expect(b':')?;
        at.ws();
        match key.as_ref() {
            "version" if version.is_none() => version = Some(at.value::<u64>()?),
            "replies" if replies.is_none() => replies = Some(at.value::<bool>()?),
            "peers" if peers.is_none() => peers = Some(at.peers(&mut read)?),
            // Tests, a field repeated or unknown: the full parse decides.
            _ => return None,
        }
        at.ws();
        match at.next()? {
            b',' => {}
            b'}' => break,
            _ => return None,
        }
    }
    at.ws();
    let (peers, end) = peers?;
    (at.at == text.len() && version? == SCHEMA_VERSION && peers.len() <= MAX_PEERS as usize)
        .then_some(Top {
            replies,
            peers,
            end,
        })
}

/// A position in a state file's text, read forward.
pub(super) struct Cursor<'a> {
    pub text: &'a str,
    pub at: usize,
}

impl<'a> Cursor<'a> {
    /// Skips JSON whitespace.
    pub fn ws(&mut self) {
        let bytes = self.text.as_bytes();
        while matches!(bytes.get(self.at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// The next byte, taken.
    pub fn next(&mut self) -> Option<u8> {
        let byte = *self.text.as_bytes().get(self.at)?;
        self.at += 1;
        Some(byte)
    }

    pub fn expect(&mut self, byte: u8) -> Option<()> {
        (self.next()? == byte).then_some(())
    }

    /// One JSON value, read where the cursor is.
    fn value<T: Deserialize<'a>>(&mut self) -> Option<T> {
        let mut values =
            serde_json::Deserializer::from_str(self.text.get(self.at..)?).into_iter::<T>();
        let value = values.next()?.ok()?;
        self.at += values.byte_offset();
        Some(value)
    }

    /// One peer object, read where the cursor is: by [`scan::peer`] where it can, else by
    /// serde_json (which decides what the scan leaves).
    pub fn peer(&mut self) -> Option<RawPeer<'a>> {
        if let Some((peer, end)) = scan::peer(self.text, self.at) {
            self.at = end;
            return Some(peer);
        }
        self.value::<Obj<RawPeer<'a>>>().map(|Obj(peer)| peer)
    }

    /// The peers of the array that starts at the cursor (its `[`), and the offset of its `]`.
    fn peers<T>(
        &mut self,
        read: &mut impl FnMut(RawPeer<'a>) -> T,
    ) -> Option<(Vec<(usize, T)>, usize)> {
        self.expect(b'[')?;
        self.ws();
        let mut peers = Vec::new();
        if self.text.as_bytes().get(self.at) == Some(&b']') {
            self.at += 1;
            return Some((peers, self.at - 1));
        }
        loop {
            let at = self.at;
            peers.push((at, read(self.peer()?)));
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b']' => return Some((peers, self.at - 1)),
                _ => return None,
            }
        }
    }

    /// The peers from the cursor, where a peer starts, up to `until`: where the next peer
    /// starts or, with `closes`, where the array's `]` is. `first`: the cursor is at the
    /// array's first element (after `[`, not after a comma). `None` unless the text from the
    /// cursor to `until` is exactly that: values, each followed by a comma, or by the `]` at
    /// `until` for the last one.
    pub fn run(
        &mut self,
        until: usize,
        closes: bool,
        first: bool,
    ) -> Option<Vec<(usize, RawPeer<'a>)>> {
        let mut peers = Vec::new();
        // Whitespace before the first peer is the separator's (a peer's offset is its `{`).
        self.ws();
        if self.at > until {
            return None;
        }
        // Nothing between: the array goes on (a peer follows), or it ends right after `[`.
        if self.at == until {
            return (!closes || first).then_some(peers);
        }
        loop {
            peers.push((self.at, self.peer()?));
            self.ws();
            match self.next()? {
                b',' => {
                    self.ws();
                    if self.at == until && !closes {
                        return Some(peers);
                    }
                }
                b']' if closes && self.at - 1 == until => return Some(peers),
                _ => return None,
            }
            if self.at >= until {
                return None;
            }
        }
    }
}

/// One peer, validated alone: its spec, if it is valid on its own; `None` if anything is wrong
/// or unusual (the walk decides then).
pub(super) fn one_peer<'a>(
    raw: &RawPeer<'a>,
    egress: &mut Egress<'a>,
    compiled: &mut Compiled,
) -> Option<PeerSpec> {
    peer(raw, egress, compiled)
}

/// The state, if `text` is a valid state file; `None` if anything is wrong or unusual.
pub(super) fn parse(text: &str) -> Option<DesiredState> {
    let Obj(raw) = serde_json::from_str::<Obj<RawState<'_>>>(text).ok()?;
    if raw.version != SCHEMA_VERSION || raw.peers.len() > MAX_PEERS as usize {
        return None;
    }
    let mut compiled: Compiled = HashMap::new();
    let mut egress: Egress<'_> = HashMap::new();
    let mut names: HashSet<&str> = HashSet::with_capacity(raw.peers.len());
    let mut keys: HashSet<WgKey> = HashSet::with_capacity(raw.peers.len());
    let mut addrs: HashSet<IpAddr> = HashSet::with_capacity(raw.peers.len() * 2);
    let mut peers = Vec::with_capacity(raw.peers.len());
    for Obj(raw_peer) in &raw.peers {
        let peer = peer(raw_peer, &mut egress, &mut compiled)?;
        let unique = names.insert(raw_peer.name.0.as_ref())
            && keys.insert(peer.public_key)
            && peer.addrs().all(|addr| addrs.insert(addr));
        if !unique {
            return None;
        }
        peers.push(peer);
    }
    let (v4_entries, v6_entries) = trie_entries(&compiled);
    if v4_entries.max(v6_entries) > MAX_POLICY_ENTRIES as usize {
        return None;
    }
    let tests = match raw.tests {
        Some(text) => {
            // A JSON value keeps the last of a repeated key, where the derived structs above
            // refuse one: the tree walk names it.
            if unique_keys::first_repeated(text.get()).is_some() {
                return None;
            }
            let value = serde_json::from_str(text.get()).ok()?;
            super::assertions::parse_tests(&value).ok()?
        }
        None => Vec::new(),
    };
    peers.sort_by(|a, b| a.name.cmp(&b.name));
    Some(DesiredState {
        peers,
        replies: raw.replies.unwrap_or(true),
        tests,
    })
}

/// The rules and compiled policy of each distinct `egress` seen, by its rules' texts (sorted).
pub(super) type Egress<'a> = HashMap<Vec<&'a str>, Shared>;

fn peer<'a>(
    raw: &RawPeer<'a>,
    egress: &mut Egress<'a>,
    compiled: &mut Compiled,
) -> Option<PeerSpec> {
    let name = &raw.name.0;
    if !valid_name(name) {
        return None;
    }
    let public_key = WgKey::from_base64(&raw.public_key.0)?;
    let preshared_key = match &raw.preshared_key {
        Some(key) => Some(WgKey::from_base64(&key.0)?),
        None => None,
    };
    let address = match &raw.address {
        Some(a) => Some(addr::<Ipv4Addr>(&a.0)?),
        None => None,
    };
    let address_v6 = match &raw.address_v6 {
        Some(a) => Some(addr::<Ipv6Addr>(&a.0)?),
        None => None,
    };
    if address.is_none() && address_v6.is_none() {
        return None;
    }
    let endpoint = match &raw.endpoint {
        Some(ep) => Some(parse_endpoint(&ep.0)?),
        None => None,
    };
    let persistent_keepalive = match raw.persistent_keepalive {
        Some(secs) => keepalive(secs)?,
        None => None,
    };
    let mode = match &raw.mode {
        Some(m) => Mode::from_name(&m.0)?,
        None => Mode::Enforce,
    };
    let window = window(raw)?;
    let (rules, policy) = shared_egress(raw, egress, compiled)?.unzip();
    let (preshared_key, window) = PeerSpec::rare(preshared_key, window);
    Some(PeerSpec {
        name: compact_str::CompactString::from(name.as_ref()),
        public_key,
        address,
        address_v6,
        endpoint,
        preshared_key,
        persistent_keepalive,
        rules,
        policy,
        mode,
        window,
    })
}

/// The peer's `notBefore` and `expires`, if they are times and make a window.
fn window(raw: &RawPeer<'_>) -> Option<Window> {
    let time = |t: &Option<Str<'_>>, parse: fn(&str) -> Result<u64, String>| match t {
        Some(t) => parse(&t.0).ok().map(Some),
        None => Some(None),
    };
    let window = Window {
        not_before: time(&raw.not_before, parse_start_time)?,
        expires: time(&raw.expires, parse_time)?,
    };
    if window_error(&window).is_some() {
        return None;
    }
    Some(window)
}

/// The peer's rules and compiled policy (`Some(None)`: no `egress`, unrestricted), shared with
/// every peer whose `egress` has the same rules' texts; `None`: rules this pass does not take.
fn shared_egress<'a>(
    raw: &RawPeer<'a>,
    egress: &mut Egress<'a>,
    compiled: &mut Compiled,
) -> Option<Shared> {
    let Some(list) = &raw.egress else {
        return Some(None);
    };
    // The rules' order does not matter: a set.
    let mut texts: Vec<&'a str> = list.to_vec();
    texts.sort_unstable();
    match egress.get(&texts) {
        Some(shared) => Some(shared.clone()),
        None => {
            let shared = rules(&texts, compiled)?;
            egress.insert(texts, shared.clone());
            Some(shared)
        }
    }
}

/// An `egress` array, its rules' texts: its canonical rule set and compiled policy (`[]`:
/// allowed nothing).
fn rules(texts: &[&str], compiled: &mut Compiled) -> Option<Shared> {
    if texts.len() > MAX_RULES_PER_PEER {
        return None;
    }
    let mut set = BTreeSet::new();
    for text in texts {
        let Obj(r) = serde_json::from_str::<Obj<RawRule<'_>>>(text).ok()?;
        set.insert(rule(&r)?);
    }
    share(Some(set.into_iter().collect()), compiled).ok()
}

fn addr<A>(s: &str) -> Option<A>
where
    A: std::str::FromStr + Into<IpAddr> + Copy,
{
    s.parse::<A>()
        .ok()
        .filter(|a| usable_tunnel_addr((*a).into()))
}

fn rule(raw: &RawRule<'_>) -> Option<Rule> {
    let cidr = raw
        .cidr
        .0
        .parse::<IpNet>()
        .ok()
        .filter(|n| n.trunc() == *n)?;
    let protocol = match &raw.protocol {
        Some(name) => protocol_named(&name.0)?,
        None => Protocol::Any,
    };
    let mut ports: Vec<PortRange> = Vec::new();
    if let Some(list) = &raw.ports {
        if list.is_empty() || matches!(protocol, Protocol::Any | Protocol::Icmp) {
            return None;
        }
        ports.reserve(list.len());
        for port in list {
            ports.push(match port {
                Port::Number(v) => PortRange::single(port_number(*v).ok()?),
                Port::Text(s) => port_text(&s.0).ok()?,
            });
        }
        ports.sort_unstable();
        ports.dedup();
    }
    if let Some(list) = &raw.types {
        if list.is_empty() || protocol != Protocol::Icmp {
            return None;
        }
        let v6 = matches!(cidr, IpNet::V6(_));
        for ty in list {
            ports.push(match ty {
                Port::Number(v) => crate::policy::icmp_types(None, Some(*v), v6).ok()?,
                Port::Text(s) => crate::policy::icmp_types(Some(&s.0), None, v6).ok()?,
            });
        }
        ports.sort_unstable();
        ports.dedup();
    }
    let mut except = Vec::new();
    if let Some(list) = &raw.except {
        for net in list {
            except.push(net.0.parse::<IpNet>().ok()?);
        }
        crate::policy::check_except(cidr, &except).ok()?;
    }
    Some(Rule::new(cidr, protocol, ports).with_except(except))
}
