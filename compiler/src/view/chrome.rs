//! Chrome / Perfetto traces in the Trace Event Format (`{"traceEvents": [...]}`), to open in
//! `ui.perfetto.dev` or `chrome://tracing`.
//!
//! One process (`pid`) per schedule, one thread (`tid`) per rank named `rank r`, one complete
//! event (`"ph": "X"`) per instruction (compute and comm), and one flow (`"s"` at the send,
//! `"f"` with `"bp": "e"` at the recv) per message. Simulated timelines are in cost units,
//! written as milliseconds (one cost unit = 1000 trace microseconds); measured ones keep their
//! microseconds. Times start at the timeline's earliest span.

use super::{comm_name, op_name, timeline_text::origin, Filter};
use pipec_cost::timeline::{TimeUnit, Timeline};
use pipec_ir::ir::Matching;
use pipec_ir::ir::{Instr, Program};
use pipec_schedules::Pass;
use std::fmt::Write as _;

/// Builds one trace from one or more (program, timeline) pairs, each its own process.
#[derive(Debug, Default)]
pub struct TraceBuilder {
    events: Vec<String>,
    next_pid: u32,
    next_flow: u64,
}

fn js(s: &str) -> String {
    serde_json::to_string(s).expect("strings serialize")
}

/// A timestamp in trace microseconds, at most 3 decimals, no trailing zeros.
fn ts(x: f64) -> String {
    if !x.is_finite() {
        return "0".to_string();
    }
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

impl TraceBuilder {
    pub fn new() -> Self {
        TraceBuilder::default()
    }

    /// Add one schedule as a process named `name`.
    pub fn add(&mut self, name: &str, program: &Program, timeline: &Timeline) {
        self.add_filtered(name, program, timeline, &Filter::default());
    }

    /// Add the part of one schedule that `filter` keeps; a message arrow is kept when both
    /// its ends are.
    pub fn add_filtered(
        &mut self,
        name: &str,
        program: &Program,
        timeline: &Timeline,
        filter: &Filter,
    ) {
        let pid = self.next_pid;
        self.next_pid += 1;
        let scale = match timeline.unit {
            TimeUnit::Cost => 1000.0,
            TimeUnit::Micros => 1.0,
        };
        let t0 = origin(timeline);
        let at = |x: f64| ts((x - t0) * scale);
        let dur = |a: f64, b: f64| ts(((b - a) * scale).max(0.0));
        self.events.push(format!(
            r#"{{"ph":"M","name":"process_name","pid":{pid},"args":{{"name":{}}}}}"#,
            js(name)
        ));
        self.events.push(format!(
            r#"{{"ph":"M","name":"process_sort_index","pid":{pid},"args":{{"sort_index":{pid}}}}}"#
        ));
        let rows = filter.rows(program.ranks.len());
        let mut kept_rank = vec![false; program.ranks.len()];
        for &r in &rows {
            kept_rank[r] = true;
        }
        let kept = |at: pipec_ir::ir::InstrRef, sp: pipec_cost::timeline::Span| {
            kept_rank.get(at.rank.index()).copied().unwrap_or(false)
                && filter.keeps(sp.start - t0, sp.end - t0)
        };
        // Copy-stream threads follow the ranks' (named only where a rank copies).
        let copy_tid = program.ranks.len();
        let mut copy_rows = vec![false; program.ranks.len()];
        for &r in &rows {
            let instrs = &program.ranks[r];
            self.events.push(format!(
                r#"{{"ph":"M","name":"thread_name","pid":{pid},"tid":{r},"args":{{"name":"rank {r}"}}}}"#
            ));
            self.events.push(format!(
                r#"{{"ph":"M","name":"thread_sort_index","pid":{pid},"tid":{r},"args":{{"sort_index":{r}}}}}"#
            ));
            let spans = timeline.ranks.get(r).map_or(&[][..], |v| v.as_slice());
            for (i, (ins, s)) in instrs.iter().zip(spans).enumerate() {
                if !filter.keeps(s.start - t0, s.end - t0)
                    || (filter.compute_only && ins.as_compute().is_none())
                {
                    continue;
                }
                let mut e = String::with_capacity(200);
                match ins {
                    // Copies on the rank's copy stream (a thread of its own, `rank R copy`),
                    // `wait_offload` and `recompute` on its compute stream.
                    Instr::Memory(m) => {
                        let (tid, cat) = match m.kind {
                            k if k.is_copy() => {
                                copy_rows[r] = true;
                                (copy_tid + r, "copy")
                            }
                            pipec_ir::ir::MemKind::Recompute => (r, "recompute"),
                            _ => (r, "memory"),
                        };
                        let _ = write!(
                            e,
                            r#"{{"ph":"X","name":{},"cat":"{cat}","pid":{pid},"tid":{tid},"ts":{},"dur":{},"args":{{"instr":{i},"stage":{},"mb":{}}}}}"#,
                            js(&comm_name(ins)),
                            at(s.start),
                            dur(s.start, s.end),
                            m.task.stage.0,
                            m.task.mb.0
                        );
                    }
                    Instr::Compute(_) | Instr::FwdCheckpoint(_) => {
                        let op = &ins.as_compute().expect("a compute op");
                        let parts: Vec<String> = op
                            .parts()
                            .map(|(p, t)| {
                                format!(
                                    r#"{{"pass":"{}","stage":{},"mb":{}}}"#,
                                    p.name(),
                                    t.stage.0,
                                    t.mb.0
                                )
                            })
                            .collect();
                        let cat = match op.parts().next().map(|(p, _)| p) {
                            Some(Pass::Fwd) if parts.len() == 1 => "forward",
                            Some(Pass::Fwd) => "overlapped",
                            _ => "backward",
                        };
                        let _ = write!(
                            e,
                            r#"{{"ph":"X","name":{},"cat":"{cat}","pid":{pid},"tid":{r},"ts":{},"dur":{},"args":{{"instr":{i},"ops":[{}]}}}}"#,
                            js(&op_name(op)),
                            at(s.start),
                            dur(s.start, s.end),
                            parts.join(",")
                        );
                    }
                    Instr::Send {
                        peer,
                        payload,
                        batch,
                        tokens,
                        ..
                    }
                    | Instr::Recv {
                        peer,
                        payload,
                        batch,
                        tokens,
                        ..
                    } => {
                        let kind = payload.kind.name();
                        // The message's size, when the plan knows its microbatches' lengths.
                        let size = tokens.map_or(String::new(), |t| format!(r#","tokens":{t}"#));
                        let _ = write!(
                            e,
                            r#"{{"ph":"X","name":{},"cat":"comm","pid":{pid},"tid":{r},"ts":{},"dur":{},"args":{{"instr":{i},"peer":{},"payload":"{kind}","stage":{},"mb":{},"batch":{batch}{size}}}}}"#,
                            js(&comm_name(ins)),
                            at(s.start),
                            dur(s.start, s.end),
                            peer.0,
                            payload.stage.0,
                            payload.mb.0
                        );
                    }
                    Instr::Wait { batch } => {
                        let _ = write!(
                            e,
                            r#"{{"ph":"X","name":"wait batch {batch}","cat":"comm","pid":{pid},"tid":{r},"ts":{},"dur":{},"args":{{"instr":{i},"batch":{batch}}}}}"#,
                            at(s.start),
                            dur(s.start, s.end),
                        );
                    }
                }
                self.events.push(e);
            }
        }
        for (r, _) in copy_rows.iter().enumerate().filter(|(_, &c)| c) {
            let tid = copy_tid + r;
            self.events.push(format!(
                r#"{{"ph":"M","name":"thread_name","pid":{pid},"tid":{tid},"args":{{"name":"rank {r} copy"}}}}"#
            ));
            self.events.push(format!(
                r#"{{"ph":"M","name":"thread_sort_index","pid":{pid},"tid":{tid},"args":{{"sort_index":{tid}}}}}"#
            ));
        }
        // Flows: send -> recv, bound to the enclosing comm slices.
        if filter.compute_only {
            return;
        }
        let matching = Matching::of(program);
        for (s, r) in matching.iter().flat_map(|m| m.messages(program)) {
            let (Some(ss), Some(rs)) = (span(timeline, s), span(timeline, r)) else {
                continue;
            };
            if !(kept(s, ss) && kept(r, rs)) {
                continue;
            }
            let Some(Instr::Send { payload, .. }) = program.get(s) else {
                continue;
            };
            let id = self.next_flow;
            self.next_flow += 1;
            let name = js(&format!(
                "{} s{} mb{}",
                payload.kind.name(),
                payload.stage.0,
                payload.mb.0
            ));
            // Inside the recv's slice: when the send was posted, or the recv's bounds.
            let f_at = ss.start.clamp(rs.start, rs.end.max(rs.start));
            self.events.push(format!(
                r#"{{"ph":"s","id":{id},"name":{name},"cat":"p2p","pid":{pid},"tid":{},"ts":{}}}"#,
                s.rank.0,
                at(ss.start)
            ));
            self.events.push(format!(
                r#"{{"ph":"f","bp":"e","id":{id},"name":{name},"cat":"p2p","pid":{pid},"tid":{},"ts":{}}}"#,
                r.rank.0,
                at(f_at)
            ));
        }
    }

    /// The trace document.
    pub fn finish(self) -> String {
        let mut out =
            String::with_capacity(self.events.iter().map(|e| e.len() + 2).sum::<usize>() + 64);
        out.push_str("{\"traceEvents\":[\n");
        for (i, e) in self.events.iter().enumerate() {
            out.push_str(e);
            if i + 1 < self.events.len() {
                out.push(',');
            }
            out.push('\n');
        }
        out.push_str("],\"displayTimeUnit\":\"ms\"}\n");
        out
    }
}

fn span(timeline: &Timeline, at: pipec_ir::ir::InstrRef) -> Option<pipec_cost::timeline::Span> {
    timeline
        .ranks
        .get(at.rank.index())?
        .get(at.index as usize)
        .copied()
}

/// A trace of one schedule. `name` names the process (e.g. `1f1b pp=4 m=8`).
pub fn chrome_trace(name: &str, program: &Program, timeline: &Timeline) -> String {
    chrome_trace_filtered(name, program, timeline, &Filter::default())
}

/// A trace of the part of one schedule that `filter` keeps.
pub fn chrome_trace_filtered(
    name: &str,
    program: &Program,
    timeline: &Timeline,
    filter: &Filter,
) -> String {
    let mut b = TraceBuilder::new();
    b.add_filtered(name, program, timeline, filter);
    b.finish()
}
