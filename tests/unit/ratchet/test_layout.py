"""The layout holds: no arrow runs back up the house.

Floors, from the ground: the kernel ``ratchet/`` (what the services share); the services
(``proxy``, ``judge``, ``learner``, ``console``) and the bundled ``tasks``, each of which imports
only the kernel; the embedded stack ``embedded/``, which may import the tasks and the services;
the command line ``cli/`` on top, which may import all of them. The kernel's contract types
import no client library.

Every import statement counts, wherever it is: at the top, inside a function, under
``if TYPE_CHECKING:``, or a literal ``importlib.import_module("...")``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SERVICES = ("proxy", "judge", "learner", "console")
# The packages above the services: they start and call them.
APPS = ("cli", "embedded", "tasks")
NOT_FOR_THE_KERNEL = (*SERVICES, *APPS)
# What each package above the kernel may not import: whatever stands beside or above it.
FORBIDDEN_ABOVE_THE_KERNEL = {
    "tasks": (*SERVICES, "cli", "embedded"),
    "embedded": ("cli",),
    "cli": (),
}
CLIENT_LIBRARIES = ("redis", "kafka", "aiohttp", "httpx")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules_of(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


def kernel_modules() -> dict[str, Path]:
    return modules_of("ratchet")


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module the source imports, absolute; ``from a import b`` counts as a and a.b."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            prefix = f"{base}." if base else ""
            found |= {base} if base else set()
            found |= {prefix + alias.name for alias in node.names if alias.name != "*"}
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def forbidden_imports(
    source: str, module: str, forbidden: tuple[str, ...], is_package: bool = False
) -> set[str]:
    """The imports of ``source`` that reach into one of the ``forbidden`` top-level packages."""
    return {
        name
        for name in imported_modules(source, module, is_package)
        if name.split(".")[0] in forbidden
    }


def violations(modules: dict[str, Path], forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    found = {}
    for name, path in modules.items():
        bad = forbidden_imports(
            path.read_text(), name, forbidden, is_package=path.name == "__init__.py"
        )
        if bad:
            found[name] = bad
    return found


def test_the_kernel_imports_no_service_and_no_app() -> None:
    modules = kernel_modules()
    # The walk sees the kernel, and only the kernel.
    assert {"ratchet.settings", "ratchet.records", "ratchet.bus", "ratchet.registry"} <= set(
        modules
    )
    assert all(name == "ratchet" or name.startswith("ratchet.") for name in modules)
    assert violations(modules, NOT_FOR_THE_KERNEL) == {}


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_imports_no_other_service_and_no_app(service: str) -> None:
    modules = modules_of(service)
    assert f"{service}.service" in modules or f"{service}.app" in modules
    others = tuple(s for s in SERVICES if s != service)
    assert violations(modules, (*others, *APPS)) == {}


@pytest.mark.parametrize("app", APPS)
def test_an_app_imports_nothing_beside_or_above_it(app: str) -> None:
    modules = modules_of(app)
    assert app in modules
    assert violations(modules, FORBIDDEN_ABOVE_THE_KERNEL[app]) == {}


def kernel_closure(start: str) -> dict[str, set[str]]:
    """Every kernel module ``start`` reaches through kernel imports, with what each imports."""
    kernel = kernel_modules()
    seen: dict[str, set[str]] = {}
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in kernel:
            continue
        path = kernel[name]
        seen[name] = imported_modules(path.read_text(), name, path.name == "__init__.py")
        todo += [m for m in seen[name] if m in kernel]
    return seen


def test_the_contract_types_import_no_client_library() -> None:
    """The records are what every service and every consumer of the topics shares: reading one
    must not pull in a Redis, Kafka or HTTP client."""
    reached = kernel_closure("ratchet.records")
    assert "ratchet.bill" in reached  # the walk follows the kernel's imports
    clients = {
        name: sorted(m for m in imports if m.split(".")[0] in CLIENT_LIBRARIES)
        for name, imports in reached.items()
    }
    assert {name: found for name, found in clients.items() if found} == {}
    # And at run time, through third-party imports too.
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, ratchet.records; print(sorted(sys.modules))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert not set(CLIENT_LIBRARIES) & set(ast.literal_eval(loaded))


# The check itself: each of these sources would fail the kernel test, naming the package it
# reaches into, except the last two.
@pytest.mark.parametrize(
    ("source", "reaches"),
    [
        ("import proxy.app\n", {"proxy"}),
        ("import judge as j\n", {"judge"}),
        ("from learner.service import LearnerService\n", {"learner"}),
        ("def f():\n    from proxy.routing import RoutingCache\n", {"proxy"}),
        ("class A:\n    def m(self):\n        import learner, judge\n", {"learner", "judge"}),
        (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from console import ui\n",
            {"console"},
        ),
        ("import importlib\nimportlib.import_module('judge.service')\n", {"judge"}),
        # The kernel's own modules of service-like names, and look-alike packages, are fine.
        ("from . import records\nfrom .rewards import judge_call\n", set()),
        ("import proxyish\nfrom judgement import x\nimport ratchet.proxy_names\n", set()),
    ],
)
def test_the_walk_catches_every_kind_of_import(source: str, reaches: set[str]) -> None:
    found = forbidden_imports(source, "ratchet.somewhere", NOT_FOR_THE_KERNEL)
    assert {name.split(".")[0] for name in found} == reaches


def test_relative_imports_are_resolved_against_their_package() -> None:
    assert imported_modules("from ..routing import RoutingCache\n", "proxy.log.worker") == {
        "proxy.routing",
        "proxy.routing.RoutingCache",
    }
    # In a package's __init__, `.` is the package itself.
    assert imported_modules("from .app import x\n", "proxy", is_package=True) == {
        "proxy.app",
        "proxy.app.x",
    }
