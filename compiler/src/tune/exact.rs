//! Exact search for tiny instances (branch and bound).
