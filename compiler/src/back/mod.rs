//! Back ends: what the compiler writes. Versioned instruction files ([`files`]), torch's
//! pipelining CSV ([`torch`], also read back), and the views ([`view`]: terminal timeline,
//! Chrome trace, SVG, DOT).

pub use pipec_ir::files;
pub mod torch;
pub mod view;
