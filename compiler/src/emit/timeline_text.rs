//! The terminal timeline: one row per rank, ops drawn to scale, readable with and without
//! colour.
//!
//! Each op is a run of columns that starts with its label (`F5`: forward of microbatch 5;
//! `B`, `I` (bwd_D), `W` (bwd_W), `X5/2` for an overlapped pair) and is filled with `-`
//! (without colour) or its background colour; idle time is `.`. Odd model chunks are written
//! in lowercase (and, with colour, in the bright shade) so interleaving is visible.

use super::{chunk_of, chunks, fmt_num, nice_step, op_label, OpKind};
use crate::program::{Instr, Program};
use crate::simulate::Summary;
use crate::timeline::{TimeUnit, Timeline};
use std::fmt::Write as _;

/// How to draw.
#[derive(Clone, Debug)]
pub struct TextOptions {
    /// Total width in columns, labels included.
    pub width: usize,
    /// ANSI colours.
    pub color: bool,
}

impl Default for TextOptions {
    fn default() -> Self {
        TextOptions {
            width: 100,
            color: false,
        }
    }
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
    let label_w = format!("rank {}", world.saturating_sub(1)).len();
    let cols = opts.width.saturating_sub(label_w + 3).max(10);
    let t0 = origin(timeline);
    let makespan = (timeline.makespan() - t0).max(0.0);
    // Whole columns per time unit when the schedule fits, so equal ops get equal widths.
    let scale = if makespan <= 0.0 {
        0.0
    } else if makespan <= cols as f64 {
        (cols as f64 / makespan).floor()
    } else {
        cols as f64 / makespan
    };
    let used = ((makespan * scale).round() as usize).min(cols);
    let chunk = chunks(program);
    if used == 0 {
        return format!(
            "(nothing to draw: the makespan is 0 {})\n",
            unit_word(timeline.unit)
        );
    }
    let mut kinds_seen = [false; 5];
    let mut odd_chunk_seen = false;
    let mut out = String::new();
    for (r, instrs) in program.ranks.iter().enumerate() {
        let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
        // Which op (index into instrs) covers each column.
        let mut cells: Vec<Option<usize>> = vec![None; used];
        for (i, (ins, span)) in instrs.iter().zip(spans).enumerate() {
            let Instr::Compute(_) = ins else { continue };
            if !(span.start.is_finite() && span.end.is_finite()) {
                continue;
            }
            let c0 = (((span.start - t0) * scale).round().max(0.0) as usize).min(used);
            let c1 = (((span.end - t0) * scale).round().max(0.0) as usize).min(used);
            if c1 > c0 {
                cells[c0..c1].iter_mut().for_each(|c| *c = Some(i));
            } else if c0 < used && cells[c0].is_none() {
                cells[c0] = Some(i);
            }
        }
        let _ = write!(out, "{:>label_w$} │", format!("rank {r}"));
        let mut c = 0;
        while c < used {
            let mut e = c + 1;
            while e < used && cells[e] == cells[c] {
                e += 1;
            }
            let n = e - c;
            match cells[c].and_then(|i| instrs[i].as_compute()) {
                None => {
                    if opts.color {
                        out.push_str(DIM);
                    }
                    out.push_str(&".".repeat(n));
                    if opts.color {
                        out.push_str(RESET);
                    }
                }
                Some(op) => {
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
    loop {
        let t = k as f64 * step;
        if t > makespan + 1e-9 {
            break;
        }
        let col = (t * scale).round() as usize;
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
    use crate::timeline::Span;
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
            color: false,
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
