"""The :class:`Plan`, what :func:`exittrain.plan.make_plan` found, its verdict against a device's
memory, and its Markdown and JSON forms."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from exittrain.plan.memory import Item, Step, human

MARGIN = 0.10  # of a device left for fragmentation and the temporaries the plan cannot see

UNSEEN = (
    "allocator fragmentation and cached blocks (10% of the device is left for them and the rest of this list)",
    "the CUDA context, 0.5-1 GiB per process (1 GiB is added on a GPU)",
    "workspace and temporary buffers of attention and matmul kernels (no attention score matrix is counted)",
    "NCCL buffers, DataLoader workers and pinned memory, the decoding evaluations and checkpoint writes",
    "Python, torch and library overhead (on a CPU: this plan process's own resident size stands in for it)",
)


def fit_verdict(need: int, capacity: int | None) -> str | None:
    """``fits`` (within 90% of ``capacity``), ``tight`` (within 100%), ``does not fit``; None without a capacity."""
    if capacity is None:
        return None
    return "fits" if need <= (1 - MARGIN) * capacity else "tight" if need <= capacity else "does not fit"


# ----------------------------------------------------------------------------------------------
# the plan


@dataclass
class Plan:
    """Everything :func:`make_plan` found; :meth:`to_markdown` and :meth:`to_dict` present it."""

    overrides: list[str]
    target: dict
    drafter: dict
    precision: dict
    world: dict
    steps: list[Step]
    data: list[Item]
    schedule: dict
    notes: list[str]
    capacity: int | None = None
    capacity_source: str = ""
    reserve: int = 0
    reserve_source: str = ""
    suggestions: list[dict] = field(default_factory=list)
    bf16_peak: int | None = None

    @property
    def peak_step(self) -> Step:
        return max(self.steps, key=lambda st: st.peak)

    @property
    def peak(self) -> int:
        return self.peak_step.peak

    @property
    def verdict(self) -> str | None:
        """``fits`` (need within 90% of the device), ``tight`` (within 100%), ``does not fit``; None without a size."""
        return fit_verdict(self.peak + self.reserve, self.capacity)

    def to_dict(self) -> dict:
        steps = [{"stage": st.stage, "kind": st.kind, "peak_phase": st.peak_phase, "peak_bytes": st.peak,
                  "phases": {p: [asdict(i) for i in items] for p, items in st.phases.items()}} for st in self.steps]
        return {
            "overrides": self.overrides, "target": self.target, "drafter": self.drafter, "precision": self.precision,
            "world": self.world, "peak_bytes": self.peak, "peak_step": f"{self.peak_step.stage}/{self.peak_step.kind}",
            "bf16_peak_bytes": self.bf16_peak, "capacity_bytes": self.capacity, "capacity_source": self.capacity_source,
            "reserve_bytes": self.reserve, "reserve_source": self.reserve_source, "verdict": self.verdict,
            "suggestions": self.suggestions, "steps": steps, "data": [asdict(i) for i in self.data],
            "schedule": self.schedule, "notes": self.notes, "unseen": list(UNSEEN),
        }  # fmt: skip

    def to_markdown(self) -> str:
        from exittrain.tables import markdown_table

        t, d, p, w = self.target, self.drafter, self.precision, self.world
        bf16 = f"; {human(t['bf16_bytes'])} in bf16" if t["dtype"] != "torch.bfloat16" else ""
        lines = [
            f"Plan of `fit {' '.join(self.overrides)}`, per rank (W = {w['world_size']}: {w['devices']} device(s) x "
            f"{w['nodes']} node(s), {w['strategy']}).",
            "",
            f"- target {t['name']}: {t['params'] / 1e9:.3f}B parameters, {human(t['bytes'])} in {t['dtype']}{bf16} "
            f"(config: {t['source']})",
            f"- drafter: {d['params'] / 1e6:.1f}M parameters, {d['layers']} layers of width {d['width']}, block "
            f"{d['block_size']} (from {d['source']})",
            f"- trainer.precision {p['trainer']}: drafter parameters {p['param_bytes']} B each, autocast "
            f"{'on' if p['autocast'] else 'off'}",
            *[f"- {n}" for n in self.notes],
            "",
        ]
        peak = self.peak_step
        rows = [[i.name, i.formula, human(i.bytes)] for i in peak.items if i.bytes]
        lines += [f"Device memory at the peak: {peak.stage} {peak.kind} step, phase '{peak.peak_phase}':", ""]
        lines += markdown_table(["item", "formula", "bytes"], rows + [["**total**", "", f"**{human(self.peak)}**"]])
        if self.bf16_peak is not None:
            lines += ["", f"With the target in bf16 the peak would be {human(self.bf16_peak)}."]
        lines += ["", "Every step kind (its largest phase):", ""]
        lines += markdown_table(["stage", "step", "peak phase", "peak"],
                                [[st.stage, st.kind, st.peak_phase, human(st.peak)] for st in self.steps])
        lines += ["", "Data (rank 0 writes it; the feature store holds it in every process with feature_cache):", ""]
        lines += markdown_table(["item", "formula", "bytes"], [[i.name, i.formula, human(i.bytes)] for i in self.data])
        sch = self.schedule
        lines += ["", "Schedule:", ""]
        lines += markdown_table(["quantity", "value"], [[k, "-" if v is None else v] for k, v in sch.items()])
        if self.capacity is not None:
            need = self.peak + self.reserve
            lines += ["", f"**{self.verdict}**: needs {human(need)} ({human(self.peak)} planned + "
                      f"{human(self.reserve)} {self.reserve_source}) of {human(self.capacity)} "
                      f"({self.capacity_source}; {MARGIN:.0%} kept free for what the plan cannot see)."]  # fmt: skip
            if self.verdict != "fits":
                lines += ["", "What to change, by how much each lowers the peak:", ""]
                rows = [[s["change"], human(s["saves"]), human(s["peak"]), s["verdict"], s["note"]]
                        for s in self.suggestions]
                lines += markdown_table(["change", "saves", "new peak", "then", "note"], rows) if rows else [
                    "(none of the planned changes lowers it)"]
        else:
            lines += ["", "No device memory known: pass --device-memory SIZE (e.g. 80GiB) for a verdict."]
        lines += ["", "Not seen by this plan: " + "; ".join(UNSEEN) + "."]
        return "\n".join(lines) + "\n"
