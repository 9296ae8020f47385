//! Support for the kvdir fuzz targets (`fuzz_targets/`): the reference model of DESIGN §2 to
//! check `directory_ops` against (the `kvdir-reference` crate, which the differential test uses
//! too), and a MessagePack writer for the event batches it sends.
//!
//! Both are written from the design, not from `kvdir`'s code, so that a bug shared by the two
//! would have to be made twice.

pub mod check;
pub mod wire;

/// The reference model, shared with the differential test (`kvdir-reference`).
pub use kvdir_reference as model;
