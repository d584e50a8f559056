//! The references of the group kernels: the expert-parallel dispatch (`ep_slots`,
//! `ep_take_ids`: the messages a rank packs on its device are
//! `engine::parallel::expert::dispatch_messages`'), the replicated pairs' (`held_ids`,
//! `clear_unheld_rows`), `sum_blocks`, and the collectives over host buffers standing for
//! device ones.

use engine::parallel::collective::Collective;

use super::{ShapeError, err, part};
use crate::step::kernels::{SlotSpec, check_received, merge_owned};

/// `ep_slots` ([`crate::step::kernels::Kernels::ep_slots`]).
pub(super) fn ep_slots(
    experts: &[i32],
    spec: SlotSpec,
    send: &mut [f32],
    (pack_to, back_from): (&mut [i64], &mut [i64]),
    counts: &mut [i32],
) -> Result<(), ShapeError> {
    let SlotSpec {
        ranks,
        per_rank,
        width,
        pairs,
    } = spec;
    let experts = experts
        .get(..pairs)
        .ok_or_else(|| err("ep_slots experts"))?;
    let owner = |e: i32| {
        usize::try_from(e)
            .ok()
            .filter(|&e| e < ranks * per_rank)
            .map(|e| (e, e / per_rank))
    };
    let mut count = vec![0usize; ranks + 1];
    for &e in experts {
        count[owner(e).map_or(ranks, |(_, d)| d)] += 1;
    }
    let most = ranks + pairs * (1 + width);
    if send.len() < most || pack_to.len() < pairs || back_from.len() < pairs {
        return Err(err("ep_slots"));
    }
    let counts = counts
        .get_mut(..=ranks)
        .ok_or_else(|| err("ep_slots counts"))?;
    // Each message's start and its pairs' first output row.
    let (mut start, mut row) = (Vec::with_capacity(ranks), Vec::with_capacity(ranks));
    let (mut s, mut r) = (0usize, 0usize);
    for (d, &c) in count.iter().take(ranks).enumerate() {
        start.push(s);
        row.push(r);
        send[s] = c as f32;
        counts[d] = c as i32;
        s += 1 + c * (1 + width);
        r += c;
    }
    counts[ranks] = count[ranks] as i32;
    let mut placed = vec![0usize; ranks];
    for (p, &e) in experts.iter().enumerate() {
        let Some((e, d)) = owner(e) else {
            pack_to[p] = -1;
            back_from[p] = -1;
            continue;
        };
        let j = placed[d];
        placed[d] += 1;
        send[start[d] + 1 + j] = e as f32;
        pack_to[p] = (start[d] + 1 + count[d] + j * width) as i64;
        back_from[p] = ((row[d] + j) * width) as i64;
    }
    Ok(())
}

/// `ep_take_ids` ([`crate::step::kernels::Kernels::ep_take_ids`]).
pub(super) fn ep_take_ids(
    recv: &[f32],
    at: &[i64],
    (first, held): (usize, usize),
    ids: &mut [i32],
) -> Result<(), ShapeError> {
    if ids.len() < at.len() {
        return Err(err("ep_take_ids"));
    }
    for (id, &o) in ids.iter_mut().zip(at) {
        let v = usize::try_from(o)
            .ok()
            .and_then(|o| recv.get(o))
            .ok_or_else(|| err("ep_take_ids"))?;
        let local = v - first as f32;
        *id = if v.fract() == 0.0 && (0.0..held as f32).contains(&local) {
            local as i32
        } else {
            -1
        };
    }
    Ok(())
}

/// `held_ids` ([`crate::step::kernels::Kernels::held_ids`]).
pub(super) fn held_ids(
    experts: &[i32],
    (first, held): (usize, usize),
    total: usize,
    ids: &mut [i32],
) -> Result<(), ShapeError> {
    if ids.len() < experts.len() {
        return Err(err("held_ids"));
    }
    for (id, &e) in ids.iter_mut().zip(experts) {
        *id = match usize::try_from(e) {
            Ok(e) if e >= first && e - first < held => (e - first) as i32,
            Ok(e) if e < total => -1,
            _ => -2,
        };
    }
    Ok(())
}

/// `clear_unheld_rows` ([`crate::step::kernels::Kernels::clear_unheld_rows`]).
pub(super) fn clear_unheld_rows(
    ys: &mut [f32],
    ids: &[i32],
    width: usize,
    pairs: usize,
) -> Result<(), ShapeError> {
    let (Some(ids), Some(ys)) = (ids.get(..pairs), ys.get_mut(..pairs * width)) else {
        return Err(err("clear_unheld_rows"));
    };
    for (row, &id) in ys.chunks_exact_mut(width.max(1)).zip(ids) {
        if id == -1 {
            row.fill(-0.0);
        }
    }
    Ok(())
}

/// `sum_blocks`: the first `part` values of `out` the block-order sums of `x`'s `blocks`
/// blocks of `part` (the first block as it is, NaN in NaN out).
pub(super) fn sum_blocks(
    x: &[f32],
    (blocks, part): (usize, usize),
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let whole = blocks
        .checked_mul(part)
        .filter(|&n| blocks > 0 && n <= x.len());
    let (Some(_), Some(out)) = (whole, out.get_mut(..part)) else {
        return Err(err("sum_blocks"));
    };
    out.copy_from_slice(&x[..part]);
    for block in x[..blocks * part].chunks_exact(part.max(1)).skip(1) {
        for (o, v) in out.iter_mut().zip(block) {
            *o += v;
        }
    }
    Ok(())
}

/// [`crate::step::kernels::Kernels::exchange_known`] of host buffers standing for device
/// ones.
pub(super) fn exchange_known(
    coll: &mut dyn Collective,
    send: &[f32],
    (sizes, from): (&[usize], &[usize]),
) -> Result<Vec<f32>, ShapeError> {
    let mut at = 0;
    let mut sends = Vec::with_capacity(sizes.len());
    for &n in sizes {
        sends.push(part(send, at, n, "exchange")?);
        at += n;
    }
    let received = coll
        .exchange(sends)
        .map_err(|e| ShapeError(format!("exchange: {e}")))?;
    let got: Vec<usize> = received.iter().map(Vec::len).collect();
    check_received(&got, from).map_err(ShapeError)?;
    Ok(received.concat())
}

/// [`crate::step::kernels::Kernels::all_gather`] of host buffers standing for device ones.
pub(super) fn all_gather(
    coll: &mut dyn Collective,
    send: &[f32],
    part: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let mine = send.get(..part).ok_or_else(|| err("all_gather"))?;
    let out = out
        .get_mut(..coll.size() * part)
        .ok_or_else(|| err("all_gather"))?;
    let all = coll
        .all_gather(mine.to_vec())
        .map_err(|e| ShapeError(format!("all-gather: {e}")))?;
    let got: Vec<usize> = all.iter().map(Vec::len).collect();
    check_received(&got, &vec![part; all.len()]).map_err(ShapeError)?;
    out.copy_from_slice(&all.concat());
    Ok(())
}

/// [`crate::step::kernels::Kernels::all_owned`] of host buffers standing for device ones
/// (checked as the host's: a value two ranks hold is refused).
pub(super) fn all_owned(
    coll: &mut dyn Collective,
    send: &[f32],
    len: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let (Some(mine), Some(out)) = (send.get(..len), out.get_mut(..len)) else {
        return Err(err("all_owned"));
    };
    let all = coll
        .all_gather(mine.to_vec())
        .map_err(|e| ShapeError(format!("all-reduce: {e}")))?;
    out.copy_from_slice(&merge_owned(&all, len).map_err(ShapeError)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test code")]

    use engine::{
        parallel::expert::{ExpertSplit, dispatch_messages},
        synth::Rng,
    };

    use super::*;

    /// Block-order sums, the first block's bits kept (a lone -0 stays -0), NaN in NaN out;
    /// blocks beyond the buffer or none at all refused.
    #[test]
    fn blocks_are_summed_in_order() {
        let x = [
            1.0,
            -0.0,
            f32::NAN,
            1e8,
            2.0,
            -0.0,
            1.0,
            -1e8,
            3.0,
            -0.0,
            0.0,
            1.0,
        ];
        let mut out = vec![9.0; 5];
        sum_blocks(&x, (3, 4), &mut out).unwrap();
        // The last column is 0 in reverse order.
        let want = [6.0, -0.0, f32::NAN, 1.0];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out[..4]), bits(&want));
        assert_eq!(out[4].to_bits(), 9f32.to_bits());
        sum_blocks(&x, (1, 4), &mut out).unwrap();
        assert_eq!(bits(&out[..4]), bits(&x[..4]));
        assert!(sum_blocks(&x, (4, 4), &mut out).is_err());
        assert!(sum_blocks(&x, (0, 4), &mut out).is_err());
        assert!(sum_blocks(&x, (2, 6), &mut out).is_err());
        sum_blocks(&x, (3, 0), &mut out).unwrap();
    }

    /// `ep_slots`' messages for random pairs, with each pair's row put where `pack_to` says
    /// (as `copy_rows` does); the messages' counts and where each output comes back from.
    fn pack(
        (ranks, per_rank, width): (usize, usize, usize),
        xs: &[Vec<f32>],
        ids: &[i32],
        k: usize,
    ) -> (Vec<f32>, Vec<i64>, Vec<i32>) {
        let pairs = ids.len();
        let spec = SlotSpec {
            ranks,
            per_rank,
            width,
            pairs,
        };
        let mut send = vec![f32::NAN; ranks + pairs * (1 + width)];
        let (mut pack_to, mut back_from) = (vec![7; pairs], vec![7; pairs]);
        let mut counts = vec![-5; ranks + 1];
        ep_slots(
            ids,
            spec,
            &mut send,
            (&mut pack_to, &mut back_from),
            &mut counts,
        )
        .unwrap();
        for (p, &to) in pack_to.iter().enumerate() {
            if let Ok(to) = usize::try_from(to) {
                send[to..to + width].copy_from_slice(&xs[p / k]);
            }
        }
        (send, back_from, counts)
    }

    /// The device's messages are the host's, value for value, at awkward shapes (no pairs, one
    /// rank, a width of 1, more pairs than a block has threads), and each output comes back
    /// from its row in the order the destinations return them.
    #[test]
    fn packed_messages_are_the_host_framings() {
        let mut rng = Rng::for_tensor(3, "ep-slots");
        let shapes = [
            (1, 4, 3, 0, 2),
            (2, 3, 5, 1, 1),
            (3, 2, 7, 13, 4),
            (4, 8, 16, 300, 6),
            (8, 4, 1, 40, 8),
        ];
        for (ranks, per_rank, width, tokens, k) in shapes {
            let xs: Vec<Vec<f32>> = (0..tokens)
                .map(|_| (0..width).map(|_| rng.normal()).collect())
                .collect();
            let total = ranks * per_rank;
            let pairs: Vec<(usize, usize)> = (0..tokens * k)
                .map(|p| (p / k, (rng.next_u64() % total as u64) as usize))
                .collect();
            let ids: Vec<i32> = pairs.iter().map(|&(_, e)| e as i32).collect();
            let (send, back_from, counts) = pack((ranks, per_rank, width), &xs, &ids, k);
            let split = ExpertSplit::new(total, ranks).unwrap();
            let rows: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
            let (messages, lists) = dispatch_messages((split, width), &rows, &pairs).unwrap();
            let want = messages.concat();
            let got = &send[..want.len()];
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ranks} ranks, {} pairs: {got:?} vs {want:?}",
                pairs.len()
            );
            let listed: Vec<i32> = lists.iter().map(|l| l.len() as i32).collect();
            assert_eq!(counts[..ranks], listed[..]);
            assert_eq!(counts[ranks], 0);
            for (row, &p) in lists.concat().iter().enumerate() {
                assert_eq!(back_from[p], (row * width) as i64, "pair {p}");
            }
        }
    }

    /// A pair whose expert is not the model's is counted apart and moves nothing; the others
    /// are packed as without it.
    #[test]
    fn pairs_of_no_expert_are_counted_and_skipped() {
        let xs: Vec<Vec<f32>> = (0..4).map(|t| vec![t as f32; 3]).collect();
        let ids = [1, -1, 5, 6, 2, i32::MAX, 0, 7];
        let (send, back_from, counts) = pack((2, 3, 3), &xs, &ids, 2);
        assert_eq!(counts, [3, 1, 4]);
        for p in [1, 3, 5, 7] {
            assert_eq!(back_from[p], -1, "pair {p}");
        }
        let kept: Vec<i32> = ids
            .iter()
            .copied()
            .filter(|&e| (0..6).contains(&e))
            .collect();
        let (alone, ..) = pack((2, 3, 3), &xs, &kept, 1);
        assert_eq!(send[..2 + 4 * 4], alone[..2 + 4 * 4]);
    }

    /// A held expert becomes its index among the held, another rank's -1, anything else
    /// (negative, past the model's experts) -2; only the -1 rows are cleared, to -0.
    #[test]
    fn held_ids_name_this_ranks_experts_and_clear_the_others_rows() {
        let experts = [4, 5, 3, 6, 0, 8, -1, 7, i32::MAX];
        let mut ids = vec![9; experts.len()];
        held_ids(&experts, (4, 2), 8, &mut ids).unwrap();
        assert_eq!(ids, [0, 1, -1, -1, -1, -2, -2, -1, -2]);
        assert!(held_ids(&experts, (4, 2), 8, &mut ids[..3]).is_err());
        let mut ys: Vec<f32> = (0..ids.len() * 2).map(|v| v as f32 + 0.5).collect();
        ys[10] = f32::NAN;
        clear_unheld_rows(&mut ys, &ids, 2, ids.len()).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (p, &id) in ids.iter().enumerate() {
            let row = &ys[2 * p..2 * p + 2];
            if id == -1 {
                assert_eq!(bits(row), bits(&[-0.0, -0.0]), "row {p}");
            } else if p == 5 {
                assert!(
                    row[0].is_nan() && row[1].to_bits() == 11.5f32.to_bits(),
                    "row {p}"
                );
            } else {
                let want = [2.0 * p as f32 + 0.5, 2.0 * p as f32 + 1.5];
                assert_eq!(bits(row), bits(&want), "row {p}");
            }
        }
        assert!(clear_unheld_rows(&mut ys, &ids, 2, 10).is_err());
    }

    /// Values each held by one rank merge to that rank's bits (+0 and -0 kept, a NaN of one
    /// rank or of every rank NaN), whichever rank holds them; two ranks holding one value, or
    /// a rank sending another count, are refused.
    #[test]
    fn owned_values_merge_to_their_holders_bits() {
        let z = -0.0f32;
        let all = [
            vec![1.5, z, z, 0.0, f32::NAN, z],
            vec![z, -2.0, z, z, f32::NAN, f32::NAN],
            vec![z, z, f32::INFINITY, z, f32::NAN, 7.0],
        ];
        let merged = merge_owned(&all, 6).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&merged[..4]), bits(&[1.5, -2.0, f32::INFINITY, 0.0]));
        assert!(merged[4].is_nan() && merged[5].is_nan());
        assert_eq!(
            merge_owned(&[vec![z], vec![z]], 1).unwrap()[0].to_bits(),
            z.to_bits()
        );
        let two = [vec![1.0, z], vec![z, z], vec![2.0, z]];
        let e = merge_owned(&two, 2).unwrap_err();
        assert!(e.contains("ranks 0 and 2 both hold value 0"), "{e}");
        assert!(merge_owned(&[vec![0.0], vec![0.0]], 1).is_err());
        assert!(merge_owned(&[vec![1.0], vec![]], 1).is_err());
    }

    /// Only whole numbers naming a held expert become ids; everything else (fractions, NaN,
    /// infinities, experts of other ranks) is -1.
    #[test]
    fn taken_ids_name_held_experts_only() {
        let recv = [
            3.0,
            4.0,
            5.0,
            4.5,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            2.0,
            -0.0,
            6.0,
            1e9,
        ];
        let at: Vec<i64> = (0..recv.len() as i64).rev().collect();
        let mut ids = vec![9; recv.len()];
        ep_take_ids(&recv, &at, (3, 3), &mut ids).unwrap();
        ids.reverse();
        assert_eq!(ids, [0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1]);
        assert!(ep_take_ids(&recv, &[11], (3, 3), &mut ids).is_err());
    }
}
