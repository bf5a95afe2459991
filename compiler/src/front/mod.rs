//! The front end: what users write or other tools wrote. Megatron layout strings ([`layout`])
//! and torch's schedule CSV files ([`torch_csv`], the importer) become checked values the
//! compiler trusts.

pub mod layout;
pub mod torch_csv;
