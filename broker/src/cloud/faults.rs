//! Launch failures on demand, for clouds that never fail on their own (LocalStack and the
//! simulator enforce no capacity or quotas): a wrapper that answers chosen launches with the
//! errors EC2 would give, so the cool-down path can be exercised end to end.

use super::{Cloud, CloudError, CloudEvent, CloudInstance, LaunchSpec};
use async_trait::async_trait;
use std::sync::{Arc, Mutex};

/// One rule: fail the next `remaining` launches whose market matches `pattern`
/// (`zone/type`, `*/type` or `zone/*`).
#[derive(Debug, Clone, PartialEq)]
pub struct FaultRule {
    pub pattern: String,
    pub error: String,
    pub remaining: u32,
}

impl FaultRule {
    /// Parses `PATTERN=ERROR[:COUNT]`, e.g. `us-east-1a/c3.xlarge=insufficient-capacity:2`.
    pub fn parse(text: &str) -> Result<FaultRule, String> {
        let (pattern, rest) = text
            .split_once('=')
            .ok_or_else(|| format!("fault rule `{text}`: expected MARKET=ERROR[:COUNT]"))?;
        let (error, count) = match rest.split_once(':') {
            Some((e, c)) => (
                e,
                c.parse::<u32>()
                    .map_err(|_| format!("fault rule `{text}`: bad count `{c}`"))?,
            ),
            None => (rest, u32::MAX),
        };
        if ![
            "insufficient-capacity",
            "spot-quota-exceeded",
            "price-too-low",
        ]
        .contains(&error)
        {
            return Err(format!(
                "fault rule `{text}`: unknown error `{error}` (insufficient-capacity, spot-quota-exceeded, price-too-low)"
            ));
        }
        Ok(FaultRule {
            pattern: pattern.to_string(),
            error: error.to_string(),
            remaining: count,
        })
    }

    fn matches(&self, market: &str) -> bool {
        let (pz, pt) = self.pattern.split_once('/').unwrap_or((&self.pattern, "*"));
        let (mz, mt) = market.split_once('/').unwrap_or((market, ""));
        (pz == "*" || pz == mz) && (pt == "*" || pt == mt)
    }

    fn to_error(&self, market: String) -> CloudError {
        let message = "injected by PROTEUS_INJECT_LAUNCH_FAULTS".to_string();
        match self.error.as_str() {
            "insufficient-capacity" => CloudError::InsufficientCapacity { market, message },
            "spot-quota-exceeded" => CloudError::SpotQuotaExceeded { message },
            _ => CloudError::PriceTooLow { market, message },
        }
    }
}

/// A cloud whose launches fail according to rules.
#[derive(Debug)]
pub struct FaultyCloud {
    inner: Arc<dyn Cloud>,
    rules: Mutex<Vec<FaultRule>>,
}

impl FaultyCloud {
    pub fn new(inner: Arc<dyn Cloud>, rules: Vec<FaultRule>) -> Self {
        FaultyCloud {
            inner,
            rules: Mutex::new(rules),
        }
    }

    /// Rules from a comma-separated list, as in `PROTEUS_INJECT_LAUNCH_FAULTS`.
    pub fn parse_rules(text: &str) -> Result<Vec<FaultRule>, String> {
        text.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(FaultRule::parse)
            .collect()
    }
}

#[async_trait]
impl Cloud for FaultyCloud {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    async fn launch(&self, spec: &LaunchSpec) -> Result<CloudInstance, CloudError> {
        let market = spec.market.to_string();
        let injected = {
            let mut rules = self.rules.lock().unwrap_or_else(|e| e.into_inner());
            rules
                .iter_mut()
                .find(|r| r.remaining > 0 && r.matches(&market))
                .map(|r| {
                    r.remaining -= 1;
                    r.to_error(market.clone())
                })
        };
        match injected {
            Some(e) => Err(e),
            None => self.inner.launch(spec).await,
        }
    }

    async fn terminate(&self, cloud_ids: &[String]) -> Result<(), CloudError> {
        self.inner.terminate(cloud_ids).await
    }

    async fn describe(&self) -> Result<Vec<CloudInstance>, CloudError> {
        self.inner.describe().await
    }

    async fn events(&self) -> Result<Vec<CloudEvent>, CloudError> {
        self.inner.events().await
    }

    async fn send_interruption(&self, cloud_id: &str) -> Result<(), CloudError> {
        self.inner.send_interruption(cloud_id).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_parse_and_match() {
        let r = FaultRule::parse("*/c3.xlarge=insufficient-capacity:2").unwrap();
        assert!(r.matches("us-east-1a/c3.xlarge"));
        assert!(!r.matches("us-east-1a/r3.large"));
        assert_eq!(r.remaining, 2);
        assert!(FaultRule::parse("x=boom").is_err());
        assert!(FaultRule::parse("nothing").is_err());
        assert_eq!(
            FaultyCloud::parse_rules(" a/b=price-too-low , ")
                .unwrap()
                .len(),
            1
        );
    }
}
