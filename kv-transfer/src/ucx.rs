//! The UCX transport: one-sided puts (RMA) from the prefill worker straight into the decode
//! worker's page pool. The decode side registers its pool memory once ([`Exporter`]) and
//! publishes its worker address, the regions' base addresses and packed remote keys in every
//! transfer descriptor; the prefill side ([`Putter`]) connects an endpoint, unpacks the keys,
//! puts each page and the slot, and flushes the endpoint before it commits, so every byte has
//! landed when decode admits the request.
//!
//! UCX handles are not thread-safe in single-thread mode and are raw pointers: each side owns
//! its UCX context and worker on one dedicated thread and talks to it over channels.

use std::{
    collections::HashMap,
    ffi::c_void,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use proto::v1::{MemoryRegion, UcxTarget};
use ucx_rs::sys;

use crate::TransferError;

/// A put that does not complete (peer gone, link down) fails after this.
const PUT_TIMEOUT: Duration = Duration::from_secs(10);

fn status_error(what: &str, status: sys::ucs_status_t) -> TransferError {
    TransferError::Failed {
        peer: "ucx".to_owned(),
        message: format!("{what}: {}", ucx_rs::status_string(status)),
    }
}

/// A UCX context and worker, used from the thread that created them only.
struct Endpoint0 {
    context: sys::ucp_context_h,
    worker: sys::ucp_worker_h,
}

impl Endpoint0 {
    /// A context for RMA; `wakeup` also asks for event notification (the exporter sleeps on
    /// it while no transfer arrives).
    fn new(wakeup: bool) -> Result<Self, TransferError> {
        // SAFETY: plain FFI calls with zero-initialised parameter structs whose field masks
        // name exactly the fields set; every out-pointer is a valid local.
        unsafe {
            let mut params: sys::ucp_params_t = std::mem::zeroed();
            params.field_mask = u64::from(sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES);
            params.features = u64::from(sys::ucp_feature_UCP_FEATURE_RMA);
            if wakeup {
                params.features |= u64::from(sys::ucp_feature_UCP_FEATURE_WAKEUP);
            }
            let mut context: sys::ucp_context_h = std::ptr::null_mut();
            let status = sys::ucp_init_version(
                sys::UCP_API_MAJOR,
                sys::UCP_API_MINOR,
                &raw const params,
                std::ptr::null(),
                &raw mut context,
            );
            if status != sys::ucs_status_t_UCS_OK {
                return Err(status_error("ucp_init", status));
            }
            let mut wparams: sys::ucp_worker_params_t = std::mem::zeroed();
            wparams.field_mask =
                u64::from(sys::ucp_worker_params_field_UCP_WORKER_PARAM_FIELD_THREAD_MODE);
            wparams.thread_mode = sys::ucs_thread_mode_t_UCS_THREAD_MODE_SINGLE;
            let mut worker: sys::ucp_worker_h = std::ptr::null_mut();
            let status = sys::ucp_worker_create(context, &raw const wparams, &raw mut worker);
            if status != sys::ucs_status_t_UCS_OK {
                sys::ucp_cleanup(context);
                return Err(status_error("ucp_worker_create", status));
            }
            Ok(Self { context, worker })
        }
    }

    /// The worker's event file descriptor, when its transports can signal events.
    fn event_fd(&self) -> Option<std::os::fd::RawFd> {
        let mut fd: std::os::raw::c_int = -1;
        // SAFETY: the worker is live; `fd` is a valid out-pointer; UCX owns the descriptor.
        let status = unsafe { sys::ucp_worker_get_efd(self.worker, &raw mut fd) };
        (status == sys::ucs_status_t_UCS_OK && fd >= 0).then_some(fd)
    }

    /// Arms the event descriptor for the next event; false while events are pending (progress
    /// first) or when arming fails.
    fn arm(&self) -> bool {
        // SAFETY: the worker is live and used from this thread only.
        unsafe { sys::ucp_worker_arm(self.worker) == sys::ucs_status_t_UCS_OK }
    }

    fn progress(&self) -> u32 {
        // SAFETY: the worker is live and used from this thread only.
        unsafe { sys::ucp_worker_progress(self.worker) }
    }

    fn address(&self) -> Result<Vec<u8>, TransferError> {
        // SAFETY: out-pointers are valid locals; the address buffer is copied and released.
        unsafe {
            let mut address: *mut sys::ucp_address_t = std::ptr::null_mut();
            let mut len = 0usize;
            let status = sys::ucp_worker_get_address(self.worker, &raw mut address, &raw mut len);
            if status != sys::ucs_status_t_UCS_OK {
                return Err(status_error("ucp_worker_get_address", status));
            }
            let bytes = std::slice::from_raw_parts(address.cast::<u8>(), len).to_vec();
            sys::ucp_worker_release_address(self.worker, address);
            Ok(bytes)
        }
    }

    /// Progresses until `request` completes (or the timeout); frees it.
    fn wait(&self, request: sys::ucs_status_ptr_t, deadline: Instant) -> Result<(), TransferError> {
        match ucx_rs::decode_status_ptr(request) {
            Ok(None) => Ok(()),
            Err(status) => Err(status_error("request", status)),
            Ok(Some(request)) => loop {
                self.progress();
                // SAFETY: `request` is a live request handle returned by UCX.
                let status = unsafe { sys::ucp_request_check_status(request) };
                if status != sys::ucs_status_t_UCS_INPROGRESS {
                    // SAFETY: completed; released exactly once.
                    unsafe { sys::ucp_request_free(request) };
                    return if status == sys::ucs_status_t_UCS_OK {
                        Ok(())
                    } else {
                        Err(status_error("request", status))
                    };
                }
                if Instant::now() > deadline {
                    // The request stays with UCX; the endpoint is closed by the caller, which
                    // completes it with an error.
                    return Err(TransferError::Failed {
                        peer: "ucx".to_owned(),
                        message: "the put did not complete in time (peer gone?)".to_owned(),
                    });
                }
            },
        }
    }
}

impl Drop for Endpoint0 {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, on the owning thread.
        unsafe {
            sys::ucp_worker_destroy(self.worker);
            sys::ucp_cleanup(self.context);
        }
    }
}

/// Memory a decode worker exposes for remote writes: its page pool and slot pool.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    /// First byte (the memory must stay allocated and unmoved for the exporter's lifetime).
    pub base: usize,
    pub length: usize,
}

/// The decode side: registered regions, their packed keys, and a progress thread (transports
/// that emulate RMA need the target to progress). Dropping it (or [`Exporter::stop`]) ends the
/// thread and waits for it, so UCX is torn down before the process exits or the memory goes.
#[derive(Debug)]
pub struct Exporter {
    target: UcxTarget,
    thread: UcxThread,
}

/// A UCX thread that is stopped and joined, once, on [`UcxThread::stop`] or drop: a UCX thread
/// still running while the process exits races UCX's own global teardown (a crash at exit).
#[derive(Debug)]
struct UcxThread {
    stop: Arc<AtomicBool>,
    handle: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl UcxThread {
    fn spawn(
        name: &str,
        body: impl FnOnce(Arc<AtomicBool>) + Send + 'static,
    ) -> Result<Self, TransferError> {
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || body(thread_stop))
            .map_err(|e| TransferError::Failed {
                peer: "ucx".to_owned(),
                message: e.to_string(),
            })?;
        Ok(Self {
            stop,
            handle: std::sync::Mutex::new(Some(handle)),
        })
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let handle = self
            .handle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

impl Drop for UcxThread {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Exporter {
    /// Registers `regions` (region `i` is `PageRef.region == i`) and starts progressing.
    pub fn start(regions: Vec<Region>) -> Result<Self, TransferError> {
        let (tx, rx) = mpsc::channel();
        let thread = UcxThread::spawn("pdserve-ucx-export", move |stop| {
            export_thread(&regions, &tx, &stop);
        })?;
        let target = rx.recv().map_err(|_| TransferError::Failed {
            peer: "ucx".to_owned(),
            message: "the UCX thread stopped".to_owned(),
        })??;
        Ok(Self { target, thread })
    }

    /// Unregisters the memory and ends the UCX thread (waits for it); later transfers fail.
    pub fn stop(&self) {
        self.thread.stop();
    }

    /// What a descriptor carries for this worker.
    pub fn target(&self) -> &UcxTarget {
        &self.target
    }
}

fn export_thread(
    regions: &[Region],
    reply: &mpsc::Sender<Result<UcxTarget, TransferError>>,
    stop: &AtomicBool,
) {
    let setup = || -> Result<(Endpoint0, Vec<sys::ucp_mem_h>, UcxTarget), TransferError> {
        let ep = Endpoint0::new(true)?;
        let mut handles = Vec::new();
        let mut out = Vec::new();
        for r in regions {
            // SAFETY: the caller guarantees the region stays allocated; out-pointers are
            // valid locals; the packed key is copied and released.
            unsafe {
                let mut params: sys::ucp_mem_map_params_t = std::mem::zeroed();
                params.field_mask = u64::from(
                    sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                        | sys::ucp_mem_map_params_field_UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                );
                params.address = r.base as *mut c_void;
                params.length = r.length;
                let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
                let status = sys::ucp_mem_map(ep.context, &raw const params, &raw mut memh);
                if status != sys::ucs_status_t_UCS_OK {
                    return Err(status_error("ucp_mem_map", status));
                }
                handles.push(memh);
                let mut buffer: *mut c_void = std::ptr::null_mut();
                let mut size = 0usize;
                let status = sys::ucp_rkey_pack(ep.context, memh, &raw mut buffer, &raw mut size);
                if status != sys::ucs_status_t_UCS_OK {
                    return Err(status_error("ucp_rkey_pack", status));
                }
                let key = std::slice::from_raw_parts(buffer.cast::<u8>(), size).to_vec();
                sys::ucp_rkey_buffer_release(buffer);
                out.push(MemoryRegion {
                    base_address: r.base as u64,
                    length: r.length as u64,
                    remote_key: key,
                });
            }
        }
        let target = UcxTarget {
            worker_address: ep.address()?,
            regions: out,
        };
        Ok((ep, handles, target))
    };
    let (ep, handles) = match setup() {
        Ok((ep, handles, target)) => {
            let _ = reply.send(Ok(target));
            (ep, handles)
        }
        Err(e) => {
            let _ = reply.send(Err(e));
            return;
        }
    };
    // Event-driven when idle: drain the worker, arm its event descriptor and sleep until a
    // transport signals (a put arriving on an emulated-RMA transport) or a stop check is due.
    // Transports without events fall back to a short sleep between progress calls.
    let events = ep.event_fd();
    if events.is_none() {
        tracing::warn!("UCX transports offer no event descriptor: the exporter polls");
    }
    while !stop.load(Ordering::Relaxed) {
        if ep.progress() != 0 {
            continue;
        }
        match events {
            Some(fd) if ep.arm() => wait_readable(fd, STOP_CHECK),
            Some(_) => {}
            None => std::thread::sleep(Duration::from_micros(200)),
        }
    }
    for memh in handles {
        // SAFETY: mapped above with this context; unmapped once.
        unsafe { sys::ucp_mem_unmap(ep.context, memh) };
    }
}

/// How long an idle exporter sleeps on its event descriptor before checking for a stop.
const STOP_CHECK: Duration = Duration::from_millis(50);

/// Waits until `fd` is readable or `limit` passes.
fn wait_readable(fd: std::os::fd::RawFd, limit: Duration) {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    // SAFETY: UCX keeps the descriptor open for the worker's lifetime, which outlasts this
    // call on the worker's own thread.
    let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    let mut fds = [PollFd::new(borrowed, PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(limit).unwrap_or(PollTimeout::MAX);
    // An interrupted or failed poll only means progressing again sooner.
    let _ = poll(&mut fds, timeout);
}

/// One put: `data` to `offset` bytes into region `region` of the target.
#[derive(Debug)]
pub struct Put {
    pub region: usize,
    pub offset: u64,
    pub data: Vec<u8>,
}

struct Job {
    target: UcxTarget,
    puts: Vec<Put>,
    reply: tokio::sync::oneshot::Sender<Result<u64, TransferError>>,
}

/// The prefill side: a UCX worker on its own thread that performs puts and flushes. The thread
/// ends (and is waited for) when the last clone is dropped or on [`Putter::stop`].
#[derive(Debug, Clone)]
pub struct Putter {
    jobs: mpsc::Sender<Job>,
    thread: Arc<UcxThread>,
}

impl Putter {
    /// Starts the UCX thread (fails when UCX cannot initialise here).
    pub fn start() -> Result<Self, TransferError> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = UcxThread::spawn("pdserve-ucx-put", move |stop| {
            put_thread(&rx, &ready_tx, &stop);
        })?;
        ready_rx.recv().map_err(|_| TransferError::Failed {
            peer: "ucx".to_owned(),
            message: "the UCX thread stopped".to_owned(),
        })??;
        Ok(Self {
            jobs,
            thread: Arc::new(thread),
        })
    }

    /// Closes the endpoints and ends the UCX thread (waits for it); later puts fail.
    pub fn stop(&self) {
        self.thread.stop();
    }

    /// Writes every put into the target and flushes; returns the bytes written.
    pub async fn put(&self, target: UcxTarget, puts: Vec<Put>) -> Result<u64, TransferError> {
        let (reply, rx) = tokio::sync::oneshot::channel();
        let stopped = || TransferError::Failed {
            peer: "ucx".to_owned(),
            message: "the UCX thread stopped".to_owned(),
        };
        self.jobs
            .send(Job {
                target,
                puts,
                reply,
            })
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}

/// An endpoint to one decode worker and its unpacked keys.
struct Peer {
    ep: sys::ucp_ep_h,
    keys: Vec<(Vec<u8>, sys::ucp_rkey_h)>,
}

fn put_thread(
    jobs: &mpsc::Receiver<Job>,
    ready: &mpsc::Sender<Result<(), TransferError>>,
    stop: &AtomicBool,
) {
    let worker = match Endpoint0::new(false) {
        Ok(w) => {
            let _ = ready.send(Ok(()));
            w
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let mut peers: HashMap<Vec<u8>, Peer> = HashMap::new();
    while !stop.load(Ordering::Relaxed) {
        let job = match jobs.recv_timeout(Duration::from_millis(50)) {
            Ok(job) => job,
            Err(mpsc::RecvTimeoutError::Timeout) => continue,
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let address = job.target.worker_address.clone();
        let result = put_job(&worker, &mut peers, &job.target, &job.puts);
        if result.is_err() {
            // A failed peer's endpoint is not reused.
            if let Some(peer) = peers.remove(&address) {
                close(&worker, peer);
            }
        }
        let _ = job.reply.send(result);
    }
    for (_, peer) in peers.drain() {
        close(&worker, peer);
    }
}

fn close(worker: &Endpoint0, peer: Peer) {
    // SAFETY: handles created on this thread with this worker; destroyed once.
    unsafe {
        for (_, rkey) in peer.keys {
            sys::ucp_rkey_destroy(rkey);
        }
        let mut param: sys::ucp_request_param_t = std::mem::zeroed();
        param.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
        let request = sys::ucp_ep_close_nbx(peer.ep, &raw const param);
        let _ = worker.wait(request, Instant::now() + Duration::from_secs(1));
    }
}

fn put_job(
    worker: &Endpoint0,
    peers: &mut HashMap<Vec<u8>, Peer>,
    target: &UcxTarget,
    puts: &[Put],
) -> Result<u64, TransferError> {
    let deadline = Instant::now() + PUT_TIMEOUT;
    if !peers.contains_key(&target.worker_address) {
        // SAFETY: the address bytes came from ucp_worker_get_address on the peer; UCX copies
        // what it needs during ucp_ep_create.
        let ep = unsafe {
            let mut params: sys::ucp_ep_params_t = std::mem::zeroed();
            params.field_mask = u64::from(
                sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                    | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
            );
            params.address = target.worker_address.as_ptr().cast();
            params.err_mode = sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER;
            let mut ep: sys::ucp_ep_h = std::ptr::null_mut();
            let status = sys::ucp_ep_create(worker.worker, &raw const params, &raw mut ep);
            if status != sys::ucs_status_t_UCS_OK {
                return Err(status_error("ucp_ep_create", status));
            }
            ep
        };
        peers.insert(
            target.worker_address.clone(),
            Peer {
                ep,
                keys: Vec::new(),
            },
        );
    }
    let peer = peers
        .get_mut(&target.worker_address)
        .ok_or_else(|| status_error("peer", sys::ucs_status_t_UCS_ERR_NO_ELEM))?;
    // Keys for every region (the decode worker's keys change only if it restarts, and then its
    // worker address changes too).
    let mut keys = Vec::with_capacity(target.regions.len());
    for region in &target.regions {
        if let Some((_, key)) = peer.keys.iter().find(|(k, _)| *k == region.remote_key) {
            keys.push(*key);
            continue;
        }
        let mut rkey: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: the key bytes came from ucp_rkey_pack on the peer.
        let status = unsafe {
            sys::ucp_ep_rkey_unpack(peer.ep, region.remote_key.as_ptr().cast(), &raw mut rkey)
        };
        if status != sys::ucs_status_t_UCS_OK {
            return Err(status_error("ucp_ep_rkey_unpack", status));
        }
        peer.keys.push((region.remote_key.clone(), rkey));
        keys.push(rkey);
    }
    // Issue every put, then wait for them together: each is non-blocking, and the buffers live
    // in `puts` until this function returns.
    let mut bytes = 0u64;
    let mut pending = Vec::new();
    let mut failure = None;
    for put in puts {
        let region = target.regions.get(put.region).ok_or_else(|| {
            TransferError::Descriptor(format!("no region {} in the UCX target", put.region))
        });
        let region = match region {
            Ok(r) => r,
            Err(e) => {
                failure = Some(e);
                break;
            }
        };
        let end = put.offset.checked_add(put.data.len() as u64);
        if end.is_none_or(|end| end > region.length) {
            failure = Some(TransferError::Descriptor(format!(
                "a put of {} bytes at offset {} overruns region {} ({} bytes)",
                put.data.len(),
                put.offset,
                put.region,
                region.length
            )));
            break;
        }
        // SAFETY: the source buffer lives in `puts` until every request below has completed;
        // the remote range was checked against the region the peer registered.
        let request = unsafe {
            let param: sys::ucp_request_param_t = std::mem::zeroed();
            sys::ucp_put_nbx(
                peer.ep,
                put.data.as_ptr().cast(),
                put.data.len(),
                region.base_address + put.offset,
                keys[put.region],
                &raw const param,
            )
        };
        match ucx_rs::decode_status_ptr(request) {
            Ok(None) => {}
            Ok(Some(request)) => pending.push(request),
            Err(status) => {
                failure = Some(status_error("ucp_put_nbx", status));
                break;
            }
        }
        bytes += put.data.len() as u64;
    }
    // Every issued request completes (or fails) before the buffers may go away.
    for request in pending {
        if let Err(e) = worker.wait(request, deadline) {
            failure.get_or_insert(e);
        }
    }
    if let Some(e) = failure {
        return Err(e);
    }
    // Remote completion of every put before the caller commits.
    // SAFETY: live endpoint; zeroed params request no callbacks.
    let request = unsafe {
        let param: sys::ucp_request_param_t = std::mem::zeroed();
        sys::ucp_ep_flush_nbx(peer.ep, &raw const param)
    };
    worker.wait(request, deadline)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two UCX workers in one process: puts land in the exported memory byte for byte, and
    /// out-of-range puts are refused before they are issued.
    #[tokio::test]
    async fn puts_land_in_exported_memory() {
        let mut pages = vec![0u8; 1 << 16];
        let mut slot = vec![0u8; 777];
        let exporter = Exporter::start(vec![
            Region {
                base: pages.as_mut_ptr() as usize,
                length: pages.len(),
            },
            Region {
                base: slot.as_mut_ptr() as usize,
                length: slot.len(),
            },
        ])
        .unwrap();
        let putter = Putter::start().unwrap();
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        let written = putter
            .put(
                exporter.target().clone(),
                vec![
                    Put {
                        region: 0,
                        offset: 4096,
                        data: data.clone(),
                    },
                    Put {
                        region: 1,
                        offset: 700,
                        data: vec![9; 77],
                    },
                ],
            )
            .await
            .unwrap();
        assert_eq!(written, 5077);
        assert_eq!(&pages[4096..4096 + 5000], &data[..]);
        assert!(pages[..4096].iter().all(|&b| b == 0));
        assert_eq!(&slot[700..], &[9u8; 77][..]);
        let overrun = putter
            .put(
                exporter.target().clone(),
                vec![Put {
                    region: 1,
                    offset: 700,
                    data: vec![1; 78],
                }],
            )
            .await;
        assert!(matches!(overrun, Err(TransferError::Descriptor(_))));
        drop(exporter);
    }
}
