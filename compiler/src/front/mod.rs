//! The front end: what users write. Megatron layout strings ([`layout`]) become checked values
//! the compiler trusts.

pub mod layout;
