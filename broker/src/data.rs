//! Data sets the project carries: the small spot trace is compiled into the binary so that
//! `proteus demo` works from any directory; the larger files are found on disk.

use std::path::{Path, PathBuf};

/// The 2015 us-east-1 spot trace of the papers (15 markets, 156,005 changes). See `data/SOURCES.md`.
pub const TRACE_2015: &[u8] = include_bytes!("../../data/spot/aws-us-east-1-2015-03-to-06.csv.gz");
pub const TRACE_2015_NAME: &str = "aws-us-east-1-2015-03-to-06.csv.gz";
/// On-demand prices of the five 2015 types.
pub const ON_DEMAND_2015: &[u8] = include_bytes!("../../data/spot/on-demand-us-east-1-2015.csv");
pub const ON_DEMAND_2015_NAME: &str = "on-demand-us-east-1-2015.csv";

/// The project's `data/` directory: `$PROTEUS_DATA_DIR`, else see [`project_dir`].
pub fn data_dir() -> PathBuf {
    project_dir("data", Some("PROTEUS_DATA_DIR"), "SOURCES.md")
}

/// The one lookup of a directory of the project's tree (`data/`, `policies/`, `examples/`):
/// `$env` if set, else a `name/` holding `marker` beside or above the running binary (an
/// installed tree), else the one in the source tree this binary was built from.
pub fn project_dir(name: &str, env: Option<&str>, marker: &str) -> PathBuf {
    if let Some(dir) = env.and_then(std::env::var_os) {
        return PathBuf::from(dir);
    }
    if let Ok(exe) = std::env::current_exe() {
        for ancestor in exe.ancestors().skip(1).take(4) {
            let candidate = ancestor.join(name);
            if candidate.join(marker).is_file() {
                return candidate;
            }
        }
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(name)
}

/// Where this user's Proteus state lives by default (`~/.local/share/proteus` on Linux): the
/// embedded database and the local agents' state. The one lookup of the user's data directory.
pub fn user_dir() -> PathBuf {
    dirs::data_dir()
        .or_else(dirs::home_dir)
        .unwrap_or_else(std::env::temp_dir)
        .join("proteus")
}
