"""One benchmark measurement, run in a fresh process with an empty compiler cache.

The parent (:mod:`aotdist.bench`) starts ``python -m aotdist.bench.runner`` once per
(model, depth, strategy, ranks) with ``TORCHINDUCTOR_CACHE_DIR`` pointing at a new empty
directory, so every compile is cold; the child prints one ``AOTDIST_RESULT`` JSON line.
With ``--nproc N`` the child starts N ranks through :func:`aotdist.launch.run_distributed`
(fresh spawned processes, a process group, a timeout that kills every rank when one
hangs); each rank compiles into an empty cache directory of its own.

A measurement: build the model (seeded), take the memory baseline, apply the strategy,
time the first training step (cold compile), ``warmup`` more steps, then ``steps`` timed
steps, and one step whose forward runs under saved-tensor hooks
(:mod:`aotdist.bench.saved`). Cold compile time is the first step's wall time minus the
median steady step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

from aotdist.bench.memory import MemoryProbe
from aotdist.bench.phases import (
    PROFILED_STEPS,
    PhaseTimer,
    profile_first_step,
    profile_steady_steps,
)

RESULT_PREFIX = "AOTDIST_RESULT "
PHASE_PREFIX = "AOTDIST_PHASE "


def _phase(rank: int, text: str) -> None:
    """A progress line the parent shows (rank 0 only)."""
    if rank == 0:
        print(PHASE_PREFIX + text, flush=True)


def _step_fn(model, opt, x, y, device: str, *, cuda_graphs: bool = False):
    import torch

    from aotdist.bench.models import training_loss

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step() -> float:
        if cuda_graphs:  # a new iteration: cudagraph trees may reuse the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        sync()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = training_loss(model(x), y)
        loss.backward()
        opt.step()
        sync()
        return time.perf_counter() - start

    return step


def _saved_for_backward(model, run_model, opt, x, y, *, cuda_graphs: bool = False) -> dict:
    """One more training step with :class:`~aotdist.bench.saved.SavedBytes` around the
    forward: the bytes saved for backward (activations; parameters and buffers apart)."""
    import torch

    from aotdist.bench.models import training_loss
    from aotdist.bench.saved import SavedBytes

    if cuda_graphs:
        torch.compiler.cudagraph_mark_step_begin()
    opt.zero_grad(set_to_none=True)
    with SavedBytes(exclude=[*model.parameters(), *model.buffers()]) as saved:
        loss = training_loss(run_model(x), y)
    loss.backward()
    opt.zero_grad(set_to_none=True)
    return {
        "saved_activation_bytes": saved.activation_bytes,
        "saved_bytes_total": saved.total_bytes,
        "saved_tensors": saved.saved_tensors,
    }


def _build(spec: dict, name: str, *, fsdp: bool = False) -> tuple:
    """The seeded model (the same weights for every rank and strategy) and strategy
    ``name`` applied to it: ``(strategy, model, module to call, strategy notes, seconds
    the strategy's apply took)``."""
    import torch

    from aotdist.bench.models import build_bench_model
    from aotdist.bench.strategies import Setup, get_strategy

    strategy = get_strategy(name)
    torch.manual_seed(0)
    model = build_bench_model(spec["model"], depth=spec["depth"]).to(spec["device"])
    notes = strategy.notes(model) if strategy.notes else ""
    setup = Setup(
        backend=spec["backend"],
        fsdp=fsdp,
        float8=spec["float8"],
        replicate=spec.get("replicate", 1) if fsdp else 1,
        mode=spec.get("mode"),
    )
    start = time.perf_counter()  # a warm restart counts this: loading artifacts is in it
    run_model = strategy.apply(model, setup)
    return strategy, model, run_model, notes, time.perf_counter() - start


def _fsdp_mesh_shape(model) -> list[int] | None:
    """The shape of the mesh the model's parameters are sharded on (``None``: not sharded)."""
    mesh = next((getattr(p, "device_mesh", None) for p in model.parameters()), None)
    return list(mesh.shape) if mesh is not None else None


def _training(spec: dict, model, run_model, rank: int = 0) -> tuple:
    """SGD, this rank's synthetic batch (on the device) and the timed step function:
    ``(opt, x, y, step)``."""
    import torch

    from aotdist.bench.models import synthetic_batch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    x, y = synthetic_batch(spec["model"], model, batch=spec["batch"], generator=g)
    x, y = x.to(spec["device"]), y.to(spec["device"])
    return opt, x, y, _step_fn(run_model, opt, x, y, spec["device"], cuda_graphs=_cuda_graphs(spec))


def _cuda_graphs(spec: dict) -> bool:
    from aotdist.bench.strategies import CUDA_GRAPH_MODES

    return spec.get("mode") in CUDA_GRAPH_MODES and spec["device"].startswith("cuda")


def measure(spec: dict, *, rank: int = 0, world_size: int = 1) -> dict:
    """Builds the model, applies the strategy and times training steps.

    Args:
        spec: ``strategy``, ``model``, ``depth``, ``backend``, ``steps``, ``warmup``,
            ``batch``, ``device``, ``float8`` and optionally ``profile_dir`` and ``mode``
            (``torch.compile``'s).
            After the timed steps, one more step measures the bytes saved for backward.
        rank: This process's rank (under FSDP2).
        world_size: Ranks in the process group; > 1 shards with FSDP2.

    Returns:
        The JSON-able result of this rank.
    """
    import torch

    from aotdist import _compat, metrics

    device = spec["device"]
    _phase(rank, f"build {spec['model']} depth {spec['depth']}, apply {spec['strategy']}")
    # first, in every strategy alike: a warm start's bundle load in parallelize imports the
    # compiler too, the cold step does not count these imports, and the memory baseline
    # holds the compiler's code
    _compat.import_compiler_stack()
    strategy, model, run_model, notes, apply_s = _build(spec, spec["strategy"], fsdp=world_size > 1)
    isa_probe_s = _probe_cpu_isa(spec, strategy)
    memory = MemoryProbe(device)  # baseline: after imports, model build and strategy
    opt, x, y, step = _training(spec, model, run_model, rank)
    barrier = _barrier(world_size)
    tracked = model if spec["strategy"].startswith("aotdist") else None
    profile_dir = spec.get("profile_dir") if rank == 0 else None
    label = f"{spec['model']}-d{spec['depth']}-{spec['strategy']}-np{world_size}"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        barrier()
        _phase(rank, "cold step (compile)")
        with metrics.track(tracked) as m, PhaseTimer() as phases:
            first = profile_first_step(step, profile_dir, label) if profile_dir else step()
        save_s = time.perf_counter()
        if tracked is not None:  # cache.mode local/shared: save after the first step
            import aotdist.cache

            aotdist.cache.save(model)  # with precompile: the graph is traced once more
        save_s = time.perf_counter() - save_s
        _phase(rank, f"cold step {first:.2f}s; warm-up and timed steps")
        with metrics.track(None) as later:  # warm-up and timed steps: nothing may compile
            for _ in range(spec["warmup"]):
                step()
            barrier()
            times = [step() for _ in range(spec["steps"])]
            saved = _saved_for_backward(model, run_model, opt, x, y, cuda_graphs=_cuda_graphs(spec))
        if profile_dir:
            profile_steady_steps(step, profile_dir, label, phases)
        elif spec.get("profile_dir"):  # other ranks: the same steps, for their collectives
            for _ in range(PROFILED_STEPS):
                step()
    steady = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [steady] * 3
    compile_s = max(first - steady, 0.0) if strategy.compiles else 0.0
    return {
        "strategy": spec["strategy"],
        "model": spec["model"],
        "depth": spec["depth"],
        "nproc": world_size,
        "backend": spec["backend"],
        "compile_mode": spec.get("mode"),
        "device": device,
        "float8": spec["float8"],
        "batch": spec["batch"],
        "rank": rank,
        "fsdp_mesh": _fsdp_mesh_shape(model),
        "first_step_s": first,
        "isa_probe_s": isa_probe_s,
        "apply_s": apply_s,
        "steady_step_s": steady,
        "step_times_s": times,
        "steady_step_iqr_s": [q[0], q[2]],
        "compile_s": compile_s,
        "compile_split_s": phases.split(m, compile_s=compile_s),
        **memory.report(),
        **saved,
        "frames_compiled": m.frames_compiled,
        "graphs": m.graphs,
        "graph_breaks": m.num_graph_breaks,
        "frames_skipped": sum(m.unsupported.values()),  # Dynamo gave up: ran eager
        "graph_break_reasons": {k.splitlines()[0][:200]: v for k, v in m.graph_breaks.items()},
        "recompiles": len(m.recompiles),
        "recompiles_after_first_step": len(later.recompiles),
        "frames_compiled_after_first_step": later.frames_compiled,
        "regions": {n: vars(s) for n, s in m.regions.items()},
        "mode": m.mode,
        "notes": notes,
        "profiled": bool(profile_dir),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **_cache_fields(model),
        "cache_save_s": save_s,
        "precompiled": m.precompiled,
    }


def measure_paired(spec: dict, strategies: list[str], slices: int) -> dict:
    """Steady steps of several strategies side by side in one process.

    Each strategy gets its own model (the same seeded weights and batch), a first step
    (a compile, or a load where the Inductor cache dir holds its artifacts) and
    ``spec["warmup"]`` warm-up steps; then ``slices`` rounds each time
    ``spec["steps"]`` steps of every strategy, the order rotating by one per round. A
    ratio of two strategies' medians within one round compares steps taken seconds
    apart in the same process, which separate processes minutes apart cannot do on a
    shared machine.

    Returns:
        ``slice_step_s``: strategy -> the median step time of each round; also each
        strategy's ``first_step_s`` and the process's ``cache_hits``.
    """
    import torch

    device, steps, first = spec["device"], {}, {}
    hits = _cache_hits()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in strategies:
            _phase(0, f"build {spec['model']} depth {spec['depth']}, apply {name}, compile")
            _, model, run_model, *_ = _build(spec, name)
            steps[name] = _training(spec, model, run_model)[-1]
            first[name] = steps[name]()
            for _ in range(spec["warmup"]):
                steps[name]()
        _phase(0, f"{slices} rounds of {spec['steps']} steps per strategy, interleaved")
        medians: dict[str, list[float]] = {name: [] for name in strategies}
        for k in range(slices):
            shift = k % len(strategies)
            for name in strategies[shift:] + strategies[:shift]:
                medians[name].append(statistics.median(steps[name]() for _ in range(spec["steps"])))
    return {
        "model": spec["model"],
        "depth": spec["depth"],
        "nproc": 1,
        "backend": spec["backend"],
        "compile_mode": spec.get("mode"),
        "device": device,
        "strategies": list(strategies),
        "slices": slices,
        "steps_per_slice": spec["steps"],
        "slice_step_s": medians,
        "first_step_s": first,
        "cache_hits": {k: v - hits[k] for k, v in _cache_hits().items()},
        "torch": torch.__version__,
    }


def _cache_hits() -> dict[str, int]:
    """Inductor FX-graph and AOTAutograd cache hits so far in this process (a paired run
    that starts from compiled artifacts shows hits)."""
    from aotdist import _compat

    return {
        "fx_graph": _compat.dynamo_counters("inductor").get("fxgraph_cache_hit", 0),
        "aot_autograd": _compat.dynamo_counters("aot_autograd").get("autograd_cache_hit", 0),
    }


def _probe_cpu_isa(spec: dict, strategy) -> float:
    """Seconds of Inductor's CPU vector-ISA probes, run before the cold step (0.0 where
    they do not apply: no Inductor, no compile, not CPU).

    They are a one-time cost of an Inductor cache dir (seconds of C++ compiles), the same
    for every strategy, which a persistent cache dir pays once per machine; in
    the cold step they would add that constant to every strategy's compile and pull every
    compile ratio toward 1. The report gives them apart, and the warm/cold first-step
    ratio of a fresh start adds them back on both sides.
    """
    if spec["device"] != "cpu" or spec["backend"] != "inductor" or not strategy.compiles:
        return 0.0
    from aotdist import _compat

    start = time.perf_counter()
    _compat.probe_cpu_isa()
    return time.perf_counter() - start


def _cache_fields(model) -> dict:
    """What ``parallelize`` did with the cache bundle: its status, the seconds it spent
    loading it (a warm start's share of setup) and why no graph was saved or loaded."""
    state = vars(model).get("_aotdist_cache")
    if state is None:
        return {"cache_load": "off", "cache_load_s": 0.0, "precompile_reason": ""}
    load = state["load"]
    return {
        "cache_load": str(load.status),
        "cache_load_s": state["load_s"],
        "precompile_reason": load.precompile_reason,
    }


def _barrier(world_size: int):
    if world_size == 1:
        return lambda: None
    import torch.distributed as dist

    return dist.barrier


def _rank_measure(rank: int, world_size: int, spec: dict) -> dict:
    """Entry point of one rank: an empty compiler cache of its own, then :func:`measure`."""
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if base:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"rank{rank}")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(base, f"rank{rank}", "triton")
    if spec["device"].startswith("cuda"):
        spec = {**spec, "device": f"cuda:{rank}"}
    return measure(spec, rank=rank, world_size=world_size)


def merge_ranks(results: list[dict]) -> dict:
    """One result for a multi-rank measurement: the slowest rank's times, the largest peak.

    Ranks run in lockstep (collectives), so their step times agree closely; the maximum
    is what a training job waits for. Every rank's own result is kept under ``ranks``.
    """
    merged = dict(results[0])
    for key in (
        "first_step_s",
        "isa_probe_s",
        "steady_step_s",
        "compile_s",
        "peak_mem_mib",
        "peak_rss_mib",
        "saved_activation_bytes",
        "saved_bytes_total",
    ):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            merged[key] = max(values)
    merged["compile_split_s"] = max(results, key=lambda r: r["compile_s"])["compile_split_s"]
    merged["ranks"] = [
        {
            k: r.get(k)
            for k in (
                "rank",
                "first_step_s",
                "steady_step_s",
                "compile_s",
                "peak_mem_mib",
                "fsdp_mesh",
            )
        }
        for r in results
    ]
    merged.pop("rank", None)
    return merged


def run(spec: dict, *, nproc: int, timeout: float) -> dict:
    """One measurement on ``nproc`` ranks (this process when ``nproc == 1``)."""
    if nproc == 1:
        return measure(spec)
    from aotdist.launch import run_distributed

    pg_backend = "nccl" if spec["device"].startswith("cuda") else "gloo"
    # skip_teardown: with torch 2.15, C++ teardown after Inductor compiled in a rank can
    # abort (SIGABRT) after the measurement was reported; a measurement is not a test of it.
    results = run_distributed(
        _rank_measure, nproc, spec, backend=pg_backend, timeout=timeout, skip_teardown=True
    )
    return merge_ranks(results)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--strategy", required=True)
    p.add_argument("--model", default="gpt")
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--mode", default=None, help="torch.compile mode of every compiling strategy")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--float8", action="store_true")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicate degree (--nproc > 1)")
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="steady steps only: --strategy a,b,... side by side in one process, "
        "ROUNDS interleaved rounds of --steps steps each",
    )
    a = p.parse_args(argv)
    spec = {
        "strategy": a.strategy,
        "model": a.model,
        "depth": a.depth,
        "backend": a.backend,
        "steps": a.steps,
        "warmup": a.warmup,
        "batch": a.batch,
        "device": a.device,
        "float8": a.float8,
        "replicate": a.replicate,
        "profile_dir": a.profile_dir,
        "mode": a.mode,
    }
    if a.paired:
        result = measure_paired(spec, a.strategy.split(","), a.paired)
    else:
        result = run(spec, nproc=a.nproc, timeout=a.timeout)
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is out: skip tearing down the compiler's state (about 2 s a run here);
    # Inductor's compile workers exit when they see their parent gone.
    os._exit(status)
