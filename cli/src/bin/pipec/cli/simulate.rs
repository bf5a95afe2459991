//! `pipec simulate`: makespan, bubble ratio and peak memory per rank under a cost model.
//! Also home of the cost-model arguments the other viewing commands share.

use super::{print_json, CliError};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{simulate_unverified, SimError, Simulation};
use pipec_cost::timeline::TimeUnit;
use pipec_ir::files::Loaded;
use pipec_ir::verify::Unverified;
use std::path::PathBuf;
use std::process::ExitCode;

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

/// A one-line name for a loaded schedule: `1f1b pp=4 vpp=1 microbatches=8`.
pub fn title(l: &Loaded) -> String {
    pipec_compiler::view::report::schedule_title(
        l.manifest.schedule.as_ref(),
        &l.manifest.source,
        &l.program,
    )
}

/// Simulate a loaded directory. A deadlock or a bad id is the input being invalid (exit 1).
/// The viewers load without verifying (`pipec check` is the judge): the simulator shows what
/// the program does, deadlock included.
pub fn run_sim(loaded: &Loaded, model: &CostModel) -> Result<Simulation, SimError> {
    let costs = StageCosts::new(model, &loaded.manifest.layout, loaded.program.num_stages());
    if !costs.layout_used {
        eprintln!(
            "note: the layout has {} stages but the program {}; costing every stage as one decoder layer",
            loaded.manifest.layout.stages.len(),
            loaded.program.num_stages()
        );
    }
    simulate_unverified(&Unverified::unchecked(&loaded.program), &costs)
}

/// Wording of a simulation failure at the CLI edge.
pub fn sim_error(e: SimError) -> CliError {
    CliError::Invalid(e.to_string())
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A compiled schedule directory or a torch CSV schedule.
    pub input: PathBuf,
    /// Pipeline-parallel size of a torch CSV schedule (CSV input only, as for `check`).
    #[arg(long)]
    pub pp: Option<u32>,
    /// Stage placement of a torch CSV schedule (CSV input only, as for `check`).
    #[arg(long, value_parser = super::import::parse_placement)]
    pub placement: Option<pipec_compiler::torch::PlacementChoice>,
    #[command(flatten)]
    pub cost: CostArgs,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let loaded = super::load_any(&a.input, a.pp, a.placement)?;
    // The manifest's cost model (tune's) unless --cost / --cost-file is given.
    let model = a.cost.model_for(&loaded)?;
    let name = title(&loaded);
    let result = run_sim(&loaded, &model);
    if a.json {
        if let Some(mut v) =
            pipec_compiler::view::report::json_report(&name, &loaded.program, &model, &result)
        {
            // Only when there is one: the JSON stays what Python's `Schedule.simulate` returns.
            if let (Some(o), Some(c)) = (v.as_object_mut(), loaded.manifest.caveat()) {
                o.insert("caveat".into(), c.into());
            }
            print_json(&v);
            return Ok(if result.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            });
        }
    }
    match result {
        Ok(sim) => {
            println!("{name}");
            if let Some(c) = loaded.manifest.caveat() {
                println!("note: {c}");
            }
            println!("cost: {}", model.describe());
            print!(
                "{}",
                pipec_compiler::view::timeline_text::render_summary(&sim.summary, TimeUnit::Cost)
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Err(sim_error(e)),
    }
}
