//! The loader's structural checks (`pipec_runtime::load`) on lowered programs, and the damage
//! it refuses.

use pipec_ir::files::Encoding;
use pipec_ir::ir::Program;
use pipec_ir::ir::{Instr, PayloadKind};
use pipec_runtime::error::RunError;
use pipec_runtime::load::*;
use pipec_schedules::{generate, Compute, Limits, Rank, ScheduleKind, ScheduleSpec, StageId, Task};

fn program(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> Program {
    let spec = ScheduleSpec::new(kind, pp, vpp, m);
    pipec_compiler::lower::lower(&generate(&spec, &Limits::DEFAULT).unwrap())
}

fn refused(p: &Program) -> String {
    match check_structure(p, Encoding::Json) {
        Err(e @ RunError::Refused { .. }) => e.to_string(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn generated_programs_pass() {
    for (k, vpp) in [
        (ScheduleKind::Gpipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved1F1B, 2),
        (ScheduleKind::LoopedBfs, 3),
    ] {
        check_structure(&program(k, 3, vpp, 6), Encoding::Json).unwrap();
    }
}

#[test]
fn out_of_range_ids_are_refused() {
    let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
    let i = p.ranks[0]
        .iter()
        .position(|x| matches!(x, Instr::Send { .. }))
        .unwrap();
    if let Instr::Send { peer, .. } = &mut p.ranks[0][i] {
        *peer = Rank(5);
    }
    let msg = refused(&p);
    assert!(
        msg.contains("rank-0.json")
            && msg.contains(&format!("instructions[{i}]"))
            && msg.contains("peer rank 5 is out of range"),
        "{msg}"
    );
    let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
    p.ranks[1][1] = Instr::Compute(Compute::Fwd(Task::new(1, 9)));
    let msg = refused(&p);
    assert!(
        msg.contains("instructions[1]") && msg.contains("mb 9 is out of range"),
        "{msg}"
    );
}

#[test]
fn fifo_payload_mismatch_is_refused_naming_both_sides() {
    let mut p = program(ScheduleKind::Gpipe, 2, 1, 3);
    // Swap the payloads of rank 1's first two activation receives.
    let idx: Vec<usize> = p.ranks[1]
        .iter()
        .enumerate()
        .filter(
            |(_, x)| matches!(x, Instr::Recv { payload, .. } if payload.kind == PayloadKind::Act),
        )
        .map(|(i, _)| i)
        .take(2)
        .collect();
    let (a, b) = (p.ranks[1][idx[0]], p.ranks[1][idx[1]]);
    let set = |x: &mut Instr, from: Instr| {
        if let (Instr::Recv { payload, .. }, Instr::Recv { payload: q, .. }) = (x, from) {
            *payload = q;
        }
    };
    set(&mut p.ranks[1][idx[0]], b);
    set(&mut p.ranks[1][idx[1]], a);
    let msg = refused(&p);
    assert!(
        msg.contains("rank-1.json") && msg.contains("sent at rank 0, #"),
        "{msg}"
    );
    assert!(
        msg.contains("mb 1 <- rank 0) would receive act of stage 0, mb 0"),
        "{msg}"
    );
}

#[test]
fn unmatched_send_is_refused() {
    let mut p = program(ScheduleKind::Gpipe, 2, 1, 2);
    // Drop rank 1's last receive from rank 0: the counts no longer match.
    let i = p.ranks[1]
        .iter()
        .rposition(|x| matches!(x, Instr::Recv { .. }))
        .unwrap();
    p.ranks[1].remove(i);
    let msg = refused(&p);
    assert!(
        msg.contains("rank-0.json") && msg.contains("has no matching recv"),
        "{msg}"
    );
}

#[test]
fn compute_on_the_wrong_rank_and_missing_backward_are_refused() {
    let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
    let i = p.ranks[0]
        .iter()
        .position(|x| matches!(x, Instr::Compute(Compute::Bwd(_))))
        .unwrap();
    p.ranks[0][i] = Instr::Compute(Compute::Bwd(Task {
        stage: StageId(1),
        mb: pipec_schedules::Microbatch(0),
    }));
    let msg = refused(&p);
    assert!(
        msg.contains("rank-0.json")
            && msg.contains(&format!("instructions[{i}]"))
            && msg.contains("runs on rank 0, but stage 1 is on rank 1"),
        "{msg}"
    );
    let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
    let i = p.ranks[0]
        .iter()
        .position(|x| matches!(x, Instr::Compute(Compute::Bwd(_))))
        .unwrap();
    p.ranks[0].remove(i);
    let msg = refused(&p);
    assert!(
        msg.contains("rank-0.json: field `instructions`")
            && msg.contains("bwd(stage 0, mb 0) never runs"),
        "{msg}"
    );
}
