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
//! Blocks are compared by the pipeline's 128-bit hashes ([`Hash`]), as peers are. Both sets
//! of blocks are hashed in one pass over the file read in pieces ([`blocks`]); [`locate`] then
//! needs only the hashes and a few top-level bytes, and the run is read from the bytes of its
//! [`Window`] alone, so the whole file is never held for it.

use super::typed::{Cursor, RawPeer};

/// A 128-bit hash, random-keyed per pipeline: a peer's identity (of what decides its spec), a
/// block's of a file, a file's. Defined here, where blocks are compared, so that the pipeline
/// uses the splice and never the other way round.
pub(super) type Hash = u128;

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

/// Hashes of the consecutive blocks of bytes fed in pieces of any size: `first` bytes, then
/// `block` bytes each, the last one short. Each block is hashed whole, as one slice, whatever
/// the pieces were.
struct Blocker {
    first: usize,
    block: usize,
    pending: Vec<u8>,
    hashes: Vec<Hash>,
}

impl Blocker {
    fn new(first: usize, block: usize) -> Self {
        Self {
            first,
            block,
            pending: Vec::new(),
            hashes: Vec::new(),
        }
    }

    fn feed(&mut self, mut bytes: &[u8], hash: &impl Fn(&[u8]) -> Hash) {
        while !bytes.is_empty() {
            let size = if self.hashes.is_empty() {
                self.first
            } else {
                self.block
            };
            if self.pending.is_empty() && bytes.len() >= size {
                self.hashes.push(hash(&bytes[..size]));
                bytes = &bytes[size..];
                continue;
            }
            let take = (size - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() == size {
                self.hashes.push(hash(&self.pending));
                self.pending.clear();
            }
        }
    }

    fn finish(mut self, hash: &impl Fn(&[u8]) -> Hash) -> Vec<Hash> {
        if !self.pending.is_empty() {
            self.hashes.push(hash(&self.pending));
        }
        self.hashes
    }
}

/// The blocks of `bytes` (of `len` bytes, fed in pieces by `each_piece`), in one pass: from the
/// start, and counted from the end (the first of those, at the start, is the short one).
pub(super) fn blocks<E>(
    len: usize,
    each_piece: impl FnOnce(&mut dyn FnMut(&[u8])) -> Result<(), E>,
    block: usize,
    hash: &impl Fn(&[u8]) -> Hash,
) -> Result<Blocks, E> {
    let mut head = Blocker::new(block, block);
    let short = len % block;
    let mut tail = Blocker::new(if short == 0 { block } else { short }, block);
    each_piece(&mut |piece: &[u8]| {
        head.feed(piece, hash);
        tail.feed(piece, hash);
    })?;
    let mut tail = tail.finish(hash);
    tail.reverse();
    Ok(Blocks {
        len,
        head: head.finish(hash),
        tail,
    })
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

/// Where a new file differs from the last accepted one, if it is a splice of it: the peers
/// `from..to` of the last file are replaced by what the new file has in `range`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Window {
    from: usize,
    to: usize,
    /// Where the run starts (a peer's offset, the same in both files) and where it ends (the
    /// next peer's offset in the new file, or its `]` with `closes`).
    start: usize,
    until: usize,
    closes: bool,
}

impl Window {
    /// The bytes of the new file the run is read from.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.start..self.until + usize::from(self.closes)
    }

    /// The splice, given `text`, the new file's bytes in [`Self::range`]; `None` if they are not
    /// a run of peers that joins both ends.
    pub fn splice<'a>(&self, layout: &Layout, text: &'a str) -> Option<Splice<'a>> {
        let (start, until) = (self.start, self.until);
        let mut cursor = Cursor { text, at: 0 };
        let mut run = cursor.run(until - start, self.closes, self.from == 0)?;
        run.iter_mut().for_each(|(at, _)| *at += start);
        let first = run.first().map_or(until, |(at, _)| *at);
        Some(Splice {
            from: self.from,
            to: self.to,
            // The new file's bytes before `start` are the last one's, its text before its
            // first peer.
            before: (self.from == 0)
                .then(|| format!("{}{}", layout.before, &text[..first - start])),
            run,
        })
    }
}

/// Where the new file (of `blocks`, of `block` bytes) differs from the file `layout` describes,
/// if it is a splice of it; `read_at` reads the new file's bytes at an offset (here only the
/// few bytes of its top level, to compare them with the last file's). `None` if it is not one.
pub(super) fn locate<E>(
    layout: &Layout,
    blocks: &Blocks,
    block: usize,
    mut read_at: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
) -> Result<Option<Window>, E> {
    let len = blocks.len;
    let Blocks { head, tail, .. } = blocks;
    let same = |new: &[Hash], old: &[Hash]| new.iter().zip(old).take_while(|(a, b)| a == b).count();
    let shortest = len.min(layout.len);
    // The first `equal_head` bytes of both files are the same, and so are their last
    // `equal_tail` bytes.
    let mut equal_head = (same(head, &layout.head) * block).min(shortest);
    let mut equal_tail = (same(tail, &layout.tail) * block).min(shortest);
    let mut read_equal = |at: usize, old: &str| -> Result<bool, E> {
        let mut bytes = vec![0; old.len()];
        read_at(at, &mut bytes)?;
        Ok(bytes == old.as_bytes())
    };
    if equal_head < layout.before.len()
        && len >= layout.before.len()
        && read_equal(0, &layout.before)?
    {
        equal_head = layout.before.len();
    }
    if equal_tail < layout.after.len()
        && len >= layout.after.len()
        && read_equal(len - layout.after.len(), &layout.after)?
    {
        equal_tail = layout.after.len();
    }
    Ok(window(layout, len, equal_head, equal_tail))
}

/// The window of a new file of `len` bytes whose first `equal_head` and last `equal_tail`
/// bytes are those of the file `layout` describes.
fn window(layout: &Layout, len: usize, equal_head: usize, equal_tail: usize) -> Option<Window> {
    // An offset of the old file from `tail_from` on is `offset + len - old len` in the new.
    let tail_from = layout.len - equal_tail;
    let to_new = |old: usize| (old + len).checked_sub(layout.len);
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
    // The `]` is a byte of the file.
    if until < start || (closes && until >= len) {
        return None;
    }
    Some(Window {
        from,
        to,
        start,
        until,
        closes,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn hash(bytes: &[u8]) -> Hash {
        // Position-sensitive, so that a block cut elsewhere hashes otherwise.
        bytes.iter().fold(bytes.len() as Hash, |h, b| {
            h.wrapping_mul(31) ^ Hash::from(*b)
        })
    }

    proptest! {
        /// Blocks hashed from pieces of any size are the blocks of the whole, from the start and
        /// from the end: a file read in pieces compares with a layout kept from one in memory.
        #[test]
        fn blocks_of_pieces_are_the_blocks_of_the_whole(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            block in 1usize..17,
            cuts in proptest::collection::vec(1usize..40, 1..12),
        ) {
            let pieces = |f: &mut dyn FnMut(&[u8])| -> Result<(), std::convert::Infallible> {
                let mut rest = &bytes[..];
                for cut in cuts.iter().cycle() {
                    if rest.is_empty() {
                        break;
                    }
                    let (piece, after) = rest.split_at((*cut).min(rest.len()));
                    f(piece);
                    rest = after;
                }
                Ok(())
            };
            let blocks = match blocks(bytes.len(), pieces, block, &hash) {
                Ok(blocks) => blocks,
                Err(never) => match never {},
            };
            let head: Vec<Hash> = bytes.chunks(block).map(hash).collect();
            let tail: Vec<Hash> = bytes.rchunks(block).map(hash).collect();
            prop_assert_eq!(blocks.len, bytes.len());
            prop_assert_eq!(blocks.head, head);
            prop_assert_eq!(blocks.tail, tail);
        }
    }
}
