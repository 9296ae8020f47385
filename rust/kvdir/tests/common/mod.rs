//! Shared test support: a tiny MessagePack writer for building SGLang event batches (the
//! reference model of the directory is the `kvdir-reference` crate).

pub mod msgpack;
