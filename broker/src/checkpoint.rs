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
    #[error("checkpoint archive is larger than {0} bytes")]
    TooLarge(u64),
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
    /// `s3://bucket/prefix` or a directory path.
    pub async fn open(spec: &str) -> Result<CheckpointStore, CheckpointError> {
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
        Ok(CheckpointStore::Dir(DirStore::new(PathBuf::from(spec))?))
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

/// Largest archive the directory store accepts.
pub const MAX_ARCHIVE_BYTES: u64 = 8 << 30;

impl DirStore {
    pub fn new(root: PathBuf) -> Result<DirStore, CheckpointError> {
        private_dir(&root)?;
        Ok(DirStore { root })
    }

    pub fn path(&self, job: JobId, rank: u32) -> PathBuf {
        self.root.join(key(job, rank))
    }

    /// Writes a rank's archive from a stream of chunks, atomically (temp file, then rename).
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
        let tmp = path.with_extension(format!("part-{}", rand::random::<u64>()));
        let mut file = tokio::fs::File::create(&tmp).await.map_err(io(&tmp))?;
        let mut written = 0u64;
        let result = async {
            while let Some(chunk) = body.next().await {
                let chunk = chunk.map_err(|e| CheckpointError::Io {
                    path: tmp.clone(),
                    source: std::io::Error::other(format!("upload interrupted: {e}")),
                })?;
                written += chunk.len() as u64;
                if written > MAX_ARCHIVE_BYTES {
                    return Err(CheckpointError::TooLarge(MAX_ARCHIVE_BYTES));
                }
                file.write_all(&chunk).await.map_err(io(&tmp))?;
            }
            file.sync_all().await.map_err(io(&tmp))?;
            tokio::fs::rename(&tmp, &path).await.map_err(io(&path))
        }
        .await;
        if result.is_err() {
            let _ = tokio::fs::remove_file(&tmp).await;
        }
        result.map(|()| written)
    }
}

/// Everything command jobs keep on the broker's side: checkpoints and output tails.
#[derive(Debug)]
pub struct ProgramStorage {
    pub checkpoints: CheckpointStore,
    /// `<dir>/job-<id>/<instance>.log`: the newest tail each instance sent.
    outputs: PathBuf,
}

/// Most bytes of one instance's output tail the broker keeps.
pub const MAX_TAIL_BYTES: usize = 256 * 1024;

impl ProgramStorage {
    pub fn new(checkpoints: CheckpointStore, outputs: PathBuf) -> Result<Self, CheckpointError> {
        private_dir(&outputs)?;
        Ok(ProgramStorage {
            checkpoints,
            outputs,
        })
    }

    fn output_path(&self, job: JobId, instance: &str) -> PathBuf {
        // Instance ids are the broker's own (`i-…`, `sim-…`); keep them to one path element.
        let name: String = instance
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        self.outputs
            .join(format!("job-{}", job.0))
            .join(format!("{name}.log"))
    }

    /// Replaces `instance`'s output tail (keeping its last [`MAX_TAIL_BYTES`]).
    pub async fn write_output(
        &self,
        job: JobId,
        instance: &str,
        text: &str,
    ) -> Result<(), CheckpointError> {
        let path = self.output_path(job, instance);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CheckpointError::Io { path, source }
        };
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
        }
        let mut start = text.len().saturating_sub(MAX_TAIL_BYTES);
        while !text.is_char_boundary(start) {
            start += 1;
        }
        let tmp = path.with_extension("tmp");
        tokio::fs::write(&tmp, &text[start..])
            .await
            .map_err(io(&tmp))?;
        tokio::fs::rename(&tmp, &path).await.map_err(io(&path))
    }

    /// Every instance's tail for `job`, by instance id.
    pub async fn outputs(&self, job: JobId) -> Result<Vec<(String, String)>, CheckpointError> {
        let dir = self.outputs.join(format!("job-{}", job.0));
        let mut out = Vec::new();
        let mut entries = match tokio::fs::read_dir(&dir).await {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(source) => return Err(CheckpointError::Io { path: dir, source }),
        };
        while let Ok(Some(entry)) = entries.next_entry().await {
            let path = entry.path();
            let Some(instance) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".log"))
            else {
                continue;
            };
            let text =
                tokio::fs::read_to_string(&path)
                    .await
                    .map_err(|source| CheckpointError::Io {
                        path: path.clone(),
                        source,
                    })?;
            out.push((instance.to_string(), text));
        }
        out.sort();
        Ok(out)
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
                .presign_url("HEAD", &base, &host, 60, SystemTime::now())
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
                .presign_url("PUT", &base, &host, 60, SystemTime::now())
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
