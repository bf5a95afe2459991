//! The whole compilation: layout + spec -> schedule -> program -> verdict
//! ([`compile_verified`], the one entry point from a request to a verified program).

pub mod sweep;

use crate::lower::lower;
use pipec_cost::cost::CostModel;
use pipec_cost::memory::{Limit, MemoryError, Rule};
use pipec_ir::ir::Program;
use pipec_ir::verify::{self, Rejected, Verified};
use pipec_schedules::layout::{self, LayerKind, Layout, LayoutError};
use pipec_schedules::{
    generate, Lengths, LengthsError, Limits, MegatronP2p, P2pGroups, Schedule, ScheduleKind,
    ScheduleSpec, SpecError,
};
use thiserror::Error;

/// What the user asked for, before the layout decides vpp.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileRequest {
    pub kind: ScheduleKind,
    pub pp: u32,
    /// Explicit `--vpp`; with a layout it must agree with stages / pp.
    pub vpp: Option<u32>,
    pub microbatches: u32,
    pub group_size: Option<u32>,
    pub forward_only: bool,
    /// Megatron's combined 1F1B (`--combined`).
    pub combined: bool,
    /// How Megatron posts its P2P calls (1f1b, interleaved-1f1b).
    pub megatron_p2p: MegatronP2p,
    pub layout: Option<String>,
    pub num_layers: Option<u32>,
    pub mtp_num_layers: Option<u32>,
    pub limits: Limits,
    /// Megatron's `num_microbatches_with_partial_activation_checkpoints` (1f1b,
    /// interleaved-1f1b): the forwards Megatron checkpoints fully become checkpointed forwards
    /// with a recompute before their backward ([`crate::lower::recompute`]).
    pub megatron_partial_recompute: Option<i64>,
    /// The tokens of each microbatch's sequences (`--microbatch-lengths`, Python `lengths=`;
    /// issue #38): the program records them and sizes every message by them.
    pub lengths: Option<Lengths>,
    /// The order in which the user's microbatches enter the pipeline (tune's
    /// `microbatch_order`): the `k`-th microbatch the schedule runs is the user's
    /// `microbatch_order[k]`. `None` is index order.
    pub microbatch_order: Option<Vec<u32>>,
    /// Model Megatron's `config.variable_seq_lengths = True` handshake: the shape messages
    /// `_communicate_shapes` posts before every P2P call, in its order
    /// (`--megatron-variable-seq-lengths`, Python `megatron_variable_seq_lengths=True`; 1f1b and
    /// interleaved-1f1b). For `pipec check` to say where Megatron's handshake deadlocks or
    /// crosses shapes; such a program is not run (a plan with lengths needs no handshake).
    pub megatron_variable_seq_lengths: bool,
    /// Which communicator carries each message (`--p2p-groups`, Python `p2p_groups=`): the
    /// program records it (the manifest's `p2p_groups`) and is verified under it.
    pub p2p_groups: P2pGroups,
    /// A static buffer plan (`--buffer-plan`, Python `buffer_plan=True`; issue #39): every
    /// send and receive of a tensor gets a slot of its rank's message-buffer pool, sized by
    /// the cost model's message size ([`pipec_cost::memory::message_size`]), as few slots as
    /// the messages' lifetimes allow ([`pipec_ir::ir::buffers`]).
    pub buffer_plan: bool,
}

impl CompileRequest {
    /// A request with every optional field at its default (vpp from the kind or the layout, no
    /// layout, Megatron's default group size, training, default limits); set others with struct
    /// update syntax (`CompileRequest { vpp: Some(2), ..CompileRequest::new(k, 4, 8) }`).
    pub fn new(kind: ScheduleKind, pp: u32, microbatches: u32) -> Self {
        CompileRequest {
            kind,
            pp,
            vpp: None,
            microbatches,
            group_size: None,
            forward_only: false,
            combined: false,
            megatron_p2p: MegatronP2p::default_for(kind, pp),
            layout: None,
            num_layers: None,
            mtp_num_layers: None,
            limits: Limits::DEFAULT,
            megatron_partial_recompute: None,
            lengths: None,
            microbatch_order: None,
            megatron_variable_seq_lengths: false,
            p2p_groups: P2pGroups::Pair,
            buffer_plan: false,
        }
    }
}

#[derive(Debug, Error)]
pub enum CompileError {
    /// `--megatron-variable-seq-lengths` models Megatron's own P2P calls, which only its two
    /// schedule functions make.
    #[error("--megatron-variable-seq-lengths models Megatron's shape exchange, which only Megatron's own schedules post: use 1f1b or interleaved-1f1b, not {kind}")]
    ShapesNeedMegatron { kind: ScheduleKind },
    #[error(transparent)]
    Layout(#[from] LayoutError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// `num_layers` without a layout must split evenly over the stages, as Megatron requires.
    #[error("{num_layers} decoder layers do not split evenly over {stages} stages (pp x vpp); give a layout for an uneven split")]
    UnevenLayers { num_layers: u32, stages: u32 },
    /// More layers than a layout string may expand to: the even split allocates one entry
    /// per layer.
    #[error("{layers} layers are over the limit of {max} layers (the layout strings' cap)")]
    TooManyLayers { layers: u64, max: u64 },
    #[error(transparent)]
    PartialRecompute(#[from] pipec_schedules::PartialRecomputeError),
    #[error(transparent)]
    Checkpoint(#[from] crate::lower::recompute::CheckpointError),
    /// Lengths for another number of microbatches than the request's.
    #[error("the microbatch lengths give {given} microbatches, but {microbatches} were asked for (one line of lengths per microbatch)")]
    LengthsCount { given: u32, microbatches: u32 },
    /// A microbatch order that is not a permutation of the microbatches.
    #[error("microbatch order {order}: not a permutation of 0..{microbatches} ({why})")]
    Order {
        order: String,
        microbatches: u32,
        why: String,
    },
    #[error(transparent)]
    Lengths(#[from] LengthsError),
    /// The cost model's `[model]` table states `num_layers`, and the plan has another count.
    #[error(transparent)]
    LayersDisagree(#[from] pipec_cost::model::LayersDisagree),
}

/// A compiled schedule: everything the emitters and the runtime need.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub spec: ScheduleSpec,
    pub layout: Layout,
    pub schedule: Schedule,
    pub program: Program,
}

/// A [`Compiled`] without the per-rank orders lowering has consumed: what verifying and
/// writing need, and lighter by those orders (pages a large compile no longer touches).
#[derive(Clone, Debug)]
pub struct Lowered {
    pub spec: ScheduleSpec,
    pub layout: Layout,
    pub program: Program,
}

impl Compiled {
    /// Drop the orders, keeping what the emitters and the verifier use.
    pub fn into_lowered(self) -> Lowered {
        Lowered {
            spec: self.spec,
            layout: self.layout,
            program: self.program,
        }
    }
}

/// Resolve the layout, generate and lower. Verification is the caller's next step.
pub fn compile(req: &CompileRequest) -> Result<Compiled, CompileError> {
    let (layout, vpp) = match &req.layout {
        Some(text) => {
            let l = layout::parse(text)?;
            let vpp =
                layout::check_against(&l, req.pp, req.vpp, req.num_layers, req.mtp_num_layers)?;
            (l, vpp)
        }
        None => {
            let vpp = match (req.vpp, req.kind.row().vpp_required) {
                (Some(v), _) => v,
                (None, Some(hint)) => {
                    return Err(SpecError::ChunksNotGiven {
                        kind: req.kind,
                        hint,
                    }
                    .into())
                }
                (None, None) => req.kind.default_vpp(),
            };
            let spec_probe = ScheduleSpec {
                kind: req.kind,
                pp: req.pp,
                vpp,
                microbatches: req.microbatches,
                group_size: req.group_size,
                forward_only: req.forward_only,
                combined: req.combined,
                megatron_p2p: req.megatron_p2p,
            };
            // Validate before the layout allocates pp * vpp stages.
            spec_probe.validate(&req.limits)?;
            let stages = req.pp * vpp;
            let layout = match (req.num_layers, req.mtp_num_layers) {
                (None, None) => Layout::uniform(stages),
                (n, mtp) => even_layout(stages, n.unwrap_or(stages), mtp.unwrap_or(0))?,
            };
            (layout, vpp)
        }
    };
    let spec = ScheduleSpec {
        kind: req.kind,
        pp: req.pp,
        vpp,
        microbatches: req.microbatches,
        group_size: req.group_size,
        forward_only: req.forward_only,
        combined: req.combined,
        megatron_p2p: req.megatron_p2p,
    };
    check_lengths(req)?;
    let schedule = generate(&spec, &req.limits)?;
    let mut program = if req.megatron_variable_seq_lengths {
        crate::lower::lower_megatron_shapes(&schedule)
            .ok_or(CompileError::ShapesNeedMegatron { kind: req.kind })?
    } else {
        lower(&schedule)
    };
    if let Some(n) = req.megatron_partial_recompute {
        let marks = pipec_schedules::megatron_partial_recompute(&spec, &req.limits, n)?;
        crate::lower::recompute::checkpoint_forwards(&mut program, &marks)?;
    }
    if let Some(order) = &req.microbatch_order {
        program.renumber(order);
    }
    program.set_lengths(req.lengths.clone());
    program.p2p_groups = req.p2p_groups;
    Ok(Compiled {
        spec,
        layout,
        schedule,
        program,
    })
}

/// The lengths name as many microbatches as the request, and the order is a permutation.
fn check_lengths(req: &CompileRequest) -> Result<(), CompileError> {
    let m = req.microbatches;
    if let Some(l) = &req.lengths {
        if l.microbatches() != m {
            return Err(CompileError::LengthsCount {
                given: l.microbatches(),
                microbatches: m,
            });
        }
    }
    if let Some(order) = &req.microbatch_order {
        let bad = |why: String| {
            let shown: Vec<String> = order.iter().take(16).map(u32::to_string).collect();
            let more = if order.len() > 16 { ", ..." } else { "" };
            CompileError::Order {
                order: format!("[{}{more}]", shown.join(", ")),
                microbatches: m,
                why,
            }
        };
        if order.len() != m as usize {
            return Err(bad(format!("{} entries", order.len())));
        }
        let mut seen = vec![false; m as usize];
        for &x in order {
            match seen.get_mut(x as usize) {
                None => return Err(bad(format!("{x} is out of range"))),
                Some(true) => return Err(bad(format!("{x} appears twice"))),
                Some(s) => *s = true,
            }
        }
    }
    Ok(())
}

/// Why a request did not become a verified program.
#[derive(Debug, Error)]
pub enum BuildError {
    #[error(transparent)]
    Compile(#[from] CompileError),
    /// The limit cannot be applied under the cost model (a byte limit without byte costs).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The program does not verify: the verifier's report, every violation.
    #[error("{}", .0.report.verdict_line())]
    Rejected(Box<Rejected>),
}

/// A compiled program with the memory rule it is to be verified under: the first half of
/// [`compile_verified`], for callers that verify while they write (`pipec compile`).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub spec: ScheduleSpec,
    pub layout: Layout,
    pub program: Program,
    pub rule: Rule,
}

impl Prepared {
    /// The verifier on `threads` threads, under the prepared memory rule.
    pub fn verify_on(&self, threads: usize) -> Result<Verified<&Program>, Box<Rejected<&Program>>> {
        verify::verified_with(&self.program, threads, &self.rule.memory, self.rule.limit)
    }
}

/// A verified program and what it was compiled from.
#[derive(Clone, Debug)]
pub struct Built {
    pub spec: ScheduleSpec,
    pub layout: Layout,
    pub verified: Verified,
}

/// [`compile`] a request and weigh its memory under `model`, with `limit` resolved against the
/// model's unit ([`Limit::resolve_for`]) before anything is compiled: the memory rule every
/// path from a request to a verified program uses.
pub fn prepare(
    req: &CompileRequest,
    model: &CostModel,
    limit: Option<Limit>,
) -> Result<Prepared, BuildError> {
    let limit = limit.map(|l| l.resolve_for(model)).transpose()?;
    if let (Some(l), Some(shape)) = (&req.lengths, &model.shape) {
        l.check_seq(shape.seq).map_err(CompileError::from)?;
    }
    // A `[model]` table's `num_layers` (issue #40): the layers when the request names none,
    // else a count the plan must have, so that a plan is not costed as another model's.
    let from_table;
    let req = match model.shape.as_ref().and_then(|s| s.layer_count()) {
        Some(n) if req.layout.is_none() && req.num_layers.is_none() => {
            from_table = CompileRequest {
                num_layers: Some(n),
                ..req.clone()
            };
            &from_table
        }
        _ => req,
    };
    let mut c = compile(req)?.into_lowered();
    if let Some(shape) = &model.shape {
        let given = c.layout.count(pipec_schedules::layout::LayerKind::Decoder) as u64;
        let from = if req.layout.is_some() {
            "the layout"
        } else {
            "the layer count asked for"
        };
        shape
            .check_layers(given, from)
            .map_err(CompileError::from)?;
    }
    let memory = pipec_cost::memory::weights(&c.program, &c.layout, model);
    if req.buffer_plan {
        let m = c.program.microbatches;
        let size = |p: &pipec_ir::ir::Payload, _: Option<pipec_ir::ir::Tokens>| {
            memory.message_size(p, m).unwrap_or(0.0)
        };
        pipec_ir::ir::buffers::plan(&mut c.program, size);
    }
    Ok(Prepared {
        spec: c.spec,
        layout: c.layout,
        program: c.program,
        rule: Rule { memory, limit },
    })
}

/// The one path from a request to a verified program: [`prepare`] (compile, the memory rule)
/// and the verifier, on the threads the program's size warrants
/// ([`pipec_ir::par::threads_for`]).
pub fn compile_verified(
    req: &CompileRequest,
    model: &CostModel,
    limit: Option<Limit>,
) -> Result<Built, BuildError> {
    let p = prepare(req, model, limit)?;
    let threads = pipec_ir::par::threads_for(p.program.len() as u64);
    let verified = verify::verified_with(p.program, threads, &p.rule.memory, p.rule.limit)
        .map_err(BuildError::Rejected)?;
    Ok(Built {
        spec: p.spec,
        layout: p.layout,
        verified,
    })
}

/// The layout of `num_layers` decoder layers split evenly over `stages` stages (`E` first, `L`
/// last, MTP layers on the last stage), so that `--num-layers` without `--layout` builds the
/// model it names instead of one layer per stage.
pub fn even_layout(stages: u32, num_layers: u32, mtp_layers: u32) -> Result<Layout, CompileError> {
    let layers = u64::from(num_layers) + u64::from(mtp_layers);
    if layers > layout::MAX_LAYERS {
        return Err(CompileError::TooManyLayers {
            layers,
            max: layout::MAX_LAYERS,
        });
    }
    if stages == 0 || !num_layers.is_multiple_of(stages) {
        return Err(CompileError::UnevenLayers { num_layers, stages });
    }
    let per = (num_layers / stages) as usize;
    let n = stages as usize;
    let layers = (0..n)
        .map(|i| {
            let mut st = Vec::with_capacity(per + 3);
            if i == 0 {
                st.push(LayerKind::Embedding);
            }
            st.extend(std::iter::repeat_n(LayerKind::Decoder, per));
            if i + 1 == n {
                st.extend(std::iter::repeat_n(LayerKind::Mtp, mtp_layers as usize));
                st.push(LayerKind::Loss);
            }
            st
        })
        .collect();
    Ok(Layout {
        text: None,
        stages: layers,
    })
}
