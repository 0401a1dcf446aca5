"""The plugin inventory as the text table `fw plugins list` and `fw doctor` print."""

from __future__ import annotations


def format_table(rows: list[dict]) -> str:
    header = ("PLUGIN", "DISTRIBUTION", "VERSION", "API", "STATUS", "PROVIDES")
    lines = [header]
    for r in rows:
        served = r.get("hf_architectures", {})
        provides = "; ".join(f"{kind}: {', '.join(_with_served(n, served) for n in names)}"
                             for kind, names in r["provides"].items() if names)
        if r["overrides"]:
            provides += " (overrides " + "; ".join(x for v in r["overrides"].values() for x in v) + ")"
        status = "error: " + r["error"] if r["error"] else r["status"]
        lines.append((r["name"], r["distribution"], r["version"], r["api_version"] or "-", status, provides or "-"))
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(line[:-1], widths)) + "  " + str(line[-1]) for line in lines
    )


def _with_served(name: str, served: dict[str, list[str]]) -> str:
    """`llama (LlamaForCausalLM, MistralForCausalLM)` for an architecture, the bare name otherwise."""
    return f"{name} ({', '.join(served[name]) or 'any, as a fallback'})" if name in served else name
