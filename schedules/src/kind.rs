//! The schedule kinds' vocabulary: the [`ScheduleKind`] enum (its variants and their names on
//! the command line and in files) and the plain types a kind's row of the kinds table is
//! written in and its families share ([`ChunkRule`], [`Flags`], [`MegatronLoop`],
//! [`SearchQuery`], [`SearchSpace`]).
//!
//! A leaf: it imports no family and no table, so that the spec and every family can name a
//! kind while the table, which names their generators and rules, sits above them all. Adding
//! a kind is one line here (its variant and name) and its row in the table, `kinds!` in
//! `kinds.rs`, which refuses to build unless its rows follow the enum one for one.

use serde::{Deserialize, Serialize};

/// Writes the enum, [`ScheduleKind::ALL`] and the names from the lines `Variant "name"`.
macro_rules! schedule_kinds {
    ($( $variant:ident $name:literal )*) => {
        /// The schedule families pipec generates: one variant per row of the kinds table.
        #[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        pub enum ScheduleKind {
            $( #[serde(rename = $name)] $variant, )*
        }

        /// Number of kinds.
        pub(crate) const N: usize = [$($name),*].len();

        impl ScheduleKind {
            /// Every kind, in the table's order.
            pub const ALL: [ScheduleKind; N] = [$(ScheduleKind::$variant),*];

            /// The kinds' names (on the command line and in files), in the table's order.
            pub(crate) const NAMES: [&'static str; N] = [$($name),*];
        }
    };
}

// The variants follow the table's rows, whose order is also the order `pipec schedules` lists
// them in and the order the tuner weighs them in (a tie goes to the earlier row), so kinds are
// appended.
schedule_kinds! {
    Gpipe "gpipe"
    OneFOneB "1f1b"
    Interleaved1F1B "interleaved-1f1b"
    LoopedBfs "looped-bfs"
    ZbH1 "zb-h1"
    ZbH2 "zb-h2"
    Zb1P "zb-1p"
    ZbV "zb-v"
    VHalf "v-half"
    VMin "v-min"
    DualPipe "dualpipe"
    DualPipeV "dualpipe-v"
    GroupInterleaved "group-interleaved"
}

/// How many model chunks (stages) per rank a kind takes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ChunkRule {
    /// Exactly one (vpp = 1).
    One,
    /// Any number (`--vpp`).
    Any,
    /// Exactly two, folded into a V (stage `s` and `2pp-1-s` on rank `s`).
    TwoV,
}

/// What a kind does beyond generating its orders, as yes/no facts.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Flags {
    /// It splits backward into `bwd_D` and `bwd_W` somewhere (three passes per task).
    pub splits_backward: bool,
    /// `--combined` (Megatron's combined 1F1B) applies.
    pub combined: bool,
    /// `--group-size` applies.
    pub group_size: bool,
    /// The kind's own loop posts both directions of a step in one batch (DualPipe's
    /// `_commit_and_wait_comm`), so batches carrying two tensors for one peer are the kind's,
    /// not the user's to fix: `pipec compile` says so in one note instead of warnings.
    pub same_peer_batches: bool,
}

impl Flags {
    /// Every flag off.
    pub const NONE: Flags = Flags {
        splits_backward: false,
        combined: false,
        group_size: false,
        same_peer_batches: false,
    };
}

/// Megatron-LM's two pipelined schedule loops (`megatron/core/pipeline_parallel/schedules.py`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum MegatronLoop {
    /// `forward_backward_pipelining_without_interleaving` (one chunk per rank).
    NonInterleaved,
    /// `forward_backward_pipelining_with_interleaving` (model chunks, group size).
    Interleaved,
}

impl MegatronLoop {
    /// The loop's function name in megatron-core.
    pub fn function(self) -> &'static str {
        match self {
            MegatronLoop::NonInterleaved => "forward_backward_pipelining_without_interleaving",
            MegatronLoop::Interleaved => "forward_backward_pipelining_with_interleaving",
        }
    }
}

/// What the tuner asks a kind when it decides what to weigh.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SearchQuery {
    pub pp: u32,
    pub microbatches: u32,
    /// A large instance: weigh the common choices only, to stay within seconds.
    pub big: bool,
    /// The request has a memory limit.
    pub memory_limit: bool,
}

/// The variants of a kind the tuner weighs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SearchSpace {
    /// Chunks per rank.
    pub vpps: Vec<u32>,
    /// Group sizes, each weighed with every vpp (`None`: the kind's default).
    pub groups: Vec<Option<u32>>,
}
