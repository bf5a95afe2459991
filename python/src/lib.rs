//! `pipec._native`: the Rust core of the `pipec` Python package (built with maturin).
//!
//! Everything here is a thin wrapper over the crates the CLI uses: [`pipec_compiler::compile`] and
//! [`pipec_ir::verify`] for `compile`, [`pipec_runtime::load`] (every check `pipec-run` makes) for
//! `load`, [`pipec_ir::files`] for `save` and the instruction records, [`pipec_cost::simulate`] and
//! [`pipec_compiler::torch`] for simulation and torch's actions. Results with structure are handed to
//! Python as JSON text (the same JSON the CLI prints); `pipec/__init__.py` decodes them and
//! maps the error kinds to the documented exception classes.

mod typed;

use pipec_compiler::compile::{compile_verified, BuildError, CompileError, CompileRequest};
use pipec_compiler::target::{Target, TargetChoice};
use pipec_compiler::torch::{export_cells, export_csv, CsvForm};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::simulate;
use pipec_ir::files::{self, Encoding, Header};
use pipec_ir::ir::{Instr, Program};
use pipec_runtime::{load::LaunchWorld, RunError};
use pipec_schedules::layout::Layout;
use pipec_schedules::{Lengths, Limits, MegatronP2p, ScheduleKind, ScheduleSpec};
use pipec_tune::{tune, TuneRequest};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::json;
use std::path::PathBuf;

create_exception!(
    pipec,
    PipecError,
    PyValueError,
    "Base of every pipec error."
);
create_exception!(
    pipec,
    LayoutError,
    PipecError,
    "The layout string is invalid; the message echoes it with a caret."
);
create_exception!(
    pipec,
    SpecError,
    PipecError,
    "The schedule parameters are invalid."
);
create_exception!(
    pipec,
    InvalidSchedule,
    PipecError,
    "The schedule does not verify; `.violations` lists every violation in words."
);
create_exception!(
    pipec,
    FileError,
    PipecError,
    "A compiled directory was refused; the message names the file and the reason."
);
create_exception!(
    pipec,
    TorchExportError,
    PipecError,
    "The schedule cannot be expressed with torch's pipeline actions."
);

/// An `InvalidSchedule` carrying its violations.
fn invalid(py: Python<'_>, msg: String, violations: Vec<String>) -> PyErr {
    let e = InvalidSchedule::new_err(msg);
    if let Err(set) = e.value(py).setattr("violations", violations) {
        return set;
    }
    e
}

fn report_error(py: Python<'_>, what: &str, r: &pipec_ir::verify::Report) -> PyErr {
    let violations: Vec<String> = r
        .violations
        .iter()
        .map(|v| format!("[{}] {v}", v.class()))
        .collect();
    let mut msg = format!("{what}: {}", r.verdict_line());
    for v in &violations {
        msg.push_str("\n  ");
        msg.push_str(v);
    }
    invalid(py, msg, violations)
}

/// Memory counted as every command counts it ([`pipec_ir::memory`]): the weights under `cost`
/// (the `--cost` text; default: layer-activations) and `memory_limit` (`"80GiB"` or a plain
/// number in the report's unit) resolved in their unit, as `pipec check --cost --memory-limit`
/// takes them.
fn memory_rule(
    program: &Program,
    layout: &Layout,
    memory_limit: Option<&str>,
    cost: Option<&str>,
) -> PyResult<(pipec_ir::memory::MemoryModel, Option<f64>)> {
    let model = cost_model(cost)?;
    let mem = pipec_cost::memory::weights(program, layout, &model);
    Ok((mem, resolve_limit(parse_limit(memory_limit)?, &model)?))
}

/// The cost model of `cost` (the CLI's `--cost` spec), the default without one.
fn cost_model(cost: Option<&str>) -> PyResult<CostModel> {
    let mut model = CostModel::default();
    if let Some(spec) = cost {
        model
            .apply(spec, None)
            .map_err(|e| SpecError::new_err(e.render()))?;
    }
    Ok(model)
}

/// `memory_limit` (`"80GiB"` or a plain number) as given, refused as the CLI refuses a
/// `--memory-limit` it cannot read.
fn parse_limit(memory_limit: Option<&str>) -> PyResult<Option<pipec_cost::memory::Limit>> {
    memory_limit
        .map(pipec_cost::memory::Limit::parse)
        .transpose()
        .map_err(|e| SpecError::new_err(format!("memory_limit: {e}")))
}

/// `memory_limit` in the unit of `model`'s memory, refused as the CLI refuses `--memory-limit`
/// ([`pipec_cost::memory::Limit::resolve_for`]): a byte limit needs byte costs.
fn resolve_limit(
    memory_limit: Option<pipec_cost::memory::Limit>,
    model: &CostModel,
) -> PyResult<Option<f64>> {
    memory_limit
        .map(|l| l.resolve_for(model))
        .transpose()
        .map_err(|e| SpecError::new_err(format!("memory_limit: {e}")))
}

/// The manifest's `cost` for a schedule made under `cost` (the full spec, as the CLI writes
/// it with `--cost`), or none when no cost was given.
fn recorded_cost(cost: Option<&str>) -> PyResult<Option<String>> {
    cost.map(|c| {
        CostModel::parse(c)
            .map(|m| m.spec())
            .map_err(|e| SpecError::new_err(e.render()))
    })
    .transpose()
}

/// A compiled (or loaded) schedule: its program and the header its files carry.
#[pyclass(module = "pipec._native", frozen)]
struct NativeSchedule {
    /// Every way to make one verifies it: compile, tune and load.
    verified: pipec_ir::verify::Verified,
    layout: Layout,
    spec: Option<ScheduleSpec>,
    source: String,
    /// The cost model it was planned or compiled with (the manifest's `cost`): written by
    /// `save`, the default of `check` and `simulate`, as the CLI does.
    cost: Option<String>,
    /// The plan's name when no spec names it (the manifest's `plan`: `tune`'s winner).
    plan: Option<String>,
}

impl NativeSchedule {
    fn program(&self) -> &Program {
        self.verified.program()
    }

    fn rank(&self, rank: u32) -> PyResult<&[Instr]> {
        self.program()
            .ranks
            .get(rank as usize)
            .map(Vec::as_slice)
            .ok_or_else(|| PyValueError::new_err(format!("rank {rank} is out of range")))
    }

    fn header(&self) -> Header<'_> {
        Header {
            source: &self.source,
            schedule: self.spec,
            layout: &self.layout,
        }
    }

    /// `1f1b pp=4 vpp=1 microbatches=8`, as `pipec simulate` names a schedule.
    fn title(&self) -> String {
        pipec_compiler::view::report::schedule_title(
            self.spec.as_ref(),
            &self.source,
            self.plan.as_deref(),
            self.program(),
        )
    }
}

#[pymethods]
impl NativeSchedule {
    #[getter]
    fn pp(&self) -> u32 {
        self.program().world()
    }

    #[getter]
    fn num_stages(&self) -> u32 {
        self.program().num_stages()
    }

    #[getter]
    fn num_microbatches(&self) -> u32 {
        self.program().microbatches
    }

    /// The microbatch lengths the plan carries (the manifest's `microbatch_lengths`) as JSON:
    /// a list of ints when every microbatch is one sequence, else a list of lists; `null`
    /// without lengths.
    fn lengths_json(&self) -> String {
        serde_json::to_string(&self.program().lengths).unwrap_or_else(|_| "null".into())
    }

    #[getter]
    fn forward_only(&self) -> bool {
        self.program().forward_only
    }

    /// Which communicator carries each message (`pair`, `direction`, `edge`; the manifest's
    /// `p2p_groups`, `pair` when absent).
    #[getter]
    fn p2p_groups(&self) -> &'static str {
        self.program().p2p_groups.name()
    }

    /// The schedule kind (`1f1b`, ...), or the source (`torch-csv`) of an imported one.
    #[getter]
    fn kind(&self) -> String {
        match &self.spec {
            Some(s) => s.kind.to_string(),
            None => self.source.clone(),
        }
    }

    /// Chunks (stages) per rank: the spec's, else the program's stages over its ranks when they
    /// divide evenly (a tuned plan's `loop vpp=2`, a V placement's 2), else `None`.
    #[getter]
    fn vpp(&self) -> Option<u32> {
        match self.spec {
            Some(s) => Some(s.vpp),
            None => {
                let (stages, pp) = (self.program().num_stages(), self.program().world());
                (pp > 0 && stages.is_multiple_of(pp)).then(|| stages / pp)
            }
        }
    }

    /// The Megatron layout string of the split: as given or tuned, else expanded (`Et|tL`).
    #[getter]
    fn layout(&self) -> String {
        self.layout
            .text
            .clone()
            .unwrap_or_else(|| self.layout.expanded())
    }

    /// The plan's name when no spec names it (`tuned loop vpp=2`, `1f1b + offload 3`).
    #[getter]
    fn plan(&self) -> Option<String> {
        self.plan.clone()
    }

    #[getter]
    fn placement(&self) -> String {
        format!("{:?}", self.program().placement.kind).to_lowercase()
    }

    #[getter]
    fn stage_to_rank(&self) -> Vec<u32> {
        self.program()
            .placement
            .table()
            .iter()
            .map(|r| r.0)
            .collect()
    }

    #[getter]
    fn title_line(&self) -> String {
        self.title()
    }

    /// The manifest's `layout` and `comm_policy` fields, and the NCCL stream rule the program's
    /// communicator model implies (`streams`: the verifier's, so adapters need not derive it
    /// from the label), as JSON, without rendering the rank
    /// files the whole manifest would need (for their hashes).
    fn header_json(&self) -> String {
        let rule = pipec_ir::verify::StreamRule::of(self.program());
        json!({
            "layout": self.layout,
            "comm_policy": self.program().comm,
            "streams": { "per_direction": rule.per_direction, "ops_in_order": rule.ops_in_order },
        })
        .to_string()
    }

    /// Why `target` (`megatron`, `torch`, `torchtitan`, `pipec-run`, `deepspeed`, `any`)
    /// cannot run this schedule, or `None`: the rule `pipec tune --target` filters by.
    fn target_refusal(&self, target: &str) -> PyResult<Option<String>> {
        let t: Target = target.parse().map_err(SpecError::new_err)?;
        Ok(t.check(self.program()).err())
    }

    /// The same rule in the words of `target`'s adapter (`pipec.torch`, `pipec.megatron`
    /// raise it as it is), or `None`; `placement_only`: its stage -> rank half only
    /// ([`pipec_compiler::target::Target::refuse_placement`]), what an adapter checks before it has
    /// anything to run.
    #[pyo3(signature = (target, placement_only=false))]
    fn adapter_refusal(&self, target: &str, placement_only: bool) -> PyResult<Option<String>> {
        let t: Target = target.parse().map_err(SpecError::new_err)?;
        let refused = if placement_only {
            t.refuse_placement(&self.program().placement)
        } else {
            t.refuse(self.program())
        };
        Ok(refused.err().map(|r| r.adapter_message(t, &self.kind())))
    }

    /// The forwards megatron-core checkpoints fully on each rank under
    /// `num_microbatches_with_partial_activation_checkpoints = n`, as (stage, mb) in the rank's
    /// order (`pipec_schedules::megatron_partial_recompute`, recorded against megatron-core):
    /// what `pipec.megatron` compares the schedule's checkpointed forwards with.
    fn megatron_checkpoints(&self, n: i64) -> PyResult<Vec<Vec<(u32, u32)>>> {
        let spec = self.spec.as_ref().ok_or_else(|| {
            PipecError::new_err(format!(
                "{}: no generating spec (tuned or imported), so Megatron's partial recompute has no rule here",
                self.title()
            ))
        })?;
        let limits = Limits {
            max_compute_ops: pipec_schedules::MAX_COMPUTE_OPS,
        };
        let marks = pipec_schedules::megatron_partial_recompute(spec, &limits, n)
            .map_err(|e| PipecError::new_err(e.to_string()))?;
        Ok(marks
            .iter()
            .map(|r| r.checkpointed().map(|t| (t.stage.0, t.mb.0)).collect())
            .collect())
    }

    /// The checkpointed forwards (`fwd` with `"checkpoint": true`) of every rank, as (stage,
    /// mb) in the rank's order: what `pipec.megatron` compares with
    /// [`Self::megatron_checkpoints`], without a Python object per instruction (a job that
    /// plans every step asks it every step).
    fn checkpointed_forwards(&self) -> Vec<Vec<(u32, u32)>> {
        self.program()
            .ranks
            .iter()
            .map(|instrs| {
                instrs
                    .iter()
                    .filter_map(|ins| match ins {
                        Instr::FwdCheckpoint(t) => Some((t.stage.0, t.mb.0)),
                        _ => None,
                    })
                    .collect()
            })
            .collect()
    }

    /// Rank `rank`'s CUDA-graph capture order in Transformer Engine's `_order` encoding
    /// ([`pipec_ir::ir::capture_order`]): forwards as ints, backwards as negative ints,
    /// weight gradients as half steps (floats).
    fn capture_order(&self, py: Python<'_>, rank: u32) -> PyResult<Vec<Py<PyAny>>> {
        self.rank(rank)?;
        let order = pipec_ir::ir::capture_order(self.program(), rank)
            .map_err(|e| PipecError::new_err(format!("{}: {e}", self.title())))?;
        order
            .iter()
            .map(|s| -> PyResult<Py<PyAny>> {
                Ok(match *s {
                    pipec_ir::ir::CaptureStep::Fwd(c) => c.into_pyobject(py)?.into_any().unbind(),
                    pipec_ir::ir::CaptureStep::Bwd(c) => {
                        (-i64::from(c)).into_pyobject(py)?.into_any().unbind()
                    }
                    pipec_ir::ir::CaptureStep::Wgrad(_) => {
                        s.value().into_pyobject(py)?.into_any().unbind()
                    }
                })
            })
            .collect()
    }

    #[getter]
    fn instruction_count(&self) -> usize {
        self.program().len()
    }

    /// Rank `rank`'s instruction records as JSON (the array of `rank-<r>.json`), rendering
    /// that rank only.
    fn rank_instructions_json(&self, rank: u32) -> PyResult<String> {
        let instrs = self.rank(rank)?;
        // The writer emits ASCII only.
        Ok(String::from_utf8_lossy(&pipec_ir::files::instructions_json(instrs)).into_owned())
    }

    /// Rank `rank`'s instructions as `Instruction`s, reading that rank only.
    fn instructions<'py>(
        &self,
        py: Python<'py>,
        rank: u32,
    ) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        typed::instructions(py, self.rank(rank)?)
    }

    /// Rank `rank`'s steps (`ComputeStep`, `BatchStep`, `WaitStep`), cut by `ir::steps`,
    /// reading that rank only. Steps are what the executors run: a program with Megatron's
    /// shape messages (`megatron_variable_seq_lengths=True`) models Megatron's handshake for
    /// the verifier and is refused here, as `pipec-run` refuses it.
    fn steps<'py>(&self, py: Python<'py>, rank: u32) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let instrs = self.rank(rank)?;
        let shape = instrs.iter().position(|i| {
            matches!(i, Instr::Send { payload, .. } | Instr::Recv { payload, .. } if payload.kind.is_shape())
        });
        if let Some(k) = shape {
            return Err(SpecError::new_err(format!(
                "rank {rank}, #{k}: {} is one of Megatron's shape messages: this schedule models Megatron's variable_seq_lengths handshake (megatron_variable_seq_lengths=True) for checking and is not executed; compile without it (with lengths every receive is sized from the plan)",
                instrs[k]
            )));
        }
        typed::rank_steps(py, instrs)
    }

    fn render(&self, encoding: &str) -> PyResult<Vec<(String, Vec<u8>)>> {
        let enc = parse_encoding(encoding)?;
        Ok(files::render(&self.header(), &self.verified, enc))
    }

    fn save(&self, path: PathBuf, encoding: &str) -> PyResult<()> {
        let enc = parse_encoding(encoding)?;
        // Streamed from the program, as `pipec compile` writes (no whole-output buffer).
        let header = self.header();
        let prepared = files::prepare(&header, self.program(), enc)
            .with_cost(self.cost.clone())
            .with_plan(self.plan.clone());
        let threads = files::threads_for(self.program().len() as u64);
        files::write_verified(&path, &prepared, threads, &self.verified)
            .map_err(|e| FileError::new_err(e.to_string()))
    }

    /// The verifier's report as JSON: valid, violations, peak activations and peak memory per
    /// rank, risks.
    #[pyo3(signature = (memory_limit=None, cost=None))]
    fn check(
        &self,
        py: Python<'_>,
        memory_limit: Option<&str>,
        cost: Option<&str>,
    ) -> PyResult<String> {
        let program = self.program();
        let (mem, limit) = memory_rule(
            program,
            &self.layout,
            memory_limit,
            cost.or(self.cost.as_deref()),
        )?;
        let threads = pipec_ir::par::threads_for(program.len() as u64);
        let r = py.detach(|| {
            pipec_ir::verify::verify_with(
                program,
                pipec_ir::verify::Level::Full,
                threads,
                &mem,
                limit,
            )
        });
        Ok(json!({
            "valid": r.is_valid(),
            "violations": r.violations.iter().map(|v| format!("[{}] {v}", v.class())).collect::<Vec<_>>(),
            // As the CLI's JSON names them (`simulate`'s `peak_activations` and `peak_memory`;
            // `check`'s `memory[r].peak` and `params`): live activations alone, and with the
            // parameters (issue #40: `peak_activations` held both).
            "peak_activations": r.memory.iter().map(|m| pipec_cost::rounding::figure(m.peak - m.params)).collect::<Vec<_>>(),
            "peak_memory": r.memory.iter().map(|m| pipec_cost::rounding::figure(m.peak)).collect::<Vec<_>>(),
            "memory_unit": r.memory_unit,
            "risks": r.risks.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
            "verdict": r.verdict_line(),
        })
        .to_string())
    }

    /// What `pipec simulate --json` prints, as JSON text.
    #[pyo3(signature = (cost=None))]
    fn simulate(&self, py: Python<'_>, cost: Option<&str>) -> PyResult<String> {
        let mut model = CostModel::default();
        if let Some(spec) = cost.or(self.cost.as_deref()) {
            model
                .apply(spec, None)
                .map_err(|e| SpecError::new_err(e.render()))?;
        }
        let costs = StageCosts::new(&model, &self.layout, self.program().num_stages());
        let name = self.title();
        let result = py.detach(|| simulate(&self.verified, &costs));
        let v =
            match pipec_compiler::view::report::json_report(&name, self.program(), &model, &result)
            {
                Some(v) => v,
                None => {
                    let e = result.err().map(|e| e.to_string()).unwrap_or_default();
                    return Err(InvalidSchedule::new_err(e));
                }
            };
        Ok(pipec_cost::rounding::tidy(v).to_string())
    }

    /// Every rank's instruction indices in an order that runs with blocking, one-at-a-time
    /// sends and receives (DeepSpeed's `p2p.send`/`recv`; gloo's send waits for its receive):
    /// compute and batches keep their places, the ops of each batch are reordered, waits are
    /// dropped (every batch completes where it stands). See [`pipec_ir::ir::blocking_order`].
    fn blocking_order(&self, py: Python<'_>) -> PyResult<Vec<Vec<u32>>> {
        let v = &self.verified;
        py.detach(|| pipec_ir::ir::blocking_order(v.program(), v.matching()))
            .map_err(|e| PipecError::new_err(format!("{}: {e}", self.title())))
    }

    /// torch's schedule CSV (compute+comms unless `compute_only`).
    #[pyo3(signature = (compute_only=false))]
    fn to_torch_csv(&self, compute_only: bool) -> PyResult<String> {
        export_csv(&self.verified, form(compute_only))
            .map_err(|e| TorchExportError::new_err(e.to_string()))
    }

    /// The same cells as Python lists, one list per rank: `[stage, "TYPE", mb|None]` for an
    /// action, `["OVERLAP_F_B", fwd, bwd]` for an overlapped pair, `None` for an idle cell
    /// (made directly, no JSON text in between). Memory instructions, which the CSV refuses,
    /// come as pipec's own types (`ActionType::MEMORY`).
    #[pyo3(signature = (compute_only=false))]
    fn torch_actions<'py>(
        &self,
        py: Python<'py>,
        compute_only: bool,
    ) -> PyResult<Bound<'py, pyo3::types::PyList>> {
        let lines = py
            .detach(|| export_cells(&self.verified, form(compute_only)))
            .map_err(|e| TorchExportError::new_err(e.to_string()))?;
        typed::torch_cells(py, &lines)
    }
}

fn form(compute_only: bool) -> CsvForm {
    if compute_only {
        CsvForm::ComputeOnly
    } else {
        CsvForm::ComputeComms
    }
}

fn parse_encoding(s: &str) -> PyResult<Encoding> {
    match s {
        "json" => Ok(Encoding::Json),
        "bin" | "binary" | "postcard" => Ok(Encoding::Postcard),
        _ => Err(PyValueError::new_err(format!(
            "unknown format `{s}` (expected \"json\" or \"bin\")"
        ))),
    }
}

/// Generate, lower and verify, exactly as `pipec compile` does before it writes.
#[pyfunction]
#[pyo3(signature = (schedule, pp, microbatches, vpp=None, layout=None, group_size=None,
    forward_only=false, combined=false, memory_limit=None, megatron_p2p=None, max_ops=None,
    cost=None, megatron_partial_recompute=None, lengths=None, microbatch_order=None,
    megatron_variable_seq_lengths=false, num_layers=None, mtp_num_layers=None, p2p_groups=None,
    buffer_plan=false))]
#[allow(clippy::too_many_arguments)]
fn compile_schedule(
    py: Python<'_>,
    schedule: &str,
    pp: u32,
    microbatches: Option<u32>,
    vpp: Option<u32>,
    layout: Option<String>,
    group_size: Option<u32>,
    forward_only: bool,
    combined: bool,
    memory_limit: Option<String>,
    megatron_p2p: Option<&str>,
    max_ops: Option<u64>,
    cost: Option<&str>,
    megatron_partial_recompute: Option<i64>,
    lengths: Option<Vec<Vec<i128>>>,
    microbatch_order: Option<Vec<i64>>,
    megatron_variable_seq_lengths: bool,
    num_layers: Option<u32>,
    mtp_num_layers: Option<u32>,
    p2p_groups: Option<&str>,
    buffer_plan: bool,
) -> PyResult<NativeSchedule> {
    let p2p_groups = match p2p_groups {
        Some(s) => s
            .parse::<pipec_schedules::P2pGroups>()
            .map_err(SpecError::new_err)?,
        None => pipec_schedules::P2pGroups::Pair,
    };
    let lengths = lengths
        .map(Lengths::from_lists)
        .transpose()
        .map_err(|e| SpecError::new_err(e.to_string()))?;
    // The count: `microbatches`, which the lengths must agree with (the compiler's
    // `LengthsCount`, raised below), or the lengths' count.
    let microbatches = match (microbatches, &lengths) {
        (Some(m), _) => m,
        (None, Some(l)) => l.microbatches(),
        (None, None) => {
            return Err(SpecError::new_err(
                "microbatches must be given (or lengths=, one entry per microbatch)",
            ))
        }
    };
    let microbatch_order = microbatch_order
        .map(|o| order_u32(o, microbatches))
        .transpose()?;
    let kind: ScheduleKind = schedule
        .parse()
        .map_err(|e: pipec_schedules::UnknownKind| SpecError::new_err(e.to_string()))?;
    let p2p = match megatron_p2p {
        Some(s) => s.parse::<MegatronP2p>().map_err(SpecError::new_err)?,
        None => MegatronP2p::default_for(kind, pp),
    };
    let req = CompileRequest {
        vpp,
        group_size,
        forward_only,
        combined,
        megatron_p2p: p2p,
        layout,
        limits: limits(max_ops)?,
        megatron_partial_recompute,
        lengths,
        microbatch_order,
        megatron_variable_seq_lengths,
        num_layers,
        mtp_num_layers,
        p2p_groups,
        buffer_plan,
        ..CompileRequest::new(kind, pp, microbatches)
    };
    let model = cost_model(cost)?;
    let limit = parse_limit(memory_limit.as_deref())?;
    let c = py
        .detach(|| compile_verified(&req, &model, limit))
        .map_err(|e| match e {
            BuildError::Compile(CompileError::Layout(l)) => LayoutError::new_err(l.to_string()),
            BuildError::Compile(CompileError::Spec(s)) => SpecError::new_err(s.to_string()),
            BuildError::Compile(e) => SpecError::new_err(e.to_string()),
            BuildError::Memory(e) => SpecError::new_err(format!("memory_limit: {e}")),
            BuildError::Rejected(r) => report_error(
                py,
                &format!("{kind} pp={pp} microbatches={microbatches} does not verify"),
                &r.report,
            ),
        })?;
    let verified = c.verified;
    Ok(NativeSchedule {
        verified,
        layout: c.layout,
        spec: Some(c.spec),
        source: "generated".into(),
        cost: recorded_cost(cost)?,
        plan: None,
    })
}

/// `microbatch_order=` as the compiler takes it: an entry that is no microbatch index at all
/// (negative, or past `u32`) is refused in the words of [`CompileError::Order`], as one out of
/// range is; the compiler checks the rest (a permutation of `0..microbatches`).
fn order_u32(order: Vec<i64>, microbatches: u32) -> PyResult<Vec<u32>> {
    if let Some(&x) = order.iter().find(|&&x| u32::try_from(x).is_err()) {
        let shown: Vec<String> = order.iter().take(16).map(i64::to_string).collect();
        let more = if order.len() > 16 { ", ..." } else { "" };
        return Err(SpecError::new_err(
            CompileError::Order {
                order: format!("[{}{more}]", shown.join(", ")),
                microbatches,
                why: format!("{x} is out of range"),
            }
            .to_string(),
        ));
    }
    Ok(order.into_iter().map(|x| x as u32).collect())
}

/// `pipec tune` as a function: the fastest verified schedule and layer split for the costs
/// (`cost`: the cost-spec text of `--cost`/`--cost-file`) under `memory_limit` (bytes with
/// units, `"40GiB"`, or activation units). Returns the schedule and `pipec tune --json`'s
/// object as JSON text.
#[pyfunction]
#[pyo3(signature = (pp, microbatches, num_layers=None, mtp_num_layers=None, layout=None,
    rebalance=false, cost=None, memory_limit=None, max_ops=None, target=None, kinds=None,
    exclude_kinds=None, out=None, offload=true, recompute=true, lengths=None,
    host_memory_limit=None, p2p_groups=None))]
#[allow(clippy::too_many_arguments)]
fn tune_schedule(
    py: Python<'_>,
    pp: u32,
    microbatches: u32,
    num_layers: Option<u32>,
    mtp_num_layers: Option<u32>,
    layout: Option<String>,
    rebalance: bool,
    cost: Option<&str>,
    memory_limit: Option<&str>,
    max_ops: Option<u64>,
    target: Option<&str>,
    kinds: Option<Vec<String>>,
    exclude_kinds: Option<Vec<String>>,
    out: Option<String>,
    offload: bool,
    recompute: bool,
    lengths: Option<Vec<Vec<i128>>>,
    host_memory_limit: Option<&str>,
    p2p_groups: Option<&str>,
) -> PyResult<(NativeSchedule, String)> {
    // `--p2p-groups`'s parser and words (`pair` when absent).
    let p2p_groups = match p2p_groups {
        Some(s) => s
            .parse::<pipec_schedules::P2pGroups>()
            .map_err(SpecError::new_err)?,
        None => pipec_schedules::P2pGroups::Pair,
    };
    // Per microbatch, its sequences' lengths (issue #38); a bad one names its index.
    let lengths = lengths
        .map(pipec_schedules::Lengths::from_lists)
        .transpose()
        .map_err(|e| SpecError::new_err(format!("lengths: {e}")))?;
    let target = match target {
        Some(t) => TargetChoice::One(
            t.parse::<Target>()
                .map_err(|e| SpecError::new_err(format!("target: {e}")))?,
        ),
        None => TargetChoice::Every,
    };
    // Refused as `pipec tune` refuses the flags, in the parameters' names.
    if layout.is_some() {
        for (given, name) in [
            (num_layers.is_some(), "num_layers"),
            (mtp_num_layers.is_some(), "mtp_num_layers"),
        ] {
            if given {
                return Err(SpecError::new_err(pipec_tune::layers_with_layout(
                    name, "layout",
                )));
            }
        }
    }
    let mut model = CostModel::default();
    if let Some(spec) = cost {
        model
            .apply(spec, None)
            .map_err(|e| SpecError::new_err(e.render()))?;
    }
    let layout = match layout {
        Some(text) => Some(
            pipec_schedules::layout::parse(&text)
                .map_err(|e| LayoutError::new_err(e.to_string()))?,
        ),
        None => None,
    };
    // A byte limit needs byte costs: 40GiB against 1-unit activations would be met by anything.
    let memory_limit = parse_limit(memory_limit)?;
    resolve_limit(memory_limit, &model)?;
    // Refused as `--host-memory-limit` is, in the parameter's name.
    let host_memory_limit = host_memory_limit
        .map(|s| {
            let l = pipec_cost::memory::Limit::parse(s)
                .map_err(|e| SpecError::new_err(format!("host_memory_limit: {e}")))?;
            l.resolve_for(&model)
                .map_err(|e| SpecError::new_err(format!("host_memory_limit: {e}")))?;
            Ok::<_, PyErr>(l)
        })
        .transpose()?;
    let req = TuneRequest {
        layout,
        rebalance,
        num_layers,
        mtp_num_layers,
        memory_limit,
        limits: limits(max_ops)?,
        target,
        kinds,
        exclude_kinds: exclude_kinds.unwrap_or_default(),
        levers: pipec_compiler::target::Levers { offload, recompute },
        lengths,
        host_memory_limit,
        p2p_groups,
        ..TuneRequest::new(pp, microbatches, pipec_tune::target_model(&model, target))
    };
    let t0 = std::time::Instant::now();
    let t = py
        .detach(|| tune(&req))
        .map_err(|e| SpecError::new_err(e.to_string()))?;
    // Rounded as `pipec tune --json` prints it.
    let report = pipec_cost::rounding::tidy(t.json_for(t0.elapsed().as_secs_f64(), out.as_deref()))
        .to_string();
    let layout = t.file_layout();
    let source = t.header(&layout).source.to_string();
    let plan = t.plan_name();
    Ok((
        NativeSchedule {
            verified: t.verified,
            layout,
            spec: t.spec,
            source,
            cost: cost.is_some().then(|| req.model.spec()), // with the target's costs
            plan,
        },
        report,
    ))
}

/// Load a compiled directory with every check `pipec-run` makes.
#[pyfunction]
#[pyo3(signature = (path, world_size=None))]
fn load_dir(py: Python<'_>, path: PathBuf, world_size: Option<u32>) -> PyResult<NativeSchedule> {
    let world = world_size.map(|size| LaunchWorld {
        size,
        from: "world_size=",
    });
    let loaded = py
        .detach(|| pipec_runtime::load::load(&path, world))
        .map_err(|e| match e {
            RunError::NotVerified { dir, report } => {
                report_error(py, &format!("{dir}: refusing to load"), &report)
            }
            e => FileError::new_err(e.to_string()),
        })?;
    let m = loaded.manifest;
    Ok(NativeSchedule {
        verified: loaded.program,
        layout: m.layout,
        spec: m.schedule,
        source: m.source,
        cost: m.cost,
        plan: m.plan,
    })
}

/// `pipec seal`: recompute the hashes of a directory another tool wrote or edited
/// ([`files::seal_dir`]); what was done as JSON. A malformed file raises `FileError` with the
/// CLI's message.
#[pyfunction]
fn seal_dir(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let s = py
        .detach(|| files::seal_dir(&path))
        .map_err(|e| FileError::new_err(e.to_string()))?;
    Ok(json!({
        "ranks": s.ranks,
        "instructions": s.instructions,
        "changed": s.changed,
        "unchanged": s.unchanged,
    })
    .to_string())
}

/// The cost model a spec describes (`--cost` / `--cost-file` text, `[model]` table
/// included), as the JSON the cost model serializes to: per kind `f`/`b`/`w`, `memory`
/// (`act`, `param` in bytes when derived) and `model` (the shape).
#[pyfunction]
fn cost_model_json(spec: &str) -> PyResult<String> {
    let model = CostModel::parse(spec).map_err(|e| SpecError::new_err(e.render()))?;
    let v = serde_json::to_value(&model).map_err(|e| SpecError::new_err(e.to_string()))?;
    Ok(v.to_string())
}

/// The rank file's instructions, one row each (`pipec_ir::files::OPS`, in variant-index
/// order): `(row, op, [field])`, the row's own name (`fwd_checkpoint`) beside the file's op
/// (`fwd`). `pipec.Op` is made from it.
#[pyfunction]
fn op_rows() -> Vec<(&'static str, &'static str, Vec<&'static str>)> {
    pipec_ir::files::OPS
        .iter()
        .map(|o| (o.row, o.name, o.fields.iter().map(|f| f.0).collect()))
        .collect()
}

/// The schedule kinds pipec generates.
#[pyfunction]
fn kinds() -> Vec<String> {
    ScheduleKind::ALL
        .iter()
        .map(|k| k.name().to_string())
        .collect()
}

/// The rank file's instructions as its one schema defines them
/// (`pipec_ir::files::OPS`): `(op, [(field, kind)])` in variant-index order, so that the
/// Python executors are tested against it rather than against a copy.
#[pyfunction]
fn instruction_schema() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
    pipec_ir::files::OPS
        .iter()
        .map(|o| (o.name, o.fields.to_vec()))
        .collect()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("PipecError", py.get_type::<PipecError>())?;
    m.add("LayoutError", py.get_type::<LayoutError>())?;
    m.add("SpecError", py.get_type::<SpecError>())?;
    m.add("InvalidSchedule", py.get_type::<InvalidSchedule>())?;
    m.add("FileError", py.get_type::<FileError>())?;
    m.add("TorchExportError", py.get_type::<TorchExportError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Megatron's P2P modes (`megatron_p2p=`) and the `[model]` keys, as Rust defines them.
    m.add(
        "MEGATRON_P2P_MODES",
        pyo3::types::PyTuple::new(py, MegatronP2p::ALL.iter().map(|p| p.name()))?,
    )?;
    m.add(
        "MODEL_KEYS",
        pyo3::types::PyTuple::new(py, pipec_cost::model::MODEL_KEYS)?,
    )?;
    m.add_class::<NativeSchedule>()?;
    m.add_class::<typed::Task>()?;
    m.add_class::<typed::Instruction>()?;
    m.add_class::<typed::ComputeStep>()?;
    m.add_class::<typed::BatchStep>()?;
    m.add_class::<typed::WaitStep>()?;
    m.add_class::<typed::MemoryStep>()?;
    m.add_function(wrap_pyfunction!(compile_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(load_dir, m)?)?;
    m.add_function(wrap_pyfunction!(seal_dir, m)?)?;
    m.add_function(wrap_pyfunction!(tune_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(kinds, m)?)?;
    m.add_function(wrap_pyfunction!(cost_model_json, m)?)?;
    m.add_function(wrap_pyfunction!(instruction_schema, m)?)?;
    m.add_function(wrap_pyfunction!(op_rows, m)?)?;
    Ok(())
}

/// The op limit a call asks for, capped as the CLI's `--max-ops` is.
fn limits(max_ops: Option<u64>) -> PyResult<Limits> {
    let max = pipec_schedules::MAX_COMPUTE_OPS;
    match max_ops {
        Some(n) if n == 0 || n > max => Err(SpecError::new_err(format!(
            "max_ops = {n} is out of range: 1 to {max}"
        ))),
        n => Ok(Limits {
            max_compute_ops: n.unwrap_or(Limits::DEFAULT.max_compute_ops),
        }),
    }
}
