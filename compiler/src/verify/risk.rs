//! Risks: what is valid under pipec's model but fragile on a real NCCL job. Reported beside the
//! verdict, never as a violation.
//!
//! - K1. A comm batch with two messages in one direction between the same two ranks (two
//!   sends to one peer, or two receives from one). NCCL pairs them with the peer's operations
//!   by posting order alone (same shape, no tag), so the program is right only because both
//!   sides post that call in the same order; a runtime or a peer that orders the call
//!   differently swaps the tensors silently. Megatron's interleaved schedule at pp = 2 is the
//!   known case: its batched call sends a gradient then an activation to the one neighbour,
//!   which receives an activation then a gradient (Megatron-LM refuses it; pipec too).

use super::index::{Index, NONE};
use super::report::Site;
use crate::program::{Instr, Payload};
use pipec_schedules::Rank;
use serde::Serialize;
use std::fmt;

/// One risk, tied to the first instruction of the batch it is about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Risk {
    /// K1: `payloads` all go to (`send`) or come from `peer` in the one batch at `site`.
    SamePeerTwice {
        site: Site,
        peer: Rank,
        send: bool,
        payloads: Vec<Payload>,
    },
}

impl fmt::Display for Risk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Risk::SamePeerTwice {
                site,
                peer,
                send,
                payloads,
            } => {
                let list: Vec<String> = payloads.iter().map(|p| p.to_string()).collect();
                let (verb, prep) = if *send {
                    ("sends", "to")
                } else {
                    ("receives", "from")
                };
                write!(
                    f,
                    "{}: one comm batch {verb} {} tensors {prep} {peer} ({}); NCCL pairs them with {peer}'s operations by posting order alone, so this holds only while both sides post that call in this order (a runtime or framework that reorders it swaps them silently)",
                    site.at,
                    payloads.len(),
                    list.join(", then ")
                )
            }
        }
    }
}

/// Every risk of the program, in program order.
pub(crate) fn check(ix: &Index<'_>) -> Vec<Risk> {
    let mut out = Vec::new();
    for b in 0..ix.batch_start.len() {
        if ix.wait_of[b] != NONE || ix.batch_len[b] < 2 {
            continue;
        }
        let s = ix.batch_start[b];
        // (send, peer) -> payloads, first seen first.
        let mut groups: Vec<((bool, Rank), Vec<Payload>)> = Vec::new();
        for g in s..s + ix.batch_len[b] {
            let (send, peer, payload) = match ix.instr(g) {
                Instr::Send { peer, payload, .. } => (true, peer, payload),
                Instr::Recv { peer, payload, .. } => (false, peer, payload),
                _ => continue,
            };
            match groups.iter_mut().find(|(k, _)| *k == (send, peer)) {
                Some((_, v)) => v.push(payload),
                None => groups.push(((send, peer), vec![payload])),
            }
        }
        for ((send, peer), payloads) in groups {
            if payloads.len() > 1 {
                out.push(Risk::SamePeerTwice {
                    site: ix.site(s),
                    peer,
                    send,
                    payloads,
                });
            }
        }
    }
    out
}
