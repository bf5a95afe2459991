//! The lockstep lowering's promise, over orders no generator makes: for ANY per-rank compute
//! orders that can run (here: random topological orders of the whole training DAG, projected
//! onto the ranks), the lowered program is valid for `pipec_ir::verify` and runs to the end on the
//! brute-force rendezvous executor. Timing: under blocking rendezvous a message can only pass
//! at an instant when neither end is inside an op; whenever every message has such an instant
//! before its consumer starts, `pipec_cost::simulate` gives exactly the compute orders' makespan
//! (lowering adds no wait), and never less. The compute-order times are computed here by a
//! fixpoint over start times, independently of the lowering's own list schedule.

use pipec_compiler::lower::lower_orders;
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_ir::verify::{verify, VerifyOptions};
use pipec_schedules::{CommPolicy, Compute, Microbatch, Placement, Rank, RankOrder, StageId, Task};
use std::collections::HashMap;

fn task(s: u32, mb: u32) -> Task {
    Task {
        stage: StageId(s),
        mb: Microbatch(mb),
    }
}

/// Every pass of a training step, with the passes each depends on (indices into the list).
fn dag(stages: u32, m: u32, split: bool, forward_only: bool) -> (Vec<Compute>, Vec<Vec<usize>>) {
    let mut ops = Vec::new();
    let mut deps: Vec<Vec<usize>> = Vec::new();
    let mut fwd = vec![vec![0usize; m as usize]; stages as usize];
    let mut bwd = vec![vec![0usize; m as usize]; stages as usize];
    for mb in 0..m {
        for s in 0..stages {
            fwd[s as usize][mb as usize] = ops.len();
            deps.push(if s > 0 {
                vec![fwd[s as usize - 1][mb as usize]]
            } else {
                vec![]
            });
            ops.push(Compute::Fwd(task(s, mb)));
        }
    }
    if forward_only {
        return (ops, deps);
    }
    for mb in 0..m {
        for s in (0..stages).rev() {
            let mut d = vec![fwd[s as usize][mb as usize]];
            if s + 1 < stages {
                d.push(bwd[s as usize + 1][mb as usize]);
            }
            bwd[s as usize][mb as usize] = ops.len();
            deps.push(d);
            if split {
                ops.push(Compute::BwdD(task(s, mb)));
                deps.push(vec![ops.len() - 1]);
                ops.push(Compute::BwdW(task(s, mb)));
            } else {
                ops.push(Compute::Bwd(task(s, mb)));
            }
        }
    }
    (ops, deps)
}

/// A random topological order of the DAG (xorshift over the ready set), projected per rank.
fn random_orders(
    ops: &[Compute],
    deps: &[Vec<usize>],
    placement: &Placement,
    world: u32,
    mut seed: u64,
) -> Vec<RankOrder> {
    let mut waiting: Vec<usize> = deps.iter().map(Vec::len).collect();
    let mut users = vec![Vec::new(); ops.len()];
    for (i, d) in deps.iter().enumerate() {
        for &j in d {
            users[j].push(i);
        }
    }
    let mut ready: Vec<usize> = (0..ops.len()).filter(|&i| waiting[i] == 0).collect();
    let mut orders: Vec<RankOrder> = (0..world)
        .map(|r| RankOrder {
            rank: Rank(r),
            ops: Vec::new(),
            warmup: 0,
        })
        .collect();
    while !ready.is_empty() {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let i = ready.swap_remove((seed % ready.len() as u64) as usize);
        let (_, t) = ops[i].parts().next().unwrap();
        orders[placement.rank_of(t).index()].ops.push(ops[i]);
        for &u in &users[i] {
            waiting[u] -= 1;
            if waiting[u] == 0 {
                ready.push(u);
            }
        }
    }
    orders
}

/// End tick of every op of the orders with `F = B_D = W = 1`, `B = 2`: iterate to the fixpoint
/// `start = max(previous op's end, inputs' ends)` (a Bellman-Ford style relaxation; the orders
/// come from a topological order, so it converges).
fn order_ends(ops: &[Compute], deps: &[Vec<usize>], orders: &[RankOrder]) -> Vec<u64> {
    let index: HashMap<Compute, usize> = ops.iter().enumerate().map(|(i, c)| (*c, i)).collect();
    let mut end = vec![0u64; ops.len()];
    loop {
        let mut changed = false;
        for o in orders {
            let mut free = 0;
            for c in &o.ops {
                let i = index[c];
                let start = deps[i].iter().map(|&j| end[j]).fold(free, u64::max);
                let e = start + cost(c);
                if e != end[i] {
                    end[i] = e;
                    changed = true;
                }
                free = e;
            }
        }
        if !changed {
            return end;
        }
    }
}

fn cost(c: &Compute) -> u64 {
    match c {
        Compute::Bwd(_) => 2,
        _ => 1,
    }
}

/// Whether every cross-rank dependency has an instant between the producer's end and the
/// consumer's start at which neither rank is inside an op: the condition under which blocking
/// rendezvous can follow the compute orders' timing exactly.
fn meeting_points_exist(
    ops: &[Compute],
    deps: &[Vec<usize>],
    end: &[u64],
    placement: &Placement,
) -> bool {
    let rank = |i: usize| placement.rank_of(ops[i].parts().next().unwrap().1).index();
    let inside = |r: usize, t: u64| {
        (0..ops.len()).any(|k| rank(k) == r && end[k] - cost(&ops[k]) < t && t < end[k])
    };
    deps.iter().enumerate().all(|(c, d)| {
        d.iter().all(|&p| {
            let (a, b) = (rank(p), rank(c));
            a == b || (end[p]..=end[c] - cost(&ops[c])).any(|t| !inside(a, t) && !inside(b, t))
        })
    })
}

/// 400 random cases (fixed seed): always valid and runs to the end; never faster than the
/// compute orders; exactly as fast whenever every message has a meeting point.
#[test]
fn lockstep_lowers_any_runnable_orders_deadlock_free() {
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (mut exact, mut meeting) = (0, 0);
    for case in 0..400 {
        let pp = 1 + next(5) as u32;
        let v_shape = next(2) == 0;
        let vpp = 1 + next(2) as u32;
        let m = 1 + next(5) as u32;
        let split = next(2) == 0;
        let forward_only = next(5) == 0;
        let seed = next(u64::MAX - 1) + 1;
        let placement = if v_shape {
            Placement::v_shape(pp)
        } else {
            Placement::looped(pp, vpp)
        };
        let stages = placement.num_stages();
        let (ops, deps) = dag(stages, m, split, forward_only);
        let orders = random_orders(&ops, &deps, &placement, pp, seed);
        let what = format!(
            "case {case}: pp {pp} v-shape {v_shape} vpp {vpp} m {m} split {split} forward-only {forward_only}"
        );
        let program = lower_orders(&placement, m, forward_only, CommPolicy::Lockstep, &orders);
        let report = verify(&program, &VerifyOptions::default());
        assert!(report.is_valid(), "{what}: {}", report.verdict_line());
        let run = pipec_tests::reference::execute(&program);
        assert!(run.finished, "{what}: {:?}", run.problems);
        let costs = StageCosts::uniform(&CostModel::default(), stages);
        let sim = pipec_cost::simulate::simulate(&pipec_tests::verified(&program), &costs).unwrap();
        let end = order_ends(&ops, &deps, &orders);
        let order = end.iter().copied().max().unwrap_or(0) as f64;
        assert!(sim.summary.makespan >= order, "{what}");
        if meeting_points_exist(&ops, &deps, &end, &placement) {
            meeting += 1;
            assert_eq!(sim.summary.makespan, order, "{what}");
        }
        exact += usize::from(sim.summary.makespan == order);
    }
    eprintln!(
        "lockstep on random orders: 400 cases, {meeting} with meeting points, {exact} as fast as the orders"
    );
    assert!(
        meeting >= 100,
        "too few cases test the exact timing: {meeting}"
    );
}

/// The oracle is not vacuous: the same orders lowered with one fused batch per op (which
/// looped BFS is known to deadlock under) fail somewhere in a small sample.
#[test]
fn fused_per_op_fails_on_some_random_orders() {
    let placement = Placement::looped(3, 2);
    let (ops, deps) = dag(6, 4, false, false);
    let failures = (1..200u64)
        .filter(|&seed| {
            let orders = random_orders(&ops, &deps, &placement, 3, seed * 7919);
            let p = lower_orders(&placement, 4, false, CommPolicy::FusedPerOp, &orders);
            !verify(&p, &VerifyOptions::default()).is_valid()
        })
        .count();
    assert!(failures > 0);
}
