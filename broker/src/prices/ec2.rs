//! Live price history from EC2's DescribeSpotPriceHistory.
//!
//! The SDK's default credential chain and `AWS_ENDPOINT_URL` decide where the calls go, so the
//! same code reads a real account or LocalStack.

use crate::market::{InstanceType, Market, Product, Region, Timestamp, UsdPerHour, Zone};
use crate::prices::files::SpotPriceRow;
use aws_sdk_ec2::types::InstanceType as SdkInstanceType;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum Ec2PriceError {
    #[error("DescribeSpotPriceHistory in {region} failed on page {page}: {message}")]
    Call {
        region: String,
        page: usize,
        message: String,
    },
    #[error(
        "DescribeSpotPriceHistory in {region}, page {page}, item {item}: field `{field}`: {problem}"
    )]
    Item {
        region: String,
        page: usize,
        item: usize,
        field: &'static str,
        problem: String,
    },
}

/// What to fetch.
#[derive(Debug, Clone)]
pub struct FetchRequest {
    pub region: Region,
    pub instance_types: Vec<InstanceType>,
    pub product: Product,
    pub since: Timestamp,
    /// Items per page (`MaxResults`): EC2 accepts 5 to 1000.
    pub page_size: PageSize,
}

/// A `DescribeSpotPriceHistory` page size, within what EC2 accepts (5 to 1000 items).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageSize(i32);

impl PageSize {
    pub const MAX: PageSize = PageSize(1000);

    pub fn new(items: u32) -> Result<PageSize, String> {
        if (5..=1000).contains(&items) {
            Ok(PageSize(items as i32))
        } else {
            Err(format!(
                "{items} items per page: EC2 returns 5 to 1000 price changes per page"
            ))
        }
    }

    pub fn get(self) -> i32 {
        self.0
    }
}

impl Default for PageSize {
    fn default() -> Self {
        PageSize::MAX
    }
}

/// The rows fetched and how many pages it took.
#[derive(Debug, Clone)]
pub struct Fetched {
    pub rows: Vec<SpotPriceRow>,
    pub pages: usize,
}

/// Builds an EC2 client for a region from the default chain (env, profile, IMDS role) and
/// `AWS_ENDPOINT_URL` when set.
pub async fn client(region: &Region) -> aws_sdk_ec2::Client {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .region(aws_config::Region::new(region.as_str().to_string()))
        .load()
        .await;
    aws_sdk_ec2::Client::new(&config)
}

/// Fetches every page of price history since `since` for the requested types.
pub async fn fetch(
    client: &aws_sdk_ec2::Client,
    req: &FetchRequest,
) -> Result<Fetched, Ec2PriceError> {
    let types: Vec<SdkInstanceType> = req
        .instance_types
        .iter()
        .map(|t| SdkInstanceType::from(t.as_str()))
        .collect();
    let start = aws_sdk_ec2::primitives::DateTime::from_millis(req.since.millis());
    let mut pages = client
        .describe_spot_price_history()
        .set_instance_types((!types.is_empty()).then_some(types))
        .product_descriptions(req.product.as_str())
        .start_time(start)
        .into_paginator()
        .page_size(req.page_size.get())
        .send();
    let region = req.region.as_str().to_string();
    let mut rows = Vec::new();
    let mut page_no = 0;
    while let Some(page) = pages.next().await {
        page_no += 1;
        let page = page.map_err(|e| Ec2PriceError::Call {
            region: region.clone(),
            page: page_no,
            message: aws_sdk_ec2::error::DisplayErrorContext(&e).to_string(),
        })?;
        for (i, item) in page.spot_price_history().iter().enumerate() {
            rows.push(
                convert(item).map_err(|(field, problem)| Ec2PriceError::Item {
                    region: region.clone(),
                    page: page_no,
                    item: i + 1,
                    field,
                    problem,
                })?,
            );
        }
    }
    Ok(Fetched {
        rows,
        pages: page_no,
    })
}

fn convert(item: &aws_sdk_ec2::types::SpotPrice) -> Result<SpotPriceRow, (&'static str, String)> {
    let zone = Zone::parse(item.availability_zone().unwrap_or(""))
        .map_err(|e| ("AvailabilityZone", e.to_string()))?;
    let itype = InstanceType::parse(item.instance_type().map(|t| t.as_str()).unwrap_or(""))
        .map_err(|e| ("InstanceType", e.to_string()))?;
    let product = Product::parse(item.product_description().map(|p| p.as_str()).unwrap_or(""))
        .map_err(|e| ("ProductDescription", e.to_string()))?;
    let price = UsdPerHour::parse(item.spot_price().unwrap_or(""))
        .map_err(|e| ("SpotPrice", e.to_string()))?;
    let ts = item
        .timestamp()
        .ok_or(("Timestamp", "missing".to_string()))?;
    let millis = ts.to_millis().map_err(|e| ("Timestamp", e.to_string()))?;
    Ok(SpotPriceRow {
        market: Market::new(zone, itype, product),
        time: Timestamp::from_millis(millis),
        price,
    })
}
