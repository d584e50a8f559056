//! What two workers check before one writes into the other's pages.

use proto::v1::{StateLayout, TransportKind};

use crate::TransferError;

/// Transports this build implements, in order of preference.
pub const SUPPORTED: &[TransportKind] = &[TransportKind::Tcp];

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
        assert_eq!(negotiate(&[ucx, tcp], SUPPORTED), Some(TransportKind::Tcp));
        assert_eq!(negotiate(&[ucx], SUPPORTED), None);
        assert_eq!(negotiate(&[0, 99], SUPPORTED), None);
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
