"""What a plan of a context-parallel job (``cp`` > 1) adds: each rank traced with its
``seq / cp`` tokens (torch's head-tail load balancer: two chunks of ``seq / (2 cp)``), FSDP2
over ``dp_shard x cp`` flattened (torchtitan's ``dp_shard_cp``), and per traced SDPA call
the transfers of torch's ring attention (``torch.distributed.tensor.experimental.
_context_parallel._attention``, read on torch 2.11 and 2.14.1): forward, one all-gather of
the call's keys and values (rotate method ``allgather``, torch's default) or ``cp - 1``
ring permutes of them (``alltoall``); backward, the same for the keys and values plus
``cp`` permutes of their gradients (always ``alltoall``, in float32: torch's
``convert_to_f32``). A checkpointed forward's calls rerun in backward, with their transfers.
"""

from __future__ import annotations

from typing import Any

from aotdist.errors import ConfigError
from aotdist.simulate.report import Collective, Plan

ROTATES = ("allgather", "alltoall")
# the SDPA kernels torch's context_parallel runs as ring attention, and CPU's (this trace's)
_FORWARD = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
)
_BACKWARD = tuple(f"{name}_backward" for name in _FORWARD)
_ACCUMULATE = 4  # bytes per element of the key and value gradients passed around the ring


def _check_cp(config: dict, world: int, cp: int, rotate: str) -> None:
    """``plan``'s ``cp`` and ``cp_rotate``, and what they cannot be planned with."""
    if cp < 1 or world % cp:
        raise ConfigError(
            f"plan: cp {cp} does not divide the {world} ranks into context-parallel groups. "
            "Fix: --cp N with N dividing --world (1: no context parallelism)"
        )
    if rotate not in ROTATES:
        raise ConfigError(
            f"plan: unknown cp rotate method {rotate!r}; one of {', '.join(ROTATES)} "
            "(torch's set_rotate_method)"
        )
    if cp == 1:
        return
    fsdp = config.get("fsdp") or {}
    refused = (
        ("pipeline.enabled (--pp)", (config.get("pipeline") or {}).get("enabled")),
        ("fsdp.expert_params (--expert-params)", fsdp.get("expert_params")),
    )
    for what, on in refused:
        if on:
            raise ConfigError(
                f"plan: context parallelism (cp {cp}) with {what} is not planned: each is "
                f"traced on a step of its own. Fix: plan them apart (drop --cp, or {what})"
            )


def _cp_inputs(inputs: tuple, cp: int) -> tuple:
    """One rank's share of the batch: every input of two or more dimensions narrowed to
    ``seq / cp`` along dimension 1, the sequence (token ids, labels, positions)."""
    import torch

    out = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            out.append(t)
            continue
        seq = t.shape[1]
        if seq % (2 * cp):
            raise ConfigError(
                f"plan: cp {cp} splits each sequence into 2 x {cp} chunks (torch's head-tail "
                f"load balancing under causal attention), but input {i} has {seq} tokens "
                f"(shape {tuple(t.shape)}, sequence in dimension 1). Fix: --seq a multiple "
                f"of {2 * cp}, or a --cp N whose 2N divides it"
            )
        out.append(t.narrow(1, 0, seq // cp).clone())  # its own storage, as a rank holds it
    return tuple(out)


class AttentionCalls:
    """The ``values`` of :func:`aotdist._compat.distributed.fake_tensor_mode`: the SDPA
    kernel calls of the step while ``phase`` is set, as ``(phase, direction, query
    elements, key + value elements, element bytes)``; ``direction`` is the kernel's,
    ``forward`` (a checkpointed recompute's in the backward phase) or ``backward``."""

    def __init__(self):
        self.phase: str | None = None
        self.calls: list[tuple[str, str, int, int, int]] = []
        self.masked = self.bidirectional = 0  # forward calls with a mask, without one nor causal

    def dispatch(self, func, args, kwargs, fake):
        name = func.name()
        if self.phase is not None and (name in _FORWARD or name in _BACKWARD):
            forward = name in _FORWARD
            q, k, v = args[0:3] if forward else args[1:4]
            kv = k.numel() + v.numel()
            self.calls.append(
                (self.phase, "forward" if forward else "backward", q.numel(), kv, k.element_size())
            )
            if forward and name == _FORWARD[0] and self.phase == "forward":  # CPU's kernel
                causal = kwargs.get("is_causal", args[4] if len(args) > 4 else False)
                masked = kwargs.get("attn_mask") is not None
                self.masked += masked
                self.bidirectional += not (masked or causal)
        return fake(func, args, kwargs)


def _ring_attention(
    out: Plan, calls: AttentionCalls, cp: int, rotate: str, network: bool, seq: int | None
) -> None:
    """Per SDPA call, the transfers of torch's ring attention at ``cp`` ranks over the
    ``cp`` dimension: all-gathers (bytes: the gathered output) and permutes (bytes:
    sent, as received), by phase."""
    if not any(direction == "forward" for _, direction, *_ in calls.calls):
        raise ConfigError(
            f"plan: cp {cp} shards attention, but the traced step calls no SDPA kernel "
            "(torch's context parallelism runs F.scaled_dot_product_attention's flash, "
            "memory-efficient and cuDNN kernels as ring attention; this CPU trace runs "
            "aten._scaled_dot_product_flash_attention_for_cpu): the model writes attention "
            "out (matmul, softmax), or its mask sends SDPA to the math path. Fix: attention "
            "through F.scaled_dot_product_attention(q, k, v, is_causal=True) (transformers: "
            "attn_implementation='sdpa', no attention mask), or drop --cp"
        )
    if calls.bidirectional:
        raise ConfigError(
            f"plan: cp {cp}: {calls.bidirectional} SDPA call(s) of the step are neither causal "
            "nor masked (bidirectional attention); torch's ring attention balances the "
            "sequence head-tail only under causal attention (with its load balancing on, "
            "the default, it raises 'Load balancing requires `is_causal=True`'). Fix: "
            "context parallelism for a causal model (is_causal=True), or drop --cp"
        )
    if calls.masked:  # torch's ring takes no mask ('attn_bias is not supported yet')
        out.cp_note = (
            f"{calls.masked} SDPA call(s) took an attention mask in this trace, planned as "
            "causal: torch's ring attention takes none (transformers builds a causal mask "
            "under fake tensors; its real step without padding calls SDPA with is_causal=True)"
        )
    found: dict[tuple[str, str], Collective] = {}

    def add(phase: str, kind: str, count: int, nbytes: int) -> None:
        c = found.setdefault((phase, kind), Collective(kind, "cp", network=network, phase=phase))
        c.count, c.bytes = c.count + count, c.bytes + count * nbytes

    for phase, direction, q, kv, size in calls.calls:
        if rotate == "allgather":  # one gather of every rank's keys and values
            add(phase, "all_gather", 1, cp * kv * size)
        else:  # passed around the ring: cp - 1 permutes of this rank's
            add(phase, "permute", cp - 1, kv * size)
        if direction == "backward":  # their gradients around the ring, every step of it
            add(phase, "permute", cp, kv * _ACCUMULATE)
        # the largest working set of one call: the keys and values held (all of them,
        # gathered; or this and the next rank's), float32 gradients of q, k, v and the
        # gradients in flight
        held = cp * kv * size if rotate == "allgather" else 2 * kv * size
        if direction == "backward":
            held += _ACCUMULATE * (q + 2 * kv)
        out.cp_buffer_bytes = max(out.cp_buffer_bytes, held)
    order = {"forward": 0, "backward": 1}
    out.context_parallel = sorted(found.values(), key=lambda c: (order[c.phase], c.kind))
    out.cp_calls = sum(1 for p, d, *_ in calls.calls if p == "forward" and d == "forward")
    out.cp_seq = seq or 0


def _name_flattened_shard_dim(out: Plan, shard: str) -> None:
    """FSDP2's collectives run over ``dp_shard x cp`` flattened: torchtitan's name."""
    for c in out.collectives:
        if c.dim == shard:
            c.dim = "dp_shard_cp"


def _sequence(inputs: Any) -> int | None:
    import torch

    seqs = [t.shape[1] for t in inputs if isinstance(t, torch.Tensor) and t.dim() >= 2]
    return seqs[0] if seqs else None
