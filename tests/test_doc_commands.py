"""Every command the docs quote parses: its program exists, and each flag it passes is one
that program's parser knows (so docs and command lines cannot drift apart)."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
import warnings
from functools import cache
from pathlib import Path

import pytest

from benchmarks import bench
from mgrit.app import cli

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAG = re.compile(r"^--?[A-Za-z][\w-]*")


def quoted(text: str) -> list[str]:
    """Command lines in a page: the lines of its shell blocks (continuations joined) and its
    inline code spans."""
    out, fenced, shell, logical = [], False, False, ""
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            shell = fenced and line.strip() in ("```sh", "```bash", "```console")
            continue
        if not fenced:
            out += re.findall(r"`([^`\n]+)`", line)
        elif shell:
            logical += line.strip()
            if logical.endswith("\\"):
                logical = logical[:-1] + " "
                continue
            out.append(logical)
            logical = ""
    return [c.split(" #")[0].strip() for c in out if c.strip()]


def program(command: str) -> tuple[str, list[str]] | None:
    """(program, its arguments) of a quoted command, or None where it is no command of
    this project's: `mgrit`, `python -m MODULE` (of mgrit or benchmarks), `make`, or
    any of these under `mpiexec -n P python -m mpi4py`."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):      # MGRIT_NATIVE=torch ...
        words = words[1:]
    if words[:1] == ["mpiexec"]:
        words = words[3:] if words[1:2] == ["-n"] else []
        if words[:3] == ["python", "-m", "mpi4py"]:
            words = words[3:]
            if words and words[0].endswith(".py"):
                return None                                          # the user's own script
            words = ["python", *words]
    # "..." stands for any further arguments (`mgrit ...`)
    words = [w.removeprefix(".venv/bin/") for w in words if w != "..."]
    if words[:1] == ["mgrit"]:
        return ("mgrit", words[1:])
    if words[:1] == ["python"] and words[1:2] == ["-m"] and len(words) > 2:
        module = words[2]
        if module == "mgrit":
            return ("mgrit", words[3:])
        if module.split(".")[0] in ("mgrit", "benchmarks"):
            return (module, words[3:])
    if words[:1] == ["make"]:
        return ("make", words[1:])
    return None


def commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        for command in quoted(page.read_text()):
            parsed = program(command)
            if parsed:
                found.append((f"{page.name}: {command}", *parsed))
    return found


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


@cache
def module_flags(module: str) -> set[str] | None:
    """The flags `python -m MODULE --help` lists, read in this process; None when the
    module has no command line."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [module, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit), \
                warnings.catch_warnings():
            # runpy warns that the package imported the module first; it runs it anyway
            warnings.simplefilter("ignore", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    finally:
        sys.argv = argv
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", out.getvalue()))


def flags_of(words: list[str]) -> list[str]:
    return [FLAG.match(w).group(0) for w in words if FLAG.match(w)]


CASES = commands()


def test_the_docs_quote_commands_of_every_kind():
    kinds = {p if p in ("mgrit", "make") else p.split(".")[0] for _, p, _ in CASES}
    # the extraction itself: a page set without these would mean the reader broke
    assert {"mgrit", "make", "benchmarks"} <= kinds, kinds


@pytest.mark.parametrize("where,prog,words", CASES, ids=[c[0][:80] for c in CASES])
def test_quoted_command_parses(where, prog, words):
    if prog == "make":
        makefile = (ROOT / "Makefile").read_text()
        targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
        for word in words:
            if "=" in word or word.startswith("-"):
                break
            assert word in targets, f"{where}: no make target {word!r} (has {sorted(targets)})"
        return
    if prog == "mgrit":
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if not words or words[0].startswith("-"):
            assert not set(flags_of(words)) - _options(parser), where
            return
        assert words[0] in sub.choices, f"{where}: no subcommand {words[0]!r}"
        if words[0] == "bench":
            parser = bench.build_parser()
            named = [w for w in words[1:] if re.fullmatch(r"w\d\w*|heat", w)]
            assert not set(named) - set(bench.ALL_WORKLOADS), f"{where}: unknown workload"
        else:
            parser = sub.choices[words[0]]
        known = _options(parser)
    else:
        assert (ROOT / Path(*prog.split("."))).with_suffix(".py").exists() or \
            (ROOT / Path(*prog.split(".")) / "__main__.py").exists(), f"{where}: no {prog}"
        known = module_flags(prog)
    unknown = [f for f in flags_of(words[1:] if prog == "mgrit" else words) if f not in known]
    assert not unknown, f"{where}: {prog} does not know {unknown}"


def test_a_wrong_flag_is_caught():
    """The check itself: a flag no parser has is reported, a real one is not."""
    assert "--ranks" in _options(bench.build_parser())
    assert "--no-such-flag" not in _options(bench.build_parser())
    assert program("mpiexec -n 2 python -m mpi4py -m mgrit train --trace 5") == \
        ("mgrit", ["train", "--trace", "5"])
    assert "--cases" in module_flags("benchmarks.scaling")
    assert "--no-such-flag" not in module_flags("benchmarks.scaling")


def test_bench_help_lists_every_workload(capsys):
    with pytest.raises(SystemExit) as end:
        cli.main(["bench", "--help"])
    assert end.value.code == 0
    text = capsys.readouterr().out
    for name in bench.ALL_WORKLOADS:
        assert re.search(rf"^  {name}\s+\S", text, re.M), name
    with pytest.raises(SystemExit) as end:
        cli.main(["bench", "-h"])
    assert end.value.code == 0
