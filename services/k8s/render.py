"""The manifests as files: one YAML file per component, its objects sorted by kind and name, keys sorted."""
from __future__ import annotations

from pathlib import Path

import yaml

from services.k8s.manifests import stack
from services.k8s.values import load_values


class _Dumper(yaml.SafeDumper):
    """Writes a value used twice (a probe's command) twice, not as an anchor and an alias."""

    def ignore_aliases(self, data) -> bool:
        return True


def render(values_path: str | Path) -> dict[str, str]:
    """File name -> YAML text of every component of the stack `values_path` describes."""
    name = Path(values_path).name
    header = f"# Rendered by `deepinfer deploy k8s` from {name}: change the values, not this file.\n"
    return {f"{component}.yaml": header + yaml.dump_all(
                sorted(objects, key=lambda o: (o["kind"], o["metadata"]["name"])), Dumper=_Dumper, sort_keys=True,
                width=1000)  # a command stays on one line
            for component, objects in sorted(stack(load_values(values_path)).items())}


def write(files: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text)
