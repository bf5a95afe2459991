//! The interpreter: runs one rank's instruction stream on a [`Backend`].
//!
//! Tensors live in dense per-(stage, microbatch) tables, indexed by the rank's local stages:
//! - `act_in[s][m]`: the input of `fwd(s, m)` (received, or handed over by `fwd(s-1, m)` on
//!   this rank); freed when the forward consumes it.
//! - `grad_in[s][m]`: the gradient of `(s, m)`'s output; freed when its backward consumes it.
//! - `act_out` / `grad_out`: a tensor produced here for another rank; freed when its send
//!   completes (the transport takes it).
//! - `saved[s][m]`: the activation stash, from `fwd(s, m)` to `bwd(s, m)`, or to `bwd_W(s, m)`
//!   when the backward is split, cut at `bwd_D` to what `bwd_W` reads (the backend's
//!   `keep_for_w`; metered from `act` down to `act_w`); `partial[s][m]` from `bwd_D` to
//!   `bwd_W`.
//! - `host[s][m]`: a stash an `offload` moved off the device, until its `reload` moves it back;
//!   `kept[s][m]`: the input a checkpointed `fwd` keeps for its `recompute`, which rebuilds
//!   the stash by running the same forward again (the same ops in the same order, so the
//!   backward's results are bitwise those of the plain schedule).
//!
//! The device store (`saved`, with the sources of copies in flight) and the host store (`host`)
//! are metered apart (`Meter`) in the verifier's memory model (docs/format.md, "Memory
//! instructions"; [`pipec_ir::ir::activations`]): a buffer counts from the instruction that puts
//! it in a store through the one that takes it out, an offload's device copy until the copy
//! is known to have ended (a `wait_offload` of it or of a later copy, a backward waiting for a
//! later reload), a reload's host copy likewise. The CPU has one memory: its copies end at once,
//! but the stores are released where a device's asynchronous copies would release them. The
//! live count of the device store is the activation memory the verifier bounds (docs/design.md
//! rule 5); a forward that saves nothing (forward-only, or checkpointed) holds its activation
//! while it runs, as the verifier counts it. [`static_peak_activations`] computes the same
//! count from the program alone, and a run reports both.
//!
//! Consecutive send/recv instructions with the same batch id are handed to the backend as one
//! batch. Every instruction gets a [`Span`]: a compute op from its start to its end, each op of
//! a batch from the batch's post to its completion.

use crate::backend::{Backend, CommOp, Dir};
use crate::diagnose::{describe, Fault};
use crate::watchdog::{Status, Watch};
use pipec_cost::timeline::Span;
use pipec_ir::ir::activations::{self, Amount};
use pipec_ir::ir::{Instr, MemKind, MemOp, OptIdx, Payload, PayloadKind, Program};
use pipec_ir::memory::MemoryModel;
use pipec_schedules::{Compute, Rank, StageId, Task};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// What one rank measured in one run.
#[derive(Clone, Debug)]
pub struct RankRun {
    /// One span per instruction, microseconds since the run's origin.
    pub spans: Vec<Span>,
    /// Sum of compute spans (microseconds).
    pub busy_us: f64,
    /// When the rank finished (microseconds since the origin).
    pub end_us: f64,
    /// Peak number of live activation stashes, counting the activation of a forward that
    /// saves none (forward-only) while it runs: the verifier's figure.
    pub peak_activations: u32,
    /// The most the device store held at once, each stash weighted by its stage's activation
    /// weight ([`run_rank_with`]): the verifier's `activations` figure of
    /// [`pipec_ir::memory::RankPeak`] (parameters not included).
    pub device_peak: f64,
    /// The most the host store (offloaded stashes) held at once, in the same weights: the
    /// verifier's `host` figure.
    pub host_peak: f64,
    /// A GPU's own figure: the high watermark of its memory pool over the step, in bytes
    /// (set by the CUDA backend's `end_step`; `None` from the interpreter).
    pub pool_peak_bytes: Option<u64>,
    /// With a buffer plan (issue #39): the slots of the rank's pool, allocated before the step,
    /// and the most of them that held a tensor at once (`(slots, most held)`); `None` without
    /// a plan.
    pub buffer_slots: Option<(u32, u32)>,
    /// The step ran as one CUDA graph (`pipec-run --cuda-graph`): `end_us` is the graph's GPU
    /// time, `spans` is empty and `busy_us` 0 (a replay has no per-instruction times).
    pub graph: bool,
}

/// The buffer plan's pool of one rank (issue #39, `pipec_ir::ir::buffers`): its slots exist
/// from the start of the step; a receive lands in its slot and stays there until the pass
/// that consumes it takes it, a sent tensor holds its slot from the pass that produces it
/// until its send completes. A slot asked for while it holds another message is a fault.
struct Pool<T> {
    held: Vec<Option<T>>,
    owner: Vec<Option<Payload>>,
    /// (is a send, payload) -> its slot, from the instructions.
    slot_of: HashMap<(bool, Payload), u32>,
    /// Slots whose tensor a pass took as input: held until the pass ends, since it reads
    /// them while it writes its output (the plan's lifetimes share that index).
    leaving: Vec<u32>,
    live: u32,
    peak: u32,
}

impl<T> Pool<T> {
    fn new(program: &Program, rank: usize) -> Option<Self> {
        let n = program.buffer_slots.as_ref()?.rank(rank).len();
        let mut slot_of = HashMap::new();
        for ins in &program.ranks[rank] {
            match *ins {
                Instr::Send {
                    payload,
                    slot: Some(s),
                    ..
                } => {
                    slot_of.insert((true, payload), s);
                }
                Instr::Recv {
                    payload,
                    slot: Some(s),
                    ..
                } => {
                    slot_of.insert((false, payload), s);
                }
                _ => {}
            }
        }
        Some(Pool {
            held: none_vec(n),
            owner: vec![None; n],
            slot_of,
            leaving: Vec::new(),
            live: 0,
            peak: 0,
        })
    }

    /// `p` takes its slot (`None`: it has none).
    fn occupy(&mut self, send: bool, p: Payload) -> Result<Option<u32>, Fault> {
        let Some(&s) = self.slot_of.get(&(send, p)) else {
            return Ok(None);
        };
        let n = self.owner.len();
        let o = self.owner.get_mut(s as usize).ok_or_else(|| {
            Fault::Schedule(format!("{p}: buffer slot {s} is past the pool ({n} slots)"))
        })?;
        if let Some(h) = o {
            return Err(Fault::Schedule(format!(
                "{p} needs buffer slot {s}, which still holds {h}"
            )));
        }
        *o = Some(p);
        self.live += 1;
        self.peak = self.peak.max(self.live);
        Ok(Some(s))
    }

    /// The instruction ended: the inputs it took leave their slots.
    fn settle(&mut self) {
        while let Some(s) = self.leaving.pop() {
            self.release(s);
        }
    }

    fn release(&mut self, s: u32) {
        if let Some(o) = self.owner.get_mut(s as usize) {
            if o.take().is_some() {
                self.live -= 1;
            }
        }
    }
}

/// The rank stopped: the failure (its own or another rank's) is in the [`Watch`].
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Stopped;

/// One store's occupancy as the verifier times it: what an instruction frees still counts
/// during it and goes when the next counted instruction (compute or memory) begins; the peak
/// is sampled at the end of each counted instruction, after its allocations.
#[derive(Copy, Clone, Debug, Default)]
struct Occupancy<W> {
    now: W,
    alloc: W,
    free: W,
    peak: W,
}

impl<W: Amount> Occupancy<W> {
    fn alloc(&mut self, w: W) {
        self.alloc = self.alloc.plus(w);
    }

    fn free(&mut self, w: W) {
        self.free = self.free.plus(w);
    }

    fn begin(&mut self) {
        self.now = self.now.minus(self.free);
        self.free = W::default();
    }

    fn sample(&mut self) {
        self.now = self.now.plus(self.alloc);
        self.alloc = W::default();
        if self.now > self.peak {
            self.peak = self.now;
        }
    }
}

/// The meters of a rank's stores: device stashes counted (the verifier's activation count)
/// and weighted, host stashes weighted.
#[derive(Debug, Default)]
struct Meter {
    count: Occupancy<u64>,
    device: Occupancy<f64>,
    host: Occupancy<f64>,
}

impl Meter {
    fn alloc(&mut self, w: f64) {
        self.count.alloc(1);
        self.device.alloc(w);
    }

    fn free(&mut self, w: f64) {
        self.count.free(1);
        self.device.free(w);
    }

    fn begin(&mut self) {
        self.count.begin();
        self.device.begin();
        self.host.begin();
    }

    fn sample(&mut self) {
        self.count.sample();
        self.device.sample();
        self.host.sample();
    }
}

/// A copy's source buffer, still allocated until the copy is known to have ended, and its
/// weight.
#[derive(Copy, Clone, Debug)]
enum Source {
    Device(f64),
    Host(f64),
}

/// The rank's copy stream (docs/format.md): offloads and reloads run one after another in
/// program order, so once a copy is known to have ended every earlier one has too.
#[derive(Debug, Default)]
struct CopyStream {
    next: u32,
    /// Copies not yet known to have ended, in posting order.
    pending: VecDeque<(u32, Source)>,
    /// Per slot, the sequence number of its latest offload / reload.
    offloads: HashMap<usize, u32>,
    reloads: HashMap<usize, u32>,
}

impl CopyStream {
    fn post(&mut self, slot: usize, src: Source) {
        let k = self.next;
        self.next = self.next.wrapping_add(1);
        match src {
            Source::Device(_) => self.offloads.insert(slot, k),
            Source::Host(_) => self.reloads.insert(slot, k),
        };
        self.pending.push_back((k, src));
    }

    /// Copy `k` has ended: it and every copy before it release their source buffers.
    fn ended(&mut self, k: u32, meter: &mut Meter) {
        while let Some(&(j, src)) = self.pending.front() {
            if j > k {
                break;
            }
            self.pending.pop_front();
            match src {
                Source::Device(w) => meter.free(w),
                Source::Host(w) => meter.host.free(w),
            }
        }
    }
}

/// What a checkpointed forward keeps for its recompute: its input (none for stage 0, whose
/// input the backend makes).
struct Kept<T>(Option<T>);

struct Tables<B: Backend> {
    m: usize,
    /// Global stage -> local index; none when the rank does not run the stage.
    local: Vec<OptIdx>,
    /// The weights stashes are metered in: per stage `act` and `act_w` (what `bwd_D` leaves
    /// for `bwd_W`), per microbatch its factor (microbatches of different lengths).
    mem: MemoryModel,
    act_in: Vec<Option<B::Tensor>>,
    grad_in: Vec<Option<B::Tensor>>,
    act_out: Vec<Option<B::Tensor>>,
    grad_out: Vec<Option<B::Tensor>>,
    /// The device store of stashes.
    saved: Vec<Option<B::Saved>>,
    partial: Vec<Option<B::Partial>>,
    /// Per slot: its stash was cut to what `bwd_W` needs (its `bwd_D` ran), and weighs `act_w`.
    for_w: Vec<bool>,
    /// The host store: offloaded stashes.
    host: Vec<Option<B::Host>>,
    kept: Vec<Option<Kept<B::Tensor>>>,
    copies: CopyStream,
    meter: Meter,
    pool: Option<Pool<B::Tensor>>,
}

fn none_vec<T>(n: usize) -> Vec<Option<T>> {
    std::iter::repeat_with(|| None).take(n).collect()
}

impl<B: Backend> Tables<B> {
    fn new(program: &Program, rank: usize, mem: &MemoryModel) -> Self {
        let mut local = vec![OptIdx::NONE; program.num_stages() as usize];
        let mut n = 0u32;
        for ins in &program.ranks[rank] {
            if let Some(c) = ins.as_compute() {
                for (_, t) in c.parts() {
                    if let Some(l) = local.get_mut(t.stage.index()) {
                        if l.is_none() {
                            *l = OptIdx::some(n);
                            n += 1;
                        }
                    }
                }
            }
        }
        let m = program.microbatches as usize;
        let size = n as usize * m;
        Tables {
            m,
            local,
            mem: mem.clone(),
            act_in: none_vec(size),
            grad_in: none_vec(size),
            act_out: none_vec(size),
            grad_out: none_vec(size),
            saved: none_vec(size),
            partial: none_vec(size),
            for_w: vec![false; size],
            host: none_vec(size),
            kept: none_vec(size),
            copies: CopyStream::default(),
            meter: Meter::default(),
            pool: Pool::new(program, rank),
        }
    }

    /// `t`'s activation weight (tasks are in range once they have a slot).
    fn weight(&self, t: Task) -> f64 {
        self.mem.weights(t, self.m as u32).0
    }

    /// What `t`'s stash in slot `i` weighs now: `act`, or `act_w` once its `bwd_D` cut it.
    fn held(&self, i: usize, t: Task) -> f64 {
        let (w, kept) = self.mem.weights(t, self.m as u32);
        if self.for_w[i] {
            kept
        } else {
            w
        }
    }

    fn slot(&self, stage: u32, mb: u32) -> Option<usize> {
        let l = self.local.get(stage as usize)?.get()?;
        ((mb as usize) < self.m).then(|| l as usize * self.m + mb as usize)
    }

    fn task_slot(&self, t: Task, what: &str) -> Result<usize, Fault> {
        self.slot(t.stage.0, t.mb.0).ok_or_else(|| {
            Fault::Schedule(format!(
                "{what} of {t}: this rank runs no compute op of {}",
                t.stage
            ))
        })
    }

    /// `t`'s stash may enter the device store: it is not there already.
    fn unsaved(&self, i: usize, t: Task) -> Result<(), Fault> {
        if self.saved[i].is_some() {
            return Err(Fault::Schedule(format!(
                "the activation of {t} is already saved: a second forward, reload or recompute of it"
            )));
        }
        Ok(())
    }

    /// Put `t`'s stash in the device store (a forward, a reload or a recompute).
    fn save(&mut self, i: usize, t: Task, s: B::Saved) -> Result<(), Fault> {
        self.unsaved(i, t)?;
        self.saved[i] = Some(s);
        self.for_w[i] = false;
        self.meter.alloc(self.weight(t));
        Ok(())
    }

    /// Take `t`'s stash out of the device store for good (its backward), or say where it is.
    fn take_saved(&mut self, i: usize, t: Task) -> Result<B::Saved, Fault> {
        let s = self.saved[i].take().ok_or_else(|| self.not_saved(i, t))?;
        self.meter.free(self.held(i, t));
        self.for_w[i] = false;
        Ok(s)
    }

    /// Why the device store has no stash of `t`.
    fn not_saved(&self, i: usize, t: Task) -> Fault {
        Fault::Schedule(if self.host[i].is_some() {
            format!("the saved activation of {t} is on the host: offloaded and not reloaded")
        } else if self.kept[i].is_some() {
            format!("the activation of {t} was checkpointed and is not recomputed yet")
        } else {
            format!("the saved activation of {t} is not here")
        })
    }

    /// A forward that saves nothing still held its activation while it ran
    /// ([`pipec_ir::ir::activations`]: a forward-only rank that runs a forward peaks at 1).
    fn held_while_running(&mut self, t: Task) {
        let w = self.weight(t);
        self.meter.alloc(w);
        self.meter.free(w);
    }
}

fn put<T>(
    table: &mut [Option<T>],
    i: usize,
    v: T,
    what: impl FnOnce() -> String,
) -> Result<(), Fault> {
    if table[i].is_some() {
        return Err(Fault::Schedule(format!(
            "{} is already here and not yet consumed: it was produced or received twice",
            what()
        )));
    }
    table[i] = Some(v);
    Ok(())
}

fn take<T>(table: &mut [Option<T>], i: usize, what: impl FnOnce() -> String) -> Result<T, Fault> {
    table[i].take().ok_or_else(|| {
        Fault::Schedule(format!(
            "{} is not here: not produced or received yet, or already consumed",
            what()
        ))
    })
}

struct Interp<'a, B: Backend> {
    program: &'a Program,
    rank: Rank,
    last: u32,
    backend: &'a mut B,
    t: Tables<B>,
    ops: Vec<CommOp<B::Tensor>>,
    /// Batch ids some `Wait` of this rank names: those batches are left in flight.
    waited: std::collections::HashSet<u32>,
    in_flight: std::collections::HashMap<u32, Vec<CommOp<B::Tensor>>>,
    /// Batches left in flight that a wait has completed.
    completed: std::collections::HashSet<u32>,
}

impl<'a, B: Backend> Interp<'a, B> {
    /// The input of `fwd(t)`: `None` for stage 0.
    fn fwd_input(&mut self, t: Task) -> Result<Option<B::Tensor>, Fault> {
        if t.stage.0 == 0 {
            return Ok(None);
        }
        if let Some(v) = self.take_from_slot(Payload::act(t.stage.0 - 1, t.mb.0))? {
            return Ok(Some(v));
        }
        let i = self.t.task_slot(t, "the forward")?;
        take(&mut self.t.act_in, i, || {
            format!(
                "the input of fwd({t}) (the activation of stage {}, {})",
                t.stage.0 - 1,
                t.mb
            )
        })
        .map(Some)
    }

    /// The output gradient for the backward of `t`: `None` for the last stage.
    fn bwd_input(&mut self, t: Task) -> Result<Option<B::Tensor>, Fault> {
        if t.stage.0 == self.last {
            return Ok(None);
        }
        if let Some(v) = self.take_from_slot(Payload::grad(t.stage.0 + 1, t.mb.0))? {
            return Ok(Some(v));
        }
        let i = self.t.task_slot(t, "the backward")?;
        take(&mut self.t.grad_in, i, || {
            format!(
                "the output gradient of {t} (the gradient from stage {}, {})",
                t.stage.0 + 1,
                t.mb
            )
        })
        .map(Some)
    }

    /// The received `p` from its pool slot, which it then leaves; `None` when it has no slot.
    fn take_from_slot(&mut self, p: Payload) -> Result<Option<B::Tensor>, Fault> {
        let Some(pool) = self.t.pool.as_mut() else {
            return Ok(None);
        };
        let Some(&s) = pool.slot_of.get(&(false, p)) else {
            return Ok(None);
        };
        let v = pool.held.get_mut(s as usize).and_then(Option::take);
        let v = v.ok_or_else(|| {
            Fault::Schedule(format!(
                "{p} is not in its buffer slot {s}: not received yet"
            ))
        })?;
        pool.leaving.push(s);
        Ok(Some(v))
    }

    /// Hand the forward output of `t` to its consumer: local table, send buffer, or nowhere.
    fn route_act(&mut self, t: Task, out: B::Tensor) -> Result<(), Fault> {
        if t.stage.0 >= self.last {
            return Ok(());
        }
        let next = Task {
            stage: StageId(t.stage.0 + 1),
            mb: t.mb,
        };
        if self.program.placement.rank_of(next) == self.rank {
            let i = self.t.task_slot(next, "the forward")?;
            put(&mut self.t.act_in, i, out, || {
                format!("the input of fwd({next})")
            })
        } else {
            if let Some(pool) = self.t.pool.as_mut() {
                pool.occupy(true, Payload::act(t.stage.0, t.mb.0))?;
            }
            let i = self.t.task_slot(t, "the forward")?;
            put(&mut self.t.act_out, i, out, || {
                format!("the activation of {t}")
            })
        }
    }

    fn route_grad(&mut self, t: Task, din: B::Tensor) -> Result<(), Fault> {
        if t.stage.0 == 0 {
            return Ok(());
        }
        let prev = Task {
            stage: StageId(t.stage.0 - 1),
            mb: t.mb,
        };
        if self.program.placement.rank_of(prev) == self.rank {
            let i = self.t.task_slot(prev, "the backward")?;
            put(&mut self.t.grad_in, i, din, || {
                format!("the output gradient of {prev}")
            })
        } else {
            if let Some(pool) = self.t.pool.as_mut() {
                pool.occupy(true, Payload::grad(t.stage.0, t.mb.0))?;
            }
            let i = self.t.task_slot(t, "the backward")?;
            put(&mut self.t.grad_out, i, din, || {
                format!("the input gradient of {t}")
            })
        }
    }

    fn take_saved(&mut self, t: Task) -> Result<B::Saved, Fault> {
        let i = self.t.task_slot(t, "the backward")?;
        self.t.take_saved(i, t)
    }

    /// A backward (`bwd`, `bwd_D`) of `t` waits for `t`'s latest reload: it and every copy
    /// before it have ended.
    fn backward_waits(&mut self, t: Task) -> Result<(), Fault> {
        let i = self.t.task_slot(t, "the backward")?;
        if let Some(&k) = self.t.copies.reloads.get(&i) {
            self.t.copies.ended(k, &mut self.t.meter);
        }
        Ok(())
    }

    fn compute(&mut self, c: &Compute) -> Result<(), Fault> {
        let save = !self.program.forward_only;
        let be = |e: crate::backend::BackendError| Fault::Compute(e.0);
        match *c {
            Compute::Fwd(t) => {
                let input = self.fwd_input(t)?;
                let (out, stash) = self.backend.fwd(t, input, save).map_err(be)?;
                match stash {
                    Some(s) => {
                        let i = self.t.task_slot(t, "the forward")?;
                        self.t.save(i, t, s)?;
                    }
                    None => self.t.held_while_running(t),
                }
                self.route_act(t, out)
            }
            Compute::Bwd(t) => {
                self.backward_waits(t)?;
                let saved = self.take_saved(t)?;
                let g = self.bwd_input(t)?;
                let din = self.backend.bwd(t, saved, g).map_err(be)?;
                self.route_grad(t, din)
            }
            Compute::BwdD(t) => {
                self.backward_waits(t)?;
                let i = self.t.task_slot(t, "the backward")?;
                let g = self.bwd_input(t)?;
                let saved = match self.t.saved[i].as_mut() {
                    Some(s) => s,
                    None => return Err(self.t.not_saved(i, t)),
                };
                let (din, part) = self.backend.bwd_d(t, saved, g).map_err(be)?;
                // The input gradient is done: drop what only it read, keep the weight
                // GEMMs' inputs for `bwd_W` (`act - act_w` goes, as the verifier counts).
                if !self.t.for_w[i] && self.backend.keep_for_w(t, saved).map_err(be)? {
                    let (w, kept) = self.t.mem.weights(t, self.t.m as u32);
                    self.t.meter.device.free(w - kept);
                    self.t.for_w[i] = true;
                }
                put(&mut self.t.partial, i, part, || {
                    format!("the bwd_D result of {t}")
                })?;
                self.route_grad(t, din)
            }
            Compute::BwdW(t) => {
                let i = self.t.task_slot(t, "the backward")?;
                let part = take(&mut self.t.partial, i, || {
                    format!("the bwd_D result of {t}")
                })?;
                let saved = self.t.take_saved(i, t)?;
                self.backend.bwd_w(t, saved, part).map_err(be)?;
                Ok(())
            }
            Compute::FwdBwd { fwd, bwd } => {
                if fwd == bwd {
                    return Err(Fault::Schedule(format!(
                        "an overlapped pair cannot run the forward and backward of one task ({fwd})"
                    )));
                }
                self.backward_waits(bwd)?;
                let input = self.fwd_input(fwd)?;
                let saved = self.take_saved(bwd)?;
                let g = self.bwd_input(bwd)?;
                let (out, stash, din) = self
                    .backend
                    .fwd_bwd(fwd, input, save, bwd, saved, g)
                    .map_err(be)?;
                // Both stashes were alive during the pair: the old one's release counts only
                // from the next instruction (the meter), as the static count does.
                match stash {
                    Some(s) => {
                        let i = self.t.task_slot(fwd, "the forward")?;
                        self.t.save(i, fwd, s)?;
                    }
                    None => self.t.held_while_running(fwd),
                }
                self.route_act(fwd, out)?;
                self.route_grad(bwd, din)
            }
        }
    }

    /// A checkpointed `fwd(t)`: the forward, saving nothing (its activation is live while it
    /// runs), keeping a copy of its input for the recompute.
    fn checkpoint(&mut self, t: Task) -> Result<(), Fault> {
        let be = |e: crate::backend::BackendError| Fault::Compute(e.0);
        let i = self.t.task_slot(t, "the forward")?;
        let input = self.fwd_input(t)?;
        let keep = !self.program.forward_only;
        let kept = match (&input, keep) {
            (Some(x), true) => Some(self.backend.keep(x).map_err(be)?),
            _ => None,
        };
        let (out, _) = self.backend.fwd(t, input, false).map_err(be)?;
        self.t.held_while_running(t);
        if keep {
            put(&mut self.t.kept, i, Kept(kept), || {
                format!("the input kept by the checkpointed fwd({t})")
            })?;
        }
        self.route_act(t, out)
    }

    /// `offload`, `reload`, `wait_offload` or `recompute` of `op.task` (docs/format.md,
    /// "Memory instructions").
    fn memory(&mut self, op: MemOp) -> Result<(), Fault> {
        let be = |e: crate::backend::BackendError| Fault::Compute(e.0);
        let t = op.task;
        let i = self.t.task_slot(t, op.kind.op())?;
        let w = self.t.weight(t);
        match op.kind {
            MemKind::Offload => {
                // After `bwd_D` only `act_w` is left to move (as the verifier counts it).
                let w = self.t.held(i, t);
                self.t.for_w[i] = false;
                // The device copy stays allocated until the copy is known to have ended.
                let s = self.t.saved[i]
                    .take()
                    .ok_or_else(|| match self.t.not_saved(i, t) {
                        Fault::Schedule(m) => Fault::Schedule(format!("nothing to offload: {m}")),
                        f => f,
                    })?;
                let h = self.backend.offload(t, s).map_err(be)?;
                self.t.host[i] = Some(h);
                self.t.meter.host.alloc(w);
                self.t.copies.post(i, Source::Device(w));
            }
            MemKind::Reload => {
                let h = self.t.host[i].take().ok_or_else(|| {
                    Fault::Schedule(format!(
                        "nothing to reload: the activation of {t} is not on the host (not offloaded, or reloaded already)"
                    ))
                })?;
                // Refused before the backend allocates a second device stash.
                self.t.unsaved(i, t)?;
                let s = self.backend.reload(t, h).map_err(be)?;
                self.t.save(i, t, s)?;
                self.t.copies.post(i, Source::Host(w));
            }
            MemKind::WaitOffload => {
                let k = *self.t.copies.offloads.get(&i).ok_or_else(|| {
                    Fault::Schedule(format!("no offload of {t} was posted before"))
                })?;
                self.backend.wait_offload(t).map_err(be)?;
                self.t.copies.ended(k, &mut self.t.meter);
            }
            MemKind::Recompute => {
                let Kept(input) = self.t.kept[i].take().ok_or_else(|| {
                    Fault::Schedule(if self.t.saved[i].is_some() || self.t.host[i].is_some() {
                        format!("nothing to recompute: fwd({t}) was not checkpointed")
                    } else {
                        format!("nothing to recompute: no checkpointed fwd({t}) ran before, or it is recomputed already")
                    })
                })?;
                // The same forward from the same input: the stash the plain forward saved.
                let (_, stash) = self.backend.fwd(t, input, true).map_err(be)?;
                let s = stash.ok_or_else(|| {
                    Fault::Compute(format!("the backend saved nothing recomputing fwd({t})"))
                })?;
                self.t.save(i, t, s)?;
            }
        }
        Ok(())
    }

    /// Table and slot that hold a sent payload (by producing stage) or receive it (by
    /// consuming stage).
    fn msg_slot(&self, dir: Dir, p: Payload) -> Result<usize, Fault> {
        let stage = match dir {
            Dir::Send => Some(p.stage),
            Dir::Recv => p.consumer(),
        };
        stage.and_then(|s| self.t.slot(s.0, p.mb.0)).ok_or_else(|| {
            Fault::Schedule(format!(
                "{p} is neither produced nor consumed by a compute op of this rank"
            ))
        })
    }

    /// Post the batch at `first..end` and, unless it is left in flight (a later `Wait` names
    /// it), wait for it and file what arrived.
    fn batch(&mut self, first: usize, end: usize) -> Result<(), Fault> {
        self.ops.clear();
        self.fill_ops(first, end)?;
        let id = self.program.ranks[self.rank.index()][first].batch();
        if let Some(b) = id.filter(|b| self.waited.contains(b)) {
            if self.in_flight.contains_key(&b) || self.completed.contains(&b) {
                return Err(Fault::Schedule(format!(
                    "batch {b} is posted twice, but a wait names it: which one it waits for is ambiguous"
                )));
            }
            let mut ops = std::mem::take(&mut self.ops);
            self.backend.post(&mut ops).map_err(Fault::Comm)?;
            self.in_flight.insert(b, ops);
            return Ok(());
        }
        self.backend.exchange(&mut self.ops).map_err(Fault::Comm)?;
        let ops = std::mem::take(&mut self.ops);
        self.file(ops)
    }

    /// `Wait { batch }`: complete a batch left in flight and file what arrived. A second wait
    /// on the same batch does nothing (as `work.wait()` twice).
    fn wait(&mut self, batch: u32) -> Result<(), Fault> {
        let Some(mut ops) = self.in_flight.remove(&batch) else {
            if self.completed.contains(&batch) {
                self.backend.rewait();
                return Ok(());
            }
            return Err(Fault::Schedule(format!(
                "waits for batch {batch}, which this rank has not posted before"
            )));
        };
        self.completed.insert(batch);
        self.backend.complete(&mut ops).map_err(Fault::Comm)?;
        self.file(ops)
    }

    /// Build the comm ops of `first..end` into `self.ops`, taking each send's tensor.
    fn fill_ops(&mut self, first: usize, end: usize) -> Result<(), Fault> {
        let program = self.program;
        let instrs = &program.ranks[self.rank.index()];
        for (k, ins) in instrs[first..end].iter().enumerate() {
            let at = (first + k) as u32;
            let (dir, peer, payload, tokens) = match *ins {
                Instr::Send {
                    peer,
                    payload,
                    tokens,
                    ..
                } => (Dir::Send, peer, payload, tokens),
                Instr::Recv {
                    peer,
                    payload,
                    tokens,
                    ..
                } => (Dir::Recv, peer, payload, tokens),
                Instr::Compute(_)
                | Instr::Wait { .. }
                | Instr::FwdCheckpoint(_)
                | Instr::Memory(_) => {
                    unreachable!("a batch holds only send/recv")
                }
            };
            if payload.kind.is_shape() {
                // The loader refuses these programs; this guards hand-built ones.
                return Err(Fault::Schedule(format!(
                    "{payload} is one of Megatron's shape messages, which pipec-run does not execute (a plan sizes every receive itself)"
                )));
            }
            let tensor = match dir {
                Dir::Send => {
                    let i = self.msg_slot(dir, payload)?;
                    let table = match payload.kind {
                        PayloadKind::Act | PayloadKind::ActShape => &mut self.t.act_out,
                        PayloadKind::Grad | PayloadKind::GradShape => &mut self.t.grad_out,
                    };
                    Some(take(table, i, || format!("{payload}, to be sent,"))?)
                }
                Dir::Recv => {
                    self.msg_slot(dir, payload)?;
                    // The receive's buffer is its slot from the post on.
                    if let Some(pool) = self.t.pool.as_mut() {
                        pool.occupy(false, payload)?;
                    }
                    None
                }
            };
            self.ops.push(CommOp {
                at,
                dir,
                peer,
                payload,
                tensor,
                seq: 0,
                tokens: tokens.map(|t| t.get()),
                slot: ins.slot(),
            });
        }
        Ok(())
    }

    /// File the tensors a completed batch received.
    fn file(&mut self, mut ops: Vec<CommOp<B::Tensor>>) -> Result<(), Fault> {
        // A completed send gives its slot back.
        if let Some(pool) = self.t.pool.as_mut() {
            for op in ops.iter().filter(|o| o.dir == Dir::Send) {
                if let Some(s) = op.slot {
                    pool.release(s);
                }
            }
        }
        for op in ops.iter_mut().filter(|o| o.dir == Dir::Recv) {
            let i = self.msg_slot(Dir::Recv, op.payload)?;
            let v = op.tensor.take().ok_or_else(|| {
                Fault::Schedule(format!("the backend returned no tensor for {}", op.payload))
            })?;
            let p = op.payload;
            // With a buffer plan the receive lands in its slot.
            if let (Some(pool), Some(s)) = (self.t.pool.as_mut(), op.slot) {
                if let Some(h) = pool.held.get_mut(s as usize) {
                    *h = Some(v);
                    continue;
                }
            }
            let table = match p.kind {
                PayloadKind::Act | PayloadKind::ActShape => &mut self.t.act_in,
                PayloadKind::Grad | PayloadKind::GradShape => &mut self.t.grad_in,
            };
            put(table, i, v, || format!("{p}"))?;
        }
        ops.clear();
        self.ops = ops;
        Ok(())
    }
}

/// Run `rank`'s stream of `program` on `backend`. Spans are measured from `origin`.
/// On failure the report goes to `watch` (which stops every rank) and `Err(Stopped)` returns.
/// The stores are metered with every stage's activation weight 1 ([`run_rank_with`]).
pub fn run_rank<B: Backend>(
    program: &Program,
    rank: Rank,
    backend: &mut B,
    watch: &Watch,
    origin: Instant,
) -> Result<RankRun, Stopped> {
    let ones = vec![1.0; program.num_stages() as usize];
    run_rank_with(program, rank, backend, watch, origin, &ones)
}

/// [`run_rank`] with the stores metered in `act` (per stage, one microbatch's activation
/// weight: [`pipec_ir::memory::MemoryModel::act`]); a stage past its end weighs 0.
pub fn run_rank_with<B: Backend>(
    program: &Program,
    rank: Rank,
    backend: &mut B,
    watch: &Watch,
    origin: Instant,
    act: &[f64],
) -> Result<RankRun, Stopped> {
    let mut mem = MemoryModel::units(program);
    mem.act = act.to_vec();
    run_rank_scaled(program, rank, backend, watch, origin, &mem)
}

/// [`run_rank_with`] with the stores metered in `mem`'s weights: each microbatch's stashes
/// also weighted by its factor (microbatches of different lengths, issue #38), and a stash
/// weighing `act_w` from its `bwd_D` (which cuts it to what `bwd_W` needs) to its `bwd_W`,
/// so the measured peaks are the verifier's.
pub fn run_rank_scaled<B: Backend>(
    program: &Program,
    rank: Rank,
    backend: &mut B,
    watch: &Watch,
    origin: Instant,
    mem: &MemoryModel,
) -> Result<RankRun, Stopped> {
    let r = rank.index();
    let instrs = &program.ranks[r];
    let mut it = Interp {
        program,
        rank,
        last: program.num_stages().saturating_sub(1),
        backend,
        t: Tables::new(program, r, mem),
        ops: Vec::new(),
        waited: pipec_ir::ir::waited_batches(instrs),
        in_flight: Default::default(),
        completed: Default::default(),
    };
    let us = |t: Instant| t.saturating_duration_since(origin).as_secs_f64() * 1e6;
    let mut spans = Vec::with_capacity(instrs.len());
    let mut busy = 0.0;
    let mut now = Instant::now();
    let mut i = 0;
    while i < instrs.len() {
        if watch.is_aborted() {
            watch.set(r, Status::Stopped(i as u32));
            return Err(Stopped);
        }
        let counted = matches!(
            instrs[i],
            Instr::Compute(_) | Instr::FwdCheckpoint(_) | Instr::Memory(_)
        );
        if counted {
            it.t.meter.begin();
        }
        let (res, end) = match &instrs[i] {
            Instr::Compute(c) => {
                watch.set(r, Status::Running(i as u32));
                (it.compute(c), i + 1)
            }
            Instr::Wait { batch } => {
                watch.set(r, Status::Waiting(i as u32));
                (it.wait(*batch), i + 1)
            }
            Instr::Send { .. } | Instr::Recv { .. } => {
                let end = pipec_ir::ir::batch_end(instrs, i);
                watch.set(r, Status::Waiting(i as u32));
                (it.batch(i, end), end)
            }
            Instr::FwdCheckpoint(t) => {
                watch.set(r, Status::Running(i as u32));
                (it.checkpoint(*t), i + 1)
            }
            Instr::Memory(op) => {
                watch.set(r, Status::Running(i as u32));
                (it.memory(*op), i + 1)
            }
        };
        if let Err(f) = res {
            // `Stopped` is published only after the report is filed: a peer that times out
            // at the same moment then still reads as waiting in the report that wins (the
            // first filed), never as "stopped" by a failure that was not yet recorded.
            if let Some(failure) = describe(program, rank, i, end, f, watch) {
                watch.fail(failure);
            }
            watch.set(r, Status::Stopped(i as u32));
            return Err(Stopped);
        }
        let t = Instant::now();
        let span = Span {
            start: us(now),
            end: us(t),
        };
        if counted {
            it.t.meter.sample();
        }
        if let Some(pool) = it.t.pool.as_mut() {
            pool.settle();
        }
        if instrs[i].as_compute().is_some() {
            busy += span.end - span.start;
        }
        for _ in i..end {
            spans.push(span);
        }
        now = t;
        i = end;
    }
    watch.set(r, Status::Finished);
    it.backend.finish();
    Ok(RankRun {
        spans,
        busy_us: busy,
        end_us: us(now),
        peak_activations: u32::try_from(it.t.meter.count.peak).unwrap_or(u32::MAX),
        device_peak: it.t.meter.device.peak,
        host_peak: it.t.meter.host.peak,
        pool_peak_bytes: None,
        buffer_slots: it.t.pool.as_ref().map(|p| (p.owner.len() as u32, p.peak)),
        graph: false,
    })
}

/// Peak live activations per rank from the program alone: the verifier's figure
/// ([`pipec_ir::ir::activations::peaks`]), so a run's measured peak is checked against the number
/// `pipec check` reports.
pub fn static_peak_activations(program: &Program) -> Vec<u32> {
    activations::peaks(program)
        .iter()
        .map(|p| u32::try_from(p.peak).unwrap_or(u32::MAX))
        .collect()
}
