//! `pipec simulate`: makespan, bubble ratio and peak memory per rank under a cost model.

use super::args::CostArgs;
use super::{print_json, CliError};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::{simulate_unverified, SimError, Simulation};
use pipec_cost::timeline::TimeUnit;
use pipec_ir::files::Loaded;
use pipec_ir::verify::Unverified;
use std::path::PathBuf;
use std::process::ExitCode;

/// A one-line name for a loaded schedule: `1f1b pp=4 vpp=1 microbatches=8`.
pub fn title(l: &Loaded) -> String {
    pipec_compiler::view::report::schedule_title(
        l.manifest.schedule.as_ref(),
        &l.manifest.source,
        l.manifest.plan.as_deref(),
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
    #[arg(long, value_parser = super::args::parse_placement)]
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
            println!(
                "cost: {}",
                model.describe_for(loaded.program.lengths.as_ref(), a.cost.given_for(&loaded))
            );
            print!(
                "{}",
                pipec_compiler::view::timeline_text::render_summary(&sim.summary, TimeUnit::Cost)
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => Err(sim_error(e)),
    }
}
