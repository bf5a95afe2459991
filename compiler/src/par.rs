//! When a pass over a program is worth threads, and the two ways pipec uses them. Scoped std
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
        std::thread::available_parallelism().map_or(1, |n| n.get())
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
