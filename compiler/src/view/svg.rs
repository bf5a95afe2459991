//! A standalone SVG timeline: one lane per rank, one `<rect class="op ...">` per compute op
//! with a `<title>` tooltip, a legend and a time axis. Rows shrink for large pipelines
//! (24 px up to 16 ranks, down to 2 px), labels appear only where they fit. Output is
//! deterministic: fixed number formatting, program order.
//!
//! Above [`OVERVIEW_ABOVE_OPS`] ops the picture is an overview instead (one cell per rank and
//! time bucket, a stack of its kinds each as tall as its share of the bucket's time), which a
//! browser opens at once; a picture of every op stays available with [`Detail::Ops`].

use super::{
    chunk_of, chunks, fmt_num, nice_step, op_label, op_name, timeline_text::origin, Filter, OpKind,
};
use pipec_cost::timeline::{TimeUnit, Timeline};
use pipec_ir::ir::{Instr, Program};
use std::fmt::Write as _;

/// Every op, or an overview per rank and time bucket.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Detail {
    /// Every op up to [`SvgOptions::max_ops`] ops drawn, the overview above.
    #[default]
    Auto,
    /// One rect per op, whatever the size.
    Ops,
    /// One cell per rank and time bucket.
    Overview,
}

/// Above this many ops drawn, [`Detail::Auto`] draws the overview: an SVG of this many ops is
/// small enough for browsers to open at once, and one of every op of a large schedule (a
/// million ops) is not (bench/HISTORY.md has the sizes).
pub const OVERVIEW_ABOVE_OPS: usize = 20_000;

/// Width of one overview time bucket in pixels.
pub const BUCKET_PX: f64 = 2.0;

/// How to draw.
#[derive(Clone, Debug)]
pub struct SvgOptions {
    /// Picture width in pixels.
    pub width: f64,
    /// A heading above the legend.
    pub title: Option<String>,
    /// The ranks and time window drawn (communication is never drawn).
    pub filter: Filter,
    /// Every op or an overview.
    pub detail: Detail,
    /// The most ops [`Detail::Auto`] draws one by one.
    pub max_ops: usize,
}

impl Default for SvgOptions {
    fn default() -> Self {
        SvgOptions {
            width: 1200.0,
            title: None,
            filter: Filter::default(),
            detail: Detail::Auto,
            max_ops: OVERVIEW_ABOVE_OPS,
        }
    }
}

/// The compute ops a picture under `opts` would draw (in its ranks and window).
pub fn ops_drawn(program: &Program, timeline: &Timeline, opts: &SvgOptions) -> usize {
    let t0 = origin(timeline);
    opts.filter
        .rows(program.ranks.len())
        .iter()
        .map(|&r| {
            let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
            program.ranks[r]
                .iter()
                .zip(spans)
                .filter(|(i, sp)| {
                    i.as_compute().is_some()
                        && sp.start.is_finite()
                        && sp.end.is_finite()
                        && opts.filter.keeps(sp.start - t0, sp.end - t0)
                })
                .count()
        })
        .sum()
}

/// Whether `opts` draws the overview.
pub fn is_overview(program: &Program, timeline: &Timeline, opts: &SvgOptions) -> bool {
    match opts.detail {
        Detail::Ops => false,
        Detail::Overview => true,
        Detail::Auto => ops_drawn(program, timeline, opts) > opts.max_ops,
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
    if odd {
        (mix(color(kind), 45), "#1b1b1b")
    } else {
        (mix(color(kind), 0), "#ffffff")
    }
}

/// `rgb` mixed `pct` percent of the way towards white, as `#rrggbb`.
fn mix((r, g, b): (u8, u8, u8), pct: u16) -> String {
    let l = |c: u8| c + ((255 - c as u16) * pct / 100) as u8;
    format!("#{:02x}{:02x}{:02x}", l(r), l(g), l(b))
}

/// With more than two chunks, light/dark parity would make chunks 0, 2 and 4 alike: chunk `c`
/// gets the shade `CHUNK_SHADES[c % 4]` (percent mixed towards white, or towards black when
/// negative) and the hatching `c / 4 % 4` (none, `/`, `\\`, crossed), so 16 chunks look
/// distinct; more repeat.
pub const CHUNK_SHADES: [i16; 4] = [0, 45, -35, 75];

/// `rgb` shaded by `pct` ([`CHUNK_SHADES`]), as `#rrggbb`.
fn shade(rgb: (u8, u8, u8), pct: i16) -> String {
    if pct >= 0 {
        mix(rgb, pct as u16)
    } else {
        let d = |c: u8| (c as u16 * (100 - pct.unsigned_abs()) / 100) as u8;
        format!("#{:02x}{:02x}{:02x}", d(rgb.0), d(rgb.1), d(rgb.2))
    }
}

/// The look of chunk `chunk` of `chunks` for a kind: `(fill, text colour, hatching)`; the fill
/// is a pattern reference when the chunk is hatched.
fn chunk_fill(kind: OpKind, chunk: u32, chunks: u32) -> (String, &'static str, u32) {
    if chunks <= 2 {
        let (f, t) = fill(kind, chunk % 2 == 1);
        return (f, t, 0);
    }
    let pct = CHUNK_SHADES[(chunk % 4) as usize];
    let hatch = chunk / 4 % 4;
    let text = if pct >= 40 { "#1b1b1b" } else { "#ffffff" };
    let f = if hatch == 0 {
        shade(color(kind), pct)
    } else {
        format!("url(#{}{chunk})", kind.letter())
    };
    (f, text, hatch)
}

/// A pattern for a hatched chunk: its shade with white lines.
fn hatch_pattern(kind: OpKind, chunk: u32) -> String {
    let base = shade(color(kind), CHUNK_SHADES[(chunk % 4) as usize]);
    let lines = match chunk / 4 % 4 {
        1 => r##"<path d="M0,6 L6,0" stroke="#ffffff" stroke-width="1.5"/>"##,
        2 => r##"<path d="M0,0 L6,6" stroke="#ffffff" stroke-width="1.5"/>"##,
        _ => r##"<path d="M0,6 L6,0 M0,0 L6,6" stroke="#ffffff" stroke-width="1.2"/>"##,
    };
    format!(
        r##"<pattern id="{}{chunk}" patternUnits="userSpaceOnUse" width="6" height="6"><rect width="6" height="6" fill="{base}"/>{lines}</pattern>"##,
        kind.letter()
    )
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
    let n_chunks = chunk.iter().max().map_or(1, |c| c + 1);
    let overview = is_overview(program, timeline, opts);
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
            present[OpKind::of(&op) as usize] = true;
            odd_seen |= chunk_of(&op, &chunk) % 2 == 1;
        }
    }
    let shaded = !overview && n_chunks > 2;
    if shaded && n_chunks > 4 {
        let _ = writeln!(s, "<defs>");
        for k in OpKind::ALL.into_iter().filter(|&k| present[k as usize]) {
            for c in (4..n_chunks).filter(|c| c / 4 % 4 != 0) {
                let _ = writeln!(s, "{}", hatch_pattern(k, c));
            }
        }
        let _ = writeln!(s, "</defs>");
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
    if overview {
        // No chunks in the overview: a cell holds many ops.
    } else if shaded {
        let k = OpKind::ALL
            .into_iter()
            .find(|&k| present[k as usize])
            .unwrap_or(OpKind::Fwd);
        for c in 0..n_chunks {
            let (f, _, _) = chunk_fill(k, c, n_chunks);
            let text = if c == 0 {
                "chunk 0".to_string()
            } else {
                c.to_string()
            };
            let _ = writeln!(
                s,
                r##"<rect class="swatch chunk" x="{}" y="{}" width="12" height="12" fill="{f}" stroke="#999999" stroke-width="0.5"/><text x="{}" y="{}">{}</text>"##,
                px(x),
                px(legend_y - 10.0),
                px(x + 15.0),
                px(legend_y),
                esc(&text)
            );
            x += 15.0 + 6.2 * text.chars().count() as f64 + 8.0;
        }
        x += 10.0;
    } else if odd_seen {
        let (f, _) = fill(OpKind::Fwd, true);
        swatch(&mut s, &mut x, &f, &f, "lighter: odd model chunk");
    }
    swatch(&mut s, &mut x, "#f0f0f0", "#d0d0d0", "idle");
    if overview {
        let buckets = (plot_w / BUCKET_PX).floor().max(1.0);
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}">overview: a cell is {} {unit}, each kind as tall as its share of the cell's time (in tenths), the rest idle</text>"##,
            px(x),
            px(legend_y),
            fmt_num((to - from) / buckets)
        );
    }
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

    if overview {
        draw_overview(
            &mut s,
            program,
            timeline,
            &rows,
            Frame {
                left,
                plot_w,
                top,
                row_h,
                gap,
                from,
                to,
            },
        );
    } else {
        // Ops.
        let _ = writeln!(
            s,
            r##"<g class="ops" font-size="{}" text-anchor="middle">"##,
            px(font)
        );
        let mut copy_bars = String::new();
        for (j, &r) in rows.iter().enumerate() {
            let instrs = &program.ranks[r];
            let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
            let y = top + j as f64 * row_h + gap / 2.0;
            let h = row_h - gap;
            // The rank's copy stream: a thin bar along the bottom of its row per copy, drawn
            // over the ops (after them).
            for (i, m, sp) in super::copies(instrs, spans) {
                if !opts.filter.keeps(sp.start - t0, sp.end - t0) {
                    continue;
                }
                let (a, b) = ((sp.start - t0).max(from), (sp.end - t0).min(to));
                let (what, fill) = if m.kind == pipec_ir::ir::MemKind::Offload {
                    ("offload", "#6b6b6b")
                } else {
                    ("reload", "#2f2f2f")
                };
                let _ = write!(
                    copy_bars,
                    r##"<rect class="copy {what}" x="{}" y="{}" width="{}" height="{}" fill="{fill}"><title>rank {r}, #{i}: {what} s{} mb{} [{} – {}]</title></rect>"##,
                    px(left + (a - from) * scale),
                    px(y + h * 0.8),
                    px(((b - a) * scale).max(0.0)),
                    px(h * 0.2),
                    m.task.stage.0,
                    m.task.mb.0,
                    fmt_num(sp.start - t0),
                    fmt_num(sp.end - t0)
                );
                copy_bars.push('\n');
            }
            for (i, (ins, sp)) in instrs.iter().zip(spans).enumerate() {
                let Some(op) = &super::drawn_compute(ins) else {
                    continue;
                };
                if !(sp.start.is_finite() && sp.end.is_finite()) {
                    continue;
                }
                if !opts.filter.keeps(sp.start - t0, sp.end - t0) {
                    continue;
                }
                let kind = OpKind::of(op);
                let c = chunk_of(op, &chunk);
                let (f, text_fill, _) = chunk_fill(kind, c, n_chunks);
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
                    r##"<rect class="op {}" x="{}" y="{}" width="{}" height="{}" fill="{f}"{stroke}><title>rank {r}, #{i}: {}{} [{} – {}]</title></rect>"##,
                    kind.letter(),
                    px(x0),
                    px(y),
                    px(w),
                    px(h),
                    esc(&op_name(op)),
                    if n_chunks > 2 {
                        format!(", chunk {c}")
                    } else {
                        String::new()
                    },
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
        s.push_str(&copy_bars);
        let _ = writeln!(s, "</g>");
    }
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

/// Where the rows are drawn.
struct Frame {
    left: f64,
    plot_w: f64,
    top: f64,
    row_h: f64,
    gap: f64,
    from: f64,
    to: f64,
}

/// The tenths of a cell's height each kind takes in the overview, [`OpKind::ALL`] order: the
/// cell's busy tenths (its busy share of the cell's time `u` in tenths, rounded up so that
/// any work shows, at most 10) shared among the kinds in proportion to their work by the
/// largest-remainder method (ties: [`OpKind::ALL`] order). A 50/50 mix is half and half, not
/// one solid kind; the rest of the cell is idle. All zero when the cell does no work.
pub fn cell_tenths(work: &[f64; 5], u: f64) -> [u32; 5] {
    let busy: f64 = work.iter().sum();
    let mut out = [0u32; 5];
    if busy <= 0.0 || u <= 0.0 {
        return out;
    }
    let total = ((busy / u * 10.0 - 1e-9).ceil() as u32).clamp(1, 10);
    let quota: Vec<f64> = work.iter().map(|w| w / busy * total as f64).collect();
    for k in 0..5 {
        out[k] = quota[k].floor() as u32;
    }
    let mut left = total - out.iter().sum::<u32>();
    let mut order: Vec<usize> = (0..5).filter(|&k| work[k] > 0.0).collect();
    order.sort_by(|&a, &b| {
        (quota[b] - quota[b].floor())
            .total_cmp(&(quota[a] - quota[a].floor()))
            .then(a.cmp(&b))
    });
    for k in order {
        if left == 0 {
            break;
        }
        out[k] += 1;
        left -= 1;
    }
    out
}

/// The overview: per rank, the window cut into buckets of [`BUCKET_PX`] pixels; a bucket is
/// a stack of its kinds, each as tall as its share of the bucket's time in tenths
/// ([`cell_tenths`]), top down in [`OpKind::ALL`] order, the rest of the lane idle, so a
/// mixed steady state shows as mixed. Equal neighbours merge, each kind one rect whose
/// tooltip gives the run's busy share and work by kind.
fn draw_overview(s: &mut String, program: &Program, timeline: &Timeline, rows: &[usize], f: Frame) {
    let buckets = (f.plot_w / BUCKET_PX).floor().max(1.0) as usize;
    let span = f.to - f.from;
    let u = span / buckets as f64;
    let t0 = origin(timeline);
    let _ = writeln!(
        s,
        r##"<g class="overview" data-buckets="{buckets}" font-size="10">"##
    );
    if span <= 0.0 {
        let _ = writeln!(s, "</g>");
        return;
    }
    let bw = f.plot_w / buckets as f64;
    for (j, &r) in rows.iter().enumerate() {
        let work = bucket_work(program, timeline, r, f.from, u, buckets, t0);
        let y = f.top + j as f64 * f.row_h + f.gap / 2.0;
        let h = f.row_h - f.gap;
        let look: Vec<[u32; 5]> = work.iter().map(|w| cell_tenths(w, u)).collect();
        let mut b = 0;
        while b < buckets {
            if look[b] == [0; 5] {
                b += 1;
                continue;
            }
            let mut e = b + 1;
            while e < buckets && look[e] == look[b] {
                e += 1;
            }
            let mut total = [0.0f64; 5];
            for w in &work[b..e] {
                for k in 0..5 {
                    total[k] += w[k];
                }
            }
            let busy: f64 = total.iter().sum();
            let mut parts: Vec<(usize, f64)> = (0..5)
                .filter(|&k| total[k] > 0.0)
                .map(|k| (k, total[k]))
                .collect();
            parts.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let shares: Vec<String> = parts
                .iter()
                .map(|&(k, t)| format!("{} {:.0}%", OpKind::ALL[k].letter(), t / busy * 100.0))
                .collect();
            let (a, z) = (f.from + b as f64 * u, f.from + e as f64 * u);
            let mut top = 0u32;
            for (k, &t) in look[b].iter().enumerate() {
                if t == 0 {
                    continue;
                }
                let kind = OpKind::ALL[k];
                let _ = writeln!(
                    s,
                    r##"<rect class="bucket {}" data-tenths="{t}" x="{}" y="{}" width="{}" height="{}" fill="{}"><title>rank {r}, {} – {}: busy {:.0}%, {}</title></rect>"##,
                    kind.letter(),
                    px(f.left + b as f64 * bw),
                    px(y + h * top as f64 / 10.0),
                    px((e - b) as f64 * bw),
                    px(h * t as f64 / 10.0),
                    fill(kind, false).0,
                    fmt_num(a),
                    fmt_num(z),
                    busy / (z - a) * 100.0,
                    shares.join(" ")
                );
                top += t;
            }
            b = e;
        }
    }
    let _ = writeln!(s, "</g>");
}

/// Busy time per kind in each of `buckets` buckets of `u` from `from` (times from the origin
/// `t0`) on rank `r`.
fn bucket_work(
    program: &Program,
    timeline: &Timeline,
    r: usize,
    from: f64,
    u: f64,
    buckets: usize,
    t0: f64,
) -> Vec<[f64; 5]> {
    let mut work = vec![[0.0f64; 5]; buckets];
    let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
    for (ins, sp) in program.ranks[r].iter().zip(spans) {
        let Some(op) = &ins.as_compute() else {
            continue;
        };
        if !(sp.start.is_finite() && sp.end.is_finite()) {
            continue;
        }
        let (a, z) = (sp.start - t0 - from, sp.end - t0 - from);
        if z <= 0.0 || a >= buckets as f64 * u {
            continue;
        }
        let k = OpKind::of(op) as usize;
        let b0 = ((a / u).floor().max(0.0) as usize).min(buckets - 1);
        let b1 = ((z / u).ceil().max(0.0) as usize).min(buckets);
        for (b, w) in work.iter_mut().enumerate().take(b1).skip(b0) {
            let o = z.min((b + 1) as f64 * u) - a.max(b as f64 * u);
            if o > 0.0 {
                w[k] += o;
            }
        }
    }
    work
}

#[cfg(test)]
mod tests {
    use super::cell_tenths;

    /// Hand-derived cells: 50/50 is 5 and 5; a third and two thirds of a full cell is 3.33
    /// and 6.67 tenths, the spare tenth to the larger remainder; a cell 12% busy rounds up to
    /// two tenths and one exactly 10% busy is one; an idle cell is empty.
    #[test]
    fn cells_share_their_tenths() {
        assert_eq!(
            cell_tenths(&[1.0, 1.0, 0.0, 0.0, 0.0], 2.0),
            [5, 5, 0, 0, 0]
        );
        assert_eq!(
            cell_tenths(&[1.0, 2.0, 0.0, 0.0, 0.0], 3.0),
            [3, 7, 0, 0, 0]
        );
        assert_eq!(
            cell_tenths(&[0.0, 0.12, 0.0, 0.0, 0.0], 1.0),
            [0, 2, 0, 0, 0]
        );
        assert_eq!(
            cell_tenths(&[0.0, 0.1, 0.0, 0.0, 0.0], 1.0),
            [0, 1, 0, 0, 0]
        );
        assert_eq!(cell_tenths(&[0.0; 5], 1.0), [0; 5]);
    }
}
