//! Arguments several commands share: the cost model (`--cost`, `--cost-file`) and the
//! placement of an imported torch CSV (`--placement`).

use super::CliError;
use pipec_compiler::torch::PlacementChoice;
use pipec_cost::cost::CostModel;
use pipec_ir::files::Loaded;
use pipec_schedules::Lengths;
use std::path::PathBuf;

/// `--cost` and `--cost-file`, shared by show, simulate, compare and export.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CostArgs {
    /// Cost model entries, e.g. "f=1,b=1,w=1,p2p=0.05". Keys: f b w (decoder/MTP layer
    /// forward, bwd_D, bwd_W), E.f t.b L.w ... (per layer kind), floor, p2p, msg, bw,
    /// rendezvous, overlap. Defaults: f=b=w=1, E and L free, communication free, rendezvous.
    // `--help` names every key (issue #40: it listed few); `-h` keeps the short line above.
    #[arg(long, value_name = "SPEC", long_help = cost_long_help())]
    pub cost: Option<String>,
    /// A file of cost entries, one `key = value` per line, `#` comments; --cost entries
    /// override it.
    #[arg(long, value_name = "FILE", long_help = cost_file_long_help())]
    pub cost_file: Option<PathBuf>,
}

/// `--cost`'s `--help`: every key the parser takes, from the list its own errors give
/// ([`pipec_cost::cost::KEYS`]), so the two cannot drift apart.
fn cost_long_help() -> String {
    format!(
        "Cost model entries, comma-separated key=value, e.g. \"f=1,b=1,w=1,p2p=0.05\". \
         Keys: {}. f b w: a decoder or MTP layer's forward, bwd_D and bwd_W; K.f K.b K.w per \
         layer kind (E embedding, t decoder, m MTP, L output layer); K.act: a layer's \
         activations of one microbatch, K.act_w: the part of them bwd_W still needs after \
         bwd_D (default K.act), K.param: its parameter and optimizer memory \
         (a number of layer-activations, or bytes: t.act=1.5GiB). Defaults: f=b=w=1, E \
         and L free, communication free, rendezvous. \
         Every key, its unit and default: docs/costs.md",
        pipec_cost::cost::KEYS
    )
}

/// `--cost-file`'s `--help`: the keys of `--cost`, and the `[model]` table.
fn cost_file_long_help() -> String {
    format!(
        "A file of cost entries, one `key = value` per line (the keys of --cost), `#` \
         comments; --cost entries override it. A [model] table (keys {}) derives every \
         layer kind's times and bytes from the model's shape (docs/tune.md, docs/costs.md)",
        pipec_cost::model::MODEL_KEYS.join(", ")
    )
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

    /// Whether a cost model was given for a loaded schedule: the flags, or the model its
    /// manifest records (what [`CostArgs::model_for`] uses then).
    pub fn given_for(&self, loaded: &Loaded) -> bool {
        self.given() || loaded.manifest.cost.is_some()
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

/// `--microbatch-lengths FILE`, shared by compile, tune and compare (issue #38).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LengthsArgs {
    /// A file of microbatch lengths: one line per microbatch, the tokens of the sequences
    /// packed into it separated by spaces or commas (one number: one unpacked sequence). The
    /// number of lines is the number of microbatches; every send and receive then carries
    /// its tokens, and costs and memory follow each microbatch's length.
    #[arg(long, value_name = "FILE")]
    pub microbatch_lengths: Option<PathBuf>,
}

impl LengthsArgs {
    /// The lengths, if given: an unreadable file is I/O (exit 2), a bad line invalid input
    /// (exit 1, naming the file and line).
    pub fn load(&self) -> Result<Option<Lengths>, CliError> {
        let Some(path) = &self.microbatch_lengths else {
            return Ok(None);
        };
        let text = super::read_text("--microbatch-lengths", path)?;
        Lengths::parse(&text)
            .map(Some)
            .map_err(|e| CliError::Invalid(format!("{}: {e}", path.display())))
    }

    /// The microbatch count: `--microbatches`, which must agree with the lengths when both are
    /// given, or the lengths' count.
    pub fn microbatches(
        lengths: Option<&Lengths>,
        flag: Option<u32>,
    ) -> Result<Option<u32>, CliError> {
        match (lengths, flag) {
            (Some(l), Some(m)) if l.microbatches() != m => Err(CliError::Invalid(format!(
                "--microbatches {m} disagrees with --microbatch-lengths, which gives {} microbatches (one line each)",
                l.microbatches()
            ))),
            (Some(l), _) => Ok(Some(l.microbatches())),
            (None, m) => Ok(m),
        }
    }
}

/// `--placement loop|v` of a torch CSV.
pub fn parse_placement(s: &str) -> Result<PlacementChoice, String> {
    s.parse()
}
