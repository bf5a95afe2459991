//! The CUDA backend's NCCL communicators per P2P group (`pipec_cuda::groups`, issue #39):
//! which groups a program uses, their members, each rank's NCCL rank inside them and the one
//! global order, against hand-derived 1F1B and interleaved cases (pure: no GPU, no NCCL).
use pipec_cuda::groups::{GroupPlan, Route};
use pipec_ir::ir::{Instr, Payload, Program};
use pipec_schedules::{generate, Limits, P2pGroups, ScheduleKind, ScheduleSpec};
use pipec_schedules::{P2pGroup, Rank};

fn program(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, groups: P2pGroups) -> Program {
    let mut p = pipec_compiler::lower(
        &generate(&ScheduleSpec::new(kind, pp, vpp, m), &Limits::DEFAULT).unwrap(),
    );
    p.p2p_groups = groups;
    p
}

fn r(i: u32) -> Rank {
    Rank(i)
}

fn keys(plan: &GroupPlan) -> Vec<(P2pGroup, Vec<Rank>)> {
    plan.groups
        .iter()
        .map(|g| (g.key, g.members.clone()))
        .collect()
}

/// 1F1B at pp = 4 sends activations R0->R1->R2->R3 and gradients back: by hand, three
/// pairs, two directions over all four ranks, six directed edges.
#[test]
fn one_f_one_b_pp4_under_each_layout() {
    use P2pGroup::*;
    let pair = GroupPlan::of(&program(ScheduleKind::OneFOneB, 4, 1, 8, P2pGroups::Pair));
    assert_eq!(
        keys(&pair),
        vec![
            (Pair(r(0), r(1)), vec![r(0), r(1)]),
            (Pair(r(1), r(2)), vec![r(1), r(2)]),
            (Pair(r(2), r(3)), vec![r(2), r(3)]),
        ]
    );
    assert_eq!(pair.of_rank(r(1)), vec![0, 1]);
    assert_eq!(pair.of_rank(r(3)), vec![2]);
    let act = |s: u32| Payload::act(s, 0);
    let grad = |s: u32| Payload::grad(s, 0);
    // Rank 1 receives stage 0's activation from R0 (NCCL rank 0 of pair R0-R1) and sends
    // stage 1's to R2 (NCCL rank 1 of pair R1-R2); R2's receive names the same group.
    assert_eq!(
        pair.route(r(1), r(0), false, act(0)),
        Ok(Route { group: 0, peer: 0 })
    );
    assert_eq!(
        pair.route(r(1), r(2), true, act(1)),
        Ok(Route { group: 1, peer: 1 })
    );
    assert_eq!(
        pair.route(r(2), r(1), false, act(1)),
        Ok(Route { group: 1, peer: 0 })
    );
    // The gradient back to R0 shares the pair's communicator.
    assert_eq!(
        pair.route(r(1), r(0), true, grad(1)),
        Ok(Route { group: 0, peer: 0 })
    );

    let all = vec![r(0), r(1), r(2), r(3)];
    let dir = GroupPlan::of(&program(
        ScheduleKind::OneFOneB,
        4,
        1,
        8,
        P2pGroups::Direction,
    ));
    // Upstream (`false`) sorts first.
    assert_eq!(
        keys(&dir),
        vec![(Direction(false), all.clone()), (Direction(true), all)]
    );
    assert_eq!(dir.of_rank(r(0)), vec![0, 1]);
    // Over all ranks, a peer's NCCL rank is its own rank.
    assert_eq!(
        dir.route(r(1), r(2), true, act(1)),
        Ok(Route { group: 1, peer: 2 })
    );
    assert_eq!(
        dir.route(r(1), r(0), true, grad(1)),
        Ok(Route { group: 0, peer: 0 })
    );
    assert_eq!(
        dir.route(r(2), r(3), false, grad(3)),
        Ok(Route { group: 0, peer: 3 })
    );

    let edge = GroupPlan::of(&program(ScheduleKind::OneFOneB, 4, 1, 8, P2pGroups::Edge));
    assert_eq!(
        keys(&edge),
        vec![
            (Edge(r(0), r(1)), vec![r(0), r(1)]),
            (Edge(r(1), r(0)), vec![r(0), r(1)]),
            (Edge(r(1), r(2)), vec![r(1), r(2)]),
            (Edge(r(2), r(1)), vec![r(1), r(2)]),
            (Edge(r(2), r(3)), vec![r(2), r(3)]),
            (Edge(r(3), r(2)), vec![r(2), r(3)]),
        ]
    );
    assert_eq!(edge.of_rank(r(1)), vec![0, 1, 2, 3]);
    assert_eq!(edge.of_rank(r(3)), vec![4, 5]);
    // R1's send of an activation to R2 is on edge R1->R2, where R2 is NCCL rank 1; R1's
    // send of a gradient to R0 on edge R1->R0, where R0 is NCCL rank 0.
    assert_eq!(
        edge.route(r(1), r(2), true, act(1)),
        Ok(Route { group: 2, peer: 1 })
    );
    assert_eq!(
        edge.route(r(1), r(0), true, grad(1)),
        Ok(Route { group: 1, peer: 0 })
    );
    assert_eq!(
        edge.route(r(0), r(1), false, grad(1)),
        Ok(Route { group: 1, peer: 1 })
    );
}

/// Interleaved 1F1B at pp = 4, vpp = 2 (stages r and r + 4 on rank r): the wrap-around
/// activation of stage 3 goes R3->R0 and its gradient R0->R3, so edge has eight directed
/// edges (the ring both ways) and pair four pairs, the last R0-R3; direction still two
/// groups of all ranks.
#[test]
fn interleaved_has_the_wrap_around_edges() {
    use P2pGroup::*;
    let p = |g| program(ScheduleKind::Interleaved1F1B, 4, 2, 8, g);
    let edge = GroupPlan::of(&p(P2pGroups::Edge));
    let want: Vec<P2pGroup> = [
        (0, 1),
        (0, 3),
        (1, 0),
        (1, 2),
        (2, 1),
        (2, 3),
        (3, 0),
        (3, 2),
    ]
    .into_iter()
    .map(|(a, b)| Edge(r(a), r(b)))
    .collect();
    assert_eq!(edge.groups.iter().map(|g| g.key).collect::<Vec<_>>(), want);
    let wrap = edge.index(Edge(r(3), r(0))).unwrap();
    assert_eq!(edge.groups[wrap].members, vec![r(0), r(3)]);
    // R0 receives stage 3's activation from R3, NCCL rank 1 of edge R3->R0; R3 sends it
    // to R0, NCCL rank 0.
    assert_eq!(
        edge.route(r(0), r(3), false, Payload::act(3, 0)),
        Ok(Route {
            group: wrap,
            peer: 1
        })
    );
    assert_eq!(
        edge.route(r(3), r(0), true, Payload::act(3, 0)),
        Ok(Route {
            group: wrap,
            peer: 0
        })
    );
    assert_eq!(
        edge.route(r(0), r(3), true, Payload::grad(4, 0)),
        Ok(Route { group: 1, peer: 1 })
    );
    assert_eq!(edge.of_rank(r(0)), vec![0, 1, 2, 6]);

    let pair = GroupPlan::of(&p(P2pGroups::Pair));
    assert_eq!(
        pair.groups.iter().map(|g| g.key).collect::<Vec<_>>(),
        vec![
            Pair(r(0), r(1)),
            Pair(r(0), r(3)),
            Pair(r(1), r(2)),
            Pair(r(2), r(3))
        ]
    );
    let dir = GroupPlan::of(&p(P2pGroups::Direction));
    assert_eq!(dir.groups.len(), 2);
    assert!(dir.groups.iter().all(|g| g.members.len() == 4));
    // The wrap-around activation is downstream (pytorch #195760's R3->R0 forward).
    assert_eq!(
        dir.route(r(0), r(3), false, Payload::act(3, 0)),
        Ok(Route { group: 1, peer: 3 })
    );
}

/// A forward-only program sends activations only: one `direction` group, and no edge
/// against the stages.
#[test]
fn forward_only_uses_downstream_groups_only() {
    let mut spec = ScheduleSpec::new(ScheduleKind::Gpipe, 3, 1, 4);
    spec.forward_only = true;
    let mut p = pipec_compiler::lower(&generate(&spec, &Limits::DEFAULT).unwrap());
    p.p2p_groups = P2pGroups::Direction;
    let plan = GroupPlan::of(&p);
    assert_eq!(
        plan.groups
            .iter()
            .map(|g| (g.key, g.members.len()))
            .collect::<Vec<_>>(),
        vec![(P2pGroup::Direction(true), 3)]
    );
    p.p2p_groups = P2pGroups::Edge;
    assert_eq!(
        GroupPlan::of(&p)
            .groups
            .iter()
            .map(|g| g.key)
            .collect::<Vec<_>>(),
        vec![P2pGroup::Edge(r(0), r(1)), P2pGroup::Edge(r(1), r(2))]
    );
}

/// Every send and receive of every kind, under every layout, routes to a group that holds
/// both ends, and the two ends of each message agree on the group and name each other.
#[test]
fn both_ends_of_every_message_meet_on_one_communicator() {
    for kind in [
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved1F1B,
        ScheduleKind::ZbV,
    ] {
        for groups in P2pGroups::ALL {
            let vpp = if kind == ScheduleKind::OneFOneB { 1 } else { 2 };
            let p = program(kind, 4, vpp, 8, groups);
            let plan = GroupPlan::of(&p);
            for (me, instrs) in p.ranks.iter().enumerate() {
                let me = r(me as u32);
                for i in instrs {
                    let (send, peer, payload) = match *i {
                        Instr::Send { peer, payload, .. } => (true, peer, payload),
                        Instr::Recv { peer, payload, .. } => (false, peer, payload),
                        _ => continue,
                    };
                    let mine = plan.route(me, peer, send, payload).unwrap();
                    let theirs = plan.route(peer, me, !send, payload).unwrap();
                    assert_eq!(mine.group, theirs.group, "{kind:?} {groups}");
                    let g = &plan.groups[mine.group];
                    assert_eq!(g.members[mine.peer], peer);
                    assert_eq!(g.members[theirs.peer], me);
                }
            }
        }
    }
}

/// A message the plan has not seen is an error naming the missing communicator.
#[test]
fn a_message_of_another_program_is_an_error() {
    let plan = GroupPlan::of(&program(ScheduleKind::OneFOneB, 4, 1, 8, P2pGroups::Edge));
    let e = plan
        .route(r(0), r(3), true, Payload::act(0, 0))
        .unwrap_err();
    assert!(e.contains("no communicator `edge R0->R3`"), "{e}");
}
