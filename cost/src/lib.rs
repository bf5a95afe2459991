//! pipec-cost: what a program costs. The cost language and its `[model]` shapes, the memory a
//! cost model gives each stage and rank, the calibration fit, and the event-driven simulator
//! with the timeline it produces.
//!
//! ```text
//! cost spec / file -> CostModel (cost, model) -> StageCosts -> simulate(Verified program) -> Timeline
//!                                             -> memory weights -> pipec_ir::memory peaks
//! measured timings -> calibrate::fit -> a cost spec
//! ```
//!
//! It reads programs (`pipec-ir`) and layouts (`pipec-schedules`) and knows nothing of how a
//! program was made, so the compiler's views, the tuner and the runtimes share one cost model
//! without depending on each other.

pub mod calibrate;
pub mod cost;
pub mod layer;
pub mod lengths;
pub mod memory;
pub mod model;
pub mod rounding;
pub mod simulate;
pub mod timeline;
