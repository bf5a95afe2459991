//! The CUDA backend's calibration (`pipec_cuda::calibrate`) on timelines simulated for
//! lowered programs under known costs: it must recover them.

use pipec_compiler::compile::{compile, CompileRequest};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::simulate_unverified;
use pipec_cuda::calibrate::*;
use pipec_ir::ir::{Instr, Program};
use pipec_ir::verify::Unverified;
use pipec_schedules::layout::Layout;
use pipec_schedules::ScheduleKind;

/// The fit is a least-squares solve (with a 1e-9 ridge): exact to about 1e-6.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1.0)
}

fn program(kind: ScheduleKind, pp: u32, m: u32) -> (Program, Layout) {
    let c = compile(&CompileRequest {
        vpp: Some(1),
        ..CompileRequest::new(kind, pp, m)
    })
    .unwrap();
    (c.program, c.layout)
}

/// On a timeline simulated under known costs, the calibration recovers them and so
/// re-simulates the same makespan.
#[test]
fn recovers_the_costs_of_a_simulated_timeline() {
    for (kind, pp, split) in [
        (ScheduleKind::OneFOneB, 4, false),
        (ScheduleKind::ZbH1, 3, true),
    ] {
        let (p, layout) = program(kind, pp, 6);
        let spec = if split {
            "f=2,b=3,w=1.5"
        } else {
            "f=2,b=3,w=3"
        };
        let costs = StageCosts::new(&CostModel::parse(spec).unwrap(), &layout, p.num_stages());
        let sim = simulate_unverified(&Unverified::unchecked(&p), &costs).unwrap();
        let c = calibrate(&p, &layout, &sim.timeline).unwrap();
        assert_eq!(c.split, split, "{kind:?}");
        assert!(c.pure, "{kind:?}");
        let (b, w) = if split { (3.0, 1.5) } else { (3.0, 3.0) };
        for (got, want) in [(c.f, 2.0), (c.b, b), (c.w, w)] {
            assert!(close(got, want), "{kind:?}: {c:?}");
        }
        assert_eq!(c.p2p, 0.0, "{kind:?}");
        assert_eq!(c.measured_makespan, sim.summary.makespan, "{kind:?}");
        assert!(
            close(c.simulated_makespan, sim.summary.makespan),
            "{kind:?}"
        );
        assert!(close(c.simulated_bubble, c.measured_bubble), "{kind:?}");
    }
}

/// Checkpointed forwards and recomputes are forward samples, and the copies give the
/// `offload` cost the timeline was simulated with.
#[test]
fn memory_instructions_calibrate_forwards_and_copies() {
    let p = crate::interp::with_memory_ops();
    let (_, layout) = program(ScheduleKind::OneFOneB, 4, 6);
    assert_eq!(layout.stages[1].len(), 1, "stage 1 is one decoder layer");
    let model = CostModel::parse("f=2,b=3,w=3,offload=0.5").unwrap();
    let sim = simulate_unverified(
        &Unverified::unchecked(&p),
        &StageCosts::new(&model, &layout, p.num_stages()),
    )
    .unwrap();
    let c = calibrate(&p, &layout, &sim.timeline).unwrap();
    assert!(close(c.f, 2.0) && close(c.b, 3.0), "{c:?}");
    assert!(c.spec.ends_with(",offload=0.5"), "{c:?}");
    assert!(close(c.simulated_makespan, sim.summary.makespan), "{c:?}");
    // Without copies the spec has no `offload`.
    let (q, layout) = program(ScheduleKind::OneFOneB, 4, 6);
    let sim = simulate_unverified(
        &Unverified::unchecked(&q),
        &StageCosts::new(&model, &layout, q.num_stages()),
    )
    .unwrap();
    let c = calibrate(&q, &layout, &sim.timeline).unwrap();
    assert!(!c.spec.contains("offload"), "{c:?}");
}

/// Batches left in flight (Megatron's overlap mode) span their post to their wait, compute
/// in between: they are no measure of a transfer and stay out of `p2p`, which the blocking
/// batches still give exactly.
#[test]
fn batches_left_in_flight_are_not_taken_for_transfers() {
    let c = compile(&CompileRequest {
        vpp: Some(2),
        megatron_p2p: pipec_schedules::MegatronP2p::Overlap,
        ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 4, 8)
    })
    .unwrap();
    let (p, layout) = (c.program, c.layout);
    assert!(p.ranks[0].iter().any(|i| matches!(i, Instr::Wait { .. })));
    let model = CostModel::parse("f=2,b=3,w=3,p2p=0.5").unwrap();
    let sim = simulate_unverified(
        &Unverified::unchecked(&p),
        &StageCosts::new(&model, &layout, p.num_stages()),
    )
    .unwrap();
    // Whatever a batch left in flight measures, from its post to its wait (as the CUDA
    // backend does) or nothing at all, the latency comes from the blocking batches.
    for stretch in [true, false] {
        let mut timeline = sim.timeline.clone();
        for (instrs, spans) in p.ranks.iter().zip(&mut timeline.ranks) {
            for (w, ins) in instrs.iter().enumerate() {
                let Instr::Wait { batch } = ins else { continue };
                for (i, op) in instrs.iter().enumerate().take(w) {
                    if op.batch() == Some(*batch) {
                        spans[i].end = if stretch {
                            spans[w].end
                        } else {
                            spans[i].start
                        };
                    }
                }
            }
        }
        let cal = calibrate(&p, &layout, &timeline).unwrap();
        assert!(
            close(cal.f, 2.0) && close(cal.b, 3.0) && cal.p2p == 0.5,
            "stretch {stretch}: {cal:?}"
        );
        assert!(cal.pure);
    }
}

/// One stage holding the embedding, the layers and the head: the per-layer figures are
/// the whole stage's, and the calibration says so.
#[test]
fn a_single_stage_is_not_a_pure_decoder_measurement() {
    let (p, layout) = program(ScheduleKind::OneFOneB, 1, 2);
    let model = CostModel::parse("f=2,b=3,w=3").unwrap();
    let sim = simulate_unverified(
        &Unverified::unchecked(&p),
        &StageCosts::new(&model, &layout, p.num_stages()),
    )
    .unwrap();
    let cal = calibrate(&p, &layout, &sim.timeline).unwrap();
    assert!(!cal.pure);
}
