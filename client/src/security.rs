//! API tokens: generated here (on the client), installed as SHA-256 digests on every
//! shard. The node never sees a token except as a bearer credential, and stores none.

use crate::error::{Error, Result};
use crate::transport::Client;
use allot_statemachine::{Command, OrgId, PrincipalId, Reply, RequestId, Scope, TokenDigest};
use base64::Engine;

/// Prefix of generated tokens (so leaked ones are easy to grep for).
pub const TOKEN_PREFIX: &str = "alt_";
/// Shortest operator-chosen secret accepted for a bootstrap admin token.
pub const CHOSEN_TOKEN_LEN_MIN: usize = 32;

/// A new token: `alt_` + 256 bits from the operating system's CSPRNG, base64url.
pub fn generate_token() -> Result<String> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b).map_err(|e| Error::Config(format!("no OS randomness: {e}")))?;
    Ok(format!(
        "{TOKEN_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(b)
    ))
}

/// Checks an operator-chosen token (e.g. read from a file): long enough, printable.
pub fn check_chosen_token(token: &str) -> Result<()> {
    if token.len() < CHOSEN_TOKEN_LEN_MIN || token.len() > 512 {
        return Err(Error::Config(format!(
            "a chosen token must be {CHOSEN_TOKEN_LEN_MIN}..=512 characters (got {}); \
             omit it to have one generated",
            token.len()
        )));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::Config(
            "a token may contain only printable ASCII without spaces".into(),
        ));
    }
    Ok(())
}

/// The bootstrap admin token and where it came from: read from `file` if it exists (an
/// operator-chosen secret, checked), else generated and written there with mode 0600,
/// else (no file) generated and to be shown once. Used by `allotctl cluster init` and
/// `allot-node init`.
pub fn admin_token(file: Option<&std::path::Path>) -> Result<(String, String)> {
    let io = |p: &std::path::Path, e: std::io::Error| {
        Error::Config(format!("admin token file {}: {e}", p.display()))
    };
    match file {
        Some(p) if p.exists() => {
            let t = std::fs::read_to_string(p)
                .map_err(|e| io(p, e))?
                .trim()
                .to_string();
            check_chosen_token(&t)?;
            Ok((t, format!("read from {}", p.display())))
        }
        Some(p) => {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let t = generate_token()?;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(p)
                .map_err(|e| io(p, e))?;
            writeln!(f, "{t}").map_err(|e| io(p, e))?;
            Ok((
                t,
                format!("generated, written to {} (mode 0600)", p.display()),
            ))
        }
        None => Ok((generate_token()?, "generated (shown once)".to_string())),
    }
}

/// How to use a freshly installed admin token (printed by the init commands).
pub fn admin_token_help(token: &str, source: &str) -> String {
    format!(
        "cluster secured with admin principal 1; admin token ({source}):\n  {token}\n\
         use it as: export ALLOTCTL_TOKEN=<token> (or allotctl --token); gRPC clients send \
         `authorization: Bearer <token>`; create org, project and agent tokens with \
         `allotctl token create --scope ...`"
    )
}

pub fn digest(token: &str) -> TokenDigest {
    TokenDigest::of(token.as_bytes())
}

impl Client {
    /// Runs `command` on every shard (the operator's principals live on every shard),
    /// with request id `id` on each — each shard has its own idempotency table — reused
    /// on every retry, so running it again with the same `id` completes what a failed
    /// attempt left undone and answers as before where it was done. (It used `id + s` on
    /// shard `s`: the ids this client hands out next, so its next command on shard `s`
    /// was refused `RequestIdReused` there.)
    async fn on_every_shard(&self, what: &str, id: RequestId, command: Command) -> Result<()> {
        for shard in 0..self.shards().await? {
            match self.run_in(shard, None, id, command.clone()).await? {
                Reply::TokenSet => {}
                other => {
                    return Err(Error::Unexpected(format!(
                        "{what} on shard {shard}: unexpected reply {other:?}"
                    )))
                }
            }
        }
        Ok(())
    }

    /// Runs a token command where its principal lives: an org's principals (org,
    /// project and user tokens) on the org's home shard only — the only shard that
    /// org's requests ever reach, so creating one is a single, atomic write —; the
    /// operator's (admin and agent tokens) on every shard.
    async fn on_principal_shards(
        &self,
        what: &str,
        org: Option<OrgId>,
        base: RequestId,
        command: Command,
    ) -> Result<()> {
        let Some(org) = org else {
            return self.on_every_shard(what, base, command).await;
        };
        let shard = self.shard_of_org(org).await?;
        match self.run_in(shard, Some(org), base, command).await? {
            Reply::TokenSet => Ok(()),
            other => Err(Error::Unexpected(format!(
                "{what} on shard {shard}: unexpected reply {other:?}"
            ))),
        }
    }

    /// Installs the first admin token on every shard and so secures the cluster. Send
    /// it from a client *without* a token. Idempotent for the same token; refused with
    /// `AlreadyBootstrapped` on a shard secured with another one.
    pub async fn bootstrap(&self, principal: PrincipalId, token: &str) -> Result<()> {
        self.on_every_shard(
            "bootstrap",
            self.next_request_id(),
            Command::Bootstrap {
                principal,
                digest: digest(token),
            },
        )
        .await
    }

    /// Creates principal `principal` with `scope` and a new token (on its org's home
    /// shard, or on every shard for an admin or agent token); returns the token (shown
    /// once, stored nowhere).
    pub async fn create_token(
        &self,
        principal: PrincipalId,
        scope: Scope,
        expires_at_ms: Option<u64>,
    ) -> Result<String> {
        let token = generate_token()?;
        self.create_token_with(
            principal,
            scope,
            expires_at_ms,
            &token,
            self.next_request_id(),
        )
        .await?;
        Ok(token)
    }

    /// [`Client::create_token`] with a given token and request id: run it again with
    /// both to complete a creation whose first attempt failed part of the way (an admin
    /// or agent principal is written on every shard).
    pub async fn create_token_with(
        &self,
        principal: PrincipalId,
        scope: Scope,
        expires_at_ms: Option<u64>,
        token: &str,
        request_id: RequestId,
    ) -> Result<()> {
        self.on_principal_shards(
            "create token",
            scope.org(),
            request_id,
            Command::CreateToken {
                principal,
                digest: digest(token),
                scope,
                expires_at_ms,
            },
        )
        .await
    }

    /// Gives principal `principal` (of `org`; `None`: an admin or agent principal) a
    /// new token; its old ones stop working `overlap_ms` later.
    pub async fn rotate_token(
        &self,
        org: Option<OrgId>,
        principal: PrincipalId,
        overlap_ms: u64,
    ) -> Result<String> {
        let token = generate_token()?;
        self.on_principal_shards(
            "rotate token",
            org,
            self.next_request_id(),
            Command::RotateToken {
                principal,
                digest: digest(&token),
                overlap_ms,
            },
        )
        .await?;
        Ok(token)
    }

    /// Revokes every token of principal `principal` (of `org`; `None`: an admin or agent
    /// principal).
    pub async fn revoke_token(&self, org: Option<OrgId>, principal: PrincipalId) -> Result<()> {
        self.on_principal_shards(
            "revoke token",
            org,
            self.next_request_id(),
            Command::RevokeToken { principal },
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_tokens_are_long_distinct_and_accepted() {
        let a = generate_token().unwrap();
        let b = generate_token().unwrap();
        assert_ne!(a, b);
        assert!(a.starts_with(TOKEN_PREFIX));
        assert_eq!(a.len(), TOKEN_PREFIX.len() + 43);
        check_chosen_token(&a).unwrap();
        assert_ne!(digest(&a), digest(&b));
    }

    #[test]
    fn admin_token_files_are_created_private_or_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("allot-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("admin-token");
        let _ = std::fs::remove_file(&f);
        let (t, _) = admin_token(Some(&f)).unwrap();
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(admin_token(Some(&f)).unwrap().0, t, "read back");
        std::fs::write(&f, "too-short\n").unwrap();
        assert!(admin_token(Some(&f)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn short_or_unprintable_chosen_tokens_are_refused() {
        assert!(check_chosen_token("short").is_err());
        assert!(check_chosen_token(&"x y".repeat(20)).is_err());
        assert!(check_chosen_token(&"x".repeat(513)).is_err());
        assert!(check_chosen_token(&"x".repeat(32)).is_ok());
    }
}
