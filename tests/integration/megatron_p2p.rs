//! Megatron's P2P modes end to end (the issue "Megatron, exactly, in every configuration it
//! runs"): every mode verifies, runs to the end on the brute-force executor, trains bitwise on
//! the CPU runtime; batches left in flight are judged by their waits; what Megatron refuses is
//! refused with its reason. Call-for-call equality with Megatron is `megatron_calls.rs`.

use pipec_compiler::compile::{compile, CompileRequest};
use pipec_ir::files::{write_program, Encoding, Header};
use pipec_ir::ir::{Instr, Payload, Program};
use pipec_ir::verify::{verify, verify_under, Level, Report, StreamRule, VerifyOptions, Violation};
use pipec_runtime::model::ModelConfig;
use pipec_runtime::{load, run_cpu, RunOptions};
use pipec_schedules::{Compute, MegatronP2p, Placement, Rank, ScheduleKind, Task};
use pipec_tests::ir::{bwd, fwd, recv, send};
use pipec_tests::reference::{execute, Verdict};
use std::time::Duration;

fn req(pp: u32, vpp: u32, m: u32, g: Option<u32>, fo: bool, mode: MegatronP2p) -> CompileRequest {
    CompileRequest {
        vpp: Some(vpp),
        group_size: g,
        forward_only: fo,
        megatron_p2p: mode,
        ..CompileRequest::new(
            if vpp == 1 {
                ScheduleKind::OneFOneB
            } else {
                ScheduleKind::Interleaved1F1B
            },
            pp,
            m,
        )
    }
}

/// Every mode over a grid of legal (pp, vpp, M, g), training and forward-only: the verifier
/// says valid and the independent brute-force executor runs every program to the end.
#[test]
fn every_mode_verifies_and_runs_on_the_reference_executor() {
    let mut n = 0;
    for mode in MegatronP2p::ALL {
        for pp in 2..=5u32 {
            for vpp in 1..=3u32 {
                for m in [1, pp - 1, pp, pp + 1, 2 * pp, 3 * pp] {
                    for g in [None, Some(pp + 1), Some(m)] {
                        for fo in [false, true] {
                            let r = req(pp, vpp, m, if vpp == 1 { None } else { g }, fo, mode);
                            let Ok(c) = compile(&r) else { continue };
                            let what = format!("{mode} pp {pp} vpp {vpp} M {m} g {g:?} fo {fo}");
                            let report = verify(&c.program, &VerifyOptions::default());
                            assert!(report.is_valid(), "{what}: {report}");
                            let out = execute(&c.program);
                            assert_eq!(out.verdict, Verdict::Valid, "{what}: {:?}", out.problems);
                            assert!(out.finished, "{what}");
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(n > 400, "only {n} configurations");
}

/// The overlapped modes put in-flight batches and waits into the streams; the CPU runtime runs
/// them and reproduces the single-thread reference bitwise (losses and every gradient).
#[test]
fn every_mode_trains_bitwise_on_the_cpu_runtime() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = RunOptions {
        model: ModelConfig {
            hidden: 4,
            ffn: 8,
            vocab: 8,
            seq: 3,
            seed: 5,
        },
        steps: 2,
        lr: 0.1,
        timeout: Duration::from_secs(20),
        check: true,
        trace_steps: None,
    };
    for mode in MegatronP2p::ALL {
        for (pp, vpp, m, g) in [(2, 2, 4, None), (3, 2, 8, Some(4)), (4, 3, 8, Some(8))] {
            if pp == 2 && mode == MegatronP2p::Batched {
                continue; // refused, as Megatron-LM refuses it
            }
            let c = compile(&req(pp, vpp, m, g, false, mode)).unwrap();
            if mode.overlaps() {
                assert!(c
                    .program
                    .ranks
                    .iter()
                    .flatten()
                    .any(|i| matches!(i, Instr::Wait { .. })));
            }
            let dir = tmp.path().join(format!("{mode}-{pp}-{vpp}-{m}"));
            let header = Header {
                source: "generated",
                schedule: Some(c.spec),
                layout: &c.layout,
            };
            write_program(
                &dir,
                &header,
                &pipec_tests::verified(&c.program),
                Encoding::Json,
            )
            .unwrap();
            let loaded = load(&dir, None).unwrap();
            assert_eq!(
                *loaded.program.program(),
                c.program,
                "the wait instructions round-trip"
            );
            let report = run_cpu(&loaded.program, &loaded.manifest.layout, &opts)
                .unwrap_or_else(|e| panic!("{mode} pp {pp}: {e}"));
            for s in &report.steps {
                assert_eq!(
                    s.check.as_ref().unwrap().max_abs_diff,
                    0.0,
                    "{mode} pp {pp}"
                );
            }
        }
    }
}

/// The configurations the issue found refused or wrong: group size above pp (rank 0 receives
/// the last rank's activation as soon as it exists, in the same call as its own send) and
/// M = pp (no gradient receive fused at the end of warmup).
#[test]
fn group_size_above_pp_was_refused_with_16_deadlocks() {
    let c = compile(&req(4, 2, 8, Some(8), false, MegatronP2p::Batched)).unwrap();
    assert!(verify(&c.program, &VerifyOptions::default()).is_valid());
    // Megatron: after F(chunk 0, mb 3), rank 0's call is {recv act of stage 3 mb 0 from rank 3,
    // send act of stage 0 mb 3 to rank 1}, in _batched_p2p_ops' order (recv_prev first).
    let r0 = &c.program.ranks[0];
    let at = r0
        .iter()
        .position(|i| *i == Instr::Compute(Compute::Fwd(Task::new(0, 3))))
        .unwrap();
    assert_eq!(
        &r0[at + 1..at + 3],
        &[
            Instr::Recv {
                peer: Rank(3),
                payload: Payload::act(3, 0),
                batch: 3,
                tokens: None,
                slot: None,
            },
            Instr::Send {
                peer: Rank(1),
                payload: Payload::act(0, 3),
                batch: 3,
                tokens: None,
                slot: None,
            }
        ]
    );
}

#[test]
fn m_equal_pp_fused_a_gradient_receive_megatron_does_not_post() {
    // pp = 4, vpp = 2, M = 4: rank 0's warmup covers every microbatch (8 >= 8), so its last
    // warmup call only sends (Megatron: {send act 4/3}).
    let c = compile(&req(4, 2, 4, None, false, MegatronP2p::Batched)).unwrap();
    let r0 = &c.program.ranks[0];
    let at = r0
        .iter()
        .position(|i| *i == Instr::Compute(Compute::Fwd(Task::new(4, 3))))
        .unwrap();
    assert_eq!(
        r0[at + 1],
        Instr::Send {
            peer: Rank(1),
            payload: Payload::act(4, 3),
            batch: r0[at + 1].batch().unwrap(),
            tokens: None,
            slot: None,
        }
    );
    assert!(!matches!(r0[at + 2], Instr::Recv { .. } if r0[at + 2].batch() == r0[at + 1].batch()));
}

/// What Megatron refuses, with Megatron's reason.
#[test]
fn megatron_refusals_say_why() {
    let e = compile(&req(2, 2, 4, None, false, MegatronP2p::Batched)).unwrap_err();
    assert!(
        e.to_string().contains("greater than 2 to avoid having multiple p2p sends and recvs between same 2 ranks per communication batch"),
        "{e}"
    );
    let e = compile(&req(4, 1, 8, None, false, MegatronP2p::Overlap)).unwrap_err();
    assert!(
        e.to_string().contains(
            "Non-interleaved pipeline parallelism does not support overlapping p2p communication"
        ),
        "{e}"
    );
    let e = compile(&CompileRequest {
        megatron_p2p: MegatronP2p::Overlap,
        ..CompileRequest::new(ScheduleKind::ZbV, 4, 8)
    })
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("applies to 1f1b and interleaved-1f1b only"),
        "{e}"
    );
    // Without a mode, interleaving at pp = 2 takes the one Megatron runs there.
    let c = compile(&CompileRequest {
        vpp: Some(2),
        ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 2, 4)
    })
    .unwrap();
    assert_eq!(c.spec.megatron_p2p, MegatronP2p::Overlap);
}

/// pp = 2 unbatched is valid but sends two tensors to one peer in one call: `check` says so.
#[test]
fn two_tensors_to_one_peer_in_one_call_is_reported_as_a_risk() {
    let c = compile(&req(2, 2, 4, None, false, MegatronP2p::Unbatched)).unwrap();
    let r = verify(&c.program, &VerifyOptions::default());
    assert!(r.is_valid());
    let first = r.risks.first().expect("a risk").to_string();
    assert!(
        first.starts_with("rank 0, #13: one comm batch sends 2 tensors to rank 1"),
        "{first}"
    );
    // Batched 1F1B at pp = 4 has none.
    let c = compile(&req(4, 1, 8, None, false, MegatronP2p::Batched)).unwrap();
    assert!(verify(&c.program, &VerifyOptions::default())
        .risks
        .is_empty());
}

// ---------------------------------------------------------------------------------------------
// Hand-written programs: the semantics of batches left in flight.

fn two_ranks(r0: Vec<Instr>, r1: Vec<Instr>) -> Program {
    Program {
        placement: Placement::looped(2, 1),
        microbatches: 1,
        forward_only: false,
        comm: None,
        ranks: vec![r0, r1],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    }
}

/// Each rank posts its receive first and in flight, then its blocking send: a posted but not
/// waited receive does not block its rank, so this is valid where each direction has its own
/// NCCL stream (on one stream per pair the send would queue behind the receive: see
/// `megatron_calls_do_not_hang_in_nccl_stream_order`). With the receives blocking it is the
/// classic crossing deadlock.
#[test]
fn a_receive_left_in_flight_does_not_block_its_rank() {
    let split = StreamRule {
        per_direction: true,
        ops_in_order: true,
        groups: pipec_schedules::P2pGroups::Pair,
    };
    let (a, g) = (Payload::act(0, 0), Payload::grad(1, 0));
    let in_flight = two_ranks(
        vec![
            fwd(0, 0),
            recv(1, g, 0),
            send(1, a, 1),
            Instr::Wait { batch: 0 },
            bwd(0, 0),
        ],
        vec![
            recv(0, a, 0),
            Instr::Wait { batch: 0 },
            fwd(1, 0),
            bwd(1, 0),
            send(0, g, 1),
        ],
    );
    let r = verify_as(&in_flight, split);
    assert!(r.is_valid(), "{r}");
    assert_eq!(execute(&in_flight).verdict, Verdict::Valid);
    // The same receive blocking (no wait names it): rank 0 waits for a gradient that rank 1
    // sends only after the activation rank 0 sends after that receive.
    let blocking = two_ranks(
        vec![fwd(0, 0), recv(1, g, 0), send(1, a, 1), bwd(0, 0)],
        vec![recv(0, a, 0), fwd(1, 0), bwd(1, 0), send(0, g, 1)],
    );
    let r = verify(&blocking, &VerifyOptions::default());
    assert!(
        r.violations
            .iter()
            .any(|v| matches!(v, Violation::Deadlock { .. })),
        "{r}"
    );
    assert_eq!(execute(&blocking).verdict, Verdict::Deadlock);
}

/// Using a received tensor before its wait, and waiting for a batch never posted.
#[test]
fn waits_are_checked() {
    let (a, g) = (Payload::act(0, 0), Payload::grad(1, 0));
    let early = two_ranks(
        vec![
            fwd(0, 0),
            send(1, a, 0),
            recv(1, g, 1),
            bwd(0, 0),
            Instr::Wait { batch: 1 },
        ],
        vec![recv(0, a, 0), fwd(1, 0), bwd(1, 0), send(0, g, 1)],
    );
    assert_eq!(
        messages(&early),
        ["rank 0, #3: bwd(stage 0, mb 0) uses its gradient from the receive at #2 before waiting for it (the receive is still in flight)"]
    );
    let nothing = two_ranks(
        vec![
            fwd(0, 0),
            send(1, a, 0),
            Instr::Wait { batch: 7 },
            recv(1, g, 1),
            bwd(0, 0),
        ],
        vec![recv(0, a, 0), fwd(1, 0), bwd(1, 0), send(0, g, 1)],
    );
    assert_eq!(
        messages(&nothing),
        ["rank 0, #2: waits for batch 7, which this rank has not posted before"]
    );
}

/// A cycle through waits is a deadlock the verifier names.
#[test]
fn a_cycle_through_waits_is_a_deadlock() {
    let (a, g) = (Payload::act(0, 0), Payload::grad(1, 0));
    // Rank 0 waits for its gradient before it sends the activation rank 1 needs to make it.
    let p = two_ranks(
        vec![
            fwd(0, 0),
            recv(1, g, 0),
            Instr::Wait { batch: 0 },
            send(1, a, 1),
            bwd(0, 0),
        ],
        vec![recv(0, a, 0), fwd(1, 0), bwd(1, 0), send(0, g, 1)],
    );
    let r = verify(&p, &VerifyOptions::default());
    assert!(
        r.violations
            .iter()
            .any(|v| matches!(v, Violation::Deadlock { .. })),
        "{r}"
    );
    assert_eq!(execute(&p).verdict, Verdict::Deadlock);
}

// ---------------------------------------------------------------------------------------------
// NCCL's stream order: torch's ProcessGroupNCCL runs the P2P ops of one communicator between
// two ranks in issue order on one stream, so an op completes only once every op issued before
// it there has, and its partner is at the head of the peer's stream too. Megatron orders its
// unbatched calls even/odd and, at pp = 2, sends odd-to-even traffic over a second
// communicator (WORLD) for exactly that reason. An independent executor of that model.

/// The communicator of a message from `from` (`_p2p_ops`: at pp = 2 even ranks send on the
/// pipeline group and receive on WORLD, odd ranks the other way round), or always one
/// communicator per pair (`megatron_groups` false).
fn communicator(pp: usize, from: usize, megatron_groups: bool) -> usize {
    usize::from(megatron_groups && pp == 2 && from % 2 == 1)
}

/// Runs `p` with every `isend`/`irecv` its own NCCL call on its (pair, communicator) stream
/// ([`crate::stream_order`]), a send matched with its receive per communicator; `Err` names
/// where it hangs.
fn run_in_stream_order(p: &Program, megatron_groups: bool) -> Result<(), String> {
    let w = p.ranks.len();
    let c = |from: usize| communicator(w, from, megatron_groups);
    crate::stream_order::run_in_stream_order(
        p,
        |from, to, _| (from.min(to), from.max(to), c(from)),
        |from, _, _| c(from),
    )
}

/// Megatron's unbatched and overlapped calls never hang under NCCL's stream order: the
/// even/odd order and the pp = 2 WORLD group line every stream up. The model is not vacuous: a
/// receive posted before a send to the same peer on both sides of one stream hangs.
#[test]
fn megatron_calls_do_not_hang_in_nccl_stream_order() {
    let (mut n, mut single_comm_hangs) = (0, 0);
    for mode in MegatronP2p::ALL {
        if mode == MegatronP2p::Batched {
            continue; // one NCCL group per call, waited at once: the rendezvous model
        }
        for pp in 2..=6u32 {
            for vpp in 1..=3u32 {
                for m in [pp, pp + 1, 2 * pp, 3 * pp] {
                    for g in [None, Some(pp + 1)] {
                        for fo in [false, true] {
                            let r = req(pp, vpp, m, if vpp == 1 { None } else { g }, fo, mode);
                            let Ok(c) = compile(&r) else { continue };
                            let what = format!("{mode} pp {pp} vpp {vpp} M {m} g {g:?} fo {fo}");
                            run_in_stream_order(&c.program, true)
                                .unwrap_or_else(|e| panic!("{what}: {e}"));
                            // The verifier's D2 with the program's own rule agrees...
                            let rule = StreamRule::of(&c.program);
                            assert!(stream_deadlocks(&c.program, rule) == 0, "{what}");
                            // ...and, with one communicator per pair, flags exactly the
                            // programs that then hang (Megatron's WORLD group is needed).
                            let one = StreamRule {
                                per_direction: false,
                                ..rule
                            };
                            let hangs = run_in_stream_order(&c.program, false).is_err();
                            assert_eq!(stream_deadlocks(&c.program, one) > 0, hangs, "{what}");
                            single_comm_hangs += usize::from(hangs);
                            n += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(n > 300, "{n}");
    assert!(
        single_comm_hangs > 0,
        "the pp = 2 WORLD group never mattered"
    );
    // Both ranks post a receive from the other before their send, on one stream (pp > 2
    // communicator rule, here forced by three ranks with rank 2 idle): it hangs, and D2 says
    // so though rendezvous (D1) alone finds it valid.
    let (a, g) = (Payload::act(0, 0), Payload::grad(1, 0));
    let crossing = Program {
        placement: Placement::looped(3, 1),
        microbatches: 1,
        forward_only: false,
        comm: None,
        ranks: vec![
            vec![
                fwd(0, 0),
                recv(1, g, 0),
                send(1, a, 1),
                Instr::Wait { batch: 0 },
            ],
            vec![recv(0, a, 0), send(0, g, 1), Instr::Wait { batch: 0 }],
            vec![],
        ],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    };
    assert!(run_in_stream_order(&crossing, true)
        .unwrap_err()
        .starts_with("hangs"));
    let r = verify(&crossing, &VerifyOptions::default());
    let msgs: Vec<String> = r
        .violations
        .iter()
        .filter(|v| matches!(v, Violation::StreamDeadlock { .. }))
        .map(|v| v.to_string())
        .collect();
    assert_eq!(
        msgs,
        ["deadlock under NCCL's stream order (ops of one communicator between two ranks run in issue order):\n    rank 0, #1 recv(grad of stage 1, mb 0 <- rank 1)\n    rank 1, #0 recv(act of stage 0, mb 0 <- rank 0)\n    (each waits for the one after it, the last for the first)"],
    );
    // With each direction on its own communicator, nothing queues behind the receives.
    let split = StreamRule {
        per_direction: true,
        ops_in_order: true,
        groups: pipec_schedules::P2pGroups::Pair,
    };
    assert_eq!(stream_deadlocks(&crossing, split), 0);
}

/// Every violation of `p` in words, under the default options.
fn messages(p: &Program) -> Vec<String> {
    verify(p, &VerifyOptions::default())
        .violations
        .iter()
        .map(|v| v.to_string())
        .collect()
}

/// `p` verified under `streams` rather than the rule of its own communicator model.
fn verify_as(p: &Program, streams: StreamRule) -> Report {
    verify_under(p, &VerifyOptions::default(), Level::Full, 1, streams)
}

fn stream_deadlocks(p: &Program, streams: StreamRule) -> usize {
    verify_as(p, streams)
        .violations
        .iter()
        .filter(|v| matches!(v, Violation::StreamDeadlock { .. }))
        .count()
}

/// Review finding: a waited id reused by a later batch was valid for the verifier, while
/// `pipec-run` (which keys handles by id for the whole stream) refused it. Both refuse now.
#[test]
fn a_waited_batch_id_reused_after_its_wait_is_ambiguous() {
    let (a, g) = (Payload::act(0, 0), Payload::grad(1, 0));
    let p = two_ranks(
        vec![
            fwd(0, 0),
            send(1, a, 0),
            Instr::Wait { batch: 0 },
            recv(1, g, 0),
            bwd(0, 0),
        ],
        vec![recv(0, a, 0), fwd(1, 0), bwd(1, 0), send(0, g, 1)],
    );
    assert_eq!(
        messages(&p),
        ["rank 0, #2: waits for batch 0, but two separate batches of this rank use that id"]
    );
}

/// Review finding: a long batch made the same-peer risk check quadratic (200,000 sends to one
/// peer: 2e10 comparisons); it is one sorted pass now, and the risk lists every tensor.
#[test]
fn a_long_batch_to_one_peer_is_one_risk_found_fast() {
    let n = 200_000u32;
    let p = Program {
        placement: Placement::looped(2, 1),
        microbatches: n,
        forward_only: true,
        comm: None,
        ranks: vec![
            (0..n)
                .map(|mb| fwd(0, mb))
                .chain((0..n).map(|mb| send(1, Payload::act(0, mb), 0)))
                .collect(),
            (0..n)
                .map(|mb| recv(0, Payload::act(0, mb), 0))
                .chain((0..n).map(|mb| fwd(1, mb)))
                .collect(),
        ],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    };
    let t = std::time::Instant::now();
    let r = verify(&p, &VerifyOptions::default());
    assert!(r.is_valid(), "{r}");
    assert_eq!(r.risks.len(), 2, "one for the sends, one for the receives");
    for k in &r.risks {
        let pipec_ir::verify::Risk::SamePeerTwice { payloads, .. } = k else {
            panic!("only K1 here: every batch is blocking, so nothing queues ({k})");
        };
        assert_eq!(payloads.len(), n as usize);
        assert_eq!(payloads[7], Payload::act(0, 7), "in posting order");
    }
    // Not a timing test: a quadratic check would take minutes; this takes well under one.
    assert!(t.elapsed() < std::time::Duration::from_secs(60));
}

/// Review finding: with each batch one NCCL group, a later op on a stream waits for the whole
/// earlier batch that used it (one kernel), not just its last op. Rank 0 leaves in flight a
/// group that receives from rank 1 and sends to rank 1; rank 1 first needs rank 0's later
/// blocking send before it can send what that group receives.
#[test]
fn a_later_op_waits_for_the_whole_group_before_it_on_its_stream() {
    let (a0, a1, g) = (Payload::act(0, 0), Payload::act(0, 1), Payload::grad(1, 0));
    // Rank 0: group {recv g from 1, send a0 to 1} in flight; then blocking send a1 to 1.
    // Rank 1: receives a0, then a1, then sends g. The blocking send of a1 queues behind the
    // whole group on the pair's stream, the group needs g, g needs a1: a hang on NCCL.
    let p = Program {
        placement: Placement::looped(2, 1),
        microbatches: 2,
        forward_only: false,
        comm: None,
        ranks: vec![
            vec![
                fwd(0, 0),
                fwd(0, 1),
                recv(1, g, 0),
                send(1, a0, 0),
                send(1, a1, 1),
                Instr::Wait { batch: 0 },
            ],
            vec![recv(0, a0, 0), recv(0, a1, 1), send(0, g, 2)],
        ],
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    };
    assert_eq!(stream_deadlocks(&p, StreamRule::default()), 1);
    // Under rendezvous alone (D1) it runs: the send of a1 does not wait for the group.
    let r = verify(&p, &VerifyOptions::default());
    assert!(
        !r.violations
            .iter()
            .any(|v| matches!(v, Violation::Deadlock { .. })),
        "{r}"
    );
}
