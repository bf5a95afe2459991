//! Fitting a timed schedule into a memory limit by offloading activations to host memory
//! (issue #30), without moving any compute.
//!
//! PipeOffload (Wan et al., "PipeOffload: Improving Scalability of Pipeline Parallelism with
//! Memory Optimization", ICML 2025; sail-sg `scheduler/offloading.py`) fits its copies onto the
//! timeline of a schedule without copies, so that the makespan does not change, and frees a
//! forward's activations when its offload ends. This planner does the same for any placement
//! and order, and places the copies as instructions whose positional memory count (the
//! verifier's rule, in program order) is what it planned:
//!
//! - each rank has one copy stream; its copies run in program order, so copies are placed at
//!   instruction boundaries in order of their planned start;
//! - an `offload(s, m)` is posted after `fwd(s, m)` at the last boundary the rank reaches no
//!   later than its planned start; a `wait_offload(s, m)` at the first boundary the rank
//!   reaches after its planned end frees the device memory there (no stall);
//! - a `reload(s, m)` is posted at the last boundary reached no later than its planned start,
//!   counts on the device from that position, and ends before the backward that needs it.
//!
//! A copy never starts later than planned (its post and the copy before it are no later), so
//! no backward waits and no wait blocks: the makespan is the timeline's. Durations are the
//! cost model's `K.offload`; with `offload_pair` that is a copy's time while both ranks of the
//! pair copy, so planning with it is safe whatever the partner does.
//!
//! Choice: Belady's rule at the first position over the limit: among the activations live
//! there whose copies fit on the stream, offload the one needed furthest in the future.

use pipec_schedules::{Compute, Task};

/// A compute op of a rank with its planned start and end.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct TimedOp {
    pub op: Compute,
    pub start: f64,
    pub end: f64,
}

/// What the planner needs of a rank.
#[derive(Clone, Debug)]
pub struct RankInput {
    /// The rank's compute ops in program order.
    pub ops: Vec<TimedOp>,
    /// Memory held whatever runs (parameters, optimizer state).
    pub base: f64,
}

/// Every rank's compute ops with their simulated spans (`timeline`, one span per
/// instruction as the simulator gives them) and `base(r)` as the rank's fixed memory.
pub fn inputs(
    program: &pipec_ir::ir::Program,
    timeline: &pipec_cost::timeline::Timeline,
    base: impl Fn(usize) -> f64,
) -> Vec<RankInput> {
    program
        .ranks
        .iter()
        .zip(&timeline.ranks)
        .enumerate()
        .map(|(r, (instrs, spans))| RankInput {
            ops: instrs
                .iter()
                .zip(spans)
                .filter_map(|(i, sp)| {
                    i.as_compute().map(|op| TimedOp {
                        op,
                        start: sp.start,
                        end: sp.end,
                    })
                })
                .collect(),
            base: base(r),
        })
        .collect()
}

/// A memory instruction the plan inserts.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CopyOp {
    Offload,
    WaitOffload,
    Reload,
}

/// One inserted instruction: before compute op `at` of its rank (`at == ops.len()`: at the
/// end), with the copy's planned interval (for a wait, the offload's).
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Insert {
    pub at: usize,
    pub op: CopyOp,
    pub task: Task,
    pub start: f64,
    pub end: f64,
}

/// The plan of one rank.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankPlan {
    /// In program order (by position, then planned start).
    pub inserts: Vec<Insert>,
    /// The positional peak with the inserts.
    pub peak: f64,
}

/// Why a rank cannot fit.
#[derive(Clone, Debug, PartialEq)]
pub struct Infeasible {
    pub rank: usize,
    /// The peak the planner reached.
    pub peak: f64,
}

/// One activation a rank stashes: allocated by its forward, freed by its last backward.
#[derive(Clone, Debug)]
struct Item {
    task: Task,
    fwd: usize,
    /// The first op that needs it back (`bwd` or `bwd_D`).
    need: usize,
    /// The op that frees it (`bwd` or `bwd_W`).
    free: usize,
    act: f64,
    copy: f64,
    /// Offloaded: (offload start, end, wait position, reload start, end, reload position).
    plan: Option<Planned>,
}

#[derive(Copy, Clone, Debug)]
struct Planned {
    off: (f64, f64),
    off_at: usize,
    wait_at: usize,
    rel: (f64, f64),
    rel_at: usize,
}

/// Plan offloads for every rank so that its positional peak is at most `limit`. `act(task)`
/// and `copy(task)` give an activation's memory and its one-way copy time.
pub fn plan(
    ranks: &[RankInput],
    limit: f64,
    act: impl Fn(Task) -> f64,
    copy: impl Fn(Task) -> f64,
) -> Result<Vec<RankPlan>, Infeasible> {
    ranks
        .iter()
        .enumerate()
        .map(|(r, input)| {
            plan_rank(input, limit, &act, &copy).map_err(|peak| Infeasible { rank: r, peak })
        })
        .collect()
}

fn items_of(input: &RankInput, act: &dyn Fn(Task) -> f64, copy: &dyn Fn(Task) -> f64) -> Vec<Item> {
    let ops = &input.ops;
    let mut out: Vec<Item> = Vec::new();
    let mut index = std::collections::HashMap::new();
    for (i, o) in ops.iter().enumerate() {
        match o.op {
            Compute::Fwd(t) => {
                index.insert(t, out.len());
                out.push(Item {
                    task: t,
                    fwd: i,
                    need: usize::MAX,
                    free: usize::MAX,
                    act: act(t),
                    copy: copy(t),
                    plan: None,
                });
            }
            Compute::Bwd(t) | Compute::BwdD(t) => {
                if let Some(&k) = index.get(&t) {
                    let it: &mut Item = &mut out[k];
                    it.need = it.need.min(i);
                    if matches!(o.op, Compute::Bwd(_)) {
                        it.free = it.free.min(i);
                    }
                }
            }
            Compute::BwdW(t) => {
                if let Some(&k) = index.get(&t) {
                    out[k].free = out[k].free.min(i);
                }
            }
            // A fused pair's forward and backward run as one: never a candidate.
            Compute::FwdBwd { fwd, bwd } => {
                for t in [fwd, bwd] {
                    if let Some(&k) = index.get(&t) {
                        out[k].need = 0;
                    }
                }
                index.remove(&fwd);
            }
        }
    }
    out
}

/// The positional live memory of a rank after each event, in program order, and the first
/// position over `limit` as (op index the event precedes or is, value). Events at a position
/// `a`: the inserts before op `a` (waits free, reloads allocate), then op `a` itself.
fn profile(input: &RankInput, items: &[Item]) -> Vec<(usize, f64)> {
    let n = input.ops.len();
    // Per position: delta applied by inserts before the op, delta of the op (alloc, then free).
    // At a position, in program order (see `finish`): waits for offloads posted earlier
    // free first, then reloads allocate, then waits for offloads posted at this position.
    let mut early = vec![0.0f64; n + 1];
    let mut reload = vec![0.0f64; n + 1];
    let mut late = vec![0.0f64; n + 1];
    let mut alloc = vec![0.0f64; n];
    let mut free = vec![0.0f64; n];
    for it in items {
        alloc[it.fwd] += it.act;
        if let Some(p) = it.plan {
            if p.wait_at > p.off_at {
                early[p.wait_at] += it.act;
            } else {
                late[p.wait_at] += it.act;
            }
            reload[p.rel_at] += it.act;
        }
        if it.free < n {
            free[it.free] += it.act;
        }
    }
    let mut live = input.base;
    let mut out = Vec::with_capacity(2 * n + 1);
    for a in 0..=n {
        live -= early[a];
        if reload[a] != 0.0 {
            live += reload[a];
            out.push((a, live));
        }
        live -= late[a];
        if a < n {
            live += alloc[a];
            out.push((a, live));
            live -= free[a];
        }
    }
    out
}

fn peak_of(profile: &[(usize, f64)], base: f64) -> f64 {
    profile.iter().map(|&(_, v)| v).fold(base, f64::max)
}

/// Busy intervals of the copy stream, sorted.
#[derive(Default)]
struct Stream {
    busy: Vec<(f64, f64)>,
}

impl Stream {
    /// The earliest start `>= from` of a gap of length `d`.
    fn earliest(&self, from: f64, d: f64) -> f64 {
        let mut t = from;
        for &(s, e) in &self.busy {
            if e <= t {
                continue;
            }
            if s >= t + d {
                break;
            }
            t = t.max(e);
        }
        t
    }

    /// The latest start of a gap of length `d` ending by `by` and starting at or after `from`.
    fn latest(&self, from: f64, by: f64, d: f64) -> Option<f64> {
        let mut t = by - d;
        for &(s, e) in self.busy.iter().rev() {
            if s >= t + d {
                continue;
            }
            if e <= t {
                break;
            }
            t = t.min(s - d);
        }
        (t >= from).then_some(t)
    }

    fn take(&mut self, iv: (f64, f64)) {
        let k = self.busy.partition_point(|&(s, _)| s < iv.0);
        self.busy.insert(k, iv);
    }
}

/// The last boundary `a` (op index an insert precedes) whose post time is at most `t`, among
/// `lo..=hi`: the rank reaches boundary `a` when op `a - 1` ends (0 at the start).
fn post_at_or_before(ops: &[TimedOp], t: f64, lo: usize, hi: usize) -> Option<usize> {
    let reach = |a: usize| if a == 0 { 0.0 } else { ops[a - 1].end };
    (lo..=hi).rev().find(|&a| reach(a) <= t)
}

/// The first boundary in `lo..=ops.len()` reached at or after `t`.
fn reached_after(ops: &[TimedOp], t: f64, lo: usize) -> usize {
    let reach = |a: usize| if a == 0 { 0.0 } else { ops[a - 1].end };
    (lo..=ops.len())
        .find(|&a| reach(a) >= t)
        .unwrap_or(ops.len())
}

fn plan_rank(
    input: &RankInput,
    limit: f64,
    act: &dyn Fn(Task) -> f64,
    copy: &dyn Fn(Task) -> f64,
) -> Result<RankPlan, f64> {
    let ops = &input.ops;
    let mut items = items_of(input, act, copy);
    let mut stream = Stream::default();
    loop {
        let prof = profile(input, &items);
        let Some(&(j, _)) = prof
            .iter()
            .find(|&&(_, v)| v > limit + 1e-9 * limit.abs().max(1.0))
        else {
            return Ok(finish(&items, peak_of(&prof, input.base)));
        };
        // Candidates live across position j, furthest next use first.
        let mut cands: Vec<usize> = (0..items.len())
            .filter(|&k| {
                let it = &items[k];
                it.plan.is_none()
                    && it.fwd < j
                    && it.need > j
                    && it.need != usize::MAX
                    && it.act > 0.0
            })
            .collect();
        cands.sort_by(|&a, &b| items[b].need.cmp(&items[a].need).then(a.cmp(&b)));
        let mut done = false;
        for k in cands {
            let it = &items[k];
            let fwd_end = ops[it.fwd].end;
            // The offload must have ended by the time the rank reaches position j.
            let reach_j = if j == 0 { 0.0 } else { ops[j - 1].end };
            let s = stream.earliest(fwd_end, it.copy);
            let off = (s, s + it.copy);
            if off.1 > reach_j {
                continue;
            }
            let off_at = match post_at_or_before(ops, off.0, it.fwd + 1, j) {
                Some(a) => a,
                None => continue,
            };
            let wait_at = reached_after(ops, off.1, off_at).max(off_at);
            if wait_at > j {
                continue;
            }
            // The reload: as late as it can, ending before the op that needs it, starting
            // after the rank has passed position j (so j is counted without it).
            let need_start = ops[it.need].start;
            let after_j = ops[j.min(ops.len() - 1)].end;
            let mut tmp = Stream {
                busy: stream.busy.clone(),
            };
            tmp.take(off);
            let Some(rs) = tmp.latest(after_j.max(off.1), need_start, it.copy) else {
                continue;
            };
            let rel = (rs, rs + it.copy);
            let Some(rel_at) = post_at_or_before(ops, rel.0, j + 1, it.need) else {
                continue;
            };
            tmp.take(rel);
            stream = tmp;
            items[k].plan = Some(Planned {
                off,
                off_at,
                wait_at,
                rel,
                rel_at,
            });
            done = true;
            break;
        }
        if !done {
            return Err(peak_of(&profile(input, &items), input.base));
        }
    }
}

fn finish(items: &[Item], peak: f64) -> RankPlan {
    let mut inserts = Vec::new();
    for it in items {
        let Some(p) = it.plan else { continue };
        // A wait carries its offload's interval.
        for (at, op, (start, end)) in [
            (p.off_at, CopyOp::Offload, p.off),
            (p.wait_at, CopyOp::WaitOffload, p.off),
            (p.rel_at, CopyOp::Reload, p.rel),
        ] {
            inserts.push(Insert {
                at,
                op,
                task: it.task,
                start,
                end,
            });
        }
    }
    // Program order: by position; at one position first the waits for offloads posted
    // earlier (they free memory and never stall), then the copies in order of planned start
    // (the copy stream runs them in program order), then a wait for an offload posted at this
    // very position (a copy of zero time).
    let off_at: std::collections::HashMap<Task, usize> = inserts
        .iter()
        .filter(|i| i.op == CopyOp::Offload)
        .map(|i| (i.task, i.at))
        .collect();
    let rank = |i: &Insert| match i.op {
        CopyOp::WaitOffload if off_at[&i.task] < i.at => 0,
        CopyOp::WaitOffload => 2,
        _ => 1,
    };
    inserts.sort_by(|a, b| {
        a.at.cmp(&b.at)
            .then(rank(a).cmp(&rank(b)))
            .then(a.start.total_cmp(&b.start))
            .then(a.op.cmp(&b.op))
            .then(a.task.cmp(&b.task))
    });
    RankPlan { inserts, peak }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 1F1B rank's timeline with unit forward/backward times: `warm` forwards, then pairs.
    fn one_f_one_b(m: u32, warm: u32, f: f64, b: f64) -> RankInput {
        let mut ops = Vec::new();
        let mut t = 0.0;
        let mut push = |op, d: f64, t: &mut f64| {
            ops.push(TimedOp {
                op,
                start: *t,
                end: *t + d,
            });
            *t += d;
        };
        let (mut nf, mut nb) = (0, 0);
        for _ in 0..warm.min(m) {
            push(Compute::Fwd(Task::new(0, nf)), f, &mut t);
            nf += 1;
        }
        while nb < m {
            if nf < m {
                push(Compute::Fwd(Task::new(0, nf)), f, &mut t);
                nf += 1;
            }
            push(Compute::Bwd(Task::new(0, nb)), b, &mut t);
            nb += 1;
        }
        RankInput { ops, base: 0.0 }
    }

    /// An independent check of a plan: copies on one stream in program order, never later
    /// than planned, each offload after its forward and each reload before its need; and the
    /// positional peak recomputed from the instruction list.
    fn check(input: &RankInput, plan: &RankPlan, copy: f64) -> f64 {
        let ops = &input.ops;
        let mut last_end = 0.0f64;
        let mut live = input.base;
        let mut peak = input.base;
        let mut offloaded = std::collections::HashSet::new();
        let mut stashed = std::collections::HashSet::new();
        let mut k = 0;
        for a in 0..=ops.len() {
            while k < plan.inserts.len() && plan.inserts[k].at == a {
                let ins = plan.inserts[k];
                let reach = if a == 0 { 0.0 } else { ops[a - 1].end };
                match ins.op {
                    CopyOp::Offload | CopyOp::Reload => {
                        let start = reach.max(last_end);
                        assert!(start <= ins.start + 1e-12, "{ins:?} starts late");
                        assert!((ins.end - ins.start - copy).abs() < 1e-12);
                        last_end = start + copy;
                        if ins.op == CopyOp::Offload {
                            assert!(stashed.contains(&ins.task), "{ins:?} before its fwd");
                            offloaded.insert(ins.task);
                        } else {
                            assert!(offloaded.remove(&ins.task), "{ins:?} not offloaded");
                            live += 1.0;
                        }
                    }
                    CopyOp::WaitOffload => {
                        assert!(reach >= ins.end - 1e-12, "{ins:?} would stall");
                        live -= 1.0;
                    }
                }
                peak = peak.max(live);
                k += 1;
            }
            if a < ops.len() {
                let o = ops[a];
                match o.op {
                    Compute::Fwd(t) => {
                        stashed.insert(t);
                        live += 1.0;
                        peak = peak.max(live);
                    }
                    Compute::Bwd(t) => {
                        assert!(!offloaded.contains(&t), "{t} used on the host");
                        live -= 1.0;
                    }
                    _ => {}
                }
            }
        }
        assert!(offloaded.is_empty());
        peak
    }

    #[test]
    fn fits_gpipe_like_stash_under_half_the_peak() {
        // All forwards then all backwards: the stash grows to M without offload.
        let m = 8;
        let input = one_f_one_b(m, m, 1.0, 2.0);
        let unlimited = plan(std::slice::from_ref(&input), 100.0, |_| 1.0, |_| 0.5).unwrap();
        assert!(unlimited[0].inserts.is_empty());
        assert_eq!(unlimited[0].peak, 8.0);
        for (limit, copy) in [(4.0, 0.5), (5.0, 1.0), (3.0, 0.25)] {
            let p = plan(std::slice::from_ref(&input), limit, |_| 1.0, |_| copy).unwrap();
            let peak = check(&input, &p[0], copy);
            assert_eq!(peak, p[0].peak);
            assert!(peak <= limit, "{limit}: {peak}");
        }
    }

    #[test]
    fn too_slow_a_link_is_infeasible() {
        let input = one_f_one_b(8, 8, 1.0, 2.0);
        // Copies slower than the forwards cannot free memory in time.
        let e = plan(std::slice::from_ref(&input), 2.0, |_| 1.0, |_| 5.0).unwrap_err();
        assert_eq!(e.rank, 0);
        assert!(e.peak > 2.0);
    }

    #[test]
    fn one_f_one_b_fits_at_a_lower_peak() {
        let input = one_f_one_b(16, 4, 1.0, 2.0);
        let base = plan(std::slice::from_ref(&input), 100.0, |_| 1.0, |_| 1.0).unwrap();
        assert_eq!(base[0].peak, 5.0);
        let p = plan(std::slice::from_ref(&input), 3.0, |_| 1.0, |_| 1.0).unwrap();
        assert_eq!(check(&input, &p[0], 1.0), p[0].peak);
        assert!(p[0].peak <= 3.0);
    }

    /// A random rank: `m` forwards and backwards of one stage in a random valid order,
    /// random durations and idle gaps.
    fn random_rank(seed: u64, m: u32) -> RankInput {
        let mut x = seed | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let (mut nf, mut nb) = (0u32, 0u32);
        let mut ops = Vec::new();
        let mut t = 0.0;
        while nb < m {
            let fwd = nf < m && (nf == nb || next() % 2 == 0);
            let d = 0.5 + (next() % 4) as f64 * 0.5;
            t += (next() % 3) as f64 * 0.25;
            let op = if fwd {
                nf += 1;
                Compute::Fwd(Task::new(0, nf - 1))
            } else {
                nb += 1;
                Compute::Bwd(Task::new(0, nb - 1))
            };
            ops.push(TimedOp {
                op,
                start: t,
                end: t + d,
            });
            t += d;
        }
        RankInput { ops, base: 0.0 }
    }

    proptest::proptest! {
        /// Whatever the timeline, a plan the planner returns is one the rank can run as
        /// planned (checked independently), and within the limit.
        #[test]
        fn plans_run_as_planned(seed in 1u64..u64::MAX, m in 1u32..12, limit in 1u32..8, copy in 1u32..8) {
            let input = random_rank(seed, m);
            let copy = copy as f64 * 0.25;
            let limit = limit as f64;
            if let Ok(p) = plan(std::slice::from_ref(&input), limit, |_| 1.0, |_| copy) {
                let peak = check(&input, &p[0], copy);
                proptest::prop_assert_eq!(peak, p[0].peak);
                proptest::prop_assert!(peak <= limit);
            }
        }
    }
}
