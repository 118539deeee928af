"""Peak memory of one measurement: CUDA max allocated, or the RSS high-water mark on CPU.

On CPU a fresh process's high-water mark includes the imports (torch alone is hundreds
of MiB) and the model build. :class:`MemoryProbe` therefore takes a baseline after the
model is built, the strategy applied and the compiler stack imported (in every strategy,
eager too), and, on Linux, resets the kernel's high-water mark there
(``/proc/self/clear_refs``), so ``peak_mem_mib`` is the growth over that baseline:
compiler state, compiled code, activations, gradients and optimizer state. Pages of
mapped files (torch's own libraries, first touched by the compile) are left out of the
growth (``RssFile`` at the end less at the baseline): they are shared page cache, and a
process forked after the imports (the bench's fork server) faults in again what a
spawned one touched while importing, 30 MiB more growth at GPT depth 8 otherwise. The raw
high-water mark is reported too, as ``peak_rss_mib``, and the file pages as
``file_rss_growth_mib``.
"""

from __future__ import annotations

import resource
import sys


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_hwm() -> bool:
    """Resets VmHWM to the current RSS (Linux >= 4.0); ``False`` where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Takes the baseline when created; :meth:`report` gives the peak since then."""

    def __init__(self, device: str):
        self.device = device
        if device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline_kib = torch.cuda.memory_allocated(device) / 1024
            self.hwm_reset = True
            return
        self.hwm_reset = _reset_hwm()
        self.baseline_kib = _status_kib("VmRSS") or 0
        self.file_kib = _status_kib("RssFile")

    def report(self) -> dict:
        """``peak_mem_mib`` (the figure ratios use), its ``memory_metric`` label, and more."""
        if self.device.startswith("cuda"):
            import torch

            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
            return {
                "peak_mem_mib": peak,
                "peak_rss_mib": None,
                "memory_baseline_mib": self.baseline_kib / 1024,
                "memory_metric": "CUDA max allocated (model parameters included)",
            }
        hwm = _status_kib("VmHWM")
        if hwm is None:  # not Linux: ru_maxrss (KiB on Linux, bytes on macOS)
            scale = 1 if sys.platform.startswith("linux") else 1 / 1024
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
        label = (
            "RSS high-water mark growth over the baseline after model build and strategy"
            if self.hwm_reset
            else "RSS high-water mark (includes imports: the reset was not possible) "
            "minus the RSS after model build"
        )
        file_now = _status_kib("RssFile")
        file_growth = (
            max(file_now - self.file_kib, 0) if None not in (file_now, self.file_kib) else 0
        )
        if file_now is not None:
            label += ", mapped-file pages apart"
        return {
            "peak_mem_mib": max(hwm - self.baseline_kib - file_growth, 0) / 1024,
            "peak_rss_mib": hwm / 1024,
            "file_rss_growth_mib": file_growth / 1024,
            "memory_baseline_mib": self.baseline_kib / 1024,
            "memory_metric": label,
        }
