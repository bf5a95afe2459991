//! An order of every rank's instructions that runs with blocking, one-at-a-time sends and
//! receives (DeepSpeed's `p2p.send`/`recv`; gloo's send waits for its receive).

use super::{steps, Instr, Matching, Program, Step};

/// Every rank's instruction indices in an order that cannot deadlock when each send and
/// receive blocks until its partner is posted and a rank posts one op at a time: compute and
/// memory instructions and batches keep their places, the ops of each batch are reordered,
/// waits are dropped (every batch completes where it stands).
///
/// Found by running the program under exactly that rule (the verifier's rendezvous model,
/// docs/design.md rule 4, with one op in flight per rank instead of a whole batch): a rank
/// passes compute ops and waits at once; at a comm batch, an op completes as soon as its
/// matched op (`matching`, the verifier's: the k-th send from a to b meets b's k-th receive
/// from a) is in the batch its rank stands at, and the rank moves on when the batch is empty.
/// Which pair completes first does not change what completes (a rank only leaves a batch,
/// never an op), so when this run stalls, every serial order of the batches stalls, and the
/// error names the stuck ops.
pub fn blocking_order(p: &Program, m: &Matching) -> Result<Vec<Vec<u32>>, String> {
    let pos = m.positions();
    let world = p.ranks.len();
    let units: Vec<Vec<Step>> = p.ranks.iter().map(|r| steps(r).collect()).collect();
    let mut next = vec![0usize; world]; // next unit of each rank
    let mut at: Vec<Option<std::ops::Range<usize>>> = vec![None; world]; // batch a rank stands at
    let mut left = vec![0usize; world]; // ops of that batch not yet completed
    let mut done = vec![false; pos.total() as usize];
    let mut order: Vec<Vec<u32>> = p
        .ranks
        .iter()
        .map(|r| Vec::with_capacity(r.len()))
        .collect();
    let mut queue: std::collections::VecDeque<usize> = (0..world).collect();
    while let Some(r) = queue.pop_front() {
        if at[r].is_some() {
            continue;
        }
        // Pass compute and waits up to the next batch, then complete what meets a partner.
        while let Some(unit) = units[r].get(next[r]) {
            next[r] += 1;
            match unit {
                // A memory instruction waits on nothing of another rank: it passes at once.
                Step::Compute(i) | Step::Memory(i) => order[r].push(*i as u32),
                Step::Wait { .. } => {}
                Step::Batch { ops, .. } => {
                    at[r] = Some(ops.clone());
                    left[r] = ops.len();
                    break;
                }
            }
        }
        let Some(ops) = at[r].clone() else { continue };
        for i in ops {
            let g = pos.base(r) + i as u32;
            let Some(q) = m.partner_of(g) else {
                return Err(format!(
                    "rank {r}, #{i} ({}) has no matching op",
                    p.ranks[r][i]
                ));
            };
            let qr = pos.rank_of(q) as usize;
            let qi = (q - pos.base(qr)) as usize;
            let meets = at[qr].as_ref().is_some_and(|b| b.contains(&qi)) && !done[q as usize];
            if !meets || done[g as usize] {
                continue;
            }
            done[g as usize] = true;
            done[q as usize] = true;
            order[r].push(i as u32);
            order[qr].push(qi as u32);
            for k in [r, qr] {
                left[k] -= 1;
                if left[k] == 0 {
                    at[k] = None;
                    queue.push_back(k);
                }
            }
        }
    }
    let stuck: Vec<String> = (0..world)
        .filter_map(|r| {
            let ops = at[r].clone()?;
            let i = ops
                .clone()
                .find(|&i| !done[(pos.base(r) + i as u32) as usize])?;
            Some(format!("rank {r} at #{i} ({})", p.ranks[r][i]))
        })
        .collect();
    if !stuck.is_empty() {
        return Err(format!(
            "deadlocks with blocking sends and receives taken one at a time: {}",
            stuck.join("; ")
        ));
    }
    debug_assert!(order.iter().zip(&p.ranks).all(|(o, r)| o.len()
        == r.iter()
            .filter(|i| !matches!(i, Instr::Wait { .. }))
            .count()));
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Payload;
    use pipec_schedules::{Compute, Placement, Rank, Task};

    fn program(ranks: Vec<Vec<Instr>>) -> Program {
        Program {
            placement: Placement::looped(ranks.len() as u32, 1),
            microbatches: 1,
            forward_only: false,
            comm: None,
            ranks,
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    fn order(p: &Program) -> Result<Vec<Vec<u32>>, String> {
        blocking_order(p, &Matching::of(p).unwrap())
    }

    #[test]
    fn an_exchange_posts_the_receive_first_on_one_side() {
        // Both ranks send first within one batch: taken one op at a time in stream order,
        // both sends would block. Rank 1 keeps its order, rank 0 receives first; compute
        // keeps its place and the wait is dropped.
        let a = Payload::act(0, 0);
        let g = Payload::grad(1, 0);
        let p = program(vec![
            vec![
                Instr::Compute(Compute::Fwd(Task::new(0, 0))),
                Instr::message(true, Rank(1), a, 1),
                Instr::message(false, Rank(1), g, 1),
                Instr::Wait { batch: 1 },
                Instr::Compute(Compute::Bwd(Task::new(0, 0))),
            ],
            vec![
                Instr::message(true, Rank(0), g, 1),
                Instr::message(false, Rank(0), a, 1),
            ],
        ]);
        assert_eq!(order(&p).unwrap(), vec![vec![0, 2, 1, 4], vec![0, 1]]);
    }

    #[test]
    fn two_receives_first_deadlock_and_are_named() {
        let a = Payload::act(0, 0);
        let g = Payload::grad(1, 0);
        let p = program(vec![
            vec![
                Instr::message(false, Rank(1), g, 1),
                Instr::message(true, Rank(1), a, 2),
            ],
            vec![
                Instr::message(false, Rank(0), a, 1),
                Instr::message(true, Rank(0), g, 2),
            ],
        ]);
        let e = order(&p).unwrap_err();
        assert!(
            e.starts_with("deadlocks with blocking sends and receives taken one at a time")
                && e.contains("rank 0 at #0")
                && e.contains("rank 1 at #0"),
            "{e}"
        );
    }

    #[test]
    fn an_unmatched_op_is_named() {
        let p = program(vec![
            vec![Instr::message(true, Rank(1), Payload::act(0, 0), 1)],
            vec![],
        ]);
        let e = order(&p).unwrap_err();
        assert!(
            e.starts_with("rank 0, #0 (") && e.ends_with("has no matching op"),
            "{e}"
        );
    }
}
