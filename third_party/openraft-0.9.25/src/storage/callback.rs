//! Callbacks used by Storage API

use std::io;

use tokio::sync::mpsc;
use tokio::sync::oneshot;

use crate::async_runtime::AsyncOneshotSendExt;
use crate::core::notify::Notify;
use crate::raft_state::io_state::log_io_id::LogIOId;
use crate::type_config::alias::OneshotSenderOf;
use crate::LogId;
use crate::RaftTypeConfig;
use crate::StorageIOError;
use crate::Vote;

/// A oneshot callback for completion of log io operation.
pub struct LogFlushed<C>
where C: RaftTypeConfig
{
    log_io_id: LogIOId<C::NodeId>,
    /// `None` once reported.
    tx: Option<FlushedTx<C>>,
}

/// allot patch: where a flush is reported.
enum FlushedTx<C>
where C: RaftTypeConfig
{
    /// To the caller awaiting it (upstream's only way).
    Oneshot(OneshotSenderOf<C, Result<LogIOId<C::NodeId>, io::Error>>),
    /// Straight to RaftCore's notification channel, as `Notify::LocalLogFlushed` (a
    /// leader that did not wait for its flush, `Config::leader_flush_overlap`). The
    /// channel keeps the order in which the log store reports its flushes.
    Notify {
        tx: mpsc::UnboundedSender<Notify<C>>,
        vote: Vote<C::NodeId>,
        last_log_id: LogId<C::NodeId>,
    },
}

impl<C> LogFlushed<C>
where C: RaftTypeConfig
{
    pub(crate) fn new(
        log_io_id: LogIOId<C::NodeId>,
        tx: OneshotSenderOf<C, Result<LogIOId<C::NodeId>, io::Error>>,
    ) -> Self {
        Self {
            log_io_id,
            tx: Some(FlushedTx::Oneshot(tx)),
        }
    }

    /// allot patch: a callback that reports to RaftCore's notification channel.
    pub(crate) fn notifying(
        vote: Vote<C::NodeId>,
        last_log_id: LogId<C::NodeId>,
        tx: mpsc::UnboundedSender<Notify<C>>,
    ) -> Self {
        Self {
            log_io_id: LogIOId::new(vote.clone(), Some(last_log_id.clone())),
            tx: Some(FlushedTx::Notify { tx, vote, last_log_id }),
        }
    }

    /// Report log io completion event.
    ///
    /// It will be called when the log is successfully appended to the storage or an error occurs.
    pub fn log_io_completed(mut self, result: Result<(), io::Error>) {
        self.report(result)
    }

    fn report(&mut self, result: Result<(), io::Error>) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        if let Err(e) = &result {
            tracing::error!("LogFlush error: {}, while flushing upto {}", e, self.log_io_id);
        }
        let log_io_id = self.log_io_id.clone();
        match tx {
            FlushedTx::Oneshot(tx) => {
                let res = tx.send(result.map(|()| log_io_id));
                if let Err(e) = res {
                    tracing::error!("failed to send log io completion event: {:?}", e);
                }
            }
            FlushedTx::Notify { tx, vote, last_log_id } => {
                // RaftCore gone (shutting down): nothing to report to.
                let _ = tx.send(Notify::LocalLogFlushed {
                    vote,
                    last_log_id,
                    result: result.map(|()| log_io_id),
                });
            }
        }
    }
}

/// allot patch: a notifying callback dropped without a report (the log store lost it, e.g.
/// its sync thread died) reports a failure, which is fatal: RaftCore must not wait
/// forever for a flush nobody will report. (A dropped oneshot is seen by its receiver.)
impl<C> Drop for LogFlushed<C>
where C: RaftTypeConfig
{
    fn drop(&mut self) {
        if matches!(self.tx, Some(FlushedTx::Notify { .. })) {
            self.report(Err(io::Error::other("the log store dropped a flush callback unreported")));
        }
    }
}

/// A oneshot callback for completion of applying logs to state machine.
pub struct LogApplied<C>
where C: RaftTypeConfig
{
    last_log_id: LogId<C::NodeId>,
    tx: oneshot::Sender<Result<(LogId<C::NodeId>, Vec<C::R>), StorageIOError<C::NodeId>>>,
}

impl<C> LogApplied<C>
where C: RaftTypeConfig
{
    #[allow(dead_code)]
    pub(crate) fn new(
        last_log_id: LogId<C::NodeId>,
        tx: oneshot::Sender<Result<(LogId<C::NodeId>, Vec<C::R>), StorageIOError<C::NodeId>>>,
    ) -> Self {
        Self { last_log_id, tx }
    }

    /// Report apply io completion event.
    ///
    /// It will be called when the log is successfully applied to the state machine or an error
    /// occurs.
    pub fn completed(self, result: Result<Vec<C::R>, StorageIOError<C::NodeId>>) {
        let res = match result {
            Ok(x) => {
                tracing::debug!("LogApplied upto {}", self.last_log_id);
                let resp = (self.last_log_id.clone(), x);
                self.tx.send(Ok(resp))
            }
            Err(e) => {
                tracing::error!("LogApplied error: {}, while applying upto {}", e, self.last_log_id);
                self.tx.send(Err(e))
            }
        };

        if let Err(_e) = res {
            tracing::error!("failed to send apply complete event, last_log_id: {}", self.last_log_id);
        }
    }
}

#[cfg(test)]
mod allot_tests {
    use tokio::sync::mpsc;

    use super::LogFlushed;
    use crate::core::notify::Notify;
    use crate::engine::testing::UTConfig;
    use crate::testing::log_id;
    use crate::Vote;

    /// allot patch: a notifying callback reports exactly once — its report, or a failure
    /// if the log store drops it unreported (RaftCore must not wait for a report nobody
    /// will send).
    #[test]
    fn a_notifying_callback_reports_once_or_fails_when_dropped() {
        let (tx, mut rx) = mpsc::unbounded_channel::<Notify<UTConfig>>();
        let vote = Vote::new_committed(1, 2);

        LogFlushed::<UTConfig>::notifying(vote.clone(), log_id(1, 2, 3), tx.clone()).log_io_completed(Ok(()));
        match rx.try_recv() {
            Ok(Notify::LocalLogFlushed { last_log_id, result, .. }) => {
                assert_eq!(last_log_id, log_id(1, 2, 3));
                assert!(result.is_ok());
            }
            _ => panic!("a reported flush is notified"),
        }
        assert!(rx.try_recv().is_err(), "reported once, nothing from its drop");

        drop(LogFlushed::<UTConfig>::notifying(vote, log_id(1, 2, 4), tx));
        match rx.try_recv() {
            Ok(Notify::LocalLogFlushed { last_log_id, result, .. }) => {
                assert_eq!(last_log_id, log_id(1, 2, 4));
                assert!(result.is_err(), "a dropped callback reports a failure");
            }
            _ => panic!("a dropped callback is notified"),
        }
        assert!(rx.try_recv().is_err());
    }
}
