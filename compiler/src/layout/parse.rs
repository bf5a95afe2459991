//! Placeholder until the nom parser lands: accepts only already-expanded layouts.

use super::{LayerKind, Layout};
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LayoutErrorKind {
    UnknownSymbol(char),
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid layout at {pos}")]
pub struct LayoutError {
    pub input: String,
    pub pos: usize,
    pub kind: LayoutErrorKind,
}

pub fn parse(text: &str) -> Result<Layout, LayoutError> {
    let mut stages = vec![Vec::new()];
    for (pos, c) in text.char_indices() {
        if c == '|' {
            stages.push(Vec::new());
        } else {
            let l = LayerKind::from_symbol(c).ok_or(LayoutError {
                input: text.to_string(),
                pos,
                kind: LayoutErrorKind::UnknownSymbol(c),
            })?;
            stages.last_mut().unwrap().push(l);
        }
    }
    Ok(Layout {
        text: Some(text.to_string()),
        stages,
    })
}

/// Check a parsed layout against the pipeline size and return the derived vpp.
pub fn check_against(
    layout: &Layout,
    pp: u32,
    vpp: Option<u32>,
    _num_layers: Option<u32>,
    _mtp_num_layers: Option<u32>,
) -> Result<u32, LayoutError> {
    let n = layout.num_stages();
    let derived = if pp == 0 { 0 } else { n / pp };
    match vpp {
        Some(v) if v != derived => Err(LayoutError {
            input: layout.text.clone().unwrap_or_default(),
            pos: 0,
            kind: LayoutErrorKind::UnknownSymbol('?'),
        }),
        _ => Ok(derived),
    }
}
