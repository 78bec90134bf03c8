"""GPU-path decisions checked on CPU (issue 27): backend and device from ``parallel.backend``,
ranks per GPU refused before launch, peak FLOPs by exact device name, ``train.tf32`` and
``train.deterministic``. CUDA is faked in-process by monkeypatching ``torch.cuda``; nothing
here needs a GPU (docs/gpu.md says what only a GPU can show)."""
import pytest
import torch
from click.testing import CliRunner

import gridshard.device as device_mod
from gridshard.cli import EXIT_CONFIG, main
from gridshard.config import resolve_config
from gridshard.errors import ConfigError


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n)``: torch.cuda reports n visible GPUs (0: no CUDA)."""
    def fake(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return fake


@pytest.fixture
def no_group(monkeypatch):
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: False)


# ---- backend and device: one derivation (gridshard/device.py) ------------------------------
@pytest.mark.parametrize("gpus,requested,backend,local_rank,device", [
    (2, "auto", "nccl", 1, "cuda:1"),
    (0, "auto", "gloo", 1, "cpu"),
    (2, "gloo", "gloo", 1, "cpu"),          # gloo on a CUDA host computes on the CPU (was cuda:LOCAL_RANK%n)
    (8, "nccl", "nccl", 7, "cuda:7"),
])
def test_backend_and_device_follow_the_config_and_the_machine(gpus, requested, backend, local_rank, device,
                                                              fake_gpus, no_group, monkeypatch):
    fake_gpus(gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert device_mod.resolve_backend(requested) == backend
    assert device_mod.rank_device(requested) == torch.device(device)


def test_nccl_rank_without_a_gpu_of_its_own_is_refused_not_wrapped(fake_gpus, no_group, monkeypatch):
    fake_gpus(2)
    monkeypatch.setenv("LOCAL_RANK", "2")     # the old LOCAL_RANK % device_count gave cuda:0, shared with rank 0
    with pytest.raises(ConfigError, match="local rank 2 has no GPU.*parallel.backend: gloo"):
        device_mod.rank_device("nccl")


def test_nccl_without_cuda_is_a_config_error(fake_gpus):
    fake_gpus(0)
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs CUDA.*Fix: parallel.backend: gloo"):
        device_mod.resolve_backend("nccl")


def test_an_existing_process_group_decides_the_device(fake_gpus, monkeypatch):
    """The test harness's gloo group on a GPU host: every rank on the CPU (was cuda:0 for all)."""
    fake_gpus(4)
    monkeypatch.setattr(device_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(device_mod.dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert device_mod.rank_device("auto") == torch.device("cpu")
    from gridshard.device import rank_device

    assert rank_device() == torch.device("cpu")


def test_backend_key_is_validated():
    assert resolve_config(None, ["parallel.backend=gloo"]).parallel.backend == "gloo"
    with pytest.raises(ConfigError, match="parallel.backend"):
        resolve_config(None, ["parallel.backend=cuda"])


def test_a_config_backend_other_than_the_groups_is_refused():
    """Inside the harness's gloo group a config asking for nccl is refused, naming both."""
    from gridshard.testing import run_on_ranks

    assert "parallel.backend=nccl but this process group runs gloo" in run_on_ranks(1, _build_with_nccl)[0]


def _build_with_nccl():
    import gridshard

    try:
        gridshard.build_job({"parallel": {"data": 1, "tensor": 1, "backend": "nccl"}})
    except ConfigError as e:
        return str(e)
    return "built"


# ---- refused before launch: more nccl ranks than GPUs ----------------------------------------


def test_more_nccl_ranks_than_gpus_is_refused_before_launch(fake_gpus, no_launch):
    fake_gpus(2)
    result = CliRunner().invoke(main, ["train", "--check", "--nproc", "4"])
    assert result.exit_code == EXIT_CONFIG, (result.output, result.exception)
    line = result.output.strip()
    assert line.count("\n") == 0 and "config error:" in line, line
    for words in ("--nproc 4", "2 visible GPU(s)", "parallel.backend: gloo", "--nproc 2 or fewer"):
        assert words in line, (words, line)


def test_nccl_without_gpus_is_refused_before_launch(fake_gpus, no_launch):
    fake_gpus(0)
    result = CliRunner().invoke(main, ["train", "--check", "parallel.backend=nccl"])
    assert result.exit_code == EXIT_CONFIG and "parallel.backend=nccl needs CUDA" in result.output, result.output


def test_gloo_on_a_gpu_host_may_share_cores(fake_gpus, no_launch, monkeypatch):
    """With parallel.backend=gloo the same request passes the check: CPU workers, no GPU mapping."""
    fake_gpus(2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    result = CliRunner().invoke(main, ["train", "--check", "--nproc", "4",
                                       "parallel.backend=gloo"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert "gloo: fine for checks and tests" in result.output


def test_torchrun_ranks_per_node_checked_at_init(fake_gpus, monkeypatch):
    """Under torchrun: LOCAL_WORLD_SIZE nccl ranks on a node with fewer GPUs fail before joining."""
    fake_gpus(1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    from gridshard.mesh import init_distributed

    with pytest.raises(ConfigError, match="--nproc-per-node 2 .* 1 visible GPU"):
        init_distributed("nccl")


# ---- peak FLOPs: one table, exact names (gridshard/peak_flops.py) ---------------------------
@pytest.mark.parametrize("name,precision,peak", [
    ("NVIDIA H100 PCIe", "bf16", 756.5e12),           # substring matching gave the SXM 989
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),
    ("NVIDIA H100 NVL", "bf16", 835.5e12),
    ("NVIDIA L40", "bf16", 181.05e12),                 # substring matching gave L4's 121
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA A100-SXM4-80GB", "fp32", 19.5e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("  nvidia  h100 pcie ", "fp32", 51e12),           # normalised: spaces and case only
    ("NVIDIA H100", "bf16", None),                     # not a device name: unknown, no guess
    ("NVIDIA H100 PCIe-X", "bf16", None),
    ("Tesla V100-SXM2-32GB", "tf32", 15.7e12),         # no TF32 there: its fp32 rate
    ("Tesla V100-SXM2-32GB", "bf16", None),
])
def test_peak_flops_by_exact_device_name(name, precision, peak):
    from gridshard.peak_flops import peak_flops_of

    assert peak_flops_of(name, precision) == peak


def test_metrics_use_the_table_the_override_and_tf32(monkeypatch):
    from gridshard.engine.metrics import device_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40")
    gpu = torch.device("cuda", 0)
    assert device_peak_flops(gpu, "bf16") == 181.05e12
    assert device_peak_flops(gpu, "fp32", tf32=False) == 90.5e12
    assert device_peak_flops(gpu, "fp32", tf32=True) == 90.5e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    assert device_peak_flops(gpu, "fp32", tf32=True) == 156e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA RTX 9999")
    assert device_peak_flops(gpu, "bf16") is None                  # unknown: MFU not reported
    assert device_peak_flops(gpu, "bf16", override=2e14) == 2e14   # train.peak_flops
    assert device_peak_flops(torch.device("cpu"), "fp32") is None
    assert device_peak_flops(torch.device("cpu"), "fp32", override=5e10) == 5e10


def test_planner_profiles_read_the_same_table():
    from gridshard.peak_flops import device_peaks
    from gridshard.planner.hardware import load_hardware

    for profile, name in (("h100", "NVIDIA H100 80GB HBM3"), ("h200", "NVIDIA H200"), ("a100", "NVIDIA A100-SXM4-80GB")):
        assert load_hardware(profile).peak_flops == device_peaks(name)
    with pytest.raises(ConfigError, match="peak_flops_of"):
        load_hardware({**_raw("h100"), "peak_flops_of": "NVIDIA H100"})


def _raw(profile):
    import json
    import os

    from gridshard.planner.hardware import HARDWARE_DIR

    with open(os.path.join(HARDWARE_DIR, f"{profile}.json")) as f:
        return json.load(f)


def test_peak_flops_key_is_validated():
    assert resolve_config(None, ["train.peak_flops=1.5e14"]).train.peak_flops == 1.5e14
    with pytest.raises(ConfigError, match="train.peak_flops"):
        resolve_config(None, ["train.peak_flops=0"])


# ---- train.tf32 and train.deterministic, set once when the job is built --------------------
@pytest.fixture
def math_switches(monkeypatch):
    """Record the switches apply_math_modes sets, leaving the process's own untouched."""
    seen = {}
    monkeypatch.setattr(torch, "set_float32_matmul_precision", lambda v: seen.__setitem__("matmul", v))
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda v: seen.__setitem__("deterministic", v))
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    return seen


@pytest.mark.parametrize("device,precision,tf32,matmul,cudnn", [
    ("cuda", "fp32", True, "high", True),
    ("cuda", "fp32", False, "highest", False),
    ("cuda", "bf16", True, "highest", False),     # autocast runs the matmuls in bf16
    ("cpu", "fp32", True, None, None),            # nothing touched on CPU
])
def test_tf32_applies_to_fp32_cuda_runs_only(device, precision, tf32, matmul, cudnn, math_switches):
    from gridshard.engine.precision import apply_math_modes

    before = torch.backends.cudnn.allow_tf32
    modes = apply_math_modes(precision, tf32, False, torch.device(device))
    assert modes == {"tf32": matmul == "high", "deterministic": False}
    assert math_switches.get("matmul") == matmul and math_switches["deterministic"] is False
    assert torch.backends.cudnn.allow_tf32 == (before if cudnn is None else cudnn)


def test_deterministic_sets_the_switch_and_the_cublas_hint(math_switches):
    import os

    from gridshard.engine.precision import apply_math_modes

    apply_math_modes("bf16", True, True, torch.device("cpu"))
    assert math_switches["deterministic"] is True and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    apply_math_modes("bf16", True, True, torch.device("cuda", 0))
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_math_keys_validate_with_their_defaults():
    t = resolve_config(None, []).train
    assert (t.tf32, t.deterministic, t.peak_flops) == (True, False, None)
    with pytest.raises(ConfigError, match="train.tf32"):
        resolve_config(None, ["train.tf32=maybe"])
    with pytest.raises(ConfigError, match="train.deterministic"):
        resolve_config(None, ["train.deterministic=1"])


def test_build_job_applies_the_math_modes():
    """build_job (one CPU rank of the harness): train.deterministic in effect, TF32 not (CPU)."""
    from gridshard.testing import run_on_ranks

    out = run_on_ranks(1, _job_math_modes)
    assert out[0] == ({"tf32": False, "deterministic": True}, True, False)


def _job_math_modes():
    import gridshard

    job = gridshard.build_job({"parallel": {"data": 1, "tensor": 1},
                               "train": {"deterministic": True, "global_batch": 4, "micro_batch": 4}})
    on = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)          # the harness reuses this worker
    return job.math_modes, on, job.device.type == "cuda"


# ---- memory peaks per log interval, with reserved bytes --------------------------------------
def test_cuda_memory_peaks_are_per_interval_with_reserved(monkeypatch):
    """Each call reports the peaks since the previous one (the allocator's peak stats reset);
    reserved bytes come alongside. The allocator is faked: CPU only."""
    from gridshard.engine.metrics import interval_memory_peaks

    state = {"alloc": 5 << 30, "reserved": 6 << 30}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["alloc"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: state["reserved"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda *a: state.update(alloc=1 << 30, reserved=2 << 30))
    gpu = torch.device("cuda", 0)
    assert interval_memory_peaks(gpu) == (5 << 30, 6 << 30)
    assert interval_memory_peaks(gpu) == (1 << 30, 2 << 30)        # the first interval's peak is gone
    allocated, reserved = interval_memory_peaks(torch.device("cpu"))
    assert allocated > 0 and reserved is None


# ---- calibration: the same backend rule as a job ---------------------------------------------
class _Started(Exception):
    pass


@pytest.fixture
def spawned(monkeypatch):
    """Calibration's rank processes are not started: the backend they would get is recorded."""
    import torch.multiprocessing as mp

    seen = []

    def start(fn, args, nprocs, **kwargs):
        seen.append((nprocs, args[2]))                 # (nproc, port, backend, result path)
        raise _Started
    monkeypatch.setattr(mp, "start_processes", start)
    return seen


@pytest.mark.parametrize("gpus,requested,backend", [(2, "auto", "nccl"), (0, "auto", "gloo"), (1, "gloo", "gloo")])
def test_calibration_takes_the_backend_from_the_device_rule(gpus, requested, backend, fake_gpus, spawned, tmp_path):
    from gridshard.planner.calibrate import calibrate

    fake_gpus(gpus)
    with pytest.raises(_Started):
        calibrate(nproc=2, out=str(tmp_path / "p.json"), backend=requested)
    assert spawned == [(2, backend)]


def test_calibration_refuses_more_ranks_than_gpus_before_starting(fake_gpus, spawned, tmp_path):
    """It measured the CPU instead, quietly, when the host had fewer GPUs than ranks."""
    from gridshard.planner.calibrate import calibrate

    fake_gpus(1)
    with pytest.raises(ConfigError, match=r"--nproc 2 starts 2 nccl ranks.*1 visible GPU.*parallel.backend: gloo"):
        calibrate(nproc=2, out=str(tmp_path / "p.json"))
    assert spawned == []
    result = CliRunner().invoke(main, ["plan", "--calibrate", "--nproc", "2", "--out", str(tmp_path / "p.json")])
    assert result.exit_code == EXIT_CONFIG and "--nproc 2" in result.output and spawned == []
    result = CliRunner().invoke(main, ["plan", "--calibrate", "--nproc", "2", "--out", str(tmp_path / "p.json"),
                                       "parallel.backend=gloo"])
    assert isinstance(result.exception, _Started) and spawned == [(2, "gloo")]


# ---- all-reduces of temporaries run in place ---------------------------------------------------
# The copying all-reduces left: a forward's input or a backward's incoming gradient (held by the
# caller or by autograd, which may hand one gradient to several branches) and the early
# input-gradient collective (its source is compared afterwards).
COPY_KEPT = {"_ReduceFromGroup.forward", "_CopyToGroup.backward", "_SumAlong.forward", "_SumAlong.backward",
             "_SplitBatch.backward", "InputGradHandoff.launch", "_ColumnInput.backward"}


def _all_reduce_calls(runs: list) -> list:
    """Per (layout, copy) run: ([(caller, in place, result aliases input)], ledger entries, the
    global loss and gradient norm) of one training step, all_reduce in place where callers allow
    it (``copy``: forced to copy, the former form)."""
    import sys

    import gridshard
    from gridshard.comm import collectives as C
    from gridshard.engine.step import global_losses, train_step

    real, force_copy = C.all_reduce, []

    def spy(x, axis, *args, inplace=False, **kwargs):
        caller = sys._getframe(1).f_code.co_qualname
        # the copying form: every call but those that were in place already (their result is their input)
        copy = force_copy and not kwargs.get("async_op") and caller != "TiedEmbeddingSync.sync"
        out = real(x, axis, *args, inplace=inplace and not copy, **kwargs)
        if axis.size > 1 and not kwargs.get("async_op"):
            calls.append((caller, inplace, out.data_ptr() == x.data_ptr()))
        return out

    C.all_reduce = spy
    results = []
    try:
        for parallel, copy in runs:
            force_copy[:] = [True] if copy else []
            calls = []
            job = gridshard.build_job({"model": {"preset": "tiny"}, "parallel": parallel, "data": {"seq_len": 32},
                                       "train": {"global_batch": 4, "micro_batch": 2, "seed": 5}})
            result = train_step(job, job.batch(0))
            losses = global_losses(job, [(result.loss_share, result.valid_targets)])
            entries = sorted((k, e.count, e.payload_bytes) for k, e in job.ledger.entries.items())
            results.append((calls, entries, losses + [float(result.grad_norm)]))
    finally:
        C.all_reduce = real
    return results


def test_all_reduces_of_temporaries_run_in_place_with_the_same_ledger_and_numbers():
    """Every all-reduce of a step whose input is a temporary (norm and loss statistics, id
    verdicts, the gradient norm, loss sums) reduces in place — the result is its input, no
    clone — and the step's ledger entries and numbers equal those of the copying form (1D, D=2:
    the vocabulary-parallel loss, the norm over tensor and data; 2D: norms, loss, id verdicts,
    whose numbers the 2D equivalence tests hold to the single-device reference)."""
    from gridshard.testing import run_on_ranks

    one_d, two_d = {"data": 2, "tensor": 2, "tensor_mode": "1d"}, {"data": 1, "tensor": 4, "tensor_mode": "2d"}
    out = run_on_ranks(4, _all_reduce_calls, [(one_d, False), (one_d, True), (two_d, False)])
    for (calls, entries, numbers), (copy_calls, copy_entries, copy_numbers), (calls_2d, _, _) in out:
        for run in (calls, calls_2d):
            copying = {caller for caller, inplace, _ in run if not inplace}
            assert copying <= COPY_KEPT, copying - COPY_KEPT
            in_place = [(caller, alias) for caller, inplace, alias in run if inplace]
            assert in_place and all(alias for _, alias in in_place)
        assert len(calls) == len(copy_calls) and entries == copy_entries
        assert numbers == pytest.approx(copy_numbers, rel=1e-12, abs=0)
    callers = {c for rank_results in out for calls, _, _ in rank_results for c, _, _ in calls}
    assert {"_RMSNorm2DFn.forward", "_CrossEntropy2DFn.forward", "_VocabParallelCrossEntropy.forward",
            "global_grad_norm", "global_losses"} <= callers


# ---- pipeline busy/bubble time on the device's clock -------------------------------------------
class _FakeCudaEvent:
    """A CUDA event that completes when the test says so; ``elapsed_time`` is what the fake
    device took (ms), not what the host spent."""
    log: list = []
    done = True

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = len([e for e in self.log if e == "record"]) * 250.0          # each region: 250 ms on the device
        self.log.append("record")

    def query(self):
        self.log.append("query")
        return self.done

    def synchronize(self):
        self.log.append("synchronize")

    def elapsed_time(self, end):
        return end.t - self.t


def test_region_timer_on_cpu_sums_host_time_inside_regions_only():
    import time

    from gridshard.pipeline.meter import RegionTimer

    timer = RegionTimer("cpu")
    with timer.region():
        time.sleep(0.03)
    time.sleep(0.05)                                   # outside every region: not counted
    with timer.region():
        time.sleep(0.01)
    assert 0.04 <= timer.total_s < 0.08


def test_region_timer_on_cuda_reads_events_without_a_host_sync_per_region(monkeypatch):
    """Host time would measure kernel launches: the regions' device time comes from events on
    the current stream; a region's end only asks (``query``) whether earlier ones completed, and
    only reading the total waits (after the step's own sync point)."""
    from gridshard.pipeline.meter import RegionTimer, StageMeter

    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    _FakeCudaEvent.log, _FakeCudaEvent.done = [], False
    timer = RegionTimer(torch.device("cuda", 0))
    for _ in range(3):
        with timer.region():
            pass
    assert "synchronize" not in _FakeCudaEvent.log and _FakeCudaEvent.log.count("record") == 6
    assert len(timer._pending) == 3                    # not completed yet: nothing read, nothing waited for
    assert timer.total_s == pytest.approx(0.75) and _FakeCudaEvent.log.count("synchronize") == 3
    _FakeCudaEvent.done = True
    with timer.region():
        pass
    assert timer._pending == []                        # completed pairs are folded in as regions end

    class Stage:                                       # the three compute calls the meter wraps
        stage_index = 0

        def forward_one_chunk(self, i, *a):
            return torch.ones(2, requires_grad=True) * 2

        backward_one_chunk = backward_weight_one_chunk = lambda self, i, *a: None
        get_fwd_send_ops = get_bwd_send_ops = lambda self, i: []

    _FakeCudaEvent.log = []
    meter, stage = StageMeter(None, [], device="cuda"), Stage()
    meter.attach(stage)
    stage.forward_one_chunk(0)
    stage.backward_one_chunk(0)
    with meter.schedule.region():
        pass
    assert meter.busy_s == pytest.approx(0.5) and meter.schedule_s == pytest.approx(0.25)


# ---- collective timeouts: every group, and train.compile's first step -------------------------
def _group_timeouts(cfg: dict) -> dict:
    import gridshard
    import gridshard.engine.job as job_module
    import torch.distributed as dist
    from gridshard.engine.step import evaluate, train_step
    from gridshard.mesh import build_mesh, group_timeout_s

    world = group_timeout_s(dist.group.WORLD)
    out = {"world": world, "mesh": [group_timeout_s(g) for g in build_mesh(2, 1, 2, "1d").groups()]}
    real_compile = job_module.apply_compile
    job_module.apply_compile = lambda model: 0         # the timeouts only: no compiling on 2 shared cores
    try:
        job = gridshard.build_job(cfg)
        groups = [dist.group.WORLD] + job.mesh.groups()
        seen = lambda: sorted({group_timeout_s(g) for g in groups})      # noqa: E731
        out["built"] = seen()
        train_step(job, job.batch(0))
        out["after_step"] = seen()
        evaluate(job)
        out["after_eval"] = seen()
        out["groups"] = len(job.mesh.groups())
    finally:
        job_module.apply_compile = real_compile
    return out


def test_mesh_groups_wait_the_collective_timeout_and_compile_warms_up_with_a_longer_one():
    """torch gives a mesh's sub-groups its default timeout (gloo 30 min, NCCL 10 min), not the
    world's: they now get the world's (train.collective_timeout_s when gridshard initialised it;
    here the harness's). With train.compile the job's groups wait train.compile_timeout_s until
    the first step and the first evaluation ran (ranks compile then), then their own again."""
    from gridshard.testing import run_on_ranks

    cfg = {"parallel": {"data": 2, "tensor": 2, "tensor_mode": "1d"}, "data": {"seq_len": 32, "val_fraction": 0.1},
           "train": {"global_batch": 4, "micro_batch": 2, "compile": True, "compile_timeout_s": 55,
                     "collective_timeout_s": 7, "eval_batches": 1}}
    for out in run_on_ranks(4, _group_timeouts, cfg):
        assert out["world"] is not None and out["mesh"] == [out["world"]] * 2        # data and tensor groups
        assert out["groups"] == 2 and out["built"] == [55.0]
        assert out["after_step"] == [55.0] and out["after_eval"] == [out["world"]]


def test_compile_timeout_is_validated():
    with pytest.raises(ConfigError, match="train.compile_timeout_s"):
        resolve_config(None, ["train.compile_timeout_s=0"])


def test_the_collective_timeout_reaches_init_process_group(monkeypatch):
    """A job that starts the process group starts it with train.collective_timeout_s."""
    import datetime

    import gridshard.engine.job as job_module
    import gridshard.mesh as mesh_module

    seen = []
    monkeypatch.setattr(job_module.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(job_module, "init_distributed",
                        lambda backend, timeout_s, run_dir=None: (seen.append(timeout_s), 1 / 0))
    with pytest.raises(ZeroDivisionError):
        job_module.resolve_job_config({"train": {"collective_timeout_s": 42}})
    monkeypatch.setattr(mesh_module.dist, "init_process_group", lambda backend, **kw: seen.append(kw["timeout"]))
    monkeypatch.setattr(mesh_module, "elastic_attempt_store", lambda timeout: None)
    from gridshard.netutil import free_port

    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port()))):
        monkeypatch.setenv(var, value)
    mesh_module.init_distributed("gloo", timeout_s=42)
    assert seen == [42, datetime.timedelta(seconds=42)]
