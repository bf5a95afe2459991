//! P3's routing rules, the part of the dependency rules a runtime needs before it can run a
//! program at all: a sent tensor is one some stage consumes, goes to the rank that owns that
//! stage, and never to the sender itself.

use super::index::Index;
use super::violation::Violation;
use crate::ir::{Instr, Payload};
use pipec_schedules::{Rank, Task};

/// The routing violation of the send at global id `g` on rank `r`, if any. Ids out of range
/// are reported by the index and skipped here.
pub(crate) fn route(
    ix: &Index<'_>,
    r: u32,
    g: u32,
    peer: Rank,
    payload: Payload,
) -> Option<Violation> {
    let t = Task {
        stage: payload.stage,
        mb: payload.mb,
    };
    if !ix.in_range(t) || peer.0 >= ix.world {
        return None;
    }
    match ix.consumer(payload) {
        None => Some(Violation::NoConsumer { site: ix.site(g) }),
        Some(_) if peer.0 == r => Some(Violation::SelfMessage { site: ix.site(g) }),
        Some(c) => match ix.owner(c) {
            Some(o) if o != peer.0 => Some(Violation::WrongDestination {
                site: ix.site(g),
                consumer: c.stage,
                owner: Rank(o),
            }),
            _ => None,
        },
    }
}

/// [`route`] for every send of the program (the structural level; the full level checks each
/// send's route in `deps.rs`, in program order with the rest of P3).
pub(crate) fn check(ix: &Index<'_>, out: &mut Vec<Violation>) {
    for (r, instrs) in ix.p.ranks.iter().enumerate() {
        let base = ix.pos.base(r);
        for (i, ins) in instrs.iter().enumerate() {
            if let Instr::Send { peer, payload, .. } = *ins {
                out.extend(route(ix, r as u32, base + i as u32, peer, payload));
            }
        }
    }
}
