//! The device page pool with the decode attention kernel on real engine state: a prompt's
//! state is stored by the engine's `PagedStore`, its pages are mirrored to the device, and the
//! kernel reads every layer's window and compressed rows at the offsets the store computes;
//! the result must match the f64 CPU reference over the rows the CPU path gathers (bound
//! 1e-4 of the largest |row value|, as in attn_decode.rs). The same again with the pages placed
//! past 4 GiB in the device pool (64-bit offsets), and a row in a page never uploaded reads as
//! NaN. Skips without a GPU.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr, reason = "test code")]

use engine::{
    config::{Attention, ExpertFormat},
    model::{Logits, Model},
    paged::{
        layout::{KvStorage, StateLayout},
        store::{PagedSeq, PagedStore},
    },
    synth::{GenerateOptions, Preset, Rng, generate},
};
use kernels::{
    cpu,
    cuda::{AttnShape, DevicePages, Gpu},
};

/// A Tiny model with a 150-token prompt stored in pages of 16 tokens.
struct Stored {
    _dir: tempfile::TempDir,
    model: Model,
    store: PagedStore,
    seq: PagedSeq,
}

fn stored() -> Stored {
    let dir = tempfile::tempdir().unwrap();
    let options = GenerateOptions::new(Preset::Tiny, 4, ExpertFormat::Mxfp4, dir.path());
    generate(&options).unwrap();
    let model = Model::load(dir.path()).unwrap();
    let layout = StateLayout::new(&model.config, 16, KvStorage::F32, "t").unwrap();
    let mut store = PagedStore::new(&model.config, layout, 64, 1);
    let mut seq = store.open().unwrap();
    let mut rng = Rng::for_tensor(4, "device pages");
    let prompt: Vec<u32> = (0..150).map(|_| (rng.next_u64() % 1000) as u32).collect();
    store.reserve(&mut seq, prompt.len()).unwrap();
    let mut state = store.gather(&seq).unwrap();
    model.forward(&mut state, &prompt, Logits::None).unwrap();
    store.scatter(&mut seq, &state).unwrap();
    Stored {
        _dir: dir,
        model,
        store,
        seq,
    }
}

/// One attention request per layer: (row offsets, rows as the CPU path gathers them).
fn requests(s: &Stored) -> Vec<(Vec<u64>, Vec<Vec<f32>>)> {
    let c = &s.model.config;
    let gathered = s.store.gather(&s.seq).unwrap();
    let first = (s.seq.len + 1).saturating_sub(c.sliding_window);
    c.layers
        .iter()
        .enumerate()
        .map(|(l, spec)| {
            let closed: Vec<usize> = match spec.attention {
                Attention::Sliding => Vec::new(),
                a => (0..s.seq.len / a.ratio()).collect(),
            };
            let offsets = s
                .store
                .attention_row_offsets(&s.seq, l, first, &closed)
                .unwrap();
            let mut flat = gathered.layers[l].window.clone();
            if let Some(comp) = &gathered.layers[l].compressor {
                flat.extend_from_slice(&comp.rows);
            }
            let rows: Vec<Vec<f32>> = flat.chunks(c.head_dim).map(<[f32]>::to_vec).collect();
            assert_eq!(rows.len(), offsets.len());
            (offsets, rows)
        })
        .collect()
}

/// Runs every layer's request on the device pool with offsets shifted by `shift` bytes and
/// returns (gpu, reference, bound).
fn attend(
    gpu: &Gpu,
    pool: &DevicePages,
    s: &Stored,
    shift: u64,
    extra_offset: Option<u64>,
) -> (Vec<f32>, Vec<f32>, f32) {
    let c = &s.model.config;
    let (heads, dim) = (c.num_heads, c.head_dim);
    let reqs = requests(s);
    let mut rng = Rng::for_tensor(9, "device pages q");
    let q: Vec<f32> = (0..reqs.len() * heads * dim)
        .map(|_| rng.normal())
        .collect();
    let sinks: Vec<f32> = (0..heads).map(|_| rng.normal()).collect();
    let mut starts = vec![0usize];
    let mut offsets: Vec<i64> = Vec::new();
    let mut rows: Vec<Vec<f32>> = Vec::new();
    for (o, r) in &reqs {
        offsets.extend(o.iter().map(|&x| i64::try_from(x + shift).unwrap()));
        rows.extend(r.iter().cloned());
        starts.push(rows.len());
    }
    if let Some(extra) = extra_offset {
        // One more row in the last request, at an offset the test chose.
        offsets.push(i64::try_from(extra).unwrap());
        rows.push(vec![0.0; dim]);
        *starts.last_mut().unwrap() += 1;
    }
    let scale = 1.0 / (dim as f32).sqrt();
    let want = cpu::attn_decode(&q, &rows, &starts, &sinks, dim, scale);
    let shape = AttnShape {
        heads,
        dim,
        splits: 5,
        scale,
    };
    let starts_i: Vec<i64> = starts.iter().map(|&x| x as i64).collect();
    let d_q = gpu.stream.clone_htod(&q).unwrap();
    let d_offsets = gpu.stream.clone_htod(&offsets).unwrap();
    let d_starts = gpu.stream.clone_htod(&starts_i).unwrap();
    let d_sinks = gpu.stream.clone_htod(&sinks).unwrap();
    let mut scratch = gpu.attn_scratch(reqs.len(), shape).unwrap();
    gpu.launch_attn_decode(
        &d_q,
        pool.data(),
        &d_offsets,
        &d_starts,
        &d_sinks,
        shape,
        &mut scratch,
    )
    .unwrap();
    let got = gpu.stream.clone_dtoh(&scratch.out).unwrap();
    let bound = 1e-4 * rows.iter().flatten().fold(1.0f32, |m, v| m.max(v.abs()));
    (got, want, bound)
}

fn assert_close(got: &[f32], want: &[f32], bound: f32, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= bound, "{what} at {i}: gpu {g} ref {w}");
    }
}

#[test]
fn gpu_attention_over_device_pages_matches_reference() {
    let Some(gpu) = Gpu::for_test("gpu_attention_over_device_pages_matches_reference") else {
        return;
    };
    let s = stored();
    let mut pool = gpu
        .device_pages(s.store.pages().total() as u64, s.store.layout.page_bytes)
        .unwrap();
    gpu.upload_pages(&mut pool, s.store.pages(), &s.seq.pages)
        .unwrap();
    let (got, want, bound) = attend(&gpu, &pool, &s, 0, None);
    assert_close(&got, &want, bound, "mirrored pool");
    eprintln!(
        "{} layers over {} pages of {} bytes: ok",
        s.model.config.layers.len(),
        s.seq.pages.len(),
        pool.page_bytes()
    );

    // A row in a page that was never uploaded is NaN, and so is the result that read it.
    let unused = (0..pool.count())
        .find(|p| !s.seq.pages.contains(&(*p as u32)))
        .unwrap();
    let (got, _, _) = attend(&gpu, &pool, &s, 0, Some(pool.offset(unused).unwrap()));
    let last = &got[got.len() - s.model.config.num_heads * s.model.config.head_dim..];
    assert!(
        last.iter().all(|v| v.is_nan()),
        "poisoned page read as numbers"
    );
}

#[test]
fn gpu_device_pages_past_4_gib() {
    let Some(gpu) = Gpu::for_test("gpu_device_pages_past_4_gib") else {
        return;
    };
    let s = stored();
    let page_bytes = s.store.layout.page_bytes;
    let base = (5u64 << 30).div_ceil(page_bytes as u64);
    let count = base + s.store.pages().total() as u64;
    let (free, _) = gpu.ctx.mem_get_info().unwrap();
    if (count as usize) * page_bytes + (1 << 30) > free {
        eprintln!("skipping gpu_device_pages_past_4_gib: {free} bytes free on the device");
        return;
    }
    let mut pool = gpu.device_pages(count, page_bytes).unwrap();
    for &page in &s.seq.pages {
        let bytes = s.store.pages().page(page).unwrap();
        gpu.write_page(&mut pool, base + u64::from(page), bytes)
            .unwrap();
        assert_eq!(gpu.read_page(&pool, base + u64::from(page)).unwrap(), bytes);
    }
    assert!(gpu.read_page(&pool, 0).unwrap().iter().all(|&b| b == 0xFF));
    let shift = pool.offset(base).unwrap();
    assert!(shift > u64::from(u32::MAX));
    let (got, want, bound) = attend(&gpu, &pool, &s, shift, None);
    assert_close(&got, &want, bound, "pages past 4 GiB");
    assert!(pool.offset(count).is_err());
    eprintln!(
        "pool of {count} pages ({} GiB): ok",
        (count as usize * page_bytes) >> 30
    );
}

/// Several ranges of several buffers read back with one wait (`Gpu::read_ranges`: gathered
/// by one `gather_pieces` launch, how a prompt step's deltas come back) are each range's values
/// (the reference: the host's slices): ranges out of order, overlapping, empty (at any start),
/// of 1 value and one buffer's whole; a range past its buffer is an error.
#[test]
fn gpu_read_ranges_gives_each_ranges_values() {
    let Some(gpu) = Gpu::for_test("gpu_read_ranges_gives_each_ranges_values") else {
        return;
    };
    let mut rng = Rng::for_tensor(3, "read-ranges");
    let a: Vec<f32> = (0..1000).map(|_| rng.normal()).collect();
    let b: Vec<f32> = (0..37).map(|_| rng.normal()).collect();
    let (da, db) = (
        gpu.stream.clone_htod(&a).unwrap(),
        gpu.stream.clone_htod(&b).unwrap(),
    );
    // (buffer, range): buffer 0 is `a`, 1 is `b`.
    let spec = [
        (0, 900..1000),
        (1, 0..37),
        (0, 5..5),
        (0, 0..130),
        (1, 36..37),
        (0, 100..200),
    ];
    let (host, device) = ([&a, &b], [&da, &db]);
    let parts: Vec<_> = spec.iter().map(|(i, r)| (device[*i], r.clone())).collect();
    let got = gpu.read_ranges(&parts).unwrap();
    for ((i, r), got) in spec.iter().zip(&got) {
        assert_eq!(got[..], host[*i][r.clone()], "{r:?}");
    }
    assert!(gpu.read_ranges(&[(&db, 30..38)]).is_err());
    assert_eq!(gpu.read_ranges(&[]).unwrap().len(), 0);
}
