//! What two workers check before one writes into the other's pages.

use proto::v1::{StateLayout, TransportKind};

use crate::TransferError;

/// Transports this build implements, in order of preference.
#[cfg(not(feature = "nccl"))]
pub const SUPPORTED: &[TransportKind] = &[TransportKind::Ucx, TransportKind::Tcp];
/// Transports this build implements, in order of preference.
#[cfg(feature = "nccl")]
pub const SUPPORTED: &[TransportKind] =
    &[TransportKind::Ucx, TransportKind::Nccl, TransportKind::Tcp];

/// A configured transport or list of transports that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportConfigError {
    /// Not the name of any transport; `accepted` lists this build's names.
    #[error("unknown transport {name:?} (accepted: {accepted})")]
    UnknownTransport {
        name: String,
        accepted: &'static str,
    },
    /// `nccl` in a build without the `nccl` feature.
    #[error("transport \"nccl\": this binary was built without NCCL (cargo feature `nccl`)")]
    NotBuilt,
    /// An empty list of transports.
    #[error("at least one transport is required")]
    Empty,
    /// A transport (its configuration name) listed more than once.
    #[error("transport {0:?} is listed twice")]
    Repeated(&'static str),
}

/// A transport from its configuration name (`ucx`, `tcp`, and `nccl` in builds with the
/// `nccl` feature).
pub fn parse_transport(name: &str) -> Result<TransportKind, TransportConfigError> {
    match name {
        "ucx" => Ok(TransportKind::Ucx),
        "tcp" => Ok(TransportKind::Tcp),
        "nccl" if cfg!(feature = "nccl") => Ok(TransportKind::Nccl),
        "nccl" => Err(TransportConfigError::NotBuilt),
        other => {
            let accepted = if cfg!(feature = "nccl") {
                "ucx, nccl, tcp"
            } else {
                "ucx, tcp"
            };
            Err(TransportConfigError::UnknownTransport {
                name: other.to_owned(),
                accepted,
            })
        }
    }
}

/// The configuration name of a transport.
pub fn transport_name(kind: TransportKind) -> &'static str {
    match kind {
        TransportKind::Ucx => "ucx",
        TransportKind::Tcp => "tcp",
        TransportKind::Nccl => "nccl",
        TransportKind::Unspecified => "unspecified",
    }
}

/// A configured list of transports in order of preference: at least one, none twice.
pub fn check_transports(kinds: &[TransportKind]) -> Result<(), TransportConfigError> {
    if kinds.is_empty() {
        return Err(TransportConfigError::Empty);
    }
    for (i, kind) in kinds.iter().enumerate() {
        if kinds[..i].contains(kind) {
            return Err(TransportConfigError::Repeated(transport_name(*kind)));
        }
    }
    Ok(())
}

/// Ok when `theirs` describes exactly the bytes `ours` does; otherwise every difference.
pub fn check_layouts(ours: &StateLayout, theirs: &StateLayout) -> Result<(), TransferError> {
    let differences = proto::layout::differences(ours, theirs);
    if differences.is_empty() {
        Ok(())
    } else {
        Err(TransferError::LayoutMismatch(differences.join("; ")))
    }
}

/// The first of the sender's transports (in its order of preference) that the receiver
/// supports.
pub fn negotiate(sender: &[i32], receiver: &[TransportKind]) -> Option<TransportKind> {
    sender
        .iter()
        .filter_map(|&k| TransportKind::try_from(k).ok())
        .find(|k| *k != TransportKind::Unspecified && receiver.contains(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiation_follows_the_sender_preference() {
        let ucx = TransportKind::Ucx as i32;
        let tcp = TransportKind::Tcp as i32;
        assert_eq!(
            negotiate(&[ucx, tcp], &[TransportKind::Tcp, TransportKind::Ucx]),
            Some(TransportKind::Ucx)
        );
        assert_eq!(negotiate(&[tcp, ucx], SUPPORTED), Some(TransportKind::Tcp));
        assert_eq!(negotiate(&[ucx], &[TransportKind::Tcp]), None);
        assert_eq!(negotiate(&[0, 99], SUPPORTED), None);
        assert_eq!(parse_transport("tcp"), Ok(TransportKind::Tcp));
        assert_eq!(parse_transport("ucx"), Ok(TransportKind::Ucx));
        for kind in SUPPORTED {
            assert_eq!(parse_transport(transport_name(*kind)), Ok(*kind));
        }
        let rdma = parse_transport("rdma");
        assert!(
            matches!(&rdma, Err(TransportConfigError::UnknownTransport { name, .. }) if name == "rdma"),
            "{rdma:?}"
        );
        assert!(rdma.is_err_and(|e| {
            e.to_string()
                .starts_with("unknown transport \"rdma\" (accepted: ucx, ")
        }));
        let nccl = parse_transport("nccl");
        if cfg!(feature = "nccl") {
            assert_eq!(nccl, Ok(TransportKind::Nccl));
            assert_eq!(SUPPORTED.len(), 3);
        } else {
            assert_eq!(nccl, Err(TransportConfigError::NotBuilt));
            assert!(
                TransportConfigError::NotBuilt
                    .to_string()
                    .contains("built without NCCL")
            );
            assert!(!SUPPORTED.contains(&TransportKind::Nccl));
        }
        assert_eq!(
            check_transports(&[TransportKind::Tcp, TransportKind::Ucx]),
            Ok(())
        );
        let twice = check_transports(&[TransportKind::Tcp, TransportKind::Tcp]);
        assert_eq!(twice, Err(TransportConfigError::Repeated("tcp")));
        assert!(twice.is_err_and(|e| e.to_string() == "transport \"tcp\" is listed twice"));
        let empty = check_transports(&[]);
        assert_eq!(empty, Err(TransportConfigError::Empty));
        assert!(empty.is_err_and(|e| e.to_string() == "at least one transport is required"));
    }

    #[test]
    fn layouts_must_match_field_for_field() {
        let ours = StateLayout {
            model_fingerprint: "abc".into(),
            page_size_tokens: 64,
            ..StateLayout::default()
        };
        assert!(check_layouts(&ours, &ours.clone()).is_ok());
        let theirs = StateLayout {
            page_size_tokens: 16,
            model_fingerprint: "abd".into(),
            ..ours.clone()
        };
        let Err(TransferError::LayoutMismatch(message)) = check_layouts(&ours, &theirs) else {
            panic!("mismatch expected");
        };
        assert!(
            message.contains("page_size") && message.contains("fingerprint"),
            "{message}"
        );
    }
}
