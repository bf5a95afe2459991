//! Simulation speed at the benchmark sizes of the design: interleaved 1F1B at
//! pp=8 vpp=2 M=64, pp=32 vpp=4 M=256 and pp=64 vpp=8 M=1024 (about 3M instructions).
//! Generation and lowering happen outside the timed loop; `simulate` includes the send/recv
//! matching and the per-rank summary.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use pipec_compiler::compile::{compile, CompileRequest};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::simulate_unverified;
use pipec_ir::verify::Unverified;
use pipec_schedules::ScheduleKind;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("simulate/interleaved-1f1b");
    g.sample_size(10);
    for (pp, vpp, m) in [(8, 2, 64), (32, 4, 256), (64, 8, 1024)] {
        let compiled = compile(&CompileRequest {
            vpp: Some(vpp),
            ..CompileRequest::new(ScheduleKind::Interleaved1F1B, pp, m)
        })
        .expect("valid spec");
        let costs = StageCosts::new(
            &CostModel::parse("p2p=0.05").expect("cost spec"),
            &compiled.layout,
            compiled.program.num_stages(),
        );
        let n = compiled.program.len();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("pp{pp}_vpp{vpp}_m{m}_{n}instrs")),
            &compiled.program,
            |b, p| {
                // Unverified: the timed loop includes the send/recv matching, as before.
                b.iter(|| {
                    simulate_unverified(&Unverified::unchecked(p), &costs).expect("no deadlock")
                })
            },
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
