//! The streamed backup file (DESIGN §41): written and read in bounded pieces, so neither
//! the node taking a backup nor `allotctl` writing it nor a restore ever holds the audit
//! trail, and only a restore holds the state.
//!
//! ```text
//! file  = MAGIC frame*                      MAGIC = "ALLOTBK" ++ layout version (1)
//! frame = tag:u8 len:u32le payload[len]     len <= FRAME_MAX
//!   1 Header  codec(BackupHeader)           exactly one, first
//!   2 State   raw bytes                     the concatenation is State::encode()
//!   3 Audit   codec(Vec<AuditRow>)          rows in log order: an entry's batch row,
//!                                           then its events rows
//!   4 End     codec(BackupEnd)              last; its checksum covers every byte before it
//! ```
//!
//! Everything that can be checked in one pass is checked while reading ([`BackupReader`]):
//! framing and order, the checksum (a truncated or corrupted file is refused by type),
//! the state's hash, the audit chain from genesis to the header's chain head, and every
//! command event against its entry's command. [`read_verified`] adds what needs the
//! decoded state: the invariants, and that the state agrees with the header.

use super::{
    token_view, AuditRow, AuditRowKind, BackupError, BackupSummary, LogPosition, ShardBackup,
    TokenView,
};
use crate::audit::{command_digest, command_of, verify_chain, AuditChain, AuditEvent, EventBody};
use crate::codec;
use crate::command::Entry;
use crate::invariants::check_invariants;
use crate::state::State;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{self, Read, Write};

/// The first bytes of a streamed backup: "ALLOTBK" and the stream layout's version.
/// (A backup of the releases before it is one `codec::encode(&ShardBackup)`, whose first
/// byte is a format version: 5 or 6, never `A`.)
pub const MAGIC: [u8; 8] = *b"ALLOTBK\x01";
/// Frames are written up to this size (state chunks, batches of audit rows) …
pub const FRAME_TARGET: usize = 1 << 20;
/// … and read up to this one: a single audit row (one entry's commands) may exceed the
/// target, and a hostile length prefix allocates no more than this.
pub const FRAME_MAX: u32 = 64 << 20;

const TAG_HEADER: u8 = 1;
const TAG_STATE: u8 = 2;
const TAG_AUDIT: u8 = 3;
const TAG_END: u8 = 4;

/// What a backup copies besides its state and rows: where the state sits in the log,
/// and the facts about the state that a reader checks without decoding it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupHeader {
    pub shard: u32,
    /// The cluster's shard count (a restore must start with the same).
    pub shards: u32,
    /// `None`: the shard had applied nothing yet.
    pub position: Option<LogPosition>,
    /// The voters at that position: (node id, address).
    pub members: Vec<(u64, String)>,
    pub logical_time_ms: u64,
    /// The state's audit chain head: the rows must end exactly there.
    pub audit_head: AuditChain,
    /// The state's active rule version (a restoring binary must support it).
    pub rules_active: u32,
    /// The operator's tokens as the state holds them: backups of a cluster's shards are
    /// compared on this before any is restored.
    pub tokens: TokenView,
}

impl BackupHeader {
    pub fn of(
        state: &State,
        shard: u32,
        shards: u32,
        position: Option<LogPosition>,
        members: Vec<(u64, String)>,
    ) -> BackupHeader {
        BackupHeader {
            shard,
            shards,
            position,
            members,
            logical_time_ms: state.time_ms,
            audit_head: state.audit.clone(),
            rules_active: state.rules.active,
            tokens: token_view(state),
        }
    }

    /// Where the decoded state disagrees with this header (`None`: it agrees).
    fn disagreement(&self, state: &State) -> Option<&'static str> {
        if state.audit != self.audit_head {
            Some("audit chain head")
        } else if state.time_ms != self.logical_time_ms {
            Some("logical time")
        } else if state.rules.active != self.rules_active {
            Some("rule version")
        } else if token_view(state) != self.tokens {
            Some("operator tokens")
        } else if state.last_applied > self.position.map(|p| p.index) {
            // Entries without commands for the state machine (a leader's blank entry, a
            // membership change) advance the position, not the state's own index.
            Some("applied index")
        } else {
            None
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct BackupEnd {
    state_hash: [u8; 32],
    state_bytes: u64,
    audit_rows: u64,
    /// SHA-256 of every byte of the file before the End frame.
    checksum: [u8; 32],
}

/// Writes a streamed backup: [`BackupWriter::start`], [`BackupWriter::state`] once,
/// [`BackupWriter::audit_row`] per row in log order, [`BackupWriter::finish`]. Holds at
/// most one frame.
pub struct BackupWriter<W: Write> {
    out: W,
    checksum: Sha256,
    state_hash: Sha256,
    state_bytes: u64,
    state_written: bool,
    audit_rows: u64,
    rows: Vec<AuditRow>,
    rows_bytes: usize,
    frame_bytes: usize,
}

fn frame_to<W: Write>(out: &mut W, sum: &mut Sha256, tag: u8, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= FRAME_MAX)
        .ok_or_else(|| io::Error::other(format!("a backup frame of {} bytes", payload.len())))?;
    let mut head = [0u8; 5];
    head[0] = tag;
    head[1..].copy_from_slice(&len.to_le_bytes());
    sum.update(head);
    sum.update(payload);
    out.write_all(&head)?;
    out.write_all(payload)
}

impl<W: Write> BackupWriter<W> {
    pub fn start(mut out: W, header: &BackupHeader) -> io::Result<BackupWriter<W>> {
        let mut checksum = Sha256::new();
        checksum.update(MAGIC);
        out.write_all(&MAGIC)?;
        frame_to(&mut out, &mut checksum, TAG_HEADER, &codec::encode(header))?;
        Ok(BackupWriter {
            out,
            checksum,
            state_hash: Sha256::new(),
            state_bytes: 0,
            state_written: false,
            audit_rows: 0,
            rows: Vec::new(),
            rows_bytes: 0,
            frame_bytes: FRAME_TARGET,
        })
    }

    /// Frames of about `n` bytes instead of [`FRAME_TARGET`] (any size reads back).
    pub fn with_frame_bytes(mut self, n: usize) -> BackupWriter<W> {
        self.frame_bytes = n.clamp(1, FRAME_MAX as usize);
        self
    }

    /// Streams `state`'s encoding in frames of [`FRAME_TARGET`] bytes.
    pub fn state(&mut self, state: &State) -> io::Result<()> {
        if self.state_written || self.audit_rows > 0 {
            return Err(io::Error::other(
                "the state goes once, before the audit rows",
            ));
        }
        self.state_written = true;
        let mut frames = StateFrames {
            buf: Vec::with_capacity(self.frame_bytes),
            w: self,
        };
        state.encode_to(&mut frames)?;
        frames.flush()
    }

    fn state_frame(&mut self, bytes: &[u8]) -> io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        // The state hash covers the encoding after its version byte (State::state_hash).
        let skip = usize::from(self.state_bytes == 0);
        self.state_hash.update(&bytes[skip..]);
        self.state_bytes += bytes.len() as u64;
        frame_to(&mut self.out, &mut self.checksum, TAG_STATE, bytes)
    }

    /// Adds one audit row (rows go in log order: [`merge_rows`]).
    pub fn audit_row(&mut self, row: AuditRow) -> io::Result<()> {
        self.rows_bytes += row.value.len() + 16;
        self.rows.push(row);
        self.audit_rows += 1;
        if self.rows_bytes >= self.frame_bytes {
            self.flush_rows()?;
        }
        Ok(())
    }

    fn flush_rows(&mut self) -> io::Result<()> {
        if self.rows.is_empty() {
            return Ok(());
        }
        let payload = codec::encode(&self.rows);
        self.rows.clear();
        self.rows_bytes = 0;
        frame_to(&mut self.out, &mut self.checksum, TAG_AUDIT, &payload)
    }

    /// Writes the End frame and returns the output (flushed).
    pub fn finish(mut self) -> io::Result<W> {
        if !self.state_written {
            return Err(io::Error::other("a backup without its state"));
        }
        self.flush_rows()?;
        let end = BackupEnd {
            state_hash: self.state_hash.clone().finalize().into(),
            state_bytes: self.state_bytes,
            audit_rows: self.audit_rows,
            checksum: self.checksum.clone().finalize().into(),
        };
        let mut sink = Sha256::new();
        frame_to(&mut self.out, &mut sink, TAG_END, &codec::encode(&end))?;
        self.out.flush()?;
        Ok(self.out)
    }
}

/// The state's encoding cut into frames as the encoder writes it.
struct StateFrames<'a, W: Write> {
    w: &'a mut BackupWriter<W>,
    buf: Vec<u8>,
}

impl<W: Write> Write for StateFrames<'_, W> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let target = self.w.frame_bytes;
        let take = bytes.len().min(target - self.buf.len());
        self.buf.extend_from_slice(&bytes[..take]);
        if self.buf.len() == target {
            self.w.state_frame(&self.buf)?;
            self.buf.clear();
        }
        Ok(take)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.w.state_frame(&self.buf)?;
        self.buf.clear();
        Ok(())
    }
}

/// The log index of an events row (its events all come from one entry).
pub fn events_row_index(value: &[u8]) -> Result<u64, BackupError> {
    let events: Vec<AuditEvent> = codec::decode_kept(value)?;
    events
        .first()
        .map(|e| e.log_index)
        .ok_or_else(|| BackupError::Frame("an empty events row".into()))
}

/// Merges a shard's events rows (in sequence order) and batch rows (in index order) into
/// log order: each entry's batch row before its events rows — the order a reader checks
/// commands in without holding more than one entry.
pub fn merge_rows<E>(
    events: impl Iterator<Item = Result<AuditRow, E>>,
    batches: impl Iterator<Item = Result<AuditRow, E>>,
) -> impl Iterator<Item = Result<AuditRow, E>>
where
    E: From<BackupError>,
{
    let mut events = events.peekable();
    let mut batches = batches.peekable();
    let mut next_event_index: Option<u64> = None;
    std::iter::from_fn(move || {
        if next_event_index.is_none() {
            match events.peek() {
                Some(Ok(row)) => match events_row_index(&row.value) {
                    Ok(i) => next_event_index = Some(i),
                    Err(e) => return Some(Err(E::from(e))),
                },
                Some(Err(_)) => return events.next(),
                None => {}
            }
        }
        let batch_first = match (batches.peek(), next_event_index) {
            (Some(Err(_)), _) => return batches.next(),
            (Some(Ok(b)), Some(e)) => b.key <= e,
            (Some(Ok(_)), None) => true,
            (None, _) => false,
        };
        if batch_first {
            batches.next()
        } else {
            next_event_index = None;
            events.next()
        }
    })
}

/// One piece of a backup, in file order.
#[derive(Debug)]
pub enum BackupItem {
    /// The next bytes of the state's encoding.
    State(Vec<u8>),
    /// The next audit rows (already checked: chain, keys, commands).
    Audit(Vec<AuditRow>),
}

/// Reads and checks a streamed backup piece by piece, holding at most one frame and the
/// current entry's commands.
pub struct BackupReader<R: Read> {
    input: R,
    header: BackupHeader,
    checksum: Sha256,
    state_hash: Sha256,
    state_bytes: u64,
    audit_started: bool,
    audit_rows: u64,
    chain: AuditChain,
    entry: Option<Entry>,
    last_batch: Option<u64>,
    last_events_index: Option<u64>,
    batches: u64,
    summary: Option<BackupSummary>,
    scratch: Vec<u8>,
}

fn read_full<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<(), BackupError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => BackupError::Truncated,
        _ => BackupError::Io(e.to_string()),
    })
}

impl<R: Read> BackupReader<R> {
    /// Reads the magic and the header.
    pub fn open(mut input: R) -> Result<BackupReader<R>, BackupError> {
        let mut magic = [0u8; 8];
        read_full(&mut input, &mut magic)?;
        check_magic(&magic)?;
        let mut checksum = Sha256::new();
        checksum.update(magic);
        let (tag, payload) = read_frame(&mut input, &mut checksum)?;
        if tag != TAG_HEADER {
            return Err(BackupError::Frame(format!(
                "the first frame has tag {tag}, not the header"
            )));
        }
        let header: BackupHeader = codec::decode(&payload)?;
        if header.shard >= header.shards {
            return Err(BackupError::ShardOutOfRange {
                shard: header.shard,
                shards: header.shards,
            });
        }
        Ok(BackupReader {
            input,
            header,
            checksum,
            state_hash: Sha256::new(),
            state_bytes: 0,
            audit_started: false,
            audit_rows: 0,
            chain: AuditChain::default(),
            entry: None,
            last_batch: None,
            last_events_index: None,
            batches: 0,
            summary: None,
            scratch: Vec::new(),
        })
    }

    pub fn header(&self) -> &BackupHeader {
        &self.header
    }

    /// The summary, once [`BackupReader::next_item`] returned `None` (the End frame
    /// checked).
    pub fn summary(&self) -> Option<&BackupSummary> {
        self.summary.as_ref()
    }

    /// The next piece, checked; `None` after the End frame, once everything it records
    /// matched.
    pub fn next_item(&mut self) -> Result<Option<BackupItem>, BackupError> {
        if self.summary.is_some() {
            return Ok(None);
        }
        let before = self.checksum.clone();
        let (tag, payload) = read_frame(&mut self.input, &mut self.checksum)?;
        match tag {
            TAG_STATE if !self.audit_started => {
                let skip = usize::from(self.state_bytes == 0).min(payload.len());
                self.state_hash.update(&payload[skip..]);
                self.state_bytes += payload.len() as u64;
                Ok(Some(BackupItem::State(payload)))
            }
            TAG_AUDIT if self.state_bytes > 0 => {
                self.audit_started = true;
                let rows: Vec<AuditRow> = codec::decode(&payload)?;
                for row in &rows {
                    self.check_row(row)?;
                }
                self.audit_rows += rows.len() as u64;
                Ok(Some(BackupItem::Audit(rows)))
            }
            TAG_END if self.state_bytes > 0 => {
                self.end(&payload, before)?;
                Ok(None)
            }
            tag => Err(BackupError::Frame(format!(
                "a frame with tag {tag} where it does not belong"
            ))),
        }
    }

    fn check_row(&mut self, row: &AuditRow) -> Result<(), BackupError> {
        let row_error = |problem: String| BackupError::AuditRow {
            key: row.key,
            problem,
        };
        match row.kind {
            AuditRowKind::Batch => {
                let entry: Entry =
                    codec::decode_kept(&row.value).map_err(|e| row_error(e.to_string()))?;
                let beyond = self
                    .header
                    .position
                    .is_none_or(|p| entry.log_index > p.index);
                let backwards = self.last_batch.is_some_and(|last| row.key <= last)
                    || self.last_events_index.is_some_and(|last| row.key <= last);
                if entry.log_index != row.key || beyond || backwards {
                    return Err(row_error(format!(
                        "holds the commands of entry {} (out of place)",
                        entry.log_index
                    )));
                }
                self.last_batch = Some(row.key);
                self.batches += 1;
                self.entry = Some(entry);
            }
            AuditRowKind::Events => {
                let events: Vec<AuditEvent> =
                    codec::decode_kept(&row.value).map_err(|e| row_error(e.to_string()))?;
                let first = events
                    .first()
                    .ok_or_else(|| row_error("no events".into()))?;
                if first.seq != row.key {
                    return Err(row_error("keyed by another event than its first".into()));
                }
                let index = first.log_index;
                let backwards = self.last_events_index.is_some_and(|last| index < last);
                if events.iter().any(|e| e.log_index != index) || backwards {
                    return Err(row_error(
                        "events of several entries, or out of order".into(),
                    ));
                }
                self.last_events_index = Some(index);
                self.chain = verify_chain(&self.chain, &events)
                    .map_err(|e| BackupError::AuditChain(format!("{e:?}")))?;
                for ev in &events {
                    let EventBody::Command { digest, .. } = &ev.body else {
                        continue;
                    };
                    let command = self
                        .entry
                        .as_ref()
                        .and_then(|entry| command_of(ev, entry))
                        .ok_or_else(|| {
                            BackupError::AuditCommands(format!(
                                "event {}: its entry {} is not before it",
                                ev.seq, ev.log_index
                            ))
                        })?;
                    if command_digest(command, &mut self.scratch) != *digest {
                        return Err(BackupError::AuditCommands(format!(
                            "event {}: the command does not match its digest",
                            ev.seq
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    fn end(&mut self, payload: &[u8], before: Sha256) -> Result<(), BackupError> {
        let end: BackupEnd = codec::decode(payload)?;
        let checksum: [u8; 32] = before.finalize().into();
        if end.checksum != checksum {
            return Err(BackupError::Checksum);
        }
        if end.state_bytes != self.state_bytes || end.audit_rows != self.audit_rows {
            return Err(BackupError::Frame(format!(
                "the end records {} state bytes and {} rows; the file holds {} and {}",
                end.state_bytes, end.audit_rows, self.state_bytes, self.audit_rows
            )));
        }
        let state_hash: [u8; 32] = self.state_hash.clone().finalize().into();
        if state_hash != end.state_hash {
            return Err(BackupError::HashMismatch);
        }
        if self.chain != self.header.audit_head {
            return Err(BackupError::AuditIncomplete {
                found: self.chain.next_seq,
                expected: self.header.audit_head.next_seq,
            });
        }
        match self.input.read(&mut [0u8; 1]) {
            Ok(0) => {}
            Ok(_) => return Err(BackupError::Frame("bytes after the end".into())),
            Err(e) => return Err(BackupError::Io(e.to_string())),
        }
        self.summary = Some(BackupSummary {
            shard: self.header.shard,
            position: self.header.position,
            state_hash,
            logical_time_ms: self.header.logical_time_ms,
            audit_events: self.chain.next_seq,
            audit_batches: self.batches,
        });
        Ok(())
    }
}

fn check_magic(magic: &[u8; 8]) -> Result<(), BackupError> {
    if magic[..7] != MAGIC[..7] {
        return Err(BackupError::Frame("not a streamed allot backup".into()));
    }
    if magic[7] > MAGIC[7] {
        return Err(BackupError::NewerLayout(magic[7]));
    }
    if magic[7] < MAGIC[7] {
        return Err(BackupError::Frame(format!(
            "unknown backup layout {}",
            magic[7]
        )));
    }
    Ok(())
}

fn read_frame<R: Read>(r: &mut R, sum: &mut Sha256) -> Result<(u8, Vec<u8>), BackupError> {
    let mut head = [0u8; 5];
    read_full(r, &mut head)?;
    let mut len = [0u8; 4];
    len.copy_from_slice(&head[1..]);
    let len = u32::from_le_bytes(len);
    if len > FRAME_MAX {
        return Err(BackupError::Frame(format!(
            "a frame of {len} bytes (at most {FRAME_MAX})"
        )));
    }
    let mut payload = Vec::new();
    let got = r
        .by_ref()
        .take(u64::from(len))
        .read_to_end(&mut payload)
        .map_err(|e| BackupError::Io(e.to_string()))?;
    if got != len as usize {
        return Err(BackupError::Truncated);
    }
    sum.update(head);
    sum.update(&payload);
    Ok((head[0], payload))
}

/// Whether `prefix` (a file's first bytes) opens a streamed backup.
pub fn is_streamed(prefix: &[u8]) -> bool {
    prefix.len() >= 7 && prefix[..7] == MAGIC[..7]
}

/// A backup read and checked whole: the header, the state's encoding and the summary.
pub struct VerifiedBackup {
    pub header: BackupHeader,
    pub state: Vec<u8>,
    pub summary: BackupSummary,
}

/// Reads a backup of either layout (streamed, or one encoded [`ShardBackup`] of the
/// releases before), checks everything — the stream checks, then the decoded state's
/// hash, invariants and agreement with the header — and hands the audit rows to `rows`
/// as they come (in log order). Holds the state's encoding and, while checking it, the
/// decoded state; never the audit trail (except a whole old-layout file, read as before).
pub fn read_verified<R: Read, E>(
    input: R,
    rows: impl FnMut(&[AuditRow]) -> Result<(), E>,
) -> Result<VerifiedBackup, ReadError<E>> {
    read_verified_with(input, |_| {}, rows)
}

/// [`read_verified`], telling `header` the header (unchecked against the state yet)
/// before the first rows.
pub fn read_verified_with<R: Read, E>(
    mut input: R,
    header: impl FnOnce(&BackupHeader),
    mut rows: impl FnMut(&[AuditRow]) -> Result<(), E>,
) -> Result<VerifiedBackup, ReadError<E>> {
    let mut prefix = [0u8; 8];
    let n = read_prefix(&mut input, &mut prefix).map_err(ReadError::Backup)?;
    if !is_streamed(&prefix[..n]) {
        // The layout before streaming: one codec blob, read whole as it was written.
        let mut bytes = prefix[..n].to_vec();
        input
            .take(codec::DECODE_BYTES_MAX)
            .read_to_end(&mut bytes)
            .map_err(|e| ReadError::Backup(BackupError::Io(e.to_string())))?;
        let b = ShardBackup::decode(&bytes).map_err(ReadError::Backup)?;
        let (state, summary) = b.verify().map_err(ReadError::Backup)?;
        let h = BackupHeader::of(&state, b.shard, b.shards, b.position, b.members.clone());
        header(&h);
        rows(&b.audit).map_err(ReadError::Sink)?;
        return Ok(VerifiedBackup {
            header: h,
            state: b.state,
            summary,
        });
    }
    let mut reader = BackupReader::open((&prefix[..n]).chain(input)).map_err(ReadError::Backup)?;
    header(reader.header());
    let mut state = Vec::new();
    while let Some(item) = reader.next_item().map_err(ReadError::Backup)? {
        match item {
            BackupItem::State(bytes) => state.extend_from_slice(&bytes),
            BackupItem::Audit(r) => rows(&r).map_err(ReadError::Sink)?,
        }
    }
    let summary = reader
        .summary()
        .cloned()
        .ok_or_else(|| ReadError::Backup(BackupError::Truncated))?;
    let decoded =
        State::decode(&state).map_err(|e| ReadError::Backup(BackupError::State(e.to_string())))?;
    // The stream's hash is of the bytes; the decoded state must hash the same (a state
    // of an older format is converted, and converts to what was recorded).
    if decoded.state_hash() != summary.state_hash {
        return Err(ReadError::Backup(BackupError::HashMismatch));
    }
    check_invariants(&decoded)
        .map_err(|v| ReadError::Backup(BackupError::Invariant(v.to_string())))?;
    let header = reader.header().clone();
    if let Some(what) = header.disagreement(&decoded) {
        return Err(ReadError::Backup(BackupError::HeaderMismatch(what)));
    }
    Ok(VerifiedBackup {
        header,
        state,
        summary,
    })
}

fn read_prefix<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<usize, BackupError> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(BackupError::Io(e.to_string())),
        }
    }
    Ok(n)
}

/// Why [`read_verified`] stopped: the backup, or the consumer of its rows.
#[derive(Debug, thiserror::Error)]
pub enum ReadError<E> {
    #[error(transparent)]
    Backup(BackupError),
    #[error("{0}")]
    Sink(E),
}

/// Writes `b` (a whole in-memory backup) as a streamed backup.
pub fn write_streamed<W: Write>(
    b: &ShardBackup,
    out: W,
    frame_bytes: usize,
) -> Result<W, BackupError> {
    let state = State::decode(&b.state).map_err(|e| BackupError::State(e.to_string()))?;
    let header = BackupHeader::of(&state, b.shard, b.shards, b.position, b.members.clone());
    let io = |e: io::Error| BackupError::Io(e.to_string());
    let mut w = BackupWriter::start(out, &header)
        .map_err(io)?
        .with_frame_bytes(frame_bytes);
    w.state(&state).map_err(io)?;
    let (events, batches): (Vec<&AuditRow>, Vec<&AuditRow>) =
        b.audit.iter().partition(|r| r.kind == AuditRowKind::Events);
    let ok = |r: &&AuditRow| Ok::<AuditRow, BackupError>((*r).clone());
    for row in merge_rows(events.iter().map(ok), batches.iter().map(ok)) {
        w.audit_row(row?).map_err(io)?;
    }
    w.finish().map_err(io)
}

/// Reads a streamed backup whole into a [`ShardBackup`] (tests, small shards), checking
/// the stream as it goes.
pub(super) fn read_whole(bytes: &[u8]) -> Result<ShardBackup, BackupError> {
    let mut reader = BackupReader::open(bytes)?;
    let mut state = Vec::new();
    let mut audit = Vec::new();
    while let Some(item) = reader.next_item()? {
        match item {
            BackupItem::State(b) => state.extend_from_slice(&b),
            BackupItem::Audit(r) => audit.extend(r),
        }
    }
    let summary = reader.summary().cloned().ok_or(BackupError::Truncated)?;
    let h = reader.header().clone();
    Ok(ShardBackup {
        shard: h.shard,
        shards: h.shards,
        position: h.position,
        members: h.members,
        state,
        state_hash: summary.state_hash,
        logical_time_ms: h.logical_time_ms,
        audit,
    })
}
