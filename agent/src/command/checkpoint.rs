//! A command job's checkpoint directory as one archive (gzipped tar) in durable storage.
//!
//! The agent never talks to a cloud storage API: the broker tells it where to `PUT` or `GET`
//! each rank's archive ([`CheckpointTransfer`]: a presigned S3 URL, or the broker's own
//! directory store), so the same code path serves S3 and a laptop.

use crate::control::Broker;
use crate::error::{AgentError, Result};
use proteus_wire::InstanceId;
use proteus_wire::agent_api::CheckpointOp;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What one transfer moved, for logs and benchmarks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Transferred {
    /// Bytes of the (compressed) archive.
    pub bytes: usize,
    pub secs: f64,
}

/// Packs `dir` (its contents, not the directory itself) into a gzipped tar. Files that vanish
/// while being packed (a program replacing them) are skipped, not fatal.
pub fn pack(dir: &Path) -> Result<Vec<u8>> {
    let io = |source| AgentError::Io {
        file: dir.to_path_buf(),
        source,
    };
    // Fast compression: checkpoints are mostly incompressible floats, and the upload must fit
    // between a notice and its deadline.
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut tar = tar::Builder::new(gz);
    tar.follow_symlinks(false);
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let entries = match std::fs::read_dir(dir.join(&rel)) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(e)),
        };
        let mut names: Vec<_> = entries.filter_map(|e| e.ok()).collect();
        names.sort_by_key(|e| e.file_name());
        for entry in names {
            let path = rel.join(entry.file_name());
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                tar.append_dir(&path, dir.join(&path)).map_err(io)?;
                stack.push(path);
            } else if kind.is_file() {
                match std::fs::File::open(dir.join(&path)) {
                    Ok(mut f) => tar.append_file(&path, &mut f).map_err(io)?,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io(e)),
                }
            }
        }
    }
    tar.into_inner().and_then(|gz| gz.finish()).map_err(io)
}

/// Replaces the contents of `dir` with the archive's.
pub fn unpack(archive: &[u8], dir: &Path) -> Result<()> {
    let io = |source| AgentError::Io {
        file: dir.to_path_buf(),
        source,
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io)?;
    }
    std::fs::create_dir_all(dir).map_err(io)?;
    let mut gz = flate2::read::GzDecoder::new(archive);
    let mut tar = tar::Archive::new(&mut gz as &mut dyn Read);
    tar.set_preserve_permissions(true);
    // `unpack` refuses entries that would land outside `dir` (`..`, absolute paths).
    tar.unpack(dir).map_err(io)
}

/// Packs `dir` and uploads it as `rank`'s newest checkpoint.
pub async fn upload(
    broker: &Broker,
    me: &InstanceId,
    rank: u32,
    dir: &Path,
) -> Result<Transferred> {
    let t = Instant::now();
    let d = dir.to_path_buf();
    let archive = tokio::task::spawn_blocking(move || pack(&d))
        .await
        .map_err(|e| AgentError::Config(format!("packing the checkpoint crashed: {e}")))??;
    let bytes = archive.len();
    let target = broker
        .checkpoint_transfer(me, rank, CheckpointOp::Upload)
        .await?;
    broker.put_archive(&target, archive).await?;
    Ok(Transferred {
        bytes,
        secs: t.elapsed().as_secs_f64(),
    })
}

/// Fetches `rank`'s newest checkpoint into `dir`; `None` (and an empty `dir`) when the job has
/// none yet.
pub async fn restore(
    broker: &Broker,
    me: &InstanceId,
    rank: u32,
    dir: &Path,
) -> Result<Option<Transferred>> {
    let t = Instant::now();
    let source = broker
        .checkpoint_transfer(me, rank, CheckpointOp::Download)
        .await?;
    let archive = broker.get_archive(&source).await?;
    let d = dir.to_path_buf();
    let bytes = archive.as_ref().map_or(0, |a| a.len());
    let found = archive.is_some();
    tokio::task::spawn_blocking(move || match archive {
        Some(a) => unpack(&a, &d),
        None => std::fs::create_dir_all(&d).map_err(|source| AgentError::Io { file: d, source }),
    })
    .await
    .map_err(|e| AgentError::Config(format!("unpacking the checkpoint crashed: {e}")))??;
    Ok(found.then(|| Transferred {
        bytes,
        secs: t.elapsed().as_secs_f64(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_then_unpack_gives_the_same_tree() {
        let src = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(src.path().join("sub/deeper")).unwrap();
        std::fs::write(src.path().join("state.json"), b"{\"step\": 7}").unwrap();
        std::fs::write(src.path().join("sub/deeper/w.bin"), vec![3u8; 100_000]).unwrap();
        let archive = pack(src.path()).unwrap();
        let dst = tempfile::tempdir().unwrap();
        std::fs::write(dst.path().join("stale"), b"old").unwrap();
        unpack(&archive, dst.path()).unwrap();
        assert_eq!(
            std::fs::read(dst.path().join("state.json")).unwrap(),
            b"{\"step\": 7}"
        );
        assert_eq!(
            std::fs::read(dst.path().join("sub/deeper/w.bin")).unwrap(),
            vec![3u8; 100_000]
        );
        assert!(!dst.path().join("stale").exists(), "restore replaces");
    }

    #[test]
    fn an_empty_directory_round_trips() {
        let src = tempfile::tempdir().unwrap();
        let archive = pack(&src.path().join("missing")).unwrap();
        let dst = tempfile::tempdir().unwrap();
        unpack(&archive, &dst.path().join("ck")).unwrap();
        assert!(dst.path().join("ck").is_dir());
    }
}
