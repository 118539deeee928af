"""Verbatim copies of the library stochastic-depth code that ``droppath`` reproduces.

Never called: :func:`aotdist.fixes.droppath.same_code` compares a library's current
function with these, so a module is swapped only while its library still draws exactly
as the copy does (torchvision 0.26-0.29, timm 1.0, transformers 5). A release that
changes the draw no longer matches and its modules run as written. Names, order and
constants must stay as the libraries wrote them; docstrings are left out.
"""

# ruff: noqa
# fmt: off
import torch

_log_api_usage_once = Tensor = None  # names the copies read; never called


def torchvision_stochastic_depth(input: Tensor, p: float, mode: str, training: bool = True) -> Tensor:
    if not torch.jit.is_scripting() and not torch.jit.is_tracing():
        _log_api_usage_once(stochastic_depth)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"drop probability has to be between 0 and 1, but got {p}")
    if mode not in ["batch", "row"]:
        raise ValueError(f"mode has to be either 'batch' or 'row', but got {mode}")
    if not training or p == 0.0:
        return input

    survival_rate = 1.0 - p
    if mode == "row":
        size = [input.shape[0]] + [1] * (input.ndim - 1)
    else:
        size = [1] * input.ndim
    noise = torch.empty(size, dtype=input.dtype, device=input.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return input * noise


def timm_drop_path(x, drop_prob: float = 0., training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0. or not training:
        return x
    keep_prob = 1 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)  # work with diff dim tensors, not just 2D ConvNets
    random_tensor = x.new_empty(shape).bernoulli_(keep_prob)
    if keep_prob > 0.0 and scale_by_keep:
        random_tensor.div_(keep_prob)
    return x * random_tensor


def transformers_drop_path_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if self.drop_prob == 0.0 or not self.training:
        return hidden_states
    keep_prob = 1 - self.drop_prob
    shape = (hidden_states.shape[0],) + (1,) * (hidden_states.ndim - 1)
    random_tensor = torch.rand(shape, dtype=hidden_states.dtype, device=hidden_states.device)
    random_tensor = torch.floor(random_tensor + keep_prob)
    return hidden_states.div(keep_prob) * random_tensor
