"""AOTAutograd's partitioners, and how a backend or Inductor takes another one.

- :func:`aot_eager_with_partitioner`: torch's ``aot_eager`` with a partition function of
  aotdist's (:mod:`aotdist.backends.partition`);
- :func:`partitioners`: torch's ``default_partition`` and min-cut partitioner;
- :func:`custom_partitioner_base`: what Inductor's ``custom_partitioner_fn`` takes.
"""

from __future__ import annotations

from collections.abc import Callable

from aotdist._compat._base import attr, checked_on, unavailable


@checked_on("2.11", "2.14")
def aot_eager_with_partitioner(
    partition_fn: Callable, fw_compiler: Callable, bw_compiler: Callable
) -> Callable:
    """``aot_eager`` as torch builds it (``torch._dynamo.backends.debugging``: AOTAutograd
    with ``keep_inference_input_mutations``), with ``partition_fn`` in place of its
    min-cut partitioner (``torch._dynamo.backends.common.aot_autograd``).

    Raises:
        TorchFeatureUnavailable: ``aot_autograd`` is missing.
    """
    build = attr("torch._dynamo.backends.common", "aot_autograd")
    if build is None:
        raise unavailable("torch._dynamo.backends.common.aot_autograd")
    return build(
        fw_compiler=fw_compiler,
        bw_compiler=bw_compiler,
        partition_fn=partition_fn,
        keep_inference_input_mutations=True,
    )


@checked_on("2.11", "2.14")
def partitioners() -> tuple[Callable, Callable]:
    """``(default_partition, min_cut_rematerialization_partition)`` from
    ``torch._functorch.partitioners``: the one that saves what the backward needs, and the
    one that may recompute instead (both take ``num_fwd_outputs`` and
    ``static_lifetime_input_indices``; only min-cut takes ``compiler``).

    Raises:
        TorchFeatureUnavailable: Either is missing.
    """
    default = attr("torch._functorch.partitioners", "default_partition")
    min_cut = attr("torch._functorch.partitioners", "min_cut_rematerialization_partition")
    if default is None or min_cut is None:
        raise unavailable("torch._functorch.partitioners.default_partition / min_cut")
    return default, min_cut


@checked_on("2.11", "2.14")
def custom_partitioner_base() -> type:
    """``torch._inductor.custom_graph_pass.CustomPartitionerFn``: what
    ``torch._inductor.config.custom_partitioner_fn`` takes (a ``__call__`` with the
    min-cut partitioner's arguments and a ``uuid`` for the caches).

    Raises:
        TorchFeatureUnavailable: It is missing.
    """
    cls = attr("torch._inductor.custom_graph_pass", "CustomPartitionerFn")
    if cls is None:
        raise unavailable("torch._inductor.custom_graph_pass.CustomPartitionerFn")
    return cls
