//! `pipec layout`: the expanded stage table.

use super::{print_json, CliError};
use pipec_schedules::layout::{self, LayoutError, LayoutErrorKind};
use std::path::Path;
use std::process::ExitCode;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The layout string, e.g. "Et*3|(tt|)*29,m|L".
    #[arg(
        required_unless_present = "layout_file",
        conflicts_with = "layout_file"
    )]
    pub layout: Option<String>,
    /// Read the layout string from a file (one trailing newline is ignored).
    #[arg(long, value_name = "FILE")]
    pub layout_file: Option<std::path::PathBuf>,
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

/// Read a layout string from a file, as people keep them in config files. The bytes must be
/// UTF-8 (reported with the byte offset of the first bad byte, exit 1); one trailing newline
/// (`\n` or `\r\n`) is dropped, anything else is the layout. A file that cannot be read is an
/// I/O error (exit 2).
pub fn read_layout_file(path: &Path) -> Result<String, CliError> {
    let mut text = super::read_text("--layout-file", path)?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    Ok(text)
}

/// The layout echoed with a caret under the offending character, then the reason.
pub fn render_error(e: &LayoutError) -> String {
    // The library names the parameter; the edge names the flag that sets it.
    let flag = match e.kind {
        LayoutErrorKind::VppConflict { .. } => " (--vpp)",
        LayoutErrorKind::DecoderCount { .. } => " (--num-layers)",
        LayoutErrorKind::MtpCount { .. } => " (--mtp-num-layers)",
        _ => "",
    };
    format!("{e}{flag}")
}

pub fn run(a: Args) -> Result<ExitCode, CliError> {
    if a.pp == 0 {
        // The same words and exit code as `compile --pp 0`: the value is invalid input.
        return Err(CliError::Invalid(
            pipec_schedules::SpecError::ZeroPp.to_string(),
        ));
    }
    let text = match (&a.layout, &a.layout_file) {
        (_, Some(path)) => read_layout_file(path)?,
        (Some(text), None) => text.clone(),
        (None, None) => return Err(CliError::Usage("give a layout or --layout-file".into())),
    };
    let l = layout::parse(&text).map_err(|e| CliError::Invalid(render_error(&e)))?;
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
            "layout": text,
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
