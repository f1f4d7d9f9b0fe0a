//! Multi-process tests: real `proteus-agent` processes on loopback, a test coordinator and one
//! IMDS mock per agent. One test binary (modules below) so it links once.

mod backup;
mod data_plane;
mod faults;
mod flexrr;
mod handover;
mod pipeline;
mod support;
mod training;
