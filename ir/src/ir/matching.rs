//! Who meets whom: sends paired with receives.
//!
//! NCCL delivers point-to-point messages between an ordered pair of ranks in the order they
//! are posted (FIFO per peer and communicator; torch's `_PipelineScheduleRuntime` relies on the
//! same with tag 0), so the k-th send from `a` to `b` meets the k-th receive that `b` posts
//! from `a`, whatever the two sides think they carry. Whether the payloads agree is the
//! verifier's question ([`crate::verify`], M1/M2); this module pairs, and notes on the way
//! which pairs carry different payloads ([`Channel::differing`]) for the verifier to report.

use super::id::{OptIdx, Positions};
use super::{Instr, InstrRef, Program};

/// The messages between one ordered pair of ranks, as global ids in program order.
#[derive(Clone, Debug)]
pub struct Channel {
    pub src: u32,
    pub dst: u32,
    pub sends: Vec<u32>,
    pub recvs: Vec<u32>,
    /// The `k` (in order) whose `sends[k]` and `recvs[k]` carry different payloads. Found
    /// while pairing, when the op paired second is the one being read and its partner was
    /// read moments before (mostly on the previous rank, still in cache): comparing
    /// afterwards, channel by channel, fetches both ops from memory again, a large share of
    /// one verifier thread's time on a large program (bench/HISTORY.md has the figure).
    pub differing: Vec<u32>,
}

/// Sends paired with receives, per global id.
#[derive(Clone, Debug)]
pub struct Matching {
    positions: Positions,
    /// Per global id: the matched op, none for compute, waits and unmatched ops.
    partner: Vec<OptIdx>,
    /// Every channel that carries at least one op, in order of first use (by rank, then
    /// instruction), so reports built from them are deterministic.
    channels: Vec<Channel>,
}

impl Matching {
    /// Pair every send and receive of `program`. Ops whose peer is out of range, and ops left
    /// over on one side of a channel, stay unmatched.
    pub fn new(program: &Program, positions: Positions) -> Matching {
        let world = program.ranks.len();
        // Channel ids per ordered pair: a dense `world x world` table for any real pipeline,
        // a map when that would be too big to allocate (a hostile file with many ranks).
        let dense = world <= 1024;
        let mut table = vec![OptIdx::NONE; if dense { world * world } else { 0 }];
        let mut map: std::collections::HashMap<(u32, u32), u32> = Default::default();
        let mut channels: Vec<Channel> = Vec::new();
        // Each op is paired as soon as the other side of its channel has an op at its index:
        // the pair's first op was pushed earlier, this one completes it.
        let mut partner = vec![OptIdx::NONE; positions.total() as usize];
        // The payload of the op at global id `g` on rank `r`.
        let payload_at = |r: u32, g: u32| match program.ranks[r as usize]
            [(g - positions.base(r as usize)) as usize]
        {
            Instr::Send { payload, .. } | Instr::Recv { payload, .. } => payload,
            Instr::Compute(_) | Instr::Wait { .. } | Instr::FwdCheckpoint(_) | Instr::Memory(_) => {
                unreachable!("a channel holds messages")
            }
        };
        for (r, instrs) in program.ranks.iter().enumerate() {
            let base = positions.base(r);
            for (i, ins) in instrs.iter().enumerate() {
                let (is_send, peer, payload) = match *ins {
                    Instr::Send { peer, payload, .. } => (true, peer.0, payload),
                    Instr::Recv { peer, payload, .. } => (false, peer.0, payload),
                    Instr::Compute(_)
                    | Instr::Wait { .. }
                    | Instr::FwdCheckpoint(_)
                    | Instr::Memory(_) => continue,
                };
                if peer as usize >= world {
                    continue; // reported as out of range; it can never be matched
                }
                let (src, dst) = if is_send {
                    (r as u32, peer)
                } else {
                    (peer, r as u32)
                };
                let next = channels.len() as u32;
                let id = if dense {
                    let slot = &mut table[src as usize * world + dst as usize];
                    if slot.is_none() {
                        *slot = OptIdx::some(next);
                    }
                    slot.get().unwrap_or(next)
                } else {
                    *map.entry((src, dst)).or_insert(next)
                };
                if id == next {
                    channels.push(Channel {
                        src,
                        dst,
                        sends: Vec::new(),
                        recvs: Vec::new(),
                        differing: Vec::new(),
                    });
                }
                let c = &mut channels[id as usize];
                let g = base + i as u32;
                let (mine, theirs) = if is_send {
                    (&mut c.sends, &c.recvs)
                } else {
                    (&mut c.recvs, &c.sends)
                };
                let k = mine.len();
                mine.push(g);
                if let Some(&q) = theirs.get(k) {
                    partner[g as usize] = OptIdx::some(q);
                    partner[q as usize] = OptIdx::some(g);
                    if payload_at(peer, q) != payload {
                        c.differing.push(k as u32);
                    }
                }
            }
        }
        Matching {
            positions,
            partner,
            channels,
        }
    }

    /// Match a program whose ids have not been numbered yet; `None` when it is too large to
    /// number (see [`Positions::new`]).
    pub fn of(program: &Program) -> Option<Matching> {
        Positions::new(program)
            .ok()
            .map(|pos| Matching::new(program, pos))
    }

    pub fn positions(&self) -> &Positions {
        &self.positions
    }

    /// The global id of the op matching global id `g`.
    #[inline]
    pub fn partner_of(&self, g: u32) -> Option<u32> {
        self.partner.get(g as usize).and_then(|p| p.get())
    }

    /// The op that matches a send or receive, if any.
    pub fn partner(&self, at: InstrRef) -> Option<InstrRef> {
        let g = self.positions.global(at)?;
        self.partner_of(g).map(|p| self.positions.local(p))
    }

    pub fn channels(&self) -> &[Channel] {
        &self.channels
    }

    /// Every matched message as (send, recv), in order of the sending rank and index.
    pub fn messages(&self, program: &Program) -> Vec<(InstrRef, InstrRef)> {
        let mut out = Vec::new();
        for (r, instrs) in program.ranks.iter().enumerate() {
            let base = self.positions.base(r);
            for (i, ins) in instrs.iter().enumerate() {
                if let Instr::Send { .. } = ins {
                    if let Some(p) = self.partner_of(base + i as u32) {
                        out.push((
                            InstrRef {
                                rank: pipec_schedules::Rank(r as u32),
                                index: i as u32,
                            },
                            self.positions.local(p),
                        ));
                    }
                }
            }
        }
        out
    }
}
