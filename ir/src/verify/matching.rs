//! Send/recv matching. NCCL delivers point-to-point messages between an ordered pair of
//! ranks in the order they are posted (FIFO per peer and communicator; torch's
//! `_PipelineScheduleRuntime` relies on the same with tag 0), so the k-th send from `a` to `b`
//! meets the k-th receive that `b` posts from `a`, whatever the two sides think they carry.

use super::index::Index;
use super::violation::Violation;
use crate::ir::{Instr, Matching, Payload, Tokens};
use std::collections::HashMap;

/// The payload of the send or receive at global id `g` on rank `r`.
fn payload(ix: &Index<'_>, r: u32, g: u32) -> Payload {
    match ix.p.ranks[r as usize][(g - ix.pos.base(r as usize)) as usize] {
        Instr::Send { payload, .. } | Instr::Recv { payload, .. } => payload,
        // A channel holds only sends and receives.
        Instr::Compute(_) | Instr::Wait { .. } | Instr::FwdCheckpoint(_) | Instr::Memory(_) => {
            unreachable!("a channel holds only messages")
        }
    }
}

/// The tokens of the send or receive at global id `g` on rank `r`.
fn tokens(ix: &Index<'_>, r: u32, g: u32) -> Option<Tokens> {
    match ix.p.ranks[r as usize][(g - ix.pos.base(r as usize)) as usize] {
        Instr::Send { tokens, .. } | Instr::Recv { tokens, .. } => tokens,
        Instr::Compute(_) | Instr::Wait { .. } | Instr::FwdCheckpoint(_) | Instr::Memory(_) => None,
    }
}

/// Report wrong tensors and unmatched ops of the pairing of sends and receives ([`Matching`]).
///
/// On a channel whose send and receive counts differ, the ops whose payload has no
/// counterpart are reported as unmatched (the likely culprit: a dropped or extra message),
/// and the shifted pairs behind them are not also reported as wrong tensors: the channel hangs
/// anyway, and the shift is a consequence, not a second defect.
pub(crate) fn check(ix: &Index<'_>, m: &Matching, out: &mut Vec<Violation>) {
    let mut found = Vec::new();
    for c in m.channels() {
        if c.sends.len() == c.recvs.len() {
            // The pairing compared the payloads as it went.
            for &k in &c.differing {
                let (a, b) = (c.sends[k as usize], c.recvs[k as usize]);
                found.push(Violation::WrongTensor {
                    recv: ix.site(b),
                    send: ix.site(a),
                });
            }
            // M3: the same tensor, the same size (a receive allocated from the plan).
            let mut differing = c.differing.iter().peekable();
            for (k, (&a, &b)) in c.sends.iter().zip(&c.recvs).enumerate() {
                if differing.peek() == Some(&&(k as u32)) {
                    differing.next();
                    continue;
                }
                if tokens(ix, c.src, a) != tokens(ix, c.dst, b) {
                    found.push(Violation::WrongTokens {
                        recv: ix.site(b),
                        send: ix.site(a),
                    });
                }
            }
        } else {
            let with_payloads = |ops: &[u32], r: u32| -> Vec<(u32, Payload)> {
                ops.iter().map(|&g| (g, payload(ix, r, g))).collect()
            };
            unbalanced(
                ix,
                &with_payloads(&c.sends, c.src),
                &with_payloads(&c.recvs, c.dst),
                &mut found,
            );
        }
    }
    sizes(ix, &mut found);
    found.sort_by_key(|v| v.at());
    out.extend(found);
}

/// M4: every send and receive carries its microbatch's tokens as the program's lengths give
/// them, and none carries any without lengths. One violation per rank, at its first such op:
/// a file written without (or with other) lengths is wrong at every message alike.
fn sizes(ix: &Index<'_>, out: &mut Vec<Violation>) {
    let p = ix.p;
    for (r, instrs) in p.ranks.iter().enumerate() {
        for (i, ins) in instrs.iter().enumerate() {
            let (Instr::Send {
                payload, tokens, ..
            }
            | Instr::Recv {
                payload, tokens, ..
            }) = *ins
            else {
                continue;
            };
            let expected = p.tokens_of(payload.mb);
            let missing_lengths = p.lengths.is_some() && expected.is_none();
            if tokens != expected && !missing_lengths {
                out.push(Violation::TokensNotLengths {
                    site: ix.site(ix.pos.base(r) + i as u32),
                    expected: expected.map(Tokens::get),
                });
                break;
            }
        }
    }
}

/// Report the ops of an unbalanced channel whose payloads the other side does not carry (as
/// often): of several equal payloads, the later ones are the extra.
fn unbalanced(
    ix: &Index<'_>,
    s: &[(u32, Payload)],
    r: &[(u32, Payload)],
    out: &mut Vec<Violation>,
) {
    let mut balance: HashMap<Payload, i64> = HashMap::new();
    for &(_, p) in s {
        *balance.entry(p).or_default() += 1;
    }
    for &(_, p) in r {
        *balance.entry(p).or_default() -= 1;
    }
    let (ns, nr) = (s.len() as u32, r.len() as u32);
    for (ops, sign) in [(s, 1i64), (r, -1i64)] {
        let mut left = balance.clone();
        for &(g, p) in ops.iter().rev() {
            let e = left.entry(p).or_default();
            if *e * sign > 0 {
                *e -= sign;
                out.push(Violation::Unmatched {
                    site: ix.site(g),
                    sends: ns,
                    recvs: nr,
                });
            }
        }
    }
}
