//! Loading a compiled directory for execution. Everything is checked before any rank starts:
//! the instruction-file checks of [`pipec::back::files::load_dir`] (format, version, each rank
//! file's hash against the manifest, one schedule hash for all ranks), the world size of the
//! launch, the layout against the stage count, the structure of the schedule ([`preverify`],
//! which names the file and field at fault), and then the full verifier
//! ([`pipec::verify::verify`]: completeness, dependencies, matching, deadlock freedom).

use crate::error::RunError;
use pipec::back::files::{load_dir, rank_file_name, Encoding, Loaded, MANIFEST_FILE};
use pipec::ir::{Instr, Payload, Program};
use pipec_schedules::{Compute, Pass, Rank, Task};
use std::path::Path;

/// Where the launch's world size came from, for messages.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LaunchWorld {
    pub size: u32,
    /// `--world-size` or `WORLD_SIZE`.
    pub from: &'static str,
}

/// Load `dir`, check it is runnable by a launch of `world` ranks (when given), and verify it.
pub fn load(dir: &Path, world: Option<LaunchWorld>) -> Result<Loaded, RunError> {
    let loaded = load_unverified(dir, world)?;
    let opts = pipec::verify::VerifyOptions {
        streams: pipec::verify::StreamRule::of_policy(
            loaded.manifest.comm_policy,
            loaded.program.world(),
        ),
        ..Default::default()
    };
    let report = pipec::verify::verify(&loaded.program, &opts);
    if !report.is_valid() {
        return Err(RunError::NotVerified {
            dir: dir.display().to_string(),
            report: Box::new(report),
        });
    }
    Ok(loaded)
}

/// [`load`] without the full verifier: file, launch and structural checks only. For
/// `pipec-run --no-verify`, which exists to watch what a broken schedule does (the watchdog).
pub fn load_unverified(dir: &Path, world: Option<LaunchWorld>) -> Result<Loaded, RunError> {
    let loaded = load_dir(dir)?;
    let m = &loaded.manifest;
    if let Some(w) = world {
        if w.size != m.world_size {
            return Err(RunError::Refused {
                file: dir.join(MANIFEST_FILE).display().to_string(),
                field: "world_size".into(),
                msg: format!(
                    "the schedule is compiled for {} ranks, but the launch has {} ({})",
                    m.world_size, w.size, w.from
                ),
            });
        }
    }
    if m.layout.num_stages() != m.num_stages {
        return Err(RunError::Refused {
            file: dir.join(MANIFEST_FILE).display().to_string(),
            field: "layout".into(),
            msg: format!(
                "the layout `{}` has {} stages, but `num_stages` is {}",
                m.layout.expanded(),
                m.layout.num_stages(),
                m.num_stages
            ),
        });
    }
    preverify(&loaded.program).map_err(|e| match e {
        RunError::Refused { file, field, msg } => RunError::Refused {
            file: dir.join(file).display().to_string(),
            field,
            msg,
        },
        e => e,
    })?;
    Ok(loaded)
}

fn refuse(rank: usize, field: String, msg: String) -> RunError {
    RunError::Refused {
        file: rank_file_name(rank as u32, Encoding::Json),
        field,
        msg,
    }
}

/// Check the program before running it. Cheap structural checks: every id in range, every
/// compute op on the rank that owns its stage, every message between the producing and the
/// consuming rank of its tensor, every (stage, microbatch) with exactly one forward and one
/// backward (`bwd`, or `bwd_D` and `bwd_W`), and between each ordered pair of ranks the k-th
/// send matching the k-th receive with an equal payload (NCCL's FIFO order). Deadlock freedom
/// and dependency order are left to the full verifier ([`load`] runs it next); under
/// `--no-verify` the runtime's watchdog catches what slips through.
pub fn preverify(program: &Program) -> Result<(), RunError> {
    let world = program.world();
    let stages = program.num_stages();
    let m = program.microbatches;
    if program.placement.pp != world {
        return Err(RunError::Refused {
            file: MANIFEST_FILE.into(),
            field: "placement".into(),
            msg: format!(
                "the placement is for {} ranks, the program has {world}",
                program.placement.pp
            ),
        });
    }
    if let Some((s, r)) = program
        .placement
        .table()
        .iter()
        .enumerate()
        .find(|(_, r)| r.0 >= world)
    {
        return Err(RunError::Refused {
            file: MANIFEST_FILE.into(),
            field: "placement".into(),
            msg: format!("stage {s} is placed on {r}, out of range for {world} ranks"),
        });
    }
    let tasks = stages as usize * m as usize;
    // Per task: [fwd, bwd, bwd_D, bwd_W] counts.
    let mut seen = vec![[0u8; 4]; tasks];
    // sends[a][b], recvs[b][a]: payloads with their instruction index, in order.
    let w = world as usize;
    let mut sends: Vec<Vec<Vec<(Payload, usize)>>> = vec![vec![Vec::new(); w]; w];
    let mut recvs: Vec<Vec<Vec<(Payload, usize)>>> = vec![vec![Vec::new(); w]; w];
    for (r, instrs) in program.ranks.iter().enumerate() {
        let rank = Rank(r as u32);
        for (i, ins) in instrs.iter().enumerate() {
            let field = |f: &str| format!("instructions[{i}].{f}");
            match ins {
                Instr::Compute(c) => {
                    if let Compute::FwdBwd { fwd, bwd } = c {
                        if fwd == bwd {
                            return Err(refuse(r, field("bwd_stage"), format!("#{i} {c}: the forward and the backward of an overlapped pair must be different tasks")));
                        }
                    }
                    for (k, (pass, t)) in c.parts().enumerate() {
                        let prefix = match (c, k) {
                            (Compute::FwdBwd { .. }, 0) => "fwd_",
                            (Compute::FwdBwd { .. }, _) => "bwd_",
                            _ => "",
                        };
                        check_task(t, stages, m).map_err(|(f, msg)| {
                            refuse(
                                r,
                                field(&format!("{prefix}{f}")),
                                format!("#{i} {c}: {msg}"),
                            )
                        })?;
                        let owner = program.placement.rank_of(t);
                        if owner != rank {
                            return Err(refuse(r, field(&format!("{prefix}stage")), format!("#{i} {c}: {} runs on {owner} by the manifest's placement, not on {rank}", t.stage)));
                        }
                        if program.forward_only && pass != Pass::Fwd {
                            return Err(refuse(
                                r,
                                field("op"),
                                format!("#{i} {c}: a forward-only schedule has no backward"),
                            ));
                        }
                        let slot = t.stage.index() * m as usize + t.mb.index();
                        let p = match pass {
                            Pass::Fwd => 0,
                            Pass::Bwd => 1,
                            Pass::BwdD => 2,
                            Pass::BwdW => 3,
                        };
                        seen[slot][p] += 1;
                        if seen[slot][p] > 1 {
                            return Err(refuse(
                                r,
                                field("op"),
                                format!("#{i} {c}: a second {} of {t}", pass.name()),
                            ));
                        }
                    }
                }
                // Which batch a wait names is checked by the verifier (`WaitWithoutBatch`).
                Instr::Wait { .. } => {}
                Instr::Send { peer, payload, .. } | Instr::Recv { peer, payload, .. } => {
                    let is_send = matches!(ins, Instr::Send { .. });
                    if peer.0 >= world || *peer == rank {
                        return Err(refuse(
                            r,
                            field("peer"),
                            format!(
                                "#{i} {ins}: peer {} is not another rank of a world of {world}",
                                peer.0
                            ),
                        ));
                    }
                    let t = Task {
                        stage: payload.stage,
                        mb: payload.mb,
                    };
                    check_task(t, stages, m)
                        .map_err(|(f, msg)| refuse(r, field(f), format!("#{i} {ins}: {msg}")))?;
                    let Some(consumer) = payload.consumer().filter(|c| c.0 < stages) else {
                        return Err(refuse(
                            r,
                            field("stage"),
                            format!("#{i} {ins}: no stage consumes {payload}"),
                        ));
                    };
                    let producer = program.placement.rank_of(t);
                    let consumer = program.placement.rank_of(Task {
                        stage: consumer,
                        mb: payload.mb,
                    });
                    let (from, to) = if is_send {
                        (rank, *peer)
                    } else {
                        (*peer, rank)
                    };
                    if (from, to) != (producer, consumer) {
                        return Err(refuse(r, field("peer"), format!("#{i} {ins}: {payload} travels from {producer} to {consumer} by the placement, not from {from} to {to}")));
                    }
                    if is_send {
                        sends[r][peer.index()].push((*payload, i));
                    } else {
                        recvs[r][peer.index()].push((*payload, i));
                    }
                }
            }
        }
    }
    for s in 0..stages {
        for mb in 0..m {
            let c = seen[s as usize * m as usize + mb as usize];
            let t = Task::new(s, mb);
            let owner = program.placement.rank_of(t).index();
            let ok_bwd = program.forward_only
                || (c[1] == 1 && c[2] == 0 && c[3] == 0)
                || (c[1] == 0 && c[2] == 1 && c[3] == 1);
            if c[0] != 1 || !ok_bwd {
                let what = if c[0] != 1 {
                    "no forward".to_string()
                } else {
                    format!(
                        "an incomplete backward (bwd {}, bwd_D {}, bwd_W {}; expected bwd, or bwd_D and bwd_W)",
                        c[1], c[2], c[3]
                    )
                };
                return Err(refuse(
                    owner,
                    "instructions".into(),
                    format!("{t} has {what}"),
                ));
            }
        }
    }
    for a in 0..w {
        for b in 0..w {
            let (s, r) = (&sends[a][b], &recvs[b][a]);
            for (k, (sp, rp)) in s.iter().zip(r).enumerate() {
                if sp.0 != rp.0 {
                    return Err(refuse(b, format!("instructions[{}]", rp.1), format!(
                        "#{} {}: the {} receive from rank {a} expects {}, but the {} send from rank {a} to rank {b} ({}, #{} {}) carries {}",
                        rp.1, program.ranks[b][rp.1], nth(k), rp.0, nth(k), rank_file_name(a as u32, Encoding::Json), sp.1, program.ranks[a][sp.1], sp.0
                    )));
                }
            }
            if s.len() != r.len() {
                let (file, idx, msg) = if s.len() > r.len() {
                    let (_, i) = s[r.len()];
                    (a, i, format!("#{i} {}: rank {a} sends {} messages to rank {b}, but rank {b} posts {} receives from rank {a}; this send has no receive", program.ranks[a][i], s.len(), r.len()))
                } else {
                    let (_, i) = r[s.len()];
                    (b, i, format!("#{i} {}: rank {b} posts {} receives from rank {a}, but rank {a} sends it {} messages; this receive has no send", program.ranks[b][i], r.len(), s.len()))
                };
                return Err(refuse(file, format!("instructions[{idx}]"), msg));
            }
        }
    }
    Ok(())
}

fn nth(k: usize) -> String {
    let n = k + 1;
    let suffix = match (n % 10, n % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

fn check_task(t: Task, stages: u32, m: u32) -> Result<(), (&'static str, String)> {
    if t.stage.0 >= stages {
        return Err((
            "stage",
            format!("{} is out of range ({stages} stages)", t.stage),
        ));
    }
    if t.mb.0 >= m {
        return Err(("mb", format!("{} is out of range ({m} microbatches)", t.mb)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec::ir::PayloadKind;
    use pipec_schedules::{generate, Limits, ScheduleKind, ScheduleSpec, StageId};

    fn program(kind: ScheduleKind, pp: u32, vpp: u32, m: u32) -> Program {
        let spec = ScheduleSpec::new(kind, pp, vpp, m);
        pipec::lower(&generate(&spec, &Limits::DEFAULT).unwrap())
    }

    fn refused(p: &Program) -> String {
        match preverify(p) {
            Err(e @ RunError::Refused { .. }) => e.to_string(),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn generated_programs_pass() {
        for (k, vpp) in [
            (ScheduleKind::Gpipe, 1),
            (ScheduleKind::OneFOneB, 1),
            (ScheduleKind::Interleaved1F1B, 2),
            (ScheduleKind::LoopedBfs, 3),
        ] {
            preverify(&program(k, 3, vpp, 6)).unwrap();
        }
    }

    #[test]
    fn out_of_range_ids_are_refused() {
        let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
        let i = p.ranks[0]
            .iter()
            .position(|x| matches!(x, Instr::Send { .. }))
            .unwrap();
        if let Instr::Send { peer, .. } = &mut p.ranks[0][i] {
            *peer = Rank(5);
        }
        let msg = refused(&p);
        assert!(
            msg.contains("rank-0.json") && msg.contains(&format!("instructions[{i}].peer")),
            "{msg}"
        );
        let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
        p.ranks[1][1] = Instr::Compute(Compute::Fwd(Task::new(1, 9)));
        let msg = refused(&p);
        assert!(
            msg.contains("instructions[1].mb") && msg.contains("mb 9 is out of range"),
            "{msg}"
        );
    }

    #[test]
    fn fifo_payload_mismatch_is_refused_naming_both_sides() {
        let mut p = program(ScheduleKind::Gpipe, 2, 1, 3);
        // Swap the payloads of rank 1's first two activation receives.
        let idx: Vec<usize> = p.ranks[1]
            .iter()
            .enumerate()
            .filter(|(_, x)| matches!(x, Instr::Recv { payload, .. } if payload.kind == PayloadKind::Act))
            .map(|(i, _)| i)
            .take(2)
            .collect();
        let (a, b) = (p.ranks[1][idx[0]], p.ranks[1][idx[1]]);
        let set = |x: &mut Instr, from: Instr| {
            if let (Instr::Recv { payload, .. }, Instr::Recv { payload: q, .. }) = (x, from) {
                *payload = q;
            }
        };
        set(&mut p.ranks[1][idx[0]], b);
        set(&mut p.ranks[1][idx[1]], a);
        let msg = refused(&p);
        assert!(
            msg.contains("rank-1.json") && msg.contains("rank-0.json"),
            "{msg}"
        );
        assert!(msg.contains("expects act of stage 0, mb 1"), "{msg}");
    }

    #[test]
    fn unmatched_send_is_refused() {
        let mut p = program(ScheduleKind::Gpipe, 2, 1, 2);
        // Drop rank 1's last receive from rank 0: the counts no longer match.
        let i = p.ranks[1]
            .iter()
            .rposition(|x| matches!(x, Instr::Recv { .. }))
            .unwrap();
        p.ranks[1].remove(i);
        let msg = refused(&p);
        assert!(
            msg.contains("rank-0.json") && msg.contains("this send has no receive"),
            "{msg}"
        );
    }

    #[test]
    fn compute_on_the_wrong_rank_and_missing_backward_are_refused() {
        let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
        let i = p.ranks[0]
            .iter()
            .position(|x| matches!(x, Instr::Compute(Compute::Bwd(_))))
            .unwrap();
        p.ranks[0][i] = Instr::Compute(Compute::Bwd(Task {
            stage: StageId(1),
            mb: pipec_schedules::Microbatch(0),
        }));
        assert!(refused(&p).contains("runs on rank 1"));
        let mut p = program(ScheduleKind::OneFOneB, 2, 1, 2);
        let i = p.ranks[0]
            .iter()
            .position(|x| matches!(x, Instr::Compute(Compute::Bwd(_))))
            .unwrap();
        p.ranks[0].remove(i);
        assert!(refused(&p).contains("incomplete backward"));
    }
}
