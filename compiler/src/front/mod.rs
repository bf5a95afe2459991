//! The front end: what users write or other tools wrote. Megatron layout strings ([`layout`])
//! and torch's schedule CSV files ([`torch_csv`], the importer) become checked values the
//! compiler trusts.

pub use pipec_schedules::layout;
pub mod torch_csv;
