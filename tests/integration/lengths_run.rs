//! Microbatches of different lengths on the CPU runtime (issue #38): plans compiled with
//! packed `microbatch_lengths` train on `pipec-run`, each microbatch with its own number of
//! tokens and each receive sized by its instruction's `tokens`.
//!
//! References: the same model run without pipelining, each microbatch alone with its own
//! length (`reference::step_with`), which every pipelined step must equal bitwise; the uniform
//! runtime that existed before lengths (a plan whose lengths are all `seq` computes the same
//! gradients); and the verifier and the runtime refusing a send and receive that disagree on
//! `tokens` (a rank file edited by hand, then sealed).

use crate::harness::{pipec_run_on, pipec_with};
use crate::runtime::opts;
use pipec_compiler::compile::{compile, CompileRequest, Compiled};
use pipec_ir::ir::Instr;
use pipec_runtime::model;
use pipec_runtime::reference;
use pipec_runtime::run::run_cpu_unchecked;
use pipec_runtime::{run_cpu, RunError};
use pipec_schedules::{Lengths, ScheduleKind};

/// Six microbatches, several packed, 5 to 9 tokens.
const PACKED: &str = "3 4\n5\n2 2 2\n6\n1 7\n9\n";

fn lengths(text: &str) -> Lengths {
    Lengths::parse(text).unwrap()
}

fn compiled(kind: ScheduleKind, vpp: u32, order: Option<Vec<u32>>) -> Compiled {
    let l = lengths(PACKED);
    compile(&CompileRequest {
        vpp: Some(vpp),
        lengths: Some(l.clone()),
        microbatch_order: order,
        ..CompileRequest::new(kind, 2, l.microbatches())
    })
    .unwrap()
}

#[test]
fn packed_lengths_train_equal_to_the_unpipelined_model() {
    let cases = [
        (ScheduleKind::OneFOneB, 1, None),
        (ScheduleKind::Interleaved1F1B, 2, None),
        (ScheduleKind::ZbV, 2, None),
        (ScheduleKind::Zb1P, 1, None),
        (ScheduleKind::OneFOneB, 1, Some(vec![5, 2, 0, 4, 1, 3])),
        (ScheduleKind::ZbV, 2, Some(vec![3, 0, 5, 1, 4, 2])),
    ];
    for (kind, vpp, order) in cases {
        let what = format!("{kind} vpp={vpp} order={order:?}");
        let c = compiled(kind, vpp, order);
        let report = run_cpu(&pipec_tests::verified(&c.program), &c.layout, &opts(3))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(report.steps.len(), 3, "{what}");
        for s in &report.steps {
            let check = s
                .check
                .as_ref()
                .unwrap_or_else(|| panic!("{what}: no check"));
            assert!(check.tensors > 0, "{what}");
            assert_eq!(check.max_abs_diff, 0.0, "{what}");
            assert!(s.loss.is_finite(), "{what}");
        }
        // The per-token loss of the first step, recomputed from the reference's per-microbatch
        // losses by hand.
        let stages = reference::build(&c.layout, &opts(1).model).unwrap();
        let l = lengths(PACKED);
        let r = reference::step_with(&stages, &opts(1).model, 0, 6, false, Some(l.all_tokens()))
            .unwrap();
        let by_hand: f64 = r
            .losses
            .iter()
            .zip(l.all_tokens())
            .map(|(&x, &n)| x as f64 * n as f64)
            .sum::<f64>()
            / l.all_tokens().iter().map(|&n| n as f64).sum::<f64>();
        assert!(
            (report.steps[0].loss as f64 - by_hand).abs() < 1e-6,
            "{what}: {} vs {by_hand}",
            report.steps[0].loss
        );
    }
}

/// Lengths that are all `seq` are the uniform model: the same per-microbatch losses and the
/// same gradients, bitwise (the loss scale `n / T` is then `1/M`, both divisions correctly
/// rounded), as the runtime computed them before lengths existed.
#[test]
fn lengths_of_seq_are_the_uniform_model() {
    let cfg = opts(1).model;
    let c = compile(&CompileRequest::new(ScheduleKind::OneFOneB, 2, 4)).unwrap();
    let stages = reference::build(&c.layout, &cfg).unwrap();
    let uniform = reference::step(&stages, &cfg, 0, 4, false).unwrap();
    let seq = [cfg.seq as u32; 4];
    let with = reference::step_with(&stages, &cfg, 0, 4, false, Some(&seq)).unwrap();
    assert_eq!(uniform.losses, with.losses);
    assert_eq!(uniform.grads, with.grads);
    assert!((uniform.loss - with.loss).abs() <= 1e-6 * uniform.loss.abs());
    // And the data of a shorter microbatch is a prefix of the longer one's.
    assert_eq!(
        model::tokens_n(&cfg, 0, 1, 2)[..],
        model::tokens(&cfg, 0, 1)[..2]
    );
}

/// A receive whose `tokens` is not the size of the tensor that arrives is a runtime error
/// naming the rank and the instruction (the runtime sizes receives from the plan and exchanges
/// no shapes). The verifier refuses such a plan before it runs (next test); the interpreter is
/// reached here through the unchecked path the verifier-vs-runtime tests use.
#[test]
fn a_tensor_of_another_size_than_its_tokens_is_a_runtime_error() {
    let c = compiled(ScheduleKind::OneFOneB, 1, None);
    let mut p = c.program.clone();
    let (at, was) = p.ranks[1]
        .iter_mut()
        .enumerate()
        .find_map(|(i, ins)| match ins {
            Instr::Recv { tokens, .. } => {
                let t = tokens.expect("a plan with lengths sizes every receive");
                *tokens = Some(t.checked_add(1).unwrap());
                Some((i, t.get()))
            }
            _ => None,
        })
        .unwrap();
    let mut o = opts(1);
    o.check = false;
    match run_cpu_unchecked(&p, &c.layout, &o) {
        Err(RunError::Failed(f)) => {
            let want = format!(
                "wrong tensor size: rank 1, #{at} {} carries tokens {} (its size in the plan) but the tensor received holds {was} rows",
                p.ranks[1][at],
                was + 1
            );
            assert_eq!(f.report, want);
        }
        other => panic!("expected a wrong-size failure, got {other:?}"),
    }
}

/// The issue's refusal: a compiled rank file whose receive disagrees with its send on
/// `tokens`, sealed so that the hashes match, is refused by `pipec check` (exit 1, naming both
/// ends) and by `pipec-run`, also under `--no-verify` (its structural checks hold matched ends
/// to one size).
#[test]
fn a_send_and_receive_that_disagree_on_tokens_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("lengths.txt");
    std::fs::write(&file, PACKED).unwrap();
    let dir = tmp.path().join("plan");
    let out = pipec_with(["compile", "--schedule", "1f1b", "--pp", "2"])
        .arg("--microbatch-lengths")
        .arg(&file)
        .arg("-o")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Before the edit it runs, checked against the reference.
    let ok = pipec_run_on(&dir, &["--check", "--json"]).output().unwrap();
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(json["steps"][0]["check"]["max_abs_diff"], 0.0);
    assert_eq!(
        json["microbatch_lengths"],
        serde_json::json!([[3, 4], [5], [2, 2, 2], [6], [1, 7], [9]])
    );

    let rank1 = dir.join("rank-1.json");
    let text = std::fs::read_to_string(&rank1).unwrap();
    let recv = r#""op":"recv","peer":0,"payload":"act","stage":0,"mb":1,"batch":1,"tokens":5"#;
    assert_eq!(text.matches(recv).count(), 1, "{text}");
    std::fs::write(&rank1, text.replace(recv, &recv.replace(":5", ":6"))).unwrap();
    let sealed = pipec_with(["seal"]).arg(&dir).output().unwrap();
    assert!(sealed.status.success());

    let both_ends = "rank 1, #4 recv(act of stage 0, mb 1 <- rank 0) expects 6 tokens but rank 0, #3 send(act of stage 0, mb 1 -> rank 1) sends 5 tokens";
    let check = pipec_with(["check"]).arg(&dir).output().unwrap();
    assert_eq!(check.status.code(), Some(1));
    let said = String::from_utf8_lossy(&check.stdout);
    assert!(
        said.contains("INVALID") && said.contains(both_ends),
        "{said}"
    );
    for extra in [&[][..], &["--no-verify"][..]] {
        let run = pipec_run_on(&dir, extra).output().unwrap();
        assert_eq!(run.status.code(), Some(1), "{extra:?}");
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(err.contains(both_ends), "{extra:?}: {err}");
    }
}
