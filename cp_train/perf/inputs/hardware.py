"""GPU constants for the planner: peaks, memory, links, and measured GEMM and attention efficiency curves.

A ``Hardware`` is one GPU type in one kind of node. The built-in profiles are the YAML files in
``cp_train/perf/inputs/profiles/`` (one per GPU type, each constant's source in a comment); a user's file has the
same keys, and ``to_yaml`` writes that format (so ``--calibrate OUT.yaml`` and ``--hardware OUT.yaml`` agree).

Units: TFLOP/s dense (no sparsity) per GPU; HBM in GiB (2**30 bytes, the device's total as nvidia-smi shows
it) and TB/s (1e12 B/s); link bandwidths in GB/s (1e9 B/s) per GPU per direction; latencies in microseconds.
Efficiencies are fractions of the matching peak, 0 < f <= 1:

- ``gemm_bf16`` / ``gemm_fp8``: points ``[FLOPs of one GEMM call (2*b*m*n*k), fraction of the peak]``,
  FLOPs increasing, interpolated linearly in log(FLOPs) and constant beyond the ends.
- ``attention``: per kernel, head_dim and mask, points ``[block length, fraction of the bf16 peak]`` for one
  forward + backward kernel call of ``block`` query rows over ``block`` keys; FLOPs counted as flash attention
  does (forward ``4 * pairs * heads * head_dim``, backward 2.5x that, causal: visible pairs only), interpolated in
  log(length).
- ``nvlink_efficiency`` / ``net_efficiency``: the bus bandwidth NCCL ring collectives reach over the link's.
- Latencies follow NCCL's model: a collective costs ``collective_latency_us`` plus one step latency per ring
  step (``nvlink_latency_us`` inside a node, ``net_latency_us`` for a step that crosses nodes).
- The host: ``host_op_us`` per op the host dispatches (Python, the dispatcher, the launch) and
  ``graph_build_ms`` per cuDNN execution graph built for a new attention shape (``host.py``); ``pcie_gb_s``, what
  pinned copies between a GPU and host memory reach per direction, and ``host_memory_gib`` per node: activation
  offload (``cp_train/memory/offload.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from cp_train.errors import InputError

PROFILES_DIR = Path(__file__).with_name("profiles")
PRECISIONS = ("bf16", "fp8")
Curve = tuple[tuple[float, float], ...]

FIELDS: dict[str, str] = {  # every key of a hardware file -> what it holds (named in errors)
    "name": "the profile's name",
    "bf16_tflops": "dense bf16 tensor-core peak, TFLOP/s per GPU",
    "fp8_tflops": "dense fp8 tensor-core peak, TFLOP/s per GPU (0: no fp8)",
    "hbm_gib": "device memory, GiB",
    "hbm_tb_s": "device memory bandwidth, TB/s",
    "nvlink_gb_s": "NVLink bandwidth per GPU per direction, GB/s",
    "nvlink_efficiency": "fraction of nvlink_gb_s that NCCL ring collectives reach",
    "nvlink_latency_us": "latency of one ring step inside a node, microseconds",
    "net_gb_s": "inter-node network bandwidth per GPU per direction, GB/s",
    "net_efficiency": "fraction of net_gb_s that NCCL ring collectives reach",
    "net_latency_us": "latency of one ring step across nodes, microseconds",
    "collective_latency_us": "fixed cost of one collective call, microseconds",
    "gemm_bf16": "bf16 GEMM efficiency: a list of [GEMM FLOPs, fraction of bf16_tflops]",
    "gemm_fp8": "fp8 GEMM efficiency: a list of [GEMM FLOPs, fraction of fp8_tflops] (empty when fp8_tflops is 0)",
    "attention": "attention kernel efficiency: a list of {kernel, head_dim, causal, points: [[length, fraction]]}",
    "attention_kernel": "the kernel the trainer uses on this GPU (one of the attention entries' kernels)",
    "varlen_kernel": "the kernel of the varlen calls packed documents run as (default: attention_kernel)",
    "gpus_per_node": "GPUs per node (default 8)",
    "notes": "free text (default empty)",
    "host_op_us": "host time per dispatched op (Python, dispatcher, kernel launch), microseconds",
    "graph_build_ms": "host time to build one cuDNN attention execution graph for a new shape, milliseconds",
    "pcie_gb_s": "host link (PCIe) bandwidth per GPU per direction that pinned copies reach, GB/s (activation offload)",
    "host_memory_gib": "host (CPU) memory per node, GiB (activation offload)",
}
# a user's file may leave these out: 8 GPUs, no notes; a PCIe 4 x16 link's copies (about 25 GB/s) and 1 TiB of host
# memory, the lower figures of the built-in profiles' hosts; packed documents' varlen calls on attention_kernel
OPTIONAL = {"gpus_per_node": 8, "notes": "", "pcie_gb_s": 25.0, "host_memory_gib": 1024.0, "varlen_kernel": ""}


class HardwareError(InputError):
    """A hardware name or file that cannot be used; the message names the key or lists the known names."""


def known_hardware() -> list[str]:
    """The built-in profile names, sorted."""
    return sorted(path.stem for path in PROFILES_DIR.glob("*.yaml"))


def interpolate(points: Curve, x: float) -> float:
    """``points`` (x increasing) at ``x``: linear in log(x) between points, the end values beyond them."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]


@dataclass(frozen=True)
class AttentionCurve:
    """Forward + backward efficiency of one attention kernel at one head_dim and mask, by block length."""

    kernel: str
    head_dim: int
    causal: bool
    points: Curve


@dataclass(frozen=True)
class Hardware:
    """One GPU type's constants (see the module docstring for units and curve semantics)."""

    name: str
    bf16_tflops: float
    fp8_tflops: float
    hbm_gib: float
    hbm_tb_s: float
    nvlink_gb_s: float
    nvlink_efficiency: float
    nvlink_latency_us: float
    net_gb_s: float
    net_efficiency: float
    net_latency_us: float
    collective_latency_us: float
    gemm_bf16: Curve
    gemm_fp8: Curve
    attention: tuple[AttentionCurve, ...]
    attention_kernel: str
    host_op_us: float
    graph_build_ms: float
    gpus_per_node: int = 8
    notes: str = ""
    pcie_gb_s: float = OPTIONAL["pcie_gb_s"]
    host_memory_gib: float = OPTIONAL["host_memory_gib"]
    varlen_kernel: str = ""

    def peak_tflops(self, precision: str = "bf16") -> float:
        """Dense peak TFLOP/s per device for ``precision`` (bf16 | fp8)."""
        if precision not in PRECISIONS:
            raise HardwareError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
        peak = self.bf16_tflops if precision == "bf16" else self.fp8_tflops
        if peak <= 0:
            raise HardwareError(f"hardware {self.name} has no {precision} peak ({precision}_tflops 0): plan with "
                                f"precision bf16")
        return peak

    def gemm_fraction(self, flops: float, precision: str = "bf16") -> float:
        """Fraction of ``peak_tflops(precision)`` one GEMM call of ``flops`` (2*b*m*n*k) reaches."""
        return interpolate(self.gemm_bf16 if precision == "bf16" else self.gemm_fp8, flops)

    def attention_fraction(self, head_dim: int, block: float, causal: bool = True, kernel: str | None = None
                           ) -> float:
        """Fraction of the bf16 peak one forward + backward attention call of ``block`` rows x ``block`` keys reaches
        with ``kernel`` (default ``attention_kernel``); for a call of ``rows`` x ``keys`` pass the side of the square
        of the same area, ``sqrt(rows * keys)``. A head_dim without a curve uses the nearest one (in log2); a mask
        without a curve uses the other mask's curve."""
        kernel = kernel or self.attention_kernel
        curves = [curve for curve in self.attention if curve.kernel == kernel]
        if not curves:
            kernels = sorted({curve.kernel for curve in self.attention})
            raise HardwareError(f"hardware {self.name} has no attention curve for kernel {kernel!r}; "
                                f"choose one of {', '.join(kernels)}")
        best = min(abs(math.log2(curve.head_dim / head_dim)) for curve in curves)
        curves = [curve for curve in curves if abs(math.log2(curve.head_dim / head_dim)) == best]
        chosen = next((curve for curve in curves if curve.causal == causal), curves[0])
        return interpolate(chosen.points, block)

    def to_dict(self) -> dict[str, Any]:
        """Plain data with the file's keys (``from_dict`` reads it back to an equal ``Hardware``)."""
        out: dict[str, Any] = {}
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in ("gemm_bf16", "gemm_fp8"):
                value = [[float(x), float(y)] for x, y in value]
            elif item.name == "attention":
                value = [{"kernel": c.kernel, "head_dim": c.head_dim, "causal": c.causal,
                          "points": [[float(x), float(y)] for x, y in c.points]} for c in value]
            out[item.name] = value
        return out

    def to_yaml(self) -> str:
        """The YAML text of ``to_dict`` (the format ``load_hardware`` reads)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


def _numeric(value: Any) -> Any:
    """``value``, or the float a string spells (PyYAML reads ``1e9``, without a dot, as text)."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _number(data: dict[str, Any], key: str, source: str, fraction: bool = False, zero: bool = False) -> float:
    value = _numeric(data[key])
    ok = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    ok = ok and (0 < value <= 1 if fraction else (value >= 0 if zero else value > 0))
    if not ok:
        want = "a fraction in (0, 1]" if fraction else ("a number >= 0" if zero else "a number > 0")
        raise HardwareError(f"{source}: {key} must be {want} ({FIELDS[key]}), got {value!r}")
    return float(value)


def _curve(value: Any, key: str, source: str) -> Curve:
    """A non-empty list of [x, fraction] pairs, x > 0 increasing, 0 < fraction <= 1."""
    pairs = []
    for item in value if isinstance(value, list) and value else [value]:
        item = [_numeric(v) for v in item] if isinstance(item, list | tuple) else item
        if not (isinstance(item, list | tuple) and len(item) == 2 and all(
                not isinstance(v, bool) and isinstance(v, int | float) for v in item)
                and item[0] > 0 and 0 < item[1] <= 1):
            raise HardwareError(f"{source}: {key} must be a list of [x > 0, fraction in (0, 1]] pairs, "
                                f"got {item!r}")
        pairs.append((float(item[0]), float(item[1])))
    if any(b[0] <= a[0] for a, b in zip(pairs, pairs[1:], strict=False)):
        raise HardwareError(f"{source}: {key} must list its points with x increasing")
    return tuple(pairs)


def _attention(value: Any, source: str) -> tuple[AttentionCurve, ...]:
    if not isinstance(value, list) or not value:
        raise HardwareError(f"{source}: attention must be a non-empty list ({FIELDS['attention']})")
    curves = []
    for i, item in enumerate(value):
        where = f"attention[{i}]"
        if not isinstance(item, dict) or set(item) != {"kernel", "head_dim", "causal", "points"}:
            raise HardwareError(f"{source}: {where} must be a mapping with exactly kernel, head_dim, causal, points")
        if not isinstance(item["kernel"], str) or not item["kernel"]:
            raise HardwareError(f"{source}: {where}.kernel must be a kernel name, got {item['kernel']!r}")
        if isinstance(item["head_dim"], bool) or not isinstance(item["head_dim"], int) or item["head_dim"] < 1:
            raise HardwareError(f"{source}: {where}.head_dim must be an integer >= 1, got {item['head_dim']!r}")
        if not isinstance(item["causal"], bool):
            raise HardwareError(f"{source}: {where}.causal must be true or false, got {item['causal']!r}")
        curves.append(AttentionCurve(item["kernel"], item["head_dim"], item["causal"],
                                     _curve(item["points"], f"{where}.points", source)))
    return tuple(curves)


def from_dict(data: Any, source: str = "hardware") -> Hardware:
    """A ``Hardware`` from a file's mapping; ``HardwareError`` naming ``source`` and the key otherwise."""
    if not isinstance(data, dict):
        raise HardwareError(f"{source}: the top level must be a mapping of constants ({', '.join(FIELDS)})")
    if "cpu" in data or data.get("compute_dtype") == "fp32":
        raise HardwareError(f"{source} is a CPU profile: cp-train-plan predicts GPUs (for a CPU run's memory use "
                            f"train.py --dry-run)")
    unknown = sorted(str(key) for key in data if key not in FIELDS)
    if unknown:
        raise HardwareError(f"{source}: unknown key {unknown[0]!r}; the keys are {', '.join(FIELDS)}")
    data = {**OPTIONAL, **data}
    missing = [key for key in FIELDS if key not in data]
    if missing:
        raise HardwareError(f"{source}: missing {missing[0]} ({FIELDS[missing[0]]}): add it")
    if not isinstance(data["name"], str) or not data["name"]:
        raise HardwareError(f"{source}: name must be a non-empty string, got {data['name']!r}")
    values: dict[str, Any] = {"name": data["name"], "notes": str(data["notes"] or "")}
    for key in ("bf16_tflops", "hbm_gib", "hbm_tb_s", "nvlink_gb_s", "nvlink_latency_us", "net_gb_s",
                "net_latency_us", "collective_latency_us", "host_op_us", "graph_build_ms", "pcie_gb_s",
                "host_memory_gib"):
        values[key] = _number(data, key, source, zero=key.endswith(("latency_us", "_us", "_ms")))
    values["fp8_tflops"] = _number(data, "fp8_tflops", source, zero=True)
    for key in ("nvlink_efficiency", "net_efficiency"):
        values[key] = _number(data, key, source, fraction=True)
    gpus = data["gpus_per_node"]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise HardwareError(f"{source}: gpus_per_node must be an integer >= 1, got {gpus!r}")
    values["gpus_per_node"] = gpus
    for key in ("gemm_bf16", "gemm_fp8"):  # empty only without the matching peak
        peak = values[key.replace("gemm_", "") + "_tflops"]
        values[key] = _curve(data[key], key, source) if data[key] or peak > 0 else ()
    values["attention"] = _attention(data["attention"], source)
    kernels = sorted({curve.kernel for curve in values["attention"]})
    if data["attention_kernel"] not in kernels:
        raise HardwareError(f"{source}: attention_kernel {data['attention_kernel']!r} has no attention curve; "
                            f"choose one of {', '.join(kernels)}")
    values["attention_kernel"] = data["attention_kernel"]
    if data["varlen_kernel"] and data["varlen_kernel"] not in kernels:
        raise HardwareError(f"{source}: varlen_kernel {data['varlen_kernel']!r} has no attention curve; "
                            f"choose one of {', '.join(kernels)}, or leave it out (attention_kernel's)")
    values["varlen_kernel"] = str(data["varlen_kernel"] or "")
    return Hardware(**values)


def _read(path: Path, source: str) -> Hardware:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise HardwareError(f"{source} cannot be read: {error}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = " ".join(str(getattr(error, "problem", None) or error).split())
        raise HardwareError(f"{where}: not valid YAML ({problem}); fix the file") from None
    return from_dict(data, source)


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A built-in profile by name (``known_hardware()``) or a YAML file of constants with ``FIELDS``' keys."""
    spec = str(name_or_path)
    known = known_hardware()
    if spec in known:
        return _read(PROFILES_DIR / f"{spec}.yaml", f"hardware profile {spec}")
    path = Path(spec)
    if path.is_file():
        return _read(path, f"hardware file {spec}")
    if path.suffix in (".yaml", ".yml") or "/" in spec:
        raise HardwareError(f"hardware file {spec} does not exist: pass a YAML file of constants "
                            f"or one of {', '.join(known)}")
    raise HardwareError(f"unknown hardware {spec!r}: choose one of {', '.join(known)}, "
                        f"or pass a YAML file of constants (--calibrate OUT.yaml writes one)")
