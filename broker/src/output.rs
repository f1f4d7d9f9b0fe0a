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

/// A table: a header and rows of cells.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub header: Vec<String>,
    /// The CSV header, when it differs from what people read: the JSON's field names (dotted
    /// paths into it), so a script reads the same names in CSV and JSON.
    pub fields: Option<Vec<String>>,
    pub rows: Vec<Vec<Cell>>,
}

/// One cell: what people read in a table (`$0.4092`, `42.0%`) and what a script reads in CSV
/// (`0.4092`, `0.42`: plain numbers, percentages as fractions as in the JSON).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cell {
    pub shown: String,
    pub plain: String,
}

impl Cell {
    /// Dollars.
    pub fn usd(v: crate::market::Usd) -> Cell {
        Cell {
            shown: v.to_string(),
            plain: v.get().to_string(),
        }
    }

    /// Dollars, from a plain number (shown with four decimals).
    pub fn dollars(v: f64) -> Cell {
        Cell {
            shown: format!("${v:.4}"),
            plain: v.to_string(),
        }
    }

    /// A fraction, shown as a percentage.
    pub fn pct(fraction: f64) -> Cell {
        Cell {
            shown: pct(fraction),
            plain: fraction.to_string(),
        }
    }

    /// A duration: `1 h 05 min` for people, seconds (as in the JSON) in CSV.
    pub fn duration(secs: f64) -> Cell {
        Cell {
            shown: duration(secs),
            plain: secs.to_string(),
        }
    }

    /// Absent or unknown: `?` for people, empty in CSV.
    pub fn unknown() -> Cell {
        Cell {
            shown: "?".into(),
            plain: String::new(),
        }
    }

    /// `f` of the value, or [`Cell::unknown`].
    pub fn or_unknown<T>(v: Option<T>, f: impl FnOnce(T) -> Cell) -> Cell {
        v.map_or_else(Cell::unknown, f)
    }
}

impl From<String> for Cell {
    fn from(s: String) -> Cell {
        Cell {
            shown: s.clone(),
            plain: s,
        }
    }
}

impl From<&str> for Cell {
    fn from(s: &str) -> Cell {
        Cell::from(s.to_string())
    }
}

impl Table {
    pub fn new(header: &[&str]) -> Self {
        Table {
            header: header.iter().map(|h| h.to_string()).collect(),
            fields: None,
            rows: Vec::new(),
        }
    }

    /// The CSV header: the JSON field (or dotted path) each column shows, one per column.
    pub fn fields(mut self, fields: &[&str]) -> Self {
        debug_assert_eq!(fields.len(), self.header.len(), "one field per column");
        self.fields = Some(fields.iter().map(|f| f.to_string()).collect());
        self
    }

    pub fn push<C: Into<Cell>>(&mut self, row: impl IntoIterator<Item = C>) {
        self.rows.push(row.into_iter().map(Into::into).collect());
    }

    /// Renders through comfy-table: columns padded to their widest cell, a rule under the
    /// header, no borders; numbers (cells starting with a digit, `$`, `-` or `+`) are
    /// right-aligned so that they line up on the units. Never wrapped: a pipe gets whole rows.
    pub fn render(&self) -> String {
        use comfy_table::{
            CellAlignment, ContentArrangement, ContentLineStyle, LineStyle, TableStyle,
        };
        // Two spaces between columns (one of padding, one of junction), a dashed rule under the
        // header, nothing else.
        const PLAIN: TableStyle = TableStyle::new()
            .header_lines(ContentLineStyle::none().junction(' '))
            .content_lines(ContentLineStyle::none().junction(' '))
            .header_separator(LineStyle::none().fill('-').junction(' '));
        let cols = self.header.len();
        let is_number = |c: &str| {
            c.starts_with(|c: char| c.is_ascii_digit() || c == '$' || c == '-' || c == '+')
        };
        let mut table = comfy_table::Table::new();
        table
            .load_style(PLAIN)
            .set_content_arrangement(ContentArrangement::Disabled)
            .set_header(self.header.clone());
        for row in &self.rows {
            table.add_row(
                (0..cols).map(|i| row.get(i).map(|c| c.shown.clone()).unwrap_or_default()),
            );
        }
        for i in 0..cols {
            let numeric = i > 0
                && !self.rows.is_empty()
                && self.rows.iter().all(|r| {
                    r.get(i)
                        .map(|c| c.shown.as_str())
                        .is_none_or(|c| c.is_empty() || c == "?" || is_number(c))
                });
            if let Some(column) = table.column_mut(i) {
                column.set_padding((0, u16::from(i + 1 < cols)));
                if numeric {
                    column.set_cell_alignment(CellAlignment::Right);
                }
            }
        }
        let mut out = table.trim_fmt();
        out.push('\n');
        out
    }

    pub fn to_csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        let _ = w.write_record(self.fields.as_ref().unwrap_or(&self.header));
        for row in &self.rows {
            let _ = w.write_record(row.iter().map(|c| c.plain.as_str()));
        }
        String::from_utf8(w.into_inner().unwrap_or_default()).unwrap_or_default()
    }
}

/// A table whose columns are `fields` of each row's JSON, named as in the JSON: for CSV that a
/// script reads with the same names as `--output json`. Numbers stay plain; a missing or null
/// field is an empty cell; a field that is an object or a list is written as JSON.
pub fn json_table<T: Serialize>(fields: &[&str], rows: &[T]) -> Table {
    let mut t = Table::new(fields);
    for row in rows {
        let v = serde_json::to_value(row).unwrap_or_default();
        t.push(fields.iter().map(|f| {
            let text = match v.get(*f) {
                None | Some(serde_json::Value::Null) => String::new(),
                Some(serde_json::Value::String(s)) => s.clone(),
                Some(other) => other.to_string(),
            };
            Cell {
                shown: text.clone(),
                plain: text,
            }
        }));
    }
    t
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

pub fn pct(v: f64) -> String {
    format!("{:.1}%", v * 100.0)
}

/// A duration for people: `42 s`, `7 min 05 s`, `3 h 07 min`, `2 d 04 h`.
pub fn duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {:02} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {:02} h", s / 86_400, s % 86_400 / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_tables_name_their_columns_after_the_fields() {
        let rows = [
            serde_json::json!({"policy": "a", "cost_usd": 1.5, "ratio": null, "n": 3}),
            serde_json::json!({"policy": "b", "cost_usd": 0.25, "ratio": 0.5, "n": 4}),
        ];
        let t = json_table(&["policy", "cost_usd", "ratio", "missing"], &rows);
        assert_eq!(
            t.to_csv(),
            "policy,cost_usd,ratio,missing\na,1.5,,\nb,0.25,0.5,\n"
        );
    }

    #[test]
    fn durations_read_in_the_two_largest_units() {
        let cases = [
            (0.0, "0 s"),
            (-3.0, "0 s"),
            (59.4, "59 s"),
            (60.0, "1 min 00 s"),
            (425.0, "7 min 05 s"),
            (3600.0, "1 h 00 min"),
            (11_220.0, "3 h 07 min"),
            (86_399.0, "23 h 59 min"),
            (187_200.0, "2 d 04 h"),
        ];
        for (secs, text) in cases {
            assert_eq!(duration(secs), text, "{secs} s");
        }
        assert_eq!(Cell::duration(425.4).plain, "425.4");
    }

    #[test]
    fn tables_align_numbers_right_and_csv_has_plain_numbers() {
        let mut t = Table::new(&["market", "price", "share"]);
        t.push([Cell::from("a"), Cell::dollars(1.5), Cell::pct(0.25)]);
        t.push([Cell::from("bbbbbb"), Cell::dollars(10.25), Cell::unknown()]);
        assert_eq!(
            t.render(),
            "market     price  share\n------- --------- -----\na        $1.5000  25.0%\nbbbbbb  $10.2500      ?\n"
        );
        assert_eq!(
            t.to_csv(),
            "market,price,share\na,1.5,0.25\nbbbbbb,10.25,\n"
        );
        // With field names, CSV's header is them; people still read the table's.
        let t = t.fields(&["market", "usd_per_hour", "share"]);
        assert!(t.to_csv().starts_with("market,usd_per_hour,share\n"));
        assert!(t.render().starts_with("market     price  share"));
    }
}
