"""``fsdp2-profile``: under subclass_ca FSDP2's reduce-scatters are issued where eager FSDP2 issues them.

The 2-process test profiles one steady backward of the FSDP2 MLP (gloo) in both modes and
checks the schedule: one reduce-scatter per ``fully_shard`` group, in the same order and at
the same points between the hooks and the compute as eager FSDP2, each but the root's
followed by compiled pieces of later layers (so on a GPU those pieces can overlap it).  The
other tests feed hand-made trace events (the CUDA kernel overlap included, which needs no GPU).
"""

from __future__ import annotations

import pytest

from tools.__main__ import usage as _usage
from tools.fsdp2 import profiling as fp
from tools.fsdp2.parity import FSDP2Run

RUN = FSDP2Run(steps=3)
GROUPS = ["4", "2", "0"]
"""The MLP's ``fully_shard`` groups (Sequential indices of its Linear layers), in backward order."""


@pytest.fixture(scope="module")
def summary() -> dict:
    return fp.profile(RUN, world_size=2, timeout_s=110)


def _index(schedule: fp.Schedule, kind: str, label: str) -> int:
    return next(i for i, s in enumerate(schedule.spans) if s.kind == kind and s.label == label)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_reduce_scatters_are_issued_where_eager_fsdp2_issues_them(summary):
    eager, ours = summary["modes"]["eager"], summary["modes"]["subclass_ca"]
    assert summary["same_schedule"] and eager.outline() == ours.outline(), (eager.outline(), ours.outline())
    for schedule in (eager, ours):
        assert [rs.group for rs in schedule.reduce_scatters] == GROUPS, schedule.mode
        spans = schedule.spans
        for index, group in enumerate(GROUPS):
            issued = _index(schedule, "reduce_scatter", group)
            # after its own layer's all-gather and gradient compute ...
            own = _index(schedule, "pre_backward", group)
            assert any(s.kind == "compute" for s in spans[own:issued]), (schedule.mode, group)
            # ... and before the next layer's hooks and compute: not bunched at the end of the backward
            if index + 1 < len(GROUPS):
                following = _index(schedule, "pre_backward", GROUPS[index + 1])
                assert issued < following, (schedule.mode, group)
                assert any(s.kind == "compute" for s in spans[issued:following]), (schedule.mode, group)
        first, *_, last = schedule.reduce_scatters
        assert first.later_compute_spans > 0 and first.later_compute_us > 0, schedule.mode
        assert last.later_compute_spans == 0, schedule.mode  # the root's: from the final callback, after all compute
        # gloo's reduce-scatter blocks the calling thread: nothing computes while it runs (eager FSDP2 neither)
        assert all(rs.cpu_overlap_us == 0 for rs in schedule.reduce_scatters), schedule.mode
        assert schedule.gpu is None  # CPU activity only
    # the compute between the reduce-scatters is the split CA graph's compiled pieces
    assert ours.split_pieces == ours.compiled_regions == ours.compute_spans >= len(GROUPS)
    assert ours.split_hooks >= 2 * len(GROUPS)
    between = [s for s in ours.spans if ours.reduce_scatters[0].issue_us < s.start_us < ours.reduce_scatters[1].issue_us]
    assert any(s.kind == "compute" and s.label.startswith("Torch-Compiled Region") for s in between)
    assert eager.compiled_regions == 0 and eager.split_pieces is None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_reports_render_every_reduce_scatter(summary):
    text = fp.format_summary(summary)
    assert "same hook/compute order in every mode: yes" in text
    assert "split CA graph:" in text
    section = fp.markdown_section(summary)
    assert section.count("| eager |") == section.count("| subclass_ca |") == len(GROUPS)
    assert fp.summary_json(summary)["modes"]["subclass_ca"]["outline"] == list(summary["modes"]["subclass_ca"].outline())


# --- hand-made traces ----------------------------------------------------------------


def _x(name: str, ts: float, dur: float, *, tid: int = 1, cat: str = "cpu_op", **args) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat, "args": args}


def _eager_events(*, bunched: bool = False) -> list[dict]:
    """Two layers; ``bunched``: both reduce-scatters at the end (what the checks must reject)."""
    node = fp._NODE_PREFIX
    rs4 = (_x("FSDP::post_backward_reduce (1)", 40 if not bunched else 90, 5, cat="user_annotation"))
    return [
        _x(fp.BACKWARD_LABEL, 0, 100, cat="user_annotation"),
        _x(node + "AddmmBackward0", 10, 30),
        _x("FSDP::pre_backward (1)", 12, 20, cat="user_annotation"),  # inside the node: cut out of its compute
        _x("FSDP::all_gather (1)", 13, 10, cat="user_annotation"),
        _x(node + "RegisterPostBackwardFunctionBackward", 39, 8),  # FSDP2's hook node, not compute
        rs4,
        _x(node + "AddmmBackward0", 50, 30),
        _x("gloo:all_reduce", 41, 4, tid=7, cat="user_annotation"),
        _x("FSDP::root_post_backward_callback", 85, 14, cat="user_annotation"),
        _x("FSDP::post_backward_reduce (0)", 86 if not bunched else 95, 4, cat="user_annotation"),
        _x(node + "AddmmBackward0", 200, 5),  # after the backward: ignored
    ]


def test_schedule_cuts_hooks_out_of_autograd_nodes():
    schedule = fp.schedule_from_trace(_eager_events(), mode="eager")
    compute = [(s.start_us, s.end_us) for s in schedule.spans if s.kind == "compute"]
    assert compute == [(10, 12), (32, 40), (50, 80)]
    assert schedule.compute_us == 40 and schedule.backward_us == 100
    assert schedule.outline() == ("compute", "pre_backward(1)", "compute", "reduce_scatter(1)", "compute",
                                  "root_callback", "reduce_scatter(0)")
    first, last = schedule.reduce_scatters
    assert (first.group, first.issue_us, first.compute_before_us, first.later_compute_us, first.later_compute_spans) == ("1", 40, 10, 30, 1)
    assert (last.group, last.later_compute_us, last.cpu_overlap_us) == ("0", 0, 0)
    assert first.gpu_kernel_us is None and schedule.gpu is None


def test_a_reduce_scatter_bunched_at_the_end_changes_the_schedule():
    right, bunched = (fp.schedule_from_trace(_eager_events(bunched=b), mode="x") for b in (False, True))
    assert right.outline() != bunched.outline()
    assert bunched.reduce_scatters[0].later_compute_us == 0


def test_schedule_needs_the_backward_mark():
    with pytest.raises(ValueError, match="expected one"):
        fp.schedule_from_trace([_x("FSDP::pre_backward (1)", 0, 1)], mode="eager")


def test_cuda_kernel_overlap_counts_compute_on_other_streams_only():
    events = [
        _x(fp.BACKWARD_LABEL, 0, 100, cat="user_annotation"),
        _x("Torch-Compiled Region: !0/1/0", 5, 10),
        _x("FSDP::post_backward_reduce (1)", 20, 2, cat="user_annotation"),
        _x("Torch-Compiled Region: !0/2/0", 23, 10),
        # the reduce-scatter kernel on FSDP2's stream 20, from 30 to 50
        _x("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 30, 20, cat="kernel", tid=20, stream=20),
        _x("void gemm_kernel", 25, 15, cat="kernel", tid=7, stream=7),  # 30..40 overlaps
        _x("void gemm_kernel", 45, 10, cat="kernel", tid=7, stream=7),  # 45..50 overlaps
        _x("void chunk_cat", 30, 20, cat="kernel", tid=20, stream=20),  # same stream: serialised, not overlap
        _x("ncclDevKernel_AllGather_RING_LL", 30, 20, cat="kernel", tid=21, stream=21),  # communication, not compute
    ]
    assert fp.kernel_overlaps(events) == [(20.0, 15.0)]
    schedule = fp.schedule_from_trace(events, mode="subclass_ca")
    assert schedule.gpu == {"rs_kernels": 1, "rs_kernel_us": 20.0, "rs_overlap_us": 15.0, "rs_overlap_fraction": 0.75}
    (rs,) = schedule.reduce_scatters
    assert (rs.gpu_kernel_us, rs.gpu_overlap_us, rs.later_compute_spans, rs.later_compute_us) == (20.0, 15.0, 1, 10)
    assert schedule.compiled_regions == 2 and "ms" in fp.format_summary(
        {"run": {"dims": (1, 2), "steps": 2, "backend": "x"}, "world_size": 2, "device": "cuda", "torch": "t",
         "modes": {"subclass_ca": schedule}, "same_schedule": True})


def test_the_subcommand_is_listed():
    assert "fsdp2-profile" in _usage()
    with pytest.raises(SystemExit):
        fp.main(["--steps", "1", "--nproc", "2"])  # at least one warm-up step: a usage error, nothing launched
