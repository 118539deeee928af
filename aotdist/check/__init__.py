"""Does aotdist train this model? ``aotdist check`` and ``aotdist zoo``.

:func:`check_family` trains three SGD steps eager, with whole-model ``torch.compile`` and
with aotdist from the same weights, batches and seeds, compares losses, gradients and
buffers after each, and classifies what aotdist did with each
region (:class:`CheckResult`); :func:`check_fsdp` does the same under FSDP2 on several
gloo ranks. :func:`run_zoo` checks every family in :data:`FAMILIES` (tiny random-weight
``transformers`` and ``torchvision`` builds), each in a fresh process, and writes the
table of ``docs/models.md``.
"""

from aotdist.check.families import FAMILIES, Family, family
from aotdist.check.fsdp import check_fsdp
from aotdist.check.runner import FAILING, CheckResult, check_family
from aotdist.check.specs import resolve
from aotdist.check.zoo import render, run_zoo

__all__ = [
    "FAILING",
    "FAMILIES",
    "CheckResult",
    "Family",
    "check_family",
    "check_fsdp",
    "family",
    "render",
    "resolve",
    "run_zoo",
]
