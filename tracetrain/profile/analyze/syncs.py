"""The sync rule's two judgements (advice.sync_stalls): which remedies apply to the syncs a trace shows,
and whether the syncs come before the host's pace.

A sync drains the GPU's queue and the host refills it (utilisation.refill_windows); the idle of that
refill is charged first to the sync (up to its own time and the next launch's latency) and the rest to
the host's pace (host_bound/launch_bound). Where the syncs' part, each corrected for the profiler as its
cause is, is the larger, removing them comes first and the host's pace is read again after: the sync
advice is listed before host_bound/launch_bound whatever their gains (advice.rank_advice). On the
advice-truth corpus (`item_per_param`, 76 `.item()` a step) the syncs hold 76% of the corrected refill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from tracetrain.profile.analyze.host_gaps import activity

if TYPE_CHECKING:
    from tracetrain.profile.analyze.report import RankReport

_READ_BACK: Final = (
    "Read values back less often: accumulate metrics on the GPU and read them every N steps "
    "(`.item()`, `.cpu()`, `.tolist()` and `print(tensor)` each wait for the GPU)."
)
_DATA_DEPENDENT: Final = (
    "Avoid data-dependent shapes in the step (`nonzero`, boolean-mask indexing): give them a fixed "
    "size (`torch.where`, masks multiplied in) so the host need not wait for the count."
)
_EXPLICIT: Final = (
    "Remove `torch.cuda.synchronize()` and `event.synchronize()` from the step (they are needed only "
    "around timing), and blocking `cudaMemcpy` copies: copy with `non_blocking=True` from pinned memory."
)


def sync_remedy(report: RankReport) -> str:
    """The remedies for the syncs the trace shows (the top host events of the sync idle): reading
    values back, data-dependent shapes, explicit synchronisation; all three when none is named."""
    names = {name for name, _ in activity(report.host_gaps, "sync").top}
    found = [
        text
        for text, marks in (
            (_READ_BACK, {"aten::item", "aten::_local_scalar_dense"}),
            (_DATA_DEPENDENT, {"aten::nonzero"}),
        )
        if names & marks
    ]
    if not found and names:  # only runtime calls: synchronisation written out, or a blocking copy
        found = [_EXPLICIT]
    return " ".join(found or [_READ_BACK, _DATA_DEPENDENT, _EXPLICIT])


def refill_share(report: RankReport) -> float:
    """Of the idle in sync refills (from a sync's start until the GPU runs from its queue again), each
    part corrected for the profiler as its cause is, the share charged to the syncs; the rest is the
    host's pace after them, which host_bound/launch_bound charge."""
    util = report.utilisation
    host_literal = util.idle_us["host"]
    host_rate = report.real_idle_us("host") / host_literal if host_literal > 0 else 0.0
    host_part = max(util.sync_refill_us - util.idle_us["sync"], 0.0) * host_rate
    sync_part = report.real_idle_us("sync")
    return sync_part / (sync_part + host_part) if sync_part + host_part > 0 else 0.0
