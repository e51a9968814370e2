//! The docs against the code: every list of pinned objects in README.md and docs/ (between
//! `<!-- pins:begin -->` and `<!-- pins:end -->`) names exactly what the agent pins
//! ([`wgfence::dataplane::pins`]). Needs neither root nor wireguard-go.

use std::{collections::BTreeSet, path::Path};

/// The files with pin lists, and how many lists each has (a list removed by an edit fails too).
const DOCS: [(&str, usize); 2] = [("README.md", 1), ("docs/operations.md", 1)];

const BEGIN: &str = "<!-- pins:begin -->";
const END: &str = "<!-- pins:end -->";

/// The text between each pair of markers.
fn lists(text: &str) -> Vec<&str> {
    let mut lists = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(BEGIN) {
        let after = &rest[start + BEGIN.len()..];
        let end = after
            .find(END)
            .unwrap_or_else(|| panic!("{BEGIN} without {END}"));
        lists.push(&after[..end]);
        rest = &after[end + END.len()..];
    }
    lists
}

/// What is wrong with `list` against the code's pins, if anything.
fn differences(list: &str, pins: &BTreeSet<String>) -> Option<String> {
    let named = wgfence_tests::pin_names(list);
    let missing: Vec<_> = pins.difference(&named).collect();
    let unknown: Vec<_> = named.difference(pins).collect();
    (!missing.is_empty() || !unknown.is_empty())
        .then(|| format!("missing {missing:?}, not pinned by the agent {unknown:?}"))
}

#[test]
fn every_list_of_pins_in_the_docs_names_what_the_agent_pins() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let pins: BTreeSet<String> = wgfence::dataplane::pins().into_iter().collect();
    let mut wrong = Vec::new();
    for (doc, expected) in DOCS {
        let text = std::fs::read_to_string(root.join(doc)).expect(doc);
        let found = lists(&text);
        if found.len() != expected {
            wrong.push(format!(
                "{doc}: {} lists between {BEGIN} and {END}, expected {expected}",
                found.len()
            ));
        }
        for (i, list) in found.iter().enumerate() {
            if let Some(d) = differences(list, &pins) {
                wrong.push(format!("{doc}, list {}: {d}", i + 1));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_list_that_disagrees_is_named() {
    let pins: BTreeSet<String> = ["wgf4_stats", "link_ingress", "prog_ingress_<identity>"]
        .map(str::to_owned)
        .into();
    let listing = "-rw------- 1 root root 0 Nov 30 02:58 link_ingress\n\
                   -rw------- 1 root root 0 Nov 30 02:58 prog_ingress_0123456789abcdef\n\
                   -rw------- 1 root root 0 Nov 30 02:58 wgf4_stats\n";
    assert_eq!(differences(listing, &pins), None);
    let text = "the maps `wgf4_stats` and `wgf2_peers_v4`, the link `link_ingress`";
    assert_eq!(
        differences(text, &pins).as_deref(),
        Some(r#"missing ["prog_ingress_<identity>"], not pinned by the agent ["wgf2_peers_v4"]"#)
    );
    assert_eq!(
        lists(&format!("a {BEGIN} b {END} c {BEGIN} d {END}")),
        [" b ", " d "]
    );
}
