"""Accelerate: ``RegionalCompileHook`` and ``aotdist.callbacks.prepare``; the recipe under
``accelerate launch`` on 2 CPU processes, against single-process eager runs."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module
from aotdist.callbacks import RegionalCompileHook

from aotdist import ConfigError, OrderingError
from aotdist.compile.state import STATE_ATTR
from aotdist.testing import build_model, example_inputs, free_port, run_distributed
from aotdist.testing.parity import assert_parity

ROOT = Path(__file__).resolve().parents[2]
AOT = {"compile": {"backend": "aot_eager"}}
DEPTH = 3


class Scale(ModelHook):
    """Another Accelerate hook to compose with: scales the output."""

    def post_forward(self, module, output):
        return output * 3


def test_hook_attach_detach_parity_and_metrics():
    model = build_model("vit", depth=DEPTH)
    ref = copy.deepcopy(model)
    (x,), _ = example_inputs(model, 4)
    hook = RegionalCompileHook(AOT)
    add_hook_to_module(model, hook)
    assert STATE_ATTR in vars(model)  # marked; the forward the hook wraps is compiled
    assert hook.metrics is None  # nothing ran yet
    assert_parity(model, ref, (x,))
    region = hook.metrics.regions["EncoderBlock"]
    assert region.instances == DEPTH and region.call_sites + region.inlined == DEPTH
    assert region.subgraphs == 1 and hook.metrics.frames_compiled >= 1
    remove_hook_from_module(model)
    assert STATE_ATTR not in vars(model) and model._compiled_call_impl is None
    assert model.forward.__func__ is type(ref).forward  # Accelerate put the plain one back
    assert type(model.encoder[0]) is type(ref.encoder[0])  # unmarked
    assert_parity(model, ref, (x,))
    assert list(model.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("compile_first", [True, False])
def test_hook_composes_with_sequential_hook(compile_first):
    model = build_model("vit", depth=2)
    ref = copy.deepcopy(model)
    hooks = [RegionalCompileHook(AOT), Scale()]
    for hook in hooks if compile_first else hooks[::-1]:
        add_hook_to_module(model, hook, append=True)  # the second makes a SequentialHook
    assert type(model._hf_hook).__name__ == "SequentialHook"
    (img,), _ = example_inputs(model, 2)
    torch.testing.assert_close(model(img), ref(img) * 3, rtol=1e-4, atol=1e-5)
    assert hooks[0].metrics is not None and hooks[0].metrics.frames_compiled >= 1
    assert hooks[0].metrics.num_graph_breaks == 0  # Accelerate's disabled hooks stay outside
    remove_hook_from_module(model)
    torch.testing.assert_close(model(img), ref(img), rtol=1e-5, atol=1e-6)
    assert STATE_ATTR not in vars(model)


def test_hook_refuses_what_it_cannot_do():
    with pytest.raises(ConfigError, match="aotdist.callbacks.prepare"):
        RegionalCompileHook({"fsdp": {"enabled": True}})
    with pytest.raises(ConfigError, match="compile.backnd"):
        RegionalCompileHook({"compile": {"backnd": "x"}})
    from accelerate.utils import DynamoBackend
    from aotdist.callbacks._accelerate_checks import check_accelerate_dynamo

    state = SimpleNamespace(dynamo_plugin=SimpleNamespace(backend=DynamoBackend.INDUCTOR))
    with pytest.raises(ConfigError, match="dynamo_backend: 'no'"):
        check_accelerate_dynamo(RegionalCompileHook(AOT).config, state)
    model = build_model("gpt", depth=2)
    model.blocks[1].compile(backend="aot_eager")
    with pytest.raises(OrderingError, match="already compiled"):
        add_hook_to_module(model, RegionalCompileHook(AOT))


# ---- hook and prepare in either order, DDP on 2 CPU processes ----------------------------


def _steps(model, optimizer, accelerator, batches):
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    return losses


def _orders(rank: int, world_size: int):
    from accelerate import Accelerator
    from aotdist.callbacks import prepare

    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(rank + 10)
    batches = [example_inputs(build_model("gpt", depth=1), 2, generator=g) for _ in range(3)]
    batches = [(x[0], y) for x, y in batches]
    out = {}
    for order in ("eager", "hook_then_prepare", "prepare_then_hook", "aotdist_prepare"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model("gpt", depth=DEPTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        hook = RegionalCompileHook(AOT)
        if order == "hook_then_prepare":
            add_hook_to_module(model, hook)
        if order == "aotdist_prepare":
            model, optimizer = prepare(accelerator, model, optimizer, config=AOT)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)
        if order == "prepare_then_hook":
            add_hook_to_module(model, hook)  # on the DDP wrapper: compiles what it wraps
        losses = _steps(model, optimizer, accelerator, batches)
        inner = accelerator.unwrap_model(model)
        out[order] = {
            "losses": losses,
            "params": {k: v.detach().clone() for k, v in inner.state_dict().items()},
            "ddp": type(model).__name__,
            "call_sites": hook.metrics.regions["GPTBlock"].call_sites if hook.metrics else None,
            "compiled": STATE_ATTR in vars(inner),
        }
    return out


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
def test_hook_before_and_after_prepare_with_ddp():
    rank0 = run_distributed(_orders, 2, timeout=300)[0]
    eager = rank0["eager"]
    for order in ("hook_then_prepare", "prepare_then_hook", "aotdist_prepare"):
        got = rank0[order]
        assert got["ddp"] == "DistributedDataParallel", order
        assert got["compiled"], order
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(eager["losses"]))
        for key, value in eager["params"].items():
            torch.testing.assert_close(got["params"][key], value, rtol=1e-5, atol=1e-6)
    assert rank0["hook_then_prepare"]["call_sites"] == DEPTH
    assert rank0["prepare_then_hook"]["call_sites"] == DEPTH


# ---- the recipe under accelerate launch ----------------------------------------------------


def _run(cmd: list[str], cwd: Path) -> list[float]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"step"')]
    return [r["loss"] for r in rows]


def _launch(*args: str) -> list[str]:
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    return [
        accelerate,
        "launch",
        "--main_process_port",  # not 29500: another suite may run beside this one
        str(free_port()),
        "--config_file",
        str(ROOT / "configs/accelerate/cpu_2proc.yaml"),
        str(ROOT / "recipes/train_accelerate.py"),
        "--batch-size",
        "4",
        *args,
    ]


@pytest.fixture(scope="module")
def eager_losses():
    """One process, eager, the global batch (2 processes x 4) at once."""
    cmd = [
        sys.executable,
        str(ROOT / "recipes/train_accelerate.py"),
        "--aotdist-config",
        "none",
        "--batch-size",
        "8",
        "--steps",
        "4",
    ]
    return _run(cmd, ROOT)


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
@pytest.mark.parametrize("config", ["regional_compile", "fsdp2", "fsdp_graph"])
def test_recipe_under_accelerate_launch_matches_eager(config, eager_losses):
    losses = _run(
        _launch(
            "--aotdist-config",
            f"configs/aotdist/{config}.yaml",
            "--backend",
            "aot_eager",
            "--steps",
            "4",
        ),
        ROOT,
    )
    assert len(losses) == 4
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5
    )


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
def test_fsdp2_save_state_resume_and_plain_keys(tmp_path, eager_losses):
    common = ("--aotdist-config", "configs/aotdist/fsdp2.yaml", "--backend", "aot_eager")
    first = _run(_launch(*common, "--steps", "2", "--save-dir", str(tmp_path / "ckpt")), ROOT)
    resumed = _run(
        _launch(
            *common, "--steps", "2", "--resume-from", str(tmp_path / "ckpt"), "--skip-batches", "2"
        ),
        ROOT,
    )
    # AdamW: the resumed steps match only if weights *and* optimizer state came back
    torch.testing.assert_close(
        torch.tensor(first + resumed), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5
    )
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "recipes"))
    try:
        import train_accelerate
    finally:
        sys.path.remove(str(ROOT / "recipes"))
    plain = train_accelerate.build_model("tiny", None, 0)
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert sorted(saved) == sorted(plain.state_dict())  # full tensors, plain keys
    plain.load_state_dict(saved)
    assert all(saved[k].shape == v.shape for k, v in plain.state_dict().items())


def test_prepare_refuses_a_foreign_optimizer_before_touching_the_model():
    from accelerate.utils import DistributedType
    from aotdist.callbacks import prepare

    accelerator = SimpleNamespace(
        state=SimpleNamespace(dynamo_plugin=None),
        distributed_type=DistributedType.NO,
        device=torch.device("cpu"),
    )
    model = build_model("gpt", depth=2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match="not the model's"):
        prepare(accelerator, model, optimizer, config=AOT)
    assert STATE_ATTR not in vars(model)  # refused before marking or compiling anything


# ---- prepare on aotdist's FSDP2 path: mixed precision, accumulation, Float8; 2 ranks --------


def _fresh_accelerator(**kwargs):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # one process, several Accelerator configurations
    return Accelerator(cpu=True, **kwargs)


def _fsdp_prepare_configs(rank: int, world_size: int):
    from aotdist.callbacks import prepare

    import aotdist

    fsdp = {"fsdp": {"enabled": True}, **AOT}
    g = torch.Generator().manual_seed(rank + 10)
    batches = [example_inputs(build_model("gpt", depth=1), 2, generator=g) for _ in range(4)]
    batches = [(x[0], y) for x, y in batches]
    out = {}

    # Accelerate's bf16 mixed precision becomes FSDP2's MixedPrecisionPolicy.
    accelerator = _fresh_accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = build_model("gpt", depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = prepare(accelerator, model, optimizer, config=fsdp)
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.append((str(args[0].dtype), str(m.ln1.weight.dtype)))
    )
    x, y = batches[0]
    losses = []
    for _ in range(3):  # one batch, again and again: the loss must go down
        logits = model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    out["bf16"] = {
        "losses": losses,
        "logits": str(logits.dtype),
        "seen": seen,
        "master": sorted({str(p.dtype) for p in model.parameters()}),
        "policy": str(aotdist.parallelize_info(model).config.fsdp.param_dtype),
    }

    # Gradient accumulation: 4 micro-batches, 2 real steps, same result as by hand.
    def run(accumulate: bool):
        torch.manual_seed(0)
        model = build_model("gpt", depth=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = []
        optimizer.register_step_post_hook(lambda *_: steps.append(1))  # the real steps
        if accumulate:
            accelerator = _fresh_accelerator(gradient_accumulation_steps=2)
            model, optimizer = prepare(accelerator, model, optimizer, config=fsdp)
        else:
            aotdist.parallelize(model, config=fsdp)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            optimizer.register_step_post_hook(lambda *_: steps.append(1))
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            if accumulate:
                with accelerator.accumulate(model):
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            else:
                (loss / 2).backward()
                if i % 2 == 1:
                    optimizer.step()
                    optimizer.zero_grad()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return len(steps), {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}

    out["accumulate"] = {"prepare": run(True), "by_hand": run(False)}

    # Float8 (torchao) through prepare, with float8 all-gather: scales after each real step.
    accelerator = _fresh_accelerator()
    torch.manual_seed(0)
    model = build_model("gpt", depth=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    float8 = {"enabled": True, "exclude": ["head"], "fsdp_all_gather": True}
    model, optimizer = prepare(accelerator, model, optimizer, config={**fsdp, "float8": float8})
    losses = []
    for x, y in batches[:2]:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    info = aotdist.parallelize_info(model)
    out["float8"] = {
        "layers": len(info.float8_fqns),
        "losses": losses,
        "weight": type(model.blocks[0].mlp.fc.weight.to_local()).__name__,
    }
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_prepare_fsdp_mixed_precision_accumulation_and_float8():
    rank0 = run_distributed(_fsdp_prepare_configs, 2, timeout=540)[0]
    bf16 = rank0["bf16"]
    assert bf16["policy"] == "bfloat16"
    # the region computes in bf16: its input and its (all-gathered) weights
    assert bf16["seen"] and set(bf16["seen"]) == {("torch.bfloat16", "torch.bfloat16")}, bf16
    assert bf16["logits"] == "torch.bfloat16"
    assert bf16["master"] == ["torch.float32"]  # sharded master weights stay fp32
    assert bf16["losses"][-1] < bf16["losses"][0], bf16["losses"]
    (n_prep, prep), (n_hand, hand) = rank0["accumulate"]["prepare"], rank0["accumulate"]["by_hand"]
    assert n_prep == n_hand == 2
    for key, value in hand.items():
        torch.testing.assert_close(prep[key], value, rtol=1e-5, atol=1e-6)
    f8 = rank0["float8"]
    assert f8["layers"] > 0 and f8["weight"] == "WeightWithDynamicFloat8CastTensor", f8
    assert all(math.isfinite(v) for v in f8["losses"])


def test_prepare_refuses_fsdp_param_dtype_that_conflicts_with_accelerate_mixed_precision():
    from accelerate.utils import DistributedType
    from aotdist.callbacks import prepare

    accelerator = SimpleNamespace(
        state=SimpleNamespace(dynamo_plugin=None),
        distributed_type=DistributedType.NO,
        mixed_precision="bf16",
        device=torch.device("cpu"),
    )
    model = build_model("gpt", depth=2)
    config = {"fsdp": {"enabled": True, "param_dtype": "float16"}, **AOT}
    with pytest.raises(ConfigError, match="mixed_precision is bf16.*fsdp.param_dtype: float16"):
        prepare(accelerator, model, config=config)
    assert STATE_ATTR not in vars(model)


@pytest.mark.slow  # two 2-process torchrun launches, ~1 min on a 2-core CPU machine
def test_recipe_as_two_nodes_with_hsdp_matches_eager(tmp_path, eager_losses):
    """The recipe as 2 nodes x 2 processes on this machine (torchrun's static rendezvous),
    HSDP replicating across the nodes and sharding within each: the same losses as one
    eager process on the global batch (4 processes x 2)."""
    port = free_port()
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(n),
                "--rdzv-endpoint",
                f"localhost:{port}",
                "--nproc-per-node",
                "2",
                str(ROOT / "recipes/train_accelerate.py"),
                "--aotdist-config",
                "configs/aotdist/hsdp.yaml",
                "--backend",
                "aot_eager",
                "--batch-size",
                "2",
                "--steps",
                "4",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in (0, 1)
    ]
    outs = [node.communicate(timeout=480) for node in nodes]
    for node, (out, err) in zip(nodes, outs, strict=True):
        assert node.returncode == 0, out[-3000:] + err[-3000:]
    rows = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith('{"step"')]
    assert not any(line.startswith('{"step"') for line in outs[1][0].splitlines())
    torch.testing.assert_close(
        torch.tensor([r["loss"] for r in rows]), torch.tensor(eager_losses), rtol=1e-4, atol=1e-5
    )
