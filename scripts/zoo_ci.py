# Copyright (c) the 3D MONAI bundle collection contributors.
# Licensed under the Apache License, Version 2.0.
"""Run the MONAI model zoo's own CI (``ci/verify_bundle.py`` of Project-MONAI/model-zoo, unmodified, full mode, as
its GPU premerge runs it: ``python ci/verify_bundle.py --b <bundle>`` from the zoo's root) on packaged bundles, and
report its real result per check.

Each package is unzipped into a copy of the zoo's layout (``ci/``, ``models/model_info.json``,
``models/<bundle>/``) and verified twice: with the zoo's ``ci/bundle_custom_data.py`` as it is, and with the entries
a submission adds to its lists (``exclude_verify_shape_list``, ``exclude_verify_torchscript_list``), derived from
the bundle's ``metadata.json`` ``model_zoo_ci_exclusions`` (``verify_data_shape``, ``verify_torchscript``: the
reason). ``--submission True`` prints those lines. The zoo's script stops at its first failure, so each check is
``passed``, ``failed`` (the first error: its headline and the deepest source location), ``skipped`` (in the zoo's
list) or ``not reached``.

A declared exclusion is confirmed only when, with the bundle's other exclusions applied, the zoo's script fails at
that check and the error contains a fragment the reason quotes in backticks (a file, a message); an exclusion of a
check that passes, or a reason the error does not bear out, is reported and makes the exit status 1, as does any
check that fails with the submission's lines applied.

``properties``: the zoo checks a bundle's inference workflow against the ``bundle_properties.py`` of each app named
in ``supported_apps`` found in the zoo's tree; the zoo snapshot has none (``all properties:  []``), so it passes
checking nothing, and the table says so. The column ``properties (MONAI)`` runs the zoo's own ``check_properties``
with MONAI's ``InferProperties`` and ``MetaProperties``, what such a file holds. The column ``ckpt_export (trace)``
is MONAI's ``ckpt_export network --use_trace True`` of the shipped weights, the export every model card documents.
Nothing is downloaded: the metadata schema is the local copy and the weights travel inside the packages
(``--weights_inside True``). Example::

    python scripts/zoo_ci.py dist/*.zip --zoo /path/to/model-zoo --output zoo_ci.json --submission True
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common.bundle import ROOT
from common.bundle_tools.package import extract_bundle
from common.errors import UserError

__all__ = ["CHECKS", "LISTS", "main", "run_checks", "submission_lines", "with_entries"]

SCHEMA = ROOT / "tests" / "data" / "meta_schema_20240725.json"
CHECKS = ("directory", "version", "metadata", "properties", "data_shape", "torchscript")
EXTRA = ("properties (MONAI)", "ckpt_export (trace)")
# what ci/verify_bundle.py prints after each check, and when one of its lists skips a check
_PASSED = {
    "directory": "directory is verified correctly.",
    "version": "version and changelog are verified correctly.",
    "metadata": "metadata format is verified correctly.",
    "properties": "properties are verified correctly.",
    "data_shape": "data shape is verified correctly.",
    "torchscript": "export weights into TorchScript module successfully.",
}
_SKIPPED = {"data_shape": "skip verifying the data shape of bundle", "torchscript": "does not support torchscript"}
_NO_PROPERTIES = "all properties:  []"
# model_zoo_ci_exclusions key -> (check, the zoo's list)
LISTS = {
    "verify_data_shape": ("data_shape", "exclude_verify_shape_list"),
    "verify_torchscript": ("torchscript", "exclude_verify_torchscript_list"),
}
_PROPERTIES_FILE = "from monai.bundle.properties import InferProperties, MetaProperties  # noqa: F401\n"
_PROPERTIES_DRIVER = """
import os, sys
import verify_bundle as vb  # the zoo's ci/ is on PYTHONPATH
bundle_path, properties = sys.argv[1:3]
configs = os.path.join(bundle_path, "configs")
vb.check_properties(workflow_type="inference", bundle_root=bundle_path, properties_path=properties,
                    config_file=os.path.join(configs, vb._find_bundle_file(configs, "inference")),
                    logging_file=os.path.join(configs, "logging.conf"), meta_file=os.path.join(configs, "metadata.json"))
"""


def _env() -> dict[str, str]:
    """Only the installed packages importable (each bundle brings its own ``common/``), one thread."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _run(cmd: list[str], cwd: Path, **env: str) -> tuple[int, str]:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**_env(), **env}, timeout=1200)
    return result.returncode, (result.stdout + result.stderr).replace(f"{cwd}{os.sep}", "")  # paths as the zoo's


def first_error(text: str) -> tuple[str, str]:
    """The headline (``Type: message``) and deepest source location (``path:line``) of the last traceback in
    ``text``; paths are shortened to what follows ``site-packages/`` or ``models/``."""
    body = text[text.rfind("Traceback (most recent call last)") :] if "Traceback" in text else text
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    headline = "(no error printed)"
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)(:|$)", line):
            headline = line if not line.endswith(":") or i + 1 == len(lines) else f"{line} {lines[i + 1]}"
    frames = re.findall(r'File "([^"]+)", line (\d+)', body)
    where = ""
    if frames:
        path, line = frames[-1]
        path = path.replace("\\", "/")
        path = re.split(r"site-packages/|/models/", path)[-1]
        where = f"{path}:{line}"
    return headline[:300], where


def _checks(rc: int, text: str) -> dict[str, tuple[str, str]]:
    """Each check's status from what one run of the zoo's script printed."""
    row, failed = {}, False
    for check in CHECKS:
        if failed:
            row[check] = ("not reached", "")
        elif _SKIPPED.get(check, "\0") in text:
            row[check] = ("skipped", "in the zoo's list")
        elif _PASSED[check] in text:
            nothing = check == "properties" and (_NO_PROPERTIES in text or "all properties:" not in text)
            row[check] = ("passed", "checked nothing: no app of supported_apps has properties in the zoo" * nothing)
        elif rc != 0:
            headline, where = first_error(text)
            row[check], failed = ("failed", f"{headline} ({where})" if where else headline), True
        else:
            row[check] = ("not reached", "")  # a mode that stops early
    if rc != 0 and not failed:
        row[CHECKS[-1]] = ("failed", " ".join(first_error(text)))  # after its last marker (e.g. loading model.ts)
    return row


def with_entries(text: str, entries: dict[str, list[str]], source: str = "ci/bundle_custom_data.py") -> str:
    """``text`` of the zoo's ``bundle_custom_data.py`` with ``entries`` (``{list name: [bundle, ...]}``) added as the
    first items of those list literals, one ``    "<bundle>",`` line each."""
    for name, bundles in entries.items():
        match = re.search(rf"^{re.escape(name)} = \[\n", text, flags=re.M)
        if match is None:
            raise UserError(f"{source}: no list literal '{name} = [' to add {bundles} to.")
        lines = "".join(f'    "{bundle}",\n' for bundle in bundles)
        text = text[: match.end()] + lines + text[match.end() :]
    return text


def _declared(bundle: str, meta: dict) -> dict[str, str]:
    declared = meta.get("model_zoo_ci_exclusions") or {}
    unknown = sorted(set(declared) - set(LISTS))
    if unknown:
        raise UserError(
            f"{bundle}/configs/metadata.json: model_zoo_ci_exclusions has {unknown}; the zoo's lists are {sorted(LISTS)}."
        )
    return declared


def submission_lines(declared: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """``{list name: [line, ...]}``: the lines a submission adds to the zoo's ``ci/bundle_custom_data.py`` for
    ``declared`` (``{bundle: model_zoo_ci_exclusions}``)."""
    lines: dict[str, list[str]] = {}
    for bundle, keys in declared.items():
        for key in keys:
            lines.setdefault(LISTS[key][1], []).append(f'    "{bundle}",')
    return lines


class _Zoo:
    """A copy of the zoo's layout in ``work``: ``ci/`` and ``models/model_info.json`` from ``zoo``."""

    def __init__(self, zoo: Path, work: Path):
        for needed in ("ci/verify_bundle.py", "ci/bundle_custom_data.py", "models/model_info.json"):
            if not (zoo / needed).is_file():
                raise UserError(f"{zoo}: no {needed}; --zoo takes a checkout of Project-MONAI/model-zoo.")
        self.work, self.models = work, work / "models"
        shutil.rmtree(work / "ci", ignore_errors=True)
        shutil.copytree(zoo / "ci", work / "ci")
        self.models.mkdir(parents=True, exist_ok=True)
        shutil.copy(zoo / "models" / "model_info.json", self.models / "model_info.json")
        self.custom_data = (work / "ci" / "bundle_custom_data.py").read_text()

    def place(self, package: str) -> tuple[str, dict]:
        """Unzip ``package`` into ``models/`` with the schema copy the zoo's ``ci/prepare_schema.py`` downloads."""
        bundle_dir = extract_bundle(package, self.models, overwrite=True)
        meta = json.loads((bundle_dir / "configs" / "metadata.json").read_text())
        if Path(str(meta.get("schema", ""))).name != SCHEMA.name:
            raise UserError(f"{package}: metadata 'schema' is {meta.get('schema')!r}; only {SCHEMA.name} is here.")
        (bundle_dir / "eval").mkdir(exist_ok=True)
        shutil.copy(SCHEMA, bundle_dir / "eval" / "schema.json")
        return bundle_dir.name, meta

    def verify(self, bundle: str, keys: list[str]) -> dict[str, tuple[str, str]]:
        """The zoo's script on ``bundle`` with ``keys`` (``model_zoo_ci_exclusions`` keys) in the zoo's lists."""
        entries: dict[str, list[str]] = {}
        for key in keys:
            entries.setdefault(LISTS[key][1], []).append(bundle)
        (self.work / "ci" / "bundle_custom_data.py").write_text(with_entries(self.custom_data, entries))
        try:
            rc, text = _run([sys.executable, "ci/verify_bundle.py", "--b", bundle], self.work)
        finally:
            (self.work / "ci" / "bundle_custom_data.py").write_text(self.custom_data)
        return {**_checks(rc, text), "_text": ("", text)}

    def monai_properties(self, bundle: str) -> tuple[str, str]:
        folder = self.work / "properties"
        folder.mkdir(exist_ok=True)
        (folder / "bundle_properties.py").write_text(_PROPERTIES_FILE)
        cmd = [
            sys.executable,
            "-c",
            _PROPERTIES_DRIVER,
            str(self.models / bundle),
            str(folder / "bundle_properties.py"),
        ]
        try:
            rc, text = _run(cmd, self.work, PYTHONPATH=str(self.work / "ci"))
        finally:
            (self.work / "ci" / "bundle_properties.py").unlink(missing_ok=True)  # where check_properties copies it
        if rc == 0 and "check properties for workflow successfully" in text:
            return "passed", ""
        return "failed", " ".join(first_error(text)).strip()

    def trace_export(self, bundle: str) -> tuple[str, str]:
        from common.bundle_tools.export import default_input_shape

        bundle_dir = self.models / bundle
        shape = default_input_shape(bundle_dir)  # the bundle folder's own configs (bundle_root is bundle_dir)
        cmd = [sys.executable, "-m", "monai.bundle", "ckpt_export", "network"]
        cmd += ["--filepath", str(bundle_dir / "models" / "trace_check.ts")]
        cmd += ["--ckpt_file", str(bundle_dir / "models" / "model.pt"), "--bundle_root", str(bundle_dir)]
        cmd += ["--meta_file", str(bundle_dir / "configs" / "metadata.json")]
        cmd += ["--config_file", str(bundle_dir / "configs" / "inference.json")]
        cmd += ["--use_trace", "True", "--input_shape", json.dumps(shape)]
        rc, text = _run(cmd, bundle_dir)
        (bundle_dir / "models" / "trace_check.ts").unlink(missing_ok=True)
        return ("passed", "") if rc == 0 else ("failed", " ".join(first_error(text)).strip())


def _confirm(check: str, reason: str, run: dict) -> str:
    """Why a declared exclusion is not borne out by ``run`` (the zoo's script with the other exclusions), or ``""``."""
    status, detail = run[check]
    if status != "failed":
        return f"declared excluded, but with the other exclusions the zoo's {check} check is {status}"
    quoted = re.findall(r"`([^`]+)`", reason)
    text = run["_text"][1].replace("\\", "/")
    if not any(fragment in text for fragment in quoted):
        return f"the reason quotes {quoted or 'nothing in backticks'}, not found in the real error: {detail}"
    return ""


def run_checks(
    zoo: str | os.PathLike, packages: list[str], work_dir: str | os.PathLike, extra: bool = True
) -> dict[str, dict]:
    """Verify each package with the zoo's unmodified script, as the zoo is and with the submission's list entries.

    Returns:
        ``{bundle: {"as_is": row, "submission": row, "extra": row, "declared": {key: {"reason", "problem"}}}}``; a
        row maps each check to ``(status, detail)``; ``problem`` is ``""`` for a confirmed reason.

    Args:
        zoo: a checkout of Project-MONAI/model-zoo (its ``ci/`` and ``models/model_info.json`` are used).
        packages: bundle zips made by ``scripts/package_bundle.py``.
        work_dir: receives the zoo's layout (``ci/``, ``models/<bundle>/``).
        extra: also run the columns :data:`EXTRA`.
    """
    layout = _Zoo(Path(zoo), Path(work_dir))
    results: dict[str, dict] = {}
    for package in packages:
        bundle, meta = layout.place(package)
        declared = _declared(bundle, meta)
        runs = {(): layout.verify(bundle, [])}
        keys = tuple(declared)
        if keys not in runs:
            runs[keys] = layout.verify(bundle, list(keys))
        confirmed = {}
        for key in keys:
            others = tuple(k for k in keys if k != key)
            if others not in runs:
                runs[others] = layout.verify(bundle, list(others))
            confirmed[key] = {"reason": declared[key], "problem": _confirm(LISTS[key][0], declared[key], runs[others])}
        row = {"as_is": runs[()], "submission": runs[keys], "declared": confirmed}
        if extra:
            row["extra"] = {EXTRA[0]: layout.monai_properties(bundle), EXTRA[1]: layout.trace_export(bundle)}
        for kind in ("as_is", "submission"):
            row[kind] = {c: row[kind][c] for c in CHECKS}  # the text stays out of the report
        results[bundle] = row
        print(f"{bundle}: " + ", ".join(f"{c} {s}" for c, (s, _) in row["submission"].items()), file=sys.stderr)
    return results


def report(results: dict[str, dict]) -> tuple[list[str], bool]:
    """Markdown lines for ``results`` and whether the submission passes (every check, every reason confirmed)."""
    ok = True
    lines = []
    for kind, title in (("as_is", "The zoo's lists as they are"), ("submission", "With the submission's lines")):
        columns = CHECKS + (EXTRA if kind == "submission" and all("extra" in r for r in results.values()) else ())
        lines += [f"### {title}", "", "| bundle | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        notes = []
        for bundle, row in results.items():
            cells = {**row[kind], **(row.get("extra", {}) if len(columns) > len(CHECKS) else {})}
            lines.append(f"| {bundle} | " + " | ".join(cells[c][0] for c in columns) + " |")
            notes += [f"- {bundle} / {c}: {cells[c][1]}" for c in columns if cells[c][1]]
            if kind == "submission":
                ok &= all(cells[c][0] in ("passed", "skipped") for c in columns)
        lines += ["", *notes, ""] if notes else [""]
    problems = [
        f"- {bundle} / {key}: {d['problem']}" for bundle, r in results.items() for key, d in r["declared"].items()
    ]
    problems = [p for p in problems if not p.endswith(": ")]
    ok &= not any(d["problem"] for r in results.values() for d in r["declared"].values())
    return lines + (["### Declared exclusions not borne out", "", *problems, ""] if problems else []), ok


def main(
    *packages: str, zoo: str, work_dir: str | None = None, output: str | None = None, submission: bool = False
) -> None:
    """Print the tables of :func:`run_checks` (and write them as JSON to ``output``); exit with status 1 when a
    check fails with the submission's lines or a declared reason is not borne out.

    Args:
        packages: bundle zips made by ``scripts/package_bundle.py``.
        zoo: a checkout of Project-MONAI/model-zoo.
        work_dir: where the zoo layout is made (default: a temporary folder).
        output: a JSON file receiving the results.
        submission: also print the lines to add to the zoo's ``ci/bundle_custom_data.py``, with the reasons.
    """
    if not packages:
        raise SystemExit("error: name the bundle zips to verify (made by scripts/package_bundle.py)")
    try:
        with tempfile.TemporaryDirectory(prefix="zoo_ci_") as tmp:
            results = run_checks(zoo, [str(p) for p in packages], work_dir or tmp)
    except UserError as e:
        raise SystemExit(f"error: {e}") from None
    lines, ok = report(results)
    if submission:
        declared = {bundle: {k: d["reason"] for k, d in r["declared"].items()} for bundle, r in results.items()}
        lines += ["### Lines to add to ci/bundle_custom_data.py", ""]
        for name, entries in submission_lines(declared).items():
            lines += ["```python", f"{name} = [", *entries, "```"]
        lines += [""] + [f"- {b} / {k}: {reason}" for b, keys in declared.items() for k, reason in keys.items()]
    print("\n".join(lines))
    if output:
        Path(output).write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    from common.bundle import checkout_problem

    if problem := checkout_problem(__file__):  # another checkout's code would run
        raise SystemExit(f"error: {problem}")
    import fire

    fire.Fire(main)
