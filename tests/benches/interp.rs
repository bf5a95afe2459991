//! Interpreter overhead per instruction: every rank of a compiled program run with the no-op
//! backend (compute returns at once, receives complete at once), so what is measured is the
//! interpreter itself: tables, batching, status publishing and span timing.
//! Criterion's throughput line reads in instructions per second.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pipec_compiler::compile::{compile, CompileRequest};
use pipec_runtime::backend::noop::NoopBackend;
use pipec_runtime::interp::run_rank;
use pipec_runtime::watchdog::Watch;
use pipec_schedules::{Rank, ScheduleKind};
use std::time::{Duration, Instant};

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("interp");
    for (kind, pp, vpp, m) in [
        (ScheduleKind::OneFOneB, 8, 1, 64),
        (ScheduleKind::Interleaved1F1B, 8, 4, 64),
    ] {
        let program = compile(&CompileRequest {
            vpp: Some(vpp),
            ..CompileRequest::new(kind, pp, m)
        })
        .expect("compiles")
        .program;
        let n = program.len() as u64;
        g.throughput(Throughput::Elements(n));
        let watch = Watch::new(program.ranks.len(), Duration::from_secs(30));
        g.bench_function(format!("{kind} pp{pp} vpp{vpp} m{m} ({n} instrs)"), |b| {
            b.iter(|| {
                let origin = Instant::now();
                for r in 0..program.ranks.len() {
                    let mut be = NoopBackend;
                    let run =
                        run_rank(&program, Rank(r as u32), &mut be, &watch, origin).expect("runs");
                    criterion::black_box(run.peak_activations);
                }
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
