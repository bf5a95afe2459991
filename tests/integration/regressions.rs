//! One test per crash the fuzzers (`fuzz/`) found, named after the bug, with the minimized
//! input. Each reproduces the input through the same entry point the fuzz target drives.
