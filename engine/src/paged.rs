//! Request state in pages: the layout of a page and a slot, the store that keeps sequences'
//! state in a page pool, and the prefix cache over page-aligned blocks.

pub mod codec;
pub mod layout;
pub mod prefix;
pub mod store;
