//! [`Staged`]: the step's kernels run in passes, so a decode step can be replayed as a CUDA
//! graph. A graph replays launches over fixed addresses with the arguments they were captured
//! with, after the host has written the step's plans; so a step splits into a plan pass (the
//! host writes every plan; nothing launches) and a launch pass (every launch; no host write),
//! and each pass folds every launch and write it makes, with every buffer address and scalar
//! argument, into a signature. Two steps with one signature make the same launches over the
//! same buffers: a graph captured in one step's launch pass replays the other's after its plan
//! pass. Over the kernels' CPU references the launch pass runs instead of a graph, which CI
//! checks gives the engine's bits (every write before every launch must be enough).

use std::{
    cell::{Cell, RefCell},
    fmt,
    hash::{DefaultHasher, Hasher},
    ops::Range,
};

use engine::{
    paged::layout::RowFormat,
    parallel::collective::Collective,
    tensor::Weight,
    weights::{ExpertWeights, MoeWeights},
};

use super::{
    Proj,
    kernels::{HyperSpec, Kernels, PoolSpec, RouteSpec, RowSpec, ScoreSpec, SlotSpec},
};

mod passes;

/// What a pass of the kernels does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Everything, as it comes (a step without graphs).
    Run,
    /// The host's writes; no launch, no read.
    Plan,
    /// The launches (captured into a graph where the device can); no host write, no new
    /// buffer, no read.
    Launch,
}

/// A pass's launches and writes, folded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Signature {
    pub hash: u64,
    pub launches: usize,
    pub writes: usize,
}

/// `K` with passes and signatures.
#[derive(Debug)]
pub struct Staged<K: Kernels> {
    k: K,
    pass: Cell<Pass>,
    hasher: RefCell<DefaultHasher>,
    counts: Cell<(usize, usize)>,
    /// Each noted launch and write in words, when asked for (to see what tells two
    /// signatures apart).
    trace: RefCell<Option<Vec<String>>>,
}

/// Hashes what `Debug` prints of a launch's scalars.
struct HashWriter<'a>(&'a mut DefaultHasher);

impl fmt::Write for HashWriter<'_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        self.0.write(s.as_bytes());
        Ok(())
    }
}

/// A launch's buffer addresses, computed only in a pass (an address can cost a call).
macro_rules! addrs {
    ($self:ident, $($e:expr),* $(,)?) => {
        if $self.noting() { vec![$($e),*] } else { Vec::new() }
    };
}

/// A weight's identity (its place in the device model, which is uploaded once).
fn at<T>(w: &T) -> usize {
    std::ptr::from_ref(w) as usize
}

impl<K: Kernels> Kernels for Staged<K> {
    type Error = K::Error;
    type F = K::F;
    type I = K::I;
    type L = K::L;
    type Rows = K::Rows;
    type Stack = K::Stack;
    type Table = K::Table;
    type Hash = K::Hash;
    type Graph = K::Graph;

    fn f_len(b: &K::F) -> usize {
        K::f_len(b)
    }
    fn i_len(b: &K::I) -> usize {
        K::i_len(b)
    }
    fn f_addr(b: &K::F) -> usize {
        K::f_addr(b)
    }
    fn i_addr(b: &K::I) -> usize {
        K::i_addr(b)
    }
    fn l_addr(b: &K::L) -> usize {
        K::l_addr(b)
    }
    fn rows_shape(w: &K::Rows) -> (usize, usize) {
        K::rows_shape(w)
    }
    fn stack_shape(s: &K::Stack) -> (usize, usize, usize) {
        K::stack_shape(s)
    }

    fn zeros(&self, len: usize) -> Result<K::F, K::Error> {
        self.new_buffer(|k| k.zeros(len))
    }
    fn zeros_i(&self, len: usize) -> Result<K::I, K::Error> {
        self.new_buffer(|k| k.zeros_i(len))
    }
    fn zeros_l(&self, len: usize) -> Result<K::L, K::Error> {
        self.new_buffer(|k| k.zeros_l(len))
    }
    fn upload(&self, v: &[f32]) -> Result<K::F, K::Error> {
        self.new_buffer(|k| k.upload(v))
    }
    fn upload_i(&self, v: &[i32]) -> Result<K::I, K::Error> {
        self.new_buffer(|k| k.upload_i(v))
    }
    fn upload_l(&self, v: &[i64]) -> Result<K::L, K::Error> {
        self.new_buffer(|k| k.upload_l(v))
    }
    fn upload_rows(&self, w: &Weight) -> Result<K::Rows, K::Error> {
        self.new_buffer(|k| k.upload_rows(w))
    }
    fn upload_matrix(&self, data: &[f32], rows: usize, cols: usize) -> Result<K::Rows, K::Error> {
        self.new_buffer(|k| k.upload_matrix(data, rows, cols))
    }
    fn upload_stack(&self, experts: &[ExpertWeights], proj: Proj) -> Result<K::Stack, K::Error> {
        self.new_buffer(|k| k.upload_stack(experts, proj))
    }
    fn upload_table(&self, embed: &Weight) -> Result<K::Table, K::Error> {
        self.new_buffer(|k| k.upload_table(embed))
    }
    fn upload_hash(&self, moe: &MoeWeights) -> Result<Option<K::Hash>, K::Error> {
        self.new_buffer(|k| k.upload_hash(moe))
    }

    fn write(&self, dst: &mut K::F, at: usize, v: &[f32]) -> Result<(), K::Error> {
        let addr = self.noting().then(|| K::f_addr(dst) + 4 * at);
        self.host_write("write", addr, |k| k.write(dst, at, v))
    }
    fn write_i(&self, dst: &mut K::I, v: &[i32]) -> Result<(), K::Error> {
        let addr = self.noting().then(|| K::i_addr(dst));
        self.host_write("write_i", addr, |k| k.write_i(dst, v))
    }
    fn write_l(&self, dst: &mut K::L, v: &[i64]) -> Result<(), K::Error> {
        let addr = self.noting().then(|| K::l_addr(dst));
        self.host_write("write_l", addr, |k| k.write_l(dst, v))
    }
    fn read(&self, b: &K::F, range: Range<usize>) -> Result<Vec<f32>, K::Error> {
        self.host_read(|k| k.read(b, range))
    }
    fn read_many(&self, parts: &[(&K::F, Range<usize>)]) -> Result<Vec<Vec<f32>>, K::Error> {
        self.host_read(|k| k.read_many(parts))
    }
    fn read_i(&self, b: &K::I, range: Range<usize>) -> Result<Vec<i32>, K::Error> {
        self.host_read(|k| k.read_i(b, range))
    }
    fn read_l(&self, b: &K::L) -> Result<Vec<i64>, K::Error> {
        self.host_read(|k| k.read_l(b))
    }

    fn copy(&self, src: &K::F, dst: &mut K::F, len: usize) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(src), K::f_addr(dst));
        self.launch("copy", &addrs, len, |k| k.copy(src, dst, len))
    }
    fn fill_nan(&self, x: &mut K::F) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(x));
        self.launch("fill_nan", &addrs, K::f_len(x), |k| k.fill_nan(x))
    }
    fn embed_rows(
        &self,
        table: &K::Table,
        tokens: &K::I,
        n_hc: (usize, usize),
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, at(table), K::i_addr(tokens), K::f_addr(out));
        self.launch("embed_rows", &addrs, n_hc, |k| {
            k.embed_rows(table, tokens, n_hc, out)
        })
    }
    fn copy_rows(
        &self,
        src: &K::F,
        from: &K::L,
        dst: &mut K::F,
        to: &K::L,
        width: usize,
        n: usize,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(src),
            K::l_addr(from),
            K::f_addr(dst),
            K::l_addr(to)
        );
        self.launch("copy_rows", &addrs, (width, n), |k| {
            k.copy_rows(src, from, dst, to, width, n)
        })
    }
    fn exact_gemv(
        &self,
        w: &K::Rows,
        rows: (usize, usize),
        x: &K::F,
        n: usize,
        y: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, at(w), K::f_addr(x), K::f_addr(y));
        self.launch("exact_gemv", &addrs, (rows, n), |k| {
            k.exact_gemv(w, rows, x, n, y)
        })
    }
    fn norm_rope_rows(
        &self,
        x: &mut K::F,
        spec: RowSpec,
        w: &K::F,
        sin_cos: &K::F,
        rows: usize,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(x), K::f_addr(w), K::f_addr(sin_cos));
        self.launch("norm_rope_rows", &addrs, (spec, rows), |k| {
            k.norm_rope_rows(x, spec, w, sin_cos, rows)
        })
    }
    fn hyper_pre(
        &self,
        x: &K::F,
        mixes: &K::F,
        (scale, base): (&K::F, &K::F),
        spec: HyperSpec,
        n: usize,
        (a, b, c): (&mut K::F, &mut K::F, &mut K::F),
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(x),
            K::f_addr(mixes),
            K::f_addr(scale),
            K::f_addr(base),
            K::f_addr(a),
            K::f_addr(b),
            K::f_addr(c)
        );
        self.launch("hyper_pre", &addrs, (spec, n), |k| {
            k.hyper_pre(x, mixes, (scale, base), spec, n, (a, b, c))
        })
    }
    fn hyper_post(
        &self,
        x: &K::F,
        y: &K::F,
        post: &K::F,
        comb: &K::F,
        spec: HyperSpec,
        n: usize,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(x),
            K::f_addr(y),
            K::f_addr(post),
            K::f_addr(comb),
            K::f_addr(out)
        );
        self.launch("hyper_post", &addrs, (spec, n), |k| {
            k.hyper_post(x, y, post, comb, spec, n, out)
        })
    }
    fn hyper_head(
        &self,
        x: &K::F,
        mix: &K::F,
        (scale, base): (f32, &K::F),
        spec: HyperSpec,
        n: usize,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(x),
            K::f_addr(mix),
            K::f_addr(base),
            K::f_addr(out)
        );
        self.launch("hyper_head", &addrs, (scale.to_bits(), spec, n), |k| {
            k.hyper_head(x, mix, (scale, base), spec, n, out)
        })
    }
    fn add_periodic(
        &self,
        x: &mut K::F,
        bias: &K::F,
        period: usize,
        n: usize,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(x), K::f_addr(bias));
        self.launch("add_periodic", &addrs, (period, n), |k| {
            k.add_periodic(x, bias, period, n)
        })
    }
    fn sum_blocks(&self, x: &K::F, shape: (usize, usize), out: &mut K::F) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(x), K::f_addr(out));
        self.launch("sum_blocks", &addrs, shape, |k| k.sum_blocks(x, shape, out))
    }
    fn scale_values(&self, x: &mut K::F, by: f32, n: usize) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(x));
        self.launch("scale_values", &addrs, (by.to_bits(), n), |k| {
            k.scale_values(x, by, n)
        })
    }
    fn fp8_kv_store(
        &self,
        rows: &K::F,
        shape: (usize, usize),
        arena: &mut K::F,
        offsets: &K::L,
        n: usize,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(rows), K::f_addr(arena), K::l_addr(offsets));
        self.launch("fp8_kv_store", &addrs, (shape, n), |k| {
            k.fp8_kv_store(rows, shape, arena, offsets, n)
        })
    }
    fn fp8_kv_round(
        &self,
        rows: &mut K::F,
        shape: (usize, usize),
        n: usize,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(rows));
        self.launch("fp8_kv_round", &addrs, (shape, n), |k| {
            k.fp8_kv_round(rows, shape, n)
        })
    }
    fn compress_pool(
        &self,
        kv: &K::F,
        gate: &K::F,
        (prev_kv, prev_gate): (&K::F, &K::F),
        has_prev: &K::I,
        spec: PoolSpec,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(kv),
            K::f_addr(gate),
            K::f_addr(prev_kv),
            K::f_addr(prev_gate),
            K::i_addr(has_prev),
            K::f_addr(out)
        );
        self.launch("compress_pool", &addrs, spec, |k| {
            k.compress_pool(kv, gate, (prev_kv, prev_gate), has_prev, spec, out)
        })
    }
    fn indexer_scores(
        &self,
        q: &K::F,
        w: &K::F,
        keys: &K::F,
        starts: &K::L,
        visible: &K::I,
        spec: ScoreSpec,
        scores: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(q),
            K::f_addr(w),
            K::f_addr(keys),
            K::l_addr(starts),
            K::i_addr(visible),
            K::f_addr(scores)
        );
        self.launch("indexer_scores", &addrs, spec, |k| {
            k.indexer_scores(q, w, keys, starts, visible, spec, scores)
        })
    }
    fn indexer_topk(
        &self,
        scores: &K::F,
        visible: &K::I,
        shape: (usize, usize, usize),
        out: &mut K::I,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(scores), K::i_addr(visible), K::i_addr(out));
        self.launch("indexer_topk", &addrs, shape, |k| {
            k.indexer_topk(scores, visible, shape, out)
        })
    }
    fn chosen_offsets(
        &self,
        chosen: &K::I,
        k_: usize,
        (tokens, starts, counts, bases): (&K::I, &K::L, &K::I, &K::L),
        row_bytes: usize,
        entries: usize,
        offsets: &mut K::L,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::i_addr(chosen),
            K::i_addr(tokens),
            K::l_addr(starts),
            K::i_addr(counts),
            K::l_addr(bases),
            K::l_addr(offsets)
        );
        self.launch("chosen_offsets", &addrs, (k_, row_bytes, entries), |k| {
            k.chosen_offsets(
                chosen,
                k_,
                (tokens, starts, counts, bases),
                row_bytes,
                entries,
                offsets,
            )
        })
    }
    fn attn_exact(
        &self,
        q: &K::F,
        (pool, format): (&K::F, RowFormat),
        (offsets, starts): (&K::L, &K::L),
        sinks: &K::F,
        shape: (usize, usize, usize, usize),
        scale: f32,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(q),
            K::f_addr(pool),
            K::l_addr(offsets),
            K::l_addr(starts),
            K::f_addr(sinks),
            K::f_addr(out)
        );
        let scalars = (format, shape, scale.to_bits());
        self.launch("attn_exact", &addrs, scalars, |k| {
            k.attn_exact(
                q,
                (pool, format),
                (offsets, starts),
                sinks,
                shape,
                scale,
                out,
            )
        })
    }
    fn attn_fast(
        &self,
        q: &K::F,
        (pool, dims): (&K::F, (usize, usize)),
        (offsets, starts): (&K::L, &K::L),
        sinks: &K::F,
        shape: (usize, usize),
        scale: f32,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(q),
            K::f_addr(pool),
            K::l_addr(offsets),
            K::l_addr(starts),
            K::f_addr(sinks),
            K::f_addr(out)
        );
        let scalars = (dims, shape, scale.to_bits());
        self.launch("attn_fast", &addrs, scalars, |k| {
            k.attn_fast(q, (pool, dims), (offsets, starts), sinks, shape, scale, out)
        })
    }
    fn moe_route(
        &self,
        logits: &K::F,
        bias: Option<&K::F>,
        hash: Option<&K::Hash>,
        tokens: &K::I,
        spec: RouteSpec,
        scores: &mut K::F,
        (chosen, weights): (&mut K::I, &mut K::F),
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(logits),
            bias.map_or(0, K::f_addr),
            hash.map_or(0, at),
            K::i_addr(tokens),
            K::f_addr(scores),
            K::i_addr(chosen),
            K::f_addr(weights)
        );
        self.launch("moe_route", &addrs, spec, |k| {
            k.moe_route(logits, bias, hash, tokens, spec, scores, (chosen, weights))
        })
    }
    fn exact_pairs(
        &self,
        stack: &K::Stack,
        (tokens, experts): (&K::I, &K::I),
        x: &K::F,
        pairs: usize,
        y: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            at(stack),
            K::i_addr(tokens),
            K::i_addr(experts),
            K::f_addr(x),
            K::f_addr(y)
        );
        self.launch("exact_pairs", &addrs, pairs, |k| {
            k.exact_pairs(stack, (tokens, experts), x, pairs, y)
        })
    }
    fn fast_pairs(
        &self,
        stack: &K::Stack,
        (tokens, experts): (&K::I, &K::I),
        x: &K::F,
        pairs: usize,
        y: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            at(stack),
            K::i_addr(tokens),
            K::i_addr(experts),
            K::f_addr(x),
            K::f_addr(y),
        );
        self.launch("fast_pairs", &addrs, pairs, |k| {
            k.fast_pairs(stack, (tokens, experts), x, pairs, y)
        })
    }
    fn gemm_pairs(
        &self,
        stack: &K::Stack,
        (tokens, experts): (&K::I, &K::I),
        x: &K::F,
        pairs: usize,
        y: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            at(stack),
            K::i_addr(tokens),
            K::i_addr(experts),
            K::f_addr(x),
            K::f_addr(y),
        );
        self.launch("gemm_pairs", &addrs, pairs, |k| {
            k.gemm_pairs(stack, (tokens, experts), x, pairs, y)
        })
    }
    fn fast_linear_takes(w: &K::Rows) -> bool {
        K::fast_linear_takes(w)
    }
    fn fast_linear_scratch(&self, n: usize, rows: usize, cols: usize) -> usize {
        self.k.fast_linear_scratch(n, rows, cols)
    }
    fn fast_linear(
        &self,
        w: &K::Rows,
        rows: (usize, usize),
        x: &K::F,
        n: usize,
        scratch: &mut K::F,
        y: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, at(w), K::f_addr(x), K::f_addr(scratch), K::f_addr(y));
        self.launch("fast_linear", &addrs, (rows, n), |k| {
            k.fast_linear(w, rows, x, n, scratch, y)
        })
    }
    fn swiglu(
        &self,
        gate: &K::F,
        up: &K::F,
        n: usize,
        limit: f32,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(gate), K::f_addr(up), K::f_addr(out));
        self.launch("swiglu", &addrs, (n, limit.to_bits()), |k| {
            k.swiglu(gate, up, n, limit, out)
        })
    }
    fn argmax_rows(&self, x: &K::F, shape: (usize, usize), out: &mut K::I) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(x), K::i_addr(out));
        self.launch("argmax_rows", &addrs, shape, |k| {
            k.argmax_rows(x, shape, out)
        })
    }
    fn ep_slots(
        &self,
        experts: &K::I,
        spec: SlotSpec,
        send: &mut K::F,
        (pack_to, back_from): (&mut K::L, &mut K::L),
        counts: &mut K::I,
    ) -> Result<(), K::Error> {
        let (e, c) = (K::i_addr(experts), K::i_addr(counts));
        let (p, b) = (K::l_addr(pack_to), K::l_addr(back_from));
        let addrs = addrs!(self, e, K::f_addr(send), p, b, c);
        self.launch("ep_slots", &addrs, spec, |k| {
            k.ep_slots(experts, spec, send, (pack_to, back_from), counts)
        })
    }
    fn ep_take_ids(
        &self,
        recv: &K::F,
        at: &K::L,
        held: (usize, usize),
        m: usize,
        ids: &mut K::I,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(recv), K::l_addr(at), K::i_addr(ids));
        self.launch("ep_take_ids", &addrs, (held, m), |k| {
            k.ep_take_ids(recv, at, held, m, ids)
        })
    }
    fn held_ids(
        &self,
        experts: &K::I,
        held: (usize, usize),
        total: usize,
        pairs: usize,
        ids: &mut K::I,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::i_addr(experts), K::i_addr(ids));
        self.launch("held_ids", &addrs, (held, total, pairs), |k| {
            k.held_ids(experts, held, total, pairs, ids)
        })
    }
    fn clear_unheld_rows(
        &self,
        ys: &mut K::F,
        ids: &K::I,
        width: usize,
        pairs: usize,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(ys), K::i_addr(ids));
        self.launch("clear_unheld_rows", &addrs, (width, pairs), |k| {
            k.clear_unheld_rows(ys, ids, width, pairs)
        })
    }
    /// Only outside the passes: an exchange waits for the host (a graph cannot hold it).
    fn exchange_known(
        &self,
        coll: &mut dyn Collective,
        send: &K::F,
        sizes: (&[usize], &[usize]),
    ) -> Result<K::F, K::Error> {
        self.host_read(|k| k.exchange_known(coll, send, sizes))
    }
    fn gather_counts(
        &self,
        coll: &mut dyn Collective,
        counts: &K::I,
        n: usize,
    ) -> Result<Vec<Vec<i32>>, K::Error> {
        self.host_read(|k| k.gather_counts(coll, counts, n))
    }
    /// A collective of sizes the batch fixes, into a buffer of the step's: a launch (a
    /// graph holds it where the device's collectives run on its stream; a plan pass skips it).
    fn all_gather(
        &self,
        coll: &mut dyn Collective,
        send: &K::F,
        part: usize,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(self, K::f_addr(send), K::f_addr(out));
        self.launch("all_gather", &addrs, (part, coll.size()), |k| {
            k.all_gather(coll, send, part, out)
        })
    }
    fn all_owned(
        &self,
        coll: &mut dyn Collective,
        send: &K::F,
        len: usize,
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        // A launch, as `all_gather`.
        let addrs = addrs!(self, K::f_addr(send), K::f_addr(out));
        self.launch("all_owned", &addrs, (len, coll.size()), |k| {
            k.all_owned(coll, send, len, out)
        })
    }
    fn moe_combine(
        &self,
        (ys, weights, shared): (&K::F, &K::F, &K::F),
        shape: (usize, usize, usize),
        out: &mut K::F,
    ) -> Result<(), K::Error> {
        let addrs = addrs!(
            self,
            K::f_addr(ys),
            K::f_addr(weights),
            K::f_addr(shared),
            K::f_addr(out)
        );
        self.launch("moe_combine", &addrs, shape, |k| {
            k.moe_combine((ys, weights, shared), shape, out)
        })
    }

    fn begin_capture(&self) -> Result<bool, K::Error> {
        self.k.begin_capture()
    }
    fn graphs_hold_collectives(&self) -> Result<(), String> {
        self.k.graphs_hold_collectives()
    }
    fn end_capture(&self) -> Result<Option<K::Graph>, K::Error> {
        self.k.end_capture()
    }
    fn launch_graph(&self, graph: &K::Graph) -> Result<(), K::Error> {
        self.k.launch_graph(graph)
    }
}
