//! One minimal program per [`Violation`] variant: each breaks one invariant of the verifier's
//! specification (`pipec_ir::verify`'s module doc) in an otherwise valid program, and the test
//! states, derived by hand from that program, every violation the verifier must report: its
//! variant and the rank and instruction index it is reported at (`Violation::at`), or for a
//! violation of the whole program (no instruction) the rank or figure it names. A guard reads
//! the variants from the enum's source so that a new variant without a program here fails.
//!
//! The programs are tiny: one rank holding two stages (`looped(1, 2)`), two ranks with one
//! stage each (`looped(2, 1)`), or three (`looped(3, 1)`), one microbatch.

use pipec_ir::ir::{Instr, InstrRef, MemKind, MemOp, Payload, Program, Tokens};
use pipec_ir::verify::{verify, VerifyOptions, Violation};
use pipec_schedules::{Compute, Lengths, Placement, Rank, Task};

fn f(s: u32, m: u32) -> Instr {
    Instr::Compute(Compute::Fwd(Task::new(s, m)))
}
fn b(s: u32, m: u32) -> Instr {
    Instr::Compute(Compute::Bwd(Task::new(s, m)))
}
fn bd(s: u32, m: u32) -> Instr {
    Instr::Compute(Compute::BwdD(Task::new(s, m)))
}
fn bw(s: u32, m: u32) -> Instr {
    Instr::Compute(Compute::BwdW(Task::new(s, m)))
}
fn ck(s: u32, m: u32) -> Instr {
    Instr::FwdCheckpoint(Task::new(s, m))
}
fn mem(kind: MemKind, s: u32, m: u32) -> Instr {
    Instr::Memory(MemOp {
        kind,
        task: Task::new(s, m),
    })
}
fn off(s: u32, m: u32) -> Instr {
    mem(MemKind::Offload, s, m)
}
fn rel(s: u32, m: u32) -> Instr {
    mem(MemKind::Reload, s, m)
}
fn wait_off(s: u32, m: u32) -> Instr {
    mem(MemKind::WaitOffload, s, m)
}
fn rec(s: u32, m: u32) -> Instr {
    mem(MemKind::Recompute, s, m)
}
fn send(peer: u32, payload: Payload, batch: u32) -> Instr {
    Instr::Send {
        peer: Rank(peer),
        payload,
        batch,
        tokens: None,
        slot: None,
    }
}
fn recv(peer: u32, payload: Payload, batch: u32) -> Instr {
    Instr::Recv {
        peer: Rank(peer),
        payload,
        batch,
        tokens: None,
        slot: None,
    }
}
fn wait(batch: u32) -> Instr {
    Instr::Wait { batch }
}
fn a(s: u32) -> Payload {
    Payload::act(s, 0)
}
fn g(s: u32) -> Payload {
    Payload::grad(s, 0)
}

fn program(placement: Placement, ranks: Vec<Vec<Instr>>) -> Program {
    Program {
        placement,
        microbatches: 1,
        forward_only: false,
        comm: None,
        ranks,
        lengths: None,
        p2p_groups: Default::default(),
        buffer_slots: None,
    }
}

/// One rank holding stages 0 and 1.
fn one_rank(instrs: Vec<Instr>) -> Program {
    program(Placement::looped(1, 2), vec![instrs])
}

/// Two ranks, stage 0 on rank 0 and stage 1 on rank 1.
fn two_ranks(r0: Vec<Instr>, r1: Vec<Instr>) -> Program {
    program(Placement::looped(2, 1), vec![r0, r1])
}

/// The valid two-rank program the two-rank cases change.
/// `p` with microbatch lengths (one sequence each), every message sized by them.
fn sized(mut p: Program, lengths: &[i128]) -> Program {
    let l = Lengths::from_lists(lengths.iter().map(|&x| vec![x]).collect()).unwrap();
    p.set_lengths(Some(l));
    p
}

fn set_tokens(ins: &mut Instr, t: u32) {
    if let Instr::Send { tokens, .. } | Instr::Recv { tokens, .. } = ins {
        *tokens = Tokens::new(t);
    }
}

fn two_rank_ok() -> (Vec<Instr>, Vec<Instr>) {
    (
        vec![f(0, 0), send(1, a(0), 0), recv(1, g(1), 1), b(0, 0)],
        vec![recv(0, a(0), 0), f(1, 0), b(1, 0), send(0, g(1), 1)],
    )
}

/// A violation's variant name (`WrongTensor`) and where it is reported: `(rank, index)` of
/// its instruction, or `None` for a violation of the whole program.
type Found = (String, Option<(u32, u32)>);

fn found(v: &Violation) -> Found {
    let name = format!("{v:?}");
    let name = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .next()
        .unwrap()
        .to_string();
    (name, v.at().map(|InstrRef { rank, index }| (rank.0, index)))
}

fn judged(p: &Program, opts: &VerifyOptions, msg: Option<f64>) -> Vec<Violation> {
    if msg.is_none() {
        return verify(p, opts).violations;
    }
    // A cost model that sizes messages (B3): the default memory model, messages of `msg`.
    let mem = pipec_ir::memory::MemoryModel {
        msg,
        ..pipec_ir::memory::MemoryModel::units(p)
    };
    let limit = opts.memory_limit.map(|l| l as f64);
    pipec_ir::verify::verify_with(p, pipec_ir::verify::Level::Full, 1, &mem, limit).violations
}

/// `p` with a buffer plan: pools of `pool` slots of size 1 per rank, and the slots `slots[r][i]`
/// on each message of rank `r` in stream order (`None`: none).
fn slotted(mut p: Program, pool: usize, slots: &[&[Option<u32>]]) -> Program {
    for (r, want) in slots.iter().enumerate() {
        let mut k = 0;
        for ins in p.ranks[r].iter_mut() {
            if let Instr::Send { slot, .. } | Instr::Recv { slot, .. } = ins {
                *slot = want[k];
                k += 1;
            }
        }
    }
    p.buffer_slots = Some(pipec_ir::ir::Pools(vec![vec![1.0; pool]; p.ranks.len()]));
    p
}

/// One case: a name, the program, the options, and every violation the verifier must report
/// (variant, instruction), in the verifier's order.
struct Case {
    name: &'static str,
    program: Program,
    opts: VerifyOptions,
    want: Vec<(&'static str, Option<(u32, u32)>)>,
    /// Messages' size under the cost model (B3), `None`: the verifier's default model.
    msg: Option<f64>,
}

fn case(
    name: &'static str,
    program: Program,
    want: Vec<(&'static str, Option<(u32, u32)>)>,
) -> Case {
    Case {
        name,
        program,
        opts: VerifyOptions::default(),
        want,
        msg: None,
    }
}

fn cases() -> Vec<Case> {
    let (r0, r1) = two_rank_ok();
    let at = |rank: u32, index: u32| Some((rank, index));
    let mut out = vec![
        // S1: a placement for one rank (both stages on rank 0) over a program with two rank
        // streams, the second empty.
        case(
            "WorldMismatch",
            program(
                Placement::looped(1, 2),
                vec![vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0)], vec![]],
            ),
            vec![("WorldMismatch", None)],
        ),
        // S1: the two-rank placement over one rank stream: stage 1 is placed on rank 1,
        // which the program does not have. Stage 1's passes run on rank 0 (whose owner is
        // out of range: no wrong-rank or missing report for them).
        case(
            "PlacementOutOfRange",
            program(
                Placement::looped(2, 1),
                vec![vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0)]],
            ),
            vec![("WorldMismatch", None), ("PlacementOutOfRange", None)],
        ),
        // S2: a forward of microbatch 7 in a one-microbatch program, at rank 0, #4.
        case(
            "OutOfRange",
            one_rank(vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0), f(0, 7)]),
            vec![("OutOfRange", at(0, 4))],
        ),
        // C1: stage 0's backward never runs.
        case(
            "Missing",
            one_rank(vec![f(0, 0), f(1, 0), b(1, 0)]),
            vec![("Missing", None)],
        ),
        // C1: stage 0's forward runs twice; reported at the second, #1.
        case(
            "Duplicate",
            one_rank(vec![f(0, 0), f(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("Duplicate", at(0, 1))],
        ),
        // C3: rank 0 runs stage 1's forward and backward, which rank 1 owns. Stage 0's
        // backward (#3) then needs stage 1's gradient from rank 1, its owner, which never
        // sends it (the wrong-rank passes feed nothing).
        case(
            "WrongRank",
            two_ranks(vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0)], vec![]),
            vec![
                ("WrongRank", at(0, 1)),
                ("WrongRank", at(0, 2)),
                ("InputNeverReceived", at(0, 3)),
            ],
        ),
        // C2: stage 0's bwd_D without its bwd_W, at #3.
        case(
            "UnpairedSplit",
            one_rank(vec![f(0, 0), f(1, 0), b(1, 0), bd(0, 0)]),
            vec![("UnpairedSplit", at(0, 3))],
        ),
        // C2: stage 0 has a full bwd (#3) and a bwd_D + bwd_W pair; reported at the bwd.
        case(
            "MixedBackward",
            one_rank(vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0), bd(0, 0), bw(0, 0)]),
            vec![("MixedBackward", at(0, 3))],
        ),
        // C2: a backward (#2) in a forward-only program.
        case(
            "BackwardInForwardOnly",
            Program {
                forward_only: true,
                ..one_rank(vec![f(0, 0), f(1, 0), b(1, 0)])
            },
            vec![("BackwardInForwardOnly", at(0, 2))],
        ),
        // M1: rank 1's receive (#0) names the gradient of stage 0 where rank 0 sends the
        // activation; the activation rank 1's forward (#1) needs is then never received.
        case(
            "WrongTensor",
            {
                let mut r1 = r1.clone();
                r1[0] = recv(0, g(0), 0);
                two_ranks(r0.clone(), r1)
            },
            vec![("WrongTensor", at(1, 0)), ("InputNeverReceived", at(1, 1))],
        ),
        // M3: microbatch 0 holds 5 tokens and every message says so, but rank 1's receive
        // (#0) of the activation expects 7: it is matched with a send of 5 tokens, and 7 is
        // not what the lengths give either.
        case(
            "WrongTokens",
            {
                let mut p = sized(two_ranks(r0.clone(), r1.clone()), &[5]);
                set_tokens(&mut p.ranks[1][0], 7);
                p
            },
            vec![("WrongTokens", at(1, 0)), ("TokensNotLengths", at(1, 0))],
        ),
        // M4: the program gives microbatch 0 five tokens, and no message carries them (a
        // file written without lengths under a manifest with them): one report per rank, at
        // its first message.
        case(
            "TokensNotLengths",
            Program {
                lengths: Some(Lengths::parse("5").unwrap()),
                ..two_ranks(r0.clone(), r1.clone())
            },
            vec![
                ("TokensNotLengths", at(0, 1)),
                ("TokensNotLengths", at(1, 0)),
            ],
        ),
        // M2: a second send of stage 0's activation (#4) that rank 1 never receives.
        case(
            "Unmatched",
            {
                let mut r0 = r0.clone();
                r0.push(send(1, a(0), 2));
                two_ranks(r0, r1.clone())
            },
            vec![("Unmatched", at(0, 4))],
        ),
        // D1: rank 0 waits for the gradient (#1) before sending the activation (#2) that
        // rank 1 needs to make it.
        case(
            "Deadlock",
            two_ranks(
                vec![f(0, 0), recv(1, g(1), 1), send(1, a(0), 0), b(0, 0)],
                r1.clone(),
            ),
            vec![("Deadlock", at(0, 1))],
        ),
        // D2: rank 0 leaves its receive of the gradient (#1) in flight and then sends the
        // activation on the same communicator: under NCCL's stream order the send waits for
        // the receive, which waits for rank 1, which waits for the send. Rendezvous alone
        // (D1) finds it valid.
        case(
            "StreamDeadlock",
            two_ranks(
                vec![
                    f(0, 0),
                    recv(1, g(1), 0),
                    send(1, a(0), 1),
                    wait(0),
                    b(0, 0),
                ],
                vec![recv(0, a(0), 0), f(1, 0), b(1, 0), send(0, g(1), 1)],
            ),
            vec![("StreamDeadlock", at(0, 1))],
        ),
        // D3: a wait (#1) for batch 9, which rank 0 never posts.
        case(
            "WaitWithoutBatch",
            one_rank(vec![f(0, 0), wait(9), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("WaitWithoutBatch", at(0, 1))],
        ),
        // D3: batch id 0 names two batches of rank 0: its send, waited at #2, and the receive
        // after that wait. The wait cannot say which (a runtime keys handles by id for the
        // whole stream).
        case(
            "WaitAmbiguous",
            two_ranks(
                vec![
                    f(0, 0),
                    send(1, a(0), 0),
                    wait(0),
                    recv(1, g(1), 0),
                    b(0, 0),
                ],
                r1.clone(),
            ),
            vec![("WaitAmbiguous", at(0, 2))],
        ),
        // D3: rank 1 leaves its receive of the activation in flight and runs the forward
        // (#1) that uses it before the wait (#2).
        case(
            "RunsBeforeWait",
            two_ranks(
                r0.clone(),
                vec![
                    recv(0, a(0), 0),
                    f(1, 0),
                    wait(0),
                    b(1, 0),
                    send(0, g(1), 1),
                ],
            ),
            vec![("RunsBeforeWait", at(1, 1))],
        ),
        // P2: rank 1's forward (#0) runs before the receive (#1) of its activation.
        case(
            "RunsBeforeInput",
            two_ranks(
                r0.clone(),
                vec![f(1, 0), recv(0, a(0), 0), b(1, 0), send(0, g(1), 1)],
            ),
            vec![("RunsBeforeInput", at(1, 0))],
        ),
        // P2: nobody sends stage 0's activation to rank 1; its forward (#0) never gets it.
        case(
            "InputNeverReceived",
            two_ranks(
                vec![f(0, 0), recv(1, g(1), 1), b(0, 0)],
                vec![f(1, 0), b(1, 0), send(0, g(1), 1)],
            ),
            vec![("InputNeverReceived", at(1, 0))],
        ),
        // P2: stage 1's forward (#0) runs before stage 0's (#1) on the same rank.
        case(
            "RunsBeforeLocal",
            one_rank(vec![f(1, 0), f(0, 0), b(1, 0), b(0, 0)]),
            vec![("RunsBeforeLocal", at(0, 0))],
        ),
        // P2: rank 1 runs stage 1's forward twice (#1, #2) on one received activation: the
        // second run is a duplicate and uses the tensor the first already consumed.
        case(
            "InputUsedTwice",
            two_ranks(
                r0.clone(),
                vec![
                    recv(0, a(0), 0),
                    f(1, 0),
                    f(1, 0),
                    b(1, 0),
                    send(0, g(1), 1),
                ],
            ),
            vec![("Duplicate", at(1, 2)), ("InputUsedTwice", at(1, 2))],
        ),
        // P2: rank 0 sends the activation twice and rank 1 receives it twice; its forward
        // uses the first receive, the second (#1) is never used.
        case(
            "ReceivedUnused",
            two_ranks(
                vec![
                    f(0, 0),
                    send(1, a(0), 0),
                    send(1, a(0), 0),
                    recv(1, g(1), 1),
                    b(0, 0),
                ],
                vec![
                    recv(0, a(0), 0),
                    recv(0, a(0), 0),
                    f(1, 0),
                    b(1, 0),
                    send(0, g(1), 1),
                ],
            ),
            vec![("ReceivedUnused", at(1, 1))],
        ),
        // P3: rank 0 sends the activation (#0) before the forward that makes it (#1).
        case(
            "SendBeforeProduce",
            two_ranks(
                vec![send(1, a(0), 0), f(0, 0), recv(1, g(1), 1), b(0, 0)],
                r1.clone(),
            ),
            vec![("SendBeforeProduce", at(0, 0))],
        ),
        // P3: over three ranks, rank 0 sends stage 1's activation (#1), which rank 1 makes,
        // to rank 2 (its consumer's owner); rank 1 sends nothing.
        case(
            "SendsUnproduced",
            program(
                Placement::looped(3, 1),
                vec![
                    vec![
                        f(0, 0),
                        send(1, a(0), 0),
                        send(2, a(1), 1),
                        recv(1, g(1), 2),
                        b(0, 0),
                    ],
                    vec![
                        recv(0, a(0), 0),
                        f(1, 0),
                        recv(2, g(2), 1),
                        b(1, 0),
                        send(0, g(1), 2),
                    ],
                    vec![recv(0, a(1), 1), f(2, 0), b(2, 0), send(1, g(2), 1)],
                ],
            ),
            vec![("SendsUnproduced", at(0, 2))],
        ),
        // P3: over three ranks, rank 0 sends stage 0's activation (#1) to rank 2, which
        // receives it; stage 1's owner is rank 1, whose forward (#0) then never gets it.
        case(
            "WrongDestination",
            program(
                Placement::looped(3, 1),
                vec![
                    vec![f(0, 0), send(2, a(0), 0), recv(1, g(1), 1), b(0, 0)],
                    vec![
                        f(1, 0),
                        send(2, a(1), 0),
                        recv(2, g(2), 1),
                        b(1, 0),
                        send(0, g(1), 1),
                    ],
                    vec![
                        recv(0, a(0), 0),
                        recv(1, a(1), 0),
                        f(2, 0),
                        b(2, 0),
                        send(1, g(2), 1),
                    ],
                ],
            ),
            vec![
                ("WrongDestination", at(0, 1)),
                ("InputNeverReceived", at(1, 0)),
            ],
        ),
        // P3: rank 1 sends the last stage's activation (#2), which no stage consumes, and rank
        // 0 receives it.
        case(
            "NoConsumer",
            two_ranks(
                vec![
                    f(0, 0),
                    send(1, a(0), 0),
                    recv(1, a(1), 2),
                    recv(1, g(1), 1),
                    b(0, 0),
                ],
                vec![
                    recv(0, a(0), 0),
                    f(1, 0),
                    send(0, a(1), 2),
                    b(1, 0),
                    send(0, g(1), 1),
                ],
            ),
            vec![("NoConsumer", at(1, 2))],
        ),
        // P3: one rank holding both stages sends stage 0's activation to itself (#1); stage
        // 1's forward takes it from stage 0's forward on the rank, so the receive (#2) is
        // never used either.
        case(
            "SelfMessage",
            one_rank(vec![
                f(0, 0),
                send(0, a(0), 0),
                recv(0, a(0), 0),
                f(1, 0),
                b(1, 0),
                b(0, 0),
            ]),
            vec![("SelfMessage", at(0, 1)), ("ReceivedUnused", at(0, 2))],
        ),
        // M1: an offload (#0) before the forward it copies.
        case(
            "OffloadWithoutForward",
            one_rank(vec![off(0, 0), f(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("OffloadWithoutForward", at(0, 0))],
        ),
        // M1: an offload (#1) of a checkpointed forward.
        case(
            "OffloadOfCheckpointed",
            one_rank(vec![
                ck(0, 0),
                off(0, 0),
                f(1, 0),
                b(1, 0),
                rec(0, 0),
                b(0, 0),
            ]),
            vec![("OffloadOfCheckpointed", at(0, 1))],
        ),
        // M3: a reload (#1) with no offload before it.
        case(
            "ReloadWithoutOffload",
            one_rank(vec![f(0, 0), rel(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("ReloadWithoutOffload", at(0, 1))],
        ),
        // M4: a wait_offload (#1) with no offload before it.
        case(
            "WaitOffloadWithoutOffload",
            one_rank(vec![f(0, 0), wait_off(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("WaitOffloadWithoutOffload", at(0, 1))],
        ),
        // M5: a recompute (#2) of a forward that was not checkpointed.
        case(
            "RecomputeWithoutCheckpoint",
            one_rank(vec![f(0, 0), f(1, 0), rec(0, 0), b(1, 0), b(0, 0)]),
            vec![("RecomputeWithoutCheckpoint", at(0, 2))],
        ),
        // M2: the second offload (#2) of one forward.
        case(
            "MemoryOpTwice",
            one_rank(vec![
                f(0, 0),
                off(0, 0),
                off(0, 0),
                f(1, 0),
                rel(0, 0),
                b(1, 0),
                b(0, 0),
            ]),
            vec![("MemoryOpTwice", at(0, 2))],
        ),
        // M2: an offload (#4) after the backward that needed the activations.
        case(
            "MemoryOpAfterBackward",
            one_rank(vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0), off(0, 0)]),
            vec![("MemoryOpAfterBackward", at(0, 4))],
        ),
        // M3: stage 0's backward (#4) while its activations are offloaded, not reloaded.
        case(
            "BackwardWhileOffloaded",
            one_rank(vec![f(0, 0), off(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("BackwardWhileOffloaded", at(0, 4))],
        ),
        // M5: the backward (#3) of a checkpointed forward with no recompute before it.
        case(
            "BackwardWithoutRecompute",
            one_rank(vec![ck(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("BackwardWithoutRecompute", at(0, 3))],
        ),
    ];
    // R1: two live activations (after stage 1's forward, #1) under a limit of one.
    out.push(Case {
        opts: VerifyOptions {
            memory_limit: Some(1),
        },
        ..case(
            "MemoryLimit",
            one_rank(vec![f(0, 0), f(1, 0), b(1, 0), b(0, 0)]),
            vec![("MemoryLimit", at(0, 1))],
        )
    });
    // B1-B3 (buffer plan, issue #39). In the valid two-rank program each rank's two messages
    // live apart (rank 0: the send over #0-#1, from its forward to its batch; the receive over
    // #2-#3, to its backward), so one slot per rank holds both.
    // B1: rank 1's send (#3) has no slot in a program with a plan.
    out.push(case(
        "SlotMissing",
        slotted(
            two_ranks(r0.clone(), r1.clone()),
            1,
            &[&[Some(0), Some(0)], &[Some(0), None]],
        ),
        vec![("SlotMissing", at(1, 3))],
    ));
    // B1: rank 0's send (#1) names a slot in a program without a plan.
    out.push(case(
        "SlotWithoutPlan",
        {
            let mut p = two_ranks(r0.clone(), r1.clone());
            if let Instr::Send { slot, .. } = &mut p.ranks[0][1] {
                *slot = Some(0);
            }
            p
        },
        vec![("SlotWithoutPlan", at(0, 1))],
    ));
    // B1: rank 1's receive (#0) names slot 1 of a one-slot pool.
    out.push(case(
        "SlotOutOfRange",
        slotted(
            two_ranks(r0.clone(), r1.clone()),
            1,
            &[&[Some(0), Some(0)], &[Some(1), Some(0)]],
        ),
        vec![("SlotOutOfRange", at(1, 0))],
    ));
    // B2: rank 0 posts its send and its receive in one batch (#1-#2), so the sent activation
    // (from the forward at #0 to the batch's end at #2) and the received gradient (from the
    // post at #1 to the backward at #3) live together; both in slot 0: reported at the
    // receive, the later start.
    out.push(case(
        "SlotReused",
        {
            let r0 = vec![f(0, 0), send(1, a(0), 0), recv(1, g(1), 0), b(0, 0)];
            slotted(
                two_ranks(r0, r1.clone()),
                1,
                &[&[Some(0), Some(0)], &[Some(0), Some(0)]],
            )
        },
        vec![("SlotReused", at(0, 2))],
    ));
    // B3: under a cost model whose messages weigh 2, every slot (size 1) is too small: each
    // message, in rank order.
    out.push(Case {
        msg: Some(2.0),
        ..case(
            "SlotTooSmall",
            slotted(
                two_ranks(r0.clone(), r1.clone()),
                1,
                &[&[Some(0), Some(0)], &[Some(0), Some(0)]],
            ),
            vec![
                ("SlotTooSmall", at(0, 1)),
                ("SlotTooSmall", at(0, 2)),
                ("SlotTooSmall", at(1, 0)),
                ("SlotTooSmall", at(1, 3)),
            ],
        )
    });
    // S3: so many (stage, microbatch) tasks (2 * u32::MAX) that the program's one compute op
    // cannot cover them: per-task checks are skipped.
    out.push(case(
        "TooFewOps",
        Program {
            microbatches: u32::MAX,
            ..one_rank(vec![f(0, 0)])
        },
        vec![("TooFewOps", None)],
    ));
    out
}

/// Variants no program can produce, and why.
const UNPRODUCIBLE: [&str; 1] = [
    // S3: a program with u32::MAX instructions or rank streams, more than the verifier's u32
    // positions can number: tens of GB of instruction vectors, more than a test machine has.
    // The rule is the one comparison at the top of `pipec_ir::ir::Positions::new`.
    "TooLarge",
];

/// Each minimal program gets exactly the violations derived for it, at the instructions
/// derived for it, and its own variant among them; each message names its instruction.
#[test]
fn each_minimal_program_gets_its_violations_at_its_instructions() {
    let mut failures = Vec::new();
    for c in cases() {
        let got: Vec<Found> = judged(&c.program, &c.opts, c.msg)
            .iter()
            .map(found)
            .collect();
        let want: Vec<Found> = c.want.iter().map(|(n, at)| (n.to_string(), *at)).collect();
        assert!(
            want.iter().any(|(n, _)| n == c.name),
            "{}: the case must expect its own variant",
            c.name
        );
        if got != want {
            failures.push(format!("{}: got {got:?}, want {want:?}", c.name));
        }
        // The message names the instruction the way pipec prints it: `rank 1, #4`.
        for v in judged(&c.program, &c.opts, c.msg) {
            if let Some(InstrRef { rank, index }) = v.at() {
                let named = format!("rank {}, #{index}", rank.0);
                if !v.to_string().contains(&named) {
                    failures.push(format!("{}: {v} does not name {named}", c.name));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The fields of the violations that name no instruction: the figures of the program they
/// are about.
#[test]
fn whole_program_violations_name_their_ranks_and_figures() {
    let all: Vec<(&str, Vec<Violation>)> = cases()
        .into_iter()
        .map(|c| (c.name, judged(&c.program, &c.opts, c.msg)))
        .collect();
    let of = |name: &str| &all.iter().find(|(n, _)| *n == name).unwrap().1;
    assert_eq!(
        of("WorldMismatch")[0],
        Violation::WorldMismatch { pp: 1, ranks: 2 }
    );
    assert!(matches!(
        of("PlacementOutOfRange")[1],
        Violation::PlacementOutOfRange { stage, rank: Rank(1), world: 1 } if stage.0 == 1
    ));
    assert!(matches!(
        &of("Missing")[0],
        Violation::Missing { part, owner: Rank(0) }
            if part.pass == pipec_schedules::Pass::Bwd && part.task == Task::new(0, 0)
    ));
    assert_eq!(
        of("TooFewOps")[0],
        Violation::TooFewOps {
            tasks: 2 * u32::MAX as u64,
            compute_parts: 1
        }
    );
    let Violation::MemoryLimit {
        rank, limit, peak, ..
    } = &of("MemoryLimit")[0]
    else {
        panic!("{:?}", of("MemoryLimit"));
    };
    assert_eq!((*rank, *limit, *peak), (Rank(0), 1.0, 2.0));
}

/// Every variant of `Violation`, read from its source, has a minimal program here or is
/// listed as one no program can produce.
#[test]
fn every_violation_variant_has_a_minimal_program() {
    let src = include_str!("../../ir/src/verify/violation.rs");
    let body = &src[src.find("pub enum Violation {").expect("the enum")..];
    let body = &body[..body.find("\n}\n").expect("its end")];
    let variants: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("    "))
        .filter(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|l| {
            l.split(|c: char| !c.is_ascii_alphanumeric())
                .next()
                .unwrap()
        })
        .collect();
    assert!(variants.len() >= 38, "{variants:?}");
    let names: Vec<&str> = cases().iter().map(|c| c.name).collect();
    for v in &variants {
        assert!(
            names.contains(v) || UNPRODUCIBLE.contains(v),
            "no minimal program for Violation::{v}"
        );
    }
    for n in names.iter().chain(&UNPRODUCIBLE) {
        assert!(variants.contains(n), "{n} is not a variant of Violation");
    }
}
