"""Every command and code block in README.md and docs/*.md is executed here.

The convention (docs/README.md says the same, for writers):

* A page is README.md or any ``docs/**/*.md``; pages are found by globbing, so a new
  page is covered the moment it exists. The blocks of one page run in order, in one
  fresh temporary folder, so a later block can use a file an earlier one wrote.
* ```` ```python ````: written to a file and run with this interpreter in a subprocess
  (``MPLBACKEND=Agg``); it must exit 0.
* ```` ```bash ```` / ```` ```sh ```` / ```` ```console ````: run with bash (``set -e``);
  in ``console`` blocks only the lines starting with ``$`` are commands. ``plait`` and
  ``torchrun`` on the PATH are shims that run this checkout and append :data:`TINY` to
  every ``plait train`` (a tiny model, 2 steps, no MFU measurement; later flags win;
  :data:`TINY_PS` to ``plait ps-train``), so
  a command written for a real run finishes in seconds and still checks every flag.
* ```` ```toml ````: a config file; it must load with :func:`plait.config.toml_io.load_config`.
* ```` ```text ```` right after a command block (blank lines between allowed) is that
  block's output: the command's stdout must equal it (trailing spaces ignored). That is
  how shown output such as ``plait plan --search`` cannot drift.
* Markers, an HTML comment on the last non-blank line before the opening fence:

  - ``<!-- not-run: REASON -->``: the block is not executed (installs, several nodes,
    a SLURM script, an illustration); the reason is required. The marks are counted and
    reported.
  - ``<!-- ranks: N -->``: a python block run on every rank of an N-rank gloo world (the
    session's worker pool, whose world is joined as torchrun's is).
  - ``<!-- run-by: tests/PATH.py -->``: another test runs this block (it must exist and
    name the page).

* Any other block -- a ``text`` block that is not an output, no language, another
  language -- without a marker fails :func:`test_every_block_is_run_or_marked`.

README's two set-up commands are never run (they install); they are checked textually:
first on the page, verbatim, the second one equal to what ``.ci/run`` runs.
"""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from plait.testing import WorkerContext, WorkerPool

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
"""Every page whose blocks run: README.md and docs/**/*.md."""

SETUP_COMMANDS = (
    "python -m pip install torch==2.13.0 -e . && plait train",
    "python -m pip install torch==2.13.0 -e '.[dev]' && ruff check . && mypy "
    "&& python -m pytest -q",
)
"""README's two set-up commands, first on the page and exactly so."""

TINY = (
    "--model.dim 32 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 4 "
    "--model.max_seq_len 32 --seq-len 32 --global-batch 8 --data.max_bytes 100000 "
    "--steps 2 --train.warmup_steps 1 --train.eval_every 0 --train.eval_batches 1 "
    "--log.peak_tflops 1 --launch.threads 1 --progress lines"
)
"""Appended to every ``plait train`` a block runs: a model and run small enough for CI."""
TINY_PS = "--steps 2 --dim 32 --seq-len 16 --batch 2"
"""Appended to every ``plait ps-train``: the same idea for the parameter server."""

COMMANDS = ("bash", "sh", "console")
MARKER = re.compile(r"^<!--\s*(not-run|ranks|run-by):\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)\s*$")
TIMEOUT_S = 240


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    code: str
    marker: tuple[str, str] | None
    """(kind, argument) of the marker comment before the fence, if any."""
    output_of: int | None = None
    """For an output block: the index (in the page's blocks) of the command block."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse_blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page``, each with its marker and output pairing."""
    lines = page.read_text("utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    last_end = -1  # the line index of the previous block's closing fence
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2).lower()
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page}:{i + 1}: a fenced block is never closed")
        code = "\n".join(
            ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : j]
        )
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = None
        if k >= 0 and (mm := MARKER.match(lines[k].strip())):
            marker = (mm.group(1), mm.group(2))
        elif k >= 0 and lines[k].strip().startswith("<!--") and "not-run" in lines[k]:
            raise AssertionError(f"{page}:{k + 1}: malformed marker {lines[k].strip()!r}")
        output_of = None
        prev = blocks[-1] if blocks else None
        if (
            lang == "text"
            and marker is None
            and prev is not None
            and prev.lang in COMMANDS
            and prev.marker is None
            and k == last_end
        ):
            output_of = len(blocks) - 1
        blocks.append(Block(page, i + 1, lang, code, marker, output_of))
        last_end = j
        i = j + 1
    return blocks


def _runnable(b: Block, blocks: list[Block]) -> bool:
    if b.marker is not None:
        return b.marker[0] in ("ranks", "run-by")
    return b.lang in ("python", "toml", *COMMANDS) or b.output_of is not None


def test_every_block_is_run_or_marked(capsys: pytest.CaptureFixture[str]) -> None:
    unmarked: list[str] = []
    marks: dict[str, int] = {}
    total = 0
    for page in PAGES:
        blocks = parse_blocks(page)
        for b in blocks:
            total += 1
            if b.marker is not None:
                kind, arg = b.marker
                marks[kind] = marks.get(kind, 0) + 1
                assert arg, f"{b.where}: a {kind} marker needs its argument"
                if kind == "ranks":
                    assert b.lang == "python" and arg.isdigit() and int(arg) in (2, 4, 8), b.where
                if kind == "run-by":
                    test = ROOT / arg
                    assert test.is_file(), f"{b.where}: run-by names {arg}, which does not exist"
                    assert page.name in test.read_text("utf-8"), f"{arg} does not name {page.name}"
            elif not _runnable(b, blocks):
                unmarked.append(f"{b.where} ({b.lang or 'no language'})")
    assert not unmarked, (
        "blocks neither run nor marked (add <!-- not-run: reason --> before the fence, or make "
        "them runnable; see tests/test_docs.py): " + ", ".join(unmarked)
    )
    with capsys.disabled():
        print(f"\ndocs: {len(PAGES)} pages, {total} blocks; marked: {marks}")


def test_setup_commands_come_first_verbatim_and_match_ci() -> None:
    blocks = parse_blocks(ROOT / "README.md")
    assert tuple(b.code.strip() for b in blocks[:2]) == SETUP_COMMANDS
    assert all(b.marker is not None and b.marker[0] == "not-run" for b in blocks[:2])
    ci = (ROOT / ".ci" / "run").read_text("utf-8")
    assert SETUP_COMMANDS[1].replace("-m pip install ", "-m pip install -q ") in ci


LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_links_resolve_and_every_docs_page_is_listed_in_readme() -> None:
    for page in PAGES:
        for target in LINK.findall(page.read_text("utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: dead link {target}"
    readme = (ROOT / "README.md").read_text("utf-8")
    listed = set(LINK.findall(readme))
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"docs/{page.name}" in listed, f"README's docs list lacks docs/{page.name}"


# --------------------------------------------------------------------------- running


def _shims(bindir: Path) -> None:
    """``plait`` and ``torchrun`` that run this checkout with :data:`TINY` on train."""
    py = sys.executable
    scripts = {
        "plait": f'if [ "$1" = train ]; then exec "{py}" -m plait "$@" {TINY}; fi\n'
        f'if [ "$1" = ps-train ]; then exec "{py}" -m plait "$@" {TINY_PS}; fi\n'
        f'exec "{py}" -m plait "$@"\n',
        "torchrun": f'case " $* " in *" -m plait train "*) exec "{py}" -m torch.distributed.run '
        f'"$@" {TINY};; esac\nexec "{py}" -m torch.distributed.run "$@"\n',
    }
    for name, body in scripts.items():
        path = bindir / name
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _commands(b: Block) -> str:
    if b.lang != "console":
        return b.code
    return "\n".join(ln[1:].lstrip() for ln in b.code.splitlines() if ln.startswith("$"))


def _run(args: list[str], cwd: Path, env: dict[str, str], b: Block) -> str:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, (
        f"{b.where}: exit code {r.returncode}\n--- block\n{b.code}\n--- stdout\n"
        f"{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    )
    return r.stdout


def _body_exec(ctx: WorkerContext, code: str, where: str) -> bool:
    exec(compile(code, where, "exec"), {"__name__": "__docs__"})
    return True


def _norm(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.strip("\n").splitlines()]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(page: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from plait.config.toml_io import load_config

    blocks = parse_blocks(page)
    bindir = tmp_path / ".bin"
    bindir.mkdir()
    _shims(bindir)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}", MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p
    )
    outputs: dict[int, str] = {}
    for n, b in enumerate(blocks):
        if b.marker is not None:
            if b.marker[0] == "ranks":
                pools: Callable[[int], WorkerPool] = request.getfixturevalue("pools")
                assert all(pools(int(b.marker[1])).run(_body_exec, b.code, b.where))
            continue
        if b.lang == "python":
            script = work / f"_block_{b.line}.py"
            script.write_text(b.code + "\n")
            outputs[n] = _run([sys.executable, script.name], work, env, b)
        elif b.lang in COMMANDS:
            outputs[n] = _run(["bash", "-e", "-c", _commands(b)], work, env, b)
        elif b.lang == "toml":
            toml = work / f"_block_{b.line}.toml"
            toml.write_text(b.code + "\n")
            load_config(str(toml))
        elif b.output_of is not None:
            got = outputs[b.output_of]
            assert _norm(got) == _norm(b.code), (
                f"{b.where}: the shown output differs from what the command prints now; "
                f"replace the block with:\n{got}"
            )
