//! The vocabulary of the spot market: where capacity is sold, what it costs, and when.
//!
//! Every value here is validated once, at the edge (a file, a flag, a request), so the rest of
//! the broker never has to wonder whether a zone is empty or a price is negative.

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::time::Duration;
use thiserror::Error;

/// Why a value was refused. The caller adds where it came from (file and line, flag, field).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum InvalidValue {
    #[error("empty {0}")]
    Empty(&'static str),
    #[error("`{value}` is not a valid {what}: {why}")]
    Malformed {
        what: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("price `{0}` is not a number")]
    NotANumber(String),
    #[error("price {0} is negative")]
    NegativePrice(f64),
    #[error("amount `{0}` is not a finite number of dollars")]
    NotAnAmount(String),
    #[error("`{0}` is not an RFC 3339 timestamp (e.g. 2015-03-11T10:34:42Z)")]
    Timestamp(String),
}

/// A point in time, in milliseconds since the Unix epoch (UTC).
///
/// Milliseconds as a plain integer because that is what both Postgres and SQLite store without
/// a driver-specific type, and what the simulator compares millions of times per sweep. The
/// integer is private: code moves a timestamp by a [`Duration`] (`t + d`, `t - d`) and measures
/// between two with `a - b` (a signed [`TimeDelta`]) or [`Timestamp::secs_since`], so a count
/// of seconds is never mistaken for one of milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(i64);

impl Timestamp {
    pub const MIN: Timestamp = Timestamp(i64::MIN);
    pub const MAX: Timestamp = Timestamp(i64::MAX);

    pub const fn from_millis(ms: i64) -> Self {
        Timestamp(ms)
    }
    pub const fn from_secs(s: i64) -> Self {
        Timestamp(s * 1000)
    }
    /// Milliseconds since the epoch: for storage and wire formats.
    pub const fn millis(self) -> i64 {
        self.0
    }
    pub fn secs_f64(self) -> f64 {
        self.0 as f64 / 1000.0
    }
    pub fn now() -> Self {
        Timestamp(Utc::now().timestamp_millis())
    }

    /// Accepts RFC 3339 (`2015-03-11T10:34:42Z`, `2015-03-11T10:34:42.000+00:00`) and, because
    /// people type them on the command line, a bare date (`2015-04-01`, midnight UTC): the
    /// parser the agent uses too ([`proteus_wire::time::parse_millis`]).
    pub fn parse(text: &str) -> Result<Self, InvalidValue> {
        proteus_wire::time::parse_millis(text)
            .map(Timestamp)
            .map_err(|e| InvalidValue::Timestamp(e.0))
    }

    pub fn to_datetime(self) -> DateTime<Utc> {
        proteus_wire::time::datetime(self.0)
    }

    pub fn plus_secs(self, secs: f64) -> Timestamp {
        Timestamp(self.0 + (secs * 1000.0).round() as i64)
    }

    /// Seconds from `earlier` to `self` (negative if `earlier` is later).
    pub fn secs_since(self, earlier: Timestamp) -> f64 {
        (self.0 - earlier.0) as f64 / 1000.0
    }
}

/// The schema of a time the API takes: RFC 3339 (`2015-03-11T10:34:42Z`) or a bare date
/// (`2015-03-11`, midnight UTC), as [`Timestamp::parse`] reads it.
pub fn time_schema() -> utoipa::openapi::schema::Schema {
    time_schema_of(false)
}

/// [`time_schema`], or `null`.
pub fn nullable_time_schema() -> utoipa::openapi::schema::Schema {
    time_schema_of(true)
}

fn time_schema_of(nullable: bool) -> utoipa::openapi::schema::Schema {
    use utoipa::openapi::schema::{
        KnownFormat, ObjectBuilder, OneOfBuilder, SchemaFormat, SchemaType, Type,
    };
    let string = |format| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .format(Some(SchemaFormat::KnownFormat(format)))
    };
    let mut one = OneOfBuilder::new()
        .item(string(KnownFormat::DateTime))
        .item(string(KnownFormat::Date));
    if nullable {
        one = one.item(ObjectBuilder::new().schema_type(SchemaType::Type(Type::Null)));
    }
    one.description(Some(
        "RFC 3339 (`2015-03-11T10:34:42Z`) or a date (`2015-03-11`, midnight UTC)",
    ))
    .build()
    .into()
}

/// `t + d`: `d` later (saturating at [`Timestamp::MAX`]).
impl std::ops::Add<Duration> for Timestamp {
    type Output = Timestamp;
    fn add(self, d: Duration) -> Timestamp {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(ms))
    }
}

/// `t - d`: `d` earlier (saturating at [`Timestamp::MIN`]).
impl std::ops::Sub<Duration> for Timestamp {
    type Output = Timestamp;
    fn sub(self, d: Duration) -> Timestamp {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(ms))
    }
}

/// `a - b`: how long after `b` `a` is (negative if before), to the millisecond.
impl std::ops::Sub for Timestamp {
    type Output = TimeDelta;
    fn sub(self, earlier: Timestamp) -> TimeDelta {
        TimeDelta::milliseconds(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&proteus_wire::time::format_millis(self.0))
    }
}

impl std::str::FromStr for Timestamp {
    type Err = InvalidValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Timestamp::parse(s)
    }
}

/// A price in US dollars per instance-hour: finite and never negative.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct UsdPerHour(f64);

impl UsdPerHour {
    pub const ZERO: UsdPerHour = UsdPerHour(0.0);

    pub fn new(value: f64) -> Result<Self, InvalidValue> {
        if !value.is_finite() {
            return Err(InvalidValue::NotANumber(value.to_string()));
        }
        if value < 0.0 {
            return Err(InvalidValue::NegativePrice(value));
        }
        Ok(UsdPerHour(value))
    }

    pub fn parse(text: &str) -> Result<Self, InvalidValue> {
        let value: f64 = text
            .trim()
            .parse()
            .map_err(|_| InvalidValue::NotANumber(text.to_string()))?;
        Self::new(value)
    }

    /// A price that was a `UsdPerHour` before it was stored as a bare number in a hot,
    /// columnar structure (a [`crate::prices::PriceSeries`]). Not for untrusted input.
    pub(crate) fn validated(value: f64) -> Self {
        debug_assert!(
            value.is_finite() && value >= 0.0,
            "a stored price is {value}"
        );
        UsdPerHour(value)
    }

    pub fn get(self) -> f64 {
        self.0
    }

    /// What `hours` at this rate cost: `rate × hours`. With [`UsdPerHour::for_secs`], the only
    /// place a rate turns into money.
    pub fn for_hours(self, hours: f64) -> Usd {
        Usd::computed(self.0 * hours)
    }

    /// What `secs` seconds at this rate cost: `rate × secs / 3600`, in that order — the order
    /// the ledger and the simulator have always computed it in, so their figures do not move
    /// by a rounding step (`rate × (secs / 3600)` can differ in the last digit).
    pub fn for_secs(self, secs: f64) -> Usd {
        Usd::computed(self.0 * secs / 3600.0)
    }
}

impl TryFrom<f64> for UsdPerHour {
    type Error = InvalidValue;
    fn try_from(v: f64) -> Result<Self, Self::Error> {
        UsdPerHour::new(v)
    }
}

impl From<UsdPerHour> for f64 {
    fn from(p: UsdPerHour) -> f64 {
        p.0
    }
}

impl fmt::Display for UsdPerHour {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "${:.4}/h", self.0)
    }
}

/// An amount of US dollars: a cost, a spend, a budget, or a difference between two of them
/// (so it may be negative: what is left of a budget). Always finite.
///
/// Serialised as a plain JSON number and stored as a `DOUBLE PRECISION`/`REAL` column, as the
/// bare `f64` it replaces was: only the Rust side gained a type. Untrusted numbers (a request,
/// a file, a database row) come in through [`Usd::new`]; arithmetic on amounts and
/// [`UsdPerHour::for_hours`]/[`UsdPerHour::for_secs`] produce the rest.
#[derive(Debug, Clone, Copy, Default, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(try_from = "f64", into = "f64")]
pub struct Usd(f64);

impl Usd {
    pub const ZERO: Usd = Usd(0.0);

    /// Checks an amount from outside the process: refuses NaN and infinities.
    pub fn new(value: f64) -> Result<Self, InvalidValue> {
        if value.is_finite() {
            Ok(Usd(value))
        } else {
            Err(InvalidValue::NotAnAmount(value.to_string()))
        }
    }

    /// An amount computed from amounts and rates already checked (a sum, a product with a
    /// finite factor). Not for untrusted input: use [`Usd::new`].
    pub fn computed(value: f64) -> Self {
        debug_assert!(value.is_finite(), "a computed amount is {value}");
        Usd(value)
    }

    pub fn get(self) -> f64 {
        self.0
    }
}

impl TryFrom<f64> for Usd {
    type Error = InvalidValue;
    fn try_from(v: f64) -> Result<Self, Self::Error> {
        Usd::new(v)
    }
}

impl From<Usd> for f64 {
    fn from(a: Usd) -> f64 {
        a.0
    }
}

impl std::ops::Add for Usd {
    type Output = Usd;
    fn add(self, o: Usd) -> Usd {
        Usd::computed(self.0 + o.0)
    }
}

impl std::ops::Sub for Usd {
    type Output = Usd;
    fn sub(self, o: Usd) -> Usd {
        Usd::computed(self.0 - o.0)
    }
}

impl std::ops::AddAssign for Usd {
    fn add_assign(&mut self, o: Usd) {
        *self = *self + o;
    }
}

impl std::ops::SubAssign for Usd {
    fn sub_assign(&mut self, o: Usd) {
        *self = *self - o;
    }
}

impl std::ops::Neg for Usd {
    type Output = Usd;
    fn neg(self) -> Usd {
        Usd(-self.0)
    }
}

/// Scaling: a share of an amount, an amount per unit.
impl std::ops::Mul<f64> for Usd {
    type Output = Usd;
    fn mul(self, k: f64) -> Usd {
        Usd::computed(self.0 * k)
    }
}

impl std::ops::Div<f64> for Usd {
    type Output = Usd;
    fn div(self, k: f64) -> Usd {
        Usd::computed(self.0 / k)
    }
}

/// A ratio of two amounts (a cost against a baseline's): a plain number.
impl std::ops::Div for Usd {
    type Output = f64;
    fn div(self, o: Usd) -> f64 {
        self.0 / o.0
    }
}

impl std::iter::Sum for Usd {
    fn sum<I: Iterator<Item = Usd>>(iter: I) -> Usd {
        // Folded from -0.0 like `f64`'s own `Sum`, so a sum of amounts is bit for bit the sum
        // of their values.
        Usd::computed(iter.map(|a| a.0).sum::<f64>())
    }
}

impl<'a> std::iter::Sum<&'a Usd> for Usd {
    fn sum<I: Iterator<Item = &'a Usd>>(iter: I) -> Usd {
        iter.copied().sum()
    }
}

/// `$12.3456`, or `$123.45` from a hundred dollars up: what every table and message prints.
impl fmt::Display for Usd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.abs() >= 100.0 {
            write!(f, "${:.2}", self.0)
        } else {
            write!(f, "${:.4}", self.0)
        }
    }
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $what:literal, $check:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn parse(text: &str) -> Result<Self, InvalidValue> {
                let text = text.trim();
                if text.is_empty() {
                    return Err(InvalidValue::Empty($what));
                }
                // No name has one, and Postgres cannot even store a NUL.
                if text.chars().any(char::is_control) {
                    return Err(InvalidValue::Malformed {
                        what: $what,
                        value: text.escape_debug().to_string(),
                        why: "contains a control character",
                    });
                }
                let check: fn(&str) -> Result<(), &'static str> = $check;
                check(text).map_err(|why| InvalidValue::Malformed {
                    what: $what,
                    value: text.to_string(),
                    why,
                })?;
                Ok($name(text.to_string()))
            }
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = InvalidValue;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                $name::parse(&s)
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = InvalidValue;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::parse(s)
            }
        }
    };
}

fn no_whitespace(s: &str) -> Result<(), &'static str> {
    if s.chars().any(char::is_whitespace) {
        Err("contains whitespace")
    } else {
        Ok(())
    }
}

name_type!(
    /// An AWS region such as `us-east-1`.
    Region,
    "region",
    no_whitespace
);

name_type!(
    /// An availability zone such as `us-east-1a`; its region is the name without the last letter.
    Zone,
    "availability zone",
    |s| {
        no_whitespace(s)?;
        if s.ends_with(|c: char| c.is_ascii_lowercase()) && s.len() > 1 {
            Ok(())
        } else {
            Err("expected a region followed by a zone letter, e.g. us-east-1a")
        }
    }
);

name_type!(
    /// An EC2 instance type such as `c3.xlarge`: a family and a size separated by a dot.
    InstanceType,
    "instance type",
    |s| {
        no_whitespace(s)?;
        match s.split_once('.') {
            Some((family, size)) if !family.is_empty() && !size.is_empty() => Ok(()),
            _ => Err("expected family.size, e.g. c3.xlarge"),
        }
    }
);

name_type!(
    /// The product description of a spot market, e.g. `Linux/UNIX`.
    Product,
    "product description",
    |_| Ok(())
);

impl Zone {
    pub fn region(&self) -> Region {
        Region(self.0[..self.0.len() - 1].to_string())
    }
}

impl InstanceType {
    pub fn family(&self) -> &str {
        self.0.split_once('.').map(|(f, _)| f).unwrap_or(&self.0)
    }
}

impl Product {
    pub fn linux() -> Self {
        Product("Linux/UNIX".to_string())
    }
}

/// One spot market: capacity of one instance type, in one zone, for one product.
/// Prices, evictions and bids are all per market.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Market {
    pub zone: Zone,
    pub instance_type: InstanceType,
    pub product: Product,
}

impl Market {
    pub fn new(zone: Zone, instance_type: InstanceType, product: Product) -> Self {
        Market {
            zone,
            instance_type,
            product,
        }
    }

    pub fn region(&self) -> Region {
        self.zone.region()
    }

    /// Parses the short form people write: `us-east-1a/c3.xlarge` (Linux/UNIX implied) or
    /// `us-east-1a/c3.xlarge/Linux/UNIX`.
    pub fn parse(text: &str) -> Result<Self, InvalidValue> {
        let mut parts = text.trim().splitn(3, '/');
        let zone = Zone::parse(parts.next().unwrap_or(""))?;
        let instance_type = InstanceType::parse(parts.next().unwrap_or(""))?;
        let product = match parts.next() {
            Some(p) => Product::parse(p)?,
            None => Product::linux(),
        };
        Ok(Market::new(zone, instance_type, product))
    }
}

impl fmt::Display for Market {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.zone, self.instance_type)?;
        if self.product != Product::linux() {
            write!(f, "/{}", self.product)?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Market {
    type Err = InvalidValue;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Market::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_move_by_durations_and_measure_between_them() {
        let t = Timestamp::from_secs(1_000);
        assert_eq!((t + Duration::from_millis(1_500)).millis(), 1_001_500);
        assert_eq!((t - Duration::from_secs(2)).millis(), 998_000);
        assert_eq!(t + Duration::from_secs(90) - t, TimeDelta::seconds(90));
        assert_eq!(t - (t + Duration::from_secs(1)), TimeDelta::seconds(-1));
        assert_eq!(
            Timestamp::MAX + Duration::from_secs(1),
            Timestamp::MAX,
            "saturates"
        );
        assert_eq!(
            Timestamp::MIN - Duration::from_secs(1),
            Timestamp::MIN,
            "saturates"
        );
        assert_eq!((t + Duration::from_secs(30)).secs_since(t), 30.0);
    }

    #[test]
    fn timestamps_parse_rfc3339_and_dates() {
        let t = Timestamp::parse("2015-03-11T10:34:42Z").unwrap();
        assert_eq!(t.millis(), 1_426_070_082_000);
        assert_eq!(t.to_string(), "2015-03-11T10:34:42Z");
        assert_eq!(
            Timestamp::parse("2015-03-11T11:34:42+01:00").unwrap(),
            t,
            "offsets are normalised to UTC"
        );
        assert_eq!(
            Timestamp::parse("2015-03-12").unwrap().millis(),
            1_426_118_400_000
        );
        assert!(Timestamp::parse("yesterday").is_err());
        assert!(Timestamp::parse("2015-02-29T00:00:00Z").is_err());
        assert!(Timestamp::parse("2015-13-01T00:00:00Z").is_err());
    }

    #[test]
    fn prices_refuse_negative_and_non_numbers() {
        assert_eq!(UsdPerHour::parse("0.1131").unwrap().get(), 0.1131);
        assert!(matches!(
            UsdPerHour::parse("-0.1"),
            Err(InvalidValue::NegativePrice(_))
        ));
        assert!(matches!(
            UsdPerHour::parse("abc"),
            Err(InvalidValue::NotANumber(_))
        ));
        assert!(UsdPerHour::parse("NaN").is_err());
        assert!(UsdPerHour::parse("inf").is_err());
    }

    #[test]
    fn amounts_are_finite_and_add_up() {
        assert_eq!(
            Usd::new(-2.5).unwrap().get(),
            -2.5,
            "differences may be negative"
        );
        assert!(matches!(
            Usd::new(f64::NAN),
            Err(InvalidValue::NotAnAmount(_))
        ));
        assert!(Usd::new(f64::INFINITY).is_err());
        assert!(Usd::new(f64::NEG_INFINITY).is_err());
        let (a, b) = (Usd::new(1.25).unwrap(), Usd::new(0.5).unwrap());
        assert_eq!((a + b).get(), 1.75);
        assert_eq!((a - b).get(), 0.75);
        assert_eq!((b - a).get(), -0.75);
        assert_eq!((-a).get(), -1.25);
        assert_eq!((a * 2.0).get(), 2.5);
        assert_eq!((a / 5.0).get(), 0.25);
        assert_eq!(b / a, 0.4);
        let mut c = Usd::ZERO;
        c += a;
        c -= b;
        assert_eq!(c, Usd::new(0.75).unwrap());
        assert!(b < a && Usd::ZERO < b && -a < Usd::ZERO);
        assert_eq!([a, b, b].iter().sum::<Usd>().get(), 2.25);
        assert_eq!(std::iter::empty::<Usd>().sum::<Usd>(), Usd::ZERO);
        // The same bits as summing the bare numbers, in order.
        let xs = [0.1, 0.2, 0.3, 1e-17];
        assert_eq!(
            xs.iter().map(|&x| Usd::new(x).unwrap()).sum::<Usd>().get(),
            xs.iter().sum::<f64>()
        );
    }

    #[test]
    fn rates_turn_into_amounts_over_time() {
        let p = UsdPerHour::new(0.21).unwrap();
        assert_eq!(p.for_hours(2.0).get(), 0.42);
        assert_eq!(p.for_secs(1800.0).get(), 0.21 * 1800.0 / 3600.0);
        assert_eq!(p.for_hours(0.0), Usd::ZERO);
    }

    #[test]
    fn amounts_print_like_the_tables_and_serialise_as_numbers() {
        assert_eq!(Usd::new(1.23456).unwrap().to_string(), "$1.2346");
        assert_eq!(Usd::new(215.04).unwrap().to_string(), "$215.04");
        assert_eq!(Usd::new(-0.5).unwrap().to_string(), "$-0.5000");
        let a = Usd::new(28.813399999999987).unwrap();
        let json = serde_json::to_string(&a).unwrap();
        assert_eq!(
            json, "28.813399999999987",
            "a bare number, every digit kept"
        );
        assert_eq!(serde_json::from_str::<Usd>(&json).unwrap(), a);
        assert_eq!(serde_json::from_str::<Usd>("-3").unwrap().get(), -3.0);
        // JSON has no NaN or infinity (serde_json refuses `1e400` itself), but TOML has both,
        // and any other format hands the number over as an f64.
        assert!(serde_json::from_str::<Usd>("1e400").is_err());
        #[derive(Debug, Deserialize)]
        struct Doc {
            amount: Usd,
        }
        for text in ["amount = inf", "amount = -inf", "amount = nan"] {
            let err = toml::from_str::<Doc>(text).unwrap_err().to_string();
            assert!(
                err.contains("not a finite number of dollars"),
                "{text}: {err}"
            );
        }
        assert_eq!(
            toml::from_str::<Doc>("amount = 2.5").unwrap().amount.get(),
            2.5
        );
        assert!(serde_json::from_str::<Usd>("\"1.0\"").is_err());
        assert!(serde_json::from_str::<Usd>("null").is_err());
    }

    #[test]
    fn names_are_validated() {
        assert_eq!(
            Zone::parse("us-east-1a").unwrap().region().as_str(),
            "us-east-1"
        );
        assert!(Zone::parse("").is_err());
        assert!(Zone::parse("us-east-1").is_err());
        assert!(InstanceType::parse("c3xlarge").is_err());
        assert!(InstanceType::parse("c3.x\u{0}large").is_err());
        assert!(Product::parse("Linux/UNIX\u{0}").is_err());
        assert_eq!(InstanceType::parse("c3.xlarge").unwrap().family(), "c3");
        let m = Market::parse("us-east-1b/r3.large").unwrap();
        assert_eq!(m.product, Product::linux());
        assert_eq!(m.to_string(), "us-east-1b/r3.large");
        let w = Market::parse("us-east-1b/r3.large/Windows").unwrap();
        assert_eq!(w.to_string(), "us-east-1b/r3.large/Windows");
    }
}
