//! The price-file parsers (`proteus prices ingest`, `serve --trace/--on-demand`): spot CSV and
//! JSON, on-demand tables, gzip, and the price history built from what parsed. The first byte
//! picks the parser.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proteus_broker::market::Region;
use proteus_broker::prices::files;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let region = Region::parse("us-east-1").expect("region");
    let path = Path::new("fuzz.csv");
    match which % 4 {
        0 => {
            if let Ok(rows) = files::parse_spot_bytes(path, bytes) {
                let history = proteus_broker::sim::inputs::history_from_rows(rows, Vec::new());
                let _ = history.span();
            }
        }
        1 => {
            if let Ok(offers) = files::parse_on_demand_bytes(path, bytes, &region) {
                let _ = proteus_broker::sim::inputs::history_from_rows(Vec::new(), offers);
            }
        }
        2 => {
            if let Ok(raw) = files::decompress_if_gzipped(bytes.to_vec()) {
                let _ = files::parse_spot_bytes(path, &raw);
            }
        }
        _ => {
            // Both files of a simulation, split at the first NUL.
            let cut = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
            let (spot, od) = bytes.split_at(cut);
            if let (Ok(rows), Ok(offers)) = (
                files::parse_spot_bytes(path, spot),
                files::parse_on_demand_bytes(path, od.get(1..).unwrap_or_default(), &region),
            ) {
                let history = proteus_broker::sim::inputs::history_from_rows(rows, offers);
                let _ = history.span();
            }
        }
    }
});
