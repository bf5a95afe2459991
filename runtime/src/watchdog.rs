//! The watchdog: every rank publishes what it is doing; a rank whose comm batch waits longer
//! than the timeout (or waits on a peer that has finished) writes a report naming itself, the
//! instruction, what it waits for and what every other rank is doing, then raises the shared
//! abort flag. Every waiting rank wakes up (the transport registers a waker) and stops, so no
//! thread stays blocked and the process can exit non-zero.

use pipec_ir::ir::InstrRef;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// What a rank is doing, as published on the status board.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Status {
    NotStarted,
    /// Running the instruction at this index (compute, or preparing a batch).
    Running(u32),
    /// Waiting for the comm batch that starts at this index.
    Waiting(u32),
    Finished,
    /// Stopped at this index because of a failure (its own or another rank's).
    Stopped(u32),
}

impl Status {
    fn encode(self) -> u64 {
        match self {
            Status::NotStarted => 4,
            Status::Running(i) => (i as u64) << 3,
            Status::Waiting(i) => ((i as u64) << 3) | 1,
            Status::Finished => 2,
            Status::Stopped(i) => ((i as u64) << 3) | 3,
        }
    }

    fn decode(v: u64) -> Self {
        let i = (v >> 3) as u32;
        match v & 7 {
            0 => Status::Running(i),
            1 => Status::Waiting(i),
            2 => Status::Finished,
            3 => Status::Stopped(i),
            _ => Status::NotStarted,
        }
    }
}

/// What went wrong.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// A rank waited past the timeout, or on a peer that had finished.
    Hang,
    /// A received message is not the tensor the receive expects.
    WrongPayload,
    /// An instruction found its inputs missing or its outputs already present: the order of
    /// the streams is wrong.
    Schedule,
    /// The backend failed.
    Compute,
}

/// The first failure of a run, with its report already worded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub kind: FailureKind,
    /// The instruction that detected it.
    pub at: InstrRef,
    pub report: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.report)
    }
}

/// One cache line per rank so that publishing a status does not contend with other ranks.
#[repr(align(64))]
struct Slot(AtomicU64);

type Waker = Box<dyn Fn() + Send + Sync>;

/// Shared by all ranks of one run.
pub struct Watch {
    timeout: Duration,
    aborted: AtomicBool,
    failure: Mutex<Option<Failure>>,
    status: Vec<Slot>,
    wakers: Mutex<Vec<Waker>>,
}

impl Watch {
    pub fn new(world: usize, timeout: Duration) -> Self {
        Watch {
            timeout,
            aborted: AtomicBool::new(false),
            failure: Mutex::new(None),
            status: (0..world)
                .map(|_| Slot(AtomicU64::new(Status::NotStarted.encode())))
                .collect(),
            wakers: Mutex::new(Vec::new()),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Called on abort; must wake every thread blocked in a wait it owns.
    pub fn on_abort(&self, waker: impl Fn() + Send + Sync + 'static) {
        self.wakers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(waker));
    }

    #[inline]
    pub fn set(&self, rank: usize, s: Status) {
        self.status[rank].0.store(s.encode(), Ordering::Relaxed);
    }

    pub fn get(&self, rank: usize) -> Status {
        Status::decode(self.status[rank].0.load(Ordering::Relaxed))
    }

    #[inline]
    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    /// Record `f` as the run's failure unless another rank got there first, raise the abort
    /// flag and wake everyone. Returns whether `f` was the first.
    pub fn fail(&self, f: Failure) -> bool {
        let first = {
            let mut slot = self.failure.lock().unwrap_or_else(|e| e.into_inner());
            let first = slot.is_none();
            if first {
                *slot = Some(f);
            }
            first
        };
        self.aborted.store(true, Ordering::Release);
        for w in self.wakers.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            w();
        }
        first
    }

    pub fn failure(&self) -> Option<Failure> {
        self.failure
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Reset for another run over the same ranks (keeps the wakers).
    pub fn reset(&self) {
        *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = None;
        self.aborted.store(false, Ordering::Release);
        for s in &self.status {
            s.0.store(Status::NotStarted.encode(), Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_round_trips() {
        for s in [
            Status::NotStarted,
            Status::Running(0),
            Status::Running(123_456),
            Status::Waiting(7),
            Status::Finished,
            Status::Stopped(9),
        ] {
            assert_eq!(Status::decode(s.encode()), s);
        }
    }

    #[test]
    fn first_failure_wins_and_wakes() {
        let w = Watch::new(2, Duration::from_secs(1));
        let woke = std::sync::Arc::new(AtomicU64::new(0));
        let w2 = woke.clone();
        w.on_abort(move || {
            w2.fetch_add(1, Ordering::Relaxed);
        });
        let f = |r: u32| Failure {
            kind: FailureKind::Hang,
            at: InstrRef {
                rank: pipec_schedules::Rank(r),
                index: 0,
            },
            report: format!("rank {r}"),
        };
        assert!(w.fail(f(1)));
        assert!(!w.fail(f(0)));
        assert!(w.is_aborted());
        assert_eq!(w.failure().unwrap().report, "rank 1");
        assert_eq!(woke.load(Ordering::Relaxed), 2);
    }
}
