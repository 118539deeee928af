"""``aotdist plan --pp`` on models that hold constant tensors: a tensor made from a Python
number (``torch.tensor(2.0)``) under the plan's fake tensors carries the real one beside it,
which the stage copy of ``aotdist.pipeline`` could not copy inside the fake mode
("Attempted to set the storage of a tensor on device meta to a storage on different
device cpu"). Held as a buffer (transformers Gemma's ``embed_scale``), a plain attribute,
or in a list attribute, each is shared by the stage copies and planned."""

from __future__ import annotations

import pytest
import torch
from torch import nn

PIPELINED = {"pipeline": {"enabled": True, "degree": 2, "microbatches": 2}}


class Block(nn.Module):
    def __init__(self, holder: str):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.holder = holder
        if holder == "buffer":
            self.register_buffer("gain", torch.tensor(0.5), persistent=False)
        elif holder == "attribute":
            self.gain = torch.tensor(0.5)  # neither parameter nor buffer
        else:
            self.gains = [torch.tensor(0.5)]

    def forward(self, x):
        gain = self.gains[0] if self.holder == "list" else self.gain
        return x + torch.relu(self.proj(x)) * gain


class Net(nn.Module):
    def __init__(self, holder: str):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block(holder) for _ in range(4))

    def forward(self, x):
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("holder", ["buffer", "attribute", "list"])
def test_constant_tensors_are_planned_in_stages(holder):
    from aotdist.simulate import plan

    def build():
        return Net(holder), (torch.randn(4, 8),)

    whole = plan(build, world=1, mesh=(1,))
    piped = plan(build, world=2, mesh=(1,), config=PIPELINED)
    stages = piped.pipeline.stages
    assert [s.units for s in stages] == [
        ("stem", "blocks.0", "blocks.1"),
        ("blocks.2", "blocks.3"),
    ]
    assert sum(s.param_bytes for s in stages) == whole.param_bytes
    assert all(s.regions["Block"] == {"call_sites": 2, "subgraphs": 1} for s in stages)


class StagedGemma(nn.Module):
    """A tiny transformers Gemma (its embedding, decoder layers, norm and head), with a
    forward that skips the modules other stages hold, as torchtitan's models do; the
    rotary frequencies sit on the root, so that every stage has them."""

    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.AutoConfig.for_model(
            "gemma",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=128,
        )
        hf = transformers.AutoModelForCausalLM.from_config(config)
        self.embed = hf.model.embed_tokens  # its embed_scale: a buffer made from a float
        self.layers = hf.model.layers
        self.norm = hf.model.norm
        self.head = hf.lm_head
        inv_freq = hf.model.rotary_emb.inv_freq.clone()
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        freqs = torch.arange(x.shape[1], device=x.device)[:, None].float() * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[None]
        rope = (angles.cos().to(x.dtype), angles.sin().to(x.dtype))
        for layer in self.layers:
            x = layer(x, position_embeddings=rope)
        if self.norm is not None:
            x = self.norm(x)
        return self.head(x) if self.head is not None else x


def test_a_gemma_is_planned_in_stages():
    pytest.importorskip("transformers")
    from aotdist.simulate import plan

    def build():
        return StagedGemma(), (torch.randint(0, 128, (4, 16)),)

    whole = plan(build, world=1, mesh=(1,))
    piped = plan(build, world=2, mesh=(1,), config=PIPELINED)
    first, last = piped.pipeline.stages
    assert first.units[:2] == ("embed", "layers.0") and last.units[-2:] == ("norm", "head")
    tied = 128 * 64 * 4  # embedding and head share a weight: each end stage holds it
    assert first.param_bytes + last.param_bytes == whole.param_bytes + tied
    for stage in (first, last):
        assert stage.regions["GemmaDecoderLayer"] == {"call_sites": 2, "subgraphs": 1}
        assert stage.sends[0] == stage.recvs[0] == 2  # a hidden state on, a gradient back
