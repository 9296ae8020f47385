//! Support for the kvdir fuzz targets (`fuzz_targets/`): a reference model of DESIGN §2 to check
//! `directory_ops` against, and a MessagePack writer for the event batches it sends.
//!
//! Both are written from the design, not from `kvdir`'s code or its tests, so that a bug shared
//! by the two would have to be made twice.

pub mod check;
pub mod model;
pub mod wire;
