"""``aotdist zoo``: every family checked in a fresh process, and its table: the listed
families (``docs/models.md``), timm's architectures and torchtitan's models
(``docs/models-timm-torchtitan.md``), diffusers' denoisers and peft's LoRA adapters
(``docs/models-diffusers-peft.md``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence

from aotdist.check.families import FAMILIES, causal_lm_types
from aotdist.check.families_diffusers import DIFFUSERS_MODELS
from aotdist.check.families_peft import PEFT_MODELS
from aotdist.check.families_timm import TIMM_MODELS
from aotdist.check.families_titan import TITAN_MODELS
from aotdist.check.runner import FAILING, STEPS, CheckResult

# Families the zoo also checks under FSDP2 hooks mode on 2 ranks: dense, MoE, encoder, and
# dense with transformers' default KV cache (use_cache=True: each layer compiles anew, named).
FSDP_FAMILIES = ("llama", "qwen3_moe", "bert", "llama+cache")

# What ``aotdist zoo --source`` checks: the listed families, timm's, torchtitan's,
# diffusers' denoisers, peft's adapters.
SOURCES = ("families", "timm", "torchtitan", "diffusers", "peft")


def source_specs(source: str) -> list[str]:
    """The specs a source's sweep checks (``families``: :data:`FAMILIES`; ``timm``:
    ``timm:ARCH`` of :data:`TIMM_MODELS`; ``torchtitan``: ``titan:NAME``; ``diffusers``:
    ``diffusers:CLASS`` of :data:`DIFFUSERS_MODELS`; ``peft``: ``peft:TYPE`` of
    :data:`PEFT_MODELS`)."""
    if source == "families":
        return [f.name for f in FAMILIES]
    if source == "timm":
        return [f"timm:{f.name}" for f in TIMM_MODELS]
    if source == "torchtitan":
        return [f"titan:{name}" for name in TITAN_MODELS]
    if source == "diffusers":
        return [f"diffusers:{f.name}" for f in DIFFUSERS_MODELS]
    if source == "peft":
        return [f"peft:{f.name}" for f in PEFT_MODELS]
    raise ValueError(f"unknown source {source!r}: one of {', '.join(SOURCES)}")


STATUS_MEANING = {
    "reused": "every region compiled once, one subgraph for all its instances",
    "partly reused": "some region demoted, inlined or compiled more than once (named in "
    "Notes, warned at run time)",
    "demoted": "no region kept as a subgraph: the model compiles whole",
    "no regions": "no repeated region found",
    "torch.compile fails too": "aotdist fails, and whole-model torch.compile fails or "
    "trains with gradients off eager's (by at least half as "
    "much as aotdist's)",
    "not built": "the tiny config does not build or train eagerly (not checked)",
    "crash": "FAILS: aotdist fails where whole-model torch.compile trains as eager does",
    "parity": "FAILS: loss or a gradient differs from eager",
    "eager!": "FAILS: a region instance ran uncompiled without a warning",
}


def default_memory_limit_gb() -> float:
    """Half this machine's physical memory: a tiny config that asks for more (some
    multimodal ones ask for 16-24 GB) fails its build and reads "not built" instead of
    taking the machine down with it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 / 2**30
    except (ValueError, OSError, AttributeError):
        return 0.0


def limit_memory(gb: float) -> None:
    """Caps this process's address space at ``gb`` GiB (``aotdist check --memory-limit``;
    0: no cap). The checks run on CPU, which reserves no large address ranges as CUDA
    does. A no-op where ``resource`` is missing (not a POSIX system)."""
    try:
        import resource
    except ImportError:
        return
    if gb > 0:
        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


_OUT_OF_MEMORY = (
    "MemoryError",
    "can't allocate memory",
    "std::bad_alloc",
    "Cannot allocate memory",
)


def _one(
    spec: str, *, backend: str, fsdp: int, timeout: float, memory_gb: float = 0.0
) -> CheckResult:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "aotdist.cli",
            "check",
            spec,
            "--backend",
            backend,
            "--json",
            out,
        ]
        if fsdp:
            cmd += ["--nproc", str(fsdp)]
        if memory_gb > 0:
            cmd += ["--memory-limit", str(memory_gb)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return CheckResult(
                spec, status="crash", fsdp=fsdp, error=f"timed out after {timeout:.0f} s"
            )
        if not os.path.exists(out):
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            error = f"exit {proc.returncode}: " + "\n".join(tail)
            if proc.returncode == -9 or any(m in error for m in _OUT_OF_MEMORY):
                cap = (
                    f"capped at {memory_gb:.1f} GiB of address space" if memory_gb > 0 else "no cap"
                )
                error = (
                    f"out of memory ({cap}; set one with --memory-limit GB; exit -9: "
                    "killed by the system): " + error
                )
            return CheckResult(spec, status="crash", fsdp=fsdp, error=error)
        with open(out) as f:
            data = json.load(f)
    fields = set(CheckResult.__dataclass_fields__)
    return CheckResult(**{k: v for k, v in data.items() if k in fields})


def run_zoo(
    names: Sequence[str] | None = None,
    *,
    backend: str = "aot_eager",
    fsdp_names: Sequence[str] = FSDP_FAMILIES,
    fsdp_ranks: int = 2,
    timeout: float = 600.0,
    memory_gb: float | None = None,
    progress: Callable[[str], None] | None = print,
    source: str | Sequence[str] = "families",
) -> list[CheckResult]:
    """Checks each family (when ``names`` is ``None``: every one of ``source``, one of
    :data:`SOURCES` or several) in a fresh process, then those of ``fsdp_names`` under
    FSDP2 on ``fsdp_ranks`` gloo ranks (beyond the listed families: only those checked).
    Each process's address space is capped at ``memory_gb`` GiB (default: half the
    physical memory; 0: no cap), so a tiny config whose build asks for more reads "not
    built"."""
    memory_gb = default_memory_limit_gb() if memory_gb is None else memory_gb
    sources = [source] if isinstance(source, str) else list(source)
    if names is None:
        names = [spec for s in sources for spec in source_specs(s)]
    names = list(names)
    if sources != ["families"]:  # FSDP2 rows of the listed families belong to their page
        fsdp_names = [n for n in fsdp_names if n in names]
    if "all" in names:  # the listed families and every causal LM of the installed transformers
        listed = [f.name for f in FAMILIES]
        names = listed + [f"hf:{t}" for t in causal_lm_types() if t not in listed]
    jobs = [(n, 0) for n in names] + [(n, fsdp_ranks) for n in fsdp_names if fsdp_ranks > 1]
    results = []
    for i, (name, ranks) in enumerate(jobs, 1):
        result = _one(name, backend=backend, fsdp=ranks, timeout=timeout, memory_gb=memory_gb)
        results.append(result)
        if progress is not None:
            progress(f"[{i}/{len(jobs)}] {result.line()}")
    return results


_SHORT = (  # torch's long reasons, as a table cell says them
    (
        "in-place input or buffer mutations",
        "demoted: updates a buffer in place in training, which invoke_subgraph does not "
        "support yet",
    ),
    (
        "inputs differ between call sites",
        "compiled more than once: its inputs differ "
        "between call sites (shape, layout or requires_grad)",
    ),
)


def _short(why: str) -> str:
    if "call sites pass inputs that differ" in why:
        # up to the paren that closes torch's reason: a shape or stride has parens of its own
        detail = re.search(r"mismatch: ([^;]+?)\)(?:;|$)", why) or re.search(
            r"mismatch: ([^;]+)", why
        )
        text = detail.group(1) if detail else ""
        text += ")" * (text.count("(") - text.count(")"))  # a reason cut short at 300 chars
        return "compiled more than once: its call sites pass inputs that differ" + (
            f" ({text})" if text else ""
        )
    for needle, text in _SHORT:
        if needle in why:
            return text
    return why[:200]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


_TITLES = {
    "families": "Model families",
    "timm": "timm models",
    "torchtitan": "torchtitan models",
    "diffusers": "diffusers models",
    "peft": "peft LoRA adapters",
}
_LIBRARIES = {
    "families": ("transformers",),
    "timm": ("timm",),
    "torchtitan": ("torchtitan",),
    "diffusers": ("diffusers",),
    "peft": ("peft", "transformers"),
}


def render(
    results: Sequence[CheckResult],
    *,
    backend: str = "aot_eager",
    source: str | Sequence[str] = "families",
) -> str:
    """The markdown of a sweep's page (``docs/models.md`` for the listed families): one row
    per check, the statuses explained."""
    import importlib
    import importlib.metadata

    import torch

    sources = [source] if isinstance(source, str) else list(source)
    found = [f"torch {torch.__version__.split('+')[0]}"]
    for library in dict.fromkeys(lib for s in sources for lib in _LIBRARIES.get(s, ())):
        try:
            found.append(f"{library} {importlib.metadata.version(library)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    versions = ", ".join(found)
    single = [r for r in results if not r.fsdp and r.status != "not built"]
    reused = sum(r.status == "reused" for r in single)
    failing = [r for r in results if r.status in FAILING]
    built = {
        "families": "each family is built from its config, shrunk to a few layers of width "
        "64 with random weights",
        "timm": "each architecture is built by `timm.create_model(arch, pretrained=False, "
        "num_classes=10, drop_path_rate=0.1)` with random weights, at 64 pixels "
        "where it takes an `img_size` (fewer blocks where it takes `depth`), in "
        "train mode",
        "torchtitan": "each model is built from torchtitan's own model code (its debug "
        "flavor: 3 blocks, fewer experts, SDPA attention) with random weights",
        "diffusers": "each diffusers model class is built from its constructor arguments "
        "(2-3 blocks of width 32, a latent of a few patches) with random weights, in train "
        "mode, and called with random inputs its forward takes; the loss is the mean square "
        "of its `sample`",
        "peft": "each adapter is a `peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05)` "
        "on the attention projections of a frozen transformers causal LM built from its "
        "config (a few layers of width 64, random weights), its `lora_B` drawn non-zero",
    }
    peers = "diffusers" in sources or any(r.repeated_blocks for r in results)
    steps = max((r.steps for r in results), default=STEPS)
    flag = "" if sources == ["families"] else f" --source {','.join(sources)}"
    lines = [
        "# "
        + " and ".join(_TITLES.get(s, s) for s in sources)
        + ("" if backend == "aot_eager" else f", backend {backend}"),
        "",
        f"Generated by `aotdist zoo{flag}` "
        "(do not edit): " + "; ".join(built.get(s, s) for s in sources) + ". Each is "
        f"trained {steps} SGD step(s) on CPU with backend `{backend}` ({versions}), eagerly, "
        "with whole-model `torch.compile` and with aotdist, from the same weights, batch and "
        "random seed per step, with dropout and stochastic depth off (random masks are not "
        "comparable); losses, gradients and buffers (running statistics) are compared "
        "after every step. A model built with stochastic depth on is compiled once more as "
        "built, and its regions' reuse judged there (Stochastic depth on). Check your own "
        "model the same way with `aotdist check module:factory`. Grad diff: the largest "
        "difference of a parameter's gradient from eager, relative to that gradient's largest "
        "value (or to a thousandth of the model's largest gradient, where that is larger), "
        "for aotdist and (in brackets) whole-model `torch.compile`; buffers are measured "
        "the same way. Where only gradients are off eager's, each run is compared once more "
        "with eager in float64: no further from it than twice eager's own float32 gradients "
        "is rounding (named in the notes), not a failure."
        + (
            " Where a diffusers class declares `_repeated_blocks`, a copy is also trained with "
            "diffusers' own regional compile, `model.compile_repeated_blocks(backend=...)` "
            "(a `torch.compile` of each such block), and judged as whole-model compile is "
            "(compile_repeated_blocks; none declared: the class names no blocks)."
            if peers
            else ""
        ),
        "",
        f"{reused} of {len(single)} families keep every region as one reused subgraph; "
        f"{len(failing)} check(s) fail"
        + (
            f"; {len(results) - len(single) - sum(bool(r.fsdp) for r in results)} tiny "
            "config(s) do not build."
            if any(r.status == "not built" for r in results)
            else "."
        ),
        "",
        "| Family | Kind | Regions (instances) | aotdist | Whole-model torch.compile "
        + ("| compile_repeated_blocks " if peers else "")
        + "| Loss diff | Grad diff: aotdist (whole-model) | Buffer diff | Stochastic depth on "
        "| Notes |",
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if peers else ""),
    ]
    for r in results:
        regions = ", ".join(f"{n} ({s['instances']})" for n, s in r.regions.items()) or "-"
        diff = "-" if r.loss_diff is None else f"{r.loss_diff:.0e}"
        buffers = "-" if r.max_buffer_diff is None else f"{r.max_buffer_diff:.0e}"
        grad = "-" if r.max_grad_diff is None else f"{r.max_grad_diff:.0e}"
        if r.whole_model_grad_diff is not None:
            grad += f" ({r.whole_model_grad_diff:.0e})"
        mode = " graph mode" if r.fsdp_mode == "graph" else ""
        name = f"{r.name} (FSDP2{mode}, {r.fsdp} ranks)" if r.fsdp else r.name
        whole = r.whole_model or ("-" if r.fsdp else "")
        notes = "; ".join(f"{n}: {_short(why)}" for n, why in r.notes.items())
        if r.status in FAILING and r.error:
            notes = (notes + "; " if notes else "") + r.error.strip().splitlines()[-1][:200]
        declared = "none declared" if r.source == "diffusers" else "-"
        peer = f"| {_cell(r.repeated_blocks[:120] or declared)} " if peers else ""
        lines.append(
            f"| {_cell(name)} | {_cell(r.kind)} | {_cell(regions)} | {r.status} "
            f"| {_cell(whole[:120])} {peer}| {diff} | {grad} | {buffers} "
            f"| {r.stochastic_depth or '-'} | {_cell(notes)} |"
        )
    lines += ["", "Statuses:", ""]
    lines += [f"- **{k}**: {v}" for k, v in STATUS_MEANING.items()]
    return "\n".join(lines) + "\n"
