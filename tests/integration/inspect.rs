//! Inspection at real sizes (issue #17): `compare` on equal models, `show` columns checked
//! against the simulated timeline by independent code, one named bubble, checked costs, exit
//! codes, and CSV input wherever `check` takes it.

use assert_cmd::Command;
use pipec::simulate::cost::{CostModel, StageCosts};
use pipec::simulate::timeline::Timeline;
use pipec::{Instr, Program};
use pipec_schedules::Compute;
use std::path::{Path, PathBuf};

fn pipec() -> Command {
    let mut c = Command::from_std(pipec_tests::pipec());
    c.env_remove("NO_COLOR").env_remove("COLUMNS");
    c
}

fn stdout(c: &mut Command) -> String {
    let out = c.assert().success().get_output().stdout.clone();
    String::from_utf8(out).expect("utf-8")
}

fn compiled(tmp: &Path, name: &str, args: &[&str]) -> PathBuf {
    let dir = tmp.join(name);
    pipec()
        .arg("compile")
        .args(args)
        .arg("-o")
        .arg(&dir)
        .assert()
        .success();
    dir
}

/// The rows of a `compare` table after its header line, as whitespace-split cells.
fn table_rows(out: &str) -> Vec<Vec<String>> {
    let mut lines = out.lines().skip_while(|l| !l.starts_with("schedule"));
    lines.next().expect("table header");
    lines
        .take_while(|l| !l.starts_with('*'))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// The example: without a layout every candidate gets the same 16 decoder layers, so
/// 1F1B's makespan is the published `(m + p - 1)(F + B)` with two layers per stage (F = 2,
/// B = 4), 426 rather than the 213 of a half-size model, and ZB-V beats it.
#[test]
fn compare_builds_every_schedule_on_the_same_model() {
    let out = stdout(pipec().args([
        "compare",
        "--schedule",
        "1f1b",
        "--schedule",
        "zb-v",
        "--schedule",
        "interleaved-1f1b",
        "--pp",
        "8",
        "--vpp",
        "2",
        "--microbatches",
        "64",
    ]));
    assert!(out.contains("same for every schedule"), "{out}");
    let rows = table_rows(&out);
    assert_eq!(rows.len(), 3, "{out}");
    // Cells: name (4 words), model (2), instrs, makespan, vs first, ...
    for r in &rows {
        assert_eq!(r[4..6], ["16".to_string(), "t".to_string()], "{out}");
        assert!(!r[8].ends_with('*'), "{out}");
    }
    let (p, m, f, b) = (8.0, 64.0, 2.0, 4.0);
    assert_eq!(rows[0][7], format!("{}", (m + p - 1.0) * (f + b)), "{out}");
    let zbv: f64 = rows[1][8].trim_end_matches('x').parse().unwrap();
    assert!(zbv < 1.0, "zb-v must beat 1f1b on the same model: {out}");

    // --num-layers picks the model; an uneven split is refused as invalid input.
    let out = stdout(pipec().args([
        "compare",
        "--schedule",
        "1f1b",
        "--schedule",
        "gpipe",
        "--pp",
        "4",
        "--microbatches",
        "8",
        "--num-layers",
        "8",
    ]));
    assert!(table_rows(&out).iter().all(|r| r[4] == "8"), "{out}");
    pipec()
        .args([
            "compare",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "6",
        ])
        .assert()
        .code(1);
}

/// Directories of different models are flagged, not ranked.
#[test]
fn compare_flags_rows_of_different_models() {
    let tmp = tempfile::tempdir().unwrap();
    let small = compiled(
        tmp.path(),
        "small",
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
    );
    let big = compiled(
        tmp.path(),
        "big",
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--num-layers",
            "4",
        ],
    );
    let out = stdout(pipec().arg("compare").arg(&small).arg(&big));
    let rows = table_rows(&out);
    assert!(rows[1].iter().any(|c| c.ends_with("x*")), "{out}");
    assert!(out.contains("not comparable"), "{out}");
}

/// `--num-layers` without `--layout` builds that model instead of being ignored.
#[test]
fn num_layers_without_layout_splits_the_layers() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "nl",
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "16",
            "--mtp-num-layers",
            "1",
        ],
    );
    let loaded = pipec::back::files::load_dir(&d).unwrap();
    let layout = &loaded.manifest.layout;
    assert_eq!(layout.count(pipec::front::layout::LayerKind::Decoder), 16);
    assert_eq!(layout.count(pipec::front::layout::LayerKind::Mtp), 1);
    pipec()
        .args([
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--num-layers",
            "6",
            "-o",
        ])
        .arg(tmp.path().join("bad"))
        .assert()
        .code(1);
}

// ---------------------------------------------------------------------------------------------
// `show`: every column against the simulated timeline.

/// The simulated timeline of a compiled directory under the default costs.
pub(crate) fn timeline_of(dir: &Path) -> (Program, Timeline) {
    let loaded = pipec::back::files::load_dir(dir).unwrap();
    let costs = StageCosts::new(
        &CostModel::default(),
        &loaded.manifest.layout,
        loaded.program.num_stages(),
    );
    let sim =
        pipec::simulate::simulate_unverified(&pipec_tests::unverified(&loaded.program), &costs)
            .unwrap();
    (loaded.program, sim.timeline)
}

fn kind_letter(op: &Compute) -> char {
    match op {
        Compute::Fwd(_) => 'F',
        Compute::Bwd(_) => 'B',
        Compute::BwdD(_) => 'I',
        Compute::BwdW(_) => 'W',
        Compute::FwdBwd { .. } => 'X',
    }
}

/// Check the rank rows of `show --no-color` output against the timeline, by brute force, with
/// the geometry and rules docs/views.md states: the window fills all `width - label - 3` columns;
/// a column is idle (`.`) when less than half busy; it belongs to an op (its label and `-`
/// fill) when that op covers at least half of it, more than any other; otherwise a kind's
/// letter when that kind does 3/4 of the work of the column and of the three columns centred
/// on it, else `+`; a run of `+` starts with its work by kind (`B67%F33%`, as many as fit).
pub(crate) fn check_rows(
    out: &str,
    program: &Program,
    timeline: &Timeline,
    width: usize,
    ranks: &[usize],
    from: f64,
    to: Option<f64>,
) {
    let label_w = format!("rank {}", program.ranks.len() - 1).len();
    let cols = width - label_w - 3;
    let makespan = timeline.makespan();
    let span = to.unwrap_or(makespan).min(makespan) - from;
    let u = span / cols as f64;
    let rows: Vec<&str> = out.lines().filter(|l| l.contains(" │")).collect();
    assert_eq!(rows.len(), ranks.len(), "{out}");
    let eps = 1e-9 * (1.0 + makespan);
    for (&r, row) in ranks.iter().zip(&rows) {
        assert!(
            row.trim_start().starts_with(&format!("rank {r} │")),
            "{row}"
        );
        let cells: Vec<char> = row.split('│').nth(1).expect("row body").chars().collect();
        assert_eq!(cells.len(), cols, "rank {r} at width {width}: {row}");
        // Per column: each op's overlap, and the work per kind letter.
        let ops: Vec<(usize, &Compute, f64, f64)> = program.ranks[r]
            .iter()
            .zip(&timeline.ranks[r])
            .enumerate()
            .filter_map(|(i, (ins, s))| match ins {
                Instr::Compute(op) => Some((i, op, s.start, s.end)),
                _ => None,
            })
            .collect();
        let col = |c: usize| {
            let (a, b) = (from + c as f64 * u, from + (c + 1) as f64 * u);
            let mut per_op: Vec<(usize, f64)> = Vec::new();
            let mut by_kind: Vec<(char, f64)> = Vec::new();
            for &(i, op, s, e) in &ops {
                let o = e.min(b) - s.max(a);
                if o > 0.0 {
                    per_op.push((i, o));
                    let k = kind_letter(op);
                    match by_kind.iter_mut().find(|(x, _)| *x == k) {
                        Some(x) => x.1 += o,
                        None => by_kind.push((k, o)),
                    }
                }
            }
            (per_op, by_kind)
        };
        let work: Vec<_> = (0..cols).map(col).collect();
        let busy = |c: usize| work[c].1.iter().map(|k| k.1).sum::<f64>();
        let top = |c: usize| work[c].0.iter().map(|o| o.1).fold(0.0, f64::max);
        let share = |c: usize, k: char| work[c].1.iter().find(|x| x.0 == k).map_or(0.0, |x| x.1);
        // Whether kind `k` may be drawn as a lone letter in crowded column `c`.
        let dominant = |c: usize, k: char, slack: f64| {
            let (a, b) = (c.saturating_sub(1), (c + 2).min(cols));
            let near: f64 = (a..b).map(|j| share(j, k)).sum();
            let near_busy: f64 = (a..b).map(busy).sum();
            share(c, k) >= 0.75 * busy(c) - slack && near >= 0.75 * near_busy - slack
        };
        let ctx = |c: usize| {
            format!(
                "rank {r} column {c} [{}, {}) width {width}: {:?} in {row}",
                from + c as f64 * u,
                from + (c + 1) as f64 * u,
                work[c]
            )
        };
        let crowded = |c: usize| {
            assert!(busy(c) >= u / 2.0 - eps, "{}", ctx(c));
            assert!(top(c) <= u / 2.0 + eps, "{}", ctx(c));
        };
        let mut c = 0;
        while c < cols {
            let ch = cells[c];
            if ch == '.' {
                assert!(busy(c) <= u / 2.0 + eps, "{}", ctx(c));
                c += 1;
                continue;
            }
            // A run of mixed columns: its label (if any), then `+`.
            let is_item = |j: usize| {
                let mut k = j + 1;
                while k < cols && cells[k].is_ascii_digit() {
                    k += 1;
                }
                cells[j].is_ascii_alphabetic() && k > j + 1 && k < cols && cells[k] == '%'
            };
            if ch == '+' || is_item(c) {
                let start = c;
                let mut label = String::new();
                while c < cols && is_item(c) {
                    while cells[c] != '%' {
                        label.push(cells[c]);
                        c += 1;
                    }
                    label.push('%');
                    c += 1;
                }
                while c < cols && cells[c] == '+' {
                    c += 1;
                }
                for (j, w) in work.iter().enumerate().take(c).skip(start) {
                    crowded(j);
                    for &(k, _) in &w.1 {
                        assert!(!dominant(j, k, -eps), "{k} dominates: {}", ctx(j));
                    }
                }
                if !label.is_empty() {
                    // The run's work by kind, largest first, whole percents.
                    let mut total: Vec<(char, f64)> = Vec::new();
                    for w in &work[start..c] {
                        for &(k, t) in &w.1 {
                            match total.iter_mut().find(|x| x.0 == k) {
                                Some(x) => x.1 += t,
                                None => total.push((k, t)),
                            }
                        }
                    }
                    let sum: f64 = total.iter().map(|x| x.1).sum();
                    let order = "FBIWX";
                    total.sort_by(|a, b| {
                        b.1.total_cmp(&a.1)
                            .then(order.find(a.0).cmp(&order.find(b.0)))
                    });
                    let want: String = total
                        .iter()
                        .map(|&(k, t)| format!("{k}{}%", (t / sum * 100.0).round()))
                        .collect();
                    assert!(
                        want.starts_with(&label),
                        "run label {label:?}, work {want:?}: {}",
                        ctx(start)
                    );
                }
                continue;
            }
            assert!(ch.is_ascii_alphabetic(), "{}", ctx(c));
            let letter = ch.to_ascii_uppercase();
            // An op's run: its label (letter, digits) and `-` fill.
            let start = c;
            c += 1;
            while c < cols && (cells[c].is_ascii_digit() || cells[c] == '/' || cells[c] == '-') {
                c += 1;
            }
            let text: String = cells[start..c].iter().collect();
            let label = text.trim_end_matches('-').to_ascii_uppercase();
            let as_op = ops.iter().any(|&(i, op, _, _)| {
                let l = pipec::back::view::op_label(op);
                kind_letter(op) == letter
                    && (label == l || label.len() == 1)
                    && (start..c).all(|j| {
                        let o = work[j].0.iter().find(|x| x.0 == i).map_or(0.0, |x| x.1);
                        o >= u / 2.0 - eps && o >= top(j) - eps
                    })
            });
            let as_kind =
                c == start + 1 && top(start) <= u / 2.0 + eps && dominant(start, letter, eps);
            assert!(
                as_op || as_kind,
                "{text:?} is neither an op's run nor a dominant kind: {}",
                ctx(start)
            );
        }
    }
}

#[test]
fn show_columns_agree_with_the_simulated_timeline_at_every_width() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: [(&str, &[&str]); 5] = [
        ("1f1b", &["--pp", "8", "--microbatches", "64"]),
        (
            "interleaved-1f1b",
            &[
                "--pp",
                "4",
                "--vpp",
                "2",
                "--microbatches",
                "8",
                "--layout",
                "Et|tt|tt|tt|tt|tt|tt|tL",
            ],
        ),
        ("zb-h1", &["--pp", "4", "--microbatches", "12"]),
        ("zb-v", &["--pp", "4", "--microbatches", "8"]),
        ("dualpipe", &["--pp", "4", "--microbatches", "8"]),
    ];
    for (kind, args) in cases {
        let mut a = vec!["--schedule", kind];
        a.extend_from_slice(args);
        let d = compiled(tmp.path(), kind, &a);
        let (program, timeline) = timeline_of(&d);
        let all: Vec<usize> = (0..program.ranks.len()).collect();
        for width in [30usize, 80, 117, 200, 400] {
            let out = stdout(pipec().arg("show").arg(&d).args([
                "--no-color",
                "--width",
                &width.to_string(),
            ]));
            check_rows(&out, &program, &timeline, width, &all, 0.0, None);
        }
        // A window and a choice of ranks.
        let to = (timeline.makespan() * 0.6).round();
        let from = (timeline.makespan() * 0.2).round();
        let out = stdout(pipec().arg("show").arg(&d).args([
            "--no-color",
            "--width",
            "90",
            "--ranks",
            "1,3",
            "--from",
            &from.to_string(),
            "--to",
            &to.to_string(),
        ]));
        check_rows(&out, &program, &timeline, 90, &[1, 3], from, Some(to));
    }
}

#[test]
fn show_refuses_bad_windows_and_widths() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "s",
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
    );
    for bad in [
        &["--width", "0"][..],
        &["--ranks", "2"],
        &["--ranks", "1-0"],
        &["--from", "5", "--to", "5"],
        &["--from", "1000"],
    ] {
        pipec()
            .arg("show")
            .arg(&d)
            .args(bad)
            .assert()
            .code(2)
            .stderr(predicates::str::starts_with("error:"));
    }
}

// ---------------------------------------------------------------------------------------------
// One bubble, checked costs, exit codes, CSV input.

#[test]
fn every_output_names_its_bubble() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "s",
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
    );
    let def = pipec::simulate::BUBBLE;
    assert!(stdout(pipec().arg("simulate").arg(&d)).contains(def));
    assert!(stdout(pipec().arg("show").arg(&d)).contains(def));
    assert!(stdout(pipec().arg("compare").arg(&d)).contains(def));
    let json: serde_json::Value =
        serde_json::from_str(&stdout(pipec().arg("simulate").arg(&d).arg("--json"))).unwrap();
    assert_eq!(json["bubble"], def);
}

#[test]
fn costs_are_finite_and_in_range_and_bad_input_exits_1() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "s",
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
    );
    for cost in ["f=1e308,b=1e308", "f=1e13", "b=1e-12", "f=x"] {
        for cmd in ["show", "simulate"] {
            pipec()
                .arg(cmd)
                .arg(&d)
                .args(["--cost", cost])
                .assert()
                .code(1)
                .stderr(predicates::str::starts_with("error:"));
        }
    }
    pipec()
        .args([
            "compare",
            "--schedule",
            "nope",
            "--pp",
            "2",
            "--microbatches",
            "2",
        ])
        .assert()
        .code(1);
    pipec()
        .args([
            "compile",
            "--schedule",
            "nope",
            "--pp",
            "2",
            "--microbatches",
            "2",
            "-o",
        ])
        .arg(tmp.path().join("x"))
        .assert()
        .code(1);
    // Usage stays 2.
    pipec().args(["compare", "--bogus-flag"]).assert().code(2);
}

/// A torch CSV without the `.csv` extension is still a CSV (detected by content), and every
/// viewer takes what `check` takes.
#[test]
fn viewers_accept_torch_csv_like_check() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "s",
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
    );
    let csv = tmp.path().join("schedule.txt");
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "torch-csv", "-o"])
        .arg(&csv)
        .assert()
        .success();
    pipec().arg("check").arg(&csv).assert().success();
    pipec().arg("show").arg(&csv).assert().success();
    pipec()
        .arg("simulate")
        .arg(&csv)
        .args(["--pp", "2"])
        .assert()
        .success();
    pipec()
        .arg("export")
        .arg(&csv)
        .args(["--format", "svg"])
        .assert()
        .success();
    // --pp applies to CSV input only.
    pipec()
        .arg("show")
        .arg(&d)
        .args(["--pp", "2"])
        .assert()
        .code(2);
}

/// Export, import with the layout, compare: the same schedule at 1.00x on the same model.
#[test]
fn csv_round_trip_keeps_the_layout_with_import_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let layout = "Ett|tt|tt|ttL";
    let d = compiled(
        tmp.path(),
        "s",
        &[
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "8",
            "--layout",
            layout,
        ],
    );
    let csv = tmp.path().join("s.csv");
    pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "torch-csv", "-o"])
        .arg(&csv)
        .assert()
        .success();
    let back = tmp.path().join("back");
    pipec()
        .arg("import")
        .arg(&csv)
        .args(["--layout", layout, "-o"])
        .arg(&back)
        .assert()
        .success();
    let out = stdout(pipec().arg("compare").arg(&d).arg(&back));
    let rows = table_rows(&out);
    assert!(rows[1].contains(&"1.00x".to_string()), "{out}");
    pipec()
        .arg("import")
        .arg(&csv)
        .args(["--layout", "Et|tL", "-o"])
        .arg(tmp.path().join("bad"))
        .assert()
        .code(1);
}

// ---------------------------------------------------------------------------------------------
// Exports: filters, flags that apply or are refused.

#[test]
fn export_filters_keep_the_ranks_and_window_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "s",
        &["--schedule", "1f1b", "--pp", "4", "--microbatches", "8"],
    );
    let (program, timeline) = timeline_of(&d);
    let (from, to) = (6.0, 15.0);
    // Expected, counted here: spans of ranks 1 and 2 meeting [from, to].
    let meets = |r: usize, compute: bool| {
        program.ranks[r]
            .iter()
            .zip(&timeline.ranks[r])
            .filter(|(i, s)| {
                (!compute || matches!(i, Instr::Compute(_))) && s.end >= from && s.start <= to
            })
            .count()
    };
    let args = [
        "--ranks",
        "1-2",
        "--from",
        &from.to_string(),
        "--to",
        &to.to_string(),
    ];
    let trace: serde_json::Value = serde_json::from_str(&stdout(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "chrome-trace"])
            .args(args),
    ))
    .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    for r in [0usize, 1, 2, 3] {
        let slices = events
            .iter()
            .filter(|e| e["ph"] == "X" && e["tid"] == r as u64)
            .count();
        let want = if r == 1 || r == 2 { meets(r, false) } else { 0 };
        assert_eq!(slices, want, "rank {r}");
    }
    // Compute only: no comm slices and no arrows.
    let trace: serde_json::Value = serde_json::from_str(&stdout(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "chrome-trace", "--compute-only"])
            .args(args),
    ))
    .unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    assert!(events.iter().all(|e| e["cat"] != "comm" && e["ph"] != "s"));
    assert_eq!(
        events.iter().filter(|e| e["ph"] == "X").count(),
        meets(1, true) + meets(2, true)
    );
    // The SVG: one op rect per kept compute op, rows for the kept ranks only.
    let svg = stdout(
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", "svg"])
            .args(args),
    );
    assert_eq!(
        svg.matches("<rect class=\"op ").count(),
        meets(1, true) + meets(2, true)
    );
    assert_eq!(svg.matches("<rect class=\"lane\"").count(), 2);
    assert!(svg.contains("showing 2 of 4 ranks"));
}

#[test]
fn export_refuses_flags_that_do_not_apply() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "s",
        &["--schedule", "1f1b", "--pp", "2", "--microbatches", "4"],
    );
    for (format, flags) in [
        ("svg", &["--condense", "stage"][..]),
        ("chrome-trace", &["--svg-width", "800"]),
        ("dot", &["--compute-only"]),
        ("dot", &["--ranks", "0"]),
        ("torch-csv", &["--from", "1"]),
        ("svg", &["--ranks", "5"]),
        ("svg", &["--from", "3", "--to", "2"]),
    ] {
        pipec()
            .arg("export")
            .arg(&d)
            .args(["--format", format])
            .args(flags)
            .assert()
            .code(2)
            .stderr(predicates::str::starts_with("error:"));
    }
}

/// The verdict line of a wide pipeline lists a few peaks, not one per rank.
#[test]
fn compile_keeps_its_verdict_line_short_at_large_pp() {
    let tmp = tempfile::tempdir().unwrap();
    let out = stdout(
        pipec()
            .args([
                "compile",
                "--schedule",
                "gpipe",
                "--pp",
                "64",
                "--microbatches",
                "1",
                "-o",
            ])
            .arg(tmp.path().join("wide")),
    );
    let verdict = out.lines().find(|l| l.starts_with("verified")).unwrap();
    assert!(verdict.contains("64 ranks; pipec check"), "{verdict}");
    assert!(verdict.len() < 200, "{verdict}");
}

/// Progress goes to a terminal only: piped, a compile writes nothing on stderr.
#[test]
fn no_progress_output_when_stderr_is_not_a_terminal() {
    let tmp = tempfile::tempdir().unwrap();
    pipec()
        .args([
            "compile",
            "--schedule",
            "1f1b",
            "--pp",
            "4",
            "--microbatches",
            "64",
            "-o",
        ])
        .arg(tmp.path().join("s"))
        .assert()
        .success()
        .stderr("");
}

/// At real sizes the default trace stays openable: smaller than 100 MiB, with a note saying
/// what was kept; `--full` is the way to everything. (pp=64, vpp=8, M=512: about 250 MB whole.)
#[test]
fn a_large_trace_is_cut_to_an_openable_size_with_a_note() {
    let tmp = tempfile::tempdir().unwrap();
    let d = compiled(
        tmp.path(),
        "big",
        &[
            "--schedule",
            "interleaved-1f1b",
            "--pp",
            "64",
            "--vpp",
            "8",
            "--microbatches",
            "512",
            "--format",
            "bin",
        ],
    );
    let out = tmp.path().join("big.json");
    let assert = pipec()
        .arg("export")
        .arg(&d)
        .args(["--format", "chrome-trace", "-o"])
        .arg(&out)
        .assert()
        .success();
    let err = String::from_utf8_lossy(&assert.get_output().stderr).to_string();
    assert!(err.contains("too big to open; kept"), "{err}");
    let size = std::fs::metadata(&out).unwrap().len();
    assert!(size < 100 << 20, "{size} bytes");
    assert!(size > 10 << 20, "kept far less than it could: {size} bytes");
}

/// "1 ranks" no more.
#[test]
fn compile_counts_in_words() {
    let tmp = tempfile::tempdir().unwrap();
    let out = stdout(
        pipec()
            .args([
                "compile",
                "--schedule",
                "gpipe",
                "--pp",
                "1",
                "--microbatches",
                "1",
                "-o",
            ])
            .arg(tmp.path().join("one")),
    );
    assert!(out.contains(": 1 rank, 1 stage, "), "{out}");
    // The verifier's verdict too.
    assert!(out.contains("verified: 1 rank, 2 instructions, "), "{out}");
}
