//! Today's market from availability traces: when a pool had spot capacity, and how much.
//!
//! Since late 2017 EC2 does not evict on price: it refuses a spot launch when a pool has no
//! capacity (`InsufficientInstanceCapacity`) and interrupts running instances, with a 2-minute
//! notice, when it needs the capacity back. An availability trace records that directly: one
//! value per tick of `gap_seconds`, the number of instances of one type a zone would sell then.
//! This module reads such traces (`{"metadata": {"gap_seconds": G}, "data": [n0, n1, …]}`,
//! SkyPilot's format, one file per zone, the zone named by the file name up to its first `_`)
//! and answers the simulator's two questions:
//!
//! - may one more instance be launched in a pool at `t`: only while the pool's capacity at `t`
//!   is above what the job already holds there;
//! - when does a held instance get its notice: at the first tick whose capacity is below what
//!   the job holds there, the newest instances first (see `sim::Run`).
//!
//! # Reading a tick
//!
//! Value `n` at index `i` means "`n` instances available" during `[origin + i·G, origin +
//! (i+1)·G)` ([`Reading::Available`], the upstream README's reading, the default). The 0/1
//! files can also be read the other way round, 1 meaning "preempted" ([`Reading::Preempted`]);
//! `docs/today.md` gives the figures under both. Files of one run must share `gap_seconds`;
//! they are cut to the shortest (the common period), and all start at `origin` (the date in a
//! parent folder named `aws-MM-DD-YYYY`, else 2023-01-01).

use crate::market::{InstanceType, Market, Timestamp, UsdPerHour, Zone};
use crate::prices::{InstanceOffer, OnDemandCatalog, PriceHistory, PriceSeries};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// The spot price the traces' own preemption data record for p3.2xlarge (they carry none for
/// availability), USD per hour: what every pool is priced at.
pub const TRACE_SPOT_USD_PER_HOUR: f64 = 0.918;
/// p3.2xlarge's on-demand list price in the traces' regions (the catalog's, and the paper's).
pub const P3_2XLARGE_ON_DEMAND_USD_PER_HOUR: f64 = 3.06;

/// How a 0/1 value of a trace is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Reading {
    /// The value is the number of instances available (1: spot can be had).
    #[default]
    Available,
    /// In 0/1 files, 1 means preempted (no spot); counts above 1 are read as available.
    Preempted,
}

#[derive(Debug, Error)]
pub enum AvailabilityError {
    #[error("{file}: cannot read: {cause}")]
    Io { file: String, cause: std::io::Error },
    #[error(
        "{file}: not an availability trace ({problem}); expected {{\"metadata\": {{\"gap_seconds\": G}}, \"data\": [n, …]}}"
    )]
    Format { file: String, problem: String },
    #[error("{file}: the zone `{zone}` taken from the file name is not a zone ({problem})")]
    Zone {
        file: String,
        zone: String,
        problem: String,
    },
    #[error(
        "{file}: gap_seconds {gap} differs from {first_file}'s {first_gap}: the files of one run must share their tick"
    )]
    Gap {
        file: String,
        gap: u64,
        first_file: String,
        first_gap: u64,
    },
    #[error("{file}: zone {zone} appears twice")]
    Duplicate { file: String, zone: String },
    #[error("no availability file given")]
    Empty,
}

#[derive(Deserialize)]
struct RawTrace {
    metadata: RawMetadata,
    data: Vec<f64>,
}

#[derive(Deserialize)]
struct RawMetadata {
    gap_seconds: f64,
}

/// One zone's trace as read from its file.
#[derive(Debug, Clone, PartialEq)]
pub struct AvailabilityTrace {
    pub file: PathBuf,
    pub zone: Zone,
    pub gap_secs: u64,
    /// Instances available at each tick.
    pub counts: Vec<u32>,
}

impl AvailabilityTrace {
    pub fn load(path: &Path, reading: Reading) -> Result<Self, AvailabilityError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|cause| AvailabilityError::Io {
            file: file.clone(),
            cause,
        })?;
        Self::parse(path, &text, reading)
    }

    pub fn parse(path: &Path, text: &str, reading: Reading) -> Result<Self, AvailabilityError> {
        let file = path.display().to_string();
        let format = |problem: String| AvailabilityError::Format {
            file: file.clone(),
            problem,
        };
        let raw: RawTrace = serde_json::from_str(text).map_err(|e| format(e.to_string()))?;
        let gap = raw.metadata.gap_seconds;
        if !(gap.is_finite() && gap >= 1.0 && gap.fract() == 0.0) {
            return Err(format(format!(
                "gap_seconds must be a whole number of seconds ≥ 1, not {gap}"
            )));
        }
        if raw.data.is_empty() {
            return Err(format("data is empty".into()));
        }
        let mut counts = Vec::with_capacity(raw.data.len());
        for (i, &v) in raw.data.iter().enumerate() {
            if !(v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= 1e6) {
                return Err(format(format!(
                    "data[{i}] is {v}: a count of instances (a whole number ≥ 0) was expected"
                )));
            }
            counts.push(v as u32);
        }
        let binary = counts.iter().all(|&c| c <= 1);
        if reading == Reading::Preempted && binary {
            for c in &mut counts {
                *c = 1 - *c;
            }
        }
        let stem = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        let zone_text = stem.split(['_', '.']).next().unwrap_or_default();
        let zone_error = |problem: String| AvailabilityError::Zone {
            file: file.clone(),
            zone: zone_text.to_string(),
            problem,
        };
        if !looks_like_a_zone(zone_text) {
            return Err(zone_error(
                "a zone is a region and a letter, like us-west-2a; name the file <zone>_….json"
                    .into(),
            ));
        }
        let zone = Zone::parse(zone_text).map_err(|e| zone_error(e.to_string()))?;
        Ok(AvailabilityTrace {
            file: path.to_path_buf(),
            zone,
            gap_secs: gap as u64,
            counts,
        })
    }

    /// The share of ticks with at least one instance available.
    pub fn available_share(&self) -> f64 {
        self.counts.iter().filter(|&&c| c > 0).count() as f64 / self.counts.len().max(1) as f64
    }
}

/// `us-west-2a`: lowercase words, then a number, then one letter.
fn looks_like_a_zone(text: &str) -> bool {
    let Some((region, letter)) = text.len().checked_sub(1).map(|i| text.split_at(i)) else {
        return false;
    };
    let parts: Vec<&str> = region.split('-').collect();
    letter.chars().all(|c| c.is_ascii_lowercase())
        && parts.len() >= 3
        && parts
            .last()
            .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()))
        && parts[..parts.len() - 1]
            .iter()
            .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase()))
}

/// The date a folder named like SkyPilot's (`aws-10-26-2022`) says a trace starts, else
/// 2023-01-01 (the traces carry no timestamps; only durations matter to a run).
pub fn origin_of(path: &Path) -> Timestamp {
    let fallback = Timestamp::parse("2023-01-01T00:00:00Z").unwrap_or(Timestamp::from_millis(0));
    path.ancestors()
        .filter_map(|a| a.file_name().and_then(|n| n.to_str()))
        .find_map(|name| {
            let rest = name.strip_prefix("aws-")?;
            let parts: Vec<&str> = rest.split('-').collect();
            let [m, d, y] = parts.as_slice() else {
                return None;
            };
            Timestamp::parse(&format!("{y}-{m}-{d}T00:00:00Z")).ok()
        })
        .unwrap_or(fallback)
}

/// Several zones' capacity of one instance type over a common period.
#[derive(Debug, Clone)]
pub struct Availability {
    origin: Timestamp,
    gap_ms: i64,
    ticks: usize,
    instance_type: InstanceType,
    pools: BTreeMap<Market, Vec<u32>>,
    /// Per pool, the indexes where the count changes (for the next event after a time).
    changes: BTreeMap<Market, Vec<usize>>,
}

impl Availability {
    /// Pools of `instance_type` in each trace's zone, cut to the shortest trace.
    pub fn new(
        traces: Vec<AvailabilityTrace>,
        instance_type: InstanceType,
        origin: Timestamp,
    ) -> Result<Self, AvailabilityError> {
        let first = traces.first().ok_or(AvailabilityError::Empty)?;
        let gap = first.gap_secs;
        let first_file = first.file.display().to_string();
        let ticks = traces.iter().map(|t| t.counts.len()).min().unwrap_or(0);
        let mut pools = BTreeMap::new();
        for t in traces {
            if t.gap_secs != gap {
                return Err(AvailabilityError::Gap {
                    file: t.file.display().to_string(),
                    gap: t.gap_secs,
                    first_file,
                    first_gap: gap,
                });
            }
            let market = Market::new(
                t.zone.clone(),
                instance_type.clone(),
                crate::market::Product::linux(),
            );
            let mut counts = t.counts;
            counts.truncate(ticks);
            if pools.insert(market, counts).is_some() {
                return Err(AvailabilityError::Duplicate {
                    file: t.file.display().to_string(),
                    zone: t.zone.to_string(),
                });
            }
        }
        let changes = pools
            .iter()
            .map(|(m, c)| {
                let idx = (1..c.len()).filter(|&i| c[i] != c[i - 1]).collect();
                (m.clone(), idx)
            })
            .collect();
        Ok(Availability {
            origin,
            gap_ms: gap as i64 * 1000,
            ticks,
            instance_type,
            pools,
            changes,
        })
    }

    /// The period the traces cover: `[origin, origin + ticks × gap)`.
    pub fn span(&self) -> (Timestamp, Timestamp) {
        (
            self.origin,
            Timestamp::from_millis(self.origin.millis() + self.ticks as i64 * self.gap_ms),
        )
    }

    pub fn gap_secs(&self) -> f64 {
        self.gap_ms as f64 / 1000.0
    }

    pub fn markets(&self) -> impl Iterator<Item = &Market> {
        self.pools.keys()
    }

    pub fn instance_type(&self) -> &InstanceType {
        &self.instance_type
    }

    fn tick(&self, t: Timestamp) -> Option<usize> {
        let ms = t.millis() - self.origin.millis();
        if ms < 0 {
            return None;
        }
        let i = (ms / self.gap_ms) as usize;
        (i < self.ticks).then_some(i)
    }

    /// The pool's capacity at `from`, and every change in `(from, to]` with its time.
    pub fn capacity_changes(
        &self,
        market: &Market,
        from: Timestamp,
        to: Timestamp,
    ) -> (u32, Vec<(Timestamp, u32)>) {
        let at = |i: usize| Timestamp::from_millis(self.origin.millis() + i as i64 * self.gap_ms);
        let changes = self
            .changes
            .get(market)
            .zip(self.pools.get(market))
            .map(|(idx, counts)| {
                idx.iter()
                    .map(|&i| (at(i), counts[i]))
                    .filter(|(t, _)| *t > from && *t <= to)
                    .collect()
            })
            .unwrap_or_default();
        (self.capacity(market, from), changes)
    }

    /// How far into its tick `t` falls, seconds (0 on a boundary).
    pub fn offset_in_tick(&self, t: Timestamp) -> f64 {
        (t.millis() - self.origin.millis()).rem_euclid(self.gap_ms) as f64 / 1000.0
    }

    /// Instances the pool sells at `t` (0 outside the traces or for an unknown pool).
    pub fn capacity(&self, market: &Market, t: Timestamp) -> u32 {
        match (self.pools.get(market), self.tick(t)) {
            (Some(c), Some(i)) => c[i],
            _ => 0,
        }
    }

    /// The pool's capacity from the tick that contains `t` to the end of the period.
    pub fn capacity_from(&self, market: &Market, t: Timestamp) -> &[u32] {
        match (self.pools.get(market), self.tick(t)) {
            (Some(c), Some(i)) => &c[i..],
            _ => &[],
        }
    }

    /// The first tick boundary after `t` where the pool's capacity changes.
    pub fn next_change(&self, market: &Market, t: Timestamp) -> Option<Timestamp> {
        let changes = self.changes.get(market)?;
        let ms = t.millis() - self.origin.millis();
        // The first change index whose start is strictly after t.
        let k = changes.partition_point(|&i| i as i64 * self.gap_ms <= ms);
        changes
            .get(k)
            .map(|&i| Timestamp::from_millis(self.origin.millis() + i as i64 * self.gap_ms))
    }

    /// Prices for a run on these pools: spot at `spot` in every pool over the whole period,
    /// on-demand at `on_demand` in each pool's region.
    pub fn price_history(&self, spot: UsdPerHour, on_demand: UsdPerHour) -> PriceHistory {
        let (start, end) = self.span();
        let series = self
            .pools
            .keys()
            .map(|m| PriceSeries::new(m.clone(), vec![(start, spot), (end, spot)]));
        let offers: BTreeMap<_, _> = self
            .pools
            .keys()
            .map(|m| {
                (
                    m.region(),
                    InstanceOffer {
                        region: m.region(),
                        instance_type: m.instance_type.clone(),
                        vcpus: None,
                        memory_gib: None,
                        on_demand,
                    },
                )
            })
            .collect();
        PriceHistory::new(series, OnDemandCatalog::new(offers.into_values()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(name: &str, gap: u64, data: &[u32]) -> AvailabilityTrace {
        let text = format!(
            "{{\"metadata\": {{\"gap_seconds\": {gap}}}, \"data\": {:?}}}",
            data
        );
        AvailabilityTrace::parse(Path::new(name), &text, Reading::Available).unwrap()
    }

    #[test]
    fn a_tick_covers_its_gap_and_changes_are_found_after_a_time() {
        let t0 = Timestamp::from_millis(0);
        let a = Availability::new(
            vec![
                trace("us-west-2a_v100_1.json", 600, &[1, 1, 0, 0, 1, 1]),
                trace("us-west-2b_v100_1.json", 600, &[0, 1, 1, 1, 1]),
            ],
            InstanceType::parse("p3.2xlarge").unwrap(),
            t0,
        )
        .unwrap();
        let m = Market::parse("us-west-2a/p3.2xlarge").unwrap();
        let at = |s: i64| Timestamp::from_millis(s * 1000);
        // Cut to the shorter file: five ticks of ten minutes.
        assert_eq!(a.span(), (t0, at(3000)));
        assert_eq!(a.capacity(&m, at(0)), 1);
        assert_eq!(a.capacity(&m, at(1199)), 1);
        assert_eq!(a.capacity(&m, at(1200)), 0);
        assert_eq!(a.capacity(&m, at(3000)), 0, "after the common period");
        assert_eq!(a.next_change(&m, at(0)), Some(at(1200)));
        assert_eq!(a.next_change(&m, at(1200)), Some(at(2400)));
        assert_eq!(a.next_change(&m, at(2400)), None);
        let other = Market::parse("us-east-1a/p3.2xlarge").unwrap();
        assert_eq!(a.capacity(&other, at(0)), 0);
    }

    #[test]
    fn readings_and_bad_files_are_explained() {
        let p = Path::new("/x/aws-10-26-2022/us-west-2a_k80_1.json");
        let text = "{\"metadata\": {\"gap_seconds\": 600}, \"data\": [1, 0, 1]}";
        let inv = AvailabilityTrace::parse(p, text, Reading::Preempted).unwrap();
        assert_eq!(inv.counts, vec![0, 1, 0]);
        assert_eq!(inv.zone.to_string(), "us-west-2a");
        assert_eq!(
            origin_of(p),
            Timestamp::parse("2022-10-26T00:00:00Z").unwrap()
        );
        // Counts above 1 are counts under either reading.
        let many = "{\"metadata\": {\"gap_seconds\": 300}, \"data\": [16, 3, 0]}";
        let c = AvailabilityTrace::parse(
            Path::new("us-east-2b_v100_1.json"),
            many,
            Reading::Preempted,
        )
        .unwrap();
        assert_eq!(c.counts, vec![16, 3, 0]);
        let bad = AvailabilityTrace::parse(
            Path::new("us-west-2a.json"),
            "{\"metadata\": {\"gap_seconds\": 600}, \"data\": [1, -1]}",
            Reading::Available,
        )
        .unwrap_err()
        .to_string();
        assert!(
            bad.contains("us-west-2a.json") && bad.contains("data[1]"),
            "{bad}"
        );
        let zone =
            AvailabilityTrace::parse(Path::new("nowhere_v100.json"), text, Reading::Available)
                .unwrap_err()
                .to_string();
        assert!(zone.contains("`nowhere`"), "{zone}");
        let gap = Availability::new(
            vec![
                trace("us-west-2a_x.json", 600, &[1]),
                trace("us-west-2b_x.json", 300, &[1]),
            ],
            InstanceType::parse("p3.2xlarge").unwrap(),
            Timestamp::from_millis(0),
        )
        .unwrap_err()
        .to_string();
        assert!(
            gap.contains("us-west-2b_x.json") && gap.contains("300"),
            "{gap}"
        );
    }
}
