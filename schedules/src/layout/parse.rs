//! The layout grammar, parsed with nom into an AST with byte positions.
//!
//! ```text
//! layout := seq
//! seq    := sep* (item sep*)*
//! item   := atom ('*' count)?        -- a group must have the count; `|` must not
//! atom   := 'E' | 't' | 'm' | 'L' | '|' | '(' seq ')'
//! count  := [0-9]+                   -- at least 1
//! sep    := ',' | whitespace         -- cosmetic
//! ```
//!
//! This is the language Megatron-LM accepts (`PipelineParallelLayerLayout.parse_str_to_list`,
//! which deletes commas, expands `(...)*n` then `x*n` with regexes and splits on `|`), read as a
//! grammar instead of as text. Two extensions, both in strings Megatron rejects, so they never
//! change the meaning of one it accepts: parentheses may nest (Megatron copies the inner `(`
//! into its output and then fails on it), and whitespace is a separator like `,`.
//!
//! Where Megatron's textual expansion accepts a string with a surprising meaning, the parser
//! refuses it with a reason instead of guessing: a comma inside a count (`t*1,0` is `t*10`
//! there), a separator between an item and its `*`, `|*n`, a repeat of a repeat (`(tt)*2*2`
//! is 5 layers there), and counts of 0 (which delete the item before `*0`).

use super::error::{LayoutError, LayoutErrorKind as K};
use super::LayerKind;
use nom::bytes::complete::take_while;
use nom::character::complete::{char, digit1, one_of};
use nom::combinator::{map, opt};
use nom::multi::many0;
use nom::sequence::preceded;
use nom::{IResult, Parser};

/// Longest layout text accepted, in bytes.
pub const MAX_TEXT_BYTES: usize = 1 << 20;
/// Deepest nesting of parentheses accepted (bounds the parser's recursion).
pub const MAX_DEPTH: u32 = 32;

/// One item of a sequence: an atom and its optional repeat.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Item {
    pub atom: Atom,
    /// Byte offset of the atom's first character (the symbol, `|` or `(`).
    pub pos: u32,
    /// `*n`: the count (saturated at `u32::MAX`) and the byte offset of its first digit.
    pub repeat: Option<(u32, u32)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Atom {
    Layer(LayerKind),
    Bar,
    Group(Vec<Item>),
}

/// A parse failure located by the input that remained when it happened.
#[derive(Debug)]
struct PErr<'a> {
    at: &'a str,
    kind: Option<K>,
}

impl<'a> nom::error::ParseError<&'a str> for PErr<'a> {
    fn from_error_kind(at: &'a str, _: nom::error::ErrorKind) -> Self {
        PErr { at, kind: None }
    }
    fn append(_: &'a str, _: nom::error::ErrorKind, other: Self) -> Self {
        other
    }
}

type PResult<'a, O> = IResult<&'a str, O, PErr<'a>>;

/// Commit to an error: no alternative is tried after it.
fn fail<'a, O>(at: &'a str, kind: K) -> PResult<'a, O> {
    Err(nom::Err::Failure(PErr {
        at,
        kind: Some(kind),
    }))
}

/// Byte offset of `rest` within `full`.
fn offset(full: &str, rest: &str) -> u32 {
    (full.len() - rest.len()) as u32
}

fn is_sep(c: char) -> bool {
    c == ',' || c.is_whitespace()
}

fn separators(i: &str) -> PResult<'_, &str> {
    take_while(is_sep)(i)
}

fn layer(i: &str) -> PResult<'_, Atom> {
    map(one_of("EtmL"), |c| {
        Atom::Layer(LayerKind::from_symbol(c).expect("one_of filtered"))
    })
    .parse(i)
}

fn bar(i: &str) -> PResult<'_, Atom> {
    map(char('|'), |_| Atom::Bar).parse(i)
}

/// ASCII digits, saturated at `u32::MAX` (the size bound refuses such counts later).
fn count(i: &str) -> PResult<'_, u32> {
    match digit1::<_, PErr>(i) {
        Ok((rest, digits)) => {
            let n = digits.bytes().fold(0u32, |n, d| {
                n.saturating_mul(10).saturating_add(u32::from(d - b'0'))
            });
            if n == 0 {
                return fail(i, K::ZeroCount);
            }
            Ok((rest, n))
        }
        Err(_) => match i.chars().next() {
            Some(c) if c.is_numeric() => fail(i, K::NonAsciiDigit(c)),
            _ => fail(i, K::MissingCount),
        },
    }
}

/// `( seq )`; the repeat is checked by [`item`].
fn group<'a>(full: &'a str, depth: u32) -> impl Fn(&'a str) -> PResult<'a, Atom> {
    move |i| {
        let (inner, _) = char('(').parse(i)?;
        if depth >= MAX_DEPTH {
            return fail(i, K::TooDeep { max: MAX_DEPTH });
        }
        let (rest, items) = seq(inner, full, depth + 1)?;
        if rest.is_empty() {
            return fail(i, K::UnclosedGroup);
        }
        if items.is_empty() {
            return fail(i, K::EmptyGroup);
        }
        let (rest, _) = char(')').parse(rest)?;
        Ok((rest, Atom::Group(items)))
    }
}

/// An atom, or a committed error naming what stands where an atom was expected. Plain
/// (backtracking) errors are left for `)` and the end of input, which end a sequence.
fn atom<'a>(i: &'a str, full: &'a str, depth: u32) -> PResult<'a, Atom> {
    match layer(i).or_else(|_| bar(i)) {
        Ok(r) => return Ok(r),
        Err(_) => match group(full, depth)(i) {
            Err(nom::Err::Error(_)) => {}
            r => return r,
        },
    }
    match i.chars().next() {
        None | Some(')') => Err(nom::Err::Error(PErr { at: i, kind: None })),
        Some('*') => fail(i, K::RepeatWithoutItem),
        Some(c) if c.is_ascii_digit() => fail(i, K::UnexpectedDigit(c)),
        Some(c) => fail(i, K::UnknownSymbol(c)),
    }
}

fn item<'a>(i: &'a str, full: &'a str, depth: u32) -> PResult<'a, Item> {
    let pos = offset(full, i);
    let (after_atom, atom) = atom(i, full, depth)?;
    let (rest, repeat) = opt(preceded(char('*'), |j| {
        let at = offset(full, j);
        count(j).map(|(r, n)| (r, (n, at)))
    }))
    .parse(after_atom)?;
    let (after_sep, sep) = separators(rest)?;
    let next = after_sep.chars().next();
    match (&atom, repeat) {
        (Atom::Bar, Some(_)) => return fail(after_atom, K::RepeatedBar),
        (_, Some(_)) => {
            if next == Some('*') {
                return fail(after_sep, K::RepeatOfRepeat);
            }
            match rest.chars().next() {
                Some(c) if c.is_numeric() => return fail(rest, K::NonAsciiDigit(c)),
                _ => {}
            }
            if let (Some(c), Some(comma)) = (next, sep.find(',')) {
                if c.is_numeric() {
                    return fail(&rest[comma..], K::CommaInCount);
                }
            }
        }
        (_, None) => {
            if next == Some('*') {
                return fail(after_sep, K::SeparatorBeforeStar);
            }
            if let Atom::Group(_) = atom {
                // The `)` is the last byte before `after_atom`.
                let close = &full[full.len() - after_atom.len() - 1..];
                return fail(close, K::UnrepeatedGroup);
            }
        }
    }
    Ok((rest, Item { atom, pos, repeat }))
}

/// Items up to the end of input or a `)` (left for the caller).
fn seq<'a>(i: &'a str, full: &'a str, depth: u32) -> PResult<'a, Vec<Item>> {
    let (i, items) = many0(preceded(separators, |j| item(j, full, depth))).parse(i)?;
    let (i, _) = separators(i)?;
    Ok((i, items))
}

/// Parse the text into items, or the first error with its position.
pub(crate) fn parse_items(text: &str) -> Result<Vec<Item>, LayoutError> {
    if text.len() > MAX_TEXT_BYTES {
        let mut cut = MAX_TEXT_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        return Err(LayoutError::at(
            text,
            cut,
            K::TooLong {
                len: text.len(),
                max: MAX_TEXT_BYTES,
            },
        ));
    }
    match seq(text, text, 0) {
        Ok((rest, items)) => {
            if rest.is_empty() {
                Ok(items)
            } else {
                // `seq` stops only at the end or at a `)`: this one closes nothing.
                Err(LayoutError::at(
                    text,
                    offset(text, rest) as usize,
                    K::UnopenedGroup,
                ))
            }
        }
        Err(nom::Err::Error(e) | nom::Err::Failure(e)) => {
            let pos = offset(text, e.at) as usize;
            let kind = e.kind.unwrap_or_else(|| match e.at.chars().next() {
                Some(c) => K::UnknownSymbol(c),
                None => K::UnclosedGroup,
            });
            Err(LayoutError::at(text, pos, kind))
        }
        Err(nom::Err::Incomplete(_)) => unreachable!("complete parsers never ask for more input"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> (usize, K) {
        let e = parse_items(text).unwrap_err();
        (e.pos.expect("syntax errors have a position"), e.kind)
    }

    #[test]
    fn items_and_positions() {
        let items = parse_items("Et*3|(tt|)*29,m|L").unwrap();
        assert_eq!(items.len(), 7);
        assert_eq!(items[1].pos, 1);
        assert_eq!(items[1].repeat, Some((3, 3)));
        assert_eq!(items[3].pos, 5);
        assert_eq!(items[3].repeat, Some((29, 11)));
        assert_eq!(items[4].pos, 14);
    }

    #[test]
    fn syntax_errors_point_at_the_culprit() {
        assert_eq!(err("EtX|L"), (2, K::UnknownSymbol('X')));
        assert_eq!(err("E(tt|L"), (1, K::UnclosedGroup));
        assert_eq!(err("Et)|L"), (2, K::UnopenedGroup));
        assert_eq!(err("E(tt)L"), (4, K::UnrepeatedGroup));
        assert_eq!(err("E()*2L"), (1, K::EmptyGroup));
        assert_eq!(err("E( , )*2L"), (1, K::EmptyGroup));
        assert_eq!(err("Et*"), (3, K::MissingCount));
        assert_eq!(err("Et*,3"), (3, K::MissingCount));
        assert_eq!(err("*3E"), (0, K::RepeatWithoutItem));
        assert_eq!(err("E(*3t)*2"), (2, K::RepeatWithoutItem));
        assert_eq!(err("Et3L"), (2, K::UnexpectedDigit('3')));
        assert_eq!(err("Et*1,0|L"), (4, K::CommaInCount));
        assert_eq!(err("Et*1 0|L"), (5, K::UnexpectedDigit('0')));
        assert_eq!(err("Et,*3|L"), (3, K::SeparatorBeforeStar));
        assert_eq!(err("E(t),*3|L"), (5, K::SeparatorBeforeStar));
        assert_eq!(err("E|*3tL"), (2, K::RepeatedBar));
        assert_eq!(err("E(tt)*2*2L"), (7, K::RepeatOfRepeat));
        assert_eq!(err("Et*2,*2L"), (5, K::RepeatOfRepeat));
        assert_eq!(err("Et*0L"), (3, K::ZeroCount));
        assert_eq!(err("Et*00L"), (3, K::ZeroCount));
        assert_eq!(err("Et*\u{663}L"), (3, K::NonAsciiDigit('\u{663}')));
        assert_eq!(err("Et*1\u{663}L"), (4, K::NonAsciiDigit('\u{663}')));
        assert_eq!(err("Eé|L"), (1, K::UnknownSymbol('é')));
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = "(".repeat(10_000);
        assert_eq!(err(&deep).1, K::TooDeep { max: MAX_DEPTH });
        let ok = format!("{}t{}", "(".repeat(32), ")*1".repeat(32));
        assert!(parse_items(&ok).is_ok());
        let over = format!("{}t{}", "(".repeat(33), ")*1".repeat(33));
        assert_eq!(err(&over), (32, K::TooDeep { max: MAX_DEPTH }));
    }

    #[test]
    fn huge_counts_saturate() {
        let items = parse_items("t*99999999999").unwrap();
        assert_eq!(items[0].repeat, Some((u32::MAX, 2)));
    }

    #[test]
    fn too_long_is_refused_before_parsing() {
        let text = "t".repeat(MAX_TEXT_BYTES + 1);
        assert!(matches!(err(&text).1, K::TooLong { .. }));
    }
}
