//! Fresh databases for each test, on both backends.

use proteus_broker::store::Store;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// The admin URL of the test Postgres cluster. Tests fail (not skip) without it: a green run
/// must mean the Postgres paths were exercised.
pub fn pg_admin_url() -> String {
    std::env::var("PROTEUS_TEST_PG_URL").expect(
        "PROTEUS_TEST_PG_URL is not set: run the suite through scripts/test, which starts Postgres",
    )
}

#[cfg_attr(not(feature = "ec2"), allow(dead_code))]
pub fn localstack_url() -> String {
    std::env::var("PROTEUS_TEST_LOCALSTACK_URL")
        .expect("PROTEUS_TEST_LOCALSTACK_URL is not set: run the suite through scripts/test, which starts LocalStack")
}

fn unique_name(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        nanos
    )
}

/// A database that exists only for one test.
pub struct TestDb {
    pub url: String,
    pub store: Store,
    _dir: Option<tempfile::TempDir>,
}

/// Logs of the code under test, shown with a failing test's output.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "warn,proteus_broker=info",
        ))
        .with_test_writer()
        .try_init();
}

impl TestDb {
    pub async fn postgres() -> TestDb {
        init_logs();
        let admin = pg_admin_url();
        let name = unique_name("proteus_test");
        let admin_store = Store::connect(&admin)
            .await
            .expect("connect to the test Postgres");
        admin_store
            .execute_admin(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create test database");
        admin_store.close().await;
        let (base, _) = admin
            .rsplit_once('/')
            .expect("admin URL has a database path");
        let url = format!("{base}/{name}");
        let store = Store::open(&url)
            .await
            .expect("open fresh Postgres database");
        TestDb {
            url,
            store,
            _dir: None,
        }
    }

    pub async fn sqlite() -> TestDb {
        init_logs();
        let dir = tempfile::tempdir().expect("temp dir");
        let url = format!("sqlite://{}", dir.path().join("test.db").display());
        let store = Store::open(&url).await.expect("open fresh SQLite database");
        TestDb {
            url,
            store,
            _dir: Some(dir),
        }
    }
}

/// Generates one `#[tokio::test]` per backend from an `async fn(TestDb)`.
#[macro_export]
macro_rules! on_both_backends {
    ($($check:ident),* $(,)?) => {
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    super::$check($crate::support::TestDb::postgres().await).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $check() {
                    super::$check($crate::support::TestDb::sqlite().await).await;
                }
            )*
        }
    };
}

/// The repository's data directory.
pub fn data(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../data")
        .join(path)
}

pub const TRACE_2015: &str = "spot/aws-us-east-1-2015-03-to-06.csv.gz";
pub const ON_DEMAND_2015: &str = "spot/on-demand-us-east-1-2015.csv";
