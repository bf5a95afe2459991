//! What a cost model says about memory: the rule and its figures are the IR crate's
//! ([`pipec_ir::memory`]); this module turns a cost model and a layout into the per-stage
//! weights and per-rank parameters that rule counts with, and reads a memory limit.

use crate::cost::{parse_memory, CostModel};
use pipec_ir::ir::Program;
use pipec_ir::memory::{MemoryModel, Unit};
use pipec_schedules::layout::Layout;
use pipec_schedules::{Placement, Rank, Task};
use thiserror::Error;

/// The unit of a cost model's memory: bytes when some `K.act` / `K.param` has a byte unit.
pub fn unit_of(model: &CostModel) -> Unit {
    if model.memory_bytes {
        Unit::Bytes
    } else {
        Unit::LayerActivations
    }
}

/// `program`'s weights under `model` with the stages of `layout`; a layout whose stage count
/// is not the program's (an imported schedule) counts one `t` per stage, as the simulator
/// costs it ([`crate::cost::StageCosts::new`]). With lengths (`program.lengths`), each
/// microbatch's activations weigh its tokens / `seq` ([`crate::lengths::Scale`]): `K.act`
/// describes a microbatch of `seq` tokens and activations are linear in tokens (Korthikanti
/// et al. 2022 count them per `sbh`). The attention core's scores of a `[model]` without
/// recomputation (`(2e+1) a s^2 b`) are quadratic per document; they are counted linearly
/// too, an upper bound for packed microbatches of short documents whose longest is `seq`
/// (docs/memory.md, "Microbatches of different lengths").
pub fn weights(program: &Program, layout: &Layout, model: &CostModel) -> MemoryModel {
    let n = program.num_stages() as usize;
    let uniform;
    let layout = if layout.stages.len() == n {
        layout
    } else {
        uniform = Layout::uniform(n as u32);
        &uniform
    };
    let (act, sparam) = stage_memory(model, layout);
    let mut param = rank_params(&program.placement, &sparam);
    param.resize(program.world() as usize, 0.0);
    MemoryModel {
        act,
        param,
        unit: unit_of(model),
        mb_scale: crate::lengths::Scale::of_program(model, program).map(|s| s.lin),
        msg: Some(message_size(model)),
        act_w: stage_act_w(model, layout),
    }
}

/// One message's size in the memory unit of `model` ([`unit_of`]): the tensor at a stage
/// boundary, `s b h` elements of the model's dtype (split by tp under sequence parallelism,
/// `s` by cp), when a `[model]` table gives the shape (Korthikanti et al. 2022, the layer input
/// of section 4.1); else `msg`, read in the memory unit (one layer's activations by default,
/// an upper bound: a layer keeps its input and more). With lengths it scales by each
/// microbatch's tokens ([`pipec_ir::memory::MemoryModel::message_size`]). What a buffer plan's
/// slots are sized by (issue #39).
pub fn message_size(model: &CostModel) -> f64 {
    match &model.shape {
        Some(s) => s.boundary_bytes(),
        None => model.msg,
    }
}

/// Per stage, the activation memory kept from `bwd_D` to `bwd_W` (`K.act_w` summed over its
/// layers), when some kind keeps less than its `K.act` ([`CostModel::has_act_w`]); `None`
/// otherwise, every stage keeping all of it (`pipec_ir::ir::activations`). Linear in tokens
/// like `K.act` (the weight GEMMs' inputs are `sbh`-sized), so the lengths' `lin` factor
/// scales it too.
pub fn stage_act_w(model: &CostModel, layout: &Layout) -> Option<Vec<f64>> {
    model.has_act_w().then(|| {
        layout
            .stages
            .iter()
            .map(|st| st.iter().map(|&k| model.layer_memory(k).kept_for_w()).sum())
            .collect()
    })
}

/// Per-stage activation memory and per-stage parameter memory of a layout under a model.
pub fn stage_memory(model: &CostModel, layout: &Layout) -> (Vec<f64>, Vec<f64>) {
    let mut act = Vec::with_capacity(layout.stages.len());
    let mut param = Vec::with_capacity(layout.stages.len());
    for st in &layout.stages {
        act.push(st.iter().map(|&k| model.layer_memory(k).act).sum());
        param.push(st.iter().map(|&k| model.layer_memory(k).param).sum());
    }
    (act, param)
}

/// The ranks that hold a stage's parameters: its rank, and for a bidirectional placement
/// (DualPipe) also the mirrored one.
pub fn holders(placement: &Placement, stage: u32) -> Vec<Rank> {
    let mut v = vec![placement.rank_of(Task::new(stage, 0))];
    if let Some(h) = placement.mirror_from() {
        let r = placement.rank_of(Task::new(stage, h));
        if !v.contains(&r) {
            v.push(r);
        }
    }
    v
}

/// Parameter memory per rank of a placement.
pub fn rank_params(placement: &Placement, stage_param: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; placement.pp as usize];
    for (s, p) in stage_param.iter().enumerate() {
        for r in holders(placement, s as u32) {
            out[r.index()] += p;
        }
    }
    out
}

/// A `--memory-limit` as given: a plain number, or bytes with a unit.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Limit {
    pub value: f64,
    /// It had a byte unit (`80GiB`).
    pub bytes: bool,
}

impl Limit {
    /// A plain number, in the unit of the cost model's memory (bytes or layer-activations).
    pub fn plain(value: f64) -> Limit {
        Limit {
            value,
            bytes: false,
        }
    }

    /// Parse `80GiB`, `300MB`, `12` or `1.5e3` (see [`parse_memory`]).
    pub fn parse(s: &str) -> Result<Limit, String> {
        let t = s.trim();
        if t.starts_with('-') {
            return Err(format!("`{t}` is negative; a memory limit is at least 0"));
        }
        let (value, bytes) = parse_memory(t)?;
        Ok(Limit { value, bytes })
    }

    /// The limit in `unit`: a plain number is taken in the report's unit; bytes against a
    /// model whose memory is not in bytes is an error that says what to add.
    pub fn resolve(self, unit: Unit) -> Result<f64, MemoryError> {
        if self.bytes && unit != Unit::Bytes {
            return Err(MemoryError::BytesWithoutByteCosts {
                limit: Unit::Bytes.fmt(self.value),
            });
        }
        Ok(self.value)
    }

    /// The limit in the unit of `model`'s memory ([`unit_of`]): where a request's limit meets
    /// its cost model, for every caller (`pipec tune`, `pipec import`, `pipec.tune`,
    /// `pipec.compile`, `Schedule.check`), so a byte limit without byte costs is refused alike.
    pub fn resolve_for(self, model: &CostModel) -> Result<f64, MemoryError> {
        self.resolve(unit_of(model))
    }
}

/// The memory rule one program is verified under: the weights a cost model gives its stages
/// and ranks ([`weights`]), and the limit in their unit ([`Limit::resolve_for`]).
#[derive(Clone, Debug)]
pub struct Rule {
    pub memory: MemoryModel,
    pub limit: Option<f64>,
}

/// Why a memory limit cannot be applied.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum MemoryError {
    #[error("the memory limit {limit} is in bytes, but the cost model gives memory in layer-activations (no K.act or K.param with a byte unit): add the bytes one microbatch's activations of a layer keep, e.g. `t.act=1.5GiB` (and `t.param=...` for parameters + optimizer state, `E.act`, `L.act` for the embedding and the loss) to --cost or --cost-file, or give the limit as a plain number of layer-activations")]
    BytesWithoutByteCosts { limit: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_units() {
        let l = Limit::parse("80GiB").unwrap();
        assert!(l.bytes && l.value == 80.0 * (1u64 << 30) as f64);
        assert!(l.resolve(Unit::LayerActivations).is_err());
        assert_eq!(l.resolve(Unit::Bytes).unwrap(), l.value);
        let n = Limit::parse("12").unwrap();
        assert_eq!(n.resolve(Unit::LayerActivations).unwrap(), 12.0);
        assert!(Limit::parse("-3").unwrap_err().contains("negative"));
        // A prefix without `B` (or `iB`) is ambiguous, 7% apart at G: both readings offered.
        for (s, want) in [
            (
                "40G",
                "`40G` has an ambiguous unit: did you mean 40GiB or 40GB?",
            ),
            (
                "1.5m",
                "`1.5m` has an ambiguous unit: did you mean 1.5MiB or 1.5MB?",
            ),
            (
                "8K",
                "`8K` has an ambiguous unit: did you mean 8KiB or 8KB?",
            ),
            (
                "2T",
                "`2T` has an ambiguous unit: did you mean 2TiB or 2TB?",
            ),
            ("40Gi", "`40Gi` is not a memory size: did you mean 40GiB?"),
        ] {
            assert_eq!(Limit::parse(s).unwrap_err(), want);
        }
        // Each suggestion parses, to the binary and the decimal size.
        assert_eq!(Limit::parse("40GiB").unwrap().value, 40.0 * 1024f64.powi(3));
        assert_eq!(Limit::parse("40GB").unwrap().value, 40e9);
        // Against a cost model: bytes only where some `K.act` / `K.param` has a byte unit.
        let units = CostModel::default();
        let bytes = CostModel::parse("t.act=1GiB").unwrap();
        assert_eq!(
            l.resolve_for(&units),
            Err(MemoryError::BytesWithoutByteCosts {
                limit: "80.00GiB".into()
            })
        );
        assert_eq!(l.resolve_for(&bytes).unwrap(), l.value);
        assert_eq!(n.resolve_for(&units).unwrap(), 12.0);
        assert_eq!(
            Unit::LayerActivations.list([4.0, 3.5]),
            "4 3.5 layer-activations"
        );
        assert_eq!(Unit::Bytes.list([1.5 * (1u64 << 30) as f64]), "1.50GiB");
    }
}
