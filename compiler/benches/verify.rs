//! Verification time of interleaved 1F1B programs (Megatron's order and comm placement) at
//! three sizes, up to about 3 million instructions (pp=64, vpp=8, M=1024).
//! `cargo bench -p pipec-compiler --bench verify`; `-- small` for only the smallest size.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pipec_compiler::lower::lower;
use pipec_ir::verify::{verify, VerifyOptions};
use pipec_schedules::{generate, Limits, ScheduleKind, ScheduleSpec};
use std::time::Duration;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("verify/interleaved-1f1b");
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(10));
    for (name, pp, vpp, m) in [
        ("small pp=8 vpp=2 M=64", 8, 2, 64),
        ("medium pp=32 vpp=4 M=256", 32, 4, 256),
        ("large pp=64 vpp=8 M=1024", 64, 8, 1024),
    ] {
        let spec = ScheduleSpec::new(ScheduleKind::Interleaved1F1B, pp, vpp, m);
        let program = lower(&generate(&spec, &Limits::DEFAULT).expect("valid spec"));
        let report = verify(&program, &VerifyOptions::default());
        assert!(report.is_valid(), "{report}");
        group.throughput(Throughput::Elements(program.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &program, |b, p| {
            b.iter(|| verify(p, &VerifyOptions::default()))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
