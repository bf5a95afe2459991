//! The zero-bubble authors' greedy scheduler, reimplemented as candidate orders for `tune`.
//!
//! sail-sg/zero-bubble-pipeline-parallelism ships an automatic scheduler for one stage per
//! rank (`Graph.manual_order` in `megatron/core/pipeline_parallel/zerobubble/scheduler/zb.py`,
//! run by `zb.initial_solution` in eight variants; Qi et al., "Zero Bubble Pipeline
//! Parallelism", 2024). Its rules, rewritten here from the description of the algorithm:
//! warmup forwards per stage until the first `bwd_D` can arrive (within the memory limit, then
//! made to decrease along the pipeline), then rounds of one forward per stage and the `bwd_D`s
//! in reverse stage order, `bwd_W`s put where they end before the next input arrives, where a
//! pass would exceed the memory limit, or into a gap no longer than the largest bubble so far.
//! `tune` runs the eight variants as heuristics among its own (`greedy::Heuristic`'s
//! `zb`), so on their placement it is never slower than their scheduler's pick: that pick is
//! one of these orders, and tune keeps the fastest (by makespan; theirs by the longest stage
//! span) before its local search, which only accepts improvements.
//!
//! Memory is theirs too: `mem_f = act`, `mem_b = -(act - act_w)`, `mem_w = -act_w` (their
//! `GraphConfig`; `act_w = act` is their `mem_b = 0` default of `initial_solution`'s
//! callers, and `act_w = act / 2` their examples' split model, `mem_f = 2, mem_b = mem_w =
//! -1`), which is also the verifier's rule (`pipec_ir::ir::activations`).
//!
//! The decisions use their clock (an op ends at the later of the stage's previous op and its
//! producer's end plus comm, plus its cost), with their tie rules, so the orders are theirs op for op
//! (`tests/integration/tune.rs` checks every variant's makespan against their code). The
//! returned plan's times are pipec's list schedule of the orders.

use super::plan::{list_makespan, order_peaks, staircase_applies, Plan};
use super::problem::Problem;
use pipec_schedules::{Compute, Rank, RankOrder, Task};

/// The three flags of their `manual_order`; `initial_solution` runs all eight.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Rules {
    /// `allow_bubble_before_first_b`: warmup forwards until the next one would end after the
    /// first `bwd_D`'s input arrives (otherwise: until the rank's time reaches it).
    pub bubble_before_first_b: bool,
    /// `prioritize_b`: a rank two or more forwards ahead of the next skips its forward when
    /// that would delay the next rank's forward and `bwd_D`.
    pub prioritize_b: bool,
    /// `no_bubble_greedy`: a `bwd_W` that cannot end before the next input still fills a gap
    /// no longer than the largest bubble so far.
    pub no_bubble_greedy: bool,
}

impl Rules {
    /// Their eight variants, in the order `initial_solution` tries them.
    pub fn all() -> Vec<Rules> {
        let mut v = Vec::with_capacity(8);
        for bubble_before_first_b in [true, false] {
            for prioritize_b in [true, false] {
                for no_bubble_greedy in [true, false] {
                    v.push(Rules {
                        bubble_before_first_b,
                        prioritize_b,
                        no_bubble_greedy,
                    });
                }
            }
        }
        v
    }
}

/// Whether their scheduler applies: one direction, one stage per rank (stage s on rank s).
pub fn applies(p: &Problem) -> bool {
    staircase_applies(p) && (0..p.num_stages()).all(|s| p.rank(s) == s)
}

/// Their state while placing ops: per stage the counts of placed F/B/W, the stage's clock,
/// live memory and bubble so far, and every op's end time (0 until placed, as theirs).
struct State<'a> {
    p: &'a Problem,
    m: usize,
    nf: Vec<usize>,
    nb: Vec<usize>,
    nw: Vec<usize>,
    end: Vec<f64>,
    mem: Vec<f64>,
    bubble: Vec<f64>,
    /// The largest of `bubble` (bubbles only grow, so a running maximum).
    max_bubble: f64,
    /// End times: F of (stage, mb) at `s * m + mb`, B at `n * m + s * m + mb`.
    t: Vec<f64>,
    orders: Vec<Vec<Compute>>,
}

impl State<'_> {
    fn tf(&self, s: usize, mb: usize) -> f64 {
        self.t[s * self.m + mb]
    }

    fn tb(&self, s: usize, mb: usize) -> f64 {
        self.t[(self.p.num_stages() + s) * self.m + mb]
    }

    /// Place the next op of `kind` (0 F, 1 B, 2 W) on stage `s`.
    fn put(&mut self, s: usize, kind: u8) {
        let p = self.p;
        let n = p.num_stages();
        let (mb, cost, mem) = match kind {
            0 => (self.nf[s], p.f[s], p.act[s]),
            // Their `mem_b` and `mem_w`: `bwd_D` frees `act - act_w`, `bwd_W` the rest.
            1 => (self.nb[s], p.b[s], -p.freed_at_d(s)),
            _ => (self.nw[s], p.w[s], -p.act_w[s]),
        };
        let mut tmp = self.end[s] + cost;
        let no_bubble = tmp;
        if s > 0 && kind == 0 {
            tmp = tmp.max(self.tf(s - 1, mb) + p.comm + cost);
        }
        if s + 1 < n && kind == 1 {
            tmp = tmp.max(self.tb(s + 1, mb) + p.comm + cost);
        }
        if self.nf[s] > 0 {
            self.bubble[s] += tmp - no_bubble;
            if self.bubble[s] > self.max_bubble {
                self.max_bubble = self.bubble[s];
            }
        }
        self.end[s] = tmp;
        self.mem[s] += mem;
        let task = Task::new(s as u32, mb as u32);
        match kind {
            0 => {
                self.t[s * self.m + mb] = tmp;
                self.nf[s] += 1;
                self.orders[s].push(Compute::Fwd(task));
            }
            1 => {
                self.t[(n + s) * self.m + mb] = tmp;
                self.nb[s] += 1;
                self.orders[s].push(Compute::BwdD(task));
            }
            _ => {
                self.nw[s] += 1;
                self.orders[s].push(Compute::BwdW(task));
            }
        }
    }

    /// Before an op whose input arrives at `arrive`: the `bwd_W`s that end by then, and one
    /// more into the gap under their bubble rule.
    fn fill_w(&mut self, s: usize, arrive: f64, rules: Rules) {
        let w = self.p.w[s];
        while self.nw[s] < self.nb[s] && self.end[s] + w <= arrive {
            self.put(s, 2);
        }
        if self.nw[s] < self.nb[s] && self.end[s] < arrive {
            if arrive - self.end[s] <= self.max_bubble - self.bubble[s] {
                if rules.no_bubble_greedy {
                    self.put(s, 2);
                }
            } else {
                self.put(s, 2);
            }
        }
    }

    /// `bwd_W`s until a pass allocating `need` fits the budget; `false`: it cannot.
    fn make_room(&mut self, s: usize, need: f64, budget: f64) -> bool {
        while self.mem[s] + need > budget {
            if self.nw[s] >= self.nb[s] {
                return false;
            }
            self.put(s, 2);
        }
        true
    }
}

/// Their per-stage orders under `rules` as their runtime runs them, or `None` where their
/// scheduler gives up ("Cannot fit memory") or does not apply.
pub fn orders(p: &Problem, rules: Rules) -> Option<Vec<RankOrder>> {
    if !applies(p) {
        return None;
    }
    let n = p.num_stages();
    let m = p.microbatches as usize;
    // Their default limit without one is 3 * M forwards' memory: never binding.
    let budget: Vec<f64> = (0..n).map(|s| p.budget(p.rank(s))).collect();
    let mut st = State {
        p,
        m,
        nf: vec![0; n],
        nb: vec![0; n],
        nw: vec![0; n],
        end: vec![0.0; n],
        mem: vec![0.0; n],
        bubble: vec![0.0; n],
        max_bubble: 0.0,
        t: vec![0.0; 2 * n * m],
        orders: (0..n).map(|_| Vec::with_capacity(3 * m)).collect(),
    };
    let comm = p.comm;
    for i in 0..m {
        if i == 0 {
            for s in 0..n {
                st.put(s, 0);
            }
            // Warmup forwards per stage, from the last stage back: until the first `bwd_D`'s
            // input can arrive.
            let mut extra = vec![0usize; n];
            let mut last_t = 0.0;
            for s in (0..n).rev() {
                if s == n - 1 {
                    last_t = st.tf(s, 0) + p.b[s];
                    continue;
                }
                let mut mem = st.mem[s];
                let mut cost = st.end[s];
                while st.nf[s] + extra[s] < m && mem + p.act[s] <= budget[s] {
                    let stop = if rules.bubble_before_first_b {
                        cost + p.f[s] > last_t + comm
                    } else {
                        cost >= last_t + comm
                    };
                    if stop {
                        break;
                    }
                    mem += p.act[s];
                    cost += p.f[s];
                    extra[s] += 1;
                }
                last_t = cost.max(last_t + comm) + p.b[s];
            }
            // Strictly fewer than the stage before.
            for s in 1..n {
                while extra[s] > 0 && extra[s] >= extra[s - 1] && st.nf[s] + extra[s] < m {
                    extra[s] -= 1;
                }
            }
            for (s, &k) in extra.iter().enumerate() {
                for _ in 0..k {
                    st.put(s, 0);
                }
            }
            for s in (0..n).rev() {
                st.put(s, 1);
            }
            continue;
        }
        // One forward per stage (unless held back), then the `bwd_D`s from the last stage.
        let mut go = vec![false; n];
        for s in 0..n {
            if st.nf[s] >= m {
                continue;
            }
            if s + 1 < n && st.nf[s] >= st.nf[s + 1] + 2 && rules.prioritize_b {
                let next_plus_fw = st.end[s + 1] + p.f[s + 1] + p.b[s + 1] + comm;
                if st.end[s] >= next_plus_fw {
                    continue;
                }
                let mut w_cost = 0.0;
                let mut w_cnt = 0;
                let mut mem_with_w = st.mem[s] + p.act[s];
                while mem_with_w > budget[s] && st.nw[s] + w_cnt < st.nb[s] {
                    w_cost += p.w[s];
                    mem_with_w -= p.act_w[s];
                    w_cnt += 1;
                }
                if st.end[s] + p.f[s] + w_cost <= next_plus_fw {
                    go[s] = true;
                    continue;
                }
                if next_plus_fw - (st.end[s] + 0.0) <= st.max_bubble - st.bubble[s] {
                    continue;
                }
            }
            go[s] = true;
        }
        // A stage runs its forward only if the next stage does.
        for s in (0..n.saturating_sub(1)).rev() {
            go[s] = go[s] && go[s + 1];
        }
        for s in 0..n {
            if !go[s] {
                continue;
            }
            if !st.make_room(s, p.act[s], budget[s]) {
                return None;
            }
            if s > 0 {
                let arrive = st.tf(s - 1, st.nf[s]) + comm;
                st.fill_w(s, arrive, rules);
            }
            st.put(s, 0);
        }
        for s in (0..n).rev() {
            if st.nb[s] != i || !st.make_room(s, -p.freed_at_d(s), budget[s]) {
                return None;
            }
            if s + 1 < n {
                let arrive = st.tb(s + 1, i) + comm;
                st.fill_w(s, arrive, rules);
            }
            if s == 0 && st.nf[s] == m {
                while st.nw[s] < st.nb[s] {
                    st.put(s, 2);
                }
            }
            st.put(s, 1);
        }
    }
    for s in 0..n {
        while st.nw[s] < m {
            st.put(s, 2);
        }
    }
    // Forwards their rules never placed (seen with a heavy first stage and M = 2pp) keep
    // completion time 0; their runtime orders a stage's passes by completion time
    // (`create_scheduled_nodes`), so it runs them first. So do these orders.
    for s in 0..n {
        if st.nf[s] < m {
            let missing = (st.nf[s]..m).map(|mb| Compute::Fwd(Task::new(s as u32, mb as u32)));
            st.orders[s].splice(0..0, missing);
        }
    }
    Some(
        st.orders
            .into_iter()
            .enumerate()
            .map(|(r, ops)| RankOrder {
                rank: Rank(r as u32),
                warmup: ops.iter().take_while(|o| o.is_forward()).count() as u32,
                ops,
            })
            .collect(),
    )
}

/// Their orders under `rules` as a plan timed by pipec's list schedule, or `None` when their
/// scheduler gives up, the orders cannot run, or they exceed the memory limit (their
/// scheduler checks the limit only before some passes).
pub fn schedule(p: &Problem, rules: Rules) -> Option<Plan> {
    let orders = orders(p, rules)?;
    let (peak, fits) = order_peaks(p, &orders);
    if !fits {
        return None;
    }
    let makespan = list_makespan(p, &orders)?;
    Some(Plan {
        orders,
        makespan,
        peak,
    })
}
