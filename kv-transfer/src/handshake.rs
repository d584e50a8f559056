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

/// Transport names from a configuration (`ucx`, `tcp`, and `nccl` in builds with the `nccl`
/// feature), in order; an unknown, repeated or missing name is an error.
pub fn parse_transports(names: &[String]) -> Result<Vec<TransportKind>, String> {
    let accepted = if cfg!(feature = "nccl") {
        "ucx, nccl, tcp"
    } else {
        "ucx, tcp"
    };
    let mut out = Vec::new();
    for name in names {
        let kind = match name.as_str() {
            "ucx" => TransportKind::Ucx,
            "tcp" => TransportKind::Tcp,
            "nccl" if cfg!(feature = "nccl") => TransportKind::Nccl,
            "nccl" => {
                return Err(
                    "transport \"nccl\": this binary was built without NCCL (cargo feature \
                     `nccl`)"
                        .to_owned(),
                );
            }
            other => {
                return Err(format!(
                    "unknown transport {other:?} (accepted: {accepted})"
                ));
            }
        };
        if out.contains(&kind) {
            return Err(format!("transport {name:?} is listed twice"));
        }
        out.push(kind);
    }
    if out.is_empty() {
        return Err("at least one transport is required".to_owned());
    }
    Ok(out)
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
        let names = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            parse_transports(&names(&["tcp", "ucx"])),
            Ok(vec![TransportKind::Tcp, TransportKind::Ucx])
        );
        assert!(parse_transports(&names(&["rdma"])).is_err());
        let nccl = parse_transports(&names(&["nccl", "tcp"]));
        if cfg!(feature = "nccl") {
            assert_eq!(nccl, Ok(vec![TransportKind::Nccl, TransportKind::Tcp]));
            assert_eq!(SUPPORTED.len(), 3);
        } else {
            assert!(nccl.is_err_and(|e| e.contains("built without NCCL")));
            assert!(!SUPPORTED.contains(&TransportKind::Nccl));
        }
        assert!(parse_transports(&names(&["tcp", "tcp"])).is_err());
        assert!(parse_transports(&[]).is_err());
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
