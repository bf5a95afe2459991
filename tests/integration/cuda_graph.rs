//! `pipec-run --backend cuda --cuda-graph` (issue #39, "A captured step").
//!
//! Everywhere: the usage errors, and the plans that cannot be captured are refused with the
//! reason (exit 1) before any GPU or CUDA library is needed, by every build of `pipec-run`;
//! a capturable plan gets as far as the CUDA stack (exit 2 without the feature or a driver).
//! On a GPU machine (`#[ignore]`d, feature `cuda`): every step of captured and replayed runs
//! passes `--check` against the single-thread CPU reference, in f32 and bf16.

use crate::cuda::compile_req_to;
use crate::cuda_memory::{every_memory_op_last_rank, write};
use crate::harness::pipec_run_cuda;
use crate::memory::{has, insert, mem};
use pipec_compiler::compile::CompileRequest;
use pipec_ir::ir::{Instr, MemKind, Program};
use pipec_schedules::{MegatronP2p, Pass, ScheduleKind, Task};
use std::path::Path;

fn run(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let mut c = pipec_run_cuda();
    c.arg(dir)
        .args(["--backend", "cuda", "--cuda-graph"])
        .args(extra)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .env_remove("WORLD_SIZE");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (
        o.status.code(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// 1F1B, pp = 2, M = 3, with mb 1's forward on the last rank checkpointed and recomputed
/// before its backward: memory instructions that stay on the device, which a graph captures.
fn checkpointed() -> (pipec_compiler::compile::Compiled, Program) {
    let c = pipec_compiler::compile::compile(&CompileRequest::new(ScheduleKind::OneFOneB, 2, 3))
        .unwrap();
    let r1 = &c.program.ranks[1];
    let t1 = Task::new(1, 1);
    let b = r1.iter().position(|i| has(i, t1, &[Pass::Bwd])).unwrap();
    let mut r = insert(r1, vec![(b, mem(MemKind::Recompute, t1))]);
    let f = r.iter().position(|i| has(i, t1, &[Pass::Fwd])).unwrap();
    r[f] = Instr::FwdCheckpoint(t1);
    let mut q = c.program.clone();
    q.ranks[1] = r;
    (c, q)
}

/// The capturable programs of the GPU test: every kind of step the backend runs in one process
/// (blocking batches, batches left in flight, split backward, overlapped pairs, recompute).
fn capturable(root: &Path) -> Vec<(&'static str, std::path::PathBuf)> {
    let mut v = Vec::new();
    for (name, req) in [
        ("1f1b", CompileRequest::new(ScheduleKind::OneFOneB, 4, 8)),
        (
            "interleaved overlap",
            CompileRequest {
                vpp: Some(2),
                megatron_p2p: MegatronP2p::Overlap,
                ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 4, 8)
            },
        ),
        ("zb-v", CompileRequest::new(ScheduleKind::ZbV, 4, 8)),
        (
            "dualpipe-v",
            CompileRequest::new(ScheduleKind::DualPipeV, 4, 8),
        ),
    ] {
        let dir = root.join(name.replace(' ', "-"));
        compile_req_to(req, &dir);
        v.push((name, dir));
    }
    let dir = root.join("checkpointed");
    let (c, q) = checkpointed();
    write(&c, &q, &dir);
    v.push(("checkpointed 1f1b", dir));
    v
}

#[test]
fn cuda_graph_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    compile_req_to(
        CompileRequest::new(ScheduleKind::OneFOneB, 2, 2),
        tmp.path(),
    );
    let o = crate::harness::pipec_run()
        .arg(tmp.path())
        .args(["--cuda-graph", "--steps", "3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--cuda-graph applies to --backend cuda only"),
        "{err}"
    );
    let (code, _, err) = run(tmp.path(), &["--steps", "1"], &[]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("--cuda-graph needs --steps 2 or more"),
        "{err}"
    );
}

/// What cannot be captured is refused with its reason (exit 1), whatever the build.
#[test]
fn cuda_graph_refuses_what_it_cannot_capture() {
    let tmp = tempfile::tempdir().unwrap();
    // DualPipe: the two copies of a stage sum their gradients between steps on the host.
    let d = tmp.path().join("dualpipe");
    compile_req_to(CompileRequest::new(ScheduleKind::DualPipe, 2, 4), &d);
    let (code, _, err) = run(&d, &["--steps", "2"], &[]);
    assert_eq!(code, Some(1), "{err}");
    for w in [
        "manifest.json: field `schedule`: stage 0 runs on ranks 0 and 1",
        "without --cuda-graph",
    ] {
        assert!(err.contains(w), "{w}\n{err}");
    }
    // Offloads: the first copy to the host is named.
    let o = tmp.path().join("offload");
    let (c, q) = every_memory_op_last_rank();
    write(&c, &q, &o);
    let first = q.ranks[1]
        .iter()
        .position(|i| matches!(i, Instr::Memory(m) if m.kind == MemKind::Offload))
        .unwrap();
    let (code, _, err) = run(&o, &["--steps", "2"], &[]);
    assert_eq!(code, Some(1), "{err}");
    let want = format!("rank 1, #{first} {}", q.ranks[1][first]);
    assert!(err.contains(&want), "{want}\n{err}");
    assert!(err.contains("tune --no-offload"), "{err}");
    // A launch of several processes.
    let p = tmp.path().join("plain");
    compile_req_to(CompileRequest::new(ScheduleKind::OneFOneB, 2, 2), &p);
    let launch = [
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ];
    let (code, _, err) = run(&p, &["--steps", "2"], &launch);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("this is a launch of 2 processes"), "{err}");
}

/// Every capturable program passes the plan check and stops only where the CUDA stack is
/// missing: the build without the feature says so, a build with it names the driver.
#[test]
fn cuda_graph_takes_capturable_plans_up_to_the_cuda_stack() {
    #[cfg(feature = "cuda")]
    // SAFETY: only tries to dlopen libcuda.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        return; // a GPU machine: gpu_cuda_graph_steps_pass_the_check runs them
    }
    let tmp = tempfile::tempdir().unwrap();
    for (name, dir) in capturable(tmp.path()) {
        let (code, _, err) = run(&dir, &["--steps", "3"], &[]);
        assert_eq!(code, Some(2), "{name}: {err}");
        let want = if cfg!(feature = "cuda") {
            "CUDA driver not found"
        } else {
            "without the `cuda` feature"
        };
        assert!(err.contains(want), "{name}: {err}");
    }
}

/// On a GPU: the warm-up step, the captured step and its replays all pass `--check`, in f32
/// and bf16, and the report marks the graph steps.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_cuda_graph_steps_pass_the_check() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, dir) in capturable(tmp.path()) {
        for dtype in ["f32", "bf16"] {
            let mut extra = vec!["--dtype", dtype, "--steps", "4", "--check"];
            extra.extend(crate::cuda::TINY[..8].iter().copied());
            let (code, out, err) = run(&dir, &extra, &[]);
            assert_eq!(code, Some(0), "{name} {dtype}\n{out}\n{err}");
            assert_eq!(
                out.matches("  check: losses and").count(),
                4,
                "{name} {dtype}\n{out}"
            );
            assert!(
                out.contains("(captured in a CUDA graph, first launch)"),
                "{out}"
            );
            assert_eq!(out.matches("(CUDA graph replay)").count(), 2, "{out}");
            assert!(out.contains("cuda graph: step 1 (eager, warm-up)"), "{out}");
        }
    }
}
