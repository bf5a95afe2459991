//! Megatron-LM's P2P calls, one for one.
//!
//! A port of the communication of `forward_backward_pipelining_with_interleaving` and
//! `forward_backward_pipelining_without_interleaving` (megatron-core 0.19.2,
//! `megatron/core/pipeline_parallel/schedules.py`) and of how `P2PCommunicator._communicate`
//! posts a call (`p2p_communication.py`): the loops below keep Megatron's variable names and
//! branch structure so they can be read side by side with it. Compute comes from the rank's
//! generated order (the same `get_schedule_table` / warmup rule, `pipec_schedules::megatron`);
//! only where Megatron talks is decided here.
//!
//! A call becomes, by [`MegatronP2p`]:
//! - `Batched`: one comm batch `[send_prev, recv_prev, send_next, recv_next]`
//!   (`_batched_p2p_ops`' order), waited at once;
//! - `Unbatched`: one batch in `_p2p_ops`' order (even pipeline ranks
//!   `send_next, recv_prev, send_prev, recv_next`; odd ones `recv_prev, send_next, recv_next,
//!   send_prev`), waited at once;
//! - overlapped calls (`overlap_p2p_comm=True`): every op its own batch, left in flight; each
//!   `handle.wait()` of Megatron is an [`Instr::Wait`] on that batch (with
//!   `deallocate_pipeline_outputs`, a forward's send is waited right after it is posted).
//!
//! With `variable_seq_lengths` ([`Shapes::Megatron`], `pipec compile
//! --megatron-variable-seq-lengths`) every `_communicate` call first runs `_communicate_shapes`:
//! one `batch_isend_irecv` of the shapes of the call's tensors, in the order
//! `[send_prev, recv_prev, send_next, recv_next]` whatever the P2P mode (it never reads
//! `batch_p2p_comm`), on the pipeline group, waited at once, then `torch.cuda.synchronize()`.
//! The shapes are [`PayloadKind::ActShape`](pipec_ir::ir::PayloadKind) /
//! `GradShape` messages named by their tensor; the device synchronize completes every batch
//! still in flight on the rank, so it becomes a [`Instr::Wait`] for each (and Megatron's later
//! `wait()` on one of those is a no-op, left out). Megatron's calls that always reach
//! `_communicate` (`send_forward_recv_forward`, ...) synchronize even with nothing to send or
//! receive; `recv_forward` / `recv_backward` / `send_*` at the pipeline's ends return before it.
//!
//! The tensor a receive carries is the one Megatron files it under: a receive appended to
//! `input_tensors[c]` is the activation for chunk `c`'s next forward, one appended to
//! `output_tensor_grads[c]` the gradient for chunk `c`'s next backward. Each chunk runs its
//! microbatches in increasing order, so the `j`-th receive filed under chunk `c` carries
//! microbatch `j`.

use pipec_ir::ir::{Instr, Payload};
use pipec_schedules::{Compute, MegatronP2p, Rank};

/// The four tensor slots of one `_communicate` call.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum Key {
    SendNext,
    RecvPrev,
    SendPrev,
    RecvNext,
}

/// The requests an overlapped call returns (`reqs` dict, in insertion order).
#[derive(Default, Debug)]
struct Handles(Vec<(Key, u32)>);

impl Handles {
    fn pop(&mut self, key: Key) -> Option<u32> {
        let i = self.0.iter().position(|(k, _)| *k == key)?;
        Some(self.0.remove(i).1)
    }
}

/// Whether the lowering models Megatron's shape exchange (`config.variable_seq_lengths`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Shapes {
    /// Fixed shapes: Megatron's default, and every plan of pipec's.
    #[default]
    None,
    /// `_communicate_shapes` before every `_communicate` call.
    Megatron,
}

/// One rank's stream under construction, with Megatron's bookkeeping of received tensors.
struct Comm {
    rank: u32,
    pp: u32,
    mode: MegatronP2p,
    shapes: Shapes,
    /// Every `call` reaches `_communicate` (the interleaved loop's calls), rather than only
    /// those with something to send or receive.
    always_communicate: bool,
    out: Vec<Instr>,
    next_batch: u32,
    /// Per batch: posted by an overlapped call (left in flight until a wait).
    overlapped: Vec<bool>,
    /// Per batch: completed by a shape exchange's device synchronize (already waited).
    synced: Vec<bool>,
    /// Per batch: the stream has a wait for it.
    waited: Vec<bool>,
    /// Overlapped batches posted since the last shape exchange (some may be waited since).
    in_flight: Vec<u32>,
    /// Receives filed so far per chunk: forward inputs and backward output-gradients.
    fwd_recvs: Vec<u32>,
    bwd_recvs: Vec<u32>,
}

impl Comm {
    fn new(
        rank: u32,
        pp: u32,
        chunks: u32,
        mode: MegatronP2p,
        shapes: Shapes,
        capacity: usize,
    ) -> Self {
        Comm {
            rank,
            pp,
            mode,
            shapes,
            always_communicate: false,
            out: Vec::with_capacity(capacity),
            next_batch: 0,
            overlapped: Vec::new(),
            synced: Vec::new(),
            waited: Vec::new(),
            in_flight: Vec::new(),
            fwd_recvs: vec![0; chunks as usize],
            bwd_recvs: vec![0; chunks as usize],
        }
    }

    fn next(&self) -> Rank {
        Rank((self.rank + 1) % self.pp)
    }

    fn prev(&self) -> Rank {
        Rank((self.rank + self.pp - 1) % self.pp)
    }

    /// The activation the next receive filed under chunk `c` carries.
    fn recv_act(&mut self, c: u32) -> Payload {
        let mb = self.fwd_recvs[c as usize];
        self.fwd_recvs[c as usize] += 1;
        Payload::act(c * self.pp + self.rank - 1, mb)
    }

    /// The gradient the next receive filed under chunk `c` carries.
    fn recv_grad(&mut self, c: u32) -> Payload {
        let mb = self.bwd_recvs[c as usize];
        self.bwd_recvs[c as usize] += 1;
        Payload::grad(c * self.pp + self.rank + 1, mb)
    }

    fn wait(&mut self, batch: Option<u32>) {
        if let Some(batch) = batch {
            let b = batch as usize;
            if !self.synced.get(b).copied().unwrap_or(false) {
                self.out.push(Instr::Wait { batch });
                if let Some(w) = self.waited.get_mut(b) {
                    *w = true;
                }
            }
        }
    }

    /// A new batch id.
    fn batch(&mut self, overlapped: bool) -> u32 {
        let b = self.next_batch;
        self.next_batch += 1;
        self.overlapped.push(overlapped);
        self.synced.push(false);
        self.waited.push(false);
        if overlapped {
            self.in_flight.push(b);
        }
        b
    }

    /// `_communicate_shapes`: the shapes of the call's tensors in one blocking batch in
    /// `[send_prev, recv_prev, send_next, recv_next]` order, then `torch.cuda.synchronize()`,
    /// which completes every batch of this rank still in flight (a wait for each, in posting
    /// order).
    fn shape_exchange(&mut self, slots: &[(Key, Option<Payload>); 4]) {
        // slots are (send_next, recv_prev, send_prev, recv_next).
        let posted: Vec<(Key, Payload)> = [2usize, 1, 0, 3]
            .iter()
            .filter_map(|&i| slots[i].1.map(|p| (slots[i].0, p.shape())))
            .collect();
        if !posted.is_empty() {
            let batch = self.batch(false);
            for (key, payload) in posted {
                self.out.push(self.op(key, payload, batch));
            }
        }
        for b in std::mem::take(&mut self.in_flight) {
            if !self.waited[b as usize] {
                self.out.push(Instr::Wait { batch: b });
                self.synced[b as usize] = true;
                self.waited[b as usize] = true;
            }
        }
    }

    fn op(&self, key: Key, payload: Payload, batch: u32) -> Instr {
        match key {
            Key::SendNext => Instr::Send {
                peer: self.next(),
                payload,
                batch,
                tokens: None,
                slot: None,
            },
            Key::SendPrev => Instr::Send {
                peer: self.prev(),
                payload,
                batch,
                tokens: None,
                slot: None,
            },
            Key::RecvPrev => Instr::Recv {
                peer: self.prev(),
                payload,
                batch,
                tokens: None,
                slot: None,
            },
            Key::RecvNext => Instr::Recv {
                peer: self.next(),
                payload,
                batch,
                tokens: None,
                slot: None,
            },
        }
    }

    /// `_communicate`: post one call. `overlap` is the call's `overlap_p2p_comm` argument;
    /// the returned handles are empty unless it is set.
    fn call(
        &mut self,
        send_next: Option<Payload>,
        recv_prev: Option<Payload>,
        send_prev: Option<Payload>,
        recv_next: Option<Payload>,
        overlap: bool,
    ) -> Handles {
        let slots = [
            (Key::SendNext, send_next),
            (Key::RecvPrev, recv_prev),
            (Key::SendPrev, send_prev),
            (Key::RecvNext, recv_next),
        ];
        let any = slots.iter().any(|s| s.1.is_some());
        if self.shapes == Shapes::Megatron && (any || self.always_communicate) {
            self.shape_exchange(&slots);
        }
        let order: [usize; 4] = match self.mode {
            // _batched_p2p_ops: send_prev, recv_prev, send_next, recv_next.
            MegatronP2p::Batched => [2, 1, 0, 3],
            // _p2p_ops: even ranks send first, odd ranks receive first.
            _ if self.rank.is_multiple_of(2) => [0, 1, 2, 3],
            _ => [1, 0, 3, 2],
        };
        let posted = order
            .iter()
            .filter_map(|&i| slots[i].1.map(|p| (slots[i].0, p)));
        let mut handles = Handles::default();
        if overlap && self.mode != MegatronP2p::Batched {
            for (key, payload) in posted {
                let batch = self.batch(true);
                self.out.push(self.op(key, payload, batch));
                handles.0.push((key, batch));
            }
        } else {
            let ops: Vec<(Key, Payload)> = posted.collect();
            if !ops.is_empty() {
                let batch = self.batch(false);
                for (key, payload) in ops {
                    self.out.push(self.op(key, payload, batch));
                }
            }
        }
        handles
    }

    /// A call Megatron makes only where it has something to receive (`recv_forward`,
    /// `recv_backward`: they return at the pipeline's ends before `_communicate`).
    fn call_if_any(&mut self, recv_prev: Option<Payload>, recv_next: Option<Payload>) {
        let always = std::mem::replace(&mut self.always_communicate, false);
        self.call(None, recv_prev, None, recv_next, false);
        self.always_communicate = always;
    }
}

/// The rank's generated order, handed out one compute op at a time (Megatron's
/// `forward_step` / `backward_step`, or one combined step).
struct Cursor<'o> {
    ops: &'o [Compute],
    cursor: usize,
}

impl Cursor<'_> {
    /// The next op's task, if it is a forward (or backward) of one stage.
    fn peek_task(&self) -> Option<pipec_schedules::Task> {
        match self.ops.get(self.cursor)? {
            Compute::Fwd(t) | Compute::Bwd(t) => Some(*t),
            _ => None,
        }
    }

    /// The next compute op of the order (Megatron's `forward_step` / `backward_step`).
    fn compute(&mut self, comm: &mut Comm) {
        if let Some(op) = self.ops.get(self.cursor) {
            comm.out.push(Instr::Compute(*op));
            self.cursor += 1;
        }
    }
}

/// The parameters of one rank's interleaved loop.
pub(crate) struct Interleaved<'o> {
    pub pp: u32,
    pub rank: u32,
    pub chunks: u32,
    pub warmup: u32,
    pub forward_only: bool,
    pub combined: bool,
    pub mode: MegatronP2p,
    pub shapes: Shapes,
    pub ops: &'o [Compute],
}

/// `forward_backward_pipelining_with_interleaving`'s communication for one rank.
pub(crate) fn interleaved(x: &Interleaved<'_>) -> Vec<Instr> {
    let (pp, r, v) = (x.pp, x.rank, x.chunks);
    let mut comm = Comm::new(r, pp, v, x.mode, x.shapes, x.ops.len() * 3);
    // Every call of the interleaved loop but `recv_forward` / `recv_backward` is one of
    // `send_forward_recv_forward`, `send_backward_recv_backward`,
    // `send_forward_backward_recv_forward_backward`: they reach `_communicate` always.
    comm.always_communicate = true;
    let mut cursor = Cursor {
        ops: x.ops,
        cursor: 0,
    };
    // The schedule table, read off the order: (chunk, microbatch) of the k-th forward.
    let mut fwd_chunk = Vec::new();
    let mut fwd_mb = Vec::new();
    for op in x.ops {
        let f = match op {
            Compute::Fwd(t) => Some(*t),
            Compute::FwdBwd { fwd, .. } => Some(*fwd),
            _ => None,
        };
        if let Some(t) = f {
            fwd_chunk.push(t.stage.0 / pp);
            fwd_mb.push(t.mb.0);
        }
    }
    let total = fwd_chunk.len() as u32;
    let warmup = x.warmup.min(total);
    let all_warmup = warmup >= total;
    let remaining = total - warmup;
    let forward_only = x.forward_only;
    let overlap = x.mode.overlaps();
    let flush = x.mode.flushes();
    let (first, last) = (r == 0, r == pp - 1);
    // `_is_vp_first_stage(c) and is_pp_first_stage`: the model's first stage (no input to
    // receive, no gradient to send); likewise its last stage.
    let model_first = |c: u32| c == 0 && first;
    let model_last = |c: u32| c == v - 1 && last;
    let chunk_of = |k: u32, forward: bool| {
        let c = fwd_chunk[(k % total.max(1)) as usize];
        if forward {
            c
        } else {
            v - 1 - c
        }
    };
    // `recv_tensor_from_previous_stage`.
    let recv_from_previous = |k: u32, forward: bool| -> (bool, u32) {
        let leading = if forward { first } else { last };
        let last_chunk = if forward { v - 1 } else { 0 };
        if !leading {
            return (true, chunk_of(k + 1, forward));
        }
        let (mut recv, next) = if k < pp - 1 {
            (false, chunk_of(k + 1, forward))
        } else {
            (true, chunk_of(k - (pp - 1), forward))
        };
        if next == last_chunk {
            recv = false;
        }
        // A wrapped-around id is only used when `recv` is false.
        let next = if forward {
            next + 1
        } else {
            next.wrapping_sub(1)
        };
        (recv, next)
    };
    // The tensor a forward (backward) of virtual microbatch `k` sends, if any.
    let act_out = |k: u32| {
        let c = chunk_of(k, true);
        (!model_last(c)).then(|| Payload::act(c * pp + r, fwd_mb[k as usize]))
    };
    let grad_out = |k: u32| {
        let c = chunk_of(k, false);
        (!model_first(c)).then(|| Payload::grad(c * pp + r, fwd_mb[k as usize]))
    };
    let recv_act = |comm: &mut Comm, recv: bool, c: u32| recv.then(|| comm.recv_act(c));
    let recv_grad = |comm: &mut Comm, recv: bool, c: u32| recv.then(|| comm.recv_grad(c));

    // Warmup.
    let first_in = (!first).then(|| comm.recv_act(0));
    comm.call_if_any(first_in, None);
    let mut fwd_wait_handles: Option<Handles> = None;
    let mut bwd_wait_handles: Option<Handles> = None;
    let mut recv_prev_wait_handles: Vec<u32> = Vec::new();
    let mut recv_next_wait_handles: Vec<u32> = Vec::new();
    let mut send_next_wait_handle: Option<u32> = None;
    let mut send_prev_wait_handle: Option<u32> = None;

    for k in 0..warmup {
        let cur = chunk_of(k, true);
        if flush && !model_first(cur) && k != 0 && !recv_prev_wait_handles.is_empty() {
            let h = recv_prev_wait_handles.remove(0);
            comm.wait(Some(h));
        }
        let (mut recv_prev, next_fwd_chunk) = recv_from_previous(k, true);
        if k == total - 1 {
            recv_prev = false;
        }
        if flush && !first {
            let rp = recv_act(&mut comm, recv_prev, next_fwd_chunk);
            let mut h = comm.call(None, rp, None, None, true);
            if let Some(b) = h.pop(Key::RecvPrev) {
                recv_prev_wait_handles.push(b);
            }
        }
        cursor.compute(&mut comm);
        let output = act_out(k);
        if !flush {
            // Not overlapped even under overlap_p2p_comm: warmup calls wait at once.
            let rp = recv_act(&mut comm, recv_prev, next_fwd_chunk);
            if k == warmup - 1 && !overlap && !forward_only && !all_warmup {
                let rn = recv_grad(&mut comm, !last, v - 1);
                comm.call(output, rp, None, rn, false);
            } else {
                comm.call(output, rp, None, None, false);
            }
        } else {
            let h = if !first {
                // Send only: the receive was prefetched above.
                comm.call(output, None, None, None, true)
            } else {
                let rp = recv_act(&mut comm, recv_prev, next_fwd_chunk);
                comm.call(output, rp, None, None, true)
            };
            fwd_wait_handles = Some(h);
            after_send(
                &mut comm,
                FORWARD,
                &mut send_next_wait_handle,
                fwd_wait_handles.as_mut(),
                &mut recv_prev_wait_handles,
            );
        }
        if overlap && k == warmup - 1 && !forward_only && !all_warmup {
            let rn = recv_grad(&mut comm, !last, v - 1);
            let h = comm.call(None, None, None, rn, true);
            bwd_wait_handles = Some(h);
            after_send(
                &mut comm,
                BACKWARD,
                &mut send_prev_wait_handle,
                bwd_wait_handles.as_mut(),
                &mut recv_next_wait_handles,
            );
        }
    }

    // Steady state.
    for k in 0..remaining {
        let forward_k = k + warmup;
        let backward_k = k;
        if overlap {
            // pp_pre_forward / pp_pre_backward wait for the receives the step consumes; under
            // combined 1F1B both run before the fused op (`combined_forward_backward_step`).
            let fc = chunk_of(forward_k, true);
            let pre_forward = |comm: &mut Comm, hs: &mut Vec<u32>| {
                if !model_first(fc) && !hs.is_empty() {
                    let h = hs.remove(0);
                    comm.wait(Some(h));
                }
            };
            let bc = chunk_of(backward_k, false);
            let pre_backward = |comm: &mut Comm, hs: &mut Vec<u32>| {
                if !model_last(bc) && !hs.is_empty() {
                    let h = hs.remove(0);
                    comm.wait(Some(h));
                }
            };
            let post_forward = |comm: &mut Comm,
                                fwh: &mut Option<Handles>,
                                snw: &mut Option<u32>,
                                rpw: &mut Vec<u32>| {
                let output = act_out(forward_k);
                let (mut recv_prev, next_fwd_chunk) = recv_from_previous(forward_k, true);
                if k == remaining - 1 {
                    recv_prev = false;
                }
                let rp = recv_act(comm, recv_prev, next_fwd_chunk);
                *fwh = Some(comm.call(output, rp, None, None, true));
                after_send(comm, FORWARD, snw, fwh.as_mut(), rpw);
            };
            let post_backward = |comm: &mut Comm,
                                 bwh: &mut Option<Handles>,
                                 spw: &mut Option<u32>,
                                 rnw: &mut Vec<u32>| {
                let grad = grad_out(backward_k);
                let (recv_next, next_bwd_chunk) = recv_from_previous(backward_k, false);
                let rn = recv_grad(comm, recv_next, next_bwd_chunk);
                *bwh = Some(comm.call(None, None, grad, rn, true));
                after_send(comm, BACKWARD, spw, bwh.as_mut(), rnw);
            };
            if x.combined {
                pre_forward(&mut comm, &mut recv_prev_wait_handles);
                pre_backward(&mut comm, &mut recv_next_wait_handles);
                cursor.compute(&mut comm);
                post_forward(
                    &mut comm,
                    &mut fwd_wait_handles,
                    &mut send_next_wait_handle,
                    &mut recv_prev_wait_handles,
                );
                post_backward(
                    &mut comm,
                    &mut bwd_wait_handles,
                    &mut send_prev_wait_handle,
                    &mut recv_next_wait_handles,
                );
            } else {
                pre_forward(&mut comm, &mut recv_prev_wait_handles);
                cursor.compute(&mut comm);
                post_forward(
                    &mut comm,
                    &mut fwd_wait_handles,
                    &mut send_next_wait_handle,
                    &mut recv_prev_wait_handles,
                );
                pre_backward(&mut comm, &mut recv_next_wait_handles);
                cursor.compute(&mut comm);
                post_backward(
                    &mut comm,
                    &mut bwd_wait_handles,
                    &mut send_prev_wait_handle,
                    &mut recv_next_wait_handles,
                );
            }
        } else {
            cursor.compute(&mut comm);
            if !x.combined {
                cursor.compute(&mut comm);
            }
            let output = act_out(forward_k);
            let grad = grad_out(backward_k);
            let (mut recv_prev, next_fwd_chunk) = recv_from_previous(forward_k, true);
            let (recv_next, next_bwd_chunk) = recv_from_previous(backward_k, false);
            if k == remaining - 1 {
                recv_prev = false;
            }
            let rp = recv_act(&mut comm, recv_prev, next_fwd_chunk);
            let rn = recv_grad(&mut comm, recv_next, next_bwd_chunk);
            comm.call(output, rp, grad, rn, false);
        }
    }

    // Cooldown.
    if !forward_only {
        if let Some(h) = bwd_wait_handles.take() {
            for (_, b) in h.0 {
                comm.wait(Some(b));
            }
        }
        if all_warmup {
            let rn = (!last).then(|| comm.recv_grad(v - 1));
            comm.call_if_any(None, rn);
        }
        for k in remaining..total {
            let cur = chunk_of(k, false);
            if !model_last(cur) && k != 0 && !recv_next_wait_handles.is_empty() {
                let h = recv_next_wait_handles.remove(0);
                comm.wait(Some(h));
            }
            let (mut recv_next, next_bwd_chunk) = recv_from_previous(k, false);
            if k == total - 1 {
                recv_next = false;
            }
            if flush && !last {
                let rn = recv_grad(&mut comm, recv_next, next_bwd_chunk);
                let mut h = comm.call(None, None, None, rn, true);
                if let Some(b) = h.pop(Key::RecvNext) {
                    recv_next_wait_handles.push(b);
                }
            }
            cursor.compute(&mut comm);
            let grad = grad_out(k);
            if flush {
                let h = if !last {
                    comm.call(None, None, grad, None, true)
                } else {
                    let rn = recv_grad(&mut comm, recv_next, next_bwd_chunk);
                    comm.call(None, None, grad, rn, true)
                };
                bwd_wait_handles = Some(h);
                after_send(
                    &mut comm,
                    BACKWARD,
                    &mut send_prev_wait_handle,
                    bwd_wait_handles.as_mut(),
                    &mut recv_next_wait_handles,
                );
            } else {
                let rn = recv_grad(&mut comm, recv_next, next_bwd_chunk);
                comm.call(None, None, grad, rn, false);
            }
        }
        comm.wait(send_prev_wait_handle.take());
    }
    // Whatever compute the loop did not reach (an order not of Megatron's shape) is appended
    // op by op, for the verifier to judge.
    while cursor.cursor < cursor.ops.len() {
        cursor.compute(&mut comm);
    }
    finish(comm)
}

/// `forward_backward_pipelining_without_interleaving`'s communication for one rank: warmup
/// `recv_forward`, forward, `send_forward`; steady `send_forward_recv_backward` and
/// `send_backward_recv_forward`; cooldown `recv_backward`, backward, `send_backward`. Its
/// warmup is `min(pp - r - 1, M)` also when forward-only (the steady loop then sends and
/// receives one forward at a time, the same calls).
pub(crate) fn one_f_one_b(
    pp: u32,
    rank: u32,
    forward_only: bool,
    mode: MegatronP2p,
    shapes: Shapes,
    ops: &[Compute],
) -> Vec<Instr> {
    // Its calls all return before `_communicate` with nothing to do (`always_communicate`
    // stays false).
    let mut comm = Comm::new(rank, pp, 1, mode, shapes, ops.len() * 3);
    let mut cur = Cursor { ops, cursor: 0 };
    let (first, last) = (rank == 0, rank + 1 == pp);
    let m = ops.iter().filter(|o| o.is_forward()).count() as u32;
    let warmup = (pp - rank - 1).min(m);
    let remaining = m - warmup;
    // The tensor the next op sends: its activation (forward) or input gradient (backward).
    let act = |cur: &Cursor<'_>| {
        let t = cur.peek_task()?;
        (!last).then(|| Payload::act(t.stage.0, t.mb.0))
    };
    let grad = |cur: &Cursor<'_>| {
        let t = cur.peek_task()?;
        (!first).then(|| Payload::grad(t.stage.0, t.mb.0))
    };
    let recv_forward = |comm: &mut Comm| {
        let rp = (!first).then(|| comm.recv_act(0));
        comm.call(None, rp, None, None, false);
    };
    for _ in 0..warmup {
        recv_forward(&mut comm);
        let out = act(&cur);
        cur.compute(&mut comm);
        comm.call(out, None, None, None, false);
    }
    if remaining > 0 {
        recv_forward(&mut comm);
    }
    for i in 0..remaining {
        let last_iteration = i + 1 == remaining;
        let out = act(&cur);
        cur.compute(&mut comm);
        if forward_only {
            comm.call(out, None, None, None, false);
            if !last_iteration {
                recv_forward(&mut comm);
            }
        } else {
            let rn = (!last).then(|| comm.recv_grad(0));
            comm.call(out, None, None, rn, false);
            let g = grad(&cur);
            cur.compute(&mut comm);
            if last_iteration {
                comm.call(None, None, g, None, false);
            } else {
                let rp = (!first).then(|| comm.recv_act(0));
                comm.call(None, rp, g, None, false);
            }
        }
    }
    if !forward_only {
        for _ in 0..warmup {
            let rn = (!last).then(|| comm.recv_grad(0));
            comm.call(None, None, None, rn, false);
            let g = grad(&cur);
            cur.compute(&mut comm);
            comm.call(None, None, g, None, false);
        }
    }
    while cur.cursor < cur.ops.len() {
        cur.compute(&mut comm);
    }
    finish(comm)
}

/// The bookkeeping after an overlapped call of one direction (forward: `send_next` and
/// `recv_prev`; backward: `send_prev` and `recv_next`): wait for the previous send of that
/// direction, keep this call's send handle and queue its receive handle.
fn after_send(
    comm: &mut Comm,
    (send, recv): (Key, Key),
    send_wait_handle: &mut Option<u32>,
    handles: Option<&mut Handles>,
    recv_wait_handles: &mut Vec<u32>,
) {
    comm.wait(send_wait_handle.take());
    if let Some(h) = handles {
        *send_wait_handle = h.pop(send);
        if let Some(b) = h.pop(recv) {
            recv_wait_handles.push(b);
        }
    }
    // "isend() copies asynchronously; wait until the copy is done before freeing the source
    // buffer" (deallocate_pipeline_outputs): a forward's send is waited at once.
    if send == Key::SendNext && comm.mode.deallocates_outputs() {
        comm.wait(send_wait_handle.take());
    }
}

const FORWARD: (Key, Key) = (Key::SendNext, Key::RecvPrev);
const BACKWARD: (Key, Key) = (Key::SendPrev, Key::RecvNext);

/// Megatron returns with some sends still in flight (the last `send_next` handle is never
/// waited); they complete once their receiver posts. pipec ends the stream with a wait for
/// each, so every posted op has one completion point: nothing else runs after it on the rank.
fn finish(mut comm: Comm) -> Vec<Instr> {
    let mut pending = comm.overlapped.clone();
    for i in &comm.out {
        if let Instr::Wait { batch } = *i {
            pending[batch as usize] = false;
        }
    }
    for (b, p) in pending.into_iter().enumerate() {
        if p {
            comm.out.push(Instr::Wait { batch: b as u32 });
        }
    }
    comm.out
}
