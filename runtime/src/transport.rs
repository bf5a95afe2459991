//! In-process point-to-point transport with the semantics of NCCL blocking groups under
//! rendezvous (the strictest NCCL behaviour, docs/design.md rule 4):
//!
//! - A comm batch (one `ncclGroupStart/End`, one `batch_isend_irecv`) posts all its ops at once
//!   and completes only when every op is matched: a send when its receive has been posted, a
//!   receive when its send has been posted. A send never completes on its own, whatever the
//!   size: no eager buffering.
//! - Between an ordered pair of ranks, the k-th send matches the k-th receive (NCCL's FIFO
//!   order per peer and communicator; torch's P2P with tag 0 does the same).
//! - On receipt the sender's payload tag must equal what the receive expects; a mismatch is an
//!   error naming both instructions, never a silently wrong tensor.
//!
//! Waits are bounded by the [`Watch`]'s timeout and end early when the run aborts or when a
//! peer the batch waits for has finished (it will never post again).

use crate::backend::{CommError, CommOp, Dir, Pending};
use crate::watchdog::Watch;
use pipec_ir::ir::Payload;
use pipec_schedules::Rank;
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

struct Msg<T> {
    payload: Payload,
    /// The sending instruction's index on its rank.
    at: u32,
    tensor: T,
}

/// The FIFO between an ordered pair (from, to).
struct Pair<T> {
    sends_posted: u64,
    recvs_posted: u64,
    /// Messages sent and not yet taken, by their send sequence number: the k-th receive
    /// takes message k whenever it completes (a receive left in flight may complete after
    /// later ones).
    queue: HashMap<u64, Msg<T>>,
}

struct State<T> {
    world: usize,
    pairs: Vec<Pair<T>>,
    finished: Vec<bool>,
}

impl<T> State<T> {
    fn pair(&mut self, from: usize, to: usize) -> &mut Pair<T> {
        &mut self.pairs[from * self.world + to]
    }

    /// What `op` (posted by `rank`) still waits for, if anything.
    fn pending(&mut self, rank: usize, op: &CommOp<T>) -> Option<Pending> {
        let peer = op.peer.index();
        let peer_posted = match op.dir {
            Dir::Send => self.pair(rank, peer).recvs_posted,
            Dir::Recv => self.pair(peer, rank).sends_posted,
        };
        (peer_posted <= op.seq).then_some(Pending {
            at: op.at,
            dir: op.dir,
            peer: op.peer,
            seq: op.seq,
            peer_posted,
        })
    }
}

pub struct Transport<T> {
    world: usize,
    state: Mutex<State<T>>,
    /// One per rank: a rank waits on its own.
    cvs: Vec<Condvar>,
    watch: Arc<Watch>,
}

impl<T: Send + 'static> Transport<T> {
    /// A transport for `world` ranks; registers with `watch` so an abort wakes every waiter.
    pub fn new(world: usize, watch: Arc<Watch>) -> Arc<Self> {
        let t = Arc::new(Transport {
            world,
            state: Mutex::new(State {
                world,
                pairs: (0..world * world)
                    .map(|_| Pair {
                        sends_posted: 0,
                        recvs_posted: 0,
                        queue: HashMap::new(),
                    })
                    .collect(),
                finished: vec![false; world],
            }),
            cvs: (0..world).map(|_| Condvar::new()).collect(),
            watch: watch.clone(),
        });
        let weak = Arc::downgrade(&t);
        watch.on_abort(move || {
            if let Some(t) = weak.upgrade() {
                t.wake_all();
            }
        });
        t
    }
}

impl<T> Transport<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wake every waiter (taking the lock first, so a waiter between its checks and its wait
    /// cannot miss the wake-up).
    pub fn wake_all(&self) {
        let _g = self.lock();
        for cv in &self.cvs {
            cv.notify_all();
        }
    }

    /// `rank` will post nothing more.
    pub fn finish(&self, rank: Rank) {
        let mut st = self.lock();
        st.finished[rank.index()] = true;
        drop(st);
        for cv in &self.cvs {
            cv.notify_all();
        }
    }

    /// Forget all traffic, for the next step. Call only when no rank is inside `exchange`.
    pub fn reset(&self) {
        let mut st = self.lock();
        for p in &mut st.pairs {
            p.sends_posted = 0;
            p.recvs_posted = 0;
            p.queue.clear();
        }
        st.finished.iter_mut().for_each(|f| *f = false);
    }

    /// Post `ops` as one batch of `rank` and block until the whole batch completes.
    pub fn exchange(&self, rank: Rank, ops: &mut [CommOp<T>]) -> Result<(), CommError> {
        self.post(rank, ops)?;
        self.complete(rank, ops)
    }

    /// Post `ops` as one batch of `rank` without waiting (`isend`/`irecv` left in flight):
    /// sends hand over their tensors and every op takes its place in its channel's FIFO.
    pub fn post(&self, rank: Rank, ops: &mut [CommOp<T>]) -> Result<(), CommError> {
        let me = rank.index();
        // Every op is checked before any is posted, so a refused batch leaves no trace.
        if let Some(op) = ops
            .iter()
            .find(|op| op.peer.index() >= self.world || op.peer.index() == me)
        {
            // Refused by the loader's checks; kept as an error rather than a panic.
            return Err(CommError::Stalled {
                pending: vec![Pending {
                    at: op.at,
                    dir: op.dir,
                    peer: op.peer,
                    seq: 0,
                    peer_posted: 0,
                }],
                waited: Default::default(),
                peer_finished: Some(op.peer),
            });
        }
        let mut st = self.lock();
        for op in ops.iter_mut() {
            let peer = op.peer.index();
            match op.dir {
                Dir::Send => {
                    let tensor = op.tensor.take().expect("a send carries its tensor");
                    let pair = st.pair(me, peer);
                    op.seq = pair.sends_posted;
                    pair.sends_posted += 1;
                    pair.queue.insert(
                        op.seq,
                        Msg {
                            payload: op.payload,
                            at: op.at,
                            tensor,
                        },
                    );
                }
                Dir::Recv => {
                    let pair = st.pair(peer, me);
                    op.seq = pair.recvs_posted;
                    pair.recvs_posted += 1;
                }
            }
        }
        drop(st);
        for op in ops.iter() {
            self.cvs[op.peer.index()].notify_all();
        }
        Ok(())
    }

    /// Block until every op of a batch `rank` posted with [`Transport::post`] is matched, then
    /// take the received messages, checking what arrived.
    pub fn complete(&self, rank: Rank, ops: &mut [CommOp<T>]) -> Result<(), CommError> {
        let me = rank.index();
        let mut st = self.lock();
        let start = Instant::now();
        let timeout = self.watch.timeout();
        loop {
            let mut pending = Vec::new();
            for op in ops.iter() {
                if let Some(p) = st.pending(me, op) {
                    pending.push(p);
                }
            }
            if pending.is_empty() {
                break;
            }
            if self.watch.is_aborted() {
                return Err(CommError::Aborted);
            }
            let waited = start.elapsed();
            let dead = pending
                .iter()
                .map(|p| p.peer)
                .find(|p| st.finished[p.index()]);
            if dead.is_some() || waited >= timeout {
                return Err(CommError::Stalled {
                    pending,
                    waited,
                    peer_finished: dead,
                });
            }
            st = self.cvs[me]
                .wait_timeout(st, timeout - waited)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        // Every op is matched: take the messages, in order, checking what arrived.
        for op in ops.iter_mut().filter(|o| o.dir == Dir::Recv) {
            let peer = op.peer;
            let msg = st
                .pair(peer.index(), me)
                .queue
                .remove(&op.seq)
                .expect("a matched receive has its message queued");
            if msg.payload != op.payload {
                return Err(CommError::WrongPayload {
                    recv_at: op.at,
                    expected: op.payload,
                    peer,
                    send_at: msg.at,
                    got: msg.payload,
                });
            }
            op.tensor = Some(msg.tensor);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn op(at: u32, dir: Dir, peer: u32, payload: Payload, t: Option<u32>) -> CommOp<u32> {
        CommOp {
            at,
            dir,
            peer: Rank(peer),
            payload,
            tensor: t,
            seq: 0,
            tokens: None,
            slot: None,
        }
    }

    fn setup(timeout_ms: u64) -> (Arc<Watch>, Arc<Transport<u32>>) {
        let w = Arc::new(Watch::new(2, Duration::from_millis(timeout_ms)));
        let t = Transport::new(2, w.clone());
        (w, t)
    }

    /// Two ranks whose batches are each a lone send to the other: with eager buffering of small
    /// messages this would pass; under rendezvous it must not complete.
    #[test]
    fn crossing_lone_sends_deadlock_under_rendezvous() {
        let (_w, t) = setup(100);
        let results: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u32)
                .map(|r| {
                    let t = t.clone();
                    s.spawn(move || {
                        let mut ops = [op(0, Dir::Send, 1 - r, Payload::act(r, 0), Some(r))];
                        t.exchange(Rank(r), &mut ops)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Err(CommError::Stalled {
                    pending,
                    peer_finished: None,
                    ..
                }) => {
                    assert_eq!(pending.len(), 1);
                    assert_eq!(pending[0].dir, Dir::Send);
                    assert_eq!(pending[0].peer, Rank(1 - r as u32));
                    assert_eq!(pending[0].peer_posted, 0);
                }
                other => panic!("rank {r}: expected a stall, got {other:?}"),
            }
        }
    }

    /// Regression: a receive left in flight (posted, completed later) took whatever message was
    /// at the front of its channel when it completed, not the one it was matched with when
    /// posted: a later blocking receive on the same channel had taken its message first. Found
    /// by `verify_vs_run` on mutated overlap-mode programs.
    #[test]
    fn in_flight_receive_completing_late_takes_its_own_message() {
        let (_w, t) = setup(5_000);
        std::thread::scope(|s| {
            let t0 = t.clone();
            s.spawn(move || {
                for mb in 0..2 {
                    let mut ops = [op(mb, Dir::Send, 1, Payload::act(0, mb), Some(100 + mb))];
                    t0.exchange(Rank(0), &mut ops).unwrap();
                }
            });
            let t1 = t.clone();
            s.spawn(move || {
                let mut first = [op(0, Dir::Recv, 0, Payload::act(0, 0), None)];
                t1.post(Rank(1), &mut first).unwrap();
                let mut second = [op(1, Dir::Recv, 0, Payload::act(0, 1), None)];
                t1.exchange(Rank(1), &mut second).unwrap();
                t1.complete(Rank(1), &mut first).unwrap();
                assert_eq!(first[0].tensor, Some(100));
                assert_eq!(second[0].tensor, Some(101));
            });
        });
    }

    /// The same two sends, each fused with the matching receive in one batch, complete.
    #[test]
    fn fused_send_recv_batches_complete() {
        let (_w, t) = setup(5_000);
        std::thread::scope(|s| {
            for r in 0..2u32 {
                let t = t.clone();
                s.spawn(move || {
                    let mut ops = [
                        op(0, Dir::Send, 1 - r, Payload::act(r, 0), Some(10 + r)),
                        op(1, Dir::Recv, 1 - r, Payload::act(1 - r, 0), None),
                    ];
                    t.exchange(Rank(r), &mut ops).unwrap();
                    assert_eq!(ops[1].tensor, Some(10 + (1 - r)));
                });
            }
        });
    }

    /// A lone send stays blocked until the receive is posted, then completes; the k-th send
    /// meets the k-th receive whatever the batching on either side.
    #[test]
    fn fifo_matching_across_batches() {
        let (_w, t) = setup(5_000);
        std::thread::scope(|s| {
            let t0 = t.clone();
            s.spawn(move || {
                let mut ops = [
                    op(0, Dir::Send, 1, Payload::act(0, 0), Some(100)),
                    op(1, Dir::Send, 1, Payload::act(0, 1), Some(101)),
                    op(2, Dir::Send, 1, Payload::act(0, 2), Some(102)),
                ];
                t0.exchange(Rank(0), &mut ops).unwrap();
            });
            let t1 = t.clone();
            s.spawn(move || {
                let mut a = [op(0, Dir::Recv, 0, Payload::act(0, 0), None)];
                t1.exchange(Rank(1), &mut a).unwrap();
                let mut b = [
                    op(1, Dir::Recv, 0, Payload::act(0, 1), None),
                    op(2, Dir::Recv, 0, Payload::act(0, 2), None),
                ];
                t1.exchange(Rank(1), &mut b).unwrap();
                assert_eq!(a[0].tensor, Some(100));
                assert_eq!((b[0].tensor, b[1].tensor), (Some(101), Some(102)));
                assert_eq!((a[0].seq, b[0].seq, b[1].seq), (0, 1, 2));
            });
        });
    }

    #[test]
    fn unmatched_send_waits_then_times_out() {
        let (_w, t) = setup(50);
        let mut ops = [op(3, Dir::Send, 1, Payload::act(0, 0), Some(1))];
        match t.exchange(Rank(0), &mut ops) {
            Err(CommError::Stalled {
                pending, waited, ..
            }) => {
                assert_eq!(pending[0].at, 3);
                assert!(waited >= Duration::from_millis(50));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn wrong_payload_names_both_instructions() {
        let (_w, t) = setup(5_000);
        std::thread::scope(|s| {
            let t0 = t.clone();
            s.spawn(move || {
                let mut ops = [op(4, Dir::Send, 1, Payload::act(0, 1), Some(1))];
                t0.exchange(Rank(0), &mut ops).unwrap();
            });
            let mut ops = [op(9, Dir::Recv, 0, Payload::act(0, 0), None)];
            match t.exchange(Rank(1), &mut ops) {
                Err(CommError::WrongPayload {
                    recv_at: 9,
                    send_at: 4,
                    expected,
                    got,
                    peer: Rank(0),
                }) => {
                    assert_eq!(expected, Payload::act(0, 0));
                    assert_eq!(got, Payload::act(0, 1));
                }
                other => panic!("{other:?}"),
            }
        });
    }

    #[test]
    fn waiting_on_a_finished_peer_fails_at_once() {
        let (_w, t) = setup(60_000);
        t.finish(Rank(1));
        let mut ops = [op(0, Dir::Recv, 1, Payload::grad(1, 0), None)];
        match t.exchange(Rank(0), &mut ops) {
            Err(CommError::Stalled {
                peer_finished: Some(Rank(1)),
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn abort_wakes_a_waiter() {
        let (w, t) = setup(60_000);
        std::thread::scope(|s| {
            let t0 = t.clone();
            let h = s.spawn(move || {
                let mut ops = [op(0, Dir::Recv, 1, Payload::grad(1, 0), None)];
                t0.exchange(Rank(0), &mut ops)
            });
            // Abort once the waiter is blocked (or before: either way it must return).
            std::thread::sleep(Duration::from_millis(20));
            w.fail(crate::watchdog::Failure {
                kind: crate::watchdog::FailureKind::Compute,
                at: pipec_ir::ir::InstrRef {
                    rank: Rank(1),
                    index: 0,
                },
                report: "test".into(),
            });
            assert_eq!(h.join().unwrap(), Err(CommError::Aborted));
        });
    }
}
