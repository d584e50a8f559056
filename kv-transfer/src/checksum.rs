//! Per-page checksums of a transferred state: the prefill side hashes what it sent, the decode
//! side hashes what landed in its pages, and a mismatch fails the commit, so a corrupted or
//! misplaced page is an error, never a plausible continuation.

use proto::v1::{PageChecksum, TransferDescriptor};

use crate::TransferError;

/// xxh3-64 of `bytes`.
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Checksums of `pages` (written to the descriptor's pages in order) and the slot.
pub fn of_state(
    descriptor: &TransferDescriptor,
    pages: &[Vec<u8>],
    slot: &[u8],
) -> Vec<PageChecksum> {
    pages
        .iter()
        .zip(&descriptor.pages)
        .map(|(bytes, page)| PageChecksum {
            page: page.page,
            slot: false,
            xxh3: xxh3(bytes),
        })
        .chain(std::iter::once(PageChecksum {
            page: 0,
            slot: true,
            xxh3: xxh3(slot),
        }))
        .collect()
}

/// Compares `expected` with the checksums of what is stored (`stored(Some(page))` gives a
/// page's bytes, `stored(None)` the slot's); names the first mismatch.
pub fn verify<'a>(
    expected: &[PageChecksum],
    mut stored: impl FnMut(Option<u64>) -> Option<&'a [u8]>,
) -> Result<(), TransferError> {
    for c in expected {
        let target = (!c.slot).then_some(c.page);
        let what = if c.slot {
            "the state slot".to_owned()
        } else {
            format!("page {}", c.page)
        };
        let bytes = stored(target).ok_or_else(|| {
            TransferError::Descriptor(format!("checksum for {what}, which is not reserved"))
        })?;
        let actual = xxh3(bytes);
        if actual != c.xxh3 {
            return Err(TransferError::Failed {
                peer: "decode".to_owned(),
                message: format!(
                    "checksum mismatch on {what}: sent {:016x}, stored {actual:016x}",
                    c.xxh3
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use proto::v1::PageRef;

    use super::*;

    #[test]
    fn a_flipped_byte_or_swapped_pages_fail() {
        let descriptor = TransferDescriptor {
            decode_rank: 0,
            pages: (0..2)
                .map(|p| PageRef {
                    region: 0,
                    page: 7 + p,
                    offset_bytes: 0,
                })
                .collect(),
            ..TransferDescriptor::default()
        };
        let pages = vec![vec![1u8; 64], vec![2u8; 64]];
        let slot = vec![3u8; 10];
        let sums = of_state(&descriptor, &pages, &slot);
        assert_eq!(sums.len(), 3);
        let lookup = |store: &[Vec<u8>], slot: &[u8]| {
            let (store, slot) = (store.to_vec(), slot.to_vec());
            move |page: Option<u64>| -> Option<Vec<u8>> {
                match page {
                    None => Some(slot.clone()),
                    Some(p) => store.get(usize::try_from(p.checked_sub(7)?).ok()?).cloned(),
                }
            }
        };
        let check = |store: &[Vec<u8>], slot: &[u8]| {
            let get = lookup(store, slot);
            let owned: Vec<Option<Vec<u8>>> =
                vec![get(Some(7)), get(Some(8)), get(None), get(Some(99))];
            verify(&sums, |p| match p {
                Some(7) => owned[0].as_deref(),
                Some(8) => owned[1].as_deref(),
                None => owned[2].as_deref(),
                _ => owned[3].as_deref(),
            })
        };
        assert!(check(&pages, &slot).is_ok());
        let mut flipped = pages.clone();
        flipped[1][5] ^= 1;
        assert!(matches!(
            check(&flipped, &slot),
            Err(TransferError::Failed { .. })
        ));
        let swapped = vec![pages[1].clone(), pages[0].clone()];
        assert!(check(&swapped, &slot).is_err());
        assert!(check(&pages, &[3u8; 9]).is_err());
    }
}
