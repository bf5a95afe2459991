//! The front end: what users write. Megatron layout strings ([`layout`]) and sweep files of
//! many compile requests ([`sweep`]) become checked values the compiler trusts.

pub mod layout;
pub mod sweep;
