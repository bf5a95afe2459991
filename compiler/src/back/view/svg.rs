//! A standalone SVG timeline: one lane per rank, one `<rect class="op ...">` per compute op
//! with a `<title>` tooltip, a legend and a time axis. Rows shrink for large pipelines
//! (24 px up to 16 ranks, down to 2 px), labels appear only where they fit. Output is
//! deterministic: fixed number formatting, program order.

use super::{
    chunk_of, chunks, fmt_num, nice_step, op_label, op_name, timeline_text::origin, Filter, OpKind,
};
use crate::ir::{Instr, Program};
use crate::simulate::timeline::{TimeUnit, Timeline};
use std::fmt::Write as _;

/// How to draw.
#[derive(Clone, Debug)]
pub struct SvgOptions {
    /// Picture width in pixels.
    pub width: f64,
    /// A heading above the legend.
    pub title: Option<String>,
    /// The ranks and time window drawn (communication is never drawn).
    pub filter: Filter,
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions {
            width: 1200.0,
            title: None,
            filter: Filter::default(),
        }
    }
}

/// Tableau-10 colours: forward blue, backward green, bwd_D orange, bwd_W purple, pair teal.
fn color(kind: OpKind) -> (u8, u8, u8) {
    match kind {
        OpKind::Fwd => (0x4e, 0x79, 0xa7),
        OpKind::Bwd => (0x59, 0xa1, 0x4f),
        OpKind::BwdD => (0xf2, 0x8e, 0x2b),
        OpKind::BwdW => (0xb0, 0x7a, 0xa1),
        OpKind::Pair => (0x76, 0xb7, 0xb2),
    }
}

/// Fill and text colour; odd chunks are the colour mixed 45% towards white.
fn fill(kind: OpKind, odd: bool) -> (String, &'static str) {
    let (r, g, b) = color(kind);
    if odd {
        let l = |c: u8| c + ((255 - c as u16) * 45 / 100) as u8;
        (format!("#{:02x}{:02x}{:02x}", l(r), l(g), l(b)), "#1b1b1b")
    } else {
        (format!("#{r:02x}{g:02x}{b:02x}"), "#ffffff")
    }
}

fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            c => o.push(c),
        }
    }
    o
}

/// Pixel values with at most 2 decimals.
fn px(x: f64) -> String {
    fmt_num(x)
}

/// The picture.
pub fn render(program: &Program, timeline: &Timeline, opts: &SvgOptions) -> String {
    let rows = opts.filter.rows(program.ranks.len());
    let world = rows.len().max(1);
    let width = opts.width.max(300.0);
    let (left, right) = (64.0, 24.0);
    let plot_w = width - left - right;
    let row_h: f64 = if world <= 16 {
        24.0
    } else {
        (640.0 / world as f64).clamp(2.0, 24.0).floor()
    };
    let gap = if row_h >= 8.0 { 3.0 } else { row_h * 0.2 };
    let title_h = if opts.title.is_some() { 26.0 } else { 0.0 };
    let legend_y = 14.0 + title_h;
    let top = legend_y + 22.0;
    let rows_h = row_h * world as f64;
    let axis_y = top + rows_h + 4.0;
    let height = axis_y + 44.0;
    let t0 = origin(timeline);
    let makespan = (timeline.makespan() - t0).max(0.0);
    let from = opts.filter.from.unwrap_or(0.0).clamp(0.0, makespan);
    let to = opts.filter.to.unwrap_or(makespan).clamp(from, makespan);
    let scale = if to > from { plot_w / (to - from) } else { 0.0 };
    let unit = match timeline.unit {
        TimeUnit::Cost => "cost units",
        TimeUnit::Micros => "µs",
    };
    let chunk = chunks(program);
    let font = (row_h * 0.55).clamp(6.0, 11.0);

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="Helvetica, Arial, sans-serif">"##,
        w = px(width),
        h = px(height)
    );
    let _ = writeln!(
        s,
        r##"<rect class="background" x="0" y="0" width="{}" height="{}" fill="#ffffff"/>"##,
        px(width),
        px(height)
    );
    if let Some(t) = &opts.title {
        let _ = writeln!(
            s,
            r##"<text x="{}" y="20" font-size="14" font-weight="bold" fill="#222">{}</text>"##,
            px(left),
            esc(t)
        );
    }
    // Legend: the kinds present, idle, and the chunk shading when there are several chunks.
    let mut present = [false; 5];
    let mut odd_seen = false;
    for &r in &rows {
        for op in program.ranks[r].iter().filter_map(Instr::as_compute) {
            present[OpKind::of(op) as usize] = true;
            odd_seen |= chunk_of(op, &chunk) % 2 == 1;
        }
    }
    let mut x = left;
    let _ = writeln!(s, r##"<g class="legend" font-size="11" fill="#333">"##);
    let swatch = |s: &mut String, x: &mut f64, fill: &str, stroke: &str, text: &str| {
        let _ = writeln!(
            s,
            r##"<rect class="swatch" x="{}" y="{}" width="12" height="12" fill="{fill}" stroke="{stroke}"/><text x="{}" y="{}">{}</text>"##,
            px(*x),
            px(legend_y - 10.0),
            px(*x + 16.0),
            px(legend_y),
            esc(text)
        );
        *x += 16.0 + 6.2 * text.chars().count() as f64 + 18.0;
    };
    for k in OpKind::ALL {
        if present[k as usize] {
            let (f, _) = fill(k, false);
            swatch(
                &mut s,
                &mut x,
                &f,
                &f,
                &format!("{} {}", k.letter(), k.word()),
            );
        }
    }
    if odd_seen {
        let (f, _) = fill(OpKind::Fwd, true);
        swatch(&mut s, &mut x, &f, &f, "lighter: odd model chunk");
    }
    swatch(&mut s, &mut x, "#f0f0f0", "#d0d0d0", "idle");
    let _ = writeln!(s, "</g>");

    // Lanes and rank labels.
    let label_every = if row_h >= 9.0 {
        1
    } else {
        (9.0 / row_h).ceil() as usize
    };
    let _ = writeln!(s, r##"<g class="lanes" fill="#f0f0f0">"##);
    for j in 0..rows.len() {
        let y = top + j as f64 * row_h;
        let _ = writeln!(
            s,
            r##"<rect class="lane" x="{}" y="{}" width="{}" height="{}"/>"##,
            px(left),
            px(y + gap / 2.0),
            px(plot_w),
            px(row_h - gap)
        );
    }
    let _ = writeln!(s, "</g>");
    let _ = writeln!(
        s,
        r##"<g class="ranks" font-size="{}" fill="#333" text-anchor="end">"##,
        px(font.max(8.0))
    );
    for (j, &r) in rows.iter().enumerate().step_by(label_every) {
        let y = top + j as f64 * row_h + row_h / 2.0;
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" dominant-baseline="central">rank {r}</text>"##,
            px(left - 6.0),
            px(y)
        );
    }
    let _ = writeln!(s, "</g>");

    // Ops.
    let _ = writeln!(
        s,
        r##"<g class="ops" font-size="{}" text-anchor="middle">"##,
        px(font)
    );
    for (j, &r) in rows.iter().enumerate() {
        let instrs = &program.ranks[r];
        let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
        let y = top + j as f64 * row_h + gap / 2.0;
        let h = row_h - gap;
        for (i, (ins, sp)) in instrs.iter().zip(spans).enumerate() {
            let Instr::Compute(op) = ins else { continue };
            if !(sp.start.is_finite() && sp.end.is_finite()) {
                continue;
            }
            if !opts.filter.keeps(sp.start - t0, sp.end - t0) {
                continue;
            }
            let kind = OpKind::of(op);
            let (f, text_fill) = fill(kind, chunk_of(op, &chunk) % 2 == 1);
            // Clipped to the window.
            let (a, b) = ((sp.start - t0).max(from), (sp.end - t0).min(to));
            let x0 = left + (a - from) * scale;
            let w = ((b - a) * scale).max(0.0);
            let stroke = if w >= 3.0 && h >= 6.0 {
                r##" stroke="#ffffff" stroke-width="0.6""##
            } else {
                ""
            };
            let _ = write!(
                s,
                r##"<rect class="op {}" x="{}" y="{}" width="{}" height="{}" fill="{f}"{stroke}><title>rank {r}, #{i}: {} [{} – {}]</title></rect>"##,
                kind.letter(),
                px(x0),
                px(y),
                px(w),
                px(h),
                esc(&op_name(op)),
                fmt_num(sp.start - t0),
                fmt_num(sp.end - t0)
            );
            let label = &op_label(op)[1..];
            if h >= 10.0 && w >= font * 0.62 * label.len() as f64 + 3.0 {
                let _ = write!(
                    s,
                    r##"<text x="{}" y="{}" dominant-baseline="central" fill="{text_fill}">{}</text>"##,
                    px(x0 + w / 2.0),
                    px(y + h / 2.0),
                    esc(label)
                );
            }
            s.push('\n');
        }
    }
    let _ = writeln!(s, "</g>");

    // Time axis.
    let _ = writeln!(
        s,
        r##"<g class="axis" font-size="10" fill="#333" stroke="#666" text-anchor="middle">"##
    );
    let _ = writeln!(
        s,
        r##"<line x1="{}" y1="{}" x2="{}" y2="{}"/>"##,
        px(left),
        px(axis_y),
        px(left + plot_w),
        px(axis_y)
    );
    if scale > 0.0 {
        let step = nice_step(70.0 / scale);
        let first = (from / step).ceil() as u64;
        let mut k = 0u64;
        while ((first + k) as f64) * step <= to + 1e-9 && k <= 1000 {
            let t = (first + k) as f64 * step;
            let xt = left + (t - from) * scale;
            let _ = writeln!(
                s,
                r##"<line x1="{}" y1="{}" x2="{}" y2="{}"/><text x="{}" y="{}" stroke="none">{}</text>"##,
                px(xt),
                px(axis_y),
                px(xt),
                px(axis_y + 4.0),
                px(xt),
                px(axis_y + 16.0),
                fmt_num(t)
            );
            k += 1;
        }
    }
    let _ = writeln!(
        s,
        r##"<text x="{}" y="{}" stroke="none">time ({unit}); makespan {}{}</text>"##,
        px(left + plot_w / 2.0),
        px(axis_y + 34.0),
        fmt_num(makespan),
        if opts.filter.is_all() {
            String::new()
        } else {
            format!(
                "; showing {} of {} ranks, {} to {}",
                rows.len(),
                program.ranks.len(),
                fmt_num(from),
                fmt_num(to)
            )
        }
    );
    let _ = writeln!(s, "</g>");
    s.push_str("</svg>\n");
    s
}
