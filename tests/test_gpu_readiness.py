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
    from gridshard.mesh import default_device

    assert default_device() == torch.device("cpu")


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
