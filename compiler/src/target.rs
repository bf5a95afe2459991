//! Which framework can run a program: the one rule `pipec tune --target` filters by and the
//! adapters apply (they ask for it through `Schedule.adapter_refusal`, in their own words:
//! [`Refusal::adapter_message`]), and the words that tell a user how to run the winner there.
//!
//! The rule is what pipec's adapters refuse, written once:
//! - `pipec.torch`: torch's runtime gives every stage one rank. Any stage -> rank table is
//!   fine (`_prepare_schedule_with_comms` reads it off the actions), and so is any microbatch
//!   order (a tuned `microbatch_order`, #38): torch takes microbatch m's loss from position m
//!   of its loss list, which it fills as the last stage's forwards run, so `pipec.torch`
//!   renumbers the microbatches for torch in the last stage's forward order and permutes the
//!   step's inputs and losses to match (`build_schedule`, docs/torch.md).
//! - `pipec.megatron`: a model chunk lives on one rank. V placements are built from
//!   `stage_layers`. Forwards may run in any microbatch order (a tuned `microbatch_order`, #38):
//!   Megatron's data iterators hand out microbatches in order, and `pipec.megatron` hands each
//!   forward its own microbatch by id (`_ById`), and returns the losses in microbatch order.
//! - torchtitan lowers the compute-only CSV itself and places stages by the schedule class it
//!   is told (`_get_pp_rank_to_stage_indices_mapping`, torchtitan 0.3.0): looped (`s % pp`)
//!   except for `ZBVZeroBubble` / `DualPipeV` (V, two stages per rank). The CSV runs on torch's
//!   runtime with the plan's microbatch ids and no `pipec.torch` in between, so the last
//!   stage must run its forwards in microbatch order (torch's loss list).
//! - DeepSpeed's `PipelineEngine` (0.19.8): one stage per rank, stage `s` on rank `s`
//!   (`pipec.deepspeed.check`).
//! - `pipec-run` runs every verified program.

use pipec_ir::ir::{Instr, Program};
use pipec_schedules::{Compute, Placement, PlacementKind, Rank};
use serde::Serialize;
use std::fmt;

/// A framework a tuned schedule is meant for (`pipec tune --target`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    Megatron,
    Torch,
    Torchtitan,
    PipecRun,
    Deepspeed,
    /// No restriction (the search over every placement; `pipec-run` runs the result).
    Any,
}

impl Target {
    /// The names `--target` takes.
    pub const ALL: [Target; 6] = [
        Target::Megatron,
        Target::Torch,
        Target::Torchtitan,
        Target::PipecRun,
        Target::Deepspeed,
        Target::Any,
    ];

    /// The frameworks pipec has an adapter for.
    pub const FRAMEWORKS: [Target; 5] = [
        Target::Megatron,
        Target::Torch,
        Target::Torchtitan,
        Target::Deepspeed,
        Target::PipecRun,
    ];

    /// The same, strictest placement rule first: a refusal under the default names the
    /// framework that refuses most.
    const STRICTEST_FIRST: [Target; 5] = [
        Target::Deepspeed,
        Target::Torchtitan,
        Target::Megatron,
        Target::Torch,
        Target::PipecRun,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Megatron => "megatron",
            Target::Torch => "torch",
            Target::Torchtitan => "torchtitan",
            Target::PipecRun => "pipec-run",
            Target::Deepspeed => "deepspeed",
            Target::Any => "any",
        }
    }

    /// Whether this target accepts `program`, or why not (the adapter's reason, in words).
    pub fn check(self, program: &Program) -> Result<(), String> {
        self.refuse(program).map_err(|r| r.reason())
    }

    /// The same, as the rule that fails ([`Refusal`]): what the adapters ask
    /// (`Schedule.adapter_refusal`) so that they apply this rule instead of a copy.
    pub fn refuse(self, program: &Program) -> Result<(), Refusal> {
        self.refuse_placement(&program.placement)?;
        self.check_memory_ops(program).map_err(Refusal::MemoryOps)?;
        if program.lengths.is_some() && !self.runs_lengths() {
            return Err(Refusal::Lengths);
        }
        if !program.p2p_groups.is_pair() && !self.creates_p2p_groups() {
            return Err(Refusal::P2pGroups {
                groups: program.p2p_groups,
                target: self,
            });
        }
        match self {
            Target::Torchtitan => forwards_in_order(program, true),
            Target::Torch
            | Target::Megatron
            | Target::PipecRun
            | Target::Deepspeed
            | Target::Any => Ok(()),
        }
    }

    /// The memory instructions the target's adapter executes: `pipec-run`, `pipec.torch`
    /// (`build_schedule`) and `pipec.megatron` all of them (`pipec.megatron` its checkpointed
    /// forwards as megatron-core's partial recompute, which it checks against Megatron's rule
    /// at run time); torchtitan (torch's CSV has no such action) and DeepSpeed none.
    fn check_memory_ops(self, program: &Program) -> Result<(), String> {
        match self {
            Target::PipecRun | Target::Any | Target::Torch | Target::Megatron => Ok(()),
            Target::Torchtitan | Target::Deepspeed => {
                let first = program.ranks.iter().enumerate().find_map(|(r, instrs)| {
                    instrs.iter().enumerate().find_map(|(i, ins)| {
                        matches!(ins, Instr::Memory(_) | Instr::FwdCheckpoint(_))
                            .then(|| format!("rank {r}, #{i}: {ins}"))
                    })
                });
                match first {
                    Some(at) => Err(format!(
                        "{at}: offload, reload, wait_offload, recompute and checkpointed forwards \
                         are not executed by this target's adapter yet (pipec-run, pipec.torch \
                         and pipec.megatron run them)"
                    )),
                    None => Ok(()),
                }
            }
        }
    }

    /// Whether the target's adapter runs microbatches of different lengths (issue #38), each
    /// receive sized from the plan: pipec-run, `pipec.torch` and `pipec.megatron` do;
    /// torchtitan runs torch's CSV, which carries no shapes, and DeepSpeed's engine sizes its
    /// receive buffers from the first microbatch (DeepSpeed #3195).
    pub fn runs_lengths(self) -> bool {
        match self {
            Target::PipecRun | Target::Any | Target::Torch | Target::Megatron => true,
            Target::Torchtitan | Target::Deepspeed => false,
        }
    }

    /// Whether the target's adapter posts each message on the communicator the plan's
    /// `p2p_groups` names (issue #39), so that the verdict under `direction`/`edge` is the one
    /// it runs under: `pipec.torch` creates the groups, pipec-run's NCCL mode one communicator
    /// per group (its single-process transport has no communicators to queue on), and
    /// DeepSpeed's adapter posts every send and receive alone and blocking, in an order it
    /// verifies itself (`blocking_order`), which no communicator layout can stall. Megatron posts
    /// on torch's communicators of its pipeline group (one per pair of ranks for single sends,
    /// one per device for batches) and torchtitan through torch's CSV runtime on torch's: the
    /// default `pair`, which leaves them unknown, only.
    pub fn creates_p2p_groups(self) -> bool {
        self.own_communicators().is_none()
    }

    /// How the target posts its messages where it does not take the plan's P2P groups
    /// ([`Target::creates_p2p_groups`]), in words; `None` where it takes them.
    pub fn own_communicators(self) -> Option<&'static str> {
        match self {
            Target::PipecRun | Target::Any | Target::Torch | Target::Deepspeed => None,
            Target::Megatron => Some(
                "Megatron posts every message on torch's own communicators of its pipeline group",
            ),
            Target::Torchtitan => Some(
                "torchtitan runs the plan through torch's CSV runtime, on torch's own communicators",
            ),
        }
    }

    /// The memory levers the tuner may pull for this target: those its adapter runs as the
    /// tuner places them (`pipec.megatron` runs copies anywhere, but checkpoints only where
    /// Megatron's own rule puts them, not the tuner's).
    pub fn levers(self) -> Levers {
        match self {
            Target::PipecRun | Target::Any | Target::Torch => Levers::ALL,
            Target::Megatron => Levers {
                offload: true,
                recompute: false,
            },
            Target::Torchtitan | Target::Deepspeed => Levers::NONE,
        }
    }

    /// Whether the target's split backward frees part of a stage's activations at `bwd_D`
    /// (`K.act_w`, issue #39). pipec's runtime does (it drops what the weight gradients do not
    /// read); torch's `stage_backward_input` and pipec's copy of it for Megatron and DeepSpeed
    /// (`python/pipec/_split_backward.py`) retain the whole autograd graph until `W`
    /// (`retain_graph=True`; `bench/split_keep.py` measures all saved activations held), so
    /// planning for them counts `act_w = act`.
    pub fn frees_at_bwd_d(self) -> bool {
        matches!(self, Target::PipecRun | Target::Any)
    }

    /// The placement half of [`Target::check`]: what the target's stage -> rank rule allows.
    /// `tune` skips the placements it refuses before planning on them.
    pub fn check_placement(self, p: &Placement) -> Result<(), String> {
        self.refuse_placement(p).map_err(|r| r.reason())
    }

    /// The same, as the rule that fails.
    pub fn refuse_placement(self, p: &Placement) -> Result<(), Refusal> {
        match self {
            Target::PipecRun | Target::Any => Ok(()),
            Target::Torch | Target::Megatron if p.kind == PlacementKind::Bidirectional => {
                Err(Refusal::TwoRanks)
            }
            Target::Torch | Target::Megatron => Ok(()),
            Target::Torchtitan => {
                if p.kind == PlacementKind::Bidirectional {
                    return Err(Refusal::TwoRanks);
                }
                torchtitan_class(p).map(|_| ()).ok_or_else(|| {
                    Refusal::Placement(
                        "torchtitan places stages by its schedule class, looped (s % pp) or \
                         V-shaped (ZBVZeroBubble, DualPipeV); this placement is neither"
                            .to_string(),
                    )
                })
            }
            Target::Deepspeed => {
                let engine =
                    "DeepSpeed's PipelineEngine runs one stage per rank (stage s on rank s)";
                if p.kind == PlacementKind::Bidirectional {
                    // Not `TwoRanks`: its remedy, dualpipe-v, is V-shaped, refused here too.
                    return Err(Refusal::Placement(format!(
                        "{engine}; this schedule places every stage on two ranks (DualPipe's two directions)"
                    )));
                }
                let one_each = p.num_stages() == p.pp
                    && p.table()
                        .iter()
                        .enumerate()
                        .all(|(s, r)| *r == Rank(s as u32));
                if one_each {
                    Ok(())
                } else if p.num_stages() != p.pp {
                    Err(Refusal::Placement(format!(
                        "{engine}; this schedule has {} stages on {} ranks ({} stages per rank{})",
                        p.num_stages(),
                        p.pp,
                        pipec_ir::human::num(f64::from(p.num_stages()) / f64::from(p.pp)),
                        if p.kind == PlacementKind::V {
                            ", in a V"
                        } else {
                            ""
                        }
                    )))
                } else {
                    let table: Vec<String> = p.table().iter().map(|r| r.0.to_string()).collect();
                    Err(Refusal::Placement(format!(
                        "{engine}; this schedule places its stages on ranks [{}]",
                        table.join(", ")
                    )))
                }
            }
        }
    }
}

/// Why a target refuses a program: the rule that fails, with the facts its words name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Every stage lives on two ranks (DualPipe's two directions); a stage lives on one rank
    /// there (torch, Megatron, torchtitan).
    TwoRanks,
    /// The framework builds no such stage -> rank table (torchtitan, DeepSpeed): why.
    Placement(String),
    /// A memory instruction the target's adapter does not execute: where and why.
    MemoryOps(String),
    /// Rank `rank` runs the forwards of `stage` in the microbatch order `order` (all of that
    /// stage's forwards on the rank), which is not ascending: torch's loss list (the last
    /// stage, `last_only`) needs it ascending when torch runs the plan's ids as they are
    /// (torchtitan's CSV).
    ForwardOrder {
        rank: u32,
        stage: u32,
        order: Vec<u32>,
        last_only: bool,
    },
    /// The program's microbatches have different lengths, which the target cannot size
    /// ([`Target::runs_lengths`]).
    Lengths,
    /// The program is verified under communicators the target does not create
    /// ([`Target::creates_p2p_groups`]).
    P2pGroups {
        groups: pipec_schedules::P2pGroups,
        target: Target,
    },
}

impl Refusal {
    /// The reason in `pipec tune`'s words (its report's `not_runnable`, `runs_on`).
    pub fn reason(&self) -> String {
        match self {
            Refusal::TwoRanks => "places every stage on two ranks (one per direction); a stage \
                 lives on one rank there (use dualpipe-v, its V-shaped form)"
                .to_string(),
            Refusal::Placement(why) | Refusal::MemoryOps(why) => why.clone(),
            Refusal::ForwardOrder {
                rank,
                stage,
                order,
                last_only,
            } => {
                let (prev, mb) = order
                    .windows(2)
                    .find(|w| w[1] < w[0])
                    .map_or((0, 0), |w| (w[0], w[1]));
                let what = if *last_only {
                    "torchtitan runs the plan's microbatch ids on torch's runtime, which takes \
                     microbatch m's loss from position m of its loss list (pipec.torch \
                     renumbers them; torchtitan does not)"
                } else {
                    "the target needs every stage's forwards in microbatch order"
                };
                format!(
                    "rank {rank} runs the forwards of stage {stage} out of microbatch order ({mb} after {prev}); {what}"
                )
            }
            Refusal::P2pGroups { groups: g, target } => format!(
                "it is verified under the P2P groups `{g}`, and {}, whose order that verdict \
                 does not cover: plan it with the default groups, `pair` (pipec.torch, \
                 pipec.deepspeed and pipec-run create `{g}`)",
                target
                    .own_communicators()
                    .unwrap_or("this framework posts on its own communicators")
            ),
            Refusal::Lengths => concat!(
                "its microbatches have different lengths, and this framework sizes every ",
                "receive once (torchtitan runs torch's CSV, which carries no shapes; DeepSpeed's ",
                "engine keeps the first microbatch's shapes, DeepSpeed #3195): pipec.megatron, ",
                "pipec.torch and pipec-run size each receive from the plan"
            )
            .to_string(),
        }
    }

    /// The refusal in the words of `target`'s adapter (`pipec.torch`, `pipec.megatron`), for
    /// the schedule `name` (its kind, or its source when imported); other targets' adapters
    /// say [`Refusal::reason`].
    pub fn adapter_message(&self, target: Target, name: &str) -> String {
        match (self, target) {
            (Refusal::TwoRanks, Target::Torch) => format!(
                "{name} places each stage on two ranks (one per direction); torch's pipeline \
                 runtime gives every stage exactly one rank and cannot run it (use dualpipe-v, \
                 its V-shaped form)"
            ),
            (Refusal::TwoRanks, Target::Megatron) => format!(
                "{name} places every stage on two ranks (one copy per direction, with their \
                 gradients summed); a Megatron model chunk lives on one rank, so pipec.megatron \
                 cannot run it (use dualpipe-v, its V-shaped form)"
            ),
            _ => self.reason(),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Target {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Target::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Target::ALL.iter().map(|t| t.name()).collect();
                format!(
                    "unknown target `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

/// What a tune request must run on: one target, or (the default of the CLI and Python) every
/// framework pipec has an adapter for.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum TargetChoice {
    One(Target),
    /// Every framework in [`Target::FRAMEWORKS`].
    Every,
}

impl TargetChoice {
    /// The targets the choice stands for.
    pub fn targets(self) -> Vec<Target> {
        match self {
            TargetChoice::One(t) => vec![t],
            TargetChoice::Every => Target::STRICTEST_FIRST.to_vec(),
        }
    }

    /// Whether every target of the choice frees part of the activations at `bwd_D`
    /// ([`Target::frees_at_bwd_d`]).
    pub fn frees_at_bwd_d(self) -> bool {
        self.targets().iter().all(|t| t.frees_at_bwd_d())
    }

    /// The levers of `asked` every target of the choice allows.
    pub fn levers(self, asked: Levers) -> Levers {
        self.targets().iter().fold(asked, |l, t| {
            let t = t.levers();
            Levers {
                offload: l.offload && t.offload,
                recompute: l.recompute && t.recompute,
            }
        })
    }

    /// `torch`, or `every framework` for the default.
    pub fn label(self) -> String {
        match self {
            TargetChoice::One(t) => t.name().to_string(),
            TargetChoice::Every => "every framework".to_string(),
        }
    }

    /// `not runnable on torch: <reason>` from the first target that refuses, or `None`. With
    /// microbatch lengths, every framework means every framework that runs them
    /// ([`Target::runs_lengths`]), and with `direction`/`edge` P2P groups every framework that
    /// creates them ([`Target::creates_p2p_groups`]): a plan for the others cannot exist.
    pub fn refusal(self, program: &Program) -> Option<String> {
        let every = self == TargetChoice::Every;
        self.targets().into_iter().find_map(|t| {
            if every && program.lengths.is_some() && !t.runs_lengths() {
                return None;
            }
            // Likewise with P2P groups only some frameworks create.
            if every && !program.p2p_groups.is_pair() && !t.creates_p2p_groups() {
                return None;
            }
            t.check(program)
                .err()
                .map(|why| format!("not runnable on {t}: {why}"))
        })
    }

    /// The same, from the placement alone.
    pub fn placement_refusal(self, p: &Placement) -> Option<String> {
        self.targets().into_iter().find_map(|t| {
            t.check_placement(p)
                .err()
                .map(|why| format!("not runnable on {t}: {why}"))
        })
    }
}

/// Each stage's forwards (all stages, or the last one only) in microbatch order per rank; the
/// first rank and stage (in stream order) that breaks it, with that stage's whole order there.
fn forwards_in_order(program: &Program, last_only: bool) -> Result<(), Refusal> {
    let n = program.num_stages() as usize;
    let last = n.saturating_sub(1);
    let forward = |c: &Compute| match *c {
        Compute::Fwd(t) => Some(t),
        Compute::FwdBwd { fwd, .. } => Some(fwd),
        _ => None,
    };
    for (r, stream) in program.compute_orders().iter().enumerate() {
        let mut prev: Vec<Option<u32>> = vec![None; n];
        for fwd in stream.iter().filter_map(forward) {
            let s = fwd.stage.0 as usize;
            if s >= n || (last_only && s != last) {
                continue;
            }
            if prev[s].is_some_and(|p| fwd.mb.0 < p) {
                return Err(Refusal::ForwardOrder {
                    rank: r as u32,
                    stage: s as u32,
                    order: stream
                        .iter()
                        .filter_map(forward)
                        .filter(|t| t.stage == fwd.stage)
                        .map(|t| t.mb.0)
                        .collect(),
                    last_only,
                });
            }
            prev[s] = Some(fwd.mb.0);
        }
    }
    Ok(())
}

/// torchtitan's `pipeline_parallel_schedule` class whose placement is `p`'s (torch's class in
/// parentheses), with the extra flag it needs; `None` when no class places stages this way.
pub fn torchtitan_class(p: &Placement) -> Option<(&'static str, &'static str, Option<String>)> {
    let pp = p.pp.max(1);
    let s = p.num_stages();
    if !s.is_multiple_of(pp) {
        return None;
    }
    let vpp = s / pp;
    if p.table() == Placement::looped(pp, vpp).table() {
        return Some(match vpp {
            1 => ("1F1B", "Schedule1F1B", None),
            2 => ("Interleaved1F1B", "ScheduleInterleaved1F1B", None),
            _ => (
                "Interleaved1F1B",
                "ScheduleInterleaved1F1B",
                Some(format!(
                    "--parallelism.pipeline_parallel_layers_per_stage so that it builds {s} stages"
                )),
            ),
        });
    }
    if vpp == 2 && p.table() == Placement::v_shape(pp).table() {
        return Some(("ZBVZeroBubble", "ScheduleZBVZeroBubble", None));
    }
    None
}

/// What the run instructions need to know about the winner.
pub struct Winner<'a> {
    pub spec: Option<&'a pipec_schedules::ScheduleSpec>,
    pub placement: &'a Placement,
    pub microbatches: u32,
    /// The Megatron layout string of the split.
    pub layout: &'a str,
    /// Where the files are (`-o`), or a placeholder.
    pub dir: &'a str,
    /// The winner's program: what its run lines can carry (torch's CSV refuses memory
    /// instructions and microbatch lengths) and whether it splits the backward.
    pub program: &'a Program,
    /// The layers of each stage, in stage order (torchtitan's per-stage module lists).
    pub stages: &'a [Vec<pipec_schedules::layout::LayerKind>],
}

/// Whether Megatron's own schedule functions run this winner as it is: 1F1B
/// (`forward_backward_pipelining_without_interleaving`) or interleaved 1F1B, loop placement.
fn megatron_own(w: &Winner) -> Option<&'static str> {
    let spec = w.spec?;
    if spec.combined || spec.forward_only {
        return None;
    }
    spec.kind
        .row()
        .megatron
        .map(pipec_schedules::MegatronLoop::function)
}

/// Megatron-LM's command-line flags for a P2P mode (`megatron/training/arguments.py`: the
/// interleaved schedule overlaps P2P unless `--no-overlap-p2p-communication`; the
/// non-interleaved one always batches).
fn megatron_p2p_flags(spec: &pipec_schedules::ScheduleSpec) -> String {
    use pipec_schedules::{MegatronLoop, MegatronP2p};
    let interleaved = spec.kind.row().megatron == Some(MegatronLoop::Interleaved);
    match (interleaved, spec.megatron_p2p) {
        (false, MegatronP2p::Batched) => {
            "P2P: Megatron-LM's default for this schedule (batch_p2p_comm), no flag".into()
        }
        (true, MegatronP2p::Batched) => {
            "P2P: --no-overlap-p2p-communication (batch_p2p_comm)".into()
        }
        (true, MegatronP2p::Overlap) => {
            "P2P: Megatron-LM's default for this schedule (overlap_p2p_comm, deallocate_pipeline_outputs), no flag".into()
        }
        (true, MegatronP2p::OverlapFlush) => {
            "P2P: --overlap-p2p-communication-warmup-flush (overlap_p2p_comm, overlap_p2p_comm_warmup_flush)".into()
        }
        (_, mode) => format!("P2P: set ModelParallelConfig to {}", mode.config()),
    }
}

/// How to run the winner on `target`, one line per step. `target` must accept it.
///
/// Every line is one of three forms (issue #40: each printed command must work for the plan,
/// and a test runs them, tests/integration/tune.rs and python/tests/test_run_lines.py):
/// `$ ` a shell command, run as written (after `#`, a comment); `>>> ` a Python statement, run
/// in the framework's process with the names the comment says the user provides (`rank`,
/// `stages`, `loss_fn`, `layers`, `engine`); anything else says what a command cannot do for
/// the plan and how to do it (a framework's own flags, what its adapter was never run with).
pub fn how_to_run(target: Target, w: &Winner) -> Vec<String> {
    let pp = w.placement.pp;
    let m = w.microbatches;
    let dir = w.dir;
    let sh_dir = shell_word(dir);
    let layout_flags = format!(
        "--pipeline-model-parallel-size {pp} --pipeline-model-parallel-layout \"{}\"",
        w.layout
    );
    match target {
        Target::Megatron => {
            let looped = w.placement.table()
                == Placement::looped(pp.max(1), w.placement.num_stages() / pp.max(1)).table();
            let mut lines = if let (Some(func), Some(spec), true) =
                (megatron_own(w), w.spec, looped)
            {
                let mut first = format!(
                    "Megatron's own schedule ({func}): {layout_flags}, {m} microbatches per step"
                );
                if let Some(g) = spec.group_size {
                    first.push_str(&format!(
                        ", --microbatch-group-size-per-virtual-pipeline-stage {g}"
                    ));
                }
                vec![first, megatron_p2p_flags(spec)]
            } else if looped {
                vec![
                    format!(
                        "build the model with {layout_flags} (Megatron's placement is the \
                         schedule's: stage s on rank s % pp, chunk s / pp)"
                    ),
                    format!(
                        ">>> forward_backward = pipec.megatron.forward_backward_func(\"{dir}\")  \
                         # in place of get_forward_backward_func(), {m} microbatches; Megatron's \
                         P2P flags are not used (the communication is the one pipec verified)"
                    ),
                ]
            } else {
                vec![
                    format!(
                        "build rank r's model chunks from pipec.megatron.stage_indices(\"{dir}\", r) \
                         and pipec.megatron.stage_layers(\"{dir}\"), not from \
                         --pipeline-model-parallel-layout (which puts stage s on rank s % pp)"
                    ),
                    format!(
                        ">>> forward_backward = pipec.megatron.forward_backward_func(\"{dir}\")  \
                         # in place of get_forward_backward_func(), {m} microbatches; Megatron's \
                         P2P flags are not used"
                    ),
                ]
            };
            if megatron_own(w).is_none() || !looped {
                lines.push(
                    "not run with: GPUs and NCCL, tensor, context or data parallelism above 1, \
                     Megatron's DDP wrapper and distributed optimizer, Transformer Engine \
                     layers, MoE \
                     (pipec.megatron's tests run megatron-core's local layers; docs/megatron.md \
                     \"Evidence\"): compare the first steps with Megatron's own schedule there"
                        .into(),
                );
            }
            lines
        }
        Target::Torch => {
            let class = torchtitan_class(w.placement)
                .map(|(_, torch, _)| format!(", the placement of torch's {torch}"))
                .unwrap_or_default();
            let mut lines = vec![
                format!(
                    ">>> stage_ids = pipec.torch.stage_indices(\"{dir}\", rank)  # build this \
                     rank's PipelineStages in this order{class}"
                ),
                format!(
                    ">>> schedule = pipec.torch.build_schedule(\"{dir}\", stages, loss_fn)  \
                     # torch's _PipelineScheduleRuntime runs the verified actions, {m} \
                     microbatches per step"
                ),
            ];
            match crate::torch::export::csv_refusal(w.program) {
                None => lines.push(format!(
                    "$ pipec export {sh_dir} --format torch-csv -o schedule.csv  # or the CSV: \
                     compute+comms, for torch's _load_csv(..., format=\"compute_comms\")"
                )),
                Some(e) => lines.push(format!(
                    "no CSV for this plan (pipec export --format torch-csv refuses it: {}); \
                     build_schedule above runs it",
                    csv_reason(&e)
                )),
            }
            lines
        }
        Target::Torchtitan => {
            let (class, extra) = match torchtitan_class(w.placement) {
                Some((c, _, e)) => (c, e),
                None => ("?", None),
            };
            let mut second = format!(
                "--parallelism.pipeline_parallel_degree {pp} \
                 --parallelism.pipeline_parallel_schedule {class} \
                 --parallelism.pipeline_parallel_schedule_csv schedule.csv, {m} microbatches \
                 per step"
            );
            if let Some(e) = extra {
                second.push_str(&format!(", {e}"));
            }
            vec![
                format!(
                    "$ pipec export {sh_dir} --format torch-csv --compute-only -o schedule.csv"
                ),
                second,
                format!(
                    "layers as the plan splits them: parallelism.module_fqns_per_model_part = {} \
                     in the job's config (torchtitan's module names for its decoder-only \
                     models; with other names, the same counts per stage)",
                    torchtitan_parts(w.stages)
                ),
                "not run: torchtitan's trainer end to end (pipec's tests run its schedule \
                 builder on this CSV; docs/torch.md)"
                    .into(),
            ]
        }
        Target::PipecRun | Target::Any => vec![
            format!(
                "$ pipec-run {sh_dir}  # the cpu backend, in every build: a synthetic model \
                 (layers of --hidden, --ffn), not yours; it checks the plan runs and times it"
            ),
            if w.program.lengths.is_some() {
                "not on NVIDIA GPUs: the cuda backend runs microbatches of one length (--seq), \
                 and this plan gives each its own"
                    .to_string()
            } else {
                format!(
                    "on NVIDIA GPUs: pipec-run {dir} --backend cuda, with a pipec-run built by \
                     cargo build --release -p pipec-cli --features cuda (docs/cuda.md)"
                )
            },
        ],
        Target::Deepspeed => {
            let split = w.program.ranks.iter().flatten().any(|i| {
                matches!(
                    i,
                    Instr::Compute(Compute::BwdD(_)) | Instr::Compute(Compute::BwdW(_))
                )
            });
            let mut lines = vec![
                format!(
                    ">>> module = pipec.deepspeed.pipeline_module(\"{dir}\", layers, \
                     loss_fn=loss_fn)  # a PipelineModule of {pp} stages split as the plan \
                     ({}); layers: one LayerSpec per letter of the layout, in order (DeepSpeed's \
                     partition_method has no explicit split)",
                    w.layout
                ),
                format!(
                    ">>> pipec.deepspeed.use(engine, \"{dir}\")  # engine: \
                     deepspeed.initialize(model=module, ...) with gradient_accumulation_steps \
                     = {m}"
                ),
            ];
            if split {
                lines.push(
                    "the plan splits the backward: train in bf16 (DeepSpeed's BF16_Optimizer) or \
                     fp32; an fp16 engine (loss scaler) refuses it"
                        .into(),
                );
            }
            lines.push(
                "not run with: GPUs and NCCL, data parallelism above 1, activation \
                 checkpointing, fp16 (pipec.deepspeed's tests: CPU, gloo, fp32 and bf16, ZeRO 0 \
                 and 1; docs/deepspeed.md)"
                    .into(),
            );
            lines
        }
    }
}

/// `word` as one shell word: as it is when it needs no quoting, else in single quotes.
fn shell_word(word: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "/._-+:=@%,".contains(c);
    if !word.is_empty() && word.chars().all(plain) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', "'\\''"))
    }
}

/// The reason of a CSV refusal ([`crate::torch::export::csv_refusal`]) in a few words.
fn csv_reason(e: &crate::torch::export::ExportError) -> String {
    use crate::torch::export::ExportError;
    match e {
        ExportError::MemoryOp { .. } => "torch's schedule CSV has no action for offload, \
            reload, wait_offload, recompute or a checkpointed forward"
            .into(),
        ExportError::Lengths { .. } => "its microbatches have different lengths and torch's \
            schedule CSV carries no shapes"
            .into(),
        ExportError::P2pGroups { groups } => format!(
            "it is verified under the P2P groups `{groups}` and torch's runtime posts a CSV's \
             messages on its own communicators"
        ),
        other => other.to_string(),
    }
}

/// torchtitan's per-stage module lists for a layout (`module_fqns_per_model_part`, a list per
/// model part = stage): `tok_embeddings`, `layers.i` (decoder layers numbered across stages),
/// `norm` and `lm_head`, the names torchtitan 0.3.0's own
/// `_generate_llm_fqn_per_model_part` gives (torchtitan/distributed/pipeline_parallel.py).
/// A multi-token-prediction layer is `mtp.j` (a name of the user's model: torchtitan has none).
pub fn torchtitan_parts(stages: &[Vec<pipec_schedules::layout::LayerKind>]) -> String {
    use pipec_schedules::layout::LayerKind;
    let (mut decoder, mut mtp) = (0, 0);
    let parts: Vec<String> = stages
        .iter()
        .map(|stage| {
            let names: Vec<String> = stage
                .iter()
                .flat_map(|k| match k {
                    LayerKind::Embedding => vec!["\"tok_embeddings\"".to_string()],
                    LayerKind::Decoder => {
                        decoder += 1;
                        vec![format!("\"layers.{}\"", decoder - 1)]
                    }
                    LayerKind::Mtp => {
                        mtp += 1;
                        vec![format!("\"mtp.{}\"", mtp - 1)]
                    }
                    LayerKind::Loss => vec!["\"norm\"".to_string(), "\"lm_head\"".to_string()],
                })
                .collect();
            format!("[{}]", names.join(", "))
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Which levers the tuner may pull (`--no-offload`, `--no-recompute` turn one off).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Levers {
    pub offload: bool,
    pub recompute: bool,
}

impl Levers {
    pub const ALL: Levers = Levers {
        offload: true,
        recompute: true,
    };
    pub const NONE: Levers = Levers {
        offload: false,
        recompute: false,
    };

    pub fn any(self) -> bool {
        self.offload || self.recompute
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipec_schedules::Task;

    /// One rank, one stage: forwards of the microbatches `mbs`, in that order.
    fn forwards(mbs: &[u32]) -> Program {
        Program {
            placement: Placement::looped(1, 1),
            microbatches: mbs.len() as u32,
            forward_only: true,
            comm: None,
            ranks: vec![mbs
                .iter()
                .map(|&mb| Instr::Compute(Compute::Fwd(Task::new(0, mb))))
                .collect()],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
        }
    }

    #[test]
    fn forwards_out_of_order_are_refused_by_torchtitan_only() {
        let p = forwards(&[0, 2, 1, 3]);
        let titan = Target::Torchtitan.refuse(&p).unwrap_err();
        assert_eq!(
            titan,
            Refusal::ForwardOrder {
                rank: 0,
                stage: 0,
                order: vec![0, 2, 1, 3],
                last_only: true
            }
        );
        assert_eq!(
            Target::Torchtitan.check(&p).unwrap_err(),
            "rank 0 runs the forwards of stage 0 out of microbatch order (1 after 2); \
             torchtitan runs the plan's microbatch ids on torch's runtime, which takes \
             microbatch m's loss from position m of its loss list (pipec.torch renumbers \
             them; torchtitan does not)"
        );
        // The default (every framework) refuses it in torchtitan's words.
        assert!(TargetChoice::Every
            .refusal(&p)
            .unwrap()
            .starts_with("not runnable on torchtitan: rank 0 runs the forwards"));
        // pipec.torch renumbers the microbatches for torch (#38); pipec.megatron hands each
        // forward its own microbatch by id.
        for t in [
            Target::Torch,
            Target::Megatron,
            Target::PipecRun,
            Target::Deepspeed,
            Target::Any,
        ] {
            assert_eq!(t.refuse(&p), Ok(()), "{t}");
        }
        for t in Target::ALL {
            assert_eq!(t.refuse(&forwards(&[0, 1, 2])), Ok(()), "{t}");
        }
    }

    /// `direction`/`edge` plans run only where the adapter posts on those communicators:
    /// Megatron and torchtitan refuse them; the default choice skips those two, as it skips
    /// the frameworks that cannot size microbatch lengths.
    #[test]
    fn p2p_groups_are_refused_where_the_framework_posts_on_its_own_communicators() {
        for groups in [
            pipec_schedules::P2pGroups::Direction,
            pipec_schedules::P2pGroups::Edge,
        ] {
            let p = Program {
                p2p_groups: groups,
                ..forwards(&[0, 1])
            };
            for t in [Target::Megatron, Target::Torchtitan] {
                assert_eq!(
                    t.refuse(&p),
                    Err(Refusal::P2pGroups { groups, target: t }),
                    "{t}"
                );
                assert!(t.check(&p).unwrap_err().contains(&format!("`{groups}`")));
            }
            for t in [
                Target::Torch,
                Target::Deepspeed,
                Target::PipecRun,
                Target::Any,
            ] {
                assert_eq!(t.refuse(&p), Ok(()), "{t}");
            }
            assert_eq!(TargetChoice::Every.refusal(&p), None);
            assert!(TargetChoice::One(Target::Megatron).refusal(&p).is_some());
        }
        for t in Target::ALL {
            assert_eq!(t.refuse(&forwards(&[0, 1])), Ok(()), "{t}");
        }
    }

    #[test]
    fn a_stage_on_two_ranks_is_refused_in_each_adapters_words() {
        let p = Placement::bidirectional(2, 2);
        for t in [Target::Torch, Target::Megatron, Target::Torchtitan] {
            assert_eq!(t.refuse_placement(&p), Err(Refusal::TwoRanks), "{t}");
        }
        assert!(Target::Torch
            .check_placement(&p)
            .unwrap_err()
            .starts_with("places every stage on two ranks (one per direction)"));
        assert!(Refusal::TwoRanks
            .adapter_message(Target::Torch, "dualpipe")
            .starts_with("dualpipe places each stage on two ranks"));
        assert!(Refusal::TwoRanks
            .adapter_message(Target::Megatron, "dualpipe")
            .contains("a Megatron model chunk lives on one rank"));
        assert!(matches!(
            Target::Deepspeed.refuse_placement(&p),
            Err(Refusal::Placement(why)) if why.contains("DualPipe's two directions")
        ));
        assert_eq!(Target::PipecRun.refuse_placement(&p), Ok(()));
    }

    /// The module lists written by hand from torchtitan 0.3.0's names
    /// (`_generate_llm_fqn_per_model_part`: `tok_embeddings`, `layers.i`, `norm`, `lm_head`)
    /// for the layout `Et|tt|tL`.
    #[test]
    fn torchtitan_parts_name_each_stage_s_modules() {
        use pipec_schedules::layout::LayerKind::{Decoder as T, Embedding as E, Loss as L};
        let stages = vec![vec![E, T], vec![T, T], vec![T, L]];
        assert_eq!(
            torchtitan_parts(&stages),
            r#"[["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "norm", "lm_head"]]"#
        );
    }

    /// A directory is one shell word in the `$` lines, as POSIX sh reads single quotes.
    #[test]
    fn shell_word_quotes_only_what_needs_it() {
        assert_eq!(shell_word("tuned/run-1"), "tuned/run-1");
        assert_eq!(shell_word("my runs"), "'my runs'");
        assert_eq!(shell_word("it's"), "'it'\\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
