//! `prices ingest --from-ec2` through aws-sdk-ec2 against LocalStack. LocalStack's prices are
//! placeholders, so this checks paging, parsing and storage, not values.

use crate::support::{TestDb, localstack_url};
use proteus_broker::market::{InstanceType, Product, Region, Timestamp};
use proteus_broker::prices::ec2;
use std::process::Command;

fn with_localstack(cmd: &mut Command) -> &mut Command {
    cmd.env("AWS_ENDPOINT_URL", localstack_url())
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
