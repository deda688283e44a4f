"""Dense peak TFLOP/s of the accelerators the MFU is reported for, looked up by the exact name
`torch.cuda.get_device_name` gives. A leaf: imports nothing of the project.

Figures are NVIDIA's datasheet numbers for dense tensor-core math (the sparse figure / 2), per GPU:
"bf16"/"fp16" the 16-bit tensor cores, "fp32" TF32 (the trainer switches TF32 on for fp32 runs).

| part | bf16 | tf32 | source |
|---|---|---|---|
| H100 SXM5 (and H800 SXM, GH200's H100) | 989 | 494 | H100 datasheet: 1,979 / 989 TF sparse |
| H100 PCIe (and H800 PCIe) | 756 | 378 | H100 datasheet: 1,513 / 756 TF sparse |
| H100 NVL | 835 | 417 | H100 NVL datasheet: 1,671 / 835 TF sparse |
| H200 SXM | 989 | 494 | H200 datasheet (same tensor cores as H100 SXM) |
| H200 NVL | 835 | 417 | H200 datasheet: 1,671 / 835 TF sparse |
| B200 (HGX) | 2250 | 1100 | HGX B200 datasheet: 4.5 / 2.2 PF sparse per GPU (assumed: the HGX, not the GB200, clocks) |
| A100 SXM4 / PCIe (and A800) | 312 | 156 | A100 datasheet (dense) |
| L40S | 362 | 183 | L40S datasheet: 733 / 366 TF sparse |
| A10 | 125 | 62.5 | A10 datasheet: 250 / 125 TF sparse |

A name not listed gets no peak (the MFU is then reported as null, never as another part's
figure): set `MMTRAIN_PEAK_TFLOPS` for such a device (runtime/throughput.py)."""

from __future__ import annotations

from typing import Optional

_H100_SXM = {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0}
_H100_PCIE = {"bf16": 756.0, "fp16": 756.0, "fp32": 378.0}
_NVL = {"bf16": 835.0, "fp16": 835.0, "fp32": 417.0}
_B200 = {"bf16": 2250.0, "fp16": 2250.0, "fp32": 1100.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0}
_L40S = {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0}
_A10 = {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5}

#: dense peak TFLOP/s per precision, by the exact device name (`torch.cuda.get_device_name`,
#: without the "NVIDIA " prefix): the runtime's MFU denominator
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 80GB HBM3": _H100_SXM,
    "H100 SXM5 80GB": _H100_SXM,
    "H100 PCIe": _H100_PCIE,
    "H100 NVL": _NVL,
    "H800": _H100_SXM,
    "H800 PCIe": _H100_PCIE,
    "GH200 480GB": _H100_SXM,
    "H200": _H100_SXM,
    "H200 NVL": _NVL,
    "B200": _B200,
    "A100-SXM4-80GB": _A100,
    "A100-SXM4-40GB": _A100,
    "A100-PCIE-40GB": _A100,
    "A100 80GB PCIe": _A100,
    "A800-SXM4-80GB": _A100,
    "A800 80GB PCIe": _A100,
    "L40S": _L40S,
    "A10": _A10,
}

#: `auto_tune.device_tflops` by default: an H100 SXM in bf16
DEFAULT_DEVICE_TFLOPS = _H100_SXM["bf16"]


def peak_tflops(device_name: str, precision: str) -> Optional[float]:
    """Dense peak TFLOP/s of the device called `device_name` in `precision` (the bf16 figure for
    a precision not listed); None for a name not in `PEAK_TFLOPS`."""
    name = device_name.strip()
    table = PEAK_TFLOPS.get(name.removeprefix("NVIDIA ").strip())
    if table is None:
        return None
    return table.get(precision, table["bf16"])
