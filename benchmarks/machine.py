"""What a benchmark's results record of where they were measured: the CPU (with the SIMD flags that pick torch's
kernels), cores, memory and device (:func:`machine`, :func:`machine_line`), and the versions of Python, the
libraries and the git commit (:func:`versions`)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The SIMD flags that decide which oneDNN/MKL kernels torch picks: the image tasks' accuracies differ by up to 1
#: point between two VMs with the same code and seeds (issue 16), so the suite records them.
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16",
              "amx_int8", "amx_tile")


def machine() -> dict[str, Any]:
    """``{"cpu", "cpu_family_model", "cpu_simd", "cores", "ram_gib", "device", "torch_threads"}`` of this machine
    (``device``: the first CUDA device's name, else ``"cpu"``)."""
    import torch

    cpu, name, family, model, flags = platform.processor() or platform.machine(), "", "", "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():  # the first processor's entries
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name" and not name:
                cpu = name = value
            elif key == "cpu family" and not family:
                family = value
            elif key == "model" and not model:
                model = value
            elif key == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    ram = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) / 2**20
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"cpu": cpu, "cpu_family_model": f"{family}/{model}" if family else "",
            "cpu_simd": [f for f in SIMD_FLAGS if f in flags], "cores": os.cpu_count(), "ram_gib": ram,
            "device": device, "torch_threads": torch.get_num_threads()}


def machine_line(m: dict[str, Any]) -> str:
    """``AMD EPYC (family/model 25/1; sse4_2, avx, avx2, fma), 2 cores, 23.5 GiB RAM, device cpu``; results.json
    files written before the CPU details were recorded give the name alone."""
    detail = "; ".join(x for x in (f"family/model {m['cpu_family_model']}" if m.get("cpu_family_model") else "",
                                   ", ".join(m.get("cpu_simd", []))) if x)
    return (f"{m['cpu']}" + (f" ({detail})" if detail else "")
            + f", {m['cores']} cores, {m['ram_gib']:.1f} GiB RAM, device {m['device']}")


def versions(packages: tuple[str, ...] = ("torch", "torchvision", "transformers", "peft", "layerfreeze"),
             ) -> dict[str, Any]:
    """``{"python": ..., <package>: <version> for the installed ``packages``, "git_commit", "git_dirty"}`` (the git
    fields when this checkout is a git work tree)."""
    import importlib.metadata as md

    out: dict[str, Any] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True, check=True).stdout.strip()
        out["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                               capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return out
