//! `pipec tune` end to end (every placement and split, every heuristic, every built-in kind,
//! lowering, simulation and the verification of the winner) on an uneven model: heavy
//! embedding and output stages, `b > f`, `w < b`. The targets: pp=8 M=64 under 0.1 s,
//! pp=64 M=1024 under 10 s on a 2-core machine. Also issue #28's case, `pipec tune --pp 64
//! --microbatches 1024 --num-layers 126 --target any` with the default costs (the library's
//! default target is `any`), to hold against `pipec compile` of zb-v (at most 10x).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use pipec_cost::cost::CostModel;
use pipec_tune::{tune, TuneRequest};

fn bench(c: &mut Criterion) {
    let model =
        CostModel::parse("f=1,b=1.5,w=0.7,E.f=2,E.b=2,E.w=1,L.f=3,L.b=3,L.w=1").expect("cost spec");
    let mut g = c.benchmark_group("tune");
    g.sample_size(10);
    for (pp, m, layers) in [(8u32, 64u32, 62u32), (64, 1024, 126)] {
        let req = TuneRequest {
            num_layers: Some(layers),
            ..TuneRequest::new(pp, m, model.clone())
        };
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("pp{pp}_m{m}_{layers}layers")),
            &req,
            |b, r| b.iter(|| tune(r).expect("a schedule")),
        );
    }
    let req = TuneRequest {
        num_layers: Some(126),
        ..TuneRequest::new(64, 1024, CostModel::default())
    };
    g.bench_with_input(
        BenchmarkId::from_parameter("pp64_m1024_126layers_default_costs_any"),
        &req,
        |b, r| b.iter(|| tune(r).expect("a schedule")),
    );
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
