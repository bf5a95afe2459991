//! The rules Megatron-LM checks on an expanded layout
//! (`PipelineParallelLayerLayout.__init__` and `validate_layer_layout`), with positions.

use super::error::{LayoutError, LayoutErrorKind as K};
use super::expand::{expansion, Expansion};
use super::{LayerKind, Layout};

/// Where each layer of a layout came from, for error carets: the layout's own text when it
/// expands to these stages, else the expanded form (`Ettt|tt|...`) with positions in it.
pub(crate) struct Located {
    text: String,
    origins: Vec<Vec<u32>>,
}

impl Located {
    pub fn new(layout: &Layout) -> Self {
        if let Some(text) = &layout.text {
            if let Ok(Expansion { stages, origins }) = expansion(text) {
                if stages == layout.stages {
                    return Located {
                        text: text.clone(),
                        origins,
                    };
                }
            }
        }
        let mut pos = 0u32;
        let origins = layout
            .stages
            .iter()
            .map(|s| {
                let o: Vec<u32> = (0..s.len() as u32).map(|j| pos.saturating_add(j)).collect();
                pos = pos.saturating_add(s.len() as u32 + 1);
                o
            })
            .collect();
        Located {
            text: layout.expanded(),
            origins,
        }
    }

    pub(crate) fn from_expansion(text: &str, origins: Vec<Vec<u32>>) -> Self {
        Located {
            text: text.to_string(),
            origins,
        }
    }

    /// The error for a violation, with the caret under the layer it names.
    pub(crate) fn error(&self, v: Violation) -> LayoutError {
        let pos =
            v.at.and_then(|(stage, layer)| self.origins.get(stage)?.get(layer).copied())
                .map(|p| p as usize);
        LayoutError {
            input: self.text.clone(),
            pos,
            kind: v.kind,
        }
    }
}

/// A broken rule and the layer it is about, as (stage, index in stage), when there is one.
/// Turned into a [`LayoutError`] by [`Located::error`] only when it happens.
#[derive(Debug)]
pub(crate) struct Violation {
    at: Option<(usize, usize)>,
    kind: K,
}

fn at(stage: usize, layer: usize, kind: K) -> Violation {
    Violation {
        at: Some((stage, layer)),
        kind,
    }
}

fn whole(kind: K) -> Violation {
    Violation { at: None, kind }
}

/// Every layer with its (stage, index in stage), in model order.
fn layers(stages: &[Vec<LayerKind>]) -> impl Iterator<Item = (usize, usize, LayerKind)> + '_ {
    stages
        .iter()
        .enumerate()
        .flat_map(|(s, st)| st.iter().enumerate().map(move |(j, &k)| (s, j, k)))
}

/// The rules that do not depend on pp: `E` exactly once and first, `L` exactly once and last
/// (empty stages do not count), decoders before MTP layers, all MTP layers in one stage.
pub(crate) fn check_structure(stages: &[Vec<LayerKind>]) -> Result<(), Violation> {
    let Some((fs, fj, first)) = layers(stages).next() else {
        return Err(whole(K::NoLayers));
    };
    if first != LayerKind::Embedding {
        return Err(at(fs, fj, K::FirstNotEmbedding(first)));
    }
    let (ls, lj, last) = layers(stages).last().unwrap_or((fs, fj, first));
    if last != LayerKind::Loss {
        return Err(at(ls, lj, K::LastNotLoss(last)));
    }
    let mut mtp_stage = None;
    for (s, j, k) in layers(stages).skip(1) {
        match k {
            LayerKind::Embedding => return Err(at(s, j, K::DuplicateEmbedding)),
            LayerKind::Loss if (s, j) != (ls, lj) => return Err(at(s, j, K::DuplicateLoss)),
            LayerKind::Decoder if mtp_stage.is_some() => return Err(at(s, j, K::DecoderAfterMtp)),
            LayerKind::Mtp => match mtp_stage {
                None => mtp_stage = Some(s),
                Some(first) if first != s => return Err(at(s, j, K::MtpSplit { first, stage: s })),
                Some(_) => {}
            },
            _ => {}
        }
    }
    Ok(())
}

/// Check a layout against the pipeline and return the derived vpp (stages / pp).
///
/// Runs the structural rules of [`super::parse`] again (a [`Layout`] may be built by hand),
/// then Megatron's pipeline rules: the stage count is a multiple of `pp`; an explicit `vpp`
/// equals stages / pp (the conflict check of Megatron's `TransformerConfig`); MTP layers sit
/// in the last virtual stage of their rank (`validate_layer_layout`); and, when given, the
/// decoder and MTP layer counts match `num_layers` / `mtp_num_layers`.
pub fn check_against(
    layout: &Layout,
    pp: u32,
    vpp: Option<u32>,
    num_layers: Option<u32>,
    mtp_num_layers: Option<u32>,
) -> Result<u32, LayoutError> {
    pipeline_rules(layout, pp, vpp, num_layers, mtp_num_layers)
        .map_err(|v| Located::new(layout).error(v))
}

fn pipeline_rules(
    layout: &Layout,
    pp: u32,
    vpp: Option<u32>,
    num_layers: Option<u32>,
    mtp_num_layers: Option<u32>,
) -> Result<u32, Violation> {
    if pp == 0 {
        return Err(whole(K::ZeroPp));
    }
    check_structure(&layout.stages)?;
    let stages = layout.stages.len();
    let ppu = pp as usize;
    if !stages.is_multiple_of(ppu) {
        return Err(whole(K::NotDivisible { stages, pp }));
    }
    let derived = u32::try_from(stages / ppu).unwrap_or(u32::MAX);
    if let Some(given) = vpp {
        if given != derived {
            return Err(whole(K::VppConflict {
                stages,
                pp,
                derived,
                given,
            }));
        }
    }
    for (s, j, k) in layers(&layout.stages) {
        let vpp_rank = (s / ppu) as u32;
        if k == LayerKind::Mtp && vpp_rank + 1 != derived {
            return Err(at(
                s,
                j,
                K::MtpNotInLastChunk {
                    stage: s,
                    pp_rank: (s % ppu) as u32,
                    vpp_rank,
                    vpp: derived,
                },
            ));
        }
    }
    if let Some(expected) = num_layers {
        let found = layout.count(LayerKind::Decoder);
        if found != expected as usize {
            return Err(whole(K::DecoderCount { found, expected }));
        }
    }
    if let Some(expected) = mtp_num_layers {
        let found = layout.count(LayerKind::Mtp);
        if found != expected as usize {
            return Err(whole(K::MtpCount { found, expected }));
        }
    }
    Ok(derived)
}

#[cfg(test)]
mod tests {
    use super::super::{expand, parse};
    use super::*;

    fn structure(text: &str) -> Result<(), (Option<usize>, K)> {
        parse(text).map(|_| ()).map_err(|e| (e.pos, e.kind))
    }

    fn against(text: &str, pp: u32, vpp: Option<u32>) -> Result<u32, (Option<usize>, K)> {
        let l = expand(text).unwrap();
        check_against(&l, pp, vpp, None, None).map_err(|e| (e.pos, e.kind))
    }

    #[test]
    fn embedding_and_loss() {
        assert_eq!(structure(""), Err((None, K::NoLayers)));
        assert_eq!(structure("||"), Err((None, K::NoLayers)));
        assert_eq!(
            structure("tE|L"),
            Err((Some(0), K::FirstNotEmbedding(LayerKind::Decoder)))
        );
        assert_eq!(
            structure("E|tm"),
            Err((Some(3), K::LastNotLoss(LayerKind::Mtp)))
        );
        assert_eq!(
            structure("Et|Et|t|L"),
            Err((Some(3), K::DuplicateEmbedding))
        );
        assert_eq!(structure("(Et|)*2L"), Err((Some(1), K::DuplicateEmbedding)));
        assert_eq!(structure("EtL|tL"), Err((Some(2), K::DuplicateLoss)));
        // Empty stages around E and L do not count.
        assert_eq!(structure("||E|t||L||"), Ok(()));
        assert_eq!(structure("EL"), Ok(()));
    }

    #[test]
    fn mtp_rules() {
        assert_eq!(structure("Etm|tL"), Err((Some(4), K::DecoderAfterMtp)));
        assert_eq!(
            structure("Et|m|mL"),
            Err((Some(5), K::MtpSplit { first: 1, stage: 2 }))
        );
        assert_eq!(structure("Et|mm|L"), Ok(()));
    }

    #[test]
    fn pipeline_rules() {
        assert_eq!(against("E|t|t|L", 2, None), Ok(2));
        assert_eq!(
            against("E|t|L", 2, None),
            Err((None, K::NotDivisible { stages: 3, pp: 2 }))
        );
        assert_eq!(
            against("E|t|t|L", 2, Some(1)),
            Err((
                None,
                K::VppConflict {
                    stages: 4,
                    pp: 2,
                    derived: 2,
                    given: 1
                }
            ))
        );
        assert_eq!(against("E|t|t|L", 0, None), Err((None, K::ZeroPp)));
        // m in stage 1 = (pp rank 1, vpp rank 0) of vpp 2: not the rank's last chunk.
        assert_eq!(
            against("Et|m|||L|", 3, None),
            Err((
                Some(3),
                K::MtpNotInLastChunk {
                    stage: 1,
                    pp_rank: 1,
                    vpp_rank: 0,
                    vpp: 2
                }
            ))
        );
        assert_eq!(against("Et|t|m|L", 2, None), Ok(2));
    }

    #[test]
    fn counts_when_given() {
        let l = parse("Et*3|(tt|)*29,m|L").unwrap();
        assert_eq!(check_against(&l, 16, Some(2), Some(61), Some(1)), Ok(2));
        let e = check_against(&l, 16, None, Some(60), None).unwrap_err();
        assert_eq!(
            e.kind,
            K::DecoderCount {
                found: 61,
                expected: 60
            }
        );
        let e = check_against(&l, 16, None, None, Some(2)).unwrap_err();
        assert_eq!(
            e.kind,
            K::MtpCount {
                found: 1,
                expected: 2
            }
        );
    }

    #[test]
    fn hand_built_layouts_are_located_in_their_expansion() {
        let l = Layout {
            text: None,
            stages: vec![
                vec![LayerKind::Embedding],
                vec![LayerKind::Embedding, LayerKind::Loss],
            ],
        };
        let e = check_against(&l, 1, None, None, None).unwrap_err();
        assert_eq!((e.input.as_str(), e.pos), ("E|EL", Some(2)));
    }
}
