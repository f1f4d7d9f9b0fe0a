//! A CPU cap on one process, through the kernel's CFS bandwidth control: the process is moved
//! into a cgroup of its own whose quota is a fraction of a core. Used to disrupt a machine
//! (its worker gets less CPU than it needs for a while), as a competing process would.
//!
//! cgroup v2 (`cpu.max`) where the unified hierarchy has the cpu controller, else v1
//! (`cpu.cfs_quota_us` / `cpu.cfs_period_us` under `/sys/fs/cgroup/cpu`). Needs root (or a
//! delegated cgroup); on drop the process goes back to its parent group and the group is
//! removed.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The kernel's smallest quota per period.
const MIN_QUOTA: Duration = Duration::from_millis(1);
/// The period. The quota is enforced at scheduler-tick granularity (a throttled process may
/// overrun it by up to a tick, 4 ms at 250 Hz, each period), so a quota of a few milliseconds
/// is only roughly what it says; a longer period is more exact but makes the process run in
/// longer bursts and stall longer between them.
const PERIOD: Duration = Duration::from_millis(100);

enum Version {
    V1,
    V2,
}

pub struct CpuLimit {
    dir: PathBuf,
    parent: PathBuf,
    version: Version,
    pid: u32,
}

fn write(path: &Path, text: &str) -> Result<(), String> {
    std::fs::write(path, text)
        .map_err(|e| format!("cannot write {text:?} to {}: {e}", path.display()))
}

impl CpuLimit {
    /// Moves `pid` into a new cgroup named `name`, unlimited for now.
    pub fn new(name: &str, pid: u32) -> Result<CpuLimit, String> {
        let unified = Path::new("/sys/fs/cgroup");
        let v2 = std::fs::read_to_string(unified.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu"));
        let (parent, version) = if v2 {
            (unified.to_path_buf(), Version::V2)
        } else {
            (PathBuf::from("/sys/fs/cgroup/cpu"), Version::V1)
        };
        let dir = parent.join(name);
        std::fs::create_dir_all(&dir).map_err(|e| {
            format!(
                "cannot create cgroup {}: {e} (a CPU cap needs root)",
                dir.display()
            )
        })?;
        let limit = CpuLimit {
            dir,
            parent,
            version,
            pid,
        };
        write(&limit.dir.join("cgroup.procs"), &pid.to_string())?;
        Ok(limit)
    }

    /// Caps the process at `cores` of one core (e.g. 0.02: 2 ms per 100 ms).
    pub fn set(&self, cores: f64) -> Result<(), String> {
        if !(cores.is_finite() && cores > 0.0) {
            return Err(format!(
                "a CPU cap must be a positive fraction of a core, not {cores}"
            ));
        }
        let period = PERIOD;
        let quota = period.mul_f64(cores.min(64.0));
        if quota < MIN_QUOTA {
            return Err(format!(
                "a cap of {cores} cores is below the kernel's 1 ms per period of {PERIOD:?}"
            ));
        }
        let (q, p) = (quota.as_micros(), period.as_micros());
        match self.version {
            Version::V2 => write(&self.dir.join("cpu.max"), &format!("{q} {p}")),
            Version::V1 => {
                // The period first: the quota is checked against it.
                write(&self.dir.join("cpu.cfs_period_us"), &p.to_string())?;
                write(&self.dir.join("cpu.cfs_quota_us"), &q.to_string())
            }
        }
    }

    /// No cap.
    pub fn lift(&self) -> Result<(), String> {
        match self.version {
            Version::V2 => write(&self.dir.join("cpu.max"), "max"),
            Version::V1 => write(&self.dir.join("cpu.cfs_quota_us"), "-1"),
        }
    }
}

impl Drop for CpuLimit {
    fn drop(&mut self) {
        let _ = self.lift();
        let _ = std::fs::write(self.parent.join("cgroup.procs"), self.pid.to_string());
        let _ = std::fs::remove_dir(&self.dir);
    }
}
