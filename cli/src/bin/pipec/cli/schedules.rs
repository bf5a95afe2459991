//! `pipec schedules`: the kinds and their parameters.

use super::{print_json, CliError};
use pipec_schedules::ScheduleKind;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    let infos: Vec<_> = ScheduleKind::ALL.iter().map(|k| k.info()).collect();
    if a.json {
        let v: Vec<_> = infos
            .iter()
            .map(|i| {
                serde_json::json!({
                    "kind": i.kind.name(),
                    "summary": i.summary,
                    "parameters": i.params,
                    "source": i.source,
                })
            })
            .collect();
        print_json(&v);
    } else {
        let w = infos.iter().map(|i| i.kind.name().len()).max().unwrap_or(0);
        for i in &infos {
            println!("{:w$}  {}", i.kind.name(), i.summary);
            println!("{:w$}  parameters: {}", "", i.params);
            println!("{:w$}  source: {}", "", i.source);
        }
        println!();
        println!("Every kind also takes --forward-only (inference: forwards only).");
    }
    Ok(ExitCode::SUCCESS)
}
