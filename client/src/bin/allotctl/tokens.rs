//! `token create|rotate|revoke`: API tokens. Tokens are generated here from the OS
//! CSPRNG and shown once; only their SHA-256 reaches the cluster (on every shard).

use crate::connect::{fresh_id, Ctx};
use crate::output::{show, Table};
use crate::timefmt::now_ms;
use crate::values;
use allot_statemachine::{NodeId, OrgId, PrincipalId, ProjectId, Scope};
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
    /// admin, org:<org id>, project:<org id>/<project id>, or agent:<node id>.
    #[arg(long, value_parser = token_scope)]
    scope: Scope,
    /// The principal id (default: a fresh id, printed).
    #[arg(long)]
    principal: Option<u64>,
    /// The token stops working after this long (30d, 12h); default: no expiry.
    #[arg(long, value_parser = values::duration_ms)]
    expires_in: Option<u64>,
}

#[derive(Args, Debug)]
pub struct RotateArgs {
    #[arg(long)]
    principal: u64,
    /// How long the old tokens keep working (0s: stop at once).
    #[arg(long, default_value = "0s", value_parser = values::duration_ms)]
    overlap: u64,
}

#[derive(Args, Debug)]
pub struct RevokeArgs {
    #[arg(long)]
    principal: u64,
}

pub fn token_scope(s: &str) -> Result<Scope, String> {
    let bad = || {
        format!(
            "scope {s:?}: expected admin, org:<org id>, project:<org id>/<project id> or \
             agent:<node id>"
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
        _ => Err(bad()),
    }
}

pub async fn run(ctx: &Ctx, cmd: TokenCmd) -> anyhow::Result<()> {
    let (what, principal, token) = match cmd {
        TokenCmd::Create(a) => {
            let principal = PrincipalId(a.principal.unwrap_or_else(fresh_id));
            let expires = a.expires_in.map(|d| now_ms() + d);
            let token = ctx.client.create_token(principal, a.scope, expires).await?;
            ("created", principal, Some(token))
        }
        TokenCmd::Rotate(a) => {
            let principal = PrincipalId(a.principal);
            let token = ctx.client.rotate_token(principal, a.overlap).await?;
            ("rotated", principal, Some(token))
        }
        TokenCmd::Revoke(a) => {
            let principal = PrincipalId(a.principal);
            ctx.client.revoke_token(principal).await?;
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
        for bad in [
            "",
            "root",
            "org:",
            "org:x",
            "project:7",
            "agent:-1",
            "user:1",
        ] {
            assert!(token_scope(bad).is_err(), "{bad}");
        }
    }
}
