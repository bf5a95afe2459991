//! The measured timeline and its Chrome trace.

use crate::interp::RankRun;
use pipec::ir::Program;
use pipec::simulate::timeline::{TimeUnit, Timeline};

/// One span per instruction per rank, in microseconds, from the runs of (rank, run); a rank
/// of the `world` with no run (another process's) has none.
pub fn timeline(world: usize, runs: &[(u32, RankRun)]) -> Timeline {
    let mut ranks = vec![Vec::new(); world];
    for (r, run) in runs {
        ranks[*r as usize] = run.spans.clone();
    }
    Timeline {
        unit: TimeUnit::Micros,
        ranks,
    }
}

/// The measured timeline as a Chrome trace, in the same format as `pipec export --format
/// chrome-trace` (one event per instruction, send->recv flow arrows), so simulated and
/// measured timelines open side by side in Perfetto.
pub fn chrome_trace(program: &Program, timeline: &Timeline) -> String {
    pipec::back::view::chrome::chrome_trace("measured (pipec-run)", program, timeline)
}
