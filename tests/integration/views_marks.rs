//! `pipec show` against a brute-force reading of the simulated timeline (issue #40, "a picture
//! that lies"): every rank row, at many widths and cost mixes, equals the row this file
//! derives from the timeline's spans with the rule docs/views.md states, and 1F1B's steady
//! state is drawn alike on every rank.
//!
//! The reader shares nothing with the renderer but the names of things (which instruction is
//! which kind of work, an op's label, a stage's model chunk); the rule is written out here
//! from the documentation: a column `[from + c u, from + (c + 1) u)` is `.` when its busy
//! time is under half of `u`; else the letter of the kind with the most work (the first of
//! F, B, I, W, X on equal work) when that kind does more than 3/4 of the busy time, lowercase
//! when more than half of that work is on odd chunks; else `+`. A run of at least 6 `+`
//! names its work by kind after its first `+` when every kind of the run fits with a `+`
//! left after it. An op's run is the columns showing its own letter in which it does the most
//! work (the earlier op on equal work); it is labelled (`F5` then `-`) where its label and one
//! more column fit in the run.

use pipec_compiler::compile::{compile, CompileRequest};
use pipec_compiler::view::{chunk_of, chunks, drawn_compute, op_label, timeline_text, OpKind};
use pipec_cost::cost::{CostModel, StageCosts};
use pipec_cost::simulate::simulate;
use pipec_cost::timeline::Timeline;
use pipec_ir::Program;
use pipec_schedules::ScheduleKind;

/// The documented slack of threshold comparisons, relative to a column's length.
const SLACK: f64 = 1e-9;

/// The rows (the part between the borders) the documented rule gives for `ranks` at `width`
/// over the window `[from, to)` (times from the timeline's origin; `to` the end when `None`).
pub(crate) fn expected_rows(
    program: &Program,
    timeline: &Timeline,
    width: usize,
    ranks: &[usize],
    from: f64,
    to: Option<f64>,
) -> Vec<String> {
    let label_w = format!("rank {}", program.ranks.len() - 1).len();
    let cols = width.saturating_sub(label_w + 3).max(10);
    let t0 = timeline
        .ranks
        .iter()
        .flatten()
        .map(|s| s.start)
        .filter(|s| s.is_finite())
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let end = timeline.makespan() - t0;
    let to = to.unwrap_or(end).min(end);
    let u = (to - from) / cols as f64;
    let chunk = chunks(program);
    let letters = ['F', 'B', 'I', 'W', 'X'];
    ranks
        .iter()
        .map(|&r| {
            // Every drawn op of the rank: (instruction, kind, odd chunk, start, end).
            let ops: Vec<(usize, usize, bool, f64, f64)> = program.ranks[r]
                .iter()
                .zip(&timeline.ranks[r])
                .enumerate()
                .filter_map(|(i, (ins, s))| {
                    let op = drawn_compute(ins)?;
                    let k = OpKind::ALL
                        .iter()
                        .position(|&k| k == OpKind::of(&op))
                        .unwrap();
                    let odd = chunk_of(&op, &chunk) % 2 == 1;
                    Some((i, k, odd, s.start - t0, s.end - t0))
                })
                .collect();
            // Work and odd-chunk work per kind, per column, straight from the spans.
            let mut work = vec![[0.0f64; 5]; cols];
            let mut odd_work = vec![[0.0f64; 5]; cols];
            for (c, (w, ow)) in work.iter_mut().zip(odd_work.iter_mut()).enumerate() {
                let (a, b) = (from + c as f64 * u, from + (c + 1) as f64 * u);
                for &(_, k, odd, s, e) in &ops {
                    let o = e.min(b) - s.max(a);
                    if o > 0.0 {
                        w[k] += o;
                        if odd {
                            ow[k] += o;
                        }
                    }
                }
            }
            let mut row: Vec<char> = (0..cols)
                .map(|c| {
                    let busy: f64 = work[c].iter().sum();
                    if busy < u / 2.0 - SLACK * u {
                        return '.';
                    }
                    let mut d = 0;
                    for k in 0..5 {
                        if work[c][k] > work[c][d] {
                            d = k;
                        }
                    }
                    if work[c][d] > 0.75 * busy + SLACK * u {
                        if odd_work[c][d] * 2.0 > work[c][d] + SLACK * u {
                            letters[d].to_ascii_lowercase()
                        } else {
                            letters[d]
                        }
                    } else {
                        '+'
                    }
                })
                .collect();
            let marks = row.clone();
            // Mixed runs.
            let mut c = 0;
            while c < cols {
                let mut e = c + 1;
                while e < cols && marks[e] == marks[c] {
                    e += 1;
                }
                if marks[c] == '+' && e - c >= 6 {
                    let mut total = [0.0f64; 5];
                    for w in &work[c..e] {
                        for k in 0..5 {
                            total[k] += w[k];
                        }
                    }
                    let sum: f64 = total.iter().sum();
                    let mut order: Vec<usize> = (0..5).filter(|&k| total[k] > 0.0).collect();
                    order.sort_by(|&x, &y| total[y].total_cmp(&total[x]).then(x.cmp(&y)));
                    let label: String = order
                        .iter()
                        .map(|&k| (k, (total[k] / sum * 100.0).round()))
                        .filter(|&(_, p)| p >= 1.0)
                        .map(|(k, p)| format!("{}{}%", letters[k], p))
                        .collect();
                    if label.len() + 2 <= e - c {
                        for (j, ch) in label.chars().enumerate() {
                            row[c + 1 + j] = ch;
                        }
                    }
                }
                c = e;
            }
            // Op runs: the columns showing an op's own letter in which it does the most work
            // (the earlier op unless a later one does more).
            let owner: Vec<Option<usize>> = (0..cols)
                .map(|c| {
                    let (a, b) = (from + c as f64 * u, from + (c + 1) as f64 * u);
                    let mut top: Option<(usize, f64)> = None;
                    for (j, &(_, _, _, s, e)) in ops.iter().enumerate() {
                        let o = e.min(b) - s.max(a);
                        if o > 0.0 && top.is_none_or(|(_, t)| o > t + SLACK * u) {
                            top = Some((j, o));
                        }
                    }
                    let (j, _) = top?;
                    let (_, k, odd, _, _) = ops[j];
                    let own = if odd {
                        letters[k].to_ascii_lowercase()
                    } else {
                        letters[k]
                    };
                    (marks[c] == own).then_some(j)
                })
                .collect();
            let mut c = 0;
            while c < cols {
                let mut e = c + 1;
                while e < cols && owner[e] == owner[c] {
                    e += 1;
                }
                if let Some(j) = owner[c] {
                    let (i, _, odd, _, _) = ops[j];
                    let op = drawn_compute(&program.ranks[r][i]).unwrap();
                    let mut label = op_label(&op);
                    if odd {
                        label = label.to_lowercase();
                    }
                    if label.len() < e - c {
                        for (x, ch) in label
                            .chars()
                            .chain(std::iter::repeat('-'))
                            .enumerate()
                            .take(e - c)
                        {
                            row[c + x] = ch;
                        }
                    }
                }
                c = e;
            }
            row.into_iter().collect()
        })
        .collect()
}

/// The rank rows of `show --no-color` output (or `render` without colour): the text between
/// the borders, in order.
pub(crate) fn drawn_rows(out: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.trim_start().starts_with("rank ") && l.contains(" │"))
        .map(|l| {
            l.split('│')
                .nth(1)
                .expect("a row between borders")
                .to_string()
        })
        .collect()
}

fn timeline(kind: ScheduleKind, pp: u32, vpp: u32, m: u32, cost: &str) -> (Program, Timeline) {
    let c = compile(&CompileRequest {
        vpp: Some(vpp),
        ..CompileRequest::new(kind, pp, m)
    })
    .expect("valid spec");
    let model = CostModel::parse(cost).expect("cost spec");
    let costs = StageCosts::new(&model, &c.layout, c.program.num_stages());
    let sim = simulate(&pipec_tests::verified(&c.program), &costs).expect("runs");
    (c.program, sim.timeline)
}

fn render(program: &Program, timeline: &Timeline, width: usize) -> String {
    timeline_text::render(
        program,
        timeline,
        &timeline_text::TextOptions {
            width,
            ..Default::default()
        },
    )
}

/// The cost mixes of issue #40: equal passes, a full backward of 2 + 1, and real-looking costs
/// with communication time.
const MIXES: [&str; 3] = ["f=1,b=1,w=1", "f=1,b=2", "f=1,b=1.5,w=0.7,p2p=0.1"];

#[test]
fn show_rows_equal_a_brute_force_reading_of_the_timeline() {
    let cases: [(ScheduleKind, u32, u32, u32, usize); 4] = [
        (ScheduleKind::OneFOneB, 8, 1, 64, 1),
        (ScheduleKind::Interleaved1F1B, 4, 2, 8, 3),
        (ScheduleKind::ZbH1, 4, 1, 12, 3),
        (ScheduleKind::DualPipe, 4, 1, 8, 5),
    ];
    let mut labelled = [0usize; 2];
    for (kind, pp, vpp, m, step) in cases {
        for cost in MIXES {
            let (program, tl) = timeline(kind, pp, vpp, m, cost);
            let all: Vec<usize> = (0..program.ranks.len()).collect();
            for width in (80..=200).step_by(step) {
                let out = render(&program, &tl, width);
                let got = drawn_rows(&out);
                let want = expected_rows(&program, &tl, width, &all, 0.0, None);
                assert_eq!(got, want, "{kind:?} {cost} at {width}:\n{out}");
                labelled[0] += got.iter().filter(|r| r.contains('%')).count();
                labelled[1] += got.iter().filter(|r| r.contains("-")).count();
            }
        }
    }
    // Both kinds of label occur, so the label rules are exercised, not only the marks.
    assert!(labelled[0] > 0 && labelled[1] > 0, "{labelled:?}");
}

/// The columns of rank `r`'s steady state in 1F1B: from the end of its first backward to the
/// start of its last forward, so that each column lies within alternating F and B.
fn steady_columns(program: &Program, tl: &Timeline, r: usize, width: usize) -> (usize, usize) {
    let label_w = format!("rank {}", program.ranks.len() - 1).len();
    let cols = width - label_w - 3;
    let u = tl.makespan() / cols as f64;
    let spans: Vec<(char, f64, f64)> = program.ranks[r]
        .iter()
        .zip(&tl.ranks[r])
        .filter_map(|(i, s)| {
            let op = drawn_compute(i)?;
            Some((OpKind::of(&op).letter(), s.start, s.end))
        })
        .collect();
    let first_b_end = spans.iter().find(|s| s.0 == 'B').unwrap().2;
    let last_f_start = spans.iter().rev().find(|s| s.0 == 'F').unwrap().1;
    (
        (first_b_end / u).ceil() as usize,
        (last_f_start / u).floor() as usize,
    )
}

/// Issue #40's Done-when, as far as a picture of columns can meet it: 1F1B at pp=8, M=64, at
/// widths 80 to 200 under each cost mix. The steady state does one forward to one backward on
/// every rank, shifted in time from rank to rank. The rule reads a column's work alone, so the
/// same work is drawn the same way on every rank (the brute-force test above); what can still
/// differ is where the column edges fall in the cycle, and the picture says what each column
/// holds. So on every rank, every steady column is `F`, `B` or `+` (or a label's character);
/// no rank's steady state is drawn as one kind throughout (five ranks were solid `B` at 80
/// columns, three solid `+`): each shows `+` or both letters; and where a column is exactly
/// one cycle (80 columns: 213 units over 71 columns with F 1 and B 2 in each, or 284 units
/// with F 1 and B 3, exactly 3/4, which is mixed) every rank's steady state is the same run
/// of `+`.
#[test]
fn one_f_one_b_steady_state_is_drawn_alike_on_every_rank() {
    for cost in MIXES {
        let (program, tl) = timeline(ScheduleKind::OneFOneB, 8, 1, 64, cost);
        for width in 80..=200 {
            let out = render(&program, &tl, width);
            let rows = drawn_rows(&out);
            for (r, row) in rows.iter().enumerate() {
                let (a, b) = steady_columns(&program, &tl, r, width);
                let steady: Vec<char> = row.chars().collect::<Vec<_>>()[a..b].to_vec();
                assert!(
                    steady.iter().all(|&ch| "FB+-%0123456789".contains(ch)),
                    "rank {r} {cost} at {width}: {row}"
                );
                let marks: std::collections::BTreeSet<char> = steady
                    .iter()
                    .copied()
                    .filter(|c| "FB+".contains(*c))
                    .collect();
                assert!(
                    marks.contains(&'+') || marks.len() == 2,
                    "rank {r} {cost} at {width}: one kind throughout: {row}"
                );
                if cost != MIXES[2] && width == 80 {
                    // Past the run's label, every steady column is `+`.
                    assert!(steady[12..].iter().all(|&ch| ch == '+'), "rank {r}: {row}");
                }
            }
        }
    }
}
