//! V-Half and V-Min ("Pipeline Parallelism with Controllable Memory", Qi et al., 2024), built
//! the way the authors' code builds them (sail-sg/zero-bubble-pipeline-parallelism,
//! `zerobubble/scheduler/zbv_greedy.py`, `PipelineGraph.create_schedule`):
//!
//! 1. a repeating *building block* (`stable_pattern_v_half` / `stable_pattern_v_min`) gives
//!    each rank a time slot for its four passes of microbatch 0 (forward of chunk 0 and 1,
//!    input-gradient backward of chunk 1 and 0); microbatch `k` repeats them `6k` slots later;
//! 2. two greedy "squeeze" passes (`reorder`) move each pass to the earliest free slot after its
//!    dependencies that does not raise the rank's peak activation memory above the block's
//!    own peak; the first pass places `W` passes in empty slots (`put_w`) and may move
//!    everything, the second only moves the passes after the warmup (`phase 2`);
//! 3. `W` passes are placed in the remaining empty slots (chunk 1's first) and every rank's
//!    order is read off the final slot times.
//!
//! Slot times are integers and every pass takes one slot, so the order depends only on
//! (pp, m) and the building block, not on measured op times. This is our own code for the
//! same algorithm: slot ties are broken by (time, rank, pass type, microbatch), exactly as
//! Python's `min` over those tuples does.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Which building block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Block {
    Half,
    Min,
}

/// Pass types in the order `zbv_greedy.py` numbers them (`names = 'FfBbWw'`).
pub(crate) const F0: usize = 0;
pub(crate) const F1: usize = 1;
pub(crate) const B1: usize = 2;
pub(crate) const B0: usize = 3;
/// `W` of chunk 1 (after `put_w(split_w=True)`), or every `W` when not split.
pub(crate) const W1: usize = 4;
pub(crate) const W0: usize = 5;

/// Slot times: `[rank][type][microbatch]`.
type Times = Vec<Vec<Vec<i64>>>;

/// `stable_pattern_v_min` / `stable_pattern_v_half`: the slot of each pass of microbatch 0.
fn pattern(block: Block, n: i64) -> Vec<[i64; 4]> {
    (0..n)
        .map(|i| match block {
            Block::Min => {
                let gap = if n % 3 == 0 { 2 } else { 0 };
                [i, 2 * n - i - 1, 2 * n + gap + i, 4 * n + gap - i - 1]
            }
            Block::Half => {
                let gap = if n % 2 == 0 { 3 } else { 0 };
                [
                    2 * i,
                    3 * n - i - 2,
                    3 * n + gap + 2 * i - 1,
                    6 * n + gap - i - 2,
                ]
            }
        })
        .collect()
}

/// The next pass of one rank in slot order among the first `types` lists: (time, type).
#[cfg(test)]
fn head(stage: &[Vec<i64>], ptr: &[usize], types: usize) -> Option<(i64, usize)> {
    (0..types)
        .filter_map(|t| stage[t].get(ptr[t]).map(|&time| (time, t)))
        .min()
}

#[cfg(test)]
fn bound(stage: &[Vec<i64>]) -> i64 {
    stage
        .iter()
        .filter_map(|l| l.last())
        .copied()
        .max()
        .unwrap_or(0)
}

/// `put_w`: walk the slots; each empty slot takes one pending `W` (chunk 1's first when
/// split); the rest follow the last slot. Walks the passes and fills the gaps between them, so
/// it costs the rank's passes, not its slots (which span `O(pp + m)`).
fn put_w(stage: &mut Vec<Vec<i64>>, split: bool) {
    debug_assert_eq!(stage.len(), 4);
    let mut passes: Vec<(i64, usize)> = (0..4)
        .flat_map(|t| stage[t].iter().map(move |&time| (time, t)))
        .collect();
    passes.sort_unstable();
    stage.push(Vec::new());
    if split {
        stage.push(Vec::new());
    }
    let mut pending = [0usize; 2];
    // The first slot not walked yet.
    let mut next = 0;
    for (time, t) in passes {
        while next < time {
            let Some(w) = (0..2).find(|&w| pending[w] > 0) else {
                break;
            };
            stage[W1 + w].push(next);
            pending[w] -= 1;
            next += 1;
        }
        if t == B1 || t == B0 {
            pending[if split { t - B1 } else { 0 }] += 1;
        }
        next = time + 1;
    }
    for w in 0..2 {
        while pending[w] > 0 {
            stage[W1 + w].push(next);
            next += 1;
            pending[w] -= 1;
        }
    }
}

/// `mem_of_stage`: peak activations of one rank in slot order; a forward holds one, a `W`
/// frees one; without `W` lists each empty slot runs one pending `W`.
#[cfg(test)]
fn mem_of_stage(stage: &[Vec<i64>]) -> i64 {
    let types = stage.len();
    let has_w = types > 4;
    let last = bound(stage);
    let mut ptr = [0usize; 6];
    let (mut pending, mut cur, mut peak) = (0i64, 0i64, 0i64);
    for i in 0..=last {
        match head(stage, &ptr[..types], types) {
            Some((time, t)) if time == i => {
                ptr[t] += 1;
                cur += MEM[t];
                if t == B1 || t == B0 {
                    pending += 1;
                }
            }
            _ if !has_w && pending > 0 => {
                cur -= 1;
                pending -= 1;
            }
            _ => {}
        }
        peak = peak.max(cur);
    }
    peak
}

/// Every pass of `times` as (rank, type, microbatch), in the order the authors' loops take
/// them: a k-way merge of the per-(rank, type) lists by (slot, rank, type, microbatch), each
/// list entering with its next microbatch when the previous one is taken. When every list is
/// non-decreasing (what `pattern` builds and the squeeze keeps) that is the sorted order of the
/// tuples, found by a counting sort on the slot (stable over a (rank, type, microbatch) walk);
/// otherwise the merge itself runs.
fn slot_order(times: &Times) -> Vec<(usize, usize, usize)> {
    let sorted = times
        .iter()
        .flatten()
        .all(|l| l.windows(2).all(|w| w[0] <= w[1]));
    let (lo, hi) = times
        .iter()
        .flatten()
        .flatten()
        .fold((i64::MAX, i64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let total: usize = times.iter().flatten().map(Vec::len).sum();
    let span = hi.checked_sub(lo).and_then(|d| usize::try_from(d).ok());
    match span {
        Some(span) if sorted && span <= 4 * total + 1024 => {
            let mut start = vec![0usize; span + 2];
            for &x in times.iter().flatten().flatten() {
                start[(x - lo) as usize + 1] += 1;
            }
            for i in 1..start.len() {
                start[i] += start[i - 1];
            }
            let mut out = vec![(0, 0, 0); total];
            for (s, stage) in times.iter().enumerate() {
                for (t, l) in stage.iter().enumerate() {
                    for (mb, &x) in l.iter().enumerate() {
                        let at = &mut start[(x - lo) as usize];
                        out[*at] = (s, t, mb);
                        *at += 1;
                    }
                }
            }
            out
        }
        _ => {
            let mut heap = BinaryHeap::new();
            for (s, stage) in times.iter().enumerate() {
                for (t, l) in stage.iter().enumerate() {
                    if let Some(&time) = l.first() {
                        heap.push(Reverse((time, s, t, 0usize)));
                    }
                }
            }
            let mut out = Vec::with_capacity(total);
            while let Some(Reverse((_, s, t, mb))) = heap.pop() {
                if let Some(&time) = times[s][t].get(mb + 1) {
                    heap.push(Reverse((time, s, t, mb + 1)));
                }
                out.push((s, t, mb));
            }
            out
        }
    }
}

/// `eager_execution_time` with unit costs and no communication time: every pass as early as
/// its dependencies and its rank allow, in slot order. Returns the start slots and each rank's
/// pass order.
fn eager(times: &Times) -> (Times, Vec<Vec<(usize, usize)>>) {
    let n = times.len();
    let mut end: Vec<Vec<Vec<Option<i64>>>> = times
        .iter()
        .map(|s| s.iter().map(|l| vec![None; l.len()]).collect())
        .collect();
    let mut order: Vec<Vec<(usize, usize)>> = vec![Vec::new(); n];
    let get = |end: &Vec<Vec<Vec<Option<i64>>>>, s: usize, t: usize, mb: usize| {
        end[s][t][mb].expect("eager: a dependency runs in a later slot")
    };
    for (s, t, mb) in slot_order(times) {
        let mut dep = 0;
        if (t == F0 || t == B1) && s > 0 {
            dep = dep.max(get(&end, s - 1, t, mb));
        }
        if (t == F1 || t == B0) && s + 1 < n {
            dep = dep.max(get(&end, s + 1, t, mb));
        }
        if t > 0 && t < 4 {
            dep = dep.max(get(&end, s, t - 1, mb));
        }
        if mb > 0 {
            dep = dep.max(get(&end, s, t, mb - 1));
        }
        if let Some(&(pt, pmb)) = order[s].last() {
            dep = dep.max(get(&end, s, pt, pmb));
        }
        end[s][t][mb] = Some(dep + 1);
        order[s].push((t, mb));
    }
    let start = end
        .into_iter()
        .map(|s| {
            s.into_iter()
                .map(|l| l.into_iter().map(|e| e.map_or(0, |e| e - 1)).collect())
                .collect()
        })
        .collect();
    (start, order)
}

/// One rank's memory walk (`mem_of_stage`) kept up to date, so that trying a pass in an
/// earlier slot costs the passes between the change and the point where the walk rejoins the
/// old one, instead of a walk over the whole rank (which makes `reorder` quadratic in `m`).
///
/// It holds the rank's passes, not its slots: a rank's slots span `O(pp + m)` while it has
/// `O(m)` passes, and `reorder` keeps every rank's profile at once, so a table per slot is
/// `pp²` (issue #28). Between two passes live activations only fall (an empty slot runs a
/// pending implicit `W`), so the states right after the passes carry the whole walk's peak.
struct Profile {
    has_w: bool,
    /// The rank's passes in slot order: (slot, pass type).
    ev: Vec<(i64, u8)>,
    /// Walk state right after each pass: (live activations, pending implicit `W`s).
    state: Vec<(i32, i32)>,
    /// Max-tree over `state[i].0`. (i32: a rank holds fewer than 2^31 passes.)
    tree: Vec<i32>,
    size: usize,
}

const MEM: [i64; 5] = [1, 1, 0, 0, -1];

impl Profile {
    fn new(stage: &[Vec<i64>]) -> Self {
        let mut ev: Vec<(i64, u8)> = stage
            .iter()
            .enumerate()
            .flat_map(|(t, l)| l.iter().map(move |&time| (time, t as u8)))
            .collect();
        ev.sort_unstable();
        let size = ev.len().next_power_of_two();
        let mut p = Profile {
            has_w: stage.len() > 4,
            state: vec![(0, 0); ev.len()],
            tree: vec![i32::MIN; 2 * size],
            size,
            ev,
        };
        let (mut st, mut prev) = ((0, 0), -1);
        for i in 0..p.ev.len() {
            let (time, t) = p.ev[i];
            st = p.step(p.gap(st, time - prev - 1), t);
            prev = time;
            p.set(i, st);
        }
        p
    }

    /// The state after a pass of type `t`.
    fn step(&self, (cur, pending): (i32, i32), t: u8) -> (i32, i32) {
        let b = t as usize == B1 || t as usize == B0;
        (cur + MEM[t as usize] as i32, pending + b as i32)
    }

    /// The state after `k` empty slots: each runs one pending implicit `W` (none when the
    /// rank's `W` passes are placed).
    fn gap(&self, (cur, pending): (i32, i32), k: i64) -> (i32, i32) {
        if self.has_w {
            return (cur, pending);
        }
        let d = pending.min(k.clamp(0, i32::MAX as i64) as i32);
        (cur - d, pending - d)
    }

    fn set(&mut self, i: usize, st: (i32, i32)) {
        self.state[i] = st;
        let mut k = i + self.size;
        self.tree[k] = st.0;
        while k > 1 {
            k /= 2;
            self.tree[k] = self.tree[2 * k].max(self.tree[2 * k + 1]);
        }
    }

    /// Max of live activations after passes `lo..hi`.
    fn max(&self, lo: usize, hi: usize) -> i32 {
        let (mut l, mut r) = (lo + self.size, hi + self.size);
        let mut best = i32::MIN;
        while l < r {
            if l & 1 == 1 {
                best = best.max(self.tree[l]);
                l += 1;
            }
            if r & 1 == 1 {
                r -= 1;
                best = best.max(self.tree[r]);
            }
            l /= 2;
            r /= 2;
        }
        best
    }

    /// The number of passes before `slot`.
    fn before(&self, slot: i64) -> usize {
        self.ev.partition_point(|e| e.0 < slot)
    }

    /// Whether no pass runs at `slot`.
    fn is_free(&self, slot: i64) -> bool {
        self.ev.get(self.before(slot)).is_none_or(|e| e.0 != slot)
    }

    /// The walk with the pass at slot `from` moved to the empty slot `to < from`: yields
    /// (index of the pass in the new order, state after it) from the moved pass on until the
    /// walk rejoins the old one after `from`, and returns the index where it rejoined.
    fn rewalk(
        &self,
        from: i64,
        to: i64,
        mut visit: impl FnMut(usize, (i32, i32)),
    ) -> Option<usize> {
        let (jf, jt) = (self.before(from), self.before(to));
        debug_assert!(jt <= jf && self.ev[jf].0 == from);
        let mut st = match jt.checked_sub(1) {
            Some(j) => self.gap(self.state[j], to - self.ev[j].0 - 1),
            None => (0, 0),
        };
        st = self.step(st, self.ev[jf].1);
        visit(jt, st);
        let mut prev = to;
        for k in jt..self.ev.len() {
            if k == jf {
                continue;
            }
            let (time, t) = self.ev[k];
            st = self.step(self.gap(st, time - prev - 1), t);
            prev = time;
            visit(if k < jf { k + 1 } else { k }, st);
            if k > jf && st == self.state[k] {
                return Some(k);
            }
        }
        None
    }

    /// `mem_of_stage` after moving the pass at `from` to `to`.
    fn peak_if_moved(&self, from: i64, to: i64) -> i32 {
        let mut peak = 0.max(self.max(0, self.before(to)));
        let rejoined = self.rewalk(from, to, |_, st| peak = peak.max(st.0));
        if let Some(k) = rejoined {
            peak = peak.max(self.max(k + 1, self.ev.len()));
        }
        peak
    }

    fn peak(&self) -> i32 {
        0.max(self.max(0, self.ev.len()))
    }

    fn commit_move(&mut self, from: i64, to: i64) {
        let mut updates = Vec::new();
        self.rewalk(from, to, |i, st| updates.push((i, st)));
        let (jf, jt) = (self.before(from), self.before(to));
        self.ev[jt..=jf].rotate_right(1);
        self.ev[jt].0 = to;
        for (i, st) in updates {
            self.set(i, st);
        }
    }
}

/// The `k`-th smallest of the union of two sorted lists.
fn kth_of_two(a: &[i64], b: &[i64], k: usize) -> i64 {
    // Take i from a and k + 1 - i from b, the largest of the two prefixes' ends is the answer
    // when the prefixes are the k + 1 smallest.
    let need = k + 1;
    let (mut lo, mut hi) = (need.saturating_sub(b.len()), need.min(a.len()));
    while lo < hi {
        let i = (lo + hi) / 2;
        let j = need - i;
        if j > 0 && i < a.len() && b[j - 1] > a[i] {
            lo = i + 1;
        } else {
            hi = i;
        }
    }
    let i = lo;
    let j = need - i;
    match (
        i.checked_sub(1).map(|x| a[x]),
        j.checked_sub(1).map(|x| b[x]),
    ) {
        (Some(x), Some(y)) => x.max(y),
        (Some(x), None) => x,
        (None, Some(y)) => y,
        (None, None) => unreachable!("k is in range"),
    }
}

/// `reorder`: one greedy squeeze pass (see the module comment).
fn reorder(mut times: Times, consider_w: bool) -> Times {
    if consider_w {
        for s in times.iter_mut() {
            put_w(s, false);
        }
    }
    let n = times.len();
    let m = times.first().map_or(0, |s| s[F0].len());
    let mut profiles: Vec<Profile> = times.iter().map(|s| Profile::new(s)).collect();
    let current_mem = profiles.iter().map(Profile::peak).max().unwrap_or(0);
    let mut phase = 0;
    // A pass only ever moves when it is taken, so the order is that of the slots before.
    for (s, t, mb) in slot_order(&times) {
        let next_time = times[s][t][mb];
        if t == B0 && s == 0 && phase == 0 {
            phase = 1;
        }
        let keep = if phase == 1 {
            if t == F0 && mb + 1 == m {
                phase = 2;
            }
            true
        } else {
            phase == 0 && !consider_w
        };
        if !keep {
            let mut dep = -1;
            if (t == F0 || t == B1) && s > 0 {
                dep = dep.max(times[s - 1][t][mb]);
            }
            if (t == F1 || t == B0) && s + 1 < n {
                dep = dep.max(times[s + 1][t][mb]);
            }
            if t > 0 && t < 4 {
                dep = dep.max(times[s][t - 1][mb]);
            }
            if t == 4 {
                dep = dep.max(kth_of_two(&times[s][B1], &times[s][B0], mb));
            }
            if mb > 0 {
                dep = dep.max(times[s][t][mb - 1]);
            }
            // The passes are taken in slot order, so the rank's passes before `next_time`
            // are exactly the ones already placed: a free slot there is one the original's
            // `occupied` table has not marked.
            let slot = (dep + 1..next_time).find(|&slot| {
                profiles[s].is_free(slot)
                    && profiles[s].peak_if_moved(next_time, slot) <= current_mem
            });
            if let Some(slot) = slot {
                profiles[s].commit_move(next_time, slot);
                times[s][t][mb] = slot;
            }
        }
    }
    if !consider_w {
        for s in times.iter_mut() {
            put_w(s, false);
        }
    }
    eager(&times).0
}

/// `reorder` as written in `zbv_greedy.py` (a full memory walk per candidate slot): the
/// reference the incremental [`reorder`] is tested against.
#[cfg(test)]
fn reorder_naive(mut times: Times, consider_w: bool) -> Times {
    if consider_w {
        for s in times.iter_mut() {
            put_w(s, false);
        }
    }
    let n = times.len();
    let m = times.first().map_or(0, |s| s[F0].len());
    let current_mem = times.iter().map(|s| mem_of_stage(s)).max().unwrap_or(0);
    let mut occupied: Vec<Vec<bool>> = times
        .iter()
        .map(|s| vec![false; bound(s) as usize + 1])
        .collect();
    let mut heap = BinaryHeap::new();
    for (s, stage) in times.iter().enumerate() {
        for (t, l) in stage.iter().enumerate() {
            if let Some(&time) = l.first() {
                heap.push(Reverse((time, s, t, 0usize)));
            }
        }
    }
    let mut phase = 0;
    while let Some(Reverse((next_time, s, t, mb))) = heap.pop() {
        if let Some(&time) = times[s][t].get(mb + 1) {
            heap.push(Reverse((time, s, t, mb + 1)));
        }
        if t == B0 && s == 0 && phase == 0 {
            phase = 1;
        }
        let keep = if phase == 1 {
            if t == F0 && mb + 1 == m {
                phase = 2;
            }
            true
        } else {
            phase == 0 && !consider_w
        };
        if !keep {
            let mut dep = -1;
            if (t == F0 || t == B1) && s > 0 {
                dep = dep.max(times[s - 1][t][mb]);
            }
            if (t == F1 || t == B0) && s + 1 < n {
                dep = dep.max(times[s + 1][t][mb]);
            }
            if t > 0 && t < 4 {
                dep = dep.max(times[s][t - 1][mb]);
            }
            if t == 4 {
                let mut bs: Vec<i64> = times[s][B1].iter().chain(&times[s][B0]).copied().collect();
                bs.sort_unstable();
                dep = dep.max(bs[mb]);
            }
            if mb > 0 {
                dep = dep.max(times[s][t][mb - 1]);
            }
            let mut placed = false;
            for slot in dep + 1..next_time {
                if !occupied[s][slot as usize] {
                    times[s][t][mb] = slot;
                    if mem_of_stage(&times[s]) <= current_mem {
                        placed = true;
                        break;
                    }
                }
            }
            if !placed {
                times[s][t][mb] = next_time;
            }
        }
        occupied[s][times[s][t][mb] as usize] = true;
    }
    if !consider_w {
        for s in times.iter_mut() {
            put_w(s, false);
        }
    }
    eager(&times).0
}

/// Each rank's passes in order as (type, microbatch): types [`F0`], [`F1`], [`B1`], [`B0`],
/// [`W1`], [`W0`]. `pp >= 1`, `m >= 1`.
pub(crate) fn order(block: Block, pp: u32, m: u32) -> Vec<Vec<(usize, usize)>> {
    let times: Times = pattern(block, pp as i64)
        .into_iter()
        .map(|slots| {
            slots
                .iter()
                .map(|&x| (0..m as i64).map(|k| x + 6 * k).collect())
                .collect()
        })
        .collect();
    let strip = |t: Times| -> Times {
        t.into_iter()
            .map(|mut s| {
                s.truncate(4);
                s
            })
            .collect()
    };
    let r1 = strip(reorder(times, true));
    let mut r2 = strip(reorder(r1, false));
    for s in r2.iter_mut() {
        put_w(s, true);
    }
    eager(&r2).1
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn put_w_fills_gaps_then_appends() {
        // F at 0, B at 1 and 3: the W of the B at 1 goes into slot 2, the other after 3.
        let mut s = vec![vec![0], vec![], vec![1], vec![3]];
        put_w(&mut s, true);
        assert_eq!(s[W1], vec![2]);
        assert_eq!(s[W0], vec![4]);
    }

    #[test]
    fn memory_counts_implicit_w_in_gaps() {
        // F F B . B : peak 2; the gap after the first B frees one.
        let s = vec![vec![0], vec![1], vec![2], vec![4]];
        assert_eq!(mem_of_stage(&s), 2);
        let s = vec![vec![0, 1], vec![2], vec![3], vec![5]];
        assert_eq!(mem_of_stage(&s), 3);
    }

    /// The building blocks' own peaks equal the published activation memory (authors' table
    /// at huggingface.co/spaces/sail/pipeline-parallelism-with-controllable-memory: V-Min
    /// `(p+4)//3`, V-Half `(p+2)//2` microbatches of a whole rank's layers). Here the unit is
    /// one of the two half-size chunks, so the figures double.
    #[test]
    fn building_block_memory_is_the_published_figure() {
        for n in 1..=24i64 {
            let peak = |block| {
                pattern(block, n)
                    .into_iter()
                    .map(|s| {
                        let s: Vec<Vec<i64>> = s
                            .iter()
                            .map(|&x| (0..4 * n).map(|k| x + 6 * k).collect())
                            .collect();
                        mem_of_stage(&s)
                    })
                    .max()
                    .unwrap()
            };
            assert_eq!(peak(Block::Half), 2 * ((n + 2) / 2), "v-half, p = {n}");
            assert_eq!(peak(Block::Min), 2 * ((n + 4) / 3), "v-min, p = {n}");
        }
    }

    #[test]
    fn kth_of_two_sorted_lists() {
        let a = [1, 4, 6, 9, 20];
        let b = [2, 3, 10, 11];
        let mut all: Vec<i64> = a.iter().chain(&b).copied().collect();
        all.sort();
        for (k, &want) in all.iter().enumerate() {
            assert_eq!(kth_of_two(&a, &b, k), want);
            assert_eq!(kth_of_two(&b, &a, k), want);
        }
        assert_eq!(kth_of_two(&[], &b, 2), 10);
        assert_eq!(kth_of_two(&a, &[], 4), 20);
    }

    fn initial(block: Block, pp: u32, m: u32) -> Times {
        pattern(block, pp as i64)
            .into_iter()
            .map(|slots| {
                slots
                    .iter()
                    .map(|&x| (0..m as i64).map(|k| x + 6 * k).collect())
                    .collect()
            })
            .collect()
    }

    /// `put_w` as `zbv_greedy.py` writes it, one slot at a time: the reference for the
    /// pass-by-pass [`put_w`].
    fn put_w_dense(stage: &mut Vec<Vec<i64>>, split: bool) {
        let last = bound(stage);
        stage.push(Vec::new());
        if split {
            stage.push(Vec::new());
        }
        let mut pending = [0usize; 2];
        let mut ptr = [0usize; 4];
        let mut i = 0;
        while i <= last {
            match head(stage, &ptr, 4) {
                Some((time, t)) if time == i => {
                    ptr[t] += 1;
                    if t == B1 || t == B0 {
                        pending[if split { t - B1 } else { 0 }] += 1;
                    }
                }
                _ => {
                    if let Some(w) = (0..2).find(|&w| pending[w] > 0) {
                        stage[W1 + w].push(i);
                        pending[w] -= 1;
                    }
                }
            }
            i += 1;
        }
        let mut i = last;
        for w in 0..2 {
            while pending[w] > 0 {
                i += 1;
                stage[W1 + w].push(i);
                pending[w] -= 1;
            }
        }
    }

    /// A rank's lists from distinct slots and their pass types (each list sorted).
    fn stage_of(slots: &[(i64, usize)], types: usize) -> Vec<Vec<i64>> {
        let mut stage = vec![Vec::new(); types];
        for &(time, t) in slots {
            stage[t % types].push(time);
        }
        for l in stage.iter_mut() {
            l.sort_unstable();
        }
        stage
    }

    /// Distinct slots under 96 (sparse or dense), each with a pass type.
    fn random_slots() -> impl Strategy<Value = Vec<(i64, usize)>> {
        proptest::collection::btree_map(0i64..96, 0usize..6, 1..40)
            .prop_map(|m| m.into_iter().collect())
    }

    /// The merge the authors' loops make: a heap of each list's head, the next entering when
    /// its predecessor leaves.
    fn merge_by_heap(times: &Times) -> Vec<(usize, usize, usize)> {
        let mut heap = BinaryHeap::new();
        for (s, stage) in times.iter().enumerate() {
            for (t, l) in stage.iter().enumerate() {
                if let Some(&time) = l.first() {
                    heap.push(Reverse((time, s, t, 0usize)));
                }
            }
        }
        let mut out = Vec::new();
        while let Some(Reverse((_, s, t, mb))) = heap.pop() {
            if let Some(&time) = times[s][t].get(mb + 1) {
                heap.push(Reverse((time, s, t, mb + 1)));
            }
            out.push((s, t, mb));
        }
        out
    }

    proptest! {
        /// The counting sort takes passes in the heap's order: ties across lists, repeated
        /// slots within a list, negative and sparse slots, and unsorted lists (the fallback).
        #[test]
        fn slot_order_is_the_heap_merge(
            raw in proptest::collection::vec(
                proptest::collection::vec(proptest::collection::vec(-20i64..60, 0..12), 1..5),
                1..5,
            ),
            sort in any::<bool>(),
            sparse in any::<bool>(),
        ) {
            let mut times = raw;
            for l in times.iter_mut().flatten() {
                if sparse {
                    l.iter_mut().for_each(|x| *x *= 100_000);
                }
                if sort {
                    l.sort_unstable();
                }
            }
            prop_assert_eq!(slot_order(&times), merge_by_heap(&times));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn put_w_equals_the_slot_walk(slots in random_slots(), split: bool) {
            let mut a = stage_of(&slots, 4);
            let mut b = a.clone();
            put_w(&mut a, split);
            put_w_dense(&mut b, split);
            prop_assert_eq!(a, b);
        }

        /// The sparse profile against the full walk (`mem_of_stage` of the moved rank):
        /// `peak_if_moved` for random moves of a pass to an earlier free slot, and `peak`
        /// after committing some of them.
        #[test]
        fn profile_equals_the_full_walk(
            slots in random_slots(),
            with_w: bool,
            moves in proptest::collection::vec((any::<prop::sample::Index>(), any::<prop::sample::Index>(), any::<bool>()), 0..30),
        ) {
            let types = if with_w { 5 } else { 4 };
            let mut stage = stage_of(&slots, types);
            let mut p = Profile::new(&stage);
            prop_assert_eq!(p.peak() as i64, mem_of_stage(&stage));
            for (pick, dest, commit) in moves {
                let passes: Vec<(i64, usize)> = (0..types)
                    .flat_map(|t| stage[t].iter().map(move |&x| (x, t)))
                    .collect();
                let (from, t) = passes[pick.index(passes.len())];
                let free: Vec<i64> = (0..from).filter(|x| !passes.iter().any(|p| p.0 == *x)).collect();
                if free.is_empty() {
                    continue;
                }
                let to = free[dest.index(free.len())];
                prop_assert!(p.is_free(to) && !p.is_free(from));
                let mut moved = stage.clone();
                let i = moved[t].iter().position(|&x| x == from).unwrap();
                moved[t][i] = to;
                moved[t].sort_unstable();
                prop_assert_eq!(p.peak_if_moved(from, to) as i64, mem_of_stage(&moved), "{} -> {}", from, to);
                if commit {
                    p.commit_move(from, to);
                    stage = moved;
                    prop_assert_eq!(p.peak() as i64, mem_of_stage(&stage));
                    let mut all: Vec<(i64, u8)> = (0..types)
                        .flat_map(|t| stage[t].iter().map(move |&x| (x, t as u8)))
                        .collect();
                    all.sort_unstable();
                    prop_assert_eq!(&p.ev, &all);
                }
            }
        }
    }

    /// The incremental memory walk gives the same slots as `zbv_greedy.py`'s full walk.
    #[test]
    fn incremental_reorder_equals_the_reference() {
        let strip = |t: Times| -> Times {
            t.into_iter()
                .map(|mut s| {
                    s.truncate(4);
                    s
                })
                .collect()
        };
        for block in [Block::Half, Block::Min] {
            for pp in 1..=9u32 {
                for m in [1, 2, 3, pp, pp + 1, 2 * pp + 1, 3 * pp + 2] {
                    let a = reorder(initial(block, pp, m), true);
                    let b = reorder_naive(initial(block, pp, m), true);
                    assert_eq!(a, b, "{block:?} pp {pp} m {m}, first pass");
                    let a2 = reorder(strip(a), false);
                    let b2 = reorder_naive(strip(b), false);
                    assert_eq!(a2, b2, "{block:?} pp {pp} m {m}, second pass");
                }
            }
        }
    }

    #[test]
    fn every_pass_once_per_rank() {
        for block in [Block::Half, Block::Min] {
            for pp in 1..=9u32 {
                for m in [1, 2, 3, pp, 2 * pp + 1, 4 * pp] {
                    let o = order(block, pp, m);
                    assert_eq!(o.len(), pp as usize);
                    for ops in &o {
                        for t in 0..6 {
                            let mbs: Vec<usize> =
                                ops.iter().filter(|x| x.0 == t).map(|x| x.1).collect();
                            assert_eq!(
                                mbs,
                                (0..m as usize).collect::<Vec<_>>(),
                                "{block:?} pp {pp} m {m}"
                            );
                        }
                    }
                }
            }
        }
    }
}
