//! torch.distributed.pipelining CSV interop: conformance with files torch wrote, round trips,
//! the rules torch's runtime imposes on compute+comms files, malformed input, and the CLI.

use pipec_compiler::torch::action::{parse_cell, ActionType, Cell};
use pipec_compiler::torch::{
    export_csv, import_csv, import_csv_bytes, CsvErrorKind, CsvForm, ImportOptions,
    PlacementChoice, PlacementSource,
};
use pipec_ir::ir::{Instr, Payload, Program};
use pipec_schedules::{
    generate, CommPolicy, Compute, Limits, Placement, PlacementKind, Rank, RankOrder, ScheduleKind,
    ScheduleSpec, Task,
};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

fn conformance(name: &str) -> String {
    let p = pipec_tests::shared_dir()
        .join("conformance/torch")
        .join(name);
    std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("conformance file {} is missing: {e}", p.display()))
}

const INTERLEAVED_ONLY: &str = "interleaved1f1b_pp2_v2_m2.compute_only.csv";
const INTERLEAVED_COMMS: &str = "interleaved1f1b_pp2_v2_m2.compute_comms.csv";
const DUALPIPEV_ONLY: &str = "dualpipev_pp2_v2_m4.compute_only.csv";

fn opts() -> ImportOptions {
    ImportOptions::default()
}

fn spec(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, forward_only: bool) -> ScheduleSpec {
    ScheduleSpec {
        kind,
        pp,
        vpp,
        microbatches: m,
        group_size: None,
        forward_only,
        combined: false,
        megatron_p2p: pipec_tests::megatron_p2p_for(kind, pp),
    }
}

/// Each rank's sends and recvs without batch numbers: (is_send, peer, payload).
fn messages(p: &Program) -> Vec<Vec<(bool, Rank, Payload)>> {
    p.ranks
        .iter()
        .map(|r| {
            r.iter()
                .filter_map(|i| match *i {
                    Instr::Send { peer, payload, .. } => Some((true, peer, payload)),
                    Instr::Recv { peer, payload, .. } => Some((false, peer, payload)),
                    Instr::Compute(_)
                    | Instr::Wait { .. }
                    | Instr::FwdCheckpoint(_)
                    | Instr::Memory(_) => None,
                })
                .collect()
        })
        .collect()
}

/// Each (rank, direction, peer)'s message sequence: what FIFO matching depends on.
type PerPeer = BTreeMap<(usize, bool, u32), Vec<Payload>>;

fn per_peer(p: &Program) -> PerPeer {
    let mut m = PerPeer::new();
    for (r, msgs) in messages(p).into_iter().enumerate() {
        for (s, peer, payload) in msgs {
            m.entry((r, s, peer.0)).or_default().push(payload);
        }
    }
    m
}

/// Each rank's messages as a sorted list (order ignored).
fn message_sets(p: &Program) -> Vec<Vec<(bool, Rank, Payload)>> {
    let mut m = messages(p);
    for r in &mut m {
        r.sort();
    }
    m
}

/// How comm batches are taken to complete.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Model {
    /// NCCL group semantics under rendezvous: a batch completes once every message it is
    /// matched with (FIFO per peer pair) has been posted, i.e. its rank has reached that
    /// message's batch.
    Posted,
    /// docs/design.md rule 4 read literally: a batch completes only together with all batches its
    /// messages are matched with (transitively), each the current batch of its rank.
    Merged,
}

/// Runs `p` with compute free and comm batches blocking under `model`. With one action per
/// batch (an imported compute+comms file) both models say: each action blocks until its
/// partner is reached. Returns the stuck positions when nothing can move.
fn strict_deadlock_in(p: &Program, model: Model) -> Option<Vec<usize>> {
    let w = p.ranks.len();
    // Batch runs: (rank, first index, end index).
    let mut run_of: Vec<Vec<usize>> = p.ranks.iter().map(|r| vec![usize::MAX; r.len()]).collect();
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    for (r, instrs) in p.ranks.iter().enumerate() {
        for step in pipec_ir::ir::steps(instrs) {
            if let pipec_ir::ir::Step::Batch { ops, .. } = step {
                run_of[r][ops.clone()].fill(runs.len());
                runs.push((r, ops.start, ops.end));
            }
        }
    }
    // Partner run of each message, FIFO per ordered pair.
    let mut sends: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    let mut recvs: HashMap<(usize, usize), Vec<usize>> = HashMap::new();
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            match *ins {
                Instr::Send { peer, .. } => sends
                    .entry((r, peer.index()))
                    .or_default()
                    .push(run_of[r][i]),
                Instr::Recv { peer, .. } => recvs
                    .entry((peer.index(), r))
                    .or_default()
                    .push(run_of[r][i]),
                Instr::Compute(_)
                | Instr::Wait { .. }
                | Instr::FwdCheckpoint(_)
                | Instr::Memory(_) => {}
            }
        }
    }
    let mut adj: Vec<Vec<usize>> = vec![Vec::new(); runs.len()];
    for (k, s) in &sends {
        let rs = recvs.get(k).cloned().unwrap_or_default();
        assert_eq!(s.len(), rs.len(), "unmatched messages between {k:?}");
        for (&a, &b) in s.iter().zip(&rs) {
            adj[a].push(b);
            adj[b].push(a);
        }
    }
    let mut pc = vec![0usize; w];
    loop {
        let mut progress = false;
        for r in 0..w {
            while pc[r] < p.ranks[r].len() && p.ranks[r][pc[r]].batch().is_none() {
                pc[r] += 1;
                progress = true;
            }
            if pc[r] >= p.ranks[r].len() {
                continue;
            }
            let start = run_of[r][pc[r]];
            match model {
                Model::Posted => {
                    let posted = adj[start].iter().all(|&y| {
                        let (yr, yi, _) = runs[y];
                        pc[yr] >= yi
                    });
                    if posted {
                        pc[r] = runs[start].2;
                        progress = true;
                    }
                }
                Model::Merged => {
                    // The component of this run: every member must be current on its rank.
                    let (mut stack, mut comp) = (vec![start], vec![start]);
                    let mut ok = true;
                    while let Some(x) = stack.pop() {
                        let (xr, xi, _) = runs[x];
                        if pc[xr] != xi {
                            ok = false;
                            break;
                        }
                        for &y in &adj[x] {
                            if !comp.contains(&y) {
                                comp.push(y);
                                stack.push(y);
                            }
                        }
                    }
                    if ok {
                        for &x in &comp {
                            let (xr, _, end) = runs[x];
                            pc[xr] = end;
                        }
                        progress = true;
                    }
                }
            }
        }
        if (0..w).all(|r| pc[r] == p.ranks[r].len()) {
            return None;
        }
        if !progress {
            return Some(pc);
        }
    }
}

fn strict_deadlock(p: &Program) -> Option<Vec<usize>> {
    strict_deadlock_in(p, Model::Posted)
}

/// An imported compute+comms program: one action per batch, so both models must agree.
fn strict_deadlock_single(p: &Program) -> Option<Vec<usize>> {
    let posted = strict_deadlock_in(p, Model::Posted);
    assert_eq!(posted, strict_deadlock_in(p, Model::Merged));
    posted
}

/// Between every ordered pair of ranks, the k-th send carries the k-th recv's payload
/// (first-in first-out, as torch and NCCL match them). Returns the number of messages.
fn assert_fifo_matched(p: &Program) -> usize {
    let mut sent: BTreeMap<(u32, u32), Vec<Payload>> = BTreeMap::new();
    let mut got: BTreeMap<(u32, u32), Vec<Payload>> = BTreeMap::new();
    for (r, msgs) in messages(p).into_iter().enumerate() {
        for (send, peer, payload) in msgs {
            if send {
                sent.entry((r as u32, peer.0)).or_default().push(payload);
            } else {
                got.entry((peer.0, r as u32)).or_default().push(payload);
            }
        }
    }
    assert_eq!(sent, got, "sends and recvs do not match FIFO per peer pair");
    sent.values().map(Vec::len).sum()
}

// ---------------------------------------------------------------------------------------
// Conformance: the files torch 2.15 wrote.

#[test]
fn conformance_files_import() {
    for name in [INTERLEAVED_ONLY, INTERLEAVED_COMMS, DUALPIPEV_ONLY] {
        let text = conformance(name);
        let imp = import_csv(&text, &opts()).unwrap_or_else(|e| panic!("{name}:\n{e}"));
        let want_form = if name.contains("compute_comms") {
            CsvForm::ComputeComms
        } else {
            CsvForm::ComputeOnly
        };
        assert_eq!(imp.form, want_form, "{name}");
        assert_eq!(imp.placement_source, PlacementSource::File);
        assert_eq!(imp.program.world(), 2, "{name}");
        assert!(!imp.program.forward_only);
        // Counted independently from the text: empty cells, and bookkeeping words.
        let cells: Vec<&str> = text.lines().flat_map(|l| l.split(',')).collect();
        let empty = cells.iter().filter(|c| c.is_empty()).count();
        let bookkeeping = cells
            .iter()
            .filter(|c| {
                ["UNSHARD", "RESHARD", "REDUCE_GRAD", "WAIT_SEND"]
                    .iter()
                    .any(|w| c.contains(w))
            })
            .count();
        assert_eq!(imp.idle_cells, empty, "{name}");
        assert_eq!(imp.bookkeeping, bookkeeping, "{name}");
        // Every compute cell of the file (`(..)OVERLAP_F_B`, or digits, one of F B I W,
        // digits) is one compute op of the program.
        let is_compute = |c: &str| {
            let rest = c.trim_start_matches(|ch: char| ch.is_ascii_digit());
            c.starts_with('(')
                || (rest.len() < c.len()
                    && rest.starts_with(['F', 'B', 'I', 'W'])
                    && rest.len() > 1
                    && rest[1..].bytes().all(|b| b.is_ascii_digit()))
        };
        let computes = cells.iter().filter(|c| is_compute(c)).count();
        let n: usize = imp.program.compute_orders().iter().map(Vec::len).sum();
        assert_eq!(n, computes, "{name}");
    }
    let v = import_csv(&conformance(DUALPIPEV_ONLY), &opts()).unwrap();
    assert_eq!(v.program.placement, Placement::v_shape(2));
    assert_eq!(v.program.microbatches, 4);
    let i = import_csv(&conformance(INTERLEAVED_ONLY), &opts()).unwrap();
    assert_eq!(i.program.placement, Placement::looped(2, 2));
    assert_eq!(i.program.microbatches, 2);
}

#[test]
fn interleaved_conformance_compute_orders_agree_with_each_other_and_with_pipec() {
    let only = import_csv(&conformance(INTERLEAVED_ONLY), &opts()).unwrap();
    let comms = import_csv(&conformance(INTERLEAVED_COMMS), &opts()).unwrap();
    assert_eq!(
        only.program.compute_orders(),
        comms.program.compute_orders(),
        "torch's compute-only and compute+comms files disagree"
    );
    let ours = generate(
        &spec(ScheduleKind::Interleaved1F1B, 2, 2, 2, false),
        &Limits::DEFAULT,
    )
    .unwrap();
    for (r, order) in ours.ranks.iter().enumerate() {
        let torch = &only.program.compute_orders()[r];
        let diff: Vec<String> = (0..order.ops.len().max(torch.len()))
            .filter(|&k| order.ops.get(k) != torch.get(k))
            .map(|k| {
                format!(
                    "#{k}: pipec {:?} torch {:?}",
                    order.ops.get(k),
                    torch.get(k)
                )
            })
            .collect();
        assert!(diff.is_empty(), "rank {r} differs:\n{}", diff.join("\n"));
    }
}

#[test]
fn interleaved_conformance_compute_comms_matches_fifo() {
    let comms = import_csv(&conformance(INTERLEAVED_COMMS), &opts()).unwrap();
    // 2 ranks, 4 stages, 2 microbatches: 3 stage boundaries x 2 mb x (act + grad) = 12.
    assert_eq!(assert_fifo_matched(&comms.program), 12);
    // Each torch P2P action is its own comm batch.
    for r in &comms.program.ranks {
        let batches: Vec<u32> = r.iter().filter_map(Instr::batch).collect();
        assert_eq!(batches, (0..batches.len() as u32).collect::<Vec<_>>());
    }
}

/// pipec's export of the schedule torch wrote has torch's compute order, the same multiset of
/// actions on every rank (so every action torch uses, in torch's spelling), and the same
/// per-peer send and recv sequences; only where P2P sits between computes differs.
#[test]
fn export_has_the_shape_of_torchs_own_compute_comms_file() {
    let ours = pipec_compiler::lower(
        &generate(
            &spec(ScheduleKind::Interleaved1F1B, 2, 2, 2, false),
            &Limits::DEFAULT,
        )
        .unwrap(),
    );
    let text = export_csv(&pipec_tests::verified(&ours), CsvForm::ComputeComms).unwrap();
    let torch = conformance(INTERLEAVED_COMMS);
    assert_eq!(text.lines().count(), torch.lines().count());
    assert!(text.ends_with("\r\n") && torch.ends_with("\r\n"));
    for (mine, theirs) in text.lines().zip(torch.lines()) {
        let cells = |l: &str| -> Vec<String> { l.split(',').map(str::to_string).collect() };
        let (mut a, mut b) = (cells(mine), cells(theirs));
        let compute = |v: &[String]| -> Vec<String> {
            v.iter()
                .filter(|c| matches!(parse_cell(c), Ok(Cell::Action(x)) if x.ty.is_compute()))
                .cloned()
                .collect()
        };
        assert_eq!(compute(&a), compute(&b), "compute order");
        let p2p = |v: &[String], ty: ActionType| -> Vec<String> {
            v.iter()
                .filter(|c| matches!(parse_cell(c), Ok(Cell::Action(x)) if x.ty == ty))
                .cloned()
                .collect()
        };
        for ty in ActionType::ALL {
            assert_eq!(p2p(&a, ty), p2p(&b, ty), "order of {ty} actions");
        }
        a.sort();
        b.sort();
        assert_eq!(a, b, "multiset of actions");
    }
    let back = import_csv(&text, &opts()).unwrap();
    let theirs = import_csv(&torch, &opts()).unwrap();
    // Per-peer FIFO sequences are the same.
    assert_eq!(per_peer(&back.program), per_peer(&theirs.program));
    // Both run under pipec's strict reading of compute+comms files.
    assert_eq!(strict_deadlock_single(&back.program), None);
    assert_eq!(strict_deadlock_single(&theirs.program), None);
    check_torch_runtime_rules(&text, &ours.placement);
    check_torch_runtime_rules(&torch, &ours.placement);
}

// ---------------------------------------------------------------------------------------
// The rules torch's `_PipelineScheduleRuntime` imposes on a compute+comms file, and a
// simulation of its execution (isend/irecv posted where written, a compute waits for its
// recv, WAIT_SEND waits until the peer has posted the matching recv: rendezvous, the
// strictest NCCL behaviour). Written from torch's runtime, independently of the exporter.

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
struct Key {
    ty: ActionType,
    stage: u32,
    mb: u32,
}

fn check_torch_runtime_rules(text: &str, placement: &Placement) {
    let stages = placement.num_stages();
    let rank = |s: u32| placement.rank_of(Task::new(s, 0)).0;
    let lines: Vec<Vec<Cell>> = text
        .lines()
        .map(|l| {
            l.split(',')
                .map(|c| {
                    assert!(!c.is_empty(), "empty cell in a compute+comms export");
                    parse_cell(c).unwrap()
                })
                .collect()
        })
        .collect();
    for (r, cells) in lines.iter().enumerate() {
        let r = r as u32;
        let mut seen: HashMap<Key, usize> = HashMap::new();
        let mut last_bwd: HashMap<u32, usize> = HashMap::new();
        let mut last_any: HashMap<u32, usize> = HashMap::new();
        let mut waits: HashMap<Key, usize> = HashMap::new();
        let mut sends: Vec<Key> = Vec::new();
        let idx = |c: &Cell| -> Vec<Key> {
            match *c {
                Cell::Empty => vec![],
                Cell::Action(a) => vec![Key {
                    ty: a.ty,
                    stage: a.stage,
                    mb: a.mb.unwrap_or(u32::MAX),
                }],
                Cell::Overlap { fwd, bwd } => [fwd, bwd]
                    .iter()
                    .map(|a| Key {
                        ty: a.ty,
                        stage: a.stage,
                        mb: a.mb.unwrap(),
                    })
                    .collect(),
            }
        };
        for (i, c) in cells.iter().enumerate() {
            for k in idx(c) {
                let before = |ty, stage, mb| seen.contains_key(&Key { ty, stage, mb });
                let (s, m) = (k.stage, k.mb);
                match k.ty {
                    ActionType::Forward => {
                        if s > 0 && rank(s - 1) != r {
                            assert!(
                                before(ActionType::RecvF, s, m),
                                "rank {r}: {s}F{m} without RECV_F"
                            );
                        }
                        assert!(
                            before(ActionType::Unshard, s, u32::MAX),
                            "rank {r}: {s}F{m} before UNSHARD"
                        );
                    }
                    ActionType::FullBackward | ActionType::BackwardInput
                        if s + 1 < stages && rank(s + 1) != r =>
                    {
                        assert!(
                            before(ActionType::RecvB, s, m),
                            "rank {r}: {s}B{m} without RECV_B"
                        );
                    }
                    ActionType::SendF => assert!(before(ActionType::Forward, s, m)),
                    ActionType::SendB => assert!(
                        before(ActionType::FullBackward, s, m)
                            || before(ActionType::BackwardInput, s, m)
                    ),
                    ActionType::WaitSendF => {
                        assert!(
                            before(ActionType::SendF, s, m),
                            "rank {r}: wait before send"
                        )
                    }
                    ActionType::WaitSendB => {
                        assert!(
                            before(ActionType::SendB, s, m),
                            "rank {r}: wait before send"
                        )
                    }
                    ActionType::WaitReduceGrad => {
                        assert!(before(ActionType::ReduceGrad, s, u32::MAX))
                    }
                    _ => {}
                }
                if matches!(k.ty, ActionType::SendF | ActionType::SendB) {
                    sends.push(k);
                }
                if matches!(k.ty, ActionType::WaitSendF | ActionType::WaitSendB) {
                    *waits.entry(k).or_default() += 1;
                }
                if matches!(
                    k.ty,
                    ActionType::FullBackward
                        | ActionType::BackwardInput
                        | ActionType::BackwardWeight
                ) {
                    last_bwd.insert(s, i);
                }
                if k.ty.is_compute() {
                    last_any.insert(s, i);
                }
                assert!(
                    seen.insert(k, i).is_none() || k.ty.is_bookkeeping(),
                    "rank {r}: {k:?} twice"
                );
            }
        }
        // One wait per send.
        for k in &sends {
            let ty = if k.ty == ActionType::SendF {
                ActionType::WaitSendF
            } else {
                ActionType::WaitSendB
            };
            let w = Key { ty, ..*k };
            assert_eq!(
                waits.remove(&w),
                Some(1),
                "rank {r}: {k:?} has no single wait"
            );
        }
        assert!(waits.is_empty(), "rank {r}: waits without sends {waits:?}");
        // REDUCE_GRAD after the last backward of each stage, then WAIT_REDUCE_GRAD, RESHARD
        // after the stage's last compute.
        for (&s, &i) in &last_bwd {
            let red = seen[&Key {
                ty: ActionType::ReduceGrad,
                stage: s,
                mb: u32::MAX,
            }];
            assert!(
                red > i,
                "rank {r}: REDUCE_GRAD of stage {s} before its last backward"
            );
        }
        for (&s, &i) in &last_any {
            let re = seen[&Key {
                ty: ActionType::Reshard,
                stage: s,
                mb: u32::MAX,
            }];
            assert!(
                re > i,
                "rank {r}: RESHARD of stage {s} before its last compute\n{text}"
            );
        }
    }
    simulate_torch_runtime(&lines, placement);
}

/// Runs every line as torch's runtime would. Panics with the stuck positions on a hang.
fn simulate_torch_runtime(lines: &[Vec<Cell>], placement: &Placement) {
    let rank = |s: u32| placement.rank_of(Task::new(s, 0)).0 as usize;
    // Per ordered pair (from, to): the line positions of sends and of recvs, in order.
    let mut sends: HashMap<(usize, usize), Vec<(usize, Key)>> = HashMap::new();
    let mut recvs: HashMap<(usize, usize), Vec<(usize, Key)>> = HashMap::new();
    // For each P2P action (rank, pos): its partner (rank, pos).
    let mut partner: HashMap<(usize, usize), (usize, usize)> = HashMap::new();
    for (r, cells) in lines.iter().enumerate() {
        for (i, c) in cells.iter().enumerate() {
            if let Cell::Action(a) = *c {
                let k = Key {
                    ty: a.ty,
                    stage: a.stage,
                    mb: a.mb.unwrap_or(0),
                };
                match a.ty {
                    ActionType::SendF => sends
                        .entry((r, rank(a.stage + 1)))
                        .or_default()
                        .push((i, k)),
                    ActionType::SendB => sends
                        .entry((r, rank(a.stage - 1)))
                        .or_default()
                        .push((i, k)),
                    ActionType::RecvF => recvs
                        .entry((rank(a.stage - 1), r))
                        .or_default()
                        .push((i, k)),
                    ActionType::RecvB => recvs
                        .entry((rank(a.stage + 1), r))
                        .or_default()
                        .push((i, k)),
                    _ => {}
                }
            }
        }
    }
    for (&(from, to), ss) in &sends {
        let rs = recvs.get(&(from, to)).cloned().unwrap_or_default();
        assert_eq!(
            ss.len(),
            rs.len(),
            "{from}->{to}: sends and recvs differ in number"
        );
        for (&(si, sk), &(ri, rk)) in ss.iter().zip(&rs) {
            // Same tensor: SEND_F of s is RECV_F of s+1, SEND_B of s is RECV_B of s-1.
            let same = match sk.ty {
                ActionType::SendF => rk.ty == ActionType::RecvF && rk.stage == sk.stage + 1,
                _ => rk.ty == ActionType::RecvB && rk.stage + 1 == sk.stage,
            } && rk.mb == sk.mb;
            assert!(same, "{from}->{to}: {sk:?} is matched FIFO with {rk:?}");
            partner.insert((from, si), (to, ri));
            partner.insert((to, ri), (from, si));
        }
    }
    // recv posted at (r, pos) for (stage, mb, kind) so computes find theirs.
    let mut pc = vec![0usize; lines.len()];
    let mut posted_recv: Vec<HashMap<(u32, u32, bool), usize>> = vec![HashMap::new(); lines.len()];
    let mut send_pos: Vec<HashMap<(u32, u32, bool), usize>> = vec![HashMap::new(); lines.len()];
    loop {
        let mut progress = false;
        for r in 0..lines.len() {
            while let Some(c) = lines[r].get(pc[r]) {
                let done = |rk: usize, pos: usize, pc: &[usize]| pc[rk] > pos;
                // A compute may run when each of its remote inputs' sends has been posted.
                let ready = {
                    let parts: Vec<_> = match *c {
                        Cell::Action(a) => vec![a],
                        Cell::Overlap { fwd, bwd } => vec![fwd, bwd],
                        Cell::Empty => vec![],
                    };
                    parts.iter().all(|a| {
                        let m = a.mb.unwrap_or(0);
                        let need = match a.ty {
                            ActionType::Forward => posted_recv[r].get(&(a.stage, m, true)),
                            ActionType::FullBackward | ActionType::BackwardInput => {
                                posted_recv[r].get(&(a.stage, m, false))
                            }
                            ActionType::WaitSendF => {
                                let p = send_pos[r][&(a.stage, m, true)];
                                let (pr, ppos) = partner[&(r, p)];
                                return done(pr, ppos, &pc);
                            }
                            ActionType::WaitSendB => {
                                let p = send_pos[r][&(a.stage, m, false)];
                                let (pr, ppos) = partner[&(r, p)];
                                return done(pr, ppos, &pc);
                            }
                            _ => None,
                        };
                        match need {
                            None => true,
                            Some(&recv_at) => {
                                let (sr, spos) = partner[&(r, recv_at)];
                                done(sr, spos, &pc)
                            }
                        }
                    })
                };
                if !ready {
                    break;
                }
                if let Cell::Action(a) = *c {
                    let m = a.mb.unwrap_or(0);
                    match a.ty {
                        ActionType::RecvF => {
                            posted_recv[r].insert((a.stage, m, true), pc[r]);
                        }
                        ActionType::RecvB => {
                            posted_recv[r].insert((a.stage, m, false), pc[r]);
                        }
                        ActionType::SendF => {
                            send_pos[r].insert((a.stage, m, true), pc[r]);
                        }
                        ActionType::SendB => {
                            send_pos[r].insert((a.stage, m, false), pc[r]);
                        }
                        _ => {}
                    }
                }
                pc[r] += 1;
                progress = true;
            }
        }
        if pc.iter().zip(lines).all(|(&p, l)| p == l.len()) {
            return;
        }
        assert!(
            progress,
            "torch's runtime would hang: positions {pc:?}, waiting at {:?}",
            pc.iter()
                .zip(lines)
                .map(|(&p, l)| l.get(p).map(|c| c.to_string()))
                .collect::<Vec<_>>()
        );
    }
}

/// The checkers above can fail: a schedule torch runs (its sends are asynchronous) that the
/// strict reading of compute+comms files reports as a deadlock, and one that hangs both.
#[test]
fn strict_reading_is_stricter_than_torchs_runtime() {
    // 1F1B on two ranks with both forwards' activations sent before the first gradient
    // comes back: rank 0's second SEND_F waits for rank 1's RECV_F1, which rank 1 posts only
    // after its SEND_B0, which waits for rank 0's RECV_B0.
    let text = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
                1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";
    let imp = import_csv(text, &opts()).unwrap();
    assert_eq!(strict_deadlock_single(&imp.program), Some(vec![3, 3]));
    let cells = |t: &str| -> Vec<Vec<Cell>> {
        t.lines()
            .map(|l| l.split(',').map(|c| parse_cell(c).unwrap()).collect())
            .collect()
    };
    simulate_torch_runtime(&cells(text), &imp.program.placement);
    // pipec's own lowering and export of the same compute order does not have the problem.
    let orders: Vec<RankOrder> = imp
        .program
        .compute_orders()
        .into_iter()
        .enumerate()
        .map(|(r, ops)| RankOrder {
            rank: Rank(r as u32),
            ops,
            warmup: 0,
        })
        .collect();
    let lowered = pipec_compiler::lower_orders(
        &imp.program.placement,
        2,
        false,
        CommPolicy::FusedPerOp,
        &orders,
    );
    let again = export_csv(&pipec_tests::verified(&lowered), CsvForm::ComputeComms).unwrap();
    assert_eq!(
        strict_deadlock(&import_csv(&again, &opts()).unwrap().program),
        None
    );
    check_torch_runtime_rules(&again, &imp.program.placement);
}

#[test]
#[should_panic(expected = "would hang")]
fn torch_runtime_simulation_detects_a_hang() {
    // Rank 0 waits for a gradient computed from an activation it sends only afterwards.
    let text = "0RECV_B0,0B0,0F0,0SEND_F0\n1RECV_F0,1F0,1B0,1SEND_B0\n";
    let cells: Vec<Vec<Cell>> = text
        .lines()
        .map(|l| l.split(',').map(|c| parse_cell(c).unwrap()).collect())
        .collect();
    simulate_torch_runtime(&cells, &Placement::looped(2, 1));
}

#[test]
#[should_panic(expected = "has no single wait")]
fn runtime_rules_require_a_wait_per_send() {
    let p = pipec_compiler::lower(
        &generate(
            &spec(ScheduleKind::OneFOneB, 2, 1, 2, false),
            &Limits::DEFAULT,
        )
        .unwrap(),
    );
    let text = export_csv(&pipec_tests::verified(&p), CsvForm::ComputeComms).unwrap();
    check_torch_runtime_rules(&text.replacen(",0WAIT_SEND_F0", "", 1), &p.placement);
}

// ---------------------------------------------------------------------------------------
// Round trips over every generated kind.

fn grid() -> Vec<ScheduleSpec> {
    let mut v = Vec::new();
    for (kind, vpps) in [
        (ScheduleKind::Gpipe, &[1u32][..]),
        (ScheduleKind::OneFOneB, &[1]),
        (ScheduleKind::Interleaved1F1B, &[2, 3]),
        (ScheduleKind::LoopedBfs, &[1, 2, 3]),
    ] {
        for &vpp in vpps {
            for pp in 1..=4 {
                for m in [1, 2, pp, pp + 1, 2 * pp, 3 * pp + 1] {
                    for fo in [false, true] {
                        let s = spec(kind, pp, vpp, m, fo);
                        // pipec_schedules generates interleaved-1f1b with pp = 1 and vpp >= 3
                        // with a backward before its own forward (bwd(2,0) before fwd(2,0)):
                        // not a program torch could run, and not this module's to fix.
                        let broken = kind == ScheduleKind::Interleaved1F1B && pp == 1 && vpp >= 3;
                        if !broken && s.validate(&Limits::DEFAULT).is_ok() && !v.contains(&s) {
                            v.push(s);
                        }
                    }
                }
            }
        }
    }
    v
}

/// Batches are not preserved: an imported compute+comms file has one batch per P2P action
/// (torch posts each on its own), where pipec's lowering fuses a step's sends and recvs.
#[test]
fn compute_comms_round_trip_keeps_compute_and_messages() {
    let specs = grid();
    assert!(specs.len() > 60, "grid too small: {}", specs.len());
    for s in specs {
        let sched = generate(&s, &Limits::DEFAULT).unwrap();
        let p = pipec_compiler::lower(&sched);
        let text = export_csv(&pipec_tests::verified(&p), CsvForm::ComputeComms).unwrap();
        assert_eq!(
            text,
            export_csv(&pipec_tests::verified(&p), CsvForm::ComputeComms).unwrap()
        );
        let back = import_csv(&text, &opts()).unwrap_or_else(|e| panic!("{s:?}\n{e}"));
        assert_eq!(back.program.compute_orders(), p.compute_orders(), "{s:?}");
        // The same messages per rank, in the same FIFO order per peer; only the order of
        // messages inside one of pipec's batches may change (see `emission_order`).
        assert_eq!(message_sets(&back.program), message_sets(&p), "{s:?}");
        assert_eq!(per_peer(&back.program), per_peer(&p), "{s:?}");
        // Every generated program is deadlock-free under NCCL group semantics (rendezvous),
        // and so is its export under the strict one-action-per-batch reading.
        let verdict = strict_deadlock(&p);
        assert_eq!(verdict, None, "{s:?} deadlocks");
        assert_eq!(
            strict_deadlock_single(&back.program).is_some(),
            verdict.is_some(),
            "{s:?}"
        );
        assert_eq!(back.program.placement, p.placement, "{s:?}");
        assert_eq!(back.program.microbatches, p.microbatches, "{s:?}");
        assert_eq!(back.program.forward_only, p.forward_only, "{s:?}");
        if s.pp > 1 {
            assert_eq!(back.form, CsvForm::ComputeComms);
            assert!(back.bookkeeping > 0);
        }
        check_torch_runtime_rules(&text, &p.placement);
    }
}

#[test]
fn compute_only_round_trip_equals_lockstep_lowering() {
    for s in grid() {
        let sched = generate(&s, &Limits::DEFAULT).unwrap();
        let p = pipec_compiler::lower(&sched);
        let text = export_csv(&pipec_tests::verified(&p), CsvForm::ComputeOnly).unwrap();
        assert!(!text
            .split("\r\n")
            .any(|l| l.split(',').any(|c| c.is_empty()) && !l.is_empty()));
        let back = import_csv(&text, &opts()).unwrap_or_else(|e| panic!("{s:?}\n{e}"));
        assert_eq!(back.form, CsvForm::ComputeOnly);
        let want = pipec_compiler::lower_orders(
            &sched.placement,
            s.microbatches,
            s.forward_only,
            CommPolicy::Lockstep,
            &sched.ranks,
        );
        assert_eq!(back.program, want, "{s:?}");
        // And its own compute+comms export runs on torch's runtime.
        check_torch_runtime_rules(
            &export_csv(&pipec_tests::verified(&back.program), CsvForm::ComputeComms).unwrap(),
            &sched.placement,
        );
    }
}

/// DualPipeV from torch: V placement, split backward, overlapped pairs, local turnaround.
#[test]
fn dualpipev_round_trip_through_both_forms() {
    let imp = import_csv(&conformance(DUALPIPEV_ONLY), &opts()).unwrap();
    let p = &imp.program;
    assert_eq!(p.placement.kind, PlacementKind::V);
    let pairs = p
        .compute_orders()
        .iter()
        .flatten()
        .filter(|c| matches!(c, Compute::FwdBwd { .. }))
        .count();
    assert_eq!(pairs, 6);
    assert_fifo_matched(p);
    let only = export_csv(&pipec_tests::verified(p), CsvForm::ComputeOnly).unwrap();
    // torch's file without its idle cells (there are none) is exactly our compute-only export.
    assert_eq!(only, conformance(DUALPIPEV_ONLY));
    let comms = export_csv(&pipec_tests::verified(p), CsvForm::ComputeComms).unwrap();
    check_torch_runtime_rules(&comms, &p.placement);
    let back = import_csv(&comms, &opts()).unwrap();
    assert_eq!(back.program.compute_orders(), p.compute_orders());
    assert_eq!(message_sets(&back.program), message_sets(p));
    assert_eq!(per_peer(&back.program), per_peer(p));
    // Regression: with fused-per-op lowering this order deadlocked under rendezvous (rank 0's
    // send of grad(3,0) waited for rank 1's recv at #10 while rank 1's batch at #7 waited for
    // rank 0's recv of act(2,1) at #11). Lockstep lowering pairs every send with its recv in
    // the same round, and the export keeps that.
    assert_eq!(strict_deadlock(p), None);
    assert_eq!(strict_deadlock_single(&back.program), None);
    // With the placement given instead of read off the file.
    let given = import_csv(
        &comms,
        &ImportOptions {
            pp: Some(2),
            placement: Some(PlacementChoice::V),
        },
    )
    .unwrap();
    assert_eq!(given.program, back.program);
}

#[test]
fn compute_only_export_of_torchs_interleaved_file_drops_only_idle_cells() {
    let text = conformance(INTERLEAVED_ONLY);
    let imp = import_csv(&text, &opts()).unwrap();
    let ours = export_csv(&pipec_tests::verified(&imp.program), CsvForm::ComputeOnly).unwrap();
    let squeezed: String = text
        .split("\r\n")
        .filter(|l| !l.is_empty())
        .map(|l| {
            l.split(',')
                .filter(|c| !c.is_empty())
                .collect::<Vec<_>>()
                .join(",")
                + "\r\n"
        })
        .collect();
    assert_eq!(ours, squeezed);
}

// ---------------------------------------------------------------------------------------
// Malformed input: each with its line, cell and character column.

#[track_caller]
fn fails(text: &str, o: ImportOptions, line: u32, cell: u32, column: u32) -> CsvErrorKind {
    let e = import_csv(text, &o).expect_err(text);
    assert_eq!(
        (e.line, e.cell_index, e.column),
        (line, cell, column),
        "position of {:?} in {text:?}",
        e.kind
    );
    e.kind
}

#[test]
fn malformed_cells_are_refused_with_their_position() {
    use CsvErrorKind as K;
    let d = opts();
    type Case = (&'static str, u32, u32, u32, fn(&K) -> bool);
    let cases: Vec<Case> = vec![
        (
            "0F0,1F0xyz",
            1,
            2,
            5,
            |k| matches!(k, K::TrailingText { rest, .. } if rest == "xyz"),
        ),
        (
            "0F0,0X1\n1F0",
            1,
            2,
            5,
            |k| matches!(k, K::UnknownType { word } if word == "X"),
        ),
        (
            "0f0",
            1,
            1,
            1,
            |k| matches!(k, K::UnknownType { word } if word == "f"),
        ),
        ("0F0\n1F", 2, 1, 1, |k| {
            matches!(
                k,
                K::MissingMicrobatch {
                    ty: ActionType::Forward
                }
            )
        }),
        ("0F0\n1SEND_F", 2, 1, 1, |k| {
            matches!(k, K::MissingMicrobatch { .. })
        }),
        ("F0", 1, 1, 1, |k| matches!(k, K::MissingStage { .. })),
        (
            "\"0F0\"",
            1,
            1,
            1,
            |k| matches!(k, K::MissingStage { found } if found == "'\"'"),
        ),
        ("-1F0", 1, 1, 1, |k| matches!(k, K::MissingStage { .. })),
        ("0", 1, 1, 1, |k| matches!(k, K::MissingType)),
        ("0;", 1, 1, 1, |k| {
            matches!(k, K::UnexpectedChar { ch: ';' })
        }),
        ("0F99999999999", 1, 1, 1, |k| {
            matches!(
                k,
                K::NumberTooLarge {
                    what: "microbatch",
                    ..
                }
            )
        }),
        ("70000F0", 1, 1, 1, |k| {
            matches!(k, K::NumberTooLarge { what: "stage", .. })
        }),
        ("99999999999999999999999F0", 1, 1, 1, |k| {
            matches!(k, K::NumberTooLarge { .. })
        }),
        ("0F\u{663}", 1, 1, 1, |k| {
            matches!(k, K::NonAsciiDigit { ch: '\u{663}' })
        }),
        ("\u{FF11}F0", 1, 1, 1, |k| {
            matches!(k, K::NonAsciiDigit { .. })
        }),
        ("0UNSHARD3", 1, 1, 1, |k| {
            matches!(
                k,
                K::UnexpectedMicrobatch {
                    ty: ActionType::Unshard
                }
            )
        }),
        ("0F0 1F0", 1, 1, 1, |k| matches!(k, K::TrailingText { .. })),
        ("0F0;1F0", 1, 1, 1, |k| matches!(k, K::TrailingText { .. })),
        ("0F0\r1F0", 1, 1, 1, |k| matches!(k, K::TrailingText { .. })),
        ("0F0,(0F0;1B0;2B0)OVERLAP_F_B", 1, 2, 5, |k| {
            matches!(k, K::OverlapArity { parts: 3, empty: 0 })
        }),
        ("(0F0)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::OverlapArity { parts: 1, .. })
        }),
        ("(0F0;)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::OverlapArity { parts: 2, empty: 1 })
        }),
        ("(0F0;1F0)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::OverlapParts { .. })
        }),
        ("(0F0;1I0)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::OverlapParts { .. })
        }),
        ("(0F0;0SEND_F0)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::OverlapParts { .. })
        }),
        ("((0F0;1B0)OVERLAP_F_B;2B0)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::NestedParens)
        }),
        ("(0F0;1B0", 1, 1, 1, |k| matches!(k, K::UnclosedParen)),
        ("(0F0;1B0)OVERLAP", 1, 1, 1, |k| {
            matches!(k, K::OverlapType { .. })
        }),
        ("(0F0;1B0)", 1, 1, 1, |k| matches!(k, K::OverlapType { .. })),
        ("(0F0;1X0)OVERLAP_F_B", 1, 1, 1, |k| {
            matches!(k, K::UnknownType { .. })
        }),
        // The column counts characters, after a multi-byte cell and leading blanks.
        ("0F0,(0F1;1B0)OVERLAP_F_B, \u{e9}", 1, 3, 27, |k| {
            matches!(k, K::MissingStage { .. })
        }),
    ];
    for (text, line, cell, column, ok) in cases {
        let k = fails(text, d, line, cell, column);
        assert!(ok(&k), "{text:?}: unexpected {k:?}");
    }
}

#[test]
fn whole_file_and_placement_errors() {
    use CsvErrorKind as K;
    let d = opts();
    let pp = |n| ImportOptions {
        pp: Some(n),
        placement: None,
    };
    let place = |c| ImportOptions {
        pp: None,
        placement: Some(c),
    };
    assert!(matches!(fails("", d, 0, 0, 0), K::EmptyInput));
    assert!(matches!(fails("\r\n", d, 0, 0, 0), K::NoCompute));
    assert!(matches!(fails("0UNSHARD", d, 0, 0, 0), K::NoCompute));
    assert!(matches!(
        fails("0F0\n1F0\n", pp(3), 0, 0, 0),
        K::LineCount {
            found: 2,
            expected: 3
        }
    ));
    assert!(matches!(
        fails("0F0\n1F0\n2F0\n", pp(2), 3, 0, 0),
        K::LineCount {
            found: 3,
            expected: 2
        }
    ));
    assert!(matches!(
        fails("0F0,1F0\n2F0,1B0", d, 2, 2, 5),
        K::StageOnTwoRanks {
            stage: 1,
            first_line: 1,
            first_rank: 0,
            rank: 1
        }
    ));
    assert!(matches!(
        fails("0F0\n2F0", d, 0, 0, 0),
        K::StageMissing {
            stage: 1,
            max: 2,
            stages: 3
        }
    ));
    assert!(matches!(
        fails("0F0\n\n1F0", d, 2, 0, 0),
        K::RankWithoutStage { rank: 1 }
    ));
    assert!(matches!(
        fails("0F0\n,,\n1F0", d, 2, 0, 0),
        K::RankWithoutStage { rank: 1 }
    ));
    assert!(matches!(
        fails("0F0,1F0\n2F0", place(PlacementChoice::Loop), 1, 2, 5),
        K::WrongRank {
            stage: 1,
            owner: 1,
            rank: 0,
            placement: "loop"
        }
    ));
    assert!(matches!(
        fails("0F0,4F0\n1F0", place(PlacementChoice::V), 1, 2, 5),
        K::StageOutOfPlacement {
            stage: 4,
            stages: 4,
            ..
        }
    ));
    assert!(matches!(
        fails("0F0,,0SEND_F0\n1RECV_F0,1F0", d, 1, 2, 5),
        K::EmptyCellInComms
    ));
    assert!(matches!(
        fails("0F0,0SEND_F0,\n1RECV_F0,1F0", d, 1, 3, 14),
        K::EmptyCellInComms
    ));
    assert!(matches!(
        fails("0RECV_F0,0F0,0SEND_F0\n1RECV_F0,1F0", d, 1, 1, 1),
        K::NoNeighbour {
            ty: ActionType::RecvF,
            stage: 0,
            ..
        }
    ));
    assert!(matches!(
        fails("0F0,0SEND_F0\n1RECV_F0,1F0,1SEND_F0", d, 2, 3, 14),
        K::NoNeighbour {
            ty: ActionType::SendF,
            stage: 1,
            side: "next",
            stages: 2
        }
    ));
    assert!(matches!(
        fails("0F0,0SEND_B0\n1F0", d, 1, 2, 5),
        K::NoNeighbour {
            ty: ActionType::SendB,
            stage: 0,
            ..
        }
    ));
    assert!(matches!(
        fails("0F0,0SEND_F0,1RECV_F0,1F0", d, 1, 2, 5),
        K::SelfMessage {
            stage: 0,
            peer: 1,
            rank: 0,
            ..
        }
    ));
    assert!(matches!(
        fails("0F0,1F9000000", d, 0, 0, 0),
        K::TooLarge {
            stages: 2,
            microbatches: 9000001,
            ..
        }
    ));
    // Invalid UTF-8, from bytes.
    let e = import_csv_bytes(b"0F0\n1F0,1F\xff1\n", &d).unwrap_err();
    assert_eq!((e.line, e.cell_index, e.column), (2, 2, 5));
    assert!(matches!(e.kind, K::InvalidUtf8 { offset: 10 }));
}

#[test]
fn accepted_variants() {
    // CRLF or LF, a missing final newline, blanks around cells and pair parts (torch strips
    // them), leading zeros (torch's int() reads them), bookkeeping actions anywhere.
    let a = import_csv("0F0,0B0\r\n", &opts()).unwrap();
    let b = import_csv(" 0F0 ,\t00B00", &opts()).unwrap();
    assert_eq!(a.program, b.program);
    let c = import_csv(
        "0UNSHARD,(0F1; 0B0 )OVERLAP_F_B,0F0,0B1,0RESHARD\n",
        &opts(),
    )
    .unwrap();
    assert_eq!(c.bookkeeping, 2);
    assert_eq!(c.program.microbatches, 2);
    // A file with forwards only is a forward-only (inference) program.
    let f = import_csv("0F0,0F1\n1F0,1F1\n", &opts()).unwrap();
    assert!(f.program.forward_only);
    // A placement neither looped nor V is kept as a custom table.
    let x = import_csv("0F0,2F0,0B0,2B0\n1F0,1B0\n", &opts()).unwrap();
    assert_eq!(x.program.placement.kind, PlacementKind::Custom);
    assert_eq!(
        x.program.placement.table(),
        &[Rank(0), Rank(1), Rank(0)][..]
    );
    // --placement loop rounds the stage count up to a multiple of pp.
    let l = import_csv(
        "0F0,0B0\n1F0,1B0\n",
        &ImportOptions {
            pp: Some(2),
            placement: Some(PlacementChoice::Loop),
        },
    )
    .unwrap();
    assert_eq!(l.program.placement, Placement::looped(2, 1));
}

#[test]
fn error_display_echoes_the_line_with_a_caret_under_the_cell() {
    let e = import_csv("0F0,0F1,1F0xyz,0B0\n", &opts()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "line 1, cell 3 (column 9), `1F0xyz`: unexpected text `xyz` after the action `1F0`\n    \
         0F0,0F1,1F0xyz,0B0\n            ^^^^^^"
    );
    // Long lines are cut to a window around the cell.
    let mut long = vec!["0F0"; 100];
    long[60] = "0Z0";
    let e = import_csv(&long.join(","), &opts()).unwrap_err();
    let shown = e.to_string();
    let echo: Vec<&str> = shown.lines().collect();
    assert_eq!(echo.len(), 3);
    assert!(echo[1].starts_with("    ...") && echo[1].ends_with("..."));
    let caret = echo[2].find('^').unwrap();
    assert_eq!(&echo[1][caret..caret + 3], "0Z0");
    // Whole-file errors have no position.
    let e = import_csv("0F0\n2F0", &opts()).unwrap_err();
    assert!(!e.to_string().starts_with("line"), "{e}");
    assert!(!e.to_string().contains('^'));
}

// ---------------------------------------------------------------------------------------
// Nothing panics the importer.

mod never_panics {
    use super::*;
    use proptest::prelude::*;

    fn tokens() -> impl Strategy<Value = String> {
        let t = prop::sample::select(vec![
            "0",
            "1",
            "2",
            "3",
            "7",
            "65535",
            "99999999999",
            "F",
            "B",
            "I",
            "W",
            "SEND_F",
            "RECV_F",
            "SEND_B",
            "RECV_B",
            "UNSHARD",
            "WAIT_SEND_F",
            "REDUCE_GRAD",
            "(",
            ";",
            ")",
            ")OVERLAP_F_B",
            ",",
            ",",
            "\n",
            "\r\n",
            " ",
            "\u{663}",
            "\u{e9}",
            "",
        ]);
        prop::collection::vec(t, 0..64).prop_map(|v| v.concat())
    }

    fn options() -> impl Strategy<Value = ImportOptions> {
        (
            prop::option::of(0u32..6),
            prop::option::of(prop::sample::select(vec![
                PlacementChoice::Loop,
                PlacementChoice::V,
            ])),
        )
            .prop_map(|(pp, placement)| ImportOptions { pp, placement })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn arbitrary_strings(s in any::<String>(), o in options()) {
            if let Err(e) = import_csv(&s, &o) {
                let _ = e.to_string();
            }
        }

        #[test]
        fn token_soup(s in tokens(), o in options()) {
            match import_csv(&s, &o) {
                Err(e) => { let _ = e.to_string(); }
                // Whatever imports exports again without error.
                Ok(i) => {
                    for f in [CsvForm::ComputeOnly, CsvForm::ComputeComms] {
                        prop_assert!(pipec_compiler::torch::export_csv_unverified(&pipec_tests::unverified(&i.program), f).is_ok());
                    }
                }
            }
        }

        #[test]
        fn arbitrary_bytes(b in prop::collection::vec(any::<u8>(), 0..256), o in options()) {
            if let Err(e) = import_csv_bytes(&b, &o) {
                let _ = e.to_string();
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// `pipec import`.

mod cli {
    use super::*;
    use crate::harness::pipec;
    use assert_cmd::prelude::*;
    use predicates::str::contains;

    fn shared_file(name: &str) -> PathBuf {
        let p = pipec_tests::shared_dir()
            .join("conformance/torch")
            .join(name);
        assert!(p.exists(), "conformance file {} is missing", p.display());
        p
    }

    #[test]
    fn imports_each_conformance_file_into_a_loadable_directory() {
        let tmp = tempfile::tempdir().unwrap();
        for (i, name) in [INTERLEAVED_ONLY, INTERLEAVED_COMMS, DUALPIPEV_ONLY]
            .into_iter()
            .enumerate()
        {
            let out = tmp.path().join(format!("out{i}"));
            pipec()
                .args(["import"])
                .arg(shared_file(name))
                .arg("-o")
                .arg(&out)
                .assert()
                .success()
                .stdout(contains("imported"));
            let loaded = pipec_ir::files::load_dir(&out).unwrap();
            let want = import_csv(&conformance(name), &opts()).unwrap();
            assert_eq!(loaded.program, want.program, "{name}");
            assert_eq!(loaded.manifest.source, "torch-csv");
            assert_eq!(loaded.manifest.schedule, None);
            let policy = if want.form == CsvForm::ComputeOnly {
                Some(CommPolicy::Lockstep)
            } else {
                None
            };
            assert_eq!(loaded.manifest.comm_policy, policy, "{name}");
            assert_eq!(
                loaded.manifest.layout,
                pipec_schedules::layout::Layout::uniform(want.program.num_stages())
            );
        }
        // --pp and --placement that agree with the file.
        let out = tmp.path().join("given");
        pipec()
            .args(["import", "--pp", "2", "--placement", "v"])
            .arg(shared_file(DUALPIPEV_ONLY))
            .arg("-o")
            .arg(&out)
            .assert()
            .success();
    }

    #[test]
    fn exit_codes() {
        let tmp = tempfile::tempdir().unwrap();
        let bad = tmp.path().join("bad.csv");
        std::fs::write(&bad, "0F0,0F1\n1F0,1F0xyz\n").unwrap();
        let out = tmp.path().join("out");
        pipec()
            .arg("import")
            .arg(&bad)
            .arg("-o")
            .arg(&out)
            .assert()
            .code(1)
            .stderr(contains("line 2, cell 2 (column 5), `1F0xyz`"))
            .stderr(contains("\n        ^^^^^^"));
        assert!(!out.exists(), "nothing is written for an invalid file");
        // --pp disagreeing with the line count.
        pipec()
            .args(["import", "--pp", "3"])
            .arg(shared_file(INTERLEAVED_ONLY))
            .arg("-o")
            .arg(&out)
            .assert()
            .code(1)
            .stderr(contains("but pp is 3 (--pp)"));
        // Invalid UTF-8.
        std::fs::write(&bad, b"0F0\xc3\n").unwrap();
        pipec()
            .arg("import")
            .arg(&bad)
            .arg("-o")
            .arg(&out)
            .assert()
            .code(1)
            .stderr(contains("not valid UTF-8"));
        // A file that is not there, and a bad option value: usage / I/O.
        pipec()
            .arg("import")
            .arg(tmp.path().join("nope.csv"))
            .arg("-o")
            .arg(&out)
            .assert()
            .code(2)
            .stderr(contains("cannot read"));
        pipec()
            .args(["import", "--placement", "zigzag"])
            .arg(shared_file(INTERLEAVED_ONLY))
            .arg("-o")
            .arg(&out)
            .assert()
            .code(1); // an unknown placement is invalid input (docs/cli.md: exit 1)
                      // An output path that holds something else.
        let occupied = tmp.path().join("occupied");
        std::fs::create_dir(&occupied).unwrap();
        std::fs::write(occupied.join("notes.txt"), "keep").unwrap();
        pipec()
            .arg("import")
            .arg(shared_file(INTERLEAVED_ONLY))
            .arg("-o")
            .arg(&occupied)
            .assert()
            .code(2);
    }
}

#[test]
fn export_refuses_what_the_csv_cannot_say() {
    use pipec_compiler::torch::ExportError;
    let mut p = pipec_compiler::lower(
        &generate(
            &spec(ScheduleKind::OneFOneB, 2, 1, 2, false),
            &Limits::DEFAULT,
        )
        .unwrap(),
    );
    let first_send = p.ranks[0]
        .iter()
        .position(|i| matches!(i, Instr::Send { .. }))
        .unwrap();
    let good = p.clone();
    for (peer, want_self) in [(Rank(0), true), (Rank(7), false)] {
        p = good.clone();
        if let Instr::Send { peer: q, .. } = &mut p.ranks[0][first_send] {
            *q = peer;
        }
        let e = pipec_compiler::torch::export_csv_unverified(
            &pipec_tests::unverified(&p),
            CsvForm::ComputeComms,
        )
        .unwrap_err();
        assert_eq!(
            matches!(e, ExportError::SelfMessage { .. }),
            want_self,
            "{e}"
        );
        assert!(
            e.to_string()
                .starts_with(&format!("rank 0, #{first_send}: ")),
            "{e}"
        );
        // The compute-only form has no messages to get wrong.
        assert!(pipec_compiler::torch::export_csv_unverified(
            &pipec_tests::unverified(&p),
            CsvForm::ComputeOnly
        )
        .is_ok());
    }
    // A gradient received from stage -1 names no stage.
    p = good;
    p.ranks[0].push(Instr::Recv {
        peer: Rank(1),
        payload: Payload::grad(0, 0),
        batch: 99,
        tokens: None,
        slot: None,
    });
    assert!(matches!(
        pipec_compiler::torch::export_csv_unverified(
            &pipec_tests::unverified(&p),
            CsvForm::ComputeComms
        ),
        Err(ExportError::NoNeighbour { .. })
    ));
}

/// DualPipe keeps stage s on two ranks (one per direction); torch's CSV cannot say that, so
/// the export is refused up front instead of writing a file `pipec check` would then reject.
#[test]
fn export_refuses_bidirectional_placements() {
    let s = spec(ScheduleKind::DualPipe, 4, 1, 8, false);
    let p = pipec_compiler::lower(&generate(&s, &Limits::DEFAULT).unwrap());
    for form in [CsvForm::ComputeOnly, CsvForm::ComputeComms] {
        let e = export_csv(&pipec_tests::verified(&p), form).unwrap_err();
        assert!(e.to_string().contains("bidirectional"), "{e}");
    }
}
