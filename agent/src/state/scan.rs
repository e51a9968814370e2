//! A peer object read by hand, for the pass that reads every peer of a file in another order.
//!
//! serde_json's derived reader was most of that pass: for each field it matches the key,
//! then skips each rule's value once to borrow its text. Peers as a controller writes them
//! are plainer than JSON allows: keys and values without escapes, a keepalive in digits, rules
//! as objects. This reads exactly that in one forward pass. Anything else (an escape, a
//! control character, a field unknown, repeated or `null`, a number with a sign, a fraction or
//! an exponent) makes it answer `None`, and serde_json reads the peer as before, and decides.
//!
//! So for a peer it reads, the scan gives what serde_json gives: the same borrowed strings,
//! the same number, each rule's text as serde_json's raw value borrows it, and the same end.
//! A rule's text is only delimited here, not checked: a new rule set is parsed from its texts
//! by serde_json before anything is accepted, and a known one is the same bytes as one that
//! was. The unit tests compare the two readers on valid peers and on mutations of them.

use std::borrow::Cow;

use super::typed::{Cursor, RawPeer, RuleTexts, Str};

/// The peer object that starts at `at` in `text`, and where it ends (just after its `}`);
/// `None` where serde_json must read it.
pub(super) fn peer(text: &str, at: usize) -> Option<(RawPeer<'_>, usize)> {
    let mut cursor = Cursor { text, at };
    let peer = cursor.plain_peer()?;
    Some((peer, cursor.at))
}

/// Sets a field once: a second one is serde_json's error to name.
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    match slot {
        Some(_) => None,
        None => {
            *slot = Some(value);
            Some(())
        }
    }
}

/// The scan, on the typed pass's cursor (its whitespace and byte steps).
impl<'a> Cursor<'a> {
    fn plain_peer(&mut self) -> Option<RawPeer<'a>> {
        self.expect(b'{')?;
        let mut name = None;
        let mut public_key = None;
        let mut address = None;
        let mut address_v6 = None;
        let mut endpoint = None;
        let mut preshared_key = None;
        let mut persistent_keepalive = None;
        let mut egress = None;
        let mut mode = None;
        let mut not_before = None;
        let mut expires = None;
        loop {
            self.ws();
            let key = self.string()?;
            self.ws();
            self.expect(b':')?;
            self.ws();
            match key {
                "name" => once(&mut name, self.str()?)?,
                "publicKey" => once(&mut public_key, self.str()?)?,
                "address" => once(&mut address, self.str()?)?,
                "addressV6" => once(&mut address_v6, self.str()?)?,
                "endpoint" => once(&mut endpoint, self.str()?)?,
                "presharedKey" => once(&mut preshared_key, self.str()?)?,
                "persistentKeepalive" => once(&mut persistent_keepalive, self.number()?)?,
                "egress" => once(&mut egress, self.rules()?)?,
                "mode" => once(&mut mode, self.str()?)?,
                "notBefore" => once(&mut not_before, self.str()?)?,
                "expires" => once(&mut expires, self.str()?)?,
                _ => return None,
            }
            self.ws();
            match self.next()? {
                b',' => {}
                b'}' => break,
                _ => return None,
            }
        }
        Some(RawPeer {
            name: name?,
            public_key: public_key?,
            address,
            address_v6,
            endpoint,
            preshared_key,
            persistent_keepalive,
            egress,
            mode,
            not_before,
            expires,
        })
    }

    /// A string without escapes or control characters, borrowed.
    fn string(&mut self) -> Option<&'a str> {
        self.expect(b'"')?;
        let start = self.at;
        let end = special(self.text.as_bytes(), start)?;
        // The first special byte must be the closing quote: not an escape, not a control
        // character.
        if self.text.as_bytes()[end] != b'"' {
            return None;
        }
        self.at = end + 1;
        self.text.get(start..end)
    }

    fn str(&mut self) -> Option<Str<'a>> {
        self.string().map(|s| Str(Cow::Borrowed(s)))
    }

    /// A number in digits, without a leading zero (JSON's), that fits a `u64`; followed by
    /// neither a fraction nor an exponent.
    fn number(&mut self) -> Option<u64> {
        let start = self.at;
        while self
            .text
            .as_bytes()
            .get(self.at)
            .is_some_and(u8::is_ascii_digit)
        {
            self.at += 1;
        }
        let digits = self.text.get(start..self.at)?;
        if digits.is_empty()
            || (digits.len() > 1 && digits.starts_with('0'))
            || matches!(self.text.as_bytes().get(self.at), Some(b'.' | b'e' | b'E'))
        {
            return None;
        }
        digits.parse().ok()
    }

    /// An array of objects: each one's text.
    fn rules(&mut self) -> Option<RuleTexts<'a>> {
        self.expect(b'[')?;
        let mut texts = RuleTexts::new();
        self.ws();
        if self.text.as_bytes().get(self.at) == Some(&b']') {
            self.at += 1;
            return Some(texts);
        }
        loop {
            texts.push(self.object()?);
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b']' => return Some(texts),
                _ => return None,
            }
        }
    }

    /// An object's text, from its `{` to the `}` that closes it: strings stepped over (an
    /// escape with the byte it escapes), brackets counted.
    fn object(&mut self) -> Option<&'a str> {
        let (bytes, start) = (self.text.as_bytes(), self.at);
        if bytes.get(start) != Some(&b'{') {
            return None;
        }
        let mut at = start + 1;
        let mut depth = 1usize;
        while depth > 0 {
            match *bytes.get(at)? {
                b'"' => at = string_end(bytes, at + 1)?,
                b'{' | b'[' => {
                    depth += 1;
                    at += 1;
                }
                b'}' | b']' => {
                    depth -= 1;
                    at += 1;
                }
                _ => at += 1,
            }
        }
        self.at = at;
        self.text.get(start..at)
    }
}

/// Where the string whose text starts at `at` ends (just after its closing quote).
fn string_end(bytes: &[u8], mut at: usize) -> Option<usize> {
    loop {
        at = special(bytes, at)?;
        match bytes[at] {
            b'"' => return Some(at + 1),
            // An escape: the byte after the backslash is never the string's end.
            b'\\' => at += 2,
            // A control character: serde_json's to reject, where it parses the text.
            _ => at += 1,
        }
    }
}

/// The first byte from `at` on that is `"`, `\` or a control character (below 0x20), looked
/// for eight bytes at a time: the strings here (keys, addresses, names) are a few words long,
/// too short for a vectorised search to pay for its set-up, too long for a byte loop.
fn special(bytes: &[u8], mut at: usize) -> Option<usize> {
    const ONES: u64 = u64::from_ne_bytes([1; 8]);
    const HIGH: u64 = u64::from_ne_bytes([0x80; 8]);
    while let Some(chunk) = bytes.get(at..at + 8) {
        let mut word = [0; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        let (quote, slash) = (w ^ (ONES * u64::from(b'"')), w ^ (ONES * u64::from(b'\\')));
        // A byte's high bit is set in `found` where the byte is 0 in `quote` or `slash`, or
        // below 0x20 in `w`: exactly so in the lowest byte flagged (a borrow only runs
        // upwards, to bytes after it), which is the one taken.
        let found = ((quote.wrapping_sub(ONES) & !quote)
            | (slash.wrapping_sub(ONES) & !slash)
            | (w.wrapping_sub(ONES * 0x20) & !w))
            & HIGH;
        if found != 0 {
            return Some(at + (found.trailing_zeros() / 8) as usize);
        }
        at += 8;
    }
    let rest = bytes.get(at..)?;
    rest.iter()
        .position(|b| matches!(b, b'"' | b'\\' | 0..=0x1f))
        .map(|i| at + i)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::state::typed::{Cursor, Obj};

    /// What a reader made of a peer: every field, as text.
    fn fields(peer: &RawPeer<'_>) -> String {
        let s = |v: &Option<Str<'_>>| v.as_ref().map(|s| s.0.to_string());
        format!(
            "{:?}",
            (
                peer.name.0.to_string(),
                peer.public_key.0.to_string(),
                [
                    s(&peer.address),
                    s(&peer.address_v6),
                    s(&peer.endpoint),
                    s(&peer.preshared_key),
                    s(&peer.mode),
                    s(&peer.not_before),
                    s(&peer.expires),
                ],
                peer.persistent_keepalive,
                peer.egress.as_ref().map(|r| r.to_vec()),
            )
        )
    }

    /// serde_json's reading of the peer at `at`, and where it ends.
    fn serde(text: &str, at: usize) -> Option<(String, usize)> {
        let mut values =
            serde_json::Deserializer::from_str(text.get(at..)?).into_iter::<Obj<RawPeer<'_>>>();
        let Obj(peer) = values.next()?.ok()?;
        Some((fields(&peer), at + values.byte_offset()))
    }

    /// Where the scan reads a peer, serde_json reads the same; where serde_json reads one and
    /// the scan does not, the peer is unusual (the scan is not asked to read every JSON).
    fn agrees(text: &str, at: usize) -> Result<(), TestCaseError> {
        if let Some((peer, end)) = peer(text, at) {
            match serde(text, at) {
                Some((theirs, their_end)) => {
                    prop_assert_eq!(fields(&peer), theirs);
                    prop_assert_eq!(end, their_end);
                }
                // serde_json fails on text the scan read: only inside a rule's text, which
                // is then no rule serde_json reads (and so never accepted).
                None => {
                    let bad = peer.egress.iter().flatten().any(|rule| {
                        serde_json::from_str::<serde_json::Value>(rule)
                            .map_or(true, |v| !v.is_object())
                    });
                    prop_assert!(bad, "the scan read what serde_json rejects: {text}");
                }
            }
        }
        Ok(())
    }

    const PEERS: [&str; 4] = [
        r#"{"name":"a","publicKey":"k","address":"10.0.0.2","egress":[{"cidr":"10.1.0.0/16","protocol":"tcp","ports":[443,"8000-8100"]},{"cidr":"0.0.0.0/0","except":["10.0.0.0/8"]}],"persistentKeepalive":25}"#,
        r#"{ "publicKey" : "k2" , "name" : "b-c.d" , "addressV6":"fd00::2", "endpoint":"[fd01::1]:51820",
            "presharedKey":"p", "mode":"audit", "notBefore":"2026-01-01T00:00:00Z", "expires":"2027-01-01T00:00:00Z",
            "egress" : [ ] , "persistentKeepalive" : 0 }"#,
        r#"{"name":"e","publicKey":"k","egress":[ {"cidr":"fd00::/8","protocol":"icmp","types":["echo-request"]} ,{"cidr":"1.2.3.4/32","note":"\"}]\\"}]}"#,
        r#"{"name":"f","publicKey":"k"}"#,
    ];

    #[test]
    fn reads_plain_peers_as_serde_json_does() {
        for text in PEERS {
            let scanned = peer(text, 0).map(|(p, end)| (fields(&p), end));
            assert!(scanned.is_some(), "the scan left a plain peer: {text}");
            assert_eq!(scanned, serde(text, 0), "{text}");
        }
    }

    #[test]
    fn leaves_unusual_peers_to_serde_json() {
        for text in [
            r#"{"name":"a\u0062","publicKey":"k"}"#,
            r#"{"name":"a","publicKey":"k","name":"b"}"#,
            r#"{"name":"a","publicKey":"k","address":null}"#,
            r#"{"name":"a","publicKey":"k","persistentKeepalive":25.0}"#,
            r#"{"name":"a","publicKey":"k","persistentKeepalive":025}"#,
            r#"{"name":"a","publicKey":"k","persistentKeepalive":-1}"#,
            r#"{"name":"a","publicKey":"k","persistentKeepalive":18446744073709551616}"#,
            r#"{"name":"a","publicKey":"k","other":1}"#,
            r#"{"name":"a","publicKey":"k","egress":["10.0.0.0/8"]}"#,
            r#"{"name":"a"}"#,
            "{\"name\":\"a\tb\",\"publicKey\":\"k\"}",
            r#"["name","a"]"#,
        ] {
            assert!(peer(text, 0).is_none(), "the scan read {text}");
        }
    }

    #[test]
    fn reads_a_peer_where_the_cursor_is() {
        let text = format!(r#"{{"peers": [{}, {}]}}"#, PEERS[0], PEERS[3]);
        let at = text.find("{\"name\":\"f\"").unwrap_or(0);
        let mut cursor = Cursor { text: &text, at };
        let read = cursor.peer().map(|p| fields(&p));
        assert_eq!(read, serde(&text, at).map(|(f, _)| f));
        assert_eq!(&text[cursor.at..], "]}");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// Mutations of plain peers (bytes replaced, inserted or removed, with the bytes JSON
        /// gives meaning to): the scan reads nothing serde_json reads otherwise.
        #[test]
        fn agrees_with_serde_json_on_mutations(
            which in 0..PEERS.len(),
            edits in proptest::collection::vec(
                (any::<prop::sample::Index>(), 0..3u8, prop::sample::select(
                    b"\"\\{}[],: 0159.eE-nu\t\x01a".to_vec())),
                1..4,
            ),
        ) {
            let mut bytes = PEERS[which].as_bytes().to_vec();
            for (at, kind, byte) in edits {
                let i = at.index(bytes.len() + 1);
                match kind {
                    0 if i < bytes.len() => bytes[i] = byte,
                    1 => bytes.insert(i, byte),
                    _ if i < bytes.len() => { bytes.remove(i); }
                    _ => {}
                }
            }
            if let Ok(text) = std::str::from_utf8(&bytes) {
                agrees(text, 0)?;
            }
        }

        /// The word-at-a-time search finds the byte a byte loop finds, wherever it starts,
        /// among bytes near the ones it looks for (and UTF-8's high ones).
        #[test]
        fn special_is_the_first_quote_escape_or_control_byte(
            bytes in proptest::collection::vec(
                prop::sample::select(b"\"\\\x00\x1f\x20!#[\\]a\x7f\x80\xa2\xdc\xff".to_vec()),
                0..40,
            ),
            from in 0usize..41,
        ) {
            let want = bytes
                .iter()
                .enumerate()
                .skip(from)
                .find(|(_, b)| matches!(b, b'"' | b'\\' | 0..=0x1f))
                .map(|(i, _)| i);
            prop_assert_eq!(special(&bytes, from), want);
        }
    }
}
