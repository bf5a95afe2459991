//! The NCCL communicators of a program's P2P groups (`--p2p-groups`,
//! [`pipec_schedules::P2pGroups`]): which groups its sends and receives use, their members,
//! each rank's NCCL rank in them and the one order every process creates them in. Pure (no
//! GPU), so it is built and tested everywhere; the NCCL mode of `run.rs` creates one
//! communicator per group from it and `comm.rs` routes every op through its group's (both
//! behind the feature `cuda`).
//!
//! A message's group is the verifier's: [`GroupPlan::route`] asks
//! [`StreamRule::group_of`], the function the stream rule D2 keys its streams by, so the
//! communicators the backend runs are the ones the verdict was proved under (`downstream`
//! there means the payload is an activation or its shape).
//!
//! Members: a `pair` or `edge` group holds its two ranks, a `direction` group every rank (the
//! pipeline group of pytorch #186173). Inside a communicator member `i` of the sorted member
//! list is NCCL rank `i`. The global order is [`P2pGroup`]'s `Ord` over the groups the program
//! uses: every process reads the same program, so every process derives the same list.

use pipec_ir::ir::{Instr, Payload, Program};
use pipec_ir::verify::StreamRule;
use pipec_schedules::{P2pGroup, Rank};
use std::collections::BTreeSet;

/// One communicator of a program's layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Group {
    pub key: P2pGroup,
    /// Its ranks in increasing order: `members[i]` is NCCL rank `i` of the communicator.
    pub members: Vec<Rank>,
}

impl Group {
    /// The NCCL rank of `r` in this communicator, `None` when `r` is not a member.
    pub fn index_of(&self, r: Rank) -> Option<usize> {
        self.members.binary_search(&r).ok()
    }
}

/// Where one send or receive goes: its group (an index into [`GroupPlan::groups`]) and the
/// peer's NCCL rank in that group's communicator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Route {
    pub group: usize,
    pub peer: usize,
}

/// The communicators of a program, in the order every process creates them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPlan {
    rule: StreamRule,
    pub groups: Vec<Group>,
}

impl GroupPlan {
    /// The groups `program`'s sends and receives use (every rank's, not only one: each
    /// process must list the groups of the others too to agree on the order and on the
    /// unique ids rank 0 hands out).
    pub fn of(program: &Program) -> GroupPlan {
        let rule = StreamRule::of(program);
        let world = program.world();
        let keys: BTreeSet<P2pGroup> = program
            .ranks
            .iter()
            .enumerate()
            .flat_map(|(r, instrs)| {
                instrs
                    .iter()
                    .filter_map(move |i| rule.group_of(Rank(r as u32), i))
            })
            .collect();
        let groups = keys
            .into_iter()
            .map(|key| Group {
                key,
                members: members(key, world),
            })
            .collect();
        GroupPlan { rule, groups }
    }

    /// The index of the group `key` in [`GroupPlan::groups`].
    pub fn index(&self, key: P2pGroup) -> Option<usize> {
        self.groups.binary_search_by(|g| g.key.cmp(&key)).ok()
    }

    /// The groups `r` belongs to, as indices in the global order: the communicators it
    /// creates, in the order it creates them.
    pub fn of_rank(&self, r: Rank) -> Vec<usize> {
        (0..self.groups.len())
            .filter(|&g| self.groups[g].index_of(r).is_some())
            .collect()
    }

    /// The communicator and peer of rank `me`'s send (`send`) or receive of `payload` with
    /// `peer`. An error, not a panic, for a message the program does not have (a plan made
    /// from another program).
    pub fn route(
        &self,
        me: Rank,
        peer: Rank,
        send: bool,
        payload: Payload,
    ) -> Result<Route, String> {
        let key = self
            .rule
            .group_of(me, &Instr::message(send, peer, payload, 0))
            .expect("a message has a group");
        let group = self.index(key).ok_or_else(|| {
            format!(
                "{me}: no communicator `{key}` for a {} of {} {} {peer}: the program has no such \
                 message",
                if send { "send" } else { "receive" },
                payload.kind.name(),
                if send { "to" } else { "from" },
            )
        })?;
        let g = &self.groups[group];
        let (Some(_), Some(peer)) = (g.index_of(me), g.index_of(peer)) else {
            return Err(format!(
                "{me}: communicator `{key}` does not hold both {me} and {peer}"
            ));
        };
        Ok(Route { group, peer })
    }
}

/// The ranks of group `key` of a `world`-rank program, in increasing order.
fn members(key: P2pGroup, world: u32) -> Vec<Rank> {
    match key {
        P2pGroup::Pair(a, b) | P2pGroup::Edge(a, b) => {
            let mut m = vec![a.min(b), a.max(b)];
            m.dedup();
            m
        }
        P2pGroup::Direction(_) => (0..world).map(Rank).collect(),
    }
}
