//! One pass over the program: range checks, batch segmentation, and the dense tables every
//! later check reads. Nothing here indexes with an id before checking its range, so a program
//! read from a file cannot make the verifier panic.

use super::violation::{Field, Part, Site, Stats, Violation};
use crate::ir::{steps, Step};
use crate::ir::{Instr, InstrRef, OptIdx, Payload, PayloadKind, Positions, Program};
use pipec_schedules::{Microbatch, Pass, Rank, StageId, Task};
use std::collections::HashMap;

/// Table slot of a pass.
#[inline]
pub(crate) fn slot(p: Pass) -> usize {
    match p {
        Pass::Fwd => 0,
        Pass::Bwd => 1,
        Pass::BwdD => 2,
        Pass::BwdW => 3,
    }
}

/// Dense tables over global instruction positions (ranks concatenated in order), tasks
/// (`stage * M + mb`) and payloads (`kind * tasks + task`).
pub(crate) struct Index<'p> {
    pub p: &'p Program,
    pub world: u32,
    pub stages: u32,
    pub mbs: u32,
    /// Global instruction ids.
    pub pos: Positions,
    /// Whether the per-task tables below exist (see [`Index::build`]).
    pub dense: bool,
    pub tasks: usize,
    /// Per pass slot: first position of each task's pass (meaningful where its count is not
    /// zero), and how often it runs (saturating).
    pub first: [Vec<u32>; 4],
    pub count: [Vec<u8>; 4],
    /// Per payload: first position of a receive of it (meaningful where its count is not
    /// zero), and how many receives there are.
    pub recv_first: Vec<u32>,
    pub recv_count: Vec<u8>,
    /// Every receive position of payloads received more than once.
    pub multi_recv: HashMap<u32, Vec<u32>>,
    /// Per position: the comm batch of a send/recv; none for compute and waits.
    pub node_of: Vec<OptIdx>,
    /// Per batch: first position, length, rank. Batches are numbered rank-major in order, so
    /// the batch before `b` on its rank is `b - 1` when `batch_rank[b - 1] == batch_rank[b]`.
    pub batch_start: Vec<u32>,
    pub batch_len: Vec<u32>,
    pub batch_rank: Vec<u32>,
    /// Per rank: its first node; `world + 1` entries, the last the node count.
    pub rank_nodes: Vec<u32>,
    /// Per node: for a `Wait` node (length 0, at the wait), the batch node it waits for;
    /// none for batches.
    pub wait_of: Vec<OptIdx>,
    /// Per node: a batch left in flight (some later `Wait` names it).
    pub in_flight: Vec<bool>,
    /// Per node: the nearest earlier node on its rank at which the rank blocks (a blocking
    /// batch or a wait): it must complete before this node is reached.
    pub block_pred: Vec<OptIdx>,
    /// Per node: the position of the first `Wait` naming it, if any.
    pub first_wait: Vec<OptIdx>,
    pub stats: Stats,
    pub compute_parts: u64,
    /// Memory instructions and checkpointed forwards (`offload.rs` checks them; none in
    /// a program without them, which then costs nothing more).
    pub memory_ops: u64,
}

impl<'p> Index<'p> {
    /// Scan the program once. Returns `None` (with a violation pushed) only when the program is
    /// too large to number with u32 positions.
    pub fn build(p: &'p Program, out: &mut Vec<Violation>) -> Option<Index<'p>> {
        let world = p.ranks.len() as u32;
        let pos = match Positions::new(p) {
            Ok(pos) => pos,
            Err(e) => {
                out.push(Violation::TooLarge {
                    instructions: e.instructions,
                });
                return None;
            }
        };
        let total = pos.total() as u64;
        if p.placement.pp != world {
            out.push(Violation::WorldMismatch {
                pp: p.placement.pp,
                ranks: world,
            });
        }
        for (s, r) in p.placement.table().iter().enumerate() {
            if r.0 >= world {
                out.push(Violation::PlacementOutOfRange {
                    stage: StageId(s as u32),
                    rank: *r,
                    world,
                });
            }
        }
        let stages = p.placement.num_stages();
        let mbs = p.microbatches;
        let tasks = stages as u64 * mbs as u64;
        // Dense per-task tables cost a few bytes per task; without them the program is
        // reported as missing work (TooFewOps) once.
        let dense = p.task_tables_fit();
        let tasks = if dense { tasks as usize } else { 0 };
        let mut ix = Index {
            p,
            world,
            stages,
            mbs,
            pos,
            dense,
            tasks,
            first: std::array::from_fn(|_| vec![0; tasks]),
            count: std::array::from_fn(|_| vec![0u8; tasks]),
            recv_first: vec![0; 2 * tasks],
            recv_count: vec![0u8; 2 * tasks],
            multi_recv: HashMap::new(),
            node_of: vec![OptIdx::NONE; total as usize],
            batch_start: Vec::new(),
            batch_len: Vec::new(),
            batch_rank: Vec::new(),
            rank_nodes: Vec::new(),
            wait_of: Vec::new(),
            in_flight: Vec::new(),
            block_pred: Vec::new(),
            first_wait: Vec::new(),
            stats: Stats {
                ranks: world,
                instructions: total,
                ..Stats::default()
            },
            compute_parts: 0,
            memory_ops: 0,
        };
        ix.scan(out);
        if !dense {
            out.push(Violation::TooFewOps {
                tasks: stages as u64 * mbs as u64,
                compute_parts: ix.compute_parts,
            });
        }
        Some(ix)
    }

    fn scan(&mut self, out: &mut Vec<Violation>) {
        let p = self.p;
        let forward_only = p.forward_only;
        for (r, instrs) in p.ranks.iter().enumerate() {
            self.rank_nodes.push(self.batch_start.len() as u32);
            let base = self.pos.base(r);
            let rank = Rank(r as u32);
            // Batch id -> its node on this rank.
            let mut by_id = BatchIds::new(instrs.len());
            // The waits of this rank that named a batch: (position, id).
            let mut waits: Vec<(usize, u32)> = Vec::new();
            // Batches as `ir::steps` cuts them, as every consumer of the program does.
            for step in steps(instrs) {
                match step {
                    Step::Wait { at: i, batch } => {
                        let g = base + i as u32;
                        let ins = &instrs[i];
                        let site = Site {
                            at: InstrRef {
                                rank,
                                index: i as u32,
                            },
                            instr: *ins,
                        };
                        let target = match by_id.get(batch) {
                            BatchId::One(n) => OptIdx::some(n),
                            BatchId::Ambiguous => {
                                out.push(Violation::WaitAmbiguous { site, batch });
                                OptIdx::NONE
                            }
                            BatchId::Unused => {
                                out.push(Violation::WaitWithoutBatch { site, batch });
                                OptIdx::NONE
                            }
                        };
                        if let Some(t) = target.get() {
                            self.in_flight[t as usize] = true;
                            waits.push((i, batch));
                        }
                        self.batch_start.push(g);
                        self.batch_len.push(0);
                        self.batch_rank.push(r as u32);
                        self.wait_of.push(target);
                        self.in_flight.push(false);
                    }
                    Step::Compute(i) => {
                        let g = base + i as u32;
                        let ins = &instrs[i];
                        let Some(c) = ins.as_compute() else {
                            continue;
                        };
                        if let Instr::FwdCheckpoint(_) = ins {
                            self.memory_ops += 1;
                        }
                        self.stats.compute_ops += 1;
                        for (pass, t) in c.parts() {
                            self.compute_parts += 1;
                            let site = || Site {
                                at: InstrRef {
                                    rank,
                                    index: i as u32,
                                },
                                instr: *ins,
                            };
                            if !self.task_in_range(t, site, out) {
                                continue;
                            }
                            let part = Part { pass, task: t };
                            if forward_only && pass != Pass::Fwd {
                                out.push(Violation::BackwardInForwardOnly { site: site(), part });
                                continue;
                            }
                            if let Some(o) = self.owner(t) {
                                if o != rank.0 {
                                    out.push(Violation::WrongRank {
                                        site: site(),
                                        part,
                                        owner: Rank(o),
                                    });
                                }
                            }
                            if self.dense {
                                let ti = self.task_index(t);
                                let k = slot(pass);
                                if self.count[k][ti] == 0 {
                                    self.first[k][ti] = g;
                                } else {
                                    out.push(Violation::Duplicate {
                                        part,
                                        first: self.site(self.first[k][ti]),
                                        again: site(),
                                    });
                                }
                                self.count[k][ti] = self.count[k][ti].saturating_add(1);
                            }
                        }
                    }
                    // Checked by verify::offload, which owns the memory instructions.
                    Step::Memory(_) => self.memory_ops += 1,
                    Step::Batch { id, ops } => {
                        let b = self.batch_start.len();
                        by_id.insert(id, b as u32);
                        self.batch_start.push(base + ops.start as u32);
                        self.batch_len.push(ops.len() as u32);
                        self.batch_rank.push(r as u32);
                        self.wait_of.push(OptIdx::NONE);
                        self.in_flight.push(false);
                        for i in ops {
                            let g = base + i as u32;
                            self.node_of[g as usize] = OptIdx::some(b as u32);
                            let ins = &instrs[i];
                            let (Instr::Send { peer, payload, .. }
                            | Instr::Recv { peer, payload, .. }) = *ins
                            else {
                                continue;
                            };
                            self.message(r, i, g, peer, payload, out);
                        }
                    }
                }
            }
            // A waited id must name one batch of the rank, also counting batches after the
            // wait: a runtime keys its handles by id for the whole stream.
            for (i, batch) in waits {
                if by_id.get(batch) == BatchId::Ambiguous {
                    out.push(Violation::WaitAmbiguous {
                        site: Site {
                            at: InstrRef {
                                rank,
                                index: i as u32,
                            },
                            instr: instrs[i],
                        },
                        batch,
                    });
                }
            }
        }
        self.rank_nodes.push(self.batch_start.len() as u32);
        self.stats.batches = self.batch_len.iter().filter(|&&n| n > 0).count() as u64;
        self.link_waits();
    }

    /// S1-S2 of one send or receive (`i` on rank `r`, global id `g`), and its receive counted.
    #[inline]
    fn message(
        &mut self,
        r: usize,
        i: usize,
        g: u32,
        peer: Rank,
        payload: crate::ir::Payload,
        out: &mut Vec<Violation>,
    ) {
        let p = self.p;
        let ins = &p.ranks[r][i];
        let is_recv = matches!(ins, Instr::Recv { .. });
        if is_recv {
            self.stats.recvs += 1;
        } else {
            self.stats.sends += 1;
        }
        let rank = Rank(r as u32);
        let site = || Site {
            at: InstrRef {
                rank,
                index: i as u32,
            },
            instr: *ins,
        };
        if peer.0 >= self.world {
            out.push(Violation::OutOfRange {
                site: site(),
                field: Field::Peer,
                value: peer.0,
                bound: self.world,
            });
        }
        let t = Task {
            stage: payload.stage,
            mb: payload.mb,
        };
        if !self.task_in_range(t, site, out) || !is_recv || !self.dense || payload.kind.is_shape() {
            return;
        }
        let pi = self.payload_index(payload);
        match self.recv_count[pi] {
            0 => self.recv_first[pi] = g,
            1 => {
                self.multi_recv
                    .insert(pi as u32, vec![self.recv_first[pi], g]);
            }
            _ => {
                if let Some(v) = self.multi_recv.get_mut(&(pi as u32)) {
                    v.push(g);
                }
            }
        }
        // Saturate below 255 so "more than one" stays on the multi path.
        self.recv_count[pi] = self.recv_count[pi].saturating_add(1).min(2);
    }

    /// `block_pred` of every node, and the first wait of each batch left in flight.
    fn link_waits(&mut self) {
        let n = self.batch_start.len();
        self.block_pred = vec![OptIdx::NONE; n];
        self.first_wait = vec![OptIdx::NONE; n];
        let mut last = OptIdx::NONE;
        for b in 0..n {
            if b > 0 && self.batch_rank[b - 1] != self.batch_rank[b] {
                last = OptIdx::NONE;
            }
            self.block_pred[b] = last;
            if let Some(w) = self.wait_of[b].get() {
                if self.first_wait[w as usize].is_none() {
                    self.first_wait[w as usize] = OptIdx::some(self.batch_start[b]);
                }
            }
            if !self.in_flight[b] {
                last = OptIdx::some(b as u32);
            }
        }
    }

    /// Where the tensor of the receive at `g` is ready to use: the receive itself, or the first
    /// `Wait` of its in-flight batch (none when that batch is never waited).
    #[inline]
    pub fn ready(&self, g: u32) -> OptIdx {
        match self.node_of[g as usize].get() {
            Some(b) if self.in_flight[b as usize] => self.first_wait[b as usize],
            _ => OptIdx::some(g),
        }
    }

    /// Range-check a (stage, mb) pair, reporting each field out of range.
    fn task_in_range(&self, t: Task, site: impl Fn() -> Site, out: &mut Vec<Violation>) -> bool {
        let mut ok = true;
        if t.stage.0 >= self.stages {
            out.push(Violation::OutOfRange {
                site: site(),
                field: Field::Stage,
                value: t.stage.0,
                bound: self.stages,
            });
            ok = false;
        }
        if t.mb.0 >= self.mbs {
            out.push(Violation::OutOfRange {
                site: site(),
                field: Field::Microbatch,
                value: t.mb.0,
                bound: self.mbs,
            });
            ok = false;
        }
        ok
    }

    /// Whether a task's ids are in range (no report).
    #[inline]
    pub fn in_range(&self, t: Task) -> bool {
        t.stage.0 < self.stages && t.mb.0 < self.mbs
    }

    /// The rank that owns an in-range task, `None` when the placement names a rank the
    /// program does not have (reported once per stage).
    #[inline]
    pub fn owner(&self, t: Task) -> Option<u32> {
        let r = self.p.placement.rank_of(t).0;
        (r < self.world).then_some(r)
    }

    /// The task that consumes a payload, `None` when it would fall off either end.
    pub fn consumer(&self, p: Payload) -> Option<Task> {
        let s = match p.kind {
            PayloadKind::Act | PayloadKind::ActShape => {
                p.stage.0.checked_add(1).filter(|&c| c < self.stages)?
            }
            PayloadKind::Grad | PayloadKind::GradShape => p.stage.0.checked_sub(1)?,
        };
        Some(Task {
            stage: StageId(s),
            mb: p.mb,
        })
    }

    #[inline]
    pub fn task_index(&self, t: Task) -> usize {
        t.stage.index() * self.mbs as usize + t.mb.index()
    }

    /// The index of a tensor's receive tables. Shape messages are not indexed (no compute
    /// reads one); they map onto their tensor's slot for callers that never file them.
    #[inline]
    pub fn payload_index(&self, p: Payload) -> usize {
        let k = match p.kind {
            PayloadKind::Act | PayloadKind::ActShape => 0,
            PayloadKind::Grad | PayloadKind::GradShape => 1,
        };
        k * self.tasks
            + self.task_index(Task {
                stage: p.stage,
                mb: p.mb,
            })
    }

    pub fn task_of(&self, ti: usize) -> Task {
        let m = self.mbs as usize;
        Task {
            stage: StageId((ti / m) as u32),
            mb: Microbatch((ti % m) as u32),
        }
    }

    /// Whether global position `g` is on rank `r`.
    #[inline]
    pub fn on_rank(&self, g: u32, r: u32) -> bool {
        self.pos.on_rank(g, r)
    }

    pub fn instr_ref(&self, g: u32) -> InstrRef {
        self.pos.local(g)
    }

    pub fn site(&self, g: u32) -> Site {
        let at = self.instr_ref(g);
        Site {
            at,
            instr: self.p.ranks[at.rank.index()][at.index as usize],
        }
    }

    /// The node that must complete before `b` is reached: the nearest earlier blocking batch
    /// or wait on the same rank (batches left in flight do not hold the rank).
    #[inline]
    pub fn pred(&self, b: u32) -> Option<u32> {
        self.block_pred[b as usize].get()
    }
}

/// What a batch id names on one rank.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum BatchId {
    /// No batch so far.
    Unused,
    /// One batch: its node.
    One(u32),
    /// Two separate batches (a wait naming it would be ambiguous).
    Ambiguous,
}

/// Batch id -> [`BatchId`] on one rank, dense while ids stay small (they count up from 0 in
/// every file pipec writes), a map for files with sparse ids.
struct BatchIds {
    dense: Vec<BatchId>,
    sparse: HashMap<u32, BatchId>,
    limit: usize,
}

impl BatchIds {
    fn new(instructions: usize) -> Self {
        BatchIds {
            dense: Vec::new(),
            sparse: HashMap::new(),
            limit: 2 * instructions + 16,
        }
    }

    fn get(&self, id: u32) -> BatchId {
        match self.dense.get(id as usize) {
            Some(&b) => b,
            None => self.sparse.get(&id).copied().unwrap_or(BatchId::Unused),
        }
    }

    /// Record that batch `id` starts node `node` (a second batch with the id makes it
    /// ambiguous).
    fn insert(&mut self, id: u32, node: u32) {
        let next = |b: BatchId| match b {
            BatchId::Unused => BatchId::One(node),
            BatchId::One(_) | BatchId::Ambiguous => BatchId::Ambiguous,
        };
        let i = id as usize;
        if i < self.limit {
            if i >= self.dense.len() {
                self.dense.resize(i + 1, BatchId::Unused);
            }
            self.dense[i] = next(self.dense[i]);
        } else {
            let e = self.sparse.entry(id).or_insert(BatchId::Unused);
            *e = next(*e);
        }
    }
}
