//! The tuner's answer for people and programs: the winner's JSON report, run instructions,
//! file header, a candidate named in words ([`describe`]) and memory figures ([`fmt_mem`]).

use crate::greedy;
use crate::request::{Candidate, CandidateKind, Tuned};
use pipec_compiler::target::{self, Target, TargetChoice};
use pipec_ir::ir::Program;
use pipec_ir::verify::Report;
use pipec_schedules::layout::Layout;
use pipec_schedules::P2pGroups;

impl Tuned {
    /// The winner's program.
    pub fn program(&self) -> &Program {
        self.verified.program()
    }

    /// The verifier's report on it.
    pub fn report(&self) -> &Report {
        self.verified.report()
    }

    /// What `pipec tune --json` prints and `pipec.tune` returns: the choice, its layout
    /// string, makespan against the lower bound, bubble, peak memory per rank, every
    /// candidate weighed, the verdict, and `seconds` (how long the search took); with lengths,
    /// `microbatch_order` (the user's ids in the order they enter) and the rule that gave it.
    pub fn json(&self, seconds: f64) -> serde_json::Value {
        self.json_for(seconds, None)
    }

    /// [`Tuned::json`] with the run instructions naming `dir` (the `-o` directory).
    pub fn json_for(&self, seconds: f64, dir: Option<&str>) -> serde_json::Value {
        let run: serde_json::Map<String, serde_json::Value> = self
            .run_targets()
            .into_iter()
            .map(|t| {
                (
                    t.name().to_string(),
                    serde_json::json!(self.how_to_run(t, dir)),
                )
            })
            .collect();
        let mut out = serde_json::json!({
            "schedule": {
                "kind": self.best.schedule,
                "vpp": self.best.vpp,
                "group_size": self.best.group_size,
                "placement": self.best.placement,
                "heuristic": self.best.heuristic,
                "heuristic_description": self.heuristic_description(),
            },
            "layout": self.best.layout,
            "makespan": self.best.makespan,
            "planned_makespan": self.planned_makespan,
            "lower_bound": self.lower_bound.value,
            "lower_bound_parts": self.lower_bound,
            "bubble": self.summary.mean_bubble(),
            "bubble_per_rank": self.summary.ranks.iter().map(|r| r.bubble_ratio).collect::<Vec<_>>(),
            "peak_memory": self.peak_memory,
            "host_peak_memory": self.host_peak_memory,
            "target": match self.target {
                TargetChoice::One(t) => serde_json::json!(t.name()),
                TargetChoice::Every => serde_json::Value::Null,
            },
            "runs_on": self.runs_on.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "not_runnable_on": self
                .not_runnable_on
                .iter()
                .map(|(t, why)| (t.name().to_string(), serde_json::json!(why)))
                .collect::<serde_json::Map<_, _>>(),
            "run": run,
            "not_planned": self
                .skipped
                .iter()
                .map(|(n, why)| serde_json::json!({"schedule": n, "reason": why}))
                .collect::<Vec<_>>(),
            "candidates": self.candidates,
            "verdict": self.report().verdict_line(),
            "seconds": seconds,
        });
        if let (false, Some(map)) = (self.per_target.is_empty(), out.as_object_mut()) {
            map.insert("per_target".into(), self.per_target_json());
        }
        if let (true, Some(map)) = (self.copy_speed_assumed, out.as_object_mut()) {
            map.insert("copy_speed".into(), serde_json::json!(COPY_ASSUMED));
        }
        // With lengths (issue #38): the order microbatches enter the winner, the user's ids.
        if let (Some(o), Some(map)) = (&self.best.microbatch_order, out.as_object_mut()) {
            map.insert("microbatch_order".into(), serde_json::json!(o));
            map.insert(
                "microbatch_order_rule".into(),
                serde_json::json!(self.best.microbatch_order_rule),
            );
        }
        // The communicators it was verified under (`--p2p-groups`), as the manifest records
        // them: only when not the default, so the default's JSON is what it was.
        let groups = self.program().p2p_groups;
        if let (true, Some(map)) = (groups != P2pGroups::Pair, out.as_object_mut()) {
            map.insert("p2p_groups".into(), serde_json::json!(groups.name()));
        }
        out
    }

    /// `per_target` of the JSON: per framework, its own best plan (`schedule` in words,
    /// `layout`, `makespan`, `peak_memory` and `host_peak_memory` per rank, `levers`) and
    /// `gives_up`, how much longer the common plan is than it (`common / own - 1`); or
    /// `error`, why that framework has no plan.
    pub fn per_target_json(&self) -> serde_json::Value {
        let map: serde_json::Map<String, serde_json::Value> = self
            .per_target
            .iter()
            .map(|(t, r)| {
                let v = match r {
                    Ok(b) => {
                        let mut v = serde_json::json!({
                            "schedule": describe(&b.best),
                            "layout": b.best.layout,
                            "makespan": b.best.makespan,
                            "peak_memory": b.peak_memory,
                            "host_peak_memory": b.host_peak_memory,
                            "levers": b.best.levers,
                            "gives_up": self.gives_up(b),
                        });
                        if let (true, Some(m)) = (b.copy_speed_assumed, v.as_object_mut()) {
                            m.insert("copy_speed".into(), serde_json::json!(COPY_ASSUMED));
                        }
                        v
                    }
                    Err(e) => serde_json::json!({ "error": e }),
                };
                (t.name().to_string(), v)
            })
            .collect();
        serde_json::Value::Object(map)
    }

    /// How much longer the common plan is than a framework's own best: `common / own - 1`
    /// (0 when they are equally fast; 0 for an own makespan of 0).
    pub fn gives_up(&self, own: &crate::request::TargetBest) -> f64 {
        if own.best.makespan > 0.0 {
            self.best.makespan / own.best.makespan - 1.0
        } else {
            0.0
        }
    }

    /// The targets whose run instructions the report gives: the one asked for; every
    /// framework that runs the winner for `any` and for the default (which is every framework,
    /// less those that cannot run such a plan at all: microbatch lengths, P2P groups they do
    /// not create; [`TargetChoice::refusal`]).
    pub fn run_targets(&self) -> Vec<Target> {
        match self.target {
            TargetChoice::One(Target::Any) => self.runs_on.clone(),
            TargetChoice::One(t) => vec![t],
            TargetChoice::Every => Target::FRAMEWORKS
                .into_iter()
                .filter(|t| self.runs_on.contains(t))
                .collect(),
        }
    }

    /// How to run the winner on `t`, one line per step; `dir` is where its files are.
    pub fn how_to_run(&self, t: Target, dir: Option<&str>) -> Vec<String> {
        target::how_to_run(
            t,
            &target::Winner {
                spec: self.spec.as_ref(),
                placement: &self.program().placement,
                microbatches: self.program().microbatches,
                layout: &self.best.layout,
                dir: dir.unwrap_or("DIR"),
                program: self.program(),
                stages: &self.layout.stages,
            },
        )
    }

    /// The winning heuristic of the tuned scheduler, in words.
    pub fn heuristic_description(&self) -> Option<String> {
        let name = self.best.heuristic.as_ref()?;
        greedy::heuristics()
            .into_iter()
            .flat_map(|h| [h, greedy::Heuristic { w_next: true, ..h }])
            .find(|h| &h.name() == name)
            .map(|h| h.describe())
    }

    /// Stages of the winner's layout that hold no layer at all (fewer decoder layers than
    /// stages): the report says so, since such a stage's rank only passes tensors on.
    pub fn empty_stages(&self) -> usize {
        self.layout.stages.iter().filter(|s| s.is_empty()).count()
    }

    /// The name the written files carry in the manifest's `plan` (`tuned loop vpp=2`, `1f1b +
    /// offload 3`, as the report's `schedule:` line): a plan no `schedule` spec names, a plan
    /// of the tuner's own or a built-in kind fitted with levers; `None` for a built-in kind as
    /// generated (its spec names it). Viewers and Python title the plan by it, so its kind
    /// and chunks per rank are not lost to "tuned schedule".
    pub fn plan_name(&self) -> Option<String> {
        self.spec.is_none().then(|| describe(&self.best))
    }

    /// The layout the written files carry: the chosen split, with its Megatron string.
    pub fn file_layout(&self) -> Layout {
        Layout {
            text: Some(self.best.layout.clone()),
            stages: self.layout.stages.clone(),
        }
    }

    /// The header of the written files (`layout` from [`Tuned::file_layout`]): a built-in
    /// kind that won is `generated` with its spec; a plan of the tuner's own is `tuned`.
    pub fn header<'a>(&self, layout: &'a Layout) -> pipec_ir::files::Header<'a> {
        pipec_ir::files::Header {
            source: if self.spec.is_some() {
                "generated"
            } else {
                "tuned"
            },
            schedule: self.spec,
            layout,
        }
    }
}

/// What the report says when the winner offloads and no copy speed was given.
pub const COPY_ASSUMED: &str = "assumed: no `pcie` or `offload` cost given, so each copy to or from host memory takes one forward of the layers it copies (PipeOffload's experiments span 0.25 to 3 forwards); give `pcie` (the host link's bandwidth) for the makespan to mean what it says";

/// Above this many rows (after merging identical ones) the report's table shows the best row of
/// each kind and placement unless every row is asked for (`pipec tune --all`): under a tight
/// limit the table otherwise reaches 50 rows of variants that lost (issue #40).
pub const LONG_TABLE: usize = 20;

/// The rows of the report's candidates table ([`Tuned::table_rows`]).
#[derive(Debug)]
pub struct TableRows<'a> {
    /// The rows to print, the winner first, then the table's order (those the target runs,
    /// then those that fit, then by makespan).
    pub rows: Vec<&'a Candidate>,
    /// Rows dropped as the same plan as an earlier row.
    pub merged: usize,
    /// Rows left out of a long table (not the best of their kind and placement).
    pub hidden: usize,
}

/// Two candidates are the same plan when kind, vpp, group size, placement, heuristic, layout,
/// microbatch order and levers agree: the rest (makespan, peak) follows from those.
fn same_plan(a: &Candidate, b: &Candidate) -> bool {
    a.schedule == b.schedule
        && a.vpp == b.vpp
        && a.group_size == b.group_size
        && a.placement == b.placement
        && a.heuristic == b.heuristic
        && a.layout == b.layout
        && a.microbatch_order == b.microbatch_order
        && a.microbatch_order_rule == b.microbatch_order_rule
        && a.levers == b.levers
}

impl Tuned {
    /// The report's table: every candidate once (a plan weighed twice is one row), the winner
    /// first (the table's own order ranks by makespan alone, while the winner is chosen with
    /// ties broken by peak and verified in full, so it need not lead), and, unless `all`, a
    /// table longer than [`LONG_TABLE`] cut to the first (best) row of each schedule kind and
    /// placement. The JSON's `candidates` keep every candidate, in the table's order.
    pub fn table_rows(&self, all: bool) -> TableRows<'_> {
        let mut rows: Vec<&Candidate> = Vec::with_capacity(self.candidates.len() + 1);
        let winner = self
            .candidates
            .iter()
            .find(|c| same_plan(c, &self.best))
            .unwrap_or(&self.best);
        rows.push(winner);
        let mut merged = 0;
        for c in &self.candidates {
            if std::ptr::eq(c, winner) {
                continue;
            }
            if rows.iter().any(|r| same_plan(r, c)) {
                merged += 1;
            } else {
                rows.push(c);
            }
        }
        let mut hidden = 0;
        if !all && rows.len() > LONG_TABLE {
            let before = rows.len();
            let mut kept: Vec<&Candidate> = Vec::new();
            for c in rows {
                if !kept
                    .iter()
                    .any(|k| k.schedule == c.schedule && k.placement == c.placement)
                {
                    kept.push(c);
                }
            }
            hidden = before - kept.len();
            rows = kept;
        }
        TableRows {
            rows,
            merged,
            hidden,
        }
    }
}

/// `zb-v`, `interleaved-1f1b vpp=2 g=16`, `tuned loop vpp=1`.
pub fn describe(c: &Candidate) -> String {
    let mut s = c.schedule.name().to_string();
    if c.schedule == CandidateKind::Tuned {
        s.push_str(&format!(" {} vpp={}", c.placement, c.vpp));
    } else if c.vpp > 1 && c.placement == "loop" {
        s.push_str(&format!(" vpp={}", c.vpp));
    }
    if let Some(g) = c.group_size {
        s.push_str(&format!(" g={g}"));
    }
    if let Some(l) = &c.levers {
        let (o, r): (u64, u64) = (l.offloaded.iter().sum(), l.recomputed.iter().sum());
        if o > 0 {
            s.push_str(&format!(" + offload {o}"));
        }
        if r > 0 {
            s.push_str(&format!(" + recompute {r}"));
        }
    }
    s
}

/// A memory figure for people: GiB/MiB when the model's memory is in bytes, else a number.
pub fn fmt_mem(x: f64, bytes: bool) -> String {
    let unit = if bytes {
        pipec_ir::memory::Unit::Bytes
    } else {
        pipec_ir::memory::Unit::LayerActivations
    };
    unit.with_unit(x)
}
