//! `pipec layout`: the expanded stage table.

use super::{print_json, CliError};
use pipec::layout::{self, LayoutError};
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The layout string, e.g. "Et*3|(tt|)*29,m|L".
    pub layout: String,
    /// Pipeline-parallel size.
    #[arg(long)]
    pub pp: u32,
    /// Expected chunks per rank; must equal stages / pp.
    #[arg(long)]
    pub vpp: Option<u32>,
    /// Check the decoder layer count.
    #[arg(long)]
    pub num_layers: Option<u32>,
    /// Check the MTP layer count.
    #[arg(long)]
    pub mtp_num_layers: Option<u32>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
}

/// The layout echoed with a caret under the offending character, then the reason.
pub fn render_error(e: &LayoutError) -> String {
    e.to_string()
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    if a.pp == 0 {
        return Err(CliError::Usage("--pp must be at least 1".into()));
    }
    let l = layout::parse(&a.layout).map_err(|e| CliError::Invalid(render_error(&e)))?;
    let vpp = layout::check_against(&l, a.pp, a.vpp, a.num_layers, a.mtp_num_layers)
        .map_err(|e| CliError::Invalid(render_error(&e)))?;
    if a.json {
        let stages: Vec<_> = l
            .stages
            .iter()
            .enumerate()
            .map(|(i, s)| {
                serde_json::json!({
                    "index": i,
                    "pp_rank": i as u32 % a.pp,
                    "vpp_rank": i as u32 / a.pp,
                    "layers": s,
                })
            })
            .collect();
        print_json(&serde_json::json!({
            "layout": a.layout,
            "pp": a.pp,
            "vpp": vpp,
            "num_stages": l.stages.len(),
            "stages": stages,
        }));
    } else {
        println!(
            "{} stages = pp {} x vpp {vpp}; {} decoder, {} mtp layers",
            l.stages.len(),
            a.pp,
            l.count(layout::LayerKind::Decoder),
            l.count(layout::LayerKind::Mtp),
        );
        println!("{}", l.table(a.pp));
    }
    Ok(ExitCode::SUCCESS)
}
