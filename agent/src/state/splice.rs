//! What a new state file changed, found from its bytes: most pushes change a few peers of a
//! file written in the same order as the last one, so the new file is the last accepted one
//! with one run of peers replaced. Comparing hashes of fixed-size blocks, counted from the
//! start and from the end, finds the bytes both files share at each end; only the peers
//! between are read. Reading a file is then hashing it, not parsing it: a push that changes a
//! few peers of 60,000 parses those few.
//!
//! Why that is a parse of the whole file: the bytes before the run are the last accepted
//! file's up to where one of its peers starts, so a parser reading them is inside the peers
//! array, at a value; the bytes after the run are that file's from where one of its peers (or
//! the array's `]`) starts, so they read as they did then, to the end. The run between is
//! read here as exactly the values and commas that join the two
//! ([`super::typed::Cursor::run`]). Anything else (a change outside the peers, a run that does
//! not join up, a file of another order) is left to the pipeline's pass over every peer.
//!
//! Blocks are compared by the pipeline's 128-bit hashes, as peers are.

use super::typed::{Cursor, RawPeer};

use super::pipeline::Hash;

/// The block size the pipeline compares files by: small enough that a change re-reads a few
/// peers around it, large enough that the hashes are a small part of the file (0.4%).
pub(super) const BLOCK: usize = 4096;

/// Where the peers are in the last accepted file, and its blocks' hashes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Layout {
    len: usize,
    /// Each peer's offset, in file order (ascending).
    starts: Vec<usize>,
    /// Each peer's identity, in file order.
    ids: Vec<Hash>,
    /// The offset of the `]` that closes the peers array.
    end: usize,
    /// Blocks from the start (the last one may be short), and from the end.
    head: Vec<Hash>,
    tail: Vec<Hash>,
    /// The text before the first peer and after the `]`: the top level (a few bytes), kept
    /// to compare exactly, so that a change in the first or the last block is found too.
    before: String,
    after: String,
}

/// A file's blocks' hashes, from the start and from the end: what the pipeline compares files
/// by, computed once per file read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Blocks {
    pub len: usize,
    /// From the start (the last one may be short): they also give the file's identity.
    pub head: Vec<Hash>,
    /// From the end (the first one may be short).
    pub tail: Vec<Hash>,
}

/// The hashes of `bytes`'s blocks of `block` bytes, from the start.
pub(super) fn head(bytes: &[u8], block: usize, hash: &impl Fn(&[u8]) -> Hash) -> Vec<Hash> {
    bytes.chunks(block).map(hash).collect()
}

/// The hashes of `bytes`'s blocks of `block` bytes, from the end.
pub(super) fn tail(bytes: &[u8], block: usize, hash: &impl Fn(&[u8]) -> Hash) -> Vec<Hash> {
    bytes.rchunks(block).map(hash).collect()
}

impl Layout {
    /// The peers of the file.
    pub fn peers(&self) -> usize {
        self.starts.len()
    }

    /// The layout of `text` (whose blocks are `blocks`), whose peers start at `starts` and
    /// are `ids`, and whose peers array closes at `end`.
    pub fn new(text: &str, blocks: Blocks, starts: Vec<usize>, ids: Vec<Hash>, end: usize) -> Self {
        let Blocks { head, tail, .. } = blocks;
        let first = starts.first().copied().unwrap_or(end);
        Self {
            len: text.len(),
            before: text[..first].to_owned(),
            after: text[end..].to_owned(),
            starts,
            ids,
            end,
            head,
            tail,
        }
    }
}

/// A new file as the last accepted one with the peers `from..to` (file order) replaced by
/// `run`.
pub(super) struct Splice<'a> {
    pub from: usize,
    pub to: usize,
    /// The new peers, each with its offset in the new file.
    pub run: Vec<(usize, RawPeer<'a>)>,
    /// The new file's text before its first peer, where the run starts the array (the
    /// whitespace there may differ).
    before: Option<String>,
}

impl Splice<'_> {
    /// The identities of the peers the splice replaces (`from..to` of the last file's).
    pub fn replaced<'l>(&self, layout: &'l Layout) -> &'l [Hash] {
        &layout.ids[self.from..self.to]
    }

    /// The peers in the new file: those kept, and the run.
    pub fn peers(&self, layout: &Layout) -> usize {
        layout.starts.len() - (self.to - self.from) + self.run.len()
    }

    /// `layout` made the new file's (whose blocks are `blocks`), given the run's offsets and
    /// identities (in its order).
    pub fn apply(self, layout: &mut Layout, blocks: Blocks, offsets: Vec<usize>, ids: Vec<Hash>) {
        // Offsets after the run move by the difference in length (modulo: it may be negative).
        let (new_len, old_len) = (blocks.len, layout.len);
        let moved =
            |offset: &mut usize| *offset = offset.wrapping_add(new_len).wrapping_sub(old_len);
        let kept_after = self.from + offsets.len();
        layout.starts.splice(self.from..self.to, offsets);
        layout.starts[kept_after..].iter_mut().for_each(moved);
        moved(&mut layout.end);
        layout.ids.splice(self.from..self.to, ids);
        // The top level is the same text (the run is inside the peers array), but for the
        // whitespace before a run that starts it.
        if let Some(before) = self.before {
            layout.before = before;
        }
        layout.len = new_len;
        layout.head = blocks.head;
        layout.tail = blocks.tail;
    }
}

/// `text` (whose blocks are `blocks`, of `block` bytes) as a splice of the file `layout`
/// describes; `None` if it is not one.
pub(super) fn find<'a>(
    layout: &Layout,
    text: &'a str,
    blocks: &Blocks,
    block: usize,
) -> Option<Splice<'a>> {
    let bytes = text.as_bytes();
    let Blocks { head, tail, .. } = blocks;
    let same = |new: &[Hash], old: &[Hash]| new.iter().zip(old).take_while(|(a, b)| a == b).count();
    let shortest = bytes.len().min(layout.len);
    // The first `equal_head` bytes of both files are the same, and so are their last
    // `equal_tail` bytes.
    let mut equal_head = (same(head, &layout.head) * block).min(shortest);
    let mut equal_tail = (same(tail, &layout.tail) * block).min(shortest);
    if text.starts_with(&layout.before) {
        equal_head = equal_head.max(layout.before.len());
    }
    if text.ends_with(&layout.after) {
        equal_tail = equal_tail.max(layout.after.len());
    }
    // An offset of the old file from `tail_from` on is `offset + len - old len` in the new.
    let tail_from = layout.len - equal_tail;
    let to_new = |old: usize| (old + bytes.len()).checked_sub(layout.len);
    // The run starts where the last peer that starts in the equal head does.
    let from = layout
        .starts
        .partition_point(|start| *start <= equal_head)
        .checked_sub(1)?;
    let start = layout.starts[from];
    // It ends where the first peer after it starts in the equal tail, not before `start` in
    // the new file; or at the `]`.
    let in_tail = |old: usize| old >= tail_from && to_new(old).is_some_and(|new| new >= start);
    let to = from + layout.starts[from..].partition_point(|old| !in_tail(*old));
    let (until, closes) = match layout.starts.get(to) {
        Some(old) => (to_new(*old)?, false),
        None if in_tail(layout.end) => (to_new(layout.end)?, true),
        None => return None,
    };
    let mut cursor = Cursor { text, at: start };
    let run = cursor.run(until, closes, from == 0)?;
    let first = run.first().map_or(until, |(at, _)| *at);
    Some(Splice {
        from,
        to,
        before: (from == 0).then(|| text[..first].to_owned()),
        run,
    })
}
