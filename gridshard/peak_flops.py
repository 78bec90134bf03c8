"""Dense peak FLOP/s per GPU, keyed by the exact device name: the one table MFU (the trainer's
metrics) and the planner's packaged hardware profiles read.

A device is found by its name as ``torch.cuda.get_device_name()`` reports it, normalised
(surrounding and repeated spaces dropped, case folded) and compared **exactly** — never by
substring, so "NVIDIA H100 PCIe" does not get the SXM figures and "NVIDIA L40" not the L4's. An
unknown name has no peak: MFU is not reported (null) unless ``train.peak_flops`` gives one.

Figures are dense (no 2:4 sparsity: the datasheets' "with sparsity" numbers halved), per GPU, in
FLOP/s, for the tensor-core path of each precision; ``tf32`` is what fp32 matmuls run at when
``train.tf32`` is on (``fp32`` is plain fp32, TF32 off). Sources, NVIDIA datasheets:

* H100 SXM5 / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet — SXM: BF16/FP16 1,979 TFLOPS
  sparse (989.4 dense), TF32 989 sparse (494.7), FP32 67; PCIe: BF16/FP16 1,513 sparse (756.5),
  TF32 756 sparse (378), FP32 51; NVL: BF16/FP16 1,671 sparse (835.5), TF32 835 sparse (417.5),
  FP32 60.
* H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet — SXM as H100 SXM; NVL as H100 NVL.
* A100 (SXM4 and PCIe, 40 and 80 GB): "NVIDIA A100 Tensor Core GPU" datasheet — BF16/FP16 312,
  TF32 156, FP32 19.5.
* L40S: "NVIDIA L40S" datasheet — BF16/FP16 733 sparse (362.05), TF32 366 sparse (183), FP32 91.6.
* L40: "NVIDIA L40" datasheet — BF16/FP16 362.1 sparse (181.05), TF32 181 sparse (90.5), FP32 90.5.
* L4: "NVIDIA L4 Tensor Core GPU" datasheet — BF16/FP16 242 sparse (121), TF32 120 sparse (60),
  FP32 30.3.
* V100 SXM2 / PCIe: "NVIDIA Tesla V100" datasheet — FP16 tensor 125 / 112, FP32 15.7 / 14
  (no BF16, no TF32).
"""
from __future__ import annotations

from typing import Optional

_H100_SXM = {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}
_H100_NVL = {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}
_A100 = {"bf16": 312.0e12, "fp16": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12}

# exact device names as torch.cuda.get_device_name() reports them (normalised on lookup)
DEVICE_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.0e12},
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _H100_SXM,
    "NVIDIA H200 NVL": _H100_NVL,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA L40S": {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.0e12, "fp32": 91.6e12},
    "NVIDIA L40": {"bf16": 181.05e12, "fp16": 181.05e12, "tf32": 90.5e12, "fp32": 90.5e12},
    "NVIDIA L4": {"bf16": 121.0e12, "fp16": 121.0e12, "tf32": 60.0e12, "fp32": 30.3e12},
    "Tesla V100-SXM2-16GB": {"fp16": 125.0e12, "fp32": 15.7e12},
    "Tesla V100-SXM2-32GB": {"fp16": 125.0e12, "fp32": 15.7e12},
    "Tesla V100-PCIE-16GB": {"fp16": 112.0e12, "fp32": 14.0e12},
    "Tesla V100-PCIE-32GB": {"fp16": 112.0e12, "fp32": 14.0e12},
}


def normalise_device_name(name: str) -> str:
    """``"  NVIDIA  H100 PCIe "`` → ``"nvidia h100 pcie"``: spaces collapsed, case folded."""
    return " ".join(str(name).split()).casefold()


_BY_NORMALISED = {normalise_device_name(k): v for k, v in DEVICE_PEAK_FLOPS.items()}


def device_peaks(device_name: str) -> Optional[dict]:
    """The precision → FLOP/s table of the device named exactly ``device_name``, or None."""
    peaks = _BY_NORMALISED.get(normalise_device_name(device_name))
    return dict(peaks) if peaks is not None else None


def peak_flops_of(device_name: str, precision: str) -> Optional[float]:
    """Dense peak FLOP/s of ``device_name`` for ``precision`` (bf16 | fp16 | tf32 | fp32), or None
    for an unknown device or a precision it lacks (tf32 on a device without it: its fp32 rate,
    since the TF32 switch then changes nothing)."""
    peaks = device_peaks(device_name) or {}
    return peaks.get("fp32" if precision == "tf32" and "tf32" not in peaks else precision)
