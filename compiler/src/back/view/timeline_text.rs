//! The terminal timeline: one row per rank, ops drawn to scale, readable with and without
//! colour.
//!
//! Each op is a run of columns that starts with its label (`F5`: forward of microbatch 5;
//! `B`, `I` (bwd_D), `W` (bwd_W), `X5/2` for an overlapped pair) and is filled with `-`
//! (without colour) or its background colour; idle time is `.`. Odd model chunks are written
//! in lowercase (and, with colour, in the bright shade) so interleaving is visible.

use super::{chunk_of, chunks, fmt_num, nice_step, op_label, OpKind};
use crate::ir::{Instr, Program};
use crate::simulate::timeline::{TimeUnit, Timeline};
use crate::simulate::Summary;
use std::fmt::Write as _;

/// How to draw.
#[derive(Clone, Debug)]
pub struct TextOptions {
    /// Total width in columns, labels included.
    pub width: usize,
    /// ANSI colours.
    pub color: bool,
    /// Ranks to draw, in this order; every rank when `None`. Ranks out of range are skipped
    /// (the CLI refuses them first).
    pub ranks: Option<Vec<usize>>,
    /// Start of the drawn window, in the timeline's unit from its origin; 0 when `None`.
    pub from: Option<f64>,
    /// End of the drawn window; the makespan when `None`.
    pub to: Option<f64>,
}

impl Default for TextOptions {
    fn default() -> Self {
        TextOptions {
            width: 100,
            color: false,
            ranks: None,
            from: None,
            to: None,
        }
    }
}

/// A column is drawn as one kind when that kind fills at least this share of its busy time;
/// below it the column is "mixed" (`+`), so a column never claims one op while holding others.
pub const DOMINANT_SHARE: f64 = 0.75;

/// What one column of one rank shows. Columns summarise their whole time span, so a narrow
/// picture of a regular schedule cannot alias into a false pattern.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Cell {
    /// Busy less than half the column.
    Idle,
    /// Only this instruction runs in the column (and fills at least half of it).
    Op(usize),
    /// Several ops, one kind filling at least [`DOMINANT_SHARE`] of the busy time; `odd` when
    /// most of that kind's time is on odd model chunks.
    Kind { kind: OpKind, odd: bool },
    /// Several kinds, none dominant.
    Mixed,
}

/// The window drawn and its scale: `(from, to, columns per time unit, columns used)`, times
/// from the timeline's origin; a scale below 1 is `1 / n` for a whole `n`. Column `c` covers `[from + c/scale, from + (c+1)/scale)`.
pub fn geometry(
    program: &Program,
    timeline: &Timeline,
    opts: &TextOptions,
) -> (f64, f64, f64, usize) {
    let label_w = label_width(program);
    let cols = opts.width.saturating_sub(label_w + 3).max(10);
    let makespan = (timeline.makespan() - origin(timeline)).max(0.0);
    let from = opts.from.unwrap_or(0.0).clamp(0.0, makespan);
    let to = opts.to.unwrap_or(makespan).clamp(from, makespan);
    let span = to - from;
    // Whole columns per time unit when the window fits, else whole time units per column:
    // either way integral op costs land on column edges, so equal ops get equal widths.
    let scale = if span <= 0.0 {
        0.0
    } else if span <= cols as f64 {
        (cols as f64 / span).floor()
    } else {
        1.0 / (span / cols as f64).ceil()
    };
    let used = ((span * scale).round() as usize).min(cols);
    (from, to, scale, used)
}

fn label_width(program: &Program) -> usize {
    format!("rank {}", program.ranks.len().saturating_sub(1)).len()
}

/// The cells of one rank: what each column of the window holds.
pub fn cells(
    program: &Program,
    timeline: &Timeline,
    rank: usize,
    from: f64,
    scale: f64,
    used: usize,
) -> Vec<Cell> {
    let Some(instrs) = program.ranks.get(rank) else {
        return vec![Cell::Idle; used];
    };
    if used == 0 || scale <= 0.0 {
        return Vec::new();
    }
    let t0 = origin(timeline);
    let chunk = chunks(program);
    let spans = timeline.ranks.get(rank).map_or(&[][..], |v| v.as_slice());
    let u = 1.0 / scale;
    let mut busy = vec![0.0f64; used];
    let mut by_kind = vec![[0.0f64; 5]; used];
    let mut odd_by_kind = vec![[0.0f64; 5]; used];
    // The one op seen in a column, or usize::MAX once a second one shows up.
    let mut sole: Vec<Option<usize>> = vec![None; used];
    for (i, (ins, span)) in instrs.iter().zip(spans).enumerate() {
        let Instr::Compute(op) = ins else { continue };
        if !(span.start.is_finite() && span.end.is_finite()) {
            continue;
        }
        let (s, e) = (span.start - t0 - from, span.end - t0 - from);
        if e <= 0.0 || s >= used as f64 * u {
            continue;
        }
        let kind = OpKind::of(op) as usize;
        let odd = chunk_of(op, &chunk) % 2 == 1;
        let c0 = ((s * scale).floor().max(0.0) as usize).min(used - 1);
        let c1 = ((e * scale).ceil().max(0.0) as usize).min(used);
        for c in c0..c1 {
            let (a, b) = (c as f64 * u, (c + 1) as f64 * u);
            let o = e.min(b) - s.max(a);
            if o <= 0.0 {
                continue;
            }
            busy[c] += o;
            by_kind[c][kind] += o;
            if odd {
                odd_by_kind[c][kind] += o;
            }
            sole[c] = match sole[c] {
                None => Some(i),
                Some(j) if j == i => Some(i),
                Some(_) => Some(usize::MAX),
            };
        }
    }
    (0..used)
        .map(|c| {
            if busy[c] * 2.0 < u {
                return Cell::Idle;
            }
            if let Some(i) = sole[c].filter(|&i| i != usize::MAX) {
                return Cell::Op(i);
            }
            let mut d = 0;
            for k in 1..5 {
                if by_kind[c][k] > by_kind[c][d] {
                    d = k;
                }
            }
            if by_kind[c][d] >= DOMINANT_SHARE * busy[c] {
                Cell::Kind {
                    kind: OpKind::ALL[d],
                    odd: odd_by_kind[c][d] * 2.0 > by_kind[c][d],
                }
            } else {
                Cell::Mixed
            }
        })
        .collect()
}

const RESET: &str = "\x1b[0m";
const DIM: &str = "\x1b[2m";

/// Background and foreground SGR codes of a kind; `bright` for odd chunks.
fn sgr(kind: OpKind, bright: bool) -> String {
    let (bg, fg) = match (kind, bright) {
        (OpKind::Fwd, false) => (44, 97),
        (OpKind::Fwd, true) => (104, 30),
        (OpKind::Bwd, false) => (42, 30),
        (OpKind::Bwd, true) => (102, 30),
        (OpKind::BwdD, false) => (43, 30),
        (OpKind::BwdD, true) => (103, 30),
        (OpKind::BwdW, false) => (45, 97),
        (OpKind::BwdW, true) => (105, 30),
        (OpKind::Pair, false) => (46, 30),
        (OpKind::Pair, true) => (106, 30),
    };
    format!("\x1b[{bg};{fg}m")
}

fn unit_word(unit: TimeUnit) -> &'static str {
    match unit {
        TimeUnit::Cost => "cost units",
        TimeUnit::Micros => "µs",
    }
}

/// The earliest start of any span (0 for an empty timeline), so measured clocks start at 0.
pub fn origin(timeline: &Timeline) -> f64 {
    let t0 = timeline
        .ranks
        .iter()
        .flatten()
        .filter(|s| s.start.is_finite())
        .map(|s| s.start)
        .fold(f64::INFINITY, f64::min);
    if t0.is_finite() {
        t0
    } else {
        0.0
    }
}

/// The timeline rows, the time axis and the legend.
pub fn render(program: &Program, timeline: &Timeline, opts: &TextOptions) -> String {
    let world = program.ranks.len();
    let label_w = label_width(program);
    let (from, to, scale, used) = geometry(program, timeline, opts);
    let chunk = chunks(program);
    if used == 0 {
        return format!(
            "(nothing to draw: the makespan is 0 {})\n",
            unit_word(timeline.unit)
        );
    }
    let ranks: Vec<usize> = match &opts.ranks {
        Some(r) => r.iter().copied().filter(|&r| r < world).collect(),
        None => (0..world).collect(),
    };
    let mut kinds_seen = [false; 5];
    let mut odd_chunk_seen = false;
    let mut summarised = false;
    let mut out = String::new();
    for &r in &ranks {
        let instrs = &program.ranks[r];
        let cells = cells(program, timeline, r, from, scale, used);
        let _ = write!(out, "{:>label_w$} │", format!("rank {r}"));
        let mut c = 0;
        while c < used {
            let mut e = c + 1;
            while e < used && cells[e] == cells[c] && matches!(cells[c], Cell::Op(_) | Cell::Idle) {
                e += 1;
            }
            let n = e - c;
            match cells[c] {
                Cell::Idle => {
                    if opts.color {
                        out.push_str(DIM);
                    }
                    out.push_str(&".".repeat(n));
                    if opts.color {
                        out.push_str(RESET);
                    }
                }
                Cell::Mixed => {
                    summarised = true;
                    out.push('+');
                }
                Cell::Kind { kind, odd } => {
                    summarised = true;
                    kinds_seen[kind as usize] = true;
                    odd_chunk_seen |= odd;
                    let letter = if odd {
                        kind.letter().to_ascii_lowercase()
                    } else {
                        kind.letter()
                    };
                    if opts.color {
                        out.push_str(&sgr(kind, odd));
                        out.push(letter);
                        out.push_str(RESET);
                    } else {
                        out.push(letter);
                    }
                }
                Cell::Op(i) => {
                    let op = instrs[i].as_compute().expect("cells hold compute ops");
                    let kind = OpKind::of(op);
                    kinds_seen[kind as usize] = true;
                    let odd = chunk_of(op, &chunk) % 2 == 1;
                    odd_chunk_seen |= odd;
                    let mut label = op_label(op);
                    let mut letter = kind.letter();
                    if odd {
                        label = label.to_lowercase();
                        letter = letter.to_ascii_lowercase();
                    }
                    let fill = if opts.color { ' ' } else { '-' };
                    let text: String = if label.chars().count() <= n {
                        label
                            .chars()
                            .chain(std::iter::repeat(fill))
                            .take(n)
                            .collect()
                    } else {
                        std::iter::once(letter)
                            .chain(std::iter::repeat(fill))
                            .take(n)
                            .collect()
                    };
                    if opts.color {
                        out.push_str(&sgr(kind, odd));
                        out.push_str(&text);
                        out.push_str(RESET);
                    } else {
                        out.push_str(&text);
                    }
                }
            }
            c = e;
        }
        out.push_str("│\n");
    }
    // Axis: ticks on the bottom border, labels under them.
    let step = if scale > 0.0 {
        nice_step(8.0 / scale)
    } else {
        1.0
    };
    let mut border: Vec<char> = vec!['─'; used];
    let mut labels: Vec<char> = vec![' '; used + 8];
    let mut k = 0u64;
    let mut next_free = 0;
    let first = (from / step).ceil() as u64;
    loop {
        let t = (first + k) as f64 * step;
        if t > to + 1e-9 {
            break;
        }
        let col = ((t - from) * scale).round() as usize;
        if col < used {
            border[col] = '┬';
        }
        let text = fmt_num(t);
        if col >= next_free && col + text.len() <= labels.len() {
            for (j, ch) in text.chars().enumerate() {
                labels[col + j] = ch;
            }
            next_free = col + text.len() + 1;
        }
        k += 1;
        if k > 10_000 {
            break;
        }
    }
    let pad = " ".repeat(label_w + 1);
    let _ = writeln!(out, "{pad}└{}┘", border.iter().collect::<String>());
    let label_line: String = labels.iter().collect();
    let _ = writeln!(out, "{pad} {}", label_line.trim_end());
    // Legend.
    let mut legend = Vec::new();
    for kind in OpKind::ALL {
        if !kinds_seen[kind as usize] {
            continue;
        }
        let key = if opts.color {
            format!("{} {} {RESET}", sgr(kind, false), kind.letter())
        } else {
            kind.letter().to_string()
        };
        legend.push(format!("{key} {}", kind.word()));
    }
    let idle = if opts.color {
        format!("{DIM}.{RESET}")
    } else {
        ".".to_string()
    };
    legend.push(format!("{idle} idle"));
    let _ = writeln!(out, "{pad} {}", legend.join("   "));
    let mut notes = String::from("F5 = microbatch 5");
    if kinds_seen[OpKind::Pair as usize] {
        notes.push_str("; X5/2 = forward of 5 with backward of 2");
    }
    let _ = write!(notes, "; time in {}", unit_word(timeline.unit));
    if scale > 0.0 {
        let _ = write!(notes, ", one column = {}", fmt_num(1.0 / scale));
    }
    if odd_chunk_seen {
        notes.push_str(if opts.color {
            "; lowercase, bright = odd model chunk"
        } else {
            "; lowercase = odd model chunk"
        });
    }
    let _ = writeln!(out, "{pad} {notes}");
    if summarised {
        // Its own line, so the legend fits an 80-column terminal.
        let _ = writeln!(
            out,
            "{pad} a lone letter: that kind does 3/4 of the column's work; + mixed"
        );
    }
    out
}

/// The figures under the timeline: makespan, then per rank busy time, bubble and peak
/// activations.
pub fn render_summary(summary: &Summary, unit: TimeUnit) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "makespan {} {}   mean bubble {:.1}%   peak activations {} (worst rank)",
        fmt_num(summary.makespan),
        unit_word(unit),
        summary.mean_bubble() * 100.0,
        summary.peak_activations()
    );
    let _ = writeln!(out, "bubble = {}", crate::simulate::BUBBLE);
    let rows: Vec<[String; 5]> = summary
        .ranks
        .iter()
        .map(|r| {
            [
                r.rank.to_string(),
                fmt_num(r.busy),
                format!("{:.1}%", r.bubble_ratio * 100.0),
                r.peak_activations.to_string(),
                fmt_num(r.peak_at),
            ]
        })
        .collect();
    let head = ["rank", "busy", "bubble", "peak act", "at"];
    let w: Vec<usize> = (0..5)
        .map(|j| {
            rows.iter()
                .map(|r| r[j].len())
                .chain([head[j].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: [&str; 5]| {
        let mut s = String::new();
        for (j, c) in cells.iter().enumerate() {
            let _ = write!(
                s,
                "{}{:>width$}",
                if j > 0 { "  " } else { "" },
                c,
                width = w[j]
            );
        }
        s
    };
    let _ = writeln!(out, "{}", line(head));
    for r in &rows {
        let _ = writeln!(out, "{}", line([&r[0], &r[1], &r[2], &r[3], &r[4]]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::timeline::Span;
    use pipec_schedules::{Compute, Placement, Task};

    /// A measured timeline (microseconds since some epoch) draws like a simulated one that
    /// starts at 0.
    #[test]
    fn measured_timelines_start_at_their_origin() {
        let p = Program {
            placement: Placement::looped(1, 1),
            microbatches: 2,
            forward_only: false,
            ranks: vec![vec![
                Instr::Compute(Compute::Fwd(Task::new(0, 0))),
                Instr::Compute(Compute::Fwd(Task::new(0, 1))),
            ]],
        };
        let spans = |t0: f64| {
            vec![vec![
                Span {
                    start: t0,
                    end: t0 + 10.0,
                },
                Span {
                    start: t0 + 20.0,
                    end: t0 + 30.0,
                },
            ]]
        };
        let opts = TextOptions {
            width: 40,
            ..TextOptions::default()
        };
        let a = render(
            &p,
            &Timeline {
                unit: TimeUnit::Micros,
                ranks: spans(1.0e9),
            },
            &opts,
        );
        let b = render(
            &p,
            &Timeline {
                unit: TimeUnit::Micros,
                ranks: spans(0.0),
            },
            &opts,
        );
        assert_eq!(a, b);
        assert!(
            a.starts_with("rank 0 │F0--------..........F1--------│\n"),
            "{a}"
        );
        let empty = render(
            &p,
            &Timeline {
                unit: TimeUnit::Cost,
                ranks: vec![vec![]],
            },
            &opts,
        );
        assert!(empty.starts_with("(nothing to draw"));
    }
}
