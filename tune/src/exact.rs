//! Exact search for tiny instances: the shortest makespan over *every* combination of per-rank
//! orders of split-backward passes (`fwd`, `bwd_D`, `bwd_W` in any order a rank can run them,
//! not only microbatch order), within the memory limit, by branch and bound.
//!
//! For fixed orders the list schedule (each op as soon as its rank is free and its inputs
//! exist) is the fastest way to run them, so the optimum over orders is the optimum over all
//! schedules. The search fixes ops in nondecreasing order of their list-schedule start (ties
//! by rank): every combination of orders corresponds to exactly one such sequence, so each is
//! visited once. A node is cut when `max over ranks (free time + work left on the rank)`
//! reaches the best makespan found (initially the list scheduler's best plan). Memory follows
//! the verifier's rule: a forward allocates its stage's `act`, the stage's `bwd_W` frees it.
//! All costs must be positive (zero-length ops would make the start order ambiguous).

use super::problem::Problem;
use pipec_schedules::{Compute, Rank, RankOrder, Task};

/// The result of a search.
#[derive(Clone, Debug, PartialEq)]
pub struct Exact {
    pub makespan: f64,
    pub orders: Vec<RankOrder>,
    /// False when the node limit stopped the search (the makespan is then an upper bound).
    pub proven: bool,
    pub nodes: u64,
}

#[derive(Copy, Clone, PartialEq, Eq, Debug)]
enum Kind {
    F,
    B,
    W,
}

#[derive(Copy, Clone, Debug)]
struct Op {
    kind: Kind,
    s: usize,
    mb: usize,
    rank: usize,
    cost: f64,
}

struct Search<'a> {
    p: &'a Problem,
    ops: Vec<Op>,
    m: usize,
    n: usize,
    fend: Vec<f64>,
    bend: Vec<f64>,
    done: Vec<bool>,
    free: Vec<f64>,
    live: Vec<f64>,
    left: Vec<f64>,
    budget: Vec<f64>,
    seq: Vec<Vec<usize>>,
    best: f64,
    best_seq: Option<Vec<Vec<usize>>>,
    nodes: u64,
    limit: u64,
}

const UNSET: f64 = f64::INFINITY;

impl Search<'_> {
    /// Start time of op `i` if its inputs are done, else `None`.
    fn start(&self, i: usize) -> Option<f64> {
        let o = &self.ops[i];
        let (m, n, p) = (self.m, self.n, self.p);
        let ready = match o.kind {
            Kind::F => {
                if o.s == 0 {
                    0.0
                } else {
                    let e = self.fend[(o.s - 1) * m + o.mb];
                    if e == UNSET {
                        return None;
                    }
                    e + p.delay_mb(o.s - 1, o.s, o.mb)
                }
            }
            Kind::B => {
                let fe = self.fend[o.s * m + o.mb];
                if fe == UNSET {
                    return None;
                }
                if o.s + 1 == n {
                    fe
                } else {
                    let be = self.bend[(o.s + 1) * m + o.mb];
                    if be == UNSET {
                        return None;
                    }
                    fe.max(be + p.delay_mb(o.s + 1, o.s, o.mb))
                }
            }
            Kind::W => {
                let be = self.bend[o.s * m + o.mb];
                if be == UNSET {
                    return None;
                }
                be
            }
        };
        Some(ready.max(self.free[o.rank]))
    }

    fn dfs(&mut self, last: (f64, usize), makespan: f64, remaining: usize) {
        self.nodes += 1;
        if remaining == 0 {
            if makespan < self.best - 1e-9 {
                self.best = makespan;
                self.best_seq = Some(self.seq.clone());
            }
            return;
        }
        if self.nodes > self.limit {
            return;
        }
        let bound = (0..self.free.len())
            .map(|r| self.free[r] + self.left[r])
            .fold(makespan, f64::max);
        if bound >= self.best - 1e-9 {
            return;
        }
        // Candidates with their start, sorted by start (most promising first).
        let mut cands: Vec<(f64, usize)> = Vec::new();
        for i in 0..self.ops.len() {
            if self.done[i] {
                continue;
            }
            let Some(st) = self.start(i) else { continue };
            let o = self.ops[i];
            // Nondecreasing (start, rank): each combination of orders is visited once.
            let tol = 1e-9 * last.0.abs().max(1.0);
            let later = st > last.0 + tol || ((st - last.0).abs() <= tol && o.rank >= last.1);
            if !later {
                continue;
            }
            if o.kind == Kind::F && self.live[o.rank] + self.p.act[o.s] > self.budget[o.rank] + 1e-9
            {
                continue;
            }
            cands.push((st, i));
        }
        cands.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (st, i) in cands {
            let o = self.ops[i];
            let end = st + o.cost;
            let (prev_free, slot) = (self.free[o.rank], o.s * self.m + o.mb);
            self.done[i] = true;
            self.free[o.rank] = end;
            self.left[o.rank] -= o.cost;
            self.seq[o.rank].push(i);
            match o.kind {
                Kind::F => {
                    self.fend[slot] = end;
                    self.live[o.rank] += self.p.act[o.s];
                }
                Kind::B => {
                    self.bend[slot] = end;
                    self.live[o.rank] -= self.p.freed_at_d(o.s);
                }
                Kind::W => self.live[o.rank] -= self.p.act_w[o.s],
            }
            self.dfs((st, o.rank), makespan.max(end), remaining - 1);
            match o.kind {
                Kind::F => {
                    self.fend[slot] = UNSET;
                    self.live[o.rank] -= self.p.act[o.s];
                }
                Kind::B => {
                    self.bend[slot] = UNSET;
                    self.live[o.rank] += self.p.freed_at_d(o.s);
                }
                Kind::W => self.live[o.rank] += self.p.act_w[o.s],
            }
            self.seq[o.rank].pop();
            self.left[o.rank] += o.cost;
            self.free[o.rank] = prev_free;
            self.done[i] = false;
            if self.nodes > self.limit {
                return;
            }
        }
    }
}

/// The optimum of a tiny problem (split backward, every order), starting from a known
/// solution `upper` (e.g. the list scheduler's best plan: its makespan and orders), returned
/// when nothing beats it. Stops after `node_limit` nodes. `None` when no order fits the
/// memory limit and no `upper` was given.
pub fn exact(p: &Problem, upper: Option<(f64, Vec<RankOrder>)>, node_limit: u64) -> Option<Exact> {
    let start = upper.as_ref().map_or(f64::INFINITY, |u| u.0);
    let n = p.num_stages();
    let m = p.microbatches as usize;
    let mut ops = Vec::new();
    for s in 0..n {
        for mb in 0..m {
            let rank = p.rank_of(s, mb);
            for (kind, cost) in [(Kind::F, p.f[s]), (Kind::B, p.b[s]), (Kind::W, p.w[s])] {
                ops.push(Op {
                    kind,
                    s,
                    mb,
                    rank,
                    cost,
                });
            }
        }
    }
    let pp = p.pp();
    let mut left = vec![0.0; pp];
    for o in &ops {
        left[o.rank] += o.cost;
    }
    let total = ops.len();
    let mut search = Search {
        p,
        m,
        n,
        fend: vec![UNSET; n * m],
        bend: vec![UNSET; n * m],
        done: vec![false; total],
        free: vec![0.0; pp],
        live: vec![0.0; pp],
        left,
        budget: (0..pp).map(|r| p.budget(r)).collect(),
        seq: vec![Vec::new(); pp],
        best: start + 1e-9,
        best_seq: None,
        nodes: 0,
        limit: node_limit,
        ops,
    };
    search.dfs((0.0, 0), 0.0, total);
    let proven = search.nodes <= node_limit;
    let Some(seq) = search.best_seq else {
        return upper.map(|(makespan, orders)| Exact {
            makespan,
            orders,
            proven,
            nodes: search.nodes,
        });
    };
    let orders = seq
        .iter()
        .enumerate()
        .map(|(r, idx)| {
            let ops: Vec<Compute> = idx
                .iter()
                .map(|&i| {
                    let o = search.ops[i];
                    let t = Task::new(o.s as u32, o.mb as u32);
                    match o.kind {
                        Kind::F => Compute::Fwd(t),
                        Kind::B => Compute::BwdD(t),
                        Kind::W => Compute::BwdW(t),
                    }
                })
                .collect();
            RankOrder {
                rank: Rank(r as u32),
                warmup: ops.iter().take_while(|o| o.is_forward()).count() as u32,
                ops,
            }
        })
        .collect();
    Some(Exact {
        makespan: search.best,
        orders,
        proven,
        nodes: search.nodes,
    })
}
