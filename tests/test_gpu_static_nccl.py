"""Every communicating method and entry point on a fake NCCL group of 4 ranks, without a GPU.

Each rank is simulated in turn (tests/gpu_static/fake_nccl.py): torch's fake process group as the
CUDA-only backend, fake CUDA tensors, torch.cuda answering like a GPU machine. A row passes when no
collective or point-to-point op got a CPU tensor (or a tensor off the rank's device), no CUDA stream,
event or synchronisation was used on a CPU path, the ranks issued matching collectives and
send/receive pairs (what NCCL needs not to hang), every backward returned gradients shaped like its
inputs, the phases that must communicate did, and no clock read of seqpar's timing code closed an
interval with GPU work still in flight (a step or phase timed without a device synchronize). The matrix is tests/gpu_static/nccl_cases.py; the
rows not marked for CI run with SEQPAR_GPU_STATIC_FULL=1 (benchmarks/gpu_static_nccl.py writes them all).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.testing._internal.distributed.fake_pg")

from gpu_static import fake_nccl, nccl_cases  # noqa: E402
from gpu_static.fake_nccl import nccl_rank, run_ranks  # noqa: E402

import seqpar  # noqa: E402

try:  # imported before torch.cuda is patched (transformers annotates with torch.cuda.Stream at import)
    import transformers.models.llama.modeling_llama  # noqa: F401
    HAS_TRANSFORMERS = True
except ImportError:
    HAS_TRANSFORMERS = False

CASES = nccl_cases.all_cases()


def _params(ci: bool):
    out = []
    for c in (c for c in CASES if c.ci == ci):
        marks = [] if ci else [pytest.mark.gpu_static_full]
        if c.entry.startswith(("hf:", "seqpar train")) and not HAS_TRANSFORMERS:
            marks.append(pytest.mark.skip(reason="needs transformers"))
        out.append(pytest.param(c, id=c.id, marks=marks))
    return out


@pytest.mark.parametrize("case", _params(True) + _params(False))
def test_fake_nccl_row(case):
    nccl_cases.check(case)


# ------------------------------------------------------------------- the checks themselves can fail
def test_cpu_tensor_in_a_collective_is_reported_with_its_call_site():
    def drive(run):
        torch.distributed.all_reduce(torch.zeros(3))

    with pytest.raises(AssertionError, match=r"CPU tensor in an NCCL op: allreduce_ at tests/test_gpu_static_nccl"
                                             r"\.py:\d+ in drive: cpu tensor \(3,\)"):
        run_ranks(drive)


def test_tensor_off_the_current_device_is_reported():
    def drive(run):
        torch.cuda.set_device(run.rank)
        torch.distributed.all_reduce(torch.zeros(3, device="cuda:0"))

    with pytest.raises(AssertionError, match="tensor not on the rank's current CUDA device"):
        run_ranks(drive)


def test_unmatched_point_to_point_and_collectives_are_reported():
    def drive(run):
        x = torch.zeros(4 if run.rank else 2, device="cuda")
        if run.rank == 0:
            torch.distributed.send(x, 1)
        elif run.rank == 1:
            torch.distributed.recv(x, 0)
        torch.distributed.all_reduce(x)

    with pytest.raises(AssertionError) as err:
        run_ranks(drive)
    problems = str(err.value)
    assert "0 -> 1: send send on [0, 1, 2, 3] peer 1 tag 0 [(2,)]" in problems and "pairs with receive" in problems
    assert "rank 0 allreduce_ on [0, 1, 2, 3] [(2,)]" in problems and "but rank 1 allreduce_" in problems


def test_tags_matter_because_nccl_ignores_them():
    """Two payloads of one shape between the same ranks in opposite orders pair up wrongly on NCCL."""
    def drive(run):
        a, b = torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda")
        if run.rank == 0:
            torch.distributed.send(a, 1, tag=1)
            torch.distributed.send(b, 1, tag=2)
        elif run.rank == 1:
            torch.distributed.recv(b, 0, tag=2)
            torch.distributed.recv(a, 0, tag=1)

    with pytest.raises(AssertionError, match="pairs with receive"):
        run_ranks(drive)


def test_a_first_batch_that_some_members_skip_is_reported():
    def drive(run):
        x = torch.zeros(2, device="cuda")
        if run.rank < 2:  # ranks 2, 3 start with a collective instead
            peer = 1 - run.rank
            for w in torch.distributed.batch_isend_irecv([torch.distributed.P2POp(torch.distributed.isend, x, peer),
                                                          torch.distributed.P2POp(torch.distributed.irecv, x, peer)]):
                w.wait()
        torch.distributed.barrier()

    with pytest.raises(AssertionError, match=r"first used by a batch_isend_irecv of ranks \[0, 1\]"):
        run_ranks(drive)


def test_streams_and_synchronisation_on_a_cpu_path_are_reported():
    with nccl_rank(0) as run:
        torch.cuda.synchronize(torch.device("cpu"))
        torch.cuda.Stream(device="cpu")
    with nccl_rank(0, backend="gloo") as cpu_job:  # a stream chosen by is_available(), not by the tensors
        if torch.cuda.is_available():
            torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    assert [v.op for v in run.violations] == ["torch.cuda.synchronize", "torch.cuda.Stream"]
    assert {v.op for v in cpu_job.violations} == {"torch.cuda.current_stream", "torch.cuda.Stream"}
    assert {v.kind for v in run.violations + cpu_job.violations} == {"CUDA stream/event/sync outside a CUDA path"}


def test_cuda_streams_are_exercised_behind_their_checks():
    """ZeCO's All-Scan side stream runs on the fake GPU (and is checked there), not on the CPU job."""
    gpu = run_ranks(nccl_cases.linear_drive("zeco", False, "world"))
    cpu = run_ranks(nccl_cases.linear_drive("zeco", False, "world"), backend="gloo")
    assert {"torch.cuda.Stream", "Tensor.record_stream"} <= {name for name, _ in gpu[1].cuda.calls}
    assert not {name for run in cpu for name, _ in run.cuda.calls} & {"torch.cuda.Stream", "Tensor.record_stream"}


def test_a_silent_phase_and_a_wrong_gradient_fail():
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g[:1]

    def drive(run):
        run.phase = "fwd"
        Wrong.apply(torch.ones(2, device="cuda")).backward()

    with pytest.raises(AssertionError, match="gradient unlike its input"):
        run_ranks(drive)
    with pytest.raises(AssertionError, match="did not communicate in phase 'fwd'"):
        nccl_cases.check(nccl_cases.Case("silent", "dense", "world", lambda run: None))


def test_fake_cuda_tensors_read_back_real_values():
    """Host reads see the values (shadows), through the ops the CPU build cannot run on fake CUDA
    tensors; a collective's output holds what every rank sent if all sent this rank's."""
    with nccl_rank(1):
        x = torch.arange(6, device="cuda").reshape(2, 3)
        assert x[1, 1:].tolist() == [4, 5] and int(x[:, 2].sum()) == 7 and (~(x > 2)).sum().item() == 3
        x[0] = 9
        assert x.contiguous().t()[2].tolist() == [9, 5] and x.nonzero().shape == (6, 2)
        gathered = seqpar.comm.all_gather_stack(seqpar.comm.group_info(None), x)
        assert gathered.cpu().tolist() == [x.tolist()] * 4


def test_all_reduce_combines_the_ranks_simulated_so_far():
    def drive(run):
        x = torch.tensor([float(run.rank)], device="cuda")
        y = x.clone()
        torch.distributed.all_reduce(x, op=torch.distributed.ReduceOp.MAX)
        torch.distributed.all_reduce(y)
        return x.item(), y.item()

    assert [r.result for r in run_ranks(drive)] == [(0.0, 0.0), (1.0, 3.0), (2.0, 5.0), (3.0, 6.0)]


def test_helper_threads_run_under_the_rank():
    """seqpar's All-Scan helper thread: its transfers are recorded like the caller's."""
    runs = run_ranks(nccl_cases.linear_drive("zeco", False, "world"))
    sites = {op.site.split(":")[0] + " " + op.site.split(" in ")[-1] for run in runs for op in run.comm
             if op.name == "send"}
    assert sites == {"seqpar/comm/allscan.py _run"}


def test_object_collectives_replay_rank_0():
    def drive(run):
        box = [f"plan of rank {run.rank}"]
        torch.cuda.set_device(run.rank)
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    assert [r.result for r in run_ranks(drive)] == ["plan of rank 0"] * 4
    assert fake_nccl.WORLD == 4


def test_a_clock_read_with_gpu_work_in_flight_is_reported(monkeypatch):
    """On a GPU, NCCL ops and kernels return to the host at once: a step timed without a device
    synchronize times the launches. calibrate's overlap phase synchronises before each clock read
    (clean); with that removed, its comm-alone timing closes with a send in flight (reported)."""
    from gpu_static import nccl_entries

    from seqpar.bench import measure

    run_ranks(nccl_entries.phase_overlap_drive)
    monkeypatch.setattr(measure, "_sync", lambda dev: None)
    with pytest.raises(AssertionError, match=r"host clock read with GPU work in flight: time\.perf_counter at "
                                             r"seqpar/bench/measure\.py:\d+ in comm_alone: c10d\.send"):
        run_ranks(nccl_entries.phase_overlap_drive)


def test_what_settles_the_device_for_the_clock_check():
    """What the clock check counts as GPU work and as its end: a kernel until a host read of a CUDA
    value (or a blocking copy to the host) or a synchronize; an NCCL op until a device synchronize or
    a barrier, or until Work.wait() has put it on the current stream and a host read waited for that.
    A clock read (here called directly) with any of it open is reported."""
    from gpu_static.fake_clock import clock_read

    def reported(run, work, settle) -> bool:
        work()
        settle()
        clock_read(run, "time.perf_counter", "here")
        found = [v for v in run.violations if v.kind == "host clock read with GPU work in flight"]
        run.violations.clear()
        return bool(found)

    def drive(run):
        x = torch.ones(4, device="cuda")
        kernel = lambda: x.mul_(2)  # noqa: E731
        nccl = lambda: torch.distributed.all_reduce(x)  # noqa: E731  (blocking: waits on the stream)
        unwaited = lambda: torch.distributed.all_reduce(x, async_op=True)  # noqa: E731
        read = lambda: float(x.sum())  # noqa: E731
        sync = lambda: torch.cuda.synchronize()  # noqa: E731
        nothing = lambda: None  # noqa: E731
        for work, settle in ((kernel, read), (kernel, lambda: x.cpu()), (kernel, sync), (nccl, read),
                             (nccl, sync), (unwaited, sync), (unwaited, torch.distributed.barrier),
                             (lambda: torch.empty(4, device="cuda").view(2, 2), nothing)):
            assert not reported(run, work, settle)
        for work, settle in ((kernel, nothing), (nccl, nothing), (unwaited, read), (read, kernel)):
            assert reported(run, work, settle)

    run_ranks(drive)
