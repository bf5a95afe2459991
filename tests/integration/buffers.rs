//! The static buffer plan (issue #39, `pipec compile --buffer-plan`): every compiled plan's
//! pools against an independent derivation of the messages' lifetimes and of the most live at
//! once (a brute force over every instruction index, written here from docs/format.md's
//! "Buffer plan" rule, sharing no code with `pipec_ir::ir::buffers`), torch's ZBV pp=4 case
//! beside pytorch #196465's figures, and `pipec check` on hand-broken plans.

use crate::harness::{compiled, pipec_run_on, pipec_with};
use pipec_compiler::compile::{compile_verified, CompileRequest};
use pipec_cost::cost::CostModel;
use pipec_ir::ir::{Instr, MemKind, PayloadKind, Program};
use pipec_schedules::{Pass, ScheduleKind};
use std::path::Path;

/// Per message (index of its send or receive on rank `r`): the closed interval of indices at
/// which its tensor occupies its buffer, found by scanning the stream for each message.
fn brute_lifetimes(p: &Program, r: usize) -> Vec<(usize, usize, usize)> {
    let s = &p.ranks[r];
    let mut out = Vec::new();
    for (i, ins) in s.iter().enumerate() {
        let (payload, send) = match *ins {
            Instr::Send { payload, .. } => (payload, true),
            Instr::Recv { payload, .. } => (payload, false),
            _ => continue,
        };
        if payload.kind.is_shape() {
            continue;
        }
        let b = ins.batch().unwrap();
        // The batch: the run of sends and receives with this id around `i`.
        let mut first = i;
        while first > 0 && s[first - 1].batch() == Some(b) {
            first -= 1;
        }
        let mut last = i;
        while last + 1 < s.len() && s[last + 1].batch() == Some(b) {
            last += 1;
        }
        let done = (last + 1..s.len())
            .find(|&j| matches!(s[j], Instr::Wait { batch } if batch == b))
            .unwrap_or(last);
        let (st, mb) = (payload.stage.0, payload.mb.0);
        // Does instruction `j` consume (`reads`) or produce this tensor?
        let touches = |j: usize, reads: bool| -> bool {
            if let Instr::Memory(m) = s[j] {
                return reads
                    && payload.kind == PayloadKind::Act
                    && m.kind == MemKind::Recompute
                    && m.task.mb.0 == mb
                    && m.task.stage.0 == st + 1;
            }
            let Some(c) = s[j].as_compute() else {
                return false;
            };
            c.parts().any(|(pass, t)| {
                let fwd = pass == Pass::Fwd;
                let bwd = matches!(pass, Pass::Bwd | Pass::BwdD);
                t.mb.0 == mb
                    && match (payload.kind, reads) {
                        (PayloadKind::Act, true) => fwd && t.stage.0 == st + 1,
                        (PayloadKind::Act, false) => fwd && t.stage.0 == st,
                        (PayloadKind::Grad, true) => bwd && t.stage.0 + 1 == st,
                        (PayloadKind::Grad, false) => bwd && t.stage.0 == st,
                        _ => false,
                    }
            })
        };
        if send {
            let from = (0..first)
                .rev()
                .find(|&j| touches(j, false))
                .unwrap_or(first);
            out.push((i, from, done));
        } else {
            let until = (i + 1..s.len()).rev().find(|&j| touches(j, true));
            out.push((i, first, until.map_or(done, |u| u.max(done))));
        }
    }
    out
}

/// The most messages live at one index of rank `r`, by counting at every index.
fn brute_max_live(p: &Program, r: usize) -> usize {
    let lives = brute_lifetimes(p, r);
    (0..p.ranks[r].len())
        .map(|t| lives.iter().filter(|&&(_, a, b)| a <= t && t <= b).count())
        .max()
        .unwrap_or(0)
}

/// No two messages live at one index share a slot.
fn no_slot_shared(p: &Program, r: usize) {
    let lives = brute_lifetimes(p, r);
    for t in 0..p.ranks[r].len() {
        let mut slots: Vec<u32> = lives
            .iter()
            .filter(|&&(_, a, b)| a <= t && t <= b)
            .map(|&(i, _, _)| p.ranks[r][i].slot().expect("a slot"))
            .collect();
        let n = slots.len();
        slots.sort_unstable();
        slots.dedup();
        assert_eq!(
            slots.len(),
            n,
            "rank {r}: two live messages share a slot at #{t}"
        );
    }
}

fn planned(kind: ScheduleKind, pp: u32, vpp: Option<u32>, m: u32, cost: &str) -> Program {
    let req = CompileRequest {
        vpp,
        buffer_plan: true,
        ..CompileRequest::new(kind, pp, m)
    };
    let model = CostModel::parse(cost).unwrap();
    let built = compile_verified(&req, &model, None).unwrap_or_else(|e| panic!("{kind}: {e}"));
    built.verified.program().clone()
}

/// Every kind on small pipelines: each rank's pool has exactly the brute-force most live at
/// once (the fewest any plan can have), no two live messages share a slot, every slot is the
/// message size, and the verifier accepted it (compile_verified).
#[test]
fn plans_are_minimal_over_small_programs() {
    let mut cases = 0;
    for kind in ScheduleKind::ALL {
        let vpp = kind.row().vpp_required.map(|_| 2);
        for pp in [2u32, 3, 4] {
            for m in [pp, pp + 1, 2 * pp] {
                let req = CompileRequest {
                    vpp,
                    buffer_plan: true,
                    ..CompileRequest::new(kind, pp, m)
                };
                let model = CostModel::parse("msg=3").unwrap();
                let Ok(built) = compile_verified(&req, &model, None) else {
                    continue; // a shape the kind does not take (the kind's own rules)
                };
                let p = built.verified.program();
                let pools = p.buffer_slots.as_ref().expect("a plan");
                for r in 0..p.ranks.len() {
                    assert_eq!(
                        pools.rank(r).len(),
                        brute_max_live(p, r),
                        "{kind} pp={pp} M={m} rank {r}"
                    );
                    assert!(pools.rank(r).iter().all(|&x| x == 3.0));
                    no_slot_shared(p, r);
                }
                cases += 1;
            }
        }
    }
    assert!(cases >= 30, "{cases} cases");
}

/// torch's ZBV at pp=4 (pytorch #196465: `ScheduleZBVZeroBubble`, 2 stages per rank, training,
/// uniform buffer size, the same for 8 and 16 microbatches): torch's receive pools need 43
/// slots with one pool per (stage, direction) and 33 with one pool per rank, counting receive
/// buffers only, from the post of torch's receive action to the consuming computation, with
/// the receives placed by torch's `_add_send_recv`. pipec's `zb-v` lowering posts each
/// receive in the lockstep step that needs it, so its per-rank pools, sends included, need
/// far fewer: pinned here per rank and checked against the brute-force count.
#[test]
fn zbv_pp4_slot_count_beside_torch() {
    for m in [8u32, 16] {
        let p = planned(ScheduleKind::ZbV, 4, None, m, "");
        let pools = p.buffer_slots.as_ref().unwrap();
        let slots: Vec<usize> = (0..4).map(|r| pools.rank(r).len()).collect();
        let brute: Vec<usize> = (0..4).map(|r| brute_max_live(&p, r)).collect();
        assert_eq!(slots, brute, "M={m}");
        // Receives only, as torch counts them.
        let recv_only: Vec<usize> = (0..4)
            .map(|r| {
                let lives: Vec<_> = brute_lifetimes(&p, r)
                    .into_iter()
                    .filter(|&(i, _, _)| matches!(p.ranks[r][i], Instr::Recv { .. }))
                    .collect();
                (0..p.ranks[r].len())
                    .map(|t| lives.iter().filter(|&&(_, a, b)| a <= t && t <= b).count())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        assert_eq!(slots, ZBV_PP4_SLOTS, "M={m}: per rank, sends and receives");
        assert_eq!(
            recv_only, ZBV_PP4_RECV_SLOTS,
            "M={m}: per rank, receives only"
        );
    }
}

/// pipec's pools for `zb-v --pp 4` (M = 8 and 16): per rank, sends and receives.
const ZBV_PP4_SLOTS: [usize; 4] = [2, 4, 4, 3];
/// The same counting receives only, as torch does (#196465: 5, 14, 16, 8 with per-stage pools,
/// 3, 11, 12, 7 = 33 with one pool per rank).
const ZBV_PP4_RECV_SLOTS: [usize; 4] = [1, 3, 3, 2];

/// The pools count in the memory rule: each rank's peak with a plan is its peak without one
/// plus its pool.
#[test]
fn pools_count_in_the_peaks() {
    let model = CostModel::parse("msg=0.5").unwrap();
    for (kind, vpp) in [(ScheduleKind::OneFOneB, None), (ScheduleKind::ZbV, None)] {
        let with = compile_verified(
            &CompileRequest {
                vpp,
                buffer_plan: true,
                ..CompileRequest::new(kind, 4, 8)
            },
            &model,
            None,
        )
        .unwrap();
        let without = compile_verified(&CompileRequest::new(kind, 4, 8), &model, None).unwrap();
        let pools = with.verified.program().buffer_slots.clone().unwrap();
        for (r, (a, b)) in with
            .verified
            .report()
            .memory
            .iter()
            .zip(&without.verified.report().memory)
            .enumerate()
        {
            let pool = 0.5 * pools.rank(r).len() as f64;
            assert_eq!(a.peak, b.peak + pool, "{kind} rank {r}");
            assert_eq!(a.buffers, pool);
        }
    }
}

fn json_lines(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// `pipec check` on a plan: the pools in text and JSON; on a hand-broken plan (one message
/// moved into the slot of a message live at the same time, then `pipec seal`), a
/// `SlotReused` naming both messages, exit 1; a slot past the pool, `SlotOutOfRange`.
#[test]
fn check_reports_pools_and_broken_slots() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = compiled(
        tmp.path(),
        "zbv",
        "--schedule zb-v --pp 4 --microbatches 8 --buffer-plan",
    );
    let out = pipec_with(["check"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("buffer pools (slots, size in layer-activations; counted in the peaks above):\n  rank 0: 2 slots, 2\n  rank 1: 4 slots, 4\n  rank 2: 4 slots, 4\n  rank 3: 3 slots, 3\n"),
        "{text}"
    );
    let out = pipec_with(["check", "--json"]).arg(&dir).output().unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        v["buffer_pools"][1],
        serde_json::json!({"rank": 1, "slots": 4, "size": 4})
    );

    // Rank 1's first two messages: find two that are live together, and put the second in
    // the first's slot.
    let loaded = pipec_ir::files::load_dir(&dir).unwrap().program;
    let lives = brute_lifetimes(&loaded, 1);
    let (a, b) = lives
        .iter()
        .flat_map(|x| lives.iter().map(move |y| (x, y)))
        .find(|(x, y)| x.0 < y.0 && x.1 <= y.2 && y.1 <= x.2)
        .map(|(x, y)| (x.0, y.0))
        .expect("two messages live together");
    let slot_a = loaded.ranks[1][a].slot().unwrap();
    let path = dir.join("rank-1.json");
    let mut lines = json_lines(&path);
    // Rewrite exactly instruction b: the k-th instruction line.
    let first_instr = lines
        .iter()
        .position(|l| l.trim_start().starts_with("{\"op\""))
        .unwrap();
    let k = first_instr + b;
    let old = lines[k].clone();
    let cut = old.rfind("\"slot\":").unwrap();
    let tail = if old.trim_end().ends_with(',') {
        "},"
    } else {
        "}"
    };
    lines[k] = format!("{}\"slot\":{slot_a}{tail}", &old[..cut]);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let seal = pipec_with(["seal"]).arg(&dir).output().unwrap();
    assert!(
        seal.status.success(),
        "{}",
        String::from_utf8_lossy(&seal.stderr)
    );
    let out = pipec_with(["check"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    let want = format!("rank 1, #{b} ");
    let line = text
        .lines()
        .find(|l| l.contains("[wrong tensor]") && l.contains(&format!("buffer slot {slot_a}")))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(line.contains(&want), "{line}");
    assert!(line.contains(&format!("rank 1, #{a} ")), "{line}");
    assert!(
        line.contains("while the slot still holds the tensor of"),
        "{line}"
    );

    // A slot past the pool.
    let mut lines = json_lines(&path);
    let old = lines[k].clone();
    let cut = old.rfind("\"slot\":").unwrap();
    let tail = if old.trim_end().ends_with(',') {
        "},"
    } else {
        "}"
    };
    lines[k] = format!("{}\"slot\":9{tail}", &old[..cut]);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    assert!(pipec_with(["seal"])
        .arg(&dir)
        .output()
        .unwrap()
        .status
        .success());
    let out = pipec_with(["check"]).arg(&dir).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains(&format!("rank 1, #{b} "))
            && text.contains("buffer slot 9 is out of range (rank 1 has 4 slots)"),
        "{text}"
    );
}

/// The CPU runtime runs a plan with slots (every receive landing in its slot, the interpreter's
/// pool: `interp::runs_use_the_plans_slots`) to the single-threaded reference's losses and
/// gradients, bit for bit; with lengths too (sized and slotted messages).
#[test]
fn cpu_runtime_runs_slotted_plans() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, line) in [
        ("zbv", "--schedule zb-v --pp 4 --microbatches 8 --buffer-plan"),
        (
            "i1f1b",
            "--schedule interleaved-1f1b --pp 2 --vpp 2 --microbatches 4 --buffer-plan --megatron-p2p overlap",
        ),
    ] {
        let dir = compiled(tmp.path(), name, line);
        let ok = pipec_run_on(&dir, &["--check", "--json"]).output().unwrap();
        assert!(ok.status.success(), "{name}: {}", String::from_utf8_lossy(&ok.stderr));
        let json: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
        assert_eq!(json["steps"][0]["check"]["max_abs_diff"], 0.0, "{name}");
    }
}
