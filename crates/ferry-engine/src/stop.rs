//! Stop strings over streamed text: the matcher lives in `ferry-core` (the router applies stop
//! strings too, without linking the engine); re-exported here so engine code reads unchanged.

pub use ferry_core::stop::*;
