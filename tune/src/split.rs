//! The layer split: how many decoder layers each stage gets, embedding, loss and MTP layers
//! accounted for, and the Megatron layout string that says so.

use pipec_cost::cost::CostModel;
use pipec_schedules::layout::{LayerKind, Layout};
use pipec_schedules::{Placement, StageId};
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// A rank's load, ordered by `total_cmp` then rank.
#[derive(PartialEq)]
struct Load(f64, usize);
impl Eq for Load {}
impl Ord for Load {
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0).then(self.1.cmp(&o.1))
    }
}
impl PartialOrd for Load {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// Time of all three passes of one layer of a kind.
fn layer_time(model: &CostModel, k: LayerKind) -> f64 {
    let c = model.layer(k);
    c.f + c.b + c.w
}

/// The layout with `counts[s]` decoder layers on stage `s`: `E` first, MTP layers and `L` on
/// the last stage.
pub fn layout_of(counts: &[u32], mtp: u32) -> Layout {
    let n = counts.len();
    let stages = counts
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let mut st = Vec::with_capacity(c as usize + 2);
            if i == 0 {
                st.push(LayerKind::Embedding);
            }
            st.extend(std::iter::repeat_n(LayerKind::Decoder, c as usize));
            if i + 1 == n {
                st.extend(std::iter::repeat_n(LayerKind::Mtp, mtp as usize));
                st.push(LayerKind::Loss);
            }
            st
        })
        .collect();
    Layout { text: None, stages }
}

/// Megatron's even split: `num_layers / stages` each, the remainder one more on the middle
/// stages (the first and last carry the embedding and the loss).
pub fn even_counts(stages: usize, num_layers: u32) -> Vec<u32> {
    let base = num_layers / stages as u32;
    let mut rem = (num_layers % stages as u32) as usize;
    let mut counts = vec![base; stages];
    // Hand out the remainder from the middle outwards.
    let mut order: Vec<usize> = (0..stages).collect();
    let mid = (stages as f64 - 1.0) / 2.0;
    order.sort_by(|&a, &b| (a as f64 - mid).abs().total_cmp(&(b as f64 - mid).abs()));
    for &s in &order {
        if rem == 0 {
            break;
        }
        counts[s] += 1;
        rem -= 1;
    }
    counts
}

/// The split that balances time: decoder layers go one at a time to the rank with the least
/// work per microbatch (its stages' embedding, loss, MTP and decoder layers, all three
/// passes), and within a rank to its least loaded stage. `None` when the decoder layer costs
/// nothing (any split is as good; use the even one).
pub fn balanced_counts(
    model: &CostModel,
    placement: &Placement,
    num_layers: u32,
    mtp: u32,
) -> Option<Vec<u32>> {
    let n = placement.num_stages() as usize;
    let pp = placement.pp as usize;
    let t = layer_time(model, LayerKind::Decoder);
    if t <= 0.0 || n == 0 {
        return None;
    }
    let mut fixed = vec![0.0; n];
    fixed[0] += layer_time(model, LayerKind::Embedding);
    fixed[n - 1] +=
        layer_time(model, LayerKind::Loss) + mtp as f64 * layer_time(model, LayerKind::Mtp);
    let rank_of: Vec<usize> = (0..n)
        .map(|s| placement.rank_of_stage(StageId(s as u32)).index())
        .collect();
    let mut rank_load = vec![0.0; pp];
    for s in 0..n {
        rank_load[rank_of[s]] += fixed[s];
    }
    // The least loaded rank, the first of equals as `min_by` picks it, from a heap: a scan of
    // every rank per layer is `O(L pp)`, `pp²` for a model of a few layers per rank.
    let load = |r: usize, k: u32| Load(rank_load[r] + t * k as f64, r);
    let mut per_rank = vec![0u32; pp];
    let mut heap: BinaryHeap<Reverse<Load>> = (0..pp).map(|r| Reverse(load(r, 0))).collect();
    for _ in 0..num_layers {
        let Some(Reverse(Load(_, r))) = heap.pop() else {
            break;
        };
        per_rank[r] += 1;
        heap.push(Reverse(load(r, per_rank[r])));
    }
    let mut stages_of: Vec<Vec<usize>> = vec![Vec::new(); pp];
    for s in 0..n {
        stages_of[rank_of[s]].push(s);
    }
    let mut counts = vec![0u32; n];
    for (r, &layers) in per_rank.iter().enumerate() {
        let stages = &stages_of[r];
        for _ in 0..layers {
            let s = *stages
                .iter()
                .min_by(|&&a, &&b| {
                    (fixed[a] + t * counts[a] as f64).total_cmp(&(fixed[b] + t * counts[b] as f64))
                })
                .expect("every rank holds a stage");
            counts[s] += 1;
        }
    }
    Some(counts)
}

/// The candidate splits of `num_layers` decoder layers over a placement's stages: the
/// balanced one and Megatron's even one (deduplicated).
pub fn candidates(
    model: &CostModel,
    placement: &Placement,
    num_layers: u32,
    mtp: u32,
) -> Vec<Vec<u32>> {
    let n = placement.num_stages() as usize;
    let mut out = Vec::new();
    if let Some(c) = balanced_counts(model, placement, num_layers, mtp) {
        out.push(c);
    }
    let even = even_counts(n, num_layers);
    if !out.contains(&even) {
        out.push(even);
    }
    out
}

/// Decoder layers per stage of a layout.
pub fn decoder_counts(layout: &Layout) -> Vec<u32> {
    layout
        .stages
        .iter()
        .map(|s| s.iter().filter(|&&k| k == LayerKind::Decoder).count() as u32)
        .collect()
}

/// One stage in the layout language: runs of one symbol of 3 or more as `x*n`.
fn stage_text(stage: &[LayerKind]) -> String {
    let mut out = String::new();
    let mut i = 0;
    let mut counted = false;
    while i < stage.len() {
        let k = stage[i];
        let mut j = i;
        while j < stage.len() && stage[j] == k {
            j += 1;
        }
        let run = j - i;
        if counted {
            out.push(',');
        }
        if run >= 3 {
            out.push_str(&format!("{}*{run}", k.symbol()));
            counted = true;
        } else {
            out.extend(std::iter::repeat_n(k.symbol(), run));
            counted = false;
        }
        i = j;
    }
    out
}

/// The Megatron `--pipeline-model-parallel-layout` string of a layout, compressed: runs of a
/// layer as `t*n`, runs of equal stages as `(..|)*n`. pipec's own parser (and Megatron's)
/// reads it back to the same stages.
pub fn layout_string(layout: &Layout) -> String {
    let texts: Vec<String> = layout.stages.iter().map(|s| stage_text(s)).collect();
    let n = texts.len();
    let mut out = String::new();
    let mut i = 0;
    while i < n {
        let mut j = i;
        while j < n && texts[j] == texts[i] {
            j += 1;
        }
        let run = j - i;
        // A run that ends the layout leaves its last stage out of the group (no trailing `|`).
        let grouped = if j == n { run - 1 } else { run };
        if !out.is_empty() && !out.ends_with('|') {
            out.push(',');
        }
        if grouped >= 2 {
            out.push_str(&format!("({}|)*{grouped}", texts[i]));
            if j == n {
                out.push(',');
                out.push_str(&texts[i]);
            }
        } else {
            for (k, t) in texts.iter().enumerate().take(j).skip(i) {
                out.push_str(t);
                if k + 1 < n {
                    out.push('|');
                }
            }
        }
        i = j;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_strings_round_trip() {
        for (counts, mtp) in [
            (vec![3, 2, 2, 2, 2, 2, 2, 1], 0),
            (vec![0, 4, 4, 0], 1),
            (vec![1], 2),
            (vec![5, 5, 5, 5], 0),
            (vec![0, 0, 0], 0),
            (vec![2, 2, 1, 1, 2], 1),
        ] {
            let l = layout_of(&counts, mtp);
            let s = layout_string(&l);
            let back = pipec_schedules::layout::parse(&s).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(back.stages, l.stages, "{s}");
        }
        assert_eq!(
            layout_string(&layout_of(&[3, 2, 2, 2, 2, 2, 2, 2], 0)),
            "Et*3|(tt|)*6,ttL"
        );
    }

    #[test]
    fn balanced_split_moves_layers_off_heavy_ends() {
        let m = CostModel::parse("f=1,b=1,w=1,E.f=3,E.b=3,E.w=0,L.f=3,L.b=3,L.w=0").unwrap();
        let c = balanced_counts(&m, &Placement::looped(4, 1), 16, 0).unwrap();
        assert_eq!(c.iter().sum::<u32>(), 16);
        assert!(c[0] < c[1] && c[3] < c[2], "{c:?}");
        assert_eq!(even_counts(4, 10), vec![2, 3, 3, 2]);
    }
}
