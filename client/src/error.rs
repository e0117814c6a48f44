//! What a client call can end in. The state machine's own refusals stay typed
//! ([`Error::Rejected`] carries its [`CommandError`]); transport failures say how long
//! and how often the client tried.

use allot_statemachine::CommandError;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The shard applied the command and refused it (nothing changed).
    #[error("rejected: {0}")]
    Rejected(CommandError),
    /// The request was malformed or out of range (nothing was applied).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An unknown shard, or a queried object that does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    #[error("unauthenticated: {0}")]
    Unauthenticated(String),
    #[error("permission denied: {0}")]
    PermissionDenied(String),
    /// Every attempt failed with a retryable error (unreachable endpoints, no leader,
    /// rate limited, timed out) until the retry budget or deadline ran out. A mutating
    /// request may or may not have been applied: retry it with the same request id.
    #[error("gave up after {attempts} attempts in {elapsed:?}: {last}")]
    Unavailable {
        attempts: u32,
        elapsed: Duration,
        last: String,
        /// The node's reason (`allot-reason`) when the last attempt reached a node that
        /// answered with a retryable refusal of its own — `AUDIT_GAP` (this replica
        /// lacks part of the trail), `RATE_LIMITED`… — rather than no leader or no
        /// answer: what to report as the cause.
        cause: Option<String>,
    },
    /// Any other gRPC status.
    #[error("{code:?}: {message}")]
    Status { code: tonic::Code, message: String },
    #[error("decoding the reply: {0}")]
    Decode(String),
    /// The reply was not of the kind the call expects (a client/node version mismatch).
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    #[error("configuration: {0}")]
    Config(String),
    /// A local file (a backup being written) could not be written or read.
    #[error("local file: {0}")]
    Local(String),
}

impl Error {
    /// The typed refusal of the state machine, if that is what this is.
    pub fn command_error(&self) -> Option<&CommandError> {
        match self {
            Error::Rejected(e) => Some(e),
            _ => None,
        }
    }

    pub(crate) fn from_status(s: &tonic::Status) -> Error {
        // A request the node's edge refused with the state machine's own validation
        // (nothing was proposed): the same typed error apply would have given, as the
        // typed API's JSON form of it.
        if let Some(e) = s
            .metadata()
            .get_bin(allot_proto::meta::ERROR_JSON)
            .and_then(|v| v.to_bytes().ok())
            .and_then(|b| serde_json::from_slice::<CommandError>(&b).ok())
        {
            return Error::Rejected(e);
        }
        let message = s.message().to_string();
        match s.code() {
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => {
                Error::InvalidArgument(message)
            }
            tonic::Code::NotFound => Error::NotFound(message),
            tonic::Code::Unauthenticated => Error::Unauthenticated(message),
            tonic::Code::PermissionDenied => Error::PermissionDenied(message),
            code => Error::Status { code, message },
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
