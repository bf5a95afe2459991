//! Issue #38's per-step planning figures, printed (asserts nothing; bench/HISTORY.md):
//!
//! 1. planning times with lengths, median of several runs: `compile_verified` (what
//!    `pipec.compile(..., lengths=)` runs) at pp=8, M=64; `tune` at pp=8, M=64 and pp=32,
//!    M=512 (the default target, as `pipec.tune` and `pipec tune` run it);
//! 2. the ordering gain: for 1F1B, interleaved 1F1B and ZB-V at pp=8, M=64, the makespan in
//!    index order against the best of the four orders tune weighs (tune's row of that kind),
//!    and the peak memory of each, on several length distributions.
//!
//! `cargo run --release -p pipec-tests --example per_step_lengths [-- RUNS]`

use pipec_compiler::compile::{compile_verified, CompileRequest};
use pipec_cost::cost::CostModel;
use pipec_schedules::{Lengths, ScheduleKind};
use pipec_tune::{tune, CandidateKind, TuneRequest};
use std::time::Instant;

/// A small deterministic generator (xorshift), so every run measures the same lengths.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Lengths of `m` microbatches by distribution, sequences at most 8192 tokens.
fn lengths(kind: &str, m: usize, seed: u64) -> Lengths {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let lists: Vec<Vec<i128>> = (0..m)
        .map(|_| match kind {
            // Uniform between 1k and 8k tokens.
            "uniform" => vec![(1024.0 + 7168.0 * r.next()) as i128],
            // Long tail: lognormal-like, most short, a few near 8k.
            "long-tail" => vec![(256.0 * (32f64).powf(r.next().powi(3))).min(8192.0) as i128],
            // Chat (100-1000 tokens) with one long-context sample in five.
            "bimodal" => {
                if r.next() < 0.2 {
                    vec![(6144.0 + 2048.0 * r.next()) as i128]
                } else {
                    vec![(100.0 + 900.0 * r.next()) as i128]
                }
            }
            // Packed to 8k: documents until the line is full, the last one cut.
            _ => {
                let mut line = Vec::new();
                let mut left = 8192i128;
                while left > 0 {
                    let d = ((64.0 * (64f64).powf(r.next())) as i128).min(left);
                    line.push(d);
                    left -= d;
                    if r.next() < 0.15 {
                        break;
                    }
                }
                line
            }
        })
        .collect();
    Lengths::from_lists(lists).expect("valid lengths")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The process's CPU time (user + system, every thread) in ms, from /proc/self/stat (Linux;
/// 0 elsewhere): on a shared machine wall time moves with the load, CPU time much less.
fn cpu_ms() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name (which may hold spaces, so split after its `)`).
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name; in ticks
    // of 10 ms on Linux's usual USER_HZ = 100.
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) * 10.0
}

/// Median wall time (ms) of `runs` runs after one warm-up, and the mean CPU time per run.
fn time<T>(runs: usize, mut f: impl FnMut() -> T) -> (f64, f64) {
    f();
    let c0 = cpu_ms();
    let wall = median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                std::hint::black_box(f());
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect(),
    );
    (wall, (cpu_ms() - c0) / runs as f64)
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    // A decoder layer with an attention core a quarter of its forward at seq = 8192.
    let spec = "seq=8192,f=1,b=1,w=1,t.attn_f=0.25,t.attn_b=0.5,p2p=0.05";
    let model = CostModel::parse(spec)
        .or_else(|_| CostModel::parse("f=1,b=1,w=1,p2p=0.05"))
        .expect("cost spec");
    println!("cost model: {}", model.describe());
    println!("planning times, median of {runs} runs (ms):");
    let l64 = lengths("bimodal", 64, 1);
    let ms = time(runs, || {
        compile_verified(
            &CompileRequest {
                vpp: Some(2),
                lengths: Some(l64.clone()),
                ..CompileRequest::new(ScheduleKind::Interleaved1F1B, 8, 64)
            },
            &model,
            None,
        )
        .expect("compiles")
    });
    println!(
        "  compile interleaved-1f1b pp=8 vpp=2 M=64: {:.2} wall, {:.2} CPU",
        ms.0, ms.1
    );
    for (pp, m) in [(8u32, 64usize), (32, 512)] {
        let l = lengths("bimodal", m, 2);
        let req = TuneRequest {
            lengths: Some(l),
            target: pipec_compiler::target::TargetChoice::Every,
            // The default of `pipec tune` and `pipec.tune`.
            ..TuneRequest::new(pp, m as u32, model.clone())
        };
        let n = if m > 64 { runs.min(5) } else { runs * 4 };
        let ms = time(n, || tune(&req).expect("tunes"));
        let plain = TuneRequest {
            lengths: None,
            ..req.clone()
        };
        let ms0 = time(n, || tune(&plain).expect("tunes"));
        println!(
            "  tune pp={pp} M={m}: {:.1} wall, {:.1} CPU with lengths; {:.1} wall, {:.1} CPU without",
            ms.0, ms.1, ms0.0, ms0.1
        );
    }
    println!();
    println!("ordering gain at pp=8, M=64 (index order -> tune's order of that kind):");
    for dist in ["uniform", "long-tail", "bimodal", "packed"] {
        let l = lengths(dist, 64, 3);
        let req = TuneRequest {
            lengths: Some(l.clone()),
            kinds: Some(vec![
                "1f1b".into(),
                "interleaved-1f1b".into(),
                "zb-v".into(),
            ]),
            ..TuneRequest::new(8, 64, model.clone())
        };
        let t = tune(&req).expect("tunes");
        let index = TuneRequest {
            lengths: Some(l),
            ..req.clone()
        };
        // Index order: the same kinds with only index order weighed is what compile gives.
        for c in &t.candidates {
            let CandidateKind::Builtin(kind) = c.schedule else {
                continue;
            };
            let base = compile_verified(
                &CompileRequest {
                    vpp: Some(c.vpp),
                    group_size: c.group_size,
                    layout: Some(c.layout.clone()),
                    lengths: index.lengths.clone(),
                    ..CompileRequest::new(kind, 8, 64)
                },
                &model,
                None,
            )
            .expect("compiles");
            let program = base.verified.program();
            let costs =
                pipec_cost::cost::StageCosts::new(&model, &base.layout, program.num_stages());
            let sim = pipec_cost::simulate::simulate(&base.verified, &costs).expect("simulates");
            let before = sim.summary.makespan;
            // Tune's order compiled by `pipec compile`'s path and simulated: the same figure.
            let again = compile_verified(
                &CompileRequest {
                    vpp: Some(c.vpp),
                    group_size: c.group_size,
                    layout: Some(c.layout.clone()),
                    lengths: index.lengths.clone(),
                    microbatch_order: c.microbatch_order.clone(),
                    ..CompileRequest::new(kind, 8, 64)
                },
                &model,
                None,
            )
            .expect("compiles");
            let after = pipec_cost::simulate::simulate(&again.verified, &costs)
                .expect("simulates")
                .summary
                .makespan;
            assert!(
                (after - c.makespan).abs() <= 1e-9 * after,
                "{after} {}",
                c.makespan
            );
            println!(
                "  {dist:<9} {:<24} {:>9.2} -> {:>9.2} ({:+.1}%), peak {:.2} -> {:.2} [{}]",
                pipec_tune::describe(c),
                before,
                c.makespan,
                (c.makespan / before - 1.0) * 100.0,
                sim.summary.peak_memory(),
                c.peak_memory,
                c.microbatch_order_rule.as_deref().unwrap_or("-")
            );
        }
    }
}
