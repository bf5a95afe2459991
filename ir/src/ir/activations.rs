//! Live activations per rank, counted once for every reader: the verifier's memory check (R1),
//! `pipec tune`'s weighted peak, the simulator's summary and the runtime's static figure, so
//! that their numbers cannot disagree (docs/design.md "Correctness rules" 5). The unit is one
//! microbatch's activations on one stage, the unit the published formulas use (GPipe holds
//! `M`, 1F1B `p - r` on rank `r`: Narayanan et al., "Efficient Large-Scale Language Model
//! Training on GPU Clusters Using Megatron-LM", 2021).
//!
//! The rule, per compute instruction of a rank in program order:
//! - a `fwd(s, m)` part allocates the activation of `(s, m)`, `act`;
//! - a `bwd(s, m)` part frees it; when the backward is split, a `bwd_D(s, m)` part frees
//!   `act - act_w` and the `bwd_W(s, m)` part the rest, `act_w`: the weight gradient still
//!   needs the inputs of its GEMMs, the input gradient alone reads the rest (attention and
//!   dropout masks, activation-function inputs, norm statistics; Korthikanti et al. 2022's
//!   list, `pipec_cost::model`). The zero-bubble authors' `mem_f`, `mem_b`, `mem_w` are
//!   `act`, `-(act - act_w)`, `-act_w`. A backward frees only what this rank allocated and
//!   still holds: one on the wrong rank, a second one or one before its forward frees
//!   nothing, so an invalid program cannot count less than it holds;
//! - within one instruction allocation comes before freeing, so the forward half of a
//!   `fwd_bwd` pair counts while the backward half still holds its activation;
//! - a forward-only program stashes nothing, but a forward's activation is live while it runs
//!   (allocated and freed by the same instruction): a rank that runs a forward peaks at 1.
//!
//! Memory instructions (docs/format.md, "Memory instructions"; issue 30):
//! - a checkpointed `fwd(s, m)` is live while it runs and keeps nothing (its input is not
//!   counted, as PipeOffload's `calculate_peak_memory` counts it);
//! - `recompute(s, m)` allocates the activation again, held until the backward frees it
//!   (the whole of it: `bwd_D` then frees `act - act_w` as after a forward);
//! - `offload(s, m)` of a held activation puts it on the host (host `+1` from the offload) and
//!   leaves the device copy counted until the offload is known to have ended: the copy stream
//!   runs its copies in program order, so a copy has ended at a `wait_offload` of it or of a
//!   later copy, and at a `bwd`/`bwd_D` that waits for a `reload` posted after it. The device
//!   copy is released after that instruction. A backward no longer frees it;
//! - `reload(s, m)` allocates on the device at its position (in flight counts), held until the
//!   backward frees it (the whole activation: `bwd_D` frees `act - act_w` of it, as after a
//!   forward); the host copy is released when the reload is known to have ended. An offload
//!   of an activation whose `bwd_D` has run moves the `act_w` still held.
//!
//! The host count ([`Live::host`]) follows the same positions. Tasks out of range are
//! allocated and never freed. A program too small to afford a table
//! per task ([`Program::task_tables_fit`], reported by the verifier as too few ops) is counted
//! without one: every backward frees its part (`bwd` `act`, `bwd_D` `act - act_w`, `bwd_W`
//! `act_w`), never below zero.

use crate::ir::{Instr, MemKind, Program};
use pipec_schedules::{Compute, Pass, Task};
use std::collections::{HashMap, VecDeque};
use std::iter::Enumerate;
use std::slice;

/// What a live count is measured in: activations (`u64`, the verifier's unit) or weighted
/// memory (`f64`, `pipec tune`).
pub trait Amount: Copy + PartialOrd + Default {
    fn plus(self, other: Self) -> Self;
    /// `self - other`; activations never go below zero.
    fn minus(self, other: Self) -> Self;
}

impl Amount for u64 {
    fn plus(self, other: u64) -> u64 {
        self.saturating_add(other)
    }
    fn minus(self, other: u64) -> u64 {
        self.saturating_sub(other)
    }
}

impl Amount for f64 {
    fn plus(self, other: f64) -> f64 {
        self + other
    }
    fn minus(self, other: f64) -> f64 {
        self - other
    }
}

/// The most live at once on one rank, and the first instruction (index in the rank's stream)
/// where it is reached; `None` when nothing is ever live.
#[derive(Copy, Clone, Debug, Default, PartialEq)]
pub struct Peak<W> {
    pub peak: W,
    pub at: Option<u32>,
}

impl<W: Amount> Peak<W> {
    /// Take in the live count during instruction `index`.
    pub fn see(&mut self, index: u32, live: W) {
        if live > self.peak {
            self.peak = live;
            self.at = Some(index);
        }
    }

    /// The peak of a [`Live`] walk (or a prefix of one).
    pub fn of(live: impl IntoIterator<Item = (u32, W)>) -> Self {
        let mut p = Peak::default();
        for (i, l) in live {
            p.see(i, l);
        }
        p
    }
}

/// Peak live activations of every rank, in rank order (every activation 1, all of it kept
/// for `bwd_W`).
pub fn peaks(program: &Program) -> Vec<Peak<u64>> {
    let mut walk = Activations::new(program);
    (0..program.ranks.len())
        .map(|r| Peak::of(walk.live(r, |_| (1u64, 1u64))))
        .collect()
}

/// What a rank holds of one task's activation: all of it (from its forward, reload or
/// recompute), or the part its `bwd_W` needs (after its `bwd_D`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Held {
    Whole,
    ForW,
}

/// The holder state [`step`] reads and writes: per task, what this rank holds. `tracked`
/// is false for a program too large for a table (the module doc's fallback).
trait Holds {
    fn get(&self, t: Task) -> Option<Held>;
    fn set(&mut self, t: Task, h: Option<Held>);
    fn tracked(&self) -> bool {
        true
    }
}

impl Holds for HashMap<Task, Held> {
    fn get(&self, t: Task) -> Option<Held> {
        HashMap::get(self, &t).copied()
    }
    fn set(&mut self, t: Task, h: Option<Held>) {
        match h {
            Some(h) => self.insert(t, h),
            None => self.remove(&t),
        };
    }
}

/// Walks ranks under the rule of the module doc. One holder table serves every rank (each
/// walk marks with a fresh tag), so walking all ranks is linear in the program.
pub struct Activations<'p> {
    program: &'p Program,
    /// Per task (`stage * M + mb`): the tag of the walk whose rank holds its activation. Empty
    /// when the program cannot afford it.
    holder: Vec<u32>,
    /// Per task: its `bwd_D` has run, the rank holds only what `bwd_W` needs.
    for_w: Vec<bool>,
    dense: bool,
    tag: u32,
}

impl<'p> Activations<'p> {
    pub fn new(program: &'p Program) -> Self {
        let dense = program.task_tables_fit();
        let tasks = if dense {
            program.num_stages() as usize * program.microbatches as usize
        } else {
            0
        };
        Activations {
            program,
            holder: vec![0; tasks],
            for_w: vec![false; tasks],
            dense,
            tag: 0,
        }
    }

    /// The live count during each compute instruction of `rank` (after its allocations,
    /// before its frees), as `(index in the rank's stream, live)`, with each activation
    /// counted as `weight(task)`: `(act, act_w)`, all of it and the part kept from `bwd_D` to
    /// `bwd_W`. A rank the program does not have yields nothing.
    pub fn live<W: Amount, F: Fn(Task) -> (W, W)>(
        &mut self,
        rank: usize,
        weight: F,
    ) -> Live<'_, 'p, W, F> {
        self.tag = self.tag.wrapping_add(1);
        if self.tag == 0 {
            // Tags from 4 billion walks ago could collide: start over.
            self.holder.fill(0);
            self.tag = 1;
        }
        let instrs = self.program.ranks.get(rank).map_or(&[][..], Vec::as_slice);
        Live {
            instrs: instrs.iter().enumerate(),
            walk: self,
            weight,
            live: W::default(),
            frees: W::default(),
            host: W::default(),
            host_frees: W::default(),
            copies: None,
        }
    }

    fn slot(&self, t: Task) -> Option<usize> {
        let p = self.program;
        (self.dense && t.stage.0 < p.num_stages() && t.mb.0 < p.microbatches)
            .then(|| t.stage.index() * p.microbatches as usize + t.mb.index())
    }
}

impl Holds for Activations<'_> {
    fn get(&self, t: Task) -> Option<Held> {
        let s = self.slot(t)?;
        (self.holder[s] == self.tag).then_some(if self.for_w[s] {
            Held::ForW
        } else {
            Held::Whole
        })
    }

    fn set(&mut self, t: Task, h: Option<Held>) {
        if let Some(s) = self.slot(t) {
            self.holder[s] = if h.is_some() { self.tag } else { 0 };
            self.for_w[s] = h == Some(Held::ForW);
        }
    }

    fn tracked(&self) -> bool {
        self.dense
    }
}

/// One rank's copy stream as the count sees it: the copies posted and not yet known to have
/// ended, in posting order (the stream's order), and each task's latest offload and reload.
struct Copies<W> {
    next: u32,
    /// (sequence number, an offload (else a reload), weight).
    pending: VecDeque<(u32, bool, W)>,
    /// (task, offload) -> sequence number of its latest copy of that direction.
    seq: HashMap<(Task, bool), u32>,
}

impl<W: Amount> Copies<W> {
    fn new() -> Self {
        Copies {
            next: 0,
            pending: VecDeque::new(),
            seq: HashMap::new(),
        }
    }

    fn post(&mut self, t: Task, offload: bool, w: Option<W>) {
        let k = self.next;
        self.next = self.next.wrapping_add(1);
        self.seq.insert((t, offload), k);
        if let Some(w) = w {
            self.pending.push_back((k, offload, w));
        }
    }

    /// Every copy up to sequence number `k` has ended: (device freed, host freed).
    fn sync(&mut self, k: u32) -> (W, W) {
        let (mut device, mut host) = (W::default(), W::default());
        while let Some(&(j, offload, w)) = self.pending.front() {
            if j > k {
                break;
            }
            self.pending.pop_front();
            if offload {
                device = device.plus(w);
            } else {
                host = host.plus(w);
            }
        }
        (device, host)
    }
}

/// Iterator of [`Activations::live`].
pub struct Live<'a, 'p, W, F> {
    walk: &'a mut Activations<'p>,
    instrs: Enumerate<slice::Iter<'p, Instr>>,
    weight: F,
    live: W,
    /// Freed by the previous instruction, taken off before the next one counts.
    frees: W,
    /// Host memory held by offloads, and what the previous instruction released of it.
    host: W,
    host_frees: W,
    /// The copy stream, from the first memory instruction on.
    copies: Option<Copies<W>>,
}

impl<W: Amount, F: Fn(Task) -> (W, W)> Live<'_, '_, W, F> {
    /// Host memory held during the instruction last yielded.
    pub fn host(&self) -> W {
        self.host
    }

    /// A backward of `t` waits for `t`'s reload: every copy up to it has ended.
    fn backward_syncs(&mut self, t: Task) {
        let Some(c) = self.copies.as_mut() else {
            return;
        };
        if let Some(&k) = c.seq.get(&(t, false)) {
            let (d, h) = c.sync(k);
            self.frees = self.frees.plus(d);
            self.host_frees = self.host_frees.plus(h);
        }
    }

    fn memory(&mut self, kind: MemKind, t: Task) {
        let (w, kept) = (self.weight)(t);
        let copies = self.copies.get_or_insert_with(Copies::new);
        match kind {
            MemKind::Offload => {
                // The device copy stays counted until the offload is known to have ended;
                // after `bwd_D` only `act_w` is left to move.
                let held = match self.walk.get(t) {
                    Some(Held::Whole) => Some(w),
                    Some(Held::ForW) => Some(kept),
                    None if !self.walk.tracked() => Some(w),
                    None => None,
                };
                self.host = self.host.plus(held.unwrap_or(w));
                self.walk.set(t, None);
                copies.post(t, true, held);
            }
            MemKind::Reload => {
                self.live = self.live.plus(w);
                self.walk.set(t, Some(Held::Whole));
                copies.post(t, false, Some(w));
            }
            MemKind::WaitOffload => {
                if let Some(&k) = copies.seq.get(&(t, true)) {
                    let (d, h) = copies.sync(k);
                    self.frees = self.frees.plus(d);
                    self.host_frees = self.host_frees.plus(h);
                }
            }
            MemKind::Recompute => {
                self.live = self.live.plus(w);
                self.walk.set(t, Some(Held::Whole));
            }
        }
    }
}

impl<W: Amount, F: Fn(Task) -> (W, W)> Iterator for Live<'_, '_, W, F> {
    type Item = (u32, W);

    fn next(&mut self) -> Option<(u32, W)> {
        let forward_only = self.walk.program.forward_only;
        loop {
            let (i, ins) = self.instrs.next()?;
            match *ins {
                Instr::Compute(ref c) => {
                    self.live = self.live.minus(self.frees);
                    self.host = self.host.minus(self.host_frees);
                    self.host_frees = W::default();
                    let (alloc, frees) = step(c, forward_only, &self.weight, &mut *self.walk);
                    self.live = self.live.plus(alloc);
                    self.frees = frees;
                    if self.copies.is_some() {
                        for (pass, t) in c.parts() {
                            if matches!(pass, Pass::Bwd | Pass::BwdD) {
                                self.backward_syncs(t);
                            }
                        }
                    }
                }
                Instr::FwdCheckpoint(t) => {
                    self.live = self.live.minus(self.frees);
                    self.host = self.host.minus(self.host_frees);
                    self.host_frees = W::default();
                    // Live while it runs, kept by nothing.
                    let w = (self.weight)(t).0;
                    self.live = self.live.plus(w);
                    self.frees = w;
                }
                Instr::Memory(op) => {
                    self.live = self.live.minus(self.frees);
                    self.host = self.host.minus(self.host_frees);
                    self.frees = W::default();
                    self.host_frees = W::default();
                    self.memory(op.kind, op.task);
                }
                Instr::Send { .. } | Instr::Recv { .. } | Instr::Wait { .. } => continue,
            }
            return Some((i as u32, self.live));
        }
    }
}

/// One compute op under the rule of the module doc: what it allocates and what it frees (after
/// it ran), with `weight(task) = (act, act_w)`; `holds` records what this rank holds of each
/// task. Every reader of the rule goes through here: the program walk above and
/// [`order_peak`].
fn step<W: Amount>(
    c: &Compute,
    forward_only: bool,
    weight: &impl Fn(Task) -> (W, W),
    holds: &mut impl Holds,
) -> (W, W) {
    let (mut alloc, mut frees) = (W::default(), W::default());
    for (pass, t) in c.parts() {
        let (w, kept) = weight(t);
        match pass {
            Pass::Fwd => {
                alloc = alloc.plus(w);
                if forward_only {
                    frees = frees.plus(w);
                } else {
                    holds.set(t, Some(Held::Whole));
                }
            }
            _ if forward_only => {}
            Pass::BwdD => match holds.get(t) {
                Some(Held::Whole) => {
                    holds.set(t, Some(Held::ForW));
                    frees = frees.plus(w.minus(kept));
                }
                None if !holds.tracked() => frees = frees.plus(w.minus(kept)),
                _ => {}
            },
            Pass::Bwd | Pass::BwdW => {
                let held = holds.get(t);
                holds.set(t, None);
                let untracked = if pass == Pass::Bwd { w } else { kept };
                match held {
                    Some(Held::Whole) => frees = frees.plus(w),
                    Some(Held::ForW) => frees = frees.plus(kept),
                    None if !holds.tracked() => frees = frees.plus(untracked),
                    None => {}
                }
            }
        }
    }
    (alloc, frees)
}

/// The peak of one rank's compute order (before lowering: `pipec tune` judges its orders with
/// it), under the same rule as a program's walk, each activation counted as `weight(task)`,
/// `(act, act_w)`.
pub fn order_peak<'a, W: Amount>(
    ops: impl IntoIterator<Item = &'a Compute>,
    forward_only: bool,
    weight: impl Fn(Task) -> (W, W),
) -> W {
    let mut held: HashMap<Task, Held> = HashMap::new();
    let (mut live, mut frees, mut peak) = (W::default(), W::default(), W::default());
    for c in ops {
        live = live.minus(frees);
        let (alloc, f) = step(c, forward_only, &weight, &mut held);
        live = live.plus(alloc);
        frees = f;
        if live > peak {
            peak = live;
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_schedules::{Compute, Placement};

    fn program(forward_only: bool, ranks: Vec<Vec<Compute>>) -> Program {
        Program {
            placement: Placement::looped(ranks.len() as u32, 1),
            microbatches: 2,
            forward_only,
            comm: None,
            ranks: ranks
                .into_iter()
                .map(|r| r.into_iter().map(Instr::Compute).collect())
                .collect(),
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    #[test]
    fn a_forward_only_forward_is_live_while_it_runs() {
        let p = program(
            true,
            vec![vec![
                Compute::Fwd(Task::new(0, 0)),
                Compute::Fwd(Task::new(0, 1)),
            ]],
        );
        assert_eq!(
            peaks(&p),
            vec![Peak {
                peak: 1,
                at: Some(0)
            }]
        );
    }

    /// Issue #39, by hand: `act = 2`, `act_w = 1`. `bwd_D` frees 1 after it ran, `bwd_W` the
    /// other 1, a fused `bwd` all 2; a second `bwd_D` frees nothing more. The order peak
    /// agrees.
    #[test]
    fn bwd_d_frees_act_minus_act_w() {
        let (t0, t1) = (Task::new(0, 0), Task::new(0, 1));
        let ops = vec![
            Compute::Fwd(t0),  // 2
            Compute::Fwd(t1),  // 4
            Compute::BwdD(t0), // 4, then 3
            Compute::BwdD(t0), // 3 (nothing more)
            Compute::Bwd(t1),  // 3, then 1
            Compute::BwdW(t0), // 1, then 0
            Compute::Fwd(t1),  // 2
        ];
        let p = program(false, vec![ops.clone()]);
        let w = |_| (2.0f64, 1.0f64);
        let live: Vec<_> = Activations::new(&p).live(0, w).map(|x| x.1).collect();
        assert_eq!(live, vec![2.0, 4.0, 4.0, 3.0, 3.0, 1.0, 2.0]);
        assert_eq!(order_peak(&ops, false, w), 4.0);
        // Without a task table (the fallback): every part frees its share, never below 0.
        let q = program(false, vec![ops[..3].to_vec()]);
        let mut walk = Activations::new(&q);
        walk.dense = false;
        let live: Vec<_> = walk.live(0, w).map(|x| x.1).collect();
        assert_eq!(live, vec![2.0, 4.0, 4.0]);
    }

    #[test]
    fn a_pair_holds_both_and_a_foreign_backward_frees_nothing() {
        let (t0, t1) = (Task::new(0, 0), Task::new(0, 1));
        let p = program(
            false,
            vec![
                vec![Compute::Fwd(t0), Compute::FwdBwd { fwd: t1, bwd: t0 }],
                // Rank 0 still holds (0, 1): a backward of it on rank 1 frees nothing.
                vec![
                    Compute::Fwd(Task::new(1, 0)),
                    Compute::Bwd(t1),
                    Compute::Fwd(Task::new(1, 1)),
                ],
            ],
        );
        let mut walk = Activations::new(&p);
        let live: Vec<_> = walk.live(0, |_| (1u64, 1u64)).collect();
        assert_eq!(live, vec![(0, 1), (1, 2)]);
        let live: Vec<_> = walk.live(1, |_| (1u64, 1u64)).collect();
        assert_eq!(live, vec![(0, 1), (1, 1), (2, 2)]);
    }
}
