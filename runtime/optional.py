"""Optional dependencies (pyproject.toml `[project.optional-dependencies]`): which pip
package provides a module and which pagedjax extra installs it, so a command that needs
one says what to install instead of failing with a traceback or vanishing from --help."""

from __future__ import annotations

import importlib.util

# top-level module -> (pip requirement, pagedjax extra)
OPTIONAL_MODULES: dict[str, tuple[str, str]] = {
    "ray": ("ray[serve]", "fleet"),
    "zmq": ("pyzmq", "fleet"),
    "matplotlib": ("matplotlib", "bench"),
    "transformers": ("transformers", "peer"),
    "torch": ("torch", "peer"),
    "accelerate": ("accelerate", "peer"),
}


class MissingDependency(Exception):
    """An optional dependency a command needs is not installed."""

    def __init__(self, command: str, module: str) -> None:
        package, extra = OPTIONAL_MODULES.get(module, (module, ""))
        # pagedjax installs from its checkout (scripts/setup.sh), not from a package index, so
        # "pip install 'pagedjax[extra]'" would look for it where it is not
        hint = f"bash scripts/setup.sh {extra} (in the pagedjax checkout)" if extra else f"pip install '{package}'"
        super().__init__(f"'{command}' needs {package}: {hint}")
        self.command, self.module, self.package, self.extra = command, module, package, extra


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or sys.modules[name] is None
        return False


def require(command: str, *modules: str) -> None:
    """Raise MissingDependency for the first of `modules` that cannot be imported."""
    for m in modules:
        if not installed(m):
            raise MissingDependency(command, m)


def missing_optional(exc: ImportError) -> str | None:
    """The optional top-level module an ImportError is about, if it is one."""
    name = getattr(exc, "name", None) or ""
    top = name.split(".")[0]
    return top if top in OPTIONAL_MODULES else None
