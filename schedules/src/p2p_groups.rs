//! Which communicator (process group) carries each point-to-point message: `--p2p-groups`.
//!
//! NCCL runs the operations of one communicator on one stream, in the order a rank issues
//! them, so a receive issued on a communicator that still has an unfinished send to another
//! peer (or in the other direction) waits behind it: a head-of-line wait, and a deadlock when
//! such waits close a cycle across ranks. Which operations share a communicator is therefore
//! part of whether an ordering is safe; these are the three layouts torch uses or is adding:
//!
//! - [`P2pGroups::Pair`]: one communicator per unordered pair of ranks, carrying both
//!   directions. torch's `ProcessGroupNCCL` creates these lazily for raw `isend`/`irecv`
//!   (its key is the two ranks, lower first), so this is what an unconfigured run gets.
//! - [`P2pGroups::Direction`]: two communicators over the whole pipeline group, one for the
//!   downstream traffic (activations, stage `s` to `s + 1`) and one for the upstream traffic
//!   (gradients), as pytorch #186173 adds behind a config flag (`forward (r->r+1) and
//!   backward (r->r-1) P2P are carried on two separate communicators`). A looped schedule's
//!   wrap-around (the last rank to rank 0) is downstream too, so rank 0's receive from the
//!   last rank shares a stream with its sends to rank 1: pytorch #195760/#196666's PP4/VPP2
//!   example, where `recv(0F3, R3->R0)` queues behind `send(0F0)` and `send(1F0)` to R1.
//! - [`P2pGroups::Edge`]: one communicator per directed edge (source rank, destination rank),
//!   pytorch #196666 (keyed by the directed pair "so opposite directions cannot couple through
//!   one FIFO"). The operations of one communicator on a rank are then all to one peer in one
//!   direction, which FIFO matching orders anyway: no head-of-line wait is left.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The communicator layout of a program's sends and receives (`--p2p-groups`, the manifest's
/// `p2p_groups`). [`P2pGroups::Pair`] is the default and is not written to the manifest, so
/// files compiled without the option are unchanged.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum P2pGroups {
    /// One communicator per unordered pair of ranks (torch's lazy default).
    #[default]
    Pair,
    /// One downstream and one upstream communicator over all ranks (pytorch #186173).
    Direction,
    /// One communicator per directed edge between two ranks (pytorch #196666).
    Edge,
}

/// Which communicator of a [`P2pGroups`] layout a message uses, seen from either end: the
/// same value on the sender and the receiver.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum P2pGroup {
    /// The pair's communicator, lower rank first.
    Pair(Rank, Rank),
    /// The downstream (`true`, activations) or upstream communicator.
    Direction(bool),
    /// The directed edge's communicator: (source, destination).
    Edge(Rank, Rank),
}

use crate::Rank;

impl P2pGroups {
    pub const ALL: [P2pGroups; 3] = [P2pGroups::Pair, P2pGroups::Direction, P2pGroups::Edge];

    pub fn is_pair(&self) -> bool {
        *self == P2pGroups::Pair
    }

    pub fn name(self) -> &'static str {
        match self {
            P2pGroups::Pair => "pair",
            P2pGroups::Direction => "direction",
            P2pGroups::Edge => "edge",
        }
    }

    /// The communicator of a message from `src` to `dst`; `downstream` is whether it flows
    /// with the stages (an activation, or its shape), not against them (a gradient).
    pub fn group(self, src: Rank, dst: Rank, downstream: bool) -> P2pGroup {
        match self {
            P2pGroups::Pair => P2pGroup::Pair(src.min(dst), src.max(dst)),
            P2pGroups::Direction => P2pGroup::Direction(downstream),
            P2pGroups::Edge => P2pGroup::Edge(src, dst),
        }
    }
}

impl fmt::Display for P2pGroups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for P2pGroups {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        P2pGroups::ALL
            .into_iter()
            .find(|g| g.name() == s)
            .ok_or_else(|| {
                format!("unknown P2P groups `{s}` (expected one of pair, direction, edge)")
            })
    }
}

/// Names as `check` prints them: `pair R0-R1`, `downstream`/`upstream`, `edge R3->R0`.
impl fmt::Display for P2pGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            P2pGroup::Pair(a, b) => write!(f, "pair R{}-R{}", a.0, b.0),
            P2pGroup::Direction(true) => f.write_str("downstream"),
            P2pGroup::Direction(false) => f.write_str("upstream"),
            P2pGroup::Edge(a, b) => write!(f, "edge R{}->R{}", a.0, b.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_name_one_group_and_names_round_trip() {
        let (a, b) = (Rank(3), Rank(0));
        assert_eq!(
            P2pGroups::Pair.group(a, b, true),
            P2pGroups::Pair.group(b, a, false)
        );
        assert_ne!(
            P2pGroups::Edge.group(a, b, true),
            P2pGroups::Edge.group(b, a, true)
        );
        assert_eq!(
            P2pGroups::Direction.group(a, b, true),
            P2pGroups::Direction.group(Rank(0), Rank(1), true)
        );
        for g in P2pGroups::ALL {
            assert_eq!(g.name().parse::<P2pGroups>(), Ok(g));
        }
        assert!("per-pair".parse::<P2pGroups>().is_err());
    }
}
