//! `pipec._native`: the Rust core of the `pipec` Python package (built with maturin).
//!
//! Everything here is a thin wrapper over the crates the CLI uses: [`pipec::compile`] and
//! [`pipec::verify`] for `compile`, [`pipec_runtime::load`] (every check `pipec-run` makes) for
//! `load`, [`pipec::back::files`] for `save` and the instruction records, [`pipec::simulate`] and
//! [`pipec::back::torch`] for simulation and torch's actions. Results with structure are handed to
//! Python as JSON text (the same JSON the CLI prints); `pipec/__init__.py` decodes them and
//! maps the error kinds to the documented exception classes.

use pipec::back::files::{self, Encoding, Header, Loaded};
use pipec::back::torch::{export_cells, export_csv, Action, Cell, CsvForm};
use pipec::compile::{compile, CompileError, CompileRequest};
use pipec::front::layout::Layout;
use pipec::ir::Program;
use pipec::simulate::cost::{CostModel, StageCosts};
use pipec::simulate::simulate;
use pipec::tune::{tune, Target, TargetChoice, TuneRequest};
use pipec::verify::{verify, StreamRule, VerifyOptions};
use pipec_runtime::{load::LaunchWorld, RunError};
use pipec_schedules::{CommPolicy, Limits, MegatronP2p, ScheduleKind, ScheduleSpec};
use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{json, Value};
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

fn report_error(py: Python<'_>, what: &str, r: &pipec::verify::Report) -> PyErr {
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

/// A compiled (or loaded) schedule: its program and the header its files carry.
#[pyclass(module = "pipec._native", frozen)]
struct NativeSchedule {
    program: Program,
    layout: Layout,
    spec: Option<ScheduleSpec>,
    comm_policy: Option<CommPolicy>,
    source: String,
}

impl NativeSchedule {
    fn header(&self) -> Header<'_> {
        Header {
            source: &self.source,
            schedule: self.spec,
            comm_policy: self.comm_policy,
            layout: &self.layout,
        }
    }

    /// `1f1b pp=4 vpp=1 microbatches=8`, as `pipec simulate` names a schedule.
    fn title(&self) -> String {
        pipec::simulate::schedule_title(self.spec.as_ref(), &self.source, &self.program)
    }
}

fn action_json(a: &Action) -> Value {
    json!([a.stage, a.ty.name(), a.mb])
}

fn cell_json(c: &Cell) -> Value {
    match c {
        Cell::Empty => Value::Null,
        Cell::Action(a) => action_json(a),
        Cell::Overlap { fwd, bwd } => {
            json!(["OVERLAP_F_B", action_json(fwd), action_json(bwd)])
        }
    }
}

#[pymethods]
impl NativeSchedule {
    #[getter]
    fn pp(&self) -> u32 {
        self.program.world()
    }

    #[getter]
    fn num_stages(&self) -> u32 {
        self.program.num_stages()
    }

    #[getter]
    fn num_microbatches(&self) -> u32 {
        self.program.microbatches
    }

    #[getter]
    fn forward_only(&self) -> bool {
        self.program.forward_only
    }

    /// The schedule kind (`1f1b`, ...), or the source (`torch-csv`) of an imported one.
    #[getter]
    fn kind(&self) -> String {
        match &self.spec {
            Some(s) => s.kind.to_string(),
            None => self.source.clone(),
        }
    }

    #[getter]
    fn vpp(&self) -> Option<u32> {
        self.spec.map(|s| s.vpp)
    }

    #[getter]
    fn placement(&self) -> String {
        format!("{:?}", self.program.placement.kind).to_lowercase()
    }

    #[getter]
    fn stage_to_rank(&self) -> Vec<u32> {
        self.program.placement.table().iter().map(|r| r.0).collect()
    }

    #[getter]
    fn title_line(&self) -> String {
        self.title()
    }

    /// The manifest's `layout` and `comm_policy` fields as JSON, without rendering the rank
    /// files the whole manifest would need (for their hashes).
    fn header_json(&self) -> String {
        json!({ "layout": self.layout, "comm_policy": self.comm_policy }).to_string()
    }

    /// Why `target` (`megatron`, `torch`, `torchtitan`, `pipec-run`, `deepspeed`, `any`)
    /// cannot run this schedule, or `None`: the rule `pipec tune --target` filters by.
    fn target_refusal(&self, target: &str) -> PyResult<Option<String>> {
        let t: Target = target.parse().map_err(SpecError::new_err)?;
        Ok(t.check(&self.program).err())
    }

    #[getter]
    fn instruction_count(&self) -> usize {
        self.program.len()
    }

    /// The files of the schedule, manifest first: `[(name, bytes)]`.
    fn render(&self, encoding: &str) -> PyResult<Vec<(String, Vec<u8>)>> {
        let enc = parse_encoding(encoding)?;
        Ok(files::render(&self.header(), &self.program, enc))
    }

    fn save(&self, path: PathBuf, encoding: &str) -> PyResult<()> {
        let enc = parse_encoding(encoding)?;
        // Streamed from the program, as `pipec compile` writes (no whole-output buffer).
        files::write_program(&path, &self.header(), &self.program, enc)
            .map_err(|e| FileError::new_err(e.to_string()))
    }

    /// The verifier's report as JSON: valid, violations, peak activations per rank, risks.
    #[pyo3(signature = (memory_limit=None))]
    fn check(&self, py: Python<'_>, memory_limit: Option<u64>) -> String {
        let opts = VerifyOptions {
            memory_limit,
            streams: StreamRule::of_policy(self.comm_policy, self.program.world()),
        };
        let r = py.detach(|| verify(&self.program, &opts));
        json!({
            "valid": r.is_valid(),
            "violations": r.violations.iter().map(|v| format!("[{}] {v}", v.class())).collect::<Vec<_>>(),
            "peak_activations": r.memory.iter().map(|m| m.peak).collect::<Vec<_>>(),
            "risks": r.risks.iter().map(|k| k.to_string()).collect::<Vec<_>>(),
            "verdict": r.verdict_line(),
        })
        .to_string()
    }

    /// What `pipec simulate --json` prints, as JSON text.
    #[pyo3(signature = (cost=None))]
    fn simulate(&self, py: Python<'_>, cost: Option<&str>) -> PyResult<String> {
        let mut model = CostModel::default();
        if let Some(spec) = cost {
            model
                .apply(spec, None)
                .map_err(|e| SpecError::new_err(e.render()))?;
        }
        let costs = StageCosts::new(&model, &self.layout, self.program.num_stages());
        let name = self.title();
        let result = py.detach(|| simulate(&self.program, &costs));
        let v = match pipec::simulate::json_report(&name, &self.program, &model, &result) {
            Some(v) => v,
            None => {
                let e = result.err().map(|e| e.to_string()).unwrap_or_default();
                return Err(InvalidSchedule::new_err(e));
            }
        };
        Ok(pipec::tidy::tidy(v).to_string())
    }

    /// torch's schedule CSV (compute+comms unless `compute_only`).
    #[pyo3(signature = (compute_only=false))]
    fn to_torch_csv(&self, compute_only: bool) -> PyResult<String> {
        export_csv(&self.program, form(compute_only))
            .map_err(|e| TorchExportError::new_err(e.to_string()))
    }

    /// The same cells as structured JSON, one list per rank: `[stage, "TYPE", mb|null]` for an
    /// action, `["OVERLAP_F_B", fwd, bwd]` for an overlapped pair, `null` for an idle cell.
    #[pyo3(signature = (compute_only=false))]
    fn torch_actions(&self, compute_only: bool) -> PyResult<String> {
        let lines = export_cells(&self.program, form(compute_only))
            .map_err(|e| TorchExportError::new_err(e.to_string()))?;
        let v: Vec<Vec<Value>> = lines
            .iter()
            .map(|l| l.iter().map(cell_json).collect())
            .collect();
        Ok(Value::from(v).to_string())
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
    forward_only=false, combined=false, memory_limit=None, megatron_p2p=None, max_ops=None))]
#[allow(clippy::too_many_arguments)]
fn compile_schedule(
    py: Python<'_>,
    schedule: &str,
    pp: u32,
    microbatches: u32,
    vpp: Option<u32>,
    layout: Option<String>,
    group_size: Option<u32>,
    forward_only: bool,
    combined: bool,
    memory_limit: Option<u64>,
    megatron_p2p: Option<&str>,
    max_ops: Option<u64>,
) -> PyResult<NativeSchedule> {
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
        ..CompileRequest::new(kind, pp, microbatches)
    };
    let c = py.detach(|| compile(&req)).map_err(|e| match e {
        CompileError::Layout(l) => LayoutError::new_err(l.to_string()),
        CompileError::Spec(s) => SpecError::new_err(s.to_string()),
        e @ (CompileError::UnevenLayers { .. } | CompileError::TooManyLayers { .. }) => {
            SpecError::new_err(e.to_string())
        }
    })?;
    let opts = VerifyOptions {
        memory_limit,
        streams: StreamRule::of_policy(Some(c.schedule.comm), c.program.world()),
    };
    let r = py.detach(|| verify(&c.program, &opts));
    if !r.is_valid() {
        return Err(report_error(
            py,
            &format!("{kind} pp={pp} microbatches={microbatches} does not verify"),
            &r,
        ));
    }
    Ok(NativeSchedule {
        program: c.program,
        layout: c.layout,
        spec: Some(c.spec),
        comm_policy: Some(c.schedule.comm),
        source: "generated".into(),
    })
}

/// `pipec tune` as a function: the fastest verified schedule and layer split for the costs
/// (`cost`: the cost-spec text of `--cost`/`--cost-file`) under `memory_limit` (bytes with
/// units, `"40GiB"`, or activation units). Returns the schedule and `pipec tune --json`'s
/// object as JSON text.
#[pyfunction]
#[pyo3(signature = (pp, microbatches, num_layers=None, mtp_num_layers=None, layout=None,
    rebalance=false, cost=None, memory_limit=None, max_ops=None, target=None, kinds=None,
    exclude_kinds=None, out=None))]
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
) -> PyResult<(NativeSchedule, String)> {
    let target = match target {
        Some(t) => TargetChoice::One(
            t.parse::<Target>()
                .map_err(|e| SpecError::new_err(format!("target: {e}")))?,
        ),
        None => TargetChoice::Every,
    };
    let mut model = CostModel::default();
    if let Some(spec) = cost {
        model
            .apply(spec, None)
            .map_err(|e| SpecError::new_err(e.render()))?;
    }
    let layout = match layout {
        Some(text) => Some(
            pipec::front::layout::parse(&text).map_err(|e| LayoutError::new_err(e.to_string()))?,
        ),
        None => None,
    };
    let memory_limit = match memory_limit {
        Some(s) => Some(
            pipec::simulate::cost::parse_memory(s)
                .map_err(|e| SpecError::new_err(format!("memory_limit: {e}")))?
                .0,
        ),
        None => None,
    };
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
        ..TuneRequest::new(pp, microbatches, model)
    };
    let t0 = std::time::Instant::now();
    let t = py
        .detach(|| tune(&req))
        .map_err(|e| SpecError::new_err(e.to_string()))?;
    // Rounded as `pipec tune --json` prints it.
    let report =
        pipec::tidy::tidy(t.json_for(t0.elapsed().as_secs_f64(), out.as_deref())).to_string();
    let layout = t.file_layout();
    let source = t.header(&layout).source.to_string();
    Ok((
        NativeSchedule {
            program: t.program,
            layout,
            spec: t.spec,
            comm_policy: Some(t.comm),
            source,
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
    let loaded: Loaded = py
        .detach(|| pipec_runtime::load::load(&path, world))
        .map_err(|e| match e {
            RunError::NotVerified { dir, report } => {
                report_error(py, &format!("{dir}: refusing to load"), &report)
            }
            e => FileError::new_err(e.to_string()),
        })?;
    let m = loaded.manifest;
    Ok(NativeSchedule {
        program: loaded.program,
        layout: m.layout,
        spec: m.schedule,
        comm_policy: m.comm_policy,
        source: m.source,
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

/// The schedule kinds pipec generates.
#[pyfunction]
fn kinds() -> Vec<String> {
    ScheduleKind::ALL
        .iter()
        .map(|k| k.name().to_string())
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
    m.add_class::<NativeSchedule>()?;
    m.add_function(wrap_pyfunction!(compile_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(load_dir, m)?)?;
    m.add_function(wrap_pyfunction!(seal_dir, m)?)?;
    m.add_function(wrap_pyfunction!(tune_schedule, m)?)?;
    m.add_function(wrap_pyfunction!(kinds, m)?)?;
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
