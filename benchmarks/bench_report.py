"""What the benchmarks print and save: the machine they ran on (CPU, ISA, threads, load
average) and throughput.py's markdown table and JSON."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from throughput import EngineRun, Workload


def machine_info() -> dict[str, Any]:
    from tinyvllm.utils.cpu import cpu_flags, cpuinfo

    cpu = platform.processor() or "unknown"
    if cpu in ("unknown", "", platform.machine()):
        cpu = (cpuinfo() or {}).get("model name", cpu)
    flags = set(cpu_flags())
    import transformers

    return {
        "cpu": cpu,
        "cores_visible": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "cpu_count": os.cpu_count(),
        # bf16 matmuls are only fast with native bf16 instructions; say whether we have them.
        "bf16_isa": sorted(flags & {"avx512_bf16", "amx_bf16", "avx512f", "avx2"}),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        # Other processes competing for the cores skew every number; record how busy it was.
        "loadavg_start": round(os.getloadavg()[0], 2),
    }


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> str:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = sum(x[:1] == y[:1] for x, y in zip(a, b, strict=True))
    return f"{same}/{len(a)} identical, {first}/{len(a)} same first token"


def render(
    workloads: list[Workload], runs: list[EngineRun], info: dict[str, Any], build_s: float
) -> str:
    tiny, hf, peers = runs[0], runs[1] if len(runs) > 1 else None, runs[2:]
    head = ["workload", "tinyvllm tok/s", "HF tok/s", "ratio (tinyvllm/HF)"]
    head += [f"{p.name} tok/s" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def fmt(run: EngineRun | None, key: str) -> str:
        m = run.results.get(key) if run is not None else None
        return f"{m.tok_s:,.1f}" if m else "-"

    for wl in workloads:
        t, h = tiny.results.get(wl.key), hf.results.get(wl.key) if hf else None
        ratio = f"{t.tok_s / h.tok_s:.2f}x" if t and h else "-"
        unit = "prompt tok/s" if wl.unit == "prompt" else "out tok/s"
        row = [f"{wl.label} [{unit}]", fmt(tiny, wl.key), fmt(hf, wl.key), ratio]
        row += [fmt(p, wl.key) for p in peers]
        lines.append("| " + " | ".join(row) + " |")

    lines += [
        "",
        "| engine | workload | wall s | tokens | mean TTFT ms | greedy vs HF |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        for wl in workloads:
            m = run.results.get(wl.key)
            if m is None:
                continue
            agree = "-"
            if run is not hf and hf is not None and wl.key in hf.results:
                agree = greedy_agreement(m.outputs, hf.results[wl.key].outputs)
            ttft = f"{m.ttft_ms:.1f}" if m.ttft_ms is not None else "-"
            lines.append(
                f"| {run.name} | ({wl.key}) | {m.wall_s:.2f} | {m.tokens} | {ttft} | {agree} |"
            )
    lines.append("")
    for run in runs:
        startup = f"{run.startup_s:.2f} s" if run.startup_s is not None else "-"
        rss = f"{run.peak_rss_mib:,.0f} MiB" if run.peak_rss_mib is not None else "-"
        lines.append(f"- {run.name}: start-up {startup}, process peak RSS after its runs {rss}")
        lines += [f"  - {note}" for note in run.notes]
    lines.append(
        "- peak RSS is the whole process (getrusage) with every in-process engine loaded (they "
        "run interleaved, in rounds), so it is one figure for all of them, not per engine"
    )
    if build_s:
        lines.append(f"- checkpoint built in {build_s:.1f} s (cached for later runs)")
    lines.append(
        f"- machine: {info['cpu']}, {info['cores_visible']} cores visible "
        f"(cpu_count {info['cpu_count']}), ISA {'/'.join(info['bf16_isa']) or '?'}, "
        f"torch {info['torch']} ({info['torch_threads']} threads), transformers "
        f"{info['transformers']}, Python {info['python']}, {info['date']}"
    )
    lines.append(
        f"- 1-min load average {info['loadavg_start']} at start, {info.get('loadavg_end')} at end"
        + (
            " (above the core count: other processes competed for the CPU, numbers are noisy)"
            if max(info["loadavg_start"], info.get("loadavg_end") or 0) > info["cores_visible"]
            else ""
        )
    )
    return "\n".join(lines)


def to_json(
    args: argparse.Namespace,
    workloads: list[Workload],
    runs: list[EngineRun],
    info: dict[str, Any],
    engine_kwargs: dict[str, Any],
) -> dict[str, Any]:
    return {
        "machine": info,
        "model_dir": str(args.model_dir),
        "quick": args.quick,
        "seed": args.seed,
        "tinyvllm_kwargs": engine_kwargs,
        "workloads": {
            wl.key: {
                "label": wl.label,
                "unit": wl.unit,
                "counted_tokens": wl.counted_tokens,
                "num_requests": len(wl.prompts),
            }
            for wl in workloads
        },
        "engines": {
            run.name: {
                "startup_s": run.startup_s,
                "peak_rss_mib": run.peak_rss_mib,
                "notes": run.notes,
                "results": {k: m.to_json() for k, m in run.results.items()},
            }
            for run in runs
        },
        "ratio_tinyvllm_over_hf": {
            wl.key: runs[0].results[wl.key].tok_s / runs[1].results[wl.key].tok_s
            for wl in workloads
            if len(runs) > 1 and wl.key in runs[0].results and wl.key in runs[1].results
        },
    }
