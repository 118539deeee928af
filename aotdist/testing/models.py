"""Tiny models with repeated regions, for tests, examples and the benchmark.

Each one has its repeated blocks in a different kind of container, and every block
gets its own random weights, so a region mechanism that ran one block's weights for all
blocks would change the results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aotdist.errors import ConfigError


class Attention(nn.Module):
    """Multi-head self-attention on ``scaled_dot_product_attention``."""

    def __init__(self, dim: int, heads: int, *, causal: bool):
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GPTBlock(nn.Module):
    """Pre-norm decoder block."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style decoder; blocks live in an ``nn.ModuleList``."""

    def __init__(
        self, *, vocab: int = 64, dim: int = 32, depth: int = 4, heads: int = 2, seq_len: int = 16
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, seq_len, dim) * 0.02)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.vocab = vocab
        self.seq_len = seq_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # a pipeline stage's copy holds None for the modules of other stages (torchtitan's
        # split, aotdist.pipeline): it takes the hidden states and returns its own
        x = idx if self.tok is None else self.tok(idx) + self.pos[:, : idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return x if self.head is None else self.head(x)


class EncoderBlock(nn.Module):
    """Pre-norm encoder block (non-causal attention)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=False)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """ViT-style encoder; blocks live in an ``nn.Sequential`` (as in torchvision's ViT)."""

    def __init__(
        self,
        *,
        image_size: int = 16,
        patch: int = 4,
        dim: int = 32,
        depth: int = 4,
        heads: int = 2,
        num_classes: int = 10,
    ):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, dim) * 0.02)
        self.encoder = nn.Sequential(*(EncoderBlock(dim, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.image_size = image_size
        self.num_classes = num_classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.encoder(x)
        return self.head(self.norm(x[:, 0]))


class BasicBlock(nn.Module):
    """ResNet basic block; with ``stride != 1`` or a width change it gets a downsample."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    """ResNet-style net: stages of different widths, so one class gives several regions."""

    def __init__(
        self,
        *,
        widths: tuple[int, ...] = (8, 16, 32),
        blocks_per_stage: int = 3,
        num_classes: int = 10,
        image_size: int = 16,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages = []
        cin = widths[0]
        for i, w in enumerate(widths):
            blocks = [BasicBlock(cin, w, stride=1 if i == 0 else 2)]
            blocks += [BasicBlock(w, w) for _ in range(blocks_per_stage - 1)]
            stages.append(nn.Sequential(*blocks))
            cin = w
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(widths[-1], num_classes)
        self.image_size = image_size
        self.num_classes = num_classes

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(images))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class CountingBlock(nn.Module):
    """Adds each batch's mean to a buffer of its own in place in training: an update that
    ``invoke_subgraph`` refuses, which aotdist applies after the region's call."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("seen", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(x.detach().mean(0))
        return torch.relu(self.lin(x))


class ReadAfterUpdateBlock(CountingBlock):
    """Reads its buffer after updating it in place in training: the update cannot move
    after the call, so it runs on a copy made in the region, written back by the caller."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(x.detach().mean(0))
        return torch.relu(self.lin(x)) + self.seen


class BatchNormRelu(nn.BatchNorm2d):
    """BatchNorm with a forward of its own, an activation after the norm (as timm's
    ``BatchNormAct2d``): what aotdist's BatchNorm fix must leave as written."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


class ConvNormBlock(nn.Module):
    """A residual convolution block around a norm class (BatchNorm or a subclass)."""

    def __init__(self, channels: int = 8, norm: type[nn.Module] = nn.BatchNorm2d):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = norm(channels)
        self.out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.norm(self.conv(x)))


class AliasingBlock(nn.Module):
    """A block that passes its second input through unchanged: an output aliasing an input."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        return x + torch.tanh(self.fc(x)) * mask, mask


class AliasingNet(nn.Module):
    """Blocks with a pass-through output, as models that thread a mask or cache do."""

    def __init__(self, *, dim: int = 16, depth: int = 4):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(AliasingBlock(dim) for _ in range(depth))
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        mask = (x.detach().abs() > 0.05).to(x.dtype)
        for block in self.blocks:
            x, mask = block(x, mask)
        return x


def build_model(name: str, *, depth: int = 4, **kwargs) -> nn.Module:
    """A built-in tiny model by name: ``gpt``, ``vit``, ``resnet`` or ``aliasing``."""
    if name == "gpt":
        return TinyGPT(depth=depth, **kwargs)
    if name == "vit":
        return TinyViT(depth=depth, **kwargs)
    if name == "resnet":
        return TinyResNet(blocks_per_stage=max(depth, 2), **kwargs)
    if name == "aliasing":
        return AliasingNet(depth=depth, **kwargs)
    raise ConfigError(f"unknown model {name!r}; choose one of gpt, vit, resnet, aliasing")


def example_inputs(model: nn.Module, batch: int = 2, *, generator: torch.Generator | None = None):
    """Synthetic inputs and integer targets for one of the built-in models."""
    g = generator
    if isinstance(model, TinyGPT):
        idx = torch.randint(0, model.vocab, (batch, model.seq_len), generator=g)
        return (idx,), torch.randint(0, model.vocab, (batch, model.seq_len), generator=g)
    if isinstance(model, (TinyViT, TinyResNet)):
        x = torch.randn(batch, 3, model.image_size, model.image_size, generator=g)
        return (x,), torch.randint(0, model.num_classes, (batch,), generator=g)
    if isinstance(model, AliasingNet):
        x = torch.randn(batch, model.dim, generator=g)
        return (x,), torch.randn(batch, model.dim, generator=g)
    raise TypeError(f"no example inputs for {type(model).__name__}")
