//! pipec's one integration-test binary (ripgrep style): end-to-end, CLI and conformance tests.

mod check;
mod crates;
mod cuda;
mod cuda_kernels;
mod cuda_memory;
mod docs;
mod group_interleaved;
mod harness;
mod layout;
mod lowering;
mod megatron;
mod megatron_calls;
mod megatron_p2p;
mod megatron_recompute;
mod memory;
mod regressions;
mod runtime;
mod schedules;
mod sweep;
mod torch;
mod tune;
mod tune_levers;
mod verify;
mod verify_vs_run;
mod views;
mod violations;
