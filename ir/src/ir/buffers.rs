//! Message buffers: how long each message's tensor lives on its rank, and the static pool
//! that holds them (issue #39, `pipec compile --buffer-plan`). Written once here for every
//! reader: the planner ([`plan`]), the verifier's slot rule (`verify::buffers`), the memory
//! rule (the pools count per rank, [`crate::memory`]) and the runtimes that allocate the pools.
//!
//! # Liveness
//!
//! Time is a rank's instruction index; a message lives over a closed interval `[start, end]`
//! of its rank's stream, and two messages of one rank may share a slot only when their
//! intervals are disjoint.
//! - A received activation or gradient lives from the post of its comm batch (the receive
//!   writes into the buffer from then on) to its last use on the rank: the pass that consumes
//!   it as the verifier's dependence rule P1 names it (`fwd(s+1, m)` for the activation of
//!   `(s, m)`, a checkpointed forward included, and a later `recompute(s+1, m)`, which runs the
//!   forward again from the same input; `bwd(s-1, m)` or `bwd_D(s-1, m)` for the gradient of
//!   `(s, m)`). `bwd_W` needs only its `bwd_D` (P1): what the weight gradient keeps is the
//!   stage's activation memory (`K.act`), not the message buffer, so a runtime copies the
//!   tensors the backward keeps out of the slot at the consuming pass (torch does the same:
//!   pytorch #185355 clones the receive buffer before the stage uses it). At least until the
//!   receive completes (its batch, or its `wait`), even when nothing on the rank uses it.
//! - A sent tensor lives from the pass that produces it (`fwd(s, m)` for the activation,
//!   `bwd`/`bwd_D(s, m)` for the gradient; the last such pass before the send, else the post)
//!   until the send completes: the end of its batch when the batch is blocking, else the
//!   `wait` that names it.
//! - Within one instruction a pass reads its input while it writes its output: the two
//!   intervals share that index and never share a slot.
//!
//! Megatron's shape messages (`act_shape`, `grad_shape`) are 3-element integer tensors that
//! Megatron allocates itself: they take no slot.
//!
//! # Assignment
//!
//! What [`assign`] minimises, in this order: the number of slots of each rank's pool, then
//! (heuristically) its total size. The count is the most messages live at once (the maximum
//! clique of an interval graph), which no assignment can beat; visiting messages in order of
//! start and giving each a slot free at its start reaches it (interval graphs are perfect:
//! when a message starts, the busy slots hold messages live at that index, so fewer than the
//! maximum are busy and a new slot is opened only when all are). Among the free slots it
//! takes the best fit: the smallest slot at least as large as the message, else the largest
//! free one, grown to the message; a slot's size is the largest message it ever holds. Sizes
//! are equal unless microbatches differ in length (issue #38), and then the total is not
//! proven minimal (minimising it is max-colouring, NP-hard on interval graphs: Pemmaraju and
//! Raman, "Approximation algorithms for the max-coloring problem", ICALP 2005); the tests
//! check it against the lower bound of the most bytes live at once.

use super::steps::{steps, Step};
use super::{Instr, Payload, PayloadKind, Pools, Program, Tokens};
use pipec_schedules::{Pass, StageId, Task};
use std::collections::HashMap;

/// One message's lifetime on its rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Life {
    /// Index of the send or receive in the rank's stream.
    pub at: u32,
    /// First and last index (inclusive) at which its tensor occupies its buffer.
    pub start: u32,
    pub end: u32,
}

impl Life {
    /// Whether two lifetimes share an index (then they cannot share a slot).
    pub fn overlaps(&self, other: &Life) -> bool {
        self.start <= other.end && other.start <= self.end
    }
}

/// Whether a send or receive of `payload` takes a buffer slot: tensors do, shapes do not.
pub fn takes_slot(payload: &Payload) -> bool {
    !payload.kind.is_shape()
}

/// Every slot-taking message of rank `r`, in stream order, with its lifetime (module doc).
pub fn lives(program: &Program, r: usize) -> Vec<Life> {
    let Some(instrs) = program.ranks.get(r) else {
        return Vec::new();
    };
    // The index at which each batch (by its first op) completes: its `wait`, else its end.
    let mut waits: HashMap<u32, Vec<u32>> = HashMap::new();
    for (i, ins) in instrs.iter().enumerate() {
        if let Instr::Wait { batch } = *ins {
            waits.entry(batch).or_default().push(i as u32);
        }
    }
    let mut done_at: HashMap<u32, u32> = HashMap::new();
    // Per tensor (kind, stage, mb): the indices of the passes on this rank that read it as
    // input, and of those that produce it.
    let mut uses: HashMap<(PayloadKind, StageId, u32), Vec<u32>> = HashMap::new();
    let mut makes: HashMap<(PayloadKind, StageId, u32), Vec<u32>> = HashMap::new();
    let key = |kind, t: Task| (kind, t.stage, t.mb.0);
    let below = |t: Task| t.stage.0.checked_sub(1).map(|s| Task::new(s, t.mb.0));
    let above = |t: Task| t.stage.0.checked_add(1).map(|s| Task::new(s, t.mb.0));
    for step in steps(instrs) {
        match step {
            Step::Batch { id, ops } => {
                let last = ops.end as u32 - 1;
                let done = waits
                    .get(&id)
                    .and_then(|w| w.iter().find(|&&w| w > last).copied())
                    .unwrap_or(last);
                done_at.insert(ops.start as u32, done);
            }
            Step::Compute(i) => {
                let Some(c) = instrs[i].as_compute() else {
                    continue;
                };
                for (pass, t) in c.parts() {
                    // A forward reads the activation from below and makes its own; an
                    // input-gradient pass reads the gradient from above and makes its own.
                    let (kind, from) = match pass {
                        Pass::Fwd => (PayloadKind::Act, below(t)),
                        Pass::Bwd | Pass::BwdD => (PayloadKind::Grad, above(t)),
                        Pass::BwdW => continue,
                    };
                    if let Some(f) = from {
                        uses.entry(key(kind, f)).or_default().push(i as u32);
                    }
                    makes.entry(key(kind, t)).or_default().push(i as u32);
                }
            }
            Step::Memory(i) => {
                if let Instr::Memory(m) = instrs[i] {
                    if m.kind == super::MemKind::Recompute {
                        if let Some(b) = below(m.task) {
                            uses.entry(key(PayloadKind::Act, b))
                                .or_default()
                                .push(i as u32);
                        }
                    }
                }
            }
            Step::Wait { .. } => {}
        }
    }
    let mut out = Vec::new();
    let mut post = 0u32;
    for (i, ins) in instrs.iter().enumerate() {
        let i = i as u32;
        let (payload, is_send) = match *ins {
            Instr::Send { payload, .. } => (payload, true),
            Instr::Recv { payload, .. } => (payload, false),
            _ => continue,
        };
        if i == 0 || instrs[i as usize - 1].batch() != ins.batch() {
            post = i;
        }
        if !takes_slot(&payload) {
            continue;
        }
        let done = done_at.get(&post).copied().unwrap_or(i);
        let k = (payload.kind, payload.stage, payload.mb.0);
        let (start, end) = if is_send {
            let made = makes
                .get(&k)
                .and_then(|v| v.iter().rev().find(|&&j| j < post).copied());
            (made.unwrap_or(post), done)
        } else {
            let used = uses
                .get(&k)
                .and_then(|v| v.iter().rev().find(|&&j| j > i).copied());
            (post, used.map_or(done, |u| u.max(done)))
        };
        out.push(Life { at: i, start, end });
    }
    out
}

/// The most of `lives` that share one index: the fewest slots any assignment needs.
pub fn max_live(lives: &[Life]) -> u32 {
    let mut ev: Vec<(u32, i32)> = Vec::with_capacity(2 * lives.len());
    for l in lives {
        ev.push((l.start, 1));
        ev.push((l.end + 1, -1));
    }
    // At one index, ends (of intervals that closed before it) come before starts.
    ev.sort_unstable();
    let (mut live, mut most) = (0i64, 0i64);
    for (_, d) in ev {
        live += d as i64;
        most = most.max(live);
    }
    most as u32
}

/// Slots for `lives` (sizes `size[k]` for `lives[k]`), as the module doc says: per message its
/// slot, and each slot's size.
pub fn assign(lives: &[Life], size: &[f64]) -> (Vec<u32>, Vec<f64>) {
    let mut order: Vec<usize> = (0..lives.len()).collect();
    order.sort_by_key(|&k| (lives[k].start, lives[k].end, lives[k].at));
    let mut slot_of = vec![0u32; lives.len()];
    let mut sizes: Vec<f64> = Vec::new();
    // The last index each slot is busy until.
    let mut busy_until: Vec<Option<u32>> = Vec::new();
    for k in order {
        let (l, s) = (lives[k], size.get(k).copied().unwrap_or(0.0));
        let free = (0..sizes.len()).filter(|&j| busy_until[j].is_none_or(|e| e < l.start));
        let fits = free
            .clone()
            .filter(|&j| sizes[j] >= s)
            .min_by(|&a, &b| sizes[a].total_cmp(&sizes[b]).then(a.cmp(&b)));
        let pick =
            fits.or_else(|| free.max_by(|&a, &b| sizes[a].total_cmp(&sizes[b]).then(b.cmp(&a))));
        let j = match pick {
            Some(j) => j,
            None => {
                sizes.push(0.0);
                busy_until.push(None);
                sizes.len() - 1
            }
        };
        sizes[j] = sizes[j].max(s);
        busy_until[j] = Some(l.end);
        slot_of[k] = j as u32;
    }
    (slot_of, sizes)
}

/// Give `program` a buffer plan: every slot-taking send and receive its slot, and
/// [`Program::buffer_slots`] the pools. `size` is a message's size in the memory unit, from
/// its payload and tokens (`pipec_cost::memory::message_size`).
pub fn plan(program: &mut Program, size: impl Fn(&Payload, Option<Tokens>) -> f64) {
    let mut pools = Vec::with_capacity(program.ranks.len());
    for r in 0..program.ranks.len() {
        let lv = lives(program, r);
        let sizes: Vec<f64> = lv
            .iter()
            .map(|l| match program.ranks[r][l.at as usize] {
                Instr::Send {
                    payload, tokens, ..
                }
                | Instr::Recv {
                    payload, tokens, ..
                } => size(&payload, tokens),
                _ => 0.0,
            })
            .collect();
        let (slots, pool) = assign(&lv, &sizes);
        for (l, s) in lv.iter().zip(slots) {
            if let Instr::Send { slot, .. } | Instr::Recv { slot, .. } =
                &mut program.ranks[r][l.at as usize]
            {
                *slot = Some(s);
            }
        }
        pools.push(pool);
    }
    program.buffer_slots = Some(Pools(pools));
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The fewest colours of the interval graph of `lives`, by exhaustive search (each
    /// interval tries every colour used so far and one new one): the independent reference
    /// [`assign`]'s count is checked against.
    fn fewest_slots(lives: &[Life]) -> u32 {
        fn go(lives: &[Life], k: usize, col: &mut Vec<u32>, used: u32, best: &mut u32) {
            if used >= *best {
                return;
            }
            if k == lives.len() {
                *best = used;
                return;
            }
            for c in 0..=used {
                let clash = (0..k).any(|j| col[j] == c && lives[j].overlaps(&lives[k]));
                if !clash {
                    col.push(c);
                    go(lives, k + 1, col, used.max(c + 1), best);
                    col.pop();
                }
            }
        }
        let mut best = lives.len() as u32;
        go(lives, 0, &mut Vec::new(), 0, &mut best);
        best
    }

    fn arb_lives() -> impl Strategy<Value = (Vec<Life>, Vec<f64>)> {
        prop::collection::vec((0u32..12, 0u32..6, 1u32..4), 0..9).prop_map(|v| {
            let lives = v
                .iter()
                .enumerate()
                .map(|(k, &(s, d, _))| Life {
                    at: k as u32,
                    start: s,
                    end: s + d,
                })
                .collect();
            let sizes = v.iter().map(|&(_, _, z)| z as f64).collect();
            (lives, sizes)
        })
    }

    proptest! {
        /// The slot count is the exhaustive minimum and the most live at once; no two
        /// overlapping messages share a slot; each slot holds its largest message; the pool is
        /// at least the most size live at once (the lower bound any assignment meets).
        #[test]
        fn assignment_is_minimal_and_sound((lives, sizes) in arb_lives()) {
            let (slots, pool) = assign(&lives, &sizes);
            prop_assert_eq!(pool.len() as u32, fewest_slots(&lives));
            prop_assert_eq!(pool.len() as u32, max_live(&lives));
            for a in 0..lives.len() {
                prop_assert!(pool[slots[a] as usize] >= sizes[a]);
                for b in a + 1..lives.len() {
                    if lives[a].overlaps(&lives[b]) {
                        prop_assert_ne!(slots[a], slots[b]);
                    }
                }
            }
            let most_bytes = (0..20u32)
                .map(|t| {
                    lives.iter().zip(&sizes)
                        .filter(|(l, _)| l.start <= t && t <= l.end)
                        .map(|(_, s)| s)
                        .sum::<f64>()
                })
                .fold(0.0, f64::max);
            prop_assert!(pool.iter().sum::<f64>() >= most_bytes);
        }

        /// With equal sizes the total is the count times the size: the minimum.
        #[test]
        fn equal_sizes_give_the_minimal_total((lives, _) in arb_lives()) {
            let sizes = vec![2.0; lives.len()];
            let (_, pool) = assign(&lives, &sizes);
            prop_assert_eq!(pool.iter().sum::<f64>(), 2.0 * fewest_slots(&lives) as f64);
        }
    }

    /// A hand-derived case: a receive consumed by the forward at #2, then the send of that
    /// forward's output until its blocking batch at #3: they share #2, so two slots; a
    /// receive posted at #4 reuses the first.
    #[test]
    fn lifetimes_of_a_small_stream() {
        use crate::ir::Payload;
        use pipec_schedules::{Compute, Rank};
        let recv = |mb, batch| Instr::Recv {
            peer: Rank(0),
            payload: Payload::act(0, mb),
            batch,
            tokens: None,
            slot: None,
        };
        let send = |mb, batch| Instr::Send {
            peer: Rank(2),
            payload: Payload::act(1, mb),
            batch,
            tokens: None,
            slot: None,
        };
        let fwd = |mb| Instr::Compute(Compute::Fwd(Task::new(1, mb)));
        let mut p = Program {
            placement: pipec_schedules::Placement::looped(3, 1),
            microbatches: 2,
            forward_only: true,
            comm: None,
            lengths: None,
            p2p_groups: Default::default(),
            ranks: vec![
                vec![],
                vec![
                    recv(0, 0),
                    Instr::Wait { batch: 0 },
                    fwd(0),
                    send(0, 1),
                    recv(1, 2),
                    fwd(1),
                    send(1, 3),
                ],
                vec![],
            ],
            buffer_slots: None,
        };
        // recv #0 posted at #0, left in flight until the wait at #1, used by fwd at #2.
        assert_eq!(
            lives(&p, 1),
            vec![
                Life {
                    at: 0,
                    start: 0,
                    end: 2
                },
                Life {
                    at: 3,
                    start: 2,
                    end: 3
                },
                Life {
                    at: 4,
                    start: 4,
                    end: 5
                },
                Life {
                    at: 6,
                    start: 5,
                    end: 6
                },
            ]
        );
        plan(&mut p, |_, _| 1.0);
        let slots: Vec<Option<u32>> = p.ranks[1].iter().map(Instr::slot).collect();
        assert_eq!(
            slots,
            vec![Some(0), None, None, Some(1), Some(0), None, Some(1)]
        );
        assert_eq!(
            p.buffer_slots,
            Some(Pools(vec![vec![], vec![1.0, 1.0], vec![]]))
        );
    }
}
