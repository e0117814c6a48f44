use std::sync::Arc;

use maplit::btreeset;
use pretty_assertions::assert_eq;

use crate::engine::testing::UTConfig;
use crate::engine::Command;
use crate::engine::Engine;
use crate::engine::LogIdList;
use crate::raft::VoteRequest;
use crate::testing::log_id;
use crate::utime::UTime;
use crate::EffectiveMembership;
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

/// allot patch: a node whose stored vote made it the leader (of several voters) does not
/// resume that leadership at startup (upstream restored it as leader at once and appended
/// a blank entry of the old term): it holds its vote as an uncommitted vote for itself in
/// that term, appends and sends nothing, and campaigns no sooner than a follower would.
/// It is a Leader but not yet append any logs.
#[test]
fn test_startup_as_leader_without_logs() -> anyhow::Result<()> {
    let mut eng = eng();
    // self.id==2 is a voter:
    eng.state
        .membership_state
        .set_effective(Arc::new(EffectiveMembership::new(Some(log_id(2, 1, 3)), m23())));
    // Committed vote makes it a leader at startup.
    eng.state.vote = UTime::new(TokioInstant::now(), Vote::new_committed(1, 2));

    let before = TokioInstant::now();
    eng.startup();

    assert_eq!(ServerState::Candidate, eng.state.server_state);
    assert!(eng.leader.is_none());
    assert!(eng.candidate_ref().is_none(), "no election yet");
    assert_eq!(eng.state.vote_ref(), &Vote::new(1, 2));
    let lease = eng.config.timer_config.leader_lease;
    assert!(
        eng.state.vote_last_modified() >= Some(before + lease),
        "its first campaign waits a leader lease more than the election timeout"
    );
    assert_eq!(eng.output.take_commands(), vec![]);

    Ok(())
}

/// allot patch: a leader that proposed logs and restarted never hands out log ids of its
/// old term again (upstream reused the old term's noop log id and assigned the next ids
/// after its stored log — which, with `Config::leader_flush_overlap`, may lack entries
/// followers already hold under the same ids).
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
    assert_eq!(eng.state.vote_ref(), &Vote::new(1, 2));
    assert_eq!(eng.output.take_commands(), vec![]);

    // Its election, when it comes, is of a new term.
    eng.elect();
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

/// allot patch: the only voter (here with a learner) campaigns in a new term at once,
/// rather than resuming the old one with its stored log, whatever the learner received
/// past it.
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
    assert_eq!(
        vec![
            //
            Command::SaveVote { vote: Vote::new(2, 2) },
            Command::SendVote {
                vote_req: VoteRequest::new(Vote::new(2, 2), Some(log_id(1, 2, 4)))
            },
        ],
        eng.output.take_commands()
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
