#!/usr/bin/env python3
"""Golden-logits tool for pdserve: runs HuggingFace `transformers` (the external oracle) on a
DeepSeek-V4 checkpoint in DeepSeek's *native* on-disk layout (docs/checkpoint-format.md) and
writes reference logits for the Rust engine's golden tests.

The loader here is deliberately independent of both the Rust engine and transformers'
quantizers: safetensors files are read through the `safetensors` package (torch framework,
raw bits only; a hand-written header parser is the fallback), every element format (BF16,
F8_E4M3, F8_E8M0, MXFP4, NVFP4) is decoded to float32 by explicit numpy tables/formulas in
this file, and native tensor names are renamed to transformers names by an explicit rule
list mirroring `transformers/conversion_mapping.py` ("deepseek_v4"). The model is then a
plain float32 `DeepseekV4ForCausalLM` with eager attention and eager experts.

Subcommands:
  logits    one full forward per prompt (batch 1, no padding, use_cache=False); writes a
            fixture JSON (see tools/golden/README.md for the schema); with --greedy N also
            N greedy tokens per prompt, each from a full forward (no cache).
  time      prefill + greedy decode timing of transformers on a checkpoint (2 threads).
  selftest  builds random tiny models, writes them in the native layout, reloads them through
            load_checkpoint and proves the round trip and the decoders; needs no Rust output.

Run with the venv made by tools/golden/setup-venv.sh:
  ~/.cache/pdserve/golden-venv/bin/python tools/golden/golden.py --help
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import re
import struct
import sys
import tempfile
import time

import numpy as np

GENERATOR = "tools/golden/golden.py"
NUM_THREADS = 2
SUBSET_STRIDE = 61
TOPK_IDS = 16

# ---------------------------------------------------------------------------------------------
# Element formats (pure numpy, no torch, no transformers)
# ---------------------------------------------------------------------------------------------

#: e2m1 (FP4) code -> value. Bit 3 is the sign, bits 0-2 index [0, 0.5, 1, 1.5, 2, 3, 4, 6].
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_TABLE = np.array(E2M1_MAGNITUDES + [-v for v in E2M1_MAGNITUDES], dtype=np.float64)


def _e4m3fn_value(byte: int) -> float:
    """OCP FP8 E4M3 "fn" variant: 1 sign, 4 exponent (bias 7), 3 mantissa bits, no infinities,
    subnormals when the exponent field is 0, S.1111.111 (0x7F / 0xFF) is NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return float("nan")
    if exp == 0:
        return sign * (man / 8.0) * 2.0 ** (1 - 7)  # subnormal: 0.mmm * 2^-6
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)


def _e8m0_value(byte: int) -> float:
    """OCP E8M0 scale: 2^(byte - 127); 0xFF is NaN."""
    if byte == 0xFF:
        return float("nan")
    return math.ldexp(1.0, byte - 127)


#: byte -> value tables, float64 (every value is exact in float64 and in float32).
E4M3FN_TABLE = np.array([_e4m3fn_value(b) for b in range(256)], dtype=np.float64)
E8M0_TABLE = np.array([_e8m0_value(b) for b in range(256)], dtype=np.float64)


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    """uint16 BF16 bit patterns -> float32 (exact: bf16 is the top half of an f32)."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def decode_e4m3fn(bytes_: np.ndarray) -> np.ndarray:
    return E4M3FN_TABLE[bytes_.astype(np.uint8)].astype(np.float32)


def decode_e8m0(bytes_: np.ndarray) -> np.ndarray:
    return E8M0_TABLE[bytes_.astype(np.uint8)].astype(np.float32)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """[..., n/2] bytes -> [..., n] codes; the low nibble is the even element."""
    packed = packed.astype(np.uint8)
    lo = packed & np.uint8(0x0F)
    hi = packed >> np.uint8(4)
    return np.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def dequant_fp8_block(weight: np.ndarray, scale: np.ndarray, block: int = 128) -> np.ndarray:
    """FP8 linear: weight [out, in] e4m3fn bytes, scale [ceil(out/128), ceil(in/128)] e8m0 bytes.
    W[r][c] = e4m3(w[r][c]) * 2^(scale[r//128][c//128] - 127). Partial edge blocks are allowed.
    The product is exact in float32 (a 4-bit significand times a power of two)."""
    if weight.ndim != 2:
        raise ValueError(f"FP8 block weight must be 2-D, got {weight.shape}")
    out_f, in_f = weight.shape
    want = (-(-out_f // block), -(-in_f // block))
    if tuple(scale.shape) != want:
        raise ValueError(f"FP8 block scale shape {tuple(scale.shape)} != {want} for weight {weight.shape}")
    w = E4M3FN_TABLE[weight.astype(np.uint8)]
    s = E8M0_TABLE[scale.astype(np.uint8)]
    s = np.repeat(np.repeat(s, block, axis=0), block, axis=1)[:out_f, :in_f]
    return (w * s).astype(np.float32)


def dequant_mxfp4(weight: np.ndarray, scale: np.ndarray, group: int = 32) -> np.ndarray:
    """MXFP4 expert: weight [out, in/2] packed e2m1 (I8 or U8 bits), scale [out, in/32] e8m0.
    W[r][c] = e2m1(code) * 2^(scale[r][c//32] - 127)."""
    codes = unpack_e2m1(weight)
    out_f, in_f = codes.shape
    if tuple(scale.shape) != (out_f, in_f // group) or in_f % group:
        raise ValueError(f"MXFP4 scale shape {tuple(scale.shape)} does not fit weight {weight.shape}")
    s = np.repeat(E8M0_TABLE[scale.astype(np.uint8)], group, axis=1)
    return (E2M1_TABLE[codes] * s).astype(np.float32)


def dequant_nvfp4(weight: np.ndarray, weight_scale: np.ndarray, weight_scale_2, group: int = 16) -> np.ndarray:
    """NVFP4 (ModelOpt) expert: weight [out, in/2] packed e2m1 (U8), weight_scale [out, in/16]
    e4m3fn bytes, weight_scale_2 a float32 scalar.
    W[r][c] = e2m1(code) * e4m3(weight_scale[r][c//16]) * weight_scale_2, computed as the
    correctly rounded float32 of the exact product (e2m1*e4m3 is exact in f32, so this equals
    `(e2m1 * e4m3) * weight_scale_2` evaluated in f32)."""
    codes = unpack_e2m1(weight)
    out_f, in_f = codes.shape
    if tuple(weight_scale.shape) != (out_f, in_f // group) or in_f % group:
        raise ValueError(f"NVFP4 weight_scale shape {tuple(weight_scale.shape)} does not fit weight {weight.shape}")
    s2 = float(np.asarray(weight_scale_2, dtype=np.float32).reshape(()))
    s = np.repeat(E4M3FN_TABLE[weight_scale.astype(np.uint8)], group, axis=1)
    return (E2M1_TABLE[codes] * s * s2).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# safetensors reading (raw bits; decoding is done above)
# ---------------------------------------------------------------------------------------------

#: safetensors dtype string -> numpy dtype holding the raw element bits.
_RAW_NP = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.uint8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8,
    "F8_E8M0": np.uint8, "I16": np.int16, "U16": np.uint16, "F16": np.float16, "BF16": np.uint16,
    "I32": np.int32, "U32": np.uint32, "F32": np.float32, "I64": np.int64, "U64": np.uint64,
    "F64": np.float64,
}


def read_safetensors_raw(path: str) -> dict:
    """Hand-written reader: {name: (dtype_str, raw numpy array)}. Header = u64 LE length + JSON."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _RAW_NP:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[base + a : base + b], dtype=np.dtype(_RAW_NP[dt]).newbyteorder("<"))
        out[name] = (dt, arr.reshape(info["shape"]).copy())
    return out


def read_safetensors(path: str) -> dict:
    """{name: (dtype_str, raw numpy array)} through the `safetensors` package (torch framework):
    tensors are only reinterpreted as integers of the same width, never converted by torch."""
    try:
        import torch
        from safetensors import safe_open
    except ImportError:
        return read_safetensors_raw(path)
    try:
        out = {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                dt = f.get_slice(name).get_dtype()
                t = f.get_tensor(name)
                if dt not in _RAW_NP:
                    raise ValueError(f"unsupported dtype {dt}")
                width = np.dtype(_RAW_NP[dt]).itemsize
                if dt in ("F32", "F64", "F16", "I8", "U8", "I16", "I32", "I64", "BOOL"):
                    arr = t.contiguous().numpy()
                else:
                    ti = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
                    arr = t.contiguous().view(ti).numpy()
                arr = arr.view(_RAW_NP[dt]).reshape(list(t.shape)).copy()
                out[name] = (dt, arr)
        return out
    except Exception as e:  # dtype the package/torch cannot give us: parse the bytes ourselves
        print(f"note: safetensors package could not read {path} ({e}); using the raw reader", file=sys.stderr)
        return read_safetensors_raw(path)


def _decode_plain(name: str, dt: str, arr: np.ndarray) -> np.ndarray:
    if dt == "BF16":
        return decode_bf16(arr)
    if dt in ("F32",):
        return arr.astype(np.float32)
    if dt in ("F16", "F64"):
        return arr.astype(np.float32)
    if dt == "F8_E4M3":
        return decode_e4m3fn(arr)
    if dt == "F8_E8M0":
        return decode_e8m0(arr)
    if dt in ("I32", "I64", "I16", "U16", "U32", "U8"):
        return arr.astype(np.int64)
    raise ValueError(f"tensor {name}: dtype {dt} has no plain decoding (missing companion scale?)")


def dequantize_native(raw: dict) -> tuple[dict, dict]:
    """Native raw tensors -> {native_name: float32 (or int64) array}, with the quantized
    formats folded into their `.weight`. Returns (tensors, per-format counts)."""
    out, used, counts = {}, set(), {}

    def count(kind):
        counts[kind] = counts.get(kind, 0) + 1

    for name in sorted(raw):
        if name.startswith("mtp."):
            used.add(name)
            count("ignored mtp.*")
            continue
        if not name.endswith(".weight"):
            continue
        base = name[: -len(".weight")]
        dt, w = raw[name]
        if base + ".weight_scale" in raw:  # NVFP4
            if base + ".weight_scale_2" not in raw:
                raise ValueError(f"{name}: NVFP4 weight without .weight_scale_2")
            if dt not in ("U8", "I8"):
                raise ValueError(f"{name}: NVFP4 weight dtype {dt}, expected U8")
            sdt, s = raw[base + ".weight_scale"]
            s2dt, s2 = raw[base + ".weight_scale_2"]
            if sdt != "F8_E4M3" or s2dt != "F32":
                raise ValueError(f"{name}: NVFP4 scales have dtypes {sdt}/{s2dt}, expected F8_E4M3/F32")
            out[name] = dequant_nvfp4(w, s, s2)
            used.update({name, base + ".weight_scale", base + ".weight_scale_2", base + ".input_scale"})
            count("nvfp4")
        elif base + ".scale" in raw:
            sdt, s = raw[base + ".scale"]
            if sdt != "F8_E8M0":
                raise ValueError(f"{name}: scale dtype {sdt}, expected F8_E8M0")
            if dt == "F8_E4M3":
                out[name] = dequant_fp8_block(w, s)
                count("fp8 block")
            elif dt in ("I8", "U8"):
                out[name] = dequant_mxfp4(w, s)
                count("mxfp4")
            else:
                raise ValueError(f"{name}: weight dtype {dt} with an e8m0 .scale")
            used.update({name, base + ".scale"})
    for name in sorted(raw):
        if name in used:
            continue
        if name.endswith((".scale", ".weight_scale", ".weight_scale_2", ".input_scale")):
            raise ValueError(f"orphan scale tensor {name}")
        dt, arr = raw[name]
        out[name] = _decode_plain(name, dt, arr)
        count(dt.lower())
        used.add(name)
    for name, arr in out.items():
        if arr.dtype == np.float32 and not np.isfinite(arr).all():
            raise ValueError(f"tensor {name} has non-finite values after decoding")
    return out, counts


# ---------------------------------------------------------------------------------------------
# Native -> transformers names (mirrors transformers/conversion_mapping.py "deepseek_v4")
# ---------------------------------------------------------------------------------------------

#: (regex, literal replacement), applied IN ORDER, each at most once (first match), chaining,
#: exactly like transformers' WeightRenaming list for "deepseek_v4".
RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"),
    (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"),
    (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"),
    (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"),
    (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_RENAMES = [(re.compile(p), r) for p, r in RENAMES]
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def rename_native(name: str) -> str:
    """Native name -> transformers name without the `model.` prefix and without expert
    stacking (routed experts come out as `layers.i.mlp.experts.e.w1.weight`)."""
    for rx, rep in _RENAMES:
        m = rx.search(name)
        if m:
            name = name.replace(m.group(0), rep, 1)
    return name


def hf_key(renamed: str) -> str:
    return renamed if renamed == "lm_head.weight" else "model." + renamed


def native_to_hf_state(tensors: dict) -> dict:
    """{native name: array} -> {transformers key: torch tensor}, experts stacked into
    `mlp.experts.gate_up_proj [E, 2I, D]` (w1 rows then w3 rows) and `mlp.experts.down_proj [E, D, I]`."""
    import torch

    state, experts = {}, {}
    for name, arr in tensors.items():
        renamed = rename_native(name)
        m = _EXPERT.match(renamed)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = arr
            continue
        key = hf_key(renamed)
        if key in state:
            raise ValueError(f"two native tensors map to {key}")
        state[key] = torch.from_numpy(np.ascontiguousarray(arr))
    for prefix, by_expert in experts.items():
        ids = sorted(by_expert)
        if ids != list(range(len(ids))):
            raise ValueError(f"{prefix}: expert ids are not 0..E-1: {ids[:10]}...")
        for e in ids:
            if set(by_expert[e]) != {"w1", "w2", "w3"}:
                raise ValueError(f"{prefix}.{e}: needs w1, w2 and w3, has {sorted(by_expert[e])}")
        gate_up = np.stack([np.concatenate([by_expert[e]["w1"], by_expert[e]["w3"]], axis=0) for e in ids])
        down = np.stack([by_expert[e]["w2"] for e in ids])
        state[hf_key(prefix + ".gate_up_proj")] = torch.from_numpy(np.ascontiguousarray(gate_up))
        state[hf_key(prefix + ".down_proj")] = torch.from_numpy(np.ascontiguousarray(down))
    return state


def load_checkpoint(model_dir: str, verbose: bool = True) -> tuple[dict, dict]:
    """Read config.json and every *.safetensors of a native-layout folder.
    Returns (native config dict, {transformers key: float32/int64 torch tensor})."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    raw = {}
    for path in files:
        for name, v in read_safetensors(path).items():
            if name in raw:
                raise ValueError(f"tensor {name} appears in more than one file")
            raw[name] = v
    tensors, counts = dequantize_native(raw)
    if verbose:
        print(f"loaded {len(raw)} native tensors from {len(files)} file(s): {counts}", file=sys.stderr)
    return cfg, native_to_hf_state(tensors)


# ---------------------------------------------------------------------------------------------
# transformers model
# ---------------------------------------------------------------------------------------------

#: native config keys removed before DeepseekV4Config(**cfg): quantization must not reach
#: transformers (the state dict is already plain float32), and dtype keys must not make the
#: model anything but float32.
STRIPPED_CONFIG_KEYS = ("quantization_config", "expert_dtype", "torch_dtype", "dtype")


def make_config(native_cfg: dict, verbose: bool = True):
    from transformers import DeepseekV4Config

    cfg = dict(native_cfg)
    stripped = [k for k in STRIPPED_CONFIG_KEYS if cfg.pop(k, None) is not None]
    if verbose and stripped:
        print(f"note: stripped native config keys {stripped} (weights are dequantized to float32 here)",
              file=sys.stderr)
    if cfg.get("n_shared_experts", 1) != 1:
        raise ValueError("n_shared_experts must be 1")
    config = DeepseekV4Config(**cfg, attn_implementation="eager", experts_implementation="eager")
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config


def build_model(native_cfg: dict, state: dict, verbose: bool = True):
    """Plain float32 DeepseekV4ForCausalLM from a native config dict and a transformers-named
    state dict; strict loading, loud on any missing/unexpected/mismatched key."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.set_num_threads(NUM_THREADS)
    config = make_config(native_cfg, verbose)
    model = DeepseekV4ForCausalLM(config).to(torch.float32)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    bad_shape = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or bad_shape:
        lines = ["STATE DICT MISMATCH between the native checkpoint and DeepseekV4ForCausalLM:"]
        lines += [f"  missing    {k} {tuple(expected[k].shape)}" for k in missing]
        lines += [f"  unexpected {k} {tuple(state[k].shape)}" for k in unexpected]
        lines += [f"  shape      {k}: model {tuple(expected[k].shape)} vs checkpoint {tuple(state[k].shape)}"
                  for k in bad_shape]
        raise RuntimeError("\n".join(lines))
    state = {k: v.to(expected[k].dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    model.eval()
    for n, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise RuntimeError(f"parameter {n} is {p.dtype}, expected float32")
    if model.config._attn_implementation != "eager" or model.config._experts_implementation != "eager":
        raise RuntimeError(f"implementations are {model.config._attn_implementation}/"
                           f"{model.config._experts_implementation}, expected eager/eager")
    return model


def load_model(model_dir: str, verbose: bool = True):
    cfg, state = load_checkpoint(model_dir, verbose)
    return build_model(cfg, state, verbose)


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fixture_positions(n: int) -> list[int]:
    return sorted({p for p in (0, 1, n // 2, n - 2, n - 1) if 0 <= p < n})


def forward_logits(model, ids: list[int]):
    """One full forward, batch 1, no padding, no cache. Returns [len, V] float32 torch tensor."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].float()


#: `logits` refuses to write a fixture whose prompts contain a discrete choice (router or
#: indexer top-k) decided by less than this relative gap; see README "Fragility".
DEFAULT_MIN_REL_GAP = 1e-6


def decision_margins(model, ids: list[int]) -> list[dict]:
    """The records of `forward_with_margins` (without the logits)."""
    return forward_with_margins(model, ids)[1]


def forward_with_margins(model, ids: list[int]):
    """One full forward (as `forward_logits`) with hooks that measure its discrete choices.
    Returns (logits [len, V] float32, records); the records are diagnostic, not stored.

    Gaps of the discrete choices inside one forward.
    For every top-k router and token: the gap between the k-th and (k+1)-th biased expert
    score. For every CSA indexer and query with more than index_topk causally visible entries:
    the gap between the k-th and (k+1)-th visible index score. Returns one record per
    (kind, layer, position): {kind, layer, position, gap, rel_gap, tied}; `rel_gap` is the gap
    over the row's max |score|; `tied` lists the candidates sharing the k-th score on an exact tie.
    A gap near float32 rounding noise means a correct reimplementation may pick differently
    (torch.topk breaks exact ties in an implementation-defined order, not by lowest index),
    and every logit from that position on can then differ by O(1)."""
    import torch
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl

    found = []
    hooks = []

    def router_hook(layer):
        def hook(mod, inputs, output):
            scores = mod.score_fn(output[0]) + mod.e_score_correction_bias
            top = torch.topk(scores, mod.top_k + 1, dim=-1).values
            gap = top[:, mod.top_k - 1] - top[:, mod.top_k]
            rel = gap / scores.abs().amax(dim=-1)
            for pos in range(scores.shape[0]):
                tied = []
                if gap[pos] == 0:
                    tied = (scores[pos] == top[pos, mod.top_k]).nonzero().flatten().tolist()
                found.append({"kind": "router", "layer": layer, "position": pos, "gap": float(gap[pos]),
                              "rel_gap": float(rel[pos]), "tied": tied})
        return hook

    def indexer_hook(layer, ratio, topk):
        def hook(mod, inputs, scores):
            for pos in range(scores.shape[1]):
                visible = (pos + 1) // ratio
                if visible <= topk:
                    continue
                row = scores[0, pos, :visible]
                top = torch.topk(row, topk + 1).values
                gap = float(top[topk - 1] - top[topk])
                tied = (row == top[topk]).nonzero().flatten().tolist() if gap == 0 else []
                found.append({"kind": "indexer", "layer": layer, "position": pos, "gap": gap,
                              "rel_gap": gap / float(row.abs().max()) if float(row.abs().max()) > 0 else 0.0,
                              "tied": tied})
        return hook

    for layer, block in enumerate(model.model.layers):
        for module in block.modules():
            if isinstance(module, mdl.DeepseekV4TopKRouter):
                hooks.append(module.register_forward_hook(router_hook(layer)))
            if isinstance(module, mdl.DeepseekV4Indexer):
                hooks.append(module.scorer.register_forward_hook(
                    indexer_hook(layer, module.compress_rate, module.index_topk)))
    try:
        logits = forward_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, found


def summarize_margins(found: list[dict]) -> dict:
    """{kind: tightest record} over decision_margins' records."""
    out = {}
    for r in found:
        if r["kind"] not in out or r["rel_gap"] < out[r["kind"]]["rel_gap"]:
            out[r["kind"]] = r
    return out


def greedy_continuation(model, ids: list[int], steps: int, measure: bool = True) -> tuple[list[int], list[dict]]:
    """`steps` greedy tokens after `ids` by FULL RECOMPUTATION (no KV cache): step k runs one
    full forward (batch 1, no padding, use_cache=False, positions 0..len+k-1) over
    `ids + tokens[:k]` and appends torch.argmax of the last row over the full vocabulary
    (the lowest id on an exact tie). Returns (tokens, records).

    With `measure`, every one of these forwards runs with the `decision_margins` hooks (all
    router/indexer choices of every position of that forward are recorded, positions relative
    to the start of the prompt, with `"step": k`), and each step adds a record of kind
    "greedy" (`position` = len+k-1, the row the token is taken from; `gap` = top1 - top2 logit;
    `rel_gap` = gap / max |logit|; `tied` = all ids sharing the max on an exact tie)."""
    import torch

    seq, tokens, records = list(ids), [], []
    for k in range(steps):
        if measure:
            logits, found = forward_with_margins(model, seq)
            for r in found:
                r["step"] = k
            records += found
        else:
            logits = forward_logits(model, seq)
        row = logits[-1]
        if not torch.isfinite(row).all():
            raise RuntimeError(f"non-finite logits at greedy step {k}")
        tok = int(torch.argmax(row))
        if measure:
            top = torch.topk(row, 2).values
            gap = float(top[0] - top[1])
            max_abs = float(row.abs().max())
            tied = (row == top[0]).nonzero().flatten().tolist() if gap == 0 else []
            records.append({"kind": "greedy", "layer": None, "position": len(seq) - 1, "step": k, "gap": gap,
                            "rel_gap": gap / max_abs if max_abs > 0 else 0.0, "tied": tied})
        tokens.append(tok)
        seq.append(tok)
    return tokens, records


def prompt_record(logits, ids: list[int]) -> dict:
    import torch

    n, vocab = logits.shape
    positions = fixture_positions(n)
    subset = set(range(0, vocab, SUBSET_STRIDE))
    rec = {"ids": list(ids), "positions": positions, "argmax": [], "top2_gap": [], "max_abs": []}
    for p in positions:
        row = logits[p]
        if not torch.isfinite(row).all():
            raise RuntimeError(f"non-finite logits at position {p}")
        top = torch.topk(row, min(TOPK_IDS, vocab))
        rec["argmax"].append(int(torch.argmax(row)))
        rec["top2_gap"].append(float(top.values[0] - top.values[1]) if vocab > 1 else 0.0)
        rec["max_abs"].append(float(row.abs().max()))
        subset.update(int(i) for i in top.indices)
    subset = sorted(subset)
    idx = torch.tensor(subset, dtype=torch.long)
    rec["subset_ids"] = subset
    rec["logits"] = [[float(x) for x in logits[p, idx]] for p in positions]
    return rec


def make_fixture(model_dir: str, prompts: list[list[int]], model=None) -> dict:
    import torch
    import transformers

    if model is None:
        model = load_model(model_dir)
    vocab = model.config.vocab_size
    shas = {os.path.basename(p): sha256_file(p) for p in sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))}
    fixture = {
        "generator": GENERATOR,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": {
            "dir_name": os.path.basename(os.path.normpath(model_dir)),
            "config_sha256": sha256_file(os.path.join(model_dir, "config.json")),
            "safetensors_sha256": shas,
        },
        "prompts": [],
    }
    for ids in prompts:
        if not ids or min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt ids must be non-empty and in [0, {vocab}): {ids[:8]}...")
        fixture["prompts"].append(prompt_record(forward_logits(model, ids), ids))
    return fixture


def parse_ids(text: str) -> list[int]:
    return [int(t) for t in re.split(r"[,\s]+", text.strip()) if t]


def cmd_logits(args) -> int:
    import torch

    torch.set_num_threads(NUM_THREADS)
    prompts = [parse_ids(s) for s in (args.ids or [])]
    if args.random:
        model_cfg = json.load(open(os.path.join(args.model, "config.json")))
        rng = np.random.default_rng(args.seed)
        prompts += [rng.integers(0, model_cfg["vocab_size"], size=n).tolist() for n in args.random]
    if not prompts:
        print("error: give at least one --ids or --random", file=sys.stderr)
        return 2
    if args.greedy < 0:
        print("error: --greedy must be >= 0", file=sys.stderr)
        return 2
    model = load_model(args.model)
    fixture = make_fixture(args.model, prompts, model=model)
    tight = []
    for i, p in enumerate(fixture["prompts"]):
        print(f"prompt {i}: len {len(p['ids'])}, positions {p['positions']}, argmax {p['argmax']}, "
              f"min top2_gap/max_abs {min(g / m for g, m in zip(p['top2_gap'], p['max_abs'])):.3g}")
        measure = args.min_rel_gap > 0
        found = []
        if args.greedy > 0:
            # Step 0 of the continuation is the forward over the prompt itself, so its records
            # are exactly decision_margins(model, ids); steps 1.. add the continuation forwards.
            toks, found = greedy_continuation(model, p["ids"], args.greedy, measure=measure)
            if toks[0] != p["argmax"][-1]:
                raise RuntimeError(f"prompt {i}: first greedy token {toks[0]} != argmax {p['argmax'][-1]} of the "
                                   f"last position (same forward)")
            p["greedy"] = toks
            print(f"  greedy {args.greedy} (full recompute): {toks}")
        elif measure:
            found = decision_margins(model, p["ids"])
        if not measure:
            continue
        # one record per (kind, layer, position): the tightest over all forwards that saw it
        dedup = {}
        for r in found:
            key = (r["kind"], r["layer"], r["position"])
            if key not in dedup or r["rel_gap"] < dedup[key]["rel_gap"]:
                dedup[key] = r
        found = list(dedup.values())
        for kind, r in sorted(summarize_margins(found).items()):
            where = (f"step {r['step']} (position {r['position']})" if kind == "greedy"
                     else f"layer {r['layer']} position {r['position']}")
            what = "top-1/top-2 logit" if kind == "greedy" else "top-k choice"
            print(f"  tightest {kind} {what}: {where}, gap {r['gap']:.3g}, relative {r['rel_gap']:.3g}")
        bad = sorted((r for r in found if r["rel_gap"] < args.min_rel_gap), key=lambda r: r["position"])
        for r in bad[:5]:
            what = f"exact tie among {r['tied']}" if r["tied"] else f"relative gap {r['rel_gap']:.3g}"
            if r["kind"] == "greedy":
                print(f"  TIGHT: greedy step {r['step']} (logits of position {r['position']}): top-2 {what}; the "
                      f"continuation from step {r['step']} on depends on float rounding", file=sys.stderr)
            else:
                print(f"  TIGHT: {r['kind']} layer {r['layer']} position {r['position']}: {what}; logits from "
                      f"position {r['position']} on depend on float rounding / torch.topk tie order", file=sys.stderr)
        tight += bad
    if tight and not args.allow_tight:
        print(f"error: {len(tight)} discrete choice(s) (router/indexer top-k or greedy top-2) with relative gap < "
              f"{args.min_rel_gap:g}; fixture NOT "
              f"written. Pick other prompts/seeds, or pass --allow-tight.", file=sys.stderr)
        return 3
    text = json.dumps(fixture, separators=(",", ":")) + "\n"
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out} ({len(text)} bytes, {len(prompts)} prompt(s))")
    if len(text) > 2_000_000:
        print("warning: fixture is larger than 2 MB", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def run_generation(model, ids: list[int], steps: int) -> tuple[float, float, list[int]]:
    """Prefill `ids` with use_cache=True, then `steps` greedy decode steps. Returns
    (prefill seconds, decode seconds, generated ids)."""
    import torch

    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
        cache = out.past_key_values
        tok = int(out.logits[0, -1].argmax())
        t1 = time.perf_counter()
        gen = [tok]
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[tok]], dtype=torch.long), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            gen.append(tok)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, gen


def cmd_time(args) -> int:
    import torch

    torch.set_num_threads(NUM_THREADS)
    t0 = time.perf_counter()
    model = load_model(args.model)
    print(f"load: {time.perf_counter() - t0:.2f} s")
    rng = np.random.default_rng(args.seed)
    ids = rng.integers(0, model.config.vocab_size, size=args.prompt_len).tolist()
    for _ in range(args.warmup):
        run_generation(model, ids, args.decode_steps)
    # Best of --repeat runs: this is what the engine's bench reports for itself too, so the
    # ratio is not decided by which side happened to share the machine with a noisy neighbour.
    runs = [run_generation(model, ids, args.decode_steps) for _ in range(max(1, args.repeat))]
    pre = min(r[0] for r in runs)
    dec = min(r[1] for r in runs)
    print(f"threads {torch.get_num_threads()}, prompt {args.prompt_len}, decode steps {args.decode_steps}, best of {len(runs)}")
    print(f"prefill: {pre:.3f} s = {args.prompt_len / pre:.1f} tok/s")
    if args.decode_steps:
        print(f"decode:  {dec:.3f} s = {args.decode_steps / dec:.1f} tok/s")
    return 0


# ---------------------------------------------------------------------------------------------
# Selftest
# ---------------------------------------------------------------------------------------------


def selftest_native_config(experts: str) -> dict:
    """Tiny config in the native (DeepSeek config.json) spelling, modelled on DeepSeek-V4-Flash's."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "head_dim": 32, "hidden_act": "silu", "hidden_size": 64,
        "index_head_dim": 16, "index_n_heads": 8, "index_topk": 4,
        "initializer_range": 0.02, "max_position_embeddings": 1048576,
        "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 6,
        "num_hash_layers": 2, "num_key_value_heads": 1, "num_nextn_predict_layers": 0,
        "o_groups": 2, "o_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
        "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                         "original_max_position_embeddings": 65536, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
        "sliding_window": 16, "swiglu_limit": 10.0, "tie_word_embeddings": False,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "vocab_size": 512, "compress_rope_theta": 160000,
        "compress_ratios": [0, 4, 128, 4, 128, 0],
        "expert_dtype": "bf16",
    }
    if experts == "mxfp4":
        # also exercise an MTP layer: compress_ratios gets L+1 entries and mtp.* tensors appear
        cfg["expert_dtype"] = "fp4"
        cfg["num_nextn_predict_layers"] = 1
        cfg["compress_ratios"] = [0, 4, 128, 4, 128, 0, 0]
    elif experts == "nvfp4":
        del cfg["expert_dtype"]
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8", "moe_quant_algo": "NVFP4",
                                      "weight_block_size": [128, 128]}
    return cfg


def native_layout(cfg: dict) -> dict:
    """Expected native tensors per docs/checkpoint-format.md: {name: (shape, kind)}, kind one of
    'bf16', 'f32', 'i32', 'fp8' (F8_E4M3 weight + e8m0 .scale), 'expert'."""
    V, D, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    H, hd = cfg["num_attention_heads"], cfg["head_dim"]
    qr, G, orank = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    HI, dI = cfg["index_n_heads"], cfg["index_head_dim"]
    E, k, I, hc, nh = (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                       cfg["hc_mult"], cfg["num_hash_layers"])
    t = {
        "embed.weight": ([V, D], "bf16"), "head.weight": ([V, D], "bf16"), "norm.weight": ([D], "bf16"),
        "hc_head_fn": ([hc, hc * D], "f32"), "hc_head_base": ([hc], "f32"), "hc_head_scale": ([1], "f32"),
    }
    mix = (2 + hc) * hc
    for i in range(L):
        p = f"layers.{i}."
        r = cfg["compress_ratios"][i]
        t.update({
            p + "attn_norm.weight": ([D], "bf16"), p + "ffn_norm.weight": ([D], "bf16"),
            p + "hc_attn_fn": ([mix, hc * D], "f32"), p + "hc_ffn_fn": ([mix, hc * D], "f32"),
            p + "hc_attn_base": ([mix], "f32"), p + "hc_ffn_base": ([mix], "f32"),
            p + "hc_attn_scale": ([3], "f32"), p + "hc_ffn_scale": ([3], "f32"),
            p + "attn.wq_a.weight": ([qr, D], "fp8"), p + "attn.q_norm.weight": ([qr], "bf16"),
            p + "attn.wq_b.weight": ([H * hd, qr], "fp8"), p + "attn.wkv.weight": ([hd, D], "fp8"),
            p + "attn.kv_norm.weight": ([hd], "bf16"), p + "attn.wo_a.weight": ([G * orank, H * hd // G], "fp8"),
            p + "attn.wo_b.weight": ([D, G * orank], "fp8"), p + "attn.attn_sink": ([H], "f32"),
            p + "ffn.gate.weight": ([E, D], "bf16"),
            p + "ffn.shared_experts.w1.weight": ([I, D], "fp8"), p + "ffn.shared_experts.w3.weight": ([I, D], "fp8"),
            p + "ffn.shared_experts.w2.weight": ([D, I], "fp8"),
        })
        if r == 4:
            t.update({
                p + "attn.compressor.wkv.weight": ([2 * hd, D], "bf16"),
                p + "attn.compressor.wgate.weight": ([2 * hd, D], "bf16"),
                p + "attn.compressor.ape": ([4, 2 * hd], "f32"),
                p + "attn.indexer.wq_b.weight": ([HI * dI, qr], "fp8"),
                p + "attn.indexer.weights_proj.weight": ([HI, D], "bf16"),
                p + "attn.indexer.compressor.wkv.weight": ([2 * dI, D], "bf16"),
                p + "attn.indexer.compressor.wgate.weight": ([2 * dI, D], "bf16"),
                p + "attn.indexer.compressor.ape": ([4, 2 * dI], "f32"),
                p + "attn.indexer.compressor.norm.weight": ([dI], "bf16"),
            })
        elif r == 128:
            t.update({
                p + "attn.compressor.wkv.weight": ([hd, D], "bf16"),
                p + "attn.compressor.wgate.weight": ([hd, D], "bf16"),
                p + "attn.compressor.ape": ([128, hd], "f32"),
            })
        if r in (4, 128):
            t[p + "attn.compressor.norm.weight"] = ([hd], "bf16")
        if i >= nh:
            t[p + "ffn.gate.bias"] = ([E], "f32")
        else:
            t[p + "ffn.gate.tid2eid"] = ([V, k], "i32")
        for e in range(E):
            t[p + f"ffn.experts.{e}.w1.weight"] = ([I, D], "expert")
            t[p + f"ffn.experts.{e}.w3.weight"] = ([I, D], "expert")
            t[p + f"ffn.experts.{e}.w2.weight"] = ([D, I], "expert")
    return t


def _randomize(model, gen) -> None:
    """Non-trivial random values for every parameter/buffer (the default init zeroes sinks,
    biases and position biases and sets norms/scales to one)."""
    import torch

    E = model.config.n_routed_experts
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                V, k = p.shape
                p.copy_(torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(V)]))
                continue
            n = lambda *s: torch.randn(*s, generator=gen)
            if p.ndim == 1 and ("norm" in name):
                p.copy_(1.0 + 0.2 * n(p.shape))
            elif name.endswith(("hc.scale", "hc_scale")):
                p.copy_(0.5 + 0.5 * torch.rand(p.shape, generator=gen))
            elif name.endswith(("hc.base", "hc_base")):
                p.copy_(0.5 * n(p.shape))
            elif name.endswith(("hc.fn", "hc_fn")):
                p.copy_(0.05 * n(p.shape))
            elif name.endswith("sinks"):
                p.copy_(n(p.shape))
            elif name.endswith("position_bias"):
                p.copy_(0.5 * n(p.shape))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * n(p.shape))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(n(p.shape))
            elif p.ndim >= 2:
                fan_in = p.shape[-1]
                p.copy_(n(p.shape) * (1.5 / math.sqrt(fan_in)))
            else:
                raise RuntimeError(f"selftest does not know how to randomize {name} {tuple(p.shape)}")


def _quant_fp8_block(w, block: int = 128):
    """torch reference: e4m3fn weight bytes, e8m0 scale bytes, and torch's own dequantization."""
    import torch

    out_f, in_f = w.shape
    nb_r, nb_c = -(-out_f // block), -(-in_f // block)
    pad = torch.zeros(nb_r * block, nb_c * block, dtype=torch.float32)
    pad[:out_f, :in_f] = w
    amax = pad.abs().view(nb_r, block, nb_c, block).amax(dim=(1, 3)).double()
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / 448.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scale = torch.pow(2.0, exp).float()
    s_full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    q = (w / s_full).to(torch.float8_e4m3fn)
    sbytes = (exp + 127).to(torch.uint8)
    ref = q.float() * s_full
    return q, sbytes.view(torch.float8_e8m0fnu), ref


def _quant_fp4_groups(w, group: int):
    """FP4 rendering helpers for `w`: groups along the input dim, their amax, the e2m1 magnitudes."""
    import torch

    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    out_f, in_f = w.shape
    g = w.view(out_f, in_f // group, group)
    amax = g.abs().amax(dim=-1).clamp_min(1e-12)
    return g, amax, mags


def _pack_codes(codes):
    import torch

    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _nearest_codes(x, mags):
    """x already divided by its scale; nearest e2m1 code (sign bit 3)."""
    import torch

    idx = (x.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)
    return torch.where(x < 0, idx + 8, idx).to(torch.uint8)


def _quant_mxfp4(w):
    import torch

    g, amax, mags = _quant_fp4_groups(w, 32)
    exp = torch.ceil(torch.log2(amax.double() / 6.0)).clamp(-127, 127)
    scale = torch.pow(2.0, exp).float()
    codes = _nearest_codes(g / scale.unsqueeze(-1), mags).view(w.shape)
    vals = torch.tensor(E2M1_MAGNITUDES + [-v for v in E2M1_MAGNITUDES], dtype=torch.float32)[codes.long()]
    ref = (vals.view(g.shape) * scale.unsqueeze(-1)).view(w.shape)
    return _pack_codes(codes).view(torch.int8), (exp + 127).to(torch.uint8).view(torch.float8_e8m0fnu), ref


def _quant_nvfp4(w, s2: float):
    import torch

    g, amax, mags = _quant_fp4_groups(w, 16)
    ws = (amax / 6.0 / s2).clamp(max=448.0).to(torch.float8_e4m3fn)
    wsf = ws.float()
    wsf_safe = torch.where(wsf > 0, wsf, torch.ones_like(wsf))
    codes = _nearest_codes(g / (wsf_safe * s2).unsqueeze(-1), mags).view(w.shape)
    vals = torch.tensor(E2M1_MAGNITUDES + [-v for v in E2M1_MAGNITUDES], dtype=torch.float64)[codes.long()]
    ref = (vals.view(g.shape) * wsf.double().unsqueeze(-1) * s2).float().view(w.shape)
    return _pack_codes(codes), ws, ref


def write_native_checkpoint(model, native_cfg: dict, out_dir: str, experts: str, gen) -> dict:
    """Write `model` (transformers naming) in the native layout; returns the reference
    transformers state dict made of torch's own dequantization of what was written."""
    import torch
    from safetensors.torch import save_file

    layout = native_layout(native_cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    I = native_cfg["moe_intermediate_size"]
    tensors, ref = {}, {}
    covered = set()
    expert_ref = {}
    for name, (shape, kind) in layout.items():
        renamed = rename_native(name)
        m = _EXPERT.match(renamed)
        if m:
            prefix, e, which = m.group(1), int(m.group(2)), m.group(3)
            key = hf_key(prefix + (".down_proj" if which == "w2" else ".gate_up_proj"))
            full = sd[key][e]  # gate_up_proj[e] = [w1; w3], down_proj[e] = w2
            src = (full[:I] if which == "w1" else full[I:] if which == "w3" else full).contiguous()
            covered.add(key)
        else:
            key = hf_key(renamed)
            if key not in sd:
                raise RuntimeError(f"native name {name} maps to {key}, which the model does not have")
            src = sd[key]
            covered.add(key)
        if list(src.shape) != list(shape):
            raise RuntimeError(f"{name}: docs shape {shape} but model {key} has {list(src.shape)}")
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if kind == "bf16":
            tensors[name] = src.to(torch.bfloat16)
            val = tensors[name].float()
        elif kind == "f32":
            tensors[name] = src.float().contiguous()
            val = tensors[name]
        elif kind == "i32":
            tensors[name] = src.to(torch.int32)
            val = src
        elif kind == "fp8":
            q, s, val = _quant_fp8_block(src.float())
            tensors[name], tensors[base + ".scale"] = q, s
        elif kind == "expert":
            if experts == "bf16":
                tensors[name] = src.to(torch.bfloat16)
                val = tensors[name].float()
            elif experts == "mxfp4":
                q, s, val = _quant_mxfp4(src.float())
                tensors[name], tensors[base + ".scale"] = q, s
            elif experts == "nvfp4":
                # w1 and w3 of one expert share weight_scale_2 (as in ModelOpt checkpoints)
                s2 = float(np.float32(0.01 * (1 + e % 7) if which != "w2" else 0.013))
                q, ws, val = _quant_nvfp4(src.float(), s2)
                tensors[name], tensors[base + ".weight_scale"] = q, ws
                tensors[base + ".weight_scale_2"] = torch.tensor(s2, dtype=torch.float32)
                tensors[base + ".input_scale"] = torch.tensor(0.5, dtype=torch.float32)
            else:
                raise ValueError(experts)
        else:
            raise ValueError(kind)
        if m:
            expert_ref.setdefault(key, {})[(e, which)] = val
        else:
            ref[key] = val.to(sd[key].dtype)
    for key, parts in expert_ref.items():
        E = native_cfg["n_routed_experts"]
        if key.endswith("gate_up_proj"):
            ref[key] = torch.stack([torch.cat([parts[(e, "w1")], parts[(e, "w3")]], 0) for e in range(E)])
        else:
            ref[key] = torch.stack([parts[(e, "w2")] for e in range(E)])
    uncovered = sorted(set(sd) - covered)
    if uncovered:
        raise RuntimeError(f"model keys not produced by any native tensor: {uncovered}")
    if native_cfg.get("num_nextn_predict_layers", 0):
        tensors["mtp.0.embed.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
        tensors["mtp.0.attn.wq_a.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
        tensors["mtp.0.attn.wq_a.scale"] = torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(tensors)
    half = len(names) // 2  # two shards, to exercise multi-file loading
    save_file({n: tensors[n].contiguous() for n in names[:half]}, os.path.join(out_dir, "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n].contiguous() for n in names[half:]}, os.path.join(out_dir, "model-00002-of-00002.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(native_cfg, f, indent=2)
    if experts == "nvfp4":
        with open(os.path.join(out_dir, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8",
                       "moe_quant_algo": "NVFP4", "group_size": 16}}, f)
    return ref


def _check(cond: bool, what: str) -> None:
    print(f"  [{'ok' if cond else 'FAIL'}] {what}")
    if not cond:
        raise AssertionError(what)


def selftest_decoders() -> None:
    import torch

    print("decoders:")
    allb = torch.arange(256, dtype=torch.uint8)
    ours = decode_e4m3fn(allb.numpy())
    theirs = allb.view(torch.float8_e4m3fn).float().numpy()
    nan = np.isnan(ours)
    _check(list(np.nonzero(nan)[0]) == [0x7F, 0xFF], "e4m3fn: NaN exactly at 0x7F and 0xFF")
    _check(np.array_equal(ours[~nan], theirs[~nan]) and np.isnan(theirs[nan]).all(),
           "e4m3fn table == torch.float8_e4m3fn for all 256 bytes")
    _check(ours[0x01] == 2.0 ** -9 and ours[0x08] == 2.0 ** -6 and ours[0x7E] == 448.0 and ours[0x38] == 1.0
           and ours[0xC4] == -3.0, "e4m3fn hand values (0x01=2^-9, 0x08=2^-6, 0x7E=448, 0x38=1, 0xC4=-3)")
    ours = decode_e8m0(allb.numpy())
    theirs = allb.view(torch.float8_e8m0fnu).float().numpy()
    _check(np.isnan(ours[255]) and np.array_equal(ours[:255], theirs[:255]),
           "e8m0 table == torch.float8_e8m0fnu for all 256 bytes (0xFF NaN)")
    _check(ours[127] == 1.0 and ours[0] == 2.0 ** -127 and ours[254] == 2.0 ** 127, "e8m0 2^(b-127) hand values")
    bits = np.array([0x3F80, 0xBF80, 0x4049, 0x0001, 0x7F7F], dtype=np.uint16)
    _check(np.array_equal(decode_bf16(bits), torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()),
           "bf16 bits -> f32 == torch")

    # MXFP4, hand-computed: all 16 codes, low nibble = even element.
    row = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE] * 2, dtype=np.uint8)  # 32 elements
    codes_vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    w = np.stack([row, np.full(16, 0x71, dtype=np.uint8)]).view(np.int8)  # I8 storage
    scale = np.array([[128], [126]], dtype=np.uint8)  # 2^1 and 2^-1
    got = dequant_mxfp4(w, scale)
    want = np.array([[2.0 * v for v in codes_vals * 2], [0.5 * v for v in [0.5, 6.0] * 16]], dtype=np.float32)
    _check(np.array_equal(got, want) and np.signbit(got[0, 8]), "MXFP4: 16 codes x 2^(128-127), byte 0x71 = [0.5, 6.0]")
    # NVFP4, hand-computed: e4m3 group scales 1.0 (0x38), 1.5 (0x3C), 2^-9 (0x01), -2 (0xC0); scale_2 0.25.
    w = np.stack([np.concatenate([row, row]), np.full(32, 0x71, dtype=np.uint8)])  # 64 elements per row
    ws = np.array([[0x38, 0x3C, 0x01, 0xC0], [0x40, 0x00, 0x7E, 0x08]], dtype=np.uint8)
    got = dequant_nvfp4(w, ws, np.float32(0.25))
    gs = [[1.0, 1.5, 2.0 ** -9, -2.0], [2.0, 0.0, 448.0, 2.0 ** -6]]
    want = np.array([[codes_vals[j % 16] * gs[0][j // 16] * 0.25 for j in range(64)],
                     [[0.5, 6.0][j % 2] * gs[1][j // 16] * 0.25 for j in range(64)]], dtype=np.float32)
    _check(np.array_equal(got, want), "NVFP4: code * e4m3(group of 16) * weight_scale_2 (hand values)")
    _check(got[1, 0] == 0.25 and got[1, 1] == 3.0 and got[1, 33] == 6.0 * 448.0 * 0.25, "NVFP4: byte 0x71 -> [0.5, 6.0] * scales")

    # FP8 block with partial edge blocks and block-dependent magnitudes, vs torch's dequantization.
    gen = torch.Generator().manual_seed(1)
    big = torch.randn(300, 200, generator=gen) * torch.logspace(-3, 2, 300).unsqueeze(1)
    q, s, ref = _quant_fp8_block(big)
    ours = dequant_fp8_block(q.view(torch.uint8).numpy(), s.view(torch.uint8).numpy())
    _check(tuple(s.shape) == (3, 2) and np.array_equal(ours, ref.numpy()),
           "FP8 128x128 block [300,200] (edge blocks 44 rows / 72 cols) == torch dequant, bitwise")


def selftest_roundtrip(experts: str, prompt_len: int = 300, keep: str | None = None) -> None:
    import torch
    from transformers import DeepseekV4ForCausalLM
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    print(f"round trip, experts={experts}:")
    torch.set_num_threads(NUM_THREADS)
    gen = torch.Generator().manual_seed({"bf16": 11, "mxfp4": 12, "nvfp4": 13}[experts])
    native_cfg = selftest_native_config(experts)
    config = make_config(native_cfg, verbose=False)
    if experts == "bf16":
        print(f"  config.rope_parameters = {config.rope_parameters}")
        print(f"  config.layer_types = {config.layer_types}")
        print(f"  config.mlp_layer_types = {config.mlp_layer_types}")
    rp = config.rope_parameters
    _check(rp["main"] == {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25},
           "rope 'main' = default RoPE, theta 10000, partial 8/32")
    c = rp["compress"]
    _check(c["rope_type"] == "yarn" and c["attention_factor"] == 1.0 and c["rope_theta"] == 160000
           and c["factor"] == 16 and c["original_max_position_embeddings"] == 65536
           and c["beta_fast"] == 32 and c["beta_slow"] == 1,
           "rope 'compress' = YaRN(factor 16, orig 65536, beta 32/1), theta 160000, attention_factor 1.0")
    n = native_cfg["num_hidden_layers"]
    want_types = [{0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}[r]
                  for r in native_cfg["compress_ratios"][:n]]
    _check(config.layer_types == want_types and len(config.layer_types) == n,
           f"compress_ratios ({len(native_cfg['compress_ratios'])} entries) -> {n} layer_types")
    _check(config.mlp_layer_types == ["hash_moe"] * 2 + ["moe"] * (n - 2), "num_hash_layers 2 -> 2 hash_moe layers")
    _check(config.qk_rope_head_dim == 8 and config.partial_rotary_factor == 0.25, "qk_rope_head_dim 8 -> partial_rotary_factor 0.25")
    _check(not hasattr(config, "quantization_config") or config.quantization_config is None,
           "no quantization_config reaches transformers")

    original = DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    _randomize(original, gen)
    if experts == "bf16":
        re_ = original.model.rotary_emb
        print(f"  main inv_freq     = {re_.main_inv_freq.tolist()}")
        print(f"  compress inv_freq = {re_.compress_inv_freq.tolist()} (attention_scaling "
              f"{re_.compress_attention_scaling})")

    # Our renaming vs transformers' own conversion machinery, for every native name.
    mapping = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    layout = native_layout(native_cfg)
    sd_keys = set(original.state_dict())
    diffs, theirs_all = [], set()
    for name in layout:
        theirs, _ = rename_source_key(name, renamings, converters, base_model_prefix="model",
                                      meta_state_dict=original.state_dict())
        theirs_all.add(theirs)
        mine = rename_native(name)
        m = _EXPERT.match(mine)
        mine = hf_key(m.group(1) + (".down_proj" if m.group(3) == "w2" else ".gate_up_proj")) if m else hf_key(mine)
        if mine != theirs:
            diffs.append((name, mine, theirs))
    for d in diffs[:10]:
        print(f"    rename differs: {d}")
    _check(not diffs, f"rename_native == transformers rename_source_key for all {len(layout)} native names")
    _check(theirs_all == sd_keys, f"native names (docs table) cover all {len(sd_keys)} model state keys, nothing extra")

    with tempfile.TemporaryDirectory(prefix=f"golden-selftest-{experts}-") as tmp:
        if keep:
            tmp = os.path.join(keep, f"selftest-{experts}")
            for old in glob.glob(os.path.join(tmp, "*.safetensors")):
                os.remove(old)
            print(f"  keeping the native checkpoint in {tmp}")
        ref_state = write_native_checkpoint(original, native_cfg, tmp, experts, gen)
        files = sorted(glob.glob(os.path.join(tmp, "*.safetensors")))
        # The safetensors package path and the hand-written reader agree bit for bit.
        same = True
        for path in files:
            a, b = read_safetensors(path), read_safetensors_raw(path)
            same &= a.keys() == b.keys() and all(a[k][0] == b[k][0] and a[k][1].dtype == b[k][1].dtype
                                                  and np.array_equal(a[k][1], b[k][1]) for k in a)
        _check(same, "safetensors-package reader == raw header reader (dtype strings and bits)")
        raw_dtypes = sorted({dt for p in files for dt, _ in read_safetensors_raw(p).values()})
        print(f"  native dtypes written: {raw_dtypes}")

        cfg_loaded, state = load_checkpoint(tmp, verbose=True)
        _check(set(state) == sd_keys, "load_checkpoint yields exactly the model's state keys")
        mism = [k for k in sd_keys if not torch.equal(state[k].to(ref_state[k].dtype), ref_state[k])]
        for k in mism[:10]:
            print(f"    differs: {k} max {float((state[k].float() - ref_state[k].float()).abs().max())}")
        _check(not mism, "every dequantized tensor == torch's own dequantization of the written bytes (bitwise)")

        reloaded = build_model(cfg_loaded, state, verbose=False)
        reference = DeepseekV4ForCausalLM(make_config(native_cfg, verbose=False)).to(torch.float32).eval()
        reference.load_state_dict(ref_state, strict=True)
        ids = torch.randint(0, native_cfg["vocab_size"], (prompt_len,), generator=gen).tolist()
        la = forward_logits(reloaded, ids)
        lb = forward_logits(reference, ids)
        lo = forward_logits(original, ids)
        diff = float((la - lb).abs().max())
        _check(diff == 0.0, f"{prompt_len}-token logits: reloaded == model from dequantized weights (max |diff| {diff})")
        osd = original.state_dict()
        terr = max((float((ref_state[k].float() - osd[k].float()).norm() / osd[k].float().norm()), k)
                   for k in osd if osd[k].is_floating_point() and osd[k].float().norm() > 0)
        _check(terr[0] < 0.25, f"quantized tensors stay close to the originals (worst relative L2 error "
                               f"{terr[0]:.3g}, {terr[1]})")
        qerr = float((lo - lb).abs().max() / lo.abs().max())
        print(f"  info: logits of the unquantized random model vs the quantized one: max|diff|/max|logit| = "
              f"{qerr:.3g} (large: router/indexer top-k choices flip)")
        # sensitivity: the CSA indexer must matter at this length (index_topk 4 < 75 windows)
        print(f"  info: logits std {float(la.std()):.3g}, argmax of last position {int(la[-1].argmax())}")

        if experts == "bf16":
            selftest_model_behaviour(reloaded, ids, la)
            found = decision_margins(reloaded, ids)
            summary = summarize_margins(found)
            print(f"  info: tightest top-k choices on the 300-token prompt: "
                  f"{ {k: (r['layer'], r['position'], r['rel_gap']) for k, r in summary.items()} }")
            n_router = (n - 2) * prompt_len  # 4 top-k routed layers x every token
            n_indexer = 2 * sum(1 for t in range(prompt_len) if (t + 1) // 4 > 4)  # 2 CSA layers
            _check(sum(r["kind"] == "router" for r in found) == n_router
                   and sum(r["kind"] == "indexer" for r in found) == n_indexer,
                   f"decision_margins sees every router ({n_router}) and indexer ({n_indexer}) choice")
            g0, steps = 40, 4
            toks, recs = greedy_continuation(reloaded, ids[:g0], steps)
            lens = range(g0, g0 + steps)
            g_router = (n - 2) * sum(lens)
            g_indexer = 2 * sum(1 for L in lens for t in range(L) if (t + 1) // 4 > 4)
            greedy_recs = [r for r in recs if r["kind"] == "greedy"]
            _check(sum(r["kind"] == "router" for r in recs) == g_router
                   and sum(r["kind"] == "indexer" for r in recs) == g_indexer
                   and [r["position"] for r in greedy_recs] == [L - 1 for L in lens]
                   and toks[0] == int(la[g0 - 1].argmax()),
                   f"greedy_continuation: {steps} full forwards, every router ({g_router}) / indexer "
                   f"({g_indexer}) choice and every step's top-2 gap measured; step 0 = argmax of the prompt")
            _, _, cached = run_generation(reloaded, ids[:g0], steps - 1)
            print(f"  info: greedy {toks} (full recompute) vs cached decode {cached}: "
                  f"{'same' if cached == toks else 'DIFFERENT'}; tightest step rel gap "
                  f"{min(r['rel_gap'] for r in greedy_recs):.3g}")
            fx = make_fixture(tmp, [ids, ids[:7], ids[:1]], model=reloaded)
            text = json.dumps(fx, separators=(",", ":"))
            p0 = fx["prompts"][0]
            _check(p0["positions"] == [0, 1, 150, 298, 299] and fx["prompts"][1]["positions"] == [0, 1, 3, 5, 6]
                   and fx["prompts"][2]["positions"] == [0], "fixture positions 0,1,len//2,len-2,len-1 (dedup, in range)")
            top16 = set(torch.topk(la[299], 16).indices.tolist())
            _check(set(range(0, 512, 61)) | top16 <= set(p0["subset_ids"]) and p0["subset_ids"] == sorted(p0["subset_ids"]),
                   "subset_ids = every 61st id + top-16 per position, sorted")
            j = p0["subset_ids"].index(p0["argmax"][-1])
            _check(p0["logits"][-1][j] == float(la[299].max()) and p0["max_abs"][-1] == float(la[299].abs().max()),
                   "stored values are the exact float32 logits")
            _check(json.loads(text) == fx, f"fixture JSON round-trips ({len(text)} bytes for 3 prompts)")


def selftest_model_behaviour(model, ids, full_logits) -> None:
    """Informational checks of transformers behaviour the Rust side must match."""
    import torch

    # use_cache=True prefill == use_cache=False forward
    with torch.no_grad():
        lc = model(input_ids=torch.tensor([ids]), use_cache=True).logits[0]
    d = float((lc - full_logits).abs().max())
    print(f"  info: prefill with use_cache=True vs use_cache=False: max |diff| {d:.3g}")
    # incremental decode (cache) vs full recompute
    n0 = 40
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids[:n0]]), use_cache=True)
        cache = out.past_key_values
        worst = 0.0
        for t in range(n0, n0 + 100):
            out = model(input_ids=torch.tensor([[ids[t]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            worst = max(worst, float((out.logits[0, -1] - full_logits[t]).abs().max() / full_logits[t].abs().max()))
    print(f"  info: cached decode of positions {n0}..{n0 + 99} vs full forward: max rel diff {worst:.3g}")
    # single-token prompt works
    l1 = forward_logits(model, ids[:1])
    print(f"  info: 1-token prompt logits vs position 0 of the long prompt: max |diff| "
          f"{float((l1[0] - full_logits[0]).abs().max()):.3g}")
    ties = torch.topk(torch.zeros(75), 4).indices.tolist()
    print(f"  info: torch.topk order on an exact tie (75 zeros, k=4) picks {ties}, not the lowest indices")
    # grouped_mm experts vs eager (transformers' default when not forced)
    model.config._experts_implementation = "grouped_mm"
    try:
        lg = forward_logits(model, ids)
        print(f"  info: experts grouped_mm vs eager: max |diff| {float((lg - full_logits).abs().max()):.3g}")
    except Exception as e:  # pragma: no cover - informational only
        print(f"  info: grouped_mm experts unavailable ({type(e).__name__}: {e})")
    finally:
        model.config._experts_implementation = "eager"


def cmd_selftest(args) -> int:
    import torch
    import transformers

    torch.set_num_threads(NUM_THREADS)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, numpy {np.__version__}")
    t0 = time.perf_counter()
    selftest_decoders()
    for experts in args.experts:
        selftest_roundtrip(experts, keep=args.keep)
    print(f"selftest passed in {time.perf_counter() - t0:.1f} s")
    return 0


# ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("logits", help="write a golden-logits fixture JSON")
    p.add_argument("--model", required=True, help="native-layout checkpoint folder")
    p.add_argument("--ids", action="append", help="comma-separated token ids of one prompt (repeatable)")
    p.add_argument("--random", type=int, action="append", metavar="LEN",
                   help="add a prompt of LEN uniformly random ids (repeatable; see --seed)")
    p.add_argument("--seed", type=int, default=0, help="seed for --random prompts (default 0)")
    p.add_argument("--out", required=True, help="fixture path, e.g. engine/tests/golden/tiny-bf16.json")
    p.add_argument("--min-rel-gap", type=float, default=DEFAULT_MIN_REL_GAP,
                   help="refuse prompts where a router/indexer top-k choice is decided by a relative gap "
                        f"below this (default {DEFAULT_MIN_REL_GAP:g}; 0 disables the check)")
    p.add_argument("--allow-tight", action="store_true", help="write the fixture even with tight choices")
    p.add_argument("--greedy", type=int, default=0, metavar="N",
                   help="also store N greedy tokens per prompt as \"greedy\" (full recomputation, argmax over "
                        "the full vocab; every forward and every step's top-2 gap is checked like the prompt's; "
                        "default 0: no key)")
    p.set_defaults(fn=cmd_logits)

    p = sub.add_parser("time", help="time transformers prefill and greedy decode (2 threads)")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--decode-steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up runs (default 1)")
    p.add_argument("--repeat", type=int, default=1, help="timed runs; the fastest is reported (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_time)

    p = sub.add_parser("selftest", help="prove the loader, decoders and name mapping (no Rust needed)")
    p.add_argument("--experts", nargs="+", default=["bf16", "mxfp4", "nvfp4"], choices=["bf16", "mxfp4", "nvfp4"])
    p.add_argument("--keep", metavar="DIR",
                   help="keep the written tiny native checkpoints in DIR/selftest-<experts> (e.g. for `time`)")
    p.set_defaults(fn=cmd_selftest)

    args = ap.parse_args(argv)
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
        import transformers
    except ImportError as e:
        print(f"error: {e}; run tools/golden/setup-venv.sh and use ~/.cache/pdserve/golden-venv/bin/python",
              file=sys.stderr)
        return 2
    if transformers.__version__ != "5.23.0":
        print(f"warning: transformers {transformers.__version__}, the oracle is pinned to 5.23.0", file=sys.stderr)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
