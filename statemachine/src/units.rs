//! Credits as people read them: micro-credits (the ledger's exact unit) shown as
//! credits with six decimals. One rule for every message and view.

pub const MICRO_PER_CREDIT: u64 = 1_000_000;

/// `12500000` → `"12.500000"`.
pub fn credits(micro: u64) -> String {
    format!(
        "{}.{:06}",
        micro / MICRO_PER_CREDIT,
        micro % MICRO_PER_CREDIT
    )
}
