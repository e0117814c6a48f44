use std::sync::Arc;

use maplit::btreeset;
use pretty_assertions::assert_eq;

use crate::engine::testing::UTConfig;
use crate::engine::Command;
use crate::engine::Engine;
use crate::engine::LogIdList;
use crate::entry::RaftEntry;
use crate::progress::entry::ProgressEntry;
use crate::progress::Inflight;
use crate::raft::VoteRequest;
use crate::testing::log_id;
use crate::utime::UTime;
use crate::EffectiveMembership;
use crate::Entry;
use crate::Membership;
use crate::ServerState;
use crate::TokioInstant;
use crate::Vote;

fn m_empty() -> Membership<u64, ()> {
    Membership::<u64, ()>::new(vec![btreeset! {}], None)
}

fn m23() -> Membership<u64, ()> {
    Membership::<u64, ()>::new(vec![btreeset! {2,3}], None)
}

fn m34() -> Membership<u64, ()> {
    Membership::<u64, ()>::new(vec![btreeset! {3,4}], None)
}

fn eng() -> Engine<UTConfig> {
    let mut eng = Engine::testing_default(0);
    eng.state.enable_validation(false);
    eng.config.id = 2;
    // This will be overridden
    eng.state.server_state = ServerState::default();
    eng
}

/// allot patch: a node whose stored vote made it the leader campaigns in a new term at
/// startup instead of resuming the leadership (upstream restored it as leader at once and
/// appended a blank entry of the old term). It is a Leader but not yet append any logs.
#[test]
fn test_startup_as_leader_without_logs() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m23())));
    // Committed vote makes it a leader at startup.
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new_committed(1, 2));

    eng.startup();

    assert_eq!(ServerState::Candidate, eng.state.server_state);
    assert!(eng.leader.is_none());
    assert_eq!(eng.state.vote_ref(), &Vote::new(2, 2));
    assert_eq!(
        vec![
            //
            Command::SaveVote { vote: Vote::new(2, 2) },
            Command::SendVote {
                vote_req: VoteRequest::new(Vote::new(2, 2), None)
            },
        ],
        eng.output.take_commands()
    );

    Ok(())
}

/// allot patch: a leader that proposed logs and restarted campaigns in a new term: it never
/// hands out log ids of its old term again (upstream reused the old term's noop log id and
/// assigned the next ids after its stored log — which, with
/// `Config::leader_flush_overlap`, may lack entries followers already hold under the same
/// ids).
#[test]
fn test_startup_as_leader_with_proposed_logs() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m23())));
    // Fake existing log ids
    eng.state.log_ids = LogIdList::new([log_id(1, 1, 2), log_id(1, 2, 4), log_id(1, 2, 6)]);
    // Committed vote makes it a leader at startup.
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new_committed(1, 2));

    eng.startup();

    assert_eq!(ServerState::Candidate, eng.state.server_state);
    assert!(eng.leader.is_none());
    assert_eq!(
        vec![
            //
            Command::SaveVote { vote: Vote::new(2, 2) },
            Command::SendVote {
                vote_req: VoteRequest::new(Vote::new(2, 2), Some(log_id(1, 2, 6)))
            },
        ],
        eng.output.take_commands()
    );

    Ok(())
}

/// allot patch: the same for a single voter (with learners): it campaigns too, rather than
/// resuming at once with its stored log, whatever learners received past it.
#[test]
fn test_startup_as_the_only_voter_campaigns_in_a_new_term() -> anyhow::Result<()> {
    let mut eng = eng();
    eng.state.membership_state.set_effective(Arc::new(EffectiveMembership::new(
        Some(log_id(2, 1, 3)),
        Membership::<u64, ()>::new(vec![btreeset! {2}], Some(btreeset! {3})),
    )));
    eng.state.log_ids = LogIdList::new([log_id(1, 1, 2), log_id(1, 2, 4)]);
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new_committed(1, 2));

    eng.startup();

    assert_eq!(ServerState::Candidate, eng.state.server_state);
    assert_eq!(eng.state.vote_ref(), &Vote::new(2, 2));
    let cmds = eng.output.take_commands();
    assert!(
        !cmds.iter().any(|c| matches!(c, Command::AppendInputEntries { .. } | Command::Replicate { .. })),
        "nothing appended or sent in the old term: {:?}",
        cmds
    );

    Ok(())
}

/// When starting up, a leader that is not a voter should not panic.
#[test]
fn test_startup_as_leader_not_voter_issue_920() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m_empty())));
    // Committed vote makes it a leader at startup.
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new_committed(1, 2));

    eng.startup();

    assert_eq!(ServerState::Learner, eng.state.server_state);
    assert_eq!(eng.output.take_commands(), vec![]);

    Ok(())
}

#[test]
fn test_startup_candidate_becomes_follower() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m23())));
    // Non-committed vote makes it a candidate at startup.
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new(1, 2));

    eng.startup();

    assert_eq!(ServerState::Follower, eng.state.server_state);
    assert_eq!(0, eng.output.take_commands().len());

    Ok(())
}
#[test]
fn test_startup_as_follower() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m23())));

    eng.startup();

    assert_eq!(ServerState::Follower, eng.state.server_state);
    assert_eq!(0, eng.output.take_commands().len());

    Ok(())
}

#[test]
fn test_startup_as_learner() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is not a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m34())));

    eng.startup();

    assert_eq!(ServerState::Learner, eng.state.server_state);
    assert_eq!(0, eng.output.take_commands().len());

    Ok(())
}
