"""The YAML run configs a command names: a path, or the name of one bundled with the package."""

from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_DIR", "resolve_config"]

# the bundled YAML configs live beside the package's modules, one folder above this one
CONFIG_DIR = Path(__file__).parent.parent / "configs"


def resolve_config(name_or_path: str) -> Path:
    """A path to a YAML file, or the name of a config shipped in routeformer/configs."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    bundled = CONFIG_DIR / f"{name_or_path}.yaml"
    if bundled.is_file():
        return bundled
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    raise ValueError(f"config {name_or_path!r} is neither a file nor a bundled config; bundled: {names}")
