//! The verdict as a type (#27): what the verifier hands back agrees with its report, and the
//! verified entry points (which reuse the verifier's matching) give what the unverified ones
//! (which pair sends and receives themselves) give on the same program.

use pipec_compiler::compile::{compile, CompileRequest};
use pipec_compiler::torch::{export_csv, export_csv_unverified, CsvForm};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{simulate, simulate_unverified};
use pipec_ir::files::{self, Encoding, Header};
use pipec_ir::verify::{verified, verify, Checked, Unverified, VerifyOptions};
use pipec_runtime::{load, load_unverified, RunError};
use pipec_schedules::ScheduleKind;
use pipec_tests::ir::{fwd, recv};

fn compiled(kind: ScheduleKind, vpp: Option<u32>) -> pipec_compiler::Compiled {
    compile(&CompileRequest {
        vpp,
        ..CompileRequest::new(kind, 4, 8)
    })
    .unwrap()
}

/// Across kinds (blocking batches, waits, bidirectional placement): `Verified::new` succeeds
/// exactly when `verify` finds nothing, with the same report, and its matching is the one
/// `Matching::of` builds.
#[test]
fn verified_carries_the_verifiers_report_and_matching() {
    for (kind, vpp) in [
        (ScheduleKind::OneFOneB, None),
        (ScheduleKind::Interleaved1F1B, Some(2)),
        (ScheduleKind::ZbV, None),
        (ScheduleKind::DualPipe, None),
    ] {
        let c = compiled(kind, vpp);
        let want = verify(&c.program, &VerifyOptions::default());
        let v = verified(&c.program, &VerifyOptions::default()).expect("valid");
        assert_eq!(v.report(), &want, "{kind}");
        let m = pipec_ir::ir::Matching::of(&c.program).unwrap();
        assert_eq!(
            v.matching().messages(&c.program),
            m.messages(&c.program),
            "{kind}"
        );
    }
    // A send that never happens: rejected, with the report `verify` gives.
    let p = pipec_ir::Program {
        placement: pipec_schedules::Placement::looped(2, 1),
        microbatches: 1,
        forward_only: true,
        comm: None,
        ranks: vec![
            vec![fwd(0, 0)],
            vec![recv(0, pipec_ir::Payload::act(0, 0), 0), fwd(1, 0)],
        ],
    };
    let want = verify(&p, &VerifyOptions::default());
    let r = verified(p, &VerifyOptions::default()).unwrap_err();
    assert!(!want.is_valid());
    assert_eq!(r.report, want);
}

/// The simulator and the torch exporter give the same result from the verifier's matching as
/// from their own.
#[test]
fn verified_and_unverified_entry_points_agree() {
    for (kind, vpp) in [
        (ScheduleKind::Interleaved1F1B, Some(2)),
        (ScheduleKind::ZbH1, None),
    ] {
        let c = compiled(kind, vpp);
        let v = verified(&c.program, &VerifyOptions::default()).unwrap();
        let u = Unverified::unchecked(&c.program);
        let costs = StageCosts::new(
            &CostModel::parse("f=1,b=2,w=1,p2p=0.3").unwrap(),
            &c.layout,
            c.program.num_stages(),
        );
        let (a, b) = (
            simulate(&v, &costs).unwrap(),
            simulate_unverified(&u, &costs).unwrap(),
        );
        assert_eq!(a.timeline, b.timeline, "{kind}");
        for form in [CsvForm::ComputeOnly, CsvForm::ComputeComms] {
            assert_eq!(
                export_csv(&v, form).unwrap(),
                export_csv_unverified(&u, form).unwrap(),
                "{kind}"
            );
        }
    }
}

/// `load` hands back the program verified (with `verify`'s report on what it read);
/// `load_unverified` the same program, its structure checked (`Structural`), without the full
/// verdict; a directory the verifier refuses loads only that way.
#[test]
fn load_returns_the_verdict_load_unverified_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    let c = compiled(ScheduleKind::OneFOneB, None);
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    let good = tmp.path().join("good");
    let v = verified(&c.program, &VerifyOptions::default()).unwrap();
    files::write_program(&good, &header, &v, Encoding::Postcard).unwrap();
    let loaded = load(&good, None).unwrap();
    assert_eq!(loaded.program.program(), &c.program);
    assert_eq!(loaded.program.report(), v.report());
    let u = load_unverified(&good, None).unwrap();
    assert!(!u.program.fully_verified() && loaded.program.fully_verified());
    assert_eq!(u.program.program(), &c.program);

    // Rank 0 runs its first two forwards in the other order: structure intact, dependencies
    // (and the messages' order) broken.
    let mut bad = c.program.clone();
    let firsts: Vec<usize> = bad.ranks[0]
        .iter()
        .enumerate()
        .filter(|(_, i)| matches!(i, pipec_ir::Instr::Compute(_)))
        .map(|(k, _)| k)
        .take(2)
        .collect();
    bad.ranks[0].swap(firsts[0], firsts[1]);
    let want = verify(&bad, &VerifyOptions::default());
    assert!(!want.is_valid());
    let dir = tmp.path().join("bad");
    files::write_unverified(&dir, &header, &Unverified::unchecked(&bad), Encoding::Json).unwrap();
    match load(&dir, None) {
        Err(RunError::NotVerified { report, .. }) => assert_eq!(*report, want),
        other => panic!("{other:?}"),
    }
    let u = load_unverified(&dir, None).expect("the structure holds");
    assert_eq!(u.program.program(), &bad);
}
