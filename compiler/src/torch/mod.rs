//! torch.distributed.pipelining interop: its schedule CSV files, both ways.
//!
//! torch stores a pipeline schedule as CSV, one line per rank, one action per cell
//! (`_PipelineSchedule._dump_csv` / `_load_csv`, torch 2.15). The compute-only form lists each
//! rank's compute actions (`F`, `B`, `I` = pipec's `bwd_D`, `W` = `bwd_W`, and
//! `(f;b)OVERLAP_F_B` = `fwd_bwd`); the compute+comms form, which
//! `_PipelineScheduleRuntime` executes as written, adds the P2P actions and FSDP bookkeeping.
//!
//! - [`export_csv`]`(&program, form)` writes either form (used by `pipec export --format torch-csv`).
//! - [`import_csv`]`(text, &opts)` / [`import_csv_bytes`] read either form into a [`Program`]
//!   (the importer lives in the front end, [`crate::torch::import`])
//!   (used by `pipec import` and `pipec check FILE.csv`); errors are [`CsvError`]s whose
//!   `Display` echoes the line with a caret under the offending cell.
//! - [`action`] is the cell grammar both share.
//!
//! [`Program`]: pipec_ir::ir::Program

pub mod action;
pub mod export;
pub mod import;
pub mod order;

pub use action::{Action, ActionType, Cell, CsvErrorKind};
pub use export::{
    export_cells, export_cells_unverified, export_csv, export_csv_unverified, ExportError,
};
pub use import::{
    import_csv, import_csv_bytes, CsvError, ImportOptions, Imported, PlacementChoice,
    PlacementSource,
};

use std::fmt;

/// The two forms of torch's schedule CSV (`_dump_csv(format=...)`).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum CsvForm {
    /// `format="compute_only"`: compute actions only; torch adds the communication itself.
    ComputeOnly,
    /// `format="compute_comms"`: compute, P2P and bookkeeping actions, executed as written.
    ComputeComms,
}

impl CsvForm {
    /// torch's name of the form.
    pub fn torch_name(self) -> &'static str {
        match self {
            CsvForm::ComputeOnly => "compute_only",
            CsvForm::ComputeComms => "compute_comms",
        }
    }
}

impl fmt::Display for CsvForm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CsvForm::ComputeOnly => "compute-only",
            CsvForm::ComputeComms => "compute+comms",
        })
    }
}

impl std::str::FromStr for CsvForm {
    type Err = String;
    /// Accepts torch's names (`compute_only`, `compute_comms`) and the dashed forms.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "compute_only" | "compute-only" => Ok(CsvForm::ComputeOnly),
            "compute_comms" | "compute-comms" | "compute+comms" => Ok(CsvForm::ComputeComms),
            _ => Err(format!(
                "unknown CSV form `{s}` (expected `compute-only` or `compute-comms`)"
            )),
        }
    }
}
