//! The report: Markdown for docs/benchmarks.md and JSON for target/bench/results.json.

use std::fmt::Write as _;

use serde_json::{json, Map, Value};

#[derive(Debug, Default)]
pub struct Report {
    markdown: String,
    json: Map<String, Value>,
}

impl Report {
    pub fn new(title: &str, preamble: &str) -> Self {
        let mut r = Self::default();
        let _ = writeln!(r.markdown, "# {title}\n\n{preamble}\n");
        r
    }

    /// A scenario: a heading, what it measures and how, and the command that produced it.
    pub fn section(&mut self, heading: &str, text: &str) {
        let _ = writeln!(self.markdown, "## {heading}\n\n{text}\n");
    }

    pub fn paragraph(&mut self, text: &str) {
        let _ = writeln!(self.markdown, "{text}\n");
    }

    pub fn table(&mut self, headers: &[&str], rows: &[Vec<String>]) {
        let _ = writeln!(self.markdown, "| {} |", headers.join(" | "));
        let _ = writeln!(
            self.markdown,
            "|{}",
            headers.iter().map(|_| "---|").collect::<String>()
        );
        for row in rows {
            let _ = writeln!(self.markdown, "| {} |", row.join(" | "));
        }
        self.markdown.push('\n');
    }

    /// Records machine-readable results under `key`.
    pub fn record(&mut self, key: &str, value: Value) {
        self.json.insert(key.to_owned(), value);
    }

    pub fn markdown(&self) -> &str {
        &self.markdown
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
