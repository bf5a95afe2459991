//! The CUDA backend (`pipec-run --backend cuda`, `pipec_cuda::run::run_cuda`).
//!
//! Everywhere: the CLI's clear errors (without the feature; without a driver; `--dtype` on
//! the CPU backend). On a GPU machine (`#[ignore]`d, needs the `cuda` feature):
//!
//! ```text
//! cargo test -p pipec-tests --features cuda --test integration cuda -- --ignored --test-threads 1
//! ```
//!
//! `--check` against the single-thread CPU reference for 1f1b, interleaved-1f1b and zb-v in
//! fp32 and bf16 (one process, rank threads), and a 2-process NCCL launch with torchrun's
//! variables.

#[cfg(feature = "cuda")]
use crate::harness::cuda_bin;
use pipec_compiler::compile::{compile, CompileRequest};
use pipec_ir::files::{write_program, Encoding, Header};
use pipec_ir::ir::Instr;
use pipec_schedules::{MegatronP2p, ScheduleKind};
use std::path::Path;

fn compile_to(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, dir: &Path) {
    compile_p2p_to(kind, pp, vpp, m, MegatronP2p::default_for(kind, pp), dir)
}

fn compile_p2p_to(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, p2p: MegatronP2p, dir: &Path) {
    compile_req_to(
        CompileRequest {
            vpp: Some(vpp),
            megatron_p2p: p2p,
            ..CompileRequest::new(kind, pp, m)
        },
        dir,
    )
}

pub(crate) fn compile_req_to(req: CompileRequest, dir: &Path) {
    let c = compile(&req).unwrap();
    let header = Header {
        source: "generated",
        schedule: Some(c.spec),
        layout: &c.layout,
    };
    write_program(
        dir,
        &header,
        &pipec_tests::verified(&c.program),
        Encoding::Json,
    )
    .unwrap();
}

/// Megatron's overlap mode (interleaved pp=4 vpp=2, 8 microbatches) with every `wait`
/// written twice, as a hand-written program may (`work.wait()` twice): the second wait on a
/// completed batch must do nothing but keep one timing span per instruction. No generator
/// writes this, so it is the only program that reaches `Backend::rewait`.
fn write_double_wait_program(dir: &Path) {
    let c = compile(&CompileRequest {
        vpp: Some(2),
        megatron_p2p: MegatronP2p::Overlap,
        ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 4, 8)
    })
    .unwrap();
    let mut program = c.program.clone();
    let mut doubled = 0;
    for rank in &mut program.ranks {
        *rank = rank
            .iter()
            .flat_map(|&i| match i {
                Instr::Wait { .. } => vec![i, i],
                _ => vec![i],
            })
            .collect();
        doubled += rank
            .iter()
            .filter(|i| matches!(i, Instr::Wait { .. }))
            .count()
            / 2;
    }
    assert!(doubled > 0, "overlap mode has waits to double");
    let header = Header {
        source: "hand-written: every wait twice",
        schedule: None,
        layout: &c.layout,
    };
    write_program(
        dir,
        &header,
        &pipec_tests::verified(&program),
        Encoding::Json,
    )
    .unwrap();
}

/// The doubled waits load (the verifier accepts a second wait on a completed batch) and pass
/// the bitwise check on the CPU backend.
#[test]
fn a_second_wait_on_a_batch_passes_on_the_cpu_backend() {
    let tmp = tempfile::tempdir().unwrap();
    write_double_wait_program(tmp.path());
    let loaded = pipec_runtime::load(tmp.path(), None).unwrap();
    let waits: usize =
        loaded
            .program
            .program()
            .ranks
            .iter()
            .map(|r| {
                r.windows(2)
            .filter(|w| matches!(w, [Instr::Wait { batch: a }, Instr::Wait { batch: b }] if a == b))
            .count()
            })
            .sum();
    assert!(waits > 0);
    cpu_check(tmp.path(), "every wait twice");
}

/// The same on the GPU: `rewait` closes a span at once, so the trace still has one span per
/// instruction ([`gpu_check`] counts them).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_a_second_wait_on_a_batch() {
    let tmp = tempfile::tempdir().unwrap();
    write_double_wait_program(tmp.path());
    for dtype in ["f32", "bf16"] {
        gpu_check(tmp.path(), dtype, "every wait twice");
    }
}

#[test]
fn dtype_is_refused_on_the_cpu_backend() {
    let tmp = tempfile::tempdir().unwrap();
    compile_to(ScheduleKind::OneFOneB, 2, 1, 2, tmp.path());
    let out = crate::harness::pipec_run()
        .arg(tmp.path())
        .args(["--dtype", "bf16"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--dtype applies to --backend cuda only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Without the feature the binary says how to rebuild; with it but without a GPU driver it
/// names the missing library. Both exit 2, before anything runs.
#[test]
fn cuda_backend_fails_clearly_without_feature_or_driver() {
    let tmp = tempfile::tempdir().unwrap();
    compile_to(ScheduleKind::OneFOneB, 2, 1, 2, tmp.path());
    let out = crate::harness::pipec_run_cuda()
        .arg(tmp.path())
        .args(["--backend", "cuda"])
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    if cfg!(feature = "cuda") {
        #[cfg(feature = "cuda")]
        {
            // SAFETY: only tries to dlopen libcuda.
            let driver = unsafe { cudarc::driver::sys::is_culib_present() };
            if !driver {
                assert_eq!(out.status.code(), Some(2), "{err}");
                assert!(err.contains("CUDA driver not found"), "{err}");
            }
        }
    } else {
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("without the `cuda` feature"), "{err}");
    }
}

/// The library function gives the same clear error (no panic from cudarc) without a driver.
#[cfg(feature = "cuda")]
#[test]
fn run_cuda_reports_a_missing_driver() {
    use pipec_cuda::run::{run_cuda, CudaRunOptions, Dtype};
    // SAFETY: only tries to dlopen libcuda.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        return; // a GPU machine: the #[ignore]d tests below cover it
    }
    let tmp = tempfile::tempdir().unwrap();
    compile_to(ScheduleKind::OneFOneB, 2, 1, 2, tmp.path());
    let loaded = pipec_runtime::load(tmp.path(), None).unwrap();
    let opts = CudaRunOptions {
        model: Default::default(),
        steps: 1,
        lr: 0.1,
        timeout: std::time::Duration::from_secs(5),
        check: true,
        dtype: Dtype::F32,
        launch: None,
        cuda_graph: false,
    };
    let e = run_cuda(&loaded.program, &loaded.manifest.layout, &opts).unwrap_err();
    assert_eq!(e.exit_code(), 2);
    assert!(e.to_string().contains("CUDA driver not found"), "{e}");
}

pub(crate) const TINY: [&str; 10] = [
    "--hidden", "64", "--ffn", "128", "--vocab", "96", "--seq", "16", "--steps", "2",
];

#[cfg(feature = "cuda")]
fn check_single_process(kind: ScheduleKind, pp: u32, vpp: u32, dtype: &str) {
    check_single_process_p2p(kind, pp, vpp, MegatronP2p::default_for(kind, pp), dtype)
}

#[cfg(feature = "cuda")]
fn check_single_process_p2p(kind: ScheduleKind, pp: u32, vpp: u32, p2p: MegatronP2p, dtype: &str) {
    let tmp = tempfile::tempdir().unwrap();
    compile_p2p_to(kind, pp, vpp, 2 * pp, p2p, tmp.path());
    gpu_check(tmp.path(), dtype, &format!("{kind:?} {p2p:?}"));
}

/// `pipec-run DIR --backend cuda --check` in one process passes both steps and writes its
/// trace (`DIR/trace.json`); returns what it printed.
#[cfg(feature = "cuda")]
pub(crate) fn gpu_check(dir: &Path, dtype: &str, what: &str) -> String {
    let trace = dir.join("trace.json");
    let out = cuda_bin()
        .arg(dir)
        .args(["--backend", "cuda", "--check", "--dtype", dtype])
        .args(TINY)
        .arg("--trace")
        .arg(&trace)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID")
        .output()
        .unwrap();
    let (so, se) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(0), "{what} {dtype}\n{so}\n{se}");
    assert_eq!(so.matches("  check: ").count(), 2, "{so}");
    assert!(so.contains("makespan: measured"), "{so}");
    assert_one_span_per_instruction(dir, &trace, what);
    so.into_owned()
}

/// A `--trace` file holds one complete ("X") event per instruction of the program in `dir`.
fn assert_one_span_per_instruction(dir: &Path, trace: &Path, what: &str) {
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(trace).unwrap()).unwrap();
    let spans = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .count();
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let instrs: u64 = m["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["instructions"].as_u64().unwrap())
        .sum();
    assert_eq!(spans as u64, instrs, "{what}: spans in the trace");
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_1f1b() {
    for dt in ["f32", "bf16"] {
        check_single_process(ScheduleKind::OneFOneB, 4, 1, dt);
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_interleaved_1f1b() {
    for dt in ["f32", "bf16"] {
        check_single_process(ScheduleKind::Interleaved1F1B, 2, 2, dt);
    }
}

/// Megatron's P2P modes on the GPU: batches left in flight (`wait` instructions) post on the
/// comm stream while compute goes on, and the compute stream waits for them at the `wait`.
/// pp = 4 with vpp = 2 and 8 microbatches: the group size (pp) equals the microbatches / 2.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_interleaved_every_p2p_mode() {
    for p2p in [
        MegatronP2p::Overlap,
        MegatronP2p::OverlapFlush,
        MegatronP2p::OverlapKeepOutputs,
        MegatronP2p::Unbatched,
        MegatronP2p::Batched,
    ] {
        check_single_process_p2p(ScheduleKind::Interleaved1F1B, 4, 2, p2p, "f32");
    }
    check_single_process_p2p(
        ScheduleKind::Interleaved1F1B,
        2,
        3,
        MegatronP2p::Overlap,
        "bf16",
    );
}

/// `CompileRequest::new` with two chunks for the kinds that take any number (they have no
/// default: one chunk would not be what their name promises).
fn request(k: ScheduleKind, pp: u32, m: u32) -> CompileRequest {
    CompileRequest {
        vpp: (k.chunk_rule() == pipec_schedules::ChunkRule::Any).then_some(2),
        ..CompileRequest::new(k, pp, m)
    }
}

/// Every schedule kind at pp = 4 with 8 microbatches (each kind's default P2P mode, two
/// chunks where the kind takes any number), two forward-only programs and an uneven layout
/// with an MTP layer.
fn every_kind_programs() -> Vec<(String, CompileRequest)> {
    let mut v: Vec<(String, CompileRequest)> = ScheduleKind::ALL
        .iter()
        .map(|&k| (k.name().to_string(), request(k, 4, 8)))
        .collect();
    for k in [ScheduleKind::OneFOneB, ScheduleKind::Interleaved1F1B] {
        v.push((
            format!("{} forward-only", k.name()),
            CompileRequest {
                forward_only: true,
                ..request(k, 4, 8)
            },
        ));
    }
    v.push((
        "interleaved layout Et|tt|t,m|L".into(),
        CompileRequest {
            layout: Some("Et|tt|t,m|L".into()),
            ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 2, 4)
        },
    ));
    v
}

/// Every kind on the GPU, fp32 and bf16, against the CPU reference.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_every_kind() {
    gpu_check_each(every_kind_programs());
}

/// [`gpu_check`] of each program in fp32 and in bf16.
#[cfg(feature = "cuda")]
fn gpu_check_each<S: AsRef<str>>(programs: impl IntoIterator<Item = (S, CompileRequest)>) {
    for (name, req) in programs {
        for dtype in ["f32", "bf16"] {
            let tmp = tempfile::tempdir().unwrap();
            compile_req_to(req.clone(), tmp.path());
            gpu_check(tmp.path(), dtype, name.as_ref());
        }
    }
}

/// Programs with overlapped `fwd_bwd` pairs.
fn overlapped_pair_programs() -> [(&'static str, CompileRequest); 2] {
    [
        (
            "dualpipe-v",
            CompileRequest::new(ScheduleKind::DualPipeV, 2, 4),
        ),
        (
            "1f1b combined",
            CompileRequest {
                combined: true,
                ..CompileRequest::new(ScheduleKind::OneFOneB, 4, 8)
            },
        ),
    ]
}

/// Overlapped `fwd_bwd` pairs (the forward on the second stream beside the backward):
/// DualPipe-V's F&B steps and Megatron's combined 1F1B, against the CPU reference.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_overlapped_pairs() {
    gpu_check_each(overlapped_pair_programs());
}

/// Under a launcher (NCCL, one process per rank) what that mode cannot run is refused before
/// anything touches NCCL or a GPU: batches left in flight (it completes each batch before the
/// next, a stricter order than the per-communicator one the verifier proves) and stages held
/// by two ranks (DualPipe: their
/// gradients are summed in one process only). Runs without a GPU (a stand-in NCCL file only
/// gets `pipec-run` past its link-and-re-execute step).
#[cfg(all(feature = "cuda", unix))]
#[test]
fn cuda_nccl_mode_refuses_what_it_cannot_run() {
    let overlap = CompileRequest {
        vpp: Some(2),
        megatron_p2p: MegatronP2p::Overlap,
        ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 2, 4)
    };
    let dualpipe = CompileRequest::new(ScheduleKind::DualPipe, 2, 4);
    for (req, want) in [
        (
            overlap,
            &[
                "manifest.json: field `schedule`: rank 0, #",
                " wait(batch ",
                "runs only in one process",
            ][..],
        ),
        (
            dualpipe,
            &[
                "manifest.json: field `placement`: stage 0 runs on ranks 0 and 1",
                "summed after each step only in one process",
            ][..],
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("p");
        compile_req_to(req, &dir);
        let fake = tmp.path().join("libnccl.so.2");
        std::fs::write(&fake, b"").unwrap();
        let out = cuda_bin()
            .arg(&dir)
            .args(["--backend", "cuda"])
            .env("PIPEC_NCCL_LIB", &fake)
            .env_remove("PIPEC_NCCL_REEXEC")
            .env("RANK", "0")
            .env("LOCAL_RANK", "0")
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", "1")
            .output()
            .unwrap();
        let se = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{se}");
        for w in want {
            assert!(se.contains(w), "{w}\n{se}");
        }
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_check_zb_v() {
    for dt in ["f32", "bf16"] {
        check_single_process(ScheduleKind::ZbV, 2, 2, dt);
    }
}

/// The programs and flags of the GPU tests, on the CPU backend: they compile, verify and pass
/// the (bitwise) check there, so a GPU failure is the GPU's.
#[test]
fn gpu_test_programs_pass_on_the_cpu_backend() {
    use MegatronP2p::*;
    let il = ScheduleKind::Interleaved1F1B;
    for (kind, pp, vpp, p2p) in [
        (ScheduleKind::OneFOneB, 4, 1, Batched),
        (il, 2, 2, MegatronP2p::default_for(il, 2)),
        (ScheduleKind::ZbV, 2, 2, Batched),
        (il, 4, 2, Overlap),
        (il, 4, 2, OverlapFlush),
        (il, 4, 2, OverlapKeepOutputs),
        (il, 4, 2, Unbatched),
        (il, 4, 2, Batched),
        (il, 2, 3, Overlap),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        compile_p2p_to(kind, pp, vpp, 2 * pp, p2p, tmp.path());
        cpu_check(tmp.path(), &format!("{kind:?} {p2p:?}"));
    }
    for (name, req) in overlapped_pair_programs() {
        let tmp = tempfile::tempdir().unwrap();
        compile_req_to(req, tmp.path());
        cpu_check(tmp.path(), name);
    }
    for (name, req) in every_kind_programs() {
        let tmp = tempfile::tempdir().unwrap();
        compile_req_to(req, tmp.path());
        cpu_check(tmp.path(), &name);
    }
}

/// `pipec-run DIR --check` on the CPU backend passes (bitwise) on the GPU tests' model size
/// and writes its trace (`DIR/trace.json`); returns what it printed.
pub(crate) fn cpu_check(dir: &Path, what: &str) -> String {
    let trace = dir.join("trace.json");
    let out = crate::harness::pipec_run()
        .arg(dir)
        .arg("--check")
        .args(TINY)
        .arg("--trace")
        .arg(&trace)
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{what}\n{so}");
    assert_eq!(so.matches("  check: ").count(), 2, "{so}");
    assert_one_span_per_instruction(dir, &trace, what);
    so.into_owned()
}

/// Two processes, one rank each on its own GPU (NCCL refuses two ranks of a communicator on
/// one GPU, so this needs two GPUs),
/// launched with torchrun's variables; rank 0 prints the loss, every rank its busy/idle line,
/// and both pass the check of their own stages. Under each `--p2p-groups` layout: `pair` one
/// P2P communicator, `direction` two over both ranks (activations, gradients), `edge` two
/// (R0->R1, R1->R0), each besides the one over all ranks that sums the losses.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU and NCCL: cargo test -p pipec-tests --features cuda -- --ignored"]
fn gpu_two_process_nccl() {
    use pipec_cuda::probe;
    if pipec_cuda::probe_libraries(false).is_err() {
        eprintln!("skipped: no CUDA driver");
        return;
    }
    // SAFETY: only tries to dlopen NCCL.
    let loadable = unsafe { cudarc::nccl::sys::is_culib_present() };
    if !loadable && probe::find_nccl(&probe::NcclSearch::from_env()).is_err() {
        eprintln!("skipped: NCCL not found");
        return;
    }
    if cudarc::driver::CudaContext::device_count().unwrap_or(0) < 2 {
        eprintln!("skipped: needs 2 GPUs (NCCL allows one rank per GPU per communicator)");
        return;
    }
    for groups in pipec_schedules::P2pGroups::ALL {
        two_process_nccl(groups);
    }
}

#[cfg(feature = "cuda")]
fn two_process_nccl(groups: pipec_schedules::P2pGroups) {
    let tmp = tempfile::tempdir().unwrap();
    compile_req_to(
        CompileRequest {
            vpp: Some(1),
            megatron_p2p: MegatronP2p::default_for(ScheduleKind::OneFOneB, 2),
            p2p_groups: groups,
            ..CompileRequest::new(ScheduleKind::OneFOneB, 2, 4)
        },
        tmp.path(),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let children: Vec<_> = (0..2)
        .map(|r| {
            cuda_bin()
                .arg(tmp.path())
                .args(["--backend", "cuda", "--check", "--timeout", "60"])
                .args(TINY)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    for (r, o) in outs.iter().enumerate() {
        let (so, se) = (
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr),
        );
        assert_eq!(o.status.code(), Some(0), "{groups}: rank {r}\n{so}\n{se}");
        assert!(so.contains(&format!("  rank {r} (GPU ")), "{groups}: {so}");
        assert_eq!(
            so.contains("step 1: loss"),
            r == 0,
            "{groups}: rank {r}: {so}"
        );
    }
}
