use std::{
    thread,
    time::{Duration, Instant},
};

use super::*;

/// Runs `body` on every rank of a fresh group of `size`, one thread each; results by rank.
fn on_ranks<T: Send>(
    size: usize,
    timeout: Duration,
    body: impl Fn(InProcessRank) -> T + Sync,
) -> Vec<T> {
    let ranks = InProcessGroup::new(size, timeout);
    thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|rank| s.spawn(|| body(rank)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    })
}

#[test]
fn exchange_delivers_each_send_to_its_destination_round_after_round() {
    for size in [1usize, 2, 3, 4] {
        let results = on_ranks(size, Duration::from_secs(10), |mut rank| {
            let me = rank.rank();
            let mut rounds = Vec::new();
            for round in 0..20usize {
                // Sizes differ by pair and round, empty ones included.
                let sends: Vec<Vec<f32>> = (0..size)
                    .map(|d| vec![(100 * me + 10 * d + round) as f32; (me + d + round) % 4])
                    .collect();
                rounds.push(rank.exchange(sends).expect("exchange"));
            }
            rounds
        });
        for (me, rounds) in results.iter().enumerate() {
            for (round, received) in rounds.iter().enumerate() {
                assert_eq!(received.len(), size);
                for (source, got) in received.iter().enumerate() {
                    let want =
                        vec![(100 * source + 10 * me + round) as f32; (source + me + round) % 4];
                    assert_eq!(got, &want, "size {size} round {round} {source} -> {me}");
                }
            }
        }
    }
}

#[test]
fn all_gather_orders_by_rank() {
    let results = on_ranks(4, Duration::from_secs(10), |mut rank| {
        let me = rank.rank() as f32;
        rank.barrier().expect("barrier");
        rank.all_gather(vec![me, me * 2.0]).expect("all_gather")
    });
    for got in results {
        assert_eq!(
            got,
            (0..4)
                .map(|r| vec![r as f32, r as f32 * 2.0])
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn a_rank_that_never_arrives_times_the_others_out_naming_it() {
    let timeout = Duration::from_millis(300);
    let results = on_ranks(3, timeout, |mut rank| {
        if rank.rank() == 2 {
            // Hangs past the others' timeout, then finds the group failed.
            thread::sleep(Duration::from_millis(900));
            let late = rank.barrier();
            return (Duration::ZERO, late);
        }
        let started = Instant::now();
        let first = rank.barrier();
        let waited = started.elapsed();
        assert!(first.is_err());
        // Sticky: the next call fails at once.
        let again = Instant::now();
        let second = rank.barrier();
        assert!(again.elapsed() < Duration::from_millis(100));
        assert!(second.is_err());
        (waited, first)
    });
    for (rank, (waited, result)) in results.into_iter().enumerate() {
        let error = result.unwrap_err();
        if rank < 2 {
            assert!(
                waited >= Duration::from_millis(250) && waited < Duration::from_secs(2),
                "{waited:?}"
            );
        }
        match error {
            CollectiveError::Timeout { missing, .. } => assert_eq!(missing, vec![2]),
            CollectiveError::PeerFailed {
                rank: failed,
                reason,
            } => {
                assert_eq!(failed, 2, "{reason}");
                assert!(reason.contains("did not arrive"), "{reason}");
            }
            CollectiveError::Shape(s) => panic!("{s}"),
            e @ CollectiveError::Stalled { .. } => panic!("in-process ranks name who: {e}"),
        }
    }
}

#[test]
fn a_failed_or_vanished_rank_stops_the_others_at_once() {
    for vanish in [false, true] {
        let results = on_ranks(4, Duration::from_secs(30), |mut rank| {
            let me = rank.rank();
            rank.barrier().expect("first round");
            if me == 1 {
                if vanish {
                    drop(rank);
                } else {
                    rank.fail("out of memory");
                }
                return None;
            }
            let started = Instant::now();
            let e = rank.barrier().unwrap_err();
            Some((started.elapsed(), e))
        });
        for (waited, e) in results.into_iter().flatten() {
            assert!(
                waited < Duration::from_secs(2),
                "{waited:?}: not the 30 s timeout"
            );
            let CollectiveError::PeerFailed { rank, reason } = e else {
                panic!("{e:?}");
            };
            assert_eq!(rank, 1);
            let want = if vanish {
                "the rank stopped"
            } else {
                "out of memory"
            };
            assert_eq!(reason, want);
        }
    }
}

#[test]
fn sends_must_name_every_rank() {
    let mut ranks = InProcessGroup::new(2, Duration::from_secs(1));
    let e = ranks[0].exchange(vec![Vec::new()]).unwrap_err();
    assert!(matches!(e, CollectiveError::Shape(_)), "{e:?}");
}
