//! Reading price files: spot traces (CSV or the JSON of `aws ec2 describe-spot-price-history`,
//! either one plain or gzipped) and on-demand price tables.
//!
//! A file is parsed completely before anything is written, so one bad row refuses the whole
//! file and the error can say exactly where it is: file, line and field.

use crate::market::{
    InstanceType, InvalidValue, Market, Product, Region, Timestamp, UsdPerHour, Zone,
};
use crate::prices::history::InstanceOffer;
use flate2::read::MultiGzDecoder;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// One observed price change.
#[derive(Debug, Clone, PartialEq)]
pub struct SpotPriceRow {
    pub market: Market,
    pub time: Timestamp,
    pub price: UsdPerHour,
}

/// What went wrong reading a price file, and where.
#[derive(Debug, Error)]
pub enum FileError {
    /// The cause is part of the message and not also a `source()`, so that a chain printed
    /// with `{:#}` states it once.
    #[error("{file}: cannot read: {cause}")]
    Io {
        file: PathBuf,
        cause: std::io::Error,
    },
    #[error("{file}:{line}: field `{field}`: {problem}")]
    Field {
        file: PathBuf,
        line: u64,
        field: String,
        problem: String,
    },
    #[error("{file}:{line}: {problem}")]
    Format {
        file: PathBuf,
        line: u64,
        problem: String,
    },
}

impl FileError {
    fn field(file: &Path, line: u64, field: &str, problem: impl ToString) -> Self {
        FileError::Field {
            file: file.to_path_buf(),
            line,
            field: field.to_string(),
            problem: problem.to_string(),
        }
    }
    fn format(file: &Path, line: u64, problem: impl ToString) -> Self {
        FileError::Format {
            file: file.to_path_buf(),
            line,
            problem: problem.to_string(),
        }
    }
}

/// Reads a file, transparently un-gzipping it when it starts with the gzip magic bytes
/// (the extension is not trusted: people rename files).
pub fn read_maybe_gzipped(path: &Path) -> Result<Vec<u8>, FileError> {
    let io = |cause| FileError::Io {
        file: path.to_path_buf(),
        cause,
    };
    let raw = std::fs::read(path).map_err(io)?;
    decompress_if_gzipped(raw).map_err(io)
}

/// Un-gzips bytes that start with the gzip magic; returns other bytes unchanged.
pub fn decompress_if_gzipped(raw: Vec<u8>) -> std::io::Result<Vec<u8>> {
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::with_capacity(raw.len() * 6);
        MultiGzDecoder::new(&raw[..]).read_to_end(&mut out)?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Reads a spot price file of either format.
pub fn read_spot_file(path: &Path) -> Result<Vec<SpotPriceRow>, FileError> {
    let bytes = read_maybe_gzipped(path)?;
    parse_spot_bytes(path, &bytes)
}

/// Parses spot price rows from bytes already in memory; `path` is only used in error messages.
pub fn parse_spot_bytes(path: &Path, bytes: &[u8]) -> Result<Vec<SpotPriceRow>, FileError> {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        Some(b'{') | Some(b'[') => parse_spot_json(path, bytes),
        Some(_) => parse_spot_csv(path, bytes),
        None => Err(FileError::format(path, 1, "file is empty")),
    }
}

const SPOT_COLUMNS: [&str; 5] = [
    "timestamp",
    "availability_zone",
    "instance_type",
    "product_description",
    "spot_price",
];

/// Finds each wanted column in a CSV header, by name and in any order.
fn column_indices<const N: usize>(
    path: &Path,
    header: &csv::ByteRecord,
    wanted: [&str; N],
) -> Result<[Option<usize>; N], FileError> {
    let names: Vec<String> = header
        .iter()
        .map(|h| {
            String::from_utf8_lossy(h)
                .trim()
                .trim_start_matches('\u{feff}')
                .to_ascii_lowercase()
        })
        .collect();
    if names.iter().all(|n| n.is_empty()) {
        return Err(FileError::format(path, 1, "the header line is empty"));
    }
    Ok(wanted.map(|w| names.iter().position(|n| n == w)))
}

fn require<const N: usize>(
    path: &Path,
    found: [Option<usize>; N],
    wanted: [&str; N],
) -> Result<[usize; N], FileError> {
    let mut out = [0; N];
    for (i, idx) in found.iter().enumerate() {
        out[i] = idx.ok_or_else(|| {
            FileError::format(
                path,
                1,
                format!(
                    "missing column `{}` (the header must name: {})",
                    wanted[i],
                    wanted.join(", ")
                ),
            )
        })?;
    }
    Ok(out)
}

fn csv_reader(bytes: &[u8]) -> csv::Reader<&[u8]> {
    csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .from_reader(bytes)
}

fn parse_spot_csv(path: &Path, bytes: &[u8]) -> Result<Vec<SpotPriceRow>, FileError> {
    let mut reader = csv_reader(bytes);
    let header = reader
        .byte_headers()
        .map_err(|e| FileError::format(path, 1, e))?
        .clone();
    let cols = require(
        path,
        column_indices(path, &header, SPOT_COLUMNS)?,
        SPOT_COLUMNS,
    )?;
    // Markets repeat on almost every row; parsing each name once keeps ingestion fast.
    let mut markets: HashMap<Vec<u8>, Market> = HashMap::new();
    let mut key = Vec::with_capacity(64);
    let mut rows = Vec::with_capacity(bytes.len() / 60);
    let mut record = csv::ByteRecord::new();
    let mut instants = OnePricePerInstant::default();
    loop {
        let more = reader
            .read_byte_record(&mut record)
            .map_err(|e| FileError::format(path, line_of_error(&e), e))?;
        if !more {
            break;
        }
        let line = record.position().map_or(0, |p| p.line());
        if record.iter().all(|f| f.is_empty()) {
            continue; // a blank line, e.g. at the end of a hand-edited file
        }
        let field = |i: usize| -> Result<&str, FileError> {
            let name = SPOT_COLUMNS[i];
            let raw = record.get(cols[i]).ok_or_else(|| {
                FileError::field(path, line, name, "missing (row has too few fields)")
            })?;
            std::str::from_utf8(raw).map_err(|_| FileError::field(path, line, name, "not UTF-8"))
        };
        let (time, zone, itype, product, price) =
            (field(0)?, field(1)?, field(2)?, field(3)?, field(4)?);
        let time =
            Timestamp::parse(time).map_err(|e| FileError::field(path, line, SPOT_COLUMNS[0], e))?;
        key.clear();
        for part in [zone, itype, product] {
            key.extend_from_slice(part.as_bytes());
            key.push(0);
        }
        let market = match markets.get(&key) {
            Some(m) => m.clone(),
            None => {
                let m = market_from_fields(path, line, zone, itype, product)?;
                markets.insert(key.clone(), m.clone());
                m
            }
        };
        let price = UsdPerHour::parse(price)
            .map_err(|e| FileError::field(path, line, SPOT_COLUMNS[4], e))?;
        instants.check(path, &market, time, price, line)?;
        rows.push(SpotPriceRow {
            market,
            time,
            price,
        });
    }
    Ok(rows)
}

/// One price per market and instant: a file that gives a market two different prices at the
/// same timestamp is refused, naming both lines (which one should the store keep?). An exact
/// repeat is harmless; it is stored once and counted as already present.
#[derive(Default)]
struct OnePricePerInstant {
    markets: HashMap<Market, u32>,
    /// (market, instant) → (price, line that gave it).
    seen: HashMap<(u32, i64), (f64, u64)>,
}

impl OnePricePerInstant {
    fn check(
        &mut self,
        path: &Path,
        market: &Market,
        time: Timestamp,
        price: UsdPerHour,
        line: u64,
    ) -> Result<(), FileError> {
        let next = self.markets.len() as u32;
        let id = *self.markets.entry(market.clone()).or_insert(next);
        match self.seen.entry((id, time.millis())) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert((price.get(), line));
                Ok(())
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let (first, first_line) = *o.get();
                if first == price.get() {
                    return Ok(());
                }
                Err(FileError::format(
                    path,
                    line,
                    format!(
                        "{market} at {time}: price ${:.4}/h here but ${first:.4}/h on line {first_line}; \
                         one market has one price at an instant",
                        price.get()
                    ),
                ))
            }
        }
    }
}

fn market_from_fields(
    path: &Path,
    line: u64,
    zone: &str,
    itype: &str,
    product: &str,
) -> Result<Market, FileError> {
    let zone =
        Zone::parse(zone).map_err(|e| FileError::field(path, line, "availability_zone", e))?;
    let itype =
        InstanceType::parse(itype).map_err(|e| FileError::field(path, line, "instance_type", e))?;
    let product = Product::parse(product)
        .map_err(|e| FileError::field(path, line, "product_description", e))?;
    Ok(Market::new(zone, itype, product))
}

fn line_of_error(e: &csv::Error) -> u64 {
    e.position().map_or(0, |p| p.line())
}

/// One entry of `SpotPriceHistory`, with the field names EC2 uses.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct JsonEntry {
    availability_zone: Option<String>,
    instance_type: Option<String>,
    product_description: Option<String>,
    spot_price: Option<StringOrNumber>,
    timestamp: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StringOrNumber {
    S(String),
    N(f64),
}

#[derive(Deserialize)]
struct JsonDocument<'a> {
    #[serde(rename = "SpotPriceHistory", borrow)]
    history: Vec<&'a RawValue>,
}

fn parse_spot_json(path: &Path, bytes: &[u8]) -> Result<Vec<SpotPriceRow>, FileError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        FileError::format(path, line_at(bytes, e.valid_up_to()), "file is not UTF-8")
    })?;
    let syntax = |e: serde_json::Error| FileError::format(path, e.line() as u64, e);
    let trimmed = text.trim_start();
    let entries: Vec<&RawValue> = if trimmed.starts_with('[') {
        serde_json::from_str(text).map_err(syntax)?
    } else {
        serde_json::from_str::<JsonDocument>(text)
            .map_err(syntax)?
            .history
    };
    let mut instants = OnePricePerInstant::default();
    entries
        .into_iter()
        .map(|raw| {
            // Borrowed raw values point into `text`, so their offset gives the entry's line.
            let offset = raw.get().as_ptr() as usize - text.as_ptr() as usize;
            let line = line_at(bytes, offset);
            let row = json_row(path, line, raw)?;
            instants.check(path, &row.market, row.time, row.price, line)?;
            Ok(row)
        })
        .collect()
}

fn json_row(path: &Path, line: u64, raw: &RawValue) -> Result<SpotPriceRow, FileError> {
    let entry: JsonEntry = serde_json::from_str(raw.get())
        .map_err(|e| FileError::format(path, line, format!("not a price entry: {e}")))?;
    let missing = |f: &str| FileError::field(path, line, f, "missing");
    let zone = entry
        .availability_zone
        .ok_or_else(|| missing("AvailabilityZone"))?;
    let itype = entry.instance_type.ok_or_else(|| missing("InstanceType"))?;
    let product = entry
        .product_description
        .ok_or_else(|| missing("ProductDescription"))?;
    let time = entry.timestamp.ok_or_else(|| missing("Timestamp"))?;
    let price = match entry.spot_price.ok_or_else(|| missing("SpotPrice"))? {
        StringOrNumber::S(s) => UsdPerHour::parse(&s),
        StringOrNumber::N(n) => UsdPerHour::new(n),
    }
    .map_err(|e| FileError::field(path, line, "SpotPrice", e))?;
    let time = Timestamp::parse(&time).map_err(|e| FileError::field(path, line, "Timestamp", e))?;
    let zone =
        Zone::parse(&zone).map_err(|e| FileError::field(path, line, "AvailabilityZone", e))?;
    let itype =
        InstanceType::parse(&itype).map_err(|e| FileError::field(path, line, "InstanceType", e))?;
    let product = Product::parse(&product)
        .map_err(|e| FileError::field(path, line, "ProductDescription", e))?;
    Ok(SpotPriceRow {
        market: Market::new(zone, itype, product),
        time,
        price,
    })
}

/// 1-based line number of a byte offset.
fn line_at(bytes: &[u8], offset: usize) -> u64 {
    1 + bytes[..offset.min(bytes.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count() as u64
}

const ON_DEMAND_COLUMNS: [&str; 5] = [
    "instance_type",
    "on_demand_usd_per_hour",
    "vcpus",
    "memory_gib",
    "region",
];

/// Reads an on-demand price table. `default_region` applies to rows without a `region` column.
/// vCPUs and memory may be absent; then the built-in catalog of well-known types fills them in.
pub fn read_on_demand_file(
    path: &Path,
    default_region: &Region,
) -> Result<Vec<InstanceOffer>, FileError> {
    let bytes = read_maybe_gzipped(path)?;
    parse_on_demand_bytes(path, &bytes, default_region)
}

pub fn parse_on_demand_bytes(
    path: &Path,
    bytes: &[u8],
    default_region: &Region,
) -> Result<Vec<InstanceOffer>, FileError> {
    let mut reader = csv_reader(bytes);
    let header = reader
        .byte_headers()
        .map_err(|e| FileError::format(path, 1, e))?
        .clone();
    let found = column_indices(path, &header, ON_DEMAND_COLUMNS)?;
    let [itype_col, price_col] = require(
        path,
        [found[0], found[1]],
        [ON_DEMAND_COLUMNS[0], ON_DEMAND_COLUMNS[1]],
    )?;
    let mut offers = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| FileError::format(path, line_of_error(&e), e))?;
        let line = record.position().map_or(0, |p| p.line());
        if record.iter().all(str::is_empty) {
            continue;
        }
        let get = |col: Option<usize>| {
            col.and_then(|c| record.get(c))
                .map(str::trim)
                .filter(|s| !s.is_empty())
        };
        let err = |field: &str, e: InvalidValue| FileError::field(path, line, field, e);
        let instance_type = InstanceType::parse(get(Some(itype_col)).unwrap_or(""))
            .map_err(|e| err("instance_type", e))?;
        let on_demand = UsdPerHour::parse(get(Some(price_col)).unwrap_or(""))
            .map_err(|e| err("on_demand_usd_per_hour", e))?;
        let region = match get(found[4]) {
            Some(r) => Region::parse(r).map_err(|e| err("region", e))?,
            None => default_region.clone(),
        };
        let known = super::catalog::lookup(&instance_type);
        let vcpus = match get(found[2]) {
            Some(v) => Some(v.parse::<u32>().ok().filter(|&n| n > 0).ok_or_else(|| {
                FileError::field(
                    path,
                    line,
                    "vcpus",
                    format!("`{v}` is not a positive whole number"),
                )
            })?),
            None => known.map(|k| k.vcpus),
        };
        let memory_gib = match get(found[3]) {
            Some(v) => Some(
                v.parse::<f64>()
                    .ok()
                    .filter(|m| m.is_finite() && *m > 0.0)
                    .ok_or_else(|| {
                        FileError::field(
                            path,
                            line,
                            "memory_gib",
                            format!("`{v}` is not a positive number"),
                        )
                    })?,
            ),
            None => known.map(|k| k.memory_gib),
        };
        offers.push(InstanceOffer {
            region,
            instance_type,
            vcpus,
            memory_gib,
            on_demand,
        });
    }
    Ok(offers)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<SpotPriceRow>, FileError> {
        parse_spot_bytes(Path::new("t.csv"), text.as_bytes())
    }

    #[test]
    fn one_market_has_one_price_per_instant() {
        let header = "timestamp,availability_zone,instance_type,product_description,spot_price\n";
        let a = "2015-03-11T10:34:42Z,us-east-1a,c3.xlarge,Linux/UNIX,0.5\n";
        let other_zone = "2015-03-11T10:34:42Z,us-east-1b,c3.xlarge,Linux/UNIX,0.7\n";
        let rows = parse(&format!("{header}{a}{other_zone}{a}")).unwrap();
        assert_eq!(
            rows.len(),
            3,
            "an exact repeat is kept (the store stores it once)"
        );
        let err = parse(&format!(
            "{header}{a}{other_zone}2015-03-11T10:34:42Z,us-east-1a,c3.xlarge,Linux/UNIX,0.6\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("t.csv:4: us-east-1a/c3.xlarge")
                && err.contains("$0.6000/h here but $0.5000/h on line 2"),
            "{err}"
        );
        let json = r#"{"SpotPriceHistory": [
            {"AvailabilityZone": "us-east-1a", "InstanceType": "c3.xlarge", "ProductDescription": "Linux/UNIX", "SpotPrice": "0.5", "Timestamp": "2015-03-11T10:34:42Z"},
            {"AvailabilityZone": "us-east-1a", "InstanceType": "c3.xlarge", "ProductDescription": "Linux/UNIX", "SpotPrice": "0.6", "Timestamp": "2015-03-11T10:34:42Z"}
        ]}"#;
        let err = parse_spot_bytes(Path::new("t.json"), json.as_bytes())
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("t.json:3:") && err.contains("on line 2"),
            "{err}"
        );
    }

    #[test]
    fn csv_columns_are_found_by_name() {
        let rows = parse(
            "spot_price,timestamp,instance_type,availability_zone,product_description\n\
             0.5,2015-03-11T10:34:42Z,c3.xlarge,us-east-1a,Linux/UNIX\n",
        )
        .unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].price.get(), 0.5);
        assert_eq!(rows[0].market.to_string(), "us-east-1a/c3.xlarge");
    }

    #[test]
    fn bad_rows_name_file_line_and_field() {
        let header = "timestamp,availability_zone,instance_type,product_description,spot_price\n";
        let good = "2015-03-11T10:34:42Z,us-east-1a,c3.xlarge,Linux/UNIX,0.5\n";
        let cases = [
            (
                "2015-03-11T10:34:42Z,us-east-1a,c3.xlarge,Linux/UNIX,-1\n",
                "spot_price",
            ),
            (
                "2015-03-11T10:34:42Z,us-east-1a,c3.xlarge,Linux/UNIX,cheap\n",
                "spot_price",
            ),
            (
                "yesterday,us-east-1a,c3.xlarge,Linux/UNIX,0.5\n",
                "timestamp",
            ),
            (
                "2015-03-11T10:34:42Z,,c3.xlarge,Linux/UNIX,0.5\n",
                "availability_zone",
            ),
            (
                "2015-03-11T10:34:42Z,us-east-1a,,Linux/UNIX,0.5\n",
                "instance_type",
            ),
            (
                "2015-03-11T10:34:42Z,us-east-1a,c3.xlarge\n",
                "product_description",
            ),
        ];
        for (bad, field) in cases {
            let text = format!("{header}{good}{bad}{good}");
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.starts_with("t.csv:3: field `"), "{err}");
            assert!(
                err.contains(&format!("`{field}`")),
                "{err} should name {field}"
            );
        }
    }

    #[test]
    fn missing_column_is_reported() {
        let err = parse("timestamp,availability_zone,instance_type,spot_price\n").unwrap_err();
        assert!(
            err.to_string()
                .contains("missing column `product_description`"),
            "{err}"
        );
    }

    #[test]
    fn json_as_printed_by_the_aws_cli() {
        let text = r#"{
    "SpotPriceHistory": [
        {
            "AvailabilityZone": "us-east-1a",
            "InstanceType": "c5.large",
            "ProductDescription": "Linux/UNIX",
            "SpotPrice": "0.034000",
            "Timestamp": "2021-05-30T12:00:00+00:00"
        },
        {
            "AvailabilityZone": "us-east-1b",
            "InstanceType": "c5.large",
            "ProductDescription": "Linux/UNIX",
            "SpotPrice": "oops",
            "Timestamp": "2021-05-30T12:00:00.000Z"
        }
    ]
}"#;
        let err = parse(text).unwrap_err().to_string();
        assert_eq!(
            err.lines().next().unwrap().split(": field").next(),
            Some("t.csv:10"),
            "{err}"
        );
        assert!(err.contains("`SpotPrice`"), "{err}");
        let ok = text.replace("oops", "0.035");
        let rows = parse(&ok).unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(
            rows[1].time,
            Timestamp::parse("2021-05-30T12:00:00Z").unwrap()
        );
    }

    #[test]
    fn gzip_is_detected_by_content() {
        use flate2::{Compression, write::GzEncoder};
        use std::io::Write;
        let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
        enc.write_all(b"hello").unwrap();
        let gz = enc.finish().unwrap();
        assert_eq!(decompress_if_gzipped(gz).unwrap(), b"hello");
        assert_eq!(decompress_if_gzipped(b"plain".to_vec()).unwrap(), b"plain");
    }

    #[test]
    fn files_are_read_plain_or_gzipped_whatever_their_name() {
        use flate2::{Compression, write::GzEncoder};
        use std::io::Write;
        let text = "timestamp,availability_zone,instance_type,product_description,spot_price\n\
                    2015-03-11T10:34:42Z,us-east-1a,c3.xlarge,Linux/UNIX,0.5\n\
                    2015-03-11T11:00:00Z,us-east-1a,c3.xlarge,Linux/UNIX,0.25\n";
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("prices.csv.gz");
        std::fs::write(&plain, text).unwrap();
        let mut enc = GzEncoder::new(Vec::new(), Compression::fast());
        enc.write_all(text.as_bytes()).unwrap();
        let gz = dir.path().join("prices.csv");
        std::fs::write(&gz, enc.finish().unwrap()).unwrap();
        for path in [&plain, &gz] {
            assert_eq!(read_maybe_gzipped(path).unwrap(), text.as_bytes());
            let rows = read_spot_file(path).unwrap();
            let prices: Vec<f64> = rows.iter().map(|r| r.price.get()).collect();
            assert_eq!(prices, [0.5, 0.25], "{}", path.display());
        }
        let missing = dir.path().join("nope.csv");
        let err = read_spot_file(&missing).unwrap_err().to_string();
        assert!(err.starts_with(&missing.display().to_string()), "{err}");

        let od = dir.path().join("on-demand.csv");
        std::fs::write(
            &od,
            "instance_type,on_demand_usd_per_hour\nc3.xlarge,0.21\n",
        )
        .unwrap();
        let offers = read_on_demand_file(&od, &Region::parse("us-east-1").unwrap()).unwrap();
        assert_eq!(offers.len(), 1);
        assert_eq!(offers[0].on_demand.get(), 0.21);
    }

    #[test]
    fn a_row_csv_cannot_read_is_reported_at_its_line() {
        let region = Region::parse("us-east-1").unwrap();
        let err = parse_on_demand_bytes(
            Path::new("od.csv"),
            b"instance_type,on_demand_usd_per_hour\nc3.xlarge,0.21\nm3.medium,0.0\xff67\n",
            &region,
        )
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("od.csv:3:"), "{err}");
    }

    #[test]
    fn on_demand_fills_vcpus_from_the_catalog() {
        let region = Region::parse("us-east-1").unwrap();
        let offers = parse_on_demand_bytes(
            Path::new("od.csv"),
            b"instance_type,on_demand_usd_per_hour\nc3.xlarge,0.21\n",
            &region,
        )
        .unwrap();
        assert_eq!(offers[0].vcpus, Some(4));
        let err = parse_on_demand_bytes(
            Path::new("od.csv"),
            b"instance_type,vcpus,on_demand_usd_per_hour\nc3.xlarge,four,0.21\n",
            &region,
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "od.csv:2: field `vcpus`: `four` is not a positive whole number"
        );

        // Given columns win over the catalog, and must be positive (and finite).
        let parse = |vcpus: &str, memory: &str| {
            let text = format!(
                "instance_type,vcpus,memory_gib,on_demand_usd_per_hour\nc3.xlarge,{vcpus},{memory},0.21\n"
            );
            parse_on_demand_bytes(Path::new("od.csv"), text.as_bytes(), &region)
                .map(|o| (o[0].vcpus, o[0].memory_gib))
                .map_err(|e| e.to_string())
        };
        assert_eq!(parse("8", "15.5"), Ok((Some(8), Some(15.5))));
        assert_eq!(parse("1", "0.5"), Ok((Some(1), Some(0.5))));
        assert_eq!(
            parse("0", "15.5"),
            Err("od.csv:2: field `vcpus`: `0` is not a positive whole number".into())
        );
        for memory in ["0", "-1", "inf"] {
            assert_eq!(
                parse("8", memory),
                Err(format!(
                    "od.csv:2: field `memory_gib`: `{memory}` is not a positive number"
                )),
            );
        }
    }
}
