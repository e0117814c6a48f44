//! The one place that knows the persisted encoding. bincode 1.x is frozen upstream
//! (RUSTSEC-2025-0141, "unmaintained"), so everything persisted goes through here, behind
//! a format-version byte: a future codec swap is a new version, not a silent change.

use bincode::Options;
use serde::{de::DeserializeOwned, Serialize};

/// The current format version, written as the first byte of every persisted blob.
/// 2 (2026-11-25): the scheduler's state gained fields (node shapes, share weights,
/// node-failure requeues), so blobs of format 1 — snapshots, logged commands, audit rows
/// — no longer decode; they are refused by version instead of misread. There is no
/// in-place upgrade: a format-1 cluster moves by replaying its commands or starting anew.
///
/// 3: the state gained the alerts table (`crate::alerts`), audit events `LowBalance` and
/// `BudgetThreshold`, commands `IssueGrantIn` and `SetAlert` (appended: format-2 log
/// entries and audit rows would decode, but snapshots would not, so the byte moves).
///
/// 4: a node's agent incarnation (`NodeSpec::incarnation`, `GpuNode::incarnation`):
/// logged `RegisterNode` commands and snapshots of format 3 no longer decode.
pub const FORMAT_VERSION: u8 = 5;
/// The largest blob decode accepts (guards against hostile length prefixes).
pub const DECODE_BYTES_MAX: u64 = 4 << 30;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    #[error("empty input")]
    Empty,
    #[error("unsupported format version {0} (this build reads {FORMAT_VERSION})")]
    UnsupportedVersion(u8),
    #[error("malformed payload: {0}")]
    Malformed(String),
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

/// Versioned encoding: `[FORMAT_VERSION] ++ bincode(value)`.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    let mut buf = vec![FORMAT_VERSION];
    encode_into(&mut buf, value);
    buf
}

/// [`decode`] from a reader (a large blob on disk: a received snapshot), holding no more
/// than the decoder's buffer for input that does not decode. The reader must end where
/// the value does (trailing bytes are refused, as [`decode`] refuses them).
pub fn decode_from<T: DeserializeOwned, R: std::io::Read>(mut r: R) -> Result<T, CodecError> {
    let mut version = [0u8; 1];
    match r.read_exact(&mut version) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(CodecError::Empty),
        Err(e) => return Err(CodecError::Malformed(e.to_string())),
    }
    if version[0] != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion(version[0]));
    }
    let value = decode_options()
        .deserialize_from(&mut r)
        .map_err(|e| CodecError::Malformed(e.to_string()))?;
    match r.read(&mut [0u8; 1]) {
        Ok(0) => Ok(value),
        Ok(_) => Err(CodecError::Malformed(
            "trailing bytes after the value".into(),
        )),
        Err(e) => Err(CodecError::Malformed(e.to_string())),
    }
}

/// Decodes a versioned blob; any malformed input is an error, never a panic.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    let (&version, rest) = bytes.split_first().ok_or(CodecError::Empty)?;
    if version != FORMAT_VERSION {
        return Err(CodecError::UnsupportedVersion(version));
    }
    decode_options()
        .deserialize(rest)
        .map_err(|e| CodecError::Malformed(e.to_string()))
}
