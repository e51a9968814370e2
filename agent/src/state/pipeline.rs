//! The incremental state pipeline: a push costs what changed.
//!
//! Hashing the file's bytes is the only work proportional to its size that every push pays
//! (beside it, a push that adds or removes peers makes a pass over plain arrays of offsets and
//! hashes). A file that is the last accepted one with one run of peers replaced (a few peers
//! added, removed or changed in a file written in the same order) has only that run read
//! ([`splice`]); any other file has every peer read, in one typed pass over the top level and
//! each peer's fields as borrowed text. Each peer read is hashed. A peer that asks exactly
//! what a peer of the last accepted state asked (the same fields, and the same set of rules,
//! in whatever order) keeps that [`PeerSpec`]: no validation, no compiling, no planning. The
//! other peers are validated alone, and the cross-peer rules (unique names, keys and
//! addresses; the capacity of the peer map and of the policy tries) are checked against
//! indexes kept up to date with each accepted state, not rebuilt. The state itself is changed
//! in place: nothing is copied, and nothing proportional to the peer count is freed, on the
//! way to the kernel.
//!
//! Whatever the pipeline cannot decide alone (an invalid peer, a duplicate, a full trie, an
//! unusual top level) goes to [`super::parse`], the full parse, which decides: an invalid file
//! is rejected whole with exactly its errors, and a valid one replaces everything. So the
//! pipeline always ends in the state a parse from scratch gives, with the changes a comparison
//! of the two states gives; [`super::edits`] checks that (the property test and the
//! `pipeline` fuzz target run it).
//!
//! A peer's identity across pushes is a 128-bit hash (two 64-bit hashes seeded at random per
//! process; a rule set hashes as the sum of its rules' hashes). The state file is written by
//! root (see [`crate::trust`]), not by an adversary searching for collisions.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    hash::{BuildHasher, Hasher},
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
};

use ipnet::IpNet;
use wgfence_common::{MAX_PEERS, MAX_POLICY_ENTRIES};

use super::{
    parse,
    splice::{self, Blocks, Hash, Layout, Window},
    typed, Compiled, DesiredState, PeerSpec, SharedRules, StateError, WgKey,
};
use crate::policy::{CompiledPolicy, Rule};

/// A state file's identity, from the hashes of its blocks: one pass over the file
/// ([`Pipeline::fingerprint`]) tells an unchanged file, and, for a new one, where it differs
/// from the last ([`splice`]). The same bytes have the same identity for the pipeline's life.
#[derive(Debug, Clone)]
pub struct Fingerprint {
    id: Hash,
    blocks: Blocks,
}

/// A state file's bytes, as the pipeline reads them: a file read in pieces (a push reads it
/// once in order, then only the run of peers that changed, so the whole file is never held in
/// memory for a few changed peers), or bytes already in memory.
pub trait StateBytes {
    /// What a read may fail with (a file that shrank or went away while it was read).
    type Error;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Every byte, in order, in pieces.
    fn each_piece(&self, f: &mut dyn FnMut(&[u8])) -> Result<(), Self::Error>;
    /// Fills `buf` with the bytes from `offset` on.
    fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<(), Self::Error>;
    /// Every byte at once.
    fn all(&self) -> Result<std::borrow::Cow<'_, [u8]>, Self::Error>;
}

impl StateBytes for [u8] {
    type Error = std::convert::Infallible;

    fn len(&self) -> usize {
        <[u8]>::len(self)
    }

    fn each_piece(&self, f: &mut dyn FnMut(&[u8])) -> Result<(), Self::Error> {
        f(self);
        Ok(())
    }

    fn read_at(&self, offset: usize, buf: &mut [u8]) -> Result<(), Self::Error> {
        buf.copy_from_slice(&self[offset..offset + buf.len()]);
        Ok(())
    }

    fn all(&self) -> Result<std::borrow::Cow<'_, [u8]>, Self::Error> {
        Ok(std::borrow::Cow::Borrowed(self))
    }
}

impl Fingerprint {
    pub fn id(&self) -> u128 {
        self.id
    }
}

/// Sets and maps keyed by [`Hash`]es, which are random already: their low bits are the hash.
type ByHash = std::hash::BuildHasherDefault<LowBits>;

#[derive(Default)]
struct LowBits(u64);

impl Hasher for LowBits {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u128(&mut self, n: u128) {
        self.0 = n as u64;
    }
}

/// What changed between the last accepted state and the new one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    /// The peers that are new, or whose spec changed: their names, sorted.
    pub touched: Vec<String>,
    /// The previous versions of the peers that left or changed, sorted by name.
    pub gone: Vec<PeerSpec>,
    /// `replies` changed.
    pub replies: bool,
    /// When the first window of the state these changes led to ends (seconds since the
    /// epoch): `Some(None)` when no peer's does, `None` when not known (then the caller
    /// looks at every peer).
    pub earliest_expiry: Option<Option<u64>>,
}

impl Changes {
    /// Nothing changed that the kernel could see.
    pub fn is_empty(&self) -> bool {
        self.touched.is_empty() && self.gone.is_empty() && !self.replies
    }

    /// The touched peers of `desired` (the state these changes led to), sorted by name.
    pub fn touched_in<'a>(&self, desired: &'a DesiredState) -> Vec<&'a PeerSpec> {
        self.touched
            .iter()
            .filter_map(|name| {
                desired
                    .peers
                    .binary_search_by(|p| p.name.as_str().cmp(name))
                    .ok()
                    .map(|i| &desired.peers[i])
            })
            .collect()
    }
}

/// Why a state was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Rejection {
    #[error(transparent)]
    Invalid(#[from] StateError),
    /// Valid, but more peers than the caller can hold (a userspace WireGuard's limit).
    #[error("{peers} peers, at most {max}")]
    TooMany { peers: usize, max: usize },
    #[error("state file is not UTF-8: {0}")]
    NotUtf8(#[from] std::str::Utf8Error),
}

/// The pipeline: the last accepted state and the indexes that decide the next one.
pub struct Pipeline {
    state: DesiredState,
    /// The hash of each peer's text, in `state.peers` order.
    hashes: Vec<Hash>,
    /// The same hashes, to look up.
    known: HashSet<Hash, ByHash>,
    /// Each distinct rule set, with its shared copy and compiled policy.
    compiled: Compiled,
    index: Index,
    /// Where each peer is in the accepted state's file, to find what the next file changed
    /// from its bytes ([`splice`]); `None` when the typed pass could not read that file.
    layout: Option<Layout>,
    /// The block size files are compared by ([`splice::BLOCK`]; smaller in the tests).
    block: usize,
    /// Peers whose fields the last update read.
    read: usize,
    hashers: (
        foldhash::quality::RandomState,
        foldhash::quality::RandomState,
    ),
}

impl Default for Pipeline {
    fn default() -> Self {
        Self::new()
    }
}

/// What the cross-peer rules look up, kept up to date with each accepted state.
#[derive(Default)]
struct Index {
    /// Peers per fingerprint of their public key ([`key_print`]): 16 bytes a key with its
    /// count, where the key itself is 32. A fingerprint in use means the key is taken only if a peer has that
    /// very key, which [`Pipeline::key_taken`] checks against the state: a pass over the
    /// peers, on that rare case only (a duplicate key, which the file is then rejected for,
    /// or two keys of one fingerprint).
    keys: HashMap<u64, u32, foldhash::fast::FixedState>,
    addrs: Addrs,
    /// How many peers use each rule set (by its shared copy's address).
    uses: HashMap<usize, usize>,
    /// Trie entries of the distinct policies, per family (IPv4, IPv6).
    trie: (usize, usize),
    restricted: usize,
    /// Peers per window end: the first one says when a peer expires next, without a pass.
    expiries: BTreeMap<u64, usize>,
}

impl Index {
    fn add(&mut self, spec: &PeerSpec) {
        *self.keys.entry(key_print(&spec.public_key)).or_insert(0) += 1;
        for addr in spec.addrs() {
            self.addrs.insert(addr);
        }
        if let Some(end) = spec.window().expires {
            *self.expiries.entry(end).or_insert(0) += 1;
        }
        if let (Some(rules), Some(policy)) = (&spec.rules, &spec.policy) {
            self.restricted += 1;
            let uses = self.uses.entry(rules_id(rules)).or_insert(0);
            if *uses == 0 {
                let (v4, v6) = entries(policy);
                self.trie.0 += v4;
                self.trie.1 += v6;
            }
            *uses += 1;
        }
    }

    fn remove(&mut self, spec: &PeerSpec) {
        let print = key_print(&spec.public_key);
        if let Some(n) = self.keys.get_mut(&print) {
            *n -= 1;
            if *n == 0 {
                self.keys.remove(&print);
            }
        }
        for addr in spec.addrs() {
            self.addrs.remove(&addr);
        }
        if let Some(end) = spec.window().expires {
            if let Some(n) = self.expiries.get_mut(&end) {
                *n -= 1;
                if *n == 0 {
                    self.expiries.remove(&end);
                }
            }
        }
        if let (Some(rules), Some(policy)) = (&spec.rules, &spec.policy) {
            self.restricted -= 1;
            let id = rules_id(rules);
            if let Some(uses) = self.uses.get_mut(&id) {
                *uses -= 1;
                if *uses == 0 {
                    self.uses.remove(&id);
                    let (v4, v6) = entries(policy);
                    self.trie.0 -= v4;
                    self.trie.1 -= v6;
                }
            }
        }
    }
}

/// A set of addresses, a table per family: an `IpAddr` takes 17 bytes for either, so one
/// table would hold every IPv4 address in the room of an IPv6 one.
#[derive(Default, PartialEq)]
struct Addrs {
    v4: HashSet<Ipv4Addr>,
    v6: HashSet<Ipv6Addr>,
}

impl Addrs {
    fn insert(&mut self, addr: IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => self.v4.insert(a),
            IpAddr::V6(a) => self.v6.insert(a),
        }
    }

    fn remove(&mut self, addr: &IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => self.v4.remove(a),
            IpAddr::V6(a) => self.v6.remove(a),
        }
    }

    fn contains(&self, addr: &IpAddr) -> bool {
        match addr {
            IpAddr::V4(a) => self.v4.contains(a),
            IpAddr::V6(a) => self.v6.contains(a),
        }
    }
}

/// A peer of a new file, as read: one the last accepted state has (its spec is kept), or a
/// new one (its fields, to parse).
enum Read<'a> {
    Known(Hash),
    New(Hash, Box<typed::RawPeer<'a>>),
}

/// A peer's text that the last accepted state did not have, parsed.
struct Arrival {
    hash: Hash,
    spec: PeerSpec,
}

/// A public key's fingerprint in [`Index::keys`]: a hash with a fixed seed, so that indexes
/// built apart compare equal.
fn key_print(key: &WgKey) -> u64 {
    use std::hash::BuildHasher as _;
    foldhash::fast::FixedState::default().hash_one(key.0)
}

fn rules_id(rules: &Arc<Vec<Rule>>) -> usize {
    Arc::as_ptr(rules) as usize
}

fn entries(policy: &CompiledPolicy) -> (usize, usize) {
    let (mut v4, mut v6) = (0, 0);
    for (prefix, _) in policy.entries() {
        match prefix {
            IpNet::V4(_) => v4 += 1,
            IpNet::V6(_) => v6 += 1,
        }
    }
    (v4, v6)
}

impl Pipeline {
    /// A pipeline that has accepted nothing yet (an empty state).
    pub fn new() -> Self {
        Self {
            state: DesiredState::default(),
            hashes: Vec::new(),
            known: HashSet::default(),
            compiled: HashMap::new(),
            index: Index::default(),
            layout: None,
            block: splice::BLOCK,
            read: 0,
            hashers: Default::default(),
        }
    }

    /// The last accepted state.
    pub fn state(&self) -> &DesiredState {
        &self.state
    }

    /// Peers with an `egress`.
    pub fn restricted_peers(&self) -> usize {
        self.index.restricted
    }

    /// Peers whose fields the last update read: those of the run a file changed, when it is
    /// the last file with one run of peers replaced; otherwise every peer.
    pub fn peers_read(&self) -> usize {
        self.read
    }

    /// Distinct rule sets (`egress` lists) of the accepted state; rule sets that compile the
    /// same share one policy in the kernel.
    pub fn rule_sets(&self) -> usize {
        self.compiled.len()
    }

    /// The indexes, rebuilt from the state, are the ones kept up to date; what differs.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn check_indexes(&self) -> Result<(), String> {
        let mut rebuilt = Index::default();
        for peer in &self.state.peers {
            rebuilt.add(peer);
        }
        let known: HashSet<Hash, ByHash> = self.hashes.iter().copied().collect();
        let compiled: HashSet<usize> = self.compiled.keys().map(|r| rules_id(&r.0)).collect();
        let used: HashSet<usize> = rebuilt.uses.keys().copied().collect();
        let differs = [
            ("keys", rebuilt.keys != self.index.keys),
            ("addresses", rebuilt.addrs != self.index.addrs),
            ("policy uses", rebuilt.uses != self.index.uses),
            ("trie entries", rebuilt.trie != self.index.trie),
            (
                "restricted peers",
                rebuilt.restricted != self.index.restricted,
            ),
            (
                "peer hashes",
                known != self.known || known.len() != self.state.peers.len(),
            ),
            ("compiled policies", compiled != used),
        ];
        match differs.iter().find(|(_, differs)| *differs) {
            Some((what, _)) => Err(format!("the pipeline's {what} differ from its state's")),
            None => Ok(()),
        }
    }

    /// The identity of the file `bytes`: one pass over it, hashing its blocks.
    pub fn fingerprint<B: StateBytes + ?Sized>(&self, bytes: &B) -> Result<Fingerprint, B::Error> {
        let len = bytes.len();
        let blocks = splice::blocks(len, |f| bytes.each_piece(f), self.block, &|b| self.hash(b))?;
        let (a, b) = &self.hashers;
        let (mut ha, mut hb) = (a.build_hasher(), b.build_hasher());
        for hasher in [&mut ha, &mut hb] {
            hasher.write_usize(len);
            blocks.head.iter().for_each(|h| hasher.write_u128(*h));
        }
        Ok(Fingerprint {
            id: (u128::from(ha.finish()) << 64) | u128::from(hb.finish()),
            blocks,
        })
    }

    /// A 128-bit hash of `bytes` (the same bytes hash alike for this pipeline's life).
    fn hash(&self, bytes: &[u8]) -> Hash {
        let (a, b) = &self.hashers;
        (u128::from(a.hash_one(bytes)) << 64) | u128::from(b.hash_one(bytes))
    }

    /// A peer's identity: a hash of what decides its spec, its fields and its set of rules
    /// (so a peer whose rules are only reordered, or whose fields are, is the same peer).
    fn peer_hash(&self, raw: &typed::RawPeer<'_>) -> Hash {
        let (a, b) = &self.hashers;
        let (mut ha, mut hb) = (a.build_hasher(), b.build_hasher());
        raw.feed(
            &mut |bytes: &[u8]| {
                ha.write(bytes);
                hb.write(bytes);
            },
            |rule| self.hash(rule.as_bytes()),
        );
        (u128::from(ha.finish()) << 64) | u128::from(hb.finish())
    }

    /// A peer read from a new file: its identity, and its fields if the state has no such
    /// peer.
    fn read<'a>(&self, raw: typed::RawPeer<'a>) -> Read<'a> {
        let hash = self.peer_hash(&raw);
        if self.known.contains(&hash) {
            Read::Known(hash)
        } else {
            Read::New(hash, Box::new(raw))
        }
    }

    /// Reads a state file's contents. Accepted, the state becomes [`Pipeline::state`] and the
    /// changes since the previous one are returned; rejected, nothing changes and the errors
    /// are exactly those of [`super::parse`]. `max_peers`: more peers are refused (after
    /// validation: an invalid file is named as such first).
    pub fn update(&mut self, text: &str, max_peers: Option<usize>) -> Result<Changes, Rejection> {
        let bytes = text.as_bytes();
        let read = self
            .fingerprint(bytes)
            .and_then(|fingerprint| self.update_from(bytes, fingerprint, max_peers));
        match read {
            Ok(result) => result,
            Err(never) => match never {},
        }
    }

    /// [`Self::update`] for the file `bytes`, whose [`Self::fingerprint`] was taken already
    /// (the daemon's, to skip an unchanged file). A file that is a splice of the last one has
    /// only its changed run read again; any other is read whole. `Err`: the file could not be
    /// read (nothing changed then).
    pub fn update_from<B: StateBytes + ?Sized>(
        &mut self,
        bytes: &B,
        fingerprint: Fingerprint,
        max_peers: Option<usize>,
    ) -> Result<Result<Changes, Rejection>, B::Error> {
        let blocks = fingerprint.blocks;
        let spliced = match self.window(bytes, &blocks)? {
            Some((window, run)) => self.spliced(&window, &run, &blocks, max_peers),
            None => None,
        };
        let result = match spliced {
            Some(result) => result,
            None => {
                let all = bytes.all()?;
                match std::str::from_utf8(&all) {
                    Ok(text) => match self.incremental(text, &blocks, max_peers) {
                        Some(result) => result,
                        None => self.parse_whole(text, blocks, max_peers),
                    },
                    Err(e) => Err(Rejection::NotUtf8(e)),
                }
            }
        };
        Ok(result.map(|mut changes| {
            changes.earliest_expiry = Some(self.index.expiries.keys().next().copied());
            changes
        }))
    }

    /// Where `bytes` (of `blocks`) differ from the last accepted file if they are a splice of
    /// it, and the text of the run there; `None` if they are not (or the run is not UTF-8: the
    /// read of the whole file names it).
    fn window<B: StateBytes + ?Sized>(
        &self,
        bytes: &B,
        blocks: &Blocks,
    ) -> Result<Option<(Window, String)>, B::Error> {
        let Some(layout) = &self.layout else {
            return Ok(None);
        };
        let read_at = |at: usize, buf: &mut [u8]| bytes.read_at(at, buf);
        let Some(window) = splice::locate(layout, blocks, self.block, read_at)? else {
            return Ok(None);
        };
        let range = window.range();
        let mut run = vec![0; range.len()];
        bytes.read_at(range.start, &mut run)?;
        Ok(String::from_utf8(run).ok().map(|run| (window, run)))
    }

    /// The pass for a file that is the last one with one run of peers replaced, the text `run`
    /// in `window` ([`splice`]); `None` where the file is not that, or the pass cannot decide
    /// alone.
    fn spliced(
        &mut self,
        window: &Window,
        run: &str,
        blocks: &Blocks,
        max_peers: Option<usize>,
    ) -> Option<Result<Changes, Rejection>> {
        let layout = self.layout.as_ref()?;
        let mut splice = window.splice(layout, run)?;
        // A run of every peer (a file in another order) replaces the whole state.
        let replaced: Option<HashSet<Hash, ByHash>> = (splice.from > 0
            || splice.to < layout.peers())
        .then(|| splice.replaced(layout).iter().copied().collect());
        let peers = splice.peers(layout);
        if peers > MAX_PEERS as usize {
            return None;
        }
        let run: Vec<_> = std::mem::take(&mut splice.run)
            .into_iter()
            .map(|(at, raw)| (at, self.read(raw)))
            .collect();
        let offsets = run.iter().map(|(at, _)| *at).collect();
        let replies = self.state.replies;
        let (result, ids) = self.replace(run, replaced.as_ref(), peers, replies, max_peers)?;
        if let (Ok(_), Some(layout)) = (&result, &mut self.layout) {
            splice.apply(layout, blocks.clone(), offsets, ids);
        }
        Some(result)
    }

    /// The pass over every peer; `None` where it cannot decide alone.
    fn incremental(
        &mut self,
        text: &str,
        blocks: &Blocks,
        max_peers: Option<usize>,
    ) -> Option<Result<Changes, Rejection>> {
        let top = typed::top(text, |raw| self.read(raw))?;
        let starts = top.peers.iter().map(|(at, _)| *at).collect();
        let peers = top.peers.len();
        let replies = top.replies.unwrap_or(true);
        let (result, ids) = self.replace(top.peers, None, peers, replies, max_peers)?;
        if result.is_ok() {
            let layout = Layout::new(text, blocks.clone(), starts, ids, top.end);
            self.layout = Some(layout);
        }
        Some(result)
    }

    /// The accepted state with the peers `run` (of a new file) in place of those whose
    /// identities are `replaced` (`None`: every peer), leading to a state of `peers` peers;
    /// with the run's identities. Only the peers of the run that the state does not have are
    /// parsed, validated and compiled. `None` where it cannot decide alone.
    fn replace(
        &mut self,
        run: Vec<(usize, Read<'_>)>,
        replaced: Option<&HashSet<Hash, ByHash>>,
        peers: usize,
        replies: bool,
        max_peers: Option<usize>,
    ) -> Option<(Result<Changes, Rejection>, Vec<Hash>)> {
        self.read = run.len();
        let mut seen: HashSet<Hash, ByHash> =
            HashSet::with_capacity_and_hasher(run.len(), ByHash::default());
        let mut ids = Vec::with_capacity(run.len());
        let mut new_texts = Vec::new();
        for (_, read) in run {
            let (hash, known) = match &read {
                Read::Known(hash) => (*hash, true),
                Read::New(hash, _) => (*hash, false),
            };
            // The same peer twice, or again beside itself where it is kept: a duplicate the
            // full parse names.
            if !seen.insert(hash) || (known && replaced.is_some_and(|r| !r.contains(&hash))) {
                return None;
            }
            if let Read::New(hash, raw) = read {
                new_texts.push((hash, raw));
            }
            ids.push(hash);
        }
        let leaving = self.leaving(&seen, replaced, new_texts.is_empty());
        drop(seen);
        let arrivals = self.parse_arrivals(&new_texts)?;
        if !self.cross_peer_checks(&arrivals, &leaving) {
            self.forget_unused_policies();
            return None;
        }
        if let Some(max) = max_peers {
            if peers > max {
                self.forget_unused_policies();
                return Some((Err(Rejection::TooMany { peers, max }), ids));
            }
        }
        Some((Ok(self.commit(arrivals, leaving, replies)), ids))
    }

    /// Where in the state the peers are that leave: those `replaced` (every peer for `None`)
    /// that the new file does not have (`seen`).
    fn leaving(
        &self,
        seen: &HashSet<Hash, ByHash>,
        replaced: Option<&HashSet<Hash, ByHash>>,
        none_new: bool,
    ) -> Vec<usize> {
        let at = |leaves: &dyn Fn(&Hash) -> bool| {
            (0..self.hashes.len())
                .filter(|i| leaves(&self.hashes[*i]))
                .collect()
        };
        match replaced {
            // Every text known and as many as before: the same peers (hashes are distinct).
            None if none_new && seen.len() == self.hashes.len() => Vec::new(),
            None => at(&|hash| !seen.contains(hash)),
            Some(replaced) => {
                let gone: HashSet<Hash, ByHash> = replaced.difference(seen).copied().collect();
                if gone.is_empty() {
                    return Vec::new();
                }
                at(&|hash| gone.contains(hash))
            }
        }
    }

    /// Parses the texts the last state did not have, each alone; `None` if one is not a valid
    /// peer on its own.
    fn parse_arrivals<'a>(
        &mut self,
        texts: &[(Hash, Box<typed::RawPeer<'a>>)],
    ) -> Option<Vec<Arrival>> {
        let mut egress = HashMap::new();
        let mut arrivals = Vec::with_capacity(texts.len());
        for (hash, raw) in texts {
            match typed::one_peer(raw, &mut egress, &mut self.compiled) {
                Some(spec) => arrivals.push(Arrival { hash: *hash, spec }),
                None => {
                    drop(egress);
                    self.forget_unused_policies();
                    return None;
                }
            }
        }
        Some(arrivals)
    }

    /// Drops the rule sets no accepted peer uses (those compiled for a rejected change).
    fn forget_unused_policies(&mut self) {
        let uses = &self.index.uses;
        self.compiled
            .retain(|rules, _| uses.contains_key(&rules_id(&rules.0)));
    }

    /// Whether a peer of the accepted state has `key`.
    fn key_taken(&self, key: &WgKey) -> bool {
        self.index.keys.contains_key(&key_print(key))
            && self.state.peers.iter().any(|p| p.public_key == *key)
    }

    /// Unique names, keys and addresses, and the tries' capacity, for the state the arrivals
    /// and departures lead to: whether it passes.
    fn cross_peer_checks(&self, arrivals: &[Arrival], leaving: &[usize]) -> bool {
        let gone = || leaving.iter().map(|i| &self.state.peers[*i]);
        let freed_names: HashSet<&str> = gone().map(|p| p.name.as_str()).collect();
        let freed_keys: HashSet<WgKey> = gone().map(|p| p.public_key).collect();
        let freed_addrs: HashSet<IpAddr> = gone().flat_map(PeerSpec::addrs).collect();
        let mut names = HashSet::with_capacity(arrivals.len());
        let mut keys = HashSet::with_capacity(arrivals.len());
        let mut addrs = HashSet::with_capacity(arrivals.len());
        for Arrival { spec, .. } in arrivals {
            let name = spec.name.as_str();
            let taken = self
                .state
                .peers
                .binary_search_by(|p| p.name.as_str().cmp(name))
                .is_ok();
            if (taken && !freed_names.contains(name)) || !names.insert(name) {
                return false;
            }
            let key = spec.public_key;
            if (!freed_keys.contains(&key) && self.key_taken(&key)) || !keys.insert(key) {
                return false;
            }
            for addr in spec.addrs() {
                if (self.index.addrs.contains(&addr) && !freed_addrs.contains(&addr))
                    || !addrs.insert(addr)
                {
                    return false;
                }
            }
        }
        // The tries: rule sets whose last user leaves free their entries, new ones add theirs.
        let mut delta: HashMap<usize, (i64, &CompiledPolicy)> = HashMap::new();
        for p in gone() {
            if let (Some(rules), Some(policy)) = (&p.rules, &p.policy) {
                delta.entry(rules_id(rules)).or_insert((0, policy)).0 -= 1;
            }
        }
        for Arrival { spec, .. } in arrivals {
            if let (Some(rules), Some(policy)) = (&spec.rules, &spec.policy) {
                delta.entry(rules_id(rules)).or_insert((0, policy)).0 += 1;
            }
        }
        let (mut v4, mut v6) = self.index.trie;
        for (id, (change, policy)) in delta {
            let before = self.index.uses.get(&id).copied().unwrap_or(0) as i64;
            let after = before + change;
            let (p4, p6) = entries(policy);
            if before == 0 && after > 0 {
                v4 += p4;
                v6 += p6;
            } else if before > 0 && after <= 0 {
                v4 -= p4;
                v6 -= p6;
            }
        }
        v4.max(v6) <= MAX_POLICY_ENTRIES as usize
    }

    /// Makes the arrivals and departures the accepted state; the changes the kernel sees.
    fn commit(
        &mut self,
        mut arrivals: Vec<Arrival>,
        leaving: Vec<usize>,
        replies: bool,
    ) -> Changes {
        let mut changes = Changes {
            replies: replies != self.state.replies,
            ..Changes::default()
        };
        self.state.replies = replies;
        // The passes that commit take only files without policy tests (those go to the full
        // parse, which runs them): the last file's tests are gone with it.
        self.state.tests.clear();
        // Every departure out of the indexes before any arrival goes in (a peer may keep its
        // key or its addresses).
        for &i in &leaving {
            self.known.remove(&self.hashes[i]);
            self.index.remove(&self.state.peers[i]);
        }
        for arrival in &arrivals {
            self.known.insert(arrival.hash);
            self.index.add(&arrival.spec);
        }
        arrivals.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        // A departure whose name arrives again is replaced in place.
        let mut leaving: HashSet<usize> = leaving.into_iter().collect();
        let mut inserts = Vec::new();
        for Arrival { hash, spec } in arrivals {
            let at = self
                .state
                .peers
                .binary_search_by(|p| p.name.as_str().cmp(&spec.name));
            match at {
                Ok(i) if leaving.remove(&i) => {
                    self.hashes[i] = hash;
                    let old = std::mem::replace(&mut self.state.peers[i], spec);
                    if old != self.state.peers[i] {
                        changes.touched.push(old.name.to_string());
                        changes.gone.push(old);
                    }
                }
                _ => {
                    changes.touched.push(spec.name.to_string());
                    inserts.push((hash, spec));
                }
            }
        }
        let mut leaving: Vec<usize> = leaving.into_iter().collect();
        leaving.sort_unstable();
        self.remove_at(&leaving, &mut changes.gone);
        self.insert_sorted(inserts);
        changes.gone.sort_by(|a, b| a.name.cmp(&b.name));
        changes.touched.sort();
        self.forget_unused_policies();
        changes
    }

    /// Takes the peers at `at` (ascending) out of the state, into `gone`: a few in place,
    /// many in one pass.
    fn remove_at(&mut self, at: &[usize], gone: &mut Vec<PeerSpec>) {
        if at.len() <= 8 {
            for &i in at.iter().rev() {
                gone.push(self.state.peers.remove(i));
                self.hashes.remove(i);
            }
            return;
        }
        let peers = std::mem::take(&mut self.state.peers);
        let hashes = std::mem::take(&mut self.hashes);
        let mut next = at.iter().peekable();
        for (i, (peer, hash)) in peers.into_iter().zip(hashes).enumerate() {
            if next.next_if(|j| **j == i).is_some() {
                gone.push(peer);
            } else {
                self.state.peers.push(peer);
                self.hashes.push(hash);
            }
        }
    }

    /// Puts new peers (sorted by name, none in the state) in their places: a few in place,
    /// many merged in one pass.
    fn insert_sorted(&mut self, inserts: Vec<(Hash, PeerSpec)>) {
        if inserts.len() <= 8 {
            for (hash, spec) in inserts {
                let (Ok(at) | Err(at)) = self
                    .state
                    .peers
                    .binary_search_by(|p| p.name.as_str().cmp(&spec.name));
                self.state.peers.insert(at, spec);
                self.hashes.insert(at, hash);
            }
            return;
        }
        let peers = std::mem::take(&mut self.state.peers);
        let hashes = std::mem::take(&mut self.hashes);
        let total = peers.len() + inserts.len();
        self.state.peers.reserve(total);
        self.hashes.reserve(total);
        let mut old = peers.into_iter().zip(hashes).peekable();
        for (hash, spec) in inserts {
            while let Some((peer, h)) = old.next_if(|(p, _)| p.name < spec.name) {
                self.state.peers.push(peer);
                self.hashes.push(h);
            }
            self.state.peers.push(spec);
            self.hashes.push(hash);
        }
        for (peer, h) in old {
            self.state.peers.push(peer);
            self.hashes.push(h);
        }
    }

    /// The full parse decides; a valid state replaces everything (the slow path: a file the
    /// incremental pass could not decide alone, valid after all).
    fn parse_whole(
        &mut self,
        text: &str,
        blocks: Blocks,
        max_peers: Option<usize>,
    ) -> Result<Changes, Rejection> {
        let desired = parse(text)?;
        self.read = desired.peers.len();
        if let Some(max) = max_peers {
            if desired.peers.len() > max {
                return Err(Rejection::TooMany {
                    peers: desired.peers.len(),
                    max,
                });
            }
        }
        // Each peer's text hash, by name, and the file's layout.
        let mut by_name: HashMap<String, Hash> = HashMap::new();
        let mut layout = None;
        if let Some(top) = typed::top(text, |raw| (self.peer_hash(&raw), raw.name().to_owned())) {
            let ids: Vec<Hash> = top.peers.iter().map(|(_, (id, _))| *id).collect();
            let starts = top.peers.iter().map(|(at, _)| *at).collect();
            for (_, (id, name)) in top.peers {
                by_name.insert(name, id);
            }
            layout = Some(Layout::new(text, blocks, starts, ids, top.end));
        }
        let previous = std::mem::replace(self, Self::new_with(self.hashers.clone(), self.block));
        self.layout = layout;
        for peer in &desired.peers {
            // A peer without a hash of its text (none found) is parsed again next time.
            let hash = by_name.get(peer.name.as_str()).copied().unwrap_or_else(|| {
                self.hash(format!("(unknown text of) {}", peer.name).as_bytes())
            });
            self.hashes.push(hash);
            self.known.insert(hash);
            if let (Some(rules), Some(policy)) = (&peer.rules, &peer.policy) {
                self.compiled
                    .entry(SharedRules(Arc::clone(rules)))
                    .or_insert_with(|| Arc::clone(policy));
            }
            self.index.add(peer);
        }
        self.state = desired;
        let changes = diff(&previous.state, &self.state);
        // Freeing the previous state is O(peers): off the path to the kernel.
        crate::drop_later(previous);
        Ok(changes)
    }

    fn new_with(
        hashers: (
            foldhash::quality::RandomState,
            foldhash::quality::RandomState,
        ),
        block: usize,
    ) -> Self {
        Self {
            hashers,
            block,
            ..Self::new()
        }
    }

    /// A pipeline that compares files by blocks of `block` bytes: small files have several.
    #[cfg(any(test, feature = "testing"))]
    pub fn with_block(block: usize) -> Self {
        Self {
            block: block.max(1),
            ..Self::new()
        }
    }

    /// The layout kept for the accepted file is the one `text` (that file) has; what differs.
    #[cfg(any(test, feature = "testing"))]
    pub(super) fn check_layout(&self, text: &str) -> Result<(), String> {
        let Some(layout) = &self.layout else {
            return Ok(());
        };
        let top = typed::top(text, |raw| self.peer_hash(&raw))
            .ok_or("a layout kept for a file the typed pass cannot read")?;
        let ids = top.peers.iter().map(|(_, id)| *id).collect();
        let starts = top.peers.iter().map(|(at, _)| *at).collect();
        let blocks = match self.fingerprint(text.as_bytes()) {
            Ok(fingerprint) => fingerprint.blocks,
            Err(never) => match never {},
        };
        let rebuilt = Layout::new(text, blocks, starts, ids, top.end);
        if &rebuilt == layout {
            Ok(())
        } else {
            Err(format!(
                "the layout kept differs from the file's:\n kept: {layout:?}\n file: {rebuilt:?}"
            ))
        }
    }
}

/// The changes from `previous` to `desired` by comparing both.
pub(super) fn diff(previous: &DesiredState, desired: &DesiredState) -> Changes {
    let mut changes = Changes {
        replies: previous.replies != desired.replies,
        earliest_expiry: Some(
            desired
                .peers
                .iter()
                .filter_map(|p| p.window().expires)
                .min(),
        ),
        ..Changes::default()
    };
    for pair in super::by_name(previous, desired) {
        match pair {
            (Some(old), Some(new)) if old == new => {}
            (old, new) => {
                changes.gone.extend(old.cloned());
                changes.touched.extend(new.map(|p| p.name.to_string()));
            }
        }
    }
    changes
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::state::WgKey;

    fn peer(n: u32) -> Value {
        let mut key = [9u8; 32];
        key[..4].copy_from_slice(&n.to_le_bytes());
        json!({
            "name": format!("peer-{n:05}"),
            "publicKey": WgKey(key).to_base64(),
            "address": format!("10.9.{}.{}", n / 250, n % 250 + 1),
            "egress": [{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] }],
        })
    }

    fn file(peers: &[Value]) -> String {
        json!({ "version": 1, "peers": peers }).to_string()
    }

    /// A push that changes a few peers of a file in the same order reads those few, and ends
    /// in the state a parse from scratch gives; a file in another order is read whole.
    #[test]
    fn a_change_to_a_few_peers_reads_only_the_peers_around_it() {
        let mut peers: Vec<Value> = (0..2000).map(peer).collect();
        // The same pushes, read as the daemon reads them: from a file, in pieces.
        let path = std::env::temp_dir().join(format!("wgfence-pieces-{}", std::process::id()));
        let mut from_file = Pipeline::new();
        let mut read_from_file = |text: &str, pipeline: &mut Pipeline| {
            std::fs::write(&path, text).unwrap();
            let opened =
                crate::source::StateFile::new(&path, false, crate::input::DEFAULT_MAX_STATE_BYTES)
                    .open()
                    .unwrap();
            assert!(opened.len() > 256 * 1024, "a file of several pieces");
            let fingerprint = from_file.fingerprint(&opened).unwrap();
            let changes = from_file.update_from(&opened, fingerprint, None).unwrap();
            assert_eq!(from_file.state(), pipeline.state());
            assert_eq!(from_file.peers_read(), pipeline.peers_read());
            from_file.check_layout(text).unwrap();
            changes.unwrap()
        };
        let mut pipeline = Pipeline::new();
        let text = file(&peers);
        pipeline.update(&text, None).unwrap();
        read_from_file(&text, &mut pipeline);
        assert_eq!(pipeline.peers_read(), 2000);

        let mut push = |peers: &[Value], pipeline: &mut Pipeline| {
            let text = file(peers);
            let changes = pipeline.update(&text, None).unwrap();
            assert_eq!(pipeline.state(), &parse(&text).unwrap());
            pipeline.check_layout(&text).unwrap();
            assert_eq!(read_from_file(&text, pipeline), changes);
            changes
        };
        // A revocation: one peer gone.
        peers.remove(1234);
        let changes = push(&peers, &mut pipeline);
        let gone: Vec<&str> = changes.gone.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(gone, ["peer-01234"]);
        assert!(pipeline.peers_read() < 40, "read {}", pipeline.peers_read());
        // One peer changed, one added in the middle, the last one removed.
        peers[10]["address"] = json!("10.200.0.1");
        push(&peers, &mut pipeline);
        assert!(pipeline.peers_read() < 40, "read {}", pipeline.peers_read());
        peers.insert(700, peer(5000));
        push(&peers, &mut pipeline);
        assert!(pipeline.peers_read() < 40, "read {}", pipeline.peers_read());
        peers.pop();
        push(&peers, &mut pipeline);
        assert!(pipeline.peers_read() < 40, "read {}", pipeline.peers_read());
        // The same peers in another order: every peer is read, nothing changes.
        peers.reverse();
        let changes = push(&peers, &mut pipeline);
        assert!(changes.is_empty());
        assert_eq!(pipeline.peers_read(), peers.len());
        let _ = std::fs::remove_file(&path);
    }

    /// Whitespace where a run starts is no part of the first peer's text: the layout kept is
    /// the file's, and the next splice there is found.
    #[test]
    fn a_run_that_starts_with_whitespace_keeps_the_files_layout() {
        let peers: Vec<Value> = (0..3).map(peer).collect();
        let text = file(&peers);
        let mut pipeline = Pipeline::new();
        pipeline.update(&text, None).unwrap();
        for spaced in [
            text.replacen("[{", "[ \n{", 1),
            text.replacen("},{", "}, {", 1),
        ] {
            pipeline.update(&spaced, None).unwrap();
            assert_eq!(pipeline.state(), &parse(&spaced).unwrap());
            pipeline.check_layout(&spaced).unwrap();
            pipeline.update(&text, None).unwrap();
            pipeline.check_layout(&text).unwrap();
        }
    }

    /// A file with policy tests, then the same peers without them: the tests are gone, as
    /// from a parse from scratch.
    #[test]
    fn tests_removed_from_the_file_are_gone_from_the_state() {
        let peers: Vec<Value> = (0..3).map(peer).collect();
        let with = json!({ "version": 1, "peers": peers,
            "tests": [{ "peer": "peer-00000", "accept": ["10.1.2.3:443/tcp"] }] })
        .to_string();
        let mut pipeline = Pipeline::new();
        pipeline.update(&with, None).unwrap();
        assert_eq!(pipeline.state().tests.len(), 1);
        let without = file(&peers);
        pipeline.update(&without, None).unwrap();
        assert_eq!(pipeline.state(), &parse(&without).unwrap());
    }

    /// A file that is the last one with a peer duplicated, or a change outside the peers
    /// array, is decided by the full parse, with its errors.
    #[test]
    fn a_splice_that_is_not_a_valid_file_is_rejected_as_the_parse_rejects_it() {
        let peers: Vec<Value> = (0..300).map(peer).collect();
        let text = file(&peers);
        let mut pipeline = Pipeline::new();
        pipeline.update(&text, None).unwrap();
        let mut twice = peers.clone();
        twice.insert(150, peers[3].clone());
        let bad = [
            file(&twice),
            text.replacen("\"version\":1", "\"version\":2", 1),
            text.replacen("],\"version\"", "],,\"version\"", 1),
            text.replacen("},{", "},,{", 1),
        ];
        for bad in bad {
            let expected = parse(&bad).unwrap_err();
            match pipeline.update(&bad, None) {
                Err(Rejection::Invalid(errors)) => assert_eq!(errors, expected),
                other => panic!("{other:?} for {bad}"),
            }
            pipeline.check_layout(&text).unwrap();
        }
    }
}
