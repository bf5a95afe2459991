//! When each instruction ran: the shared currency of the simulator (predicted times) and the
//! runtime (measured times), so both feed the same views (terminal timeline, Chrome trace, SVG).

use serde::{Deserialize, Serialize};

/// The unit of a timeline's clock.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TimeUnit {
    /// Units of the cost model (e.g. one forward of one layer = 1).
    Cost,
    /// Measured wall time in microseconds.
    Micros,
}

/// Start and end of one instruction. For a send or recv, `start` is when its batch was posted
/// and `end` when the batch completed.
#[derive(Copy, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Span {
    pub start: f64,
    pub end: f64,
}

/// `ranks[r][i]` is the span of instruction `i` of rank `r` in the program it describes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    pub unit: TimeUnit,
    pub ranks: Vec<Vec<Span>>,
}

impl Timeline {
    /// The end of the last instruction on any rank.
    pub fn makespan(&self) -> f64 {
        self.ranks
            .iter()
            .flatten()
            .map(|s| s.end)
            .fold(0.0, f64::max)
    }
}
