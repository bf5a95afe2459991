//! The vocabulary of pipeline-parallel schedules and one generator per family.
//!
//! Pure: no I/O. Data flows one way: a [`ScheduleSpec`] is validated against [`Limits`] and
//! [`generate`]d into a [`Schedule`] (each rank's compute order, its [`Placement`] and the
//! [`CommPolicy`] lowering should follow). Beside it, the spec's other half: [`layout`] reads
//! a Megatron layout string into the layers each virtual stage holds.

mod dualpipe;
mod gpipe;
mod group_interleaved;
pub mod ids;
pub mod kind;
pub mod kinds;
pub mod layout;
pub mod lengths;
mod looped_bfs;
pub mod megatron;
pub mod megatron_recompute;
pub mod op;
pub mod order;
pub mod p2p_groups;
pub mod placement;
pub mod schedule;
pub mod spec;
mod v_shape;
mod zero_bubble;

pub use ids::{Microbatch, Rank, StageId};
pub use kind::{ChunkRule, Flags, MegatronLoop, ScheduleKind, SearchQuery, SearchSpace};
pub use kinds::{KindRow, Tune, KINDS};
pub use lengths::{Lengths, LengthsError};
pub use megatron_recompute::{megatron_partial_recompute, PartialRecomputeError, RankCheckpoints};
pub use op::{Compute, Pass, Task};
pub use order::RankOrder;
pub use p2p_groups::{P2pGroup, P2pGroups};
pub use placement::{Placement, PlacementKind};
pub use schedule::{generate, CommPolicy, Schedule};
pub use spec::{
    KindInfo, Limits, MegatronP2p, ScheduleSpec, SpecError, UnknownKind, MAX_COMPUTE_OPS, MAX_PP,
    MAX_STAGES,
};
