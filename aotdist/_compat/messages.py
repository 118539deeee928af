"""What torch's error messages say: the words a failed region compile is read by.

Dynamo, AOTAutograd and the backends report a region that cannot be a reused subgraph
in text only (no error type or field says which cause), so knowing that text is knowing
torch's internals: each reader here names the wording it matches and where torch says it.
"""

from __future__ import annotations

from aotdist._compat._base import checked_on


@checked_on("2.11", "2.14")
def names_invoke_subgraph(text: str) -> bool:
    """Whether an error's text names ``invoke_subgraph`` (Dynamo's refusal to capture a
    region's body as the higher-order op's subgraph)."""
    return "invoke_subgraph" in text


@checked_on("2.11", "2.14")
def is_aliasing_error(text: str) -> bool:
    """Whether an error's text is about aliasing (an output that aliases an input, or
    inputs that share storage: ``invoke_subgraph`` forbids both)."""
    return "aliasing" in text.lower()


@checked_on("2.11", "2.14", note="2.14 says a side effect; 2.11 a node of another Graph")
def stores_into_an_argument(reason: str) -> bool:
    """Whether a region's failure is torch's words for a tensor made in the region and
    kept by an object passed to it (torch 2.14: a side effect; 2.11: a node used outside
    the graph it was made in)."""
    return "side effect" in reason or "does not belong to this Graph" in reason


@checked_on("2.11", "2.14")
def error_cause(text: str) -> str:
    """The cause in an error's text, one line of at most 500 characters: the graph break
    after Dynamo's "Got graph break/error:" with its "Explanation:", the error on the line
    after a ``BackendCompilerFailed``'s "raised:", else the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for i, ln in enumerate(lines):
        if ln.endswith("Got graph break/error:") and i + 1 < len(lines):
            expl = next((x for x in lines[i + 1 :] if x.startswith("Explanation:")), "")
            return (lines[i + 1] + (f" - {expl[len('Explanation: ') :]}" if expl else ""))[:500]
    if len(lines) > 1 and lines[0].endswith("raised:"):  # BackendCompilerFailed: the cause
        return f"the compiler backend raised {lines[1]}"[:500]
    return lines[0][:500] if lines else "unknown reason"
