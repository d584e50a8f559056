//! Deliberate faults, for proving that `pdctl verify` and the tests catch a cluster that
//! produces wrong answers. Set `PDSERVE_INJECT_FAULT` to one of the names below before a worker
//! starts; the worker logs a warning at start and then misbehaves in exactly that way. Never
//! set in production: a faulty worker returns plausible-looking garbage on purpose (or, with
//! `slow-load`, starts slowly on purpose).

use crate::env;

/// One kind of deliberate corruption.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Prefill: flips a byte of the first state page it sends for each request.
    FlipPageByte,
    /// Prefill: never sends the state slot (the compressors' unfinished windows).
    DropSlot,
    /// Prefill: writes the first two pages of each request's state into each other's place.
    SwapPages,
    /// Decode: hands a generated token to a different concurrent request (batch mix-up).
    ReorderBatch,
    /// Decode: the engine thread stops answering one second after start, as if wedged (the
    /// watchdog must notice).
    StallEngine,
    /// Decode, over several ranks: the rank of the first request to start decoding stops
    /// answering, as if its GPU hung (the worker must fail its requests within the rank
    /// timeout, that one included, and report itself failed).
    StallRank,
    /// Either role: pauses [`SLOW_LOAD_PER_SHARD`] after each checkpoint shard is loaded, so
    /// tests can watch a worker in its loading state without depending on disk speed.
    SlowLoad,
}

/// How long `slow-load` pauses per shard: long enough for a test to look at a loading cluster
/// through a router polling its workers, short enough for a test (the test checkpoints have
/// two shards).
pub const SLOW_LOAD_PER_SHARD: std::time::Duration = std::time::Duration::from_millis(2500);

/// Why `PDSERVE_INJECT_FAULT` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    /// The name is none of [`Fault::ALL`]'s.
    #[error("{}: unknown fault {name:?} (known: {})", env::INJECT_FAULT, Fault::names().join(", "))]
    Unknown { name: String },
}

impl Fault {
    /// Every fault with its name.
    pub const ALL: [(&'static str, Fault); 7] = [
        ("flip-page-byte", Fault::FlipPageByte),
        ("drop-slot", Fault::DropSlot),
        ("swap-pages", Fault::SwapPages),
        ("reorder-batch", Fault::ReorderBatch),
        ("stall-engine", Fault::StallEngine),
        ("stall-rank", Fault::StallRank),
        ("slow-load", Fault::SlowLoad),
    ];

    /// The fault named by `PDSERVE_INJECT_FAULT`, if any; an unknown name is an error.
    pub fn from_env() -> Result<Option<Fault>, FaultError> {
        match std::env::var(env::INJECT_FAULT) {
            Err(_) => Ok(None),
            Ok(name) if name.is_empty() => Ok(None),
            Ok(name) => Self::parse(&name).map(Some),
        }
    }

    /// The fault called `name`.
    pub fn parse(name: &str) -> Result<Fault, FaultError> {
        Self::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| *f)
            .ok_or_else(|| FaultError::Unknown {
                name: name.to_owned(),
            })
    }

    /// The names of every fault, in [`Self::ALL`]'s order.
    fn names() -> Vec<&'static str> {
        Self::ALL.iter().map(|(n, _)| *n).collect()
    }

    /// [`Self::from_env`] for a worker starting up: logs the fault loudly.
    pub fn for_worker(role: &str) -> Result<Option<Fault>, FaultError> {
        let fault = Self::from_env()?;
        if let Some(f) = fault {
            tracing::warn!(
                role,
                fault = ?f,
                "FAULT INJECTION ENABLED: this worker misbehaves on purpose"
            );
        }
        Ok(fault)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_unknown_names_are_refused() {
        for (name, fault) in Fault::ALL {
            assert_eq!(Fault::parse(name), Ok(fault));
        }
        let e = Fault::parse("flip").unwrap_err();
        assert_eq!(
            e,
            FaultError::Unknown {
                name: "flip".to_owned()
            }
        );
        assert_eq!(
            e.to_string(),
            "PDSERVE_INJECT_FAULT: unknown fault \"flip\" (known: flip-page-byte, drop-slot, \
             swap-pages, reorder-batch, stall-engine, stall-rank, slow-load)"
        );
    }
}
