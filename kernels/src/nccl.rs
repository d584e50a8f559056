//! The ranks' collectives on GPUs: NCCL, one communicator per group with every GPU of the
//! worker in it (`ncclCommInitAll`: the ranks are threads of one process), behind
//! [`engine::parallel::collective::Collective`] so the engine's expert- and tensor-parallel code
//! runs unchanged over it.
//!
//! cudarc has no all-to-all, so [`Collective::exchange`] is an all-gather of the sizes followed
//! by grouped send/recv (`ncclGroupStart`, a send and a receive per peer, `ncclGroupEnd`).
//! [`Collective::exchange`]'s payloads are host rows (the engine's host forward); they are
//! copied to the device, exchanged, and copied back. A device step's dispatch messages stay on
//! the GPUs ([`NcclRank::exchange_device_known`], with the counts gathered by
//! [`NcclRank::gather_device_counts`]).
//!
//! NCCL calls have no timeout of their own: each call records an event after its work and polls
//! it until the group's timeout; a call that did not finish by then (a rank died or hangs)
//! fails, this rank aborts its communicator, and every later call fails at once. NCCL's
//! all-reduce sums in an order of its own, not the one-rank engine's: it merges only values
//! each held by one rank, -0.0 on the others ([`NcclRank::all_owned_device`]), where every
//! order gives the same bits.
//!
//! Built with the `nccl` feature; run only on a machine with 2+ GPUs (see
//! `tests::a_group_over_the_visible_gpus_exchanges_like_the_in_process_one`).

use std::{sync::Arc, time::Duration};

use cudarc::{
    driver::{CudaContext, CudaSlice, CudaStream},
    nccl::{Comm, ReduceOp},
};
use engine::parallel::collective::{Collective, CollectiveError};

/// A communicator that moves to its rank's thread.
struct RankComm(Comm);

// SAFETY: NCCL allows a communicator to be used from any thread, one call at a time; a
// `RankComm` is owned by exactly one `NcclRank`, whose calls take `&mut self`, so it is never
// used from two threads at once.
unsafe impl Send for RankComm {}

/// One rank of a group of GPUs of this process.
pub struct NcclRank {
    comm: Option<RankComm>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    timeout: Duration,
    failed: Option<String>,
}

impl std::fmt::Debug for NcclRank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclRank")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// The ranks of a group over the GPUs `ordinals` (as this process sees them), rank `r` on
/// `ordinals[r]`, each call waiting at most `timeout` for the others.
pub fn group(ordinals: &[usize], timeout: Duration) -> Result<Vec<NcclRank>, String> {
    let streams = ordinals
        .iter()
        .map(|&o| {
            CudaContext::new(o)
                .and_then(|ctx| ctx.new_stream())
                .map_err(|e| format!("GPU {o}: {e}"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let comms = Comm::from_devices(streams.clone()).map_err(|e| format!("NCCL init: {e:?}"))?;
    let size = comms.len();
    Ok(comms
        .into_iter()
        .zip(streams)
        .enumerate()
        .map(|(rank, (comm, stream))| NcclRank {
            comm: Some(RankComm(comm)),
            stream,
            rank,
            size,
            timeout,
            failed: None,
        })
        .collect())
}

impl NcclRank {
    fn failure(&self, op: &'static str) -> Result<&Comm, CollectiveError> {
        match (&self.failed, &self.comm) {
            (Some(reason), _) => Err(CollectiveError::PeerFailed {
                rank: self.rank,
                reason: format!("{op}: {reason}"),
            }),
            (None, Some(comm)) => Ok(&comm.0),
            (None, None) => Err(CollectiveError::Shape(format!("{op}: no communicator"))),
        }
    }

    /// Fails the group from this rank: aborting the communicator ends this rank's NCCL work.
    fn abort(&mut self, reason: String) -> CollectiveError {
        self.failed = Some(reason.clone());
        drop(self.comm.take());
        CollectiveError::PeerFailed {
            rank: self.rank,
            reason,
        }
    }

    /// Waits (at most the timeout) for the work queued on the stream so far.
    fn wait(&mut self, op: &'static str) -> Result<(), CollectiveError> {
        let event = match self.stream.record_event(None) {
            Ok(e) => e,
            Err(e) => return Err(self.abort(format!("{op}: {e}"))),
        };
        let done = crate::poll::poll_until(|| Ok::<_, ()>(event.is_complete()), self.timeout);
        if done != Ok(true) {
            let after = self.timeout;
            let _ = self.abort(format!("{op} did not complete within {after:?}"));
            return Err(CollectiveError::Stalled { op, after });
        }
        Ok(())
    }

    fn device_error(&mut self, op: &'static str, e: impl std::fmt::Debug) -> CollectiveError {
        self.abort(format!("{op}: {e:?}"))
    }

    /// Posts each of `sends` (its peer, buffer and range) and a receive into each of
    /// `incoming` (its peer, buffer) as one NCCL group, then waits (at most the timeout) for
    /// them.
    fn send_receive(
        &mut self,
        sends: &[(usize, &CudaSlice<f32>, std::ops::Range<usize>)],
        incoming: &mut [(usize, CudaSlice<f32>)],
    ) -> Result<(), CollectiveError> {
        let posted = {
            let comm = self.failure("exchange")?;
            let mut group = comm.group();
            let mut posted = Ok(());
            for (peer, buffer, range) in sends {
                if posted.is_ok() {
                    posted = group
                        .send(buffer.slice(range.clone()), *peer as i32)
                        .map_err(|e| format!("{e:?}"));
                }
            }
            for (peer, buffer) in incoming.iter_mut() {
                if posted.is_ok() {
                    posted = group
                        .recv(buffer.slice_mut(..), *peer as i32)
                        .map(|_| ())
                        .map_err(|e| format!("{e:?}"));
                }
            }
            posted
        };
        if let Err(e) = posted {
            return Err(self.abort(format!("exchange: {e}")));
        }
        self.wait("exchange")
    }

    /// Every rank's `sizes` row (`size` entries each), by rank.
    fn gather_sizes(&mut self, sizes: &[u64]) -> Result<Vec<Vec<u64>>, CollectiveError> {
        let n = self.size;
        let stream = Arc::clone(&self.stream);
        let send = stream
            .clone_htod(sizes)
            .map_err(|e| self.device_error("exchange sizes", e))?;
        let mut recv: CudaSlice<u64> = stream
            .alloc_zeros(n * n)
            .map_err(|e| self.device_error("exchange sizes", e))?;
        let gathered = self.failure("exchange sizes")?.all_gather(&send, &mut recv);
        if let Err(e) = gathered {
            return Err(self.device_error("exchange sizes", e));
        }
        self.wait("exchange sizes")?;
        let all = stream
            .clone_dtoh(&recv)
            .map_err(|e| self.device_error("exchange sizes", e))?;
        Ok(all.chunks_exact(n).map(<[u64]>::to_vec).collect())
    }
}

impl NcclRank {
    /// [`Collective::exchange`] of values on the GPU (a device step's dispatch messages), where
    /// this rank knows how many values each rank sends it (`from[r]`): the first `sizes[r]`
    /// values after those of the ranks before `r` go to rank `r`; returns what every rank sent
    /// to this one, back to back by source. No size is gathered and no value crosses to the
    /// host: they go GPU to GPU, ordered after the work queued on `stream` so far, and
    /// `stream`'s later work after them.
    ///
    /// # Errors
    /// Sizes that do not fit `send` or the group, a failed or stalled exchange (which fails
    /// the group, as [`Collective::exchange`] does).
    pub fn exchange_device_known(
        &mut self,
        stream: &Arc<CudaStream>,
        send: &CudaSlice<f32>,
        (sizes, from): (&[usize], &[usize]),
    ) -> Result<CudaSlice<f32>, CollectiveError> {
        self.failure("exchange")?;
        let total: usize = sizes.iter().sum();
        if sizes.len() != self.size || from.len() != self.size || total > send.len() {
            return Err(CollectiveError::Shape(format!(
                "exchange: {} destinations and {} sources of {total} values from {} for {} \
                 ranks",
                sizes.len(),
                from.len(),
                send.len(),
                self.size
            )));
        }
        let me = self.rank;
        let (starts, _) = sizes.iter().fold((Vec::new(), 0), |(mut v, at), &n| {
            v.push(at);
            (v, at + n)
        });
        let nccl = Arc::clone(&self.stream);
        let mut incoming: Vec<(usize, CudaSlice<f32>)> = Vec::new();
        for peer in (0..self.size).filter(|&p| p != me && from[p] > 0) {
            let buffer = nccl
                .alloc_zeros::<f32>(from[peer])
                .map_err(|e| self.device_error("exchange", e))?;
            incoming.push((peer, buffer));
        }
        // cudarc orders the views' streams: the sends after the step's writes.
        let sends: Vec<_> = (0..self.size)
            .filter(|&p| p != me && sizes[p] > 0)
            .map(|p| (p, send, starts[p]..starts[p] + sizes[p]))
            .collect();
        self.send_receive(&sends, &mut incoming)?;
        // Back to back by source on the step's stream (its own part straight from `send`).
        let mut recv = stream
            .alloc_zeros::<f32>(from.iter().sum::<usize>().max(1))
            .map_err(|e| self.device_error("exchange", e))?;
        let mut at = 0;
        for (source, &n) in from.iter().enumerate() {
            let mut to = recv.slice_mut(at..at + n);
            let copied = if source == me {
                let own = send.slice(starts[me]..starts[me] + n.min(sizes[me]));
                stream.memcpy_dtod(&own, &mut to)
            } else if let Some((_, buffer)) = incoming.iter().find(|(p, _)| *p == source) {
                stream.memcpy_dtod(buffer, &mut to)
            } else {
                Ok(())
            };
            copied.map_err(|e| self.device_error("exchange", e))?;
            at += n;
        }
        Ok(recv)
    }

    /// Every rank's first `part` values of `send` (on the GPU), `[size * part]` in rank order:
    /// one all-gather GPU to GPU, ordered after the work queued on `stream` so far (a device
    /// step's groups' outputs or partial outputs). Nothing crosses to the host.
    ///
    /// # Errors
    /// A `part` beyond `send`, a failed or stalled gather (which fails the group).
    pub fn all_gather_device(
        &mut self,
        _stream: &Arc<CudaStream>,
        send: &CudaSlice<f32>,
        part: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CollectiveError> {
        self.failure("all-gather")?;
        let all = part * self.size;
        if send.len() < part || out.len() < all {
            return Err(CollectiveError::Shape(format!(
                "all-gather: {part} of {} values into {} for {} ranks",
                send.len(),
                out.len(),
                self.size
            )));
        }
        if part == 0 {
            return Ok(());
        }
        // cudarc orders the views' streams: the gather after the step's writes of `send`, the
        // step's later reads of `out` after it.
        let gathered = self
            .failure("all-gather")?
            .all_gather(&send.slice(..part), &mut out.slice_mut(..all));
        if let Err(e) = gathered {
            return Err(self.device_error("all-gather", e));
        }
        self.wait("all-gather")
    }

    /// [`crate::step::kernels::Kernels::all_owned`] over NCCL: the first `len` values of
    /// `send` summed over the ranks into `out`'s first `len` (one all-reduce GPU to GPU,
    /// ordered after the work queued on `stream` so far). Each value is one rank's and -0.0 on
    /// the others, so NCCL's order of the sum gives that rank's bits. Nothing crosses to the
    /// host.
    ///
    /// # Errors
    /// A `len` beyond either buffer, a failed or stalled reduction (which fails the group).
    pub fn all_owned_device(
        &mut self,
        _stream: &Arc<CudaStream>,
        send: &CudaSlice<f32>,
        len: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<(), CollectiveError> {
        self.failure("all-reduce")?;
        if send.len() < len || out.len() < len {
            return Err(CollectiveError::Shape(format!(
                "all-reduce: {len} of {} and {} values",
                send.len(),
                out.len()
            )));
        }
        if len == 0 {
            return Ok(());
        }
        // cudarc orders the views' streams: the reduction after the step's writes of `send`,
        // the step's later reads of `out` after it.
        let reduced = self.failure("all-reduce")?.all_reduce(
            &send.slice(..len),
            &mut out.slice_mut(..len),
            &ReduceOp::Sum,
        );
        if let Err(e) = reduced {
            return Err(self.device_error("all-reduce", e));
        }
        self.wait("all-reduce")
    }

    /// Every rank's first `n` values of `counts` (on the GPU), by rank: gathered GPU to GPU
    /// and read back once.
    ///
    /// # Errors
    /// A failed or stalled gather (which fails the group).
    pub fn gather_device_counts(
        &mut self,
        stream: &Arc<CudaStream>,
        counts: &CudaSlice<i32>,
        n: usize,
    ) -> Result<Vec<Vec<i32>>, CollectiveError> {
        self.failure("gather counts")?;
        if counts.len() < n || n == 0 {
            return Err(CollectiveError::Shape(format!(
                "gather counts: {n} of {} values",
                counts.len()
            )));
        }
        let nccl = Arc::clone(&self.stream);
        let mut all: CudaSlice<i32> = nccl
            .alloc_zeros(n * self.size)
            .map_err(|e| self.device_error("gather counts", e))?;
        let gathered = self
            .failure("gather counts")?
            .all_gather(&counts.slice(..n), &mut all);
        if let Err(e) = gathered {
            return Err(self.device_error("gather counts", e));
        }
        self.wait("gather counts")?;
        let values = stream
            .clone_dtoh(&all)
            .map_err(|e| self.device_error("gather counts", e))?;
        Ok(values.chunks_exact(n).map(<[i32]>::to_vec).collect())
    }
}

impl Collective for NcclRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn exchange(&mut self, mut sends: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>, CollectiveError> {
        self.failure("exchange")?;
        if sends.len() != self.size {
            return Err(CollectiveError::Shape(format!(
                "exchange: {} destinations for {} ranks",
                sends.len(),
                self.size
            )));
        }
        let sizes: Vec<u64> = sends.iter().map(|s| s.len() as u64).collect();
        let all_sizes = self.gather_sizes(&sizes)?;
        let stream = Arc::clone(&self.stream);
        let me = self.rank;
        let mut out: Vec<Vec<f32>> = vec![Vec::new(); self.size];
        out[me] = std::mem::take(&mut sends[me]);
        // Device buffers for every peer, alive until the group's work is done.
        let mut outgoing: Vec<(usize, CudaSlice<f32>)> = Vec::new();
        let mut incoming: Vec<(usize, CudaSlice<f32>)> = Vec::new();
        for peer in (0..self.size).filter(|&p| p != me) {
            if !sends[peer].is_empty() {
                let buffer = stream
                    .clone_htod(&sends[peer])
                    .map_err(|e| self.device_error("exchange", e))?;
                outgoing.push((peer, buffer));
            }
            let count = usize::try_from(all_sizes[peer][me]).unwrap_or(usize::MAX);
            if count > 0 {
                let buffer = stream
                    .alloc_zeros::<f32>(count)
                    .map_err(|e| self.device_error("exchange", e))?;
                incoming.push((peer, buffer));
            }
        }
        let sends: Vec<_> = outgoing
            .iter()
            .map(|(peer, buffer)| (*peer, buffer, 0..buffer.len()))
            .collect();
        self.send_receive(&sends, &mut incoming)?;
        for (peer, buffer) in &incoming {
            out[*peer] = stream
                .clone_dtoh(buffer)
                .map_err(|e| self.device_error("exchange", e))?;
        }
        drop(outgoing);
        Ok(out)
    }

    fn fail(&mut self, reason: &str) {
        let _ = self.abort(reason.to_owned());
    }

    fn failure(&self) -> Option<String> {
        self.failed.clone()
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

    use super::*;

    /// Every rank sends rank-and-destination-tagged rows of ragged sizes to every rank, as the
    /// in-process group's tests do, from host rows and GPU to GPU; needs 2 or more GPUs (skips with fewer, fails under
    /// PDSERVE_REQUIRE_GPU=1 without any).
    #[test]
    fn a_group_over_the_visible_gpus_exchanges_like_the_in_process_one() {
        let Some(gpu) = crate::cuda::Gpu::for_test("nccl exchange") else {
            return;
        };
        drop(gpu);
        let count = CudaContext::device_count().unwrap_or(0);
        let count = usize::try_from(count).unwrap_or(0);
        if count < 2 {
            eprintln!("skipped: the NCCL group test needs 2 GPUs, {count} visible");
            return;
        }
        let ranks = group(&(0..count).collect::<Vec<_>>(), Duration::from_secs(30)).unwrap();
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut rank| {
                    s.spawn(move || {
                        let me = rank.rank();
                        let sends: Vec<Vec<f32>> = (0..rank.size())
                            .map(|to| {
                                (0..(me * 3 + to) % 5)
                                    .map(|i| (me * 100 + to * 10 + i) as f32)
                                    .collect()
                            })
                            .collect();
                        let host = rank.exchange(sends.clone()).unwrap();
                        // The same messages GPU to GPU: one buffer of them, back to back.
                        let stream = Arc::clone(&rank.stream);
                        let sizes: Vec<usize> = sends.iter().map(Vec::len).collect();
                        let flat: Vec<f32> = sends.concat();
                        let send = stream.clone_htod(&[flat, vec![-1.0]].concat()).unwrap();
                        let got: Vec<usize> = host.iter().map(Vec::len).collect();
                        let recv = rank
                            .exchange_device_known(&stream, &send, (&sizes, &got))
                            .unwrap();
                        let values = stream.clone_dtoh(&recv).unwrap();
                        assert_eq!(values[..got.iter().sum::<usize>()], host.concat()[..]);
                        // Counts gathered GPU to GPU.
                        let mine = stream.clone_htod(&[me as i32, 7, -1]).unwrap();
                        let all = rank.gather_device_counts(&stream, &mine, 2).unwrap();
                        let want: Vec<Vec<i32>> =
                            (0..rank.size()).map(|r| vec![r as i32, 7]).collect();
                        assert_eq!(all, want);
                        // Rows of 3 all-gathered GPU to GPU: every rank's, in rank order.
                        let row = stream.clone_htod(&[me as f32, 0.5, -2.0, 9.0]).unwrap();
                        let mut all = stream.alloc_zeros::<f32>(3 * rank.size()).unwrap();
                        rank.all_gather_device(&stream, &row, 3, &mut all).unwrap();
                        let want: Vec<f32> = (0..rank.size())
                            .flat_map(|r| [r as f32, 0.5, -2.0])
                            .collect();
                        assert_eq!(stream.clone_dtoh(&all).unwrap(), want);
                        // Values each held by one rank (value i by rank i % size, -0 on the
                        // others; +0, -0 and a subnormal held too: a reduction that flushed
                        // subnormals would lose it) merged by one all-reduce: the holders'
                        // bits.
                        let held = |i: usize| [1.5 + i as f32, -0.0, 0.0, -7.25, 1e-40][i % 5];
                        let size = rank.size();
                        let mine: Vec<f32> = (0..9)
                            .map(|i| if i % size == me { held(i) } else { -0.0 })
                            .collect();
                        let send = stream.clone_htod(&mine).unwrap();
                        let mut out = stream.clone_htod(&[5.0f32; 10]).unwrap();
                        rank.all_owned_device(&stream, &send, 9, &mut out).unwrap();
                        let got = stream.clone_dtoh(&out).unwrap();
                        let bits: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                        let want: Vec<u32> = (0..9)
                            .map(|i| held(i).to_bits())
                            .chain([5f32.to_bits()])
                            .collect();
                        assert_eq!(bits, want);
                        host
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (me, got) in results.iter().enumerate() {
            for (from, rows) in got.iter().enumerate() {
                let want: Vec<f32> = (0..(from * 3 + me) % 5)
                    .map(|i| (from * 100 + me * 10 + i) as f32)
                    .collect();
                assert_eq!(rows, &want, "rank {me} from {from}");
            }
        }
    }
}
