//! Durable storage for command jobs: each rank's newest checkpoint archive, and the tail of
//! each instance's program output.
//!
//! Agents never hold cloud credentials or an AWS SDK: for each transfer the broker hands them
//! a URL ([`CheckpointTransfer`]) — a presigned S3 URL (SigV4 in the query, signed here with
//! `aws-sigv4` and the broker's own credentials), or the broker's directory store, served by
//! the agent API behind the instance's token. One archive per `(job, rank)`, replaced whole on
//! every upload (an S3 `PUT` and the directory store's rename are both atomic), so "the newest
//! checkpoint of a rank" is simply its key.

use proteus_wire::JobId;
use proteus_wire::agent_api::{CheckpointOp, CheckpointTransfer};
use std::path::{Path, PathBuf};
use thiserror::Error;

/// How long a presigned URL stays valid: long enough for a large upload on a slow link.
pub const PRESIGN_SECS: u64 = 3600;

#[derive(Debug, Error)]
pub enum CheckpointError {
    #[error("checkpoint store `{0}`: {1}")]
    Config(String, String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the checkpoint archive is larger than the per-upload limit of {} \
         (`proteus serve --checkpoint-max-archive`)",
        human(.0)
    )]
    TooLarge(u64),
    #[error(
        "job {job}'s checkpoints would take more than its quota of {} on the broker's disk \
         ({} already kept or being uploaded; `proteus serve --checkpoint-job-quota`): keep \
         fewer or smaller checkpoints, or use an s3:// checkpoint store",
        human(.quota),
        human(.used)
    )]
    QuotaExceeded { job: JobId, quota: u64, used: u64 },
    #[error("S3: {0}")]
    S3(String),
}

/// Where checkpoints live.
#[derive(Debug)]
pub enum CheckpointStore {
    /// A directory on the broker's machine, served to agents by the broker itself.
    Dir(DirStore),
    /// An S3 bucket (or LocalStack's), reached by agents through presigned URLs.
    #[cfg(feature = "ec2")]
    S3(s3::S3Store),
}

impl CheckpointStore {
    /// `s3://bucket/prefix` or a directory path (with its `limits`).
    pub async fn open(spec: &str, limits: DirLimits) -> Result<CheckpointStore, CheckpointError> {
        if spec.starts_with("s3://") {
            #[cfg(feature = "ec2")]
            {
                return Ok(CheckpointStore::S3(s3::S3Store::open(spec).await?));
            }
            #[cfg(not(feature = "ec2"))]
            {
                return Err(CheckpointError::Config(
                    spec.into(),
                    "this broker was built without the `ec2` feature, which S3 needs".into(),
                ));
            }
        }
        Ok(CheckpointStore::Dir(DirStore::with_limits(
            PathBuf::from(spec),
            limits,
        )?))
    }

    /// Where an agent of `job` puts or fetches `rank`'s archive. For the directory store the
    /// URL is a path on the broker (`/v1/agents/{instance}/checkpoint-data/{rank}`), which the
    /// agent joins to the broker URL it already uses.
    pub async fn transfer(
        &self,
        instance: &proteus_wire::InstanceId,
        job: JobId,
        rank: u32,
        op: CheckpointOp,
    ) -> Result<CheckpointTransfer, CheckpointError> {
        match self {
            CheckpointStore::Dir(_) => {
                let _ = (job, op);
                Ok(CheckpointTransfer {
                    url: proteus_wire::agent_api::paths::checkpoint_data(instance, rank),
                    bearer: true,
                    expires_in_secs: 0,
                })
            }
            #[cfg(feature = "ec2")]
            CheckpointStore::S3(s) => {
                let method = match op {
                    CheckpointOp::Upload => "PUT",
                    CheckpointOp::Download => "GET",
                };
                let url = s
                    .presign(
                        method,
                        &key(job, rank),
                        PRESIGN_SECS,
                        std::time::SystemTime::now(),
                    )
                    .await?;
                Ok(CheckpointTransfer {
                    url,
                    bearer: false,
                    expires_in_secs: PRESIGN_SECS,
                })
            }
        }
    }

    /// Where an agent fetches a command job's `s3://bucket/key` working directory: a presigned
    /// `GET`, signed with the same credentials as the checkpoints. Only an S3 store has them.
    pub async fn workdir_transfer(&self, url: &str) -> Result<CheckpointTransfer, CheckpointError> {
        let (bucket, key) =
            parse_s3_url(url).map_err(|e| CheckpointError::Config(url.into(), e))?;
        match self {
            CheckpointStore::Dir(_) => {
                let _ = (bucket, key);
                Err(CheckpointError::Config(
                    url.into(),
                    "an s3:// working directory needs a broker started with \
                     `--checkpoint-store s3://…`, whose credentials sign the download"
                        .into(),
                ))
            }
            #[cfg(feature = "ec2")]
            CheckpointStore::S3(s) => Ok(CheckpointTransfer {
                url: s
                    .presign_get_in(bucket, key, PRESIGN_SECS, std::time::SystemTime::now())
                    .await?,
                bearer: false,
                expires_in_secs: PRESIGN_SECS,
            }),
        }
    }

    /// Whether this store can sign S3 downloads (see [`CheckpointStore::workdir_transfer`]).
    pub fn is_s3(&self) -> bool {
        !matches!(self, CheckpointStore::Dir(_))
    }

    /// The directory store, when that is what this is (the agent API serves its files).
    pub fn dir(&self) -> Option<&DirStore> {
        match self {
            CheckpointStore::Dir(d) => Some(d),
            #[cfg(feature = "ec2")]
            CheckpointStore::S3(_) => None,
        }
    }

    /// For logs: `dir:/path` or `s3://bucket/prefix`.
    pub fn describe(&self) -> String {
        match self {
            CheckpointStore::Dir(d) => format!("directory {}", d.root.display()),
            #[cfg(feature = "ec2")]
            CheckpointStore::S3(s) => s.describe(),
        }
    }
}

/// `s3://bucket/key` split into bucket and key (`key` may be empty: a bucket or a prefix).
/// The error says what is wrong, for a message naming the field it came from.
pub fn parse_s3_url(url: &str) -> Result<(&str, &str), String> {
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| format!("`{url}` is not an s3:// URL"))?;
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    let valid = (3..=63).contains(&bucket.len())
        && bucket
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if !valid {
        return Err(format!(
            "`{bucket}` is not an S3 bucket name (3–63 of a-z, 0-9, `-`, `.`)"
        ));
    }
    Ok((bucket, key))
}

/// The object key (or relative file) of a rank's newest checkpoint.
pub fn key(job: JobId, rank: u32) -> String {
    format!("job-{}/rank-{rank}.tar.gz", job.0)
}

/// Checkpoints as files under a directory.
#[derive(Debug)]
pub struct DirStore {
    root: PathBuf,
    limits: DirLimits,
    /// What each job's checkpoints take, loaded from the directory on a job's first upload
    /// since the broker started, then kept up to date by every upload.
    usage: std::sync::Mutex<std::collections::HashMap<JobId, JobUsage>>,
}

/// Creates `dir` readable by the broker's user only: every job's checkpoints and outputs are
/// there, and jobs' programs (possibly run as other users on this machine) must not read them.
fn private_dir(dir: &Path) -> Result<(), CheckpointError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|source| CheckpointError::Io {
            path: dir.to_path_buf(),
            source,
        })
}

/// How much the directory store accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirLimits {
    /// Largest archive one upload may be (the 413 limit).
    pub max_archive_bytes: u64,
    /// Most bytes one job's checkpoints may take: the newest archive of each of its ranks,
    /// an upload in progress counted in place of the archive it replaces (the 507 limit).
    pub job_quota_bytes: u64,
}

impl Default for DirLimits {
    /// The defaults of `proteus serve`.
    fn default() -> Self {
        DirLimits {
            max_archive_bytes: MAX_ARCHIVE_BYTES,
            job_quota_bytes: 64 << 30,
        }
    }
}

/// Largest archive the directory store accepts by default.
pub const MAX_ARCHIVE_BYTES: u64 = 8 << 30;

/// One job's checkpoints on disk.
#[derive(Debug, Default)]
struct JobUsage {
    ranks: std::collections::HashMap<u32, RankUsage>,
    /// The sum of [`RankUsage::counted`] over the ranks.
    total: u64,
}

#[derive(Debug, Default)]
struct RankUsage {
    /// The rank's newest archive.
    stored: u64,
    /// Bytes received so far by the rank's uploads in progress.
    uploading: u64,
}

impl RankUsage {
    /// What the rank counts against the quota: its archive, or the upload that replaces it
    /// when that is larger.
    fn counted(&self) -> u64 {
        self.stored.max(self.uploading)
    }
}

impl JobUsage {
    /// Applies `change` to `rank` and keeps the total; refuses (changing nothing) when the
    /// total would go over `quota`.
    fn update(
        &mut self,
        rank: u32,
        quota: Option<u64>,
        change: impl FnOnce(&mut RankUsage),
    ) -> Result<(), u64> {
        let entry = self.ranks.entry(rank).or_default();
        let before = entry.counted();
        let mut after = RankUsage {
            stored: entry.stored,
            uploading: entry.uploading,
        };
        change(&mut after);
        let total = self.total - before + after.counted();
        if let Some(quota) = quota
            && total > quota
            && total > self.total
        {
            return Err(self.total);
        }
        *entry = after;
        self.total = total;
        Ok(())
    }
}

/// An upload under way: its bytes count against the job's quota until it ends, and its
/// temporary file goes with it unless it was renamed into place.
struct Upload<'a> {
    store: &'a DirStore,
    job: JobId,
    rank: u32,
    tmp: PathBuf,
    received: u64,
    done: bool,
}

impl Upload<'_> {
    /// Counts `n` more bytes, or says why they cannot be kept.
    fn receive(&mut self, n: u64) -> Result<(), CheckpointError> {
        let limits = self.store.limits;
        if self.received + n > limits.max_archive_bytes {
            return Err(CheckpointError::TooLarge(limits.max_archive_bytes));
        }
        let mut usage = self.store.usage.lock().unwrap_or_else(|e| e.into_inner());
        let job = usage.entry(self.job).or_default();
        job.update(self.rank, Some(limits.job_quota_bytes), |r| {
            r.uploading += n
        })
        .map_err(|used| CheckpointError::QuotaExceeded {
            job: self.job,
            quota: limits.job_quota_bytes,
            used,
        })?;
        self.received += n;
        Ok(())
    }

    /// The archive is in place: it is now the rank's.
    fn finish(mut self) {
        let received = self.received;
        self.end(|r| {
            r.uploading -= received;
            r.stored = received;
        });
        self.done = true;
    }

    fn end(&self, change: impl FnOnce(&mut RankUsage)) {
        let mut usage = self.store.usage.lock().unwrap_or_else(|e| e.into_inner());
        let job = usage.entry(self.job).or_default();
        // Without a quota check: this never adds to what is counted.
        let _ = job.update(self.rank, None, change);
    }
}

impl Drop for Upload<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Failed, refused, or abandoned mid-way (the request went away).
        let received = self.received;
        self.end(|r| r.uploading -= received);
        let _ = std::fs::remove_file(&self.tmp);
    }
}

impl DirStore {
    pub fn new(root: PathBuf) -> Result<DirStore, CheckpointError> {
        DirStore::with_limits(root, DirLimits::default())
    }

    pub fn with_limits(root: PathBuf, limits: DirLimits) -> Result<DirStore, CheckpointError> {
        private_dir(&root)?;
        Ok(DirStore {
            root,
            limits,
            usage: Default::default(),
        })
    }

    pub fn limits(&self) -> DirLimits {
        self.limits
    }

    pub fn path(&self, job: JobId, rank: u32) -> PathBuf {
        self.root.join(key(job, rank))
    }

    /// Reads what `job`'s archives take on disk, the first time this process sees the job.
    async fn load_usage(&self, job: JobId) -> Result<(), CheckpointError> {
        if self
            .usage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&job)
        {
            return Ok(());
        }
        let dir = self.root.join(format!("job-{}", job.0));
        let mut found = JobUsage::default();
        match tokio::fs::read_dir(&dir).await {
            Ok(mut entries) => {
                while let Some(entry) =
                    entries
                        .next_entry()
                        .await
                        .map_err(|source| CheckpointError::Io {
                            path: dir.clone(),
                            source,
                        })?
                {
                    let name = entry.file_name();
                    let Some(rank) = name
                        .to_str()
                        .and_then(|n| n.strip_prefix("rank-"))
                        .and_then(|n| n.strip_suffix(".tar.gz"))
                        .and_then(|n| n.parse::<u32>().ok())
                    else {
                        continue;
                    };
                    let bytes = entry.metadata().await.map(|m| m.len()).unwrap_or(0);
                    let _ = found.update(rank, None, |r| r.stored = bytes);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(CheckpointError::Io { path: dir, source }),
        }
        self.usage
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(job)
            .or_insert(found);
        Ok(())
    }

    /// Whether an upload that announced `declared` bytes can be kept: said before any of it is
    /// read. The bytes themselves are counted as they arrive ([`DirStore::write`]).
    pub async fn check_declared(
        &self,
        job: JobId,
        rank: u32,
        declared: u64,
    ) -> Result<(), CheckpointError> {
        if declared > self.limits.max_archive_bytes {
            return Err(CheckpointError::TooLarge(self.limits.max_archive_bytes));
        }
        self.load_usage(job).await?;
        let usage = self.usage.lock().unwrap_or_else(|e| e.into_inner());
        let Some(usage) = usage.get(&job) else {
            return Ok(());
        };
        let rank_now = usage.ranks.get(&rank).map_or(0, RankUsage::counted);
        let uploading = usage.ranks.get(&rank).map_or(0, |r| r.uploading);
        let after = usage.total - rank_now + rank_now.max(uploading + declared);
        if after > self.limits.job_quota_bytes && after > usage.total {
            return Err(CheckpointError::QuotaExceeded {
                job,
                quota: self.limits.job_quota_bytes,
                used: usage.total,
            });
        }
        Ok(())
    }

    /// Writes a rank's archive from a stream of chunks, atomically (temp file, then rename),
    /// within the per-upload limit and the job's quota.
    pub async fn write<S, E>(
        &self,
        job: JobId,
        rank: u32,
        mut body: S,
    ) -> Result<u64, CheckpointError>
    where
        S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
        E: std::fmt::Display,
    {
        use futures::StreamExt;
        use tokio::io::AsyncWriteExt;
        let path = self.path(job, rank);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointError::Io { path, source }
        };
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
        }
        self.load_usage(job).await?;
        let tmp = path.with_extension(format!("part-{}", rand::random::<u64>()));
        let mut upload = Upload {
            store: self,
            job,
            rank,
            tmp: tmp.clone(),
            received: 0,
            done: false,
        };
        let mut file = tokio::fs::File::create(&tmp).await.map_err(io(&tmp))?;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| CheckpointError::Io {
                path: tmp.clone(),
                source: std::io::Error::other(format!("upload interrupted: {e}")),
            })?;
            upload.receive(chunk.len() as u64)?;
            file.write_all(&chunk).await.map_err(io(&tmp))?;
        }
        file.sync_all().await.map_err(io(&tmp))?;
        drop(file);
        tokio::fs::rename(&tmp, &path).await.map_err(io(&path))?;
        let written = upload.received;
        upload.finish();
        Ok(written)
    }
}

/// Reads a size: bytes, or a number with a unit (`512MiB`, `8GiB`, `1TiB`; `KB`/`MB`/`GB`/`TB`
/// are powers of 1000). For `--checkpoint-max-archive` and `--checkpoint-job-quota`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit_bytes: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "`{text}`: unknown unit `{other}` (bytes, or KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
            ));
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size (e.g. 8GiB, 512MiB, 1000000)"))?;
    let bytes = value * unit_bytes as f64;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(format!("`{text}`: a size of at least one byte"));
    }
    Ok(bytes.round() as u64)
}

/// [`size`] of a field, for error messages.
fn human(bytes: &u64) -> String {
    size(*bytes)
}

/// A size for people: `8 GiB`, `1.5 MiB`, `300 bytes`.
pub fn size(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (name, unit) in UNITS {
        if bytes >= unit {
            let value = bytes as f64 / unit as f64;
            return if bytes.is_multiple_of(unit) {
                format!("{} {name}", bytes / unit)
            } else {
                format!("{value:.1} {name}")
            };
        }
    }
    format!("{bytes} bytes")
}

/// Everything command jobs keep on the broker's side besides the database: their checkpoints.
/// (Output tails are in the database: see `Store::put_output`.)
#[derive(Debug)]
pub struct ProgramStorage {
    pub checkpoints: CheckpointStore,
}

/// Most bytes of one instance's output tail the broker keeps.
pub const MAX_TAIL_BYTES: usize = 256 * 1024;

/// The last [`MAX_TAIL_BYTES`] of `text`, cut at a character boundary.
pub fn tail(text: &str) -> &str {
    let mut start = text.len().saturating_sub(MAX_TAIL_BYTES);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

impl ProgramStorage {
    pub fn new(checkpoints: CheckpointStore) -> ProgramStorage {
        ProgramStorage { checkpoints }
    }
}

#[cfg(feature = "ec2")]
pub mod s3 {
    //! S3 through presigned URLs: SigV4 query signing (`aws-sigv4`, already part of the EC2
    //! SDK's build) with the default credential chain, so no S3 SDK is compiled in.

    use super::CheckpointError;
    use aws_credential_types::provider::ProvideCredentials;
    use aws_sigv4::http_request::{
        PercentEncodingMode, SignableBody, SignableRequest, SignatureLocation, SigningSettings,
        UriPathNormalizationMode, sign,
    };
    use aws_sigv4::sign::v4;
    use std::time::{Duration, SystemTime};

    /// A bucket and key prefix, with the endpoint and credentials to sign for.
    pub struct S3Store {
        bucket: String,
        prefix: String,
        region: String,
        /// `AWS_ENDPOINT_URL[_S3]` (LocalStack): path-style URLs on it. Otherwise
        /// virtual-hosted `https://{bucket}.s3.{region}.amazonaws.com`.
        endpoint: Option<String>,
        credentials: Credentials,
    }

    enum Credentials {
        Chain(aws_credential_types::provider::SharedCredentialsProvider),
        #[cfg(test)]
        Fixed(aws_credential_types::Credentials),
    }

    impl std::fmt::Debug for S3Store {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(&self.describe())
        }
    }

    impl S3Store {
        /// `spec` is the whole `s3://bucket/prefix` text.
        pub async fn open(spec: &str) -> Result<S3Store, CheckpointError> {
            let (bucket, prefix) =
                super::parse_s3_url(spec).map_err(|e| CheckpointError::Config(spec.into(), e))?;
            let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
                .load()
                .await;
            let region = config
                .region()
                .map(|r| r.to_string())
                .unwrap_or_else(|| "us-east-1".into());
            let provider = config.credentials_provider().ok_or_else(|| {
                CheckpointError::Config(spec.into(), "no AWS credentials found".into())
            })?;
            let endpoint = std::env::var("AWS_ENDPOINT_URL_S3")
                .or_else(|_| std::env::var("AWS_ENDPOINT_URL"))
                .ok()
                .map(|e| e.trim_end_matches('/').to_string());
            let store = S3Store {
                bucket: bucket.into(),
                prefix: prefix.trim_matches('/').into(),
                region,
                endpoint,
                credentials: Credentials::Chain(provider),
            };
            store.ensure_bucket().await?;
            Ok(store)
        }

        pub fn describe(&self) -> String {
            match &self.endpoint {
                Some(e) => format!("s3://{}/{} at {e}", self.bucket, self.prefix),
                None => format!("s3://{}/{} in {}", self.bucket, self.prefix, self.region),
            }
        }

        fn object_url(&self, key: &str) -> (String, String) {
            let key = if self.prefix.is_empty() {
                key.to_string()
            } else {
                format!("{}/{key}", self.prefix)
            };
            self.url_in(&self.bucket, &key)
        }

        /// The URL and `Host` of `key` in `bucket` (path style at a custom endpoint such as
        /// LocalStack's, virtual-hosted style on AWS).
        fn url_in(&self, bucket: &str, key: &str) -> (String, String) {
            match &self.endpoint {
                Some(e) => {
                    let host = e.split_once("://").map_or(e.as_str(), |(_, h)| h);
                    (format!("{e}/{bucket}/{key}"), host.to_string())
                }
                None => {
                    let host = format!("{bucket}.s3.{}.amazonaws.com", self.region);
                    (format!("https://{host}/{key}"), host)
                }
            }
        }

        /// A URL that lets its holder `GET` the object `key` of any `bucket` these
        /// credentials can read (a command job's `s3://` working directory).
        pub async fn presign_get_in(
            &self,
            bucket: &str,
            key: &str,
            expires_secs: u64,
            now: SystemTime,
        ) -> Result<String, CheckpointError> {
            let (url, host) = self.url_in(bucket, key);
            self.presign_url("GET", &url, &host, expires_secs, now)
                .await
        }

        async fn identity(
            &self,
        ) -> Result<aws_smithy_runtime_api::client::identity::Identity, CheckpointError> {
            let creds = match &self.credentials {
                Credentials::Chain(p) => p
                    .provide_credentials()
                    .await
                    .map_err(|e| CheckpointError::S3(format!("credentials: {e}")))?,
                #[cfg(test)]
                Credentials::Fixed(c) => c.clone(),
            };
            Ok(creds.into())
        }

        /// A URL that lets its holder `method` the object `key` (under the prefix) for
        /// `expires_secs` from `now`.
        pub async fn presign(
            &self,
            method: &str,
            key: &str,
            expires_secs: u64,
            now: SystemTime,
        ) -> Result<String, CheckpointError> {
            let (url, host) = self.object_url(key);
            self.presign_url(method, &url, &host, expires_secs, now)
                .await
        }

        async fn presign_url(
            &self,
            method: &str,
            url: &str,
            host: &str,
            expires_secs: u64,
            now: SystemTime,
        ) -> Result<String, CheckpointError> {
            let identity = self.identity().await?;
            let mut settings = SigningSettings::default();
            settings.signature_location = SignatureLocation::QueryParams;
            settings.expires_in = Some(Duration::from_secs(expires_secs));
            settings.percent_encoding_mode = PercentEncodingMode::Single;
            settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
            let params = v4::SigningParams::builder()
                .identity(&identity)
                .region(&self.region)
                .name("s3")
                .time(now)
                .settings(settings)
                .build()
                .map_err(|e| CheckpointError::S3(format!("signing parameters: {e}")))?
                .into();
            let request = SignableRequest::new(
                method,
                url,
                std::iter::once(("host", host)),
                SignableBody::UnsignedPayload,
            )
            .map_err(|e| CheckpointError::S3(format!("{url}: {e}")))?;
            let (instructions, _) = sign(request, &params)
                .map_err(|e| CheckpointError::S3(format!("signing {url}: {e}")))?
                .into_parts();
            let mut out = url.to_string();
            let mut sep = if out.contains('?') { '&' } else { '?' };
            for (name, value) in instructions.params() {
                out.push(sep);
                sep = '&';
                out.push_str(&encode(name));
                out.push('=');
                out.push_str(&encode(value));
            }
            Ok(out)
        }

        /// How long the bucket check's own signed requests stay valid: S3's tolerance for a
        /// signer's clock (15 minutes), so that a broker whose clock is a minute off still
        /// starts (a 60-second validity expired at once from a broker a minute slow).
        const BUCKET_CHECK_SECS: u64 = 900;

        /// Creates the bucket if it does not exist (a presigned `PUT /bucket`; "already
        /// yours" is success), so that a fresh LocalStack or account works at once.
        async fn ensure_bucket(&self) -> Result<(), CheckpointError> {
            let (base, host) = match &self.endpoint {
                Some(e) => (
                    format!("{e}/{}", self.bucket),
                    e.split_once("://")
                        .map_or(e.as_str(), |(_, h)| h)
                        .to_string(),
                ),
                None => {
                    let host = format!("{}.s3.{}.amazonaws.com", self.bucket, self.region);
                    (format!("https://{host}/"), host)
                }
            };
            if base.starts_with("https://") {
                // The broker's HTTP client speaks plain HTTP only; on AWS the bucket is the
                // operator's to create (docs/command-jobs.md).
                return Ok(());
            }
            let http = reqwest::Client::new();
            let head = self
                .presign_url(
                    "HEAD",
                    &base,
                    &host,
                    Self::BUCKET_CHECK_SECS,
                    SystemTime::now(),
                )
                .await?;
            let status = http
                .head(&head)
                .send()
                .await
                .map_err(|e| CheckpointError::S3(format!("{base}: {e}")))?
                .status();
            if status.is_success() {
                return Ok(());
            }
            let put = self
                .presign_url(
                    "PUT",
                    &base,
                    &host,
                    Self::BUCKET_CHECK_SECS,
                    SystemTime::now(),
                )
                .await?;
            let resp = http
                .put(&put)
                .send()
                .await
                .map_err(|e| CheckpointError::S3(format!("{base}: {e}")))?;
            let status = resp.status();
            let body = resp.text().await.unwrap_or_default();
            if status.is_success() || body.contains("BucketAlreadyOwnedByYou") {
                tracing::info!(bucket = %self.bucket, "created the checkpoint bucket");
                return Ok(());
            }
            Err(CheckpointError::S3(format!(
                "cannot create bucket {} ({status}): {body}",
                self.bucket
            )))
        }
    }

    /// RFC 3986 percent-encoding of everything but the unreserved characters (SigV4's rule).
    fn encode(s: &str) -> String {
        let mut out = String::with_capacity(s.len());
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                out.push(b as char);
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        /// AWS's published presigned-URL example ("Authenticating Requests: Using Query
        /// Parameters", Signature Version 4): same keys, time and object, same signature.
        #[tokio::test]
        async fn matches_the_aws_documentation_example() {
            let store = S3Store {
                bucket: "examplebucket".into(),
                prefix: String::new(),
                region: "us-east-1".into(),
                endpoint: None,
                credentials: Credentials::Fixed(aws_credential_types::Credentials::new(
                    "AKIAIOSFODNN7EXAMPLE",
                    "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                    None,
                    None,
                    "test",
                )),
            };
            let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_369_353_600); // 2013-05-24T00:00:00Z
            let url = store.presign("GET", "test.txt", 86_400, t).await.unwrap();
            assert!(
                url.starts_with("https://examplebucket.s3.us-east-1.amazonaws.com/test.txt?"),
                "{url}"
            );
            // The documented example signs host `examplebucket.s3.amazonaws.com`; sign that
            // host to compare the signature itself.
            let url = store
                .presign_url(
                    "GET",
                    "https://examplebucket.s3.amazonaws.com/test.txt",
                    "examplebucket.s3.amazonaws.com",
                    86_400,
                    t,
                )
                .await
                .unwrap();
            assert!(
                url.contains(
                    "X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404"
                ),
                "{url}"
            );
            assert!(url.contains("X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request"), "{url}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_with_or_without_a_unit() {
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size(" 512 MiB "), Ok(512 << 20));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("1000"), Ok(1000));
        for bad in ["", "0", "-1GiB", "lots", "8 parsecs", "1e400"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
        assert_eq!(size(8 << 30), "8 GiB");
        assert_eq!(size(1536 << 10), "1.5 MiB");
        assert_eq!(size(300), "300 bytes");
    }

    fn chunks(
        sizes: &[usize],
    ) -> impl futures::Stream<Item = Result<bytes::Bytes, std::io::Error>> + Unpin {
        futures::stream::iter(
            sizes
                .iter()
                .map(|n| Ok(bytes::Bytes::from(vec![1u8; *n])))
                .collect::<Vec<_>>(),
        )
    }

    /// The per-upload limit and the job's quota, as the bytes arrive and when declared first;
    /// what a refused upload leaves (nothing) and what a restarted broker counts (the archives
    /// on disk).
    #[tokio::test]
    async fn the_directory_store_keeps_each_upload_and_each_job_within_its_limits() {
        let dir = tempfile::tempdir().unwrap();
        let limits = DirLimits {
            max_archive_bytes: 100,
            job_quota_bytes: 250,
        };
        let store = DirStore::with_limits(dir.path().join("ck"), limits).unwrap();
        let job = JobId(1);
        assert_eq!(store.write(job, 0, chunks(&[60, 40])).await.unwrap(), 100);
        assert!(matches!(
            store.write(job, 1, chunks(&[60, 41])).await,
            Err(CheckpointError::TooLarge(100))
        ));
        assert!(matches!(
            store.check_declared(job, 1, 101).await,
            Err(CheckpointError::TooLarge(100))
        ));
        assert_eq!(store.write(job, 1, chunks(&[100])).await.unwrap(), 100);
        // 200 of 250 kept: 51 more is over the quota, as it arrives or declared.
        assert!(matches!(
            store.check_declared(job, 2, 51).await,
            Err(CheckpointError::QuotaExceeded { used: 200, .. })
        ));
        match store.write(job, 2, chunks(&[30, 21])).await {
            Err(CheckpointError::QuotaExceeded {
                job: j,
                quota: 250,
                used: 230,
            }) => assert_eq!(j, job),
            other => panic!("{other:?}"),
        }
        assert!(
            !store.path(job, 2).exists(),
            "nothing kept of a refused upload"
        );
        // A replacement counts in place of what it replaces; another job has its own quota.
        store.check_declared(job, 0, 100).await.unwrap();
        assert_eq!(store.write(job, 0, chunks(&[50])).await.unwrap(), 50);
        assert_eq!(store.write(job, 2, chunks(&[100])).await.unwrap(), 100);
        assert_eq!(store.write(JobId(2), 0, chunks(&[100])).await.unwrap(), 100);
        let left: Vec<_> = std::fs::read_dir(dir.path().join("ck").join("job-1"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.contains("part-"))
            .collect();
        assert!(left.is_empty(), "temporary files left: {left:?}");
        // A broker started again counts what is on disk: 250 of 250.
        let again = DirStore::with_limits(dir.path().join("ck"), limits).unwrap();
        assert!(matches!(
            again.write(job, 3, chunks(&[1])).await,
            Err(CheckpointError::QuotaExceeded { used: 250, .. })
        ));
        // An upload abandoned mid-way (the request went away) gives its bytes back.
        let (tx, rx) = futures::channel::mpsc::unbounded::<Result<bytes::Bytes, std::io::Error>>();
        tx.unbounded_send(Ok(bytes::Bytes::from(vec![1u8; 10])))
            .unwrap();
        let pending = again.write(JobId(2), 1, rx);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), pending)
                .await
                .is_err()
        );
        drop(tx);
        assert_eq!(again.write(JobId(2), 1, chunks(&[100])).await.unwrap(), 100);
        assert!(matches!(
            again.write(JobId(2), 2, chunks(&[51])).await,
            Err(CheckpointError::QuotaExceeded { used: 200, .. })
        ));
    }

    #[tokio::test]
    async fn the_directory_store_replaces_a_rank_whole() {
        let dir = tempfile::tempdir().unwrap();
        let store = DirStore::new(dir.path().join("ck")).unwrap();
        let chunks = |parts: Vec<&'static [u8]>| {
            futures::stream::iter(
                parts
                    .into_iter()
                    .map(|p| Ok::<_, std::io::Error>(bytes::Bytes::from_static(p))),
            )
        };
        assert_eq!(
            store
                .write(JobId(3), 0, chunks(vec![b"ab", b"cd"]))
                .await
                .unwrap(),
            4
        );
        assert_eq!(std::fs::read(store.path(JobId(3), 0)).unwrap(), b"abcd");
        store.write(JobId(3), 0, chunks(vec![b"x"])).await.unwrap();
        assert_eq!(std::fs::read(store.path(JobId(3), 0)).unwrap(), b"x");
        let failing = futures::stream::iter(vec![
            Ok(bytes::Bytes::from_static(b"partial")),
            Err(std::io::Error::other("connection reset")),
        ]);
        assert!(store.write(JobId(3), 0, failing).await.is_err());
        assert_eq!(
            std::fs::read(store.path(JobId(3), 0)).unwrap(),
            b"x",
            "a failed upload leaves the previous checkpoint"
        );
    }
}
