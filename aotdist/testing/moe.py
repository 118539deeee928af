"""An expert-parallel mixture-of-experts as a user writes one: each rank holds
``experts // ranks`` of the experts, tokens travel to them by all-to-all, the split sizes
read on the host (``.tolist()``, as torchtitan's dispatcher does). :class:`MoE` is a whole
block (router and experts); :class:`ExpertParallelExperts` replaces the experts module of
a transformers DeepSeek-V3 (whose own holds every expert on each rank), for
``aotdist plan``'s worked example at that model's sizes (:func:`deepseek_v3`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from aotdist._compat.compiler import functional_collectives


class AllToAll(torch.autograd.Function):
    """Rows to the ranks that hold their experts; the gradient back the same way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits):
        import torch.distributed as dist

        ctx.splits = (out_splits, in_splits)
        return functional_collectives().all_to_all_single(
            x, out_splits, in_splits, dist.group.WORLD
        )

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        back = functional_collectives().all_to_all_single(
            grad.contiguous(), in_splits, out_splits, dist.group.WORLD
        )
        return back, None, None


def planned_choice(
    tokens: int, top_k: int, experts: int, *, ranks: int = 1, imbalance: float = 1.0
) -> torch.Tensor:
    """The router choices ``aotdist plan`` assumes, ``(tokens, top_k)`` expert indices.

    ``imbalance`` 1: round robin, token ``i``'s ``j``-th choice is expert ``(i * top_k +
    j) % experts`` (balanced). ``imbalance`` F > 1: ``F / ranks`` of the choices, spread
    evenly in order, go to rank 0's experts (the first ``experts // ranks``) round robin,
    the rest to the other experts round robin, so rank 0 receives F times the mean tokens
    from every rank that routes alike.
    """
    slots = torch.arange(tokens * top_k)
    if imbalance == 1.0 or ranks == 1:
        return slots.remainder(experts).view(tokens, top_k)
    local, scale = experts // ranks, 1 << 20
    share = round(imbalance * scale)  # exact integer arithmetic: the same on every machine
    hot = (slots + 1) * share // (ranks * scale) > slots * share // (ranks * scale)
    hot_index, cold_index = hot.cumsum(0) - 1, (~hot).cumsum(0) - 1
    cold = local + cold_index.remainder(experts - local)
    return torch.where(hot, hot_index.remainder(local), cold).view(tokens, top_k)


def _ranks() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def dispatch(tokens, experts, weights, run, n_experts: int, ranks: int):
    """Top-k routed ``tokens`` (n, d) through this rank's experts: ``experts`` and
    ``weights`` (n, k) are the router's choices; ``run(rows, local_expert)`` computes one
    expert. Tokens grouped by expert, exchanged by all-to-all, computed, sent back."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    counts = flat.new_zeros(n_experts).scatter_add_(0, flat, torch.ones_like(flat))  # per expert
    routed = tokens[order // k]
    local = n_experts // ranks
    if ranks > 1:
        import torch.distributed as dist

        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts)  # (source rank, local expert)
        in_splits = counts.view(ranks, -1).sum(1).tolist()
        out_splits = received.view(ranks, -1).sum(1).tolist()
        routed = AllToAll.apply(routed, out_splits, in_splits)
        per = received.view(ranks, local)
    else:
        per = counts.view(1, n_experts)
    chunks = routed.split(per.reshape(-1).tolist())
    y = torch.cat([run(c, i % local) for i, c in enumerate(chunks)])
    if ranks > 1:
        y = AllToAll.apply(y, in_splits, out_splits)
    out = torch.zeros_like(y)
    out[order] = y
    return (out.view(n, k, -1) * weights.unsqueeze(-1).to(out.dtype)).sum(1)


class MoE(nn.Module):
    """A residual block of ``experts`` SwiGLU experts, top-``top_k`` routed; this rank
    holds ``experts // ranks`` of them (``ranks``: the world's size by default).

    ``balanced=True`` adds to the router's scores a bonus that sends token ``i``'s
    ``j``-th choice to expert ``(i * top_k + j) % experts``: routing that is balanced for
    real, as ``aotdist plan`` assumes it (tests compare the two); with ``imbalance`` F > 1
    the bonus follows :func:`planned_choice` instead: rank 0's experts get F times the
    mean tokens, as ``aotdist plan --expert-imbalance F`` assumes.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        experts: int,
        top_k: int = 1,
        *,
        ranks: int | None = None,
        balanced: bool = False,
        imbalance: float = 1.0,
    ):
        super().__init__()
        self.ranks = _ranks() if ranks is None else ranks
        self.n_experts, self.top_k, self.balanced = experts, top_k, balanced
        self.imbalance = imbalance
        local = experts // self.ranks
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(local, dim, 2 * hidden) * dim**-0.5)
        self.down = nn.Parameter(torch.randn(local, hidden, dim) * hidden**-0.5)

    def expert(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        x = rows.to(self.down.dtype)  # the experts' own dtype: FSDP2 does not cast them
        gate, up = (x @ self.gate_up[i]).chunk(2, dim=-1)
        return ((F.silu(gate) * up) @ self.down[i]).to(rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        tokens = x.reshape(-1, d)
        scores = self.router(tokens).softmax(-1)
        if self.balanced:
            n = tokens.shape[0]
            choice = planned_choice(
                n, self.top_k, self.n_experts, ranks=self.ranks, imbalance=self.imbalance
            )
            bonus = torch.zeros_like(scores).scatter_(1, choice.to(x.device), 2.0)
            scores = scores + bonus
        weights, experts = scores.topk(self.top_k, dim=-1)
        out = dispatch(tokens, experts, weights, self.expert, self.n_experts, self.ranks)
        return x + out.view(b, t, d)


class MoENet(nn.Module):
    """Embedding, ``depth`` :class:`MoE` blocks, head: the plan tests' model."""

    def __init__(
        self,
        depth: int = 3,
        dim: int = 16,
        hidden: int = 32,
        experts: int = 4,
        top_k: int = 2,
        vocab: int = 64,
        *,
        balanced: bool = True,
        imbalance: float = 1.0,
    ):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            MoE(dim, hidden, experts, top_k, balanced=balanced, imbalance=imbalance)
            for _ in range(depth)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class ExpertParallelExperts(nn.Module):
    """A transformers DeepSeek-V3 experts module (``mlp.experts``: every expert, on every
    rank) as expert parallelism holds it: ``experts // ranks`` SwiGLU experts of the same
    sizes and layout (``gate_up_proj``, ``down_proj``), tokens dispatched by all-to-all."""

    def __init__(self, hidden: int, intermediate: int, experts: int, *, ranks: int | None = None):
        super().__init__()
        self.ranks = _ranks() if ranks is None else ranks
        self.n_experts = experts
        local = experts // self.ranks
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(local, hidden, intermediate))

    def expert(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        x = rows.to(self.down_proj.dtype)  # the experts' own dtype: FSDP2 does not cast them
        gate, up = F.linear(x, self.gate_up_proj[i]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[i]).to(rows.dtype)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return dispatch(
            hidden_states, top_k_index, top_k_weights, self.expert, self.n_experts, self.ranks
        )


# DeepSeek-V3's sizes (its config.json); the layers are set by the caller
DEEPSEEK_V3 = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def deepseek_v3(layers: int = 5, seq: int = 4096, batch: int = 1):
    """transformers' DeepSeek-V3 at its sizes with ``layers`` decoder layers (the first 3
    dense, as in the model), each MoE layer's experts replaced by
    :class:`ExpertParallelExperts` over the world's ranks; ``(model, (ids,))``, one batch
    of ``batch`` sequences of ``seq`` tokens per rank. For ``aotdist plan
    --model aotdist.testing.moe:deepseek_v3 --expert-params 'model.layers.*.mlp.experts.*'``.
    """
    import transformers

    config = transformers.AutoConfig.for_model(
        "deepseek_v3", **DEEPSEEK_V3, num_hidden_layers=layers, use_cache=False
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts = ExpertParallelExperts(
                config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
            )
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    return model, (ids,)
