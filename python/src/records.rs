//! Typed instruction records for Python: `Instruction` (one record of a rank file, its fields
//! from the one schema, `pipec::back::files::fields_of`) and `Step` (a rank's stream cut by
//! `pipec::ir::steps`: a compute op, a comm batch, a wait), built for one rank at a time.
//!
//! An `Instruction` reads like the JSON record it stands for (`ins["op"]`, `ins.get("batch")`,
//! `dict(ins)`, equality with such a dict), so code written against the records keeps
//! working; its fields are attributes too (`ins.op`, `ins.stage`).

use pipec::back::files::{fields_of, FieldValue};
use pipec::ir::{steps, Instr, Step};
use pyo3::exceptions::{PyAttributeError, PyKeyError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

/// One instruction of a rank's stream: `op` and its fields in file order.
#[pyclass(module = "pipec._native", name = "Instruction", frozen)]
pub struct PyInstruction {
    op: &'static str,
    fields: Vec<(&'static str, FieldValue)>,
}

impl PyInstruction {
    pub fn of(ins: &Instr) -> Self {
        let (op, fields) = fields_of(ins);
        PyInstruction { op, fields }
    }

    fn value(&self, py: Python<'_>, key: &str) -> Option<Py<PyAny>> {
        if key == "op" {
            return Some(PyString::new(py, self.op).into_any().unbind());
        }
        let (_, v) = self.fields.iter().find(|(k, _)| *k == key)?;
        Some(match *v {
            FieldValue::Int(i) => i.into_pyobject(py).ok()?.into_any().unbind(),
            FieldValue::Name(n) => PyString::new(py, n).into_any().unbind(),
        })
    }

    fn dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("op", self.op)?;
        for (k, _) in &self.fields {
            d.set_item(*k, self.value(py, k))?;
        }
        Ok(d)
    }
}

#[pymethods]
impl PyInstruction {
    #[getter]
    fn op(&self) -> &'static str {
        self.op
    }

    /// The record's keys in file order, `op` first.
    fn keys(&self) -> Vec<&'static str> {
        std::iter::once("op")
            .chain(self.fields.iter().map(|(k, _)| *k))
            .collect()
    }

    fn __getitem__(&self, py: Python<'_>, key: &str) -> PyResult<Py<PyAny>> {
        self.value(py, key)
            .ok_or_else(|| PyKeyError::new_err(key.to_string()))
    }

    fn __getattr__(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        self.value(py, name).ok_or_else(|| {
            PyAttributeError::new_err(format!("a `{}` instruction has no field `{name}`", self.op))
        })
    }

    #[pyo3(signature = (key, default=None))]
    fn get(&self, py: Python<'_>, key: &str, default: Option<Py<PyAny>>) -> Option<Py<PyAny>> {
        self.value(py, key).or(default)
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyIterator>> {
        pyo3::types::PyList::new(py, self.keys())?.try_iter()
    }

    fn __contains__(&self, key: &str) -> bool {
        key == "op" || self.fields.iter().any(|(k, _)| *k == key)
    }

    fn __len__(&self) -> usize {
        1 + self.fields.len()
    }

    /// The record as a dict, as `json.loads` of the rank file gives it.
    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.dict(py)
    }

    /// Equal to another instruction with the same record, or to that record as a dict.
    fn __eq__(&self, py: Python<'_>, other: &Bound<'_, PyAny>) -> PyResult<bool> {
        if let Ok(o) = other.cast::<PyInstruction>() {
            let o = o.get();
            return Ok(self.op == o.op && self.fields == o.fields);
        }
        if other.cast::<PyDict>().is_ok() {
            return self.dict(py)?.eq(other);
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        let mut s = format!("Instruction(op={:?}", self.op);
        for (k, v) in &self.fields {
            match v {
                FieldValue::Int(i) => s.push_str(&format!(", {k}={i}")),
                FieldValue::Name(n) => s.push_str(&format!(", {k}={n:?}")),
            }
        }
        s.push(')');
        s
    }
}

/// One unit of a rank's stream, as every runtime executes it: `kind` `"compute"` (one op),
/// `"batch"` (the sends and receives posted together, `batch` their id) or `"wait"` (for the
/// in-flight batch `batch`); `index` is the position of its first instruction in the rank's
/// stream and `ops` its instructions (one for a compute op or a wait).
#[pyclass(module = "pipec._native", name = "Step", frozen, get_all)]
pub struct PyStep {
    kind: &'static str,
    index: usize,
    batch: Option<u32>,
    ops: Vec<Py<PyInstruction>>,
}

#[pymethods]
impl PyStep {
    fn __repr__(&self) -> String {
        match self.batch {
            Some(b) => format!(
                "Step(kind={:?}, index={}, batch={b}, ops={})",
                self.kind,
                self.index,
                self.ops.len()
            ),
            None => format!("Step(kind={:?}, index={})", self.kind, self.index),
        }
    }
}

/// A rank's stream as instruction records.
pub fn instructions(py: Python<'_>, instrs: &[Instr]) -> PyResult<Vec<Py<PyInstruction>>> {
    instrs
        .iter()
        .map(|i| Py::new(py, PyInstruction::of(i)))
        .collect()
}

/// A rank's stream cut into steps by [`pipec::ir::steps`].
pub fn rank_steps(py: Python<'_>, instrs: &[Instr]) -> PyResult<Vec<PyStep>> {
    let one = |i: usize| Py::new(py, PyInstruction::of(&instrs[i]));
    steps(instrs)
        .map(|s| {
            Ok(match s {
                Step::Compute(i) => PyStep {
                    kind: "compute",
                    index: i,
                    batch: None,
                    ops: vec![one(i)?],
                },
                Step::Wait { at, batch } => PyStep {
                    kind: "wait",
                    index: at,
                    batch: Some(batch),
                    ops: vec![one(at)?],
                },
                Step::Batch { id, ops } => PyStep {
                    kind: "batch",
                    index: ops.start,
                    batch: Some(id),
                    ops: ops.map(one).collect::<PyResult<_>>()?,
                },
            })
        })
        .collect()
}
