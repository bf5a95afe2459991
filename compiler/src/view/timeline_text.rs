//! The terminal timeline: one row per rank, ops drawn to scale, readable with and without
//! colour.
//!
//! Each column is drawn from its own work by kind alone ([`cell_of`]): the letter of a kind
//! doing over 3/4 of it (`F` forward, `B` backward, `I` bwd_D, `W` bwd_W, `X` an overlapped
//! pair), `+` when none does, `.` when it is idle over half. An op's label (`F5`, `X5/2`) is
//! written over its own letters where it fits with a `-` after it (or its background colour).
//! Odd model chunks are written in lowercase (and, with colour, in the bright shade) so
//! interleaving is visible. docs/views.md states the rule; tests/integration/views_marks.rs
//! checks every row against a brute-force reading of the timeline.

use super::{chunk_of, chunks, fmt_num, nice_step, op_label, OpKind};
use pipec_cost::simulate::Summary;
use pipec_cost::timeline::{TimeUnit, Timeline};
use pipec_ir::ir::Program;
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

/// A column is drawn as one kind of work when that kind does more than this share of the
/// column's busy time; at or below it the column is mixed (`+`). Three quarters, not a
/// majority: 1F1B's steady state is one forward to two backward units, and a majority rule
/// draws a column holding a whole cycle as solid `B` (the 80-column picture of issue #40);
/// exactly 3/4 is mixed, so a cycle of one forward to a three-unit backward is not solid `B`
/// either.
pub const DOMINANT_SHARE: f64 = 0.75;

/// Slack of the threshold comparisons, relative to a column's length, so that a column
/// exactly on a threshold (half busy: busy; a kind at exactly [`DOMINANT_SHARE`]: mixed; an
/// op ending exactly on a column edge: that column is inside it) is drawn by the documented
/// tie rule and not by the last bit of a floating-point sum.
pub const TIE_SLACK: f64 = 1e-9;

/// What one column of one rank shows: a function of that column's work by kind alone.
/// Columns summarise their whole time span, so the same work is drawn the same way on every
/// rank and at every width: a column never claims one kind while holding much of another.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Cell {
    /// Busy less than half the column (exactly half counts as busy).
    Idle,
    /// One kind does more than [`DOMINANT_SHARE`] of the column's busy time (two kinds
    /// cannot);
    /// `odd` when more than half of that kind's time in the column is on odd model chunks.
    Kind { kind: OpKind, odd: bool },
    /// Busy at least half the column, and no kind does more than [`DOMINANT_SHARE`] of its
    /// busy time.
    Mixed,
}

/// The cell of one column from its work per kind (time units, [`OpKind::ALL`] order), the
/// odd-chunk part of that work, and the column's length `u`: the rule docs/views.md states.
pub fn cell_of(work: &[f64; 5], odd: &[f64; 5], u: f64) -> Cell {
    let busy: f64 = work.iter().sum();
    let slack = TIE_SLACK * u;
    if busy < u / 2.0 - slack {
        return Cell::Idle;
    }
    let mut d = 0;
    for k in 1..5 {
        if work[k] > work[d] {
            d = k;
        }
    }
    if work[d] > DOMINANT_SHARE * busy + slack {
        Cell::Kind {
            kind: OpKind::ALL[d],
            odd: odd[d] * 2.0 > work[d] + slack,
        }
    } else {
        Cell::Mixed
    }
}

/// The window drawn and its scale: `(from, to, columns per time unit, columns used)`, times
/// from the timeline's origin. The window fills every column the width leaves (the scale is
/// fractional): column `c` covers `[from + c/scale, from + (c+1)/scale)`.
pub fn geometry(
    program: &Program,
    timeline: &Timeline,
    opts: &TextOptions,
) -> (f64, f64, f64, usize) {
    let cols = columns(program, opts.width);
    let makespan = (timeline.makespan() - origin(timeline)).max(0.0);
    let from = opts.from.unwrap_or(0.0).clamp(0.0, makespan);
    let to = opts.to.unwrap_or(makespan).clamp(from, makespan);
    let span = to - from;
    if span > 0.0 {
        (from, to, cols as f64 / span, cols)
    } else {
        (from, to, 0.0, 0)
    }
}

/// Timeline columns left by `width` after the rank label and the two borders.
pub fn columns(program: &Program, width: usize) -> usize {
    width.saturating_sub(label_width(program) + 3).max(10)
}

fn label_width(program: &Program) -> usize {
    format!("rank {}", program.ranks.len().saturating_sub(1)).len()
}

/// The work in each column of one rank's window: busy time per [`OpKind`] (in time units).
pub fn column_work(
    program: &Program,
    timeline: &Timeline,
    rank: usize,
    from: f64,
    scale: f64,
    used: usize,
) -> Vec<[f64; 5]> {
    scan(program, timeline, rank, from, scale, used).by_kind
}

/// Per-column overlaps of one rank's compute ops with the window's columns.
struct Scan {
    by_kind: Vec<[f64; 5]>,
    odd_by_kind: Vec<[f64; 5]>,
    /// The op doing the most work in each column and how much (the earlier op in program
    /// order unless a later one does more, beyond [`TIE_SLACK`]).
    top: Vec<Option<(usize, f64)>>,
}

fn scan(
    program: &Program,
    timeline: &Timeline,
    rank: usize,
    from: f64,
    scale: f64,
    used: usize,
) -> Scan {
    let mut out = Scan {
        by_kind: vec![[0.0; 5]; used],
        odd_by_kind: vec![[0.0; 5]; used],
        top: vec![None; used],
    };
    let Some(instrs) = program.ranks.get(rank) else {
        return out;
    };
    if used == 0 || scale <= 0.0 {
        return out;
    }
    let t0 = origin(timeline);
    let chunk = chunks(program);
    let spans = timeline.ranks.get(rank).map_or(&[][..], |v| v.as_slice());
    let u = 1.0 / scale;
    for (i, (ins, span)) in instrs.iter().zip(spans).enumerate() {
        let Some(op) = &super::drawn_compute(ins) else {
            continue;
        };
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
            out.by_kind[c][kind] += o;
            if odd {
                out.odd_by_kind[c][kind] += o;
            }
            if out.top[c].is_none_or(|(_, t)| o > t + TIE_SLACK * u) {
                out.top[c] = Some((i, o));
            }
        }
    }
    out
}

/// The cells of one rank: what each column of the window holds ([`cell_of`]).
pub fn cells(
    program: &Program,
    timeline: &Timeline,
    rank: usize,
    from: f64,
    scale: f64,
    used: usize,
) -> Vec<Cell> {
    if program.ranks.get(rank).is_none() {
        return vec![Cell::Idle; used];
    }
    if used == 0 || scale <= 0.0 {
        return Vec::new();
    }
    let u = 1.0 / scale;
    let w = scan(program, timeline, rank, from, scale, used);
    (0..used)
        .map(|c| cell_of(&w.by_kind[c], &w.odd_by_kind[c], u))
        .collect()
}

/// The label of a run of mixed columns: its kinds by share of the run's busy time, largest
/// first (ties in [`OpKind::ALL`] order), each kind down to 1% (rounded whole percents), e.g.
/// `B67%F33%`; empty unless all of them fit in `room` characters, so a label never hides a
/// kind of the run.
pub fn mix_label(work: &[[f64; 5]], room: usize) -> String {
    let mut total = [0.0f64; 5];
    for col in work {
        for k in 0..5 {
            total[k] += col[k];
        }
    }
    let busy: f64 = total.iter().sum();
    if busy <= 0.0 {
        return String::new();
    }
    let mut order: Vec<usize> = (0..5).filter(|&k| total[k] > 0.0).collect();
    order.sort_by(|&a, &b| total[b].total_cmp(&total[a]).then(a.cmp(&b)));
    let mut out = String::new();
    for k in order {
        if (total[k] / busy * 100.0).round() < 1.0 {
            break;
        }
        let item = format!(
            "{}{}%",
            OpKind::ALL[k].letter(),
            (total[k] / busy * 100.0).round() as u32
        );
        if out.len() + item.len() > room {
            return String::new();
        }
        out.push_str(&item);
    }
    out
}

/// How a character of a row is drawn with colour.
#[derive(Copy, Clone, Debug, PartialEq)]
enum Style {
    Idle,
    Mixed,
    Kind(OpKind, bool),
}

/// One rank's row: each column's mark ([`cell_of`]: its kind's letter, `+` or `.`), then the
/// labels. A run of at least [`MIX_LABEL_MIN_RUN`] mixed columns names its work by kind
/// ([`mix_label`]) after its first `+`, keeping at least one `+` after it, so the label never
/// touches a letter. An op is labelled (`F5`, then
/// `-` fill, or blank fill on a coloured background) only where its label and one more
/// column fit in its interior, the columns wholly inside its span: those columns are all its
/// kind, so a label replaces only marks of its own op, ends with a separator, and never meets
/// another label.
fn row(
    program: &Program,
    timeline: &Timeline,
    rank: usize,
    from: f64,
    scale: f64,
    used: usize,
    color: bool,
) -> Vec<(char, Style)> {
    let w = scan(program, timeline, rank, from, scale, used);
    let u = 1.0 / scale;
    let cells: Vec<Cell> = (0..used)
        .map(|c| cell_of(&w.by_kind[c], &w.odd_by_kind[c], u))
        .collect();
    let mut row: Vec<(char, Style)> = cells
        .iter()
        .map(|cell| match *cell {
            Cell::Idle => ('.', Style::Idle),
            Cell::Mixed => ('+', Style::Mixed),
            Cell::Kind { kind, odd } => (
                if odd {
                    kind.letter().to_ascii_lowercase()
                } else {
                    kind.letter()
                },
                Style::Kind(kind, odd),
            ),
        })
        .collect();
    let mut c = 0;
    while c < used {
        let mut e = c + 1;
        while e < used && cells[e] == cells[c] {
            e += 1;
        }
        if cells[c] == Cell::Mixed && e - c >= MIX_LABEL_MIN_RUN {
            let label = mix_label(&w.by_kind[c..e], e - c - 2);
            for (j, ch) in label.chars().enumerate() {
                row[c + 1 + j].0 = ch;
            }
        }
        c = e;
    }
    // Each op's run: the columns drawn with its kind's letter in which it does the most work.
    let instrs = &program.ranks[rank];
    let chunk = chunks(program);
    let owner: Vec<Option<usize>> = (0..used)
        .map(|c| {
            let (i, _) = w.top[c]?;
            let op = super::drawn_compute(&instrs[i])?;
            let own = Cell::Kind {
                kind: OpKind::of(&op),
                odd: chunk_of(&op, &chunk) % 2 == 1,
            };
            (cells[c] == own).then_some(i)
        })
        .collect();
    let fill = if color { ' ' } else { '-' };
    let mut c = 0;
    while c < used {
        let mut e = c + 1;
        while e < used && owner[e] == owner[c] {
            e += 1;
        }
        if let Some(op) = owner[c].and_then(|i| super::drawn_compute(&instrs[i])) {
            let mut label = op_label(&op);
            if chunk_of(&op, &chunk) % 2 == 1 {
                label = label.to_lowercase();
            }
            if label.chars().count() < e - c {
                for (j, ch) in label
                    .chars()
                    .chain(std::iter::repeat(fill))
                    .take(e - c)
                    .enumerate()
                {
                    row[c + j].0 = ch;
                }
            }
        }
        c = e;
    }
    row
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

/// The timeline rows, the time axis and the legend, every line within `opts.width` columns.
pub fn render(program: &Program, timeline: &Timeline, opts: &TextOptions) -> String {
    let world = program.ranks.len();
    let label_w = label_width(program);
    let (from, to, scale, used) = geometry(program, timeline, opts);
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
    let mut mix_labelled = false;
    let mut copies_seen = false;
    // The copy rows' time origin, once (a walk over every span).
    let t0 = origin(timeline);
    let mut out = String::new();
    for &r in &ranks {
        let instrs = &program.ranks[r];
        let _ = write!(out, "{:>label_w$} │", format!("rank {r}"));
        let row = row(program, timeline, r, from, scale, used, opts.color);
        for (ch, style) in &row {
            match style {
                Style::Idle => {}
                Style::Mixed => summarised = true,
                Style::Kind(kind, odd) => {
                    kinds_seen[*kind as usize] = true;
                    odd_chunk_seen |= odd;
                }
            }
            mix_labelled |= *style == Style::Mixed && *ch != '+';
        }
        if opts.color {
            let mut c = 0;
            while c < row.len() {
                let mut e = c + 1;
                while e < row.len() && row[e].1 == row[c].1 {
                    e += 1;
                }
                let text: String = row[c..e].iter().map(|x| x.0).collect();
                match row[c].1 {
                    Style::Mixed => out.push_str(&text),
                    Style::Idle => {
                        out.push_str(DIM);
                        out.push_str(&text);
                        out.push_str(RESET);
                    }
                    Style::Kind(kind, odd) => {
                        out.push_str(&sgr(kind, odd));
                        out.push_str(&text);
                        out.push_str(RESET);
                    }
                }
                c = e;
            }
        } else {
            out.extend(row.iter().map(|x| x.0));
        }
        out.push_str("│\n");
        // The rank's copy stream, where it has one: `>` offloading, `<` reloading.
        let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
        let mut row: Vec<char> = vec![' '; used];
        let mut any = false;
        for (_, m, sp) in super::copies(instrs, spans) {
            let (s, e) = (sp.start - t0 - from, sp.end - t0 - from);
            if e <= 0.0 || s * scale >= used as f64 {
                continue;
            }
            any = true;
            let c0 = ((s * scale).floor().max(0.0) as usize).min(used - 1);
            let c1 = ((e * scale).ceil().max(0.0) as usize).clamp(c0 + 1, used);
            let ch = if m.kind == pipec_ir::ir::MemKind::Offload {
                '>'
            } else {
                '<'
            };
            row[c0..c1].iter_mut().for_each(|x| *x = ch);
        }
        if any {
            copies_seen = true;
            let _ = writeln!(
                out,
                "{:>label_w$} │{}│",
                "copy",
                row.into_iter().collect::<String>()
            );
        }
    }
    // Axis: ticks on the bottom border, labels under them.
    let step = if scale > 0.0 {
        nice_step(8.0 / scale)
    } else {
        1.0
    };
    let mut border: Vec<char> = vec!['─'; used];
    // Labels stay inside the box's width (the last may not start past its right edge).
    let mut labels: Vec<char> = vec![' '; used + 1];
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
    // Legend, wrapped to the width.
    let room = opts.width.saturating_sub(pad.len() + 1).max(1);
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
    if copies_seen {
        legend.push("copy: > offload, < reload (recompute drawn as a forward)".to_string());
    }
    for line in wrap(&legend, "   ", room) {
        let _ = writeln!(out, "{pad} {line}");
    }
    let mut notes = vec!["F5 = microbatch 5".to_string()];
    if kinds_seen[OpKind::Pair as usize] {
        notes.push("X5/2 = forward of 5 with backward of 2".to_string());
    }
    let mut time = format!("time in {}", unit_word(timeline.unit));
    if scale > 0.0 {
        let _ = write!(time, ", one column = {}", fmt_num(1.0 / scale));
    }
    notes.push(time);
    if odd_chunk_seen {
        notes.push(
            if opts.color {
                "lowercase, bright = odd model chunk"
            } else {
                "lowercase = odd model chunk"
            }
            .to_string(),
        );
    }
    let notes: Vec<String> = notes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            if i + 1 < notes.len() {
                format!("{n};")
            } else {
                n.clone()
            }
        })
        .collect();
    for line in wrap(&notes, " ", room) {
        let _ = writeln!(out, "{pad} {line}");
    }
    let mut rule = vec![
        "a letter: that kind does over 3/4 of the column's work;".to_string(),
        "+ mixed;".to_string(),
        ". idle over half;".to_string(),
        "F5--- an op's whole columns".to_string(),
    ];
    if summarised && mix_labelled {
        rule[1] = "+ mixed (a run of + names its work: B67%F33%);".to_string();
    }
    for line in wrap(&rule, " ", room) {
        let _ = writeln!(out, "{pad} {line}");
    }
    out
}

/// Mixed runs shorter than this are only `+`: a label needs room to read as one.
pub const MIX_LABEL_MIN_RUN: usize = 6;

/// Columns a string takes on a terminal: characters outside ANSI escape sequences.
pub fn visible_width(s: &str) -> usize {
    let mut n = 0;
    let mut esc = false;
    for ch in s.chars() {
        match (esc, ch) {
            (false, '\x1b') => esc = true,
            (true, 'm') => esc = false,
            (true, _) => {}
            (false, _) => n += 1,
        }
    }
    n
}

/// Greedy wrapping of `items` joined by `sep` into lines of at most `room` visible columns;
/// an item longer than a line is broken at its spaces (and, failing that, anywhere).
fn wrap(items: &[String], sep: &str, room: usize) -> Vec<String> {
    let mut pieces: Vec<String> = Vec::new();
    for item in items {
        if visible_width(item) <= room {
            pieces.push(item.clone());
            continue;
        }
        // Too long for any line: its words, each at most `room` wide.
        let mut cur = String::new();
        for word in item.split(' ') {
            let mut word = word.to_string();
            while visible_width(&word) > room {
                let cut: String = word.chars().take(room).collect();
                word = word.chars().skip(room).collect();
                if !cur.is_empty() {
                    pieces.push(std::mem::take(&mut cur));
                }
                pieces.push(cut);
            }
            if cur.is_empty() {
                cur = word;
            } else if visible_width(&cur) + 1 + visible_width(&word) <= room {
                cur.push(' ');
                cur.push_str(&word);
            } else {
                pieces.push(std::mem::replace(&mut cur, word));
            }
        }
        if !cur.is_empty() {
            pieces.push(cur);
        }
    }
    let mut lines: Vec<String> = Vec::new();
    let mut cur = String::new();
    for p in pieces {
        if cur.is_empty() {
            cur = p;
        } else if visible_width(&cur) + sep.len() + visible_width(&p) <= room {
            cur.push_str(sep);
            cur.push_str(&p);
        } else {
            lines.push(std::mem::replace(&mut cur, p));
        }
    }
    if !cur.is_empty() {
        lines.push(cur);
    }
    lines
}

/// The figures under the timeline: makespan, then per rank busy time, bubble and peak
/// memory ([`pipec_ir::memory`]: parameters + live activations, labelled with its unit).
pub fn render_summary(summary: &Summary, unit: TimeUnit) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "makespan {} {}   mean bubble {:.1}%   peak memory {} (worst rank)",
        fmt_num(summary.makespan),
        unit_word(unit),
        summary.mean_bubble() * 100.0,
        summary.memory_unit.with_unit(summary.peak_memory())
    );
    let _ = writeln!(out, "bubble = {}", pipec_cost::simulate::BUBBLE);
    let rows: Vec<[String; 5]> = summary
        .ranks
        .iter()
        .map(|r| {
            [
                r.rank.to_string(),
                fmt_num(r.busy),
                format!("{:.1}%", r.bubble_ratio * 100.0),
                summary.memory_unit.fmt(r.peak_memory),
                fmt_num(r.peak_at),
            ]
        })
        .collect();
    let head = ["rank", "busy", "bubble", "peak mem", "at"];
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
    use pipec_cost::timeline::Span;
    use pipec_ir::ir::Instr;
    use pipec_schedules::{Compute, Placement, Task};

    /// The column rule's ties, derived by hand: exactly half busy is busy; a kind at exactly
    /// 3/4 of the busy time is mixed, just over it is that kind; odd only past half.
    #[test]
    fn column_rule_ties() {
        let none = [0.0; 5];
        assert_eq!(cell_of(&[0.49, 0.0, 0.0, 0.0, 0.0], &none, 1.0), Cell::Idle);
        let half = Cell::Kind {
            kind: OpKind::Fwd,
            odd: false,
        };
        assert_eq!(cell_of(&[0.5, 0.0, 0.0, 0.0, 0.0], &none, 1.0), half);
        assert_eq!(
            cell_of(&[0.25, 0.75, 0.0, 0.0, 0.0], &none, 1.0),
            Cell::Mixed
        );
        assert_eq!(
            cell_of(&[0.2, 0.8, 0.0, 0.0, 0.0], &[0.0, 0.4, 0.0, 0.0, 0.0], 1.0),
            Cell::Kind {
                kind: OpKind::Bwd,
                odd: false
            }
        );
        assert_eq!(
            cell_of(&[0.2, 0.8, 0.0, 0.0, 0.0], &[0.0, 0.5, 0.0, 0.0, 0.0], 1.0),
            Cell::Kind {
                kind: OpKind::Bwd,
                odd: true
            }
        );
        // 1F1B's cycle in one column: F 1, B 2.
        assert_eq!(cell_of(&[1.0, 2.0, 0.0, 0.0, 0.0], &none, 3.0), Cell::Mixed);
    }

    /// A measured timeline (microseconds since some epoch) draws like a simulated one that
    /// starts at 0.
    #[test]
    fn measured_timelines_start_at_their_origin() {
        let p = Program {
            placement: Placement::looped(1, 1),
            microbatches: 2,
            forward_only: false,
            comm: None,
            ranks: vec![vec![
                Instr::Compute(Compute::Fwd(Task::new(0, 0))),
                Instr::Compute(Compute::Fwd(Task::new(0, 1))),
            ]],
            lengths: None,
            p2p_groups: Default::default(),
            buffer_slots: None,
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
            a.starts_with("rank 0 │F0--------...........F1--------│\n"),
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
