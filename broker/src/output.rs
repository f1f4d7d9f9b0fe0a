//! Printing results for people (aligned tables) and for scripts (JSON, CSV).

use clap::ValueEnum;
use serde::Serialize;
use std::io::Write;

/// How a command prints its result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum OutputFormat {
    /// Aligned columns for people.
    #[default]
    Table,
    /// One JSON document on stdout.
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// A table: a header and rows of already-formatted cells.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub header: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn push(&mut self, row: Vec<String>) {
        self.rows.push(row);
    }

    /// Renders with columns padded to their widest cell; numbers (cells starting with a digit,
    /// `$` or `-`) are right-aligned so that they line up on the units.
    pub fn render(&self) -> String {
        let cols = self.header.len();
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (i, cell) in row.iter().enumerate().take(cols) {
                widths[i] = widths[i].max(cell.chars().count());
            }
        }
        let is_number = |c: &str| {
            c.starts_with(|c: char| c.is_ascii_digit() || c == '$' || c == '-' || c == '+')
        };
        let numeric: Vec<bool> = (0..cols)
            .map(|i| {
                i > 0
                    && !self.rows.is_empty()
                    && self.rows.iter().all(|r| {
                        r.get(i)
                            .is_none_or(|c| c.is_empty() || c == "?" || is_number(c))
                    })
            })
            .collect();
        let mut out = String::new();
        let line = |cells: &[String], out: &mut String| {
            let mut parts = Vec::with_capacity(cols);
            for (i, w) in widths.iter().enumerate() {
                let cell = cells.get(i).map(String::as_str).unwrap_or("");
                if numeric[i] {
                    parts.push(format!("{cell:>w$}"));
                } else {
                    parts.push(format!("{cell:<w$}"));
                }
            }
            out.push_str(parts.join("  ").trim_end());
            out.push('\n');
        };
        line(&self.header, &mut out);
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        line(&rule, &mut out);
        for row in &self.rows {
            line(row, &mut out);
        }
        out
    }

    pub fn to_csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        let _ = w.write_record(&self.header);
        for row in &self.rows {
            let _ = w.write_record(row);
        }
        String::from_utf8(w.into_inner().unwrap_or_default()).unwrap_or_default()
    }
}

/// Prints `value` as JSON or `table` as a table or CSV, to stdout.
pub fn emit<T: Serialize>(
    format: OutputFormat,
    value: &T,
    table: impl FnOnce() -> Table,
) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    match format {
        OutputFormat::Json => {
            serde_json::to_writer_pretty(&mut stdout, value)?;
            writeln!(stdout)?;
        }
        OutputFormat::Table => write!(stdout, "{}", table().render())?,
        OutputFormat::Csv => write!(stdout, "{}", table().to_csv())?,
    }
    Ok(())
}

/// Dollars with precision that suits the magnitude.
pub fn usd(v: f64) -> String {
    if v.abs() >= 100.0 {
        format!("${v:.2}")
    } else {
        format!("${v:.4}")
    }
}

pub fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_numbers_right() {
        let mut t = Table::new(&["market", "price"]);
        t.push(vec!["a".into(), "$1.5".into()]);
        t.push(vec!["bbbbbb".into(), "$10.25".into()]);
        assert_eq!(
            t.render(),
            "market   price\n------  ------\na         $1.5\nbbbbbb  $10.25\n"
        );
        assert_eq!(t.to_csv(), "market,price\na,$1.5\nbbbbbb,$10.25\n");
    }
}
