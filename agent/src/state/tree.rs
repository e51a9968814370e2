//! The value-tree walk over a state file: it reads the file as a JSON value tree and collects
//! every error, each naming the peer and the field. It decides what is an error and says so;
//! the typed pass (`typed`) only ever accepts what this walk accepts.

use std::{
    collections::{BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
};

use ipnet::IpNet;
use serde_json::{Map, Value};
use wgfence_common::{MAX_PEERS, MAX_POLICY_ENTRIES};

use super::{
    assertions, keepalive, parse_endpoint, parse_start_time, parse_time, port_number, port_text,
    protocol_named, share, trie_entries, unique_keys, usable_tunnel_addr, valid_name, window_error,
    Compiled, DesiredState, FieldError, Mode, PeerSpec, StateError, WgKey, Window, MAX_NAME_LEN,
    MAX_RULES_PER_PEER, SCHEMA_VERSION,
};
use crate::policy::{PortRange, Protocol, Rule};

pub(super) const PEER_FIELDS: [&str; 11] = [
    "name",
    "publicKey",
    "address",
    "addressV6",
    "endpoint",
    "presharedKey",
    "persistentKeepalive",
    "egress",
    "mode",
    "notBefore",
    "expires",
];
pub(super) const RULE_FIELDS: [&str; 5] = ["cidr", "protocol", "ports", "types", "except"];

/// `null` is never a default: a control plane that renders "nothing" as `null` (or a reader
/// that drops it) must not widen access by accident, so it is an error wherever it appears.
const NULL: &str = "null: give a value, or leave the field out";

/// Collects errors for one location.
struct Errors<'a> {
    all: &'a mut Vec<FieldError>,
    location: String,
}

impl Errors<'_> {
    fn add(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.all.push(FieldError {
            location: self.location.clone(),
            field: field.into(),
            message: message.into(),
        });
    }
}

/// Parses and validates a state file's contents by walking it as a JSON value tree, collecting
/// every error. [`parse`] uses it for files its typed pass rejects; tests and the fuzzers use
/// it as the reference the typed pass must agree with.
pub fn parse_value_tree(text: &str) -> Result<DesiredState, StateError> {
    let root = root_object(text)?;
    let mut errors = Vec::new();
    let mut top = Errors {
        all: &mut errors,
        location: String::new(),
    };
    let (replies, tests, raw_peers) = top_fields(&root, &mut top);
    let mut compiled: Compiled = HashMap::new();
    let mut peers = Vec::with_capacity(raw_peers.len());
    let mut uniques = Uniques::default();
    for (index, raw) in raw_peers.iter().enumerate() {
        let name = raw
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty());
        let location = match name {
            Some(name) => format!("peer {name:?} (peers[{index}])"),
            None => format!("peers[{index}]"),
        };
        let mut e = Errors {
            all: &mut errors,
            location,
        };
        uniques.check(index, raw, name, &mut e);
        if let Some(peer) = parse_peer(raw, &mut e, &mut compiled) {
            peers.push(peer);
        }
    }
    let (v4_entries, v6_entries) = trie_entries(&compiled);
    for (family, n) in [("IPv4", v4_entries), ("IPv6", v6_entries)] {
        if n > MAX_POLICY_ENTRIES as usize {
            Errors {
                all: &mut errors,
                location: String::new(),
            }
            .add(
                "peers",
                format!(
                    "the distinct policies need {n} {family} trie entries, the map holds at most {MAX_POLICY_ENTRIES}"
                ),
            );
        }
    }
    if !errors.is_empty() {
        return Err(StateError { errors });
    }
    peers.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(DesiredState {
        peers,
        replies,
        tests,
    })
}

/// The file as a JSON object; an error if it is not JSON, repeats a key, or is not an object.
fn root_object(text: &str) -> Result<serde_json::Map<String, Value>, StateError> {
    let fail = |field: &str, message: String| StateError {
        errors: vec![FieldError {
            location: String::new(),
            field: field.to_owned(),
            message,
        }],
    };
    let root: Value =
        serde_json::from_str(text).map_err(|e| fail("(file)", format!("not valid JSON: {e}")))?;
    if let Some((object, key)) = unique_keys::first_repeated(text) {
        let field = if object.is_empty() {
            key
        } else {
            format!("{object}.{key}")
        };
        return Err(fail(
            &field,
            "repeated: a JSON reader keeps one of the values and drops the others, so the \
             state would not say what it looks like; keep one"
                .into(),
        ));
    }
    let Value::Object(root) = root else {
        return Err(fail("(file)", "must be a JSON object".into()));
    };
    Ok(root)
}

/// The top-level fields: `version` checked, `replies`, `tests`, and the raw `peers`.
fn top_fields<'a>(
    root: &'a serde_json::Map<String, Value>,
    top: &mut Errors<'_>,
) -> (bool, Vec<assertions::PolicyTest>, &'a [Value]) {
    for key in root.keys() {
        if !matches!(key.as_str(), "version" | "peers" | "replies" | "tests") {
            top.add(key.as_str(), "unknown field");
        }
    }
    match root.get("version") {
        None => top.add("version", "missing (this agent reads version 1)"),
        Some(Value::Null) => top.add("version", format!("{NULL} (this agent reads version 1)")),
        Some(v) if v.as_u64() == Some(SCHEMA_VERSION) => {}
        Some(v) => top.add(
            "version",
            format!("unsupported version {v} (this agent reads version 1)"),
        ),
    }
    let replies = match root.get("replies") {
        None => true,
        Some(Value::Null) => {
            top.add("replies", format!("{NULL} (left out: true)"));
            true
        }
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            top.add("replies", "must be true or false");
            true
        }
    };
    let tests = match root.get("tests") {
        None => Vec::new(),
        Some(raw) => assertions::parse_tests(raw).unwrap_or_else(|errors| {
            for (field, message) in errors {
                top.add(field, message);
            }
            Vec::new()
        }),
    };
    let raw_peers = match root.get("peers") {
        Some(Value::Array(peers)) => peers.as_slice(),
        Some(Value::Null) => {
            top.add("peers", "null: must be an array of peers");
            &[]
        }
        Some(_) => {
            top.add("peers", "must be an array");
            &[]
        }
        None => {
            top.add("peers", "missing");
            &[]
        }
    };
    if raw_peers.len() > MAX_PEERS as usize {
        top.add(
            "peers",
            format!(
                "{} peers, the maps hold at most {MAX_PEERS}",
                raw_peers.len()
            ),
        );
    }
    (replies, tests, raw_peers)
}

/// The peers' names, keys and addresses seen so far, for the duplicates.
#[derive(Default)]
struct Uniques {
    names: HashMap<String, usize>,
    keys: HashMap<WgKey, usize>,
    addrs: HashMap<IpAddr, usize>,
}

impl Uniques {
    /// Peer `index` (`raw`, named `name`): each field that parses is checked, also in peers
    /// with other errors.
    fn check(&mut self, index: usize, raw: &Value, name: Option<&str>, e: &mut Errors<'_>) {
        let key = raw
            .get("publicKey")
            .and_then(Value::as_str)
            .and_then(WgKey::from_base64);
        let v4 = raw
            .get("address")
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<Ipv4Addr>().ok());
        let v6 = raw
            .get("addressV6")
            .and_then(Value::as_str)
            .and_then(|s| s.parse::<Ipv6Addr>().ok());
        if let Some(name) = name {
            if let Some(first) = self.names.insert(name.to_owned(), index) {
                e.add(
                    "name",
                    format!("duplicate: peers[{first}] has the same name"),
                );
            }
        }
        if let Some(key) = key {
            if let Some(first) = self.keys.insert(key, index) {
                e.add(
                    "publicKey",
                    format!("duplicate: peers[{first}] has the same key"),
                );
            }
        }
        for (field, addr) in [
            ("address", v4.map(IpAddr::V4)),
            ("addressV6", v6.map(IpAddr::V6)),
        ] {
            if let Some(addr) = addr {
                if let Some(first) = self.addrs.insert(addr, index) {
                    e.add(
                        field,
                        format!("duplicate: {addr} is also peers[{first}]'s address"),
                    );
                }
            }
        }
    }
}

fn parse_peer(raw: &Value, e: &mut Errors<'_>, compiled: &mut Compiled) -> Option<PeerSpec> {
    let Value::Object(obj) = raw else {
        if raw.is_null() {
            e.add(
                "(peer)",
                "null: must be a JSON object; leave the peer out instead",
            );
        } else {
            e.add("(peer)", "must be a JSON object");
        }
        return None;
    };
    let before = e.all.len();
    for key in obj.keys() {
        if !PEER_FIELDS.contains(&key.as_str()) {
            e.add(key.as_str(), "unknown field");
        }
    }
    let name = name_field(obj, e);
    let public_key = key_field(obj, "publicKey", true, e);
    let preshared_key = key_field(obj, "presharedKey", false, e);
    let address: Option<Ipv4Addr> = addr_field(obj, "address", e);
    let address_v6: Option<Ipv6Addr> = addr_field(obj, "addressV6", e);
    if !obj.contains_key("address") && !obj.contains_key("addressV6") {
        e.add(
            "address",
            "missing: a peer needs address, addressV6 or both",
        );
    }
    let endpoint = endpoint_field(obj, e);
    let persistent_keepalive = keepalive_field(obj, e);
    let rules = egress_field(obj, e);
    let mode = mode_field(obj, e);
    let window = window_field(obj, e);
    if e.all.len() > before {
        return None;
    }
    let (rules, policy) = match share(rules, compiled) {
        Ok(shared) => shared.unzip(),
        Err(err) => {
            e.add("egress", err.to_string());
            return None;
        }
    };
    let (preshared_key, window) = PeerSpec::rare(preshared_key, window);
    Some(PeerSpec {
        name: name?.into(),
        public_key: public_key?,
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

/// `name`: a valid name, else an error.
fn name_field(obj: &Map<String, Value>, e: &mut Errors<'_>) -> Option<String> {
    match obj.get("name") {
        Some(Value::String(s)) if valid_name(s) => Some(s.clone()),
        Some(Value::String(s)) if s.is_empty() => {
            e.add("name", "must not be empty");
            None
        }
        Some(Value::String(_)) => {
            e.add("name", format!("longer than {MAX_NAME_LEN} characters"));
            None
        }
        Some(Value::Null) => {
            e.add("name", NULL);
            None
        }
        Some(_) => {
            e.add("name", "must be a string");
            None
        }
        None => {
            e.add("name", "missing");
            None
        }
    }
}

/// `endpoint`: IP:port, if given.
fn endpoint_field(obj: &Map<String, Value>, e: &mut Errors<'_>) -> Option<std::net::SocketAddr> {
    match obj.get("endpoint") {
        None => None,
        Some(Value::Null) => {
            e.add("endpoint", NULL);
            None
        }
        Some(Value::String(s)) => match parse_endpoint(s) {
            Some(ep) => Some(ep),
            None => {
                e.add(
                    "endpoint",
                    format!(
                        "{s:?} is not IP:port (e.g. 198.51.100.7:51820 or [2001:db8::7]:51820)"
                    ),
                );
                None
            }
        },
        Some(_) => {
            e.add("endpoint", "must be a string");
            None
        }
    }
}

/// `persistentKeepalive`: seconds, if given (0: off).
fn keepalive_field(obj: &Map<String, Value>, e: &mut Errors<'_>) -> Option<u16> {
    match obj.get("persistentKeepalive") {
        None => None,
        Some(Value::Null) => {
            e.add("persistentKeepalive", NULL);
            None
        }
        Some(v) => match v.as_u64().and_then(keepalive) {
            Some(secs) => secs,
            None => {
                e.add(
                    "persistentKeepalive",
                    format!("{v} is not a number of seconds from 0 to 65535"),
                );
                None
            }
        },
    }
}

/// `egress`: the rules, canonical (sorted, without repeats); `None`: unrestricted.
fn egress_field(obj: &Map<String, Value>, e: &mut Errors<'_>) -> Option<Vec<Rule>> {
    match obj.get("egress") {
        None => None,
        Some(Value::Null) => {
            e.add(
                "egress",
                "null: leave egress out for an unrestricted peer, or write [] to allow nothing",
            );
            None
        }
        Some(Value::Array(rules)) => {
            if rules.len() > MAX_RULES_PER_PEER {
                e.add(
                    "egress",
                    format!(
                        "{} rules, at most {MAX_RULES_PER_PEER} per peer",
                        rules.len()
                    ),
                );
            }
            let mut set = BTreeSet::new();
            for (i, rule) in rules.iter().enumerate() {
                if let Some(rule) = parse_rule(rule, &format!("egress[{i}]"), e) {
                    set.insert(rule);
                }
            }
            Some(set.into_iter().collect())
        }
        Some(_) => {
            e.add("egress", "must be an array of rules");
            None
        }
    }
}

/// `mode`: enforce (the default) or audit.
fn mode_field(obj: &Map<String, Value>, e: &mut Errors<'_>) -> Mode {
    match obj.get("mode") {
        None => Mode::Enforce,
        Some(Value::Null) => {
            e.add("mode", NULL);
            Mode::Enforce
        }
        Some(Value::String(m)) => Mode::from_name(m).unwrap_or_else(|| {
            e.add("mode", format!("{m:?} is not \"enforce\" or \"audit\""));
            Mode::Enforce
        }),
        Some(_) => {
            e.add("mode", "must be a string: \"enforce\" or \"audit\"");
            Mode::Enforce
        }
    }
}

/// `notBefore` and `expires`: the peer's window.
fn window_field(obj: &Map<String, Value>, e: &mut Errors<'_>) -> Window {
    let mut time = |field: &str, parse: fn(&str) -> Result<u64, String>| match obj.get(field) {
        None => None,
        Some(Value::Null) => {
            e.add(field, NULL);
            None
        }
        Some(Value::String(t)) => match parse(t) {
            Ok(secs) => Some(secs),
            Err(message) => {
                e.add(field, message);
                None
            }
        },
        Some(_) => {
            e.add(
                field,
                "must be an RFC 3339 time in UTC, e.g. \"2026-12-04T17:00:00Z\"",
            );
            None
        }
    };
    let window = Window {
        not_before: time("notBefore", parse_start_time),
        expires: time("expires", parse_time),
    };
    if let Some(message) = window_error(&window) {
        e.add("expires", message);
    }
    window
}

fn key_field(
    obj: &Map<String, Value>,
    field: &str,
    required: bool,
    e: &mut Errors<'_>,
) -> Option<WgKey> {
    match obj.get(field) {
        None if !required => None,
        None => {
            e.add(field, "missing");
            None
        }
        Some(Value::Null) => {
            e.add(field, NULL);
            None
        }
        Some(Value::String(s)) => {
            let key = WgKey::from_base64(s);
            if key.is_none() {
                e.add(field, "not a WireGuard key (32 bytes, base64)");
            }
            key
        }
        Some(_) => {
            e.add(field, "must be a string (32 bytes, base64)");
            None
        }
    }
}

fn addr_field<A>(obj: &Map<String, Value>, field: &str, e: &mut Errors<'_>) -> Option<A>
where
    A: std::str::FromStr + Into<IpAddr> + Copy,
{
    let family = if field == "address" { "IPv4" } else { "IPv6" };
    match obj.get(field) {
        None => None,
        Some(Value::Null) => {
            e.add(field, NULL);
            None
        }
        Some(Value::String(s)) => match s.parse::<A>() {
            Ok(addr) => {
                if !usable_tunnel_addr(addr.into()) {
                    e.add(field, format!("{s} cannot be a peer's tunnel address"));
                    None
                } else {
                    Some(addr)
                }
            }
            Err(_) => {
                e.add(field, format!("{s:?} is not an {family} address (no prefix length: the peer's allowed IP is exactly this address)"));
                None
            }
        },
        Some(_) => {
            e.add(field, "must be a string");
            None
        }
    }
}

fn parse_rule(raw: &Value, path: &str, e: &mut Errors<'_>) -> Option<Rule> {
    let Value::Object(obj) = raw else {
        if raw.is_null() {
            e.add(
                path,
                "null: must be a rule object; leave the rule out instead",
            );
        } else {
            e.add(path, "must be a JSON object with cidr, protocol and ports");
        }
        return None;
    };
    let before = e.all.len();
    for key in obj.keys() {
        if !RULE_FIELDS.contains(&key.as_str()) {
            e.add(format!("{path}.{key}"), "unknown field");
        }
    }
    let cidr = cidr_field(obj, path, e);
    let protocol = protocol_field(obj, path, e);
    let mut ports = Vec::new();
    ports_field(obj, path, protocol, &mut ports, e);
    types_field(obj, path, (protocol, cidr), &mut ports, e);
    let except = except_field(obj, path, cidr, e);
    if e.all.len() > before {
        return None;
    }
    ports.sort_unstable();
    ports.dedup();
    Some(Rule::new(cidr?, protocol?, ports).with_except(except))
}

/// A rule's `cidr`: a prefix without host bits.
fn cidr_field(obj: &Map<String, Value>, path: &str, e: &mut Errors<'_>) -> Option<IpNet> {
    match obj.get("cidr") {
        Some(Value::String(s)) => match s.parse::<IpNet>() {
            Ok(net) if net.trunc() == net => Some(net),
            Ok(net) => {
                e.add(
                    format!("{path}.cidr"),
                    format!("{s} has host bits set (did you mean {}?)", net.trunc()),
                );
                None
            }
            Err(_) => {
                e.add(
                    format!("{path}.cidr"),
                    format!("{s:?} is not a CIDR prefix (e.g. 10.0.0.0/8, fd00::/8)"),
                );
                None
            }
        },
        Some(Value::Null) => {
            e.add(format!("{path}.cidr"), "null: must be a CIDR prefix");
            None
        }
        Some(_) => {
            e.add(format!("{path}.cidr"), "must be a string");
            None
        }
        None => {
            e.add(format!("{path}.cidr"), "missing");
            None
        }
    }
}

/// A rule's `protocol` (left out: any).
fn protocol_field(obj: &Map<String, Value>, path: &str, e: &mut Errors<'_>) -> Option<Protocol> {
    match obj.get("protocol") {
        None => Some(Protocol::Any),
        Some(Value::Null) => {
            e.add(
                format!("{path}.protocol"),
                "null: leave protocol out for any protocol",
            );
            None
        }
        Some(Value::String(s)) => match protocol_named(s) {
            Some(protocol) => Some(protocol),
            None => {
                e.add(
                    format!("{path}.protocol"),
                    format!("{s:?} is not one of tcp, udp, icmp, any"),
                );
                None
            }
        },
        Some(_) => {
            e.add(
                format!("{path}.protocol"),
                "must be a string (tcp, udp, icmp or any)",
            );
            None
        }
    }
}

/// A rule's `ports` (tcp and udp), added to `ports`.
fn ports_field(
    obj: &Map<String, Value>,
    path: &str,
    protocol: Option<Protocol>,
    ports: &mut Vec<PortRange>,
    e: &mut Errors<'_>,
) {
    match obj.get("ports") {
        None => {}
        Some(Value::Null) => e.add(
            format!("{path}.ports"),
            "null: leave ports out to allow every port",
        ),
        Some(Value::Array(list)) => {
            if matches!(protocol, Some(Protocol::Any | Protocol::Icmp)) {
                e.add(
                    format!("{path}.ports"),
                    "ports are only allowed with tcp or udp (icmp takes types)",
                );
            }
            if list.is_empty() {
                e.add(
                    format!("{path}.ports"),
                    "empty: leave ports out to allow every port",
                );
            }
            for (i, port) in list.iter().enumerate() {
                match parse_port(port) {
                    Ok(range) => ports.push(range),
                    Err(msg) => e.add(format!("{path}.ports[{i}]"), msg),
                }
            }
        }
        Some(_) => e.add(
            format!("{path}.ports"),
            "must be an array of ports and \"lo-hi\" ranges",
        ),
    }
}

/// A rule's ICMP `types` (icmp), added to `ports`: of ICMPv6 for an IPv6 `cidr`.
fn types_field(
    obj: &Map<String, Value>,
    path: &str,
    (protocol, cidr): (Option<Protocol>, Option<IpNet>),
    ports: &mut Vec<PortRange>,
    e: &mut Errors<'_>,
) {
    match obj.get("types") {
        None => {}
        Some(Value::Array(list)) => {
            if !matches!(protocol, Some(Protocol::Icmp)) {
                e.add(
                    format!("{path}.types"),
                    "types are only allowed with icmp (tcp and udp take ports)",
                );
            }
            if list.is_empty() {
                e.add(
                    format!("{path}.types"),
                    "empty: leave types out to allow every ICMP type",
                );
            }
            let v6 = matches!(cidr, Some(IpNet::V6(_)));
            for (i, ty) in list.iter().enumerate() {
                let parsed = match ty {
                    Value::Number(n) => match n.as_u64() {
                        Some(v) => crate::policy::icmp_types(None, Some(v), v6),
                        None => Err(format!("{n} is not an ICMP type (0-255)")),
                    },
                    Value::String(t) => crate::policy::icmp_types(Some(t), None, v6),
                    other => Err(format!("{other} is not an ICMP type")),
                };
                match parsed {
                    Ok(range) => ports.push(range),
                    Err(msg) => e.add(format!("{path}.types[{i}]"), msg),
                }
            }
        }
        Some(Value::Null) => e.add(
            format!("{path}.types"),
            "null: leave types out to allow every ICMP type",
        ),
        Some(_) => e.add(
            format!("{path}.types"),
            "must be an array of ICMP types, \"lo-hi\" ranges and type names",
        ),
    }
}

/// A rule's `except`: prefixes inside its `cidr`.
fn except_field(
    obj: &Map<String, Value>,
    path: &str,
    cidr: Option<IpNet>,
    e: &mut Errors<'_>,
) -> Vec<IpNet> {
    let mut except = Vec::new();
    match obj.get("except") {
        None => {}
        Some(Value::Array(list)) => {
            for (i, raw) in list.iter().enumerate() {
                match raw.as_str().map(str::parse::<IpNet>) {
                    Some(Ok(net)) => except.push(net),
                    _ => e.add(
                        format!("{path}.except[{i}]"),
                        format!("{raw} is not a CIDR prefix"),
                    ),
                }
            }
            if let Some(cidr) = cidr {
                if except.len() == list.len() {
                    if let Err(msg) = crate::policy::check_except(cidr, &except) {
                        e.add(format!("{path}.except"), msg);
                    }
                }
            }
        }
        Some(Value::Null) => e.add(
            format!("{path}.except"),
            "null: leave except out to keep the whole cidr",
        ),
        Some(_) => e.add(
            format!("{path}.except"),
            "must be an array of CIDR prefixes",
        ),
    }
    except
}

fn parse_port(raw: &Value) -> Result<PortRange, String> {
    match raw {
        Value::Number(n) => match n.as_u64() {
            Some(v) => port_number(v).map(PortRange::single),
            None => Err(format!("{n} is not a port (1-65535)")),
        },
        Value::String(s) => port_text(s),
        other => Err(format!("{other} is not a port or a \"lo-hi\" range")),
    }
}
