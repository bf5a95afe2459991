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
//! - K2. A head-of-line wait: an op posted on a communicator behind an earlier op of that
//!   communicator, to another peer or the other way, still in flight (NCCL runs one
//!   communicator's ops in issue order). A delay where it closes no cycle (D2 reports the
//!   cycles); which ops share a communicator is the program's `--p2p-groups`, and only a
//!   program that names its groups (`direction`, `edge`) is read so (under the default the
//!   runtime's communicators are not known). Found by [`super::streams::head_of_line`].

use super::index::Index;
use super::violation::Site;
use crate::ir::{Instr, Payload};
use pipec_schedules::{P2pGroups, Rank};
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
    /// K2: `site` is posted on communicator `group` (of the program's `groups`) behind
    /// `behind`, an op of an earlier batch to another peer or the other way that may still be
    /// in flight; `more` further ops of this rank wait so on that communicator.
    HeadOfLine {
        site: Site,
        behind: Site,
        group: String,
        groups: P2pGroups,
        more: u64,
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
            Risk::HeadOfLine {
                site,
                behind,
                group,
                groups,
                more,
            } => {
                write!(
                    f,
                    "{site}: head-of-line wait on communicator `{group}` (--p2p-groups {groups}): posted behind {behind}, still in flight to another peer or the other way, and NCCL runs a communicator's ops in issue order"
                )?;
                if *more > 0 {
                    write!(f, " ({more} more such waits on it on this rank)")?;
                }
                Ok(())
            }
        }
    }
}

/// Every risk of the program, in program order. Most batches are a handful of ops and are
/// scanned pairwise in place (no allocation); a long one (a file can hold any) is sorted by
/// (direction, peer) first, so the check stays `n log n`.
pub(crate) fn check(ix: &Index<'_>) -> Vec<Risk> {
    let mut out = Vec::new();
    for b in 0..ix.batch_start.len() {
        let len = ix.batch_len[b] as usize;
        if ix.wait_of[b].is_some() || len < 2 {
            continue;
        }
        let r = ix.batch_rank[b] as usize;
        let first = (ix.batch_start[b] - ix.pos.base(r)) as usize;
        let ops = &ix.p.ranks[r][first..first + len];
        let site = || ix.site(ix.batch_start[b]);
        if len <= 16 {
            // Compared by (direction, peer) alone: copying payloads out of every op of every
            // batch was most of this check's time at size L.
            for (k, op) in ops.iter().enumerate() {
                let Some(key) = way(op) else {
                    continue;
                };
                let same = |o: &Instr| way(o) == Some(key);
                // Report each group once, at its first op.
                if ops[..k].iter().any(same) || !ops[k + 1..].iter().any(same) {
                    continue;
                }
                let payloads = ops[k..]
                    .iter()
                    .filter(|o| same(o))
                    .filter_map(end)
                    .map(|e| e.2)
                    .collect();
                out.push(Risk::SamePeerTwice {
                    site: site(),
                    peer: key.1,
                    send: key.0,
                    payloads,
                });
            }
            continue;
        }
        // (direction, peer, position in the batch) of every op, grouped by sorting.
        let mut keyed: Vec<(bool, u32, usize)> = ops
            .iter()
            .enumerate()
            .filter_map(|(k, o)| way(o).map(|(s, q)| (s, q.0, k)))
            .collect();
        keyed.sort_unstable();
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for w in keyed.chunk_by(|a, b| a.0 == b.0 && a.1 == b.1) {
            if w.len() > 1 {
                groups.push((w[0].2, w.iter().map(|e| e.2).collect()));
            }
        }
        // In the order of each group's first op, as the short path reports them.
        groups.sort_unstable();
        for (_, members) in groups {
            let (send, peer, _) = end(&ops[members[0]]).expect("grouped ops are messages");
            let payloads = members
                .iter()
                .filter_map(|&k| end(&ops[k]))
                .map(|e| e.2)
                .collect();
            out.push(Risk::SamePeerTwice {
                site: site(),
                peer,
                send,
                payloads,
            });
        }
    }
    out
}

/// (is a send, peer) of a message.
#[inline]
fn way(i: &Instr) -> Option<(bool, Rank)> {
    match *i {
        Instr::Send { peer, .. } => Some((true, peer)),
        Instr::Recv { peer, .. } => Some((false, peer)),
        _ => None,
    }
}

/// (is a send, peer, payload) of a message.
fn end(i: &Instr) -> Option<(bool, Rank, Payload)> {
    match *i {
        Instr::Send { peer, payload, .. } => Some((true, peer, payload)),
        Instr::Recv { peer, payload, .. } => Some((false, peer, payload)),
        _ => None,
    }
}
