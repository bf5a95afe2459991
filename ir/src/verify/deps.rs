//! Data dependencies, on each rank by program order and across ranks through messages.
//!
//! What each pass needs (docs/design.md "Correctness rules" 2): `fwd(s,m)` the activation of
//! `(s-1,m)`; `bwd(s,m)`/`bwd_D(s,m)` its own `fwd(s,m)` and the gradient of `(s+1,m)`;
//! `bwd_W(s,m)` its `bwd_D(s,m)`. An input made on the same rank must come from an earlier
//! instruction there; one made on another rank must come from an earlier receive of exactly
//! that payload (each receive feeds one pass), whose matched send in turn must come after the
//! producing pass on its rank (checked on the send). A pass of a `fwd_bwd` pair cannot feed
//! its partner: both run at once.
//!
//! To keep one defect to one message, checks that would only repeat an earlier finding are
//! skipped: nothing is checked for parts on the wrong rank, with ids out of range, or whose
//! producer never runs (each already reported), and a receive that a too-early pass claimed
//! (reported as "runs before its input arrives") is not also reported as unused.

use super::index::{slot, Index};
use super::routes;
use super::violation::{Part, Violation};
use crate::ir::{Instr, Matching, OptIdx, Payload, PayloadKind};
use pipec_schedules::{Pass, Rank, StageId, Task};
use std::collections::HashMap;

struct Walk<'a, 'p> {
    ix: &'a Index<'p>,
    m: &'a Matching,
    /// Per payload with a single receive: the pass that consumed it.
    user: Vec<OptIdx>,
    /// Receives of multiply-received payloads: position -> consuming pass.
    multi_user: HashMap<u32, u32>,
    out: &'a mut Vec<Violation>,
}

pub(crate) fn check(ix: &Index<'_>, m: &Matching, out: &mut Vec<Violation>) {
    if !ix.dense {
        return;
    }
    let mut w = Walk {
        ix,
        m,
        user: vec![OptIdx::NONE; 2 * ix.tasks],
        multi_user: HashMap::new(),
        out,
    };
    for r in 0..ix.world {
        w.rank(r);
    }
}

impl Walk<'_, '_> {
    fn rank(&mut self, r: u32) {
        let ix = self.ix;
        let base = ix.pos.base(r as usize);
        let forward_only = ix.p.forward_only;
        for (i, ins) in ix.p.ranks[r as usize].iter().enumerate() {
            let g = base + i as u32;
            match *ins {
                // A checkpointed forward is the forward, as far as data goes: it consumes the
                // stage's input and produces its output (its memory is verify::offload's).
                Instr::Compute(_) | Instr::FwdCheckpoint(_) => {
                    let c = ins.as_compute().expect("a compute op");
                    for (pass, t) in c.parts() {
                        if !ix.in_range(t) || (forward_only && pass != Pass::Fwd) {
                            continue;
                        }
                        if ix.owner(t) != Some(r) {
                            continue;
                        }
                        self.part(r, g, Part { pass, task: t });
                    }
                }
                Instr::Send { peer, payload, .. } => self.send(r, g, peer, payload),
                Instr::Recv { .. } | Instr::Wait { .. } | Instr::Memory(_) => {}
            }
        }
        // Unused receives: only passes on this rank consume its receives.
        for (i, ins) in ix.p.ranks[r as usize].iter().enumerate() {
            if let Instr::Recv { payload, .. } = *ins {
                self.unused(r, base + i as u32, payload);
            }
        }
    }

    /// The first position of a task's pass, if it runs at all.
    fn first(&self, pass: Pass, t: Task) -> Option<u32> {
        let ti = self.ix.task_index(t);
        (self.ix.count[slot(pass)][ti] > 0).then(|| self.ix.first[slot(pass)][ti])
    }

    /// The pass that produces a task's input gradient: `bwd`, else `bwd_D`.
    fn backward(&self, t: Task) -> Option<(Pass, u32)> {
        self.first(Pass::Bwd, t)
            .map(|g| (Pass::Bwd, g))
            .or_else(|| self.first(Pass::BwdD, t).map(|g| (Pass::BwdD, g)))
    }

    fn part(&mut self, r: u32, g: u32, part: Part) {
        let ix = self.ix;
        let Task { stage: s, mb } = part.task;
        let last = ix.stages - 1;
        match part.pass {
            Pass::Fwd => {
                if s.0 > 0 {
                    let prev = Task {
                        stage: StageId(s.0 - 1),
                        mb,
                    };
                    if let Some(f) = self.first(Pass::Fwd, prev) {
                        self.input(r, g, part, prev, f, Payload::act(s.0 - 1, mb.0));
                    }
                }
            }
            Pass::Bwd | Pass::BwdD => {
                if let Some(f) = self.first(Pass::Fwd, part.task) {
                    self.local(r, g, part, f);
                }
                if s.0 < last {
                    let next = Task {
                        stage: StageId(s.0 + 1),
                        mb,
                    };
                    if let Some((_, b)) = self.backward(next) {
                        self.input(r, g, part, next, b, Payload::grad(s.0 + 1, mb.0));
                    }
                }
            }
            Pass::BwdW => {
                if let Some(d) = self.first(Pass::BwdD, part.task) {
                    self.local(r, g, part, d);
                }
            }
        }
    }

    /// `part` at `g` needs the pass at `producer` to have run earlier on rank `r`. A producer
    /// on another rank is a wrong-rank pass, already reported.
    fn local(&mut self, r: u32, g: u32, part: Part, producer: u32) {
        if self.ix.on_rank(producer, r) && producer >= g {
            self.out.push(Violation::RunsBeforeLocal {
                site: self.ix.site(g),
                part,
                needs: self.ix.site(producer),
            });
        }
    }

    /// `part` at `g` needs `input`, made by task `from` (first run at `producer`).
    fn input(&mut self, r: u32, g: u32, part: Part, from: Task, producer: u32, input: Payload) {
        let ix = self.ix;
        let Some(owner) = ix.owner(from) else {
            return;
        };
        if owner == r {
            return self.local(r, g, part, producer);
        }
        let pi = ix.payload_index(input);
        // Built only for a violation: this runs for every received input.
        let site = || ix.site(g);
        match ix.recv_count[pi] {
            0 => self.out.push(Violation::InputNeverReceived {
                site: site(),
                part,
                input,
                from: Rank(owner),
            }),
            1 => {
                let j = ix.recv_first[pi];
                if !ix.on_rank(j, r) {
                    self.out.push(Violation::InputNeverReceived {
                        site: site(),
                        part,
                        input,
                        from: Rank(owner),
                    });
                } else if let Some(u) = self.user[pi].get() {
                    let first_use = ix.site(u);
                    self.out.push(Violation::InputUsedTwice {
                        site: site(),
                        part,
                        recv: ix.site(j),
                        first_use,
                    });
                } else {
                    self.user[pi] = OptIdx::some(g);
                    if j > g {
                        self.out.push(Violation::RunsBeforeInput {
                            site: site(),
                            part,
                            input,
                            recv: ix.site(j),
                        });
                    } else if ix.ready(j).get().is_none_or(|w| w > g) {
                        self.out.push(Violation::RunsBeforeWait {
                            site: site(),
                            part,
                            input,
                            recv: ix.site(j),
                        });
                    }
                }
            }
            _ => self.input_multi(r, g, part, input, pi, owner),
        }
    }

    /// The rare case of a payload received more than once: consume the earliest unused
    /// earlier receive on this rank, else explain what is wrong.
    fn input_multi(&mut self, r: u32, g: u32, part: Part, input: Payload, pi: usize, owner: u32) {
        let ix = self.ix;
        let all = &ix.multi_recv[&(pi as u32)];
        let mine: Vec<u32> = all.iter().copied().filter(|&j| ix.on_rank(j, r)).collect();
        let site = ix.site(g);
        if let Some(&j) = mine
            .iter()
            .find(|&&j| j < g && !self.multi_user.contains_key(&j))
        {
            self.multi_user.insert(j, g);
            return;
        }
        if let Some(&j) = mine.iter().rev().find(|&&j| j < g) {
            let first_use = ix.site(self.multi_user[&j]);
            self.out.push(Violation::InputUsedTwice {
                site,
                part,
                recv: ix.site(j),
                first_use,
            });
            return;
        }
        if let Some(&j) = mine.iter().find(|&&j| !self.multi_user.contains_key(&j)) {
            self.multi_user.insert(j, g);
            self.out.push(Violation::RunsBeforeInput {
                site,
                part,
                input,
                recv: ix.site(j),
            });
            return;
        }
        match mine.first() {
            Some(&j) => {
                let first_use = ix.site(self.multi_user[&j]);
                self.out.push(Violation::InputUsedTwice {
                    site,
                    part,
                    recv: ix.site(j),
                    first_use,
                });
            }
            None => self.out.push(Violation::InputNeverReceived {
                site,
                part,
                input,
                from: Rank(owner),
            }),
        }
    }

    /// The consumer stage of a payload, if one exists.
    fn send(&mut self, r: u32, g: u32, peer: Rank, payload: Payload) {
        let ix = self.ix;
        let t = Task {
            stage: payload.stage,
            mb: payload.mb,
        };
        if !ix.in_range(t) || peer.0 >= ix.world {
            return; // reported as out of range
        }
        if let Some(v) = routes::route(ix, r, g, peer, payload) {
            self.out.push(v);
        }
        // A shape is known once its tensor is: the same producer.
        let producer = match payload.kind {
            PayloadKind::Act | PayloadKind::ActShape => self.first(Pass::Fwd, t),
            PayloadKind::Grad | PayloadKind::GradShape => self.backward(t).map(|(_, b)| b),
        };
        let Some(f) = producer else {
            return; // the producing pass never runs: reported as missing
        };
        if !ix.on_rank(f, r) {
            self.out.push(Violation::SendsUnproduced {
                site: ix.site(g),
                producer: ix.site(f),
            });
        } else if f > g {
            self.out.push(Violation::SendBeforeProduce {
                site: ix.site(g),
                producer: ix.site(f),
            });
        }
    }

    /// A receive nothing consumed. Skipped where the cause is already reported: ids out of
    /// range, a receive that never completes (unmatched), no consumer stage, a receive on a rank that does not own the consumer (the send
    /// went to the wrong rank), or a consumer pass that never runs.
    fn unused(&mut self, r: u32, g: u32, payload: Payload) {
        let ix = self.ix;
        let t = Task {
            stage: payload.stage,
            mb: payload.mb,
        };
        // A shape message sizes the receive after it; no compute reads it.
        if payload.kind.is_shape() || !ix.in_range(t) || self.m.partner_of(g).is_none() {
            return;
        }
        let pi = ix.payload_index(payload);
        let used = if ix.recv_count[pi] == 1 {
            self.user[pi].is_some()
        } else {
            self.multi_user.contains_key(&g)
        };
        if used {
            return;
        }
        let Some(c) = ix.consumer(payload) else {
            return;
        };
        if ix.owner(c) != Some(r) {
            return;
        }
        let consumer_runs = match payload.kind {
            PayloadKind::Act => self.first(Pass::Fwd, c).is_some(),
            PayloadKind::Grad => !ix.p.forward_only && self.backward(c).is_some(),
            PayloadKind::ActShape | PayloadKind::GradShape => return,
        };
        if !consumer_runs {
            return;
        }
        self.out
            .push(Violation::ReceivedUnused { site: ix.site(g) });
    }
}
