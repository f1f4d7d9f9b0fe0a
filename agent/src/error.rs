//! The library's error type.

use std::path::PathBuf;

/// Everything that can go wrong inside the agent library.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{file}: {source}")]
    Io {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}, line {line}: {message}")]
    Parse {
        file: PathBuf,
        line: u64,
        message: String,
    },
    #[error("data set {0}")]
    Data(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("broker: {0}")]
    Broker(String),
    #[error("broker refused ({status}): {message}")]
    BrokerStatus { status: u16, message: String },
    #[error(
        "this agent speaks agent protocol {agent} and the broker {broker} (0: from before the \
         protocol had a version): run the agent the broker serves \
         (GET /v1/downloads/proteus-agent)"
    )]
    ProtocolMismatch { agent: u32, broker: u32 },
    #[error("peer {peer}: {message}")]
    Peer { peer: String, message: String },
    #[error("data-plane hello refused: {0}")]
    Handshake(String),
    #[error("malformed frame: {0}")]
    Frame(String),
    #[error("instance metadata: {0}")]
    Imds(String),
    /// The job's training stopped in this agent with an error (it left the job as failed).
    #[error("training: {0}")]
    Training(String),
    #[error("I/O: {0}")]
    Net(#[from] std::io::Error),
}

pub type Result<T, E = AgentError> = std::result::Result<T, E>;
