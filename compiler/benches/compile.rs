//! Benchmarks of the compile pipeline, phase by phase, at the sizes issue #8 names:
//! S = interleaved-1f1b pp=8 vpp=2 M=64, M = pp=32 vpp=4 M=256, L = pp=64 vpp=8 M=1024
//! (about a million compute ops, three million instructions).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use pipec_compiler::lower;
use pipec_ir::files::{load_dir, render, write_program, Encoding, Header};
use pipec_ir::verify::{verified, VerifyOptions};
use pipec_schedules::layout::{self, Layout};
use pipec_schedules::{generate, Limits, ScheduleKind, ScheduleSpec};
use std::hint::black_box;

const SIZES: [(&str, u32, u32, u32); 3] = [("S", 8, 2, 64), ("M", 32, 4, 256), ("L", 64, 8, 1024)];

fn spec(pp: u32, vpp: u32, m: u32) -> ScheduleSpec {
    ScheduleSpec::new(ScheduleKind::Interleaved1F1B, pp, vpp, m)
}

fn phases(c: &mut Criterion) {
    let mut g = c.benchmark_group("compile");
    g.sample_size(10);
    g.bench_function("layout_parse/dsv3", |b| {
        b.iter(|| layout::parse(black_box("Et*3|(tt|)*29,m|L")))
    });
    for (name, pp, vpp, m) in SIZES {
        let s = spec(pp, vpp, m);
        let sched = generate(&s, &Limits::DEFAULT).unwrap();
        let prog = lower(&sched);
        // Verified once, outside the timed loops: the writers take the verdict.
        let verified = verified(&prog, &VerifyOptions::default()).expect("valid");
        g.throughput(Throughput::Elements(prog.len() as u64));
        g.bench_function(format!("generate/{name}"), |b| {
            b.iter(|| generate(black_box(&s), &Limits::DEFAULT).unwrap())
        });
        g.bench_function(format!("lower/{name}"), |b| {
            b.iter(|| lower(black_box(&sched)))
        });
        let layout = Layout::uniform(pp * vpp);
        let header = Header {
            source: "generated",
            schedule: Some(s),
            layout: &layout,
        };
        for (label, enc) in [
            ("emit_json", Encoding::Json),
            ("emit_bin", Encoding::Postcard),
        ] {
            g.bench_function(format!("{label}/{name}"), |b| {
                b.iter_batched(
                    || (),
                    |_| render(&header, black_box(&verified), enc),
                    BatchSize::PerIteration,
                )
            });
        }
        // The whole files path as `pipec compile` and `pipec check` run it: written to a
        // directory (on every core, streamed) and read back (hashes, parse, schedule hash).
        let dir = std::env::temp_dir().join(format!("pipec-bench-files-{}", std::process::id()));
        for (label, enc) in [("json", Encoding::Json), ("bin", Encoding::Postcard)] {
            g.bench_function(format!("write_{label}/{name}"), |b| {
                b.iter(|| write_program(&dir, &header, black_box(&verified), enc).unwrap())
            });
            // The directory as written (also when a filter skipped the write benchmark).
            write_program(&dir, &header, &verified, enc).unwrap();
            g.bench_function(format!("load_{label}/{name}"), |b| {
                b.iter(|| load_dir(black_box(&dir)).unwrap())
            });
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    // The lockstep lowering (a timed list schedule, then one batch per instant and rank) on
    // the kinds that use it, at the L sizes.
    for (label, kind, vpp) in [
        ("looped-bfs", ScheduleKind::LoopedBfs, 8),
        ("zb-v", ScheduleKind::ZbV, 2),
        ("dualpipe", ScheduleKind::DualPipe, 1),
    ] {
        let s = ScheduleSpec::new(kind, 64, vpp, 1024);
        let sched = generate(&s, &Limits::DEFAULT).unwrap();
        g.throughput(Throughput::Elements(lower(&sched).len() as u64));
        g.bench_function(format!("lower_lockstep/{label}/L"), |b| {
            b.iter(|| lower(black_box(&sched)))
        });
    }
    // Megatron's training default for interleaving (overlap_p2p_comm): every op its own batch
    // and a wait before use, so about 60% more instructions than the batched lowering.
    let s = ScheduleSpec {
        megatron_p2p: pipec_schedules::MegatronP2p::Overlap,
        ..spec(64, 8, 1024)
    };
    let sched = generate(&s, &Limits::DEFAULT).unwrap();
    g.throughput(Throughput::Elements(lower(&sched).len() as u64));
    g.bench_function("lower_megatron_overlap/L", |b| {
        b.iter(|| lower(black_box(&sched)))
    });
    g.finish();
}

criterion_group!(benches, phases);
criterion_main!(benches);
