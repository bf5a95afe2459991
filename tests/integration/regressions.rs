//! Regression tests, one per bug found, named after the bug (ripgrep style). Fuzzing found no
//! crash so far (see docs/robustness.md); the bugs below were found by the
//! verifier, the runtime's watchdog and the property tests while building pipec.

use pipec_ir::verify::{verify, VerifyOptions};
use pipec_schedules::{generate, Compute, Limits, ScheduleKind, ScheduleSpec, SpecError};

fn lowered(spec: &ScheduleSpec) -> pipec_ir::Program {
    pipec_compiler::lower(&generate(spec, &Limits::DEFAULT).unwrap())
}

/// Looped BFS lowered with fused-per-op batches deadlocked under rendezvous once vpp >= 2 and
/// M >= 2 pp: rank 0 sent every chunk-0 activation before posting the receive of its first
/// chunk-1 input, while rank 1's send back to rank 0 waited for that receive. Lockstep
/// placement pairs every send with its receive in the same round.
#[test]
fn looped_bfs_deadlocked_under_rendezvous() {
    for (pp, vpp, m) in [(2, 2, 4), (4, 2, 8), (3, 3, 9)] {
        let p = lowered(&ScheduleSpec::new(ScheduleKind::LoopedBfs, pp, vpp, m));
        let r = verify(&p, &VerifyOptions::default());
        assert!(r.is_valid(), "pp={pp} vpp={vpp} m={m}: {r}");
        assert_eq!(
            pipec_tests::reference::execute(&p).verdict,
            pipec_tests::reference::Verdict::Valid
        );
    }
}

/// Interleaved 1F1B at pp = 1 with vpp >= 3 ran `bwd(stage 2, mb 0)` before its forward: the
/// generator applied Megatron's no-pipelining warmup of 1 to the interleaved table. Megatron
/// never interleaves at pp = 1; neither does pipec now.
#[test]
fn interleaving_at_pp1_ran_a_backward_before_its_forward() {
    let s = ScheduleSpec::new(ScheduleKind::Interleaved1F1B, 1, 3, 4);
    assert!(matches!(
        s.validate(&Limits::DEFAULT),
        Err(SpecError::ChunksNeedPipeline { vpp: 3, .. })
    ));
}

/// 1F1B at pp = 1 ran `F0 F1 B0 F2 B1 ...` (peak 2 activations); Megatron's
/// `forward_backward_no_pipelining` runs `F0 B0 F1 B1 ...` (peak 1).
#[test]
fn one_f_one_b_at_pp1_held_two_activations() {
    let sched = generate(
        &ScheduleSpec::new(ScheduleKind::OneFOneB, 1, 1, 3),
        &Limits::DEFAULT,
    )
    .unwrap();
    let kinds: Vec<bool> = sched.ranks[0].ops.iter().map(Compute::is_forward).collect();
    assert_eq!(kinds, vec![true, false, true, false, true, false]);
    let r = verify(&lowered(&sched.spec), &VerifyOptions::default());
    assert_eq!(r.memory[0].peak, 1.0);
}

/// docs/design.md's first deadlock rule (merge every batch with its partners' batches) reported
/// GPipe at pp = 2, M = 1 as a deadlock: rank 0's batch {send act, recv grad} merges with two
/// batches of rank 1 that have its forward and backward between them. NCCL completes it; the
/// verifier's per-batch wait graph agrees.
#[test]
fn merged_batch_rule_flagged_gpipe_pp2_m1() {
    let p = lowered(&ScheduleSpec::new(ScheduleKind::Gpipe, 2, 1, 1));
    assert!(verify(&p, &VerifyOptions::default()).is_valid());
    let fused = pipec_compiler::lower_orders(
        &p.placement,
        1,
        false,
        pipec_schedules::CommPolicy::FusedPerOp,
        &generate(
            &ScheduleSpec::new(ScheduleKind::Gpipe, 2, 1, 1),
            &Limits::DEFAULT,
        )
        .unwrap()
        .ranks,
    );
    assert!(verify(&fused, &VerifyOptions::default()).is_valid());
}

/// `pipec show DIR | head -1` panicked ("failed printing to stdout: Broken pipe", exit 101):
/// Rust ignores SIGPIPE and `println!` panics on the write error. Both binaries now restore
/// the default action, so a closed reader ends them quietly, as it ends C tools.
#[cfg(unix)]
#[test]
fn broken_pipe_panicked_pipec_show_and_pipec_run() {
    use std::os::unix::process::ExitStatusExt;
    use std::process::Stdio;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("p");
    let out = crate::harness::pipec()
        .args([
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "-o",
        ])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    let mut show = crate::harness::pipec();
    show.arg("show").arg(&dir);
    let mut run = crate::harness::pipec_run();
    run.arg(&dir);
    for mut cmd in [show, run] {
        // The reader is gone before the process starts, so the first write fails whatever the
        // timing (dropping it after spawn raced with a small output fitting the pipe buffer).
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let child = cmd.stdout(writer).stderr(Stdio::piped()).spawn().unwrap();
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{cmd:?}: {stderr}");
        // SIGPIPE is 13 on Linux, macOS and the BSDs.
        assert_eq!(out.status.signal(), Some(13), "{cmd:?}: {stderr}");
    }
}
