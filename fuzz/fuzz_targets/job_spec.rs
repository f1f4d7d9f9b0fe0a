//! The job-spec parsers: the work model of `proteus simulate --job` (`job.rs`, parsed and
//! resolved against the built-in on-demand catalog) and the live API's job spec (parsed and
//! validated as `POST /v1/jobs` and `proteus submit` do). Even first bytes pick the first.
#![no_main]

use libfuzzer_sys::fuzz_target;
use proteus_broker::billing::BillingModel;
use proteus_broker::job::WorkModelSpec;
use proteus_broker::market::{Region, Timestamp};
use proteus_broker::service::spec::JobSpec;
use std::sync::OnceLock;

static CATALOG: OnceLock<proteus_broker::prices::OnDemandCatalog> = OnceLock::new();

fuzz_target!(|data: &[u8]| {
    let Some((&which, bytes)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(bytes) else {
        return;
    };
    let region = Region::parse("us-east-1").expect("region");
    if which % 2 == 0 {
        let catalog = CATALOG.get_or_init(|| {
            let offers = proteus_broker::prices::files::parse_on_demand_bytes(
                std::path::Path::new(proteus_broker::data::ON_DEMAND_2015_NAME),
                proteus_broker::data::ON_DEMAND_2015,
                &region,
            )
            .expect("built-in table");
            proteus_broker::prices::OnDemandCatalog::new(offers)
        });
        if let Ok(spec) = WorkModelSpec::parse("fuzz.toml", text) {
            if let Ok(model) = spec.resolve("fuzz.toml", catalog, &region) {
                let _ = (model.max_rate(), model.full_speed());
            }
        }
    } else if let Ok(spec) = JobSpec::parse_file("fuzz.toml", text) {
        let _ = spec.validate(BillingModel::PerSecond, Timestamp(1_426_000_000_000));
    }
});
