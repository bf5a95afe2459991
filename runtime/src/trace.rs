//! The measured timeline and its Chrome trace.

use crate::interp::RankRun;
use pipec::program::{Instr, Program};
use pipec::timeline::{TimeUnit, Timeline};
use serde_json::{json, Value};

/// One span per instruction per rank, in microseconds.
pub fn timeline(runs: &[RankRun]) -> Timeline {
    Timeline {
        unit: TimeUnit::Micros,
        ranks: runs.iter().map(|r| r.spans.clone()).collect(),
    }
}

/// Chrome's Trace Event Format (`{"traceEvents": [...]}`): one complete (`"X"`) event per
/// instruction with `ts`/`dur` in microseconds, `pid` 0 and `tid` = rank, plus thread-name
/// metadata so viewers label rows `rank r`. Opens in chrome://tracing and Perfetto.
// LEAD: replace with pipec::emit::chrome
pub fn chrome_trace(program: &Program, timeline: &Timeline) -> String {
    let mut events: Vec<Value> = Vec::new();
    for r in 0..program.ranks.len() {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": r,
            "args": {"name": format!("rank {r}")}
        }));
    }
    for (r, (instrs, spans)) in program.ranks.iter().zip(&timeline.ranks).enumerate() {
        for (i, (ins, s)) in instrs.iter().zip(spans).enumerate() {
            let cat = match ins {
                Instr::Compute(_) => "compute",
                Instr::Send { .. } => "send",
                Instr::Recv { .. } => "recv",
            };
            let mut args = json!({"index": i});
            if let Some(b) = ins.batch() {
                args["batch"] = json!(b);
            }
            events.push(json!({
                "name": ins.to_string(),
                "cat": cat,
                "ph": "X",
                "ts": ns(s.start),
                "dur": ns((s.end - s.start).max(0.0)),
                "pid": 0,
                "tid": r,
                "args": args,
            }));
        }
    }
    let mut out = serde_json::to_string(&json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
    }))
    .expect("trace serializes");
    out.push('\n');
    out
}

/// Microseconds rounded to whole nanoseconds, so the file does not carry float noise.
fn ns(us: f64) -> f64 {
    (us * 1000.0).round() / 1000.0
}
