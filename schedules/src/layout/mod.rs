//! The model layout: which layers each virtual stage holds.
//!
//! Front end for Megatron-LM's `--pipeline-model-parallel-layout` strings
//! (`megatron/core/transformer/pipeline_parallel_layer_layout.py`). The grammar and where it
//! departs from Megatron's textual expansion are in the `parse` module's docs and in
//! docs/layout.md.
//!
//! Three steps: [`expand`] parses (nom) and expands with size bounds; [`parse`] also checks
//! the rules that do not depend on the pipeline; [`check_against`] checks a layout against
//! `pp` / `vpp` / layer counts and returns vpp. Stage `i` runs on pp rank `i % pp` as
//! virtual stage `i / pp`, as in Megatron.

mod error;
mod expand;
mod parse;
mod table;
mod validate;

pub use error::{LayoutError, LayoutErrorKind};
pub use expand::{MAX_LAYERS, MAX_STAGES};
pub use parse::{MAX_DEPTH, MAX_TEXT_BYTES};
pub use validate::check_against;

/// Parse and expand a layout string, without the structural rules (E first, L last, ...).
/// Useful to see what a string means; [`parse`] is what a compile should use.
pub fn expand(text: &str) -> Result<Layout, LayoutError> {
    let e = expand::expansion(text)?;
    Ok(Layout {
        text: Some(text.to_string()),
        stages: e.stages,
    })
}

/// Parse, expand and check the rules that do not depend on the pipeline size: `E` exactly
/// once and first, `L` exactly once and last (empty stages aside), decoder layers before MTP
/// layers, all MTP layers in one stage. Errors carry the position of the offending character.
pub fn parse(text: &str) -> Result<Layout, LayoutError> {
    let e = expand::expansion(text)?;
    if let Err(v) = validate::check_structure(&e.stages) {
        return Err(validate::Located::from_expansion(text, e.origins).error(v));
    }
    Ok(Layout {
        text: Some(text.to_string()),
        stages: e.stages,
    })
}

use serde::{Deserialize, Serialize};
use std::fmt;

/// A layer symbol of the layout language.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LayerKind {
    /// `E`: the embedding.
    #[serde(rename = "E")]
    Embedding,
    /// `t`: a transformer decoder layer.
    #[serde(rename = "t")]
    Decoder,
    /// `m`: a multi-token-prediction layer.
    #[serde(rename = "m")]
    Mtp,
    /// `L`: the loss (output head).
    #[serde(rename = "L")]
    Loss,
}

impl LayerKind {
    pub fn symbol(self) -> char {
        match self {
            LayerKind::Embedding => 'E',
            LayerKind::Decoder => 't',
            LayerKind::Mtp => 'm',
            LayerKind::Loss => 'L',
        }
    }

    pub fn from_symbol(c: char) -> Option<Self> {
        Some(match c {
            'E' => LayerKind::Embedding,
            't' => LayerKind::Decoder,
            'm' => LayerKind::Mtp,
            'L' => LayerKind::Loss,
            _ => return None,
        })
    }

    /// Megatron's word for the layer, as in its layout table.
    pub fn word(self) -> &'static str {
        match self {
            LayerKind::Embedding => "embedding",
            LayerKind::Decoder => "decoder",
            LayerKind::Mtp => "mtp",
            LayerKind::Loss => "loss",
        }
    }
}

/// Stages in model order, each a list of layers (possibly empty).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    /// The string the user wrote, when there was one.
    pub text: Option<String>,
    pub stages: Vec<Vec<LayerKind>>,
}

impl Layout {
    /// The layout pipec uses without `--layout`: one `t` per stage, `E` first, `L` last.
    pub fn uniform(num_stages: u32) -> Self {
        let n = num_stages as usize;
        let stages = (0..n)
            .map(|i| {
                let mut st = Vec::with_capacity(3);
                if i == 0 {
                    st.push(LayerKind::Embedding);
                }
                st.push(LayerKind::Decoder);
                if i + 1 == n {
                    st.push(LayerKind::Loss);
                }
                st
            })
            .collect();
        Layout { text: None, stages }
    }

    pub fn num_stages(&self) -> u32 {
        self.stages.len() as u32
    }

    /// Count of layers of one kind.
    pub fn count(&self, kind: LayerKind) -> usize {
        self.stages.iter().flatten().filter(|&&l| l == kind).count()
    }

    /// The expanded form, `Ettt|tt|...`, as Megatron prints it.
    pub fn expanded(&self) -> String {
        let parts: Vec<String> = self
            .stages
            .iter()
            .map(|s| s.iter().map(|l| l.symbol()).collect())
            .collect();
        parts.join("|")
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.expanded())
    }
}
