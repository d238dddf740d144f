"""The kernel benchmark's rows as tables: the console table and the markdown table of a results file.

Both check the target for rows with tokens >= 16: lora_us <= 1.3 · floor_us + 3.
"""

from __future__ import annotations


def _us(v: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}s}" if v is None else f"{v:{width}.{digits}f}"


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'module':8s} {'T':>4s} {'A':>4s} {'r':>3s} {'pool':>4s} {'B':>5s} {'k':>2s} {'lora':>8s} {'no-pdl':>8s} "
        f"{'floor':>7s} {'target':>7s} {'copy':>7s} {'gather':>8s} {'loop':>9s} {'base':>8s} "
        f"{'err':>8s}"
    )
    print(head)
    for r in rows:
        target = 1.3 * r["floor_us"] + 3
        mark = "" if r["tokens"] < 16 else (" ok" if r["lora_us"] <= target else " MISS")
        print(
            f"{r['module']:8s} {r['tokens']:4d} {r['adapters']:4d} {r['rank']:3d} {r['pool_rank']:4d} "
            f"{r['b_layout'][:5]:>5s} {r['k']:2d} {r['lora_us']:8.2f} {_us(r.get('no_pdl_us'), 8)} {r['floor_us']:7.2f} {target:7.2f} {_us(r.get('copy_us'), 7)} {_us(r['gather_us'], 8)} "
            f"{_us(r['loop_us'], 9)} {_us(r['base_us'], 8)} {r['rel_err']:8.1e}{mark}"
        )


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table, with the tokens >= 16 target checked."""
    lines = [
        "| module | T | adapters | rank | pool | B | k | lora µs | floor µs | 1.3·floor+3 | copy µs | gather µs "
        "| loop µs | base µs |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(v: float | None) -> str:
        return "–" if v is None else f"{v:.1f}"

    for r in rows:
        target = 1.3 * r["floor_us"] + 3
        mark = "" if r["tokens"] < 16 else (" ✓" if r["lora_us"] <= target else " ✗")
        lines.append(
            f"| {r['module']} | {r['tokens']} | {r['adapters']} | {r['rank']} | {r['pool_rank']} | "
            f"{r.get('b_layout', 'out_major')} | {r['k']} | {r['lora_us']:.1f}{mark} | "
            f"{r['floor_us']:.1f} | {target:.1f} | {cell(r.get('copy_us'))} | "
            f"{cell(r['gather_us'])} | {cell(r['loop_us'])} | {cell(r['base_us'])} |"
        )
    return "\n".join(lines)
