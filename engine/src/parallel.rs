//! One worker over several ranks: the collectives they meet in ([`collective`]), the
//! expert-parallel MoE over them ([`expert`]) or its experts sliced over them ([`sliced`]),
//! tensor-parallel attention ([`tensor`]), the
//! engine threads that step together ([`ranks`]) and the group as a worker sees it
//! ([`group`]).

pub mod collective;
pub mod expert;
pub mod group;
pub mod ranks;
pub mod sliced;
pub mod tensor;
