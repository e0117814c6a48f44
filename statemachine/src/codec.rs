//! The one place that knows the persisted encoding. bincode 1.x is frozen upstream
//! (RUSTSEC-2025-0141, "unmaintained"), so everything persisted goes through here, behind
//! a format-version byte: a future codec swap is a new version, not a silent change.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

/// The format this build writes, as the first byte of every persisted blob (log
/// entries' requests, snapshots, audit rows, backups, peer messages).
///
/// History (the encoding is positional bincode: a type whose layout changes needs a new
/// format and a frozen copy of its old shape for as long as the old format is read):
/// - 1 → 2, 3, 4 (2026): state, command and event layouts grew; each bump refused the
///   older format outright (no in-place upgrade).
/// - 5: the last format without rule versions.
/// - 6: the state gained its active rule version (`crate::version::Rules`, its last
///   field); commands `ActivateVersion`, reply `RulesActive` and the error
///   `UnsupportedRulesVersion` were appended (appended variants leave older bytes
///   decodable). Every other layout is format 5's, so format-5 blobs decode as format 6
///   does, and a format-5 state is read through `state::StateV5`.
/// - 7: the state's idempotency table is encoded compactly (its records in log order,
///   actors numbered; `crate::idempotency`), and the scheduler's result-dedup tables
///   follow the state's other fields. Only the state's layout changed: every
///   other blob is still written as format 6 ([`WIRE_FORMAT`]), and a state is written
///   as format 7 only from rule version 3 on (`crate::version::state_format`).
/// - 8: the state appends the scheduler's fence instants (`scheduler::Fence`: each
///   node's last renewal, each preemption's start), which rule version 4's silent-node
///   grace rule reads, and the ledger's retired grant ids (`ledger::Books::
///   retired_grants`). Written from rule version 5 on (both are recorded from its
///   activation). Only the state's layout changed.
pub const FORMAT_VERSION: u8 = 8;
/// The state's format under rule versions 3 and 4 (`crate::version::state_format`).
pub const COMPACT_TABLE_FORMAT: u8 = 7;
/// The format this build writes for every blob whose layout did not change in formats 7 and 8:
/// log entries' requests, audit rows, peer messages, backup frames other than the
/// state. A node of the previous release (format 6) reads them, so it can stay in the
/// cluster during a rolling upgrade.
pub const WIRE_FORMAT: u8 = 6;
/// The oldest format this build reads. The support window: a release reads what the
/// two releases before it wrote (docs/DESIGN.md §48); reading an older blob is a clear
/// refusal ([`CodecError::UnsupportedVersion`]), as is a newer one
/// ([`CodecError::NewerFormat`]) — never a misread.
pub const FORMAT_READ_MIN: u8 = 5;
/// The oldest format of the blobs kept for good: audit rows (events, and the batch rows
/// that keep each entry's commands). They are never rewritten — a restore and an audit
/// fill copy them byte for byte — and the trail is read from genesis for the life of
/// the cluster, so their reader is not [`FORMAT_READ_MIN`]'s window: a release that
/// raises that keeps reading audit rows from here. Never raised; the layouts they hold
/// ([`crate::AuditEvent`], the log entry and its commands) only ever grow by appended
/// variants, or keep a frozen shape for the formats that wrote the older one
/// (docs/DESIGN.md §48).
pub const KEPT_FORMAT_READ_MIN: u8 = 5;
const _: () = assert!(KEPT_FORMAT_READ_MIN <= FORMAT_READ_MIN);
/// The largest blob decode accepts (guards against hostile length prefixes).
pub const DECODE_BYTES_MAX: u64 = 4 << 30;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("empty input")]
    Empty,
    #[error("unsupported format version {0}: this build reads formats {FORMAT_READ_MIN} to {FORMAT_VERSION} (data older than the support window must be replayed or restored by an intermediate release)")]
    UnsupportedVersion(u8),
    #[error("format version {0} was written by a newer release: this build reads formats {FORMAT_READ_MIN} to {FORMAT_VERSION}; run a release that supports it")]
    NewerFormat(u8),
    #[error("malformed payload: {0}")]
    Malformed(String),
}

/// Whether this build reads blobs of format `version`: `Ok`, or the refusal.
pub fn check_version(version: u8) -> Result<(), CodecError> {
    check_version_from(FORMAT_READ_MIN, version)
}

fn check_version_from(oldest: u8, version: u8) -> Result<(), CodecError> {
    if version > FORMAT_VERSION {
        Err(CodecError::NewerFormat(version))
    } else if version < oldest {
        Err(CodecError::UnsupportedVersion(version))
    } else {
        Ok(())
    }
}

fn encode_options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_no_limit()
        .with_little_endian()
        .with_varint_encoding()
}

fn decode_options() -> impl Options {
    bincode::DefaultOptions::new()
        .with_limit(DECODE_BYTES_MAX)
        .with_little_endian()
        .with_varint_encoding()
        .reject_trailing_bytes()
}

/// Appends the encoding of `value` (without version byte) to `buf`.
pub fn encode_into<T: Serialize + ?Sized>(buf: &mut Vec<u8>, value: &T) {
    // Serialising our own in-memory types into a Vec with no size limit cannot fail: the
    // writer never errors and every type has a known length.
    if let Err(e) = encode_options().serialize_into(&mut *buf, value) {
        unreachable!("encoding an in-memory value failed: {e}");
    }
}

/// The length of `value`'s encoding (without version byte), computed without encoding
/// it. Saturates at `u64::MAX` for a value the encoder could not size.
pub fn encoded_len<T: Serialize + ?Sized>(value: &T) -> u64 {
    encode_options().serialized_size(value).unwrap_or(u64::MAX)
}

/// Versioned encoding: `[WIRE_FORMAT] ++ bincode(value)`, for every type whose layout
/// is format 6's (all but the state, which picks its format: `State::encode`).
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    encode_as(WIRE_FORMAT, value)
}

/// [`encode`] into `buf`, replacing what it held: the same bytes, written into a buffer
/// the caller keeps. A hot path that encodes one row after another (applying entries)
/// thus reuses memory it has already touched, where [`encode`] grows a fresh `Vec`
/// by doubling and the allocator hands it freshly zeroed pages.
pub fn encode_reusing<T: Serialize + ?Sized>(buf: &mut Vec<u8>, value: &T) {
    buf.clear();
    buf.push(WIRE_FORMAT);
    encode_into(buf, value);
}

/// `[version] ++ bincode(value)`: `value`'s serialisation must be the layout of format
/// `version`.
pub fn encode_as<T: Serialize + ?Sized>(version: u8, value: &T) -> Vec<u8> {
    let mut buf = vec![version];
    encode_into(&mut buf, value);
    buf
}

/// [`encode_as`] streamed into `w`: a large value (a backup's state) is never held
/// whole. Fails only when `w` does.
pub fn encode_to<T: Serialize + ?Sized, W: std::io::Write>(
    mut w: W,
    version: u8,
    value: &T,
) -> std::io::Result<()> {
    w.write_all(&[version])?;
    encode_body_to(w, value)
}

/// [`encode_into`] streamed into `w` (no version byte).
pub fn encode_body_to<T: Serialize + ?Sized, W: std::io::Write>(
    w: W,
    value: &T,
) -> std::io::Result<()> {
    encode_options()
        .serialize_into(w, value)
        .map_err(|e| match *e {
            bincode::ErrorKind::Io(e) => e,
            e => std::io::Error::other(e.to_string()),
        })
}

/// [`decode`] from a reader (a large blob on disk: a received snapshot), holding no more
/// than the decoder's buffer for input that does not decode. The reader must end where
/// the value does (trailing bytes are refused, as [`decode`] refuses them).
pub fn decode_from<T: DeserializeOwned, R: std::io::Read>(r: R) -> Result<T, CodecError> {
    decode_versioned_from(r, |_, r| decode_body_from(r))
}

/// The one reader of the version byte: checks it against the support window, then lets
/// `body` decode the rest as that version wrote it (a type whose layout changed between
/// formats reads its old shape there), then refuses trailing bytes.
pub fn decode_versioned_from<T, R: std::io::Read>(
    mut r: R,
    body: impl FnOnce(u8, &mut R) -> Result<T, CodecError>,
) -> Result<T, CodecError> {
    let mut version = [0u8; 1];
    match r.read_exact(&mut version) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(CodecError::Empty),
        Err(e) => return Err(CodecError::Malformed(e.to_string())),
    }
    check_version(version[0])?;
    let value = body(version[0], &mut r)?;
    match r.read(&mut [0u8; 1]) {
        Ok(0) => Ok(value),
        Ok(_) => Err(CodecError::Malformed(
            "trailing bytes after the value".into(),
        )),
        Err(e) => Err(CodecError::Malformed(e.to_string())),
    }
}

/// The body of a blob (after its version byte), as the current format lays it out.
pub fn decode_body_from<T: DeserializeOwned, R: std::io::Read>(r: &mut R) -> Result<T, CodecError> {
    decode_body_within(r, DECODE_BYTES_MAX)
}

/// [`decode_body_from`] of input known to hold at most `size` bytes. A length prefix is
/// checked against what is left of `size` before anything is allocated for it: the
/// reader's decoder sizes a string or byte buffer by its prefix before reading it, so
/// without the input's size an 11-byte blob claiming a 4 GiB string allocated (and
/// zeroed) 4 GiB before failing.
pub fn decode_body_within<T: DeserializeOwned, R: std::io::Read>(
    r: &mut R,
    size: u64,
) -> Result<T, CodecError> {
    bincode::DefaultOptions::new()
        .with_limit(size.min(DECODE_BYTES_MAX))
        .with_little_endian()
        .with_varint_encoding()
        .reject_trailing_bytes()
        .deserialize_from(r)
        .map_err(|e| CodecError::Malformed(e.to_string()))
}

/// Decodes a body (no version byte) the current format laid out, all of `bytes` and
/// nothing more.
pub fn decode_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_options()
        .deserialize(bytes)
        .map_err(|e| CodecError::Malformed(e.to_string()))
}

/// Decodes a versioned blob of a type whose layout is the same in every format of the
/// support window; any malformed input is an error, never a panic.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_from_format(FORMAT_READ_MIN, bytes)
}

/// [`decode`] of an audit row (events or a batch row), read from
/// [`KEPT_FORMAT_READ_MIN`] whatever the support window.
pub fn decode_kept<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    decode_from_format(KEPT_FORMAT_READ_MIN, bytes)
}

fn decode_from_format<T: DeserializeOwned>(oldest: u8, bytes: &[u8]) -> Result<T, CodecError> {
    let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    check_version_from(oldest, version)?;
    decode_options()
        .deserialize(rest)
        .map_err(|e| CodecError::Malformed(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blobs_outside_the_support_window_are_refused_by_name() {
        let mut blob = encode(&(7u64, "x".to_string()));
        assert_eq!(blob[0], WIRE_FORMAT);
        assert_eq!(decode::<(u64, String)>(&blob), Ok((7, "x".to_string())));
        blob[0] = FORMAT_VERSION + 1;
        assert_eq!(
            decode::<(u64, String)>(&blob),
            Err(CodecError::NewerFormat(FORMAT_VERSION + 1))
        );
        assert_eq!(
            decode_from::<(u64, String), _>(&blob[..]),
            Err(CodecError::NewerFormat(FORMAT_VERSION + 1))
        );
        blob[0] = FORMAT_READ_MIN - 1;
        assert_eq!(
            decode::<(u64, String)>(&blob),
            Err(CodecError::UnsupportedVersion(FORMAT_READ_MIN - 1))
        );
        // Every format of the window reads a type whose layout did not change.
        for v in FORMAT_READ_MIN..=FORMAT_VERSION {
            blob[0] = v;
            assert_eq!(decode::<(u64, String)>(&blob), Ok((7, "x".to_string())));
        }
        assert!(CodecError::NewerFormat(9)
            .to_string()
            .contains("newer release"));
    }

    /// Audit rows are read from their own oldest format, not the support window's: the
    /// trail is never rewritten, and a release that narrows the window for the log,
    /// snapshots and peers must still read it from genesis (found by review, twenty-
    /// first session: the next release's window would have refused this release's
    /// format-5 genesis rows).
    #[test]
    fn audit_rows_are_read_from_their_own_oldest_format() {
        let mut blob = encode(&(7u64, "x".to_string()));
        for v in KEPT_FORMAT_READ_MIN..=FORMAT_VERSION {
            blob[0] = v;
            assert_eq!(
                decode_kept::<(u64, String)>(&blob),
                Ok((7, "x".to_string()))
            );
        }
        blob[0] = KEPT_FORMAT_READ_MIN - 1;
        assert_eq!(
            decode_kept::<(u64, String)>(&blob),
            Err(CodecError::UnsupportedVersion(KEPT_FORMAT_READ_MIN - 1))
        );
        blob[0] = FORMAT_VERSION + 1;
        assert_eq!(
            decode_kept::<(u64, String)>(&blob),
            Err(CodecError::NewerFormat(FORMAT_VERSION + 1))
        );
        // The oldest trail in the field was written in format 5 (`tests/fixtures/format5`).
        assert_eq!(KEPT_FORMAT_READ_MIN, 5);
        assert_eq!(decode_kept::<()>(&[]), Err(CodecError::Empty));
    }

    #[test]
    fn encoding_into_a_kept_buffer_gives_the_same_bytes() {
        let mut buf = b"what the buffer held before, longer than the next value".to_vec();
        for value in [
            (7u64, "x".to_string()),
            (u64::MAX, "y".repeat(300)),
            (0, String::new()),
        ] {
            encode_reusing(&mut buf, &value);
            assert_eq!(buf, encode(&value), "{value:?}");
            assert_eq!(decode::<(u64, String)>(&buf), Ok(value));
        }
    }
}
