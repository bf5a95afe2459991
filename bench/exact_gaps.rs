//! The gap of the tuner's list scheduler to the exact search on tiny instances (docs/tune.md,
//! "Figures"): one Markdown table on stdout. Minutes in release:
//!
//! ```text
//! cargo run --release -p pipec-tests --example exact_gaps
//! ```
//!
//! (Formerly the `#[ignore]`d test `pipec_tune::exact_gaps`, which asserted nothing.)

use pipec_cost::cost::CostModel;
use pipec_schedules::Placement;
use pipec_tune::{problem::Problem, split};

fn main() {
    println!("| instance | costs | limit | list scheduler | exact | gap | nodes |");
    println!("|---|---|---|---|---|---|---|");
    for cost in [
        "f=1,b=1,w=1",
        "f=1,b=1.5,w=0.5,E.f=2,E.b=1,E.w=1,L.f=1.5,L.b=2.5,L.w=0.5",
    ] {
        for (pl, m, counts) in [
            (Placement::looped(2, 1), 4, vec![1, 1]),
            (Placement::looped(3, 1), 3, vec![1, 1, 1]),
            (Placement::looped(2, 1), 3, vec![2, 1]),
            (Placement::v_shape(2), 2, vec![1, 1, 1, 1]),
            (Placement::bidirectional(2, 2), 4, vec![1, 2]),
        ] {
            let model = CostModel::parse(cost).unwrap();
            let layout = split::layout_of(&counts, 0);
            for limit in [None, Some(3.0)] {
                let p = Problem::new(&model, &layout, pl.clone(), m, limit);
                let Some((plan, _)) = pipec_tune::best_plan(&p) else {
                    continue;
                };
                let e = pipec_tune::exact::exact(
                    &p,
                    Some((plan.makespan, plan.orders.clone())),
                    50_000_000,
                )
                .unwrap();
                println!(
                    "| {:?} pp={} M={m} {} | {} | {} | {} | {}{} | {:.1}% | {} |",
                    pl.kind,
                    pl.pp,
                    split::layout_string(&layout),
                    if cost.contains("E.f") {
                        "uneven"
                    } else {
                        "uniform"
                    },
                    limit.map_or("none".into(), |l| l.to_string()),
                    plan.makespan,
                    e.makespan,
                    if e.proven { "" } else { " (not proven)" },
                    (plan.makespan / e.makespan - 1.0) * 100.0,
                    e.nodes
                );
            }
        }
    }
}
