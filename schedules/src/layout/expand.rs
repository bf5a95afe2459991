//! Expansion of the AST into stages, bounded before anything is allocated.
//!
//! The result is the same as Megatron-LM's textual expansion for every string both accept:
//! repeats copy their item, `|` splits stages (see the grammar in [`super::parse`]).

use super::error::{LayoutError, LayoutErrorKind as K};
use super::parse::{Atom, Item};
use super::LayerKind;

/// Most layers a layout may expand to (a text of [`super::MAX_TEXT_BYTES`] symbols fits).
pub const MAX_LAYERS: u64 = 1 << 20;
/// Most stages a layout may expand to (pp * vpp; far beyond any real pipeline).
pub const MAX_STAGES: u64 = 1 << 16;

/// Expanded stages, and for each layer the byte offset of the symbol it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Expansion {
    pub stages: Vec<Vec<LayerKind>>,
    pub origins: Vec<Vec<u32>>,
}

#[derive(Copy, Clone, Default)]
struct Size {
    layers: u64,
    bars: u64,
}

fn bounded(text: &str, s: Size, pos: u32) -> Result<Size, LayoutError> {
    if s.layers > MAX_LAYERS {
        return Err(LayoutError::at(
            text,
            pos as usize,
            K::TooManyLayers { max: MAX_LAYERS },
        ));
    }
    if s.bars + 1 > MAX_STAGES {
        return Err(LayoutError::at(
            text,
            pos as usize,
            K::TooManyStages { max: MAX_STAGES },
        ));
    }
    Ok(s)
}

/// Size of the expansion. Every partial size is at most the total (counts are at least 1), so
/// the first one over a bound is reported, at the count or item that crossed it. No product
/// overflows: a bounded size (< 2^20) times a `u32` count fits in `u64`.
fn size(text: &str, items: &[Item]) -> Result<Size, LayoutError> {
    let mut total = Size::default();
    for it in items {
        let one = match &it.atom {
            Atom::Layer(_) => Size { layers: 1, bars: 0 },
            Atom::Bar => Size { layers: 0, bars: 1 },
            Atom::Group(inner) => size(text, inner)?,
        };
        let s = match it.repeat {
            Some((n, at)) => bounded(
                text,
                Size {
                    layers: one.layers * u64::from(n),
                    bars: one.bars * u64::from(n),
                },
                at,
            )?,
            None => one,
        };
        total = bounded(
            text,
            Size {
                layers: total.layers + s.layers,
                bars: total.bars + s.bars,
            },
            it.pos,
        )?;
    }
    Ok(total)
}

fn emit(items: &[Item], out: &mut Expansion) {
    for it in items {
        for _ in 0..it.repeat.map_or(1, |(n, _)| n) {
            match &it.atom {
                Atom::Layer(k) => {
                    // `out` always has a stage: it starts with one and `|` only adds.
                    if let (Some(st), Some(or)) = (out.stages.last_mut(), out.origins.last_mut()) {
                        st.push(*k);
                        or.push(it.pos);
                    }
                }
                Atom::Bar => {
                    out.stages.push(Vec::new());
                    out.origins.push(Vec::new());
                }
                Atom::Group(inner) => emit(inner, out),
            }
        }
    }
}

/// Check the size, then expand.
pub(crate) fn expand_items(text: &str, items: &[Item]) -> Result<Expansion, LayoutError> {
    let s = size(text, items)?;
    let n = (s.bars + 1) as usize;
    let mut out = Expansion {
        stages: Vec::with_capacity(n),
        origins: Vec::with_capacity(n),
    };
    out.stages.push(Vec::new());
    out.origins.push(Vec::new());
    emit(items, &mut out);
    Ok(out)
}

/// Parse and expand, keeping origins.
pub(crate) fn expansion(text: &str) -> Result<Expansion, LayoutError> {
    let items = super::parse::parse_items(text)?;
    expand_items(text, &items)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stages(text: &str) -> String {
        let e = expansion(text).unwrap();
        let parts: Vec<String> = e
            .stages
            .iter()
            .map(|s| s.iter().map(|l| l.symbol()).collect())
            .collect();
        parts.join("|")
    }

    #[test]
    fn megatron_docstring_examples() {
        // The examples in the comments of Megatron's `parse_str_to_list`.
        assert_eq!(stages("Et(tt|tt|tt)*2,tL"), "Ettt|tt|tttt|tt|tttL");
        assert_eq!(stages("(tt)*3"), "tttttt");
        assert_eq!(stages("tt,(tt|)*2"), "tttt|tt|");
        assert_eq!(stages("(|tt)*2,tt"), "|tt|tttt");
    }

    #[test]
    fn nesting_multiplies() {
        assert_eq!(stages("((t|)*2m)*2"), "t|t|mt|t|m");
        assert_eq!(stages("(t*2)*3"), "tttttt");
    }

    #[test]
    fn origins_point_at_symbols() {
        let e = expansion("E(t|)*2L").unwrap();
        assert_eq!(e.origins, vec![vec![0, 2], vec![2], vec![7]]);
    }

    #[test]
    fn size_is_bounded_before_allocating() {
        let e = expansion("Et*99999999999|L").unwrap_err();
        assert_eq!(
            (e.pos, e.kind),
            (Some(3), K::TooManyLayers { max: MAX_LAYERS })
        );
        let e = expansion("((t)*1024)*1025").unwrap_err();
        assert_eq!(e.pos, Some(11));
        let e = expansion("(|)*70000").unwrap_err();
        assert_eq!(
            (e.pos, e.kind),
            (Some(4), K::TooManyStages { max: MAX_STAGES })
        );
        // Exactly at the bounds is fine.
        let e = expansion("t*1048576").unwrap();
        assert_eq!(e.stages[0].len(), 1 << 20);
        let e = expansion("(|)*65535").unwrap();
        assert_eq!(e.stages.len(), 1 << 16);
        // A sum crossing the bound points at the item that crossed it.
        let e = expansion("t*1048576,t").unwrap_err();
        assert_eq!(e.pos, Some(10));
    }
}
