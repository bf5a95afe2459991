//! The order in which microbatches of different lengths enter the pipeline (issue #38).
//!
//! With lengths, a schedule's bubbles at warmup and cooldown and which activations are alive
//! together depend on which microbatch runs where: ByteScale orders microbatches by cost
//! inside the pipeline, WLB-LLM (OSDI'25) balances them. The tuner weighs, for every schedule
//! it builds, the orders of [`candidates`]: index order, ascending and descending cost, and
//! short-long-short; the winner is the fastest by the simulator of those that fit the memory
//! limit, so it is never slower than any of them.
//!
//! An order is applied the way `pipec compile` applies `CompileRequest::microbatch_order`:
//! the program is renumbered ([`Program::renumber`]: the `k`-th microbatch the schedule runs
//! becomes the user's microbatch `order[k]`), then given the lengths ([`Program::set_lengths`]),
//! so the rank files keep the user's ids and every message carries its microbatch's tokens.

use pipec_cost::cost::CostModel;
use pipec_ir::ir::Program;
use pipec_schedules::layout::LayerKind;
use pipec_schedules::Lengths;

/// Each microbatch's compute cost under `model`, the key the orders sort by: a decoder
/// layer's linear parts (`f + b + w`) times its tokens / `seq`, plus the attention core's
/// (`attn_f + attn_b + attn_w`) times the sum over its sequences of (length / `seq`)^2: the
/// simulator's rule ([`pipec_cost::lengths::Scale`], `seq` as it finds it). Only the ranking
/// matters here; the simulator judges the orders with the full model.
pub fn costs(model: &CostModel, lengths: &Lengths) -> Vec<f64> {
    let scale = pipec_cost::lengths::Scale::of(model, lengths);
    let (l, a) = (
        model.linear(LayerKind::Decoder),
        model.attention(LayerKind::Decoder),
    );
    let (lin, attn) = (l.f + l.b + l.w, a.f + a.b + a.w);
    (0..lengths.microbatches())
        .map(|mb| {
            let (x, q) = scale.factors(mb);
            lin * x + attn * q
        })
        .collect()
}

/// The names of the orders [`candidates`] gives, in the order they are weighed (a tie keeps
/// the first: index order wins ties).
pub const RULES: [&str; 4] = ["index", "ascending", "descending", "short-long-short"];

/// The orders weighed for a schedule over `costs` (one per microbatch), as `(rule, order)`
/// with `order[k]` the user's microbatch that enters `k`-th:
///
/// - `index`: 0, 1, ..., M-1;
/// - `ascending`: by cost, cheapest first, ties by index;
/// - `descending`: by cost, dearest first, ties by index;
/// - `short-long-short`: the ascending order dealt alternately to the front and the back:
///   the 1st, 3rd, 5th, ... cheapest fill positions 0, 1, 2, ... from the front, the 2nd,
///   4th, ... positions M-1, M-2, ... from the back, so the cheapest enter first and last
///   (short warmup and cooldown) and the dearest in the middle (`[a0, a2, a4, ..., a5, a3,
///   a1]` for the ascending order `a`).
///
/// `split`: the first microbatch of a second direction (a bidirectional placement, where a
/// microbatch's id decides the end it enters at): each rule is then applied within each
/// direction's ids, so every microbatch keeps its direction. Orders equal to an earlier one
/// are dropped.
pub fn candidates(costs: &[f64], split: Option<u32>) -> Vec<(&'static str, Vec<u32>)> {
    let m = costs.len() as u32;
    let ranges: Vec<(u32, u32)> = match split {
        Some(h) if h > 0 && h < m => vec![(0, h), (h, m)],
        _ => vec![(0, m)],
    };
    let mut out: Vec<(&'static str, Vec<u32>)> = Vec::new();
    for rule in RULES {
        let mut order = Vec::with_capacity(m as usize);
        for &(lo, hi) in &ranges {
            order.extend(by_rule(rule, costs, lo, hi));
        }
        if !out.iter().any(|(_, o)| *o == order) {
            out.push((rule, order));
        }
    }
    out
}

/// One rule's order of the microbatches `lo..hi`.
fn by_rule(rule: &str, costs: &[f64], lo: u32, hi: u32) -> Vec<u32> {
    let mut asc: Vec<u32> = (lo..hi).collect();
    asc.sort_by(|&a, &b| {
        costs[a as usize]
            .total_cmp(&costs[b as usize])
            .then(a.cmp(&b))
    });
    match rule {
        "index" => (lo..hi).collect(),
        "ascending" => asc,
        "descending" => {
            let mut d: Vec<u32> = (lo..hi).collect();
            d.sort_by(|&a, &b| {
                costs[b as usize]
                    .total_cmp(&costs[a as usize])
                    .then(a.cmp(&b))
            });
            d
        }
        _ => {
            let front: Vec<u32> = asc.iter().step_by(2).copied().collect();
            let back: Vec<u32> = asc.iter().skip(1).step_by(2).copied().collect();
            front.into_iter().chain(back.into_iter().rev()).collect()
        }
    }
}

/// `program` (microbatches numbered in the order the schedule runs them) with `order`
/// applied and `lengths` given: renumbered, then every message sized.
pub fn apply(program: &mut Program, order: &[u32], lengths: &Lengths) {
    program.renumber(order);
    program.set_lengths(Some(lengths.clone()));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The four rules on a small instance, written out by hand.
    #[test]
    fn the_four_orders() {
        let c = [5.0, 1.0, 4.0, 1.0, 9.0];
        let got = candidates(&c, None);
        assert_eq!(
            got,
            vec![
                ("index", vec![0, 1, 2, 3, 4]),
                ("ascending", vec![1, 3, 2, 0, 4]),
                ("descending", vec![4, 0, 2, 1, 3]),
                // ascending 1 3 2 0 4: front 1 2 4, back 3 0 -> 1 2 4 0 3
                ("short-long-short", vec![1, 2, 4, 0, 3]),
            ]
        );
    }

    /// Two directions: each keeps its ids; equal orders are listed once.
    #[test]
    fn per_direction_and_deduplicated() {
        let c = [3.0, 1.0, 2.0, 2.0];
        let got = candidates(&c, Some(2));
        assert_eq!(got[0], ("index", vec![0, 1, 2, 3]));
        assert_eq!(got[1], ("ascending", vec![1, 0, 2, 3]));
        for (_, o) in &got {
            let mut a = o[..2].to_vec();
            a.sort();
            assert_eq!(a, vec![0, 1]);
        }
        let uniform = candidates(&[1.0; 3], None);
        assert_eq!(uniform.len(), 2, "{uniform:?}");
    }
}
