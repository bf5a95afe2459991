//! Event-driven simulation of a program's instruction streams under a [`StageCosts`] model.
//!
//! Each rank runs its stream in order. A compute op starts when the rank is free and takes its
//! cost. A comm batch (consecutive sends/recvs with one batch id) is posted when the rank
//! reaches it and completes, as a whole, when its last message completes (one NCCL group).
//! Messages are matched first-in first-out per ordered pair of ranks, as NCCL does. A message
//! takes `transfer = p2p + msg / bw`:
//! - rendezvous (default, NCCL's strictest behaviour): send and recv both complete at
//!   `max(post_send, post_recv) + transfer`;
//! - eager: the send completes when posted, the recv at `max(post_recv, post_send + transfer)`.
//!
//! Memory instructions (issue 30, docs/format.md "Memory instructions"): each rank has a copy
//! stream running its `offload`s and `reload`s in program order, each starting when the stream
//! is free and the rank has reached it (an offload not before its forward ends) and taking
//! [`StageCosts::copy`]; a `bwd`/`bwd_D` of reloaded activations starts once the reload ended,
//! `wait_offload` waits for its offload, `recompute` and a checkpointed forward take the
//! stage's forward time. A copy waits only for its own rank, so its end is known when it is
//! posted. With host links shared by rank pairs (`offload_pair`), every copy is given the time
//! it takes while the partner copies too (`K.offload / PAIRED_RATE`): an upper bound, since a
//! copy whose partner is idle takes `K.offload`; the partner's idle time is not modelled.
//!
//! The simulation is a dataflow computation, not a time-ordered one: each rank advances until
//! it blocks in a batch whose peers have not posted yet; the last peer to post wakes it. Every
//! instruction and message is handled once (dense `Vec`s and a stack of ready ranks), so the
//! cost is linear in the instruction count. When no rank can advance and some have not
//! finished, the schedule deadlocks, and [`Deadlock`] says which ranks wait at which batch for
//! what.

/// The rate of a copy on a host link its rank pair shares while the partner copies too, as a
/// share of a lone copy's: PipeOffload measured a lone transfer at 0.7 of the time of two at
/// once (Wan et al., ICML 2025), so each of two runs at 0.7 of its lone rate.
pub const PAIRED_RATE: f64 = 0.7;

use crate::cost::StageCosts;
use crate::lengths::Scale;
use crate::timeline::{Span, TimeUnit, Timeline};
use pipec_ir::ir::activations::{Activations, Peak};
use pipec_ir::ir::{batch_end, Instr, InstrRef, Matching, MemKind, MemOp, OptIdx, Program};
use pipec_schedules::{Pass, Rank, Task};
use serde::Serialize;
use std::fmt;
use thiserror::Error;

/// What every output means by "bubble": one definition, named wherever a figure is printed,
/// because papers also use a rank's own first-to-last span, which gives other numbers.
pub const BUBBLE: &str = "idle share of the makespan, per rank (1 - busy / makespan)";

/// One rank's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RankSummary {
    pub rank: u32,
    /// Time spent in compute ops.
    pub busy: f64,
    /// Idle share of the makespan: `1 - busy / makespan` (0 for an empty schedule).
    pub bubble_ratio: f64,
    /// Most activations alive at once, weighted per stage ([`pipec_ir::memory`], the verifier's
    /// rule), over the instructions that have a span, in the summary's `memory_unit`.
    #[serde(serialize_with = "pipec_ir::memory::figure")]
    pub peak_activations: f64,
    /// Parameters of the stages the rank holds.
    #[serde(serialize_with = "pipec_ir::memory::figure")]
    pub params: f64,
    /// `params + peak_activations`: the rank's peak memory.
    #[serde(serialize_with = "pipec_ir::memory::figure")]
    pub peak_memory: f64,
    /// When the peak is first reached (the start of the instruction that reaches it).
    pub peak_at: f64,
}

/// Makespan and per-rank figures of a timeline.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub makespan: f64,
    pub ranks: Vec<RankSummary>,
    /// What the memory figures count.
    pub memory_unit: pipec_ir::memory::Unit,
}

impl Summary {
    /// Mean bubble ratio over ranks.
    pub fn mean_bubble(&self) -> f64 {
        if self.ranks.is_empty() {
            return 0.0;
        }
        self.ranks.iter().map(|r| r.bubble_ratio).sum::<f64>() / self.ranks.len() as f64
    }

    pub fn max_bubble(&self) -> f64 {
        self.ranks
            .iter()
            .map(|r| r.bubble_ratio)
            .fold(0.0, f64::max)
    }

    /// The worst rank's peak live activations.
    pub fn peak_activations(&self) -> f64 {
        self.ranks
            .iter()
            .map(|r| r.peak_activations)
            .fold(0.0, f64::max)
    }

    /// The worst rank's peak memory (parameters + live activations).
    pub fn peak_memory(&self) -> f64 {
        self.ranks.iter().map(|r| r.peak_memory).fold(0.0, f64::max)
    }
}

/// Figures of any timeline of `program`, simulated or measured: the makespan is the span from
/// the earliest start to the latest end. Missing spans count as not run. Memory is counted
/// one layer-activation per stage ([`pipec_ir::memory::MemoryModel::units`]).
pub fn summarize(program: &Program, timeline: &Timeline) -> Summary {
    summarize_with(
        program,
        timeline,
        &pipec_ir::memory::MemoryModel::units(program),
    )
}

/// [`summarize`] with memory counted under `mem`.
pub fn summarize_with(
    program: &Program,
    timeline: &Timeline,
    mem: &pipec_ir::memory::MemoryModel,
) -> Summary {
    let t0 = timeline
        .ranks
        .iter()
        .flatten()
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let makespan = (timeline.makespan() - t0).max(0.0);
    let mut walk = Activations::new(program);
    let ranks = program
        .ranks
        .iter()
        .enumerate()
        .map(|(r, instrs)| {
            let spans: &[Span] = timeline.ranks.get(r).map_or(&[], |v| v.as_slice());
            let mut busy = 0.0;
            for (ins, span) in instrs.iter().zip(spans) {
                let recompute = matches!(ins, Instr::Memory(m) if m.kind == MemKind::Recompute);
                if ins.as_compute().is_some() || recompute {
                    busy += span.end - span.start;
                }
            }
            let ran = |&(i, _): &(u32, f64)| (i as usize) < spans.len();
            let m = program.microbatches;
            let weight = |t: pipec_schedules::Task| mem.weights(t, m);
            let peak = Peak::of(walk.live(r, weight).take_while(ran));
            let params = mem.param.get(r).copied().unwrap_or(0.0);
            let peak_at = peak.at.map_or(0.0, |i| spans[i as usize].start - t0);
            let bubble_ratio = if makespan > 0.0 {
                (1.0 - busy / makespan).clamp(0.0, 1.0)
            } else {
                0.0
            };
            RankSummary {
                rank: r as u32,
                busy,
                bubble_ratio,
                peak_activations: peak.peak,
                params,
                peak_memory: params + peak.peak,
                peak_at,
            }
        })
        .collect();
    Summary {
        makespan,
        ranks,
        memory_unit: mem.unit,
    }
}

/// A finished simulation.
#[derive(Clone, Debug, PartialEq)]
pub struct Simulation {
    pub timeline: Timeline,
    pub summary: Summary,
}

/// Why a program could not be simulated.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum SimError {
    #[error("{at}: {instr} names stage {stage}, but the program has {num_stages} stages")]
    StageOutOfRange {
        at: InstrRef,
        instr: Instr,
        stage: u32,
        num_stages: u32,
    },
    #[error("{at}: {instr} names rank {peer}, but the world has {world} ranks")]
    PeerOutOfRange {
        at: InstrRef,
        instr: Instr,
        peer: u32,
        world: u32,
    },
    #[error("{0}")]
    Deadlock(Deadlock),
    #[error("the program has {instructions} instructions, more than one simulation can number")]
    TooLarge { instructions: u64 },
}

/// No rank can advance, and these have not finished.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Deadlock {
    pub stuck: Vec<Stuck>,
    /// Simulated time at which the last rank stopped.
    pub at_time: f64,
}

/// One stuck rank: the batch it waits in and the messages of that batch still open.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stuck {
    /// The first instruction of the batch.
    pub at: InstrRef,
    /// Posted at this time.
    pub since: f64,
    pub waiting: Vec<Waiting>,
}

/// An open message: the op, and the op that would complete it (if any) with where its rank
/// stands.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Waiting {
    pub op: InstrRef,
    #[serde(serialize_with = "display")]
    pub instr: Instr,
    /// The matching op on the peer, `None` when nothing matches it.
    pub partner: Option<InstrRef>,
    /// Where the peer rank is: the instruction it is stuck at, `None` when it finished.
    pub peer_at: Option<InstrRef>,
}

fn display<S: serde::Serializer>(i: &Instr, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(i)
}

impl fmt::Display for Deadlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "deadlock: {} rank{} cannot advance",
            self.stuck.len(),
            if self.stuck.len() == 1 { "" } else { "s" }
        )?;
        for s in &self.stuck {
            write!(f, "\n  {} waits in a comm batch:", s.at)?;
            for w in &s.waiting {
                write!(f, "\n    {} ({})", w.instr, w.op)?;
                match (w.partner, w.peer_at) {
                    (None, _) => write!(f, " has no matching op on its peer")?,
                    (Some(p), Some(at)) => {
                        write!(f, " needs {p}, but {} is stuck at #{}", at.rank, at.index)?
                    }
                    (Some(p), None) => write!(f, " needs {p}, which is never reached")?,
                }
            }
        }
        Ok(())
    }
}

/// Simulate a verified `program` under `costs`, with the verifier's matching.
pub fn simulate<P: std::borrow::Borrow<Program>>(
    program: &pipec_ir::verify::Verified<P>,
    costs: &StageCosts,
) -> Result<Simulation, SimError> {
    simulate_program(program.program(), costs, Some(program.matching()))
}

/// [`simulate`] a program nobody verified (a view of loaded or imported files, a tuner's
/// candidate before its verdict): a deadlock or a bad id is an error, not a panic.
pub fn simulate_unverified<P: std::borrow::Borrow<Program>>(
    program: &pipec_ir::verify::Unverified<P>,
    costs: &StageCosts,
) -> Result<Simulation, SimError> {
    simulate_program(program.program(), costs, None)
}

fn simulate_program(
    program: &Program,
    costs: &StageCosts,
    matching: Option<&Matching>,
) -> Result<Simulation, SimError> {
    check_ids(program, costs)?;
    let owned;
    let matching = match matching {
        Some(m) => m,
        None => match Matching::of(program) {
            Some(m) => {
                owned = m;
                &owned
            }
            None => {
                return Err(SimError::TooLarge {
                    instructions: program.len() as u64,
                })
            }
        },
    };
    let mut sim = Sim::new(program, costs, matching, true);
    sim.run();
    if let Some(d) = sim.deadlock() {
        return Err(SimError::Deadlock(d));
    }
    let timeline = sim.timeline();
    let mut param = crate::memory::rank_params(&program.placement, &costs.param);
    param.resize(program.world() as usize, 0.0);
    let mem = pipec_ir::memory::MemoryModel {
        act: costs.act.clone(),
        param,
        unit: crate::memory::unit_of(&costs.model),
        mb_scale: sim.scale.take().map(|s| s.lin),
        msg: Some(crate::memory::message_size(&costs.model)),
        act_w: costs.act_w.clone(),
    };
    let summary = summarize_with(program, &timeline, &mem);
    Ok(Simulation { timeline, summary })
}

/// The makespan and the per-rank busy time of [`simulate`]'s summary, bit for bit, without
/// the timeline, the start times or the memory walk: what a search that weighs many programs
/// needs of each (`pipec tune` simulates the winner in full afterwards).
#[derive(Clone, Debug, PartialEq)]
pub struct Figures {
    pub makespan: f64,
    pub busy: Vec<f64>,
}

impl Figures {
    /// [`Summary::mean_bubble`] of the same simulation.
    pub fn mean_bubble(&self) -> f64 {
        if self.busy.is_empty() {
            return 0.0;
        }
        self.busy
            .iter()
            .map(|&busy| {
                if self.makespan > 0.0 {
                    (1.0 - busy / self.makespan).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            })
            .sum::<f64>()
            / self.busy.len() as f64
    }
}

/// [`simulate_unverified`]'s makespan and busy times only ([`Figures`]): what the tuner weighs
/// its candidates by, before any is verified.
pub fn figures<P: std::borrow::Borrow<Program>>(
    program: &pipec_ir::verify::Unverified<P>,
    costs: &StageCosts,
) -> Result<Figures, SimError> {
    let program = program.program();
    check_ids(program, costs)?;
    let Some(matching) = Matching::of(program) else {
        return Err(SimError::TooLarge {
            instructions: program.len() as u64,
        });
    };
    let mut sim = Sim::new(program, costs, &matching, false);
    sim.run();
    if let Some(d) = sim.deadlock() {
        return Err(SimError::Deadlock(d));
    }
    // As `summarize_with`: from the earliest start to the latest end.
    let t0 = if sim.min_start.is_finite() {
        sim.min_start
    } else {
        0.0
    };
    Ok(Figures {
        makespan: (sim.max_end - t0).max(0.0),
        busy: sim.busy,
    })
}

fn check_ids(program: &Program, costs: &StageCosts) -> Result<(), SimError> {
    let world = program.ranks.len() as u32;
    let n = costs.num_stages();
    for (r, instrs) in program.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            let at = InstrRef {
                rank: Rank(r as u32),
                index: i as u32,
            };
            match ins {
                Instr::Compute(op) => {
                    if let Some((_, t)) = op.parts().find(|(_, t)| t.stage.0 >= n) {
                        return Err(SimError::StageOutOfRange {
                            at,
                            instr: *ins,
                            stage: t.stage.0,
                            num_stages: n,
                        });
                    }
                }
                Instr::Wait { .. } => {}
                Instr::FwdCheckpoint(t) | Instr::Memory(MemOp { task: t, .. }) => {
                    if t.stage.0 >= n {
                        return Err(SimError::StageOutOfRange {
                            at,
                            instr: *ins,
                            stage: t.stage.0,
                            num_stages: n,
                        });
                    }
                }
                Instr::Send { peer, .. } | Instr::Recv { peer, .. } => {
                    if peer.0 >= world {
                        return Err(SimError::PeerOutOfRange {
                            at,
                            instr: *ins,
                            peer: peer.0,
                            world,
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

struct Sim<'a> {
    program: &'a Program,
    costs: &'a StageCosts,
    m: &'a Matching,
    transfer: f64,
    /// With lengths (issue #38): each microbatch's scale, and its messages' time
    /// (`p2p + msg lin / bw`), computed once.
    scale: Option<Scale>,
    mb_transfer: Vec<f64>,
    rendezvous: bool,
    /// Per global instruction: start (empty when only the figures are wanted) and end.
    start: Vec<f64>,
    /// The earliest start and the latest end, kept when `start` and `end` are not (every
    /// instruction's start and end are set once).
    min_start: f64,
    max_end: f64,
    /// Per rank: time in compute ops.
    busy: Vec<f64>,
    end: Vec<f64>,
    /// Per global comm op: posted (NaN until then).
    posted: Vec<f64>,
    /// Per global comm op: resolved (its message completed).
    resolved: Vec<bool>,
    /// Per rank: next instruction, clock, open messages of the posted batch, latest completion
    /// in it, the end of the posted batch (exclusive), or 0 when none is posted.
    pc: Vec<usize>,
    clock: Vec<f64>,
    pending: Vec<u32>,
    batch_max: Vec<f64>,
    batch_end: Vec<usize>,
    ready: Vec<usize>,
    /// The rank posting a batch right now, `usize::MAX` when none.
    posting: usize,
    /// Batches left in flight (named by a later `Wait`): per rank, batch id -> slot; per
    /// global op, its slot; per slot, open ops, latest completion and op range.
    flight_ids: Vec<BatchMap>,
    flight_of: Vec<OptIdx>,
    flight: Vec<Flight>,
    /// Per rank: the slot its current `Wait` blocks on, `usize::MAX` when none.
    waiting_on: Vec<usize>,
    /// Per rank: its copy stream (docs/format.md, "Memory instructions").
    copies: Vec<CopyStream>,
}

/// One rank's copy stream: offloads and reloads in program order, each starting when the
/// stream is free and the rank has reached it (an offload also once its forward has ended).
/// Without a shared link a copy's end is known when it is posted: it waits only for earlier
/// work of its own rank.
#[derive(Default)]
struct CopyStream {
    /// The rank has memory instructions (else none of this is looked at).
    any: bool,
    free: f64,
    fwd_end: std::collections::HashMap<Task, f64>,
    offload_end: std::collections::HashMap<Task, f64>,
    reload_end: std::collections::HashMap<Task, f64>,
}

/// Batch id -> in-flight slot, looked up at every batch and wait: hashed by one multiply
/// (batch ids are small integers the program chose; SipHash's resistance buys nothing here).
type BatchMap = std::collections::HashMap<u32, usize, std::hash::BuildHasherDefault<MulHasher>>;

#[derive(Default)]
struct MulHasher(u64);

impl std::hash::Hasher for MulHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, x: u32) {
        self.0 = (u64::from(x) ^ self.0).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// One batch left in flight.
struct Flight {
    open: u32,
    done: f64,
    ops: std::ops::Range<usize>,
}

impl<'a> Sim<'a> {
    fn new(program: &'a Program, costs: &'a StageCosts, m: &'a Matching, times: bool) -> Self {
        let total = m.positions().total() as usize;
        let world = program.ranks.len();
        let scale = Scale::of_program(&costs.model, program);
        let mb_transfer = scale.as_ref().map_or(Vec::new(), |s| {
            let c = &costs.model;
            s.lin
                .iter()
                .map(|&lin| {
                    if c.bw.is_infinite() {
                        c.p2p
                    } else {
                        c.p2p + c.msg * lin / c.bw
                    }
                })
                .collect()
        });
        Sim {
            program,
            costs,
            m,
            transfer: costs.transfer(),
            scale,
            mb_transfer,
            rendezvous: costs.model.rendezvous,
            start: if times {
                vec![f64::NAN; total]
            } else {
                Vec::new()
            },
            min_start: f64::INFINITY,
            max_end: 0.0,
            busy: vec![0.0; world],
            end: if times {
                vec![f64::NAN; total]
            } else {
                Vec::new()
            },
            posted: vec![f64::NAN; total],
            resolved: vec![false; total],
            pc: vec![0; world],
            clock: vec![0.0; world],
            pending: vec![0; world],
            batch_max: vec![0.0; world],
            batch_end: vec![0; world],
            ready: (0..world).rev().collect(),
            posting: usize::MAX,
            flight_ids: program
                .ranks
                .iter()
                .map(|instrs| {
                    instrs
                        .iter()
                        .filter_map(|i| match i {
                            Instr::Wait { batch } => Some((*batch, usize::MAX)),
                            _ => None,
                        })
                        .collect()
                })
                .collect(),
            flight_of: vec![OptIdx::NONE; total],
            flight: Vec::new(),
            waiting_on: vec![usize::MAX; world],
            copies: program
                .ranks
                .iter()
                .map(|instrs| CopyStream {
                    any: instrs.iter().any(|i| matches!(i, Instr::Memory(_))),
                    ..CopyStream::default()
                })
                .collect(),
        }
    }

    /// Memory instruction `g` (`op`) of rank `r`, reached at `clock`: its span, and the
    /// rank's clock after it. A copy runs on the copy stream and leaves the clock as it is;
    /// `wait_offload` waits for its offload's end; `recompute` takes the stage's forward.
    fn memory(&mut self, r: usize, g: usize, op: MemOp, clock: f64) -> f64 {
        let t = op.task;
        let c = &mut self.copies[r];
        match op.kind {
            MemKind::Offload | MemKind::Reload => {
                let lin = self.scale.as_ref().map_or(1.0, |s| s.lin(t.mb.0));
                let d = self.costs.copy(t.stage).unwrap_or(0.0) * lin
                    / if self.costs.model.offload_pair {
                        PAIRED_RATE
                    } else {
                        1.0
                    };
                let mut start = clock.max(c.free);
                if op.kind == MemKind::Offload {
                    start = start.max(c.fwd_end.get(&t).copied().unwrap_or(clock));
                }
                let end = start + d;
                c.free = end;
                if op.kind == MemKind::Offload {
                    c.offload_end.insert(t, end);
                } else {
                    c.reload_end.insert(t, end);
                }
                self.set_start(g, start);
                self.set_end(g, end);
                clock
            }
            MemKind::WaitOffload => {
                let end = clock.max(c.offload_end.get(&t).copied().unwrap_or(clock));
                self.set_start(g, clock);
                self.set_end(g, end);
                end
            }
            MemKind::Recompute => {
                let d = self.fwd_of(t) * self.costs.rank_factor(r);
                self.set_start(g, clock);
                self.set_end(g, clock + d);
                clock + d
            }
        }
    }

    /// The forward of task `t` (a recompute, a checkpointed forward), for its microbatch.
    fn fwd_of(&self, t: Task) -> f64 {
        match &self.scale {
            None => self.costs.pass(Pass::Fwd, t.stage),
            Some(s) => {
                let (lin, quad) = s.factors(t.mb.0);
                self.costs.pass_scaled(Pass::Fwd, t.stage, lin, quad)
            }
        }
        .unwrap_or(0.0)
    }

    /// The time of message `ins` (a send or a recv): its microbatch's with lengths; a shape
    /// message (Megatron's handshake, three integers) only the latency `p2p`.
    #[inline]
    fn transfer_of(&self, ins: &Instr) -> f64 {
        if let Instr::Send { payload, .. } | Instr::Recv { payload, .. } = ins {
            if payload.kind.is_shape() {
                return self.costs.model.p2p;
            }
        }
        if self.mb_transfer.is_empty() {
            return self.transfer;
        }
        match ins {
            Instr::Send { payload, .. } | Instr::Recv { payload, .. } => self
                .mb_transfer
                .get(payload.mb.index())
                .copied()
                .unwrap_or(self.transfer),
            _ => self.transfer,
        }
    }

    #[inline]
    fn set_start(&mut self, g: usize, t: f64) {
        if let Some(x) = self.start.get_mut(g) {
            *x = t;
        } else {
            self.min_start = self.min_start.min(t);
        }
    }

    #[inline]
    fn set_end(&mut self, g: usize, t: f64) {
        if let Some(x) = self.end.get_mut(g) {
            *x = t;
        } else {
            self.max_end = self.max_end.max(t);
        }
    }

    fn rank_of(&self, g: usize) -> usize {
        self.m.positions().rank_of(g as u32) as usize
    }

    /// Mark message op `g` (on rank `r`) complete at `t`. The last open message of a batch
    /// wakes its rank, unless that rank is the one posting right now (it checks for itself).
    fn resolve(&mut self, g: usize, r: usize, t: f64) {
        self.resolved[g] = true;
        if let Some(slot) = self.flight_of[g].get() {
            self.set_end(g, t);
            let f = &mut self.flight[slot as usize];
            f.open -= 1;
            f.done = f.done.max(t);
            if f.open == 0 && self.waiting_on[r] == slot as usize {
                self.ready.push(r);
            }
            return;
        }
        self.batch_max[r] = self.batch_max[r].max(t);
        self.pending[r] -= 1;
        if self.pending[r] == 0 && r != self.posting {
            self.ready.push(r);
        }
    }

    fn run(&mut self) {
        while let Some(r) = self.ready.pop() {
            self.advance(r);
        }
    }

    /// Run rank `r` until it blocks or finishes.
    fn advance(&mut self, r: usize) {
        let program = self.program;
        let instrs = &program.ranks[r];
        let base = self.m.positions().base(r) as usize;
        // A batch that was blocked and is now complete (or a spurious wake: still open).
        if self.batch_end[r] != 0 {
            if self.pending[r] != 0 {
                return;
            }
            let end = self.batch_max[r];
            for g in base + self.pc[r]..base + self.batch_end[r] {
                self.set_end(g, end);
            }
            self.clock[r] = end;
            self.pc[r] = self.batch_end[r];
            self.batch_end[r] = 0;
        }
        // A wait whose batch has now completed.
        let w = self.waiting_on[r];
        if w != usize::MAX {
            if self.flight[w].open != 0 {
                return;
            }
            let g = base + self.pc[r];
            self.clock[r] = self.clock[r].max(self.flight[w].done);
            self.set_end(g, self.clock[r]);
            self.pc[r] += 1;
            self.waiting_on[r] = usize::MAX;
        }
        let mut pc = self.pc[r];
        let mut clock = self.clock[r];
        while pc < instrs.len() {
            let g = base + pc;
            match &instrs[pc] {
                Instr::Wait { batch } => {
                    self.set_start(g, clock);
                    match self.flight_ids[r].get(batch).copied() {
                        Some(slot) if slot != usize::MAX && self.flight[slot].open != 0 => {
                            self.pc[r] = pc;
                            self.clock[r] = clock;
                            self.waiting_on[r] = slot;
                            return;
                        }
                        Some(slot) if slot != usize::MAX => {
                            clock = clock.max(self.flight[slot].done);
                        }
                        // A wait on nothing posted: the verifier reports it; time goes on.
                        _ => {}
                    }
                    self.set_end(g, clock);
                    pc += 1;
                }
                Instr::FwdCheckpoint(t) => {
                    let d = self.fwd_of(*t) * self.costs.rank_factor(r);
                    self.set_start(g, clock);
                    let before = clock;
                    clock += d;
                    self.set_end(g, clock);
                    self.busy[r] += clock - before;
                    self.copies[r].fwd_end.insert(*t, clock);
                    pc += 1;
                }
                Instr::Memory(op) => {
                    let before = clock;
                    clock = self.memory(r, g, *op, clock);
                    if op.kind == MemKind::Recompute {
                        // The summary counts a recompute's span as busy, as a compute.
                        self.busy[r] += clock - before;
                    }
                    pc += 1;
                }
                Instr::Compute(op) => {
                    // Ids were range-checked in `check_ids`.
                    let d = match &self.scale {
                        None => self.costs.compute(op),
                        Some(s) => s.compute(self.costs, op),
                    }
                    .unwrap_or(0.0)
                        * self.costs.rank_factor(r);
                    let c = &mut self.copies[r];
                    if c.any {
                        // A backward of reloaded activations starts once its reload ended.
                        for (pass, t) in op.parts() {
                            if matches!(pass, Pass::Bwd | Pass::BwdD) {
                                if let Some(&e) = c.reload_end.get(&t) {
                                    clock = clock.max(e);
                                }
                            }
                        }
                    }
                    let any = c.any;
                    self.set_start(g, clock);
                    let before = clock;
                    clock += d;
                    self.set_end(g, clock);
                    // As the summary sums a compute span: `end - start`, in rank order.
                    self.busy[r] += clock - before;
                    if any {
                        let c = &mut self.copies[r];
                        for (pass, t) in op.parts() {
                            if pass == Pass::Fwd {
                                c.fwd_end.insert(t, clock);
                            }
                        }
                    }
                    pc += 1;
                }
                first => {
                    let id = first.batch();
                    let hi = batch_end(instrs, pc);
                    if let Some(slot) = id.and_then(|b| self.flight_ids[r].get_mut(&b)) {
                        // Left in flight: post it and go on; its `Wait` blocks.
                        *slot = self.flight.len();
                        self.flight.push(Flight {
                            open: (hi - pc) as u32,
                            done: clock,
                            ops: base + pc..base + hi,
                        });
                        let slot = *slot as u32;
                        for k in pc..hi {
                            let g = base + k;
                            self.set_start(g, clock);
                            self.posted[g] = clock;
                            self.flight_of[g] = OptIdx::some(slot);
                        }
                        self.posting = r;
                        for (k, ins) in instrs.iter().enumerate().take(hi).skip(pc) {
                            let x = self.transfer_of(ins);
                            self.post(base + k, r, matches!(ins, Instr::Send { .. }), x);
                        }
                        self.posting = usize::MAX;
                        pc = hi;
                        continue;
                    }
                    self.pending[r] = 0;
                    self.batch_max[r] = clock;
                    for k in pc..hi {
                        let g = base + k;
                        self.set_start(g, clock);
                        self.posted[g] = clock;
                        self.pending[r] += 1;
                    }
                    // Resolve what can be resolved now: this batch's own messages whose peer
                    // is posted, and peers' messages waiting for this post.
                    self.posting = r;
                    for (k, ins) in instrs.iter().enumerate().take(hi).skip(pc) {
                        let x = self.transfer_of(ins);
                        self.post(base + k, r, matches!(ins, Instr::Send { .. }), x);
                    }
                    self.posting = usize::MAX;
                    if self.pending[r] == 0 {
                        let end = self.batch_max[r];
                        for g in base + pc..base + hi {
                            self.set_end(g, end);
                        }
                        clock = end;
                        pc = hi;
                    } else {
                        self.pc[r] = pc;
                        self.clock[r] = clock;
                        self.batch_end[r] = hi;
                        return;
                    }
                }
            }
        }
        self.pc[r] = pc;
        self.clock[r] = clock;
    }

    /// Op `g` of rank `r` was just posted; its message takes `transfer`.
    fn post(&mut self, g: usize, r: usize, is_send: bool, transfer: f64) {
        let t = self.posted[g];
        let p = self
            .m
            .partner_of(g as u32)
            .map_or(usize::MAX, |p| p as usize);
        let partner_posted = p != usize::MAX && !self.posted[p].is_nan();
        if !self.rendezvous && is_send {
            // Eager: the send is done when posted; a posted recv gets the data after transfer.
            self.resolve(g, r, t);
            if partner_posted && !self.resolved[p] {
                let done = self.posted[p].max(t + transfer);
                self.resolve(p, self.rank_of(p), done);
            }
        } else if !partner_posted || self.resolved[g] {
            // Waits for its peer to post (or was completed by a peer in this same batch).
        } else if self.rendezvous {
            // Rendezvous: both ends complete together once both are posted.
            let done = t.max(self.posted[p]) + transfer;
            self.resolve(g, r, done);
            if !self.resolved[p] {
                self.resolve(p, self.rank_of(p), done);
            }
        } else {
            // Eager recv whose send was posted (and completed) before.
            let done = t.max(self.posted[p] + transfer);
            self.resolve(g, r, done);
        }
    }

    fn deadlock(&self) -> Option<Deadlock> {
        let mut stuck = Vec::new();
        let mut at_time: f64 = 0.0;
        for (r, instrs) in self.program.ranks.iter().enumerate() {
            at_time = at_time.max(self.clock[r]);
            if self.pc[r] >= instrs.len() {
                continue;
            }
            let base = self.m.positions().base(r) as usize;
            let lo = self.pc[r];
            let hi = self.batch_end[r].max(lo + 1);
            // At a wait, the ops of the batch it waits for.
            let range = match self.waiting_on[r] {
                usize::MAX => lo..hi,
                w => self.flight[w].ops.start - base..self.flight[w].ops.end - base,
            };
            let waiting = range
                .filter(|&k| !self.resolved[base + k])
                .map(|k| {
                    let g = base + k;
                    let partner = self.m.partner(self.m.positions().local(g as u32));
                    let peer_at = partner.and_then(|pa| {
                        let pr = pa.rank.index();
                        (self.pc[pr] < self.program.ranks[pr].len()).then_some(InstrRef {
                            rank: pa.rank,
                            index: self.pc[pr] as u32,
                        })
                    });
                    Waiting {
                        op: self.m.positions().local(g as u32),
                        instr: instrs[k],
                        partner,
                        peer_at,
                    }
                })
                .collect();
            stuck.push(Stuck {
                at: InstrRef {
                    rank: Rank(r as u32),
                    index: lo as u32,
                },
                since: self.clock[r],
                waiting,
            });
        }
        (!stuck.is_empty()).then_some(Deadlock { stuck, at_time })
    }

    fn timeline(&self) -> Timeline {
        let ranks = self
            .program
            .ranks
            .iter()
            .enumerate()
            .map(|(r, instrs)| {
                let base = self.m.positions().base(r) as usize;
                (0..instrs.len())
                    .map(|i| Span {
                        start: self.start[base + i],
                        end: self.end[base + i],
                    })
                    .collect()
            })
            .collect();
        Timeline {
            unit: TimeUnit::Cost,
            ranks,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostModel;
    use pipec_ir::ir::Payload;
    use pipec_ir::verify::Unverified;
    use pipec_schedules::{Compute, Placement, Task};

    fn fwd(s: u32, m: u32) -> Instr {
        Instr::Compute(Compute::Fwd(Task::new(s, m)))
    }
    fn bwd(s: u32, m: u32) -> Instr {
        Instr::Compute(Compute::Bwd(Task::new(s, m)))
    }
    fn send(peer: u32, p: Payload, batch: u32) -> Instr {
        Instr::Send {
            peer: Rank(peer),
            payload: p,
            batch,
            tokens: None,
            slot: None,
        }
    }
    fn recv(peer: u32, p: Payload, batch: u32) -> Instr {
        Instr::Recv {
            peer: Rank(peer),
            payload: p,
            batch,
            tokens: None,
            slot: None,
        }
    }

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

    fn costs(spec: &str, n: u32) -> StageCosts {
        StageCosts::uniform(&CostModel::parse(spec).unwrap(), n)
    }

    /// Two stages, one microbatch, hand-computed times.
    #[test]
    fn two_stage_hand_computed() {
        let p = program(vec![
            vec![
                fwd(0, 0),
                send(1, Payload::act(0, 0), 0),
                recv(1, Payload::grad(1, 0), 1),
                bwd(0, 0),
            ],
            vec![
                recv(0, Payload::act(0, 0), 0),
                fwd(1, 0),
                bwd(1, 0),
                send(0, Payload::grad(1, 0), 1),
            ],
        ]);
        // f=1, full bwd = 2, transfer 0.5, rendezvous.
        let s = simulate_unverified(&Unverified::unchecked(&p), &costs("f=1,b=1,w=1,p2p=0.5", 2))
            .unwrap();
        let spans = |r: usize| -> Vec<(f64, f64)> {
            s.timeline.ranks[r]
                .iter()
                .map(|x| (x.start, x.end))
                .collect()
        };
        assert_eq!(
            spans(0),
            vec![(0.0, 1.0), (1.0, 1.5), (1.5, 5.0), (5.0, 7.0)]
        );
        assert_eq!(
            spans(1),
            vec![(0.0, 1.5), (1.5, 2.5), (2.5, 4.5), (4.5, 5.0)]
        );
        assert_eq!(s.summary.makespan, 7.0);
        assert_eq!(s.summary.ranks[0].busy, 3.0);
        assert!((s.summary.ranks[0].bubble_ratio - 4.0 / 7.0).abs() < 1e-12);
        assert_eq!(s.summary.ranks[1].peak_activations, 1.0);
        assert_eq!(s.summary.ranks[1].peak_at, 1.5);
    }

    /// Eager sends complete at post; the recv waits for the data.
    #[test]
    fn eager_send_does_not_wait() {
        let p = program(vec![
            vec![send(1, Payload::act(0, 0), 0), fwd(0, 0)],
            vec![fwd(1, 0), fwd(1, 0), recv(0, Payload::act(0, 0), 0)],
        ]);
        let s = simulate_unverified(
            &Unverified::unchecked(&p),
            &costs("p2p=1,rendezvous=false", 2),
        )
        .unwrap();
        assert_eq!(
            s.timeline.ranks[0][0],
            Span {
                start: 0.0,
                end: 0.0
            }
        );
        assert_eq!(
            s.timeline.ranks[1][2],
            Span {
                start: 2.0,
                end: 2.0
            }
        );
        let s = simulate_unverified(&Unverified::unchecked(&p), &costs("p2p=1", 2)).unwrap();
        // Rendezvous: the send waits for the recv posted at 2, then transfer 1.
        assert_eq!(
            s.timeline.ranks[0][0],
            Span {
                start: 0.0,
                end: 3.0
            }
        );
        assert_eq!(
            s.timeline.ranks[1][2],
            Span {
                start: 2.0,
                end: 3.0
            }
        );
    }

    /// Both ranks send first in separate batches: a cycle under rendezvous, fine when eager.
    #[test]
    fn send_send_deadlocks_only_under_rendezvous() {
        let p = program(vec![
            vec![
                send(1, Payload::act(0, 0), 0),
                recv(1, Payload::grad(1, 0), 1),
            ],
            vec![
                send(0, Payload::grad(1, 0), 0),
                recv(0, Payload::act(0, 0), 1),
            ],
        ]);
        let e = simulate_unverified(&Unverified::unchecked(&p), &costs("", 2)).unwrap_err();
        let SimError::Deadlock(d) = e else {
            panic!("expected deadlock, got {e:?}")
        };
        assert_eq!(d.stuck.len(), 2);
        assert_eq!(
            d.stuck[0].at,
            InstrRef {
                rank: Rank(0),
                index: 0
            }
        );
        assert_eq!(
            d.stuck[0].waiting[0].partner,
            Some(InstrRef {
                rank: Rank(1),
                index: 1
            })
        );
        assert_eq!(
            d.stuck[0].waiting[0].peer_at,
            Some(InstrRef {
                rank: Rank(1),
                index: 0
            })
        );
        let text = d.to_string();
        assert!(text.contains("rank 0, #0 waits in a comm batch"), "{text}");
        assert!(
            simulate_unverified(&Unverified::unchecked(&p), &costs("rendezvous=false", 2)).is_ok()
        );
        // Fused into one batch each, the exchange is fine under rendezvous too.
        let p = program(vec![
            vec![
                send(1, Payload::act(0, 0), 0),
                recv(1, Payload::grad(1, 0), 0),
            ],
            vec![
                send(0, Payload::grad(1, 0), 0),
                recv(0, Payload::act(0, 0), 0),
            ],
        ]);
        assert!(simulate_unverified(&Unverified::unchecked(&p), &costs("", 2)).is_ok());
    }

    #[test]
    fn unmatched_and_bad_ids_are_reported() {
        let p = program(vec![vec![recv(1, Payload::act(0, 0), 0)], vec![fwd(1, 0)]]);
        let SimError::Deadlock(d) =
            simulate_unverified(&Unverified::unchecked(&p), &costs("", 2)).unwrap_err()
        else {
            panic!()
        };
        assert_eq!(d.stuck[0].waiting[0].partner, None);
        assert!(d.to_string().contains("has no matching op"));
        let p = program(vec![vec![send(7, Payload::act(0, 0), 0)], vec![]]);
        assert!(matches!(
            simulate_unverified(&Unverified::unchecked(&p), &costs("", 2)),
            Err(SimError::PeerOutOfRange { peer: 7, .. })
        ));
        let p = program(vec![vec![fwd(9, 0)], vec![]]);
        assert!(matches!(
            simulate_unverified(&Unverified::unchecked(&p), &costs("", 2)),
            Err(SimError::StageOutOfRange { stage: 9, .. })
        ));
    }

    /// Worlds too big for a dense pair table match through the map, with the same result.
    #[test]
    fn many_ranks_match_through_the_map() {
        let w = 1100;
        let mut ranks = vec![Vec::new(); w];
        ranks[0] = vec![send(w as u32 - 1, Payload::act(0, 0), 0)];
        ranks[w - 1] = vec![recv(0, Payload::act(0, 0), 0), fwd(1, 0)];
        let p = Program {
            placement: Placement::looped(w as u32, 1),
            ..program(vec![])
        };
        let p = Program { ranks, ..p };
        let m = Matching::of(&p).unwrap();
        assert_eq!(
            m.partner(InstrRef {
                rank: Rank(0),
                index: 0
            }),
            Some(InstrRef {
                rank: Rank(w as u32 - 1),
                index: 0
            })
        );
        let s = simulate_unverified(&Unverified::unchecked(&p), &costs("p2p=1", w as u32)).unwrap();
        assert_eq!(s.summary.makespan, 2.0);
    }

    #[test]
    fn self_messages_in_one_batch_complete() {
        let p = program(vec![vec![
            send(0, Payload::act(0, 0), 0),
            recv(0, Payload::act(0, 0), 0),
        ]]);
        let s = simulate_unverified(&Unverified::unchecked(&p), &costs("p2p=2", 1)).unwrap();
        assert_eq!(s.summary.makespan, 2.0);
    }
}
