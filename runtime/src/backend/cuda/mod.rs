//! The CUDA + NCCL backend (cargo feature `cuda`).
//!
//! Pure parts, compiled and tested everywhere: [`probe`] (finding the CUDA and NCCL libraries
//! before cudarc would panic on their absence), [`launch`] (torchrun/Slurm variables and the TCP
//! rendezvous that shares NCCL's unique id) and [`kernels`] (the NVRTC source). The device code
//! needs the `cuda` feature; cudarc loads every library at run time, so `cargo build --features
//! cuda` succeeds on machines without CUDA.

pub mod kernels;
pub mod launch;
pub mod probe;

#[cfg(feature = "cuda")]
pub mod comm;
#[cfg(feature = "cuda")]
pub mod device;
#[cfg(feature = "cuda")]
pub mod model;
