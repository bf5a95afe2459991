//! pipec's Megatron lowering against Megatron's own P2P calls.
//!
//! `tests/golden/megatron/calls.txt.gz` was recorded by `tests/golden/megatron/record.py`: it
//! runs megatron-core's real `forward_backward_pipelining_with_interleaving` and
//! `_without_interleaving` once per pipeline rank with only `forward_step`, `backward_step`
//! and `torch.distributed`'s `isend`/`irecv`/`batch_isend_irecv` (and their `wait()`)
//! replaced by recorders, over a grid of (pp, vpp, M, group size, forward-only, combined, P2P
//! mode). For every configuration this test checks that pipec accepts exactly what Megatron
//! runs, and that every rank's stream is Megatron's calls one for one: each compute op, each
//! posted op with its peer and tensor in Megatron's order, each batch, each wait.
//!
//! Normal form (both sides): `[` ops `]` for one `batch_isend_irecv`; `s`/`r` ops with a handle;
//! `w` a wait on a handle, handles renumbered by first appearance. A pipec blocking batch is
//! Megatron's call that waits at once (`[...]` then a wait per op under `batch_p2p_comm`, else
//! the ops then a wait per op); a batch pipec leaves in flight is one op and its `Wait`s.
//! Trailing waits are dropped on both sides: Megatron returns with its last sends in flight,
//! where pipec's stream ends with a wait for each.

use flate2::read::GzDecoder;
use pipec_compiler::lower;
use pipec_ir::Instr;
use pipec_ir::PayloadKind;
use pipec_ir::Program;
use pipec_schedules::{
    generate, Compute, Limits, MegatronP2p, ScheduleKind, ScheduleSpec, SpecError,
};
use std::collections::HashMap;
use std::io::Read;

pub(crate) fn golden_text(name: &str) -> String {
    let path = format!("{}/golden/megatron/{name}", env!("CARGO_MANIFEST_DIR"));
    let mut text = String::new();
    GzDecoder::new(std::fs::File::open(&path).expect("golden file"))
        .read_to_string(&mut text)
        .expect("gzip text");
    text
}

fn golden() -> String {
    golden_text("calls.txt.gz")
}

pub(crate) struct Config {
    pub interleaved: bool,
    pub pp: u32,
    pub vpp: u32,
    pub m: u32,
    pub g: Option<u32>,
    pub fo: bool,
    pub combined: bool,
    pub mode: MegatronP2p,
}

/// A recorded line: the configuration, then `| ranks` where Megatron ran it or `! message`
/// where it refused.
pub(crate) fn golden_line(line: &str) -> (&str, Result<&str, &str>) {
    match line.split_once(" ! ") {
        Some((h, e)) => (h, Err(e)),
        None => {
            let (h, r) = line.split_once(" | ").expect("config line");
            (h, Ok(r))
        }
    }
}

/// A configuration Megatron refuses must be one pipec refuses too: counted in `refused`, a
/// failure filed where pipec's `verdict` accepts it, and `None`; else Megatron's ranks.
pub(crate) fn unless_megatron_refuses<'a, E>(
    head: &str,
    rest: Result<&'a str, &str>,
    verdict: &Result<(), E>,
    failures: &mut Vec<String>,
    refused: &mut usize,
) -> Option<&'a str> {
    match rest {
        Err(msg) => {
            if verdict.is_ok() {
                failures.push(format!(
                    "{head}: Megatron refuses ({msg}) but pipec accepts"
                ));
            }
            *refused += 1;
            None
        }
        Ok(r) => Some(r),
    }
}

pub(crate) fn parse_header(h: &str) -> Config {
    let mut f = h.split_whitespace();
    let interleaved = match f.next() {
        Some("interleaved") => true,
        Some("1f1b") => false,
        other => panic!("unknown function {other:?}"),
    };
    let kv: HashMap<&str, &str> = f.filter_map(|t| t.split_once('=')).collect();
    let num = |k: &str| {
        kv[k]
            .parse::<u32>()
            .unwrap_or_else(|_| panic!("{k} in {h}"))
    };
    Config {
        interleaved,
        pp: num("pp"),
        vpp: num("vpp"),
        m: num("m"),
        g: kv.get("g").and_then(|g| g.parse().ok()),
        fo: num("fo") == 1,
        combined: num("combined") == 1,
        mode: kv["mode"].replace('_', "-").parse().expect("mode"),
    }
}

/// Megatron's tokens in normal form: handles renumbered, group suffix dropped, trailing waits
/// dropped.
pub(crate) fn normal(tokens: &[String]) -> Vec<String> {
    let mut ids: HashMap<String, usize> = HashMap::new();
    let mut id = |h: &str| {
        let n = ids.len();
        *ids.entry(h.to_string()).or_insert(n)
    };
    let mut out: Vec<String> = tokens
        .iter()
        .map(|t| match t.as_bytes()[0] {
            b's' | b'r' => {
                let mut parts = t[1..].split(':');
                let h = parts.next().unwrap_or_default();
                let peer = parts.next().unwrap_or_default();
                let payload = parts.next().unwrap_or_default();
                format!("{}{}:{peer}:{payload}", &t[..1], id(h))
            }
            b'w' => format!("w{}", id(&t[1..])),
            _ => t.clone(),
        })
        .collect();
    while out.last().is_some_and(|t| t.starts_with('w')) {
        out.pop();
    }
    out
}

fn payload(p: &pipec_ir::Payload) -> String {
    let k = match p.kind {
        PayloadKind::Act => "a",
        PayloadKind::Grad => "g",
        PayloadKind::ActShape => "Sa",
        PayloadKind::GradShape => "Sg",
    };
    format!("{k}{}.{}", p.stage.0, p.mb.0)
}

/// pipec's stream of one rank in Megatron's tokens (before normal form).
pub(crate) fn ours(p: &Program, r: usize, batched: bool) -> Vec<String> {
    let pp = p.placement.pp;
    let instrs = &p.ranks[r];
    let waited: std::collections::HashSet<u32> = instrs
        .iter()
        .filter_map(|i| match i {
            Instr::Wait { batch } => Some(*batch),
            _ => None,
        })
        .collect();
    let task = |t: &pipec_schedules::Task| format!("{}.{}", t.stage.0 / pp, t.mb.0);
    let mut out = Vec::new();
    let mut handle = 0usize;
    let mut batch_handles: HashMap<u32, Vec<usize>> = HashMap::new();
    let mut i = 0;
    while i < instrs.len() {
        match &instrs[i] {
            Instr::Compute(c) => {
                out.push(match c {
                    Compute::Fwd(t) => format!("F{}", task(t)),
                    Compute::Bwd(t) => format!("B{}", task(t)),
                    Compute::FwdBwd { fwd, bwd } => format!("X{}/{}", task(fwd), task(bwd)),
                    other => panic!("unexpected op {other}"),
                });
                i += 1;
            }
            Instr::Wait { batch } => {
                for h in &batch_handles[batch] {
                    out.push(format!("w{h}"));
                }
                i += 1;
            }
            first => {
                let b = first.batch().unwrap();
                let mut end = i;
                let mut hs = Vec::new();
                // Megatron's shape exchange is always one batch_isend_irecv.
                let shapes = matches!(first, Instr::Send { payload, .. } | Instr::Recv { payload, .. } if payload.kind.is_shape());
                let group = !waited.contains(&b) && (batched || shapes);
                if group {
                    out.push("[".into());
                }
                let stop = pipec_ir::ir::batch_end(instrs, i);
                while end < stop {
                    let (c, peer, pl) = match &instrs[end] {
                        Instr::Send {
                            peer, payload: pl, ..
                        } => ('s', peer, pl),
                        Instr::Recv {
                            peer, payload: pl, ..
                        } => ('r', peer, pl),
                        _ => unreachable!(),
                    };
                    out.push(format!("{c}{handle}:{}:{}", peer.0, payload(pl)));
                    hs.push(handle);
                    handle += 1;
                    end += 1;
                }
                if group {
                    out.push("]".into());
                }
                if !waited.contains(&b) {
                    out.extend(hs.iter().map(|h| format!("w{h}")));
                }
                batch_handles.insert(b, hs);
                i = end;
            }
        }
    }
    out
}

#[test]
fn every_rank_is_megatrons_calls_one_for_one() {
    let text = golden();
    let mut lines = text.lines();
    let header = lines.next().expect("header");
    assert!(header.starts_with("# megatron-core 0.19.2"), "{header}");
    let (mut checked, mut refused, mut pp2) = (0, 0, 0);
    let mut modes = std::collections::BTreeSet::new();
    let mut failures = Vec::new();
    for line in lines {
        let (head, rest) = golden_line(line);
        let c = parse_header(head);
        let kind = if c.interleaved {
            ScheduleKind::Interleaved1F1B
        } else {
            ScheduleKind::OneFOneB
        };
        let spec = ScheduleSpec {
            kind,
            pp: c.pp,
            vpp: c.vpp,
            microbatches: c.m,
            group_size: if c.interleaved { c.g } else { None },
            forward_only: c.fo,
            combined: c.combined,
            megatron_p2p: c.mode,
        };
        let verdict = spec.validate(&Limits::DEFAULT);
        let Some(ranks) =
            unless_megatron_refuses(head, rest, &verdict, &mut failures, &mut refused)
        else {
            continue;
        };
        // megatron-core runs this with activations and gradients swapped (Megatron-LM's
        // training script refuses it); pipec refuses it and says why.
        if c.interleaved && c.pp == 2 && c.mode == MegatronP2p::Batched {
            assert!(
                matches!(verdict, Err(SpecError::InterleavedPp2NeedsOverlap { .. })),
                "{head}: {verdict:?}"
            );
            pp2 += 1;
            continue;
        }
        if let Err(e) = verdict {
            failures.push(format!("{head}: Megatron runs it but pipec refuses: {e}"));
            continue;
        }
        modes.insert(c.mode.name());
        let program = lower(&generate(&spec, &Limits::DEFAULT).unwrap());
        for (r, want) in ranks.split(" | ").enumerate() {
            let want: Vec<String> = want.split_whitespace().map(String::from).collect();
            let got = ours(&program, r, c.mode == MegatronP2p::Batched);
            let (want, got) = (normal(&want), normal(&got));
            if want != got {
                let k = want.iter().zip(&got).take_while(|(a, b)| a == b).count();
                failures.push(format!(
                    "{head}: rank {r} differs at token {k}: Megatron {:?}, pipec {:?}",
                    &want[k.saturating_sub(2)..(k + 4).min(want.len())],
                    &got[k.saturating_sub(2)..(k + 4).min(got.len())]
                ));
                break;
            }
        }
        checked += 1;
    }
    assert!(
        failures.is_empty(),
        "{} of {} configurations differ; first ones:\n{}",
        failures.len(),
        checked + refused + pp2,
        failures[..failures.len().min(15)].join("\n")
    );
    eprintln!("megatron calls: {checked} configurations compared, {refused} refused by both, {pp2} (pp = 2 batched) refused by pipec as by Megatron-LM's training script");
    // The grid is broad: both loops, every mode, refusals included.
    assert_eq!(modes.len(), MegatronP2p::ALL.len(), "{modes:?}");
    assert!(
        checked > 4000 && refused > 2000,
        "{checked} checked, {refused} refused"
    );
}
