//! `pipec calibrate`: per-layer-kind costs fitted to a measured timeline.
//!
//! Two trace formats are read (both Chrome trace JSON, `{"traceEvents": [...]}` or a bare
//! array): `pipec-run --trace` output (a compute event carries `args.ops`, each
//! `{"pass", "stage", "mb"}`), and a torch profiler trace of torch.distributed.pipelining's
//! runtime, whose actions are `record_function("PP:<stage><F|I|W|B><mb>")` spans (`F`
//! forward, `I` input gradient, `W` weight gradient, `B` full backward). Only complete events
//! (`"ph": "X"`) with one pass are used; durations are in microseconds.
//!
//! The model: a pass of stage `s` takes `sum over kinds K of n(s, K) * c(K, pass)`, with `n`
//! the layer counts of the layout. For each pass the costs `c(., pass)` are the non-negative
//! least-squares fit over every event (kinds that never occur keep no value). Where the trace
//! has only full backwards, `b` and `w` cannot be told apart: their sum is fitted and split
//! evenly, and the result says so.

use pipec_schedules::layout::{LayerKind, Layout};
use serde::Serialize;

/// The passes a fit distinguishes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Measured {
    Fwd,
    BwdD,
    BwdW,
    /// A full backward (`bwd_D + bwd_W`).
    Bwd,
}

/// One measured pass.
#[derive(Copy, Clone, Debug, PartialEq, Serialize)]
pub struct Sample {
    pub pass: Measured,
    pub stage: u32,
    pub mb: u32,
    /// The pass's duration: milliseconds from [`samples`]; [`fit`] answers in the unit it is
    /// given (the CUDA backend's calibration passes its timeline's).
    pub dur: f64,
}

/// Fitted costs of one layer kind, in the samples' unit (`None`: no event informs it).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KindFit {
    pub kind: char,
    pub f: Option<f64>,
    pub b: Option<f64>,
    pub w: Option<f64>,
}

/// The result of a fit.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fit {
    pub kinds: Vec<KindFit>,
    pub samples: usize,
    /// Root-mean-square error of the fitted durations, in the samples' unit.
    pub rms_ms: f64,
    /// `rms_ms` over the mean fitted duration of a pass (the model's prediction for each
    /// event, averaged over the events; infinite when every prediction is 0). Above
    /// [`POOR_FIT`] the fit is poor ([`Fit::poor`]).
    pub relative_rms: f64,
    /// True when `b` and `w` were split evenly from full backwards.
    pub split_evenly: bool,
}

/// The relative rms error ([`Fit::relative_rms`]) above which a fit is reported as poor:
/// 10%. Repeated passes of one stage vary by a few percent on a steady run (clock and memory
/// jitter, the odd collective), which a good fit keeps well under this; an error of a tenth of
/// a pass or more means the per-kind model does not describe the trace (a wrong layout for
/// it, stragglers, passes that overlap other work), and its costs should not be trusted.
pub const POOR_FIT: f64 = 0.1;

/// Read the samples of a trace (durations in milliseconds). Errors name what is wrong.
pub fn samples(text: &str) -> Result<Vec<Sample>, String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not a JSON trace: {e}"))?;
    let events = match &v {
        serde_json::Value::Array(a) => a,
        serde_json::Value::Object(o) => o
            .get("traceEvents")
            .and_then(|e| e.as_array())
            .ok_or("no `traceEvents` array")?,
        _ => return Err("not a Chrome trace (an object with `traceEvents`, or an array)".into()),
    };
    let mut out = Vec::new();
    for e in events {
        if e.get("ph").and_then(|p| p.as_str()) != Some("X") {
            continue;
        }
        let Some(dur) = e.get("dur").and_then(|d| d.as_f64()) else {
            continue;
        };
        if !dur.is_finite() || dur < 0.0 {
            continue;
        }
        // pipec-run: args.ops = [{pass, stage, mb}].
        if let Some(ops) = e.pointer("/args/ops").and_then(|o| o.as_array()) {
            if ops.len() != 1 {
                continue;
            }
            let op = &ops[0];
            let pass = match op.get("pass").and_then(|p| p.as_str()) {
                Some("fwd") => Measured::Fwd,
                Some("bwd") => Measured::Bwd,
                Some("bwd_D") => Measured::BwdD,
                Some("bwd_W") => Measured::BwdW,
                _ => continue,
            };
            let (Some(stage), Some(mb)) = (
                op.get("stage").and_then(|s| s.as_u64()),
                op.get("mb").and_then(|s| s.as_u64()),
            ) else {
                continue;
            };
            out.push(Sample {
                pass,
                stage: stage as u32,
                mb: mb as u32,
                dur: dur / 1000.0,
            });
            continue;
        }
        // torch: "PP:<stage><F|I|W|B><mb>".
        if let Some(name) = e.get("name").and_then(|n| n.as_str()) {
            if let Some(s) = torch_action(name) {
                out.push(Sample {
                    dur: dur / 1000.0,
                    ..s
                });
            }
        }
    }
    if out.is_empty() {
        return Err("the trace has no compute events (pipec-run `args.ops`, or torch `PP:<stage><F|I|W|B><mb>` spans)".into());
    }
    Ok(out)
}

/// `PP:2F0` -> (F, stage 2, mb 0).
fn torch_action(name: &str) -> Option<Sample> {
    let a = name.strip_prefix("PP:")?.trim();
    let i = a.find(|c: char| !c.is_ascii_digit())?;
    let (stage, rest) = a.split_at(i);
    let mut chars = rest.chars();
    let pass = match chars.next()? {
        'F' => Measured::Fwd,
        'I' => Measured::BwdD,
        'W' => Measured::BwdW,
        'B' => Measured::Bwd,
        _ => return None,
    };
    let mb = chars.as_str();
    if mb.is_empty() || !mb.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    Some(Sample {
        pass,
        stage: stage.parse().ok()?,
        mb: mb.parse().ok()?,
        dur: 0.0,
    })
}

const KINDS: [LayerKind; 4] = [
    LayerKind::Embedding,
    LayerKind::Decoder,
    LayerKind::Mtp,
    LayerKind::Loss,
];

fn counts(layout: &Layout, stage: u32) -> Option<[f64; 4]> {
    let st = layout.stages.get(stage as usize)?;
    let mut c = [0.0; 4];
    for k in st {
        let i = KINDS.iter().position(|x| x == k).expect("a kind");
        c[i] += 1.0;
    }
    Some(c)
}

/// Non-negative least squares over the columns in `cols` (active-set: solve, drop the most
/// negative column, repeat). Returns per-column values (0 for dropped ones).
fn nnls(rows: &[([f64; 4], f64)], cols: &[usize]) -> [f64; 4] {
    let mut active: Vec<usize> = cols.to_vec();
    loop {
        let k = active.len();
        let mut x = [0.0; 4];
        if k == 0 {
            return x;
        }
        let mut a = vec![vec![0.0; k + 1]; k];
        for (feat, y) in rows {
            for i in 0..k {
                for j in 0..k {
                    a[i][j] += feat[active[i]] * feat[active[j]];
                }
                a[i][k] += feat[active[i]] * y;
            }
        }
        // Tiny ridge: collinear kinds (always together) share their time instead of failing.
        for (i, row) in a.iter_mut().enumerate() {
            row[i] += 1e-9;
        }
        // Gaussian elimination with partial pivoting.
        for c in 0..k {
            let p = (c..k)
                .max_by(|&i, &j| a[i][c].abs().total_cmp(&a[j][c].abs()))
                .unwrap_or(c);
            a.swap(c, p);
            let d = a[c][c];
            if d.abs() < 1e-300 {
                continue;
            }
            let pivot = a[c].clone();
            for (r, row) in a.iter_mut().enumerate() {
                if r != c {
                    let f = row[c] / d;
                    for (x, pv) in row.iter_mut().zip(&pivot).skip(c) {
                        *x -= f * pv;
                    }
                }
            }
        }
        let sol: Vec<f64> = (0..k)
            .map(|i| {
                if a[i][i].abs() < 1e-300 {
                    0.0
                } else {
                    a[i][k] / a[i][i]
                }
            })
            .collect();
        match (0..k)
            .filter(|&i| sol[i] < 0.0)
            .min_by(|&i, &j| sol[i].total_cmp(&sol[j]))
        {
            Some(i) => {
                active.remove(i);
            }
            None => {
                for (i, &c) in active.iter().enumerate() {
                    x[c] = sol[i];
                }
                return x;
            }
        }
    }
}

/// Fit per-kind costs to `samples` of a program laid out as `layout`, in the samples' unit.
/// The one calibrator: `pipec calibrate` fits traces with it, and the CUDA backend its own
/// measured timeline (`pipec_cuda::calibrate`).
pub fn fit(samples: &[Sample], layout: &Layout) -> Result<Fit, String> {
    let mut rows: [Vec<([f64; 4], f64)>; 4] = Default::default();
    for s in samples {
        let c = counts(layout, s.stage).ok_or_else(|| {
            format!(
                "the trace names stage {}, but the layout has {} stages",
                s.stage,
                layout.stages.len()
            )
        })?;
        let i = match s.pass {
            Measured::Fwd => 0,
            Measured::BwdD => 1,
            Measured::BwdW => 2,
            Measured::Bwd => 3,
        };
        rows[i].push((c, s.dur));
    }
    let present = |r: &[([f64; 4], f64)]| -> Vec<usize> {
        (0..4)
            .filter(|&k| r.iter().any(|(c, _)| c[k] > 0.0))
            .collect()
    };
    let solve = |r: &[([f64; 4], f64)]| -> Option<([f64; 4], Vec<usize>)> {
        if r.is_empty() {
            return None;
        }
        let cols = present(r);
        Some((nnls(r, &cols), cols))
    };
    let f = solve(&rows[0]);
    let split = !rows[1].is_empty() || !rows[2].is_empty();
    let (b, w) = if split {
        (solve(&rows[1]), solve(&rows[2]))
    } else {
        match solve(&rows[3]) {
            Some((x, cols)) => {
                let half = x.map(|v| v / 2.0);
                (Some((half, cols.clone())), Some((half, cols)))
            }
            None => (None, None),
        }
    };
    let pick = |fit: &Option<([f64; 4], Vec<usize>)>, k: usize| {
        fit.as_ref()
            .and_then(|(x, cols)| cols.contains(&k).then_some(x[k]))
    };
    let kinds: Vec<KindFit> = KINDS
        .iter()
        .enumerate()
        .map(|(k, kind)| KindFit {
            kind: kind.symbol(),
            f: pick(&f, k),
            b: pick(&b, k),
            w: pick(&w, k),
        })
        .filter(|k| k.f.is_some() || k.b.is_some() || k.w.is_some())
        .collect();
    // Residuals.
    let val = |fit: &Option<([f64; 4], Vec<usize>)>, c: &[f64; 4]| -> f64 {
        fit.as_ref()
            .map_or(0.0, |(x, _)| (0..4).map(|k| x[k] * c[k]).sum())
    };
    let mut se = 0.0;
    let mut fitted = 0.0;
    let mut n = 0usize;
    for (i, r) in rows.iter().enumerate() {
        for (c, y) in r {
            let pred = match i {
                0 => val(&f, c),
                1 => val(&b, c),
                2 => val(&w, c),
                _ => val(&b, c) + val(&w, c),
            };
            se += (pred - y) * (pred - y);
            fitted += pred;
            n += 1;
        }
    }
    let rms = if n > 0 { (se / n as f64).sqrt() } else { 0.0 };
    let mean = if n > 0 { fitted / n as f64 } else { 0.0 };
    Ok(Fit {
        kinds,
        samples: samples.len(),
        rms_ms: rms,
        relative_rms: if rms == 0.0 {
            0.0
        } else if mean > 0.0 {
            rms / mean
        } else {
            f64::INFINITY
        },
        split_evenly: !split,
    })
}

impl Fit {
    /// Whether the fit is poor: its rms error is more than [`POOR_FIT`] of the mean fitted
    /// pass.
    pub fn poor(&self) -> bool {
        self.relative_rms > POOR_FIT
    }

    /// The warning a poor fit gets (`None` for a good one), in milliseconds.
    pub fn warning(&self) -> Option<String> {
        self.poor().then(|| {
            let share = if self.relative_rms.is_finite() {
                format!("{:.0}% of the mean fitted pass", self.relative_rms * 100.0)
            } else {
                "larger than every fitted pass (all 0)".to_string()
            };
            format!(
                "poor fit: rms error {} ms is {share} (more than {:.0}%): the per-kind costs do not describe this trace; check the layout it was run with, and look for stragglers or passes that overlap other work",
                pipec_ir::human::num(self.rms_ms),
                POOR_FIT * 100.0
            )
        })
    }

    /// The fit as a cost spec (`t.f=1,t.b=2,...`), as [`crate::cost::CostModel::parse`]
    /// reads it, in the samples' unit.
    pub fn spec(&self) -> String {
        let mut parts = Vec::new();
        for k in &self.kinds {
            for (p, v) in [("f", k.f), ("b", k.b), ("w", k.w)] {
                if let Some(v) = v {
                    parts.push(format!("{}.{p}={}", k.kind, fmt6(v)));
                }
            }
        }
        parts.join(",")
    }
}

/// The fit as a cost file (`K.f = ...` lines, TOML), milliseconds, said by the key
/// `time_unit = "ms"`; a poor fit ([`Fit::warning`]) is said in a comment.
pub fn cost_file(fit: &Fit, source: &str) -> String {
    let mut s = format!(
        "# costs fitted by `pipec calibrate` from {source}: {} passes, rms error {} ms\n",
        fit.samples,
        pipec_ir::human::num(fit.rms_ms)
    );
    if let Some(w) = fit.warning() {
        s.push_str(&format!("# {w}\n"));
    }
    if fit.split_evenly {
        s.push_str(
            "# the trace has full backwards only: b and w are half of each fitted backward\n",
        );
    }
    // The unit as a key, so that `pcie = "25GB/s"` added to this file converts.
    s.push_str("time_unit = \"ms\"\n");
    for k in &fit.kinds {
        for (p, v) in [("f", k.f), ("b", k.b), ("w", k.w)] {
            if let Some(v) = v {
                s.push_str(&format!("{}.{p} = {}\n", k.kind, fmt6(v)));
            }
        }
    }
    s
}

/// Six significant decimals, no exponent (the cost parser's range).
fn fmt6(v: f64) -> String {
    let v = if v.abs() < crate::cost::MIN_VALUE {
        0.0
    } else {
        v
    };
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s.is_empty() || s == "-0" {
        "0".into()
    } else {
        s.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fits_known_costs_from_both_formats() {
        let layout = pipec_schedules::layout::parse("Ett|ttt|tL").unwrap();
        // E.f=0.5 t.f=1 L.f=2 (ms); b = 2x f; w = f.
        let truth = |stage: u32, pass: &str| -> f64 {
            let c = counts(&layout, stage).unwrap();
            let f = 0.5 * c[0] + 1.0 * c[1] + 2.0 * c[3];
            match pass {
                "fwd" => f,
                "bwd_D" => 2.0 * f,
                _ => f,
            }
        };
        let mut ev = Vec::new();
        let mut torch = Vec::new();
        for s in 0..3u32 {
            for mb in 0..4u32 {
                for (p, l) in [("fwd", 'F'), ("bwd_D", 'I'), ("bwd_W", 'W')] {
                    let us = truth(s, p) * 1000.0 * (1.0 + 0.01 * (mb as f64 - 1.5));
                    ev.push(format!(r#"{{"ph":"X","name":"x","dur":{us},"args":{{"ops":[{{"pass":"{p}","stage":{s},"mb":{mb}}}]}}}}"#));
                    torch.push(format!(r#"{{"ph":"X","name":"PP:{s}{l}{mb}","dur":{us}}}"#));
                }
            }
        }
        for text in [
            format!(r#"{{"traceEvents":[{}]}}"#, ev.join(",")),
            format!("[{}]", torch.join(",")),
        ] {
            let fit = fit(&samples(&text).unwrap(), &layout).unwrap();
            let t = fit.kinds.iter().find(|k| k.kind == 't').unwrap();
            assert!((t.f.unwrap() - 1.0).abs() < 1e-6, "{fit:?}");
            assert!((t.b.unwrap() - 2.0).abs() < 1e-6);
            let e = fit.kinds.iter().find(|k| k.kind == 'E').unwrap();
            assert!((e.f.unwrap() - 0.5).abs() < 1e-6);
            let l = fit.kinds.iter().find(|k| k.kind == 'L').unwrap();
            assert!((l.w.unwrap() - 2.0).abs() < 1e-6);
            let file = cost_file(&fit, "x");
            let mut m = crate::cost::CostModel::default();
            m.apply(&file, Some("fitted.toml")).unwrap();
            assert!((m.layer(LayerKind::Decoder).b - 2.0).abs() < 1e-5);
        }
        assert!(samples("{}").is_err());
        assert!(samples(r#"{"traceEvents":[]}"#).is_err());
        assert_eq!(torch_action("PP:12I3").unwrap().stage, 12);
        assert!(torch_action("PP:1RECV_F0").is_none());
    }
}
