"""The layering is a property of the code: imports run downward, capture records are frozen.

Every import of an npugraph module is read from the source (function-level and
``TYPE_CHECKING`` ones included) and checked against the layers below.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import attrs
import pytest

from npugraph.capture import CapturedGraph, TaskRecord

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOT = REPO / "npugraph"
SIM_ROOT = REPO / "npusim" / "npusim"  # the simulator's distribution (npusim/) holds its package
PACKAGES = ("npugraph", "npusim")

# Lower layers first. A module may import its own package and anything in a lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("npusim", "npugraph.errors", "npugraph._version"),
    ("npugraph.sim",),  # the simulator's former name, an alias of npusim
    ("npugraph.files", "npugraph.device", "npugraph.reference"),
    ("npugraph.metadata",),  # a step's metadata and the padding rule: what kernels and the updater read
    ("npugraph.ops",),
    ("npugraph.policy",),  # choosing a kernel is pure: below capture
    ("npugraph.capture",),
    ("npugraph.replay",),
    ("npugraph.dump",),  # reads the core's state; the core never imports it
    ("npugraph.runtime",),
    ("npugraph.attention",),
    ("npugraph.models", "npugraph.integrations"),
    ("npugraph.tools", "npugraph.bench"),  # run models on the runtime
    ("npugraph.cli",),
    ("npugraph",),
]
CORE = ("npugraph.capture", "npugraph.replay")

# Inside the simulator (the lowest layer), its rooms, lower first: what a device is, CANN's
# runtime rules, kernels, the surfaces other people's code imports, then the two faces
# torch_npu has at its top (``torch_npu.npu`` is ``npusim.npu``, ``torch_npu`` the package).
SIM_LAYERS: list[tuple[str, ...]] = [
    ("npusim.errors",),  # every room raises them
    ("npusim.device",),
    ("npusim.runtime",),
    ("npusim.kernels",),
    ("npusim.surfaces",),
    ("npusim.npu",),
    ("npusim",),
]


def _module_name_at(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name_at(p, root.parent): p for root in (ROOT, SIM_ROOT) for p in sorted(root.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str, modules: dict[str, pathlib.Path]) -> str:
    """The npugraph or npusim module an import name refers to (a submodule if one exists, else its package)."""
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def _imports(path: pathlib.Path, own: str, modules: dict[str, pathlib.Path] = MODULES) -> list[tuple[str, int, bool]]:
    """(imported npugraph or npusim module, line, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:  # imports under `if TYPE_CHECKING:` count as module level
        if isinstance(n, ast.If):
            top |= {id(x) for x in ast.walk(n)}
    out = []
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{a.name}" for a in node.names] if base.startswith(PACKAGES) else [base]
        for name in names:
            if name.split(".")[0] in PACKAGES:
                out.append((_resolve(name, modules), node.lineno, id(node) in top))
    return out


GRAPH = {mod: _imports(path, mod) for mod, path in MODULES.items()}


def _package(mod: str, layers: list[tuple[str, ...]] = LAYERS) -> str:
    """The longest layer entry ``mod`` belongs to (``npusim`` for ``npusim.kernels.pa``)."""
    return max((p for g in layers for p in g if mod == p or mod.startswith(p + ".")), key=len, default="")


def _layer(mod: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    pkg = _package(mod, layers)
    return next((i for i, group in enumerate(layers) if pkg in group), -1)


def _upward_imports(
    graph: dict[str, list[tuple[str, int, bool]]], layers: list[tuple[str, ...]], within: str = "npugraph"
) -> list[str]:
    """Every import, among the modules under ``within``, of a module that is not in a lower
    layer than the importer (a module may import its own layer entry's modules)."""
    bad = []
    inside = [m for m in graph if m == within or m.startswith(within + ".")]
    for m in inside:
        for t, line, _ in graph[m]:
            if not (t == within or t.startswith(within + ".")) or _package(t, layers) == _package(m, layers):
                continue
            if _layer(t, layers) >= _layer(m, layers):
                bad.append(f"{m}:{line} imports {t}, which is not below it")
    return bad


def test_every_module_has_a_layer():
    assert all(_layer(m) >= 0 for m in MODULES), [m for m in MODULES if _layer(m) < 0]


def test_no_import_cycles():
    edges = {m: sorted({t for t, _, _ in GRAPH[m] if t != m}) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in edges[m]:
            if state.get(t) == 1:
                cycles.append([*stack[stack.index(t) :], t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
    assert cycles == [], "\n".join(" -> ".join(c) for c in cycles)


# The tools that model and measure on the simulator: they import npusim at module level, and
# the CLI imports them in the one command that uses them (`npugraph bench`), so that its other
# commands run where npusim is not installed (an Ascend host).  Nothing else of npugraph but
# the simulator's former name (npugraph.sim) imports npusim.
SIMULATOR_TOOLS = ("npugraph.bench",)


def test_no_function_level_imports_of_npugraph():
    bad = [
        f"{m}:{line} imports {t} inside a function"
        for m, imps in GRAPH.items()
        if m.startswith("npugraph")
        for t, line, top in imps
        if not top and t.startswith("npugraph") and not (m == "npugraph.cli" and _package(t) in SIMULATOR_TOOLS)
    ]
    assert bad == [], "\n".join(bad)


def test_only_the_simulator_tools_import_the_simulator():
    importers = {
        _package(m)
        for m, imps in GRAPH.items()
        if m.startswith("npugraph")
        for t, _, _ in imps
        if t.startswith("npusim")
    }
    assert importers == {*SIMULATOR_TOOLS, "npugraph.sim"}, importers


def test_imports_only_run_downward():
    bad = _upward_imports(GRAPH, LAYERS)
    assert bad == [], "\n".join(bad)


def test_every_simulator_module_is_in_a_room():
    sim = [m for m in MODULES if m.startswith("npusim")]
    assert all(_layer(m, SIM_LAYERS) >= 0 for m in sim), [m for m in sim if _layer(m, SIM_LAYERS) < 0]


def test_the_simulators_imports_run_from_surfaces_to_kernels_to_runtime_to_device():
    bad = _upward_imports(GRAPH, SIM_LAYERS, within="npusim")
    assert bad == [], "\n".join(bad)


def test_the_simulators_top_holds_few_modules_and_its_rooms_are_packages():
    top = [p.name for p in SIM_ROOT.glob("*.py")]
    rooms = [p.name for p in SIM_ROOT.iterdir() if (p / "__init__.py").exists()]
    assert len(top) <= 10, top
    assert sorted(rooms) == sorted(g[0].rpartition(".")[2] for g in SIM_LAYERS[1:5]), rooms
    for room in rooms:  # each says what it models and what it must not know
        doc = ast.get_docstring(ast.parse((SIM_ROOT / room / "__init__.py").read_text()))
        assert doc and len(doc) > 200, room


def test_the_room_checker_reports_a_lower_room_importing_a_higher_one(tmp_path):
    # the device importing the runtime, and a kernel importing a surface: both reported;
    # the runtime importing the device and a kernel importing the runtime are not
    sim = tmp_path / "npusim"
    files = {
        "__init__.py": "",
        "errors.py": "",
        "device/__init__.py": "",
        "device/backend.py": "from npusim.runtime import state\n",
        "runtime/__init__.py": "",
        "runtime/state.py": "from npusim.device import backend\nfrom npusim import errors\n",
        "kernels/__init__.py": "",
        "kernels/pa.py": "from npusim.runtime import state\nfrom npusim.surfaces.torch_ops import x\n",
        "surfaces/__init__.py": "",
        "surfaces/torch_ops.py": "from npusim.kernels import pa\n",
    }
    for name, text in files.items():
        (sim / name).parent.mkdir(parents=True, exist_ok=True)
        (sim / name).write_text(text)
    mods = {_module_name_at(p, tmp_path): p for p in sim.rglob("*.py")}
    graph = {m: _imports(p, m, mods) for m, p in mods.items()}
    assert sorted(_upward_imports(graph, SIM_LAYERS, within="npusim")) == [
        "npusim.device.backend:1 imports npusim.runtime.state, which is not below it",
        "npusim.kernels.pa:2 imports npusim.surfaces.torch_ops, which is not below it",
    ]


def test_the_simulator_imports_nothing_of_npugraph():
    bad = [
        f"{m}:{line} imports {t}"
        for m, imps in GRAPH.items()
        if m.startswith("npusim")
        for t, line, _ in imps
        if not t.startswith("npusim")
    ]
    assert bad == [], bad


@pytest.mark.parametrize(
    "forbidden",
    [
        "npugraph.runtime",
        "npugraph.models",
        "npugraph.cli",
        "npugraph.dump",
        "npugraph.integrations",
        "npugraph.tools",
    ],
)
def test_the_core_knows_no_runtime_engine_model_cli_or_dump_tool(forbidden):
    bad = [
        f"{m}:{line} imports {t}"
        for m, imps in GRAPH.items()
        if m.startswith(CORE)
        for t, line, _ in imps
        if t == forbidden or t.startswith(forbidden + ".")
    ]
    assert bad == [], bad


def test_the_checker_sees_module_and_function_level_imports(tmp_path):
    pkg = tmp_path / "npugraph"
    (pkg / "capture").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "capture" / "__init__.py").write_text("from npugraph.runtime import Runtime\n")
    (pkg / "runtime.py").write_text("def f():\n    from npugraph.capture import x\n")
    mods = {_module_name_at(p, tmp_path): p for p in pkg.rglob("*.py")}
    imps = {m: _imports(p, m, mods) for m, p in mods.items()}
    assert ("npugraph.runtime", 1, True) in imps["npugraph.capture"]
    assert ("npugraph.capture", 2, False) in imps["npugraph.runtime"]


def test_capture_records_are_frozen():
    for cls in (TaskRecord, CapturedGraph):
        assert attrs.has(cls) and cls.__setattr__ is not object.__setattr__
        inst = object.__new__(cls)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            inst.index = 1  # type: ignore[attr-defined]


# The core: capture, update, kernel declarations, the kernel choice and the facade.  What the
# simulator adds over torch_npu (names in reports, its task groups, its pool sizes, its slower
# fused update) reaches them only through the device adapter (npugraph/device).
SIM_FREE = ("npugraph.capture", "npugraph.replay", "npugraph.ops", "npugraph.policy", "npugraph.runtime")
# an attribute or getattr/hasattr name that only the simulator's objects have, or that says "simulator"
SIM_NAMES = {"is_sim", "_group", "label"}


def _error_fields() -> set[str]:
    """The fields the simulator's errors carry (each ``self.X = `` in npusim/errors.py): only the
    device adapter reads them (``Device.fault_info``), the rest of npugraph its neutral record."""
    tree = ast.parse((SIM_ROOT / "errors.py").read_text())
    return {
        t.attr
        for node in ast.walk(tree)
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


SIM_ERROR_FIELDS = _error_fields()
# also the names of npugraph's own records' attributes (a captured graph's device graph, a
# task's event, the adapter's task_group): read as a getattr string or a dict key only
SHARED_NAMES = {"graph", "event", "task_group"}


def _simulator_names(path: pathlib.Path) -> list[str]:
    """Each place in ``path`` that imports the simulator or reads or writes a name of the
    simulator's objects (as an attribute or a getattr/hasattr/setattr string)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n == "sim" or "npusim" in n or n == "npusim" or n.startswith("npusim.") for n in names):
                found.append(f"{path.name}:{node.lineno} imports the simulator")
        elif isinstance(node, ast.Attribute) and node.attr in SIM_NAMES | (SIM_ERROR_FIELDS - SHARED_NAMES):
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in SIM_NAMES | SIM_ERROR_FIELDS
        ):
            found.append(f"{path.name}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
        elif (  # a key of the simulator's hang report (its blocked streams' dicts)
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in SIM_ERROR_FIELDS
        ):
            found.append(f"{path.name}:{node.lineno} .get({node.args[0].value!r})")
    return found


def test_the_core_knows_no_simulator():
    bad = [f"{m}: {hit}" for m, p in MODULES.items() if m.startswith(SIM_FREE) for hit in _simulator_names(p)]
    assert bad == [], bad


def test_the_simulator_check_sees_what_the_core_used_to_do(tmp_path):
    """The four ways the core once knew the simulator, each caught."""
    src = tmp_path / "manager.py"
    src.write_text(
        "from npugraph import sim\n"
        "if hasattr(event, 'label'):\n    event.label = 'x'\n"
        "g = getattr(t.handle, '_group', None)\n"
        "fused = not self.device.is_sim\n"
        "for b in getattr(hang, 'blocked', ()):\n    g = b.get('graph')\n"
        "skipped = fault.waits_skipped\n"
    )
    hits = _simulator_names(src)
    assert sorted(hits) == [
        "manager.py:1 imports the simulator",
        "manager.py:2 hasattr(..., 'label')",
        "manager.py:3 .label",
        "manager.py:4 getattr(..., '_group')",
        "manager.py:5 .is_sim",
        "manager.py:6 getattr(..., 'blocked')",
        "manager.py:7 .get('graph')",
        "manager.py:8 .waits_skipped",
    ], hits
    # every field the simulator's errors carry is known to the check
    assert {"blocked", "waits_skipped", "others", "graph", "event", "task_group"} <= SIM_ERROR_FIELDS


# Run in a fresh interpreter (this one has the simulator loaded): the simulator's modules
# loaded after each step, as JSON.
_COUNT_SIMULATOR_MODULES = r"""
import json, sys
def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "npusim" or m.startswith("npugraph.sim"))
counts = {}
import npugraph
counts["import npugraph"] = loaded()
import npugraph.integrations.vllm
counts["import npugraph.integrations.vllm"] = loaded()
import npugraph.integrations.sglang
counts["import npugraph.integrations.sglang"] = loaded()
from npugraph.errors import DeviceUnavailable
try:
    npugraph.Runtime("npu", max_model_len=64)
except DeviceUnavailable:
    pass  # no torch_npu here: refused, as on any host without one
counts["Runtime('npu') refused"] = loaded()
npugraph.Runtime("sim", max_model_len=64)
counts["Runtime('sim')"] = loaded()
import npugraph.sim, npusim
counts["npugraph.sim is npusim"] = npugraph.sim is npusim
print(json.dumps(counts))
"""


def test_npugraph_and_its_engine_integrations_load_no_simulator_module():
    """An Ascend host gets none of the simulator: ``import npugraph``, its vLLM and SGLang
    integrations and ``Runtime("npu")`` load no npusim module; ``Runtime("sim")`` loads it, and
    the simulator's former name, ``npugraph.sim``, is that same module."""
    env = {k: v for k, v in os.environ.items() if k not in ("NPUGRAPH_SIM_TORCH_NPU", "NPUSIM_TORCH_NPU")}
    done = subprocess.run(
        [sys.executable, "-c", _COUNT_SIMULATOR_MODULES], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    for step in ("import npugraph", "import npugraph.integrations.vllm", "import npugraph.integrations.sglang"):
        assert counts[step] == [], (step, counts[step][:5])
    assert counts["Runtime('npu') refused"] == []
    assert "npusim.kernels.fia" in counts["Runtime('sim')"]
    assert counts["npugraph.sim is npusim"] is True


# A function longer than this does several things: split it into the things it does.
MAX_FUNCTION_LINES = 80


def _long_functions(paths, base=REPO):
    found = []
    for p in paths:
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{p.relative_to(base)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_of_npugraph_npusim_or_the_release_checks_is_over_80_lines():
    roots = (ROOT, SIM_ROOT, REPO / "release")
    long = _long_functions(p for root in roots for p in sorted(root.rglob("*.py")))
    assert long == [], long


def test_the_length_check_sees_a_long_function(tmp_path):
    src = tmp_path / "long.py"
    src.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert _long_functions([src], tmp_path) == [f"long.py:5 long ({MAX_FUNCTION_LINES + 1} lines)"]


# The two rooms a step goes through most, kept to a size a reader holds (issue 69)
MOST_MODULE_LINES = {"npugraph/capture/manager.py": 550, "npugraph/replay/updater.py": 600}


def test_the_capture_manager_and_the_updater_stay_readable():
    long = {f: n for f, most in MOST_MODULE_LINES.items() if (n := len((REPO / f).read_text().splitlines())) >= most}
    assert long == {}, long
