//! pipec's one integration-test binary (ripgrep style): end-to-end, CLI and conformance tests.

mod docs;
mod layout;
mod megatron;
mod runtime;
mod schedules;
mod sweep;
mod torch;
mod verify;
mod views;
