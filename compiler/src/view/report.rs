//! What a simulation reports, as `pipec simulate` prints it and `pipec.Schedule.simulate()`
//! returns it: the schedule's one-line title and the JSON document. Presentation only: the
//! figures are [`pipec_cost::simulate`]'s.

use pipec_cost::cost::CostModel;
use pipec_cost::simulate::{SimError, Simulation, BUBBLE};
use pipec_ir::ir::Program;

/// A one-line name for a schedule, as `pipec simulate` prints it: `1f1b pp=4 vpp=1
/// microbatches=8`, or for an import `torch-csv schedule, 2 ranks, 4 stages, microbatches=2`;
/// a plan tune named in the manifest (`plan`) in place of `tuned schedule`.
pub fn schedule_title(
    spec: Option<&pipec_schedules::ScheduleSpec>,
    source: &str,
    plan: Option<&str>,
    program: &Program,
) -> String {
    let title = match spec {
        Some(s) => s.label(),
        None => format!(
            "{}, {}, {}, microbatches={}",
            // A built-in kind tune fitted with levers is named by its kind, not "tuned".
            plan.map_or_else(|| format!("{source} schedule"), str::to_string),
            pipec_ir::human::count(program.world(), "rank"),
            pipec_ir::human::count(program.num_stages(), "stage"),
            program.microbatches
        ),
    };
    match &program.lengths {
        Some(l) => format!("{title}, {}", l.summary()),
        None => title,
    }
}

/// What `pipec simulate --json` prints (and `pipec.Schedule.simulate()` returns) for a
/// simulation of `program` named `name` under `model`; `None` for errors other than a
/// deadlock, which the caller reports.
pub fn json_report(
    name: &str,
    program: &Program,
    model: &CostModel,
    result: &Result<Simulation, SimError>,
) -> Option<serde_json::Value> {
    match result {
        Ok(sim) => {
            let s = &sim.summary;
            let mut v = serde_json::json!({
                "schedule": name,
                "unit": "cost",
                "makespan": s.makespan,
                "mean_bubble_ratio": s.mean_bubble(),
                "bubble": BUBBLE,
                "max_bubble_ratio": s.max_bubble(),
                "peak_activations": pipec_cost::rounding::figure(s.peak_activations()),
                "peak_memory": pipec_cost::rounding::figure(s.peak_memory()),
                "memory_unit": s.memory_unit,
                "instructions": program.len(),
                "ranks": s.ranks,
                "cost": model,
            });
            if let Some(l) = &program.lengths {
                v["microbatch_lengths"] = serde_json::json!(l);
            }
            Some(v)
        }
        Err(SimError::Deadlock(d)) => Some(serde_json::json!({
            "schedule": name,
            "deadlock": d,
            "cost": model,
        })),
        Err(_) => None,
    }
}
