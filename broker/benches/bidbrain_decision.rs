//! One BidBrain decision over the 15 markets of the 2015 trace and its whole bid-delta grid, with
//! a footprint of 40 running instances: what the live scheduler pays per control tick.
//! Run with `bench/bidbrain-decision` (target: under 1 ms median).

use criterion::{Criterion, criterion_group, criterion_main};
use proteus_broker::billing::BillingModel;
use proteus_broker::engine::view::{FutureReads, TraceMarkets, TraceView};
use proteus_broker::job::WorkModelSpec;
use proteus_broker::market::{Region, Timestamp, UsdPerHour};
use proteus_broker::market_model::{PriceDrivenModel, PriceModelConfig};
use proteus_broker::policy::{
    DecisionContext, InstanceId, InstanceState, InstanceView, JobProgress, MarketView, Purchase,
    load_policy_file, resolve_policy_path,
};
use proteus_broker::sim::inputs::load_history;
use std::hint::black_box;
use std::path::PathBuf;
use std::sync::Arc;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
}

fn decision(c: &mut Criterion) {
    let region = Region::parse("us-east-1").expect("region");
    let history = Arc::new(
        load_history(
            &repo("data/spot/aws-us-east-1-2015-03-to-06.csv.gz"),
            &repo("data/spot/on-demand-us-east-1-2015.csv"),
            &region,
        )
        .expect("the 2015 trace"),
    );
    let job_file = repo("examples/jobs/reference-2015.toml");
    let job = WorkModelSpec::load(&job_file)
        .expect("job file")
        .resolve("reference-2015.toml", history.on_demand(), &region)
        .expect("job");
    let model = PriceDrivenModel::new(history.clone(), PriceModelConfig::default());
    model.warm_up();
    let markets = TraceMarkets::new(history.clone());
    let now = Timestamp::parse("2015-05-12T14:23:00Z").expect("time");
    let view = TraceView::new(now, &markets, &model, FutureReads::Panic);
    assert_eq!(
        view.markets().len(),
        15,
        "all 15 markets have prices by then"
    );

    // 40 running spot instances over four markets, launched at different times, plus a backup.
    let mut footprint = Vec::new();
    let spot_markets: Vec<_> = view
        .markets()
        .into_iter()
        .filter(|m| ["c3.xlarge", "g2.2xlarge"].contains(&m.instance_type.as_str()))
        .cloned()
        .collect();
    for (k, market) in spot_markets.iter().cycle().take(40).enumerate() {
        let price = view.spot_price(market).map_or(0.05, UsdPerHour::get);
        footprint.push(InstanceView {
            id: InstanceId(format!("i-{k}")),
            market: market.clone(),
            purchase: Purchase::Spot {
                bid: UsdPerHour::new(price * 1.05).expect("bid"),
            },
            launched_at: Timestamp::from_millis(now.millis() - (k as i64 % 7 + 1) * 11 * 60_000),
            state: InstanceState::Running,
        });
    }
    footprint.push(InstanceView {
        id: InstanceId("i-backup".into()),
        market: spot_markets[0].clone(),
        purchase: Purchase::OnDemand,
        launched_at: Timestamp::from_millis(now.millis() - 3 * 3_600_000),
        state: InstanceState::Running,
    });
    let ctx = DecisionContext {
        market: &view,
        job: &job,
        progress: JobProgress {
            done_work: 300.0,
            total_work: job.total_work,
            started_at: Timestamp::from_millis(now.millis() - 5 * 3_600_000),
            deadline: None,
        },
        footprint: &footprint,
        billing: BillingModel::Hourly2015,
    };
    let mut policy =
        load_policy_file(&resolve_policy_path("bidbrain").expect("policy")).expect("policy");
    c.bench_function(
        "bidbrain decision, 15 markets x delta grid, 41 instances",
        |b| b.iter(|| black_box(policy.decide(black_box(&ctx)).expect("decision"))),
    );
}

criterion_group!(benches, decision);
criterion_main!(benches);
