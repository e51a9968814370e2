//! The state file (schema version 1): parsing, validation, and the canonical [`DesiredState`].
//!
//! Validation collects every error it finds, each naming the peer and the field, and rejects
//! the whole state if there is any: nothing is ever half-applied. The result does not depend
//! on the order of peers or of rules: peers are sorted by name and rules are a sorted set.

pub mod assertions;
#[cfg(any(test, feature = "testing"))]
pub mod edits;
mod pipeline;
mod scan;
pub mod source_map;
mod splice;
mod tree;
mod typed;
mod unique_keys;

pub use pipeline::{Changes, Fingerprint, Pipeline, Rejection, StateBytes};
pub use tree::parse_value_tree;

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    sync::Arc,
};

use ipnet::IpNet;
#[cfg(any(test, feature = "testing"))]
use serde_json::{Map, Value};

use crate::policy::{compile, CompiledPolicy, PolicyError, PortRange, Protocol, Rule};
pub use assertions::PolicyTest;

/// The schema version this agent reads.
pub const SCHEMA_VERSION: u64 = 1;
/// Rules one peer may have.
pub const MAX_RULES_PER_PEER: usize = 1024;
/// Longest peer name (also used as a metrics label).
pub const MAX_NAME_LEN: usize = 253;

/// A WireGuard key (public or preshared): 32 bytes, shown as base64.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WgKey(pub [u8; 32]);

impl WgKey {
    pub fn from_base64(s: &str) -> Option<Self> {
        wireguard_control::Key::from_base64(s.trim())
            .ok()
            .map(|k| Self(k.0))
    }

    pub fn to_base64(&self) -> String {
        wireguard_control::Key(self.0).to_base64()
    }
}

impl fmt::Display for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

impl fmt::Debug for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "WgKey({self})")
    }
}

/// One peer of the desired state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSpec {
    /// Held inline up to 24 bytes: most names take no heap block.
    pub name: compact_str::CompactString,
    pub public_key: WgKey,
    pub address: Option<Ipv4Addr>,
    pub address_v6: Option<Ipv6Addr>,
    pub endpoint: Option<SocketAddr>,
    /// Boxed, as `window` is: few peers have one, and held inline its 33 bytes would be paid
    /// by every peer ([`PeerSpec::preshared_key`]).
    preshared_key: Option<Box<WgKey>>,
    /// Seconds; `None` (or 0 in the file) is off.
    pub persistent_keepalive: Option<u16>,
    /// Canonical rule set (sorted, deduplicated), shared by the peers that have the same set.
    /// `None`: no `egress`, unrestricted; `Some` of no rules: `"egress": []`, allowed nothing.
    pub rules: Option<Arc<Vec<Rule>>>,
    /// The compiled rules, shared by peers with the same rule set; `None`: unrestricted
    /// (exactly when `rules` is `None`).
    pub policy: Option<Arc<CompiledPolicy>>,
    /// `"mode"`: enforce (the default) or audit (denied packets pass, counted as would-drops).
    pub mode: Mode,
    /// `"notBefore"` and `"expires"` (RFC 3339, UTC): the peer's packets pass only from
    /// `not_before` until before `expires`; `expires` > `not_before` when both are given.
    /// `None` for no window ([`PeerSpec::window`]).
    window: Option<Box<Window>>,
}

/// What a peer's policy does with a packet it denies.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// Drop it.
    #[default]
    Enforce,
    /// Let it pass, count it as a would-drop and report it (`wgfence monitor`: AUDIT).
    Audit,
}

impl Mode {
    pub const fn name(self) -> &'static str {
        match self {
            Mode::Enforce => "enforce",
            Mode::Audit => "audit",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "enforce" => Some(Mode::Enforce),
            "audit" => Some(Mode::Audit),
            _ => None,
        }
    }
}

/// A peer's access window, in wall-clock time (seconds since the Unix epoch, UTC). Neither
/// bound: no window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Window {
    pub not_before: Option<u64>,
    pub expires: Option<u64>,
}

impl Window {
    pub const fn is_some(&self) -> bool {
        self.not_before.is_some() || self.expires.is_some()
    }

    /// Whether the whole window lies before `now` (seconds since the epoch).
    pub fn is_past(&self, now: u64) -> bool {
        self.expires.is_some_and(|e| e <= now)
    }
}

/// An RFC 3339 time in UTC (`2026-12-04T17:00:00Z`, fractions of a second allowed) as seconds
/// since the Unix epoch, rounded down: an `expires` (a window closes no later than written).
pub fn parse_time(text: &str) -> Result<u64, String> {
    since_epoch(text).map(|d| d.as_secs())
}

/// As [`parse_time`], rounded up: a `notBefore` (a window opens no earlier than written).
pub fn parse_start_time(text: &str) -> Result<u64, String> {
    since_epoch(text).map(|d| d.as_secs() + u64::from(d.subsec_nanos() != 0))
}

fn since_epoch(text: &str) -> Result<std::time::Duration, String> {
    let t = humantime::parse_rfc3339(text).map_err(|e| {
        format!("{text:?} is not an RFC 3339 time in UTC such as 2026-12-04T17:00:00Z ({e})")
    })?;
    t.duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| format!("{text:?} is before 1970"))
}

/// Seconds since the epoch as RFC 3339 in UTC.
pub fn format_time(secs: u64) -> String {
    humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs))
        .to_string()
}

/// The error of a window whose end is not after its start, if so.
fn window_error(window: &Window) -> Option<String> {
    match (window.not_before, window.expires) {
        (Some(nb), Some(ex)) if ex <= nb => Some(format!(
            "{} is not after notBefore {}: the window is empty (a window is whole seconds: \
             a fraction rounds notBefore up and expires down)",
            format_time(ex),
            format_time(nb)
        )),
        _ => None,
    }
}

impl PeerSpec {
    /// The WireGuard preshared key, if the peer has one.
    pub fn preshared_key(&self) -> Option<WgKey> {
        self.preshared_key.as_deref().copied()
    }

    /// The peer's access window (neither bound: none).
    pub fn window(&self) -> Window {
        self.window.as_deref().copied().unwrap_or_default()
    }

    /// The rarely set fields, boxed only when set (so that equal peers compare equal).
    fn rare(
        preshared_key: Option<WgKey>,
        window: Window,
    ) -> (Option<Box<WgKey>>, Option<Box<Window>>) {
        (
            preshared_key.map(Box::new),
            window.is_some().then(|| Box::new(window)),
        )
    }

    /// The peer's tunnel addresses.
    pub fn addrs(&self) -> impl Iterator<Item = IpAddr> {
        self.address
            .map(IpAddr::V4)
            .into_iter()
            .chain(self.address_v6.map(IpAddr::V6))
    }
}

/// A validated state: peers sorted by name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredState {
    pub peers: Vec<PeerSpec>,
    /// Let replies to flows the network starts toward a peer pass that peer's egress policy
    /// (`"replies"`, default true): the stateless allow-list's ESTABLISHED,RELATED.
    pub replies: bool,
    /// Policy tests (`"tests"`): packets the peers' compiled policies must pass or drop. A
    /// state is only valid when they hold ([`parse`] runs them).
    pub tests: Vec<PolicyTest>,
}

impl Default for DesiredState {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            replies: true,
            tests: Vec::new(),
        }
    }
}

impl DesiredState {
    pub fn restricted_peers(&self) -> usize {
        self.peers.iter().filter(|p| p.policy.is_some()).count()
    }

    /// The state without the peers whose window is over at `now` (seconds since the epoch):
    /// what the agent applies, so an expired peer is revoked (its entries and its WireGuard
    /// peer go) at the first reconcile after its window ends. The datapath drops its packets
    /// from the end of the window on, agent or not.
    pub fn without_expired(mut self, now: u64) -> Self {
        self.peers.retain(|p| !p.window().is_past(now));
        self
    }

    /// The state as the agent applies it at `now`: itself, or (only when a peer's window is
    /// over) a copy without the expired peers.
    pub fn unexpired(&self, now: u64) -> std::borrow::Cow<'_, Self> {
        if self.peers.iter().any(|p| p.window().is_past(now)) {
            std::borrow::Cow::Owned(self.clone().without_expired(now))
        } else {
            std::borrow::Cow::Borrowed(self)
        }
    }

    /// The peers whose `egress` is empty: they may send nothing (only replies pass, if those
    /// are on). Worth a note, since older versions read `"egress": []` as unrestricted.
    pub fn peers_allowed_nothing(&self) -> Vec<&str> {
        self.peers
            .iter()
            .filter(|p| p.policy.as_ref().is_some_and(|policy| policy.is_empty()))
            .map(|p| p.name.as_str())
            .collect()
    }

    /// The state as a state file in canonical form: every field written the one way the
    /// schema's defaults allow (`replies` always, optional fields only when set), peers by name,
    /// rules and their ports sorted. Parsing it gives back an equal state, and equal states give
    /// the same text.
    #[cfg(any(test, feature = "testing"))]
    pub fn to_canonical_json(&self) -> String {
        let peers: Vec<Value> = self.peers.iter().map(PeerSpec::to_json).collect();
        let mut state = serde_json::json!({ "version": SCHEMA_VERSION, "replies": self.replies, "peers": peers });
        if !self.tests.is_empty() {
            state["tests"] = self.tests.iter().map(assertions::to_json).collect();
        }
        state.to_string()
    }
}

#[cfg(any(test, feature = "testing"))]
impl PeerSpec {
    fn to_json(&self) -> Value {
        let mut peer = Map::new();
        let mut set = |field: &str, value: Value| {
            peer.insert(field.to_owned(), value);
        };
        set("name", self.name.as_str().into());
        set("publicKey", self.public_key.to_base64().into());
        if let Some(address) = self.address {
            set("address", address.to_string().into());
        }
        if let Some(address) = self.address_v6 {
            set("addressV6", address.to_string().into());
        }
        if let Some(endpoint) = self.endpoint {
            set("endpoint", endpoint.to_string().into());
        }
        if let Some(key) = self.preshared_key() {
            set("presharedKey", key.to_base64().into());
        }
        if let Some(secs) = self.persistent_keepalive {
            set("persistentKeepalive", secs.into());
        }
        if self.mode != Mode::Enforce {
            set("mode", self.mode.name().into());
        }
        if let Some(t) = self.window().not_before {
            set("notBefore", format_time(t).into());
        }
        if let Some(t) = self.window().expires {
            set("expires", format_time(t).into());
        }
        if let Some(rules) = &self.rules {
            set(
                "egress",
                rules.iter().map(rule_to_json).collect::<Vec<_>>().into(),
            );
        }
        Value::Object(peer)
    }
}

/// A rule in one short line, as `wgfence status --rules` and the `rule` label of
/// `wgfence_rule_hits_total` name it: `tcp 10.0.0.0/8:443,8000-8100`, `any fd00::/8`,
/// `any 10.0.0.0/8 except 10.1.0.0/16,10.2.0.0/16`. Distinct rules of a policy read apart.
pub fn rule_text(rule: &Rule) -> String {
    let text = rule_head(rule);
    if rule.except().is_empty() {
        return text;
    }
    let except: Vec<String> = rule.except().iter().map(ToString::to_string).collect();
    format!("{text} except {}", except.join(","))
}

/// A rule's protocol, prefix and ports.
fn rule_head(rule: &Rule) -> String {
    let protocol = protocol_text(rule.protocol);
    let ports: Vec<String> = rule
        .ports()
        .iter()
        .map(|r| {
            if r.lo == r.hi {
                r.lo.to_string()
            } else {
                format!("{}-{}", r.lo, r.hi)
            }
        })
        .collect();
    if ports.is_empty() {
        format!("{protocol} {}", rule.cidr)
    } else {
        format!("{protocol} {}:{}", rule.cidr, ports.join(","))
    }
}

/// A protocol as the state file names it.
fn protocol_text(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Any => "any",
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Icmp => "icmp",
    }
}

#[cfg(any(test, feature = "testing"))]
fn rule_to_json(rule: &Rule) -> Value {
    let protocol = protocol_text(rule.protocol);
    let mut value = serde_json::json!({ "cidr": rule.cidr.to_string(), "protocol": protocol });
    if !rule.ports().is_empty() {
        let ports: Vec<Value> = rule
            .ports()
            .iter()
            .map(|r| {
                if r.lo == r.hi {
                    r.lo.into()
                } else {
                    format!("{}-{}", r.lo, r.hi).into()
                }
            })
            .collect();
        let field = if rule.protocol == Protocol::Icmp {
            "types"
        } else {
            "ports"
        };
        value[field] = ports.into();
    }
    if !rule.except().is_empty() {
        let except: Vec<Value> = rule.except().iter().map(|e| e.to_string().into()).collect();
        value["except"] = except.into();
    }
    value
}

/// Rule sets seen while parsing one state, keyed by their shared copy, with their compiled
/// policy.
type Compiled = HashMap<SharedRules, Arc<CompiledPolicy>>;

/// The shared copy of a rule set as a key of [`Compiled`], found by its rules: the key is the
/// copy the peers hold, not a second one (with a policy per peer, a second copy of every rule
/// set was about 0.9 KiB a policy).
#[derive(Debug, Clone)]
struct SharedRules(Arc<Vec<Rule>>);

impl PartialEq for SharedRules {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_slice() == other.0.as_slice()
    }
}

impl Eq for SharedRules {}

impl std::hash::Hash for SharedRules {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As the slice hashes, so that a lookup by `&[Rule]` finds it.
        self.0.as_slice().hash(state);
    }
}

impl std::borrow::Borrow<[Rule]> for SharedRules {
    fn borrow(&self) -> &[Rule] {
        self.0.as_slice()
    }
}

/// One validation error: where, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// `peer "alice" (peers[3])`, `peers[3]` when the peer has no usable name, or the top level.
    pub location: String,
    /// The field path inside the location, e.g. `egress[1].ports[0]`.
    pub field: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.location.is_empty() {
            write!(f, "{}: {}", self.field, self.message)
        } else {
            write!(
                f,
                "{}, field {}: {}",
                self.location, self.field, self.message
            )
        }
    }
}

/// Why a state was rejected: every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct StateError {
    pub errors: Vec<FieldError>,
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.errors.len();
        write!(
            f,
            "state rejected ({n} error{}):",
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.errors {
            write!(f, "\n  - {e}")?;
        }
        Ok(())
    }
}

/// Parses and validates a state file's contents.
///
/// A valid file (the common case, on every push) is deserialized into typed structs that
/// borrow from `text` and validated without building a JSON value tree. Anything the typed
/// pass does not accept, it hands to [`parse_value_tree`], which walks the file as a value tree
/// and names every error; so the result is always exactly what that walk decides.
pub fn parse(text: &str) -> Result<DesiredState, StateError> {
    let state = parse_unchecked(text)?;
    if state.tests.is_empty() {
        return Ok(state);
    }
    let errors = assertions::failures(&state, text);
    if errors.is_empty() {
        Ok(state)
    } else {
        Err(StateError { errors })
    }
}

/// [`parse`] without running the state's policy tests (`wgfence explain` reads a state whose
/// tests fail, to say why).
pub fn parse_unchecked(text: &str) -> Result<DesiredState, StateError> {
    match typed::parse(text) {
        Some(state) => Ok(state),
        None => parse_value_tree(text),
    }
}

/// A peer's canonical rule set and its compiled policy, if it has an `egress` (`None`:
/// unrestricted). Peers with equal rule sets share one copy of the rules and one compiled
/// policy.
fn share(rules: Option<Vec<Rule>>, compiled: &mut Compiled) -> Result<Shared, PolicyError> {
    let Some(rules) = rules else {
        return Ok(None);
    };
    if let Some((shared, policy)) = compiled.get_key_value(rules.as_slice()) {
        return Ok(Some((Arc::clone(&shared.0), Arc::clone(policy))));
    }
    let policy = Arc::new(compile(&rules)?);
    let shared = Arc::new(rules);
    compiled.insert(SharedRules(Arc::clone(&shared)), Arc::clone(&policy));
    Ok(Some((shared, policy)))
}

/// A peer's rules and compiled policy, shared with the peers that have the same; `None`:
/// unrestricted.
type Shared = Option<(Arc<Vec<Rule>>, Arc<CompiledPolicy>)>;

/// Capacity of the policy tries: the distinct policies' entries per family (IPv4, IPv6).
fn trie_entries(compiled: &Compiled) -> (usize, usize) {
    let (mut v4, mut v6) = (0usize, 0usize);
    for policy in compiled.values() {
        for (prefix, _) in policy.entries() {
            match prefix {
                IpNet::V4(_) => v4 += 1,
                IpNet::V6(_) => v6 += 1,
            }
        }
    }
    (v4, v6)
}

// The checks of single values, shared by the typed pass and the value-tree walk so that both
// decide alike.

fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN
}

fn usable_tunnel_addr(ip: IpAddr) -> bool {
    !(ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST))
}

fn parse_endpoint(s: &str) -> Option<SocketAddr> {
    s.parse::<SocketAddr>()
        .ok()
        .filter(|ep| ep.port() != 0 && !ep.ip().is_unspecified())
}

/// `persistentKeepalive` in seconds: `Some(None)` is off (0), `None` is out of range.
fn keepalive(secs: u64) -> Option<Option<u16>> {
    match u16::try_from(secs) {
        Ok(0) => Some(None),
        Ok(secs) => Some(Some(secs)),
        Err(_) => None,
    }
}

fn protocol_named(name: &str) -> Option<Protocol> {
    match name {
        "any" => Some(Protocol::Any),
        "tcp" => Some(Protocol::Tcp),
        "udp" => Some(Protocol::Udp),
        "icmp" => Some(Protocol::Icmp),
        _ => None,
    }
}

fn port_number(v: u64) -> Result<u16, String> {
    match u16::try_from(v) {
        Ok(0) => Err("port 0 is not a destination port".into()),
        Ok(p) => Ok(p),
        Err(_) => Err(format!("{v} is not a port (1-65535)")),
    }
}

/// A port written as a string: `"443"` or a `"lo-hi"` range.
fn port_text(s: &str) -> Result<PortRange, String> {
    let parsed = s.split_once('-').and_then(|(lo, hi)| {
        Some((
            lo.trim().parse::<u64>().ok()?,
            hi.trim().parse::<u64>().ok()?,
        ))
    });
    match parsed {
        Some((lo, hi)) => {
            let (lo, hi) = (port_number(lo)?, port_number(hi)?);
            if lo > hi {
                Err(format!("range {s:?} is reversed"))
            } else {
                Ok(PortRange::new(lo, hi))
            }
        }
        None => match s.trim().parse::<u64>() {
            Ok(v) => port_number(v).map(PortRange::single),
            Err(_) => Err(format!("{s:?} is not a port or a \"lo-hi\" range")),
        },
    }
}

/// The peers of two states side by side by name (both are sorted by name): `(Some, Some)` for
/// a name both have, `(Some, None)` for one only `previous` has, `(None, Some)` for one only
/// `desired` has.
pub fn by_name<'a>(
    previous: &'a DesiredState,
    desired: &'a DesiredState,
) -> impl Iterator<Item = (Option<&'a PeerSpec>, Option<&'a PeerSpec>)> + 'a {
    let (mut old, mut new) = (
        previous.peers.iter().peekable(),
        desired.peers.iter().peekable(),
    );
    std::iter::from_fn(move || match (old.peek(), new.peek()) {
        (Some(o), Some(n)) => Some(match o.name.cmp(&n.name) {
            std::cmp::Ordering::Less => (old.next(), None),
            std::cmp::Ordering::Greater => (None, new.next()),
            std::cmp::Ordering::Equal => (old.next(), new.next()),
        }),
        (Some(_), None) => Some((old.next(), None)),
        (None, Some(_)) => Some((None, new.next())),
        (None, None) => None,
    })
}

/// Policies of a state by content, for callers that need each distinct policy once.
pub fn distinct_policies(state: &DesiredState) -> BTreeMap<&CompiledPolicy, usize> {
    let mut policies = BTreeMap::new();
    for policy in state.peers.iter().filter_map(|p| p.policy.as_deref()) {
        *policies.entry(policy).or_insert(0) += 1;
    }
    policies
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::tree::{PEER_FIELDS, RULE_FIELDS};
    use super::*;

    fn key(n: u8) -> String {
        WgKey([n; 32]).to_base64()
    }

    fn peer(name: &str, n: u8) -> Value {
        json!({ "name": name, "publicKey": key(n), "address": format!("10.8.0.{n}") })
    }

    fn state(peers: Vec<Value>) -> String {
        json!({ "version": 1, "peers": peers }).to_string()
    }

    /// Parses a state that must be rejected and returns its errors as text.
    fn rejected(text: &str) -> Vec<String> {
        match parse(text) {
            Ok(s) => panic!("accepted: {s:?}"),
            Err(e) => e.errors.iter().map(ToString::to_string).collect(),
        }
    }

    /// Both passes accept `text` alike.
    fn both(text: &str) -> DesiredState {
        let tree = tree::parse_value_tree(text).unwrap();
        let fast = typed::parse(text).unwrap_or_else(|| panic!("the typed pass refused {text}"));
        assert_eq!(tree, fast);
        tree
    }

    #[test]
    fn mode_and_window_parse_alike_in_both_passes_and_round_trip() {
        let mut p = peer("alice", 2);
        p["mode"] = "audit".into();
        p["notBefore"] = "2026-12-01T08:00:00Z".into();
        p["expires"] = "2026-12-04T17:00:00.5Z".into();
        let s = both(&state(vec![p, peer("bob", 3)]));
        assert_eq!(s.peers[0].mode, Mode::Audit);
        assert_eq!(
            s.peers[0].window(),
            Window {
                not_before: Some(1_796_112_000),
                expires: Some(1_796_403_600),
            }
        );
        assert_eq!(s.peers[1].mode, Mode::Enforce);
        assert!(!s.peers[1].window().is_some());
        assert_eq!(both(&s.to_canonical_json()), s);
    }

    #[test]
    fn bad_modes_and_windows_are_rejected_naming_the_field() {
        let with = |field: &str, value: Value| {
            let mut p = peer("alice", 2);
            p[field] = value;
            state(vec![p])
        };
        assert_error(
            &with("mode", "permissive".into()),
            "field mode: \"permissive\"",
        );
        assert_error(&with("mode", Value::Null), "field mode: null");
        assert_error(
            &with("expires", "tomorrow".into()),
            "field expires: \"tomorrow\" is not",
        );
        assert_error(&with("notBefore", 5.into()), "field notBefore: must be");
        let mut p = peer("alice", 2);
        p["notBefore"] = "2026-12-04T17:00:00Z".into();
        p["expires"] = "2026-12-04T17:00:00Z".into();
        assert_error(
            &state(vec![p]),
            "field expires: 2026-12-04T17:00:00Z is not after notBefore",
        );
        // Fractions round the window inward, never wider than written: within one second
        // nothing is left; across one, the whole seconds inside.
        let mut p = peer("alice", 2);
        p["notBefore"] = "2026-12-04T17:00:00.200Z".into();
        p["expires"] = "2026-12-04T17:00:00.800Z".into();
        assert_error(
            &state(vec![p]),
            "2026-12-04T17:00:00Z is not after notBefore 2026-12-04T17:00:01Z",
        );
        let mut p = peer("alice", 2);
        p["notBefore"] = "2026-12-04T17:00:00.200Z".into();
        p["expires"] = "2026-12-04T17:00:05.900Z".into();
        for parse in [parse, parse_value_tree] {
            let desired = parse(&state(vec![p.clone()])).expect("a window of whole seconds");
            let window = desired.peers[0].window();
            assert_eq!(window.not_before, parse_time("2026-12-04T17:00:01Z").ok());
            assert_eq!(window.expires, parse_time("2026-12-04T17:00:05Z").ok());
        }
    }

    #[track_caller]
    fn assert_error(text: &str, wanted: &str) {
        let errors = rejected(text);
        assert!(
            errors.iter().any(|e| e.contains(wanted)),
            "no error contains {wanted:?}: {errors:#?}"
        );
    }

    #[test]
    fn the_design_example_parses() {
        let text = json!({
            "version": 1,
            "peers": [{
                "name": "alice-laptop",
                "publicKey": key(1),
                "address": "10.8.0.2",
                "addressV6": "fd00:8::2",
                "endpoint": "198.51.100.7:51820",
                "presharedKey": key(9),
                "persistentKeepalive": 25,
                "egress": [
                    { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] },
                    { "cidr": "fd00::/8",   "protocol": "any" },
                    { "cidr": "0.0.0.0/0",  "protocol": "icmp" }
                ]
            }]
        })
        .to_string();
        let s = parse(&text).unwrap();
        let p = &s.peers[0];
        assert_eq!(p.name, "alice-laptop");
        assert_eq!(p.address, Some(Ipv4Addr::new(10, 8, 0, 2)));
        assert_eq!(p.persistent_keepalive, Some(25));
        assert_eq!(p.rules.as_ref().map(|r| r.len()), Some(3));
        assert!(p.policy.is_some());
        assert_eq!(s.restricted_peers(), 1);
    }

    /// Issue 11 item 7, as Kubernetes NetworkPolicy: no `egress` leaves the peer unrestricted,
    /// `"egress": []` allows nothing (a restricted policy without a single entry).
    #[test]
    fn no_egress_means_unrestricted_and_an_empty_egress_allows_nothing() {
        let s = parse(&state(vec![peer("a", 2)])).unwrap();
        assert!(s.peers[0].policy.is_none());
        assert_eq!(s.peers[0].rules, None);
        assert_eq!(s.restricted_peers(), 0);
        let mut empty = peer("a", 2);
        empty["egress"] = json!([]);
        for text in [
            state(vec![empty.clone()]),
            state(vec![empty.clone()]).replace(" ", ""),
        ] {
            for (how, parsed) in [
                ("typed", typed::parse(&text).ok_or(())),
                ("walk", parse_value_tree(&text).map_err(drop)),
            ] {
                let s = parsed.unwrap_or_else(|()| panic!("{how}: rejected {text}"));
                let policy = s.peers[0].policy.as_deref();
                assert_eq!(policy, Some(&CompiledPolicy::default()), "{how}: {text}");
                assert_eq!(s.peers[0].rules.as_deref(), Some(&Vec::new()), "{how}");
                assert_eq!(s.restricted_peers(), 1, "{how}");
                assert_eq!(s.peers_allowed_nothing(), ["a"], "{how}");
            }
        }
        // Equal empty rule sets share one (empty) policy, like any other.
        let mut b = peer("b", 3);
        b["egress"] = json!([]);
        let s = parse(&state(vec![empty, b])).unwrap();
        assert_eq!(distinct_policies(&s).len(), 1);
        assert_eq!(s.peers_allowed_nothing(), ["a", "b"]);
    }

    /// Issue 11 item 7: `null` where a value is expected is an error naming the peer and the
    /// field, not a default (`"ports": null` meant every port, `"egress": null` everything).
    #[test]
    fn null_is_an_error_naming_the_peer_and_the_field() {
        for field in PEER_FIELDS {
            let mut p = peer("a", 2);
            p["addressV6"] = json!("fd00:8::2");
            p[field] = Value::Null;
            let location = if field == "name" {
                "peers[0]".to_owned()
            } else {
                "peer \"a\" (peers[0])".to_owned()
            };
            let text = state(vec![p]);
            assert_error(&text, &format!("{location}, field {field}: null"));
            assert_eq!(typed::parse(&text), None, "the typed pass took {text}");
        }
        for field in RULE_FIELDS {
            let mut rule = json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] });
            rule[field] = Value::Null;
            let mut p = peer("a", 2);
            p["egress"] = json!([rule]);
            let text = state(vec![p]);
            assert_error(
                &text,
                &format!("peer \"a\" (peers[0]), field egress[0].{field}: null"),
            );
            assert_eq!(typed::parse(&text), None, "the typed pass took {text}");
        }
        let mut p = peer("a", 2);
        p["egress"] = json!([null]);
        assert_error(&state(vec![p]), "field egress[0]: null");
        let mut p = peer("a", 2);
        p["egress"] = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [null] }]);
        assert_error(&state(vec![p]), "field egress[0].ports[0]: null");
        for (field, text) in [
            ("replies", r#"{"version":1,"replies":null,"peers":[]}"#),
            ("version", r#"{"version":null,"peers":[]}"#),
            ("peers", r#"{"version":1,"peers":null}"#),
        ] {
            assert_error(text, &format!("{field}: null"));
            assert_eq!(typed::parse(text), None, "the typed pass took {text}");
        }
        assert_error(&state(vec![Value::Null]), "peers[0], field (peer): null");
    }

    #[test]
    fn replies_default_on_and_switch_off() {
        let s = parse(&state(vec![peer("a", 2)])).unwrap();
        assert!(s.replies, "replies default to on");
        let off = json!({ "version": 1, "replies": false, "peers": [peer("a", 2)] }).to_string();
        assert!(!parse(&off).unwrap().replies);
        assert_error(
            &json!({ "version": 1, "replies": "yes", "peers": [] }).to_string(),
            "replies: must be true or false",
        );
    }

    #[test]
    fn a_repeated_key_is_rejected_not_resolved() {
        // The last "egress" would win and leave the peer unrestricted.
        let text = format!(
            r#"{{"version":1,"peers":[{{"name":"a","publicKey":"{}","address":"10.8.0.2","egress":[{{"cidr":"10.0.0.0/8"}}],"egress":[]}}]}}"#,
            key(2)
        );
        assert_error(&text, "peers[0].egress: repeated");
        assert_error(
            r#"{"version":1,"version":1,"peers":[]}"#,
            "version: repeated",
        );
        // In the policy tests too: the last "deny" would win and the test would check nothing.
        let text = format!(
            r#"{{"version":1,"peers":[{{"name":"a","publicKey":"{}","address":"10.8.0.2","egress":[{{"cidr":"10.0.0.0/8"}}]}}],"tests":[{{"peer":"a","deny":["192.0.2.1:443/tcp"],"deny":[]}}]}}"#,
            key(2)
        );
        assert_error(&text, "tests[0].deny: repeated");
    }

    #[test]
    fn malformed_json_and_versions() {
        assert_error("{\"version\": 1, \"peers\": [", "not valid JSON");
        assert_error("[]", "must be a JSON object");
        assert_error(
            &json!({ "version": 2, "peers": [] }).to_string(),
            "unsupported version 2",
        );
        assert_error(&json!({ "peers": [] }).to_string(), "version: missing");
        assert_error(&json!({ "version": 1 }).to_string(), "peers: missing");
        assert_error(
            &json!({ "version": 1, "peers": [], "peer": [] }).to_string(),
            "peer: unknown field",
        );
    }

    #[test]
    fn missing_and_duplicate_names_and_keys() {
        let mut nameless = peer("x", 3);
        nameless.as_object_mut().map(|o| o.remove("name"));
        assert_error(&state(vec![nameless]), "peers[0], field name: missing");
        let mut keyless = peer("x", 3);
        keyless.as_object_mut().map(|o| o.remove("publicKey"));
        assert_error(
            &state(vec![keyless]),
            "peer \"x\" (peers[0]), field publicKey: missing",
        );
        assert_error(
            &state(vec![peer("a", 2), peer("a", 3)]),
            "peer \"a\" (peers[1]), field name: duplicate: peers[0] has the same name",
        );
        let mut same_key = peer("b", 3);
        same_key["publicKey"] = json!(key(2));
        assert_error(
            &state(vec![peer("a", 2), same_key]),
            "field publicKey: duplicate",
        );
    }

    #[test]
    fn keys_must_be_32_bytes_of_base64() {
        for bad in ["not base64!", "AAAA", &WgKey([1; 32]).to_base64()[..40]] {
            let mut p = peer("a", 2);
            p["publicKey"] = json!(bad);
            assert_error(&state(vec![p]), "publicKey: not a WireGuard key");
        }
        let mut p = peer("a", 2);
        p["presharedKey"] = json!("short");
        assert_error(&state(vec![p]), "presharedKey: not a WireGuard key");
    }

    #[test]
    fn addresses_are_validated_and_unique_across_peers() {
        let mut p = peer("a", 2);
        p["address"] = json!("10.8.0.2/32");
        assert_error(
            &state(vec![p]),
            "address: \"10.8.0.2/32\" is not an IPv4 address",
        );
        let mut p = peer("a", 2);
        p["address"] = json!("fd00::2");
        assert_error(&state(vec![p]), "is not an IPv4 address");
        let mut p = peer("a", 2);
        p.as_object_mut().map(|o| o.remove("address"));
        assert_error(&state(vec![p]), "a peer needs address, addressV6 or both");
        let mut p = peer("b", 3);
        p["address"] = json!("10.8.0.2");
        assert_error(
            &state(vec![peer("a", 2), p]),
            "duplicate: 10.8.0.2 is also peers[0]'s address",
        );
        let mut a = peer("a", 2);
        a["addressV6"] = json!("fd00:8::2");
        let mut b = peer("b", 3);
        b["addressV6"] = json!("fd00:8::2");
        assert_error(&state(vec![a, b]), "addressV6: duplicate");
    }

    /// Each rule is refused with an error that contains its text.
    fn assert_rule_errors(cases: &[(Value, &str)]) {
        for (rule, wanted) in cases {
            let mut p = peer("a", 2);
            p["egress"] = json!([rule]);
            assert_error(&state(vec![p]), wanted);
        }
    }

    #[test]
    fn rules_are_validated() {
        assert_rule_errors(&[
            (
                json!({ "cidr": "10.1.2.3/8" }),
                "has host bits set (did you mean 10.0.0.0/8?)",
            ),
            (json!({ "cidr": "10.0.0.0/33" }), "is not a CIDR prefix"),
            (json!({ "protocol": "tcp" }), "cidr: missing"),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "sctp" }),
                "is not one of tcp, udp, icmp, any",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [0] }),
                "port 0",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [70000] }),
                "70000 is not a port",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": ["9000-8000"] }),
                "reversed",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": ["http"] }),
                "is not a port",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "icmp", "ports": [1] }),
                "only allowed with tcp or udp",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "ports": [443] }),
                "only allowed with tcp or udp",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "port": [443] }),
                "egress[0].port: unknown field",
            ),
        ]);
    }

    #[test]
    fn icmp_types_and_excepts_are_validated() {
        assert_rule_errors(&[
            // ICMP types only on icmp rules; no rule without a protocol takes ports or types.
            (
                json!({ "cidr": "10.0.0.0/8", "types": [8] }),
                "types are only allowed with icmp",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "tcp", "types": [8] }),
                "types are only allowed with icmp",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "icmp", "types": [256] }),
                "256 is not an ICMP type",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "icmp", "types": ["echo"] }),
                "is not an ICMP type",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "protocol": "icmp", "types": [] }),
                "empty: leave types out",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "except": ["10.0.0.0/8"] }),
                "is not a prefix strictly inside",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "except": ["192.168.0.0/16"] }),
                "is not a prefix strictly inside",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "except": ["10.1.0.1/16"] }),
                "has host bits set",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "except": ["fd00::/16"] }),
                "is not a prefix strictly inside",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "except": [] }),
                "empty: leave except out",
            ),
            (
                json!({ "cidr": "10.0.0.0/8", "except": ["nope"] }),
                "is not a CIDR prefix",
            ),
        ]);
    }

    #[test]
    fn except_and_types_parse_and_round_trip() {
        let mut p = peer("a", 2);
        p["egress"] = json!([
            { "cidr": "0.0.0.0/0", "except": ["10.96.0.0/12", "169.254.169.254/32"],
              "protocol": "tcp", "ports": [443] },
            { "cidr": "0.0.0.0/0", "protocol": "icmp", "types": ["echo-request", "3-4"] },
            { "cidr": "::/0", "protocol": "icmp", "types": ["echo-request"] },
        ]);
        let text = state(vec![p]);
        let parsed = parse(&text).unwrap();
        assert_eq!(parse_value_tree(&text), Ok(parsed.clone()));
        let rules = parsed.peers[0].rules.clone().unwrap();
        let icmp4 = rules
            .iter()
            .find(|r| {
                r.protocol == Protocol::Icmp
                    && r.cidr.prefix_len() == 0
                    && matches!(r.cidr, IpNet::V4(_))
            })
            .map(|r| r.ports().to_vec());
        assert_eq!(
            icmp4,
            Some(vec![PortRange::new(3, 4), PortRange::single(8)])
        );
        let icmp6 = rules
            .iter()
            .find(|r| matches!(r.cidr, IpNet::V6(_)))
            .map(|r| r.ports().to_vec());
        assert_eq!(icmp6, Some(vec![PortRange::single(128)]));
        assert_eq!(parse(&parsed.to_canonical_json()).unwrap(), parsed);
    }

    #[test]
    fn every_error_is_reported_at_once() {
        let mut a = peer("a", 2);
        a["publicKey"] = json!("bad");
        a["egress"] = json!([{ "cidr": "10.0.0.1/8" }, { "cidr": "fd00::/8", "protocol": "udp", "ports": [0] }]);
        let mut b = peer("b", 3);
        b["endpoint"] = json!("vpn.example.com:51820");
        let errors = rejected(&state(vec![a, b]));
        assert_eq!(errors.len(), 4, "{errors:#?}");
    }

    #[test]
    fn duplicates_are_found_in_peers_with_other_errors_too() {
        let mut a = peer("a", 2);
        a["egress"] = json!([{ "cidr": "10.1.2.3/8" }]);
        let mut b = peer("b", 3);
        b["address"] = json!("10.8.0.2");
        let errors = rejected(&state(vec![a, b]));
        assert_eq!(errors.len(), 2, "{errors:#?}");
        assert!(errors[1].contains("duplicate: 10.8.0.2 is also peers[0]'s address"));
    }

    #[test]
    fn too_many_allows_for_the_datapath_is_rejected_naming_the_peer() {
        let ports: Vec<u64> = (1..=40).map(|i| i * 3).collect();
        let mut p = peer("a", 2);
        p["egress"] = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": ports }]);
        assert_error(
            &state(vec![p]),
            "peer \"a\" (peers[0]), field egress: destination 10.0.0.0/8 needs 40",
        );
    }

    #[test]
    fn the_order_of_peers_and_rules_does_not_matter() {
        let mut a = peer("a", 2);
        a["egress"] = json!([
            { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] },
            { "cidr": "0.0.0.0/0", "protocol": "icmp" },
        ]);
        let mut a2 = a.clone();
        a2["egress"] = json!([
            { "cidr": "0.0.0.0/0", "protocol": "icmp" },
            { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": ["8000-8100", 443, 443] },
        ]);
        let one = parse(&state(vec![a, peer("b", 3), peer("c", 4)]));
        let two = parse(&state(vec![peer("c", 4), a2, peer("b", 3)]));
        assert_eq!(one, two);
    }

    #[test]
    fn the_typed_pass_accepts_what_the_value_tree_walk_accepts() {
        let mut a = peer("a\u{e9}\"quoted\"", 2);
        a["addressV6"] = json!("fd00:8::2");
        a["endpoint"] = json!("[2001:db8::7]:51820");
        a["presharedKey"] = json!(key(9));
        a["persistentKeepalive"] = json!(0);
        a["egress"] = json!([
            { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100", " 22 ", 443] },
            { "cidr": "fd00::/8" },
            { "cidr": "0.0.0.0/0", "protocol": "icmp" },
        ]);
        let mut b = peer("b", 3);
        b["egress"] = json!([]);
        let texts = [
            state(vec![a.clone(), b.clone()]),
            json!({ "version": 1, "replies": false, "peers": [a, b] }).to_string(),
            json!({ "version": 1, "peers": [] }).to_string(),
            // Escapes where the typed pass borrows strings.
            r#"{"version":1,"peers":[{"name":"cA","publicKey":"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=","address":"10.8.0.9","egress":[{"cidr":"10.0.0.0\/8","protocol":"tcp","ports":["1-9"]}]}]}"#.to_owned(),
        ];
        for text in texts {
            let typed = typed::parse(&text);
            assert!(typed.is_some(), "the typed pass handed over {text}");
            assert_eq!(typed.map(Ok), Some(parse_value_tree(&text)), "{text}");
        }
    }

    #[test]
    fn the_typed_pass_hands_every_doubt_to_the_value_tree_walk() {
        let texts = [
            // Repeated fields: the walk takes the last, the typed pass does not decide.
            r#"{"version":1,"version":1,"peers":[]}"#.to_owned(),
            json!({ "version": 1, "peers": [peer("a", 2), peer("a", 3)] }).to_string(),
            json!({ "version": 1, "peers": [{ "name": "a", "publicKey": key(2) }] }).to_string(),
            json!({ "version": 1.0, "peers": [] }).to_string(),
            json!({ "version": 1, "peers": [], "x": 1 }).to_string(),
            // Positional arrays for objects: serde's derived structs would take them.
            "[1,null,[]]".to_owned(),
            format!(
                r#"[1,false,[["a","{}","10.8.0.2",null,null,null,null,null]]]"#,
                key(2)
            ),
            format!(
                r#"{{"version":1,"peers":[{{"name":"a","publicKey":"{}","address":"10.8.0.2","egress":[["10.0.0.0/8",null,null]]}}]}}"#,
                key(2)
            ),
        ];
        for text in texts {
            assert!(typed::parse(&text).is_none(), "{text}");
        }
        // The walk names them: a state, a peer and a rule must be objects.
        assert_error("[1,null,[]]", "must be a JSON object");
        let array_rule = format!(
            r#"{{"version":1,"peers":[{{"name":"a","publicKey":"{}","address":"10.8.0.2","egress":[["10.0.0.0/8",null,null]]}}]}}"#,
            key(2)
        );
        assert!(
            parse(&array_rule).is_err(),
            "a rule written as an array was accepted"
        );
        // ... and the answer is still the walk's.
        let repeated = r#"{"version":1,"version":1,"peers":[]}"#;
        assert_eq!(parse(repeated), parse_value_tree(repeated));
    }

    #[test]
    fn the_typed_pass_and_the_walk_agree_on_number_edges() {
        let k = key(2);
        for (field, value) in [
            ("persistentKeepalive", "-0"),
            ("persistentKeepalive", "0"),
            ("persistentKeepalive", "25.0"),
            ("persistentKeepalive", "65536"),
            ("persistentKeepalive", "1e1"),
            ("persistentKeepalive", "18446744073709551616"),
        ] {
            let text = format!(
                r#"{{"version":1,"peers":[{{"name":"a","publicKey":"{k}","address":"10.8.0.2","{field}":{value}}}]}}"#
            );
            assert_eq!(parse(&text), parse_value_tree(&text), "{text}");
        }
        for ports in [
            "[-0]",
            "[1.0]",
            "[65535]",
            "[\"0-1\"]",
            "[\" 7 \"]",
            "[\"+7\"]",
        ] {
            let text = format!(
                r#"{{"version":1,"peers":[{{"name":"a","publicKey":"{k}","address":"10.8.0.2","egress":[{{"cidr":"10.0.0.0/8","protocol":"tcp","ports":{ports}}}]}}]}}"#
            );
            assert_eq!(parse(&text), parse_value_tree(&text), "{text}");
        }
        for version in ["-0", "1.0", "1e0", "01"] {
            let text = format!(r#"{{"version":{version},"peers":[]}}"#);
            assert_eq!(parse(&text), parse_value_tree(&text), "{text}");
        }
    }

    #[test]
    fn canonical_json_parses_back_to_the_same_state() {
        let mut a = peer("alice", 2);
        a["addressV6"] = json!("fd00:8::2");
        a["endpoint"] = json!("[2001:db8::7]:51820");
        a["presharedKey"] = json!(key(9));
        a["persistentKeepalive"] = json!(25);
        a["egress"] = json!([
            { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": ["8000-8100", 443] },
            { "cidr": "fd00::/8" },
            { "cidr": "0.0.0.0/0", "protocol": "icmp" },
        ]);
        let mut nothing = peer("carol", 4);
        nothing["egress"] = json!([]);
        let text = json!({ "version": 1, "replies": false, "peers": [peer("bob", 3), a, nothing] });
        let s = parse(&text.to_string()).unwrap();
        let canonical = s.to_canonical_json();
        let again = parse(&canonical).unwrap_or_else(|e| panic!("{e}\n{canonical}"));
        assert_eq!(again, s);
        assert_eq!(again.to_canonical_json(), canonical);
        assert!(
            canonical.contains(r#""ports":[443,"8000-8100"]"#),
            "{canonical}"
        );
        assert!(canonical.contains(r#""egress":[]"#), "{canonical}");
        assert_eq!(again.peers_allowed_nothing(), ["carol"]);
    }

    #[test]
    fn peers_with_equal_rules_share_one_compiled_policy() {
        let rules = json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp" }]);
        let mut a = peer("a", 2);
        a["egress"] = rules.clone();
        let mut b = peer("b", 3);
        b["egress"] = rules;
        let s = parse(&state(vec![a, b])).unwrap();
        let (pa, pb) = (s.peers[0].policy.as_ref(), s.peers[1].policy.as_ref());
        assert!(matches!((pa, pb), (Some(x), Some(y)) if Arc::ptr_eq(x, y)));
        assert_eq!(distinct_policies(&s).len(), 1);
    }
}
