//! `prices ingest --from-ec2` through aws-sdk-ec2 against LocalStack. LocalStack's prices are
//! placeholders and it answers every request with one page, so this checks parsing and storage
//! there, and paging, `--since` and resuming against [`PagingEc2`], which pages like EC2 and
//! records what it was asked.

use crate::support::{TestDb, localstack_url};
use proteus_broker::market::{InstanceType, Product, Region, Timestamp};
use proteus_broker::prices::ec2;
use std::collections::HashMap;
use std::process::Command;
use std::sync::{Arc, Mutex};

fn with_localstack(cmd: &mut Command) -> &mut Command {
    with_endpoint(cmd, &localstack_url())
}

fn with_endpoint<'a>(cmd: &'a mut Command, url: &str) -> &'a mut Command {
    cmd.env("AWS_ENDPOINT_URL", url)
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env("AWS_REGION", "us-east-1")
        .env_remove("AWS_PROFILE")
}

#[tokio::test]
async fn every_page_is_fetched_and_parsed() {
    // SAFETY: set before any thread of this test reads the environment through the SDK.
    unsafe {
        std::env::set_var("AWS_ENDPOINT_URL", localstack_url());
        std::env::set_var("AWS_ACCESS_KEY_ID", "test");
        std::env::set_var("AWS_SECRET_ACCESS_KEY", "test");
    }
    let region = Region::parse("us-east-1").unwrap();
    let client = ec2::client(&region).await;
    let request = ec2::FetchRequest {
        region: region.clone(),
        instance_types: vec![
            InstanceType::parse("m5.large").unwrap(),
            InstanceType::parse("c5.large").unwrap(),
        ],
        product: Product::linux(),
        since: Timestamp::parse("2000-01-01").unwrap(),
        page_size: ec2::PageSize::default(),
    };
    let fetched = ec2::fetch(&client, &request)
        .await
        .expect("DescribeSpotPriceHistory against LocalStack");
    assert!(fetched.pages >= 1);
    assert!(
        !fetched.rows.is_empty(),
        "LocalStack returns placeholder rows"
    );
    for row in &fetched.rows {
        assert!(
            ["m5.large", "c5.large"].contains(&row.market.instance_type.as_str()),
            "{row:?}"
        );
        assert_eq!(row.market.region(), region);
    }
}

#[tokio::test]
async fn the_cli_stores_ec2_history_and_resumes() {
    let db = TestDb::postgres().await;
    let run = || {
        let out = with_localstack(&mut Command::new(env!("CARGO_BIN_EXE_proteus")))
            .args([
                "prices",
                "ingest",
                "--from-ec2",
                "--region",
                "us-east-1",
                "--instance-types",
                "m5.large",
                "--output",
                "json",
            ])
            .env("PROTEUS_DATABASE_URL", &db.url)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0].clone()
    };
    let first = run();
    let inserted = first["inserted"].as_u64().unwrap();
    assert!(inserted > 0, "{first}");
    assert_eq!(db.store.price_row_count().await.unwrap() as u64, inserted);
    let second = run();
    assert_eq!(
        second["inserted"], 0,
        "a second fetch stores nothing new: {second}"
    );
    assert!(
        second["source"].as_str().unwrap().contains("since"),
        "{second}"
    );
}

/// EC2's `DescribeSpotPriceHistory` as far as `prices ingest --from-ec2` uses it, with the
/// paging LocalStack lacks: `MaxResults`, `NextToken`, `StartTime`, `InstanceType.N` honoured,
/// newest change first, in EC2's XML. Every request's parameters are recorded.
struct PagingEc2 {
    url: String,
    state: Arc<Mutex<Ec2State>>,
    task: tokio::task::JoinHandle<()>,
}

#[derive(Default)]
struct Ec2State {
    /// (zone, type, price, RFC 3339 time)
    rows: Vec<(String, String, f64, String)>,
    requests: Vec<HashMap<String, String>>,
}

impl Drop for PagingEc2 {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn ms(t: &str) -> i64 {
    chrono::DateTime::parse_from_rfc3339(t)
        .unwrap_or_else(|e| panic!("{t}: {e}"))
        .timestamp_millis()
}

impl PagingEc2 {
    async fn start() -> PagingEc2 {
        use axum::extract::{Form, State};
        use axum::routing::post;
        let state = Arc::new(Mutex::new(Ec2State::default()));
        async fn describe(
            State(state): State<Arc<Mutex<Ec2State>>>,
            Form(params): Form<HashMap<String, String>>,
        ) -> ([(axum::http::HeaderName, &'static str); 1], String) {
            let mut st = state.lock().unwrap();
            st.requests.push(params.clone());
            assert_eq!(params["Action"], "DescribeSpotPriceHistory");
            let types: Vec<&String> = params
                .iter()
                .filter(|(k, _)| k.starts_with("InstanceType."))
                .map(|(_, v)| v)
                .collect();
            let start = params.get("StartTime").map_or(i64::MIN, |t| ms(t));
            let max: usize = params
                .get("MaxResults")
                .map_or(1000, |m| m.parse().unwrap());
            let offset: usize = params
                .get("NextToken")
                .map_or(0, |t| t.trim_start_matches("page-at-").parse().unwrap());
            let mut matching: Vec<_> = st
                .rows
                .iter()
                .filter(|r| (types.is_empty() || types.contains(&&r.1)) && ms(&r.3) >= start)
                .collect();
            matching.sort_by_key(|r| std::cmp::Reverse(ms(&r.3)));
            let end = (offset + max).min(matching.len());
            let items: String = matching[offset.min(end)..end]
                .iter()
                .map(|(zone, ty, price, t)| {
                    format!(
                        "<item><availabilityZone>{zone}</availabilityZone><instanceType>{ty}</instanceType>\
                         <productDescription>Linux/UNIX</productDescription><spotPrice>{price:.4}</spotPrice>\
                         <timestamp>{t}</timestamp></item>"
                    )
                })
                .collect();
            let next = if end < matching.len() {
                format!("<nextToken>page-at-{end}</nextToken>")
            } else {
                String::new()
            };
            (
                [(axum::http::header::CONTENT_TYPE, "text/xml;charset=UTF-8")],
                format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DescribeSpotPriceHistoryResponse \
                     xmlns=\"http://ec2.amazonaws.com/doc/2016-11-15/\"><requestId>r-{}</requestId>\
                     <spotPriceHistorySet>{items}</spotPriceHistorySet>{next}</DescribeSpotPriceHistoryResponse>",
                    st.requests.len()
                ),
            )
        }
        let app = axum::Router::new()
            .route("/", post(describe))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        PagingEc2 { url, state, task }
    }

    /// Hourly m5.large (and c5.large) changes in two zones, for hours `hours` of 2026-11-20.
    fn add_hours(&self, hours: std::ops::Range<u32>) {
        let mut st = self.state.lock().unwrap();
        for h in hours {
            for (zone, ty, base) in [
                ("us-east-1a", "m5.large", 0.030),
                ("us-east-1b", "m5.large", 0.033),
                ("us-east-1a", "c5.large", 0.028),
            ] {
                let t = format!("2026-11-20T{h:02}:00:00.000Z");
                st.rows
                    .push((zone.into(), ty.into(), base + f64::from(h) * 0.0001, t));
            }
        }
    }

    fn take_requests(&self) -> Vec<HashMap<String, String>> {
        std::mem::take(&mut self.state.lock().unwrap().requests)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_since_and_resume_are_what_is_asked_of_ec2() {
    let db = TestDb::postgres().await;
    let ec2 = PagingEc2::start().await;
    ec2.add_hours(0..12);
    let url = ec2.url.clone();
    let run = move |extra: &[&str]| {
        let mut args = vec![
            "prices",
            "ingest",
            "--from-ec2",
            "--region",
            "us-east-1",
            "--instance-types",
            "m5.large",
            "--page-size",
            "5",
            "--output",
            "json",
        ];
        args.extend_from_slice(extra);
        let out = with_endpoint(&mut Command::new(env!("CARGO_BIN_EXE_proteus")), &url)
            .args(&args)
            .env("PROTEUS_DATABASE_URL", &db.url)
            .env("PROTEUS_LOG", "warn")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v[0].clone()
    };

    // --since: 24 m5.large changes from 00:00, five to a page.
    let first = tokio::task::spawn_blocking({
        let run = run.clone();
        move || run(&["--since", "2026-11-20T00:00:00Z"])
    })
    .await
    .unwrap();
    let asked = ec2.take_requests();
    assert_eq!(asked.len(), 5, "24 changes at 5 a page: {asked:?}");
    for (i, r) in asked.iter().enumerate() {
        assert_eq!(r["MaxResults"], "5", "{r:?}");
        assert_eq!(ms(&r["StartTime"]), ms("2026-11-20T00:00:00Z"), "{r:?}");
        assert_eq!(r["InstanceType.1"], "m5.large", "{r:?}");
        let token = (i > 0).then(|| format!("page-at-{}", 5 * i));
        assert_eq!(r.get("NextToken"), token.as_ref(), "page {}: {r:?}", i + 1);
    }
    assert_eq!(first["inserted"], 24, "{first}");
    assert!(
        first["source"].as_str().unwrap().contains("(5 pages)"),
        "{first}"
    );

    // Resuming: from the newest stored change (11:00), so three new hours cost 8 changes (the
    // two at 11:00 are already present), not a refetch of everything.
    ec2.add_hours(12..15);
    let second = tokio::task::spawn_blocking(move || run(&[])).await.unwrap();
    let asked = ec2.take_requests();
    assert!(!asked.is_empty());
    assert!(
        asked
            .iter()
            .all(|r| ms(&r["StartTime"]) == ms("2026-11-20T11:00:00Z")),
        "resumed from the newest stored change: {asked:?}"
    );
    assert_eq!(asked.len(), 2, "8 changes at 5 a page: {asked:?}");
    assert_eq!(
        (
            second["inserted"].as_u64(),
            second["already_present"].as_u64()
        ),
        (Some(6), Some(2)),
        "{second}"
    );
    assert_eq!(db.store.price_row_count().await.unwrap(), 30);
}
