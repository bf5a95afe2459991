//! `--p2p-groups pair|direction|edge` (issue #39, "Communicators per edge"): the verifier's
//! stream rule (D2) and head-of-line risk (K2) per communicator, the manifest field, and the
//! CLI and Python names.
//!
//! The references are the sources' own examples and hand derivations, not pipec's output:
//! pytorch #195760/#196666's PP4/VPP2 example (rank 0 queues `recv(0F3, R3->R0)` behind two
//! sends to R1 "with one forward communicator"; "with directed communicators ... that receive
//! no longer waits behind unrelated sends to rank 1"), and a two-rank program whose deadlock
//! under one communicator per pair is derived by hand below.

use crate::harness::{compiled, pipec_with};
use pipec_ir::files::{self, Encoding, Header};
use pipec_ir::ir::{Instr, Payload, Program};
use pipec_ir::verify::{verify, Report, Risk, VerifyOptions, Violation};
use pipec_schedules::layout::Layout;
use pipec_schedules::{Compute, P2pGroups, Placement, Rank, Task};

fn fwd(s: u32, m: u32) -> Instr {
    Instr::Compute(Compute::Fwd(Task::new(s, m)))
}
fn bwd(s: u32, m: u32) -> Instr {
    Instr::Compute(Compute::Bwd(Task::new(s, m)))
}
fn send(peer: u32, p: Payload, batch: u32) -> Instr {
    Instr::message(true, Rank(peer), p, batch)
}
fn recv(peer: u32, p: Payload, batch: u32) -> Instr {
    Instr::message(false, Rank(peer), p, batch)
}
fn wait(batch: u32) -> Instr {
    Instr::Wait { batch }
}

/// pytorch #195760 (carried into #196666): "2 microbatches, 8 stages, 4 GPUs", stages `r` and
/// `r + 4` on rank `r`, rank 0's compute order `0F0 -> 1F0 -> 0F4 -> 1F4`, every rank alike.
/// Forwards only, as the example shows them. Sends are left in flight (torch's stage posts
/// `isend` and waits at the end of the step); each receive is waited at once, just before the
/// forward that needs it. So rank 0 posts `send(0F0, R0->R1)`, `send(1F0, R0->R1)`, then
/// `recv(0F3, R3->R0)`, exactly the sequence of the example.
fn pp4_vpp2(groups: P2pGroups) -> Program {
    let (pp, m) = (4u32, 2u32);
    let ranks = (0..pp)
        .map(|r| {
            let mut out = Vec::new();
            let mut batch = 0u32;
            let mut sent = Vec::new();
            for chunk in 0..2 {
                let s = r + chunk * pp;
                for mb in 0..m {
                    if s > 0 {
                        // From the rank that owns stage s - 1.
                        out.push(recv((s - 1) % pp, Payload::act(s - 1, mb), batch));
                        batch += 1;
                    }
                    out.push(fwd(s, mb));
                    if s + 1 < 2 * pp {
                        out.push(send((s + 1) % pp, Payload::act(s, mb), batch));
                        sent.push(batch);
                        batch += 1;
                    }
                }
            }
            out.extend(sent.into_iter().map(wait));
            out
        })
        .collect();
    Program {
        placement: Placement::looped(pp, 2),
        microbatches: m,
        forward_only: true,
        comm: None,
        ranks,
        lengths: None,
        p2p_groups: groups,
        buffer_slots: None,
    }
}

fn check(p: &Program) -> Report {
    verify(p, &VerifyOptions::default())
}

fn head_of_line(r: &Report) -> Vec<&Risk> {
    r.risks
        .iter()
        .filter(|k| matches!(k, Risk::HeadOfLine { .. }))
        .collect()
}

#[test]
fn pytorch_196666_pp4_vpp2_example_under_each_group_layout() {
    // Valid under every layout: a head-of-line wait here is a delay (the sends to R1 finish
    // once R1 posts its receives, which wait on nothing of rank 0's), not a cycle.
    for g in P2pGroups::ALL {
        let r = check(&pp4_vpp2(g));
        assert!(r.is_valid(), "{g}: {r}");
    }
    // One forward communicator (#186173's `direction`): on every rank that receives from the
    // wrap-around or the previous rank while its own sends are in flight, the receive waits
    // behind them. Rank 0's first is the example's: recv(0F3, R3->R0) behind send(0F0).
    let r = check(&pp4_vpp2(P2pGroups::Direction));
    let hol = head_of_line(&r);
    let Some(Risk::HeadOfLine {
        site,
        behind,
        group,
        more,
        ..
    }) = hol.first().copied()
    else {
        panic!("no head-of-line wait under direction: {r}");
    };
    assert_eq!(site.at.rank, Rank(0));
    assert_eq!(site.instr, recv(3, Payload::act(3, 0), 2));
    assert_eq!(behind.instr, send(1, Payload::act(0, 0), 0));
    assert_eq!(group, "downstream");
    // Behind it on rank 0: recv(1F3) (sends of 0F0, 1F0 and 0F4 still in flight). Hand count
    // of rank 0's later receives on the downstream group: just that one.
    assert_eq!(*more, 1);
    let text = hol[0].to_string();
    assert!(
        text.contains("head-of-line wait on communicator `downstream`"),
        "{text}"
    );
    // Ranks 1-3 receive from the previous rank while their sends to the next are in flight:
    // one risk each on their downstream communicator (rank 1's recv(0F0) comes first, before
    // any send, so its first wait is recv(1F0)).
    let ranks: Vec<u32> = hol
        .iter()
        .map(|k| match k {
            Risk::HeadOfLine { site, .. } => site.at.rank.0,
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(ranks, [0, 1, 2, 3]);

    // One communicator per pair (torch's lazy default for raw isend/irecv): rank r only
    // receives from r - 1 and sends to r + 1, two different pairs at pp = 4, so nothing shares
    // a stream with anything unrelated and the example's wait does not arise there.
    assert!(head_of_line(&check(&pp4_vpp2(P2pGroups::Pair))).is_empty());
    // One per directed edge: "R0->R1: send(0F0), send(1F0); R3->R0: recv(0F3)". Clean.
    let r = check(&pp4_vpp2(P2pGroups::Edge));
    assert!(head_of_line(&r).is_empty(), "{r}");
    assert!(r.risks.is_empty(), "{r}");
}

/// Two stages on two ranks, two microbatches, 1F1B with rank 0's second send left in flight:
///
/// ```text
/// rank 0: F(0,0)  send act(0,0)   F(0,1)  send act(0,1) [in flight]  recv grad(1,0)  B(0,0)
///         recv grad(1,1)  B(0,1)  wait
/// rank 1: recv act(0,0)  F(1,0)  B(1,0)  send grad(1,0)  recv act(0,1)  F(1,1)  B(1,1)
///         send grad(1,1)
/// ```
///
/// Under rendezvous (D1) it runs: rank 0 posts its recv grad(1,0) while the send is in flight,
/// which meets rank 1's send grad(1,0). With one communicator per pair, both of rank 0's ops
/// are on the R0-R1 communicator and NCCL starts recv grad(1,0) only after send act(0,1) has
/// finished; that send finishes only when rank 1 posts recv act(0,1), which rank 1 reaches only
/// after its blocking send grad(1,0) has finished, which needs rank 0's recv grad(1,0): a
/// cycle, so a deadlock. With one communicator per directed edge (or per direction: the
/// activation goes downstream, the gradient upstream), the receive does not queue behind the
/// send and the cycle is gone.
fn crossing(groups: P2pGroups) -> Program {
    Program {
        placement: Placement::looped(2, 1),
        microbatches: 2,
        forward_only: false,
        comm: None,
        ranks: vec![
            vec![
                fwd(0, 0),
                send(1, Payload::act(0, 0), 0),
                fwd(0, 1),
                send(1, Payload::act(0, 1), 1),
                recv(1, Payload::grad(1, 0), 2),
                bwd(0, 0),
                recv(1, Payload::grad(1, 1), 3),
                bwd(0, 1),
                wait(1),
            ],
            vec![
                recv(0, Payload::act(0, 0), 0),
                fwd(1, 0),
                bwd(1, 0),
                send(0, Payload::grad(1, 0), 1),
                recv(0, Payload::act(0, 1), 2),
                fwd(1, 1),
                bwd(1, 1),
                send(0, Payload::grad(1, 1), 3),
            ],
        ],
        lengths: None,
        p2p_groups: groups,
        buffer_slots: None,
    }
}

fn stream_deadlocks(r: &Report) -> Vec<&Violation> {
    r.violations
        .iter()
        .filter(|v| matches!(v, Violation::StreamDeadlock { .. }))
        .collect()
}

#[test]
fn a_program_that_deadlocks_under_pair_runs_under_edge_and_direction() {
    let r = check(&crossing(P2pGroups::Pair));
    let found = stream_deadlocks(&r);
    assert_eq!(found.len(), 1, "{r}");
    assert!(
        !r.violations
            .iter()
            .any(|v| matches!(v, Violation::Deadlock { .. })),
        "rendezvous alone runs it: {r}"
    );
    // The cycle is the one derived above, in the ops it names: rank 0's in-flight send, which
    // waits for rank 1's blocking send of the gradient (rank 1 posts the receive only after
    // it), which waits for rank 0's receive, queued behind the first.
    let text = found[0].to_string();
    assert!(
        text.contains("rank 0, #3 send(act of stage 0, mb 1 -> rank 1)"),
        "{text}"
    );
    assert!(
        text.contains("rank 1, #3 send(grad of stage 1, mb 0 -> rank 0)"),
        "{text}"
    );
    for g in [P2pGroups::Edge, P2pGroups::Direction] {
        let r = check(&crossing(g));
        assert!(r.is_valid(), "{g}: {r}");
        assert!(head_of_line(&r).is_empty(), "{g}: {r}");
    }
}

/// A cycle through one communicator per direction, derived by hand: pp = 2, vpp = 2 (stages
/// 0 and 2 on rank 0, 1 and 3 on rank 1), two microbatches, forwards only. Every message is an
/// activation, so under `direction` all of them share the downstream communicator; the
/// wrap-around (stage 1 -> 2) runs from rank 1 back to rank 0.
///
/// ```text
/// rank 0: F(0,0)  send act(0,0)  F(0,1)  send act(0,1) [in flight]  recv act(1,0)  F(2,0)
///         send act(2,0) [in flight]  recv act(1,1)  F(2,1)  send act(2,1)  wait  wait
/// rank 1: recv act(0,0)  F(1,0)  send act(1,0)  recv act(0,1)  F(1,1)  send act(1,1)
///         recv act(2,0)  F(3,0)  recv act(2,1)  F(3,1)
/// ```
///
/// Rendezvous alone runs it. On one downstream communicator (or one per pair: both ops are on
/// R0-R1), rank 0's recv act(1,0) starts only after send act(0,1) has finished, which needs
/// rank 1's recv act(0,1), posted only after rank 1's blocking send act(1,0) has finished,
/// which needs rank 0's recv act(1,0): a cycle. The second wrap-around closes another the same
/// way (recv act(1,1) behind send act(2,0), which needs rank 1's recv act(2,0), posted after
/// its blocking send act(1,1)): two cycles. Per directed edge, rank 0's receives are on R1->R0
/// and its sends on R0->R1, and nothing else queues: no cycle.
fn wraparound(groups: P2pGroups) -> Program {
    Program {
        placement: Placement::looped(2, 2),
        microbatches: 2,
        forward_only: true,
        comm: None,
        ranks: vec![
            vec![
                fwd(0, 0),
                send(1, Payload::act(0, 0), 0),
                fwd(0, 1),
                send(1, Payload::act(0, 1), 1),
                recv(1, Payload::act(1, 0), 2),
                fwd(2, 0),
                send(1, Payload::act(2, 0), 3),
                recv(1, Payload::act(1, 1), 4),
                fwd(2, 1),
                send(1, Payload::act(2, 1), 5),
                wait(1),
                wait(3),
            ],
            vec![
                recv(0, Payload::act(0, 0), 0),
                fwd(1, 0),
                send(0, Payload::act(1, 0), 1),
                recv(0, Payload::act(0, 1), 2),
                fwd(1, 1),
                send(0, Payload::act(1, 1), 3),
                recv(0, Payload::act(2, 0), 4),
                fwd(3, 0),
                recv(0, Payload::act(2, 1), 5),
                fwd(3, 1),
            ],
        ],
        lengths: None,
        p2p_groups: groups,
        buffer_slots: None,
    }
}

#[test]
fn the_cycle_names_its_communicators() {
    for g in [P2pGroups::Pair, P2pGroups::Direction] {
        let r = check(&wraparound(g));
        assert_eq!(stream_deadlocks(&r).len(), 2, "{g}: {r}");
    }
    let r = check(&wraparound(P2pGroups::Direction));
    let text = stream_deadlocks(&r)[0].to_string();
    assert!(text.contains("--p2p-groups direction"), "{text}");
    assert!(
        text.contains("recv(act of stage 1, mb 0 <- rank 1) [on downstream]"),
        "{text}"
    );
    // Under the default the message is today's, word for word (no group names).
    let r = check(&wraparound(P2pGroups::Pair));
    let text = stream_deadlocks(&r)[0].to_string();
    assert!(
        text.starts_with("deadlock under NCCL's stream order (ops of one communicator between two ranks run in issue order):"),
        "{text}"
    );
    assert!(!text.contains("[on "), "{text}");
    let r = check(&wraparound(P2pGroups::Edge));
    assert!(r.is_valid(), "{r}");
}

/// The manifest records the layout only when it is not the default (files compiled without
/// the option keep their bytes), the loader reads it back, and `check` verifies under it.
#[test]
fn compile_records_the_groups_and_check_reads_them() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = compiled(
        tmp.path(),
        "plain",
        "--schedule 1f1b --pp 2 --microbatches 4",
    );
    let pair = compiled(
        tmp.path(),
        "pair",
        "--schedule 1f1b --pp 2 --microbatches 4 --p2p-groups pair",
    );
    let edge = compiled(
        tmp.path(),
        "edge",
        "--schedule 1f1b --pp 2 --microbatches 4 --p2p-groups edge",
    );
    let read = |d: &std::path::Path| std::fs::read_to_string(d.join("manifest.json")).unwrap();
    assert_eq!(
        read(&plain),
        read(&pair),
        "pair is the default, byte for byte"
    );
    assert!(!read(&plain).contains("p2p_groups"));
    let m: serde_json::Value = serde_json::from_str(&read(&edge)).unwrap();
    assert_eq!(m["p2p_groups"], "edge");
    // A different program for the verifier, so a different schedule hash.
    let p: serde_json::Value = serde_json::from_str(&read(&plain)).unwrap();
    assert_ne!(m["schedule_hash"], p["schedule_hash"]);
    let loaded = files::load_dir(&edge).unwrap();
    assert_eq!(loaded.program.p2p_groups, P2pGroups::Edge);
    let out = pipec_with(["check", edge.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // A bad name is a usage error (exit 2) naming the three.
    let out = pipec_with([
        "compile",
        "--schedule",
        "1f1b",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--p2p-groups",
        "ring",
        "-o",
        tmp.path().join("bad").to_str().unwrap(),
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pair, direction, edge"), "{err}");

    // `check` of a hand-written directory under `pair`: the deadlock derived above.
    let dir = tmp.path().join("crossing");
    let p = crossing(P2pGroups::Pair);
    let layout = Layout::uniform(p.num_stages());
    let header = Header {
        source: "hand-written",
        schedule: None,
        layout: &layout,
    };
    files::write_unverified(&dir, &header, &pipec_tests::unverified(&p), Encoding::Json).unwrap();
    let out = pipec_with(["check", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let dir = tmp.path().join("crossing-edge");
    let p = crossing(P2pGroups::Edge);
    files::write_unverified(&dir, &header, &pipec_tests::unverified(&p), Encoding::Json).unwrap();
    let out = pipec_with(["check", dir.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(m["p2p_groups"], "edge");
}

// ---------------------------------------------------------------------------------------------
// An independent executor of NCCL's stream order under each layout: every `isend`/`irecv` is
// its own call on its communicator's stream of its rank; an op completes when it and its
// partner both head their streams. The communicator of a message is written out here from the
// sources (not from pipec's `P2pGroups::group`): torch's pair key is the two ranks, lower
// first; #186173's groups are "forward (r->r+1)" and "backward (r->r-1)" traffic, i.e. the
// tensor's way along the stages; #196666's key is "the directed (source_rank,
// destination_rank) pair".

/// The communicator (as a small tuple) of a message from `from` to `to`.
fn comm_of(groups: P2pGroups, from: usize, to: usize, activation: bool) -> (usize, usize, usize) {
    match groups {
        P2pGroups::Pair => (0, from.min(to), from.max(to)),
        P2pGroups::Direction => (1, usize::from(activation), 0),
        P2pGroups::Edge => (2, from, to),
    }
}

/// Runs `p` under `groups` ([`crate::stream_order`]); `Err` says where it hangs. Matching is
/// FIFO per ordered pair of ranks (NCCL and torch's tag 0).
fn run_in_stream_order(p: &Program, groups: P2pGroups) -> Result<(), String> {
    crate::stream_order::run_in_stream_order(
        p,
        |from, to, payload: Payload| {
            comm_of(
                groups,
                from,
                to,
                payload.kind == pipec_ir::ir::PayloadKind::Act,
            )
        },
        |_, _, _| (),
    )
}

/// The executor agrees with the verifier's D2 (ops issued one by one, the executor's model)
/// under each layout, on the hand-derived programs above and on Megatron's unbatched and
/// overlapped calls (ops issued one by one, batches left in flight) over a grid of sizes. Not
/// vacuous: the hand programs hang where derived, and the grid has hanging programs under
/// `pair` (Megatron at pp = 2 without its WORLD group: every program ends up on one pair).
#[test]
fn stream_order_executor_agrees_with_the_verifier_under_every_layout() {
    use pipec_compiler::compile::{compile, CompileRequest};
    use pipec_ir::verify::{verify_under, Level, StreamRule};
    use pipec_schedules::{MegatronP2p, ScheduleKind};
    let d2 = |p: &Program, groups: P2pGroups| {
        let rule = StreamRule {
            per_direction: false,
            ops_in_order: true,
            groups,
        };
        let r = verify_under(p, &VerifyOptions::default(), Level::Full, 1, rule);
        r.violations.iter().any(|v| {
            matches!(
                v,
                Violation::Deadlock { .. } | Violation::StreamDeadlock { .. }
            )
        })
    };
    for (g, hangs) in [
        (P2pGroups::Pair, true),
        (P2pGroups::Direction, false),
        (P2pGroups::Edge, false),
    ] {
        assert_eq!(run_in_stream_order(&crossing(g), g).is_err(), hangs, "{g}");
        assert_eq!(d2(&crossing(g), g), hangs, "{g}");
    }
    for (g, hangs) in [
        (P2pGroups::Pair, true),
        (P2pGroups::Direction, true),
        (P2pGroups::Edge, false),
    ] {
        assert_eq!(
            run_in_stream_order(&wraparound(g), g).is_err(),
            hangs,
            "{g}"
        );
        assert_eq!(d2(&wraparound(g), g), hangs, "{g}");
    }
    for g in P2pGroups::ALL {
        run_in_stream_order(&pp4_vpp2(g), g).unwrap();
        assert!(!d2(&pp4_vpp2(g), g), "{g}");
    }
    let (mut n, mut hang) = (0, [0usize; 3]);
    for mode in [
        MegatronP2p::Unbatched,
        MegatronP2p::Overlap,
        MegatronP2p::OverlapFlush,
    ] {
        for pp in 2..=4u32 {
            for vpp in 1..=2u32 {
                if mode.overlaps() && vpp == 1 {
                    continue;
                }
                for m in [pp, 2 * pp] {
                    let kind = if vpp == 1 {
                        ScheduleKind::OneFOneB
                    } else {
                        ScheduleKind::Interleaved1F1B
                    };
                    let req = CompileRequest {
                        vpp: Some(vpp),
                        megatron_p2p: mode,
                        ..CompileRequest::new(kind, pp, m)
                    };
                    let Ok(c) = compile(&req) else { continue };
                    for (k, g) in P2pGroups::ALL.into_iter().enumerate() {
                        let what = format!("{mode} pp {pp} vpp {vpp} M {m} {g}");
                        let hangs = run_in_stream_order(&c.program, g).is_err();
                        assert_eq!(d2(&c.program, g), hangs, "{what}");
                        hang[k] += usize::from(hangs);
                        n += 1;
                    }
                }
            }
        }
    }
    assert!(n >= 60, "{n}");
    assert!(hang[0] > 0, "no program hangs under pair: {hang:?}");
}

/// `pipec tune --p2p-groups` (issue #39): every candidate is verified under the groups, the
/// written manifest records them and `--json` names them; the default is `pair`, byte for byte
/// what a tune without the flag writes and prints. The direction winner is run by the
/// independent stream-order executor above under `direction` (its communicators written out
/// from the sources, not from pipec's), and `check` reports its head-of-line waits on the
/// direction communicators, which it reports only for a program that records `direction`.
#[test]
fn tune_verifies_under_the_groups_and_records_them() {
    let tmp = tempfile::tempdir().unwrap();
    let tune = |name: &str, groups: Option<&str>| -> (std::path::PathBuf, serde_json::Value) {
        let dir = tmp.path().join(name);
        let mut args = vec![
            "tune",
            "--pp",
            "4",
            "--microbatches",
            "4",
            "--target",
            "any",
            "--cost",
            "f=1,b=1.5,w=0.7",
            "--json",
            "-o",
            dir.to_str().unwrap(),
        ];
        if let Some(g) = groups {
            args.extend(["--p2p-groups", g]);
        }
        let out = pipec_with(args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // The report names its directory in the run lines, and times itself.
        let text = String::from_utf8(out.stdout)
            .unwrap()
            .replace(dir.to_str().unwrap(), "DIR");
        let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
        json.as_object_mut().unwrap().remove("seconds");
        (dir, json)
    };
    let files = |d: &std::path::Path| -> Vec<(String, Vec<u8>)> {
        let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.file_name().to_string_lossy().into_owned(),
                    std::fs::read(e.path()).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let (plain, plain_json) = tune("plain", None);
    let (pair, pair_json) = tune("pair", Some("pair"));
    assert_eq!(
        files(&plain),
        files(&pair),
        "pair is the default, byte for byte"
    );
    assert_eq!(plain_json, pair_json);
    assert!(plain_json.get("p2p_groups").is_none());
    let manifest = |d: &std::path::Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(d.join("manifest.json")).unwrap()).unwrap()
    };
    assert!(manifest(&plain).get("p2p_groups").is_none());

    for (name, g) in [
        ("edge", P2pGroups::Edge),
        ("direction", P2pGroups::Direction),
    ] {
        let (dir, json) = tune(name, Some(name));
        assert_eq!(json["p2p_groups"], name);
        assert_eq!(manifest(&dir)["p2p_groups"], name);
        let loaded = files::load_dir(&dir).unwrap();
        assert_eq!(loaded.program.p2p_groups, g);
        run_in_stream_order(&loaded.program, g).unwrap();
        let out = pipec_with(["check", dir.to_str().unwrap(), "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(report["valid"], true);
        if g == P2pGroups::Direction {
            // The winner leaves sends in flight (tune's timed lowering), so some receive
            // queues behind one on a direction communicator: checked under direction.
            let hol: Vec<&serde_json::Value> = report["risks"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| r["kind"] == "head_of_line")
                .collect();
            assert!(!hol.is_empty(), "{report}");
            for r in hol {
                assert_eq!(r["groups"], "direction");
                assert!(
                    r["group"] == "downstream" || r["group"] == "upstream",
                    "{r}"
                );
            }
        }
    }

    // The text report names non-default groups on a line of their own, the default none.
    let text = |extra: &[&str]| -> String {
        let mut args = vec!["tune", "--pp", "2", "--microbatches", "4"];
        args.extend(extra);
        let out = pipec_with(args).output().unwrap();
        assert!(out.status.success());
        String::from_utf8(out.stdout).unwrap()
    };
    assert!(text(&["--p2p-groups", "edge"])
        .contains("\ngroups:   edge (the P2P communicators every candidate is verified on)\n"));
    assert!(!text(&[]).contains("\ngroups:"));
    // Megatron posts on torch's own communicators: refused before tuning, in one line.
    let out = pipec_with([
        "tune",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--target",
        "megatron",
        "--p2p-groups",
        "direction",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("which a plan verified under the P2P groups `direction` does not cover"),
        "{err}"
    );

    // A bad name: compile's parser and words, a usage error.
    let out = pipec_with([
        "tune",
        "--pp",
        "2",
        "--microbatches",
        "4",
        "--p2p-groups",
        "ring",
    ])
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown P2P groups `ring` (expected one of pair, direction, edge)"),
        "{err}"
    );
}

/// torch's schedule CSV names no communicators (torch's runtime would post the plan on its
/// own), so `pipec export --format torch-csv` refuses a plan under `direction` or `edge`
/// (exit 1, the reason and pipec.torch as the way), and writes the `pair` plan as before.
#[test]
fn torch_csv_export_refuses_groups_torch_would_not_use() {
    let tmp = tempfile::tempdir().unwrap();
    for groups in ["pair", "direction", "edge"] {
        let dir = tmp.path().join(groups);
        let line = format!("--schedule 1f1b --pp 2 --microbatches 4 --p2p-groups {groups}");
        crate::harness::compile(&dir, &line);
        let out = pipec_with(["export", dir.to_str().unwrap(), "--format", "torch-csv"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        if groups == "pair" {
            assert!(out.status.success(), "{err}");
            assert!(!out.stdout.is_empty());
        } else {
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert!(
                err.contains(&format!("verified under the P2P groups `{groups}`")),
                "{err}"
            );
            assert!(
                err.contains("pipec.torch.build_schedule creates the groups"),
                "{err}"
            );
        }
    }
}
