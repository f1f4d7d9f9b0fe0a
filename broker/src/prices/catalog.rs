//! Facts about well-known instance types that price tables often leave out.
//!
//! The 2015 on-demand table carries only prices; the work model needs vCPUs to derive
//! throughput. These figures are AWS's published specifications and do not change over time.

use crate::market::InstanceType;

/// The published size of an instance type.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KnownType {
    pub vcpus: u32,
    pub memory_gib: f64,
    /// Its GPUs, if it has any.
    pub accelerator: Option<Accelerator>,
}

/// GPUs of one model, as SkyPilot users name them (`V100:1`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accelerator {
    pub name: &'static str,
    pub count: u32,
}

/// GPU instance types: name, vCPUs, memory (GiB), GPU model, GPUs.
const GPU_TYPES: &[(&str, u32, f64, &str, u32)] = &[
    ("g2.2xlarge", 8, 15.0, "K520", 1),
    ("g2.8xlarge", 32, 60.0, "K520", 4),
    ("p2.xlarge", 4, 61.0, "K80", 1),
    ("p2.8xlarge", 32, 488.0, "K80", 8),
    ("p3.2xlarge", 8, 61.0, "V100", 1),
    ("p3.8xlarge", 32, 244.0, "V100", 4),
    ("p3.16xlarge", 64, 488.0, "V100", 8),
    ("g4dn.xlarge", 4, 16.0, "T4", 1),
    ("g4dn.12xlarge", 48, 192.0, "T4", 4),
    ("g5.xlarge", 4, 16.0, "A10G", 1),
    ("g5.12xlarge", 48, 192.0, "A10G", 4),
];

const KNOWN: &[(&str, u32, f64)] = &[
    // 2015 trace types
    ("c3.large", 2, 3.75),
    ("c3.xlarge", 4, 7.5),
    ("c3.2xlarge", 8, 15.0),
    ("c3.4xlarge", 16, 30.0),
    ("c3.8xlarge", 32, 60.0),
    ("d2.xlarge", 4, 30.5),
    ("d2.2xlarge", 8, 61.0),
    ("d2.4xlarge", 16, 122.0),
    ("d2.8xlarge", 36, 244.0),
    ("m3.medium", 1, 3.75),
    ("m3.large", 2, 7.5),
    ("m3.xlarge", 4, 15.0),
    ("m3.2xlarge", 8, 30.0),
    ("r3.large", 2, 15.25),
    ("r3.xlarge", 4, 30.5),
    ("r3.2xlarge", 8, 61.0),
    ("r3.4xlarge", 16, 122.0),
    ("r3.8xlarge", 32, 244.0),
    // current generation, as in the 2021 table
    ("c5.large", 2, 4.0),
    ("c5.xlarge", 4, 8.0),
    ("c5.2xlarge", 8, 16.0),
    ("c5.4xlarge", 16, 32.0),
    ("c5.9xlarge", 36, 72.0),
    ("m5.large", 2, 8.0),
    ("m5.xlarge", 4, 16.0),
    ("m5.2xlarge", 8, 32.0),
    ("m5.4xlarge", 16, 64.0),
    ("r5.large", 2, 16.0),
    ("r5.xlarge", 4, 32.0),
];

pub fn lookup(instance_type: &InstanceType) -> Option<KnownType> {
    let name = instance_type.as_str();
    if let Some(&(_, vcpus, memory_gib, gpu, count)) = GPU_TYPES.iter().find(|t| t.0 == name) {
        return Some(KnownType {
            vcpus,
            memory_gib,
            accelerator: Some(Accelerator { name: gpu, count }),
        });
    }
    KNOWN
        .iter()
        .find(|(known, _, _)| *known == name)
        .map(|&(_, vcpus, memory_gib)| KnownType {
            vcpus,
            memory_gib,
            accelerator: None,
        })
}

/// The GPU models the catalog knows, for messages.
pub fn accelerator_names() -> Vec<&'static str> {
    let mut names: Vec<&str> = GPU_TYPES.iter().map(|t| t.3).collect();
    names.sort();
    names.dedup();
    names
}
