"""Print the tables of docs/benchmarks.md from benchmark results files (Markdown).

    python scripts/bench_tables.py docs/results/2026-12-01-h200-runner-llama-3.2-1b.jsonl ...

A `.jsonl` file holds `srt.bench.one_batch` and `srt.bench.hf_baseline` rows (decode ms/step
per path and batch size, against the floor); a `.json` file is `srt.bench.cold_start` or
`srt.bench.serving` output; either may be gzipped (`.jsonl.gz`, `.json.gz`: the committed
results over 200 KB are).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from srt.bench import cold_start, one_batch, serving
from srt.bench.report import markdown_table


def path_label(row: dict[str, Any]) -> str:
    return row["method"] if "method" in row else f"srt {one_batch.label(row)}"


def runner_tables(rows: list[dict[str, Any]]) -> str:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("decode_ms_per_step")]
        sizes = sorted({r["batch_size"] for r in mine})
        grid: dict[str, dict[int, float]] = defaultdict(dict)
        for r in mine:
            grid[path_label(r)][r["batch_size"]] = r["decode_ms_per_step"]
        for r in mine:  # the same steps overlapped as the server runs them
            if r.get("decode_ms_overlapped"):
                grid[f"{path_label(r)}, overlapped"][r["batch_size"]] = r["decode_ms_overlapped"]
            if r.get("launch_host_ms"):  # the host's part of each overlapped step
                grid[f"{path_label(r)}, launch host ms"][r["batch_size"]] = r["launch_host_ms"]
        floor = grid.get("bandwidth-floor", {})
        table = [
            {
                "path": name,
                **{f"bs{b}": ms.get(b) for b in sizes},
                "bs1_x_floor": round(ms[1] / floor[1], 2) if 1 in ms and 1 in floor else None,
            }
            for name, ms in grid.items()
        ]
        columns = [
            ("decode ms/step", "path"),
            *[(f"bs {b}", f"bs{b}") for b in sizes],
            ("bs 1 / floor", "bs1_x_floor"),
        ]
        out += [f"### {model}: decode ms/step", "", markdown_table(table, columns), ""]
        srt_rows = [r for r in mine if "decode_backend" in r]
        firsts = {}
        for r in srt_rows:
            entry = firsts.setdefault(
                one_batch.label(r),
                {
                    "path": one_batch.label(r),
                    "startup_s": r["startup_s"],
                    "load_s": r["load_s"],
                    "compile_s": r["compile_s"],
                },
            )
            entry[f"first{r['batch_size']}"] = r["cold_first_decode_ms"]
        columns = [
            ("srt path", "path"),
            ("startup s", "startup_s"),
            ("load s", "load_s"),
            ("compile s", "compile_s"),
            *[(f"first hit bs {b} ms", f"first{b}") for b in sizes],
        ]
        out += [
            f"### {model}: startup and first hits",
            "",
            markdown_table(list(firsts.values()), columns),
            "",
        ]
        profiled = [
            {**r, **r["profile"], "label": one_batch.label(r)}
            for r in srt_rows
            if "profile" in r and r["batch_size"] == 1
        ]
        if profiled:
            out += [
                f"### {model}: profile of the warm decode steps, batch 1",
                "",
                markdown_table(profiled, one_batch.PROFILE_TABLE),
                "",
            ]
        compiled = [r for r in mine if r.get("compile_s") and "method" in r]
        for r in compiled:
            out.append(
                f"- {r['method']} bs {r['batch_size']}: compile and first call {r['compile_s']} s"
            )
        errors = [r for r in rows if r["model"] == model and r.get("error")]
        out += [f"- {path_label(r)} bs {r['batch_size']} failed: {r['error']}" for r in errors]
        out.append("")
    return "\n".join(out)


def read_text(path: Path) -> str:
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def main(paths: list[str]) -> None:
    for path in map(Path, paths):
        print(f"## {path.name}\n")
        text = read_text(path)
        if path.name.removesuffix(".gz").endswith(".jsonl"):
            print(runner_tables([json.loads(line) for line in text.splitlines()]))
            continue
        data = json.loads(text)
        if "runs" in data and data["runs"] and "cache" in data["runs"][0]:
            print(markdown_table(cold_start.table_rows(data["runs"]), cold_start.TABLE))
            print()
            print(markdown_table(cold_start.table_rows(data["runs"]), cold_start.PARTS_TABLE))
            print()
            if data.get("attention_backends"):
                first = data["attention_backends"][0]
                rows = cold_start.against_first_backend(data["runs"], first)
                print(markdown_table(rows, cold_start.BACKEND_TABLE))
                print()
            print(
                markdown_table(
                    [
                        {"config": r["config"], "cache": r["cache"], **b}
                        for r in data["runs"]
                        for b in r.get("buckets", [])
                    ],
                    cold_start.BUCKET_TABLE,
                )
            )
        else:
            for run in data["runs"]:
                run["flags"] = " ".join(data.get("server_flags", []))
            print(markdown_table([serving.table_row(r) for r in data["runs"]], serving.TABLE))
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
