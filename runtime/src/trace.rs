//! The measured timeline and its Chrome trace.

use crate::interp::RankRun;
use pipec::ir::Program;
use pipec::simulate::timeline::{TimeUnit, Timeline};

/// One span per instruction per rank, in microseconds.
pub fn timeline(runs: &[RankRun]) -> Timeline {
    Timeline {
        unit: TimeUnit::Micros,
        ranks: runs.iter().map(|r| r.spans.clone()).collect(),
    }
}

/// The measured timeline as a Chrome trace, in the same format as `pipec export --format
/// chrome-trace` (one event per instruction, send->recv flow arrows), so simulated and
/// measured timelines open side by side in Perfetto.
pub fn chrome_trace(program: &Program, timeline: &Timeline) -> String {
    pipec::back::view::chrome::chrome_trace("measured (pipec-run)", program, timeline)
}
