# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""The shape of ``common/``: layers only import downwards, model families only build on the family they extend,
no private name crosses modules, and every bundle config imports exactly the ``common`` modules it uses."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from common.bundle import bundle_names, demo_generator
from common.bundle_tools.registry import descriptions
from common.errors import MissingInputError

REPO = Path(__file__).resolve().parents[1]
COMMON = REPO / "common"

# a family builds on these families only (nothing else between the generic layers and the demo data)
FAMILY_BASES = {"common.vqgan": {"common.autoencoder"}, "common.xray2ct": {"common.diffusion"}}
# the families: the packages the bundles' descriptions name (the ``collection`` section of their metadata)
FAMILIES = {description.package for description in descriptions()}
# lower numbers are lower layers; a module may import from its own package or from a lower layer only. A family
# sits on the generic layers (4), one that builds on another family above it (5): a new family needs no entry here.
LAYERS = {
    "common.errors": -1,
    "common.utils": 0,
    "common.runs": 1,
    "common.data": 1,
    "common.networks": 1,
    "common.metrics": 1,
    "common.checkpoint_io": 2,
    "common.overrides": 2,
    "common.engines": 2,
    "common.handlers": 3,
    "common.config_checks": 3,
    **{family: 5 if family in FAMILY_BASES else 4 for family in FAMILIES},
    "common.demo": 6,
    "common.bundle": 7,
    "common.notebooks": 8,
    "common.bundle_tools": 8,
}


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _module_name(path: Path) -> str:
    name = ".".join(path.relative_to(REPO).with_suffix("").parts)
    return name[: -len(".__init__")] if name.endswith(".__init__") else name


def _imports(root: Path) -> list[tuple[str, str, str | None, int]]:
    """``(module, imported module, imported name or None, line)`` for every import of ``common`` under ``root``,
    including the ones inside functions."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "common":
                found += [(module, node.module, alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(module, a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "common"]
    return found


def test_every_package_has_a_layer() -> None:
    packages = {_package(_module_name(p)) for p in COMMON.rglob("*.py")} - {"common"}
    assert packages == set(LAYERS), f"add new packages of common/ to LAYERS: {sorted(packages ^ set(LAYERS))}"


def test_imports_only_point_down() -> None:
    upward = []
    for module, target, _, line in _imports(COMMON):
        source, dest = _package(module), _package(target)
        if source == dest or dest == "common":
            continue
        if LAYERS[dest] >= LAYERS[source] and dest not in FAMILY_BASES.get(source, ()):
            upward.append(f"{module}:{line} imports {target} (layer {LAYERS[dest]} >= {LAYERS[source]})")
        if source in FAMILIES and dest in FAMILIES and dest not in FAMILY_BASES.get(source, ()):
            upward.append(f"{module}:{line} imports another family, {target}")
    assert not upward, "\n".join(upward)


def _module_graph(*roots: str) -> dict[str, set[str]]:
    """Module -> the modules of ``roots`` it imports (at the top or inside a function); ``from a import b`` names the
    module ``a.b`` when that is one, else ``a``."""
    paths = {_module_name(p): p for root in roots for p in sorted((REPO / root).rglob("*.py"))}
    graph: dict[str, set[str]] = {module: set() for module in paths}
    for module, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in paths else node.module for a in node.names
                ]
            else:
                continue
            graph[module] |= {target for target in targets if target in paths and target != module}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules (Tarjan's algorithm), each as a path back to its start."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return groups


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    """No module of common/ or scripts/ reaches itself through imports, counting the ones inside functions: shared
    pieces live a floor below the modules that share them."""
    circles = _circles(_module_graph("common", "scripts"))
    assert not circles, "import circles: " + "; ".join(" <-> ".join(group) for group in circles)


def test_function_local_imports_say_why() -> None:
    """common/ imports common modules at the top; one imported inside a function (to keep a torch- or MONAI-free
    module free of them) says so in an ``imported here:`` comment on its line or the line before."""
    silent = []
    for path in sorted(COMMON.rglob("*.py")):
        lines = path.read_text().splitlines()
        for function in ast.walk(ast.parse("\n".join(lines), filename=str(path))):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                imported = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                imported += [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if any(name.split(".")[0] == "common" for name in imported):
                    said = " ".join(lines[max(node.lineno - 2, 0) : node.end_lineno])
                    if "# imported here:" not in said:
                        silent.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not silent, "function-local imports of common without an 'imported here:' comment: " + ", ".join(silent)


@pytest.mark.parametrize("root", ["common", "scripts", "tests"])
def test_no_private_name_crosses_modules(root: str) -> None:
    crossing = [
        f"{module}:{line} imports {name} from {target}"
        for module, target, name, line in _imports(REPO / root)
        if name and name.startswith("_") and not name.startswith("__") and target != module
    ]
    assert not crossing, "\n".join(crossing)


_REFERENCE = re.compile(r"(?<![\w.'\"])common(?:\.[A-Za-z_]\w*)+")


def _referenced_modules(text: str) -> set[str]:
    """The ``common`` modules named in config text (the longest dotted prefix that is a module), ignoring quoted
    strings inside expressions (e.g. the demo generator's path)."""
    found = set()
    for match in _REFERENCE.finditer(re.sub(r"'[^']*'", "''", text)):
        parts, best = match.group(0).split("."), None
        for k in range(2, len(parts) + 1):
            candidate = REPO.joinpath(*parts[:k])
            if candidate.with_suffix(".py").is_file() or (candidate / "__init__.py").is_file():
                best = ".".join(parts[:k])
        if best:
            found.add(best)
    return found


def _config_strings(config):
    if isinstance(config, dict):
        for key, value in config.items():
            if key == "imports":
                continue
            yield from ([f"${value}"] if key == "_target_" and isinstance(value, str) else _config_strings(value))
    elif isinstance(config, list):
        for value in config:
            yield from _config_strings(value)
    elif isinstance(config, str) and config.startswith("$"):  # plain strings are data (e.g. a generator's path)
        yield config


@pytest.mark.parametrize("bundle", sorted(p.name for p in (REPO / "bundles").iterdir() if p.is_dir()))
@pytest.mark.parametrize("main", ["train.json", "inference.json"])
def test_config_imports_are_what_the_configs_use(bundle: str, main: str) -> None:
    """``train.json``'s imports serve every config merged onto it (evaluate, multi-GPU, tiny, presets);
    ``inference.json``'s serve it with ``tiny.json`` and presets."""
    configs = REPO / "bundles" / bundle / "configs"
    extra = [p for p in configs.glob("*.json") if p.name not in ("train.json", "inference.json", "metadata.json")]
    if main == "inference.json":
        extra = [p for p in extra if p.name not in ("evaluate.json", "multi_gpu_train.json")]
    used: set[str] = set()
    for path in [configs / main, *extra]:
        used |= _referenced_modules("\n".join(_config_strings(json.loads(path.read_text()))))
    imports = json.loads((configs / main).read_text())["imports"]
    imported = {line.split()[-1] for line in imports if line.startswith("$import common.")}
    assert not used - imported, f"{main} uses but does not import {sorted(used - imported)}"
    assert not imported - used, f"{main} imports but does not use {sorted(imported - used)}"
    assert not any("demo" in m.split(".") for m in imported), "demo generators are imported lazily (demo_generator)"


@pytest.mark.parametrize("bundle", sorted(p.name for p in (REPO / "bundles").iterdir() if p.is_dir()))
def test_inference_takes_the_thread_count_and_leaves_the_rngs(bundle: str) -> None:
    """``--num_threads`` reaches an inference run as it reaches training (``setup_runtime`` in ``initialize``);
    inference seeds its own sampling, so the runtime step leaves the global RNGs as they are."""
    import torch
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    parser.read_config(str(REPO / "bundles" / bundle / "configs" / "inference.json"))
    assert "@runtime" in parser["initialize"][:3]  # after the run's and the settings' checks
    parser["bundle_root"] = str(REPO / "bundles" / bundle)
    parser["num_threads"] = 1
    threads, state = torch.get_num_threads(), torch.get_rng_state()
    torch.set_num_threads(2)
    try:
        parser.get_parsed_content("runtime")
        assert torch.get_num_threads() == 1
        assert torch.equal(torch.get_rng_state(), state)
    finally:
        torch.set_num_threads(threads)


def test_demo_generator() -> None:
    from common.demo.images import make_demo_dataset

    assert demo_generator("common.demo.images.make_demo_dataset") is make_demo_dataset
    with pytest.raises(MissingInputError, match=r"common\.missing_demo\.images is not here: a packaged bundle"):
        demo_generator("common.missing_demo.images.make_demo_dataset")
    with pytest.raises(AttributeError, match="no_such_generator"):
        demo_generator("common.demo.images.no_such_generator")


def test_the_json_is_the_only_pipeline() -> None:
    """The configs own the pipelines: a library function that builds a transform chain (returns a ``Compose``) is
    one a config names (postprocessing built from settings), never a Python twin of a config's list. The tests'
    step-by-step oracles of the JSON chains live in ``tests/oracles.py``."""
    configs = "\n".join(p.read_text() for p in REPO.glob("bundles/*/configs/*.json"))
    builders = []
    for path in sorted(COMMON.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.FunctionDef)
                and node.returns is not None
                and "Compose" in ast.unparse(node.returns)
            ):
                builders.append((_module_name(path), node.name))
    assert builders, "no chain builders found: the test no longer looks at the right thing"
    unnamed = [f"{module}.{name}" for module, name in builders if f"{module}.{name}" not in configs]
    assert not unnamed, f"{unnamed} build transform chains no config names (move an oracle to tests/oracles.py)"


def test_settings_checks_live_in_the_family_settings_modules() -> None:
    """A family's settings checks are in ``common/<family>/settings.py`` (its engines modules hold engines), every
    bundle config's ``check_settings`` runs one of its family's :class:`common.config_checks.SettingsChecks`, and
    every id those checks read is an id of the config (a check of a missing id is an error in the check)."""
    from monai.bundle import ConfigParser

    from common.config_checks import SettingsChecks

    misplaced = [
        f"{_module_name(path)}:{node.lineno}"
        for family in FAMILIES
        for path in sorted((REPO / family.replace(".", "/")).glob("*.py"))
        if path.name != "settings.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "SettingsChecks"
    ]
    assert not misplaced, misplaced
    checked = []
    for description in descriptions():
        configs = REPO / "bundles" / description.name / "configs"
        for names in (["train.json"], ["train.json", "evaluate.json"], ["train.json", "multi_gpu_train.json"]):
            parser = ConfigParser()
            parser.read_config([str(configs / name) for name in names])
            found = re.fullmatch(
                r"\$common\.config_checks\.check_config\((common\.\w+)\.settings\.(\w+)\)", parser["check_settings"]
            )
            assert found and found.group(1) == description.package, (description.name, names, parser["check_settings"])
            assert parser["initialize"][0] == "@check_settings", (description.name, names, parser["initialize"])
            checks = getattr(importlib.import_module(f"{found.group(1)}.settings"), found.group(2))
            assert isinstance(checks, SettingsChecks), (description.name, names)
            missing = [name for name in checks.ids if name not in parser]
            assert not missing, f"{checks!r} reads ids that {description.name}'s {names} lack: {missing}"
            checked.append(len(checks.ids))
    assert len(checked) == 3 * len(descriptions()) and min(checked) > 5


@pytest.mark.parametrize("names", [["inference.json"], ["inference.json", "multi_gpu_inference.json"]])
def test_inference_checks_its_settings_first(names: list[str]) -> None:
    """Every bundle's inference (alone and on several GPUs) runs its preamble first, its own family's ``INFERENCE``
    checks (with the overrides' check, and the hook of the ``error:`` line), before anything is loaded or written,
    and every id they read is an id of that config."""
    from monai.bundle import ConfigParser

    from common.config_checks import SettingsChecks

    for description in descriptions():
        configs = REPO / "bundles" / description.name / "configs"
        parser = ConfigParser()
        parser.read_config([str(configs / name) for name in names])
        where = (description.name, names)
        expected = f"$common.config_checks.check_config({description.package}.settings.INFERENCE)"
        assert parser["check_settings"] == expected, (*where, parser["check_settings"])
        initialize = parser["initialize"]
        assert initialize[0] == "@check_settings", (*where, initialize)
        checks = importlib.import_module(f"{description.package}.settings").INFERENCE
        assert isinstance(checks, SettingsChecks), where
        missing = [name for name in checks.ids if name not in parser]
        assert not missing, f"{checks!r} reads ids that {description.name}'s {names} lack: {missing}"
        shared = {"num_workers", "num_threads", "dist_timeout", "fail_fast", "overwrite", "progress", "distributed"}
        assert shared <= set(checks.ids), (*where, sorted(shared - set(checks.ids)))


def test_the_preamble_is_the_one_check_settings() -> None:
    """``check_settings`` names one thing, a config's preamble: no function or attribute of ``common/`` has the name,
    and ``check_config`` (the preamble's function) is called from no other config item, so the JSON alone says which
    settings checks a workflow runs and where they are."""
    named = [
        f"{_module_name(path)}:{node.lineno}"
        for path in sorted((REPO / "common").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == "check_settings"
    ]
    assert not named, named
    elsewhere = []
    for path in sorted(REPO.glob("bundles/*/configs/*.json")):
        for key, value in json.loads(path.read_text(encoding="utf-8")).items():
            if key != "check_settings" and "check_config(" in json.dumps(value):
                elsewhere.append(f"{path.relative_to(REPO)}:{key}")
    assert not elsewhere, elsewhere


def test_no_table_of_bundles_outside_the_bundle_cases() -> None:
    """A per-bundle table (a literal naming two or more bundles) lives only in tests/bundle_cases.py; everything
    else derives its tables from it or from the bundles' folders, so adding a bundle touches its folder and its
    case only. What a family does (its input layout, its inference network) is looked up by the family."""
    names = set(bundle_names())
    found = []
    for root in ("common", "scripts", "tests"):
        for path in sorted((REPO / root).rglob("*.py")):
            if path == REPO / "tests" / "bundle_cases.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.Dict, ast.List, ast.Tuple, ast.Set)):
                    items = node.keys if isinstance(node, ast.Dict) else node.elts
                    listed = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
                    if len(listed) >= 2:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} lists {sorted(listed)}")
    assert not found, found
