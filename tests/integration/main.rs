//! pipec's one integration-test binary (ripgrep style): end-to-end, CLI and conformance tests.

mod cuda;
mod docs;
mod layout;
mod megatron;
mod runtime;
mod schedules;
mod sweep;
mod torch;
mod verify;
mod views;
