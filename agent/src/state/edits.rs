//! The pipeline's contract, as a function the property test and the `pipeline` fuzz target
//! both run: for a sequence of edits to a state file (peers added, removed, changed,
//! reordered, broken, duplicated, reformatted), [`Pipeline::update`] ends each step in exactly
//! the state [`parse`] gives from scratch, with exactly the changes between the two states, and
//! rejects exactly the files `parse` rejects, with the same errors, keeping the last good state.
//! The plan made from its changes ([`plan_changes`]) is the plan made by comparing the two
//! states ([`plan_update`]), and converges the model of the kernel.

use serde_json::{json, Value};

use super::{parse, Changes, DesiredState, Pipeline, Rejection, WgKey};
use crate::plan::{plan_changes, plan_update, Actual};

/// Reads the edits from `bytes` (any bytes are a valid sequence) and checks every step; what
/// went wrong, if anything.
pub fn check_edits(bytes: &[u8]) -> Result<(), String> {
    let mut input = Input(bytes.iter());
    let first = input.byte();
    let mut file = File::new(first % 12);
    // Files compared by blocks of the agent's size, or of a few bytes (so that a small file
    // has many, and a change is found between two of them).
    let mut pipeline = Pipeline::with_block([4096, 16, 64, 5][usize::from(first / 12 % 4)]);
    let mut good = DesiredState::default();
    let mut kernel = Actual::default();
    let mut step = 0usize;
    loop {
        let text = file.text();
        check_step(&mut pipeline, &mut good, &mut kernel, &text)
            .map_err(|e| format!("step {step}: {e}\nfile:\n{text}"))?;
        if !file.edit(&mut input) {
            return Ok(());
        }
        step += 1;
    }
}

fn check_step(
    pipeline: &mut Pipeline,
    good: &mut DesiredState,
    kernel: &mut Actual,
    text: &str,
) -> Result<(), String> {
    let reference = parse(text);
    let result = pipeline.update(text, None);
    pipeline.check_indexes()?;
    if result.is_ok() {
        pipeline.check_layout(text)?;
    }
    match (reference, result) {
        (Ok(state), Ok(changes)) => {
            if pipeline.state() != &state {
                return Err(format!(
                    "accepted another state:\n pipeline: {:?}\n parse: {state:?}",
                    pipeline.state()
                ));
            }
            let expected = super::pipeline::diff(good, &state);
            if changes != expected {
                return Err(format!(
                    "other changes:\n pipeline: {changes:?}\n compared: {expected:?}"
                ));
            }
            check_plan(kernel, good, &state, &changes)?;
            *good = state;
            Ok(())
        }
        (Err(expected), Err(Rejection::Invalid(errors))) => {
            if errors != expected {
                return Err(format!(
                    "other errors:\n pipeline: {errors}\n parse: {expected}"
                ));
            }
            if pipeline.state() != good {
                return Err("a rejected file changed the accepted state".into());
            }
            Ok(())
        }
        (reference, result) => Err(format!(
            "decided otherwise:\n pipeline: {result:?}\n parse: {reference:?}"
        )),
    }
}

/// The plan from the changes is the plan from comparing the states; applied to the model of
/// the kernel (which matches `old`), it leaves nothing to do for `new`.
fn check_plan(
    kernel: &mut Actual,
    old: &DesiredState,
    new: &DesiredState,
    changes: &Changes,
) -> Result<(), String> {
    let compared = plan_update(old, new, kernel);
    let from_changes = plan_changes(
        new,
        crate::plan::Changes {
            touched: changes.touched_in(new),
            gone: changes.gone.iter().collect(),
        },
        kernel,
    );
    if compared != from_changes {
        return Err(format!(
            "other plans:\n from the changes: {from_changes:?}\n compared: {compared:?}"
        ));
    }
    let Ok(plan) = compared else {
        // A state the model's maps cannot hold: the kernel keeps what it had, and the next
        // plan compares everything (as the agent does after a failed apply).
        *kernel = Actual::default();
        let mut again = crate::plan::plan(old, kernel).map_err(|e| e.to_string())?;
        for op in std::mem::take(&mut again.ops) {
            kernel.apply(&op);
        }
        return Ok(());
    };
    for op in &plan.ops {
        kernel.apply(op);
    }
    match plan_update(new, new, kernel) {
        Ok(p) if p.is_empty() => Ok(()),
        other => Err(format!("not converged: {other:?}")),
    }
}

/// Reads byte-level edits from `bytes`, each made to the last file the parse accepted (a
/// run of the text deleted, replaced by JSON punctuation, by another run of the file, or by a
/// peer), and checks every step as [`check_edits`] does: the splices a pipeline finds between
/// two files must hold for any bytes, not only for edits of whole peers.
pub fn check_splices(bytes: &[u8]) -> Result<(), String> {
    const PIECES: [&str; 14] = [
        ",",
        "{",
        "}",
        "[",
        "]",
        "\"",
        " ",
        "\\",
        ":",
        "null",
        "1",
        "{}",
        ",{}",
        "],\"peers\":[",
    ];
    let mut input = Input(bytes.iter());
    let first = input.byte();
    let mut file = File::new(first % 8 + 2);
    let mut pipeline = Pipeline::with_block(usize::from(first / 8 % 24) + 1);
    let mut good = DesiredState::default();
    let mut kernel = Actual::default();
    let mut accepted = file.text();
    check_step(&mut pipeline, &mut good, &mut kernel, &accepted)?;
    let mut step = 1usize;
    while !input.done() {
        let op = input.byte();
        let [a, b, c, d] = [0; 4].map(|_| usize::from(input.byte()));
        let len = accepted.len();
        let (at, end) = (a * len / 256, (a * len / 256 + b % 24).min(len));
        let (at, end, piece) = match op % 5 {
            0 => (at, end, String::new()),
            1 => (
                at,
                end,
                PIECES[usize::from(op / 4) % PIECES.len()].to_owned(),
            ),
            2 => {
                let from = c * len / 256;
                (at, end, accepted[from..(from + d).min(len)].to_owned())
            }
            3 => (at, end, format!("{},", file.fresh())),
            _ => {
                // Whitespace before the next object: between peers, or before the first.
                let brace = accepted[at..].find('{').map_or(len, |i| at + i);
                (brace, brace, [" ", "\n", "\t ", "\r\n"][b % 4].to_owned())
            }
        };
        // Generated files are ASCII: any offset is a character boundary.
        let mut text = accepted.clone();
        text.replace_range(at..end, &piece);
        check_step(&mut pipeline, &mut good, &mut kernel, &text)
            .map_err(|e| format!("step {step}: {e}\nfile:\n{text}"))?;
        if parse(&text).is_ok() {
            accepted = text;
        }
        step += 1;
    }
    Ok(())
}

struct Input<'a>(std::slice::Iter<'a, u8>);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        self.0.next().copied().unwrap_or(0)
    }

    fn done(&self) -> bool {
        self.0.len() == 0
    }
}

/// A state file being edited: its peers as JSON values, in file order.
struct File {
    peers: Vec<Value>,
    replies: Option<Value>,
    pretty: bool,
    /// The next fresh peer number.
    next: u32,
}

const RULE_SETS: usize = 6;

fn rules(n: usize) -> Value {
    match n % RULE_SETS {
        0 => json!([]),
        1 => json!([{ "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443, "8000-8100"] }]),
        2 => json!([
            { "cidr": "10.0.0.0/8", "protocol": "tcp", "ports": [443] },
            { "cidr": "fd00::/8", "protocol": "any" },
            { "cidr": "0.0.0.0/0", "protocol": "icmp" }
        ]),
        3 => json!([{ "cidr": "192.0.2.0/24" }, { "cidr": "192.0.2.128/25", "protocol": "udp" }]),
        4 => json!([{ "cidr": "10.1.0.0/16", "protocol": "udp", "ports": ["53"] }]),
        _ => json!([{ "cidr": "::/0", "protocol": "icmp" }, { "cidr": "10.0.0.0/8" }]),
    }
}

fn key(n: u32) -> String {
    let mut bytes = [7u8; 32];
    bytes[..4].copy_from_slice(&n.to_le_bytes());
    WgKey(bytes).to_base64()
}

fn fresh(n: u32) -> Value {
    let mut p = json!({
        "name": format!("peer-{n}"),
        "publicKey": key(n),
        "address": format!("10.8.{}.{}", n / 200, n % 200 + 2),
    });
    if n.is_multiple_of(2) {
        p["addressV6"] = json!(format!("fd00:8::{:x}", n + 2));
    }
    if !n.is_multiple_of(3) {
        p["egress"] = rules(n as usize);
    }
    p
}

impl File {
    fn new(peers: u8) -> Self {
        let peers = u32::from(peers);
        Self {
            peers: (0..peers).map(fresh).collect(),
            replies: None,
            pretty: false,
            next: peers,
        }
    }

    fn text(&self) -> String {
        let mut top = json!({ "version": 1, "peers": self.peers });
        if let Some(replies) = &self.replies {
            top["replies"] = replies.clone();
        }
        if self.pretty {
            serde_json::to_string_pretty(&top).unwrap_or_default()
        } else {
            top.to_string()
        }
    }

    fn fresh(&mut self) -> Value {
        self.next += 1;
        fresh(self.next + 1000)
    }

    /// Sets a field of peer `i`, if it is an object (a peer broken into a number is not).
    fn set(&mut self, i: usize, field: &str, value: Value) {
        if let Some(peer) = self.peers[i].as_object_mut() {
            peer.insert(field.to_owned(), value);
        }
    }

    /// Applies the next edit of `input`; false when there is none.
    fn edit(&mut self, input: &mut Input<'_>) -> bool {
        if input.done() {
            return false;
        }
        let op = input.byte();
        let (a, b) = (usize::from(input.byte()), usize::from(input.byte()));
        let n = self.peers.len();
        if n == 0 && !op.is_multiple_of(18) {
            let p = self.fresh();
            self.peers.push(p);
            return true;
        }
        let (i, j) = (a % n.max(1), b % n.max(1));
        if op % 18 < 8 {
            self.reshape(op % 18, (a, b), (i, j), n);
        } else {
            self.break_or_swap(op % 18, b, (i, j));
        }
        true
    }

    /// Edits 0 to 7: peers added, removed, moved, their rules and options changed.
    fn reshape(&mut self, op: u8, (a, b): (usize, usize), (i, j): (usize, usize), n: usize) {
        match op {
            0 => {
                // One peer, or ten at once.
                for _ in 0..if b % 4 == 0 { 10 } else { 1 } {
                    let p = self.fresh();
                    let at = a % (self.peers.len() + 1);
                    self.peers.insert(at, p);
                }
            }
            1 => {
                let count = if b % 4 == 0 { 10.min(n) } else { 1 };
                self.peers.drain(i.min(n - count)..i.min(n - count) + count);
            }
            2 => match b % (RULE_SETS + 1) {
                RULE_SETS => {
                    if let Some(p) = self.peers[i].as_object_mut() {
                        p.remove("egress");
                    }
                }
                r => self.set(i, "egress", rules(r)),
            },
            3 => self.set(
                i,
                "endpoint",
                json!(format!("198.51.100.{}:51820", b % 4 + 1)),
            ),
            4 => self.set(i, "persistentKeepalive", json!(b % 3 * 25)),
            5 => self.peers.swap(i, j),
            6 => self.peers.rotate_left(i),
            7 => {
                if let Some(rules) = self.peers[i]
                    .get_mut("egress")
                    .and_then(Value::as_array_mut)
                {
                    rules.reverse();
                }
            }
            _ => {}
        }
    }

    /// Edits 8 to 17: fields broken or copied from another peer (duplicates), peers repeated
    /// or replaced, the reply switch and the formatting changed.
    fn break_or_swap(&mut self, op: u8, b: usize, (i, j): (usize, usize)) {
        match op {
            8 => {
                let (field, value) = match b % 7 {
                    0 => ("publicKey", json!("bad")),
                    1 => ("address", json!("300.1.1.1")),
                    2 => ("egress", Value::Null),
                    3 => ("color", json!("blue")),
                    4 => ("name", json!("")),
                    5 => ("egress", json!([{ "cidr": "10.0.0.1/8" }])),
                    _ => ("persistentKeepalive", json!(70000)),
                };
                self.set(i, field, value);
            }
            9 => self.set(i, "publicKey", self.peers[j]["publicKey"].clone()),
            10 => self.set(i, "address", self.peers[j]["address"].clone()),
            11 => self.set(i, "name", self.peers[j]["name"].clone()),
            12 => self.peers.push(self.peers[i].clone()),
            13 => self.peers[i] = self.fresh(),
            14 => {
                self.replies = match b % 3 {
                    0 => None,
                    1 => Some(json!(false)),
                    _ => Some(json!(true)),
                }
            }
            15 => {
                // A fresh address, or a fresh key: the same peer moved, or its key rotated.
                let other = self.fresh();
                let field = if b.is_multiple_of(2) {
                    "address"
                } else {
                    "publicKey"
                };
                self.set(i, field, other[field].clone());
            }
            16 => self.pretty = !self.pretty,
            _ => {
                self.peers[i] = match b % 3 {
                    0 => Value::Null,
                    1 => json!(5),
                    _ => {
                        let other = self.fresh();
                        json!({ "name": other["name"], "publicKey": self.peers[i]["publicKey"],
                                "addressV6": other["addressV6"] })
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Random edit sequences: the pipeline decides every step as a parse from scratch.
        #[test]
        fn the_pipeline_decides_every_edit_as_a_parse_from_scratch(
            bytes in prop::collection::vec(any::<u8>(), 0..120),
        ) {
            if let Err(e) = check_edits(&bytes) {
                panic!("{e}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Random byte-level edits: whatever a file's bytes, the pipeline decides it as a
        /// parse from scratch (a splice it finds between two files is one only if it is).
        #[test]
        fn the_pipeline_decides_every_byte_edit_as_a_parse_from_scratch(
            bytes in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            if let Err(e) = check_splices(&bytes) {
                panic!("{e}");
            }
        }
    }

    /// Longer sequences on a larger file than the proptest's, from a seeded generator: more
    /// arrivals and departures than the in-place limit, so the merging paths run too.
    #[test]
    fn long_seeded_edit_sequences_on_larger_files() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for round in 0..4u8 {
            let mut bytes = vec![11 + round % 2];
            for _ in 0..300 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                bytes.push((x >> 24) as u8);
            }
            // Many adds first: a file of a few dozen peers.
            let mut seeded: Vec<u8> = (0..40).flat_map(|k| [0u8, k, 0]).collect();
            seeded.insert(0, bytes[0]);
            seeded.extend_from_slice(&bytes[1..]);
            if let Err(e) = check_edits(&seeded) {
                panic!("round {round}: {e}");
            }
        }
    }
}
