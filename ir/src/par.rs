//! When a pass over a program is worth threads, and the ways pipec uses them. Scoped std
//! threads only: the work is a handful of coarse pieces (ranks, independent checks), so a
//! thread pool would add a dependency and nothing else.

/// Below this many instructions a pass takes milliseconds, less than starting threads.
const PARALLEL_FROM: u64 = 1 << 16;

/// How many threads a pass over `instructions` instructions is worth: every core for a big
/// program, one for a small one. Size first: asking for the core count reads cgroup files
/// (tens of microseconds).
pub fn threads_for(instructions: u64) -> usize {
    if instructions < PARALLEL_FROM {
        1
    } else {
        cores()
    }
}

/// `(a(), b())`, side by side when `threads > 1`. A panic in either is resumed here.
pub fn join<A: Send, B: Send>(
    threads: usize,
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B,
) -> (A, B) {
    if threads <= 1 {
        let a = a();
        return (a, b());
    }
    std::thread::scope(|s| {
        let a = s.spawn(a);
        let b = b();
        let a = a.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        (a, b)
    })
}

/// `f(i, state)` for every `i` in `0..n` on up to `threads` threads (indices taken in order as
/// threads free up, each thread with its own `state`, a reusable buffer say); the results in
/// order, or the error of the lowest failing index. Once an index fails, higher ones are no
/// longer started.
pub fn try_map<T: Send, S: Default, E: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(usize, &mut S) -> Result<T, E> + Sync,
) -> Result<Vec<T>, E> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    if threads <= 1 || n <= 1 {
        let mut state = S::default();
        return (0..n).map(|i| f(i, &mut state)).collect();
    }
    let next = AtomicUsize::new(0);
    let first_failed = AtomicUsize::new(usize::MAX);
    let slots: Vec<Mutex<Option<Result<T, E>>>> = (0..n).map(|_| Mutex::new(None)).collect();
    let work = || {
        let mut state = S::default();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= n || i > first_failed.load(Ordering::Relaxed) {
                break;
            }
            let r = f(i, &mut state);
            if r.is_err() {
                first_failed.fetch_min(i, Ordering::Relaxed);
            }
            *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..threads.min(n) {
            s.spawn(work);
        }
        work();
    });
    let mut out = Vec::with_capacity(n);
    for slot in slots {
        match slot.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(Ok(v)) => out.push(v),
            Some(Err(e)) => return Err(e),
            None => unreachable!("every index below the first failure is done"),
        }
    }
    Ok(out)
}

/// Every core the machine gives this process (at least one).
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `f(i)` for every `i` in `0..n` on up to `threads` threads (indices taken in order as
/// threads free up); the results in order. [`try_map`] for work that cannot fail.
pub fn map<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    match try_map::<T, (), std::convert::Infallible>(n, threads, |i, _| Ok(f(i))) {
        Ok(v) => v,
        Err(never) => match never {},
    }
}
