//! Shared test support: a clean-room reference model of the directory and a tiny MessagePack
//! writer for building SGLang event batches.

pub mod msgpack;
pub mod reference;
