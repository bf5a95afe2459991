//! `pipec calibrate`: per-layer-kind costs from a measured timeline.
