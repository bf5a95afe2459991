//! Memory instructions (issue 30) on the CUDA backend: `offload`/`reload` on the rank's copy
//! stream (pinned host buffers, events), `wait_offload`, checkpointed forwards and `recompute`.
//!
//! On a GPU (`#[ignore]`d, the `cuda` feature; `cargo test -p pipec-tests --features cuda
//! --test integration cuda -- --ignored --test-threads 1`), each program must
//! - pass `--check` against the single-thread CPU reference (fp32 and bf16);
//! - print the interpreter's metered peaks equal to the verifier's, the GPU pool's high
//!   watermark, and one copy line per copying rank with the program's offload and reload
//!   counts;
//! - keep the format's timing rules in its CUDA-event trace (docs/format.md, "Memory
//!   instructions"): an offload's copy starts after its forward ends, a backward of a reloaded
//!   stash starts after the reload ends, a `wait_offload` ends after its offload; every copy
//!   lies on the `rank R copy` row and takes time.
//!
//! Everywhere: the same programs pass the bitwise check on the CPU backend and the same trace
//! rules there, so a GPU failure is the GPU's.

use crate::cuda::{compile_req_to, cpu_check};
use crate::memory::{every_memory_op_1f1b, has, insert, mem};
use pipec_compiler::compile::CompileRequest;
use pipec_ir::files::{write_program, Encoding, Header};
use pipec_ir::ir::{Instr, MemKind, Program};
use pipec_ir::verify::{verified, VerifyOptions};
use pipec_schedules::{Pass, ScheduleKind, Task};
use std::collections::HashMap;
use std::path::Path;

/// Write `q` (verified) with the header of the compiled `c`.
pub(crate) fn write(c: &pipec_compiler::compile::Compiled, q: &Program, dir: &Path) {
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    let v = verified(q.clone(), &VerifyOptions::default())
        .unwrap_or_else(|r| panic!("does not verify: {}", r.report));
    write_program(dir, &header, &v, Encoding::Json).unwrap();
}

/// 1F1B, pp = 2, M = 3, on the last rank (the head's stash: probabilities and targets; a
/// checkpointed forward keeping a hidden input): offload, wait_offload and reload of mb 0, a
/// checkpointed forward and recompute of mb 1.
pub(crate) fn every_memory_op_last_rank() -> (pipec_compiler::compile::Compiled, Program) {
    let c = pipec_compiler::compile::compile(&CompileRequest::new(ScheduleKind::OneFOneB, 2, 3))
        .unwrap();
    let r1 = &c.program.ranks[1];
    let (t0, t1) = (Task::new(1, 0), Task::new(1, 1));
    let at = |t: Task, pass: Pass| r1.iter().position(|i| has(i, t, &[pass])).unwrap();
    let mut ops = vec![
        (at(t0, Pass::Fwd) + 1, mem(MemKind::Offload, t0)),
        (at(t0, Pass::Fwd) + 1, mem(MemKind::WaitOffload, t0)),
        (at(t0, Pass::Bwd), mem(MemKind::Reload, t0)),
        (at(t1, Pass::Bwd), mem(MemKind::Recompute, t1)),
    ];
    ops.sort_by_key(|o| o.0);
    let mut r = insert(r1, ops);
    let f1 = r.iter().position(|i| has(i, t1, &[Pass::Fwd])).unwrap();
    r[f1] = Instr::FwdCheckpoint(t1);
    let mut q = c.program.clone();
    q.ranks[1] = r;
    (c, q)
}

/// `pipec tune --target pipec-run` under a memory limit below the plain peak: the tuner's
/// fitting writes offloads (and may checkpoint), as `tune_levers` checks.
fn tuned(dir: &Path) {
    let o = crate::harness::pipec()
        .args([
            "tune",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "16",
            "--cost",
            "t.f=0.25,t.b=0.25,t.w=0.25,t.act=0.25,t.offload=0.0625",
            "--memory-limit",
            "2",
            "--target",
            "pipec-run",
            "-o",
        ])
        .arg(dir)
        .output()
        .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// The programs of the GPU test, written under `root`: (name, directory).
fn memory_programs(root: &Path) -> Vec<(&'static str, std::path::PathBuf)> {
    let mut v = Vec::new();
    for (name, (c, q)) in [
        ("every memory op on rank 0", every_memory_op_1f1b()),
        (
            "every memory op on the last rank",
            every_memory_op_last_rank(),
        ),
    ] {
        let dir = root.join(name.replace(' ', "-"));
        write(&c, &q, &dir);
        v.push((name, dir));
    }
    let dir = root.join("tuned");
    tuned(&dir);
    v.push(("tune --target pipec-run --memory-limit 2", dir));
    // A plain program beside them: no copy line, no copy row.
    let dir = root.join("plain");
    compile_req_to(CompileRequest::new(ScheduleKind::OneFOneB, 2, 3), &dir);
    v.push(("plain 1f1b", dir));
    v
}

/// Per rank, the (offloads, reloads) of the program in `dir`.
fn copy_counts(p: &Program) -> Vec<(usize, usize)> {
    p.ranks
        .iter()
        .map(|r| {
            let n = |k: MemKind| {
                r.iter()
                    .filter(|i| matches!(i, Instr::Memory(m) if m.kind == k))
                    .count()
            };
            (n(MemKind::Offload), n(MemKind::Reload))
        })
        .collect()
}

/// The format's timing rules in the trace `DIR/trace.json` of the program in `dir`: every
/// copy on its rank's `rank R copy` row with `min_copy_us` or more; an offload starting after
/// its forward ends, a backward (`bwd`, `bwd_D`, the backward of a pair) of a reloaded task
/// starting after the reload ends, a `wait_offload` ending after its offload. Returns the
/// number of copies seen.
fn check_copy_order(dir: &Path, min_copy_us: f64, what: &str) -> usize {
    let p = pipec_ir::files::load_dir(dir).unwrap().program;
    let t: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("trace.json")).unwrap()).unwrap();
    let world = p.ranks.len() as u64;
    // (rank, instruction) -> (start, end), and the copies' rows.
    let mut span: HashMap<(u64, u64), (f64, f64)> = HashMap::new();
    let mut copy_rows = Vec::new();
    for e in t["traceEvents"].as_array().unwrap() {
        if e["ph"] == "M" && e["name"] == "thread_name" {
            let name = e["args"]["name"].as_str().unwrap();
            if name.ends_with(" copy") {
                copy_rows.push((e["tid"].as_u64().unwrap(), name.to_string()));
            }
        }
        if e["ph"] != "X" {
            continue;
        }
        let tid = e["tid"].as_u64().unwrap();
        let (rank, on_copy_row) = if tid >= world {
            (tid - world, true)
        } else {
            (tid, false)
        };
        assert_eq!(on_copy_row, e["cat"] == "copy", "{what}: {e}");
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        if on_copy_row {
            assert!(dur >= min_copy_us, "{what}: a copy of {dur} µs: {e}");
        }
        span.insert((rank, e["args"]["instr"].as_u64().unwrap()), (ts, ts + dur));
    }
    // Rounded to 0.001 µs in the trace.
    let eps = 0.002;
    let mut copies = 0;
    for (r, instrs) in p.ranks.iter().enumerate() {
        let at = |i: usize| span[&(r as u64, i as u64)];
        let mut last: HashMap<(MemKind, Task), usize> = HashMap::new();
        let mut fwd: HashMap<Task, usize> = HashMap::new();
        for (i, ins) in instrs.iter().enumerate() {
            match ins {
                Instr::Memory(m) => {
                    match m.kind {
                        MemKind::Offload => {
                            copies += 1;
                            let f = fwd[&m.task];
                            assert!(
                                at(i).0 + eps >= at(f).1,
                                "{what}: rank {r} #{i} {ins} starts at {} before its forward ends at {}",
                                at(i).0,
                                at(f).1
                            );
                        }
                        MemKind::Reload => copies += 1,
                        MemKind::WaitOffload => {
                            let o = last[&(MemKind::Offload, m.task)];
                            assert!(
                                at(i).1 + eps >= at(o).1,
                                "{what}: rank {r} #{i} {ins} ends before its offload #{o}"
                            );
                        }
                        MemKind::Recompute => {}
                    }
                    last.insert((m.kind, m.task), i);
                }
                Instr::Compute(c) => {
                    for (pass, task) in c.parts() {
                        match pass {
                            Pass::Fwd => {
                                fwd.insert(task, i);
                            }
                            Pass::Bwd | Pass::BwdD => {
                                if let Some(&rl) = last.get(&(MemKind::Reload, task)) {
                                    assert!(
                                        at(i).0 + eps >= at(rl).1,
                                        "{what}: rank {r} #{i} {ins} starts at {} before its reload #{rl} ends at {}",
                                        at(i).0,
                                        at(rl).1
                                    );
                                }
                            }
                            Pass::BwdW => {}
                        }
                    }
                }
                _ => {}
            }
        }
        let (o, l) = copy_counts(&p)[r];
        let row = copy_rows.iter().find(|(tid, _)| *tid == world + r as u64);
        match row {
            Some((_, name)) => {
                assert!(o + l > 0, "{what}: a copy row for rank {r}");
                assert_eq!(name, &format!("rank {r} copy"), "{what}");
            }
            None => assert_eq!(o + l, 0, "{what}: no copy row for rank {r}"),
        }
    }
    copies
}

/// `pipec-run`'s line `peak memory per rank (UNIT, modelled: ...): A held in the run, verifier
/// B[; host ...]`
/// has `A == B` (and the host figures agree too).
fn assert_peaks_agree(so: &str, what: &str) {
    let line = so
        .lines()
        .find(|l| l.starts_with("peak memory per rank ("))
        .unwrap_or_else(|| panic!("{what}: no peak line\n{so}"));
    let (_, rest) = line.split_once("): ").unwrap();
    for part in rest.split("; ") {
        let part = part.strip_prefix("host ").unwrap_or(part);
        let (held, verifier) = part.split_once(" held in the run, verifier ").unwrap();
        assert_eq!(held, verifier, "{what}: {line}");
    }
}

/// The memory programs on the CPU backend: bitwise `--check`, the peaks line the GPU test
/// reads, and the trace keeps the format's order (copies take no time there).
#[test]
fn memory_programs_pass_on_the_cpu_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let mut copied = 0;
    for (name, dir) in memory_programs(tmp.path()) {
        let so = cpu_check(&dir, name);
        assert_peaks_agree(&so, name);
        copied += check_copy_order(&dir, 0.0, name);
    }
    assert!(copied >= 4, "{copied} copies");
    // The rules can fail: an offload moved before its forward's end is caught.
    let dir = tmp.path().join("every-memory-op-on-rank-0");
    let path = dir.join("trace.json");
    let mut t: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let e = t["traceEvents"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|e| e["cat"] == "copy" && e["name"].as_str().unwrap().starts_with("offload"))
        .unwrap();
    e["ts"] = serde_json::json!(0.0);
    std::fs::write(&path, serde_json::to_vec(&t).unwrap()).unwrap();
    let caught = std::panic::catch_unwind(|| check_copy_order(&dir, 0.0, "moved"));
    assert!(caught.is_err(), "an offload before its forward passed");
}

/// The memory programs on the GPU: see the module doc.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_memory_instructions() {
    use crate::cuda::gpu_check;
    let tmp = tempfile::tempdir().unwrap();
    for (name, dir) in memory_programs(tmp.path()) {
        let p = pipec_ir::files::load_dir(&dir).unwrap().program;
        for dtype in ["f32", "bf16"] {
            let what = format!("{name} {dtype}");
            let so = gpu_check(&dir, dtype, &what);
            // The interpreter's metered peaks are the verifier's on the GPU too.
            assert_peaks_agree(&so, &what);
            assert!(
                so.contains("GPU memory pool peak (last step"),
                "{what}\n{so}"
            );
            for (r, (o, l)) in copy_counts(&p).into_iter().enumerate() {
                let head = format!("  rank {r} copies (last step): {o} offloads, {l} reloads, ");
                assert_eq!(so.contains(&head), o + l > 0, "{what}: {head}\n{so}");
            }
            // A copy of a real stash takes some time on the GPU.
            check_copy_order(&dir, 0.001, &what);
        }
    }
}

/// `--backend cuda` no longer refuses memory instructions before a run: without a GPU driver
/// a program with every one of them gets as far as the library probe (exit 2, "CUDA driver
/// not found"), where it used to stop with exit 1 naming the first memory instruction.
#[cfg(feature = "cuda")]
#[test]
fn cuda_backend_takes_memory_instructions_up_to_the_driver_probe() {
    // SAFETY: only tries to dlopen libcuda.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        return; // a GPU machine: gpu_check_memory_instructions runs them
    }
    let tmp = tempfile::tempdir().unwrap();
    let (c, q) = every_memory_op_1f1b();
    write(&c, &q, tmp.path());
    let out = crate::harness::cuda_bin()
        .arg(tmp.path())
        .args(["--backend", "cuda", "--check"])
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("CUDA driver not found"), "{err}");
}
