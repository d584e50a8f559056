//! [`KeyPlan`]: which rows of the arenas each token of a step attends to, as byte offsets for
//! the attention kernels, with the indexer's choice left for `chosen_offsets` to fill.

use super::{Compressed, TokenKeys};

/// The indexer choice's slots of a token in a [`KeyPlan`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fill {
    /// The token (its row of the chosen indices).
    pub token: usize,
    /// Where its slots start in the offsets.
    pub at: i64,
    pub count: usize,
    /// Byte offset of its first compressed row.
    pub base: i64,
}

/// Every token's key offsets for `attn_exact` (bytes, CSR by `starts`), with the indexer's
/// choice left as -1 slots for `chosen_offsets` to fill.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyPlan {
    pub offsets: Vec<i64>,
    pub starts: Vec<i64>,
    pub fills: Vec<Fill>,
    /// The most keys a token has.
    pub most: usize,
}

impl KeyPlan {
    pub fn of(keys: &[TokenKeys], head_dim: usize) -> Self {
        let row_bytes = 4 * head_dim as i64;
        let (mut offsets, mut starts, mut fills) = (Vec::new(), vec![0i64], Vec::new());
        for (token, tk) in keys.iter().enumerate() {
            offsets.extend(tk.window.iter().map(|&o| 4 * o));
            match tk.compressed {
                Compressed::None => {}
                Compressed::All { rows, count } => {
                    offsets.extend((0..count as i64).map(|i| 4 * rows + i * row_bytes));
                }
                Compressed::Chosen { rows, count } => {
                    fills.push(Fill {
                        token,
                        at: offsets.len() as i64,
                        count,
                        base: 4 * rows,
                    });
                    offsets.extend(std::iter::repeat_n(-1, count));
                }
            }
            starts.push(offsets.len() as i64);
        }
        let most = starts.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0) as usize;
        Self {
            offsets,
            starts,
            fills,
            most,
        }
    }
}
