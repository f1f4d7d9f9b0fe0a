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
}

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
    ("g2.2xlarge", 8, 15.0),
    ("g2.8xlarge", 32, 60.0),
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
    KNOWN
        .iter()
        .find(|(name, _, _)| *name == instance_type.as_str())
        .map(|&(_, vcpus, memory_gib)| KnownType { vcpus, memory_gib })
}
