//! A brute-force reference executor for pipec programs, used only by tests to judge the
//! verifier. It shares no code with `pipec_ir::verify`: it runs the program.
//!
//! Semantics (the strictest NCCL behaviour, as docs/design.md states it): each rank runs its
//! instructions in order; compute never blocks; a maximal run of consecutive send/recv with
//! one batch id is posted as a whole; between an ordered pair of ranks the k-th posted send
//! pairs with the k-th posted receive (FIFO), and both complete at the moment the second of
//! the two is posted (rendezvous, whatever the size); a batch completes when all its ops have;
//! only then does the rank go on. Ranks are stepped until all finish or none can move.
//! Memory instructions (issue 30) move no tensor; a backward of offloaded activations waits
//! for their reload, a `wait_offload` for its offload, each only if posted earlier on the rank
//! (a copy waits only for earlier work of its rank), else the rank hangs there.
//!
//! While it runs it moves tensors: a pass takes its inputs from what its rank produced or
//! received (each received tensor once), a send ships what its rank produced, a receive gets
//! what the matched send shipped. Afterwards it judges what happened.

use pipec_ir::ir::{Instr, Payload, PayloadKind, Program};
use pipec_schedules::{Pass, StageId, Task};
use std::collections::{HashMap, HashSet, VecDeque};

/// The executor's judgement, most serious first (the verifier's `Class` order).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    Malformed,
    Deadlock,
    WrongTensor,
    Incomplete,
    Dependency,
    Valid,
}

/// What happened.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub verdict: Verdict,
    /// Every rank reached its end.
    pub finished: bool,
    /// Per rank, per instruction: what a receive actually got (None: not a receive, or never
    /// completed).
    pub received: Vec<Vec<Option<Payload>>>,
    /// Human-readable notes on each problem seen, for test failure messages.
    pub problems: Vec<String>,
}

#[derive(Default)]
struct Channel {
    /// Posted sends not yet paired: (rank, index, payload).
    sends: VecDeque<(usize, usize, Payload)>,
    /// Posted receives not yet paired: (rank, index).
    recvs: VecDeque<(usize, usize)>,
}

struct Rank {
    pc: usize,
    /// The posted batch `[start, end)`, if the rank is waiting on one.
    posted: Option<(usize, usize)>,
    done: Vec<bool>,
    produced: HashSet<(PayloadKind, u32, u32)>,
    inbox: HashMap<(PayloadKind, u32, u32), u32>,
    ran_fwd: HashSet<(u32, u32)>,
    ran_bwd_d: HashSet<(u32, u32)>,
}

fn key(p: Payload) -> (PayloadKind, u32, u32) {
    (p.kind, p.stage.0, p.mb.0)
}

/// Run a program to completion or to a standstill and judge it.
pub fn execute(p: &Program) -> Outcome {
    let world = p.ranks.len();
    let stages = p.placement.num_stages();
    let m = p.microbatches;
    // The rank of a task: by microbatch too, for bidirectional (DualPipe) placements.
    let owner = |s: u32, mb: u32| -> Option<usize> {
        p.placement
            .get_task(Task::new(s, mb))
            .map(|r| r.0 as usize)
            .filter(|&r| r < world)
    };
    let mut problems: Vec<String> = Vec::new();

    // Ids out of range make the program malformed; judge that first and do not run it.
    let mut malformed = p.placement.pp as usize != world;
    for s in 0..stages {
        if p.placement
            .get(StageId(s))
            .is_none_or(|r| r.0 as usize >= world)
        {
            malformed = true;
        }
    }
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            let bad = match *ins {
                Instr::Compute(_) | Instr::FwdCheckpoint(_) => ins
                    .as_compute()
                    .is_some_and(|c| c.parts().any(|(_, t)| t.stage.0 >= stages || t.mb.0 >= m)),
                Instr::Memory(op) => op.task.stage.0 >= stages || op.task.mb.0 >= m,
                Instr::Send { peer, payload, .. } | Instr::Recv { peer, payload, .. } => {
                    peer.0 as usize >= world || payload.stage.0 >= stages || payload.mb.0 >= m
                }
                Instr::Wait { .. } => false,
            };
            if bad {
                malformed = true;
                problems.push(format!("rank {r} #{i}: id out of range"));
            }
        }
    }
    let mut received: Vec<Vec<Option<Payload>>> =
        p.ranks.iter().map(|r| vec![None; r.len()]).collect();
    if malformed {
        return Outcome {
            verdict: Verdict::Malformed,
            finished: false,
            received,
            problems,
        };
    }

    let mut ranks: Vec<Rank> = p
        .ranks
        .iter()
        .map(|r| Rank {
            pc: 0,
            posted: None,
            done: vec![false; r.len()],
            produced: HashSet::new(),
            inbox: HashMap::new(),
            ran_fwd: HashSet::new(),
            ran_bwd_d: HashSet::new(),
        })
        .collect();
    let mut channels: HashMap<(usize, usize), Channel> = HashMap::new();
    let mut dependency = false;
    let mut dependency_seen: HashSet<(usize, usize)> = HashSet::new();
    let mut executed: Vec<(usize, Pass, Task)> = Vec::new();

    loop {
        let mut progress = false;
        for r in 0..world {
            loop {
                let instrs = &p.ranks[r];
                if let Some((a, b)) = ranks[r].posted {
                    if (a..b).all(|i| ranks[r].done[i]) {
                        ranks[r].posted = None;
                        ranks[r].pc = b;
                        progress = true;
                        continue;
                    }
                    break;
                }
                let pc = ranks[r].pc;
                if pc >= instrs.len() {
                    break;
                }
                // A wait blocks until every op of the (last) batch it names is done; one that
                // names nothing posted before waits for nothing and is a dependency error.
                if let Instr::Wait { batch } = instrs[pc] {
                    let lo = (0..pc).rev().find(|&i| instrs[i].batch() == Some(batch));
                    if lo.is_none() && !dependency_seen.contains(&(r, pc)) {
                        dependency_seen.insert((r, pc));
                        dependency = true;
                        problems.push(format!(
                            "rank {r} #{pc}: waits for batch {batch}, never posted before"
                        ));
                    }
                    if let Some(lo) = lo {
                        let mut a = lo;
                        while a > 0 && instrs[a - 1].batch() == Some(batch) {
                            a -= 1;
                        }
                        if !(a..=lo).all(|i| ranks[r].done[i]) {
                            break;
                        }
                    }
                }
                // The copy stream (docs/format.md, "Memory instructions"): a copy waits only
                // for earlier work of its own rank, so one posted before this point has ended
                // by now and one posted after it never will be (the compute stream has not
                // reached it). A backward of offloaded activations needs a reload posted
                // before it, a `wait_offload` its offload: otherwise the rank hangs here.
                let posted = |k: pipec_ir::ir::MemKind, t: Task| {
                    instrs[..pc]
                        .iter()
                        .any(|i| matches!(i, Instr::Memory(op) if op.kind == k && op.task == t))
                };
                let copy_wait = match instrs[pc] {
                    Instr::Memory(op) if op.kind == pipec_ir::ir::MemKind::WaitOffload => {
                        !posted(pipec_ir::ir::MemKind::Offload, op.task)
                    }
                    Instr::Compute(c) => c.parts().any(|(pass, t)| {
                        matches!(pass, Pass::Bwd | Pass::BwdD)
                            && posted(pipec_ir::ir::MemKind::Offload, t)
                            && !posted(pipec_ir::ir::MemKind::Reload, t)
                    }),
                    _ => false,
                };
                if copy_wait {
                    break;
                }
                progress = true;
                match instrs[pc] {
                    // Memory instructions move no tensor between ranks; their waits are above.
                    Instr::Wait { .. } | Instr::Memory(_) => ranks[r].pc += 1,
                    Instr::Compute(_) | Instr::FwdCheckpoint(_) => {
                        let c = instrs[pc].as_compute().expect("a compute op");
                        // Inputs of every part first: the parts of a pair run at once.
                        let me = &mut ranks[r];
                        for (pass, t) in c.parts() {
                            let (s, mb) = (t.stage.0, t.mb.0);
                            // Take an input: made here, or received (each receipt once).
                            let take = |me: &mut Rank, kind, ps: u32| -> bool {
                                let k = (kind, ps, mb);
                                if owner(ps, mb) == Some(r) {
                                    return me.produced.contains(&k);
                                }
                                match me.inbox.get_mut(&k) {
                                    Some(n) if *n > 0 => {
                                        *n -= 1;
                                        true
                                    }
                                    _ => false,
                                }
                            };
                            let ok = match pass {
                                Pass::Fwd => s == 0 || take(me, PayloadKind::Act, s - 1),
                                Pass::Bwd | Pass::BwdD => {
                                    let fwd = me.ran_fwd.contains(&(s, mb));
                                    let grad =
                                        s + 1 >= stages || take(me, PayloadKind::Grad, s + 1);
                                    fwd && grad
                                }
                                Pass::BwdW => me.ran_bwd_d.contains(&(s, mb)),
                            };
                            if !ok {
                                dependency = true;
                                problems.push(format!(
                                    "rank {r} #{pc}: {pass:?}({s},{mb}) lacks an input"
                                ));
                            }
                        }
                        for (pass, t) in c.parts() {
                            let (s, mb) = (t.stage.0, t.mb.0);
                            executed.push((r, pass, t));
                            match pass {
                                Pass::Fwd => {
                                    me.produced.insert((PayloadKind::Act, s, mb));
                                    me.ran_fwd.insert((s, mb));
                                }
                                Pass::Bwd => {
                                    me.produced.insert((PayloadKind::Grad, s, mb));
                                }
                                Pass::BwdD => {
                                    me.produced.insert((PayloadKind::Grad, s, mb));
                                    me.ran_bwd_d.insert((s, mb));
                                }
                                Pass::BwdW => {}
                            }
                        }
                        me.pc += 1;
                    }
                    Instr::Send { batch, .. } | Instr::Recv { batch, .. } => {
                        let mut end = pc;
                        while end < instrs.len() && instrs[end].batch() == Some(batch) {
                            end += 1;
                        }
                        // Left in flight when a later wait names it: the rank goes on.
                        let waited = instrs[end..]
                            .iter()
                            .any(|x| matches!(x, Instr::Wait { batch: b } if *b == batch));
                        if waited {
                            ranks[r].pc = end;
                        } else {
                            ranks[r].posted = Some((pc, end));
                        }
                        for i in pc..end {
                            match instrs[i] {
                                Instr::Send { peer, payload, .. } => {
                                    let q = peer.0 as usize;
                                    // What is shipped must exist here and go where it is used.
                                    // A shape message goes where its tensor goes, once
                                    // that exists (Megatron's `_communicate_shapes`).
                                    let consumer = match payload.kind.data() {
                                        PayloadKind::Act | PayloadKind::ActShape => {
                                            Some(payload.stage.0 + 1).filter(|&c| c < stages)
                                        }
                                        PayloadKind::Grad | PayloadKind::GradShape => {
                                            payload.stage.0.checked_sub(1)
                                        }
                                    };
                                    let ok_dest = q != r
                                        && consumer
                                            .is_some_and(|c| owner(c, payload.mb.0) == Some(q));
                                    let made = (payload.kind.data(), payload.stage.0, payload.mb.0);
                                    let ok_made = ranks[r].produced.contains(&made);
                                    if !ok_dest || !ok_made {
                                        dependency = true;
                                        problems.push(format!(
                                            "rank {r} #{i}: send {payload} (destination ok: {ok_dest}, produced: {ok_made})"
                                        ));
                                    }
                                    let ch = channels.entry((r, q)).or_default();
                                    if let Some((rr, ri)) = ch.recvs.pop_front() {
                                        ranks[r].done[i] = true;
                                        ranks[rr].done[ri] = true;
                                        received[rr][ri] = Some(payload);
                                        *ranks[rr].inbox.entry(key(payload)).or_default() += 1;
                                    } else {
                                        ch.sends.push_back((r, i, payload));
                                    }
                                }
                                Instr::Recv { peer, .. } => {
                                    let q = peer.0 as usize;
                                    let ch = channels.entry((q, r)).or_default();
                                    if let Some((sr, si, payload)) = ch.sends.pop_front() {
                                        ranks[r].done[i] = true;
                                        ranks[sr].done[si] = true;
                                        received[r][i] = Some(payload);
                                        *ranks[r].inbox.entry(key(payload)).or_default() += 1;
                                    } else {
                                        ch.recvs.push_back((r, i));
                                    }
                                }
                                Instr::Compute(_)
                                | Instr::Wait { .. }
                                | Instr::FwdCheckpoint(_)
                                | Instr::Memory(_) => {
                                    unreachable!("a batch holds only comm")
                                }
                            }
                        }
                    }
                }
            }
        }
        if !progress {
            break;
        }
    }

    let finished = ranks
        .iter()
        .zip(&p.ranks)
        .all(|(s, instrs)| s.pc >= instrs.len() && s.posted.is_none());
    if !finished {
        for (r, s) in ranks.iter().enumerate() {
            if s.pc < p.ranks[r].len() {
                problems.push(format!("rank {r} stuck at #{}", s.pc));
            }
        }
        return Outcome {
            verdict: Verdict::Deadlock,
            finished,
            received,
            problems,
        };
    }

    // Wrong tensors: a receive that got something other than what it names.
    let mut wrong = false;
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            if let Instr::Recv { payload, .. } = *ins {
                if received[r][i] != Some(payload) {
                    wrong = true;
                    problems.push(format!(
                        "rank {r} #{i}: expected {payload}, got {:?}",
                        received[r][i]
                    ));
                }
            }
        }
    }

    // Completeness: count what ran, where.
    let mut incomplete = false;
    let mut counts: HashMap<(u32, u32), [u32; 4]> = HashMap::new();
    for &(r, pass, t) in &executed {
        if owner(t.stage.0, t.mb.0) != Some(r) {
            incomplete = true;
            problems.push(format!("{pass:?} {t} ran on rank {r}"));
        }
        let slot = match pass {
            Pass::Fwd => 0,
            Pass::Bwd => 1,
            Pass::BwdD => 2,
            Pass::BwdW => 3,
        };
        counts.entry((t.stage.0, t.mb.0)).or_default()[slot] += 1;
    }
    for s in 0..stages {
        for mb in 0..m {
            let [f, b, d, w] = counts.get(&(s, mb)).copied().unwrap_or_default();
            let ok = f == 1
                && if p.forward_only {
                    b == 0 && d == 0 && w == 0
                } else {
                    (b == 1 && d == 0 && w == 0) || (b == 0 && d == 1 && w == 1)
                };
            if !ok {
                incomplete = true;
                problems.push(format!("stage {s} mb {mb}: counts f{f} b{b} d{d} w{w}"));
            }
        }
    }

    // Received tensors nobody took.
    for (r, s) in ranks.iter().enumerate() {
        for (k, &n) in &s.inbox {
            // A shape message sizes the receive after it; nothing else takes it.
            if n > 0 && !k.0.is_shape() {
                dependency = true;
                problems.push(format!("rank {r}: {k:?} received but unused"));
            }
        }
    }

    let verdict = if wrong {
        Verdict::WrongTensor
    } else if incomplete {
        Verdict::Incomplete
    } else if dependency {
        Verdict::Dependency
    } else {
        Verdict::Valid
    };
    Outcome {
        verdict,
        finished,
        received,
        problems,
    }
}
