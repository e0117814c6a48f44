//! How a failed command ends: a readable message on stderr and the exit code (2 for
//! usage errors, 1 for everything else).

use allot_client::Error;
use allot_statemachine::CommandError;

/// A usage error found after parsing (conflicting values, an unknown tier name...):
/// nothing was sent; exit code 2.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    Usage(msg.into()).into()
}

/// Prints the error and exits with its code.
pub fn exit(e: &anyhow::Error) -> ! {
    let code = if e.downcast_ref::<Usage>().is_some() {
        2
    } else {
        1
    };
    eprintln!("error: {}", render(e));
    if code == 2 {
        eprintln!("\nFor more information, try '--help'.");
    }
    std::process::exit(code)
}

/// The error chain on one line, with the state machine's refusals named.
pub fn render(e: &anyhow::Error) -> String {
    let mut parts = Vec::new();
    for cause in e.chain() {
        let text = match cause.downcast_ref::<Error>() {
            Some(err) => client_error(err),
            None => cause.to_string(),
        };
        parts.push(text);
    }
    parts.join(": ")
}

/// Whether the command was given a token (`--token` / `ALLOTCTL_TOKEN`): it decides
/// what an `UNAUTHENTICATED` answer means to the operator.
static TOKEN_GIVEN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

pub fn set_token_given(given: bool) {
    let _ = TOKEN_GIVEN.set(given);
}

fn client_error(e: &Error) -> String {
    match e {
        Error::Rejected(c) => format!("rejected by the cluster: {c} [{}]", code(c)),
        Error::Unauthenticated(_) if TOKEN_GIVEN.get() == Some(&true) => {
            "the cluster refused the token (unknown, revoked or expired) [Unauthenticated]".into()
        }
        Error::Unauthenticated(_) => "the cluster requires a token: give --token or set \
             ALLOTCTL_TOKEN (the cluster is secured; --as works only on dev-mode nodes) \
             [Unauthenticated]"
            .into(),
        Error::PermissionDenied(_) => {
            "the token's scope does not allow this call [PermissionDenied]".into()
        }
        Error::Unavailable {
            cause: Some(reason),
            attempts,
            elapsed,
            last,
        } => match reason.as_str() {
            "AUDIT_GAP" => format!(
                "the replicas asked lack part of the audit trail (they caught up by snapshot \
                 and are still copying it from peers) [AuditGap]: {last} (after {attempts} \
                 attempts in {elapsed:?}); retry later or ask another endpoint"
            ),
            "RATE_LIMITED" => format!(
                "the cluster kept rate-limiting this caller [RateLimited]: {last} (after \
                 {attempts} attempts in {elapsed:?})"
            ),
            other => format!(
                "the cluster answered but could not serve this [{other}]: {last} (after \
                 {attempts} attempts in {elapsed:?})"
            ),
        },
        Error::Unavailable { .. } => format!(
            "cluster unreachable or without a leader ({e}); check --endpoints and that the nodes run"
        ),
        other => other.to_string(),
    }
}

/// The refusal's variant name (`UnknownOrg`), stable for scripts.
pub fn code(c: &CommandError) -> String {
    let dbg = format!("{c:?}");
    dbg.split(['(', ' ', '{'])
        .next()
        .unwrap_or_default()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_named() {
        let e: anyhow::Error = anyhow::Error::new(Error::Rejected(CommandError::UnknownOrg))
            .context("creating project:5");
        let r = render(&e);
        assert!(
            r.contains("creating project:5") && r.contains("[UnknownOrg]"),
            "{r}"
        );
        assert_eq!(
            code(&CommandError::InsufficientCredits {
                available: 1,
                needed: 2
            }),
            "InsufficientCredits"
        );
    }

    /// A retryable refusal a node gave for a reason of its own is reported as that
    /// reason, not as an unreachable cluster.
    #[test]
    fn an_audit_gap_is_named_not_reported_as_unreachable() {
        let gap = |cause: Option<&str>| {
            render(&anyhow::Error::new(Error::Unavailable {
                attempts: 9,
                elapsed: std::time::Duration::from_secs(10),
                last: "127.0.0.1:7101: Unavailable: this replica lacks audit events 13..171".into(),
                cause: cause.map(str::to_string),
            }))
        };
        let named = gap(Some("AUDIT_GAP"));
        assert!(
            named.contains("[AuditGap]") && named.contains("lacks audit events"),
            "{named}"
        );
        assert!(!named.contains("unreachable"), "{named}");
        assert!(gap(Some("SOMETHING_NEW")).contains("[SOMETHING_NEW]"));
        assert!(gap(None).contains("unreachable or without a leader"));
    }
}
