//! One worker over several ranks: the collectives they meet in ([`collective`]), the
//! expert-parallel MoE over them ([`expert`]) and the engine threads that step together
//! ([`ranks`]).

pub mod collective;
pub mod expert;
pub mod group;
pub mod ranks;
