//! Megatron's `variable_seq_lengths` handshake (issue #38, "Megatron's handshake, modelled").
//!
//! `tests/golden/megatron/shapes.txt.gz` was recorded by `tests/golden/megatron/record_shapes.py`:
//! megatron-core 0.19.2's real schedule functions with `variable_seq_lengths=True`, every P2P
//! primitive and `torch.cuda.synchronize()` recorded (`S`), each shape message named by the
//! tensor it announces (the sender's tensor; for a receive, the tensor whose buffer Megatron
//! sized from it). `every_rank_is_megatrons_handshake_one_for_one` checks that
//! `pipec compile --megatron-variable-seq-lengths` writes that stream, op for op, for every
//! recorded configuration and P2P mode. `what_check_finds_in_megatrons_handshake` then runs the
//! verifier on each and checks its crossed shapes against a FIFO pairing of the recording
//! itself; the table it prints is docs/megatron.md's "Megatron's handshake".

use super::megatron_calls::{golden_text, normal, ours, parse_header};
use pipec_compiler::lower::lower_megatron_shapes;
use pipec_ir::verify::{verify, VerifyOptions, Violation};
use pipec_ir::Program;
use pipec_schedules::{generate, Limits, MegatronP2p, ScheduleKind, ScheduleSpec};
use pipec_tests::reference::{execute, Verdict};
use std::collections::{BTreeMap, HashMap, HashSet};

/// Megatron's tokens with each `S` (`torch.cuda.synchronize()`, which completes every kernel
/// of the device) as a wait on each handle posted and not yet waited, in posting order, and
/// later waits on those handles dropped (they return at once).
fn expand_sync(tokens: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut pending: Vec<String> = Vec::new();
    let mut synced: HashSet<String> = HashSet::new();
    let handle = |t: &str| t[1..].split(':').next().unwrap_or_default().to_string();
    for t in tokens {
        match t.as_bytes()[0] {
            b's' | b'r' => {
                pending.push(handle(t));
                out.push(t.clone());
            }
            b'w' => {
                let h = t[1..].to_string();
                if !synced.contains(&h) {
                    pending.retain(|p| *p != h);
                    out.push(t.clone());
                }
            }
            b'S' if t == "S" => {
                for h in pending.drain(..) {
                    out.push(format!("w{h}"));
                    synced.insert(h);
                }
            }
            _ => out.push(t.clone()),
        }
    }
    out
}

struct Line<'a> {
    head: &'a str,
    spec: ScheduleSpec,
    ranks: Option<Vec<Vec<String>>>,
}

fn lines(text: &str) -> Vec<Line<'_>> {
    let mut it = text.lines();
    let header = it.next().expect("header");
    assert!(header.starts_with("# megatron-core 0.19.2 "), "{header}");
    it.map(|line| {
        let (head, ranks) = match line.split_once(" ! ") {
            Some((h, _)) => (h, None),
            None => {
                let (h, r) = line.split_once(" | ").expect("config line");
                let ranks = r
                    .split(" | ")
                    .map(|r| r.split_whitespace().map(String::from).collect())
                    .collect();
                (h, Some(ranks))
            }
        };
        let c = parse_header(head);
        let spec = ScheduleSpec {
            kind: if c.interleaved {
                ScheduleKind::Interleaved1F1B
            } else {
                ScheduleKind::OneFOneB
            },
            pp: c.pp,
            vpp: c.vpp,
            microbatches: c.m,
            group_size: if c.interleaved { c.g } else { None },
            forward_only: c.fo,
            combined: c.combined,
            megatron_p2p: c.mode,
        };
        Line { head, spec, ranks }
    })
    .collect()
}

fn program(spec: &ScheduleSpec) -> Option<Program> {
    spec.validate(&Limits::DEFAULT).ok()?;
    lower_megatron_shapes(&generate(spec, &Limits::DEFAULT).ok()?)
}

#[test]
fn every_rank_is_megatrons_handshake_one_for_one() {
    let text = golden_text("shapes.txt.gz");
    let (mut checked, mut refused, mut pp2_batched, mut shapes) = (0, 0, 0, 0usize);
    let mut seen: HashSet<(bool, MegatronP2p, u32)> = HashSet::new();
    let mut failures = Vec::new();
    for l in lines(&text) {
        let interleaved = l.spec.kind == ScheduleKind::Interleaved1F1B;
        let verdict = l.spec.validate(&Limits::DEFAULT);
        let Some(ranks) = &l.ranks else {
            if verdict.is_ok() {
                failures.push(format!("{}: Megatron refuses, pipec accepts", l.head));
            }
            refused += 1;
            continue;
        };
        if interleaved && l.spec.pp == 2 && l.spec.megatron_p2p == MegatronP2p::Batched {
            // Refused by pipec and Megatron-LM's training script (megatron_calls.rs).
            assert!(verdict.is_err(), "{}", l.head);
            pp2_batched += 1;
            continue;
        }
        let Some(p) = program(&l.spec) else {
            failures.push(format!("{}: Megatron runs it, pipec refuses", l.head));
            continue;
        };
        assert_eq!(p.ranks.len(), ranks.len(), "{}", l.head);
        for (r, want) in ranks.iter().enumerate() {
            shapes += want.iter().filter(|t| t.contains(":S")).count();
            let want = normal(&expand_sync(want));
            let got = normal(&ours(&p, r, l.spec.megatron_p2p == MegatronP2p::Batched));
            if want != got {
                let k = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
                failures.push(format!(
                    "{}: rank {r} differs at token {k}: Megatron {:?}, pipec {:?}",
                    l.head,
                    &want[k.saturating_sub(3)..(k + 4).min(want.len())],
                    &got[k.saturating_sub(3)..(k + 4).min(got.len())]
                ));
                break;
            }
        }
        seen.insert((interleaved, l.spec.megatron_p2p, l.spec.pp));
        checked += 1;
    }
    assert!(
        failures.is_empty(),
        "{} configurations differ; first ones:\n{}",
        failures.len(),
        failures[..failures.len().min(12)].join("\n")
    );
    eprintln!("megatron handshake: {checked} configurations compared op for op ({shapes} shape messages), {refused} refused by both, {pp2_batched} pp = 2 batched interleaved refused by pipec");
    // Every mode of both functions, pp 1..8 (1F1B) and 2..8 (interleaved), odd pp too.
    for pp in 1..=8 {
        for mode in [MegatronP2p::Batched, MegatronP2p::Unbatched] {
            assert!(seen.contains(&(false, mode, pp)), "1f1b {mode} pp {pp}");
        }
    }
    for pp in 2..=8 {
        for mode in MegatronP2p::ALL {
            if pp == 2 && mode == MegatronP2p::Batched {
                continue;
            }
            assert!(
                seen.contains(&(true, mode, pp)),
                "interleaved {mode} pp {pp}"
            );
        }
    }
    assert!(
        checked > 800 && shapes > 300_000,
        "{checked} configs, {shapes} shapes"
    );
}

/// The recording's own verdict on crossed shapes, independent of pipec's program: pair the
/// sends and receives of each directed channel first-in first-out (NCCL's point-to-point
/// order; shapes always go over the pipeline group, so their channel is the pair of ranks)
/// and report whether some shape receive meets the other tensor's shape.
fn recording_crosses_shapes(ranks: &[Vec<String>]) -> bool {
    let mut chans: HashMap<(usize, usize), (Vec<String>, Vec<String>)> = HashMap::new();
    for (r, toks) in ranks.iter().enumerate() {
        for t in toks {
            let mut parts = t.split(':');
            let (Some(op), Some(peer), Some(payload)) = (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            if !payload.starts_with('S') {
                continue;
            }
            let peer: usize = peer.parse().expect("peer");
            match op.as_bytes()[0] {
                b's' => chans.entry((r, peer)).or_default().0.push(payload.into()),
                b'r' => chans.entry((peer, r)).or_default().1.push(payload.into()),
                _ => {}
            }
        }
    }
    chans
        .values()
        .any(|(s, r)| s.len() == r.len() && s.iter().zip(r).any(|(a, b)| a != b))
}

/// What `pipec check` says about each recorded configuration: the verdicts by P2P mode and
/// pipeline size (docs/megatron.md's table), crossed shapes exactly where the recording's own
/// FIFO pairing crosses them, and nothing else wrong (every other tensor is right: the data
/// calls are the ones `megatron_calls.rs` checks).
#[test]
fn what_check_finds_in_megatrons_handshake() {
    let text = golden_text("shapes.txt.gz");
    // (function, mode, pp) -> (configurations, crossed shapes, deadlocks)
    let mut table: BTreeMap<(&str, String, u32), (u32, u32, u32)> = BTreeMap::new();
    let mut failures = Vec::new();
    for l in lines(&text) {
        let Some(ranks) = &l.ranks else { continue };
        let Some(p) = program(&l.spec) else { continue };
        let report = verify(&p, &VerifyOptions::default());
        let crossed = report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::WrongTensor { .. }));
        let deadlock = report.violations.iter().any(|v| {
            matches!(
                v,
                Violation::Deadlock { .. } | Violation::StreamDeadlock { .. }
            )
        });
        let other: Vec<String> = report
            .violations
            .iter()
            .filter(|v| {
                !matches!(
                    v,
                    Violation::WrongTensor { .. }
                        | Violation::Deadlock { .. }
                        | Violation::StreamDeadlock { .. }
                )
            })
            .map(|v| v.to_string())
            .take(2)
            .collect();
        if !other.is_empty() {
            failures.push(format!("{}: {other:?}", l.head));
        }
        // Every crossed pair is a shape message meeting the other shape.
        for v in &report.violations {
            if let Violation::WrongTensor { recv, send } = v {
                let kind = |at: &pipec_ir::verify::Site| match at.instr {
                    pipec_ir::Instr::Send { payload, .. }
                    | pipec_ir::Instr::Recv { payload, .. } => payload.kind,
                    _ => panic!("not a message"),
                };
                if !kind(recv).is_shape() || !kind(send).is_shape() {
                    failures.push(format!("{}: a data message crossed: {v}", l.head));
                }
            }
        }
        if crossed != recording_crosses_shapes(ranks) {
            failures.push(format!(
                "{}: pipec check says crossed = {crossed}, the recording's FIFO pairing says otherwise",
                l.head
            ));
        }
        let f = if l.spec.kind == ScheduleKind::Interleaved1F1B {
            "interleaved"
        } else {
            "1f1b"
        };
        let e = table
            .entry((f, l.spec.megatron_p2p.to_string(), l.spec.pp))
            .or_default();
        e.0 += 1;
        e.1 += u32::from(crossed);
        e.2 += u32::from(deadlock);
        // Where the verifier finds a rendezvous deadlock (D1), the independent brute-force
        // executor hangs too, and the other way round (crossed programs aside: it stops at the
        // first wrong tensor).
        let d1 = report
            .violations
            .iter()
            .any(|v| matches!(v, Violation::Deadlock { .. }));
        if !crossed && d1 != (execute(&p).verdict == Verdict::Deadlock) {
            failures.push(format!(
                "{}: verifier D1 {d1}, reference executor disagrees",
                l.head
            ));
        }
        let c = parse_header(l.head);
        let flush = matches!(
            l.spec.megatron_p2p,
            MegatronP2p::OverlapFlush | MegatronP2p::OverlapFlushKeepOutputs
        );
        let expect_deadlock = if flush { c.pp == 2 } else { d1 };
        // Where deadlocks are: the flush modes at pp = 2, else interleaved training at M = pp
        // with the calls waited at once.
        let at_m_eq_pp = c.interleaved && c.m == c.pp && !c.fo && !l.spec.megatron_p2p.overlaps();
        if deadlock && !(flush && c.pp == 2) && !at_m_eq_pp {
            failures.push(format!("{}: an unexpected deadlock", l.head));
        }
        if deadlock != expect_deadlock {
            failures.push(format!(
                "{}: deadlock {deadlock}, expected {expect_deadlock}",
                l.head
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} findings disagree:\n{}",
        failures.len(),
        failures[..failures.len().min(12)].join("\n")
    );
    eprintln!("function     mode                        pp  configs  crossed  deadlock");
    for ((f, mode, pp), (n, c, d)) in &table {
        eprintln!("{f:<12} {mode:<27} {pp:>2}  {n:>7}  {c:>7}  {d:>8}");
    }
    // What the table shows, pinned. Shapes cross only in interleaved unbatched calls at
    // pp = 2 (#5271's case: both neighbours one rank, two shapes each way in one batch; the
    // batched mode is refused there, overlap posts the two directions in separate calls).
    // Deadlocks: never in 1F1B; interleaved batched and unbatched at M = pp in training
    // (rendezvous, D1, where the brute-force executor hangs too); the flush modes at pp = 2
    // (stream order, D2: the odd rank's prefetched receive holds the pipeline group's stream
    // that the shapes need). Overlap without flush never.
    for ((f, mode, pp), (n, c, d)) in &table {
        let expect_cross = *f == "interleaved" && *pp == 2 && mode == "unbatched";
        if expect_cross {
            assert!(*c > 0 && *c <= *n, "{f} {mode} pp {pp}");
        } else {
            assert_eq!(*c, 0, "{f} {mode} pp {pp}");
        }
        let some_deadlock = *f == "interleaved"
            && (((mode == "batched" || mode == "unbatched") && *pp >= 2)
                || (mode.starts_with("overlap-flush") && *pp == 2));
        assert_eq!(*d > 0, some_deadlock, "{f} {mode} pp {pp}");
    }
}

/// The CLI end to end: `compile --megatron-variable-seq-lengths` writes shape messages in both
/// encodings (they read back as written; the new payload values are appended to the schema,
/// so a program without them keeps its bytes), prints the verdict, writes an invalid model too,
/// refuses other kinds; `check` lists the crossing; `pipec-run`'s loader refuses the files.
#[test]
fn compile_writes_the_handshake_check_judges_it_runtimes_refuse_it() {
    use pipec_ir::files::{load_dir, Encoding};
    let tmp = tempfile::tempdir().unwrap();
    let compile = |args: &[&str], out: &std::path::Path| {
        crate::harness::pipec()
            .arg("compile")
            .args(args)
            .arg("-o")
            .arg(out)
            .output()
            .unwrap()
    };
    for (format, encoding) in [("json", Encoding::Json), ("bin", Encoding::Postcard)] {
        let dir = tmp.path().join(format);
        let args = [
            "--schedule",
            "1f1b",
            "--pp",
            "3",
            "--microbatches",
            "4",
            "--format",
            format,
            "--megatron-variable-seq-lengths",
        ];
        let out = compile(&args, &dir);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            stdout.contains("megatron handshake (variable_seq_lengths): valid"),
            "{stdout}"
        );
        let loaded = load_dir(&dir).unwrap();
        assert_eq!(loaded.manifest.encoding, encoding);
        let spec = ScheduleSpec {
            kind: ScheduleKind::OneFOneB,
            pp: 3,
            vpp: 1,
            microbatches: 4,
            group_size: None,
            forward_only: false,
            combined: false,
            megatron_p2p: MegatronP2p::Batched,
        };
        assert_eq!(loaded.program, program(&spec).unwrap(), "{format}");
        let err = pipec_runtime::load(&dir, None)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("field `payload`: #1 send(shape of act of stage 0, mb 0 -> rank 1) is one of Megatron's shape messages"),
            "{err}"
        );
    }
    // Crossed shapes: written anyway, the verdict printed, `check` names them.
    let dir = tmp.path().join("crossed");
    let out = compile(
        &[
            "--schedule",
            "interleaved-1f1b",
            "--pp",
            "2",
            "--vpp",
            "2",
            "--microbatches",
            "4",
            "--megatron-p2p",
            "unbatched",
            "--megatron-variable-seq-lengths",
        ],
        &dir,
    );
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(
            "megatron handshake (variable_seq_lengths): INVALID: 8 violations (8 wrong tensor)"
        ),
        "{stdout}"
    );
    let out = crate::harness::pipec()
        .arg("check")
        .arg(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("[wrong tensor] rank 0, #29 recv(shape of act of stage 1, mb 2 <- rank 1) would receive shape of grad of stage 1, mb 0 sent at rank 1, #28"),
        "{report}"
    );
    // Only Megatron's own loops post shapes.
    let out = compile(
        &[
            "--schedule",
            "zb-v",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--megatron-variable-seq-lengths",
        ],
        &tmp.path().join("zbv"),
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("use 1f1b or interleaved-1f1b, not zb-v"));
}
