//! The order in which an exported compute+comms line lists the messages of one comm batch.
//!
//! In pipec a comm batch is posted as one NCCL group, so its messages are unordered. A torch
//! compute+comms file has no groups: each P2P action is posted on its own, and pipec reads such
//! a file with each action its own batch, blocking until its partner is reached (stricter
//! than torch's asynchronous `isend`/`irecv`, see the importer). Written in an arbitrary order,
//! the messages of a fused batch can then wait on each other across ranks: in 1F1B's steady
//! state both neighbours send first and receive second, and each send waits for a receive the
//! other side has not reached.
//!
//! So the exporter runs the program once with every batch taken as a set of messages that
//! may complete in any order (a message completes when both its rank and its partner's rank
//! are at the batches holding the two ends) and writes each batch's messages in the order
//! they completed. That order is a valid run of the one-action-per-batch reading, so the
//! export is deadlock-free under it whenever this run finishes, which is whenever every
//! batch's partners are eventually posted (NCCL group semantics under rendezvous). Messages
//! that never complete (the program itself deadlocks, or a message has no partner) keep the
//! key order (sending rank, receiving rank, FIFO position between the two), the same on every
//! rank. Deterministic; linear in the program size. Per-peer FIFO order is never changed: the
//! k-th send to a peer always completes with the k-th recv there, before the (k+1)-th.

use pipec_ir::ir::{steps, Matching, OptIdx, Program, Step};
use std::collections::VecDeque;

/// For each rank, the instruction indices in the order to write them.
pub fn emission_orders(program: &Program) -> Vec<Vec<usize>> {
    emission_orders_with(program, None)
}

/// [`emission_orders`] with the program's matching when the caller has it (the verifier's).
pub(crate) fn emission_orders_with(
    program: &Program,
    matching: Option<&Matching>,
) -> Vec<Vec<usize>> {
    let w = program.ranks.len();
    let owned;
    let matching = match matching {
        Some(m) => Some(m),
        None => {
            owned = Matching::of(program);
            owned.as_ref()
        }
    };
    let Some(matching) = matching else {
        // Too large to number with u32 ids (and to hold in memory): program order.
        return program
            .ranks
            .iter()
            .map(|r| (0..r.len()).collect())
            .collect();
    };
    // Global message ids: offset[r] + index.
    let offset: Vec<usize> = (0..w)
        .map(|r| matching.positions().base(r) as usize)
        .collect();
    let total = matching.positions().total() as usize;

    // Comm batches ("runs"): (rank, start, end).
    let mut runs: Vec<(usize, usize, usize)> = Vec::new();
    let mut run_of = vec![OptIdx::NONE; total];
    for (r, instrs) in program.ranks.iter().enumerate() {
        for step in steps(instrs) {
            if let Step::Batch { ops, .. } = step {
                run_of[offset[r] + ops.start..offset[r] + ops.end]
                    .fill(OptIdx::some(runs.len() as u32));
                runs.push((r, ops.start, ops.end));
            }
        }
    }

    // The fallback key of each message: its channel and FIFO position there.
    let mut key = vec![(u32::MAX, u32::MAX, u32::MAX); total];
    for c in matching.channels() {
        for (k, &g) in c.sends.iter().enumerate() {
            key[g as usize] = (c.src, c.dst, k as u32);
        }
        for (k, &g) in c.recvs.iter().enumerate() {
            key[g as usize] = (c.src, c.dst, k as u32);
        }
    }

    // Each run's messages in key order; the run's completed messages in completion order.
    let members = |run: usize| -> Vec<usize> {
        let (r, s, e) = runs[run];
        let mut m: Vec<usize> = (offset[r] + s..offset[r] + e).collect();
        m.sort_by_key(|&id| key[id]);
        m
    };
    let mut done = vec![false; total];
    let mut left: Vec<usize> = runs.iter().map(|&(_, s, e)| e - s).collect();
    let mut completed: Vec<Vec<usize>> = vec![Vec::new(); runs.len()];
    let mut pc = vec![0usize; w];
    let mut current: Vec<Option<usize>> = vec![None; w];
    let mut queue: VecDeque<usize> = (0..w).collect();
    while let Some(r) = queue.pop_front() {
        let instrs = &program.ranks[r];
        loop {
            while pc[r] < instrs.len() && instrs[pc[r]].batch().is_none() {
                pc[r] += 1;
            }
            if pc[r] >= instrs.len() {
                current[r] = None;
                break;
            }
            // The instruction at `pc` is a send or receive, so it has a run.
            let Some(run) = run_of[offset[r] + pc[r]].get().map(|x| x as usize) else {
                break;
            };
            current[r] = Some(run);
            if left[run] > 0 {
                for id in members(run) {
                    let Some(p) = matching.partner_of(id as u32).map(|p| p as usize) else {
                        continue;
                    };
                    if done[id] {
                        continue;
                    }
                    let Some(prun) = run_of[p].get().map(|x| x as usize) else {
                        continue;
                    };
                    let pr = runs[prun].0;
                    if current[pr] != Some(prun) {
                        continue;
                    }
                    done[id] = true;
                    done[p] = true;
                    completed[run].push(id);
                    completed[prun].push(p);
                    left[run] -= 1;
                    left[prun] -= 1;
                    if left[prun] == 0 && pr != r {
                        queue.push_back(pr);
                    }
                }
            }
            if left[run] > 0 {
                break;
            }
            pc[r] = runs[run].2;
        }
    }

    // Stuck or unmatched messages follow in key order.
    for (run, c) in completed.iter_mut().enumerate() {
        if left[run] > 0 {
            c.extend(members(run).into_iter().filter(|&id| !done[id]));
        }
    }
    program
        .ranks
        .iter()
        .enumerate()
        .map(|(r, instrs)| {
            let mut order = Vec::with_capacity(instrs.len());
            let mut i = 0;
            while i < instrs.len() {
                match run_of[offset[r] + i].get() {
                    None => {
                        order.push(i);
                        i += 1;
                    }
                    Some(run) => {
                        let run = run as usize;
                        order.extend(completed[run].iter().map(|&id| id - offset[r]));
                        i = runs[run].2;
                    }
                }
            }
            order
        })
        .collect()
}
