//! The simulator (`pipec_cost::simulate`) on lowered programs of the built-in kinds: what
//! its own unit tests cannot build, since the cost crate knows nothing of lowering.

use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{figures, simulate_unverified};
use pipec_ir::verify::Unverified;

fn costs(spec: &str, n: u32) -> StageCosts {
    StageCosts::uniform(&CostModel::parse(spec).unwrap(), n)
}

/// `rank.R` stretches rank R's compute only. 1F1B, pp=2, M=2, `f = b = w = 1`, rank 1 twice
/// as slow, by hand: rank 1 runs F0 1-3, B0 3-7, F1 7-9, B1 9-13; rank 0 F0 0-1, F1 1-2,
/// B0 7-9, B1 13-15.
#[test]
fn rank_factor_stretches_that_ranks_compute() {
    use pipec_schedules::{generate, Limits, ScheduleKind, ScheduleSpec};
    let sched = generate(
        &ScheduleSpec::new(ScheduleKind::OneFOneB, 2, 1, 2),
        &Limits::DEFAULT,
    )
    .unwrap();
    let p = pipec_compiler::lower::lower(&sched);
    let run = |spec: &str| {
        simulate_unverified(&Unverified::unchecked(&p), &costs(spec, 2))
            .unwrap()
            .summary
    };
    assert_eq!(run("").makespan, 9.0);
    let slow = run("rank.1=2");
    assert_eq!(slow.makespan, 15.0);
    // Busy time: rank 0 its six units, rank 1 twice its six.
    assert_eq!(slow.ranks[0].busy, 6.0);
    assert_eq!(slow.ranks[1].busy, 12.0);
    // Every rank alike: the whole timeline scales.
    assert_eq!(run("rank.0=1.5,rank.1=1.5").makespan, 13.5);
}

/// `figures` is `simulate`'s summary (makespan, each rank's busy time, the mean
/// bubble) bit for bit, on every built-in kind, rendezvous and eager, with Megatron's
/// overlapped (in-flight) batches, and with costs that are not whole numbers.
#[test]
fn figures_are_the_summarys() {
    use pipec_schedules::{generate, Limits, MegatronP2p, ScheduleKind, ScheduleSpec};
    let mut specs: Vec<ScheduleSpec> = ScheduleKind::ALL
        .iter()
        .map(|&k| {
            let vpp = if k.chunk_rule() == pipec_schedules::ChunkRule::One {
                1
            } else {
                2
            };
            ScheduleSpec::new(k, 4, vpp, 8)
        })
        .collect();
    specs.push(ScheduleSpec {
        megatron_p2p: MegatronP2p::Overlap,
        ..ScheduleSpec::new(ScheduleKind::Interleaved1F1B, 4, 2, 8)
    });
    let models = [
        "f=1,b=1,w=1",
        "f=1.3,b=2.1,w=0.7,p2p=0.37",
        "f=1,b=2,p2p=0.5,rendezvous=false",
    ];
    let mut checked = 0;
    for spec in &specs {
        let program = pipec_compiler::lower::lower(&generate(spec, &Limits::DEFAULT).unwrap());
        for m in models {
            let c = costs(m, program.num_stages());
            let full = simulate_unverified(&Unverified::unchecked(&program), &c)
                .unwrap()
                .summary;
            let f = figures(&Unverified::unchecked(&program), &c).unwrap();
            assert_eq!(
                f.makespan.to_bits(),
                full.makespan.to_bits(),
                "{spec:?} {m}"
            );
            let busy: Vec<u64> = full.ranks.iter().map(|r| r.busy.to_bits()).collect();
            let got: Vec<u64> = f.busy.iter().map(|b| b.to_bits()).collect();
            assert_eq!(got, busy, "{spec:?} {m}");
            assert_eq!(f.mean_bubble().to_bits(), full.mean_bubble().to_bits());
            checked += 1;
        }
    }
    assert!(checked >= 3 * ScheduleKind::ALL.len());
}
