"""The torch side of a profile run: a Llama-architecture model with random weights in plain torch
ops over a preallocated KV pool, the attention backends (flash-attn varlen, SDPA) that lay a
composition out in the pool, and the probe that checks a backend against a float32 reference.

Torch is passed in (`torch: Any`), never imported here, so that importing this module (as the
dry run does) needs no torch and the code type-checks where torch is absent.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from iteration_profiler.plan import Composition, decode_groups

if TYPE_CHECKING:
    from evolving_infra.timing.specs import ModelConfig


class Model:
    """Random-weight Llama layers in plain torch ops over a preallocated, token-major KV pool:
    per layer a [2, capacity, kv_heads, head_dim] tensor (K then V)."""

    def __init__(
        self, torch: Any, arch: ModelConfig, layers: int, device: Any, dtype: Any, seed: int
    ) -> None:
        self.torch, self.arch, self.device, self.dtype = torch, arch, device, dtype
        self.nnf = torch.nn.functional
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        self.gen = gen

        def weight(*shape: int, std: float) -> Any:
            return torch.empty(*shape, device=device, dtype=dtype).normal_(0.0, std, generator=gen)

        h, d = arch.hidden, arch.head_dim
        q_width, kv_width = arch.heads * d, arch.kv_heads * d
        std = 1.0 / math.sqrt(h)
        self.embed = weight(arch.vocab, h, std=1.0)
        self.layers: list[dict[str, Any]] = []
        for _ in range(layers):
            self.layers.append(
                {
                    "ln1": torch.ones(h, device=device, dtype=dtype),
                    "qkv": weight(q_width + 2 * kv_width, h, std=std),
                    "o": weight(h, q_width, std=1.0 / math.sqrt(q_width)),
                    "ln2": torch.ones(h, device=device, dtype=dtype),
                    "gate_up": weight(2 * arch.intermediate, h, std=std),
                    "down": weight(h, arch.intermediate, std=1.0 / math.sqrt(arch.intermediate)),
                }
            )
        self.ln_f = torch.ones(h, device=device, dtype=dtype)
        self.lm_head = weight(arch.vocab, h, std=std)
        self.splits = [q_width, kv_width, kv_width]
        self.kv: list[Any] = []
        self.capacity = 0
        self.cos: Any = None
        self.sin: Any = None

    def allocate(self, capacity: int, max_positions: int) -> None:
        """The KV pool (random contents) and the RoPE tables (Llama 3's theta)."""
        torch, a = self.torch, self.arch
        self.kv = []
        for _ in self.layers:
            pool = torch.empty(
                2, capacity, a.kv_heads, a.head_dim, device=self.device, dtype=self.dtype
            )
            self.kv.append(pool.normal_(0.0, 1.0, generator=self.gen))
        self.capacity = capacity
        half = a.head_dim // 2
        inv = 1.0 / (500000.0 ** (torch.arange(0, half, device=self.device).float() / half))
        freqs = torch.outer(torch.arange(max_positions, device=self.device).float(), inv)
        self.cos, self.sin = freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    def _rms(self, x: Any, w: Any) -> Any:
        xf = x.float()
        xf = xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return xf.to(self.dtype) * w

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        x1, x2 = x.chunk(2, dim=-1)
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(self, step: Step) -> Any:
        """One iteration over the packed new tokens; logits of `step.last` (all when None)."""
        nnf, a = self.nnf, self.arch
        t = step.ids.shape[0]
        cos = self.cos.index_select(0, step.pos).unsqueeze(1)
        sin = self.sin.index_select(0, step.pos).unsqueeze(1)
        h = nnf.embedding(step.ids, self.embed)
        for w, pool in zip(self.layers, self.kv, strict=True):
            x = self._rms(h, w["ln1"])
            q, k, v = nnf.linear(x, w["qkv"]).split(self.splits, dim=-1)
            q = self._rope(q.view(t, a.heads, a.head_dim), cos, sin)
            k = self._rope(k.view(t, a.kv_heads, a.head_dim), cos, sin)
            pool[0].index_copy_(0, step.dst, k)
            pool[1].index_copy_(0, step.dst, v.view(t, a.kv_heads, a.head_dim))
            o = step.attend(q, pool[0], pool[1])
            h = h + nnf.linear(o, w["o"])
            x = self._rms(h, w["ln2"])
            gate, up = nnf.linear(x, w["gate_up"]).chunk(2, dim=-1)
            h = h + nnf.linear(nnf.silu(gate) * up, w["down"])
        if step.last is not None:
            h = h.index_select(0, step.last)
        return nnf.linear(self._rms(h, self.ln_f), self.lm_head)


@dataclass(slots=True)
class Step:
    """One composition's inputs: token ids, positions, pool slots of the new tokens' KV, the
    attention over the pool, the rows that get logits."""

    ids: Any
    pos: Any
    dst: Any
    attend: Callable[[Any, Any, Any], Any]
    last: Any
    kv_positions: int


@dataclass(frozen=True, slots=True)
class Layout:
    """A composition laid out in the KV pool: the attention over it (q, k pool, v pool -> the
    output [tokens, heads * head_dim]), each request's first pool position, the positions the
    layout spans (padding included)."""

    attend: Callable[[Any, Any, Any], Any]
    starts: list[int]
    positions: int


class Attention:
    """An attention backend: lays a composition out in the KV pool and attends over it."""

    name = "?"

    def __init__(self, torch: Any, arch: ModelConfig, device: Any) -> None:
        self.torch, self.arch, self.device = torch, arch, device
        self.group = arch.heads // arch.kv_heads

    def _tensor(self, values: Sequence[int], dtype: Any = None) -> Any:
        t = self.torch
        return t.tensor(list(values), dtype=dtype or t.long, device=self.device)

    def prefill(self, batch: Sequence[tuple[int, int]]) -> Layout:
        """Requests contiguous in the pool: request i holds its cached prefix, then its new
        tokens."""
        raise NotImplementedError

    def decode(self, contexts: Sequence[int]) -> Layout:
        """Request j's new token goes at its start + `contexts[j]`."""
        raise NotImplementedError

    @staticmethod
    def contiguous_starts(lengths: Sequence[int]) -> list[int]:
        starts, at = [], 0
        for n in lengths:
            starts.append(at)
            at += n
        return starts


class FlashAttention(Attention):
    """flash-attn's varlen kernel: every request in one call, causal aligned bottom-right."""

    name = "flash-attn varlen"

    def __init__(self, torch: Any, arch: ModelConfig, device: Any, flash: ModuleType) -> None:
        super().__init__(torch, arch, device)
        self.fn = flash.flash_attn_varlen_func

    def _varlen(self, q_lens: Sequence[int], k_lens: Sequence[int]) -> Callable[..., Any]:
        t, a = self.torch, self.arch
        cu_q = self._tensor([0, *self.cumsum(q_lens)], t.int32)
        cu_k = self._tensor([0, *self.cumsum(k_lens)], t.int32)
        max_q, max_k, total_k, total_q = max(q_lens), max(k_lens), sum(k_lens), sum(q_lens)
        fn = self.fn

        def attend(q: Any, k: Any, v: Any) -> Any:
            out = fn(q, k[:total_k], v[:total_k], cu_q, cu_k, max_q, max_k, causal=True)
            return out.reshape(total_q, a.heads * a.head_dim)

        return attend

    @staticmethod
    def cumsum(values: Sequence[int]) -> list[int]:
        out, at = [], 0
        for v in values:
            at += v
            out.append(at)
        return out

    def prefill(self, batch: Sequence[tuple[int, int]]) -> Layout:
        k_lens = [u + c for u, c in batch]
        attend = self._varlen([u for u, _ in batch], k_lens)
        return Layout(attend, self.contiguous_starts(k_lens), sum(k_lens))

    def decode(self, contexts: Sequence[int]) -> Layout:
        k_lens = [c + 1 for c in contexts]
        attend = self._varlen([1] * len(contexts), k_lens)
        return Layout(attend, self.contiguous_starts(k_lens), sum(k_lens))


class SdpaAttention(Attention):
    """`scaled_dot_product_attention`. Prefill: one call per request a layer, lower-right causal
    (a `causal_lower_right` bias, or a materialized mask with `mask=True`); GQA natively
    (`enable_gqa`) or by repeating K/V heads (`expand=True`). Decode: requests sorted and padded
    into groups (`decode_groups`), each query's heads folded onto its KV head as `group` query
    rows (no GQA support needed), a key-padding mask where lengths differ."""

    def __init__(
        self,
        torch: Any,
        arch: ModelConfig,
        device: Any,
        dtype: Any,
        *,
        expand: bool,
        mask: bool,
        groups: int,
    ) -> None:
        super().__init__(torch, arch, device)
        self.dtype, self.expand, self.mask, self.groups = dtype, expand, mask, groups
        self.sdpa = torch.nn.functional.scaled_dot_product_attention
        self.bias: Any = None
        if not mask:
            self.bias = importlib.import_module("torch.nn.attention.bias").causal_lower_right
        self.name = (
            f"sdpa {'materialized mask' if mask else 'causal_lower_right'}, "
            f"{'repeated K/V heads' if expand else 'enable_gqa'}; decode padded groups"
        )

    def prefill(self, batch: Sequence[tuple[int, int]]) -> Layout:
        t, a = self.torch, self.arch
        starts = self.contiguous_starts([u + c for u, c in batch])
        parts: list[tuple[int, int, int, int, Any]] = []
        q_at = 0
        for (u, c), start in zip(batch, starts, strict=True):
            if self.mask:
                bias = t.ones(u, u + c, dtype=t.bool, device=self.device).tril(diagonal=c)
            else:
                bias = self.bias(u, u + c)
            parts.append((q_at, q_at + u, start, start + u + c, bias))
            q_at += u
        total, sdpa, expand, group = q_at, self.sdpa, self.expand, self.group
        kwargs = {} if expand else {"enable_gqa": True}

        def attend(q: Any, k: Any, v: Any) -> Any:
            out = q.new_empty(total, a.heads, a.head_dim)
            for qs, qe, ks, ke, bias in parts:
                qi = q[qs:qe].transpose(0, 1).unsqueeze(0)
                ki = k[ks:ke].transpose(0, 1).unsqueeze(0)
                vi = v[ks:ke].transpose(0, 1).unsqueeze(0)
                if expand:
                    ki = ki.repeat_interleave(group, dim=1)
                    vi = vi.repeat_interleave(group, dim=1)
                oi = sdpa(qi, ki, vi, attn_mask=bias, **kwargs)
                out[qs:qe] = oi[0].transpose(0, 1)
            return out.view(total, a.heads * a.head_dim)

        return Layout(attend, starts, sum(u + c for u, c in batch))

    def decode(self, contexts: Sequence[int]) -> Layout:
        t, a = self.torch, self.arch
        layout = decode_groups(contexts, self.groups)
        starts: list[int] = []
        parts: list[tuple[int, int, int, int, Any]] = []
        for g in layout:
            lens = [c + 1 for c in contexts[g.first : g.first + g.count]]
            starts.extend(g.offset + i * g.length for i in range(g.count))
            bias = None
            if g.masked:
                keep = t.arange(g.length, device=self.device) < self._tensor(lens).unsqueeze(1)
                bias = t.zeros(g.count, 1, 1, g.length, dtype=self.dtype, device=self.device)
                bias.masked_fill_(~keep.view(g.count, 1, 1, g.length), float("-inf"))
            parts.append((g.first, g.count, g.offset, g.length, bias))
        b, sdpa, kvh, group, d = len(contexts), self.sdpa, a.kv_heads, self.group, a.head_dim

        def attend(q: Any, k: Any, v: Any) -> Any:
            out = q.new_empty(b, a.heads, d)
            for first, count, offset, length, bias in parts:
                qg = q[first : first + count].view(count, kvh, group, d)
                region = slice(offset, offset + count * length)
                kg = k[region].view(count, length, kvh, d).transpose(1, 2)
                vg = v[region].view(count, length, kvh, d).transpose(1, 2)
                og = sdpa(qg, kg, vg, attn_mask=bias)
                out[first : first + count] = og.reshape(count, a.heads, d)
            return out.view(b, a.heads * d)

        end = layout[-1].offset + layout[-1].count * layout[-1].length
        return Layout(attend, starts, end)


def build_step(torch: Any, model: Model, backend: Attention, comp: Composition, gen: Any) -> Step:
    """A composition's inputs on the device (outside the timed region)."""
    device = model.device
    if comp.phase == "prefill":
        layout = backend.prefill(comp.batch)
        pairs = zip(comp.batch, layout.starts, strict=True)
        pos = torch.cat([torch.arange(c, c + u) for u, c in comp.batch])
        dst = torch.cat([torch.arange(s + c, s + c + u) for (u, c), s in pairs])
        ends, at = [], 0
        for u, _ in comp.batch:
            at += u
            ends.append(at - 1)
        last = torch.tensor(ends, dtype=torch.long, device=device)
    else:
        layout = backend.decode(comp.contexts)
        pos = torch.tensor(list(comp.contexts), dtype=torch.long)
        news = [s + c for s, c in zip(layout.starts, comp.contexts, strict=True)]
        dst = torch.tensor(news, dtype=torch.long)
        last = None
    ids = torch.randint(0, model.arch.vocab, (comp.new_tokens,), device=device, generator=gen)
    return Step(ids, pos.to(device), dst.to(device), layout.attend, last, layout.positions)


def reference_attention(torch: Any, q: Any, k: Any, v: Any, n_past: int) -> Any:
    """float32 attention of q [L, H, d] over k, v [S, Hkv, d]; row i sees keys <= n_past + i."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = qf @ kf.transpose(1, 2) / math.sqrt(q.shape[-1])
    rows, cols = q.shape[0], k.shape[0]
    allowed = torch.ones(rows, cols, dtype=torch.bool, device=q.device).tril(diagonal=n_past)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1)


def probe(torch: Any, backend: Attention, arch: ModelConfig, device: Any, dtype: Any) -> float:
    """The largest error of `backend` against `reference_attention` on a small prefill batch
    (with and without cached prefixes) and a small decode batch with uneven contexts."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    a = arch
    worst = 0.0

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    batch = [(5, 0), (3, 9), (16, 40), (1, 7)]
    layout = backend.prefill(batch)
    k = rand(layout.positions, a.kv_heads, a.head_dim)
    v = rand(layout.positions, a.kv_heads, a.head_dim)
    q = rand(sum(u for u, _ in batch), a.heads, a.head_dim)
    out = layout.attend(q, k, v).view(-1, a.heads, a.head_dim)
    at = 0
    for (u, c), s in zip(batch, layout.starts, strict=True):
        ref = reference_attention(torch, q[at : at + u], k[s : s + u + c], v[s : s + u + c], c)
        worst = max(worst, float((out[at : at + u].float() - ref).abs().max()))
        at += u
    contexts = [3, 4, 30, 31, 77]
    layout = backend.decode(contexts)
    k = rand(layout.positions, a.kv_heads, a.head_dim)
    v = rand(layout.positions, a.kv_heads, a.head_dim)
    q = rand(len(contexts), a.heads, a.head_dim)
    out = layout.attend(q, k, v).view(-1, a.heads, a.head_dim)
    for j, (s, c) in enumerate(zip(layout.starts, contexts, strict=True)):
        ref = reference_attention(torch, q[j : j + 1], k[s : s + c + 1], v[s : s + c + 1], c)
        worst = max(worst, float((out[j : j + 1].float() - ref).abs().max()))
    return worst


PROBE_TOLERANCE = 0.05


def _sdpa_maker(
    torch: Any, arch: ModelConfig, device: Any, dtype: Any, expand: bool, mask: bool, groups: int
) -> Callable[[], Attention]:
    def make() -> Attention:
        return SdpaAttention(torch, arch, device, dtype, expand=expand, mask=mask, groups=groups)

    return make


def choose_attention(
    torch: Any, arch: ModelConfig, device: Any, dtype: Any, want: str, groups: int
) -> tuple[Attention, list[str]]:
    """The first backend that is importable and agrees with the reference on this machine."""
    tried: list[str] = []
    makers: list[tuple[str, Callable[[], Attention]]] = []
    if want in ("auto", "flash-attn") and device.type == "cuda":
        try:
            flash = importlib.import_module("flash_attn")
            makers.append(("flash-attn", lambda: FlashAttention(torch, arch, device, flash)))
        except Exception as e:
            tried.append(f"flash-attn: not importable ({type(e).__name__}: {e})")
    if want in ("auto", "sdpa"):
        for expand, mask in ((False, False), (True, False), (False, True), (True, True)):
            label = f"sdpa ({'mask' if mask else 'causal_lower_right'}, expand={expand})"
            makers.append((label, _sdpa_maker(torch, arch, device, dtype, expand, mask, groups)))
    for label, make in makers:
        try:
            backend = make()
            error = probe(torch, backend, arch, device, dtype)
        except Exception as e:
            tried.append(f"{label}: {type(e).__name__}: {e}")
            continue
        if error <= PROBE_TOLERANCE:
            tried.append(f"{backend.name}: max error {error:.4f} (chosen)")
            return backend, tried
        tried.append(f"{backend.name}: max error {error:.4f} > {PROBE_TOLERANCE}")
    raise RuntimeError("no attention backend passed the probe:\n  " + "\n  ".join(tried))
