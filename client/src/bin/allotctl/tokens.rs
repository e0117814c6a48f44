//! `token create|rotate|revoke`: API tokens. Tokens are generated here from the OS
//! CSPRNG and shown once; only their SHA-256 reaches the cluster: an org's tokens on
//! its home shard, the operator's (admin, agent) on every shard.

use crate::connect::Ctx;
use crate::output::{show, Table};
use crate::timefmt::now_ms;
use crate::values;
use allot_statemachine::{NodeId, OrgId, PrincipalId, ProjectId, Scope, UserId};
use anyhow::Context;
use clap::{Args, Subcommand};

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    /// A new principal with a new token (printed once: store it now).
    Create(CreateArgs),
    /// A new token for a principal; its old tokens stop working after --overlap.
    Rotate(RotateArgs),
    /// Revokes every token of a principal, on every shard, for good.
    Revoke(RevokeArgs),
}

#[derive(Args, Debug)]
pub struct CreateArgs {
    /// admin, org:<org id>, project:<org id>/<project id>,
    /// user:<org id>/<project id>/<user id>, or agent:<node id>.
    #[arg(long, value_parser = token_scope)]
    scope: Scope,
    /// The principal id (default: a fresh id, printed). An org's principals are in its
    /// own namespace.
    #[arg(long)]
    principal: Option<u64>,
    /// The token stops working after this long (30d, 12h); default: no expiry.
    #[arg(long, value_parser = values::duration_ms)]
    expires_in: Option<u64>,
    /// Install the token in this file (at least 32 characters) instead of a new one.
    #[arg(long)]
    token_file: Option<std::path::PathBuf>,
}

#[derive(Args, Debug)]
pub struct RotateArgs {
    #[arg(long)]
    principal: u64,
    /// The org the principal belongs to (omit for admin and agent principals).
    #[arg(long)]
    org: Option<u64>,
    /// How long the old tokens keep working (0s: stop at once).
    #[arg(long, default_value = "0s", value_parser = values::duration_ms)]
    overlap: u64,
}

#[derive(Args, Debug)]
pub struct RevokeArgs {
    #[arg(long)]
    principal: u64,
    /// The org the principal belongs to (omit for admin and agent principals).
    #[arg(long)]
    org: Option<u64>,
}

/// The namespace of principal `principal` when the operator did not name its org: the
/// operator's own if it has one of that id, else the one org that does (asked of every
/// shard); two orgs with that id need `--org`.
async fn namespace_of(ctx: &Ctx, principal: PrincipalId) -> anyhow::Result<Option<OrgId>> {
    use allot_statemachine::query::{Answer, Query};
    let mut found: Vec<Option<OrgId>> = Vec::new();
    for shard in 0..ctx.client.shards().await? {
        if let Answer::Principals(list) = ctx
            .client
            .query(shard, &Query::Principals(principal))
            .await?
        {
            found.extend(list.into_iter().map(|(org, _, _)| org));
        }
    }
    found.sort();
    found.dedup();
    match found.as_slice() {
        [] => anyhow::bail!("unknown principal {} [UNKNOWN_PRINCIPAL]", principal.0),
        [only] => Ok(*only),
        several if several.contains(&None) => Ok(None),
        several => anyhow::bail!(
            "principal {} exists in orgs {:?}: pass --org",
            principal.0,
            several.iter().flatten().map(|o| o.0).collect::<Vec<_>>()
        ),
    }
}

pub fn token_scope(s: &str) -> Result<Scope, String> {
    let bad = || {
        format!(
            "scope {s:?}: expected admin, org:<org id>, project:<org id>/<project id>, \
             user:<org id>/<project id>/<user id> or agent:<node id>"
        )
    };
    if s == "admin" {
        return Ok(Scope::Admin);
    }
    let (kind, rest) = s.split_once(':').ok_or_else(bad)?;
    let num = |v: &str| v.parse::<u64>().map_err(|_| bad());
    match kind {
        "org" => Ok(Scope::Org(OrgId(num(rest)?))),
        "agent" => Ok(Scope::Agent(NodeId(num(rest)?))),
        "project" => {
            let (o, p) = rest.split_once('/').ok_or_else(bad)?;
            Ok(Scope::Project {
                org: OrgId(num(o)?),
                project: ProjectId(num(p)?),
            })
        }
        "user" => {
            let mut parts = rest.splitn(3, '/');
            let (o, p, u) = (
                parts.next().ok_or_else(bad)?,
                parts.next().ok_or_else(bad)?,
                parts.next().ok_or_else(bad)?,
            );
            Ok(Scope::User {
                org: OrgId(num(o)?),
                project: ProjectId(num(p)?),
                user: UserId(num(u)?),
            })
        }
        _ => Err(bad()),
    }
}

pub async fn run(ctx: &Ctx, cmd: TokenCmd) -> anyhow::Result<()> {
    let (what, principal, token) = match cmd {
        TokenCmd::Create(a) => {
            let principal = PrincipalId(a.principal.unwrap_or_else(|| ctx.new_id()));
            let expires = a.expires_in.map(|d| now_ms() + d);
            let token = match &a.token_file {
                Some(f) => {
                    let t = std::fs::read_to_string(f)
                        .with_context(|| format!("reading {}", f.display()))?
                        .trim()
                        .to_string();
                    allot_client::security::check_chosen_token(&t)?;
                    t
                }
                None => allot_client::security::generate_token()?,
            };
            // With the global --request-id (and --token-file) a creation that failed
            // part of the way completes: the shards that applied it answer as before.
            let id = ctx.client.next_request_id();
            ctx.client
                .create_token_with(principal, a.scope, expires, &token, id)
                .await?;
            ("created", principal, Some(token))
        }
        TokenCmd::Rotate(a) => {
            let principal = PrincipalId(a.principal);
            let org = match a.org {
                Some(o) => Some(OrgId(o)),
                None => namespace_of(ctx, principal).await?,
            };
            let token = ctx.client.rotate_token(org, principal, a.overlap).await?;
            ("rotated", principal, Some(token))
        }
        TokenCmd::Revoke(a) => {
            let principal = PrincipalId(a.principal);
            let org = match a.org {
                Some(o) => Some(OrgId(o)),
                None => namespace_of(ctx, principal).await?,
            };
            ctx.client.revoke_token(org, principal).await?;
            ("revoked", principal, None)
        }
    };
    let mut t = Table::new(&["PRINCIPAL", "RESULT", "TOKEN (shown once)"]);
    t.row(vec![
        principal.0.to_string(),
        what.into(),
        token.clone().unwrap_or_else(|| "-".into()),
    ]);
    show(
        ctx.format,
        &serde_json::json!({"principal": principal.0, "result": what, "token": token}),
        &[t],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_parse_and_bad_ones_are_refused() {
        assert_eq!(token_scope("admin"), Ok(Scope::Admin));
        assert_eq!(token_scope("org:7"), Ok(Scope::Org(OrgId(7))));
        assert_eq!(
            token_scope("project:7/3"),
            Ok(Scope::Project {
                org: OrgId(7),
                project: ProjectId(3)
            })
        );
        assert_eq!(token_scope("agent:2"), Ok(Scope::Agent(NodeId(2))));
        assert_eq!(
            token_scope("user:7/3/9"),
            Ok(Scope::User {
                org: OrgId(7),
                project: ProjectId(3),
                user: UserId(9)
            })
        );
        for bad in [
            "",
            "root",
            "org:",
            "org:x",
            "project:7",
            "agent:-1",
            "user:1",
            "user:1/2",
        ] {
            assert!(token_scope(bad).is_err(), "{bad}");
        }
    }
}
