//! Parsers of flag values (clap `value_parser`s): a bad value is a usage error before
//! anything is sent.

use allot_client::{parse_credits, parse_duration_ms};
use allot_statemachine::scheduler::JobState;
use allot_statemachine::{
    Account, Actor, BucketKind, BudgetMode, BudgetPeriod, BudgetScope, GpuType, OrgId, ProjectId,
    UserId,
};
use std::time::Duration;

/// Credits with up to six decimals, as micro-credits.
pub fn credits(s: &str) -> Result<u64, String> {
    parse_credits(s).map_err(message)
}

pub fn duration_ms(s: &str) -> Result<u64, String> {
    parse_duration_ms(s).map_err(message)
}

/// The library's message without its "invalid argument: " prefix.
fn message(e: allot_client::Error) -> String {
    match e {
        allot_client::Error::InvalidArgument(m) => m,
        e => e.to_string(),
    }
}

pub fn duration(s: &str) -> Result<Duration, String> {
    duration_ms(s).map(Duration::from_millis)
}

/// An instant: unix milliseconds, or `YYYY-MM-DDTHH:MM:SS[.fff]Z`.
pub fn instant_ms(s: &str) -> Result<u64, String> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse().map_err(|_| format!("instant {s:?}: too large"));
    }
    crate::timefmt::parse_rfc3339(s).ok_or_else(|| {
        format!("instant {s:?}: expected unix milliseconds or e.g. 2025-01-31T12:00:00Z")
    })
}

/// A lower or upper bound of a time range: an instant (see [`instant_ms`]) or a
/// duration before now (`10m` = ten minutes ago).
pub fn since_ms(s: &str) -> Result<u64, String> {
    if s.contains('T') || s.bytes().all(|b| b.is_ascii_digit()) {
        return instant_ms(s);
    }
    let ago = duration_ms(s)
        .map_err(|_| format!("{s:?}: expected an instant or a duration ago (10m)"))?;
    Ok(crate::timefmt::now_ms().saturating_sub(ago))
}

/// `admin`, `org:<id>` (a tenant of that org, principal 1) or `agent:<node id>`.
pub fn identity(s: &str) -> Result<Actor, String> {
    // The same parser as the typed API's `dev_actor` field: one rule for the text.
    match allot_proto::typed::dev_actor(s, "identity") {
        Ok(Some(actor)) => Ok(actor),
        Ok(None) => Err("identity: expected admin, org:<id> or agent:<node>".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// One tier's changes for `scheduler configure --tier`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierChange {
    pub tier: TierArg,
    pub weight: Option<u32>,
    pub floor_pct: Option<u32>,
    pub ceiling_pct: Option<u32>,
    pub max_wait_ms: Option<u64>,
    pub price_pct: Option<u32>,
}

/// `<tier>:<key>=<value>,...` (keys weight, floor, ceiling, max-wait, price).
pub fn tier_change(s: &str) -> Result<TierChange, String> {
    let bad = |why: String| {
        format!("--tier {s:?}: {why} (expected e.g. paid:weight=3,floor=20,max-wait=2h)")
    };
    let (tier, settings) = s
        .split_once(':')
        .ok_or_else(|| bad("missing ':' after the tier".into()))?;
    let mut c = TierChange {
        tier: self::tier(tier).map_err(bad)?,
        weight: None,
        floor_pct: None,
        ceiling_pct: None,
        max_wait_ms: None,
        price_pct: None,
    };
    for kv in settings.split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| bad(format!("{kv:?} is not key=value")))?;
        let num = |v: &str| {
            v.parse::<u32>()
                .map_err(|_| bad(format!("{k}={v}: expected a whole number")))
        };
        match k {
            "weight" => c.weight = Some(num(v)?),
            "floor" => c.floor_pct = Some(num(v)?),
            "ceiling" => c.ceiling_pct = Some(num(v)?),
            "price" => c.price_pct = Some(num(v)?),
            "max-wait" | "max_wait" => c.max_wait_ms = Some(duration_ms(v).map_err(bad)?),
            _ => {
                return Err(bad(format!(
                    "unknown key {k:?}: weight, floor, ceiling, max-wait or price"
                )))
            }
        }
    }
    if [c.weight, c.floor_pct, c.ceiling_pct, c.price_pct]
        .iter()
        .all(Option::is_none)
        && c.max_wait_ms.is_none()
    {
        return Err(bad("no setting given".into()));
    }
    Ok(c)
}

/// A request id: decimal, or hexadecimal after `0x` (as `audit` prints them); not zero.
pub fn request_id(s: &str) -> Result<u128, String> {
    let parsed = match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u128::from_str_radix(hex, 16),
        None => s.parse::<u128>(),
    };
    match parsed {
        Ok(0) => Err("request id: must not be zero".into()),
        Ok(id) => Ok(id),
        Err(_) => Err(format!(
            "request id {s:?}: expected a decimal number or 0x followed by hex digits (128 bits)"
        )),
    }
}

/// A Raft member: `<node id>=<host:port>`.
pub fn member(s: &str) -> Result<(u64, String), String> {
    let bad = || format!("member {s:?}: expected <node id>=<host:port>, e.g. 1=10.0.0.1:7101");
    let (id, addr) = s.split_once('=').ok_or_else(bad)?;
    let id: u64 = id.trim().parse().map_err(|_| bad())?;
    let addr = addr.trim();
    if id == 0 || !addr.contains(':') {
        return Err(bad());
    }
    Ok((id, addr.to_string()))
}

/// A node label `key=value`.
pub fn label(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("label {s:?}: expected key=value")),
    }
}

/// A GPU type name; upper-cased (`a100` → `A100`), validated as the state machine does.
pub fn gpu_type(s: &str) -> Result<GpuType, String> {
    let t = GpuType(s.trim().to_ascii_uppercase());
    if t.is_valid() {
        Ok(t)
    } else {
        Err(format!(
            "GPU type {s:?}: 1 to 16 characters of A-Z, 0-9, '_' or '-'"
        ))
    }
}

/// A price: `<GPU type>=<credits per GPU-hour>`.
pub fn price(s: &str) -> Result<(GpuType, u64), String> {
    let (t, c) = s.split_once('=').ok_or_else(|| {
        format!("price {s:?}: expected <GPU type>=<credits per GPU-hour>, e.g. A100=2.5")
    })?;
    let micro = credits(c)?;
    if micro == 0 {
        return Err(format!("price {s:?}: must be positive"));
    }
    Ok((gpu_type(t)?, micro))
}

/// The account owning a bucket: `org` or `project:<id>`.
#[derive(Clone, Copy, Debug)]
pub enum Owner {
    Org,
    Project(u64),
}

pub fn owner(s: &str) -> Result<Owner, String> {
    match s.split_once(':') {
        None if s == "org" => Ok(Owner::Org),
        Some(("project", p)) => p
            .parse()
            .map(Owner::Project)
            .map_err(|_| format!("owner {s:?}: expected org or project:<id>")),
        _ => Err(format!("owner {s:?}: expected org or project:<id>")),
    }
}

impl Owner {
    pub fn account(self, org: OrgId) -> Account {
        match self {
            Owner::Org => Account::Org(org),
            Owner::Project(p) => Account::Project(ProjectId(p)),
        }
    }
}

/// A budget scope: `org`, `project:<id>` or `user:<id>`.
#[derive(Clone, Copy, Debug)]
pub enum Scope {
    Org,
    Project(u64),
    User(u64),
}

pub fn scope(s: &str) -> Result<Scope, String> {
    let bad = || format!("scope {s:?}: expected org, project:<id> or user:<id>");
    if s == "org" {
        return Ok(Scope::Org);
    }
    let (kind, id) = s.split_once(':').ok_or_else(bad)?;
    let id: u64 = id.parse().map_err(|_| bad())?;
    match kind {
        "project" => Ok(Scope::Project(id)),
        "user" => Ok(Scope::User(id)),
        _ => Err(bad()),
    }
}

impl Scope {
    pub fn budget_scope(self, org: OrgId) -> BudgetScope {
        match self {
            Scope::Org => BudgetScope::Org(org),
            Scope::Project(p) => BudgetScope::Project(ProjectId(p)),
            Scope::User(u) => BudgetScope::User(UserId(u)),
        }
    }
}

/// A tier by name (resolved against the shard's scheduler settings) or number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TierArg {
    Name(String),
    Number(u8),
}

pub fn tier(s: &str) -> Result<TierArg, String> {
    if s.is_empty() {
        return Err("tier: empty".into());
    }
    if s.bytes().all(|b| b.is_ascii_digit()) {
        return s
            .parse()
            .map(TierArg::Number)
            .map_err(|_| format!("tier {s:?}: at most 255"));
    }
    Ok(TierArg::Name(s.to_ascii_lowercase()))
}

pub fn bucket_kind(s: &str) -> Result<BucketKind, String> {
    match s {
        "paid" => Ok(BucketKind::Paid),
        "promotional" | "promo" => Ok(BucketKind::Promotional),
        "granted" => Ok(BucketKind::Granted),
        _ => Err(format!("kind {s:?}: expected paid, promotional or granted")),
    }
}

pub fn period(s: &str) -> Result<BudgetPeriod, String> {
    match s {
        "day" => Ok(BudgetPeriod::Day),
        "month" => Ok(BudgetPeriod::Month),
        "lifetime" => Ok(BudgetPeriod::Lifetime),
        _ => Err(format!("period {s:?}: expected day, month or lifetime")),
    }
}

pub fn mode(s: &str) -> Result<BudgetMode, String> {
    match s {
        "hard" => Ok(BudgetMode::Hard),
        "soft" => Ok(BudgetMode::Soft),
        _ => Err(format!("mode {s:?}: expected hard or soft")),
    }
}

pub const JOB_STATES: [JobState; 9] = [
    JobState::Queued,
    JobState::Placed,
    JobState::Running,
    JobState::Preempting,
    JobState::Succeeded,
    JobState::Failed,
    JobState::Lost,
    JobState::Cancelled,
    JobState::Rejected,
];

pub fn job_state(s: &str) -> Result<JobState, String> {
    JOB_STATES
        .iter()
        .find(|st| format!("{st:?}").eq_ignore_ascii_case(s))
        .copied()
        .ok_or_else(|| {
            format!("state {s:?}: expected queued, placed, running, preempting, succeeded, failed, lost, cancelled or rejected")
        })
}

/// A weighted operation mix (one flag value, hence the newtype).
#[derive(Clone, Debug)]
pub struct Mix(pub Vec<(String, u32)>);

/// A weighted operation mix, `hold=1,capture=2,release=1,balance=0`.
pub fn mix(s: &str) -> Result<Mix, String> {
    let mut out = Vec::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        let (k, w) = part
            .split_once('=')
            .ok_or_else(|| format!("mix {part:?}: expected <op>=<weight>"))?;
        if !["hold", "capture", "release", "balance"].contains(&k) {
            return Err(format!(
                "mix op {k:?}: expected hold, capture, release or balance"
            ));
        }
        let w: u32 = w
            .parse()
            .map_err(|_| format!("mix weight {w:?}: expected a whole number"))?;
        out.push((k.to_string(), w));
    }
    if out.iter().all(|(_, w)| *w == 0) {
        return Err("mix: at least one positive weight".into());
    }
    Ok(Mix(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_or_refuse() {
        assert_eq!(credits("12.5"), Ok(12_500_000));
        assert!(credits("1.1234567").is_err());
        assert_eq!(member("2=127.0.0.1:7102").unwrap().0, 2);
        assert!(member("0=h:1").is_err() && member("x").is_err());
        assert!(matches!(
            identity("org:7"),
            Ok(Actor::Tenant { org: OrgId(7), .. })
        ));
        assert!(identity("root").is_err());
        assert_eq!(gpu_type("a100").unwrap().0, "A100");
        assert_eq!(price("H100=4").unwrap().1, 4_000_000);
        assert!(price("H100=0").is_err());
        assert!(matches!(owner("project:3"), Ok(Owner::Project(3))));
        assert_eq!(job_state("running"), Ok(JobState::Running));
        assert_eq!(instant_ms("1700000000000"), Ok(1_700_000_000_000));
        assert_eq!(instant_ms("2023-11-14T22:13:20Z"), Ok(1_700_000_000_000));
        assert!(mix("hold=1,bogus=2").is_err());
    }
}
