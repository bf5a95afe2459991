//! Typed instructions and steps for Python (issue #27): what the executors in
//! `python/pipec/*.py` run, handed over as frozen pyclasses instead of JSON text.
//!
//! An [`Instruction`]'s op and fields come from the rank file's one schema
//! ([`files::fields_of`], generated from `schema.rs`'s table), so it reads exactly as the file's
//! record does and stays a read-only mapping with the record's keys (`ins["op"]`, `ins.get`,
//! `dict(ins)`), which is what `Schedule.instructions` returned before. Steps are
//! [`pipec_ir::ir::steps`]'s cut of the stream (the one every Rust consumer uses): Python never
//! cuts batches itself. Everything here reads one rank's instructions only.

use pipec_compiler::torch::{Action, Cell};
use pipec_ir::files::{fields_of, row_of, FieldValue, OpSchema, OPS};
use pipec_ir::ir::{steps, waited_batches, Instr, Step};
use pyo3::exceptions::PyKeyError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use pyo3::IntoPyObjectExt;

/// `pipec.Op`'s members in schema order, looked up once. `Op` is a Python enum that
/// `pipec/_op.py` makes from the schema's rows ([`OPS`], exported as `op_rows`): one member
/// per row, named as the row (`Op.fwd`, `Op.bwd_D`, `Op.fwd_checkpoint`), its integer the
/// row's variant index, so that a row added to `schema.rs` is a member with no other edit.
static OP_MEMBERS: PyOnceLock<Py<PyTuple>> = PyOnceLock::new();

fn op_member(py: Python<'_>, row: usize) -> PyResult<Bound<'_, PyAny>> {
    let members = OP_MEMBERS.get_or_try_init(py, || -> PyResult<Py<PyTuple>> {
        let op = py.import("pipec._op")?.getattr("Op")?;
        let members = op.try_iter()?.collect::<PyResult<Vec<_>>>()?;
        if members.len() != OPS.len() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "pipec.Op must have one member per row of the rank file's schema",
            ));
        }
        Ok(PyTuple::new(py, members)?.unbind())
    })?;
    members.bind(py).get_item(row)
}

/// A (stage, microbatch) pair: each half of a `fwd_bwd`.
#[pyclass(module = "pipec._native", eq, hash, frozen, from_py_object)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Task {
    #[pyo3(get)]
    stage: u32,
    #[pyo3(get)]
    mb: u32,
}

#[pymethods]
impl Task {
    #[new]
    fn new(stage: u32, mb: u32) -> Self {
        Task { stage, mb }
    }

    #[classattr]
    fn __match_args__() -> (&'static str, &'static str) {
        ("stage", "mb")
    }

    fn __repr__(&self) -> String {
        format!("Task(stage={}, mb={})", self.stage, self.mb)
    }
}

/// One instruction of a rank's stream, at `index`. Equal to another with the same record
/// (op and fields) and to the dict of that record, as `rank-<r>.json` holds it.
#[pyclass(module = "pipec._native", frozen, mapping)]
pub struct Instruction {
    ins: Instr,
    index: u32,
}

impl Instruction {
    fn field(&self, key: &str) -> Option<FieldValue> {
        let (_, fields) = fields_of(&self.ins);
        fields.into_iter().find(|(k, _)| *k == key).map(|(_, v)| v)
    }

    fn int(&self, key: &str) -> Option<u32> {
        match self.field(key)? {
            FieldValue::Int(n) => Some(n),
            FieldValue::Name(_) | FieldValue::True => None,
        }
    }

    fn task(&self, stage: &str, mb: &str) -> Option<Task> {
        Some(Task {
            stage: self.int(stage)?,
            mb: self.int(mb)?,
        })
    }

    /// The instruction's row of the schema.
    fn schema(&self) -> &'static OpSchema {
        &OPS[row_of(&self.ins)]
    }

    /// Its fields' keys, as the rank file orders them.
    fn field_keys(&self) -> impl Iterator<Item = &'static str> {
        self.schema().fields.iter().map(|f| f.0)
    }

    fn value<'py>(py: Python<'py>, v: FieldValue) -> PyResult<Bound<'py, PyAny>> {
        match v {
            FieldValue::Int(n) => n.into_bound_py_any(py),
            FieldValue::Name(n) => Ok(PyString::intern(py, n).into_any()),
            FieldValue::True => Ok(pyo3::types::PyBool::new(py, true).to_owned().into_any()),
        }
    }

    fn get_key<'py>(&self, py: Python<'py>, key: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
        if key == "op" {
            return Ok(Some(PyString::intern(py, self.schema().name).into_any()));
        }
        self.field(key).map(|v| Self::value(py, v)).transpose()
    }
}

#[pymethods]
impl Instruction {
    /// The op (a `pipec.Op` member).
    #[getter]
    fn op<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        op_member(py, row_of(&self.ins))
    }

    /// The position in the rank's stream (what `Schedule.blocking_order` lists).
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// The stage: of the task (`fwd`, `bwd`, `bwd_D`, `bwd_W`) or of the tensor a `send` or
    /// `recv` carries (its producer); `None` for `fwd_bwd` (see `fwd`, `bwd`) and `wait`.
    #[getter]
    fn stage(&self) -> Option<u32> {
        self.int("stage")
    }

    /// The microbatch, where `stage` is given.
    #[getter]
    fn mb(&self) -> Option<u32> {
        self.int("mb")
    }

    /// The other rank of a `send` or `recv`.
    #[getter]
    fn peer(&self) -> Option<u32> {
        self.int("peer")
    }

    /// `"act"` or `"grad"`: what a `send` or `recv` carries (`"act_shape"` / `"grad_shape"` for
    /// Megatron's shape messages, `--megatron-variable-seq-lengths`).
    #[getter]
    fn payload(&self) -> Option<&'static str> {
        match self.field("payload")? {
            FieldValue::Name(n) => Some(n),
            FieldValue::Int(_) | FieldValue::True => None,
        }
    }

    /// The tokens of the tensor a `send` or `recv` moves, when the plan carries microbatch
    /// lengths (issue #38; `Op.sized_send`, `Op.sized_recv`): the size to allocate a receive
    /// from. `None` for other ops and for plans without lengths.
    #[getter]
    fn tokens(&self) -> Option<u32> {
        self.int("tokens")
    }

    /// The slot of its rank's message-buffer pool a `send` or `recv` uses, when the plan has
    /// a buffer plan (issue #39, `buffer_plan=True`; `Op.slotted_send`, ...). `None` for
    /// other ops and for plans without one.
    #[getter]
    fn slot(&self) -> Option<u32> {
        self.int("slot")
    }

    /// A forward that keeps only its input (`"checkpoint": true`, `Op.fwd_checkpoint`).
    #[getter]
    fn checkpoint(&self) -> bool {
        matches!(self.ins, Instr::FwdCheckpoint(_))
    }

    /// The comm batch of a `send` or `recv`, or the batch a `wait` waits for.
    #[getter]
    fn batch(&self) -> Option<u32> {
        self.int("batch")
    }

    /// The forward half of a `fwd_bwd`.
    #[getter]
    fn fwd(&self) -> Option<Task> {
        self.task("fwd_stage", "fwd_mb")
    }

    /// The backward half of a `fwd_bwd`.
    #[getter]
    fn bwd(&self) -> Option<Task> {
        self.task("bwd_stage", "bwd_mb")
    }

    // --- the record, read as the dict `rank-<r>.json` holds
    /// `"op"`, then the op's fields in file order.
    fn keys(&self) -> Vec<&'static str> {
        let mut k = vec!["op"];
        k.extend(self.field_keys());
        k
    }

    fn values<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyAny>>> {
        Ok(self.items(py)?.into_iter().map(|(_, v)| v).collect())
    }

    fn items<'py>(&self, py: Python<'py>) -> PyResult<Vec<(&'static str, Bound<'py, PyAny>)>> {
        let (op, fields) = fields_of(&self.ins);
        let mut out = Vec::with_capacity(1 + fields.len());
        out.push(("op", PyString::intern(py, op).into_any()));
        for (k, v) in fields {
            out.push((k, Self::value(py, v)?));
        }
        Ok(out)
    }

    #[pyo3(signature = (key, default=None))]
    fn get<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        default: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let found = match key.cast::<PyString>() {
            Ok(k) => self.get_key(py, k.to_str()?)?,
            Err(_) => None,
        };
        Ok(found.or(default))
    }

    /// The record as a plain dict (what `json.loads` of its line gives).
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.items(py)? {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn __getitem__<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.get(py, key, None)?
            .ok_or_else(|| PyKeyError::new_err(key.clone().unbind()))
    }

    fn __contains__(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        Ok(self.get(py, key, None)?.is_some())
    }

    fn __len__(&self) -> usize {
        1 + self.schema().fields.len()
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        Ok(PyList::new(py, self.keys())?.try_iter()?.into_any())
    }

    fn __eq__<'py>(&self, py: Python<'py>, other: &Bound<'py, PyAny>) -> PyResult<Py<PyAny>> {
        if let Ok(o) = other.cast::<Instruction>() {
            return (self.ins == o.get().ins).into_py_any(py);
        }
        if other.cast::<PyDict>().is_ok() {
            return self.to_dict(py)?.eq(other)?.into_py_any(py);
        }
        Ok(py.NotImplemented())
    }

    fn __hash__(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.ins.hash(&mut h);
        h.finish()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "Instruction({}, {})",
            self.index,
            self.to_dict(py)?.repr()?
        ))
    }

    /// The instruction in pipec's words (`fwd(stage 0, mb 1)`), as the verifier names it.
    fn __str__(&self) -> String {
        self.ins.to_string()
    }
}

/// A compute op: `instruction` (`fwd`, a checkpointed `fwd`, `bwd`, `bwd_D`, `bwd_W`,
/// `fwd_bwd`).
#[pyclass(module = "pipec._native", frozen)]
pub struct ComputeStep {
    #[pyo3(get)]
    instruction: Py<Instruction>,
}

#[pymethods]
impl ComputeStep {
    #[classattr]
    fn __match_args__() -> (&'static str,) {
        ("instruction",)
    }

    /// The instruction's position in the stream.
    #[getter]
    fn index(&self) -> u32 {
        self.instruction.get().index
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "ComputeStep({})",
            self.instruction.bind(py).repr()?
        ))
    }
}

/// A memory instruction: `instruction` (`offload`, `reload`, `wait_offload`, `recompute`). A
/// checkpointed forward is a [`ComputeStep`]: it is the forward.
#[pyclass(module = "pipec._native", frozen)]
pub struct MemoryStep {
    #[pyo3(get)]
    instruction: Py<Instruction>,
}

#[pymethods]
impl MemoryStep {
    #[classattr]
    fn __match_args__() -> (&'static str,) {
        ("instruction",)
    }

    /// The instruction's position in the stream.
    #[getter]
    fn index(&self) -> u32 {
        self.instruction.get().index
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("MemoryStep({})", self.instruction.bind(py).repr()?))
    }
}

/// One comm batch: consecutive sends and receives with batch id `id`, posted together (one
/// NCCL group) and complete together: at once, or, when `in_flight`, at the `WaitStep` that
/// names it later in the stream.
#[pyclass(module = "pipec._native", frozen)]
pub struct BatchStep {
    #[pyo3(get)]
    id: u32,
    /// The sends and receives, in stream order (a tuple of `Instruction`).
    #[pyo3(get)]
    ops: Py<PyTuple>,
    /// A `wait` of this rank names the batch: it is left in flight until then.
    #[pyo3(get)]
    in_flight: bool,
    index: u32,
}

#[pymethods]
impl BatchStep {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str, &'static str) {
        ("id", "ops", "in_flight")
    }

    /// The position of its first op in the stream.
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "BatchStep(id={}, ops={}, in_flight={})",
            self.id,
            self.ops.bind(py).repr()?,
            if self.in_flight { "True" } else { "False" }
        ))
    }
}

/// A wait, at `index`, for the in-flight batch `batch`.
#[pyclass(module = "pipec._native", frozen)]
pub struct WaitStep {
    #[pyo3(get)]
    index: u32,
    #[pyo3(get)]
    batch: u32,
}

#[pymethods]
impl WaitStep {
    #[classattr]
    fn __match_args__() -> (&'static str, &'static str) {
        ("index", "batch")
    }

    fn __repr__(&self) -> String {
        format!("WaitStep(index={}, batch={})", self.index, self.batch)
    }
}

/// Python's cyclic garbage collector held off while this lives (and it was on): building
/// millions of container objects otherwise runs a collection every few hundred allocations,
/// each walking what was built so far (a large share of `torch_actions`' time). Nothing
/// built here forms a cycle, and the GIL is held throughout, so no other code runs meanwhile.
struct GcPaused<'py>(Option<Bound<'py, PyModule>>);

impl<'py> GcPaused<'py> {
    fn new(py: Python<'py>) -> PyResult<Self> {
        let gc = py.import("gc")?;
        if gc.call_method0("isenabled")?.is_truthy()? {
            gc.call_method0("disable")?;
            return Ok(GcPaused(Some(gc)));
        }
        Ok(GcPaused(None))
    }
}

impl Drop for GcPaused<'_> {
    fn drop(&mut self) {
        if let Some(gc) = &self.0 {
            // `gc.enable()` cannot fail.
            let _ = gc.call_method0("enable");
        }
    }
}

/// `instrs` (one rank's stream) as `Instruction`s.
pub fn instructions<'py>(py: Python<'py>, instrs: &[Instr]) -> PyResult<Bound<'py, PyList>> {
    let _gc = GcPaused::new(py)?;
    let out = PyList::empty(py);
    for (i, ins) in instrs.iter().enumerate() {
        out.append(Instruction {
            ins: *ins,
            index: i as u32,
        })?;
    }
    Ok(out)
}

/// `instrs` (one rank's stream) as its steps, cut by [`pipec_ir::ir::steps`].
pub fn rank_steps<'py>(py: Python<'py>, instrs: &[Instr]) -> PyResult<Bound<'py, PyList>> {
    let _gc = GcPaused::new(py)?;
    let waited = waited_batches(instrs);
    let one = |i: usize| {
        Py::new(
            py,
            Instruction {
                ins: instrs[i],
                index: i as u32,
            },
        )
    };
    let out = PyList::empty(py);
    for step in steps(instrs) {
        match step {
            Step::Compute(i) => out.append(ComputeStep {
                instruction: one(i)?,
            })?,
            Step::Batch { id, ops } => {
                let index = ops.start as u32;
                let ops = PyTuple::new(py, ops.map(one).collect::<PyResult<Vec<_>>>()?)?;
                out.append(BatchStep {
                    id,
                    ops: ops.unbind(),
                    in_flight: waited.contains(&id),
                    index,
                })?
            }
            Step::Wait { at, batch } => out.append(WaitStep {
                index: at as u32,
                batch,
            })?,
            Step::Memory(i) => out.append(MemoryStep {
                instruction: one(i)?,
            })?,
        }
    }
    Ok(out)
}

/// torch's actions as Python lists, one list per rank: `[stage, "TYPE", mb or None]`, or
/// `["OVERLAP_F_B", fwd, bwd]`, or `None` for an idle cell (the JSON this returned before).
pub fn torch_cells<'py>(py: Python<'py>, lines: &[Vec<Cell>]) -> PyResult<Bound<'py, PyList>> {
    let _gc = GcPaused::new(py)?;
    let overlap = PyString::intern(py, "OVERLAP_F_B");
    // Action types are few: one string object each.
    let mut names: Vec<(&'static str, Bound<'py, PyString>)> = Vec::new();
    let mut action = |a: &Action| -> PyResult<Bound<'py, PyList>> {
        let n = a.ty.name();
        let name = match names.iter().find(|(k, _)| std::ptr::eq(*k, n)) {
            Some((_, s)) => s.clone(),
            None => {
                let s = PyString::new(py, n);
                names.push((n, s.clone()));
                s
            }
        };
        PyList::new(
            py,
            [
                a.stage.into_bound_py_any(py)?,
                name.into_any(),
                a.mb.into_bound_py_any(py)?,
            ],
        )
    };
    let out = PyList::empty(py);
    for line in lines {
        let row = PyList::empty(py);
        for c in line {
            match c {
                Cell::Empty => row.append(py.None())?,
                Cell::Action(a) => row.append(action(a)?)?,
                Cell::Overlap { fwd, bwd } => row.append(PyList::new(
                    py,
                    [
                        overlap.clone().into_any(),
                        action(fwd)?.into_any(),
                        action(bwd)?.into_any(),
                    ],
                )?)?,
            }
        }
        out.append(row)?;
    }
    Ok(out)
}
