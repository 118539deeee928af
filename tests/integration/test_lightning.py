"""Lightning: ``RegionalCompile`` on one process, DDP, ModelParallelStrategy (FSDP2, Float8).

Every run is compared with the same run without aotdist (same seed, data, strategy).
Multi-process runs go through ``aotdist.testing.run_distributed`` (the process group and
LOCAL_RANK are set, so Lightning treats the ranks as launched externally); each spawn
runs several fits to keep process start-up, the slow part here, to a minimum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from aotdist.callbacks import RegionalCompile
from lightning.pytorch.loggers import Logger

import aotdist
from aotdist import ConfigError, OrderingError
from aotdist.testing import build_model, example_inputs, run_distributed

ROOT = Path(__file__).resolve().parents[2]
DEPTH = 3
AOT = {"compile": {"backend": "aot_eager"}}
# Lightning's default_root_dir for runs that write nothing we read: never the repository,
# and removed when this process exits (mkdtemp alone left one folder per run behind).
_SCRATCH = tempfile.TemporaryDirectory(prefix="aotdist-test-pl-")
FLOAT8 = {"enabled": True, "exclude": ["head"], "fsdp_all_gather": True}


class MemoryLogger(Logger):
    """Keeps what the callback logs."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int | None, dict]] = []

    @property
    def name(self):
        return "memory"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs):
        pass

    def merged(self) -> dict:
        out: dict = {}
        for _, row in self.rows:
            out.update(row)
        return out


class GPTModule(pl.LightningModule):
    """TinyGPT with different weights per block; records its losses."""

    def __init__(self, depth: int = DEPTH, short_seq_from_epoch: int | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.model = build_model("gpt", depth=depth)
        self.short_seq_from_epoch = short_seq_from_epoch
        self.losses: list[float] = []
        self.val_losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if (
            self.short_seq_from_epoch is not None
            and self.current_epoch >= self.short_seq_from_epoch
        ):
            x, y = x[:, :8], y[:, :8]  # a new shape: makes Dynamo recompile
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.losses.append(loss.detach().item())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("val_loss", loss)
        self.val_losses.append(loss.item())
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        self.log("test_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class BF16Probe(GPTModule):
    """Records the dtype a region's Linear computes in (a probe outside Dynamo)."""

    def configure_model(self):
        self.seen: list[str] = []

        @torch.compiler.disable
        def probe(module, args, out):
            self.seen.append(str(out.dtype))

        self.model.blocks[0].mlp.fc.register_forward_hook(probe)
        super().configure_model()


class ShardedByUser(GPTModule):
    """The run without aotdist under ModelParallelStrategy: Float8 + fully_shard by hand."""

    def __init__(self, float8: bool = False):
        super().__init__()
        self.float8 = float8

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        if self.float8:
            from aotdist.config import Float8Config
            from aotdist.float8 import convert_to_float8

            convert_to_float8(self.model, Float8Config(**FLOAT8))
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.float8:
            aotdist.precompute_float8_scales(self.model)


class ParallelizedByUser(GPTModule):
    """A configure_model that calls aotdist.parallelize itself: the callback cooperates."""

    def configure_model(self):
        if aotdist.parallelize_info(self.model) is None:
            aotdist.parallelize(
                self.model,
                config={**AOT, "fsdp": {"enabled": True}},
                mesh=self.device_mesh["data_parallel"],
            )


def _loader(batch_size: int = 4, samples: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    model = build_model("gpt", depth=1)
    xs, ys = zip(*[example_inputs(model, 1, generator=g) for _ in range(samples)], strict=True)
    data = torch.utils.data.TensorDataset(torch.cat([x[0] for x in xs]), torch.cat(ys))
    return torch.utils.data.DataLoader(data, batch_size=batch_size)


def _fit(
    module,
    callbacks,
    *,
    strategy="auto",
    devices=1,
    max_steps=4,
    max_epochs=-1,
    ckpt_path=None,
    default_root_dir=None,
    batch_size=4,
    samples=16,
    loggers=None,
    precision="32-true",
):
    logger = MemoryLogger()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        max_epochs=max_epochs,
        logger=loggers or logger,
        callbacks=callbacks,
        enable_checkpointing=default_root_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        precision=precision,
        # never the repository: Lightning writes lightning_logs/ there by default
        default_root_dir=default_root_dir or tempfile.mkdtemp(dir=_SCRATCH.name),
    )
    trainer.fit(module, _loader(batch_size, samples), ckpt_path=ckpt_path)
    return trainer, logger


def _params(module) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _assert_same_params(a: dict, b: dict, **tol):
    assert list(a) == list(b)
    for key in a:
        torch.testing.assert_close(a[key], b[key], **tol, msg=lambda m, k=key: f"{k}: {m}")


# ---- one process ------------------------------------------------------------------------


def test_single_process_matches_eager_and_logs_metrics():
    ref = GPTModule()
    _fit(ref, [])
    module = GPTModule()
    loggers = [MemoryLogger(), MemoryLogger()]
    trainer, _ = _fit(module, [RegionalCompile(AOT)], loggers=loggers)
    torch.testing.assert_close(torch.tensor(module.losses), torch.tensor(ref.losses))
    _assert_same_params(_params(module), _params(ref), rtol=1e-5, atol=1e-6)
    assert loggers[0].rows == loggers[1].rows  # every logger, not only trainer.logger
    logged = loggers[1].merged()
    assert logged["aotdist/GPTBlock/instances"] == DEPTH
    assert logged["aotdist/GPTBlock/call_sites"] == DEPTH  # each block called the region
    assert logged["aotdist/GPTBlock/subgraphs"] == 1  # ... compiled once
    assert logged["aotdist/compile_seconds"] > 0 and logged["aotdist/graphs"] == 1
    assert logged["aotdist/recompiles"] == 0
    cb = trainer.callbacks[0] if isinstance(trainer.callbacks[0], RegionalCompile) else None
    assert cb is not None and cb.applied.how == "parallelize" and cb.applied.target_fqn == "model"
    # validate / test after fit: the compiled model, not applied again, eager numbers
    for run, key in ((trainer.validate, "val_loss"), (trainer.test, "test_loss")):
        got = run(module, _loader(4, 8), verbose=False)[0][key]
        want = pl.Trainer(
            accelerator="cpu",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tempfile.mkdtemp(dir=_SCRATCH.name),
        )
        expected = getattr(want, run.__name__)(ref, _loader(4, 8), verbose=False)[0][key]
        assert got == pytest.approx(expected, rel=1e-5), run.__name__
    assert trainer.callbacks[0].applied is cb.applied and cb.applied.target is module.model


def test_recompile_after_first_epoch_warns():
    module = GPTModule(short_seq_from_epoch=1)
    with pytest.warns(UserWarning, match=r"recompile\(s\) in epoch 1"):
        _, logger = _fit(module, [RegionalCompile(AOT)], max_steps=8, max_epochs=2)
    epochs = [
        row["aotdist/recompiles_epoch"]
        for _, row in logger.rows
        if "aotdist/recompiles_epoch" in row
    ]
    assert epochs[0] == 0 and epochs[1] >= 1


def test_resume_and_cross_loading_checkpoints(tmp_path):
    """Resuming with the callback follows the same trajectory as resuming without it,
    from a checkpoint written with or without it (same keys both ways)."""
    epoch = {"samples": 8}  # 2 steps per epoch: checkpoints land on epoch boundaries

    def first_two_steps(callbacks, where):
        trainer, _ = _fit(
            GPTModule(), callbacks, max_steps=2, default_root_dir=tmp_path / where, **epoch
        )
        return trainer.checkpoint_callback.best_model_path

    def resume(callbacks, ckpt, where):
        torch._dynamo.reset()
        module = GPTModule()
        _fit(
            module,
            callbacks,
            max_steps=4,
            ckpt_path=ckpt,
            default_root_dir=tmp_path / where,
            **epoch,
        )
        return module

    compiled_ckpt = first_two_steps([RegionalCompile(AOT)], "a")
    eager_ckpt = first_two_steps([], "b")
    reference = resume([], eager_ckpt, "c")  # plain Lightning
    assert len(reference.losses) == 2
    for ckpt, where in ((compiled_ckpt, "d"), (eager_ckpt, "e")):
        resumed = resume([RegionalCompile(AOT)], ckpt, where)
        assert resumed.losses == pytest.approx(reference.losses, rel=1e-5), where
        _assert_same_params(_params(resumed), _params(reference), rtol=1e-5, atol=1e-6)
    # the compiled run's checkpoint has the plain keys and loads strictly into a plain module
    saved = torch.load(compiled_ckpt, weights_only=False)
    plain = GPTModule()
    assert list(saved["state_dict"]) == list(plain.state_dict())
    plain.load_state_dict(saved["state_dict"])
    assert list(torch.load(eager_ckpt, weights_only=False)["state_dict"]) == list(
        saved["state_dict"]
    )
    assert any("RegionalCompile" in key for key in saved["callbacks"])
    # an uncompiled run resumed from the compiled run's checkpoint: same trajectory too
    plain_resumed = resume([], compiled_ckpt, "f")
    assert plain_resumed.losses == pytest.approx(reference.losses, rel=1e-5)


def test_resume_with_another_config_warns():
    cb = RegionalCompile(AOT)
    other = RegionalCompile({**AOT, "ac": {"enabled": True}})
    with pytest.warns(UserWarning, match="another RegionalCompile config"):
        other.load_state_dict(cb.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RegionalCompile(AOT).load_state_dict(cb.state_dict())


# ---- validation ---------------------------------------------------------------------------


def _fake_trainer(strategy, precision="32-true"):
    return SimpleNamespace(strategy=strategy, precision=precision)


def test_setup_validation_names_the_fix():
    from aotdist.callbacks.lightning import _validate
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy

    cpu = SingleDeviceStrategy(device=torch.device("cpu"))
    module = GPTModule()
    cfg = RegionalCompile(AOT).config
    with pytest.raises(ConfigError, match="FSDPStrategy is FSDP1.*ModelParallelStrategy"):
        _validate(_fake_trainer(FSDPStrategy()), module, cfg)
    with pytest.raises(ConfigError, match="fsdp.enabled needs ModelParallelStrategy"):
        _validate(_fake_trainer(DDPStrategy()), module, cfg.replace(fsdp={"enabled": True}))
    with pytest.raises(ConfigError, match="float8.enabled with precision='16-true'"):
        _validate(_fake_trainer(cpu, "16-true"), module, cfg.replace(float8={"enabled": True}))
    module._compiler_ctx = {"compiler": "dynamo"}
    with pytest.raises(ConfigError, match="came from torch.compile"):
        _validate(_fake_trainer(cpu), module, cfg)
    with pytest.raises(ConfigError, match="log_metrics"):
        RegionalCompile(log_metrics="yes")
    with pytest.raises(ConfigError, match="compile.backnd"):
        RegionalCompile({"compile": {"backnd": "x"}})


def test_a_pipelined_config_is_refused_with_the_accelerate_and_script_paths(tmp_path):
    """Lightning's loop cannot drive a pipeline schedule (its automatic optimization calls
    backward on training_step's loss; its samplers give every data-parallel process its
    own batch, where a replica's stages need the same one): refused when the callback is
    built, from a mapping or a YAML file, before any process starts, not when
    configure_model reaches parallelize."""
    path = tmp_path / "pp.yaml"
    path.write_text("pipeline:\n  enabled: true\n  degree: 2\n")
    for config in ({**AOT, "pipeline": {"enabled": True, "degree": 2}}, str(path)):
        with pytest.raises(ConfigError, match="Lightning's loop cannot drive") as err:
            RegionalCompile(config)
        text = str(err.value)
        assert "automatic optimization calls backward" in text
        assert "must read the same batch" in text
        fix = text.partition("Fix: ")[2]
        assert "aotdist.callbacks.prepare_pipeline" in fix and "aotdist.pipeline(" in fix
        assert "pipeline.enabled: false" in fix
        assert len(text) < 1200  # one screen
    assert RegionalCompile({**AOT, "pipeline": {"enabled": False}}).config.pipeline.degree == 0


def test_no_regions_and_compiled_submodule_are_refused():
    class Flat(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 4)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ConfigError, match="found no repeated regions in Flat"):
        _fit(Flat(), [RegionalCompile(AOT)], max_steps=1)
    module = GPTModule()
    module.model.blocks[0].compile(backend="aot_eager")
    with pytest.raises(OrderingError, match="already compiled"):
        _fit(module, [RegionalCompile(AOT)], max_steps=1)


# ---- DDP and ModelParallelStrategy on 2 CPU processes ------------------------------------


def _ddp_runs(rank: int, world_size: int):
    out = {}
    for name, callbacks in (("eager", []), ("aotdist", [RegionalCompile(AOT)])):
        torch._dynamo.reset()
        module = GPTModule()
        _, logger = _fit(module, callbacks, strategy="ddp", devices=world_size, batch_size=2)
        out[name] = {"losses": module.losses, "params": _params(module), "logged": logger.merged()}
    return out


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
def test_ddp_two_processes():
    ranks = run_distributed(_ddp_runs, 2, timeout=300)
    eager, compiled = ranks[0]["eager"], ranks[0]["aotdist"]
    torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]))
    _assert_same_params(compiled["params"], eager["params"], rtol=1e-5, atol=1e-6)
    assert compiled["logged"]["aotdist/GPTBlock/call_sites"] == DEPTH
    assert compiled["logged"]["aotdist/GPTBlock/subgraphs"] == 1
    assert ranks[1]["aotdist"]["logged"] == {}  # rank zero logs, the others do not


def _model_parallel_runs(rank: int, world_size: int):
    from lightning.pytorch.strategies import ModelParallelStrategy

    def strategy():
        return ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)

    runs = {
        "eager": (ShardedByUser(), []),
        "aotdist": (GPTModule(), [RegionalCompile(AOT)]),
        "eager_float8": (ShardedByUser(float8=True), []),
        "aotdist_float8": (GPTModule(), [RegionalCompile({**AOT, "float8": FLOAT8})]),
        "user_parallelize": (ParallelizedByUser(), [RegionalCompile(AOT)]),
        "aotdist_graph": (
            GPTModule(),
            [RegionalCompile({**AOT, "fsdp": {"enabled": True, "mode": "graph"}})],
        ),
        "aotdist_bf16": (BF16Probe(), [RegionalCompile(AOT)]),
        "aotdist_hsdp": (
            GPTModule(),
            [RegionalCompile({**AOT, "fsdp": {"enabled": True, "replicate_degree": world_size}})],
        ),
    }
    out = {}
    for name, (module, callbacks) in runs.items():
        torch._dynamo.reset()
        trainer, logger = _fit(
            module,
            callbacks,
            strategy=strategy(),
            devices=world_size,
            batch_size=2,
            precision="bf16-mixed" if name.endswith("bf16") else "32-true",
        )
        cb = next((c for c in trainer.callbacks if isinstance(c, RegionalCompile)), None)
        out[name] = {
            "losses": module.losses,
            "params": _params(module),
            "logged": logger.merged(),
            "how": cb.applied.how if cb else None,
            "weight": type(module.model.blocks[0].mlp.fc.weight.to_local()).__name__,
            "sharded": type(module.model.blocks[0]).__mro__[1].__name__,
            "placements": [
                type(p).__name__ for p in module.model.blocks[0].mlp.fc.weight.placements
            ]
            if hasattr(module.model.blocks[0].mlp.fc.weight, "placements")
            else None,
            "seen": sorted(set(getattr(module, "seen", []))),
        }
    return out


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
def test_model_parallel_fsdp2_with_and_without_float8():
    rank0 = run_distributed(_model_parallel_runs, 2, timeout=420)[0]
    for eager, compiled, tol in (
        ("eager", "aotdist", {"rtol": 1e-5, "atol": 1e-6}),
        ("eager_float8", "aotdist_float8", {"rtol": 1e-4, "atol": 1e-5}),
        ("eager", "user_parallelize", {"rtol": 1e-5, "atol": 1e-6}),
        ("eager", "aotdist_graph", {"rtol": 1e-5, "atol": 1e-6}),
        ("eager", "aotdist_hsdp", {"rtol": 1e-5, "atol": 1e-6}),
    ):
        torch.testing.assert_close(
            torch.tensor(rank0[compiled]["losses"]), torch.tensor(rank0[eager]["losses"]), **tol
        )
        _assert_same_params(rank0[compiled]["params"], rank0[eager]["params"], **tol)
        assert rank0[compiled]["logged"]["aotdist/GPTBlock/call_sites"] == DEPTH
        assert rank0[compiled]["logged"]["aotdist/GPTBlock/subgraphs"] == 1
    assert rank0["aotdist"]["how"] == "parallelize"
    assert rank0["user_parallelize"]["how"] == "user"  # not applied a second time
    assert rank0["aotdist_float8"]["weight"] == "WeightWithDynamicFloat8CastTensor"
    assert rank0["aotdist"]["sharded"] == "FSDPModule"  # FSDP2's class around the block
    assert "FSDP" not in rank0["aotdist_graph"]["sharded"]  # graph mode: no FSDP2 unit
    assert rank0["aotdist_graph"]["logged"]["aotdist/graphs"] == 1
    # fsdp.replicate_degree under ModelParallelStrategy: HSDP over the same ranks
    assert rank0["aotdist_hsdp"]["placements"] == ["Replicate", "Shard"]
    # Float8 really changed the numbers (the comparison above is not fp32 vs fp32)
    assert rank0["eager_float8"]["losses"][1:] != rank0["eager"]["losses"][1:]
    # precision="bf16-mixed": the regions compute in bf16, and the run trains
    bf16 = rank0["aotdist_bf16"]
    assert bf16["seen"] == ["torch.bfloat16"], bf16["seen"]
    assert bf16["logged"]["aotdist/GPTBlock/call_sites"] == DEPTH
    assert bf16["losses"] != rank0["aotdist"]["losses"]  # bf16 rounding, really
    torch.testing.assert_close(
        torch.tensor(bf16["losses"]), torch.tensor(rank0["eager"]["losses"]), rtol=2e-2, atol=0
    )  # same training, to bf16 accuracy


# ---- LightningCLI configs and the recipe -------------------------------------------------

CONFIGS = sorted((ROOT / "configs" / "lightning").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_lightning_configs_parse(path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import train_lightning

    assert path.read_text().startswith(
        f"# python recipes/train_lightning.py fit --config configs/lightning/{path.name}"
    )
    cli = train_lightning.CLI(
        train_lightning.ViTClassifier,
        train_lightning.FakeImages,
        trainer_defaults=train_lightning.trainer_defaults(),
        run=False,
        args=["--config", str(path), "--trainer.accelerator", "cpu"],
        save_config_callback=None,
    )
    callbacks = [c for c in cli.trainer.callbacks if isinstance(c, RegionalCompile)]
    assert len(callbacks) == 1
    assert callbacks[0].config.compile.backend == "inductor"


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
@pytest.mark.inductor
def test_recipe_runs_end_to_end(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "recipes" / "train_lightning.py"),
        "fit",
        "--config",
        str(ROOT / "configs" / "lightning" / "cpu_fsdp2.yaml"),
        "--trainer.max_steps",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.default_root_dir",
        str(tmp_path),
        "--trainer.enable_progress_bar",
        "false",
        "--model.num_layers",
        "2",
        "--data.train_size",
        "32",
        "--data.val_size",
        "16",
    ]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=480, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # what aotdist did, in the user's words (not the name of a function they never called)
    said = "aotdist: sharded it with FSDP2 (hooks mode), compiled its regions ('model')"
    assert said in proc.stdout + proc.stderr
    assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stdout + proc.stderr


@pytest.mark.slow  # two Inductor compiles, about 30 s on a 2-core CPU machine
@pytest.mark.inductor
@pytest.mark.parametrize("sanity", [2, 0], ids=["sanity_check", "validation_after_a_step"])
def test_cache_saves_the_training_and_eval_graphs_whichever_comes_first(tmp_path, sanity):
    """Lightning validates before it trains (num_sanity_val_steps=2 by default): the saved
    graph must be the training call's, with the eval call's saved beside it. Without the
    sanity check the first validation comes after the save (here after the first step):
    the callback saves again after it. Either way a warm start validates and trains from
    the saved graphs untraced."""
    from aotdist import _compat
    from aotdist.compile.state import STATE_ATTR

    if _compat.precompile_unavailable() is not None:
        pytest.skip(_compat.precompile_unavailable())
    config = {
        "compile": {"backend": "inductor"},
        "cache": {"mode": "local", "dir": str(tmp_path / "bundle")},
    }
    runs, cold_val = [], None
    for phase in ("cold", "warm"):
        torch._dynamo.reset()
        module = GPTModule()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=2,
                logger=False,
                callbacks=[RegionalCompile(config)],
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=sanity,
                val_check_interval=None if sanity else 1,
                default_root_dir=tempfile.mkdtemp(dir=_SCRATCH.name),
            )
            trainer.fit(module, _loader(), _loader())
        load = vars(module.model)[aotdist.cache.STATE_ATTR]["load"]
        runs.append((phase, load, module.losses, [str(w.message) for w in caught]))
        cold_val = module.val_losses if phase == "cold" else cold_val
    (_, cold, cold_losses, _), (_, warm, warm_losses, warned) = runs
    assert cold.status == "missing" and cold.precompile_reason == "", cold
    assert warm.status == "loaded" and warm.precompiled, warm  # the training graph saved
    assert warm_losses == cold_losses
    assert not any("nothing was compiled" in w for w in warned), warned
    # the sanity check's eval calls ran the eval call's saved graph: nothing was traced
    assert not any("does not cover this call" in w for w in warned), warned
    saved = vars(module.model)[STATE_ATTR].hooks.cache.precompiled
    assert [ran for _, _, ran in saved.graphs] == [True, True], saved.graphs
    assert module.val_losses == cold_val, (module.val_losses, cold_val)
    assert len(cold_val) == (sanity if sanity else 2 * 4)  # the validations ran (2 steps)


def test_recipe_defaults_add_the_callback_once(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "recipes"))
    import train_lightning

    cli = train_lightning.CLI(
        train_lightning.ViTClassifier,
        train_lightning.FakeImages,
        trainer_defaults=train_lightning.trainer_defaults(),
        run=False,
        args=[],
        save_config_callback=None,
    )
    assert sum(isinstance(c, RegionalCompile) for c in cli.trainer.callbacks) == 1
    assert type(cli.trainer.strategy).__name__ == "ModelParallelStrategy"


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
def test_ddp_spawn_two_processes():
    """ddp_spawn pickles the callback into fresh processes; weights come back to this one."""
    ref = GPTModule()
    _fit(ref, [], strategy="ddp_spawn", devices=2, batch_size=2)
    module = GPTModule()
    _fit(module, [RegionalCompile(AOT)], strategy="ddp_spawn", devices=2, batch_size=2)
    _assert_same_params(_params(module), _params(ref), rtol=1e-5, atol=1e-6)
    assert not torch.equal(
        _params(module)["model.blocks.0.mlp.fc.weight"],
        _params(GPTModule())["model.blocks.0.mlp.fc.weight"],
    )


# ---- a transformers decoder under ModelParallelStrategy ----------------------------------


class LlamaModule(pl.LightningModule):
    """A tiny transformers Llama (random weights, 3 decoder layers); records its losses.
    ``shard_by_hand``: the eager reference, FSDP2 per decoder layer and root, no aotdist."""

    def __init__(self, shard_by_hand: bool = False):
        super().__init__()
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        cfg = transformers.AutoConfig.for_model(
            "llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=DEPTH,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
            use_cache=False,
        )
        self.model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
        self.shard_by_hand = shard_by_hand
        self.losses: list[float] = []

    def configure_model(self):
        if self.shard_by_hand:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _llama_model_parallel_runs(rank: int, world_size: int):
    from lightning.pytorch.strategies import ModelParallelStrategy

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randint(0, 128, (8 * world_size, 12), generator=g))
    out = {}
    for name, module, callbacks in (
        ("eager", LlamaModule(shard_by_hand=True), []),
        ("aotdist", LlamaModule(), [RegionalCompile(AOT)]),
    ):
        logger = MemoryLogger()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=world_size,
                max_steps=3,
                logger=logger,
                strategy=ModelParallelStrategy(
                    data_parallel_size=world_size, tensor_parallel_size=1
                ),
                callbacks=callbacks,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                default_root_dir=tempfile.mkdtemp(dir=_SCRATCH.name),
            )
            trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2))
        out[name] = {
            "losses": module.losses,
            "params": _params(module),
            "logged": logger.merged(),
            "sharded": type(module.model.model.layers[0]).__mro__[1].__name__,
            "warnings": [
                str(w.message)
                for w in caught
                if issubclass(w.category, aotdist.RegionCompileWarning)
            ],
        }
    return out


@pytest.mark.slow  # > 30 s on a 2-core CPU machine
def test_model_parallel_transformers_decoder_runs_every_layer_compiled():
    """transformers wraps ``forward`` of every decoder-layer subclass, FSDP2's included:
    the callback must still run each layer's compiled region, never train eagerly unsaid."""
    rank0 = run_distributed(_llama_model_parallel_runs, 2, timeout=420)[0]
    eager, compiled = rank0["eager"], rank0["aotdist"]
    assert compiled["sharded"] == "FSDPModule", compiled["sharded"]
    logged = compiled["logged"]
    assert logged["aotdist/LlamaDecoderLayer/instances"] == DEPTH, logged
    assert logged["aotdist/LlamaDecoderLayer/call_sites"] == DEPTH, logged
    assert logged["aotdist/LlamaDecoderLayer/subgraphs"] == 1, logged
    assert logged["aotdist/graphs"] >= 1, logged
    assert not compiled["warnings"], compiled["warnings"]
    assert len(compiled["losses"]) == 3
    torch.testing.assert_close(
        torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6
    )
    _assert_same_params(compiled["params"], eager["params"], rtol=1e-5, atol=1e-6)
