//! One worker over several ranks: the collectives they meet in ([`collective`]) and the
//! expert-parallel MoE over them ([`expert`]).

pub mod collective;
pub mod expert;
