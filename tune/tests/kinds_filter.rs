//! `kinds` and `exclude_kinds` hold under a memory limit with the levers on: the plans the
//! tuner makes for offload and recompute are its own orders (`tuned`), so a request that does
//! not weigh `tuned` never gets one.

use pipec_cost::cost::CostModel;
use pipec_cost::memory::Limit;
use pipec_schedules::ScheduleKind;
use pipec_tune::{tune, CandidateKind, TuneRequest};

fn request(kinds: Option<&[&str]>, exclude: &[&str]) -> TuneRequest {
    TuneRequest {
        num_layers: Some(8),
        // Half of 1F1B's peak at pp=4, M=8 (4 layer-activations on rank 0): the levers are
        // needed, and the lever plans would otherwise be weighed.
        memory_limit: Some(Limit::plain(2.0)),
        kinds: kinds.map(|k| k.iter().map(|s| s.to_string()).collect()),
        exclude_kinds: exclude.iter().map(|s| s.to_string()).collect(),
        ..TuneRequest::new(4, 8, CostModel::parse("f=1,b=1,w=1,offload=0.5").unwrap())
    }
}

#[test]
fn only_the_kinds_asked_for_win_under_a_limit() {
    // Unfiltered, the winner is one of pipec's own orders (the check has teeth).
    let free = tune(&request(None, &[])).unwrap();
    assert!(
        free.candidates
            .iter()
            .any(|c| c.schedule == CandidateKind::Tuned),
        "tuned candidates are weighed without a filter"
    );
    let only = tune(&request(Some(&["1f1b"]), &[])).unwrap();
    assert_eq!(
        only.best.schedule,
        CandidateKind::Builtin(ScheduleKind::OneFOneB)
    );
    assert!(only
        .candidates
        .iter()
        .all(|c| c.schedule == CandidateKind::Builtin(ScheduleKind::OneFOneB)));
    let no_tuned = tune(&request(None, &["tuned"])).unwrap();
    assert!(no_tuned
        .candidates
        .iter()
        .all(|c| c.schedule != CandidateKind::Tuned));
}
