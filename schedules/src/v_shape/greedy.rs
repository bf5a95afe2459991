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
fn head(stage: &[Vec<i64>], ptr: &[usize], types: usize) -> Option<(i64, usize)> {
    (0..types)
        .filter_map(|t| stage[t].get(ptr[t]).map(|&time| (time, t)))
        .min()
}

fn bound(stage: &[Vec<i64>]) -> i64 {
    stage
        .iter()
        .filter_map(|l| l.last())
        .copied()
        .max()
        .unwrap_or(0)
}

/// `put_w`: walk the slots; each empty slot takes one pending `W` (chunk 1's first when
/// split); the rest follow the last slot.
fn put_w(stage: &mut Vec<Vec<i64>>, split: bool) {
    debug_assert_eq!(stage.len(), 4);
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

/// `mem_of_stage`: peak activations of one rank in slot order; a forward holds one, a `W`
/// frees one; without `W` lists each empty slot runs one pending `W`.
fn mem_of_stage(stage: &[Vec<i64>]) -> i64 {
    const MEM: [i64; 5] = [1, 1, 0, 0, -1];
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
    let mut heap = BinaryHeap::new();
    for (s, stage) in times.iter().enumerate() {
        for (t, l) in stage.iter().enumerate() {
            if let Some(&time) = l.first() {
                heap.push(Reverse((time, s, t, 0usize)));
            }
        }
    }
    let get = |end: &Vec<Vec<Vec<Option<i64>>>>, s: usize, t: usize, mb: usize| {
        end[s][t][mb].expect("eager: a dependency runs in a later slot")
    };
    while let Some(Reverse((_, s, t, mb))) = heap.pop() {
        if let Some(&time) = times[s][t].get(mb + 1) {
            heap.push(Reverse((time, s, t, mb + 1)));
        }
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

/// `reorder`: one greedy squeeze pass (see the module comment).
fn reorder(mut times: Times, consider_w: bool) -> Times {
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
