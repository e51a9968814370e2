//! The report: Markdown for docs/benchmarks.md and JSON for target/bench/results.json.

use std::fmt::Write as _;

use serde_json::{json, Map, Value};

/// The sections of the report, in the order docs/benchmarks.md shows them, numbered from 1 in
/// this order whichever scenarios ran. A scenario names its sections by these headings.
pub const SECTIONS: [&str; 13] = [
    "Per-packet cost beside the floor",
    "Apply cost of one changed peer",
    "No-op: the same state, shuffled",
    "Parsing the state file",
    "Cold load",
    "Memory (kernel side)",
    "Throughput through a veth pair",
    "Churn under traffic",
    "Revocation latency",
    "Agent restart under traffic, and agent memory",
    "Reply flows and drop events",
    "Soak",
    // Last, so that the sections before keep their numbers (and their links).
    "Revocation latency through the Kubernetes API",
];

/// A report being written: the scenarios add sections in the order they run; the Markdown has
/// them in [`SECTIONS`]' order, then the appendices in the order they were added.
#[derive(Debug, Default)]
pub struct Report {
    preamble: String,
    /// Each section's Markdown, with its place in [`SECTIONS`] (`None`: an appendix).
    sections: Vec<(Option<usize>, String)>,
    /// The closing paragraph.
    end: String,
    json: Map<String, Value>,
}

impl Report {
    pub fn new(title: &str, preamble: &str) -> Self {
        Self {
            preamble: format!("# {title}\n\n{preamble}\n\n"),
            ..Self::default()
        }
    }

    /// A scenario's section: a heading of [`SECTIONS`], what it measures and how, and the
    /// command that produced it. What follows, up to the next section, belongs to it.
    pub fn section(&mut self, heading: &str, text: &str) {
        let Some(place) = SECTIONS.iter().position(|s| *s == heading) else {
            panic!("the report has no section {heading:?}: add it to SECTIONS");
        };
        self.sections.push((
            Some(place),
            format!("## {}. {heading}\n\n{text}\n\n", place + 1),
        ));
    }

    /// A section after the numbered ones, unnumbered.
    pub fn appendix(&mut self, heading: &str, text: &str) {
        self.sections
            .push((None, format!("## {heading}\n\n{text}\n\n")));
    }

    /// The Markdown of the current section.
    fn current(&mut self) -> &mut String {
        match self.sections.last_mut() {
            Some((_, text)) => text,
            None => &mut self.preamble,
        }
    }

    pub fn paragraph(&mut self, text: &str) {
        let _ = writeln!(self.current(), "{text}\n");
    }

    pub fn table(&mut self, headers: &[&str], rows: &[Vec<String>]) {
        let out = self.current();
        let _ = writeln!(out, "| {} |", headers.join(" | "));
        let _ = writeln!(
            out,
            "|{}",
            headers.iter().map(|_| "---|").collect::<String>()
        );
        for row in rows {
            let _ = writeln!(out, "| {} |", row.join(" | "));
        }
        out.push('\n');
    }

    /// The report's last paragraph, after every section and appendix.
    pub fn end(&mut self, text: &str) {
        let _ = writeln!(self.end, "{text}\n");
    }

    /// Records machine-readable results under `key`.
    pub fn record(&mut self, key: &str, value: Value) {
        self.json.insert(key.to_owned(), value);
    }

    pub fn markdown(&self) -> String {
        let mut sections: Vec<_> = self.sections.iter().collect();
        // Stable: an appendix (`None`, sorted after every `Some` by the key below) keeps its
        // place among the appendices.
        sections.sort_by_key(|(place, _)| place.unwrap_or(usize::MAX));
        let mut out = self.preamble.clone();
        for (_, text) in sections {
            out.push_str(text);
        }
        out.push_str(&self.end);
        out
    }

    pub fn json(&self) -> Value {
        json!(self.json)
    }
}

/// `x` with `digits` decimals.
pub fn f(x: f64, digits: usize) -> String {
    format!("{x:.digits$}")
}

/// A goal's verdict for the report.
pub fn verdict(met: bool) -> String {
    if met { "met" } else { "**missed**" }.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_come_in_their_order_numbered_whichever_ran() {
        let mut r = Report::new("t", "p");
        r.appendix("Goals", "g");
        r.paragraph("in goals");
        r.section("Soak", "s");
        r.section("Cold load", "c");
        r.table(&["a"], &[vec!["1".into()]]);
        r.end("total");
        assert_eq!(
            r.markdown(),
            "# t\n\np\n\n## 5. Cold load\n\nc\n\n| a |\n|---|\n| 1 |\n\n\
             ## 12. Soak\n\ns\n\n## Goals\n\ng\n\nin goals\n\ntotal\n\n"
        );
    }
}
