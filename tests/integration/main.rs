//! pipec's one integration-test binary (ripgrep style): end-to-end, CLI and conformance tests.

mod check_cli;
mod crates;
mod cuda;
mod cuda_kernels;
mod docs;
mod hostile;
mod inspect;
mod layout;
mod lowering;
mod megatron;
mod megatron_calls;
mod megatron_p2p;
mod megatron_recompute;
mod memory_runtime;
mod memory_units;
mod offload;
mod regressions;
mod runtime;
mod schedules;
mod sweep;
mod torch;
mod tune;
mod verdict;
mod verify;
mod verify_vs_run;
mod views;
