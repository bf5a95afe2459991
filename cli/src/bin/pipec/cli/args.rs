//! Arguments several commands share: the cost model (`--cost`, `--cost-file`) and the
//! placement of an imported torch CSV (`--placement`).

use super::CliError;
use pipec_compiler::torch::PlacementChoice;
use pipec_cost::cost::CostModel;
use pipec_ir::files::Loaded;
use std::path::PathBuf;

/// `--cost` and `--cost-file`, shared by show, simulate, compare and export.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CostArgs {
    /// Cost model entries, e.g. "f=1,b=1,w=1,p2p=0.05". Keys: f b w (decoder/MTP layer
    /// forward, bwd_D, bwd_W), E.f t.b L.w ... (per layer kind), floor, p2p, msg, bw,
    /// rendezvous, overlap. Defaults: f=b=w=1, E and L free, communication free, rendezvous.
    #[arg(long, value_name = "SPEC")]
    pub cost: Option<String>,
    /// A file of cost entries, one `key = value` per line, `#` comments; --cost entries
    /// override it.
    #[arg(long, value_name = "FILE")]
    pub cost_file: Option<PathBuf>,
}

impl CostArgs {
    /// The model: defaults, then the file, then the inline entries. A bad entry is invalid
    /// input (exit 1, with a caret); an unreadable file is I/O (exit 2).
    pub fn model(&self) -> Result<CostModel, CliError> {
        let mut m = CostModel::default();
        if let Some(path) = &self.cost_file {
            let text = super::read_text("--cost-file", path)?;
            let name = path.display().to_string();
            m.apply(&text, Some(&name))
                .map_err(|e| CliError::Invalid(e.render()))?;
        }
        if let Some(spec) = &self.cost {
            // Applied after the file, so inline entries win over the file's.
            m.apply(spec, None)
                .map_err(|e| CliError::Invalid(e.render()))?;
        }
        Ok(m)
    }

    /// Whether `--cost` or `--cost-file` was given.
    pub fn given(&self) -> bool {
        self.cost.is_some() || self.cost_file.is_some()
    }

    /// The model for a loaded schedule: the flags when given, else the cost model its
    /// manifest records (the one `pipec tune` planned it with), else the defaults.
    pub fn model_for(&self, loaded: &Loaded) -> Result<CostModel, CliError> {
        match (&loaded.manifest.cost, self.given()) {
            (Some(spec), false) => CostModel::parse(spec).map_err(|e| {
                CliError::Invalid(format!("the manifest's cost model: {}", e.render()))
            }),
            _ => self.model(),
        }
    }
}

/// `--placement loop|v` of a torch CSV.
pub fn parse_placement(s: &str) -> Result<PlacementChoice, String> {
    s.parse()
}
