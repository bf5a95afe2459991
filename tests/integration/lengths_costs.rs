//! Costs and memory that follow the microbatches' lengths (issue #38): the simulator against
//! a dataflow reference written here from the rule (linear parts x tokens/seq, attention x
//! sum (length/seq)^2, messages `p2p + msg tokens/seq / bw`), the memory peak against live
//! sets counted by hand, and uniform lengths against no lengths, bit for bit, on every kind.

use pipec_compiler::compile::{compile, CompileRequest};
use pipec_cost::cost::{CostErrorKind, CostModel, StageCosts};
use pipec_cost::lengths::{Scale, SeqFrom};
use pipec_cost::simulate::simulate;
use pipec_ir::ir::Program;
use pipec_schedules::layout::LayerKind;
use pipec_schedules::{Compute, Lengths, Pass, ScheduleKind, Task};
use std::collections::HashMap;

fn build(kind: ScheduleKind, pp: u32, m: u32, lengths: Option<&str>) -> Option<Program> {
    let vpp = match kind {
        ScheduleKind::Interleaved1F1B | ScheduleKind::LoopedBfs => Some(2),
        _ => None,
    };
    let req = CompileRequest {
        vpp,
        lengths: lengths.map(|l| Lengths::parse(l).unwrap()),
        ..CompileRequest::new(kind, pp, m)
    };
    compile(&req).ok().map(|c| c.program)
}

fn sim(p: &Program, spec: &str) -> pipec_cost::simulate::Simulation {
    let costs = StageCosts::uniform(&CostModel::parse(spec).unwrap(), p.num_stages());
    simulate(&pipec_tests::verified(p), &costs).unwrap()
}

/// The rule written out for one decoder layer per stage: keys `f b w` linear, `af ab` the
/// attention parts, for sequences `seqs` against `seq` tokens.
struct Rule {
    f: f64,
    b: f64,
    w: f64,
    af: f64,
    ab: f64,
    seq: f64,
    p2p: f64,
    msg: f64,
    bw: f64,
}

impl Rule {
    fn spec(&self) -> String {
        format!(
            "f={},b={},w={},t.attn_f={},t.attn_b={},seq={},p2p={},msg={},bw={},rendezvous=false",
            self.f, self.b, self.w, self.af, self.ab, self.seq, self.p2p, self.msg, self.bw
        )
    }

    fn tokens(&self, seqs: &[u32]) -> f64 {
        seqs.iter().map(|&l| l as f64).sum::<f64>() / self.seq
    }

    fn squares(&self, seqs: &[u32]) -> f64 {
        seqs.iter().map(|&l| (l as f64 / self.seq).powi(2)).sum()
    }

    fn time(&self, pass: Pass, seqs: &[u32]) -> f64 {
        let (lin, quad) = (self.tokens(seqs), self.squares(seqs));
        match pass {
            Pass::Fwd => self.f * lin + self.af * quad,
            Pass::BwdD => self.b * lin + self.ab * quad,
            Pass::BwdW => self.w * lin,
            Pass::Bwd => (self.b + self.w) * lin + self.ab * quad,
        }
    }

    fn message(&self, seqs: &[u32]) -> f64 {
        self.p2p + self.msg * self.tokens(seqs) / self.bw
    }
}

/// A dataflow reference for eager sends: each rank runs its compute ops in order, a forward
/// once the previous stage's forward of its microbatch has ended (plus the message when that
/// stage is on another rank), a backward once the next stage's backward (or, on the last
/// stage, its own forward) has. The makespan is the last end.
fn reference(p: &Program, rule: &Rule) -> f64 {
    let lengths = p.lengths.as_ref().unwrap();
    let last = p.num_stages() - 1;
    let ops: Vec<Vec<Compute>> = p
        .ranks
        .iter()
        .map(|r| r.iter().filter_map(|i| i.as_compute()).collect())
        .collect();
    let rank_of = |t: Task| p.placement.rank_of(t).index();
    let mut fwd_end: HashMap<Task, f64> = HashMap::new();
    let mut grad_end: HashMap<Task, f64> = HashMap::new();
    let mut pc = vec![0usize; ops.len()];
    let mut clock = vec![0.0f64; ops.len()];
    loop {
        let mut moved = false;
        for r in 0..ops.len() {
            while let Some(op) = ops[r].get(pc[r]) {
                let mut start = clock[r];
                let mut ready = true;
                for (pass, t) in op.parts() {
                    let seqs = lengths.sequences(t.mb.0);
                    let dep = match pass {
                        Pass::Fwd if t.stage.0 > 0 => {
                            let from = Task::new(t.stage.0 - 1, t.mb.0);
                            fwd_end.get(&from).map(|&e| (e, rank_of(from)))
                        }
                        Pass::Bwd | Pass::BwdD if t.stage.0 < last => {
                            let from = Task::new(t.stage.0 + 1, t.mb.0);
                            grad_end.get(&from).map(|&e| (e, rank_of(from)))
                        }
                        Pass::Bwd | Pass::BwdD => fwd_end.get(&t).map(|&e| (e, r)),
                        _ => Some((0.0, r)),
                    };
                    match dep {
                        None => ready = false,
                        Some((e, from)) => {
                            let x = if from == r { 0.0 } else { rule.message(seqs) };
                            start = start.max(e + x);
                        }
                    }
                }
                if !ready {
                    break;
                }
                let mut end = start;
                for (pass, t) in op.parts() {
                    end += rule.time(pass, lengths.sequences(t.mb.0));
                }
                for (pass, t) in op.parts() {
                    match pass {
                        Pass::Fwd => fwd_end.insert(t, end),
                        Pass::Bwd | Pass::BwdD => grad_end.insert(t, end),
                        Pass::BwdW => None,
                    };
                }
                clock[r] = end;
                pc[r] += 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    assert!(pc.iter().zip(&ops).all(|(&i, o)| i == o.len()), "stuck");
    clock.into_iter().fold(0.0, f64::max)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// (a) The simulator's makespan is the dataflow reference's, with costs, attention and
/// messages per microbatch, on GPipe, 1F1B and ZB-H1 from one rank (the sum of every
/// microbatch's passes) to four.
#[test]
fn simulated_makespans_follow_each_microbatchs_lengths() {
    let rule = Rule {
        f: 1.0,
        b: 1.5,
        w: 0.5,
        af: 0.75,
        ab: 1.25,
        seq: 1024.0,
        p2p: 0.05,
        msg: 0.5,
        bw: 2.0,
    };
    let lengths = "1024\n200 300\n700\n64,64,64,64\n1024\n512 512\n900\n32\n";
    let mut checked = 0;
    for kind in [
        ScheduleKind::Gpipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
    ] {
        for pp in [1, 2, 4] {
            let Some(p) = build(kind, pp, 8, Some(lengths)) else {
                continue;
            };
            let got = sim(&p, &rule.spec()).summary.makespan;
            let want = reference(&p, &rule);
            assert!(close(got, want), "{kind} pp {pp}: {got} != {want}");
            if pp == 1 {
                // One rank: the sum of every microbatch's forward and backward.
                let l = Lengths::parse(lengths).unwrap();
                let sum: f64 = (0..8)
                    .map(|mb| {
                        rule.time(Pass::Fwd, l.sequences(mb))
                            + rule.time(Pass::Bwd, l.sequences(mb))
                    })
                    .sum();
                assert!(close(got, sum), "{kind} pp 1: {got} != {sum}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 7, "{checked} programs");
}

/// (b) The peak of 1F1B at pp=2 is the heaviest live set, each microbatch weighing its
/// tokens / seq: rank 0 runs F0 F1 B0 F2 B1 F3 B2 B3 (live {0,1}, {1,2}, {2,3}), rank 1 one
/// microbatch at a time. `check --memory-limit` holds it: at the peak it fits, below it not.
#[test]
fn peak_memory_weighs_each_live_microbatch() {
    let p = build(
        ScheduleKind::OneFOneB,
        2,
        4,
        Some("1000\n3000\n500\n2000 500\n"),
    )
    .unwrap();
    let model = CostModel::parse("t.act=2,seq=4000").unwrap();
    let layout = pipec_schedules::layout::Layout::uniform(2);
    let mem = pipec_cost::memory::weights(&p, &layout, &model);
    let lin = [0.25, 0.75, 0.125, 0.625];
    let rank0 = 2.0
        * [lin[0] + lin[1], lin[1] + lin[2], lin[2] + lin[3]]
            .into_iter()
            .fold(0.0, f64::max);
    let rank1 = 2.0 * lin.into_iter().fold(0.0, f64::max);
    let peaks: Vec<f64> = pipec_ir::memory::peaks(&p, &mem)
        .iter()
        .map(|r| r.peak)
        .collect();
    assert_eq!(peaks, [rank0, rank1]);
    // The simulator's summary counts the same.
    let s = sim(&p, "t.act=2,seq=4000").summary;
    assert_eq!(s.peak_memory(), rank0);
    // The verifier's limit: at the peak it fits, just below it does not.
    let over = |limit: f64| {
        pipec_ir::memory::walk(&p, &mem, Some(limit))
            .iter()
            .any(|(_, over)| over.is_some())
    };
    assert!(!over(rank0));
    assert!(over(rank0 * 0.999));
    // Without lengths every microbatch weighs `t.act`: 1F1B's 2 and 1 microbatches.
    let plain = build(ScheduleKind::OneFOneB, 2, 4, None).unwrap();
    let mem = pipec_cost::memory::weights(&plain, &layout, &model);
    let peaks: Vec<f64> = pipec_ir::memory::peaks(&plain, &mem)
        .iter()
        .map(|r| r.peak)
        .collect();
    assert_eq!(peaks, [4.0, 2.0]);
}

/// (c) Every microbatch one sequence of `seq` tokens: every kind's timeline and memory are
/// the program without lengths', bit for bit, under explicit keys and a `[model]` table.
#[test]
fn uniform_lengths_cost_exactly_what_no_lengths_do() {
    let specs = [
        "f=1,b=1.5,w=0.5,t.attn_f=0.3,t.attn_b=0.6,seq=2048,p2p=0.1,msg=2,bw=4,t.act=3,overlap=0.5",
        "E.f=0.2,L.f=0.7,L.b=0.7,p2p=0.1,t.offload=0.3",
        "[model]\nhidden=1024\nffn=4096\nheads=16\nseq=2048\nvocab=32000\n",
    ];
    let lengths = "2048\n".repeat(8);
    let mut compared = 0;
    for kind in ScheduleKind::ALL {
        let (Some(plain), Some(with)) =
            (build(kind, 4, 8, None), build(kind, 4, 8, Some(&lengths)))
        else {
            continue;
        };
        for spec in specs {
            let model = CostModel::parse(spec).unwrap();
            let layout = pipec_schedules::layout::Layout::uniform(0);
            let costs = StageCosts::new(&model, &layout, plain.num_stages());
            let a = simulate(&pipec_tests::verified(&plain), &costs).unwrap();
            let b = simulate(&pipec_tests::verified(&with), &costs).unwrap();
            assert_eq!(a.timeline, b.timeline, "{kind} {spec}");
            assert_eq!(a.summary, b.summary, "{kind} {spec}");
            let layout = pipec_schedules::layout::Layout::uniform(plain.num_stages());
            assert_eq!(
                pipec_ir::memory::peaks(
                    &plain,
                    &pipec_cost::memory::weights(&plain, &layout, &model)
                ),
                pipec_ir::memory::peaks(
                    &with,
                    &pipec_cost::memory::weights(&with, &layout, &model)
                ),
                "{kind} {spec}"
            );
            compared += 1;
        }
    }
    assert!(compared >= 3 * 10, "{compared}");
}

/// (d) `seq`: the key, else the `[model]` table's, else the longest microbatch (said in the
/// header); the key wins over the table; a bad one is refused at its value.
#[test]
fn seq_comes_from_the_key_the_model_or_the_longest_microbatch() {
    let shape = "[model]\nhidden=1024\nffn=4096\nheads=16\nseq=2048\nvocab=32000\n";
    let l = Lengths::parse("512\n1024 1024\n").unwrap();
    let of = |spec: &str| Scale::of(&CostModel::parse(spec).unwrap(), &l);
    let s = of("seq=1024");
    assert_eq!((s.seq, s.seq_from), (1024, SeqFrom::Key));
    assert_eq!(
        (s.lin.clone(), s.quad.clone()),
        (vec![0.5, 2.0], vec![0.25, 2.0])
    );
    let s = of(shape);
    assert_eq!((s.seq, s.seq_from), (2048, SeqFrom::Model));
    assert_eq!(s.lin, [0.25, 1.0]);
    let s = of(&format!("seq=1024\n{shape}"));
    assert_eq!((s.seq, s.seq_from), (1024, SeqFrom::Key));
    let s = of("");
    assert_eq!((s.seq, s.seq_from), (2048, SeqFrom::Longest));
    let d = CostModel::default().describe_for(Some(&l), false);
    assert!(
        d.contains("costs per 2048 tokens (the longest microbatch"),
        "{d}"
    );
    assert_eq!(
        CostModel::default().describe_for(None, false),
        CostModel::default().describe()
    );
    // The simulator at pp=1: `seq = 1024` makes microbatch 0 half a unit, microbatch 1 two.
    let p = build(ScheduleKind::OneFOneB, 1, 2, Some("512\n1024 1024\n")).unwrap();
    assert_eq!(sim(&p, "seq=1024").summary.makespan, 3.0 * (0.5 + 2.0));
    for bad in ["seq=0", "seq=1.5", "seq=-3", "seq=many", "seq=1e3"] {
        let e = CostModel::parse(&format!("f=1,{bad}")).unwrap_err();
        assert!(matches!(e.kind, CostErrorKind::BadSeq(_)), "{bad}: {e}");
        let caret = e.render().lines().last().unwrap().to_string();
        assert_eq!(caret.trim_start(), "^".repeat(bad.len() - 4), "{bad}");
        assert_eq!(caret.len() - caret.trim_start().len(), 2 + 4 + 4, "{bad}");
    }
    assert_eq!(
        CostModel::parse("t.attn_b=-1").unwrap_err().kind,
        CostErrorKind::Negative("-1".into())
    );
    assert!(CostModel::parse("t.attn_x=1").is_err());
    // The spec reads back to the same model, and a `[model]`'s spec to the same costs.
    let m = CostModel::parse("seq=4096,t.attn_f=0.5,m.attn_b=0.25,f=2").unwrap();
    assert_eq!(CostModel::parse(&m.spec()).unwrap(), m);
    for extra in [
        "",
        "recompute=\"selective\"\n",
        "recompute=\"full\"\ncp=2\n",
        "tp=2\n",
    ] {
        let m = CostModel::parse(&format!("{shape}{extra}")).unwrap();
        let back = CostModel::parse(&m.spec()).unwrap();
        assert_eq!(back.seq, Some(2048), "{extra}");
        for k in [
            LayerKind::Embedding,
            LayerKind::Decoder,
            LayerKind::Mtp,
            LayerKind::Loss,
        ] {
            assert_eq!(back.layer(k), m.layer(k), "{extra}");
            assert_eq!(back.attention(k), m.attention(k), "{extra}");
        }
        // A uniform microbatch still costs one decoder-layer forward.
        assert_eq!(m.layer(LayerKind::Decoder).f, 1.0);
        assert!(m.attention(LayerKind::Decoder).f > 0.0);
    }
}

/// (e) One 8k sequence against eight 1k ones, the same tokens: the linear parts cost the
/// same, the attention parts eight times less.
#[test]
fn attention_is_quadratic_per_document() {
    let model = CostModel::parse("f=1,b=2,w=1,t.attn_f=2,t.attn_b=4,seq=8192").unwrap();
    let costs = StageCosts::uniform(&model, 1);
    let l = Lengths::parse(&format!("8192\n{}\n", ["1024"; 8].join(" "))).unwrap();
    let scale = Scale::of(&model, &l);
    let op = |mb| Compute::Fwd(Task::new(0, mb));
    let (long, short) = (
        scale.compute(&costs, &op(0)).unwrap(),
        scale.compute(&costs, &op(1)).unwrap(),
    );
    assert_eq!((long, short), (1.0 + 2.0, 1.0 + 2.0 / 8.0));
    let bwd = |mb| Compute::Bwd(Task::new(0, mb));
    assert_eq!(
        scale.compute(&costs, &bwd(0)).unwrap() - 3.0,
        8.0 * (scale.compute(&costs, &bwd(1)).unwrap() - 3.0)
    );
    // The same in a simulation of one rank: forward 3 and backward 3 + 4, against 1.25 and
    // 3 + 0.5.
    let p = build(
        ScheduleKind::OneFOneB,
        1,
        2,
        Some(&format!("8192\n{}\n", ["1024"; 8].join(" "))),
    )
    .unwrap();
    let s = sim(&p, &model.spec());
    assert_eq!(s.summary.makespan, 10.0 + 4.75);
    // An overlapped pair costs each half by its own microbatch.
    let pair = Compute::FwdBwd {
        fwd: Task::new(0, 1),
        bwd: Task::new(0, 0),
    };
    assert_eq!(scale.compute(&costs, &pair), Some(7.0 + 1.25));
}
