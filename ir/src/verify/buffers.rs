//! B1-B3: a buffer plan's slots (issue #39). The lifetimes are [`crate::ir::buffers`]'s, the
//! ones the planner assigned by, so a plan pipec made passes by construction and a hand-edited
//! one is judged by the same rule.

use super::index::Index;
use super::violation::Violation;
use crate::ir::buffers::{lives, takes_slot};
use crate::ir::Instr;
use crate::memory::MemoryModel;

pub(crate) fn check(ix: &Index<'_>, mem: &MemoryModel, out: &mut Vec<Violation>) {
    let p = ix.p;
    let pools = p.buffer_slots.as_ref();
    for (r, instrs) in p.ranks.iter().enumerate() {
        let base = ix.pos.base(r);
        let site = |i: u32| ix.site(base + i);
        let slots = pools.map_or(0, |pl| pl.rank(r).len() as u32);
        // B1, and whether every slot-taking message has a usable slot (else B2 is skipped:
        // it would only repeat these).
        let mut whole = pools.is_some();
        for (i, ins) in instrs.iter().enumerate() {
            let (payload, slot) = match *ins {
                Instr::Send { payload, slot, .. } | Instr::Recv { payload, slot, .. } => {
                    (payload, slot)
                }
                _ => continue,
            };
            let i = i as u32;
            match (pools.is_some() && takes_slot(&payload), slot) {
                (true, None) => {
                    whole = false;
                    out.push(Violation::SlotMissing { site: site(i) });
                }
                (false, Some(_)) => out.push(Violation::SlotWithoutPlan { site: site(i) }),
                (true, Some(s)) if s >= slots => {
                    whole = false;
                    out.push(Violation::SlotOutOfRange {
                        site: site(i),
                        slot: s,
                        slots,
                    });
                }
                (true, Some(s)) => {
                    // B3: the slot against the message's size, where the costs give one.
                    let size = pools.map_or(0.0, |pl| pl.rank(r)[s as usize]);
                    if let Some(needs) = mem.message_size(&payload, p.microbatches) {
                        if size < needs * (1.0 - 1e-12) {
                            out.push(Violation::SlotTooSmall {
                                site: site(i),
                                slot: s,
                                size,
                                needs,
                                unit: mem.unit,
                            });
                        }
                    }
                }
                (false, None) => {}
            }
        }
        if !whole {
            continue;
        }
        // B2: per slot, its messages in order of start; each must begin after every earlier
        // one has ended (one report per reuse, naming the message still live).
        let mut by_slot: Vec<Vec<crate::ir::buffers::Life>> = vec![Vec::new(); slots as usize];
        for l in lives(p, r) {
            if let Some(s) = instrs[l.at as usize].slot() {
                by_slot[s as usize].push(l);
            }
        }
        for (s, mut v) in by_slot.into_iter().enumerate() {
            v.sort_by_key(|l| (l.start, l.end, l.at));
            // The message reaching furthest so far.
            let mut held: Option<crate::ir::buffers::Life> = None;
            for l in v {
                if let Some(h) = held {
                    if h.overlaps(&l) {
                        out.push(Violation::SlotReused {
                            slot: s as u32,
                            live: site(h.at),
                            live_from: h.start,
                            live_until: h.end,
                            reuse: site(l.at),
                            reuse_from: l.start,
                        });
                    }
                }
                if held.is_none_or(|h| l.end > h.end) {
                    held = Some(l);
                }
            }
        }
    }
}
