"""Short plain-text tables of the analyses' results, printed and written to summary.md."""


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}"


def layer_correlation(r: dict) -> list[str]:
    lines = [f"examples: {r['num_examples']}; rows/columns = blocks 0..{len(r['pearson_all']) - 1}"]
    for key in ("pearson_all", "pearson_summary", "cka_all", "cka_summary"):
        lines.append(f"{key}:")
        lines += [
            "  " + " ".join("  n/a" if v is None else f"{v:5.2f}" for v in row) for row in r[key]
        ]
    return lines


def lesion(r: dict) -> list[str]:
    kinds = list(r["single"])
    lines = [
        f"intact: {_pct(r['intact'])}%",
        "| block | " + " | ".join(f"remove {k}" for k in kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for i in range(r["num_blocks"]):
        lines.append(f"| {i} | " + " | ".join(_pct(r["single"][k][i]) for k in kinds) + " |")
    if r["random_blocks"]:
        lines += ["| n random blocks | mean | s.e. | min | max |", "|---|---|---|---|---|"]
        for n, s in sorted(r["random_blocks"].items(), key=lambda item: int(item[0])):
            lines.append(
                f"| {n} | {_pct(s['mean'])} | {_pct(s['standard_error'])} | "
                f"{_pct(s['min'])} | {_pct(s['max'])} |"
            )
    return lines


def restricted_attention(r: dict) -> list[str]:
    lines = [
        f"unrestricted: {_pct(r['unrestricted'])}%",
        "| radius | masked pairs | local | random |",
        "|---|---|---|---|",
    ]
    for radius, fraction, local, random in zip(
        r["radii"], r["masked_fraction"], r["local"], r["random"]
    ):
        lines.append(f"| {radius} | {100 * fraction:.1f}% | {_pct(local)} | {_pct(random)} |")
    cut = r["no_patch_attention"]
    lines += ["| k blocks without patch-patch attention | first k | last k |", "|---|---|---|"]
    lines += [
        f"| {k} | {_pct(a)} | {_pct(b)} |"
        for k, a, b in zip(cut["blocks"], cut["first"], cut["last"])
    ]
    return lines


def spatial_attack(r: dict) -> list[str]:
    worst = r["worst_point"]
    return [
        f"examples: {r['num_examples']}, grid points: {r['grid_points']}",
        f"clean (0 px, 0 deg): {_pct(r['clean'])}%",
        f"robust over the whole grid: {_pct(r['robust'])}% (translations only: "
        f"{_pct(r['robust_translations_only'])}%, rotations only: {_pct(r['robust_rotations_only'])}%)",
        f"worst single point {worst['point']}: {_pct(worst['accuracy'])}%",
    ]


TABLES = dict(
    layer_correlation=layer_correlation,
    lesion=lesion,
    restricted_attention=restricted_attention,
    spatial_attack=spatial_attack,
)
