//! Spot and on-demand price history: reading files and EC2, holding series in memory, and
//! summarising them.

pub mod catalog;
#[cfg(feature = "ec2")]
pub mod ec2;
pub mod files;
pub mod history;
pub mod stats;

pub use files::{FileError, SpotPriceRow};
pub use history::{InstanceOffer, OnDemandCatalog, PriceHistory, PriceSeries};
pub use stats::MarketStats;
