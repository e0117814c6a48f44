//! What goes to stdout: aligned tables for humans, or exactly one JSON document.

use serde::Serialize;
use std::io::Write;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Table,
    Json,
}

/// Rows of cells under headers, printed with aligned columns.
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// A two-column FIELD / VALUE table.
    pub fn fields<K: ToString, V: ToString>(pairs: impl IntoIterator<Item = (K, V)>) -> Table {
        let mut t = Table::new(&["FIELD", "VALUE"]);
        for (k, v) in pairs {
            t.row(vec![k.to_string(), v.to_string()]);
        }
        t
    }

    pub fn with_rows(mut self, rows: Vec<Vec<String>>) -> Table {
        self.rows.extend(rows);
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    pub fn render(&self) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if i >= widths.len() {
                    widths.push(0);
                }
                widths[i] = widths[i].max(c.chars().count());
            }
        }
        let mut out = String::new();
        for r in std::iter::once(&self.headers).chain(&self.rows) {
            out.push_str(&line(r, &widths));
            out.push('\n');
        }
        out
    }
}

/// One line of cells padded to `widths` (the last cell is not padded).
pub fn line(cells: &[String], widths: &[usize]) -> String {
    let mut s = String::new();
    for (i, c) in cells.iter().enumerate() {
        if i + 1 == cells.len() {
            s.push_str(c);
        } else {
            let w = widths.get(i).copied().unwrap_or(0);
            s.push_str(&format!("{c:<w$}  "));
        }
    }
    s.trim_end().to_string()
}

/// Writes to stdout; a closed pipe (`allotctl ... | head`) ends the process quietly.
pub fn print(s: &str) {
    let mut out = std::io::stdout().lock();
    if out
        .write_all(s.as_bytes())
        .and_then(|_| out.flush())
        .is_err()
    {
        std::process::exit(0);
    }
}

pub fn print_json(v: &impl Serialize) -> anyhow::Result<()> {
    let mut s = serde_json::to_string_pretty(v)?;
    s.push('\n');
    print(&s);
    Ok(())
}

/// Prints one JSON line (for streams such as `audit export`).
pub fn print_json_line(v: &impl Serialize) -> anyhow::Result<()> {
    let mut s = serde_json::to_string(v)?;
    s.push('\n');
    print(&s);
    Ok(())
}

/// Prints `json` in JSON mode, otherwise the tables (separated by blank lines).
pub fn show(format: Format, json: &impl Serialize, tables: &[Table]) -> anyhow::Result<()> {
    match format {
        Format::Json => print_json(json),
        Format::Table => {
            let parts: Vec<String> = tables
                .iter()
                .filter(|t| !t.is_empty())
                .map(Table::render)
                .collect();
            print(&parts.join("\n"));
            Ok(())
        }
    }
}

/// Micro-credits as credits for tables.
pub fn cr(micro: u64) -> String {
    allot_client::format_credits(micro)
}

/// A list for a table cell (`-` when empty).
pub fn list<T: std::fmt::Display>(items: &[T]) -> String {
    if items.is_empty() {
        return "-".into();
    }
    items
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let mut t = Table::new(&["A", "LONGER"]);
        t.row(vec!["xyz".into(), "1".into()]);
        assert_eq!(t.render(), "A    LONGER\nxyz  1\n");
    }
}
